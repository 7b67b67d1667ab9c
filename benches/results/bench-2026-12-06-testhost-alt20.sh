# Cold starts vs restores of a template, with the restore's phases: 20 rounds alternating one
# `bulkhead bench --runs 1` cold start and one `--runs 1 --template t` restore (t: 256 MiB, 1
# vCPU, `--share-slots 0`). Run inside one test host, as root, from the repository root
# (release build):
#   target/release/bulkhead-testhost run --memory 4096 --share ~/.local/share/bulkhead \
#       -- sh benches/results/bench-2026-12-06-testhost-alt20.sh
# Writes cold-NN.json and tpl-NN.json into $OUT (default /tmp/alt20); the recorded
# bench-2026-12-06-testhost-{cold,template}-alt20.json are those merged per side (runs
# renumbered). `bulkhead bench --compare` of the two prints the table in README.md.
set -e
B=target/release/bulkhead
D=/root/.local/share/bulkhead
OUT=${OUT:-/tmp/alt20}
N=${N:-20}
export BULKHEAD_DATA_DIR=/run/bh-bench
mkdir -p "$BULKHEAD_DATA_DIR" "$OUT"
boot="--kernel $D/kernel/x86_64/vmlinux --initrd $D/images/default/initramfs.cpio.lz4"
$B template create t $boot --share-slots 0 --boot-timeout 300 -- true
for i in $(seq -w 1 "$N"); do
  env -u BULKHEAD_DATA_DIR $B bench --runs 1 --boot-timeout 300 --json "$OUT/cold-$i.json" > /dev/null
  $B bench --runs 1 --template t --boot-timeout 300 --json "$OUT/tpl-$i.json" > /dev/null
done

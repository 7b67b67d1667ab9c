# bulkheadd's warm pool vs cold creates as an API client sees them: `bulkhead bench --daemon`
# (create through the API, one exec of `true`, delete; each pooled run first waits, untimed,
# for the pool to be full again), 20 rounds alternating a cold create and a pooled one. Run
# inside one test host, as root, from the repository root (release build):
#   target/release/bulkhead-testhost run --memory 4096 --share ~/.local/share/bulkhead \
#       -- sh benches/results/pool-2026-12-06b-testhost-api-alt20.sh
# Writes pool-2026-12-06b-testhost-api-{cold,pool}-NN.json into $OUT (default /tmp); the
# recorded pool-2026-12-06b-testhost-api-{cold,pool}-alt20.json are those merged per side.
set -e
B=target/release
OUT=${OUT:-/tmp}
D=/root/.local/share/bulkhead
S=/run/bh-pool
mkdir -p $S/state
boot="--kernel $D/kernel/x86_64/vmlinux --initrd $D/images/default/initramfs.cpio.lz4"
# The daemon's templates are <state_dir>/templates: made there with the CLI.
BULKHEAD_DATA_DIR=$S/state $B/bulkhead template create t $boot --share-slots 0 --boot-timeout 300 -- true
printf '[pool]\ntemplate = "t"\nsize = 2\n' > $S/pool.toml
$B/bulkheadd --socket $S/d.sock --state-dir $S/state --config $S/pool.toml --cgroups off \
    --vmm $PWD/$B/bulkhead-vmm --kernel $D/kernel/x86_64/vmlinux \
    --image $D/images/default/initramfs.cpio.lz4 2> $S/daemon.log &
while [ ! -S $S/d.sock ]; do sleep 0.2; done
export BULKHEAD_SOCKET=$S/d.sock
for i in $(seq -w 1 20); do
    $B/bulkhead bench --daemon --runs 1 --boot-timeout 300 --json "$OUT/pool-2026-12-06b-testhost-api-cold-$i.json" > /dev/null
    $B/bulkhead bench --daemon --runs 1 --template t --boot-timeout 300 --json "$OUT/pool-2026-12-06b-testhost-api-pool-$i.json" > /dev/null
done
grep -c 'from the pool' $S/daemon.log
kill %1

# Restores of a template whose preparation wrote 100 MiB, with the writable layer in guest RAM
# (`ram`) or on a scratch disk saved with the template (`disk`, each clone's disk copy-on-write
# over the saved one), 8 restores each. Run inside one test host, as root, from the repository
# root (release build):
#   target/release/bulkhead-testhost run --memory 4096 --share ~/.local/share/bulkhead \
#       -e IMAGE=<the Debian test image's rootfs.ext4> -- sh benches/results/bench-2026-12-06-testhost-template-disk-cow.sh
# (the image's directory shared too). Writes bench-2026-12-06-testhost-template-{ram,disk}-cow.json
# into $OUT (default /tmp).
set -e
B=target/release/bulkhead
OUT=${OUT:-/tmp}
D=/root/.local/share/bulkhead
export BULKHEAD_DATA_DIR=/run/bh-bench
mkdir -p "$BULKHEAD_DATA_DIR"
prepare='head -c 104857600 /dev/urandom > /root/blob && sync'
boot="--kernel $D/kernel/x86_64/vmlinux --initrd $D/images/default/initramfs.cpio.lz4"
$B template create ram $boot --image "$IMAGE" --memory 512 --share-slots 0 --boot-timeout 300 -- sh -c "$prepare"
$B template create disk $boot --image "$IMAGE" --memory 512 --disk 512 --share-slots 0 --boot-timeout 300 -- sh -c "$prepare"
du -sh "$BULKHEAD_DATA_DIR"/templates/*
for t in ram disk; do
    $B bench --runs 8 --template "$t" --boot-timeout 300 --json "$OUT/bench-2026-12-06-testhost-template-$t-cow.json"
done

# Two bulkheadd builds' warm pools side by side in one test host: $BUILDS/A/bulkheadd and
# $BUILDS/B/bulkheadd (A and B named by $VARIANTS, default "before after"), each with its own
# state dir and a pool of 2 clones of a 256 MiB, 1-vCPU template; 20 rounds, each one pooled
# create (`bulkhead bench --daemon --template t`: create through the API, one exec of `true`,
# delete) with A, then one with B, 2 s apart so that neither daemon's refill runs during the
# other's round. Run inside one test host, as root, from the repository root (release build of
# the CLI and the VMM), with $BUILDS shared into it, e.g.:
#   target/release/bulkhead-testhost run --memory 4096 --share ~/.local/share/bulkhead \
#       --share /tmp/builds -e BUILDS=/tmp/builds -e OUT=/tmp/builds/out \
#       -- sh benches/results/pool-ab-2026-12-06d-testhost-alt20.sh
# Writes $OUT/<variant>-NN.json; the recorded pool-2026-12-06d-testhost-ab-*-alt20.json are
# those merged per variant.
set -e
B=target/release
D=/root/.local/share/bulkhead
boot="--kernel $D/kernel/x86_64/vmlinux --initrd $D/images/default/initramfs.cpio.lz4"
VARIANTS=${VARIANTS:-before after}
mkdir -p "$OUT"
for v in $VARIANTS; do
    S=/run/bh-$v
    mkdir -p $S/state
    BULKHEAD_DATA_DIR=$S/state $B/bulkhead template create t $boot --share-slots 0 --boot-timeout 300 -- true
    printf '[pool]\ntemplate = "t"\nsize = 2\n' > $S/pool.toml
    "$BUILDS/$v/bulkheadd" --socket $S/d.sock --state-dir $S/state --config $S/pool.toml \
        --cgroups off --vmm $PWD/$B/bulkhead-vmm --kernel $D/kernel/x86_64/vmlinux \
        --image $D/images/default/initramfs.cpio.lz4 2> $S/daemon.log &
done
for v in $VARIANTS; do
    while [ ! -S /run/bh-$v/d.sock ]; do sleep 0.2; done
done
sleep 5
for i in $(seq -w 1 20); do
    for v in $VARIANTS; do
        BULKHEAD_SOCKET=/run/bh-$v/d.sock $B/bulkhead bench --daemon --runs 1 --template t \
            --boot-timeout 300 --json "$OUT/$v-$i.json" > /dev/null
        sleep 2
    done
done
for v in $VARIANTS; do
    echo "$v: $(grep -c 'from the pool' /run/bh-$v/daemon.log) creates from the pool"
done
kill $(jobs -p)

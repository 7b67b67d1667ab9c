#!/bin/sh
# Runs inside the nested test host: boots N sandboxes one after another with KVM exit tracing on
# and, for every bulkhead-vmm that is still alive after HUNG_S seconds (a guest that never got
# its agent up), saves its guest RAM and the exit trace for guest-irq-stack.py.
#
#   bulkhead-testhost run --share "$PWD/target" --share ~/.local/share/bulkhead --share /tmp/diag \
#     -e BULKHEAD="$PWD/target/release/bulkhead" -e HOME="$HOME" -- \
#     "$PWD/scripts/diag/nested-hang.sh" /tmp/diag/out 30
#   scripts/diag/guest-irq-stack.py ~/.cache/bulkhead/kernel/x86_64-*/vmlinux /tmp/diag/out/ram.PID
#
# Tracing is what makes the hang frequent (it slows every nested exit down): see
# docs/testhost.md, "Known problems".
set -u
OUT=$1 N=$2 HUNG_S=${HUNG_S:-12} MIB=128
RAM_BYTES=$((MIB << 20))
mkdir -p "$OUT"
T=/sys/kernel/tracing
[ -e $T/trace ] || mount -t tracefs nodev $T
echo 40960 >$T/buffer_size_kb
for e in kvm_exit kvm_msr; do echo 1 >$T/events/kvm/$e/enable; done

# The start of the anonymous mapping of exactly RAM_BYTES in /proc/PID/maps (the guest RAM).
guest_ram_start() {
    grep -E '^[0-9a-f]+-[0-9a-f]+ rw-p 00000000 00:00 0 *$' "/proc/$1/maps" | while read -r range _; do
        s=${range%-*} e=${range#*-}
        [ $((0x$e - 0x$s)) -eq $RAM_BYTES ] && echo "$s"
    done | head -1
}

# Saves RAM and trace of every VMM alive for HUNG_S seconds, once each.
watch_vmms() {
    while :; do
        for p in /proc/[0-9]*; do
            pid=${p#/proc/}
            [ "$(cat "$p/comm" 2>/dev/null)" = bulkhead-vmm ] || continue
            [ -e "$OUT/seen.$pid" ] || { date +%s >"$OUT/seen.$pid"; continue; }
            [ -e "$OUT/ram.$pid" ] && continue
            [ $(($(date +%s) - $(cat "$OUT/seen.$pid"))) -ge "$HUNG_S" ] || continue
            start=$(guest_ram_start "$pid")
            [ -n "$start" ] || continue
            dd if="$p/mem" of="$OUT/ram.$pid" bs=4096 skip=$((0x$start / 4096)) count=$((RAM_BYTES / 4096)) 2>/dev/null
            cat $T/trace >"$OUT/trace.$pid"
            echo "nested-hang: saved the RAM of hung VMM $pid" >&2
        done
        sleep 2
    done
}

watch_vmms &
watcher=$!
i=0 fails=0
while [ $i -lt "$N" ]; do
    echo >$T/trace
    "$BULKHEAD" bench --runs 1 --memory $MIB --boot-timeout 25 >"$OUT/run.out" 2>&1
    grep -q ": 1 ok" "$OUT/run.out" || { fails=$((fails + 1)); cp "$OUT/run.out" "$OUT/fail.$i.out"; }
    i=$((i + 1))
done
kill $watcher
echo "nested-hang: $fails of $N boots failed"

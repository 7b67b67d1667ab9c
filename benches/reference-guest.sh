#!/usr/bin/env bash
# Boots the reference guest of ../shared/ENVIRONMENT.md with bulkhead-vmm and with QEMU's microvm
# machine, and the same init on bulkhead's default kernel, alternating, and prints spawn → init for
# each (the measure behind issue 8's 1602 ms Firecracker median; results and discussion:
# benches/results/README.md, parts 6 and 7).
#
#   benches/reference-guest.sh [ROUNDS] [-- bulkhead-testhost run options, e.g. --single-tcg]
#
# Reference guest: a tinyconfig kernel with the options of benches/reference-guest.config (the
# ~45 options ENVIRONMENT.md lists, with the dependencies they need to survive olddefconfig, plus
# X86_IOPL_IOPERM for the debug port and PVH so that QEMU loads the vmlinux directly; built and
# cached by scripts/build-kernel.sh --fragment ... --no-install, never installed as a bulkhead
# kernel), an uncompressed initramfs whose /init is bulkhead-test-init (prints one line with the
# guest's uptime, writes it to the debug port, reboots), 1 vCPU, 128 MiB and ENVIRONMENT.md's
# command line. Variants, one boot each per round:
#   reference  the reference guest on bulkhead-vmm
#   bulkhead   the same init on bulkhead's default kernel, on bulkhead-vmm
#   qemu       the reference guest on QEMU's microvm machine (qemu-system-x86_64 -M microvm
#              -enable-kvm -cpu host -nodefaults), a second VMM on the same KVM
# Per boot: wall ms from spawning the VMM to the init's line on its serial console (read through a
# pipe; 10 ms resolution), the guest's own uptime at that line (kvm-clock starts it during the
# kernel's early boot, so it leaves out everything the VMM does before), and for bulkhead-vmm its
# own spawn → init timeline (process start → the init's debug-port write). Each boot is bounded by
# 60 s; a boot without the init's line counts as failed. On a host whose KVM cannot boot Linux
# (kvm_pvm) the boots run in one nested test host. Needs `scripts/setup.sh --no-run` first
# (kernel, musl target, packages, QEMU).
set -euo pipefail

rounds=8
if (($#)) && [[ "$1" != "--" ]]; then rounds="$1"; shift; fi
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "reference-guest: ROUNDS must be a positive integer" >&2; exit 2; }
if (($#)); then shift; fi # the "--" before test-host options
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/target/reference-guest"
mkdir -p "$out"

ref_kernel="$("$root/scripts/build-kernel.sh" --fragment "$root/benches/reference-guest.config" \
    --no-install | sed -n 's/^vmlinux=//p')"
our_kernel="$("$root/scripts/build-kernel.sh" | sed -n 's/^vmlinux=//p')"
(cd "$root" && cargo build --quiet --release --target x86_64-unknown-linux-musl -p bulkhead-test-init \
    && cargo build --quiet --release -p bulkhead-vmm -p bulkhead-testhost)
"$root/scripts/build-initramfs.sh" --out "$out/init.cpio" \
    --init "$root/target/x86_64-unknown-linux-musl/release/bulkhead-test-init"

# QEMU for the qemu variant: the binary and the microvm firmware next to the boots (its libraries
# reach the test host through --libs-for).
qemu_bin="$(command -v qemu-system-x86_64)" || { echo "reference-guest: qemu-system-x86_64 not found (scripts/setup.sh installs it)" >&2; exit 1; }
mkdir -p "$out/qemu"
cp "$qemu_bin" "$out/qemu/"
cp /usr/share/qemu/bios-microvm.bin /usr/share/qemu/pvh.bin "$out/qemu/"

# The boots, alternating; one line per boot: "<variant> <round> <wall ms|FAILED> <uptime ms> <vmm ms>".
cat >"$out/boots.sh" <<INNER
#!/bin/sh
cmdline="console=ttyS0 reboot=k panic=1 nomodule i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd quiet"
now_ms() { read -r up _ </proc/uptime; echo \$((\${up%.*} * 1000 + 1\${up#*.}0 - 1000)); }
# boot NAME ROUND CMD...: runs CMD (a VMM with its serial console on stdout) and prints the line.
boot() {
  name=\$1; r=\$2; shift 2
  t0=\$(now_ms)
  line=\$(timeout 60 "\$@" 2>$out/\$name-\$r.err | tr -d "\\r" | while IFS= read -r l; do
    case "\$l" in *bulkhead-test-init:*) echo "\$((\$(now_ms) - t0)) \${l##*uptime_ms=}";; esac
  done)
  vmm=\$(sed -n 's/.*"guest_init":\([0-9]*\).*/\1/p' $out/\$name-\$r.json 2>/dev/null)
  echo "\$name \$r \${line:-FAILED -} \${vmm:--}"
}
for r in \$(seq 1 $rounds); do
  rm -f $out/*-\$r.json
  boot reference \$r $root/target/release/bulkhead-vmm --kernel $ref_kernel --initrd $out/init.cpio \\
    --cmdline "\$cmdline" --memory 128 --vcpus 1 --serial stdout --timings-json $out/reference-\$r.json
  boot bulkhead \$r $root/target/release/bulkhead-vmm --kernel $our_kernel --initrd $out/init.cpio \\
    --cmdline "\$cmdline" --memory 128 --vcpus 1 --serial stdout --timings-json $out/bulkhead-\$r.json
  boot qemu \$r $out/qemu/qemu-system-x86_64 -L $out/qemu -M microvm -enable-kvm -cpu host -smp 1 -m 128 \\
    -nodefaults -no-user-config -nographic -serial stdio -no-reboot \\
    -kernel $ref_kernel -initrd $out/init.cpio -append "\$cmdline"
done
INNER
if [[ -d /sys/module/kvm_pvm ]]; then
    "$root/target/release/bulkhead-testhost" run "$@" --libs-for "$qemu_bin" --share "$root/target" \
        --share "$(dirname "$ref_kernel")" --share "$(dirname "$our_kernel")" -- sh "$out/boots.sh"
else
    sh "$out/boots.sh"
fi | tee "$out/boots.txt"

# Per variant: boots, failures, and min / p50 / max of each measure in ms.
summary() { # NAME FIELD LABEL
    awk -v n="$1" -v f="$2" '$1 == n && $f != "FAILED" && $f != "-" { print $f }' "$out/boots.txt" \
        | sort -n | awk -v label="$3" '{ v[NR] = $1 } END {
            if (NR) printf "  %-24s min %5.0f  p50 %5.0f  max %5.0f\n", label, v[1], v[int((NR + 1) / 2)], v[NR] }'
}
for name in reference bulkhead qemu; do
    total="$(grep -c "^$name " "$out/boots.txt" || true)"
    failed="$(awk -v n="$name" '$1 == n && $3 == "FAILED"' "$out/boots.txt" | wc -l)"
    echo "$name: $total boots, $failed without the init's line"
    summary "$name" 3 "spawn -> init line (wall)"
    summary "$name" 4 "guest uptime at init"
    summary "$name" 5 "spawn -> init (VMM's own)"
done

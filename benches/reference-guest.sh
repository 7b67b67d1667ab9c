#!/usr/bin/env bash
# Boots the reference guest of ../shared/ENVIRONMENT.md with bulkhead-vmm, alternating with the same
# init on bulkhead's default kernel, and prints spawn → init for each (the measure behind issue 8's
# 1602 ms Firecracker median; results and discussion: benches/results/README.md, part 6).
#
#   benches/reference-guest.sh [ROUNDS] [-- bulkhead-testhost run options, e.g. --mttcg]
#
# Reference guest: a tinyconfig kernel with the options of benches/reference-guest.config (the
# ~45 options ENVIRONMENT.md lists, with the dependencies they need to survive olddefconfig, plus
# X86_IOPL_IOPERM for the debug port; built and cached by scripts/build-kernel.sh --fragment ...
# --no-install, never installed as a bulkhead kernel), an uncompressed initramfs whose
# /init is bulkhead-test-init (prints one line, writes it to the debug port, reboots), 1 vCPU,
# 128 MiB and ENVIRONMENT.md's command line. spawn → init is the VMM's own timeline: process
# start → the init's first debug-port write. Each boot is bounded by 60 s; a boot without the
# init's line counts as failed. On a host whose KVM cannot boot Linux (kvm_pvm) the boots run in
# one nested test host. Needs `scripts/setup.sh --no-run` first (kernel, musl target, packages).
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

# The boots, alternating; one line per boot: "<variant> <round> <spawn→init ms or FAILED>".
cat >"$out/boots.sh" <<INNER
#!/bin/sh
cmdline="console=ttyS0 reboot=k panic=1 nomodule i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd quiet"
for r in \$(seq 1 $rounds); do
  for v in reference:$ref_kernel bulkhead:$our_kernel; do
    name=\${v%%:*}; kernel=\${v#*:}; t=$out/\$name-\$r.json
    rm -f "\$t"
    timeout 60 $root/target/release/bulkhead-vmm --kernel "\$kernel" --initrd $out/init.cpio \\
      --cmdline "\$cmdline" --memory 128 --vcpus 1 --serial "\${t%.json}.console" --timings-json "\$t" >/dev/null 2>&1 || true
    ms=\$(sed -n 's/.*"guest_init":\([0-9.]*\).*/\1/p' "\$t" 2>/dev/null)
    echo "\$name \$r \${ms:-FAILED}"
  done
done
INNER
if [[ -d /sys/module/kvm_pvm ]]; then
    "$root/target/release/bulkhead-testhost" run "$@" --share "$root/target" \
        --share "$(dirname "$ref_kernel")" --share "$(dirname "$our_kernel")" -- sh "$out/boots.sh"
else
    sh "$out/boots.sh"
fi | tee "$out/boots.txt"

# Per variant: boots, failures, and spawn → init min / p50 / max in ms.
for name in reference bulkhead; do
    awk -v n="$name" '$1 == n { total++ } $1 == n && $3 != "FAILED" { print $3 }' "$out/boots.txt" \
        | sort -n | awk -v n="$name" -v total="$(grep -c "^$name " "$out/boots.txt")" '
            { v[NR] = $1 }
            END {
                if (NR == 0) { printf "%-9s  %d boots, all failed\n", n, total; exit }
                printf "%-9s  %d boots, %d failed; spawn -> init ms: min %.0f  p50 %.0f  max %.0f\n",
                    n, total, total - NR, v[1], v[int((NR + 1) / 2)], v[NR]
            }'
done

#!/usr/bin/env bash
# Searches the nested test host's configuration space for one whose guests survive stress (issue 28,
# item 3): the emulator under load, not bulkhead, panics or hangs nested guests ("Fatal exception in
# interrupt"; ../shared/ENVIRONMENT.md, 2026-12-03).
#
#   benches/testhost-stress.sh [ROUNDS [BOOTS]] [-- CONFIG...]
#
# Each round starts one test host per configuration, in turn (so that whatever else loads the machine
# falls on every configuration alike), and boots BOOTS guests in it one after another (defaults: 2
# rounds of 5, i.e. 10 boots per configuration). The guest is bulkhead's default kernel with a
# guest-only stress init and no virtio device (no vsock, disk or share: only the emulator and KVM are
# measured): busybox runs 300 × `echo | cat`, `dd bs=64k count=800 | md5sum` and builds a 1 MiB
# shell string, prints "stress: ok" and reboots; 2 vCPUs and 128 MiB unless the configuration says. Each boot ends as
#   ok       "stress: ok" on the console and the VMM exited by the guest's reset
#   panic    the console shows a kernel panic or oops (the VMM's exit report names it guest-written)
#   stall    the guest kernel reported an RCU stall (a vCPU unresponsive for 21 s): stopped there
#   hang     no end within HANG_SECS (default 60; a healthy boot takes about 8 s)
#   other    anything else (the VMM failed, the console stopped without a panic)
#   host     the test host itself died or never came up (counted for every boot it should have run)
# Configurations (all by default; name a subset after `--`):
#   single      `-cpu max`, single-threaded TCG (`--single-tcg`), Debian's kvm-amd as it loads; the
#               configurations below change one thing of it
#   mttcg       multi-threaded TCG instead, the test host's default since this comparison
#   cpu-novgif  `-cpu max,-vgif`: the emulated CPU offers no virtual GIF to kvm-amd
#   kvm-plain   kvm-amd with `vgif=0 vls=0 avic=0`: none of SVM's acceleration features used
#   kvm-nonpt   kvm-amd with `npt=0`: shadow paging instead of nested paging
#   cpu-epyc    `-cpu EPYC-Rome` instead of `max`
#   guest-nodl  the nested guest's LAPIC timer without TSC-deadline mode (`lapic=notscdeadline`)
#   guest-1cpu  a nested guest with 1 vCPU (a sandbox's default; the others have 2: no IPIs here)
#   qemu-alt    single-threaded TCG on another QEMU binary, QEMU_ALT=/path/to/qemu-system-x86_64
#               (e.g. bookworm-backports' 10.0 unpacked with `dpkg -x`); skipped unless QEMU_ALT is set
# Output: one line per boot in target/testhost-stress/boots.txt ("CONFIG ROUND BOOT RESULT SECS"), the
# console of every boot next to it, and a table per configuration at the end. Needs
# `scripts/setup.sh --no-run` first (kernel, musl target, packages, QEMU).
set -euo pipefail

rounds=2 boots=5
if (($#)) && [[ "$1" != "--" ]]; then rounds="$1"; shift; fi
if (($#)) && [[ "$1" != "--" ]]; then boots="$1"; shift; fi
[[ "$rounds" =~ ^[1-9][0-9]*$ && "$boots" =~ ^[1-9][0-9]*$ ]] ||
    { echo "testhost-stress: ROUNDS and BOOTS must be positive integers" >&2; exit 2; }
if (($#)); then shift; fi # the "--" before the configuration names
all=(single mttcg cpu-novgif kvm-plain kvm-nonpt cpu-epyc guest-nodl guest-1cpu qemu-alt)
configs=("$@")
((${#configs[@]})) || configs=("${all[@]}")
hang_secs="${HANG_SECS:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/target/testhost-stress"
mkdir -p "$out"

# The test-host options of a configuration (one per line) and the nested guest's extra command line.
host_options() {
    case "$1" in
        single | guest-nodl | guest-1cpu | qemu-alt) echo --single-tcg ;;
        mttcg) ;;
        cpu-novgif) printf '%s\n' --single-tcg --cpu max,-vgif ;;
        kvm-plain) printf '%s\n' --single-tcg --kernel-arg kvm_amd.vgif=0 --kernel-arg kvm_amd.vls=0 --kernel-arg kvm_amd.avic=0 ;;
        kvm-nonpt) printf '%s\n' --single-tcg --kernel-arg kvm_amd.npt=0 ;;
        cpu-epyc) printf '%s\n' --single-tcg --cpu EPYC-Rome ;;
        *) echo "testhost-stress: unknown configuration $1 (${all[*]})" >&2; return 2 ;;
    esac
}
guest_args() { [[ "$1" != guest-nodl ]] || echo lapic=notscdeadline; }
guest_vcpus() { if [[ "$1" == guest-1cpu ]]; then echo 1; else echo 2; fi; }
for c in "${configs[@]}"; do host_options "$c" >/dev/null; done
if [[ " ${configs[*]} " == *" qemu-alt "* && -z "${QEMU_ALT:-}" ]]; then
    echo "testhost-stress: qemu-alt needs QEMU_ALT=/path/to/qemu-system-x86_64; leaving it out" >&2
    configs=("${configs[@]/qemu-alt/}")
fi
if [[ -n "${QEMU_ALT:-}" ]]; then
    [[ -x "$QEMU_ALT" && "$(basename "$QEMU_ALT")" == qemu-system-x86_64 ]] ||
        { echo "testhost-stress: QEMU_ALT=$QEMU_ALT is not an executable qemu-system-x86_64" >&2; exit 2; }
fi

kernel="$("$root/scripts/build-kernel.sh" | sed -n 's/^vmlinux=//p')"
(cd "$root" && cargo build --quiet --release -p bulkhead-vmm -p bulkhead-testhost)
cat >"$out/stress-init" <<'INIT'
#!/bin/sh
mount -t proc proc /proc
echo "stress: start"
i=0
while [ $i -lt 300 ]; do echo x | cat >/dev/null; i=$((i + 1)); done
echo "stress: pipes done"
dd if=/dev/zero bs=64k count=800 2>/dev/null | md5sum
s=$(head -c 1048576 /dev/zero | tr '\0' a)
echo "stress: string of ${#s} bytes"
echo "stress: ok"
reboot -f
INIT
chmod +x "$out/stress-init"
"$root/scripts/build-initramfs.sh" --busybox --init "$out/stress-init" --out "$out/stress.cpio.gz"

# Inside the test host: BOOTS stress guests, one line each.
cat >"$out/boots.sh" <<INNER
#!/bin/sh
# boots.sh CONFIG ROUND VCPUS GUEST_ARGS
config=\$1 round=\$2 vcpus=\$3 extra=\$4
cmdline="console=ttyS0 reboot=k panic=1 nomodule i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd \$extra"
for b in \$(seq 1 $boots); do
  log=$out/\$config-\$round-\$b
  rm -f \$log.console \$log.json \$log.err
  start=\$(date +%s)
  $root/target/release/bulkhead-vmm --kernel $kernel --initrd $out/stress.cpio.gz --cmdline "\$cmdline" \\
    --memory 128 --vcpus \$vcpus --serial \$log.console --exit-file \$log.json >\$log.err 2>&1 &
  pid=\$!
  r=
  # Poll the console: a kernel panic ends the VM by itself (panic=1); an RCU stall (a vCPU that
  # has not answered for 21 s) is final enough to stop waiting.
  while kill -0 \$pid 2>/dev/null; do
    if grep -q 'rcu_sched detected stalls' \$log.console 2>/dev/null; then r=stall; break; fi
    [ \$((\$(date +%s) - start)) -ge $hang_secs ] && { r=hang; break; }
    sleep 1
  done
  kill -KILL \$pid 2>/dev/null
  wait \$pid
  secs=\$((\$(date +%s) - start))
  if [ -n "\$r" ]; then :
  elif grep -q '"guest_console_panic"' \$log.json 2>/dev/null || grep -qE 'Kernel panic|Oops|Fatal exception' \$log.console; then r=panic
  elif grep -q 'stress: ok' \$log.console && grep -q '"reason":"reset"' \$log.json; then r=ok
  else r=other
  fi
  echo "\$config \$round \$b \$r \$secs"
done
INNER

: >"$out/boots.txt"
for r in $(seq 1 "$rounds"); do
    for c in "${configs[@]}"; do
        [[ -n "$c" ]] || continue
        mapfile -t opts < <(host_options "$c")
        path="$PATH"
        [[ "$c" != qemu-alt ]] || path="$(dirname "$QEMU_ALT"):$PATH"
        lines="$(PATH="$path" "$root/target/release/bulkhead-testhost" run "${opts[@]}" \
            --share "$root/target" --share "$(dirname "$kernel")" \
            --timeout $((boots * (hang_secs + 15))) -- sh "$out/boots.sh" "$c" "$r" "$(guest_vcpus "$c")" "$(guest_args "$c")" \
            2>"$out/$c-$r.host.err" || true)"
        got="$(grep -c "^$c $r " <<<"$lines" || true)"
        printf '%s\n' "$lines" | grep "^$c $r " | tee -a "$out/boots.txt" || true
        for b in $(seq $((got + 1)) "$boots"); do echo "$c $r $b host -" | tee -a "$out/boots.txt"; done
    done
done

echo
echo "| configuration | boots | ok | panic | stall | hang | other | host | median s (ok) |"
echo "|---|---|---|---|---|---|---|---|---|"
for c in "${configs[@]}"; do
    [[ -n "$c" ]] || continue
    med="$(awk -v c="$c" '$1 == c && $4 == "ok" { print $5 }' "$out/boots.txt" | sort -n |
        awk '{ t[NR] = $1 } END { print NR ? t[int((NR + 1) / 2)] : "-" }')"
    awk -v c="$c" -v med="$med" '$1 == c { n++; k[$4]++ } END {
        printf "| %s | %d | %d | %d | %d | %d | %d | %d | %s |\n", c, n, k["ok"], k["panic"], k["stall"], k["hang"], k["other"], k["host"], med }' \
        "$out/boots.txt"
done

#!/usr/bin/env bash
# Boots aarch64 guests with the aarch64 build of bulkhead-vmm inside an emulated arm64 host
# (issue 9). `GUEST=run` is the aarch64 acceptance checklist that scripts/test.sh (and so CI)
# runs; the other modes are manual smoke tests that show how far a guest gets.
#
#   GUEST=run scripts/arm64-smoke.sh       the checklist below, in one boot of the emulated host
#   scripts/arm64-smoke.sh                 build what is missing, boot the test init once, print
#                                          the console
#   GUEST_CMDLINE="console=ttyS0 earlycon=uart,mmio,0x09000000" scripts/arm64-smoke.sh
#   VMM_ARGS="--seccomp log" scripts/arm64-smoke.sh
#   GUEST=devices scripts/arm64-smoke.sh  busybox guest probing a virtio-blk disk, a read-only
#                                          virtio-fs share and virtio-vsock, then `reboot -f`
#
# Chain: QEMU (qemu-system-aarch64 -M virt,virtualization=on,gic-version=3 -cpu max, TCG) boots
# Debian's arm64 kernel package (KVM built in, so the emulated host has /dev/kvm) with a busybox
# initramfs holding bulkhead-vmm (aarch64-unknown-linux-gnu, with its shared libraries), the guest
# kernel from `scripts/build-kernel.sh --arch aarch64` and a guest initramfs whose /init is
# bulkhead-test-init (aarch64-unknown-linux-musl, static). The host's /init runs
#   bulkhead-vmm --kernel /guest/Image --initrd /guest/initramfs.cpio.gz --memory 256 --vcpus $VCPUS --serial stdout
# and powers the emulated host off when the VMM exits (or after VMM_TIMEOUT seconds).
#
# Success looks like a `bulkhead-test-init: cpus=1 ...` line (the guest's /init ran, then
# rebooted through PSCI SYSTEM_RESET, which ends the VMM) followed by
# `arm64-smoke: bulkhead-vmm exited with status 0`; the script fails otherwise.
#
# GUEST=run: the host initramfs also holds the `bulkhead` CLI (aarch64-unknown-linux-gnu, with
# its shared libraries), the test init's initramfs (/guest/test-init.cpio.gz), and the default
# image the way scripts/setup.sh builds it on x86_64 (/guest/initramfs.cpio.gz): the guest agent
# (aarch64-unknown-linux-musl) as /init plus Debian's arm64 busybox-static
# (scripts/build-initramfs.sh --busybox-bin). It also holds a small ext4 image made here with
# `mke2fs -d` (/data/disk.ext4), the x86_64 bzImage when scripts/build-kernel.sh installed one (a
# file with just an x86 setup header otherwise). The host's /init (see run_checks_script) runs,
# as root (so each VMM that `bulkhead run` starts is jailed; the bulkhead-vmm checks run it
# directly, unjailed), with BULKHEAD_VMM=/bin/bulkhead-vmm and HOME=/root:
#   bad-bzimage, bad-magic   bulkhead-vmm given the x86 bzImage, and a copy of the guest Image with
#                            its magic overwritten: non-zero status and the loader's error message
#   boot-1-vcpu, boot-2-vcpus, boot-memory, boot-reboot
#                            bulkhead-vmm with the test init (as tests/guest/boot.rs on x86_64):
#                            cpus= matches --vcpus; ram_kib/memtotal_kib within the x86 tests' bounds
#                            for --memory 128 and 256; reboot (PSCI SYSTEM_RESET) ends it with 0
#   boot-poweroff            bulkhead-vmm with the test init and bulkhead_test.action=poweroff:
#                            PSCI SYSTEM_OFF ends it with 0
#   run-uname, run-exit7     bulkhead run -- uname -m (kernel and image at their default paths
#                            under HOME, the rest through BULKHEAD_KERNEL/BULKHEAD_INITRD) → aarch64;
#                            sh -c 'echo out; echo err >&2; exit 7' → 7 with stdout/stderr apart
#   run-kill9, run-10mib     sh -c 'kill -9 $$' → 137; 10 MiB from /dev/urandom arrive on stdout
#                            with the sha256 the guest printed on stderr
#   run-tty                  bulkhead run -t with the emulated host's console as its terminal:
#                            the guest command's `tty` is a /dev/pts/N, `stty size` the default
#                            24 80 (a serial console has no size), non-UTF-8 argv bytes arrive
#                            as sent, and the console's settings are the same before and after
#   run-disk, run-virtiofs-read, run-virtiofs-write
#                            one run with --disk-file /data/disk.ext4:ro (mounted as /dev/vda, a
#                            known file read) and --mount /tmp/share:/mnt/share (virtio-fs: a host
#                            file read, a guest file written that the host then reads)
#   run-egress               --allow-cidr 127.0.0.1/32:8080 --egress-log: busybox wget in the
#                            guest fetches a file from busybox httpd on the emulated host's
#                            127.0.0.1:8080 through the agent's relay and the host's egress proxy,
#                            gets the proxy's 403 for port 8081, and the log has both decisions
#   run-publish              -p 18080:8000: busybox httpd in the guest, its page fetched with
#                            busybox wget from the emulated host's 127.0.0.1:18080 (ingress)
#   template-clone, clone-distinct, clone-clock, clone-egress
#                            a template (bulkhead template create): two clones read its file, on
#                            both vCPUs, with random bytes of their own and the host's clock; a
#                            clone with --allow-cidr fetches run-egress's file through its proxy
#   image-template-disk      template create --image /data/root.ext4 (busybox) --disk 16
#                            --disk-file DATA: the preparation's file is on the scratch disk and
#                            its bytes on the data disk, both saved with the template; each
#                            clone reads them and writes to copy-on-write disks of its own over
#                            them, the saved disks and DATA unchanged (Debian's arm64 mke2fs
#                            formats the scratch disk)
#   daemon-pause-workspace   bulkheadd (cgroups off): a sandbox with a clone workspace writes a
#                            file there, is paused (its share unmounted in the guest, its VMM
#                            gone) and resumed: the file and the project are back and `bulkhead
#                            diff` lists the file
#   daemon-pool-workspace    bulkheadd with a warm pool of one clone (its template a paused
#                            sandbox that had a clone workspace): a create with another clone
#                            workspace is handed the clone, the directory attached to its VMM
#                            while it runs (attach_share) and mounted by its agent
#   containerd-run           scripts/containerd-demo.sh --more with Debian's arm64 containerd
#                            and ctr and the aarch64 containerd-shim-bulkhead-v2: `ctr run
#                            --runtime io.containerd.bulkhead.v2` of a busybox image prints the
#                            arch, its PID (1: its own PID namespace) and the guest kernel's
#                            release (not the emulated host's); then, as tests/guest/shim.rs
#                            checks on x86_64: `ctr task exec` (output, status 4), `ctr task
#                            kill` (SIGTERM), --memory-limit 64 MiB as the guest's MemTotal,
#                            ingress (bulkhead.io/ports), egress through the pod's proxy,
#                            `ctr task metrics`, and an OOM kill in the guest (`/tasks/oom`)
# Each check prints one `arm64-smoke: check NAME: ok - ...` or `... FAIL - ...` line, a failing
# one followed by the guest console and the output it had; the script fails unless every check
# printed ok. RUN_ARGS adds `bulkhead run` arguments (not --vcpus, --boot-timeout or --console,
# which every run gets already, nor --memory, which the 10 MiB check sets), RUN_ENV variables
# for it: VAR=VALUE words appended to an `export` line of the emulated host's /init, as they are
# (e.g. RUN_ENV="BULKHEAD_SECCOMP=log BULKHEAD_JAIL=off BULKHEAD_LOG=debug").
# Every bulkhead-vmm and bulkhead run is killed (SIGKILL, status 137, a failure) when it outlives
# VMM_TIMEOUT (twice that for bulkhead run): a VMM stopped by SIGTERM would exit 0 instead.
#
# Idempotent: Debian packages (apt-get download, unpacked with dpkg -x) are cached under
# ${XDG_CACHE_HOME:-~/.cache}/bulkhead/arm64-smoke/, cargo builds go to target/aarch64, the guest
# kernel is cached by build-kernel.sh. The console log of the last run is
# ${XDG_CACHE_HOME:-~/.cache}/bulkhead/arm64-smoke/console.log.
# Needs root (or sudo) only to install missing packages and to add the arm64 dpkg architecture.
# A whole run (builds, host initramfs, QEMU, console log) holds `flock /tmp/bulkhead-arm64.lock`;
# QEMU runs under `nice -n 10`.
#
# Environment: GUEST (test-init|devices|run, default test-init), PROFILE (debug|release, default
# debug), VCPUS (guest vCPUs, default 1; the emulated host has 2 CPUs; GUEST=run's boot checks
# set their own), VMM_ARGS (extra bulkhead-vmm arguments; not GUEST=run),
# GUEST_CMDLINE (passed as --cmdline when set; not GUEST=run), VMM_TIMEOUT (seconds, default 120;
# GUEST=run: per VMM boot, and the agent's --boot-timeout), QEMU_TIMEOUT (seconds, default 900);
# GUEST=run only: RUN_ARGS, RUN_ENV (see above).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
readonly CACHE="${XDG_CACHE_HOME:-${HOME:?HOME is not set}/.cache}/bulkhead/arm64-smoke"
readonly PROFILE="${PROFILE:-debug}"
readonly VMM_TIMEOUT="${VMM_TIMEOUT:-120}"
readonly VCPUS="${VCPUS:-1}"
readonly GUEST="${GUEST:-test-init}"
readonly QEMU_TIMEOUT="${QEMU_TIMEOUT:-900}"
readonly LOCK=/tmp/bulkhead-arm64.lock
readonly GNU_TARGET=aarch64-unknown-linux-gnu
readonly MUSL_TARGET=aarch64-unknown-linux-musl
export CARGO_TARGET_DIR="$ROOT/target/aarch64"

log() { printf 'arm64-smoke: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}
as_root() {
    if ((EUID == 0)); then "$@"; else sudo "$@"; fi
}

# --- Host packages --------------------------------------------------------------------------

ensure_packages() {
    local p missing=() wanted=(qemu-system-arm cpio gzip gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
    [[ "$GUEST" == run ]] && wanted+=(e2fsprogs) # mke2fs -d for the disk check's ext4 image
    for p in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    log "installing ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2
}

# apt can only download arm64 packages once dpkg knows the architecture.
ensure_arm64_arch() {
    dpkg --print-foreign-architectures | grep -qx arm64 && return 0
    log "adding the arm64 dpkg architecture (for apt-get download only; nothing is installed)"
    as_root dpkg --add-architecture arm64
    as_root apt-get update -qq >&2
}

# Prints the directory holding package $1 (arm64) unpacked, downloading it on first use.
fetch_deb() {
    local pkg="$1" version dir tmp
    version="$(apt-cache policy "$pkg:arm64" | awk '/Candidate:/ {print $2}')"
    [[ -n "$version" && "$version" != "(none)" ]] || die "apt knows no $pkg:arm64 (run apt-get update)"
    dir="$CACHE/debs/${pkg}_$(printf '%s' "$version" | tr -c 'A-Za-z0-9.+_-' '_')"
    if [[ ! -d "$dir" ]]; then
        tmp="$(mktemp -d "$CACHE/debs/.fetch.XXXXXX")"
        chmod 0755 "$tmp" # apt-get download writes as user _apt when it can
        log "downloading $pkg:arm64 $version"
        (cd "$tmp" && apt-get download -qq "$pkg:arm64" >&2)
        dpkg -x "$tmp"/*.deb "$tmp/root"
        mv -T "$tmp/root" "$dir"
        rm -rf "$tmp"
    fi
    printf '%s\n' "$dir"
}

# The real package behind the linux-image-arm64 metapackage, e.g. linux-image-6.1.0-57-arm64.
host_kernel_package() {
    apt-cache depends linux-image-arm64:arm64 |
        awk '/Depends: linux-image-[0-9]/ {sub(/:arm64$/, "", $2); print $2; exit}'
}

# --- Builds ---------------------------------------------------------------------------------

build_binaries() {
    local release=()
    [[ "$PROFILE" == release ]] && release=(--release)
    rustup target add "$GNU_TARGET" "$MUSL_TARGET" >/dev/null 2>&1
    log "cargo build bulkhead-vmm ($GNU_TARGET, $PROFILE)"
    nice -n 10 cargo build --quiet "${release[@]}" --target "$GNU_TARGET" -p bulkhead-vmm --bins
    log "cargo build bulkhead-test-init ($MUSL_TARGET, release)"
    nice -n 10 cargo build --quiet --release --target "$MUSL_TARGET" -p bulkhead-test-init
    [[ "$GUEST" == run ]] || return 0
    log "cargo build bulkhead, bulkheadd ($GNU_TARGET, $PROFILE)"
    nice -n 10 cargo build --quiet "${release[@]}" --target "$GNU_TARGET" -p bulkhead-cli --bin bulkhead
    nice -n 10 cargo build --quiet "${release[@]}" --target "$GNU_TARGET" -p bulkhead-daemon --bin bulkheadd
    log "cargo build containerd-shim-bulkhead-v2 ($GNU_TARGET, $PROFILE)"
    nice -n 10 cargo build --quiet "${release[@]}" --target "$GNU_TARGET" -p bulkhead-shim \
        --bin containerd-shim-bulkhead-v2
    log "cargo build bulkhead-agent ($MUSL_TARGET, release)"
    nice -n 10 cargo build --quiet --release --target "$MUSL_TARGET" -p bulkhead-agent
}

# Copies the shared libraries ELF $1 needs (recursively) from the cross sysroot into $2/lib.
copy_shared_libs() {
    local elf="$1" stage="$2" lib
    for lib in $(aarch64-linux-gnu-readelf -d "$elf" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'); do
        [[ -e "$stage/lib/$lib" ]] && continue
        cp -L "/usr/aarch64-linux-gnu/lib/$lib" "$stage/lib/$lib"
        copy_shared_libs "$stage/lib/$lib" "$stage"
    done
}

# GUEST=devices: a busybox guest whose /init lists the virtio devices and reads the disk and the
# share the host's /init prepares; written to $CACHE/guest-devices.cpio.gz.
build_devices_guest() {
    local busybox_dir="$1" stage applet
    stage="$(mktemp -d)"
    STAGE="$stage"
    chmod 0755 "$stage"
    mkdir -p "$stage"/{bin,dev,proc,sys,mnt,tmp}
    install -m 0755 "$busybox_dir/bin/busybox" "$stage/bin/busybox"
    for applet in sh mount ls cat echo head sed reboot; do ln -s busybox "$stage/bin/$applet"; done
    cat >"$stage/init" <<'GUEST_INIT'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for d in /sys/bus/virtio/devices/*; do
    echo "guest: $d device=$(cat "$d/device") driver=$(ls -l "$d/driver" | sed 's|.*/||')"
done
echo "guest: vda starts with: $(head -c 16 /dev/vda)"
mount -t virtiofs share /mnt && echo "guest: share/hello.txt: $(cat /mnt/hello.txt)"
cat /proc/interrupts
reboot -f
GUEST_INIT
    chmod 0755 "$stage/init"
    (cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner 0:0 --quiet) |
        gzip -1 >"$CACHE/guest-devices.cpio.gz"
    rm -rf "$stage"
}

# Host /init lines that prepare GUEST=devices' disk and share (none for the test-init guest).
host_device_setup() {
    [[ "$GUEST" == devices ]] || return 0
    cat <<'HOST_SETUP'
dd if=/dev/zero of=/tmp/disk.img bs=1M count=1 2>/dev/null
printf BULKHEAD-DISK-OK | dd of=/tmp/disk.img conv=notrunc 2>/dev/null
mkdir -p /tmp/share && echo hello-from-host >/tmp/share/hello.txt
HOST_SETUP
}

# The names of GUEST=run's checks, in the order the host's /init runs them (run_checks_script);
# check_console fails unless each printed an ok line.
readonly RUN_CHECKS=(bad-bzimage bad-magic boot-1-vcpu boot-2-vcpus boot-memory boot-reboot
    boot-poweroff run-uname run-exit7 run-kill9 run-tty run-10mib run-disk run-virtiofs-read
    run-virtiofs-write run-egress run-publish template-clone clone-distinct clone-clock
    clone-egress image-template-disk daemon-pause-workspace daemon-pool-workspace containerd-run)

# GUEST=run: the host /init's checklist (busybox sh). Settings come first, from here; the checks
# themselves are a quoted heredoc, so their `$` belong to the emulated host's shell.
run_checks_script() {
    printf 'VMM_TIMEOUT=%q VCPUS=%q RUN_ARGS=%q\n' "$VMM_TIMEOUT" "$VCPUS" "${RUN_ARGS:-}"
    echo "export BULKHEAD_VMM=/bin/bulkhead-vmm HOME=/root ${RUN_ENV:-}"
    cat <<'HOST_CHECKS'
ok() { echo "arm64-smoke: check $1: ok - $2"; }
# fail NAME DETAIL FILE...: the result line, then each FILE (guest console, outputs), then the
# emulated host kernel's last messages (a process that died of a signal is reported there with
# its pc: "unhandled exception" or "segfault". Seen once: bulkhead-vmm died of SIGSEGV before
# the guest printed anything, in CI's boot-memory check of 2026-12-05; 409 of the same boot in a
# loop afterwards all passed).
fail() {
    name=$1 detail=$2
    shift 2
    echo "arm64-smoke: check $name: FAIL - $detail"
    for f in "$@"; do
        echo "arm64-smoke: ---- $f"
        cat "$f" 2>/dev/null
    done
    echo "arm64-smoke: ---- the emulated host's kernel log (last 25 lines)"
    dmesg | tail -n 25
    echo "arm64-smoke: ---- end of $name"
}
# vmm NAME KERNEL INITRD CMDLINE ARGS...: bulkhead-vmm with the guest console in
# /tmp/NAME.serial and its own output in /tmp/NAME.vmm; sets $status.
vmm() {
    name=$1 kernel=$2 initrd=$3 cmdline=$4
    shift 4
    echo "arm64-smoke: running: bulkhead-vmm --kernel $kernel --initrd $initrd $* --cmdline '$cmdline'"
    timeout -s KILL "$VMM_TIMEOUT" /bin/bulkhead-vmm --kernel "$kernel" --initrd "$initrd" \
        --serial "/tmp/$name.serial" "$@" --cmdline "$cmdline" >"/tmp/$name.vmm" 2>&1
    status=$?
}
# field KEY NAME: KEY= of the test init's report line in /tmp/NAME.serial (empty without one).
field() {
    tr -d '\r' <"/tmp/$2.serial" | grep -m1 '^bulkhead-test-init:' | tr ' ' '\n' | sed -n "s/^$1=//p"
}
# brun NAME ARGS...: bulkhead run ARGS with stdout, stderr and the guest console in
# /tmp/NAME.out, .err and .console; sets $status.
brun() {
    name=$1
    shift
    echo "arm64-smoke: running: bulkhead run $RUN_ARGS $*"
    # RUN_ARGS is split into words on purpose (several arguments).
    timeout -s KILL $((VMM_TIMEOUT * 2)) /bin/bulkhead run --boot-timeout "$VMM_TIMEOUT" \
        --console "/tmp/$name.console" --vcpus "$VCPUS" $RUN_ARGS "$@" \
        >"/tmp/$name.out" 2>"/tmp/$name.err"
    status=$?
}

# Bad kernels: a clear error from the Image loader and a non-zero status, before any boot.
TI=/guest/test-init.cpio.gz
bad_kernel() {
    vmm "$1" "$2" $TI "console=ttyS0" --memory 128
    if [ "$status" != 0 ] && grep -qF "$3" "/tmp/$1.vmm"; then
        ok "$1" "status $status: $(grep -m1 -F "$3" "/tmp/$1.vmm")"
    else
        fail "$1" "status $status, no '$3' in the VMM's output" "/tmp/$1.vmm"
    fi
}
bad_kernel bad-bzimage /guest/x86-bzImage "this is an x86 bzImage"
cp /guest/Image /tmp/bad-magic.Image
printf 'BAD!' | dd of=/tmp/bad-magic.Image bs=1 seek=56 conv=notrunc 2>/dev/null
bad_kernel bad-magic /tmp/bad-magic.Image "bad magic 0x21444142 at offset 56"

# The test init under bulkhead-vmm (tests/guest/boot.rs): its report, and reboot ending the VMM.
TI_CMDLINE="console=ttyS0 panic=1 quiet bulkhead_test.action=reboot"
boot_ti() { vmm "$1" /guest/Image $TI "$TI_CMDLINE" --vcpus "$2" --memory "$3"; }
boot_ti boot-1-vcpu 1 128
status_1=$status
boot_ti boot-2-vcpus 2 128
status_2=$status
boot_ti boot-256m 1 256
status_256m=$status
# cpus_check NAME VCPUS STATUS: the VMM ended with 0 and the guest saw VCPUS CPUs online.
cpus_check() {
    cpus=$(field cpus "$1")
    if [ "$3" = 0 ] && [ "$cpus" = "$2" ]; then
        ok "$1" "status 0: $(tr -d '\r' <"/tmp/$1.serial" | grep -m1 '^bulkhead-test-init:')"
    else
        fail "$1" "status $3, cpus=[$cpus] for --vcpus $2" "/tmp/$1.serial" "/tmp/$1.vmm"
    fi
}
cpus_check boot-1-vcpu 1 "$status_1"
cpus_check boot-2-vcpus 2 "$status_2"
# mem_ok MIB NAME: tests/guest/boot.rs's bounds: RAM at most 8 MiB under MIB, MemTotal at most
# 14 MiB + MIB/64 under MIB and not above RAM.
mem_ok() {
    ram=$(field ram_kib "$2") total=$(field memtotal_kib "$2")
    mem="$mem$1 MiB: ram_kib=$ram memtotal_kib=$total; "
    [ -n "$ram" ] && [ -n "$total" ] || return 1
    ram=$((ram / 1024)) total=$((total / 1024))
    [ $((ram + 8)) -ge "$1" ] && [ "$ram" -le "$1" ] && [ "$total" -le "$ram" ] &&
        [ $((total + 14 + $1 / 64)) -ge "$1" ]
}
mem=""
if [ "$status_256m" = 0 ] && mem_ok 128 boot-1-vcpu && mem_ok 256 boot-256m; then
    ok boot-memory "$mem"
else
    fail boot-memory "status $status_256m; $mem" /tmp/boot-256m.serial /tmp/boot-256m.vmm
fi
if [ "$status_1" = 0 ] && grep -q 'reboot: Restarting system' /tmp/boot-1-vcpu.serial; then
    ok boot-reboot "PSCI SYSTEM_RESET ('reboot: Restarting system') ended bulkhead-vmm with status 0"
else
    fail boot-reboot "status $status_1" /tmp/boot-1-vcpu.serial /tmp/boot-1-vcpu.vmm
fi
vmm boot-poweroff /guest/Image $TI "console=ttyS0 panic=1 quiet bulkhead_test.action=poweroff" \
    --memory 128
if [ "$status" = 0 ] && grep -q 'reboot: Power down' /tmp/boot-poweroff.serial; then
    ok boot-poweroff "PSCI SYSTEM_OFF ('reboot: Power down') ended bulkhead-vmm with status 0"
else
    fail boot-poweroff "status $status" /tmp/boot-poweroff.serial /tmp/boot-poweroff.vmm
fi

# bulkhead run. The first run finds kernel and image at their default paths under HOME (see
# build_host_initramfs), the others through the environment.
brun run-uname -- uname -m
if [ "$status" = 0 ] && [ "$(cat /tmp/run-uname.out)" = aarch64 ] && [ ! -s /tmp/run-uname.err ]; then
    ok run-uname "status 0, stdout [aarch64], stderr []"
else
    fail run-uname "status $status" /tmp/run-uname.out /tmp/run-uname.err /tmp/run-uname.console
fi
export BULKHEAD_KERNEL=/guest/Image BULKHEAD_INITRD=/guest/initramfs.cpio.gz
brun run-exit7 -- sh -c 'echo out; echo err >&2; exit 7'
if [ "$status" = 7 ] && [ "$(cat /tmp/run-exit7.out)" = out ] && [ "$(cat /tmp/run-exit7.err)" = err ]; then
    ok run-exit7 "status 7, stdout [out], stderr [err]"
else
    fail run-exit7 "status $status" /tmp/run-exit7.out /tmp/run-exit7.err /tmp/run-exit7.console
fi
brun run-kill9 -- sh -c 'kill -9 $$'
if [ "$status" = 137 ]; then
    ok run-kill9 "status 137"
else
    fail run-kill9 "status $status" /tmp/run-kill9.out /tmp/run-kill9.err /tmp/run-kill9.console
fi
# A terminal exec: the console (this /init's stdin) is the local terminal of `run -t`.
before=$(stty -g </dev/console)
brun run-tty -t -- sh -c 'tty; stty size; printf "%s" "$1" | od -An -tx1' sh "$(printf 'a\377')" </dev/console
after=$(stty -g </dev/console)
tty_out=$(tr -d '\r' </tmp/run-tty.out)
if [ "$status" = 0 ] && echo "$tty_out" | grep -q '^/dev/pts/[0-9]' &&
    echo "$tty_out" | grep -qx '24 80' && echo "$tty_out" | grep -q '61 ff' &&
    [ "$before" = "$after" ]; then
    ok run-tty "status 0, $(echo "$tty_out" | tr '\n' ' ')console settings restored"
else
    fail run-tty "status $status, settings before [$before] after [$after]" /tmp/run-tty.out \
        /tmp/run-tty.err /tmp/run-tty.console
fi
brun run-10mib --memory 256 -- \
    sh -c 'head -c 10485760 /dev/urandom >/tmp/r && sha256sum /tmp/r >&2 && cat /tmp/r'
size=$(wc -c </tmp/run-10mib.out | tr -d ' ')
got=$(sha256sum /tmp/run-10mib.out | cut -d' ' -f1)
sent=$(head -n1 /tmp/run-10mib.err | cut -d' ' -f1)
if [ "$status" = 0 ] && [ "$size" = 10485760 ] && [ "$got" = "$sent" ]; then
    ok run-10mib "status 0, $size bytes on stdout, sha256 $got as in the guest"
else
    fail run-10mib "status $status, $size bytes on stdout with sha256 $got, guest's [$sent]" \
        /tmp/run-10mib.err /tmp/run-10mib.console
fi

# A read-only virtio-blk disk (ext4 from mke2fs -d) and a writable virtio-fs share, owned by an
# unprivileged user as in tests/guest/fs.rs (root may not share a root-owned directory read-write).
mkdir -p /tmp/share && echo bulkhead-share-ok >/tmp/share/host.txt && chown -R 1000:1000 /tmp/share
brun run-devices --disk-file /data/disk.ext4:ro --mount /tmp/share:/mnt/share -- sh -c '
    mkdir -p /tmp/disk && mount -t ext4 -o ro /dev/vda /tmp/disk && echo "disk: $(cat /tmp/disk/disk.txt)"
    echo "share: $(cat /mnt/share/host.txt)"
    echo written-by-guest >/mnt/share/guest.txt'
devices_fail() {
    fail "$1" "status $status, $2" /tmp/run-devices.out /tmp/run-devices.err /tmp/run-devices.console
}
if grep -qx 'disk: bulkhead-disk-ok' /tmp/run-devices.out; then
    ok run-disk "/dev/vda (--disk-file ext4 image, :ro) mounted, disk.txt read"
else
    devices_fail run-disk "no 'disk: bulkhead-disk-ok' on stdout"
fi
if grep -qx 'share: bulkhead-share-ok' /tmp/run-devices.out; then
    ok run-virtiofs-read "--mount /tmp/share:/mnt/share: host.txt read in the guest"
else
    devices_fail run-virtiofs-read "no 'share: bulkhead-share-ok' on stdout"
fi
owner=$(stat -c %u:%g /tmp/share/guest.txt 2>/dev/null)
if [ "$status" = 0 ] && [ "$(cat /tmp/share/guest.txt 2>/dev/null)" = written-by-guest ] &&
    [ "$owner" = 1000:1000 ]; then
    ok run-virtiofs-write "guest.txt written in the guest, read on the host (owner 1000:1000)"
else
    devices_fail run-virtiofs-write \
        "host sees guest.txt as [$(cat /tmp/share/guest.txt 2>&1)], owner [$owner] (want 1000:1000)"
fi

# The network: busybox httpd on the emulated host's loopback, reached from the guest only
# through the agent's relay (127.0.0.1:3128, vsock) and the host's egress proxy.
mkdir -p /tmp/www && echo bulkhead-egress-ok >/tmp/www/hello.txt
ip link set lo up
httpd -p 127.0.0.1:8080 -h /tmp/www
brun run-egress --allow-cidr 127.0.0.1/32:8080 --egress-log /tmp/egress.jsonl -- sh -c '
    echo "got: $(wget -q -O - http://127.0.0.1:8080/hello.txt)"
    echo "refused: $(wget -q -O - http://127.0.0.1:8081/ 2>&1)"'
if [ "$status" = 0 ] && grep -qx 'got: bulkhead-egress-ok' /tmp/run-egress.out &&
    grep -q 'refused: .*403' /tmp/run-egress.out &&
    grep -q '"port":8080.*"decision":"allow"' /tmp/egress.jsonl &&
    grep -q '"port":8081.*"decision":"deny"' /tmp/egress.jsonl; then
    ok run-egress "hello.txt fetched through the proxy, port 8081 refused (403), both logged"
else
    fail run-egress "status $status" /tmp/run-egress.out /tmp/run-egress.err /tmp/egress.jsonl \
        /tmp/run-egress.console
fi

# Ingress: `-p 18080:8000` publishes busybox httpd in the guest on the emulated host's port
# 18080 (each connection an agent Connect over vsock); busybox wget on the host fetches its page.
brun run-publish -p 18080:8000 -- sh -c \
    'echo bulkhead-ingress-ok >/tmp/index.html; exec httpd -f -p 8000 -h /tmp' &
publish_run=$!
# A GET with busybox wget, else nc; in a subshell whose stderr is /dev/null, so a client that
# dies by a signal is not reported on the console each try.
get_page() {
    (timeout 20 wget -q -O - http://127.0.0.1:18080/index.html ||
        printf 'GET /index.html HTTP/1.0\r\n\r\n' | timeout 20 nc 127.0.0.1 18080 |
        tail -n 1 | tr -d '\r') 2>/dev/null
}
page=""
tries=0
while [ -z "$page" ] && [ "$tries" -lt $((VMM_TIMEOUT * 2)) ]; do
    page=$(get_page)
    [ -n "$page" ] || sleep 0.5
    tries=$((tries + 1))
done
# The run's `bulkhead` is below the background job (timeout's child): SIGTERM it by its command
# line (busybox has no pkill here).
for p in /proc/[0-9]*; do
    case "$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)" in
    "/bin/bulkhead run "*"-p 18080:8000 "*) kill -TERM "${p#/proc/}" ;;
    esac
done
wait "$publish_run" 2>/dev/null
if [ "$page" = bulkhead-ingress-ok ]; then
    ok run-publish "the guest's httpd page fetched from the host's 127.0.0.1:18080"
else
    fail run-publish "page [$page]" /tmp/run-publish.out /tmp/run-publish.err \
        /tmp/run-publish.console
fi

# Snapshots (issue 29): a 2-vCPU template whose preparation wrote /tmp/x (snapshot of vCPUs,
# GICv3, UART, virtio devices, memory), then two clones restored from it by jailed VMMs. Each
# reads the template's file, runs a task on vCPU 1 that sleeps a second (the restored secondary
# vCPU runs and gets its timer interrupt), and their random bytes differ (the agent reseeds each
# clone); the clone's clock is the host's (the agent sets it).
# tcall NAME ARGS...: bulkhead ARGS, outputs in /tmp/NAME.out and .err; sets $status.
tcall() {
    name=$1
    shift
    echo "arm64-smoke: running: bulkhead $*"
    timeout -s KILL $((VMM_TIMEOUT * 2)) /bin/bulkhead "$@" >"/tmp/$name.out" 2>"/tmp/$name.err"
    status=$?
}
tcall template-create template create arm64-smoke --vcpus 2 --boot-timeout "$VMM_TIMEOUT" \
    -- sh -c 'echo 42 >/tmp/x'
create_status=$status
clone() {
    eval "before_$(echo "$1" | tr - _)=$(date +%s)"
    tcall "$1" run --template arm64-smoke --boot-timeout "$VMM_TIMEOUT" \
        --console "/tmp/$1.console" -- sh -c 'cat /tmp/x; head -c 16 /dev/urandom | od -x | head -n1
            taskset -c 1 sh -c "sleep 1; cat /sys/devices/system/cpu/online"; date +%s'
    eval "after_$(echo "$1" | tr - _)=$(date +%s)"
}
clone clone-1
status_c1=$status
clone clone-2
status_c2=$status
if [ "$create_status" = 0 ] && [ "$status_c1" = 0 ] && [ "$status_c2" = 0 ] &&
    [ "$(head -n1 /tmp/clone-1.out)" = 42 ] && [ "$(head -n1 /tmp/clone-2.out)" = 42 ] &&
    [ "$(sed -n 3p /tmp/clone-1.out)" = 0-1 ] && [ "$(sed -n 3p /tmp/clone-2.out)" = 0-1 ]; then
    ok template-clone "template created ($(tail -n1 /tmp/template-create.err)); both clones read 42 from /tmp/x and slept 1 s on vCPU 1 (CPUs 0-1 online)"
else
    fail template-clone "create status $create_status, clones $status_c1 and $status_c2" \
        /tmp/template-create.out /tmp/template-create.err /tmp/clone-1.out /tmp/clone-1.err \
        /tmp/clone-1.console /tmp/clone-2.out /tmp/clone-2.err /tmp/clone-2.console
fi
random_1=$(sed -n 2p /tmp/clone-1.out)
random_2=$(sed -n 2p /tmp/clone-2.out)
if [ "$status_c1" = 0 ] && [ "$status_c2" = 0 ] && [ -n "$random_1" ] && [ "$random_1" != "$random_2" ]; then
    ok clone-distinct "urandom differs: [$random_1] vs [$random_2]"
else
    fail clone-distinct "urandom [$random_1] vs [$random_2]" /tmp/clone-1.out /tmp/clone-2.out
fi
# clock_ok NAME: the clone's `date +%s` (its last line) is between the host's before and after
# the run (1 s of slack each side); without the agent setting it, it would be the template's
# clock, behind by the time since the snapshot (clone-1's whole run, for clone-2).
clock_ok() {
    guest=$(sed -n 4p "/tmp/$1.out")
    eval "before=\$before_$(echo "$1" | tr - _) after=\$after_$(echo "$1" | tr - _)"
    clocks="$clocks$1: host $before..$after guest $guest; "
    [ -n "$guest" ] && [ "$guest" -ge $((before - 1)) ] && [ "$guest" -le $((after + 1)) ]
}
clocks=""
if clock_ok clone-1 && clock_ok clone-2; then
    ok clone-clock "$clocks"
else
    fail clone-clock "$clocks" /tmp/clone-1.out /tmp/clone-2.out
fi
# A clone with a network: the template booted without one; the restore starts a proxy of its
# own, the agent starts its relay when told so, and busybox wget fetches run-egress's file from
# the emulated host's httpd (still on 127.0.0.1:8080) through it.
tcall clone-egress run --template arm64-smoke --boot-timeout "$VMM_TIMEOUT" \
    --console /tmp/clone-egress.console --allow-cidr 127.0.0.1/32:8080 \
    --egress-log /tmp/clone-egress.jsonl -- sh -c \
    'cat /tmp/x; echo "got: $(wget -q -O - http://127.0.0.1:8080/hello.txt)"'
if [ "$status" = 0 ] && [ "$(head -n1 /tmp/clone-egress.out)" = 42 ] &&
    grep -qx 'got: bulkhead-egress-ok' /tmp/clone-egress.out &&
    grep -q '"port":8080.*"decision":"allow"' /tmp/clone-egress.jsonl; then
    ok clone-egress "the clone read 42 and fetched hello.txt through its own proxy (logged)"
else
    fail clone-egress "status $status" /tmp/clone-egress.out /tmp/clone-egress.err \
        /tmp/clone-egress.jsonl /tmp/clone-egress.console
fi
# A template on a root filesystem image with a scratch disk and a writable data disk: the
# preparation writes a file to the scratch disk and bytes to the data disk (/dev/vdc), both
# saved with the template; the first clone writes to its own copy-on-write disks over them (and
# syncs), which the second does not see, and the template's saved disks and the data disk's
# file are unchanged.
dd if=/dev/zero of=/tmp/arm64-data.img bs=1024 count=1024 2>/dev/null
tcall image-create template create arm64-image --image /data/root.ext4 --disk 16 \
    --disk-file /tmp/arm64-data.img --boot-timeout "$VMM_TIMEOUT" \
    -- sh -c 'echo 42 >/root/answer; printf tmpl-data | dd of=/dev/vdc conv=fsync 2>/dev/null'
create_status=$status
saved=/root/.local/share/bulkhead/templates/arm64-image/disk-1.img
saved_data=/root/.local/share/bulkhead/templates/arm64-image/disk-2.img
saved_before=$(sha256sum "$saved" "$saved_data" /tmp/arm64-data.img 2>&1)
tcall image-clone-1 run --template arm64-image --boot-timeout "$VMM_TIMEOUT" \
    --console /tmp/image-clone-1.console -- sh -c 'cat /root/answer; echo mine >/root/own
        head -c 9 /dev/vdc; echo; printf clone-one | dd of=/dev/vdc conv=fsync 2>/dev/null; sync'
status_c1=$status
tcall image-clone-2 run --template arm64-image --boot-timeout "$VMM_TIMEOUT" \
    --console /tmp/image-clone-2.console -- sh -c 'cat /root/answer; cat /root/own 2>/dev/null || echo none
        head -c 9 /dev/vdc; echo'
status_c2=$status
saved_after=$(sha256sum "$saved" "$saved_data" /tmp/arm64-data.img 2>&1)
if [ "$create_status" = 0 ] && [ "$status_c1" = 0 ] && [ "$status_c2" = 0 ] &&
    [ "$(cat /tmp/image-clone-1.out)" = "$(printf '42\ntmpl-data')" ] &&
    [ "$(cat /tmp/image-clone-2.out)" = "$(printf '42\nnone\ntmpl-data')" ] &&
    [ -f "$saved" ] && [ -f "$saved_data" ] && [ "$saved_before" = "$saved_after" ] &&
    [ "$(head -c 9 /tmp/arm64-data.img)" = tmpl-data ]; then
    ok image-template-disk "both clones read 42 from the template's saved scratch disk and the preparation's bytes from its saved data disk, which stayed unchanged, as did the data disk's file; the first clone's writes stayed its own"
else
    fail image-template-disk "create status $create_status, clones $status_c1 and $status_c2, saved disks [$saved_before] then [$saved_after]" \
        /tmp/image-create.out /tmp/image-create.err /tmp/image-clone-1.out /tmp/image-clone-1.err \
        /tmp/image-clone-1.console /tmp/image-clone-2.out /tmp/image-clone-2.err
fi
# The daemon: pause and resume a sandbox with a clone workspace (the agent unmounts the share
# before the snapshot and mounts it again over the kept changes).
mkdir -p /run/bhd /tmp/ws && echo project >/tmp/ws/README
/bin/bulkheadd --socket /run/bhd/d.sock --state-dir /run/bhd/state --mount-root /tmp \
    --cgroups off --vmm /bin/bulkhead-vmm >/tmp/bulkheadd.log 2>&1 &
daemon=$!
export BULKHEAD_SOCKET=/run/bhd/d.sock
i=0
while [ ! -S /run/bhd/d.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
id=$(timeout -s KILL $((VMM_TIMEOUT * 2)) /bin/bulkhead create --workspace /tmp/ws:clone 2>/tmp/bhd-create.err)
# VMM processes: those whose command line starts with the daemon's --vmm path (a jailed VMM
# is two: its jail's parent and the VMM).
vmms() {
    for f in /proc/[0-9]*/cmdline; do
        head -c 17 "$f" 2>/dev/null
        echo
    done | grep -c '^/bin/bulkhead-vmm'
}
/bin/bulkhead exec "$id" -- sh -c 'echo before > /workspace/a' >/tmp/bhd.out 2>&1
vmm_running=$(vmms)
/bin/bulkhead pause "$id" >>/tmp/bhd.out 2>&1
pause_status=$?
vmm_while_paused=$(vmms)
timeout -s KILL $((VMM_TIMEOUT * 2)) /bin/bulkhead resume "$id" >>/tmp/bhd.out 2>&1
resume_status=$?
seen=$(/bin/bulkhead exec "$id" -- cat /workspace/a /workspace/README 2>&1)
changes=$(/bin/bulkhead diff "$id" 2>&1)
/bin/bulkhead rm "$id" >>/tmp/bhd.out 2>&1
kill "$daemon"
if [ -n "$id" ] && [ "$pause_status" = 0 ] && [ "$vmm_running" -ge 1 ] && [ "$vmm_while_paused" = 0 ] &&
    [ "$resume_status" = 0 ] && [ "$seen" = "$(printf 'before\nproject')" ] &&
    printf '%s\n' "$changes" | grep -q "^A.a$" && [ ! -e /tmp/ws/a ]; then
    ok daemon-pause-workspace "paused (no VMM left) and resumed: /workspace/a and README read back, diff lists a, /tmp/ws untouched"
else
    fail daemon-pause-workspace "id [$id] pause $pause_status (VMMs before: $vmm_running, while paused: $vmm_while_paused) resume $resume_status, read [$seen], diff [$changes]" \
        /tmp/bhd-create.err /tmp/bhd.out /tmp/bulkheadd.log
fi
wait "$daemon"
# The warm pool: template `base` is a paused sandbox that had a clone workspace (so its clones
# have that share slot); a create with another clone workspace is handed the idle clone, the
# directory attached to its running VMM.
mkdir -p /tmp/ws2 /run/bhd/state/templates/base && echo second >/tmp/ws2/README
start_daemon() {
    rm -f /run/bhd/d.sock
    /bin/bulkheadd --socket /run/bhd/d.sock --state-dir /run/bhd/state --mount-root /tmp \
        --cgroups off --vmm /bin/bulkhead-vmm "$@" >/tmp/bulkheadd-pool.log 2>&1 &
    daemon=$!
    i=0
    while [ ! -S /run/bhd/d.sock ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
}
start_daemon
id=$(timeout -s KILL $((VMM_TIMEOUT * 2)) /bin/bulkhead create --memory 128 --workspace /tmp/ws:clone 2>/tmp/bhd-pool.err)
/bin/bulkhead pause "$id" >>/tmp/bhd-pool.err 2>&1
mv /run/bhd/state/paused/"$id"/* /run/bhd/state/templates/base/
/bin/bulkhead rm "$id" >>/tmp/bhd-pool.err 2>&1
kill "$daemon"
wait "$daemon"
printf '[pool]\ntemplate = "base"\nsize = 1\n' >/run/bhd/pool.toml
start_daemon --config /run/bhd/pool.toml
i=0
until grep -q "a clone of base is ready" /tmp/bulkheadd-pool.log || [ $i -ge $((VMM_TIMEOUT * 2)) ]; do
    sleep 1
    i=$((i + 1))
done
pooled=$(timeout -s KILL $((VMM_TIMEOUT * 2)) /bin/bulkhead create --template base --workspace /tmp/ws2:clone 2>>/tmp/bhd-pool.err)
seen=$(/bin/bulkhead exec "$pooled" -- cat /workspace/README 2>&1)
/bin/bulkhead rm "$pooled" >>/tmp/bhd-pool.err 2>&1
kill "$daemon"
if [ -n "$pooled" ] && [ "$seen" = second ] &&
    grep "$pooled" /tmp/bulkheadd-pool.log | grep -q "(from the pool)"; then
    ok daemon-pool-workspace "a pooled clone was handed out with /tmp/ws2 attached as its clone workspace"
else
    fail daemon-pool-workspace "template sandbox [$id], pooled [$pooled], read [$seen]" \
        /tmp/bhd-pool.err /tmp/bulkheadd-pool.log
fi
# containerd places a container in a microVM: scripts/containerd-demo.sh --more (its own
# containerd, an OCI image made from busybox, `ctr run --runtime io.containerd.bulkhead.v2`,
# then exec, kill, a memory limit, ingress, egress, metrics and an OOM kill) with every busybox
# applet in PATH; its lines as tests/guest/shim.rs reads them on x86_64.
mkdir -p /opt/busybox && /bin/busybox --install -s /opt/busybox
PATH=/bin:/opt/busybox timeout -s KILL $((VMM_TIMEOUT * 5)) /bin/bash /opt/bulkhead/containerd-demo.sh \
    --bin /bin --work /tmp/ctrd --more -- sh -c 'echo "$(uname -m) pid=$$ kernel=$(uname -r)"' \
    >/tmp/ctrd.out 2>/tmp/ctrd.err
status=$?
line() { sed -n "$1p" /tmp/ctrd.out | tr -d '\r'; }
host_kernel=$(uname -r)
first=$(line 1)
case "$first" in
"aarch64 pid=1 kernel=$host_kernel") first_ok=no ;;
"aarch64 pid=1 kernel="?*) first_ok=yes ;;
*) first_ok=no ;;
esac
case "$(line 2)" in
*pid=1) exec_ok=no ;;
"exec: status=4 output=in-exec pid="?*) exec_ok=yes ;;
*) exec_ok=no ;;
esac
mem_kib=$(line 4 | sed -n 's/^memory: MemTotal: *\([0-9]*\) kB$/\1/p')
if [ "$status" = 0 ] && [ "$first_ok" = yes ] && [ "$exec_ok" = yes ] &&
    [ "$(line 3)" = "kill: STOPPED" ] && [ "${mem_kib:-0}" -ge 40960 ] && [ "$mem_kib" -le 65536 ] &&
    [ "$(line 6)" = "ingress: hello-ingress" ] && [ "$(line 7)" = "egress: hello-egress 1" ] &&
    line 8 | grep -q "^metrics: memory=[1-9][0-9]* cpu=[1-9][0-9]* pids=[1-9]" &&
    [ "$(line 10)" = "oom: status=137 events=1" ] &&
    [ "$(line 11)" = "pod: cleanups=1 second=RUNNING exec=0:pod-b-alive" ]; then
    ok containerd-run "ctr run (PID 1 in the guest's kernel: [$first], host $host_kernel), task exec, kill, 64 MiB, ingress, egress, metrics, OOM, a two-task pod"
else
    fail containerd-run "status $status (want 0); lines 1-11 as on x86_64 (tests/guest/shim.rs)" \
        /tmp/ctrd.out /tmp/ctrd.err /tmp/ctrd/containerd.log
fi
echo "arm64-smoke: checks done"
HOST_CHECKS
}

# The commands of the emulated host's /init: the VMM once, or the checklist (GUEST=run).
host_commands() {
    if [[ "$GUEST" == run ]]; then
        run_checks_script
        return 0
    fi
    local vmm_cmd="/bin/bulkhead-vmm --kernel /guest/Image --initrd /guest/initramfs.cpio.gz"
    vmm_cmd+=" --memory 256 --vcpus $VCPUS --serial stdout ${VMM_ARGS:-}"
    if [[ "$GUEST" == devices ]]; then
        vmm_cmd+=" --disk /tmp/disk.img --share share=/tmp/share:ro --vsock-uds /tmp/vsock.sock"
    fi
    # One shell word for the emulated host's sh (bash's %q quoting: backslashes or $'...').
    [[ -z "${GUEST_CMDLINE:-}" ]] || vmm_cmd+=" --cmdline $(printf '%q' "$GUEST_CMDLINE")"
    # SIGKILL: a VMM stopped by SIGTERM exits 0, which would pass a guest that hung.
    cat <<HOST_VMM
printf '%s\n' $(printf '%q' "arm64-smoke: running: $vmm_cmd")
timeout -s KILL $VMM_TIMEOUT $vmm_cmd
echo "arm64-smoke: bulkhead-vmm exited with status \$?"
HOST_VMM
}

# The emulated host's /init: mount, report KVM, run the VMM or `bulkhead run`, power off.
write_host_init() {
    cat >"$1" <<EOF
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
$(host_device_setup)
echo "arm64-smoke: host kernel \$(uname -r); \$(dmesg | grep -m1 -i 'kvm.*initialized' || echo 'no KVM init message')"
ls -l /dev/kvm
$(host_commands)
poweroff -f
EOF
    chmod 0755 "$1"
}

# GUEST=run: copies what the checks need beyond the default image into host stage $1: the test
# init's initramfs $2, the disk check's ext4 image (a known disk.txt; made anew each run, it
# takes a moment), the bad-bzimage check's kernel: the installed x86_64 bzImage, or without
# one a file with only an x86 setup header ("HdrS" at 0x202), which is all the loader looks at,
# and image-template-disk's root image (with busybox $3) and mke2fs.
stage_run_files() {
    local stage="$1" test_initrd="$2" tree bzimage
    bzimage="${XDG_DATA_HOME:-$HOME/.local/share}/bulkhead/kernel/x86_64/bzImage"
    cp "$test_initrd" "$stage/guest/test-init.cpio.gz"
    if [[ -f "$bzimage" ]]; then
        cp "$bzimage" "$stage/guest/x86-bzImage"
    else
        log "no x86_64 bzImage at $bzimage: bad-bzimage gets a bare x86 setup header"
        head -c 4096 /dev/zero >"$stage/guest/x86-bzImage"
        printf HdrS | dd of="$stage/guest/x86-bzImage" bs=1 seek=514 conv=notrunc 2>/dev/null
    fi
    tree="$stage/.disk-tree"
    mkdir -p "$tree" "$stage/data"
    echo bulkhead-disk-ok >"$tree/disk.txt"
    mke2fs -q -F -t ext4 -E root_owner=0:0 -d "$tree" "$stage/data/disk.ext4" 8M
    rm -rf "$tree"
    stage_root_image "$stage" "$3"
    stage_mke2fs "$stage"
    stage_containerd "$stage"
}

# GUEST=run: a root filesystem image for image-template-disk in host stage $1: busybox ($2)
# and its applets, and the directories the agent mounts over (/data/root.ext4).
stage_root_image() {
    local stage="$1" busybox="$2" tree applet
    tree="$stage/.root-tree"
    mkdir -p "$tree"/{bin,dev,etc,proc,root,run,sys,tmp}
    install -m 0755 "$busybox" "$tree/bin/busybox"
    for applet in sh cat echo grep sync ls; do ln -s busybox "$tree/bin/$applet"; done
    mke2fs -q -F -t ext4 -E root_owner=0:0 -d "$tree" "$stage/data/root.ext4" 16M
    rm -rf "$tree"
}

# GUEST=run: Debian's arm64 mke2fs as /bin/mkfs.ext4 in host stage $1 (bulkhead formats scratch
# disks with it), with its libraries and /etc/mke2fs.conf (which defines ext4 for it).
stage_mke2fs() {
    local stage="$1" pkg dir
    dir="$(fetch_deb e2fsprogs)"
    install -m 0755 "$dir/sbin/mke2fs" "$stage/bin/mke2fs"
    ln -s mke2fs "$stage/bin/mkfs.ext4"
    mkdir -p "$stage/etc"
    cp "$dir/etc/mke2fs.conf" "$stage/etc/mke2fs.conf"
    for pkg in libext2fs2 libcom-err2 libblkid1 libuuid1; do
        dir="$(fetch_deb "$pkg")"
        find "$dir" -name '*.so.*' \( -type f -o -type l \) -exec cp -P -t "$stage/lib" {} +
    done
}

# GUEST=run: what containerd-run needs in host stage $1: Debian's arm64 containerd and ctr,
# bash (scripts/containerd-demo.sh is written in it) with its libraries, the shim, and the demo
# script itself (/opt/bulkhead/containerd-demo.sh).
stage_containerd() {
    local stage="$1" dir b
    dir="$(fetch_deb containerd)"
    install -m 0755 "$dir/usr/bin/containerd" "$dir/usr/bin/ctr" "$stage/bin/"
    dir="$(fetch_deb bash)"
    install -m 0755 "$dir/bin/bash" "$stage/bin/bash"
    dir="$(fetch_deb libtinfo6)"
    find "$dir" -name 'libtinfo.so.*' \( -type f -o -type l \) -exec cp -P -t "$stage/lib" {} +
    for b in containerd ctr bash; do copy_shared_libs "$stage/bin/$b" "$stage"; done
    aarch64-linux-gnu-strip -o "$stage/bin/containerd-shim-bulkhead-v2" \
        "$CARGO_TARGET_DIR/$GNU_TARGET/$PROFILE/containerd-shim-bulkhead-v2"
    copy_shared_libs "$stage/bin/containerd-shim-bulkhead-v2" "$stage"
    mkdir -p "$stage/opt/bulkhead"
    install -m 0755 scripts/containerd-demo.sh "$stage/opt/bulkhead/containerd-demo.sh"
}

# Builds the emulated host's initramfs into $CACHE/host.cpio.gz.
build_host_initramfs() {
    local busybox_dir="$1" guest_image="$2" guest_initrd="$3" stage applet
    stage="$(mktemp -d)"
    STAGE="$stage" # removed on exit, see main
    chmod 0755 "$stage"
    mkdir -p "$stage"/{bin,sbin,lib,dev,proc,sys,tmp,guest,root}
    install -m 0755 "$busybox_dir/bin/busybox" "$stage/bin/busybox"
    for applet in sh mount ls cat echo dmesg grep timeout poweroff uname dd printf mkdir cp tr \
        sed head cut wc sha256sum chown stat sleep; do
        ln -s busybox "$stage/bin/$applet"
    done
    aarch64-linux-gnu-strip -o "$stage/bin/bulkhead-vmm" \
        "$CARGO_TARGET_DIR/$GNU_TARGET/$PROFILE/bulkhead-vmm"
    copy_shared_libs "$stage/bin/bulkhead-vmm" "$stage"
    if [[ "$GUEST" == run ]]; then
        for b in bulkhead bulkheadd; do
            aarch64-linux-gnu-strip -o "$stage/bin/$b" "$CARGO_TARGET_DIR/$GNU_TARGET/$PROFILE/$b"
            copy_shared_libs "$stage/bin/$b" "$stage"
        done
        # The default kernel and image of `bulkhead run` (HOME=/root, crates/sandbox/src/paths.rs).
        local data="$stage/root/.local/share/bulkhead"
        mkdir -p "$data/kernel/aarch64" "$data/images/default"
        ln -s /guest/Image "$data/kernel/aarch64/Image"
        ln -s /guest/initramfs.cpio.gz "$data/images/default/initramfs.cpio.gz"
        stage_run_files "$stage" "$CACHE/guest.cpio.gz" "$busybox_dir/bin/busybox"
    fi
    cp "$guest_image" "$stage/guest/Image"
    cp "$guest_initrd" "$stage/guest/initramfs.cpio.gz"
    write_host_init "$stage/init"
    (cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner 0:0 --quiet) |
        gzip -1 >"$CACHE/host.cpio.gz.tmp"
    mv -f "$CACHE/host.cpio.gz.tmp" "$CACHE/host.cpio.gz"
    rm -rf "$stage"
}

# --- Run ------------------------------------------------------------------------------------

run_qemu() {
    local host_image="$1"
    log "booting the emulated arm64 host (console log: $CACHE/console.log)"
    nice -n 10 timeout "$QEMU_TIMEOUT" qemu-system-aarch64 \
        -M virt,virtualization=on,gic-version=3 -cpu max -smp 2 -m 2G -accel tcg,thread=multi \
        -nographic -no-reboot -kernel "$host_image" -initrd "$CACHE/host.cpio.gz" \
        -append "console=ttyAMA0 panic=-1 quiet" </dev/null | tee "$CACHE/console.log"
}

STAGE=""
main() {
    trap '[[ -z "$STAGE" ]] || rm -rf "$STAGE"' EXIT
    case "$GUEST" in test-init | devices | run) ;; *) die "unknown GUEST=$GUEST (test-init, devices or run)" ;; esac
    case "$PROFILE" in debug | release) ;; *) die "unknown PROFILE=$PROFILE (debug or release)" ;; esac
    mkdir -p "$CACHE/debs"
    # One run at a time from here: the builds, the host initramfs and the console log in $CACHE
    # are shared by every run (another clone's included).
    exec 9>"$LOCK"
    flock -n 9 || {
        log "waiting for $LOCK (another arm64 run)"
        flock 9
    }
    ensure_packages
    ensure_arm64_arch
    local kpkg kdir busybox_dir guest_dir guest_initrd host_image
    kpkg="$(host_kernel_package)"
    [[ -n "$kpkg" ]] || die "apt-cache names no kernel behind linux-image-arm64 (run apt-get update)"
    kdir="$(fetch_deb "$kpkg")"
    host_image="$(find "$kdir/boot" -name 'vmlinuz-*' | head -n1)"
    [[ -f "$host_image" ]] || die "no vmlinuz in $kpkg"
    busybox_dir="$(fetch_deb busybox-static)"

    guest_dir="$(nice -n 10 scripts/build-kernel.sh --arch aarch64 --print-dir)"
    build_binaries
    # The test init's initramfs (GUEST=run boots it too, as /guest/test-init.cpio.gz).
    scripts/build-initramfs.sh --out "$CACHE/guest.cpio.gz" \
        --init "$CARGO_TARGET_DIR/$MUSL_TARGET/release/bulkhead-test-init"
    case "$GUEST" in
    test-init) guest_initrd="$CACHE/guest.cpio.gz" ;;
    devices)
        guest_initrd="$CACHE/guest-devices.cpio.gz"
        build_devices_guest "$busybox_dir"
        ;;
    run)
        guest_initrd="$CACHE/guest-run.cpio.gz"
        scripts/build-initramfs.sh --out "$guest_initrd" --busybox-bin "$busybox_dir/bin/busybox" \
            --init "$CARGO_TARGET_DIR/$MUSL_TARGET/release/bulkhead-agent"
        ;;
    *) die "unknown GUEST=$GUEST (test-init, devices or run)" ;;
    esac
    build_host_initramfs "$busybox_dir" "$guest_dir/Image" "$guest_initrd"
    run_qemu "$host_image"
    check_console "$CACHE/console.log"
}

# Fails unless console log $1 ends the way the GUEST mode should.
check_console() {
    local console
    console="$(tr -d '\r' <"$1")"
    if [[ "$GUEST" != run ]]; then
        grep -q '^arm64-smoke: bulkhead-vmm exited with status 0' <<<"$console" ||
            die "bulkhead-vmm did not exit with status 0 (see $1)"
        return 0
    fi
    local check failed=()
    for check in "${RUN_CHECKS[@]}"; do
        grep -q "^arm64-smoke: check $check: ok" <<<"$console" || failed+=("$check")
    done
    ((${#failed[@]} == 0)) ||
        die "${#failed[@]} of ${#RUN_CHECKS[@]} checks failed or did not run: ${failed[*]} (see $1)"
    log "all ${#RUN_CHECKS[@]} checks passed"
}

main "$@"

#!/usr/bin/env bash
# Boots an aarch64 guest with the aarch64 build of bulkhead-vmm inside an emulated arm64 host
# (issue 9). Manual smoke test, not part of CI: it shows how far the guest gets.
#
#   scripts/arm64-smoke.sh                 build what is missing, boot once, print the console
#   GUEST_CMDLINE="console=ttyS0 earlycon=uart,mmio,0x09000000" scripts/arm64-smoke.sh
#   VMM_ARGS="--seccomp log" scripts/arm64-smoke.sh
#   GUEST=devices scripts/arm64-smoke.sh  busybox guest probing a virtio-blk disk, a read-only
#                                          virtio-fs share and virtio-vsock, then `reboot -f`
#   GUEST=run scripts/arm64-smoke.sh
#                                          `bulkhead run` (CLI, sandbox, agent, vsock) instead of
#                                          bulkhead-vmm alone, see below
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
# its shared libraries), and the guest initramfs is the default image the way scripts/setup.sh
# builds it on x86_64: the guest agent (aarch64-unknown-linux-musl) as /init plus Debian's arm64
# busybox-static (scripts/build-initramfs.sh --busybox-bin). The host's /init sets
# BULKHEAD_VMM=/bin/bulkhead-vmm and HOME=/root and runs, as root (so each VMM is jailed),
#   bulkhead run --boot-timeout $VMM_TIMEOUT --console /tmp/NAME.console -- uname -m
# with the default kernel and image (symlinks in /root/.local/share/bulkhead/: kernel/aarch64/Image,
# images/default/initramfs.cpio.gz), then with BULKHEAD_KERNEL=/guest/Image
# BULKHEAD_INITRD=/guest/initramfs.cpio.gz
#   bulkhead run ... -- sh -c 'echo out; echo err >&2; exit 7'
# each with stdout and stderr in files. Success is exactly the lines
#   arm64-smoke: run uname: status 0, stdout [aarch64], stderr []
#   arm64-smoke: run exit7: status 7, stdout [out], stderr [err]
# (the guest console is printed after a run whose status is not the expected one).
# RUN_ARGS adds `bulkhead run` arguments, RUN_ENV environment assignments for it (e.g.
# RUN_ENV="BULKHEAD_SECCOMP=log BULKHEAD_JAIL=off BULKHEAD_LOG=debug").
#
# Idempotent: Debian packages (apt-get download, unpacked with dpkg -x) are cached under
# ${XDG_CACHE_HOME:-~/.cache}/bulkhead/arm64-smoke/, cargo builds go to target/aarch64, the guest
# kernel is cached by build-kernel.sh. The console log of the last run is
# ${XDG_CACHE_HOME:-~/.cache}/bulkhead/arm64-smoke/console.log.
# Needs root (or sudo) only to install missing packages and to add the arm64 dpkg architecture.
# The QEMU run is serialised with `flock /tmp/bulkhead-arm64.lock` and runs under `nice -n 10`.
#
# Environment: GUEST (test-init|devices|run, default test-init), PROFILE (debug|release, default
# debug), VCPUS (guest vCPUs, default 1; the
# emulated host has 2 CPUs), VMM_ARGS (extra bulkhead-vmm arguments),
# GUEST_CMDLINE (passed as --cmdline when set), VMM_TIMEOUT (seconds, default 120),
# QEMU_TIMEOUT (seconds, default 900); GUEST=run only: RUN_ARGS, RUN_ENV (see above).
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
    local p missing=()
    for p in qemu-system-arm cpio gzip gcc-aarch64-linux-gnu libc6-dev-arm64-cross; do
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
    log "cargo build bulkhead ($GNU_TARGET, $PROFILE)"
    nice -n 10 cargo build --quiet "${release[@]}" --target "$GNU_TARGET" -p bulkhead-cli --bin bulkhead
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

# GUEST=run: host /init lines that run `bulkhead run ... -- $2..` with stdout and stderr in files
# and print `arm64-smoke: run NAME: status N, stdout [..], stderr [..]`, plus the guest console
# when the status is not the expected one. $1 is NAME:EXPECTED_STATUS.
host_run_command() {
    local name="${1%%:*}" want="${1#*:}"
    shift
    cat <<HOST_RUN
echo "arm64-smoke: running: bulkhead run ${RUN_ARGS:-} -- $*"
timeout $VMM_TIMEOUT /bin/bulkhead run --boot-timeout $VMM_TIMEOUT --console /tmp/$name.console \\
    --vcpus $VCPUS ${RUN_ARGS:-} -- $* >/tmp/$name.out 2>/tmp/$name.err
status=\$?
echo "arm64-smoke: run $name: status \$status, stdout [\$(cat /tmp/$name.out)], stderr [\$(cat /tmp/$name.err)]"
[ "\$status" = $want ] || cat /tmp/$name.console
HOST_RUN
}

# The commands of the emulated host's /init: the VMM once, or `bulkhead run` twice (GUEST=run).
host_commands() {
    if [[ "$GUEST" == run ]]; then
        # The first run finds kernel and image at their default paths under HOME (see
        # build_host_initramfs), the second through the environment.
        echo "export BULKHEAD_VMM=/bin/bulkhead-vmm HOME=/root ${RUN_ENV:-}"
        host_run_command uname:0 uname -m
        echo "export BULKHEAD_KERNEL=/guest/Image BULKHEAD_INITRD=/guest/initramfs.cpio.gz"
        host_run_command exit7:7 sh -c "'echo out; echo err >&2; exit 7'"
        return 0
    fi
    local vmm_cmd="/bin/bulkhead-vmm --kernel /guest/Image --initrd /guest/initramfs.cpio.gz"
    vmm_cmd+=" --memory 256 --vcpus $VCPUS --serial stdout ${VMM_ARGS:-}"
    if [[ "$GUEST" == devices ]]; then
        vmm_cmd+=" --disk /tmp/disk.img --share share=/tmp/share:ro --vsock-uds /tmp/vsock.sock"
    fi
    cat <<HOST_VMM
echo "arm64-smoke: running: $vmm_cmd${GUEST_CMDLINE:+ --cmdline '$GUEST_CMDLINE'}"
timeout $VMM_TIMEOUT $vmm_cmd ${GUEST_CMDLINE:+--cmdline "$GUEST_CMDLINE"}
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

# Builds the emulated host's initramfs into $CACHE/host.cpio.gz.
build_host_initramfs() {
    local busybox_dir="$1" guest_image="$2" guest_initrd="$3" stage applet
    stage="$(mktemp -d)"
    STAGE="$stage" # removed on exit, see main
    chmod 0755 "$stage"
    mkdir -p "$stage"/{bin,sbin,lib,dev,proc,sys,tmp,guest,root}
    install -m 0755 "$busybox_dir/bin/busybox" "$stage/bin/busybox"
    for applet in sh mount ls cat echo dmesg grep timeout poweroff uname dd printf mkdir; do
        ln -s busybox "$stage/bin/$applet"
    done
    aarch64-linux-gnu-strip -o "$stage/bin/bulkhead-vmm" \
        "$CARGO_TARGET_DIR/$GNU_TARGET/$PROFILE/bulkhead-vmm"
    copy_shared_libs "$stage/bin/bulkhead-vmm" "$stage"
    if [[ "$GUEST" == run ]]; then
        aarch64-linux-gnu-strip -o "$stage/bin/bulkhead" \
            "$CARGO_TARGET_DIR/$GNU_TARGET/$PROFILE/bulkhead"
        copy_shared_libs "$stage/bin/bulkhead" "$stage"
        # The default kernel and image of `bulkhead run` (HOME=/root, crates/sandbox/src/paths.rs).
        local data="$stage/root/.local/share/bulkhead"
        mkdir -p "$data/kernel/aarch64" "$data/images/default"
        ln -s /guest/Image "$data/kernel/aarch64/Image"
        ln -s /guest/initramfs.cpio.gz "$data/images/default/initramfs.cpio.gz"
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
    flock "$LOCK" nice -n 10 timeout "$QEMU_TIMEOUT" qemu-system-aarch64 \
        -M virt,virtualization=on,gic-version=3 -cpu max -smp 2 -m 2G -accel tcg,thread=multi \
        -nographic -no-reboot -kernel "$host_image" -initrd "$CACHE/host.cpio.gz" \
        -append "console=ttyAMA0 panic=-1 quiet" </dev/null | tee "$CACHE/console.log"
}

STAGE=""
main() {
    trap '[[ -z "$STAGE" ]] || rm -rf "$STAGE"' EXIT
    mkdir -p "$CACHE/debs"
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
    case "$GUEST" in
    test-init)
        guest_initrd="$CACHE/guest.cpio.gz"
        scripts/build-initramfs.sh --out "$guest_initrd" \
            --init "$CARGO_TARGET_DIR/$MUSL_TARGET/release/bulkhead-test-init"
        ;;
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
    grep -qxF 'arm64-smoke: run uname: status 0, stdout [aarch64], stderr []' <<<"$console" ||
        die "bulkhead run -- uname -m did not print aarch64 and exit 0 (see $1)"
    grep -qxF 'arm64-smoke: run exit7: status 7, stdout [out], stderr [err]' <<<"$console" ||
        die "bulkhead run -- sh -c '...; exit 7' did not print out/err and exit 7 (see $1)"
}

main "$@"

#!/usr/bin/env bash
# Builds a newc initramfs whose /init is the given static binary.
#
#   scripts/build-initramfs.sh --init BIN --out FILE [--busybox | --busybox-bin BUSYBOX] [--add SRC:DEST]...
#
# FILE's name picks the compression: `.lz4` (the LZ4 legacy frame the kernel's unlz4 reads; in the
# nested test host a guest unpacks the default image in 10-25 ms of CPU instead of gzip's 130-170 ms,
# for a file 14 % larger: benches/results/README.md, part 5), `.gz` (gzip -6) or `.cpio` (none).
# The guest kernel must have the matching CONFIG_RD_* option.
#
# --busybox adds Debian's busybox-static as /bin/busybox with a symlink per applet (sh, ls, cat, ...).
# --busybox-bin does the same with another busybox binary, e.g. Debian's arm64 busybox-static for
# an aarch64 image (scripts/arm64-smoke.sh). The applets are those it lists when it runs here; a
# binary of another architecture cannot run, so the host's /bin/busybox lists them, which must be
# the same BusyBox build (its version banner, e.g. "BusyBox v1.35.0 (Debian 1:1.35.0-4+deb12u1+b1)",
# is compared; Debian configures busybox-static alike on every architecture).
# --add copies a host file into the image. The output is rebuilt only when an input changed: a
# sidecar FILE.key holds the sha256 of all inputs.
set -euo pipefail

init="" out="" busybox=0 adds=() BUSYBOX=/bin/busybox
while (($#)); do
    case "$1" in
        --init) init="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --busybox) busybox=1; shift ;;
        --busybox-bin) busybox=1; BUSYBOX="$2"; shift 2 ;;
        --add) adds+=("$2"); shift 2 ;;
        *) echo "build-initramfs: unknown argument $1" >&2; exit 2 ;;
    esac
done
[[ -n "$init" && -n "$out" ]] || { echo "usage: $0 --init BIN --out FILE [--busybox | --busybox-bin BUSYBOX] [--add SRC:DEST]..." >&2; exit 2; }
[[ -f "$init" ]] || { echo "build-initramfs: init binary $init not found" >&2; exit 1; }
case "$out" in
    *.lz4) compress=(lz4 -l -9 -q -c) ;;
    *.gz) compress=(gzip -6 -c) ;;
    *.cpio) compress=(cat) ;;
    *) echo "build-initramfs: --out $out: the name must end in .lz4, .gz or .cpio (it picks the compression)" >&2; exit 2 ;;
esac
command -v "${compress[0]}" >/dev/null || { echo "build-initramfs: ${compress[0]} is not installed (needed for $out)" >&2; exit 1; }

banner() { grep -a -o -m1 'BusyBox v[^ ]* ([^)]*)' "$1" | head -n1; }

# Prints the applet names of $BUSYBOX, one a line (see --busybox-bin above).
busybox_applets() {
    local list
    if list="$("$BUSYBOX" --list 2>/dev/null)" && [[ -n "$list" ]]; then
        printf '%s\n' "$list"
        return 0
    fi
    [[ -f "$BUSYBOX" ]] || { echo "build-initramfs: $BUSYBOX missing; install Debian's busybox-static" >&2; return 1; }
    local host=/bin/busybox
    if [[ "$BUSYBOX" == "$host" ]] || ! "$host" --list >/dev/null 2>&1; then
        echo "build-initramfs: cannot list the applets of $BUSYBOX (and no runnable $host); install Debian's busybox-static" >&2
        return 1
    fi
    if [[ -z "$(banner "$BUSYBOX")" || "$(banner "$BUSYBOX")" != "$(banner "$host")" ]]; then
        echo "build-initramfs: $BUSYBOX ('$(banner "$BUSYBOX")') cannot run here and is not the build of $host ('$(banner "$host")') that would list its applets" >&2
        return 1
    fi
    "$host" --list
}
applets=""
if ((busybox)); then applets="$(busybox_applets)" || exit 1; fi

key_inputs() {
    sha256sum "$init" "$0"
    if ((busybox)); then sha256sum "$BUSYBOX"; fi
    for a in "${adds[@]+"${adds[@]}"}"; do sha256sum "${a%%:*}"; echo "$a"; done
}
key=$(key_inputs | sha256sum | cut -c1-64)
if [[ -f "$out" && -f "$out.key" && "$(cat "$out.key")" == "$key" ]]; then
    exit 0
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
chmod 0755 "$stage"   # the image's / : mktemp's 0700 would lock every non-root user out
mkdir -p "$stage"/{bin,sbin,dev,proc,sys,tmp,run,etc,root,usr/bin,usr/sbin}
chmod 1777 "$stage/tmp"
install -m 0755 "$init" "$stage/init"
if ((busybox)); then
    install -m 0755 "$BUSYBOX" "$stage/bin/busybox"
    for applet in $applets; do
        [[ "$applet" == busybox || -e "$stage/bin/$applet" ]] || ln -s busybox "$stage/bin/$applet"
    done
fi
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > "$stage/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$stage/etc/group"
for a in "${adds[@]+"${adds[@]}"}"; do
    install -D -m 0755 "${a%%:*}" "$stage/${a#*:}"
done
mkdir -p "$(dirname "$out")"
( cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner 0:0 --quiet ) | "${compress[@]}" > "$out.tmp"
mv "$out.tmp" "$out"
echo "$key" > "$out.key"

#!/usr/bin/env bash
# Build the bulkhead guest kernel (or reuse a cached build) and install it for the current user.
#
# Usage: scripts/build-kernel.sh [--arch x86_64|aarch64] [--fragment FILE] [--no-install] [--print-dir]
#
# Recipe: Debian's linux-source-6.1 tarball -> `make tinyconfig` -> merge kernel-config/<arch>.config
# -> `make olddefconfig` -> check every option of the fragment survived -> build the boot image.
#
# Cache:   ${XDG_CACHE_HOME:-~/.cache}/bulkhead/kernel/<arch>-<srcver>-<hash12>/{vmlinux,<image>,config}
#          hash12 covers the arch, the source package version, the fragment's sha256 and the recipe version.
# Install: ${XDG_DATA_HOME:-~/.local/share}/bulkhead/kernel/<arch>/{vmlinux,<image>,config,SOURCE}
#          (hard links into the cache where possible, else copies; each file replaced atomically).
#
# stdout: `name=path` lines for the installed files, or only the install directory with --print-dir.
# stderr: progress and the kernel build log.
set -euo pipefail

# Bump this whenever the build steps below change in a way that changes the output: it is part of
# the cache key, so old cache entries stop matching.
readonly RECIPE_VERSION="bulkhead-kernel-recipe/1 tinyconfig+merge_config-m+olddefconfig+verify+image"
readonly SRC_PKG="linux-source-6.1"
readonly SRC_TARBALL="/usr/src/linux-source-6.1.tar.xz"
readonly HOST_PKGS=(flex bison bc libelf-dev libssl-dev xz-utils make gcc "$SRC_PKG")

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
CONFIG_DIR="$(dirname "$SCRIPT_DIR")/kernel-config"
readonly CONFIG_DIR

log() { printf 'build-kernel: %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

usage() {
    cat <<'EOF'
Usage: build-kernel.sh [--arch x86_64|aarch64] [--fragment FILE] [--no-install] [--print-dir]

Builds the bulkhead guest kernel from Debian's linux-source-6.1 and kernel-config/<arch>.config,
caches it under ${XDG_CACHE_HOME:-~/.cache}/bulkhead/kernel/ and installs vmlinux and the boot
image into ${XDG_DATA_HOME:-~/.local/share}/bulkhead/kernel/<arch>/.

  --arch ARCH    x86_64 (default: bzImage) or aarch64 (Image; cross-built on other hosts)
  --fragment F   merge config fragment F instead of kernel-config/<arch>.config (it is part of
                 the cache key); used for other guests, e.g. benches/reference-guest.config
  --no-install   build (or find) the cache entry only; the paths printed are the cache's
  --print-dir    print only the install directory (with --no-install: the cache entry) on stdout
  -h, --help     show this help
EOF
}

# --- Arguments and per-architecture settings ------------------------------------------------

ARCH="x86_64"
PRINT_DIR=0
FRAGMENT_ARG=""
INSTALL=1

parse_args() {
    while (($# > 0)); do
        case "$1" in
        --arch)
            (($# >= 2)) || die "--arch needs a value (x86_64 or aarch64)"
            ARCH="$2"
            shift 2
            ;;
        --arch=*)
            ARCH="${1#--arch=}"
            shift
            ;;
        --fragment)
            (($# >= 2)) || die "--fragment needs a file"
            FRAGMENT_ARG="$2"
            shift 2
            ;;
        --fragment=*)
            FRAGMENT_ARG="${1#--fragment=}"
            shift
            ;;
        --no-install)
            INSTALL=0
            shift
            ;;
        --print-dir)
            PRINT_DIR=1
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            usage >&2
            die "unknown argument: $1"
            ;;
        esac
    done
}

# Sets KARCH (kernel ARCH=), IMAGE_NAME, IMAGE_PATH (in the tree), CROSS_COMPILE and CROSS_PKG.
set_arch_vars() {
    local host_arch
    host_arch="$(uname -m)"
    CROSS_COMPILE=""
    CROSS_PKG=""
    case "$ARCH" in
    x86_64)
        KARCH="x86_64"
        IMAGE_NAME="bzImage"
        IMAGE_PATH="arch/x86/boot/bzImage"
        if [[ "$host_arch" != "x86_64" ]]; then
            CROSS_COMPILE="x86_64-linux-gnu-"
            CROSS_PKG="gcc-x86-64-linux-gnu"
        fi
        ;;
    aarch64)
        KARCH="arm64"
        IMAGE_NAME="Image"
        IMAGE_PATH="arch/arm64/boot/Image"
        if [[ "$host_arch" != "aarch64" ]]; then
            CROSS_COMPILE="aarch64-linux-gnu-"
            CROSS_PKG="gcc-aarch64-linux-gnu"
        fi
        ;;
    *) die "unsupported --arch '$ARCH' (use x86_64 or aarch64)" ;;
    esac
    FRAGMENT="${FRAGMENT_ARG:-$CONFIG_DIR/$ARCH.config}"
    [[ -f "$FRAGMENT" ]] || die "config fragment not found: $FRAGMENT"
    FRAGMENT="$(realpath "$FRAGMENT")" # the merge runs in the source tree, not here
}

# --- Build dependencies ---------------------------------------------------------------------

pkg_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" == "installed" ]]
}

as_root() {
    if ((EUID == 0)); then
        "$@"
    elif command -v sudo >/dev/null; then
        sudo "$@"
    else
        die "need root to run '$*' and sudo is not installed"
    fi
}

apt_install() {
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2
}

ensure_deps() {
    local pkg missing=()
    for pkg in "${HOST_PKGS[@]}" ${CROSS_PKG:+"$CROSS_PKG"}; do
        pkg_installed "$pkg" || missing+=("$pkg")
    done
    ((${#missing[@]} > 0)) || return 0
    log "installing build dependencies: ${missing[*]}"
    if ! apt_install "${missing[@]}"; then
        as_root apt-get update >&2
        apt_install "${missing[@]}"
    fi
}

# --- Cache key and locations ----------------------------------------------------------------

sha256_of_file() { sha256sum "$1" | cut -c1-64; }
sha256_of_string() { printf '%s' "$1" | sha256sum | cut -c1-64; }

# Sets SRC_VERSION, FRAGMENT_SHA, RECIPE_SHA, CACHE_KEY, CACHE_ROOT, ENTRY and DATA_DIR.
compute_key() {
    local safe_ver hash12
    SRC_VERSION="$(dpkg-query -W -f='${Version}' "$SRC_PKG")"
    [[ -n "$SRC_VERSION" ]] || die "cannot read the version of $SRC_PKG"
    FRAGMENT_SHA="$(sha256_of_file "$FRAGMENT")"
    RECIPE_SHA="$(sha256_of_string "$RECIPE_VERSION")"
    hash12="$(sha256_of_string "$ARCH $SRC_VERSION $FRAGMENT_SHA $RECIPE_SHA" | cut -c1-12)"
    # Debian versions may contain ':' (epoch) and '~'; keep directory names plain.
    safe_ver="$(printf '%s' "$SRC_VERSION" | tr -c 'A-Za-z0-9.+_-' '_')"
    CACHE_KEY="$ARCH-$safe_ver-$hash12"
    CACHE_ROOT="${XDG_CACHE_HOME:-${HOME:?HOME is not set}/.cache}/bulkhead/kernel"
    ENTRY="$CACHE_ROOT/$CACHE_KEY"
    DATA_DIR="${XDG_DATA_HOME:-${HOME:?HOME is not set}/.local/share}/bulkhead/kernel/$ARCH"
}

# A cache entry only ever appears by renaming a fully written <entry>.tmp, so this is race-free.
entry_complete() {
    [[ -f "$ENTRY/vmlinux" && -f "$ENTRY/$IMAGE_NAME" && -f "$ENTRY/config" ]]
}

# --- Building -------------------------------------------------------------------------------

kmake() {
    make -C "$SRC_TREE" ARCH="$KARCH" ${CROSS_COMPILE:+CROSS_COMPILE="$CROSS_COMPILE"} \
        KBUILD_BUILD_USER=bulkhead KBUILD_BUILD_HOST=bulkhead "$@" >&2
}

# Compares every `CONFIG_X=v` / `# CONFIG_X is not set` line of fragment $1 with final config $2.
# Prints one line per option whose final value differs and fails if there is any.
verify_config() {
    awk '
        function parse(line, out) {
            if (match(line, /^CONFIG_[A-Za-z0-9_]+=/)) {
                out["name"] = substr(line, 1, RLENGTH - 1)
                out["value"] = substr(line, RLENGTH + 1)
                return 1
            }
            if (line ~ /^# CONFIG_[A-Za-z0-9_]+ is not set$/) {
                split(line, w, " ")
                out["name"] = w[2]
                out["value"] = "n"
                return 1
            }
            return 0
        }
        NR == FNR {
            if (parse($0, kv)) { want[kv["name"]] = kv["value"]; order[++n] = kv["name"] }
            else if ($0 !~ /^[ \t]*(#.*)?$/) { printf "  unparseable fragment line %d: %s\n", FNR, $0; bad++ }
            next
        }
        parse($0, kv) { have[kv["name"]] = kv["value"] }
        END {
            for (i = 1; i <= n; i++) {
                name = order[i]
                got = (name in have) ? have[name] : "n (absent)"
                if (got != want[name] && !(want[name] == "n" && got == "n (absent)")) {
                    printf "  %s: asked %s, got %s\n", name, want[name], got
                    bad++
                }
            }
            exit (bad > 0)
        }' "$1" "$2" >&2
}

# Runs in $ENTRY.build (under the lock); leaves the finished entry at $ENTRY.
build_entry() {
    local build_dir="$ENTRY.build" tmp_entry="$ENTRY.tmp" start
    start=$SECONDS
    rm -rf "$build_dir" "$tmp_entry" "$ENTRY.rejected.config" # leftovers; we hold the lock
    trap 'rm -rf "$ENTRY.build" "$ENTRY.tmp"' EXIT
    SRC_TREE="$build_dir/src"
    mkdir -p "$SRC_TREE"

    [[ -f "$SRC_TARBALL" ]] || die "$SRC_TARBALL is missing although $SRC_PKG is installed"
    log "extracting $SRC_TARBALL ($SRC_PKG $SRC_VERSION)"
    tar -xJf "$SRC_TARBALL" -C "$SRC_TREE" --strip-components=1

    log "configuring: tinyconfig + $(basename "$FRAGMENT")"
    kmake tinyconfig
    (cd "$SRC_TREE" && scripts/kconfig/merge_config.sh -m .config "$FRAGMENT") >&2
    kmake olddefconfig
    if ! verify_config "$FRAGMENT" "$SRC_TREE/.config"; then
        cp "$SRC_TREE/.config" "$ENTRY.rejected.config"
        die "options of $FRAGMENT did not survive olddefconfig (unmet dependencies?); see above." \
            "The resulting config is $ENTRY.rejected.config"
    fi

    log "building $IMAGE_NAME with $(nproc) jobs"
    kmake -j"$(nproc)" "$IMAGE_NAME"

    mkdir "$tmp_entry"
    cp "$SRC_TREE/vmlinux" "$tmp_entry/vmlinux"
    cp "$SRC_TREE/$IMAGE_PATH" "$tmp_entry/$IMAGE_NAME"
    cp "$SRC_TREE/.config" "$tmp_entry/config"
    chmod 0444 "$tmp_entry"/*
    mv -T "$tmp_entry" "$ENTRY"
    rm -rf "$build_dir"
    trap - EXIT
    log "built $CACHE_KEY in $((SECONDS - start)) s"
}

# Builds the entry unless another invocation did (or does) it first.
build_locked() {
    local lock_fd
    mkdir -p "$CACHE_ROOT"
    exec {lock_fd}>"$ENTRY.lock"
    if ! flock -n "$lock_fd"; then
        log "another build of $CACHE_KEY is running; waiting for it"
        flock "$lock_fd"
    fi
    if entry_complete; then
        log "cache entry $CACHE_KEY appeared while waiting"
    else
        ensure_deps
        build_entry
    fi
    exec {lock_fd}>&-
}

# --- Installing for users -------------------------------------------------------------------

# Replaces $2 by a hard link to (or copy of) $1 with one rename, unless it already matches.
install_file() {
    local src="$1" dst="$2" tmp
    if [[ "$src" -ef "$dst" ]] || cmp -s "$src" "$dst" 2>/dev/null; then
        return 0
    fi
    tmp="$dst.tmp.$$"
    ln -f "$src" "$tmp" 2>/dev/null || cp "$src" "$tmp"
    # A concurrent run may have linked $dst to the same cache file since the check above; mv
    # then refuses ("are the same file") and there is nothing left to do.
    if ! mv -f "$tmp" "$dst" 2>/dev/null; then
        rm -f "$tmp"
        [[ "$src" -ef "$dst" ]] || cmp -s "$src" "$dst" || die "cannot install $dst"
    fi
}

write_source_file() {
    local tmp="$DATA_DIR/SOURCE.tmp.$$"
    cat >"$tmp" <<EOF
cache_key=$CACHE_KEY
arch=$ARCH
$SRC_PKG=$SRC_VERSION
fragment=$(basename "$FRAGMENT")
fragment_sha256=$FRAGMENT_SHA
recipe=$RECIPE_VERSION
recipe_sha256=$RECIPE_SHA
cache_dir=$ENTRY
EOF
    if cmp -s "$tmp" "$DATA_DIR/SOURCE" 2>/dev/null; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$DATA_DIR/SOURCE"
    fi
}

install_for_user() {
    local f
    mkdir -p "$DATA_DIR"
    for f in vmlinux "$IMAGE_NAME" config; do
        install_file "$ENTRY/$f" "$DATA_DIR/$f"
    done
    write_source_file
}

print_result() {
    if ((PRINT_DIR)); then
        printf '%s\n' "$DATA_DIR"
        return
    fi
    printf 'vmlinux=%s\n%s=%s\nconfig=%s\n' \
        "$DATA_DIR/vmlinux" "$IMAGE_NAME" "$DATA_DIR/$IMAGE_NAME" "$DATA_DIR/config"
    # SOURCE is written only when installing; a cache entry has none.
    if ((INSTALL)); then
        printf 'source=%s\n' "$DATA_DIR/SOURCE"
    fi
    printf 'cache=%s\n' "$ENTRY"
}

main() {
    parse_args "$@"
    set_arch_vars
    # The source package version is part of the cache key, so it must be installed to look up.
    pkg_installed "$SRC_PKG" || ensure_deps
    compute_key
    if ! entry_complete; then
        build_locked
    fi
    if ((INSTALL)); then
        install_for_user
    else
        # Nothing installed: the paths printed are the cache entry's.
        DATA_DIR="$ENTRY"
    fi
    print_result
}

main "$@"

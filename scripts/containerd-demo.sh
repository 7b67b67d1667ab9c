#!/usr/bin/env bash
# containerd runs a container in a bulkhead microVM: `ctr run --runtime io.containerd.bulkhead.v2`.
#
#   scripts/containerd-demo.sh [--bin DIR] [--work DIR] [--more] [--faults] [-- CMD...]
#   (default CMD: uname -r)
#
# What it does, offline (no registry is reached):
#   1. installs Debian's containerd when it is missing (apt-get; needs root);
#   2. builds a small OCI image from busybox-static (one layer, `ctr images import`);
#   3. starts a private containerd (its own root, state and socket under --work; the CRI plugin
#      off) with DIR (default: target/release) first in PATH, so that it finds
#      containerd-shim-bulkhead-v2 there;
#   4. runs `ctr run --rm --runtime io.containerd.bulkhead.v2 IMAGE demo CMD...` and prints what
#      the container printed (the guest kernel's release, not the host's) and its exit status;
#   5. with --more: `ctr run -d` of a shell that traps SIGTERM, `ctr task exec` into it (its output
#      and exit status), `ctr task kill` (SIGTERM: the task stops), and `ctr run --memory-limit`
#      64 MiB (the guest's MemTotal), one line each on stdout (`exec: ...`, `kill: ...`,
#      `memory: ...`), then the resident memory of the detached task's shim and VMM (`rss: ...`);
#   6. with --faults: kill -9 of a running task's VMM (the task exits with status 255, `ctr run`
#      with it; its root is unmounted) and kill -9 of a running task's shim (containerd runs the
#      shim's `delete`: the task goes, its VMM stops, its root is unmounted), one line each on
#      stdout (`vmm-kill: ...`, `shim-kill: ...`);
#   7. stops containerd and removes --work (default: a new temporary directory).
#
# The microVM needs a KVM that boots stock guests; on a kvm_pvm host run the script in the nested
# test host (docs/testhost.md), which has busybox but not containerd or bash, e.g.:
#   mkdir -p /tmp/ctrd-bin && cp /usr/bin/containerd /usr/bin/ctr /bin/bash /tmp/ctrd-bin/
#   bulkhead-testhost run --share "$PWD" --share /tmp/ctrd-bin --share ~/.local/share/bulkhead \
#       --libs-for /bin/bash -e PATH=/tmp/ctrd-bin:/bin:/sbin:/usr/bin:/usr/sbin \
#       -e BULKHEAD_DATA_DIR=$HOME/.local/share/bulkhead -- /tmp/ctrd-bin/bash scripts/containerd-demo.sh
# BULKHEAD_KERNEL, BULKHEAD_INITRD and BULKHEAD_VMM reach the shim through containerd's environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/target/release"
WORK=""
IMAGE="docker.io/bulkhead/busybox:demo"
CMD=(uname -r)
MORE=0
FAULTS=0

while (($#)); do
    case "$1" in
        --bin) BIN="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        --more) MORE=1; shift ;;
        --faults) FAULTS=1; shift ;;
        --) shift; CMD=("$@"); break ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        *) echo "containerd-demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'containerd-demo: %s\n' "$*" >&2; exit 1; }

[[ -x "$BIN/containerd-shim-bulkhead-v2" ]] \
    || die "$BIN/containerd-shim-bulkhead-v2 is missing: cargo build --release -p bulkhead-shim (or --bin DIR)"
[[ -x /bin/busybox ]] || die "/bin/busybox is missing: apt-get install busybox-static"
if ! command -v containerd >/dev/null || ! command -v ctr >/dev/null; then
    log "installing Debian's containerd"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q containerd >/dev/null
fi

cleanup_work=0
if [[ -z "$WORK" ]]; then
    WORK="$(mktemp -d /tmp/bulkhead-containerd.XXXXXX)"
    cleanup_work=1
fi
mkdir -p "$WORK"
SOCK="$WORK/containerd.sock"
CTRD_PID=""
cleanup() {
    if [[ -n "$CTRD_PID" ]]; then
        kill "$CTRD_PID" 2>/dev/null || true
        wait "$CTRD_PID" 2>/dev/null || true
    fi
    # Snapshots may still be mounted when a run failed half way.
    { grep -o " $WORK/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done
    if ((cleanup_work)); then rm -rf "$WORK"; fi
    return 0
}
trap cleanup EXIT

# --- 2. the image: one layer with busybox, as an OCI image layout in a tar ---
log "building the OCI image $IMAGE from /bin/busybox"
layer="$WORK/layer"
mkdir -p "$layer/bin" "$layer/proc" "$layer/dev" "$layer/sys" "$layer/tmp" "$layer/etc"
cp /bin/busybox "$layer/bin/busybox"
for applet in $(/bin/busybox --list); do
    [[ "$applet" == busybox ]] || ln -sf busybox "$layer/bin/$applet"
done
echo 'root:x:0:0:root:/root:/bin/sh' > "$layer/etc/passwd"
oci="$WORK/oci"
mkdir -p "$oci/blobs/sha256"
blob() { # FILE -> prints its digest and size; stores it as a blob
    local d s
    d="$(sha256sum "$1" | cut -d' ' -f1)"
    s="$(stat -c %s "$1")"
    cp "$1" "$oci/blobs/sha256/$d"
    echo "$d $s"
}
tar -C "$layer" --numeric-owner -cf "$WORK/layer.tar" .
b="$(blob "$WORK/layer.tar")"; layer_digest="${b% *}"; layer_size="${b#* }"
arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
cat > "$WORK/config.json" <<EOF
{"architecture":"$arch","os":"linux","config":{"Env":["PATH=/bin"],"Cmd":["sh"]},"rootfs":{"type":"layers","diff_ids":["sha256:$layer_digest"]}}
EOF
b="$(blob "$WORK/config.json")"; config_digest="${b% *}"; config_size="${b#* }"
cat > "$WORK/manifest.json" <<EOF
{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:$config_digest","size":$config_size},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:$layer_digest","size":$layer_size}]}
EOF
b="$(blob "$WORK/manifest.json")"; manifest_digest="${b% *}"; manifest_size="${b#* }"
cat > "$oci/index.json" <<EOF
{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:$manifest_digest","size":$manifest_size,"annotations":{"io.containerd.image.name":"$IMAGE","org.opencontainers.image.ref.name":"demo"}}]}
EOF
echo '{"imageLayoutVersion":"1.0.0"}' > "$oci/oci-layout"
tar -C "$oci" -cf "$WORK/image.tar" .

# --- 3. a private containerd ---
cat > "$WORK/containerd.toml" <<EOF
version = 2
root = "$WORK/root"
state = "$WORK/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
EOF
log "starting containerd ($(containerd --version | awk '{print $3}')) with $BIN in PATH"
PATH="$BIN:$PATH" containerd --config "$WORK/containerd.toml" >"$WORK/containerd.log" 2>&1 &
CTRD_PID=$!
for _ in $(seq 1 100); do
    [[ -S "$SOCK" ]] && ctr -a "$SOCK" version >/dev/null 2>&1 && break
    kill -0 "$CTRD_PID" 2>/dev/null || { cat "$WORK/containerd.log" >&2; die "containerd exited"; }
    sleep 0.2
done
ctr -a "$SOCK" version >/dev/null || die "containerd did not answer on $SOCK"

ctr -a "$SOCK" images import --no-unpack=false "$WORK/image.tar" >/dev/null
ctr -a "$SOCK" images ls -q | grep -qx "$IMAGE" || die "the image was not imported"

# --- 4. the container, in a microVM ---
RUNTIME=(--snapshotter native --runtime io.containerd.bulkhead.v2)
log "ctr run --runtime io.containerd.bulkhead.v2 $IMAGE demo ${CMD[*]}"
set +e
ctr -a "$SOCK" run --rm "${RUNTIME[@]}" "$IMAGE" demo "${CMD[@]}"
status=$?
set -e
log "the container exited with status $status (host kernel: $(uname -r))"
if ((status != 0)); then
    log "containerd's log:"
    tail -20 "$WORK/containerd.log" >&2
    exit "$status"
fi
task_status() { ctr -a "$SOCK" task ls | awk -v id="$1" '$1 == id { print $3 }'; }
wait_status() { # ID STATUS: up to 60 s ("" waits for the task to be gone)
    for _ in $(seq 1 300); do
        [[ "$(task_status "$1")" == "$2" ]] && return 0
        sleep 0.2
    done
    return 1
}
# The shim process serving container ID (by /proc: the test host's busybox has no pgrep).
shim_pid() {
    local p
    for p in /proc/[0-9]*; do
        if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- "containerd-shim-bulkhead-v2 .*-id $1 "; then
            echo "${p#/proc/}"
            return 0
        fi
    done
}
# The VMM of the pod whose shim serves container ID: the shim's bulkhead-vmm child (when jailed,
# its supervisor). `ctr task ls` shows the container process's pid in the guest, not this.
vmm_pid() {
    local shim p comm ppid
    shim="$(shim_pid "$1")"
    [[ -n "$shim" ]] || return 0
    for p in /proc/[0-9]*; do
        # /proc/PID/stat: pid (comm) state ppid ...
        read -r _ comm _ ppid _ <"$p/stat" 2>/dev/null || continue
        if [[ "$comm" == "(bulkhead-vmm)" && "$ppid" == "$shim" ]]; then
            echo "${p#/proc/}"
            return 0
        fi
    done
}
# Mounts of container ID's root (the shim's pod roots, <runtime dir>/pods/<pod>/<ID>).
root_mounts() { grep -c "/pods/$1" /proc/mounts || true; }

if ((FAULTS)); then
    # --- 6. faults ---
    log "kill -9 of a running task's VMM"
    # `ctr run` (attached) exits with the task's status, then deletes it (--rm).
    ctr -a "$SOCK" run --rm "${RUNTIME[@]}" "$IMAGE" vmmkill sleep 1000 &
    ctr_pid=$!
    wait_status vmmkill RUNNING || die "the task did not run: $(task_status vmmkill)"
    vmm="$(vmm_pid vmmkill)"
    [[ -n "$vmm" ]] || die "no VMM for vmmkill"
    kill -9 "$vmm"
    set +e
    wait "$ctr_pid"
    status=$?
    set -e
    echo "vmm-kill: status=$status mounts=$(root_mounts vmmkill)"

    log "kill -9 of a running task's shim"
    ctr -a "$SOCK" run -d "${RUNTIME[@]}" "$IMAGE" shimkill sleep 1000
    wait_status shimkill RUNNING || die "the task did not run: $(task_status shimkill)"
    vmm="$(vmm_pid shimkill)"
    shim="$(shim_pid shimkill)"
    [[ -n "$vmm" ]] || die "no VMM for shimkill"
    [[ -n "$shim" ]] || die "no shim process for shimkill"
    kill -9 "$shim"
    # containerd sees the shim's connection close and runs `containerd-shim-bulkhead-v2 delete`.
    gone=""
    for _ in $(seq 1 300); do
        state="$(task_status shimkill)"
        if [[ "$state" != RUNNING ]] && ! kill -0 "$vmm" 2>/dev/null \
            && (($(root_mounts shimkill) == 0)); then
            gone=1
            break
        fi
        sleep 0.2
    done
    vmm_alive=0
    kill -0 "$vmm" 2>/dev/null && vmm_alive=1
    echo "shim-kill: task=${state:-gone} vmm_alive=$vmm_alive mounts=$(root_mounts shimkill)${gone:+ clean}"
    ctr -a "$SOCK" task delete shimkill >/dev/null 2>&1 || true
    ctr -a "$SOCK" container delete shimkill >/dev/null 2>&1 || true
fi
((MORE)) || exit 0

# --- 5. exec, kill, a memory limit ---
log "ctr run -d: a shell that traps SIGTERM"
ctr -a "$SOCK" run -d "${RUNTIME[@]}" "$IMAGE" more \
    sh -c 'trap "exit 143" TERM; touch /trapped; while :; do sleep 1; done'
wait_status more RUNNING || die "the detached task did not run: $(task_status more)"
# PID 1 of a PID namespace ignores SIGTERM until its trap is set: wait for the shell to say so.
for n in $(seq 1 60); do
    ctr -a "$SOCK" task exec --exec-id "probe$n" more test -f /trapped 2>/dev/null && break
    sleep 0.5
done
# Host memory of the pod beside its guest RAM: the shim's and the VMM's resident set (the VMM's
# includes the guest pages touched so far), printed last.
rss_of() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo "?"; }
shim="$(shim_pid more)"
vmm="$(vmm_pid more)"
rss="rss: shim=$(rss_of "${shim:-0}") vmm=$(rss_of "${vmm:-0}") (KiB)"
log "ctr task exec"
set +e
out="$(ctr -a "$SOCK" task exec --exec-id e1 more sh -c 'echo in-exec pid=$$; exit 4')"
exec_status=$?
set -e
echo "exec: status=$exec_status output=$out"
log "ctr task kill (SIGTERM)"
ctr -a "$SOCK" task kill more
if wait_status more STOPPED; then echo "kill: STOPPED"; else echo "kill: $(task_status more)"; fi
ctr -a "$SOCK" task delete more >/dev/null 2>&1 || true
ctr -a "$SOCK" container delete more >/dev/null 2>&1 || true
log "ctr run --memory-limit 64 MiB"
mem="$(ctr -a "$SOCK" run --rm "${RUNTIME[@]}" --memory-limit $((64 << 20)) "$IMAGE" mem \
    grep MemTotal /proc/meminfo)"
echo "memory: $mem"
echo "$rss"

#!/usr/bin/env bash
# containerd runs a container in a bulkhead microVM: `ctr run --runtime io.containerd.bulkhead.v2`.
#
#   scripts/containerd-demo.sh [--bin DIR] [--work DIR] [--tty] [--more] [--faults] [-- CMD...]
#   scripts/containerd-demo.sh [--bin DIR] [--work DIR] --cri -- CLIENT...
#   scripts/containerd-demo.sh [--bin DIR] [--work DIR] --bench N [-- CMD...]
#   (default CMD: uname -r)
#
# What it does, offline (no registry is reached):
#   1. installs Debian's containerd when it is missing (apt-get; needs root);
#   2. builds a small OCI image from busybox-static (one layer, `ctr images import`);
#   3. starts a private containerd (its own root, state and socket under --work; the CRI plugin
#      off) with DIR (default: target/release) first in PATH, so that it finds
#      containerd-shim-bulkhead-v2 there, and mounts cgroup2 at /sys/fs/cgroup if no cgroup
#      hierarchy is mounted (the shim puts each pod's VMM in its container's cgroup);
#   4. runs `ctr run --rm --runtime io.containerd.bulkhead.v2 IMAGE demo CMD...` and prints what
#      the container printed (the guest kernel's release, not the host's) and its exit status;
#      with --tty, `ctr run -t`: the container gets a terminal of this terminal's size (run the
#      script on a terminal);
#   5. with --more: `ctr run -d` of a shell that traps SIGTERM, `ctr task exec` into it (its output
#      and exit status), `ctr task kill` (SIGTERM: the task stops), two detached tasks grouped
#      into one pod VM by the annotation io.kubernetes.cri.sandbox-id of which the first is
#      deleted (after containerd's clean-up for the first, the second still runs and execs:
#      `pod: cleanups=1 second=RUNNING exec=0:pod-b-alive`), and `ctr run --memory-limit`
#      64 MiB (the guest's MemTotal), one line each on stdout (`exec: ...`, `kill: ...`,
#      `memory: ...`), the detached task VMM's cgroup and its memory limit (`cgroup: ...`), a page
#      from busybox httpd in a task whose annotation bulkhead.io/ports=18080:8000 forwards the
#      host's port 18080 to it (`ingress: ...`), a page that a task whose annotation
#      bulkhead.io/allow-cidr=127.0.0.1/32:18081 lets out fetches through its pod's egress proxy
#      from busybox httpd on the host's loopback, and the count of 403 answers for a port no rule
#      names (`egress: PAGE 1`), the detached task's `ctr task metrics` (`metrics: memory=BYTES
#      cpu=NS pids=N`), the resident memory of the first task's shim and VMM (`rss: ...`), and
#      `ctr run --memory-limit` 64 MiB of awk keeping ever more memory, which the guest's OOM
#      killer kills: its exit status and the count of `/tasks/oom` events containerd published
#      for it (`ctr events`; `oom: status=137 events=1`), and last the two-task pod's line;
#   6. with --faults: kill -9 of a running task's VMM (the task exits with status 255, `ctr run`
#      with it; its root is unmounted, its cgroup removed), kill -9 of a running task's shim
#      (containerd runs the shim's `delete`: the task goes, its VMM stops, its root is unmounted
#      and its cgroup removed), and kill -9 of containerd under a running task (a new
#      containerd finds the task through its shim: exec and kill work), one line each on stdout (`vmm-kill: ...`, `shim-kill: ...`, `restart: ...`);
#   7. stops containerd and removes --work (default: a new temporary directory).
# With --cri, containerd's CRI plugin is on instead, with the runtime handler `bulkhead`
# (runtime_type io.containerd.bulkhead.v2, native snapshotter, no CNI: pods need the host's
# network) and a pod sandbox image of its own (docker.io/bulkhead/pause:demo, busybox `sleep`);
# both images are imported in the `k8s.io` namespace, and CLIENT runs in place of steps 4-6 with
# CONTAINER_RUNTIME_ENDPOINT=unix://SOCKET, BULKHEAD_DEMO_IMAGE=IMAGE and
# BULKHEAD_DEMO_SANDBOX_IMAGE=the pause image (e.g. crictl, or
# target/release/bulkhead-cri-check, `cargo build --release -p bulkhead-tests --bin
# bulkhead-cri-check`, which runs two pods); the script exits with its status. Its runtime
# handler passes the pods' `bulkhead.io/*` annotations on to the shim, as docs/kubernetes.md's does.
# With --bench N, steps 4-6 are N rounds of `ctr run --rm ... CMD` and `DIR/bulkhead run -- CMD`
# in turn, each timed from its start to its first line of output, printed as `bench: ctr MS` and
# `bench: run MS` (benches/containerd.rs reads them).
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
CRI=0
BENCH=0
PAUSE="docker.io/bulkhead/pause:demo"
TTY=()

# need_value OPTION VALUE...: fails unless OPTION has a value after it.
need_value() {
    (($# >= 2)) || { echo "containerd-demo: $1 needs a value (see --help)" >&2; exit 2; }
}
while (($#)); do
    case "$1" in
        --bin) need_value "$@"; BIN="$2"; shift 2 ;;
        --work) need_value "$@"; WORK="$2"; shift 2 ;;
        --more) MORE=1; shift ;;
        --tty) TTY=(-t); shift ;;
        --cri) CRI=1; shift ;;
        --bench) need_value "$@"; BENCH="$2"; shift 2 ;;
        --faults) FAULTS=1; shift ;;
        --) shift; CMD=("$@"); break ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
        *) echo "containerd-demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'containerd-demo: %s\n' "$*" >&2; exit 1; }
[[ "$BENCH" =~ ^[0-9]+$ ]] || die "--bench takes a number of rounds, not \"$BENCH\""
if ((CRI && (MORE || FAULTS || BENCH) )) || [[ "$CRI" == 1 && ${#TTY[@]} -gt 0 ]]; then
    die "--cri runs a CRI client instead of the ctr steps: it does not go with --more, --faults, --bench or --tty"
fi
if ((CRI)) && [[ "${CMD[*]}" == "uname -r" ]]; then
    die "--cri needs a CRI client after --, e.g. -- target/release/bulkhead-cri-check"
fi

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
        # Tasks a failed step left running: their shims and VMMs would outlive the script.
        for ns in default k8s.io; do
            for t in $(ctr -a "$SOCK" -n "$ns" task ls -q 2>/dev/null); do
                ctr -a "$SOCK" -n "$ns" task kill -s SIGKILL "$t" >/dev/null 2>&1 || true
                ctr -a "$SOCK" -n "$ns" task delete -f "$t" >/dev/null 2>&1 || true
            done
        done
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
case "$(uname -m)" in # the image's architecture is this machine's, named as OCI names it
    x86_64) arch=amd64 ;;
    aarch64) arch=arm64 ;;
    *) arch="$(uname -m)" ;;
esac
manifest() { # NAME REF CMD_JSON -> prints the image's index entry; stores its config and manifest
    local b config_digest config_size
    cat > "$WORK/config-$2.json" <<EOF
{"architecture":"$arch","os":"linux","config":{"Env":["PATH=/bin"],"Cmd":$3},"rootfs":{"type":"layers","diff_ids":["sha256:$layer_digest"]}}
EOF
    b="$(blob "$WORK/config-$2.json")"; config_digest="${b% *}"; config_size="${b#* }"
    cat > "$WORK/manifest-$2.json" <<EOF
{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:$config_digest","size":$config_size},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:$layer_digest","size":$layer_size}]}
EOF
    b="$(blob "$WORK/manifest-$2.json")"
    printf '{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}' \
        "${b% *}" "${b#* }" "$1" "$2"
}
# The demo image, and a pod sandbox ("pause") image whose process only waits.
entries="$(manifest "$IMAGE" demo '["sh"]'),$(manifest "$PAUSE" pause '["sleep","2147483647"]')"
echo "{\"schemaVersion\":2,\"manifests\":[$entries]}" > "$oci/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' > "$oci/oci-layout"
tar -C "$oci" -cf "$WORK/image.tar" .

# --- 3. a private containerd ---
if ((CRI)); then
    mkdir -p "$WORK/cni/bin" "$WORK/cni/net.d"
    cri_config="[plugins.\"io.containerd.grpc.v1.cri\"]
  sandbox_image = \"$PAUSE\"
  stream_server_address = \"127.0.0.1\"
  stream_server_port = \"0\"
  [plugins.\"io.containerd.grpc.v1.cri\".containerd]
    snapshotter = \"native\"
    default_runtime_name = \"bulkhead\"
    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.bulkhead]
      runtime_type = \"io.containerd.bulkhead.v2\"
      pod_annotations = [\"bulkhead.io/*\"]
  [plugins.\"io.containerd.grpc.v1.cri\".cni]
    bin_dir = \"$WORK/cni/bin\"
    conf_dir = \"$WORK/cni/net.d\""
else
    cri_config='disabled_plugins = ["io.containerd.grpc.v1.cri"]'
fi
cat > "$WORK/containerd.toml" <<EOF
version = 2
root = "$WORK/root"
state = "$WORK/state"
$cri_config
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
EOF
# The shim puts a pod's VMM in the cgroup the container's spec names (ctr: /default/ID); mount
# cgroup2 where a host has none (the nested test host mounts it at boot).
if [[ ! -e /sys/fs/cgroup/cgroup.controllers && ! -d /sys/fs/cgroup/memory ]]; then
    log "mounting cgroup2 at /sys/fs/cgroup (none was mounted)"
    mount -t cgroup2 none /sys/fs/cgroup
fi
start_containerd() {
    log "starting containerd ($(containerd --version | awk '{print $3}')) with $BIN in PATH"
    # Its stdio is its log, not this script's (which may be a terminal held open by it).
    PATH="$BIN:$PATH" containerd --config "$WORK/containerd.toml" \
        </dev/null >>"$WORK/containerd.log" 2>&1 &
    CTRD_PID=$!
    for _ in $(seq 1 100); do
        [[ -S "$SOCK" ]] && ctr -a "$SOCK" version >/dev/null 2>&1 && break
        kill -0 "$CTRD_PID" 2>/dev/null || { cat "$WORK/containerd.log" >&2; die "containerd exited"; }
        sleep 0.2
    done
    ctr -a "$SOCK" version >/dev/null || die "containerd did not answer on $SOCK"
}
start_containerd

if ((CRI)); then
    # A host-network pod gets copies of the host's /etc/hosts and /etc/resolv.conf; the nested
    # test host has neither.
    for f in /etc/hosts /etc/resolv.conf; do
        if [[ ! -e "$f" ]]; then
            log "creating $f (there is none)"
            case "$f" in
                /etc/hosts) echo "127.0.0.1 localhost" > "$f" ;;
                *) : > "$f" ;;
            esac
        fi
    done
    # The CRI plugin's images live in the k8s.io namespace, unpacked for its snapshotter.
    ctr -a "$SOCK" -n k8s.io images import --snapshotter native "$WORK/image.tar" >/dev/null
    ctr -a "$SOCK" -n k8s.io images ls -q | grep -x "$PAUSE" >/dev/null || die "the images were not imported"
    log "CRI on unix://$SOCK (handler bulkhead): ${CMD[*]}"
    set +e
    CONTAINER_RUNTIME_ENDPOINT="unix://$SOCK" BULKHEAD_DEMO_IMAGE="$IMAGE" \
        BULKHEAD_DEMO_SANDBOX_IMAGE="$PAUSE" "${CMD[@]}"
    status=$?
    set -e
    if ((status != 0)); then
        log "containerd's log:"
        tail -30 "$WORK/containerd.log" >&2
    fi
    exit "$status"
fi

ctr -a "$SOCK" images import --no-unpack=false "$WORK/image.tar" >/dev/null
ctr -a "$SOCK" images ls -q | grep -x "$IMAGE" >/dev/null || die "the image was not imported"

# --- 4. the container, in a microVM ---
RUNTIME=(--snapshotter native --runtime io.containerd.bulkhead.v2)

if ((BENCH)); then
    # --- bench: time to first output, `ctr run` beside `bulkhead run`, alternating ---
    now_ms() { local t="${EPOCHREALTIME/./}"; echo $((t / 1000)); }
    first_line_ms() { # CMD... -> ms from its start to its first line of output ("x": none)
        local t0
        t0="$(now_ms)"
        "$@" 2>/dev/null | { if read -r _; then echo $(($(now_ms) - t0)); else echo x; fi; cat >/dev/null; }
    }
    log "$BENCH rounds: ctr run --rm ${CMD[*]}, then bulkhead run -- ${CMD[*]}"
    for i in $(seq 1 "$BENCH"); do
        echo "bench: ctr $(first_line_ms ctr -a "$SOCK" run --rm "${RUNTIME[@]}" "$IMAGE" "bench$i" "${CMD[@]}")"
        echo "bench: run $(first_line_ms "$BIN/bulkhead" run -- "${CMD[@]}")"
    done
    exit 0
fi
log "ctr run ${TTY[*]} --runtime io.containerd.bulkhead.v2 $IMAGE demo ${CMD[*]}"
set +e
ctr -a "$SOCK" run --rm "${TTY[@]}" "${RUNTIME[@]}" "$IMAGE" demo "${CMD[@]}"
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
        if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -- "containerd-shim-bulkhead-v2 .*-id $1 " >/dev/null; then
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
# 1 while the cgroup `ctr run` names for container ID (/default/ID) exists.
cgroup_left() {
    if [[ -d "/sys/fs/cgroup/default/$1" || -d "/sys/fs/cgroup/memory/default/$1" ]]; then
        echo 1
    else
        echo 0
    fi
}

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
    echo "vmm-kill: status=$status mounts=$(root_mounts vmmkill) cgroup=$(cgroup_left vmmkill)"

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
            && (($(root_mounts shimkill) == 0)) && (($(cgroup_left shimkill) == 0)); then
            gone=1
            break
        fi
        sleep 0.2
    done
    vmm_alive=0
    kill -0 "$vmm" 2>/dev/null && vmm_alive=1
    echo "shim-kill: task=${state:-gone} vmm_alive=$vmm_alive mounts=$(root_mounts shimkill)" \
        "cgroup=$(cgroup_left shimkill)${gone:+ clean}"
    ctr -a "$SOCK" task delete shimkill >/dev/null 2>&1 || true
    ctr -a "$SOCK" container delete shimkill >/dev/null 2>&1 || true

    log "kill -9 of containerd under a running task, then a new containerd"
    ctr -a "$SOCK" run -d "${RUNTIME[@]}" "$IMAGE" survivor sleep 1000
    wait_status survivor RUNNING || die "the task did not run: $(task_status survivor)"
    shim="$(shim_pid survivor)"
    kill -9 "$CTRD_PID"
    wait "$CTRD_PID" 2>/dev/null || true
    CTRD_PID=""
    start_containerd
    # The new containerd reads the task's shim address from its state and connects to it.
    state="$(task_status survivor)"
    set +e
    out="$(ctr -a "$SOCK" task exec --exec-id after survivor sh -c 'echo reconnected; exit 5')"
    exec_status=$?
    set -e
    same_shim=0
    [[ -n "$shim" && "$(shim_pid survivor)" == "$shim" ]] && same_shim=1
    ctr -a "$SOCK" task kill -s SIGKILL survivor
    stopped="$(wait_status survivor STOPPED && echo STOPPED || task_status survivor)"
    echo "restart: task=${state:-gone} same_shim=$same_shim exec=$exec_status:$out kill=$stopped"
    ctr -a "$SOCK" task delete survivor >/dev/null 2>&1 || true
    ctr -a "$SOCK" container delete survivor >/dev/null 2>&1 || true
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
# The VMM's cgroup (v2: the `0::` line; v1: the memory hierarchy's) and its memory limit.
vmm_cgroup="$({ grep -E '^0::|:memory:' "/proc/${vmm:-0}/cgroup" 2>/dev/null || true; } | head -1 | cut -d: -f3)"
# `ctr task metrics`: the pod VM's usage as its host cgroup counts it (the shim's Stats).
metrics="$(ctr -a "$SOCK" task metrics more 2>/dev/null | awk '
    $1 == "memory.usage_in_bytes" { m = $2 } $1 == "cpuacct.usage" { c = $2 }
    $1 == "pids.current" { p = $2 }
    END { print "metrics: memory=" m " cpu=" c " pids=" p }')" || true
limit="$({ cat "/sys/fs/cgroup$vmm_cgroup/memory.max" \
    "/sys/fs/cgroup/memory$vmm_cgroup/memory.limit_in_bytes" 2>/dev/null || true; } | head -1)"
cgroup_line="cgroup: ${vmm_cgroup:-none} memory=${limit:-none}"
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

log "two tasks in one pod (io.kubernetes.cri.sandbox-id, one VM): the first one deleted"
pod=(--annotation io.kubernetes.cri.sandbox-id=demo-pod)
cleanups() { grep -c 'cleaning up dead shim' "$WORK/containerd.log" || true; }
shim_deletes() { # running `containerd-shim-bulkhead-v2 ... delete` processes
    local p n=0
    for p in /proc/[0-9]*; do
        tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -- "containerd-shim-bulkhead-v2 .* delete" >/dev/null && n=$((n + 1))
    done
    echo "$n"
}
cleanups_before="$(cleanups)"
for c in pod-a pod-b; do
    ctr -a "$SOCK" run -d "${RUNTIME[@]}" "${pod[@]}" "$IMAGE" "$c" sleep 600
    wait_status "$c" RUNNING || die "pod task $c did not run: $(task_status "$c")"
done
ctr -a "$SOCK" task kill -s SIGKILL pod-a
wait_status pod-a STOPPED || true
ctr -a "$SOCK" task delete pod-a >/dev/null 2>&1 || true
ctr -a "$SOCK" container delete pod-a >/dev/null 2>&1 || true
# containerd takes the closed connection of pod-a's task for a dead shim: it logs "cleaning up
# dead shim" and runs the shim's `delete` for pod-a (which took the pod VM's cgroup, and the VM,
# down before 2026-12-06). Wait for that line, then until no `delete` runs (a second at least:
# it starts right after the line).
for _ in $(seq 1 300); do
    (($(cleanups) > cleanups_before)) && break
    sleep 0.2
done
for n in $(seq 1 100); do
    ((n > 5)) && [[ "$(shim_deletes)" == 0 ]] && break
    sleep 0.2
done
set +e
out="$(ctr -a "$SOCK" task exec --exec-id p1 pod-b echo pod-b-alive 2>&1)"
pod_status=$?
set -e
# Printed last, after the other steps' lines.
pod_line="pod: cleanups=$(($(cleanups) - cleanups_before)) second=$(task_status pod-b) exec=$pod_status:$out"
ctr -a "$SOCK" task kill -s SIGKILL pod-b
wait_status pod-b STOPPED || true
ctr -a "$SOCK" task delete pod-b >/dev/null 2>&1 || true
ctr -a "$SOCK" container delete pod-b >/dev/null 2>&1 || true
log "ctr run --memory-limit 64 MiB"
mem="$(ctr -a "$SOCK" run --rm "${RUNTIME[@]}" --memory-limit $((64 << 20)) "$IMAGE" mem \
    grep MemTotal /proc/meminfo)"
echo "memory: $mem"
echo "$cgroup_line"

log "ctr run -d --annotation bulkhead.io/ports=18080:8000: busybox httpd in the microVM"
ctr -a "$SOCK" run -d "${RUNTIME[@]}" --annotation bulkhead.io/ports=18080:8000 "$IMAGE" web \
    sh -c 'mkdir -p /www && echo hello-ingress > /www/index.html && exec httpd -f -p 8000 -h /www'
wait_status web RUNNING || die "the web task did not run: $(task_status web)"
# GET PATH from 127.0.0.1:PORT with bash's /dev/tcp: the reply's last line (the page).
http_get() {
    local reply
    reply="$({ exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET %s HTTP/1.0\r\n\r\n' "$2" >&3 \
        && cat <&3; } 2>/dev/null)" || return 1
    [[ -n "$reply" ]] || return 1
    printf '%s\n' "$reply" | tail -1 | tr -d '\r'
}
page=""
for _ in $(seq 1 300); do
    page="$(http_get 18080 /index.html)" && break
    sleep 0.2
done
echo "ingress: ${page:-nothing}"
ctr -a "$SOCK" task kill -s SIGKILL web
wait_status web STOPPED || true
ctr -a "$SOCK" task delete web >/dev/null 2>&1 || true
ctr -a "$SOCK" container delete web >/dev/null 2>&1 || true

log "ctr run --annotation bulkhead.io/allow-cidr=127.0.0.1/32:18081: egress through the pod's proxy"
mkdir -p "$WORK/www" && echo hello-egress >"$WORK/www/hello.txt"
busybox httpd -f -p 127.0.0.1:18081 -h "$WORK/www" &
httpd_pid=$!
# The allowed page, then the proxy's 403 for a port no rule names (busybox wget uses http_proxy).
egress="$(ctr -a "$SOCK" run --rm "${RUNTIME[@]}" \
    --annotation bulkhead.io/allow-cidr=127.0.0.1/32:18081 "$IMAGE" net sh -c \
    'wget -q -O - http://127.0.0.1:18081/hello.txt; wget -q -O - http://127.0.0.1:18082/ 2>&1 | grep -c 403')" || true
kill "$httpd_pid" 2>/dev/null || true
wait "$httpd_pid" 2>/dev/null || true
echo "egress:" $egress

log "ctr run --memory-limit 64 MiB of a process that outgrows it: /tasks/oom"
ctr -a "$SOCK" events >"$WORK/events" 2>/dev/null &
events_pid=$!
sleep 0.5
set +e
ctr -a "$SOCK" run --rm "${RUNTIME[@]}" --memory-limit $((64 << 20)) "$IMAGE" oom \
    awk 'BEGIN { s = "x"; for (i = 0; i < 20; i++) s = s s; while (1) a[n++] = s n }' \
    >/dev/null 2>&1
oom_status=$?
set -e
sleep 0.5
kill "$events_pid" 2>/dev/null || true
wait "$events_pid" 2>/dev/null || true
oom_events="$(grep '/tasks/oom' "$WORK/events" | grep -c '"container_id":"oom"' || true)"

echo "$metrics"
echo "$rss"
echo "oom: status=$oom_status events=$oom_events"
echo "$pod_line"

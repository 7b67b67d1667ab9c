#!/usr/bin/env bash
# Runs every bulkhead test: formatting, lints, unit tests (the Python SDK's too), the
# guest-level integration tests (which boot real guests, inside the nested test host when this
# host's KVM cannot), the aarch64 checklist in an emulated arm64 host (GUEST=run
# scripts/arm64-smoke.sh), and 60 s of fuzzing per fuzz target (needs the nightly toolchain,
# installed when missing).
# Exits non-zero when anything fails.
#
# At the end (also after a failure) it prints how long each stage took, and what the guest
# tests' boots came to: guests booted, guests that crashed or showed a kernel panic, test retries
# by cause, and the tests that passed only on their retry (docs/testhost.md, "Known problems").
#
# Tests that need root are named `..._needs_root`: as root (CI) they run; otherwise they are
# skipped with `--skip needs_root` and listed. `#[ignore]`d tests are listed with their reasons.
#
# A clone without target/ (CI's clean clone) builds into a persistent cache instead:
# target/ and fuzz/target/ become links to ${XDG_CACHE_HOME:-~/.cache}/bulkhead/target/{main,fuzz},
# so the dependencies are not rebuilt on every clone (only the workspace's own crates, whose
# sources are new to cargo). BULKHEAD_TARGET_CACHE=DIR picks another cache directory,
# BULKHEAD_TARGET_CACHE=none turns this off; the cache is emptied when it has grown past
# BULKHEAD_TARGET_CACHE_GIB (default 40), or when its file system has less than
# BULKHEAD_MIN_FREE_GIB (default 15) free after its stale parts (incremental state, test
# executables not run for a day) are gone: a full disk fails builds and tests in ways that look
# like bugs (a scratch disk "larger than the free space"). Runs that share a cache take turns (a lock), so that
# one clone's tests never run another clone's binaries. An existing target/ is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '==> %s\n' "$*" >&2; }

# The persistent target directory (see above).
use_target_cache() {
    local cache="${BULKHEAD_TARGET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/bulkhead/target}"
    [[ "$cache" != none ]] || return 0
    if [[ ! -e target && ! -L target ]]; then
        mkdir -p "$cache/main" "$cache/fuzz"
        ln -s "$cache/main" target
        [[ -e fuzz/target || -L fuzz/target ]] || ln -s "$cache/fuzz" fuzz/target
        log "target/ -> $cache/main (a persistent cache; BULKHEAD_TARGET_CACHE=none turns it off)"
    fi
    [[ -L target && "$(readlink target)" == "$cache/main" ]] || return 0
    exec 9>"$cache/.lock"
    flock -n 9 || { log "waiting for another scripts/test.sh that uses $cache"; flock 9; }
    prune_target_cache "$cache"
    local gib used min_free free
    gib="${BULKHEAD_TARGET_CACHE_GIB:-40}"
    min_free="${BULKHEAD_MIN_FREE_GIB:-15}"
    used="$(du -s --block-size=1G "$cache" | cut -f1)"
    free="$(free_gib "$cache")"
    if ((used > gib || free < min_free)); then
        log "the target cache holds $used GiB (limit $gib), $free GiB free (at least $min_free): emptying it"
        rm -rf "${cache:?}/main" "${cache:?}/fuzz"
        mkdir -p "$cache/main" "$cache/fuzz"
    fi
}

# free_gib DIR: GiB free for unprivileged users on DIR's file system.
free_gib() { df --output=avail --block-size=1G "$1" | tail -n 1 | tr -d ' '; }

# prune_target_cache DIR: removes what a later build does not need: incremental state (CI builds
# each commit's crates once) and test executables not modified for a day (older commits' tests).
prune_target_cache() {
    find "$1" -maxdepth 6 -type d -name incremental -prune -exec rm -rf {} +
    find "$1" -maxdepth 6 -path '*/deps/*' -type f ! -name '*.*' -mtime +0 -delete
}
use_target_cache
# One build per commit: incremental state would only fill the disk.
export CARGO_INCREMENTAL=0
if (($(free_gib .) < ${BULKHEAD_MIN_FREE_GIB:-15})); then
    log "warning: only $(free_gib .) GiB free here; builds and the tests' disks may fail"
fi

TIMES="$(mktemp)"
TEST_LOG="$(mktemp)"
# The summary never changes the exit status: a pipe in it that ends early (SIGPIPE, 141) under
# `set -e` would otherwise turn a passing run into a failing one.
trap 'rc=$?; set +e; summary; rm -f "$TIMES" "$TEST_LOG"; exit "$rc"' EXIT
START=$SECONDS

# stage NAME COMMAND...: runs COMMAND, logging NAME first and its wall time in the summary.
stage() {
    local name=$1 began=$SECONDS status=0
    shift
    log "$name"
    "$@" || status=$?
    printf '%s\t%s\t%s\n' "$((SECONDS - began))" "$status" "$name" >>"$TIMES"
    return "$status"
}

# The summary: the stage table and the guest-boot counters of the test log.
summary() {
    echo
    echo "==> stages (wall seconds)"
    awk -F'\t' '{ printf "%6d s  %-6s %s\n", $1, ($2 == 0 ? "ok" : "FAILED"), $3 }' "$TIMES"
    printf '%6d s  total\n' "$((SECONDS - START))"
    [[ -s "$TEST_LOG" ]] || return 0
    echo "==> test binaries that took 5 s or more (cargo test; the guest tests boot real guests)"
    awk '
        /^ *Running / { cur = $2; if (!(cur in secs)) order[++n] = cur; secs[cur] += 0 }
        /^test result: / && cur != "" && match($0, /finished in [0-9.]+s/) {
            s = substr($0, RSTART + 12, RLENGTH - 13) + 0
            if (s > secs[cur]) secs[cur] = s
        }
        END { for (i = 1; i <= n; i++) if (secs[order[i]] >= 5) printf "%6d s  %s\n", secs[order[i]], order[i] }
    ' "$TEST_LOG"
    echo "==> the slowest guest tests (wall seconds in the test host, retries and its boot included)"
    awk '/^guest boots: / && match($0, / in [^ ]+ \([0-9.]+ s\)/) {
            split(substr($0, RSTART + 4, RLENGTH - 4), p, " ")
            printf "%6d s  %s\n", substr(p[2], 2) + 0.5, p[1]
        }' "$TEST_LOG" | sort -rn | awk 'NR <= 15'
    echo "==> guest boots (cargo test)"
    awk '
        /^guest boots: / {
            boots += $3
            if (match($0, /\([0-9]+ crashed\)/)) crashed += substr($0, RSTART + 1, RLENGTH - 10) + 0
            if (match($0, /longest heartbeat gap [0-9.]+ s/)) {
                gap = substr($0, RSTART + 22, RLENGTH - 24) + 0
                if (gap > longest) longest = gap
            }
        }
        /^RETRY: / { name = $0; sub(/.*"--exact", "/, "", name); sub(/".*/, "", name); retried[name] = 1 }
        /^RETRY: a nested guest / { crash_retry++ }
        /^RETRY: the test host failed/ { if ($0 ~ /timed out/) hang_retry++; else host_retry++ }
        /^test .* \.\.\. ok$/ { passed[$2] = 1 }
        END {
            printf "  guests booted: %d; guests that crashed or showed a kernel panic: %d\n", boots, crashed
            printf "  longest heartbeat gap of a live test host: %.1f s (one comes every 10 s)\n", longest
            printf "  retries: %d after a guest that crashed or never became ready, %d after a hung test, %d after a dead test host\n", crash_retry, hang_retry, host_retry
            n = 0
            for (t in retried) if (t in passed) { printf "  passed only on retry: %s\n", t; n++ }
            if (n == 0) print "  passed only on retry: none"
        }' "$TEST_LOG"
}

# --skip needs_root when not root, with the list of what that skips.
SKIP_ROOT=()
if [[ "$(id -u)" -ne 0 ]]; then
    SKIP_ROOT=(--skip needs_root)
fi

stage "set-up: packages, Rust targets, guest kernel (scripts/setup.sh --deps-only)" \
    scripts/setup.sh --deps-only
stage "cargo fmt --check" cargo fmt --all --check
stage "cargo clippy" cargo clippy --workspace --all-targets --quiet -- -D warnings
stage "cargo clippy for aarch64 (every crate, tests included)" \
    cargo clippy --workspace --target aarch64-unknown-linux-gnu --all-targets --quiet -- -D warnings
stage "guest test binaries (static, musl)" \
    cargo build --release --quiet --target x86_64-unknown-linux-musl -p bulkhead-agent -p bulkhead-test-init
stage "host binaries the guest tests drive (bulkhead-vmm, bulkhead, bulkheadd)" \
    cargo build --workspace --bins --quiet
# Every #[ignore]d test with its reason and, when not root, every *_needs_root test.
list_skipped() {
    find crates tests -name '*.rs' -print0 | xargs -0 awk '
        /#\[ignore/ { reason = $0; sub(/.*#\[ignore( = )?/, "", reason); sub(/\]$/, "", reason); pending = 1; next }
        pending && match($0, /fn [a-z0-9_]+/) {
            printf "    ignored: %s: %s\n", substr($0, RSTART + 3, RLENGTH - 3), reason
            pending = 0
        }'
    if ((${#SKIP_ROOT[@]})); then
        grep -rho --include='*.rs' 'fn [a-z0-9_]*_needs_root' crates tests | sed 's/^fn /    not root: /'
    fi
}
stage "tests skipped here" list_skipped
# The Python SDK's unit tests (a fake daemon; its integration suite against real VMs is one of
# the daemon's guest tests, run by cargo test below).
stage "Python SDK unit tests (sdk/python)" \
    env PYTHONPATH=sdk/python/src:sdk/python PYTHONDONTWRITEBYTECODE=1 \
    python3 -m unittest discover --quiet -s sdk/python/tests -t sdk/python
# Four tests at a time: the guest-level tests run in one test host per CPU (one test host keeps
# about one core busy, however many guests run in it), two tests in each.
run_tests() {
    cargo test --workspace --no-fail-fast -- --test-threads="${BULKHEAD_TEST_THREADS:-4}" \
        "${SKIP_ROOT[@]}" 2>&1 | tee "$TEST_LOG"
    return "${PIPESTATUS[0]}"
}
stage "cargo test (unit, doc and integration tests)" run_tests
fuzz_checks() {
    cargo fmt --manifest-path fuzz/Cargo.toml --check &&
        cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --quiet -- -D warnings &&
        cargo test --manifest-path fuzz/Cargo.toml --quiet
}
stage "fuzz harnesses: fmt, clippy, corpus replay (fuzz/ is its own workspace)" fuzz_checks
stage "aarch64: boot, bad-kernel, bulkhead run, disk, virtio-fs, egress, -p, template, daemon and containerd checks in an emulated arm64 host (scripts/arm64-smoke.sh)" \
    env GUEST=run scripts/arm64-smoke.sh
fuzzing() {
    cargo +nightly --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
    scripts/fuzz.sh --seconds "${FUZZ_SECONDS:-60}"
}
stage "fuzzing: every target for ${FUZZ_SECONDS:-60} s (docs/fuzzing.md)" fuzzing
log "all tests passed"

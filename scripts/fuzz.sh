#!/usr/bin/env bash
# Builds and runs the cargo-fuzz targets in fuzz/ (libFuzzer).
#
#   scripts/fuzz.sh [--seconds N] [--jobs J] [--sanitizer address|none] [--keep-corpus] [TARGET...]
#
# Default: every target, 60 s each, AddressSanitizer, as many targets at a time as there are
# CPUs (--jobs). Each run starts from a copy of the committed seeds (fuzz/corpus/TARGET) in
# fuzz/target/fuzz-work/TARGET/corpus, so the committed corpus never grows; --keep-corpus
# continues from the previous run's work corpus instead (for long runs in several sittings).
# Installs cargo-fuzz when it is missing; needs the nightly toolchain. Prints one summary line
# per target and exits non-zero when any target found a crash, a hang (a single input running
# > 10 s) or an out-of-memory. Reproducers are in fuzz/artifacts/TARGET/; docs/fuzzing.md says
# how to replay one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FUZZ="$ROOT/fuzz"
WORK="$FUZZ/target/fuzz-work"
ALL_TARGETS=(virtio_blk vsock virtio_mmio virtio_fs agent_frames boot_params snapshot_state archive_unpack)
log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'fuzz.sh: %s\n' "$*" >&2; exit 2; }

seconds=60
jobs=$(nproc 2>/dev/null || echo 1)
sanitizer=address
keep=0
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) [ $# -ge 2 ] || die "--seconds needs a value"; seconds="$2"; shift 2 ;;
        --sanitizer) [ $# -ge 2 ] || die "--sanitizer needs a value"; sanitizer="$2"; shift 2 ;;
        --keep-corpus) keep=1; shift ;;
        --jobs) [ $# -ge 2 ] || die "--jobs needs a value"; jobs="$2"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1" ;;
        *) targets+=("$1"); shift ;;
    esac
done
case "$seconds" in ''|*[!0-9]*) die "--seconds wants a whole number, got '$seconds'" ;; esac
case "$jobs" in ''|*[!0-9]*|0) die "--jobs wants a positive whole number, got '$jobs'" ;; esac
[ ${#targets[@]} -gt 0 ] || targets=("${ALL_TARGETS[@]}")
for t in "${targets[@]}"; do
    [ -d "$FUZZ/corpus/$t" ] || die "unknown target '$t' (targets: ${ALL_TARGETS[*]})"
done

cargo +nightly --version >/dev/null 2>&1 \
    || die "the nightly toolchain is missing (cargo-fuzz needs it): rustup toolchain install nightly"
if ! cargo fuzz --version >/dev/null 2>&1; then
    log "installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

cd "$FUZZ"
log "building the fuzz targets (sanitizer: $sanitizer)"
if [ ${#targets[@]} = 1 ]; then
    cargo +nightly fuzz build -s "$sanitizer" "${targets[0]}"
else
    cargo +nightly fuzz build -s "$sanitizer"
fi

# Fuzzes target $1 for $seconds s; writes its summary line to WORK/$1/summary; status 1 when the
# fuzzer found something.
fuzz_one() {
    local t="$1" dir="$WORK/$1" status execs rate cov corpus result artifact kind
    mkdir -p "$dir"
    if [ "$keep" = 0 ] || [ ! -d "$dir/corpus" ]; then
        rm -rf "$dir/corpus"
        cp -r "$FUZZ/corpus/$t" "$dir/corpus"
    fi
    log "fuzzing $t for $seconds s (log: $dir/log)"
    set +e
    cargo +nightly fuzz run -s "$sanitizer" "$t" "$dir/corpus" -- \
        -max_total_time="$seconds" -timeout=10 -max_len=16384 -print_final_stats=1 \
        >"$dir/log" 2>&1
    status=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -n1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/log" | tail -n1)
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$dir/log" | tail -n1)
    corpus=$(find "$dir/corpus" -type f | wc -l)
    if [ "$status" = 0 ]; then
        result=ok
    else
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$dir/log" | tail -n1)
        kind=$(grep -o -m1 -E 'deadly signal|timeout|out-of-memory|AddressSanitizer: [a-z-]*|panicked' \
            "$dir/log" || true)
        result="FAILED (exit $status${kind:+, $kind}${artifact:+, reproducer $artifact})"
        tail -n 40 "$dir/log" >&2
    fi
    printf 'fuzz: %-13s %5s s %10s execs %6s exec/s  %-20s corpus %4s  %s\n' \
        "$t" "$seconds" "${execs:-?}" "${rate:-?}" "${cov:-cov: ?}" "$corpus" "$result" \
        >"$dir/summary"
    [ "$status" = 0 ]
}

# Run up to $jobs targets at a time (each fuzzer is one process on one core); the verdicts come
# from the summary files, written last by each run.
for t in "${targets[@]}"; do
    rm -f "$WORK/$t/summary"
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
        wait -n || true
    done
    fuzz_one "$t" &
done
wait || true
failed=0
for t in "${targets[@]}"; do
    if [ -f "$WORK/$t/summary" ]; then
        cat "$WORK/$t/summary"
        grep -q ' ok$' "$WORK/$t/summary" || failed=1
    else
        printf 'fuzz: %-13s FAILED (the run ended without a summary)\n' "$t"
        failed=1
    fi
done
exit "$failed"

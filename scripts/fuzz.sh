#!/usr/bin/env bash
# Builds and runs the cargo-fuzz targets in fuzz/ (libFuzzer), one after the other.
#
#   scripts/fuzz.sh [--seconds N] [--sanitizer address|none] [--keep-corpus] [TARGET...]
#
# Default: every target, 60 s each, AddressSanitizer. Each run starts from a copy of the
# committed seeds (fuzz/corpus/TARGET) in fuzz/target/fuzz-work/TARGET/corpus, so the
# committed corpus never grows; --keep-corpus continues from the previous run's work corpus
# instead (for long runs in several sittings). Installs cargo-fuzz when it is missing; needs the
# nightly toolchain. Prints one summary line per target and exits non-zero when any target
# found a crash, a hang (a single input running > 10 s) or an out-of-memory. Reproducers are in
# fuzz/artifacts/TARGET/; docs/fuzzing.md says how to replay one.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FUZZ="$ROOT/fuzz"
WORK="$FUZZ/target/fuzz-work"
ALL_TARGETS=(virtio_blk vsock virtio_mmio virtio_fs agent_frames)
log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'fuzz.sh: %s\n' "$*" >&2; exit 2; }

seconds=60
sanitizer=address
keep=0
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        --seconds) [ $# -ge 2 ] || die "--seconds needs a value"; seconds="$2"; shift 2 ;;
        --sanitizer) [ $# -ge 2 ] || die "--sanitizer needs a value"; sanitizer="$2"; shift 2 ;;
        --keep-corpus) keep=1; shift ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1" ;;
        *) targets+=("$1"); shift ;;
    esac
done
case "$seconds" in ''|*[!0-9]*) die "--seconds wants a whole number, got '$seconds'" ;; esac
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

failed=0
summary=()
for t in "${targets[@]}"; do
    dir="$WORK/$t"
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
        failed=1
        artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$dir/log" | tail -n1)
        kind=$(grep -o -m1 -E 'deadly signal|timeout|out-of-memory|AddressSanitizer: [a-z-]*|panicked' \
            "$dir/log" || true)
        result="FAILED (exit $status${kind:+, $kind}${artifact:+, reproducer $artifact})"
        tail -n 40 "$dir/log" >&2
    fi
    summary+=("$(printf 'fuzz: %-13s %5s s %10s execs %6s exec/s  %-20s corpus %4s  %s' \
        "$t" "$seconds" "${execs:-?}" "${rate:-?}" "${cov:-cov: ?}" "$corpus" "$result")")
done
printf '%s\n' "${summary[@]}"
exit "$failed"

#!/usr/bin/env bash
# Runs every bulkhead test: formatting, lints, unit tests, the guest-level integration tests
# (which boot real guests, inside the nested test host when this host's KVM cannot), the aarch64
# checklist in an emulated arm64 host (GUEST=run scripts/arm64-smoke.sh), and 60 s of
# fuzzing per fuzz target (needs the nightly toolchain, installed when missing).
# Exits non-zero when anything fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
log() { printf '==> %s\n' "$*" >&2; }

scripts/setup.sh --no-run
log "cargo fmt --check"
cargo fmt --all --check
log "cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
log "cargo clippy for aarch64 (every crate, tests included)"
cargo clippy --workspace --target aarch64-unknown-linux-gnu --all-targets --quiet -- -D warnings
log "guest test binaries (static, musl)"
cargo build --release --quiet --target x86_64-unknown-linux-musl -p bulkhead-agent -p bulkhead-test-init
log "host binaries the guest tests drive (bulkhead-vmm, bulkhead, bulkheadd)"
cargo build --workspace --bins --quiet
log "cargo test (unit, doc and integration tests)"
cargo test --workspace --no-fail-fast
log "fuzz harnesses: fmt, clippy, corpus replay (fuzz/ is its own workspace)"
cargo fmt --manifest-path fuzz/Cargo.toml --check
cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --quiet -- -D warnings
cargo test --manifest-path fuzz/Cargo.toml --quiet
log "aarch64: boot, bad-kernel, bulkhead run, disk and virtio-fs checks in an emulated arm64 host (scripts/arm64-smoke.sh)"
GUEST=run scripts/arm64-smoke.sh
log "fuzzing: every target for 60 s (docs/fuzzing.md)"
cargo +nightly --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
scripts/fuzz.sh --seconds 60
log "all tests passed"

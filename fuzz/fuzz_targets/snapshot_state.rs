//! cargo-fuzz target `snapshot_state`: see `bulkhead_fuzz::targets::snapshot` for the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::snapshot::run(data));

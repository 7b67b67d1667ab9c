//! cargo-fuzz target `vsock`: see `bulkhead_fuzz::targets::vsock` for the input format and
//! the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::vsock::run(data));

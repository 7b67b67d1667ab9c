//! cargo-fuzz target `boot_params`: see `bulkhead_fuzz::targets::boot` for the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::boot::run(data));

//! cargo-fuzz target `archive_unpack`: see `bulkhead_fuzz::targets::archive` for the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::archive::run(data));

//! cargo-fuzz target `virtio_fs`: see `bulkhead_fuzz::targets::fs` for the input format and
//! the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::fs::run(data));

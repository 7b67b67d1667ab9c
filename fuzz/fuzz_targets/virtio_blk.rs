//! cargo-fuzz target `virtio_blk`: see `bulkhead_fuzz::targets::blk` for the input format and
//! the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::blk::run(data));

//! cargo-fuzz target `virtio_mmio`: see `bulkhead_fuzz::targets::mmio` for the input format and
//! the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::mmio::run(data));

//! cargo-fuzz target `agent_frames`: see `bulkhead_fuzz::targets::agent` for the input format and
//! the checks.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bulkhead_fuzz::targets::agent::run(data));

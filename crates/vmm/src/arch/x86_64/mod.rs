//! x86_64 boot set-up.

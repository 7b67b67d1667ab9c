//! Architecture-specific code, selected with `cfg(target_arch)`.
//!
//! Everything outside this module is architecture-neutral and reaches the architecture only
//! through the items re-exported here.

#[cfg(target_arch = "x86_64")]
pub mod x86_64;

//! Architecture-specific code, selected with `cfg(target_arch)`.
//!
//! Everything outside this module is architecture-neutral and reaches the architecture only
//! through the items re-exported here.

#[cfg(target_arch = "x86_64")]
pub mod x86_64;

#[cfg(target_arch = "x86_64")]
pub use x86_64::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, IRQ_BASE, IRQ_MAX, MMIO_BASE,
};
#[cfg(target_arch = "x86_64")]
pub use x86_64::memory::Error as InitrdPlacementError;
#[cfg(target_arch = "x86_64")]
pub use x86_64::{
    arch_memory_regions, configure_system, configure_vcpu, initrd_load_addr, BootInfo, Error,
};

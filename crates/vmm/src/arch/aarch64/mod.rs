//! aarch64 boot set-up: guest memory layout, the arm64 `Image`, the device tree, the in-kernel
//! GICv3 and vCPU state, for the arm64 Linux boot protocol
//! (Documentation/arch/arm64/booting.rst). No firmware runs: the VMM loads the `Image`, writes a
//! flattened device tree describing the VM at the top of RAM and starts vCPU 0 at the kernel's
//! first byte with x0 pointing at the tree; the other vCPUs wait powered off for PSCI `CPU_ON`.
//!
//! [`layout`], [`memory`], [`image`], [`fdt`], [`gic`] sizing and [`regs`] register IDs are pure
//! and are built and unit-tested on every host; what needs an arm64 KVM is
//! `cfg(target_arch = "aarch64")`.

// On x86_64 this module is only built for its unit tests; the KVM glue using some items is not.
#![cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]

pub mod fdt;
pub mod gic;
pub mod gic_persist;
pub mod image;
pub mod layout;
pub mod memory;
pub mod persist;
pub mod regs;

#[cfg(target_arch = "aarch64")]
mod boot;
#[cfg(target_arch = "aarch64")]
mod legacy;

#[cfg(target_arch = "aarch64")]
pub use boot::{load_kernel, setup_boot, setup_irqchip, setup_vcpus, BootState};
#[cfg(target_arch = "aarch64")]
pub use image::LoadedKernel;
#[cfg(target_arch = "aarch64")]
pub(crate) use legacy::legacy_devices;

/// Errors of the aarch64 boot set-up; each variant's message is its source's.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading the kernel `Image`.
    #[error(transparent)]
    Image(#[from] image::Error),
    /// Building the device tree.
    #[error(transparent)]
    Fdt(#[from] fdt::Error),
    /// Creating the GIC.
    #[error(transparent)]
    Gic(#[from] gic::Error),
    /// Initialising a vCPU or setting its registers.
    #[error(transparent)]
    Regs(#[from] regs::Error),
    /// The command line is not valid text.
    #[error("invalid kernel command line: {0}")]
    Cmdline(String),
    /// Writing the device tree into guest memory failed.
    #[error("cannot write the device tree at {addr:#x}: {source}")]
    WriteFdt {
        /// Its GPA.
        addr: u64,
        /// The guest memory error.
        source: vm_memory::GuestMemoryError,
    },
}

//! Architecture-specific code, selected with `cfg(target_arch)`.
//!
//! Everything outside this module is architecture-neutral and reaches the architecture only
//! through the items re-exported here. A VM is built in this order (see [`crate::builder`]):
//!
//! 1. [`arch_memory_regions`] gives the RAM regions to create guest memory with.
//! 2. After `KVM_CREATE_VCPU` of every vCPU, [`setup_irqchip`] completes the in-kernel interrupt
//!    controller (aarch64: the GICv3, sized for the vCPUs, whose device the VM keeps for
//!    snapshots; x86_64: nothing, it is made with the VM). Only then are irqfds wired: virtio devices are placed from [`MMIO_BASE`] with
//!    interrupts [`IRQ_BASE`]..=[`IRQ_MAX`].
//! 3. [`load_kernel`] loads the kernel; the initramfs goes at [`initrd_load_addr`].
//! 4. [`setup_boot`] writes what the kernel reads at boot (x86_64: command line, `boot_params`,
//!    MP table; aarch64: the device tree) and returns the [`BootState`] the vCPUs start from.
//! 5. [`setup_vcpus`] sets every vCPU's registers; `legacy_devices` puts the console and, on
//!    x86_64, the PC's port-I/O devices on their buses.
//!
//! The aarch64 module's pure parts (layout, device tree, GIC sizing, `Image` parsing) are also
//! built and unit-tested on x86_64 hosts.

#[cfg(target_arch = "x86_64")]
pub mod x86_64;

#[cfg(any(target_arch = "aarch64", test))]
pub mod aarch64;

use linux_loader::cmdline::Cmdline;

use crate::boot::LoadedInitrd;
use crate::device_manager::MmioSlot;

#[cfg(target_arch = "x86_64")]
pub use x86_64::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, DEFAULT_CMDLINE, HIMEM_START, IRQ_BASE, IRQ_MAX, MAX_VCPUS,
    MMIO_BASE, VIRTIO_MMIO_ON_CMDLINE,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_64::legacy_devices;
#[cfg(target_arch = "x86_64")]
pub use x86_64::memory::Error as InitrdPlacementError;
#[cfg(target_arch = "x86_64")]
pub use x86_64::persist::{
    check_cpuid, restore_vcpu, restore_vm, save_vcpu, save_vm, saveable_msrs,
    Error as PersistError, VcpuState, VmState,
};
#[cfg(target_arch = "x86_64")]
pub use x86_64::{
    arch_memory_regions, configure_system, configure_vcpu, initrd_load_addr, load_kernel,
    setup_boot, setup_irqchip, setup_vcpus, BootInfo, BootState, Error, LoadedKernel,
};

#[cfg(target_arch = "aarch64")]
pub use aarch64::layout::{
    CMDLINE_MAX_SIZE, DEFAULT_CMDLINE, IRQ_BASE, IRQ_MAX, MAX_VCPUS, MMIO_BASE,
    VIRTIO_MMIO_ON_CMDLINE,
};
#[cfg(target_arch = "aarch64")]
pub(crate) use aarch64::legacy_devices;
#[cfg(target_arch = "aarch64")]
pub use aarch64::memory::{arch_memory_regions, initrd_load_addr, Error as InitrdPlacementError};
#[cfg(target_arch = "aarch64")]
pub use aarch64::{
    load_kernel, setup_boot, setup_irqchip, setup_vcpus, BootState, Error, LoadedKernel,
};

/// The highest 4 KiB-aligned guest physical address at which `size` bytes end at or below
/// `limit` (exclusive end, bytes) without starting below `floor` (the end of the kernel); `None`
/// when they do not fit. Used by both architectures to place the initramfs.
fn place_below(limit: u64, size: usize, floor: u64) -> Option<u64> {
    const PAGE_MASK: u64 = 0x1000 - 1;
    let start = limit.checked_sub(size as u64)? & !PAGE_MASK;
    (start >= floor).then_some(start)
}

/// What the architecture's boot set-up ([`setup_boot`]) is told about the VM.
#[derive(Debug, Clone, Copy)]
pub struct BootConfig<'a> {
    /// The loaded kernel.
    pub kernel: &'a LoadedKernel,
    /// The full kernel command line.
    pub cmdline: &'a Cmdline,
    /// The loaded initramfs, if any.
    pub initrd: Option<LoadedInitrd>,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// The virtio-mmio devices in registration order.
    pub devices: &'a [MmioSlot],
}

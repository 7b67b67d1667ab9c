//! x86_64 boot set-up: guest memory layout, `boot_params`, MP table and vCPU state.
//!
//! The VMM boots Linux through the 64-bit boot protocol (Documentation/x86/boot.rst, protocol
//! 2.15): no firmware runs, so this module puts in guest memory what firmware and a boot loader
//! would have left there and puts each vCPU directly in long mode at the kernel's 64-bit entry.
//!
//! Order of use:
//! 1. [`arch_memory_regions`] gives the RAM regions to create guest memory with.
//! 2. The kernel, initramfs and command line are loaded (see [`crate::boot`]).
//! 3. [`configure_system`] writes `boot_params` (with the e820 map) and the MP table.
//! 4. After `KVM_CREATE_IRQCHIP` and `KVM_CREATE_VCPU`, [`configure_vcpu`] sets each vCPU's
//!    CPUID, MSRs, registers, FPU and local APIC.

pub mod boot;
pub mod bootparams;
pub mod cpuid;
pub mod gdt;
pub mod layout;
mod legacy;
pub mod memory;
pub mod mptable;
pub mod msr;
pub mod paging;
pub mod persist;
pub mod regs;

use kvm_bindings::CpuId;
use kvm_ioctls::VcpuFd;
use vm_memory::{GuestAddress, GuestMemoryMmap};

pub use boot::{load_kernel, setup_boot, setup_irqchip, setup_vcpus, BootState, LoadedKernel};
pub use bootparams::BootInfo;
pub(crate) use legacy::legacy_devices;
pub use memory::{arch_memory_regions, initrd_load_addr, initrd_load_addr_below};

/// Errors of the x86_64 boot set-up; each variant's message is its source's.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Building or writing `boot_params`.
    #[error(transparent)]
    BootParams(#[from] bootparams::Error),
    /// Building or writing the MP table.
    #[error(transparent)]
    MpTable(#[from] mptable::Error),
    /// Placing the initramfs.
    #[error(transparent)]
    Memory(#[from] memory::Error),
    /// Building the vCPU's CPUID.
    #[error(transparent)]
    Cpuid(#[from] cpuid::Error),
    /// `KVM_SET_CPUID2` failed.
    #[error("KVM_SET_CPUID2 failed: {0}")]
    SetCpuid(kvm_ioctls::Error),
    /// Setting MSRs.
    #[error(transparent)]
    Msr(#[from] msr::Error),
    /// Writing the GDT/IDT.
    #[error(transparent)]
    Gdt(#[from] gdt::Error),
    /// Writing the page tables.
    #[error(transparent)]
    Paging(#[from] paging::Error),
    /// Setting registers, FPU or LAPIC.
    #[error(transparent)]
    Regs(#[from] regs::Error),
    /// Writing the command line into guest memory.
    #[error(transparent)]
    Cmdline(#[from] crate::boot::Error),
    /// KVM_GET_SUPPORTED_CPUID failed.
    #[error("cannot read the CPUID KVM supports: {0}")]
    SupportedCpuid(kvm_ioctls::Error),
}

/// Writes `boot_params` (the zero page, with an e820 map built from `mem`'s regions: RAM below
/// the EBDA, EBDA..1 MiB reserved, RAM from 1 MiB to the MMIO gap and from 4 GiB up) and the MP
/// table for `nr_vcpus` vCPUs into guest memory.
///
/// ```
/// use bulkhead_vmm::arch::x86_64::{arch_memory_regions, configure_system, layout, BootInfo};
/// use linux_loader::loader::bootparam::boot_params;
/// use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&arch_memory_regions(128 << 20)).unwrap();
/// let boot = BootInfo {
///     cmdline_addr: GuestAddress(layout::CMDLINE_START),
///     cmdline_size: 14, // "console=ttyS0\0"
///     initrd: None,
///     setup_header: None,
/// };
/// configure_system(&mem, &boot, 2).unwrap();
///
/// let params: boot_params = mem.read_obj(GuestAddress(layout::ZERO_PAGE_START)).unwrap();
/// assert_eq!({ params.hdr.cmd_line_ptr }, 0x20000);
/// assert_eq!(params.e820_entries, 3);
/// ```
pub fn configure_system(mem: &GuestMemoryMmap, boot: &BootInfo, nr_vcpus: u8) -> Result<(), Error> {
    mptable::write_mptable(mem, nr_vcpus)?;
    bootparams::write_boot_params(mem, boot)?;
    Ok(())
}

/// Configures vCPU `vcpu_id` of `nr_vcpus` for the 64-bit Linux boot protocol entry at GPA
/// `entry`:
///
/// - CPUID: `supported_cpuid` (from `KVM_GET_SUPPORTED_CPUID`) with this VM's topology (one
///   socket, one core per vCPU, one thread per core, APIC ID = `vcpu_id`) and the hypervisor
///   bit; see [`cpuid`].
/// - MSRs: see [`msr`].
/// - Registers: RIP = `entry`, RSI = `boot_params` GPA, RSP = RBP = boot stack, RFLAGS = 0x2.
/// - Special registers: boot GDT and empty IDT (written to guest memory), CR0 = PE|ET|PG,
///   CR4 = PAE, EFER = LME|LMA, CR3 = identity page tables (written to guest memory).
/// - FPU: FCW 0x37f, MXCSR 0x1f80.
/// - Local APIC: LINT0 = ExtINT, LINT1 = NMI. Requires the in-kernel irqchip
///   (`KVM_CREATE_IRQCHIP`) to exist before the vCPU was created.
pub fn configure_vcpu(
    vcpu: &VcpuFd,
    supported_cpuid: &CpuId,
    vcpu_id: u8,
    nr_vcpus: u8,
    entry: GuestAddress,
    mem: &GuestMemoryMmap,
) -> Result<(), Error> {
    let topology = cpuid::VcpuTopology::new(vcpu_id, nr_vcpus)?;
    let cpuid = cpuid::vcpu_cpuid(supported_cpuid, topology)?;
    vcpu.set_cpuid2(&cpuid).map_err(Error::SetCpuid)?;
    msr::setup_msrs(vcpu)?;
    regs::setup_regs(vcpu, entry.0)?;
    gdt::write_descriptor_tables(mem)?;
    let cr3 = paging::write_identity_page_tables(mem)?;
    regs::setup_sregs(vcpu, cr3)?;
    regs::setup_fpu(vcpu)?;
    regs::setup_lapic(vcpu)?;
    Ok(())
}

#[cfg(test)]
mod tests;

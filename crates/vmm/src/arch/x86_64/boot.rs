//! The x86_64 side of the architecture interface ([`crate::arch`]): kernel loading, boot
//! structures and vCPU set-up for a whole VM, on top of [`super::configure_system`] and
//! [`super::configure_vcpu`].

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{GuestAddress, GuestMemoryMmap};

pub use crate::boot::{load_kernel, LoadedKernel};

use super::{configure_system, configure_vcpu, BootInfo, Error};
use crate::arch::BootConfig;
use crate::boot::load_cmdline;

/// What the vCPUs start from: the kernel's 64-bit entry point.
#[derive(Debug, Clone, Copy)]
pub struct BootState {
    /// GPA of the kernel's 64-bit entry (RIP of every vCPU).
    pub entry: GuestAddress,
}

/// Writes the command line at `CMDLINE_START`, then `boot_params` and the MP table.
///
/// # Errors
/// [`Error::Cmdline`] and the errors of [`configure_system`].
pub fn setup_boot(mem: &GuestMemoryMmap, config: &BootConfig<'_>) -> Result<BootState, Error> {
    let (cmdline_addr, cmdline_size) = load_cmdline(mem, config.cmdline)?;
    let info = BootInfo {
        cmdline_addr,
        cmdline_size,
        initrd: config.initrd.map(|i| (i.addr, i.size)),
        setup_header: config.kernel.setup_header,
    };
    configure_system(mem, &info, config.vcpus)?;
    Ok(BootState {
        entry: config.kernel.entry,
    })
}

/// Nothing to do: on x86_64 the in-kernel irqchip (IOAPIC, PIC, LAPICs) is made with the VM,
/// before any vCPU, as KVM requires; there is no device to return (its state is read through
/// the VM, `KVM_GET_IRQCHIP`).
///
/// # Errors
/// None.
pub fn setup_irqchip(_vm: &VmFd, _vcpus: &[VcpuFd]) -> Result<Option<kvm_ioctls::DeviceFd>, Error> {
    Ok(None)
}

/// Configures every vCPU (vCPU `n` is `vcpus[n]`) with the CPUID KVM supports; see
/// [`configure_vcpu`]. The in-kernel irqchip exists since the VM was created.
///
/// # Errors
/// [`Error::SupportedCpuid`] and the errors of [`configure_vcpu`].
pub fn setup_vcpus(
    kvm: &Kvm,
    _vm: &VmFd,
    vcpus: &[VcpuFd],
    boot: &BootState,
    mem: &GuestMemoryMmap,
) -> Result<(), Error> {
    let cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::SupportedCpuid)?;
    let count = vcpus.len() as u8;
    for (id, fd) in vcpus.iter().enumerate() {
        configure_vcpu(fd, &cpuid, id as u8, count, boot.entry, mem)?;
    }
    Ok(())
}

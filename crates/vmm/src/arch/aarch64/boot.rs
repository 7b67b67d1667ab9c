//! The aarch64 side of the architecture interface ([`crate::arch`]): the device tree and the
//! vCPUs and GIC of a whole VM.

use std::path::Path;

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::fdt::{build_fdt, FdtConfig, VirtioMmioNode};
use super::image::{self, LoadedKernel};
use super::layout::{DRAM_BASE, MMIO_DEVICE_SIZE};
use super::memory::{fdt_addr, ram_end};
use super::{gic, regs, Error};
use crate::arch::BootConfig;

/// What the vCPUs start from.
#[derive(Debug, Clone, Copy)]
pub struct BootState {
    /// GPA of the kernel's first instruction (PC of vCPU 0).
    pub entry: GuestAddress,
    /// GPA of the device tree (x0 of vCPU 0).
    pub fdt_addr: GuestAddress,
}

/// Loads the arm64 kernel `Image` at `path`; see [`image::load_kernel`].
///
/// # Errors
/// [`Error::Image`].
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, Error> {
    Ok(image::load_kernel(mem, path)?)
}

/// Builds the device tree for `config` and writes it at the top of RAM.
///
/// # Errors
/// [`Error::Cmdline`], [`Error::Fdt`], [`Error::WriteFdt`].
pub fn setup_boot(mem: &GuestMemoryMmap, config: &BootConfig<'_>) -> Result<BootState, Error> {
    let cmdline = config
        .cmdline
        .as_cstring()
        .map_err(|e| Error::Cmdline(e.to_string()))?;
    let cmdline = cmdline
        .to_str()
        .map_err(|e| Error::Cmdline(e.to_string()))?;
    let devices: Vec<VirtioMmioNode> = config
        .devices
        .iter()
        .map(|slot| VirtioMmioNode {
            base: slot.base,
            size: MMIO_DEVICE_SIZE,
            irq: slot.irq,
        })
        .collect();
    let end = ram_end(mem);
    let blob = build_fdt(&FdtConfig {
        vcpus: config.vcpus,
        memory: (DRAM_BASE, end - DRAM_BASE),
        cmdline,
        initrd: config.initrd.map(|i| (i.addr.0, i.size as u64)),
        devices: &devices,
    })?;
    let addr = fdt_addr(end);
    mem.write_slice(&blob, GuestAddress(addr))
        .map_err(|source| Error::WriteFdt { addr, source })?;
    Ok(BootState {
        entry: config.kernel.entry,
        fdt_addr: GuestAddress(addr),
    })
}

/// Creates and initialises the in-kernel GICv3 for `vcpus`, all of which must exist; returns its
/// device, which a snapshot reads the GIC's state through.
///
/// # Errors
/// [`Error::Gic`].
pub fn setup_irqchip(vm: &VmFd, vcpus: &[VcpuFd]) -> Result<Option<kvm_ioctls::DeviceFd>, Error> {
    Ok(Some(gic::create_gic(vm, vcpus.len() as u8)?))
}

/// Initialises every vCPU (vCPU `n` is `vcpus[n]`; `KVM_ARM_VCPU_INIT`) and sets its boot
/// registers.
///
/// # Errors
/// [`Error::Regs`].
pub fn setup_vcpus(
    _kvm: &Kvm,
    vm: &VmFd,
    vcpus: &[VcpuFd],
    boot: &BootState,
    _mem: &GuestMemoryMmap,
) -> Result<(), Error> {
    for (id, fd) in vcpus.iter().enumerate() {
        let id = id as u8;
        regs::init_vcpu(vm, fd, id)?;
        regs::setup_regs(fd, id, boot.entry.0, boot.fdt_addr.0)?;
    }
    Ok(())
}

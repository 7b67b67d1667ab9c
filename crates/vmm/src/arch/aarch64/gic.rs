//! The in-kernel GICv3 interrupt controller: where its register frames go and how KVM makes it.
//!
//! KVM emulates the GICv3 distributor and one redistributor per vCPU once userspace creates a
//! `KVM_DEV_TYPE_ARM_VGIC_V3` device, places both regions (`KVM_DEV_ARM_VGIC_GRP_ADDR`), says how
//! many interrupts it has (`KVM_DEV_ARM_VGIC_GRP_NR_IRQS`) and, after every vCPU exists,
//! initialises it (`KVM_DEV_ARM_VGIC_CTRL_INIT`); see the kernel's
//! Documentation/virt/kvm/devices/arm-vgic-v3.rst.

use super::layout::{GIC_DIST_BASE, GIC_DIST_SIZE, GIC_REDIST_BASE, GIC_REDIST_SIZE, MAX_VCPUS};

/// Errors sizing or creating the GIC.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vCPU count is 0 or more than the redistributor space holds.
    #[error("a GICv3 for {0} vCPUs cannot be laid out (1..={MAX_VCPUS} vCPUs fit)")]
    VcpuCount(u8),
    /// A GIC ioctl failed.
    #[error("cannot set up the in-kernel GICv3 ({what}): {source}")]
    Kvm {
        /// The step that failed.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// A guest physical address range: start GPA and size, both in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// First GPA.
    pub base: u64,
    /// Size in bytes.
    pub size: u64,
}

/// Where the GICv3 register frames of a VM are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GicRegions {
    /// The distributor (GICD), 64 KiB.
    pub dist: Region,
    /// All redistributors (GICR), contiguous, 128 KiB per vCPU.
    pub redist: Region,
}

/// The GICv3 regions for `vcpus` vCPUs.
///
/// # Errors
/// [`Error::VcpuCount`] for 0 vCPUs or more than [`MAX_VCPUS`].
pub fn gic_regions(vcpus: u8) -> Result<GicRegions, Error> {
    if vcpus == 0 || vcpus > MAX_VCPUS {
        return Err(Error::VcpuCount(vcpus));
    }
    Ok(GicRegions {
        dist: Region {
            base: GIC_DIST_BASE,
            size: GIC_DIST_SIZE,
        },
        redist: Region {
            base: GIC_REDIST_BASE,
            size: u64::from(vcpus) * GIC_REDIST_SIZE,
        },
    })
}

/// Creates the in-kernel GICv3 for `vcpus` vCPUs and initialises it. Call after every vCPU has
/// been created (`KVM_CREATE_VCPU`) and before any runs.
///
/// # Errors
/// [`Error::VcpuCount`], [`Error::Kvm`] naming the failed step.
#[cfg(target_arch = "aarch64")]
pub fn create_gic(vm: &kvm_ioctls::VmFd, vcpus: u8) -> Result<kvm_ioctls::DeviceFd, Error> {
    use kvm_bindings::{
        kvm_create_device, kvm_device_type_KVM_DEV_TYPE_ARM_VGIC_V3 as VGIC_V3,
        KVM_DEV_ARM_VGIC_CTRL_INIT, KVM_DEV_ARM_VGIC_GRP_ADDR, KVM_DEV_ARM_VGIC_GRP_CTRL,
        KVM_DEV_ARM_VGIC_GRP_NR_IRQS, KVM_VGIC_V3_ADDR_TYPE_DIST, KVM_VGIC_V3_ADDR_TYPE_REDIST,
    };

    use super::layout::GIC_NR_IRQS;

    let regions = gic_regions(vcpus)?;
    let mut device = kvm_create_device {
        type_: VGIC_V3,
        fd: 0,
        flags: 0,
    };
    let gic = vm.create_device(&mut device).map_err(kvm_step("create"))?;
    let dist = regions.dist.base;
    set_attr(
        &gic,
        KVM_DEV_ARM_VGIC_GRP_ADDR,
        KVM_VGIC_V3_ADDR_TYPE_DIST,
        &dist,
    )
    .map_err(kvm_step("distributor address"))?;
    let redist = regions.redist.base;
    set_attr(
        &gic,
        KVM_DEV_ARM_VGIC_GRP_ADDR,
        KVM_VGIC_V3_ADDR_TYPE_REDIST,
        &redist,
    )
    .map_err(kvm_step("redistributor address"))?;
    set_attr(&gic, KVM_DEV_ARM_VGIC_GRP_NR_IRQS, 0, &GIC_NR_IRQS)
        .map_err(kvm_step("number of interrupts"))?;
    let none = 0u64;
    set_attr(
        &gic,
        KVM_DEV_ARM_VGIC_GRP_CTRL,
        KVM_DEV_ARM_VGIC_CTRL_INIT,
        &none,
    )
    .map_err(kvm_step("init"))?;
    Ok(gic)
}

/// Maps a KVM error to [`Error::Kvm`] for step `what`.
#[cfg(target_arch = "aarch64")]
fn kvm_step(what: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { what, source }
}

/// `KVM_SET_DEVICE_ATTR` of `group`/`attr` on `gic`, passing a pointer to `value`; the kernel
/// reads `size_of::<T>()` bytes through it during the call, while `value` is borrowed.
#[cfg(target_arch = "aarch64")]
fn set_attr<T>(
    gic: &kvm_ioctls::DeviceFd,
    group: u32,
    attr: u32,
    value: &T,
) -> Result<(), kvm_ioctls::Error> {
    let attr = kvm_bindings::kvm_device_attr {
        group,
        attr: u64::from(attr),
        addr: value as *const T as u64,
        flags: 0,
    };
    gic.set_device_attr(&attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redistributors_grow_with_the_vcpu_count() {
        let one = gic_regions(1).unwrap();
        let four = gic_regions(4).unwrap();

        assert_eq!(one.redist.size, 0x2_0000);
        assert_eq!(four.redist.size, 4 * 0x2_0000);
        assert_eq!(four.dist, one.dist);
    }

    #[test]
    fn distributor_and_redistributors_do_not_overlap() {
        let regions = gic_regions(MAX_VCPUS).unwrap();

        assert!(regions.dist.base + regions.dist.size <= regions.redist.base);
        assert!(regions.redist.base + regions.redist.size <= super::super::layout::SERIAL_BASE);
    }

    #[test]
    fn zero_or_too_many_vcpus_are_rejected() {
        let zero = gic_regions(0).unwrap_err();
        let many = gic_regions(MAX_VCPUS + 1).unwrap_err();

        assert!(matches!(zero, Error::VcpuCount(0)));
        assert!(many.to_string().contains("1..=123 vCPUs"), "{many}");
    }
}

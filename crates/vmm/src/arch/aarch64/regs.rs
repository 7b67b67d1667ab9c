//! vCPU set-up for the arm64 boot protocol: `KVM_ARM_VCPU_INIT` and the core registers.
//!
//! Documentation/arch/arm64/booting.rst, "Call the kernel image": the boot CPU enters the kernel
//! at its first byte with x0 = the device tree's physical address, x1..x3 = 0, in EL1 with all
//! of D, A, I and F masked. Secondary CPUs start powered off and are brought up by the kernel
//! through PSCI `CPU_ON`, which KVM implements (`KVM_ARM_VCPU_PSCI_0_2`).
//!
//! Core registers are addressed with `KVM_{GET,SET}_ONE_REG` IDs built from their offset in
//! `struct kvm_regs` (arch/arm64/include/uapi/asm/kvm.h).

/// `KVM_REG_ARM64`: architecture field of a register ID.
pub const KVM_REG_ARM64: u64 = 0x6000_0000_0000_0000;
/// `KVM_REG_SIZE_U64`: size field of a 64-bit register ID.
pub const KVM_REG_SIZE_U64: u64 = 0x0030_0000_0000_0000;
/// `KVM_REG_ARM_CORE`: the core-register group.
pub const KVM_REG_ARM_CORE: u64 = 0x0010_0000;

/// Byte offset of `regs.pc` in `struct kvm_regs` (after x0..x30 and sp, 8 bytes each).
const PC_OFFSET: u64 = 32 * 8;
/// Byte offset of `regs.pstate` in `struct kvm_regs`.
const PSTATE_OFFSET: u64 = 33 * 8;

/// PSTATE.M = EL1h: EL1 using SP_EL1.
const PSR_MODE_EL1H: u64 = 0x5;
/// PSTATE.F: FIQs masked.
const PSR_F_BIT: u64 = 0x40;
/// PSTATE.I: IRQs masked.
const PSR_I_BIT: u64 = 0x80;
/// PSTATE.A: SErrors masked.
const PSR_A_BIT: u64 = 0x100;
/// PSTATE.D: debug exceptions masked.
const PSR_D_BIT: u64 = 0x200;

/// The PSTATE every vCPU starts with: EL1h, D, A, I and F masked (0x3c5).
pub const BOOT_PSTATE: u64 = PSR_MODE_EL1H | PSR_F_BIT | PSR_I_BIT | PSR_A_BIT | PSR_D_BIT;

/// `KVM_SET_ONE_REG` ID of the 64-bit core register at byte `offset` of `struct kvm_regs`.
pub const fn core_reg_id(offset: u64) -> u64 {
    KVM_REG_ARM64 | KVM_REG_SIZE_U64 | KVM_REG_ARM_CORE | (offset / 4)
}

/// ID of general-purpose register x`n` (0..=30).
pub const fn xreg_id(n: u64) -> u64 {
    core_reg_id(n * 8)
}

/// ID of the program counter.
pub const PC_ID: u64 = core_reg_id(PC_OFFSET);

/// ID of PSTATE.
pub const PSTATE_ID: u64 = core_reg_id(PSTATE_OFFSET);

/// Errors setting up a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A vCPU ioctl failed.
    #[error("cannot set up vCPU {id} ({what}): {source}")]
    Kvm {
        /// The vCPU index.
        id: u8,
        /// The step that failed.
        what: &'static str,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// `KVM_ARM_VCPU_POWER_OFF`: feature bit of a vCPU that starts powered off (arm64 `asm/kvm.h`).
pub const FEATURE_POWER_OFF: u32 = 0;
/// `KVM_ARM_VCPU_PSCI_0_2`: feature bit of PSCI 0.2 for the vCPU (arm64 `asm/kvm.h`).
const FEATURE_PSCI_0_2: u32 = 2;

/// The `kvm_vcpu_init.features` of vCPU `id`: PSCI 0.2, and (all but vCPU 0) powered off until
/// the guest's PSCI `CPU_ON`.
pub const fn vcpu_features(id: u8) -> [u32; 7] {
    let mut features = [0u32; 7];
    features[0] = 1 << FEATURE_PSCI_0_2;
    if id > 0 {
        features[0] |= 1 << FEATURE_POWER_OFF;
    }
    features
}

/// `KVM_ARM_VCPU_INIT` of vCPU `id` with the host's preferred target, PSCI 0.2, and (all but
/// vCPU 0) powered off until the guest's PSCI `CPU_ON`.
///
/// # Errors
/// [`Error::Kvm`].
#[cfg(target_arch = "aarch64")]
pub fn init_vcpu(vm: &kvm_ioctls::VmFd, vcpu: &kvm_ioctls::VcpuFd, id: u8) -> Result<(), Error> {
    use kvm_bindings::kvm_vcpu_init;

    let step = |what| move |source| Error::Kvm { id, what, source };
    let mut init = kvm_vcpu_init::default();
    vm.get_preferred_target(&mut init)
        .map_err(step("KVM_ARM_PREFERRED_TARGET"))?;
    init.features = vcpu_features(id);
    vcpu.vcpu_init(&init).map_err(step("KVM_ARM_VCPU_INIT"))
}

/// Sets the boot registers: PSTATE on every vCPU; on vCPU 0 also PC = `entry` and
/// x0 = `fdt_addr`.
///
/// # Errors
/// [`Error::Kvm`].
#[cfg(target_arch = "aarch64")]
pub fn setup_regs(
    vcpu: &kvm_ioctls::VcpuFd,
    id: u8,
    entry: u64,
    fdt_addr: u64,
) -> Result<(), Error> {
    let set = |reg: u64, value: u64, what| {
        vcpu.set_one_reg(reg, &value.to_le_bytes())
            .map(|_| ())
            .map_err(|source| Error::Kvm { id, what, source })
    };
    set(PSTATE_ID, BOOT_PSTATE, "PSTATE")?;
    if id == 0 {
        set(PC_ID, entry, "PC")?;
        set(xreg_id(0), fdt_addr, "x0")?;
    }
    Ok(())
}

// The register-ID fields above are the kernel's, as kvm-bindings has them.
#[cfg(target_arch = "aarch64")]
const _: () = assert!(
    KVM_REG_ARM64 == kvm_bindings::KVM_REG_ARM64
        && KVM_REG_SIZE_U64 == kvm_bindings::KVM_REG_SIZE_U64
        && KVM_REG_ARM_CORE == kvm_bindings::KVM_REG_ARM_CORE as u64
        && FEATURE_POWER_OFF == kvm_bindings::KVM_ARM_VCPU_POWER_OFF
        && FEATURE_PSCI_0_2 == kvm_bindings::KVM_ARM_VCPU_PSCI_0_2
        && PC_OFFSET == std::mem::offset_of!(kvm_bindings::user_pt_regs, pc) as u64
        && PSTATE_OFFSET == std::mem::offset_of!(kvm_bindings::user_pt_regs, pstate) as u64
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_pstate_is_el1h_with_daif_masked() {
        assert_eq!(BOOT_PSTATE, 0x3c5);
    }

    #[test]
    fn core_register_ids_match_the_kernel_layout() {
        // arm64 | u64 | core group | (byte offset in struct kvm_regs) / 4.
        assert_eq!(xreg_id(0), 0x6030_0000_0010_0000);
        assert_eq!(PC_ID, 0x6030_0000_0010_0040);
        assert_eq!(PSTATE_ID, 0x6030_0000_0010_0042);
    }
}

//! Model-specific registers at boot.
//!
//! A vCPU starts with whatever KVM's reset state is; these MSRs are set to known values so every
//! boot starts the same way: system-call entry points cleared (the kernel programs them), the
//! TSC at 0, fast string operations on, and MTRRs enabled with write-back as the default memory
//! type (with MTRRs disabled all memory would be uncacheable). MSR numbers are from the Intel
//! SDM vol. 4.

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;

/// Errors setting MSRs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The MSR list could not be allocated.
    #[error("cannot build the boot MSR list: {0:?}")]
    Build(vmm_sys_util::fam::Error),
    /// `KVM_SET_MSRS` failed.
    #[error("KVM_SET_MSRS failed: {0}")]
    Set(kvm_ioctls::Error),
    /// KVM stopped at an MSR it refused.
    #[error("KVM_SET_MSRS set {set} of {total} boot MSRs; it refused MSR {refused:#x}")]
    Partial {
        /// MSRs set.
        set: usize,
        /// MSRs requested.
        total: usize,
        /// Index of the first MSR KVM did not set.
        refused: u32,
    },
}

/// IA32_SYSENTER_CS.
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// IA32_SYSENTER_ESP.
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// IA32_SYSENTER_EIP.
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// IA32_STAR: SYSCALL/SYSRET segment selectors.
pub const MSR_STAR: u32 = 0xc000_0081;
/// IA32_LSTAR: 64-bit SYSCALL entry point.
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// IA32_CSTAR: compatibility-mode SYSCALL entry point.
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// IA32_FMASK: RFLAGS bits cleared on SYSCALL.
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// IA32_KERNEL_GS_BASE: GS base swapped in by SWAPGS.
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// IA32_TIME_STAMP_COUNTER.
pub const MSR_IA32_TSC: u32 = 0x10;
/// IA32_MISC_ENABLE.
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MISC_ENABLE bit 0: fast-string operations (REP MOVS/STOS) enabled.
pub const MISC_ENABLE_FAST_STRING: u64 = 1;
/// IA32_MTRR_DEF_TYPE.
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// IA32_MTRR_DEF_TYPE bit 11: MTRRs enabled.
pub const MTRR_ENABLE: u64 = 1 << 11;
/// Memory type write-back (6), in IA32_MTRR_DEF_TYPE bits 0-7.
pub const MTRR_TYPE_WRITE_BACK: u64 = 6;

/// The boot MSRs as `(index, value)` pairs, in the order they are set.
pub fn boot_msr_values() -> [(u32, u64); 11] {
    [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE | MTRR_TYPE_WRITE_BACK),
    ]
}

/// [`boot_msr_values`] as `kvm_msr_entry`s.
pub fn boot_msr_entries() -> Vec<kvm_msr_entry> {
    boot_msr_values()
        .iter()
        .map(|&(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect()
}

/// Sets the boot MSRs on `vcpu`; an MSR KVM refuses is an error naming it.
pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), Error> {
    let entries = boot_msr_entries();
    let msrs = Msrs::from_entries(&entries).map_err(Error::Build)?;
    let set = vcpu.set_msrs(&msrs).map_err(Error::Set)?;
    if set != entries.len() {
        return Err(Error::Partial {
            set,
            total: entries.len(),
            refused: entries.get(set).map_or(0, |e| e.index),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtrrs_default_to_write_back_and_enabled() {
        let values = boot_msr_values();

        let mtrr = values.iter().find(|(index, _)| *index == 0x2ff).unwrap();
        assert_eq!(mtrr.1, 0x806);
    }

    #[test]
    fn fast_strings_are_enabled() {
        let entries = boot_msr_entries();

        let misc = entries.iter().find(|e| e.index == 0x1a0).unwrap();
        assert_eq!(misc.data, 1);
    }

    #[test]
    fn each_msr_is_set_once() {
        let mut indices: Vec<u32> = boot_msr_values().iter().map(|(i, _)| *i).collect();

        indices.sort_unstable();
        indices.dedup();

        assert_eq!(indices.len(), boot_msr_values().len());
    }
}

//! Saving and restoring the KVM state of an aarch64 vCPU, for snapshots; the GICv3 is in
//! [`super::gic_persist`].
//!
//! A vCPU's state is every register `KVM_GET_REG_LIST` names (core registers, FP/SIMD, system
//! registers, the generic timer's, the firmware pseudo-registers such as the PSCI version), its
//! MP state (running or powered off) and the `KVM_ARM_VCPU_INIT` features it was initialised
//! with (the target is the restoring host's `KVM_ARM_PREFERRED_TARGET`; a host of another CPU
//! model shows when KVM refuses a saved ID register). Section numbers refer to Linux `Documentation/virt/kvm/api.rst` (6.1):
//! §4.68 `KVM_GET_ONE_REG`/`KVM_SET_ONE_REG` and the arm64 register ID layout, §4.82
//! `KVM_ARM_VCPU_INIT`, §4.84 `KVM_GET_REG_LIST`, §4.38/§4.39 the MP state.
//!
//! Restore order (as Firecracker's aarch64 `KvmVcpu::restore_state`, QEMU's
//! `target/arm/kvm.c`): `KVM_ARM_VCPU_INIT` with the saved target and features (without
//! `KVM_ARM_VCPU_POWER_OFF`: the MP state says whether the vCPU runs), then the counter
//! registers ([`KVM_REG_ARM_TIMER_CNT`], [`KVM_REG_ARM_PTIMER_CNT`]) before every other one,
//! because writing a counter moves the VM's counter offset, against which the timers' compare
//! values (`CVAL`) and controls (`CTL`), restored after, are evaluated; then the other registers
//! in `KVM_GET_REG_LIST` order; the MP state last. The GIC is restored after every vCPU
//! (its redistributor and CPU-interface registers are addressed by the vCPU's MPIDR, which
//! `KVM_ARM_VCPU_INIT` sets).

use serde::{Deserialize, Serialize};

use super::regs::{KVM_REG_ARM64, KVM_REG_SIZE_U64};

/// `KVM_REG_ARM64_SYSREG`: the system-register group of a register ID (arm64 `asm/kvm.h`).
pub const KVM_REG_ARM64_SYSREG: u64 = 0x0013 << 16;

/// Mask of the size field of a register ID (`KVM_REG_SIZE_MASK`, `linux/kvm.h`).
pub const KVM_REG_SIZE_MASK: u64 = 0x00f0_0000_0000_0000;
/// Shift of the size field (`KVM_REG_SIZE_SHIFT`): a register is `1 << field` bytes long.
pub const KVM_REG_SIZE_SHIFT: u32 = 52;

/// The largest register KVM names (`KVM_REG_SIZE_U2048`), in bytes; a saved register claiming
/// a larger size is refused.
pub const MAX_REG_BYTES: usize = 256;

/// Number of 32-bit words of `kvm_vcpu_init.features`.
pub const FEATURE_WORDS: usize = 7;

/// The register ID of the system register `op0, op1, CRn, CRm, op2` (`ARM64_SYS_REG`, arm64
/// `asm/kvm.h`), 64 bits wide.
pub const fn sys_reg_id(op0: u64, op1: u64, crn: u64, crm: u64, op2: u64) -> u64 {
    KVM_REG_ARM64
        | KVM_REG_SIZE_U64
        | KVM_REG_ARM64_SYSREG
        | (op0 << 14)
        | (op1 << 11)
        | (crn << 7)
        | (crm << 3)
        | op2
}

/// MPIDR_EL1, the vCPU's affinity (Arm ARM D17.2.101).
pub const MPIDR_EL1: u64 = sys_reg_id(3, 0, 0, 0, 5);
/// The virtual timer's control, CNTV_CTL_EL0 (`KVM_REG_ARM_TIMER_CTL`).
pub const KVM_REG_ARM_TIMER_CTL: u64 = sys_reg_id(3, 3, 14, 3, 1);
/// The virtual counter, CNTVCT_EL0 (`KVM_REG_ARM_TIMER_CNT`; its encoding is CNTV_CVAL's, a
/// historical swap kept as API, api.rst §4.68). Writing it sets the VM's virtual counter
/// offset.
pub const KVM_REG_ARM_TIMER_CNT: u64 = sys_reg_id(3, 3, 14, 3, 2);
/// The virtual timer's compare value, CNTV_CVAL_EL0 (`KVM_REG_ARM_TIMER_CVAL`; CNTVCT's
/// encoding, see [`KVM_REG_ARM_TIMER_CNT`]).
pub const KVM_REG_ARM_TIMER_CVAL: u64 = sys_reg_id(3, 3, 14, 0, 2);
/// The physical counter, CNTPCT_EL0 (`KVM_REG_ARM_PTIMER_CNT`, listed by Linux 6.4 and later).
pub const KVM_REG_ARM_PTIMER_CNT: u64 = sys_reg_id(3, 3, 14, 0, 1);

/// Errors saving or restoring a vCPU; each names the ioctl or check that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A KVM ioctl failed.
    #[error("{ioctl} failed: {source}")]
    Ioctl {
        /// The ioctl, e.g. `KVM_GET_REG_LIST`.
        ioctl: &'static str,
        /// Its error.
        source: kvm_ioctls::Error,
    },
    /// `KVM_GET_ONE_REG`/`KVM_SET_ONE_REG` of one register failed.
    #[error("{ioctl} of register {id:#x} failed: {source}")]
    Reg {
        /// `KVM_GET_ONE_REG` or `KVM_SET_ONE_REG`.
        ioctl: &'static str,
        /// The register ID.
        id: u64,
        /// Its error.
        source: kvm_ioctls::Error,
    },
    /// A saved register's value is not as long as its ID says, or the ID names no size KVM has.
    #[error("saved register {id:#x} has {len} bytes; its ID says {expected}")]
    RegSize {
        /// The register ID.
        id: u64,
        /// Bytes saved.
        len: usize,
        /// Bytes the ID's size field gives (0: an impossible size).
        expected: usize,
    },
    /// The register list could not be allocated.
    #[error("cannot build the register list for KVM_GET_REG_LIST: {0:?}")]
    RegList(vmm_sys_util::fam::Error),
}

/// One register: its `KVM_{GET,SET}_ONE_REG` ID and value (little-endian bytes, as long as the
/// ID's size field says: 4, 8 or 16 bytes for the registers of a vCPU without SVE).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reg {
    /// The register ID (api.rst §4.68).
    pub id: u64,
    /// The value's bytes.
    pub value: Vec<u8>,
}

/// Everything KVM holds for one aarch64 vCPU. Read with `save_vcpu`, written with
/// `restore_vcpu`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    /// `kvm_vcpu_init.features`, without `KVM_ARM_VCPU_POWER_OFF`.
    pub features: [u32; FEATURE_WORDS],
    /// `kvm_mp_state.mp_state`: `KVM_MP_STATE_RUNNABLE` (0), `_STOPPED` (5, powered off by
    /// PSCI) or `_SUSPENDED` (api.rst §4.38).
    pub mp_state: u32,
    /// MPIDR_EL1 (also among `regs`): how the GIC addresses this vCPU.
    pub mpidr: u64,
    /// Every register of `KVM_GET_REG_LIST`, in its order.
    pub regs: Vec<Reg>,
}

/// The size in bytes of register `id` (`1 << size field`); `None` for a size over
/// [`MAX_REG_BYTES`].
pub fn reg_size(id: u64) -> Option<usize> {
    let shift = (id & KVM_REG_SIZE_MASK) >> KVM_REG_SIZE_SHIFT;
    let bytes = 1usize.checked_shl(shift as u32)?;
    (bytes <= MAX_REG_BYTES).then_some(bytes)
}

/// Whether `id` is a counter register, whose write sets the VM's counter offset.
fn is_counter(id: u64) -> bool {
    id == KVM_REG_ARM_TIMER_CNT || id == KVM_REG_ARM_PTIMER_CNT
}

/// `regs` in the order they are restored: the counters first, then the others in their saved
/// (`KVM_GET_REG_LIST`) order.
pub fn restore_order(regs: &[Reg]) -> Vec<&Reg> {
    let counters = regs.iter().filter(|r| is_counter(r.id));
    let others = regs.iter().filter(|r| !is_counter(r.id));
    counters.chain(others).collect()
}

/// Checks that every saved register's value is as long as its ID says.
///
/// # Errors
/// [`Error::RegSize`] for the first that is not.
pub fn check_sizes(regs: &[Reg]) -> Result<(), Error> {
    regs.iter().try_for_each(|r| match reg_size(r.id) {
        Some(n) if n == r.value.len() => Ok(()),
        expected => Err(Error::RegSize {
            id: r.id,
            len: r.value.len(),
            expected: expected.unwrap_or(0),
        }),
    })
}

/// The MPIDR as the vGIC's attributes address a vCPU: Aff3..Aff0 in bits 63..32
/// (Documentation/virt/kvm/devices/arm-vgic-v3.rst, `KVM_DEV_ARM_VGIC_GRP_REDIST_REGS`), from
/// MPIDR_EL1's Aff0..Aff2 (bits 23..0) and Aff3 (bits 39..32).
pub const fn mpidr_attr(mpidr: u64) -> u64 {
    let aff = ((mpidr & 0xff_0000_0000) >> 8) | (mpidr & 0xff_ffff);
    aff << 32
}

/// Reads the state of `vcpu`, a vCPU out of `KVM_RUN` (on its own thread, VM paused).
///
/// # Errors
/// [`Error::Ioctl`], [`Error::Reg`] naming the register, [`Error::RegList`].
#[cfg(target_arch = "aarch64")]
pub fn save_vcpu(vcpu: &kvm_ioctls::VcpuFd) -> Result<VcpuState, Error> {
    let ids = reg_list(vcpu)?;
    let mut regs = Vec::with_capacity(ids.len());
    for id in ids {
        let mut buf = [0u8; MAX_REG_BYTES];
        let len = vcpu
            .get_one_reg(id, &mut buf)
            .map_err(|source| Error::Reg {
                ioctl: "KVM_GET_ONE_REG",
                id,
                source,
            })?;
        regs.push(Reg {
            id,
            value: buf[..len.min(MAX_REG_BYTES)].to_vec(),
        });
    }
    let mpidr = read_u64(vcpu, MPIDR_EL1)?;
    let mp_state = vcpu.get_mp_state().map_err(|source| Error::Ioctl {
        ioctl: "KVM_GET_MP_STATE",
        source,
    })?;
    Ok(VcpuState {
        // Every vCPU was initialised with these (vCPU 0's have no POWER_OFF).
        features: without_power_off(super::regs::vcpu_features(0)),
        mp_state: mp_state.mp_state,
        mpidr,
        regs,
    })
}

/// `features` without `KVM_ARM_VCPU_POWER_OFF`: only a boot starts secondary vCPUs powered off;
/// a restored vCPU's MP state says whether it runs.
pub fn without_power_off(mut features: [u32; FEATURE_WORDS]) -> [u32; FEATURE_WORDS] {
    features[0] &= !(1 << super::regs::FEATURE_POWER_OFF);
    features
}

/// Initialises `vcpu` (never run; of VM `vm`) as the saved one was and writes its registers and
/// MP state (order: module documentation).
///
/// # Errors
/// [`Error::RegSize`] before any ioctl for a malformed state; [`Error::Ioctl`], [`Error::Reg`]
/// naming the register KVM refused (e.g. an ID register of another CPU model).
#[cfg(target_arch = "aarch64")]
pub fn restore_vcpu(
    vm: &kvm_ioctls::VmFd,
    vcpu: &kvm_ioctls::VcpuFd,
    state: &VcpuState,
) -> Result<(), Error> {
    check_sizes(&state.regs)?;
    let mut init = kvm_bindings::kvm_vcpu_init::default();
    vm.get_preferred_target(&mut init)
        .map_err(|source| Error::Ioctl {
            ioctl: "KVM_ARM_PREFERRED_TARGET",
            source,
        })?;
    init.features = without_power_off(state.features);
    vcpu.vcpu_init(&init).map_err(|source| Error::Ioctl {
        ioctl: "KVM_ARM_VCPU_INIT",
        source,
    })?;
    for reg in restore_order(&state.regs) {
        vcpu.set_one_reg(reg.id, &reg.value)
            .map_err(|source| Error::Reg {
                ioctl: "KVM_SET_ONE_REG",
                id: reg.id,
                source,
            })?;
    }
    let mp_state = kvm_bindings::kvm_mp_state {
        mp_state: state.mp_state,
    };
    vcpu.set_mp_state(mp_state).map_err(|source| Error::Ioctl {
        ioctl: "KVM_SET_MP_STATE",
        source,
    })
}

/// `KVM_GET_REG_LIST`: every register ID of `vcpu`, asking again with the size KVM reports
/// when the first list is too short (E2BIG).
#[cfg(target_arch = "aarch64")]
fn reg_list(vcpu: &kvm_ioctls::VcpuFd) -> Result<Vec<u64>, Error> {
    use kvm_bindings::RegList;

    /// The most `RegList` holds (kvm-bindings' `ARM64_REGS_MAX`); Linux 6.x lists about 300 for
    /// a vCPU without SVE or PMU.
    const FIRST_GUESS: usize = 500;
    let mut list = RegList::new(FIRST_GUESS).map_err(Error::RegList)?;
    match vcpu.get_reg_list(&mut list) {
        Ok(()) => Ok(list.as_slice().to_vec()),
        Err(e) if e.errno() == libc::E2BIG => {
            let n = list.as_fam_struct_ref().n as usize;
            let mut list = RegList::new(n).map_err(Error::RegList)?;
            vcpu.get_reg_list(&mut list)
                .map_err(|source| Error::Ioctl {
                    ioctl: "KVM_GET_REG_LIST",
                    source,
                })?;
            Ok(list.as_slice().to_vec())
        }
        Err(source) => Err(Error::Ioctl {
            ioctl: "KVM_GET_REG_LIST",
            source,
        }),
    }
}

/// `KVM_GET_ONE_REG` of the 64-bit register `id`.
#[cfg(target_arch = "aarch64")]
fn read_u64(vcpu: &kvm_ioctls::VcpuFd, id: u64) -> Result<u64, Error> {
    let mut buf = [0u8; 8];
    vcpu.get_one_reg(id, &mut buf)
        .map_err(|source| Error::Reg {
            ioctl: "KVM_GET_ONE_REG",
            id,
            source,
        })?;
    Ok(u64::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(id: u64) -> Reg {
        Reg {
            id,
            value: vec![0; reg_size(id).unwrap()],
        }
    }

    #[test]
    fn system_register_ids_match_the_kernel_encoding() {
        // arm64 | u64 | sysreg group | op0 op1 CRn CRm op2 (values from a Linux 6.1 reg list).
        assert_eq!(MPIDR_EL1, 0x6030_0000_0013_c005);
        assert_eq!(KVM_REG_ARM_TIMER_CTL, 0x6030_0000_0013_df19);
        assert_eq!(KVM_REG_ARM_TIMER_CNT, 0x6030_0000_0013_df1a);
        assert_eq!(KVM_REG_ARM_TIMER_CVAL, 0x6030_0000_0013_df02);
    }

    #[test]
    fn register_sizes_come_from_the_id() {
        assert_eq!(reg_size(MPIDR_EL1), Some(8));
        // A core FP register: KVM_REG_SIZE_U128.
        assert_eq!(reg_size(0x6040_0000_0010_0054), Some(16));
        // fpsr: KVM_REG_SIZE_U32.
        assert_eq!(reg_size(0x6020_0000_0010_00d4), Some(4));
        // Size field 0xf: 32 KiB, more than any register.
        assert_eq!(reg_size(0x60f0_0000_0000_0000), None);
    }

    #[test]
    fn counters_are_restored_before_every_other_register() {
        let saved = vec![
            reg(super::super::regs::PC_ID),
            reg(KVM_REG_ARM_TIMER_CTL),
            reg(KVM_REG_ARM_TIMER_CNT),
            reg(KVM_REG_ARM_TIMER_CVAL),
            reg(KVM_REG_ARM_PTIMER_CNT),
            reg(MPIDR_EL1),
        ];

        let ids: Vec<u64> = restore_order(&saved).iter().map(|r| r.id).collect();

        assert_eq!(
            ids,
            [
                KVM_REG_ARM_TIMER_CNT,
                KVM_REG_ARM_PTIMER_CNT,
                super::super::regs::PC_ID,
                KVM_REG_ARM_TIMER_CTL,
                KVM_REG_ARM_TIMER_CVAL,
                MPIDR_EL1
            ]
        );
    }

    #[test]
    fn a_value_of_the_wrong_length_is_refused() {
        let mut bad = reg(MPIDR_EL1);
        bad.value.push(0);

        let err = check_sizes(&[reg(KVM_REG_ARM_TIMER_CTL), bad]).unwrap_err();

        assert!(
            matches!(
                err,
                Error::RegSize {
                    id: MPIDR_EL1,
                    len: 9,
                    expected: 8
                }
            ),
            "{err}"
        );
        assert!(check_sizes(&[Reg {
            id: 0x60f0_0000_0000_0000,
            value: vec![]
        }])
        .is_err());
    }

    #[test]
    fn mpidr_affinities_move_to_the_vgic_attribute_layout() {
        // Aff3 = 0x12 (bits 39..32), Aff2 = 0x34, Aff1 = 0x56, Aff0 = 0x78; bit 31 (RES1).
        let mpidr = 0x12_8034_5678;

        assert_eq!(mpidr_attr(mpidr), 0x1234_5678_0000_0000);
        assert_eq!(mpidr_attr(0x8000_0001), 0x0000_0001_0000_0000);
    }

    #[test]
    fn power_off_is_not_kept_in_the_features() {
        let features = without_power_off([0b101, 0, 0, 0, 0, 0, 1]);

        assert_eq!(features, [0b100, 0, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn vcpu_state_round_trips_through_json() {
        let state = VcpuState {
            features: [1 << 2, 0, 0, 0, 0, 0, 0],
            mp_state: 5,
            mpidr: 0x8000_0001,
            regs: vec![reg(MPIDR_EL1), reg(0x6040_0000_0010_0054)],
        };

        let json = serde_json::to_string(&state).unwrap();
        let back: VcpuState = serde_json::from_str(&json).unwrap();

        assert_eq!(back, state);
        assert!(serde_json::from_str::<VcpuState>(&json.replace("\"mpidr\"", "\"x\"")).is_err());
    }
}

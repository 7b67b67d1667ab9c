//! Saving and restoring the in-kernel GICv3 for snapshots, through the vGIC device's attributes
//! (Linux Documentation/virt/kvm/devices/arm-vgic-v3.rst; register offsets and encodings from
//! the Arm GICv3 architecture specification, IHI 0069).
//!
//! What is saved: the distributor's registers of the SPIs (`KVM_DEV_ARM_VGIC_GRP_DIST_REGS`,
//! 32-bit accesses), the line level of the level-triggered SPIs
//! (`KVM_DEV_ARM_VGIC_GRP_LEVEL_INFO`), and per vCPU its redistributor's SGI/PPI registers
//! (`KVM_DEV_ARM_VGIC_GRP_REDIST_REGS`) and its CPU interface's system registers
//! (`KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS`, 64-bit). The VM has no ITS ([`super::gic`] creates
//! none), so the guest has no LPIs: there are no LPI pending tables to flush to guest RAM
//! (`KVM_DEV_ARM_VGIC_SAVE_PENDING_TABLES`, which an ITS would need before the memory is saved)
//! and no ITS tables; GICR_PROPBASER/PENDBASER are not saved. Saving only reads
//! (`KVM_GET_DEVICE_ATTR`), which is all the event loop's seccomp filter allows.
//!
//! A pair of set/clear registers (GICD_ISENABLER/ICENABLER, ISPENDR/ICPENDR,
//! ISACTIVER/ICACTIVER) is read through its set register and restored by writing the clear
//! register with the bits that were clear, then the set register with those that were set, so
//! the restored state is the saved one whatever it was before. The register order is QEMU's
//! (`hw/intc/arm_gicv3_kvm.c`), as Firecracker's: control first, enables, groups, routing,
//! configuration, then pending and active state, priorities last.
//!
//! Restore runs after every vCPU is restored: the redistributor and CPU-interface attributes
//! name the vCPU by its MPIDR, which `KVM_ARM_VCPU_INIT` gives it.

use serde::{Deserialize, Serialize};

use super::layout::{GIC_NR_IRQS, GIC_NR_PRIVATE_IRQS};
use super::persist::sys_reg_id;

/// `VGIC_LEVEL_INFO_LINE_LEVEL` shifted into the attribute's info field (bits 31..10).
const LINE_LEVEL_INFO: u64 = 0 << 10;

/// The SGI_base frame of a redistributor, after its RD_base frame (64 KiB).
const SGI_BASE: u32 = 0x1_0000;

/// Errors saving or restoring the GIC.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A vGIC device attribute could not be read or written.
    #[error("{what} of GIC register {attr:#x} (group {group}) failed: {source}")]
    Attr {
        /// `KVM_GET_DEVICE_ATTR` or `KVM_SET_DEVICE_ATTR`.
        what: &'static str,
        /// The attribute group (`KVM_DEV_ARM_VGIC_GRP_*`).
        group: u32,
        /// The attribute (MPIDR and offset or encoding).
        attr: u64,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
    /// The saved state does not list the registers this VMM saves (another version, or an
    /// altered file).
    #[error("the saved GIC state does not fit this VM: {0}")]
    Layout(String),
    /// The VM has no GIC device to save or restore.
    #[error("the VM has no vGIC device")]
    NoDevice,
}

/// A 32-bit GIC register: its byte offset in the distributor or redistributor frame (for line
/// levels: the first INTID of the 32 it covers) and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GicReg {
    /// Byte offset (or first INTID).
    pub offset: u32,
    /// Value.
    pub value: u32,
}

/// A CPU-interface system register: its `op0:op1:CRn:CRm:op2` encoding (16 bits) and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IccReg {
    /// The encoding, as `KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS` takes it.
    pub encoding: u16,
    /// Value.
    pub value: u64,
}

/// One vCPU's part of the GIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GicVcpuState {
    /// Its redistributor's registers, in restore order.
    pub redist: Vec<GicReg>,
    /// Its CPU interface's system registers, in restore order.
    pub icc: Vec<IccReg>,
}

/// The GICv3's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GicState {
    /// The distributor's registers, in restore order.
    pub dist: Vec<GicReg>,
    /// The SPIs' line levels, 32 per entry.
    pub line_levels: Vec<GicReg>,
    /// Per vCPU, by index.
    pub vcpus: Vec<GicVcpuState>,
}

/// How a register is restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Written with its value.
    Plain,
    /// A set register whose clear twin is at `clear`.
    SetClear {
        /// The clear register's offset.
        clear: u32,
    },
}

/// A register to save, by offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Desc {
    offset: u32,
    kind: Kind,
}

/// The 32-bit words of a register with `bits` bits per interrupt at `base`, for INTIDs
/// `first..end`.
fn words(base: u32, bits: u32, first: u32, end: u32, kind: Kind) -> impl Iterator<Item = Desc> {
    let per_word = 32 / bits;
    (first / per_word..end.div_ceil(per_word)).map(move |w| Desc {
        offset: base + 4 * w,
        kind: match kind {
            Kind::Plain => Kind::Plain,
            Kind::SetClear { clear } => Kind::SetClear {
                clear: clear + 4 * w,
            },
        },
    })
}

fn plain(offset: u32) -> Desc {
    Desc {
        offset,
        kind: Kind::Plain,
    }
}

/// The distributor registers saved, in restore order: GICD_CTLR, then per SPI: enables,
/// groups, routing (GICD_IROUTER, 64 bits as two words), configuration, pending, active,
/// priorities.
fn dist_regs() -> Vec<Desc> {
    let (spi, end) = (GIC_NR_PRIVATE_IRQS, GIC_NR_IRQS);
    let set_clear = |set: u32, clear: u32| words(set, 1, spi, end, Kind::SetClear { clear });
    let mut regs = vec![plain(0x0)];
    regs.extend(set_clear(0x100, 0x180)); // GICD_ISENABLER / ICENABLER
    regs.extend(words(0x080, 1, spi, end, Kind::Plain)); // GICD_IGROUPR
    regs.extend((spi..end).flat_map(|irq| [plain(0x6000 + 8 * irq), plain(0x6004 + 8 * irq)])); // GICD_IROUTER
    regs.extend(words(0xc00, 2, spi, end, Kind::Plain)); // GICD_ICFGR
    regs.extend(set_clear(0x200, 0x280)); // GICD_ISPENDR / ICPENDR
    regs.extend(set_clear(0x300, 0x380)); // GICD_ISACTIVER / ICACTIVER
    regs.extend(words(0x400, 8, spi, end, Kind::Plain)); // GICD_IPRIORITYR
    regs
}

/// A redistributor's registers saved, in restore order: GICR_CTLR, then the SGI/PPI registers
/// of its SGI_base frame, as [`dist_regs`].
fn redist_regs() -> Vec<Desc> {
    let n = GIC_NR_PRIVATE_IRQS;
    let set_clear = |set: u32, clear: u32| {
        words(
            SGI_BASE + set,
            1,
            0,
            n,
            Kind::SetClear {
                clear: SGI_BASE + clear,
            },
        )
    };
    let mut regs = vec![plain(0x0)]; // GICR_CTLR
    regs.extend(set_clear(0x100, 0x180)); // GICR_ISENABLER0 / ICENABLER0
    regs.extend(words(SGI_BASE + 0x080, 1, 0, n, Kind::Plain)); // GICR_IGROUPR0
    regs.extend(words(SGI_BASE + 0xc00, 2, 0, n, Kind::Plain)); // GICR_ICFGR0, ICFGR1
    regs.extend(set_clear(0x200, 0x280)); // GICR_ISPENDR0 / ICPENDR0
    regs.extend(set_clear(0x300, 0x380)); // GICR_ISACTIVER0 / ICACTIVER0
    regs.extend(words(SGI_BASE + 0x400, 8, 0, n, Kind::Plain)); // GICR_IPRIORITYR0..7
    regs
}

/// The 16-bit `KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS` encoding of system register
/// `op0, op1, CRn, CRm, op2`.
const fn icc(op0: u64, op1: u64, crn: u64, crm: u64, op2: u64) -> u16 {
    (sys_reg_id(op0, op1, crn, crm, op2) & 0xffff) as u16
}

/// ICC_SRE_EL1.
const ICC_SRE_EL1: u16 = icc(3, 0, 12, 12, 5);
/// ICC_CTLR_EL1: its PRIbits (bits 10..8) say how many active-priority registers exist.
const ICC_CTLR_EL1: u16 = icc(3, 0, 12, 12, 4);

/// The CPU-interface registers saved, in restore order, for a CPU interface whose ICC_CTLR_EL1
/// is `ctlr`: SRE, CTLR, the group enables, PMR, the binary points, then the active-priority
/// registers ICC_AP0R<n>/AP1R<n> that its priority bits implement (1, 2 or 4 of each; GICv3
/// spec 12.2.1/12.2.2).
fn icc_regs(ctlr: u64) -> Vec<u16> {
    let pri_bits = ((ctlr >> 8) & 0x7) + 1;
    let aprs = match pri_bits {
        7 => 4,
        6 => 2,
        _ => 1,
    };
    let mut regs = vec![
        ICC_SRE_EL1,
        ICC_CTLR_EL1,
        icc(3, 0, 12, 12, 6), // ICC_IGRPEN0_EL1
        icc(3, 0, 12, 12, 7), // ICC_IGRPEN1_EL1
        icc(3, 0, 4, 6, 0),   // ICC_PMR_EL1
        icc(3, 0, 12, 8, 3),  // ICC_BPR0_EL1
        icc(3, 0, 12, 12, 3), // ICC_BPR1_EL1
    ];
    regs.extend((0..aprs).map(|n| icc(3, 0, 12, 8, 4 | n))); // ICC_AP0R<n>_EL1
    regs.extend((0..aprs).map(|n| icc(3, 0, 12, 9, n))); // ICC_AP1R<n>_EL1
    regs
}

/// The first INTID of each 32 SPIs whose line levels are saved.
fn line_level_words() -> impl Iterator<Item = u32> {
    (GIC_NR_PRIVATE_IRQS..GIC_NR_IRQS).step_by(32)
}

/// Checks that `saved` lists exactly the registers `expected`, by offset, in order.
fn check_offsets(what: &str, saved: &[GicReg], expected: &[u32]) -> Result<(), Error> {
    if saved.len() != expected.len() || saved.iter().zip(expected).any(|(s, e)| s.offset != *e) {
        return Err(Error::Layout(format!(
            "{what}: {} registers saved, {} expected, or not the same ones",
            saved.len(),
            expected.len()
        )));
    }
    Ok(())
}

/// Checks that `state` has the layout this VMM saves for `vcpus` vCPUs, before anything is
/// written into KVM.
///
/// # Errors
/// [`Error::Layout`].
pub fn check_layout(state: &GicState, vcpus: usize) -> Result<(), Error> {
    let offsets = |d: Vec<Desc>| d.iter().map(|d| d.offset).collect::<Vec<_>>();
    check_offsets("distributor", &state.dist, &offsets(dist_regs()))?;
    let levels: Vec<u32> = line_level_words().collect();
    check_offsets("line levels", &state.line_levels, &levels)?;
    if state.vcpus.len() != vcpus {
        return Err(Error::Layout(format!(
            "{} vCPUs' redistributors saved, the VM has {vcpus}",
            state.vcpus.len()
        )));
    }
    let redist = offsets(redist_regs());
    for (i, v) in state.vcpus.iter().enumerate() {
        check_offsets(&format!("vCPU {i}'s redistributor"), &v.redist, &redist)?;
        let ctlr = v.icc.iter().find(|r| r.encoding == ICC_CTLR_EL1);
        let expected = icc_regs(ctlr.map_or(0, |r| r.value));
        let saved: Vec<u16> = v.icc.iter().map(|r| r.encoding).collect();
        if saved != expected {
            return Err(Error::Layout(format!(
                "vCPU {i}'s CPU interface: registers {saved:x?}, expected {expected:x?}"
            )));
        }
    }
    Ok(())
}

#[cfg(target_arch = "aarch64")]
pub use kvm::{restore_gic, save_gic};

/// The KVM side: device-attribute accesses.
#[cfg(target_arch = "aarch64")]
mod kvm {
    use kvm_bindings::{
        kvm_device_attr, KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS, KVM_DEV_ARM_VGIC_GRP_DIST_REGS,
        KVM_DEV_ARM_VGIC_GRP_LEVEL_INFO, KVM_DEV_ARM_VGIC_GRP_REDIST_REGS,
    };
    use kvm_ioctls::DeviceFd;

    use super::super::persist::mpidr_attr;
    use super::*;

    /// `KVM_GET_DEVICE_ATTR` of `group`/`attr`: a `T` (u32 or u64, as the group's registers
    /// are).
    fn get<T: Default>(gic: &DeviceFd, group: u32, attr: u64) -> Result<T, Error> {
        let mut value = T::default();
        let mut request = kvm_device_attr {
            group,
            attr,
            addr: &mut value as *mut T as u64,
            flags: 0,
        };
        // SAFETY: `addr` points at `value`, a live, exclusively borrowed `T` of the size the
        // vGIC writes for this group (arm-vgic-v3.rst: 32-bit for the distributor,
        // redistributor and line-level groups, 64-bit for the CPU system registers); the kernel
        // writes it only during the call.
        unsafe { gic.get_device_attr(&mut request) }.map_err(|source| Error::Attr {
            what: "KVM_GET_DEVICE_ATTR",
            group,
            attr,
            source,
        })?;
        Ok(value)
    }

    /// `KVM_SET_DEVICE_ATTR` of `group`/`attr` with `value`.
    fn set<T>(gic: &DeviceFd, group: u32, attr: u64, value: &T) -> Result<(), Error> {
        let request = kvm_device_attr {
            group,
            attr,
            addr: value as *const T as u64,
            flags: 0,
        };
        gic.set_device_attr(&request).map_err(|source| Error::Attr {
            what: "KVM_SET_DEVICE_ATTR",
            group,
            attr,
            source,
        })
    }

    fn save_regs(
        gic: &DeviceFd,
        group: u32,
        base: u64,
        regs: &[Desc],
    ) -> Result<Vec<GicReg>, Error> {
        regs.iter()
            .map(|d| {
                Ok(GicReg {
                    offset: d.offset,
                    value: get(gic, group, base | u64::from(d.offset))?,
                })
            })
            .collect()
    }

    fn restore_regs(
        gic: &DeviceFd,
        group: u32,
        base: u64,
        regs: &[(Desc, u32)],
    ) -> Result<(), Error> {
        for (desc, value) in regs {
            if let Kind::SetClear { clear } = desc.kind {
                set(gic, group, base | u64::from(clear), &!value)?;
            }
            set(gic, group, base | u64::from(desc.offset), value)?;
        }
        Ok(())
    }

    /// `saved` with each register's description (the layout was checked).
    fn described(descs: Vec<Desc>, saved: &[GicReg]) -> Vec<(Desc, u32)> {
        descs
            .into_iter()
            .zip(saved.iter().map(|r| r.value))
            .collect()
    }

    /// Reads the GIC's state; the vCPUs, whose MPIDRs are `mpidrs` (by index), must be out of
    /// `KVM_RUN` (the vGIC locks every vCPU for these accesses).
    ///
    /// # Errors
    /// [`Error::Attr`] naming the register.
    pub fn save_gic(gic: &DeviceFd, mpidrs: &[u64]) -> Result<GicState, Error> {
        let dist = save_regs(gic, KVM_DEV_ARM_VGIC_GRP_DIST_REGS, 0, &dist_regs())?;
        let first = mpidr_attr(mpidrs.first().copied().unwrap_or_default());
        let line_levels = line_level_words()
            .map(|intid| {
                let attr = first | LINE_LEVEL_INFO | u64::from(intid);
                Ok(GicReg {
                    offset: intid,
                    value: get(gic, KVM_DEV_ARM_VGIC_GRP_LEVEL_INFO, attr)?,
                })
            })
            .collect::<Result<_, Error>>()?;
        let vcpus = mpidrs
            .iter()
            .map(|&mpidr| {
                let base = mpidr_attr(mpidr);
                let redist =
                    save_regs(gic, KVM_DEV_ARM_VGIC_GRP_REDIST_REGS, base, &redist_regs())?;
                let sysreg = |enc: u16| base | u64::from(enc);
                let ctlr: u64 = get(gic, KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS, sysreg(ICC_CTLR_EL1))?;
                let icc = icc_regs(ctlr)
                    .into_iter()
                    .map(|encoding| {
                        let value = get(gic, KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS, sysreg(encoding))?;
                        Ok(IccReg { encoding, value })
                    })
                    .collect::<Result<_, Error>>()?;
                Ok(GicVcpuState { redist, icc })
            })
            .collect::<Result<_, Error>>()?;
        Ok(GicState {
            dist,
            line_levels,
            vcpus,
        })
    }

    /// Writes `state` into `gic`, whose vCPUs (MPIDRs `mpidrs`, by index) are restored and have
    /// not run: the distributor, the SPIs' line levels, then each vCPU's redistributor and CPU
    /// interface.
    ///
    /// # Errors
    /// [`Error::Layout`] before any write; [`Error::Attr`] naming the register.
    pub fn restore_gic(gic: &DeviceFd, mpidrs: &[u64], state: &GicState) -> Result<(), Error> {
        check_layout(state, mpidrs.len())?;
        restore_regs(
            gic,
            KVM_DEV_ARM_VGIC_GRP_DIST_REGS,
            0,
            &described(dist_regs(), &state.dist),
        )?;
        let first = mpidr_attr(mpidrs.first().copied().unwrap_or_default());
        for level in &state.line_levels {
            let attr = first | LINE_LEVEL_INFO | u64::from(level.offset);
            set(gic, KVM_DEV_ARM_VGIC_GRP_LEVEL_INFO, attr, &level.value)?;
        }
        for (&mpidr, vcpu) in mpidrs.iter().zip(&state.vcpus) {
            let base = mpidr_attr(mpidr);
            restore_regs(
                gic,
                KVM_DEV_ARM_VGIC_GRP_REDIST_REGS,
                base,
                &described(redist_regs(), &vcpu.redist),
            )?;
            for reg in &vcpu.icc {
                let attr = base | u64::from(reg.encoding);
                set(gic, KVM_DEV_ARM_VGIC_GRP_CPU_SYSREGS, attr, &reg.value)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(descs: Vec<Desc>) -> Vec<GicReg> {
        descs
            .iter()
            .map(|d| GicReg {
                offset: d.offset,
                value: 0,
            })
            .collect()
    }

    fn state(vcpus: usize) -> GicState {
        let icc = icc_regs(0)
            .into_iter()
            .map(|encoding| IccReg { encoding, value: 0 })
            .collect::<Vec<_>>();
        GicState {
            dist: saved(dist_regs()),
            line_levels: line_level_words()
                .map(|offset| GicReg { offset, value: 0 })
                .collect(),
            vcpus: vec![
                GicVcpuState {
                    redist: saved(redist_regs()),
                    icc,
                };
                vcpus
            ],
        }
    }

    #[test]
    fn distributor_registers_cover_the_spis_only() {
        let regs = dist_regs();
        let at = |o: u32| regs.iter().find(|d| d.offset == o).copied();

        // GICD_ISENABLER1 (INTIDs 32..63) with its clear twin; not ISENABLER0 (SGIs/PPIs).
        assert_eq!(at(0x104).unwrap().kind, Kind::SetClear { clear: 0x184 });
        assert_eq!(at(0x100), None);
        assert!(at(0x10c).is_some() && at(0x110).is_none());
        // GICD_IPRIORITYR8..31, GICD_ICFGR2..7, GICD_IROUTER32..127 in two halves.
        assert!(at(0x420).is_some() && at(0x41c).is_none() && at(0x47c).is_some());
        assert!(at(0xc08).is_some() && at(0xc04).is_none() && at(0xc1c).is_some());
        assert!(at(0x6000 + 8 * 32).is_some() && at(0x6004 + 8 * 127).is_some());
        assert_eq!(regs[0], plain(0x0), "GICD_CTLR first");
        assert_eq!(regs.len(), 1 + 3 + 3 + 192 + 6 + 3 + 3 + 24);
    }

    #[test]
    fn redistributor_registers_are_in_the_sgi_frame() {
        let regs = redist_regs();
        let offsets: Vec<u32> = regs.iter().map(|d| d.offset).collect();

        assert_eq!(offsets[..4], [0x0, 0x1_0100, 0x1_0080, 0x1_0c00]);
        assert_eq!(regs[1].kind, Kind::SetClear { clear: 0x1_0180 });
        assert_eq!(*offsets.last().unwrap(), 0x1_041c);
        assert_eq!(regs.len(), 1 + 1 + 1 + 2 + 1 + 1 + 8);
    }

    #[test]
    fn active_priority_registers_follow_the_priority_bits() {
        // PRIbits = 4 (5 bits): AP0R0 and AP1R0; 7 bits: four of each.
        assert_eq!(icc_regs(4 << 8).len(), 7 + 2);
        assert_eq!(icc_regs(5 << 8).len(), 7 + 4);
        assert_eq!(icc_regs(6 << 8).len(), 7 + 8);
        // ICC_SRE_EL1 first: op0=3 op1=0 CRn=12 CRm=12 op2=5.
        assert_eq!(icc_regs(0)[0], 0xc665);
        assert_eq!(ICC_CTLR_EL1, 0xc664);
    }

    #[test]
    fn a_saved_state_of_this_layout_is_accepted() {
        check_layout(&state(2), 2).unwrap();
    }

    #[test]
    fn a_state_of_another_layout_is_refused() {
        let mut fewer = state(1);
        fewer.dist.pop();
        let mut moved = state(1);
        moved.vcpus[0].redist[1].offset = 0x1_0180;
        let mut aprs = state(1);
        aprs.vcpus[0].icc.pop();

        assert!(check_layout(&state(1), 2).is_err(), "vCPU count");
        assert!(check_layout(&fewer, 1).is_err());
        assert!(check_layout(&moved, 1).is_err());
        let err = check_layout(&aprs, 1).unwrap_err();
        assert!(err.to_string().contains("CPU interface"), "{err}");
    }

    #[test]
    fn gic_state_round_trips_through_json() {
        let mut s = state(2);
        s.dist[0].value = 0x13;
        s.vcpus[1].icc[0].value = 7;

        let json = serde_json::to_string(&s).unwrap();
        let back: GicState = serde_json::from_str(&json).unwrap();

        assert_eq!(back, s);
    }
}

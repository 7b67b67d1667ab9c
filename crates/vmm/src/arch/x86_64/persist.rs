//! Saving and restoring the KVM state of an x86_64 VM and its vCPUs, for snapshots.
//!
//! [`save_vm`] and [`save_vcpu`] read everything KVM holds for a paused VM (guest memory and
//! device models are saved elsewhere); [`restore_vm`] then [`restore_vcpu`] write it into a new
//! VM built the normal way (in-kernel irqchip and PIT2 already created, vCPUs created but never
//! run). Section numbers refer to Linux `Documentation/virt/kvm/api.rst` (6.1).
//!
//! The order of the ioctls matters; both orders follow Firecracker's x86_64 `KvmVcpu`
//! `save_state`/`restore_state` (itself from Cloud Hypervisor), with the reasons, checked
//! against Linux 6.1's arch/x86/kvm, given where each call is made.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
    kvm_xsave2, CpuId, Msrs, Xsave, KVM_CLOCK_TSC_STABLE, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use super::cpuid::{ECX_CMP_LEGACY, ECX_HYPERVISOR, ECX_TSC_DEADLINE, EDX_HTT};
use super::msr::MSR_MTRR_DEF_TYPE;

/// IA32_TSC_DEADLINE (Intel SDM vol. 4): must be written after IA32_TSC and the LAPIC.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// Most MSRs one `KVM_GET_MSRS`/`KVM_SET_MSRS` takes: the kernel refuses `nmsrs >= 256`
/// with E2BIG (`MAX_IO_MSRS`, arch/x86/kvm/x86.c `msr_io`).
const MSRS_PER_CALL: usize = 255;

/// Size in bytes of `struct kvm_xsave` (`region[1024]` of `__u32`), what `KVM_GET_XSAVE`
/// returns (§4.42).
const KVM_XSAVE_BYTES: usize = std::mem::size_of::<kvm_xsave>();

/// [`KVM_XSAVE_BYTES`] in 32-bit words.
const KVM_XSAVE_WORDS: usize = KVM_XSAVE_BYTES / 4;

/// Errors saving or restoring KVM state; each names the ioctl or check that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A KVM ioctl failed.
    #[error("{ioctl} failed: {source}")]
    Ioctl {
        /// The ioctl, e.g. `KVM_GET_REGS`.
        ioctl: &'static str,
        /// Its error.
        source: kvm_ioctls::Error,
    },
    /// The argument of an ioctl (MSR list, XSAVE area) could not be allocated.
    #[error("cannot build the {what} for {ioctl}: {source:?}")]
    Build {
        /// The ioctl it was for.
        ioctl: &'static str,
        /// What was being built.
        what: &'static str,
        /// The allocation error.
        source: vmm_sys_util::fam::Error,
    },
    /// `KVM_SET_MSRS` stopped at an MSR it refused (§4.19).
    #[error("KVM_SET_MSRS set {set} of {total} MSRs; it refused MSR {refused:#x}")]
    MsrRefused {
        /// MSRs set before the refused one.
        set: usize,
        /// MSRs in the saved state.
        total: usize,
        /// Index of the first MSR KVM did not set.
        refused: u32,
    },
    /// The saved XSAVE area is shorter than `struct kvm_xsave`.
    #[error("KVM_SET_XSAVE needs at least {KVM_XSAVE_WORDS} 32-bit words of XSAVE area; the saved state has {0}")]
    XsaveLength(usize),
    /// The saved CPUID advertises feature bits this host's KVM does not offer.
    #[error(
        "saved CPUID leaf {leaf:#x}.{subleaf} {register} advertises bits {bits:#010x} that this \
         host's KVM_GET_SUPPORTED_CPUID does not offer"
    )]
    CpuidFeatures {
        /// CPUID leaf (EAX input).
        leaf: u32,
        /// CPUID subleaf (ECX input).
        subleaf: u32,
        /// The output register, e.g. `"ECX"`.
        register: &'static str,
        /// The bits the host lacks.
        bits: u32,
    },
    /// The saved CPUID's vendor string differs from the host's.
    #[error("saved CPUID vendor {saved:?} differs from this host's {host:?} (KVM_GET_SUPPORTED_CPUID leaf 0)")]
    CpuidVendor {
        /// Vendor string of the saved CPUID (leaf 0 EBX, EDX, ECX).
        saved: String,
        /// Vendor string of the host's supported CPUID.
        host: String,
    },
}

/// Maps a kvm-ioctls error to [`Error::Ioctl`] naming `ioctl`.
fn ioctl(ioctl: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |source| Error::Ioctl { ioctl, source }
}

/// Maps an allocation error to [`Error::Build`].
fn build(ioctl: &'static str, what: &'static str) -> impl Fn(vmm_sys_util::fam::Error) -> Error {
    move |source| Error::Build {
        ioctl,
        what,
        source,
    }
}

/// Everything KVM holds for one x86_64 vCPU. Read with [`save_vcpu`], written with
/// [`restore_vcpu`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VcpuState {
    /// CPUID as the guest sees it (`KVM_GET_CPUID2`, §4.20), serialized as its entries.
    #[serde(with = "fam_entries")]
    pub cpuid: CpuId,
    /// Multiprocessing state: runnable, halted, waiting for SIPI... (`KVM_GET_MP_STATE`, §4.38).
    pub mp_state: kvm_mp_state,
    /// General-purpose registers, RIP and RFLAGS (`KVM_GET_REGS`, §4.11).
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers, EFER and APIC base
    /// (`KVM_GET_SREGS`, §4.13).
    pub sregs: kvm_sregs,
    /// The FPU/SSE/AVX... state in XSAVE standard format, as 32-bit words: the 1024 of
    /// `KVM_GET_XSAVE` (§4.42), or more from `KVM_GET_XSAVE2` (§4.134) when the state is larger
    /// than 4096 bytes (dynamically enabled features such as AMX).
    pub xsave: Vec<u32>,
    /// Extended control registers, XCR0 (`KVM_GET_XCRS`, §4.44).
    pub xcrs: kvm_xcrs,
    /// DR0-DR3, DR6, DR7 (`KVM_GET_DEBUGREGS`, §4.33).
    pub debugregs: kvm_debugregs,
    /// The local APIC's registers (`KVM_GET_LAPIC`, §4.57).
    pub lapic: kvm_lapic_state,
    /// The MSRs that could be read, in restore order (see [`saveable_msrs`]), serialized as
    /// their entries (`KVM_GET_MSRS`, §4.18).
    #[serde(with = "fam_entries")]
    pub msrs: Msrs,
    /// Pending and injected exceptions, interrupts, NMIs, SMIs and the interrupt shadow
    /// (`KVM_GET_VCPU_EVENTS`, §4.31).
    pub vcpu_events: kvm_vcpu_events,
    /// The guest's TSC frequency in kHz (`KVM_GET_TSC_KHZ`, §4.56); `None` when KVM could not
    /// report it.
    pub tsc_khz: Option<u32>,
}

/// The VM-wide KVM state of an x86_64 VM: in-kernel PICs, IOAPIC, PIT and kvmclock. Read with
/// [`save_vm`], written with [`restore_vm`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmState {
    /// The master 8259 PIC (`KVM_GET_IRQCHIP` chip 0, §4.26).
    pub pic_master: kvm_irqchip,
    /// The slave 8259 PIC (`KVM_GET_IRQCHIP` chip 1).
    pub pic_slave: kvm_irqchip,
    /// The IOAPIC (`KVM_GET_IRQCHIP` chip 2).
    pub ioapic: kvm_irqchip,
    /// The 8254 PIT (`KVM_GET_PIT2`, §4.72).
    pub pit2: kvm_pit_state2,
    /// kvmclock, in ns (`KVM_GET_CLOCK`, §4.29).
    pub clock: kvm_clock_data,
}

/// Reads the state of `vcpu`, with the MSRs of `msr_list` (from [`saveable_msrs`]) that KVM
/// lets it read. The vCPU must be out of `KVM_RUN`: call it on the vCPU's own thread while the
/// VM is paused.
///
/// An MSR that `KVM_GET_MSRS` refuses (§4.18: it stops at the first MSR it cannot read, e.g.
/// one whose feature this vCPU's CPUID does not have) is left out of the state.
///
/// # Errors
/// [`Error::Ioctl`] naming the ioctl that failed; [`Error::Build`].
pub fn save_vcpu(vcpu: &VcpuFd, msr_list: &[u32]) -> Result<VcpuState, Error> {
    // KVM_GET_MP_STATE first: it runs kvm_apic_accept_events(), which may change the vCPU and
    // LAPIC state that the other calls read.
    let mp_state = vcpu.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE"))?;
    let regs = vcpu.get_regs().map_err(ioctl("KVM_GET_REGS"))?;
    let sregs = vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?;
    let xsave = save_xsave(vcpu)?;
    let xcrs = vcpu.get_xcrs().map_err(ioctl("KVM_GET_XCRS"))?;
    let debugregs = vcpu.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS"))?;
    let lapic = vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?;
    let msrs = save_msrs(vcpu, msr_list)?;
    // KVM_GET_VCPU_EVENTS last: the other GET ioctls may update the pending events.
    let vcpu_events = vcpu
        .get_vcpu_events()
        .map_err(ioctl("KVM_GET_VCPU_EVENTS"))?;
    let cpuid = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_CPUID2"))?;
    let tsc_khz = vcpu
        .get_tsc_khz()
        .inspect_err(|e| tracing::debug!("KVM_GET_TSC_KHZ failed, TSC frequency not saved: {e}"))
        .ok();
    Ok(VcpuState {
        cpuid,
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        msrs,
        vcpu_events,
        tsc_khz,
    })
}

/// Writes `state` into `vcpu`, a vCPU that has never run, of a VM whose state [`restore_vm`]
/// has already restored.
///
/// If `state.tsc_khz` differs from the vCPU's TSC frequency, `KVM_SET_TSC_KHZ` (§4.55) scales
/// the guest's TSC to it; when KVM cannot (no TSC scaling on this host) a warning is logged and
/// the restore goes on with the TSC at this host's rate (kvmclock, computed from that rate,
/// stays right; a guest timing with the raw TSC does not).
///
/// # Errors
/// [`Error::Ioctl`] naming the ioctl that failed; [`Error::MsrRefused`];
/// [`Error::XsaveLength`]; [`Error::Build`].
pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState) -> Result<(), Error> {
    // KVM_SET_CPUID2 first: KVM checks the other state (XCR0, MSRs, CR4 bits, PMU) against
    // the guest's CPUID (§4.20; arch/x86/kvm/cpuid.c kvm_vcpu_after_set_cpuid).
    vcpu.set_cpuid2(&state.cpuid)
        .map_err(ioctl("KVM_SET_CPUID2"))?;
    // The TSC rate before IA32_TSC is written: the MSR write converts with the scaling ratio.
    restore_tsc_khz(vcpu, state.tsc_khz);
    // MP state before the registers: an INIT/SIPI state set afterwards would reset them on the
    // next KVM_RUN (arch/x86/kvm/x86.c kvm_arch_vcpu_ioctl_set_mpstate, kvm_apic_accept_events).
    vcpu.set_mp_state(state.mp_state)
        .map_err(ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&state.regs).map_err(ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&state.sregs)
        .map_err(ioctl("KVM_SET_SREGS"))?;
    restore_xsave(vcpu, &state.xsave)?;
    vcpu.set_xcrs(&state.xcrs).map_err(ioctl("KVM_SET_XCRS"))?;
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(ioctl("KVM_SET_DEBUGREGS"))?;
    // The LAPIC after KVM_SET_SREGS, which sets the APIC base (and x2APIC mode, which changes
    // how KVM_SET_LAPIC reads the APIC ID), and before the MSRs: a write of IA32_TSC_DEADLINE
    // is dropped unless the LAPIC timer is in TSC-deadline mode (§4.58; arch/x86/kvm/lapic.c
    // kvm_set_lapic_tscdeadline_msr).
    vcpu.set_lapic(&state.lapic)
        .map_err(ioctl("KVM_SET_LAPIC"))?;
    restore_msrs(vcpu, &state.msrs)?;
    // Events last (§4.32): KVM_SET_REGS clears the pending exception and KVM_SET_SREGS queues
    // the interrupt of its interrupt_bitmap (arch/x86/kvm/x86.c __set_regs, __set_sregs);
    // this puts back exceptions, interrupts, NMIs and SMIs as they were saved.
    vcpu.set_vcpu_events(&state.vcpu_events)
        .map_err(ioctl("KVM_SET_VCPU_EVENTS"))
}

/// The MSRs worth saving: `KVM_GET_MSR_INDEX_LIST` (§4.3: the MSRs KVM supports for guests,
/// KVM's paravirtual ones included) and the MTRRs, which KVM emulates but leaves out of that
/// list (arch/x86/kvm/mtrr.c; QEMU's target/i386/kvm/kvm.c saves them by name too), with
/// IA32_TSC_DEADLINE moved last so that it is restored after IA32_TSC and the LAPIC.
///
/// None is filtered out here: which ones a vCPU can read depends on its CPUID, so
/// [`save_vcpu`] leaves out those `KVM_GET_MSRS` refuses. The MCE bank MSRs are not saved:
/// KVM leaves them out of the list (§4.3) and this VMM never injects machine checks.
///
/// # Errors
/// [`Error::Ioctl`] (`KVM_GET_MSR_INDEX_LIST`).
pub fn saveable_msrs(kvm: &Kvm) -> Result<Vec<u32>, Error> {
    let list = kvm
        .get_msr_index_list()
        .map_err(ioctl("KVM_GET_MSR_INDEX_LIST"))?;
    let mut msrs = list.as_slice().to_vec();
    for mtrr in mtrr_msrs() {
        if !msrs.contains(&mtrr) {
            msrs.push(mtrr);
        }
    }
    msrs.sort_by_key(|&index| index == MSR_IA32_TSC_DEADLINE);
    Ok(msrs)
}

/// The MTRR MSRs KVM emulates (Intel SDM vol. 3A §12.11): IA32_MTRR_PHYSBASE0..PHYSMASK7 (the
/// 8 variable ranges of KVM's IA32_MTRRCAP), the 11 fixed ranges, IA32_MTRR_DEF_TYPE.
fn mtrr_msrs() -> impl Iterator<Item = u32> {
    const PHYSBASE0: u32 = 0x200;
    const FIX64K_00000: u32 = 0x250;
    const FIX16K_80000: u32 = 0x258;
    const FIX16K_A0000: u32 = 0x259;
    const FIX4K_C0000: u32 = 0x268;
    (PHYSBASE0..PHYSBASE0 + 16)
        .chain([FIX64K_00000, FIX16K_80000, FIX16K_A0000])
        .chain(FIX4K_C0000..FIX4K_C0000 + 8)
        .chain([MSR_MTRR_DEF_TYPE])
}

/// Reads the VM-wide state: the three in-kernel interrupt controllers, the PIT and kvmclock.
/// The vCPUs must be paused.
///
/// # Errors
/// [`Error::Ioctl`] naming the ioctl that failed.
pub fn save_vm(vm: &VmFd) -> Result<VmState, Error> {
    Ok(VmState {
        pic_master: save_irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: save_irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: save_irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit2: vm.get_pit2().map_err(ioctl("KVM_GET_PIT2"))?,
        clock: vm.get_clock().map_err(ioctl("KVM_GET_CLOCK"))?,
    })
}

/// Writes `state` into `vm`, whose in-kernel irqchip (`KVM_CREATE_IRQCHIP`, §4.24) and PIT
/// (`KVM_CREATE_PIT2`, §4.71) exist, before its vCPUs are restored.
///
/// kvmclock is set with KVM_CLOCK_TSC_STABLE cleared: kernels before 5.16 refuse any flag in
/// `KVM_SET_CLOCK`, later ones ignore it (§4.30). A saved KVM_CLOCK_REALTIME is kept, so KVM
/// advances kvmclock by the real time elapsed since the save.
///
/// # Errors
/// [`Error::Ioctl`] naming the ioctl that failed.
pub fn restore_vm(vm: &VmFd, state: &VmState) -> Result<(), Error> {
    vm.set_pit2(&state.pit2).map_err(ioctl("KVM_SET_PIT2"))?;
    let clock = kvm_clock_data {
        flags: state.clock.flags & !KVM_CLOCK_TSC_STABLE,
        ..state.clock
    };
    vm.set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK"))?;
    restore_irqchip(vm, KVM_IRQCHIP_PIC_MASTER, &state.pic_master)?;
    restore_irqchip(vm, KVM_IRQCHIP_PIC_SLAVE, &state.pic_slave)?;
    restore_irqchip(vm, KVM_IRQCHIP_IOAPIC, &state.ioapic)
}

/// The feature registers [`check_cpuid`] compares, as (leaf, subleaf, register, bits to
/// ignore). The ignored bits are not the host's to offer: this VMM sets them (hypervisor,
/// TSC-deadline, HTT, CmpLegacy; see [`super::cpuid`]) or KVM mirrors guest state into them
/// (OSXSAVE = CR4.OSXSAVE, OSPKE = CR4.PKE; arch/x86/kvm/cpuid.c kvm_update_cpuid_runtime).
const FEATURE_REGISTERS: [(u32, u32, Register, u32); 8] = [
    (
        0x1,
        0,
        Register::Ecx,
        ECX_HYPERVISOR | ECX_TSC_DEADLINE | ECX_OSXSAVE,
    ),
    (0x1, 0, Register::Edx, EDX_HTT),
    (0x7, 0, Register::Ebx, 0),
    (0x7, 0, Register::Ecx, ECX_OSPKE),
    (0x7, 0, Register::Edx, 0),
    (0x8000_0001, 0, Register::Ecx, ECX_CMP_LEGACY),
    (0x8000_0001, 0, Register::Edx, 0),
    (0xd, 1, Register::Eax, 0),
];

/// CPUID.1:ECX bit 27: OS has set CR4.OSXSAVE.
const ECX_OSXSAVE: u32 = 1 << 27;
/// CPUID.(EAX=7,ECX=0):ECX bit 4: OS has set CR4.PKE.
const ECX_OSPKE: u32 = 1 << 4;

/// A CPUID output register.
#[derive(Clone, Copy, Debug)]
enum Register {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

impl Register {
    fn name(self) -> &'static str {
        match self {
            Self::Eax => "EAX",
            Self::Ebx => "EBX",
            Self::Ecx => "ECX",
            Self::Edx => "EDX",
        }
    }

    fn read(self, entry: &kvm_cpuid_entry2) -> u32 {
        match self {
            Self::Eax => entry.eax,
            Self::Ebx => entry.ebx,
            Self::Ecx => entry.ecx,
            Self::Edx => entry.edx,
        }
    }
}

/// Refuses a saved CPUID this host cannot give the guest: one with another vendor string, or
/// one advertising a feature bit (in leaves 0x1 ECX/EDX, 0x7.0 EBX/ECX/EDX, 0x8000_0001
/// ECX/EDX, 0xD.1 EAX) that this host's `KVM_GET_SUPPORTED_CPUID` (§4.46) does not offer. Call
/// it before [`restore_vcpu`]: a guest that finds a feature gone faults on its instructions.
///
/// kvm_pvm's `KVM_GET_CPUID2` reports this CPU's own feature bits rather than those set with
/// `KVM_SET_CPUID2`, so a state saved under kvm_pvm fails this check even on the same host.
///
/// # Errors
/// [`Error::CpuidVendor`]; [`Error::CpuidFeatures`] naming the first leaf, register and bits
/// that differ; [`Error::Ioctl`] (`KVM_GET_SUPPORTED_CPUID`).
pub fn check_cpuid(kvm: &Kvm, saved: &CpuId) -> Result<(), Error> {
    let host = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_SUPPORTED_CPUID"))?;
    let (saved, host) = (saved.as_slice(), host.as_slice());
    let (saved_vendor, host_vendor) = (vendor(saved), vendor(host));
    if saved_vendor != host_vendor {
        return Err(Error::CpuidVendor {
            saved: saved_vendor,
            host: host_vendor,
        });
    }
    for (leaf, subleaf, register, ignored) in FEATURE_REGISTERS {
        let bits = |entries| leaf_entry(entries, leaf, subleaf).map_or(0, |e| register.read(e));
        let missing = bits(saved) & !bits(host) & !ignored;
        if missing != 0 {
            return Err(Error::CpuidFeatures {
                leaf,
                subleaf,
                register: register.name(),
                bits: missing,
            });
        }
    }
    Ok(())
}

/// The entry of `entries` for `leaf`.`subleaf`.
fn leaf_entry(entries: &[kvm_cpuid_entry2], leaf: u32, subleaf: u32) -> Option<&kvm_cpuid_entry2> {
    entries
        .iter()
        .find(|e| e.function == leaf && e.index == subleaf)
}

/// The vendor string of leaf 0 (EBX, EDX, ECX), empty without leaf 0.
fn vendor(entries: &[kvm_cpuid_entry2]) -> String {
    leaf_entry(entries, 0, 0).map_or_else(String::new, |e| {
        let bytes: Vec<u8> = [e.ebx, e.edx, e.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Reads the MSRs of `indices` in calls of at most [`MSRS_PER_CALL`], leaving out each one
/// `KVM_GET_MSRS` refuses (it returns how many it read, stopping at the first it cannot).
fn save_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Msrs, Error> {
    let mut saved = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MSRS_PER_CALL)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(build("KVM_GET_MSRS", "MSR list"))?;
        let read = vcpu.get_msrs(&mut msrs).map_err(ioctl("KVM_GET_MSRS"))?;
        saved.extend_from_slice(&msrs.as_slice()[..read]);
        let skipped = usize::from(read < chunk.len());
        if let Some(refused) = chunk.get(read) {
            tracing::debug!("KVM_GET_MSRS refused MSR {refused:#x}; not saved");
        }
        rest = &rest[read + skipped..];
    }
    Msrs::from_entries(&saved).map_err(build("KVM_GET_MSRS", "saved MSR list"))
}

/// Writes `msrs` in calls of at most [`MSRS_PER_CALL`], IA32_TSC_DEADLINE last: KVM arms the
/// LAPIC timer against the guest TSC when the deadline is written, so IA32_TSC must already
/// hold its saved value.
fn restore_msrs(vcpu: &VcpuFd, msrs: &Msrs) -> Result<(), Error> {
    let mut entries = msrs.as_slice().to_vec();
    entries.sort_by_key(|e| e.index == MSR_IA32_TSC_DEADLINE);
    for (n, chunk) in entries.chunks(MSRS_PER_CALL).enumerate() {
        let request = Msrs::from_entries(chunk).map_err(build("KVM_SET_MSRS", "MSR list"))?;
        let set = vcpu.set_msrs(&request).map_err(ioctl("KVM_SET_MSRS"))?;
        if let Some(refused) = chunk.get(set) {
            return Err(Error::MsrRefused {
                set: n * MSRS_PER_CALL + set,
                total: entries.len(),
                refused: refused.index,
            });
        }
    }
    Ok(())
}

/// Scales the guest TSC to `saved` kHz if that differs from the vCPU's current rate; a
/// failure is logged, not returned (see [`restore_vcpu`]).
///
/// A refused `KVM_SET_TSC_KHZ` has already changed the rate KVM reports and gives the guest's
/// kvmclock (arch/x86/kvm/x86.c kvm_set_tsc_khz sets `virtual_tsc_khz` before failing), so the
/// current rate is then set back.
fn restore_tsc_khz(vcpu: &VcpuFd, saved: Option<u32>) {
    let Some(khz) = saved else { return };
    let current = vcpu.get_tsc_khz().ok();
    if current == Some(khz) {
        return;
    }
    let Err(e) = vcpu.set_tsc_khz(khz) else {
        return;
    };
    tracing::warn!("KVM_SET_TSC_KHZ {khz} kHz failed, the guest TSC keeps this host's rate: {e}");
    if let Some(Err(e)) = current.map(|current| vcpu.set_tsc_khz(current)) {
        tracing::warn!("KVM_SET_TSC_KHZ back to this host's rate failed: {e}");
    }
}

/// An upper bound, in bytes, of the XSAVE area KVM copies in `KVM_GET_XSAVE2` and
/// `KVM_SET_XSAVE`: the guest FPU's `uabi_size`, which is 4096 or the standard-format size of
/// the XSAVE features this process may give guests (arch/x86/kernel/fpu/core.c
/// fpu_alloc_guest_fpstate, xstate.c fpstate_realloc). CPUID.(EAX=0xD,ECX=0):ECX is the
/// standard-format size for every feature this CPU supports (Intel SDM vol. 1 §13.2), so at
/// least that.
fn xsave_bound_bytes() -> usize {
    // SAFETY: CPUID exists on every x86_64 CPU and only reads registers; the intrinsic is
    // `unsafe` on older Rust toolchains only (hence the `allow`).
    #[allow(unused_unsafe)]
    let max = unsafe { std::arch::x86_64::__cpuid_count(0xd, 0) }.ecx as usize;
    max.max(KVM_XSAVE_BYTES)
}

/// Reads the XSAVE area: `KVM_GET_XSAVE` (§4.42), or `KVM_GET_XSAVE2` (§4.134) when the former
/// refuses with EINVAL because the area is larger than 4096 bytes (KVM_CAP_XSAVE2 > 4096).
fn save_xsave(vcpu: &VcpuFd) -> Result<Vec<u32>, Error> {
    match vcpu.get_xsave() {
        Ok(xsave) => Ok(xsave.region.to_vec()),
        Err(e) if e.errno() == libc::EINVAL && xsave_bound_bytes() > KVM_XSAVE_BYTES => {
            save_xsave2(vcpu)
        }
        Err(e) => Err(ioctl("KVM_GET_XSAVE")(e)),
    }
}

/// Reads the XSAVE area with `KVM_GET_XSAVE2` into a buffer of [`xsave_bound_bytes`].
fn save_xsave2(vcpu: &VcpuFd) -> Result<Vec<u32>, Error> {
    let extra_words = (xsave_bound_bytes() - KVM_XSAVE_BYTES).div_ceil(4);
    let mut xsave = Xsave::new(extra_words).map_err(build("KVM_GET_XSAVE2", "XSAVE area"))?;
    // SAFETY: `xsave` holds 4096 + 4 * `extra_words` bytes, at least `xsave_bound_bytes()`,
    // which bounds the `uabi_size` bytes KVM writes.
    unsafe { vcpu.get_xsave2(&mut xsave) }.map_err(ioctl("KVM_GET_XSAVE2"))?;
    let mut words = xsave.as_fam_struct_ref().xsave.region.to_vec();
    words.extend_from_slice(xsave.as_slice());
    Ok(words)
}

/// Writes the XSAVE area `words` with `KVM_SET_XSAVE` (§4.43), which reads the guest FPU's
/// `uabi_size` bytes: from a `kvm_xsave` when that is at most 4096 bytes here, else from a
/// buffer padded with zeros (features in their initial state) to [`xsave_bound_bytes`].
fn restore_xsave(vcpu: &VcpuFd, words: &[u32]) -> Result<(), Error> {
    let (region, extra) = words
        .split_first_chunk::<KVM_XSAVE_WORDS>()
        .ok_or(Error::XsaveLength(words.len()))?;
    let xsave = kvm_xsave {
        region: *region,
        ..Default::default()
    };
    let bound_words = xsave_bound_bytes().div_ceil(4);
    if extra.is_empty() && bound_words <= KVM_XSAVE_WORDS {
        // SAFETY: KVM reads `uabi_size` bytes, at most `xsave_bound_bytes()` = 4096 here, the
        // size of `xsave`.
        return unsafe { vcpu.set_xsave(&xsave) }.map_err(ioctl("KVM_SET_XSAVE"));
    }
    let mut buffer = Xsave::from_header(kvm_xsave2::from(xsave))
        .map_err(build("KVM_SET_XSAVE", "XSAVE area"))?;
    let padding = bound_words.saturating_sub(words.len());
    for &word in extra.iter().chain(std::iter::repeat_n(&0, padding)) {
        buffer
            .push(word)
            .map_err(build("KVM_SET_XSAVE", "XSAVE area"))?;
    }
    // SAFETY: `buffer` holds at least `xsave_bound_bytes()` bytes, which bounds the
    // `uabi_size` bytes KVM reads.
    unsafe { vcpu.set_xsave2(&buffer) }.map_err(ioctl("KVM_SET_XSAVE"))
}

/// Reads in-kernel interrupt controller `chip_id` (`KVM_GET_IRQCHIP`, §4.26).
fn save_irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, Error> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(ioctl("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

/// Writes `saved` into in-kernel interrupt controller `chip_id` (`KVM_SET_IRQCHIP`, §4.27),
/// whatever chip the saved state names.
fn restore_irqchip(vm: &VmFd, chip_id: u32, saved: &kvm_irqchip) -> Result<(), Error> {
    let chip = kvm_irqchip { chip_id, ..*saved };
    vm.set_irqchip(&chip).map_err(ioctl("KVM_SET_IRQCHIP"))
}

/// Serde for the FAM wrappers (`CpuId`, `Msrs`) as the list of their entries, which
/// kvm-bindings serializes.
mod fam_entries {
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use vmm_sys_util::fam::{FamStruct, FamStructWrapper};

    pub(super) fn serialize<T, S>(
        fam: &FamStructWrapper<T>,
        serializer: S,
    ) -> Result<S::Ok, S::Error>
    where
        T: Default + FamStruct,
        T::Entry: Serialize,
        S: Serializer,
    {
        fam.as_slice().serialize(serializer)
    }

    pub(super) fn deserialize<'de, T, D>(deserializer: D) -> Result<FamStructWrapper<T>, D::Error>
    where
        T: Default + FamStruct,
        T::Entry: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        let entries = Vec::<T::Entry>::deserialize(deserializer)?;
        FamStructWrapper::from_entries(&entries)
            .map_err(|e| D::Error::custom(format!("{} entries: {e:?}", entries.len())))
    }
}

#[cfg(test)]
#[path = "persist_tests.rs"]
mod persist_tests;

//! Per-vCPU CPUID: what KVM supports, with the topology of this VM written in.
//!
//! `KVM_GET_SUPPORTED_CPUID` describes the host's features but not the guest's shape: its APIC
//! IDs, processor counts and cache sharing still say "host". The guest is presented as one
//! socket with one core per vCPU and one thread per core, vCPU `n` having (x2)APIC ID `n`.
//! Leaves touched (Intel SDM vol. 2A "CPUID"; AMD APM vol. 3, appendix E):
//!
//! - 0x1: EBX\[31:24\] initial APIC ID, EBX\[23:16\] addressable logical processor IDs,
//!   EDX\[28\] HTT (more than one logical processor), ECX\[31\] hypervisor present,
//!   ECX\[24\] TSC-deadline timer (emulated by KVM's LAPIC).
//! - 0x4 (deterministic cache parameters): EAX\[31:26\] cores per package - 1,
//!   EAX\[25:14\] logical processors sharing the cache - 1 (L1/L2 private, L3 shared).
//! - 0xB and 0x1F (extended topology): rebuilt as an SMT level of 1 thread and a core level
//!   of `nr_vcpus` cores, EDX = x2APIC ID on every subleaf.
//! - AMD 0x8000_0001 ECX\[1\] CmpLegacy (HTT counts cores, not threads), 0x8000_0008 ECX
//!   (core count, APIC ID core bits), 0x8000_001D (cache sharing), 0x8000_001E (extended
//!   APIC ID, core ID, one thread per core, node 0).
//!
//! KVM's paravirtual leaves (0x4000_0000 and up) and everything else pass through unchanged.

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_CPUID_FLAG_SIGNIFCANT_INDEX};

use super::layout::MAX_VCPUS;

/// Errors building a vCPU's CPUID.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vCPU index or count is out of range.
    #[error("invalid vCPU topology: vCPU {vcpu_id} of {nr_vcpus} (1..={MAX_VCPUS} vCPUs)")]
    Topology {
        /// The vCPU index.
        vcpu_id: u8,
        /// The vCPU count.
        nr_vcpus: u8,
    },
    /// The fixed-up entry list could not be turned back into a `CpuId`.
    #[error("cannot build the CPUID table ({0} entries): {1:?}")]
    TooManyEntries(usize, vmm_sys_util::fam::Error),
}

/// Leaf 0x1: version and feature information.
pub const LEAF_FEATURES: u32 = 0x1;
/// Leaf 0x4: deterministic cache parameters (Intel).
pub const LEAF_CACHE_PARAMS: u32 = 0x4;
/// Leaf 0xB: extended topology enumeration.
pub const LEAF_EXT_TOPOLOGY: u32 = 0xb;
/// Leaf 0x1F: V2 extended topology enumeration.
pub const LEAF_EXT_TOPOLOGY_V2: u32 = 0x1f;
/// Leaf 0x8000_0001: extended feature flags.
pub const LEAF_EXT_FEATURES: u32 = 0x8000_0001;
/// Leaf 0x8000_0008: address sizes and (AMD) core count.
pub const LEAF_ADDR_SIZES: u32 = 0x8000_0008;
/// Leaf 0x8000_001D: AMD cache topology.
pub const LEAF_AMD_CACHE_TOPOLOGY: u32 = 0x8000_001d;
/// Leaf 0x8000_001E: AMD extended APIC ID, core and node IDs.
pub const LEAF_AMD_EXT_APIC_ID: u32 = 0x8000_001e;

/// CPUID.1:ECX bit 31: running under a hypervisor.
pub const ECX_HYPERVISOR: u32 = 1 << 31;
/// CPUID.1:ECX bit 24: the local APIC timer has TSC-deadline mode. KVM emulates it in its
/// in-kernel LAPIC (KVM_CAP_TSC_DEADLINE_TIMER) but leaves the bit clear in
/// `KVM_GET_SUPPORTED_CPUID`; with it set Linux skips calibrating the APIC timer against the
/// PIT, which takes 100 ms of every boot (`calibrate_APIC_clock`, `LAPIC_CAL_LOOPS`).
pub const ECX_TSC_DEADLINE: u32 = 1 << 24;
/// CPUID.1:EDX bit 28: the logical processor count field in EBX\[23:16\] is valid.
pub const EDX_HTT: u32 = 1 << 28;
/// CPUID.8000_0001:ECX bit 1 (AMD CmpLegacy): the HTT count is a count of cores.
pub const ECX_CMP_LEGACY: u32 = 1 << 1;

/// Level type 1 in leaf 0xB/0x1F ECX\[15:8\]: SMT (threads).
const LEVEL_SMT: u32 = 1;
/// Level type 2 in leaf 0xB/0x1F ECX\[15:8\]: core.
const LEVEL_CORE: u32 = 2;

/// Where one vCPU sits in the VM: one socket, `nr_vcpus` cores, one thread per core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VcpuTopology {
    vcpu_id: u8,
    nr_vcpus: u8,
}

impl VcpuTopology {
    /// vCPU `vcpu_id` (its APIC ID) of `nr_vcpus`; error unless
    /// `vcpu_id < nr_vcpus <= MAX_VCPUS`.
    pub fn new(vcpu_id: u8, nr_vcpus: u8) -> Result<Self, Error> {
        if vcpu_id >= nr_vcpus || nr_vcpus > MAX_VCPUS {
            return Err(Error::Topology { vcpu_id, nr_vcpus });
        }
        Ok(Self { vcpu_id, nr_vcpus })
    }

    /// Bits of the APIC ID that number the cores: ceil(log2(nr_vcpus)).
    pub fn core_id_bits(&self) -> u32 {
        u32::from(self.nr_vcpus)
            .next_power_of_two()
            .trailing_zeros()
    }

    /// Addressable core IDs in the package: `nr_vcpus` rounded up to a power of two.
    pub fn addressable_ids(&self) -> u32 {
        1 << self.core_id_bits()
    }
}

/// CPU vendor, from the leaf 0 vendor string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vendor {
    /// "GenuineIntel".
    Intel,
    /// "AuthenticAMD" or "HygonGenuine" (AMD's topology leaves).
    Amd,
    /// Anything else.
    Other,
}

/// The vendor named by leaf 0 of `entries` (EBX, EDX, ECX spell the vendor string).
pub fn vendor(entries: &[kvm_cpuid_entry2]) -> Vendor {
    let Some(leaf0) = entries.iter().find(|e| e.function == 0) else {
        return Vendor::Other;
    };
    let mut name = [0u8; 12];
    name[..4].copy_from_slice(&leaf0.ebx.to_le_bytes());
    name[4..8].copy_from_slice(&leaf0.edx.to_le_bytes());
    name[8..].copy_from_slice(&leaf0.ecx.to_le_bytes());
    match &name {
        b"GenuineIntel" => Vendor::Intel,
        b"AuthenticAMD" | b"HygonGenuine" => Vendor::Amd,
        _ => Vendor::Other,
    }
}

/// Replaces the bits `[shift, shift + width)` of `reg` with `value` (truncated to `width`).
fn set_bits(reg: &mut u32, shift: u32, width: u32, value: u32) {
    let mask = ((1u64 << width) - 1) as u32;
    *reg = (*reg & !(mask << shift)) | ((value & mask) << shift);
}

/// The CPUID table for one vCPU: `supported` (from `KVM_GET_SUPPORTED_CPUID`) with the
/// topology of `topo` applied. Entries keep their order; leaves 0xB/0x1F are rebuilt in place.
pub fn vcpu_cpuid_entries(
    supported: &[kvm_cpuid_entry2],
    topo: VcpuTopology,
) -> Vec<kvm_cpuid_entry2> {
    let amd = vendor(supported) == Vendor::Amd;
    let mut out = Vec::with_capacity(supported.len() + 3);
    for entry in supported {
        match entry.function {
            LEAF_EXT_TOPOLOGY | LEAF_EXT_TOPOLOGY_V2 => {
                if entry.index == 0 {
                    out.extend(ext_topology_leaf(entry.function, topo));
                }
                continue;
            }
            _ => out.push(*entry),
        }
        let last = out.len() - 1;
        fix_entry(&mut out[last], topo, amd);
    }
    out
}

/// Applies the topology fixups to one (non-0xB/0x1F) entry.
fn fix_entry(entry: &mut kvm_cpuid_entry2, topo: VcpuTopology, amd: bool) {
    match entry.function {
        LEAF_FEATURES => fix_features_leaf(entry, topo),
        LEAF_CACHE_PARAMS => fix_cache_leaf(entry, topo, true),
        LEAF_EXT_FEATURES if amd => fix_amd_ext_features(entry, topo),
        LEAF_ADDR_SIZES if amd => fix_amd_core_count(entry, topo),
        LEAF_AMD_CACHE_TOPOLOGY if amd => fix_cache_leaf(entry, topo, false),
        LEAF_AMD_EXT_APIC_ID if amd => fix_amd_ext_apic_id(entry, topo),
        _ => {}
    }
}

/// Leaf 0x1: APIC ID, logical processor count, HTT, hypervisor and TSC-deadline bits.
pub fn fix_features_leaf(entry: &mut kvm_cpuid_entry2, topo: VcpuTopology) {
    set_bits(&mut entry.ebx, 24, 8, u32::from(topo.vcpu_id));
    set_bits(&mut entry.ebx, 16, 8, topo.addressable_ids());
    entry.ecx |= ECX_HYPERVISOR | ECX_TSC_DEADLINE;
    if topo.nr_vcpus > 1 {
        entry.edx |= EDX_HTT;
    } else {
        entry.edx &= !EDX_HTT;
    }
}

/// Leaf 0x4 (Intel, `with_core_count`) or 0x8000_001D (AMD): cache sharing. L1 and L2 are
/// private to a core (and its single thread); L3 and beyond are shared by all vCPUs.
pub fn fix_cache_leaf(entry: &mut kvm_cpuid_entry2, topo: VcpuTopology, with_core_count: bool) {
    let cache_type = entry.eax & 0x1f;
    if cache_type == 0 {
        return; // No more caches: subleaf left as the host reported it (all zero).
    }
    let level = (entry.eax >> 5) & 0x7;
    let sharing = if level >= 3 {
        topo.addressable_ids() - 1
    } else {
        0
    };
    set_bits(&mut entry.eax, 14, 12, sharing);
    if with_core_count {
        set_bits(&mut entry.eax, 26, 6, topo.addressable_ids() - 1);
    }
}

/// The subleaves of leaf 0xB or 0x1F for `topo`: SMT level, core level, and the
/// terminating invalid level.
pub fn ext_topology_leaf(function: u32, topo: VcpuTopology) -> [kvm_cpuid_entry2; 3] {
    let x2apic_id = u32::from(topo.vcpu_id);
    let subleaf = |index: u32, shift: u32, count: u32, level_type: u32| kvm_cpuid_entry2 {
        function,
        index,
        flags: KVM_CPUID_FLAG_SIGNIFCANT_INDEX,
        eax: shift,
        ebx: count,
        ecx: (level_type << 8) | index,
        edx: x2apic_id,
        padding: [0; 3],
    };
    [
        subleaf(0, 0, 1, LEVEL_SMT),
        subleaf(1, topo.core_id_bits(), u32::from(topo.nr_vcpus), LEVEL_CORE),
        subleaf(2, 0, 0, 0),
    ]
}

/// AMD leaf 0x8000_0001: CmpLegacy set when there is more than one core, so that the HTT
/// logical processor count is read as a core count (one thread per core).
pub fn fix_amd_ext_features(entry: &mut kvm_cpuid_entry2, topo: VcpuTopology) {
    if topo.nr_vcpus > 1 {
        entry.ecx |= ECX_CMP_LEGACY;
    } else {
        entry.ecx &= !ECX_CMP_LEGACY;
    }
}

/// AMD leaf 0x8000_0008: ECX\[7:0\] cores - 1, ECX\[15:12\] APIC ID bits numbering cores.
pub fn fix_amd_core_count(entry: &mut kvm_cpuid_entry2, topo: VcpuTopology) {
    set_bits(&mut entry.ecx, 0, 8, u32::from(topo.nr_vcpus) - 1);
    set_bits(&mut entry.ecx, 12, 4, topo.core_id_bits());
}

/// AMD leaf 0x8000_001E: extended APIC ID, core ID = vCPU index, one thread per core,
/// a single node.
pub fn fix_amd_ext_apic_id(entry: &mut kvm_cpuid_entry2, topo: VcpuTopology) {
    entry.eax = u32::from(topo.vcpu_id);
    entry.ebx = u32::from(topo.vcpu_id); // [15:8] threads per core - 1 = 0.
    entry.ecx = 0; // Node 0 of 1.
    entry.edx = 0;
}

/// [`vcpu_cpuid_entries`] as a `CpuId` ready for `KVM_SET_CPUID2`.
pub fn vcpu_cpuid(supported: &CpuId, topo: VcpuTopology) -> Result<CpuId, Error> {
    let entries = vcpu_cpuid_entries(supported.as_slice(), topo);
    CpuId::from_entries(&entries).map_err(|e| Error::TooManyEntries(entries.len(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32, regs: [u32; 4]) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: regs[0],
            ebx: regs[1],
            ecx: regs[2],
            edx: regs[3],
            ..Default::default()
        }
    }

    fn vendor_leaf(name: &[u8; 12]) -> kvm_cpuid_entry2 {
        let word = |i: usize| u32::from_le_bytes(name[i..i + 4].try_into().unwrap());
        leaf(0, 0, [0x20, word(0), word(8), word(4)])
    }

    /// A host-like table: 16-thread host values that must be overwritten.
    fn host(vendor: &[u8; 12]) -> Vec<kvm_cpuid_entry2> {
        vec![
            vendor_leaf(vendor),
            leaf(
                1,
                0,
                [0x906ea, 0x0710_0800 | (9 << 24), 0x7efa_fbff, 0xbfeb_fbff],
            ),
            leaf(4, 0, [0x1c00_4121, 0, 0, 0]), // L1d, 8 sharing.
            leaf(4, 3, [0x1c03_c163, 0, 0, 0]), // L3, 16 sharing.
            leaf(4, 4, [0, 0, 0, 0]),
            leaf(0xb, 0, [1, 2, 0x100, 9]),
            leaf(0xb, 1, [4, 16, 0x201, 9]),
            leaf(
                0x4000_0000,
                0,
                [0x4000_0001, 0x4b4d_564b, 0x564b_4d56, 0x4d],
            ),
            leaf(0x8000_0001, 0, [0, 0, 0x0040_0121, 0]),
            leaf(0x8000_0008, 0, [0x3030, 0, 0x700f, 0]),
            leaf(0x8000_001e, 0, [9, 0x0104, 0x0100, 0]),
        ]
    }

    fn find(entries: &[kvm_cpuid_entry2], function: u32, index: u32) -> kvm_cpuid_entry2 {
        *entries
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap_or_else(|| panic!("leaf {function:#x}.{index} missing"))
    }

    #[test]
    fn leaf_1_carries_apic_id_count_htt_hypervisor_and_tsc_deadline_bits() {
        let topo = VcpuTopology::new(2, 3).unwrap();

        let out = vcpu_cpuid_entries(&host(b"GenuineIntel"), topo);

        let l1 = find(&out, 1, 0);
        assert_eq!(l1.ebx >> 24, 2);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_eq!(l1.ebx & 0xffff, 0x0800, "CLFLUSH size and brand index kept");
        assert_ne!(l1.ecx & ECX_HYPERVISOR, 0);
        assert_ne!(l1.ecx & ECX_TSC_DEADLINE, 0, "the host table had it clear");
        assert_ne!(l1.edx & EDX_HTT, 0);
    }

    #[test]
    fn single_vcpu_has_no_htt() {
        let out = vcpu_cpuid_entries(&host(b"GenuineIntel"), VcpuTopology::new(0, 1).unwrap());

        let l1 = find(&out, 1, 0);
        assert_eq!(l1.edx & EDX_HTT, 0);
        assert_eq!(l1.ebx >> 16, 1);
    }

    #[test]
    fn leaf_4_private_l1_shared_l3() {
        let out = vcpu_cpuid_entries(&host(b"GenuineIntel"), VcpuTopology::new(0, 4).unwrap());

        let l1d = find(&out, 4, 0);
        let l3 = find(&out, 4, 3);
        assert_eq!(((l1d.eax >> 14) & 0xfff, l1d.eax >> 26), (0, 3));
        assert_eq!(((l3.eax >> 14) & 0xfff, l3.eax >> 26), (3, 3));
        assert_eq!(l3.eax & 0x3fff, 0x0163, "cache type and level kept");
        assert_eq!(find(&out, 4, 4).eax, 0);
    }

    #[test]
    fn leaf_0xb_is_rebuilt_for_cores_without_smt() {
        let out = vcpu_cpuid_entries(&host(b"GenuineIntel"), VcpuTopology::new(5, 6).unwrap());

        let subleaves: Vec<_> = out.iter().filter(|e| e.function == 0xb).collect();
        assert_eq!(subleaves.len(), 3);
        let regs: Vec<[u32; 4]> = subleaves
            .iter()
            .map(|e| [e.eax, e.ebx, e.ecx, e.edx])
            .collect();
        assert_eq!(regs, [[0, 1, 0x100, 5], [3, 6, 0x201, 5], [0, 0, 2, 5]]);
        assert!(subleaves
            .iter()
            .all(|e| e.flags == KVM_CPUID_FLAG_SIGNIFCANT_INDEX));
    }

    #[test]
    fn paravirt_leaves_pass_through() {
        let supported = host(b"GenuineIntel");

        let out = vcpu_cpuid_entries(&supported, VcpuTopology::new(0, 2).unwrap());

        assert_eq!(find(&out, 0x4000_0000, 0), find(&supported, 0x4000_0000, 0));
    }

    #[test]
    fn intel_leaves_ignore_amd_topology_fixups() {
        let supported = host(b"GenuineIntel");

        let out = vcpu_cpuid_entries(&supported, VcpuTopology::new(1, 2).unwrap());

        assert_eq!(find(&out, 0x8000_0008, 0), find(&supported, 0x8000_0008, 0));
        assert_eq!(find(&out, 0x8000_001e, 0), find(&supported, 0x8000_001e, 0));
    }

    #[test]
    fn amd_leaves_describe_one_thread_per_core() {
        let out = vcpu_cpuid_entries(&host(b"AuthenticAMD"), VcpuTopology::new(1, 3).unwrap());

        let ext = find(&out, 0x8000_0001, 0);
        let sizes = find(&out, 0x8000_0008, 0);
        let apic = find(&out, 0x8000_001e, 0);
        assert_ne!(ext.ecx & ECX_CMP_LEGACY, 0);
        assert_eq!(ext.ecx & (1 << 22), 1 << 22, "TOPOEXT kept");
        assert_eq!((sizes.ecx & 0xff, (sizes.ecx >> 12) & 0xf), (2, 2));
        assert_eq!(sizes.eax, 0x3030, "address sizes kept");
        assert_eq!([apic.eax, apic.ebx, apic.ecx], [1, 1, 0]);
    }

    #[test]
    fn vendor_is_read_from_leaf_0() {
        assert_eq!(vendor(&host(b"GenuineIntel")), Vendor::Intel);
        assert_eq!(vendor(&host(b"AuthenticAMD")), Vendor::Amd);
        assert_eq!(vendor(&host(b"HygonGenuine")), Vendor::Amd);
        assert_eq!(vendor(&[]), Vendor::Other);
    }

    #[test]
    fn topology_rejects_ids_outside_the_vm() {
        assert!(VcpuTopology::new(2, 2).is_err());
        assert!(VcpuTopology::new(0, 0).is_err());
        assert!(VcpuTopology::new(0, MAX_VCPUS + 1).is_err());
        assert!(VcpuTopology::new(MAX_VCPUS - 1, MAX_VCPUS).is_ok());
    }

    #[test]
    fn builds_a_cpuid_wrapper_for_kvm() {
        let supported = CpuId::from_entries(&host(b"GenuineIntel")).unwrap();

        let cpuid = vcpu_cpuid(&supported, VcpuTopology::new(0, 1).unwrap()).unwrap();

        assert_eq!(cpuid.as_slice().len(), supported.as_slice().len() + 1);
    }
}

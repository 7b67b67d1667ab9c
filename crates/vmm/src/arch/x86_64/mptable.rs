//! The MP table: how the guest learns its CPUs and interrupt routing without ACPI.
//!
//! Layout follows the MultiProcessor Specification 1.4 (Intel, 1997), chapter 4. Linux scans
//! the first KiB of the EBDA for the 16-byte MP floating pointer structure (signature `_MP_`),
//! which points to the MP configuration table (signature `PCMP`): a 44-byte header followed by
//! entries sorted by type:
//!
//! | type | entry                  | bytes | what we list                                    |
//! |------|------------------------|-------|-------------------------------------------------|
//! | 0    | processor              | 20    | one per vCPU, APIC ID = vCPU index, BSP = 0     |
//! | 1    | bus                    | 8     | bus 0, "ISA"                                    |
//! | 2    | I/O APIC               | 8     | the in-kernel IOAPIC at [`IOAPIC_START`]        |
//! | 3    | I/O interrupt assign.  | 8     | ISA IRQ n → IOAPIC pin n, n = 0..23             |
//! | 4    | local interrupt assign.| 8     | ExtINT → LINT0, NMI → LINT1 on every local APIC |
//!
//! ISA IRQ n goes to IOAPIC pin n because that is KVM's default GSI routing after
//! `KVM_CREATE_IRQCHIP`. Both structures carry a checksum byte that makes all their bytes sum
//! to zero (mod 256).

use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{
    HIMEM_START, IOAPIC_PINS, IOAPIC_START, LAPIC_START, MAX_VCPUS, MPTABLE_START,
};

/// Errors building or writing the MP table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The vCPU count is outside what the table (and the guest layout) supports.
    #[error("cannot describe {0} vCPUs in the MP table: between 1 and {MAX_VCPUS} are supported")]
    VcpuCount(u8),
    /// The table would not fit in guest memory below 1 MiB.
    #[error("cannot write the MP table ({len} bytes) at GPA {addr:#x}: {source}")]
    Write {
        /// GPA of the table.
        addr: u64,
        /// Size of the table in bytes.
        len: usize,
        /// The guest memory error.
        source: GuestMemoryError,
    },
}

/// Signature of the MP floating pointer structure.
pub const FLOATING_POINTER_SIGNATURE: [u8; 4] = *b"_MP_";
/// Signature of the MP configuration table header.
pub const CONFIG_TABLE_SIGNATURE: [u8; 4] = *b"PCMP";
/// MP specification revision 1.4, as stored in both structures.
pub const SPEC_REV_1_4: u8 = 4;

/// Entry type codes of the configuration table.
pub const ENTRY_PROCESSOR: u8 = 0;
/// Bus entry type.
pub const ENTRY_BUS: u8 = 1;
/// I/O APIC entry type.
pub const ENTRY_IOAPIC: u8 = 2;
/// I/O interrupt assignment entry type.
pub const ENTRY_IO_INTERRUPT: u8 = 3;
/// Local interrupt assignment entry type.
pub const ENTRY_LOCAL_INTERRUPT: u8 = 4;

/// Processor entry CPU flag: the processor is usable.
pub const CPU_ENABLED: u8 = 1 << 0;
/// Processor entry CPU flag: the processor is the bootstrap processor (BSP).
pub const CPU_BOOTSTRAP: u8 = 1 << 1;

/// Interrupt type of an assignment entry: vectored interrupt from the APIC redirection table.
const INT_TYPE_INT: u8 = 0;
/// Interrupt type: non-maskable interrupt.
const INT_TYPE_NMI: u8 = 1;
/// Interrupt type: external (8259-compatible) interrupt.
const INT_TYPE_EXTINT: u8 = 3;
/// Destination local APIC ID meaning "every local APIC".
const ALL_LOCAL_APICS: u8 = 0xff;
/// Version register value of an integrated xAPIC (what KVM's local APIC reports).
const LAPIC_VERSION: u8 = 0x14;
/// Version register value of KVM's in-kernel IOAPIC.
const IOAPIC_VERSION: u8 = 0x11;
/// CPU signature of the processor entries: family 6.
const CPU_SIGNATURE: u32 = 0x600;
/// CPUID.1:EDX features of the processor entries: FPU (bit 0) and on-chip APIC (bit 9).
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);
/// ID of the single (ISA) bus.
const ISA_BUS_ID: u8 = 0;

/// MP floating pointer structure (MP spec 1.4, 4.1), 16 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MpFloatingPointer {
    /// `_MP_`.
    pub signature: [u8; 4],
    /// GPA of the configuration table.
    pub config_table: u32,
    /// Length of this structure in 16-byte paragraphs (1).
    pub length: u8,
    /// Specification revision (4 for 1.4).
    pub spec_rev: u8,
    /// Makes the 16 bytes sum to zero.
    pub checksum: u8,
    /// Feature bytes 1-5; all zero: a configuration table is present, virtual wire mode.
    pub features: [u8; 5],
}

/// MP configuration table header (MP spec 1.4, 4.2), 44 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MpConfigHeader {
    /// `PCMP`.
    pub signature: [u8; 4],
    /// Length of the base table in bytes, this header included.
    pub base_table_length: u16,
    /// Specification revision (4 for 1.4).
    pub spec_rev: u8,
    /// Makes the base table's bytes sum to zero.
    pub checksum: u8,
    /// OEM ID, space padded.
    pub oem_id: [u8; 8],
    /// Product ID, space padded.
    pub product_id: [u8; 12],
    /// GPA of an OEM table (0: none).
    pub oem_table: u32,
    /// Size of the OEM table in bytes.
    pub oem_table_size: u16,
    /// Number of entries following this header.
    pub entry_count: u16,
    /// GPA of the local APIC registers.
    pub lapic_addr: u32,
    /// Length of the extended table in bytes (0: none).
    pub ext_table_length: u16,
    /// Checksum of the extended table.
    pub ext_table_checksum: u8,
    /// Reserved.
    pub reserved: u8,
}

/// Processor entry (MP spec 1.4, 4.3.1), 20 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MpProcessorEntry {
    /// [`ENTRY_PROCESSOR`].
    pub entry_type: u8,
    /// Local APIC ID.
    pub lapic_id: u8,
    /// Local APIC version.
    pub lapic_version: u8,
    /// [`CPU_ENABLED`] and, for the BSP, [`CPU_BOOTSTRAP`].
    pub cpu_flags: u8,
    /// Family/model/stepping as in CPUID.1:EAX.
    pub cpu_signature: u32,
    /// Feature flags as in CPUID.1:EDX.
    pub feature_flags: u32,
    /// Reserved.
    pub reserved: [u32; 2],
}

/// Bus entry (MP spec 1.4, 4.3.2), 8 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MpBusEntry {
    /// [`ENTRY_BUS`].
    pub entry_type: u8,
    /// Bus ID.
    pub bus_id: u8,
    /// Bus type string, space padded.
    pub bus_type: [u8; 6],
}

/// I/O APIC entry (MP spec 1.4, 4.3.3), 8 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MpIoApicEntry {
    /// [`ENTRY_IOAPIC`].
    pub entry_type: u8,
    /// I/O APIC ID.
    pub ioapic_id: u8,
    /// I/O APIC version.
    pub ioapic_version: u8,
    /// Bit 0: usable.
    pub flags: u8,
    /// GPA of the I/O APIC registers.
    pub addr: u32,
}

/// I/O or local interrupt assignment entry (MP spec 1.4, 4.3.4 and 4.3.5), 8 bytes.
#[repr(C, packed)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MpInterruptEntry {
    /// [`ENTRY_IO_INTERRUPT`] or [`ENTRY_LOCAL_INTERRUPT`].
    pub entry_type: u8,
    /// INT (0), NMI (1), SMI (2) or ExtINT (3).
    pub interrupt_type: u8,
    /// Polarity (bits 0-1) and trigger mode (bits 2-3); 0 conforms to the bus.
    pub flags: u16,
    /// Source bus ID.
    pub source_bus_id: u8,
    /// Source bus IRQ.
    pub source_bus_irq: u8,
    /// Destination I/O APIC ID, or local APIC ID (0xff: all).
    pub dest_id: u8,
    /// Destination I/O APIC INTIN pin, or local APIC LINTIN pin.
    pub dest_pin: u8,
}

// SAFETY: each struct is `repr(C, packed)` and made only of integers and integer arrays, so it
// has no padding and every bit pattern is a valid value.
unsafe impl ByteValued for MpFloatingPointer {}
// SAFETY: as above: packed, integer fields only.
unsafe impl ByteValued for MpConfigHeader {}
// SAFETY: as above: packed, integer fields only.
unsafe impl ByteValued for MpProcessorEntry {}
// SAFETY: as above: packed, integer fields only.
unsafe impl ByteValued for MpBusEntry {}
// SAFETY: as above: packed, integer fields only.
unsafe impl ByteValued for MpIoApicEntry {}
// SAFETY: as above: packed, integer fields only.
unsafe impl ByteValued for MpInterruptEntry {}

/// The byte that makes `bytes` plus itself sum to zero modulo 256.
pub fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |sum, b| sum.wrapping_add(*b)))
}

/// Builds the MP floating pointer followed by the configuration table for `nr_vcpus` vCPUs,
/// as it must appear at GPA `base`.
pub fn build_mptable(nr_vcpus: u8, base: u64) -> Result<Vec<u8>, Error> {
    if nr_vcpus == 0 || nr_vcpus > MAX_VCPUS {
        return Err(Error::VcpuCount(nr_vcpus));
    }
    let (entries, entry_count) = config_entries(nr_vcpus);
    let header_len = std::mem::size_of::<MpConfigHeader>();
    let mut header = MpConfigHeader {
        signature: CONFIG_TABLE_SIGNATURE,
        base_table_length: (header_len + entries.len()) as u16,
        spec_rev: SPEC_REV_1_4,
        oem_id: *b"BULKHEAD",
        product_id: *b"MICROVM     ",
        entry_count,
        lapic_addr: LAPIC_START as u32,
        ..Default::default()
    };
    let mut config = header.as_slice().to_vec();
    config.extend_from_slice(&entries);
    header.checksum = checksum(&config);
    config[..header_len].copy_from_slice(header.as_slice());

    let mut pointer = MpFloatingPointer {
        signature: FLOATING_POINTER_SIGNATURE,
        config_table: (base + std::mem::size_of::<MpFloatingPointer>() as u64) as u32,
        length: 1,
        spec_rev: SPEC_REV_1_4,
        ..Default::default()
    };
    pointer.checksum = checksum(pointer.as_slice());

    let mut table = pointer.as_slice().to_vec();
    table.extend_from_slice(&config);
    Ok(table)
}

/// Writes the MP table for `nr_vcpus` vCPUs at [`MPTABLE_START`].
pub fn write_mptable(mem: &GuestMemoryMmap, nr_vcpus: u8) -> Result<(), Error> {
    let table = build_mptable(nr_vcpus, MPTABLE_START)?;
    let write_error = |source| Error::Write {
        addr: MPTABLE_START,
        len: table.len(),
        source,
    };
    if MPTABLE_START + table.len() as u64 > HIMEM_START {
        return Err(write_error(GuestMemoryError::InvalidBackendAddress));
    }
    mem.write_slice(&table, GuestAddress(MPTABLE_START))
        .map_err(write_error)
}

/// The configuration table entries in spec order, and how many there are.
fn config_entries(nr_vcpus: u8) -> (Vec<u8>, u16) {
    let ioapic_id = nr_vcpus;
    let mut bytes = Vec::new();
    let mut count = 0u16;
    let mut push = |entry: &[u8]| {
        bytes.extend_from_slice(entry);
        count += 1;
    };
    for cpu in 0..nr_vcpus {
        push(processor_entry(cpu).as_slice());
    }
    let bus = MpBusEntry {
        entry_type: ENTRY_BUS,
        bus_id: ISA_BUS_ID,
        bus_type: *b"ISA   ",
    };
    push(bus.as_slice());
    let ioapic = MpIoApicEntry {
        entry_type: ENTRY_IOAPIC,
        ioapic_id,
        ioapic_version: IOAPIC_VERSION,
        flags: 1,
        addr: IOAPIC_START as u32,
    };
    push(ioapic.as_slice());
    for irq in 0..IOAPIC_PINS {
        push(interrupt_entry(ENTRY_IO_INTERRUPT, INT_TYPE_INT, irq, ioapic_id, irq).as_slice());
    }
    let extint = interrupt_entry(
        ENTRY_LOCAL_INTERRUPT,
        INT_TYPE_EXTINT,
        0,
        ALL_LOCAL_APICS,
        0,
    );
    push(extint.as_slice());
    let nmi = interrupt_entry(ENTRY_LOCAL_INTERRUPT, INT_TYPE_NMI, 0, ALL_LOCAL_APICS, 1);
    push(nmi.as_slice());
    (bytes, count)
}

fn processor_entry(apic_id: u8) -> MpProcessorEntry {
    let bsp = if apic_id == 0 { CPU_BOOTSTRAP } else { 0 };
    MpProcessorEntry {
        entry_type: ENTRY_PROCESSOR,
        lapic_id: apic_id,
        lapic_version: LAPIC_VERSION,
        cpu_flags: CPU_ENABLED | bsp,
        cpu_signature: CPU_SIGNATURE,
        feature_flags: CPU_FEATURES,
        reserved: [0; 2],
    }
}

fn interrupt_entry(
    entry_type: u8,
    interrupt_type: u8,
    source_irq: u8,
    dest_id: u8,
    dest_pin: u8,
) -> MpInterruptEntry {
    MpInterruptEntry {
        entry_type,
        interrupt_type,
        flags: 0,
        source_bus_id: ISA_BUS_ID,
        source_bus_irq: source_irq,
        dest_id,
        dest_pin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks the entries after the header: (type, bytes) pairs.
    fn entries(config: &[u8]) -> Vec<(u8, &[u8])> {
        let mut rest = &config[std::mem::size_of::<MpConfigHeader>()..];
        let mut out = Vec::new();
        while let Some(&kind) = rest.first() {
            let len = if kind == ENTRY_PROCESSOR { 20 } else { 8 };
            out.push((kind, &rest[..len]));
            rest = &rest[len..];
        }
        out
    }

    fn written_table(nr_vcpus: u8) -> (MpFloatingPointer, Vec<u8>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x20_0000)]).unwrap();
        write_mptable(&mem, nr_vcpus).unwrap();
        let pointer: MpFloatingPointer = mem.read_obj(GuestAddress(MPTABLE_START)).unwrap();
        let header: MpConfigHeader = mem
            .read_obj(GuestAddress(pointer.config_table.into()))
            .unwrap();
        let mut config = vec![0u8; header.base_table_length as usize];
        mem.read_slice(&mut config, GuestAddress(pointer.config_table.into()))
            .unwrap();
        (pointer, config)
    }

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    #[test]
    fn struct_sizes_match_the_spec() {
        assert_eq!(std::mem::size_of::<MpFloatingPointer>(), 16);
        assert_eq!(std::mem::size_of::<MpConfigHeader>(), 44);
        assert_eq!(std::mem::size_of::<MpProcessorEntry>(), 20);
        assert_eq!(std::mem::size_of::<MpBusEntry>(), 8);
        assert_eq!(std::mem::size_of::<MpIoApicEntry>(), 8);
        assert_eq!(std::mem::size_of::<MpInterruptEntry>(), 8);
    }

    #[test]
    fn floating_pointer_is_signed_and_checksummed() {
        let (pointer, _) = written_table(2);

        assert_eq!(pointer.signature, *b"_MP_");
        assert_eq!(sum(pointer.as_slice()), 0);
        assert_eq!({ pointer.config_table }, MPTABLE_START as u32 + 16);
        assert_eq!((pointer.length, pointer.spec_rev), (1, 4));
    }

    #[test]
    fn config_table_is_signed_checksummed_and_its_length_matches_its_entries() {
        let (_, config) = written_table(3);

        let header = MpConfigHeader::from_slice(&config[..44]).unwrap();
        let listed = entries(&config);
        assert_eq!(header.signature, *b"PCMP");
        assert_eq!(sum(&config), 0);
        assert_eq!(header.entry_count as usize, listed.len());
        let entry_bytes: usize = listed.iter().map(|(_, e)| e.len()).sum();
        assert_eq!(header.base_table_length as usize, 44 + entry_bytes);
        assert_eq!({ header.lapic_addr }, 0xfee0_0000);
    }

    #[test]
    fn lists_one_processor_per_vcpu_with_bsp_only_on_apic_id_0() {
        let (_, config) = written_table(4);

        let cpus: Vec<MpProcessorEntry> = entries(&config)
            .into_iter()
            .filter(|(kind, _)| *kind == ENTRY_PROCESSOR)
            .map(|(_, e)| *MpProcessorEntry::from_slice(e).unwrap())
            .collect();
        let ids: Vec<u8> = cpus.iter().map(|c| c.lapic_id).collect();
        let flags: Vec<u8> = cpus.iter().map(|c| c.cpu_flags).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
        assert_eq!(flags, [3, 1, 1, 1]);
    }

    #[test]
    fn routes_every_ioapic_pin_and_both_lints() {
        let (_, config) = written_table(1);

        let listed = entries(&config);
        let io: Vec<MpInterruptEntry> = listed
            .iter()
            .filter(|(kind, _)| *kind == ENTRY_IO_INTERRUPT)
            .map(|(_, e)| *MpInterruptEntry::from_slice(e).unwrap())
            .collect();
        let local: Vec<(u8, u8)> = listed
            .iter()
            .filter(|(kind, _)| *kind == ENTRY_LOCAL_INTERRUPT)
            .map(|(_, e)| (e[1], e[7]))
            .collect();
        assert_eq!(io.len(), 24);
        assert!(io
            .iter()
            .enumerate()
            .all(|(i, e)| e.source_bus_irq as usize == i
                && e.dest_pin as usize == i
                && e.dest_id == 1));
        assert_eq!(local, [(INT_TYPE_EXTINT, 0), (INT_TYPE_NMI, 1)]);
        let kinds: Vec<u8> = listed.iter().map(|(k, _)| *k).collect();
        assert!(
            kinds.is_sorted(),
            "entries must be sorted by type: {kinds:?}"
        );
    }

    #[test]
    fn largest_table_ends_below_1_mib() {
        let table = build_mptable(MAX_VCPUS, MPTABLE_START).unwrap();

        assert!(MPTABLE_START + table.len() as u64 <= HIMEM_START);
    }

    #[test]
    fn rejects_zero_and_too_many_vcpus() {
        assert!(matches!(
            build_mptable(0, MPTABLE_START),
            Err(Error::VcpuCount(0))
        ));
        assert!(matches!(
            build_mptable(MAX_VCPUS + 1, MPTABLE_START),
            Err(Error::VcpuCount(_))
        ));
    }

    #[test]
    fn memory_below_the_ebda_is_not_enough() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x9f000)]).unwrap();

        let err = write_mptable(&mem, 1).unwrap_err();

        assert!(err.to_string().contains("MP table"), "{err}");
    }
}

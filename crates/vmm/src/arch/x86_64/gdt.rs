//! The boot Global Descriptor Table and segment descriptor encoding.
//!
//! The 64-bit Linux boot protocol (Documentation/x86/boot.rst, protocol 2.15) enters the kernel
//! in long mode with flat 4 GiB code and data segments. KVM takes segment registers as decoded
//! `kvm_segment`s, but the guest also needs the same descriptors in memory at the GDT base in
//! case it reloads a selector, so both views are derived from one 64-bit descriptor here.
//!
//! Descriptor bit layout (Intel SDM vol. 3, 3.4.5):
//! `limit[15:0]` bits 0-15, `base[23:0]` bits 16-39, access byte (P, DPL, S, type) bits 40-47,
//! `limit[19:16]` bits 48-51, flags (G, D/B, L, AVL) bits 52-55, `base[31:24]` bits 56-63.

use kvm_bindings::kvm_segment;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{GDT_ENTRIES, GDT_START, IDT_SIZE, IDT_START};

/// Errors writing the descriptor tables to guest memory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GDT or IDT does not fit in guest memory.
    #[error("cannot write the boot {table} at GPA {addr:#x}: {source}")]
    Write {
        /// "GDT" or "IDT".
        table: &'static str,
        /// GPA the table was written to.
        addr: u64,
        /// The guest memory error.
        source: GuestMemoryError,
    },
}

/// Access byte of the 64-bit code segment: present, DPL 0, code/data, execute/read, accessed.
pub const CODE64_ACCESS: u8 = 0x9b;
/// Flags nibble of the 64-bit code segment: 4 KiB granularity, long mode (L).
pub const CODE64_FLAGS: u8 = 0xa;
/// Access byte of the data segment: present, DPL 0, code/data, read/write, accessed.
pub const DATA_ACCESS: u8 = 0x93;
/// Flags nibble of the data segment: 4 KiB granularity, 32-bit default size (D/B).
pub const DATA_FLAGS: u8 = 0xc;
/// Access byte of the task state segment: present, DPL 0, system, busy 64-bit TSS.
///
/// VMX requires TR to hold a busy TSS in IA-32e mode (Intel SDM vol. 3, 26.3.1.2).
pub const TSS_ACCESS: u8 = 0x8b;
/// Limit of the TSS in bytes minus one (a 64-bit TSS is 104 bytes).
pub const TSS_LIMIT: u32 = 0x67;

/// Segment limit (in 4 KiB units with G set) covering the full 4 GiB.
const FLAT_LIMIT: u32 = 0xf_ffff;

/// Index of the 64-bit code descriptor in the boot GDT.
pub const CODE_INDEX: u16 = 1;
/// Index of the data descriptor in the boot GDT.
pub const DATA_INDEX: u16 = 2;
/// Index of the TSS descriptor in the boot GDT.
pub const TSS_INDEX: u16 = 3;

/// Encodes a segment descriptor.
///
/// `base` is the segment base (a GPA), `limit` the 20-bit limit (bytes, or 4 KiB units when
/// the G flag is set), `access` the access byte (P, DPL, S, type) and `flags` the high nibble
/// (G, D/B, L, AVL). Bits of `limit` above 19 and of `flags` above 3 are ignored.
///
/// ```
/// use bulkhead_vmm::arch::x86_64::gdt::encode_descriptor;
/// // Flat 64-bit code segment.
/// assert_eq!(encode_descriptor(0, 0xfffff, 0x9b, 0xa), 0x00af_9b00_0000_ffff);
/// ```
pub const fn encode_descriptor(base: u32, limit: u32, access: u8, flags: u8) -> u64 {
    let base = base as u64;
    let limit = (limit & 0xf_ffff) as u64;
    (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | ((access as u64) << 40)
        | ((limit >> 16) << 48)
        | (((flags & 0xf) as u64) << 52)
        | ((base >> 24) << 56)
}

/// The four descriptors of the boot GDT: null, 64-bit code, data and TSS.
pub const fn boot_gdt() -> [u64; GDT_ENTRIES] {
    [
        0,
        encode_descriptor(0, FLAT_LIMIT, CODE64_ACCESS, CODE64_FLAGS),
        encode_descriptor(0, FLAT_LIMIT, DATA_ACCESS, DATA_FLAGS),
        encode_descriptor(0, TSS_LIMIT, TSS_ACCESS, 0),
    ]
}

/// Decodes `descriptor`, found at `index` in the GDT, into the form KVM loads into a segment
/// register: the selector is `index * 8` (GDT, RPL 0) and the limit is expanded to bytes.
pub fn kvm_segment_from_descriptor(descriptor: u64, index: u16) -> kvm_segment {
    let bits = |shift: u32, width: u32| (descriptor >> shift) & ((1 << width) - 1);
    let granular = bits(55, 1) == 1;
    let raw_limit = (bits(48, 4) << 16 | bits(0, 16)) as u32;
    kvm_segment {
        base: bits(56, 8) << 24 | bits(16, 24),
        limit: if granular {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector: index * 8,
        type_: bits(40, 4) as u8,
        s: bits(44, 1) as u8,
        dpl: bits(45, 2) as u8,
        present: bits(47, 1) as u8,
        avl: bits(52, 1) as u8,
        l: bits(53, 1) as u8,
        db: bits(54, 1) as u8,
        g: u8::from(granular),
        unusable: u8::from(bits(47, 1) == 0),
        padding: 0,
    }
}

/// Writes the boot GDT ([`boot_gdt`]) at [`GDT_START`] and a zeroed IDT at [`IDT_START`].
pub fn write_descriptor_tables(mem: &GuestMemoryMmap) -> Result<(), Error> {
    let gdt: Vec<u8> = boot_gdt().iter().flat_map(|d| d.to_le_bytes()).collect();
    mem.write_slice(&gdt, GuestAddress(GDT_START))
        .map_err(|source| Error::Write {
            table: "GDT",
            addr: GDT_START,
            source,
        })?;
    mem.write_slice(&[0u8; IDT_SIZE as usize], GuestAddress(IDT_START))
        .map_err(|source| Error::Write {
            table: "IDT",
            addr: IDT_START,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap()
    }

    #[test]
    fn encodes_the_flat_boot_segments_to_their_known_values() {
        let gdt = boot_gdt();

        assert_eq!(gdt[0], 0);
        assert_eq!(gdt[CODE_INDEX as usize], 0x00af_9b00_0000_ffff);
        assert_eq!(gdt[DATA_INDEX as usize], 0x00cf_9300_0000_ffff);
        assert_eq!(gdt[TSS_INDEX as usize], 0x0000_8b00_0000_0067);
    }

    #[test]
    fn encodes_base_and_limit_bits_in_their_split_fields() {
        let desc = encode_descriptor(0x1234_5678, 0xa_bcde, 0x93, 0x4);

        assert_eq!(desc, 0x124a_9334_5678_bcde);
    }

    #[test]
    fn decodes_code_segment_as_long_mode_flat() {
        let seg = kvm_segment_from_descriptor(boot_gdt()[1], CODE_INDEX);

        assert_eq!(seg.selector, 0x8);
        assert_eq!((seg.base, seg.limit), (0, 0xffff_ffff));
        assert_eq!((seg.type_, seg.s, seg.dpl, seg.present), (0xb, 1, 0, 1));
        assert_eq!((seg.l, seg.db, seg.g, seg.unusable), (1, 0, 1, 0));
    }

    #[test]
    fn decodes_tss_with_byte_granular_limit() {
        let seg = kvm_segment_from_descriptor(boot_gdt()[3], TSS_INDEX);

        assert_eq!((seg.selector, seg.limit, seg.g), (0x18, 0x67, 0));
        assert_eq!((seg.type_, seg.s, seg.present), (0xb, 0, 1));
    }

    #[test]
    fn decodes_null_descriptor_as_unusable() {
        let seg = kvm_segment_from_descriptor(0, 0);

        assert_eq!((seg.present, seg.unusable), (0, 1));
    }

    #[test]
    fn decoding_round_trips_base_and_limit() {
        let desc = encode_descriptor(0xdead_b000, 0x1_2345, 0x93, 0x4);

        let seg = kvm_segment_from_descriptor(desc, 5);

        assert_eq!(
            (seg.base, seg.limit, seg.selector, seg.db),
            (0xdead_b000, 0x1_2345, 40, 1)
        );
    }

    #[test]
    fn written_gdt_reads_back_from_guest_memory() {
        let mem = memory();

        write_descriptor_tables(&mem).unwrap();

        let read: Vec<u64> = (0..GDT_ENTRIES as u64)
            .map(|i| mem.read_obj(GuestAddress(GDT_START + i * 8)).unwrap())
            .collect();
        assert_eq!(read, boot_gdt());
        let idt: [u8; IDT_SIZE as usize] = mem.read_obj(GuestAddress(IDT_START)).unwrap();
        assert_eq!(idt, [0; IDT_SIZE as usize]);
    }

    #[test]
    fn writing_without_low_memory_is_an_error() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 0x1000)]).unwrap();

        let err = write_descriptor_tables(&mem).unwrap_err();

        assert!(err.to_string().contains("GDT at GPA 0x500"), "{err}");
    }
}

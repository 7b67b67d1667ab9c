//! Identity-mapped boot page tables.
//!
//! Long mode cannot run without paging, and the 64-bit boot protocol
//! (Documentation/x86/boot.rst, protocol 2.15) asks for an identity mapping that covers the
//! kernel, the zero page and the command line. Three 4 KiB tables map the first
//! [`IDENTITY_MAP_SIZE`] (1 GiB) of guest memory 1:1 with 2 MiB pages:
//! PML4\[0\] → PDPT\[0\] → PD\[0..512\], PD entry `i` mapping GPA `i * 2 MiB`.
//! The kernel replaces these tables with its own early in boot.

use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{IDENTITY_MAP_SIZE, PDPT_START, PD_START, PML4_START};

/// Errors writing the boot page tables.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A page table page does not fit in guest memory.
    #[error("cannot write the boot {table} page table at GPA {addr:#x}: {source}")]
    Write {
        /// "PML4", "PDPT" or "PD".
        table: &'static str,
        /// GPA of the table.
        addr: u64,
        /// The guest memory error.
        source: GuestMemoryError,
    },
}

/// Page table entry flag: present.
pub const PTE_PRESENT: u64 = 1 << 0;
/// Page table entry flag: writable.
pub const PTE_WRITABLE: u64 = 1 << 1;
/// Page directory entry flag: the entry maps a 2 MiB page rather than a page table.
pub const PTE_PAGE_SIZE: u64 = 1 << 7;

/// Size of a large page mapped by one PD entry, in bytes (2 MiB).
pub const LARGE_PAGE_SIZE: u64 = 2 << 20;

/// Number of 8-byte entries in one 4 KiB table.
const ENTRIES_PER_TABLE: usize = 512;

/// PML4 entry 0: points to the PDPT, present and writable.
pub const fn pml4_entry() -> u64 {
    PDPT_START | PTE_PRESENT | PTE_WRITABLE
}

/// PDPT entry 0: points to the PD, present and writable.
pub const fn pdpt_entry() -> u64 {
    PD_START | PTE_PRESENT | PTE_WRITABLE
}

/// PD entry `index`: identity-maps the 2 MiB page at GPA `index * 2 MiB`.
pub const fn pd_entry(index: u64) -> u64 {
    (index * LARGE_PAGE_SIZE) | PTE_PAGE_SIZE | PTE_PRESENT | PTE_WRITABLE
}

/// Writes the PML4, PDPT and PD and returns the GPA to load into CR3 ([`PML4_START`]).
///
/// Each table is written as a whole 4 KiB page, so unused entries are zero even if the
/// memory held something before.
pub fn write_identity_page_tables(mem: &GuestMemoryMmap) -> Result<u64, Error> {
    let mut pd = [0u64; ENTRIES_PER_TABLE];
    let pages = IDENTITY_MAP_SIZE / LARGE_PAGE_SIZE;
    for (index, entry) in (0..pages).zip(pd.iter_mut()) {
        *entry = pd_entry(index);
    }
    write_table(mem, "PML4", PML4_START, &single_entry_table(pml4_entry()))?;
    write_table(mem, "PDPT", PDPT_START, &single_entry_table(pdpt_entry()))?;
    write_table(mem, "PD", PD_START, &pd)?;
    Ok(PML4_START)
}

fn single_entry_table(first: u64) -> [u64; ENTRIES_PER_TABLE] {
    let mut table = [0u64; ENTRIES_PER_TABLE];
    table[0] = first;
    table
}

fn write_table(
    mem: &GuestMemoryMmap,
    table: &'static str,
    addr: u64,
    entries: &[u64; ENTRIES_PER_TABLE],
) -> Result<(), Error> {
    let bytes: Vec<u8> = entries.iter().flat_map(|e| e.to_le_bytes()).collect();
    mem.write_slice(&bytes, GuestAddress(addr))
        .map_err(|source| Error::Write {
            table,
            addr,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_entry(mem: &GuestMemoryMmap, table: u64, index: u64) -> u64 {
        mem.read_obj(GuestAddress(table + index * 8)).unwrap()
    }

    #[test]
    fn tables_chain_pml4_to_pdpt_to_pd() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();

        let cr3 = write_identity_page_tables(&mem).unwrap();

        assert_eq!(cr3, PML4_START);
        assert_eq!(read_entry(&mem, PML4_START, 0), 0xa003);
        assert_eq!(read_entry(&mem, PDPT_START, 0), 0xb003);
        assert_eq!(read_entry(&mem, PML4_START, 1), 0);
        assert_eq!(read_entry(&mem, PDPT_START, 511), 0);
    }

    #[test]
    fn pd_maps_first_gib_with_512_large_pages() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();

        write_identity_page_tables(&mem).unwrap();

        for i in 0..512u64 {
            let entry = read_entry(&mem, PD_START, i);
            assert_eq!(entry & !0x1f_ffff, i << 21, "PD[{i}] address");
            assert_eq!(entry & 0x1f_ffff, 0x83, "PD[{i}] flags PS|RW|P");
        }
    }

    #[test]
    fn stale_entries_are_cleared() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        mem.write_obj(0xdead_beef_u64, GuestAddress(PML4_START + 8))
            .unwrap();

        write_identity_page_tables(&mem).unwrap();

        assert_eq!(read_entry(&mem, PML4_START, 1), 0);
    }

    #[test]
    fn missing_low_memory_is_reported() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0xa000)]).unwrap();

        let err = write_identity_page_tables(&mem).unwrap_err();

        assert!(
            err.to_string().contains("PDPT page table at GPA 0xa000"),
            "{err}"
        );
    }
}

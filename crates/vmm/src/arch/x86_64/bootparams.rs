//! `struct boot_params` (the "zero page") and its e820 memory map.
//!
//! A 64-bit Linux kernel entered directly (no real-mode setup code, no firmware) learns
//! everything about its machine from `boot_params` at the GPA in RSI: where the command line
//! and initramfs are, and which physical memory is RAM (the e820 table). Field meanings follow
//! Documentation/x86/boot.rst, protocol 2.15, and Documentation/x86/zero-page.rst.

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use vm_memory::GuestMemoryRegion;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryError, GuestMemoryMmap};

use super::layout::{CMDLINE_MAX_SIZE, EBDA_START, HIMEM_START, ZERO_PAGE_START};

/// e820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 type of reserved memory.
pub const E820_RESERVED: u32 = 2;
/// Entries `boot_params.e820_table` can hold (`E820_MAX_ENTRIES_ZEROPAGE`).
pub const E820_MAX_ENTRIES: usize = 128;

/// `hdr.type_of_loader`: a boot loader without an assigned ID.
pub const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// `hdr.boot_flag` magic.
pub const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `hdr.header` magic, "HdrS" read as a little-endian u32.
pub const HDRS_MAGIC: u32 = 0x5372_6448;
/// `hdr.kernel_alignment` used when the kernel does not provide one: 2 MiB, the x86_64
/// default of `CONFIG_PHYSICAL_ALIGN`.
pub const DEFAULT_KERNEL_ALIGNMENT: u32 = 0x20_0000;

/// What [`configure_system`](super::configure_system) needs to know about the loaded payload.
#[derive(Clone, Copy, Debug, Default)]
pub struct BootInfo {
    /// GPA of the NUL-terminated kernel command line.
    pub cmdline_addr: GuestAddress,
    /// Size of the command line in bytes, including its terminating NUL.
    pub cmdline_size: usize,
    /// GPA and size in bytes of the initramfs, if any.
    pub initrd: Option<(GuestAddress, usize)>,
    /// The setup header read from a bzImage; `None` for an ELF `vmlinux`.
    pub setup_header: Option<setup_header>,
}

/// Errors building or writing `boot_params`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The guest memory map has more entries than the zero page can hold.
    #[error("the e820 map has {0} entries; boot_params holds at most {E820_MAX_ENTRIES}")]
    TooManyE820Entries(usize),
    /// The command line size is 0 (no NUL) or above the x86 limit.
    #[error(
        "kernel command line of {0} bytes (with NUL) is invalid: it must be 1..={CMDLINE_MAX_SIZE}"
    )]
    CmdlineSize(usize),
    /// The command line, initramfs or kernel is above 4 GiB or too large for the 32-bit
    /// boot protocol fields.
    #[error(
        "the {what} at GPA {addr:#x} ({size} bytes) does not fit the 32-bit boot_params fields"
    )]
    Above4G {
        /// "command line" or "initramfs".
        what: &'static str,
        /// Its GPA.
        addr: u64,
        /// Its size in bytes.
        size: usize,
    },
    /// The zero page does not fit in guest memory.
    #[error("cannot write boot_params at GPA {ZERO_PAGE_START:#x}: {0}")]
    Write(GuestMemoryError),
}

/// One e820 entry.
pub fn e820_entry(addr: u64, size: u64, type_: u32) -> boot_e820_entry {
    boot_e820_entry { addr, size, type_ }
}

/// The e820 map of `regions` (`(GPA, size in bytes)` of each RAM region, in any order): RAM
/// below the EBDA, the EBDA up to 1 MiB reserved, RAM from 1 MiB on. The result is sorted by
/// address and its entries do not overlap.
pub fn e820_map(regions: &[(u64, u64)]) -> Vec<boot_e820_entry> {
    let mut map = Vec::new();
    let mut covers_ebda = false;
    for &(start, size) in regions {
        let end = start.saturating_add(size);
        if start < EBDA_START {
            map.push(e820_entry(start, end.min(EBDA_START) - start, E820_RAM));
        }
        if end > HIMEM_START {
            let ram_start = start.max(HIMEM_START);
            map.push(e820_entry(ram_start, end - ram_start, E820_RAM));
        }
        covers_ebda |= start <= EBDA_START && end >= HIMEM_START;
    }
    if covers_ebda {
        map.push(e820_entry(
            EBDA_START,
            HIMEM_START - EBDA_START,
            E820_RESERVED,
        ));
    }
    map.sort_by_key(|entry| entry.addr);
    map
}

/// The e820 map of `mem`'s regions (see [`e820_map`]).
pub fn e820_map_of(mem: &GuestMemoryMmap) -> Vec<boot_e820_entry> {
    let regions: Vec<(u64, u64)> = mem
        .iter()
        .map(|region| (region.start_addr().raw_value(), region.len()))
        .collect();
    e820_map(&regions)
}

/// Builds `boot_params` for `boot` with the memory map `e820`.
///
/// For a bzImage the kernel's own setup header is the starting point (it carries fields such as
/// `loadflags` and `initrd_addr_max` the kernel expects back); the loader-owned fields are then
/// filled in.
pub fn build_boot_params(boot: &BootInfo, e820: &[boot_e820_entry]) -> Result<boot_params, Error> {
    if e820.len() > E820_MAX_ENTRIES {
        return Err(Error::TooManyE820Entries(e820.len()));
    }
    if boot.cmdline_size == 0 || boot.cmdline_size > CMDLINE_MAX_SIZE {
        return Err(Error::CmdlineSize(boot.cmdline_size));
    }
    let mut params = boot_params::default();
    let mut hdr = boot.setup_header.unwrap_or_default();
    hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    hdr.boot_flag = BOOT_FLAG_MAGIC;
    hdr.header = HDRS_MAGIC;
    hdr.cmd_line_ptr = fit_u32("command line", boot.cmdline_addr, boot.cmdline_size)?;
    // boot.rst: the longest command line the kernel accepts, *without* its terminating zero.
    hdr.cmdline_size = (boot.cmdline_size - 1) as u32;
    if hdr.kernel_alignment == 0 {
        hdr.kernel_alignment = DEFAULT_KERNEL_ALIGNMENT;
    }
    if let Some((addr, size)) = boot.initrd {
        hdr.ramdisk_image = fit_u32("initramfs", addr, size)?;
        hdr.ramdisk_size = size as u32;
    }
    params.hdr = hdr;
    for (slot, entry) in params.e820_table.iter_mut().zip(e820) {
        *slot = *entry;
    }
    params.e820_entries = e820.len() as u8;
    Ok(params)
}

/// `addr` as a u32, if `[addr, addr + size)` lies below 4 GiB.
fn fit_u32(what: &'static str, addr: GuestAddress, size: usize) -> Result<u32, Error> {
    let end = addr.raw_value().checked_add(size as u64);
    match end {
        Some(end) if end <= 1 << 32 => Ok(addr.raw_value() as u32),
        _ => Err(Error::Above4G {
            what,
            addr: addr.raw_value(),
            size,
        }),
    }
}

/// Builds `boot_params` for `mem` and `boot` and writes it at [`ZERO_PAGE_START`].
pub fn write_boot_params(mem: &GuestMemoryMmap, boot: &BootInfo) -> Result<(), Error> {
    let params = build_boot_params(boot, &e820_map_of(mem))?;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(Error::Write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::{CMDLINE_START, MMIO_GAP_START};
    use crate::arch::x86_64::memory::arch_memory_regions;

    fn regions(mem_size: u64) -> Vec<(u64, u64)> {
        arch_memory_regions(mem_size)
            .into_iter()
            .map(|(addr, size)| (addr.raw_value(), size as u64))
            .collect()
    }

    fn triple(entry: &boot_e820_entry) -> (u64, u64, u32) {
        (entry.addr, entry.size, entry.type_)
    }

    fn boot_info() -> BootInfo {
        BootInfo {
            cmdline_addr: GuestAddress(CMDLINE_START),
            cmdline_size: 14,
            initrd: Some((GuestAddress(0x7f0_0000), 0x1234)),
            setup_header: None,
        }
    }

    fn assert_sorted_without_overlap(map: &[boot_e820_entry]) {
        for pair in map.windows(2) {
            assert!(
                pair[0].addr + pair[0].size <= pair[1].addr,
                "{:x?}",
                triple(&pair[1])
            );
        }
    }

    #[test]
    fn e820_for_128_mib_reserves_the_ebda_up_to_1_mib() {
        let map = e820_map(&regions(128 << 20));

        let triples: Vec<_> = map.iter().map(triple).collect();
        assert_eq!(
            triples,
            [
                (0, 0x9fc00, E820_RAM),
                (0x9fc00, 0x60400, E820_RESERVED),
                (0x10_0000, (128 << 20) - 0x10_0000, E820_RAM),
            ]
        );
        assert_sorted_without_overlap(&map);
    }

    #[test]
    fn e820_for_5_gib_skips_the_mmio_gap() {
        let map = e820_map(&regions(5 << 30));

        let triples: Vec<_> = map.iter().map(triple).collect();
        assert_eq!(
            triples,
            [
                (0, 0x9fc00, E820_RAM),
                (0x9fc00, 0x60400, E820_RESERVED),
                (0x10_0000, MMIO_GAP_START - 0x10_0000, E820_RAM),
                (1 << 32, (5 << 30) - MMIO_GAP_START, E820_RAM),
            ]
        );
        assert_sorted_without_overlap(&map);
        let ram: u64 = map
            .iter()
            .filter(|e| e.type_ == E820_RAM)
            .map(|e| e.size)
            .sum();
        assert_eq!(ram, (5 << 30) - 0x60400);
    }

    #[test]
    fn e820_sorts_regions_given_out_of_order() {
        let map = e820_map(&[(1 << 32, 0x1000), (0, 0x20_0000)]);

        let addrs: Vec<u64> = map.iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [0, 0x9fc00, 0x10_0000, 1 << 32]);
    }

    #[test]
    fn boot_params_carry_the_loader_fields() {
        let e820 = e820_map(&regions(128 << 20));

        let params = build_boot_params(&boot_info(), &e820).unwrap();

        let hdr = params.hdr;
        assert_eq!(
            ({ hdr.type_of_loader }, { hdr.boot_flag }, { hdr.header }),
            (0xff, 0xaa55, 0x5372_6448)
        );
        assert_eq!(({ hdr.cmd_line_ptr }, { hdr.cmdline_size }), (0x20000, 13));
        assert_eq!(
            ({ hdr.ramdisk_image }, { hdr.ramdisk_size }),
            (0x7f0_0000, 0x1234)
        );
        assert_eq!({ hdr.kernel_alignment }, 0x20_0000);
        assert_eq!(params.e820_entries, 3);
        let table = params.e820_table;
        assert_eq!(
            triple(&table[2]),
            (0x10_0000, (128 << 20) - 0x10_0000, E820_RAM)
        );
    }

    #[test]
    fn bzimage_setup_header_fields_are_kept() {
        let header = setup_header {
            loadflags: 0x81,
            version: 0x20f,
            kernel_alignment: 0x100_0000,
            initrd_addr_max: 0x7fff_ffff,
            ..Default::default()
        };
        let boot = BootInfo {
            setup_header: Some(header),
            initrd: None,
            ..boot_info()
        };

        let params = build_boot_params(&boot, &[]).unwrap();

        let hdr = params.hdr;
        assert_eq!(({ hdr.loadflags }, { hdr.version }), (0x81, 0x20f));
        assert_eq!({ hdr.kernel_alignment }, 0x100_0000);
        assert_eq!(({ hdr.ramdisk_image }, { hdr.ramdisk_size }), (0, 0));
        assert_eq!(({ hdr.header }, { hdr.type_of_loader }), (HDRS_MAGIC, 0xff));
    }

    #[test]
    fn oversized_command_line_is_refused() {
        let boot = BootInfo {
            cmdline_size: CMDLINE_MAX_SIZE + 1,
            ..boot_info()
        };

        assert!(matches!(
            build_boot_params(&boot, &[]),
            Err(Error::CmdlineSize(2049))
        ));
    }

    #[test]
    fn initrd_above_4_gib_is_refused() {
        let boot = BootInfo {
            initrd: Some((GuestAddress(1 << 32), 0x1000)),
            ..boot_info()
        };

        let err = build_boot_params(&boot, &[]).err().unwrap();

        assert!(
            err.to_string().contains("initramfs at GPA 0x100000000"),
            "{err}"
        );
    }

    #[test]
    fn written_zero_page_reads_back() {
        let mem = GuestMemoryMmap::from_ranges(&arch_memory_regions(64 << 20)).unwrap();

        write_boot_params(&mem, &boot_info()).unwrap();

        let params: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!(
            ({ params.hdr.header }, params.e820_entries),
            (HDRS_MAGIC, 3)
        );
    }
}

//! Where guest RAM goes and where the initramfs is placed in it.

use vm_memory::{Address, GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

use super::layout::{MMIO_GAP_END, MMIO_GAP_START};

/// Highest GPA (inclusive) an initramfs may occupy when the kernel does not say otherwise.
///
/// This is `initrd_addr_max` as every x86_64 Linux kernel's setup header declares it
/// (Documentation/x86/boot.rst, protocol 2.15); an ELF `vmlinux` has no setup header to read
/// it from.
pub const DEFAULT_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;

/// Errors placing the initramfs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The initramfs does not fit between the kernel's end and the top of low RAM.
    #[error(
        "an initramfs of {size} bytes does not fit: {available} bytes are free between the \
         kernel's end and the top of RAM below {limit:#x}"
    )]
    InitrdDoesNotFit {
        /// Size of the initramfs in bytes.
        size: usize,
        /// Bytes free for it.
        available: u64,
        /// Exclusive upper GPA bound it had to stay under.
        limit: u64,
    },
}

/// Guest RAM regions for `mem_size` bytes: one region from GPA 0 if it fits below the 32-bit
/// MMIO gap, otherwise the part below [`MMIO_GAP_START`] plus the rest from 4 GiB up.
///
/// ```
/// use bulkhead_vmm::arch::x86_64::arch_memory_regions;
/// use vm_memory::GuestAddress;
///
/// assert_eq!(arch_memory_regions(128 << 20), vec![(GuestAddress(0), 128 << 20)]);
/// assert_eq!(
///     arch_memory_regions(4 << 30),
///     vec![(GuestAddress(0), 0xd000_0000), (GuestAddress(1 << 32), 0x3000_0000)],
/// );
/// ```
pub fn arch_memory_regions(mem_size: u64) -> Vec<(GuestAddress, usize)> {
    if mem_size <= MMIO_GAP_START {
        return vec![(GuestAddress(0), mem_size as usize)];
    }
    vec![
        (GuestAddress(0), MMIO_GAP_START as usize),
        (
            GuestAddress(MMIO_GAP_END),
            (mem_size - MMIO_GAP_START) as usize,
        ),
    ]
}

/// Total guest RAM in bytes.
pub fn total_size(mem: &GuestMemoryMmap) -> u64 {
    mem.iter().map(|region| region.len()).sum()
}

/// End (exclusive GPA) of the RAM that starts at GPA 0, capped at the MMIO gap: the top of
/// the memory that 32-bit boot structures and the initramfs can use. 0 if there is none.
pub fn low_ram_end(mem: &GuestMemoryMmap) -> u64 {
    let mut end = 0;
    for region in mem.iter() {
        if region.start_addr().raw_value() <= end {
            end = end.max(region.start_addr().raw_value() + region.len());
        }
    }
    end.min(MMIO_GAP_START)
}

/// Highest page-aligned GPA at which an initramfs of `size` bytes fits below the MMIO gap and
/// below [`DEFAULT_INITRD_ADDR_MAX`], at or above `kernel_end`.
///
/// ```
/// use bulkhead_vmm::arch::x86_64::initrd_load_addr;
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 128 << 20)]).unwrap();
/// let addr = initrd_load_addr(&mem, 10_000, GuestAddress(0x40_0000)).unwrap();
/// assert_eq!(addr, GuestAddress((128 << 20) - 0x3000));
/// ```
pub fn initrd_load_addr(
    mem: &GuestMemoryMmap,
    size: usize,
    kernel_end: GuestAddress,
) -> Result<GuestAddress, Error> {
    initrd_load_addr_below(mem, size, kernel_end, DEFAULT_INITRD_ADDR_MAX)
}

/// Like [`initrd_load_addr`], with the kernel's own `initrd_addr_max` (highest GPA, inclusive,
/// the initramfs may occupy) from a bzImage setup header.
pub fn initrd_load_addr_below(
    mem: &GuestMemoryMmap,
    size: usize,
    kernel_end: GuestAddress,
    initrd_addr_max: u64,
) -> Result<GuestAddress, Error> {
    let limit = low_ram_end(mem).min(initrd_addr_max.saturating_add(1));
    let available = limit.saturating_sub(kernel_end.raw_value());
    let does_not_fit = Error::InitrdDoesNotFit {
        size,
        available,
        limit,
    };
    crate::arch::place_below(limit, size, kernel_end.raw_value())
        .map(GuestAddress)
        .ok_or(does_not_fit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(size: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&arch_memory_regions(size)).unwrap()
    }

    #[test]
    fn small_guest_gets_one_region_from_zero() {
        assert_eq!(
            arch_memory_regions(128 << 20),
            [(GuestAddress(0), 128 << 20)]
        );
    }

    #[test]
    fn guest_filling_low_memory_exactly_gets_one_region() {
        assert_eq!(
            arch_memory_regions(MMIO_GAP_START),
            [(GuestAddress(0), MMIO_GAP_START as usize)]
        );
    }

    #[test]
    fn large_guest_is_split_around_the_mmio_gap() {
        let regions = arch_memory_regions(5 << 30);

        assert_eq!(
            regions,
            [
                (GuestAddress(0), 0xd000_0000),
                (GuestAddress(1 << 32), 0x7000_0000)
            ]
        );
        let total: usize = regions.iter().map(|r| r.1).sum();
        assert_eq!(total, 5 << 30);
    }

    #[test]
    fn low_ram_end_stops_at_the_gap() {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0xd000_0000),
            (GuestAddress(1 << 32), 0x1000),
        ])
        .unwrap();

        assert_eq!(low_ram_end(&mem), 0xd000_0000);
    }

    #[test]
    fn initrd_goes_page_aligned_at_the_top_of_ram() {
        let mem = memory(128 << 20);

        let addr = initrd_load_addr(&mem, 0x1800, GuestAddress(0x20_0000)).unwrap();

        assert_eq!(addr, GuestAddress((128 << 20) - 0x2000));
    }

    #[test]
    fn initrd_respects_the_kernels_initrd_addr_max() {
        let mem = memory(256 << 20);

        let addr = initrd_load_addr_below(&mem, 0x1000, GuestAddress(0), 0x37ff_ffff).unwrap();

        assert_eq!(addr, GuestAddress((256 << 20) - 0x1000));
        let capped = initrd_load_addr_below(&mem, 0x1000, GuestAddress(0), 0x07ff_ffff).unwrap();
        assert_eq!(capped, GuestAddress(0x0800_0000 - 0x1000));
    }

    #[test]
    fn initrd_overlapping_the_kernel_is_refused() {
        let mem = memory(16 << 20);

        let err = initrd_load_addr(&mem, 10 << 20, GuestAddress(8 << 20)).unwrap_err();

        let Error::InitrdDoesNotFit { available, .. } = err;
        assert_eq!(available, 8 << 20);
    }

    #[test]
    fn initrd_larger_than_memory_is_refused() {
        let mem = memory(16 << 20);

        assert!(initrd_load_addr(&mem, 32 << 20, GuestAddress(0x10_0000)).is_err());
    }
}

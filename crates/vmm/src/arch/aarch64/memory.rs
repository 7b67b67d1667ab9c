//! Where guest RAM goes, and where the device tree and the initramfs are placed in it.

use vm_memory::{Address, GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

use super::layout::{DRAM_BASE, FDT_MAX_SIZE, KERNEL_ALIGN};

/// Errors placing the initramfs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The initramfs does not fit between the kernel's end and the device tree.
    #[error(
        "an initramfs of {size} bytes does not fit: {available} bytes are free between the \
         kernel's end and the device tree at {limit:#x}"
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

/// Guest RAM regions for `mem_size` bytes: one region from [`DRAM_BASE`].
///
/// ```
/// # #[cfg(target_arch = "aarch64")] {
/// use bulkhead_vmm::arch::aarch64::memory::arch_memory_regions;
/// use vm_memory::GuestAddress;
///
/// assert_eq!(arch_memory_regions(128 << 20), vec![(GuestAddress(0x8000_0000), 128 << 20)]);
/// # }
/// ```
pub fn arch_memory_regions(mem_size: u64) -> Vec<(GuestAddress, usize)> {
    vec![(GuestAddress(DRAM_BASE), mem_size as usize)]
}

/// End (exclusive GPA) of the guest RAM that starts at [`DRAM_BASE`]; `DRAM_BASE` if none does.
pub fn ram_end(mem: &GuestMemoryMmap) -> u64 {
    let mut end = DRAM_BASE;
    for region in mem.iter() {
        if region.start_addr().raw_value() <= end {
            end = end.max(region.start_addr().raw_value() + region.len());
        }
    }
    end
}

/// GPA of the flattened device tree: the last 2 MiB aligned block of [`FDT_MAX_SIZE`] in RAM
/// ending at `ram_end`, where the kernel maps it without sharing a 2 MiB block with anything.
pub fn fdt_addr(ram_end: u64) -> u64 {
    ram_end.saturating_sub(FDT_MAX_SIZE) & !(KERNEL_ALIGN - 1)
}

/// Highest page-aligned GPA at which an initramfs of `size` bytes fits below the device tree, at
/// or above `kernel_end`.
///
/// # Errors
/// [`Error::InitrdDoesNotFit`].
pub fn initrd_load_addr(
    mem: &GuestMemoryMmap,
    size: usize,
    kernel_end: GuestAddress,
) -> Result<GuestAddress, Error> {
    let limit = fdt_addr(ram_end(mem));
    let does_not_fit = Error::InitrdDoesNotFit {
        size,
        available: limit.saturating_sub(kernel_end.raw_value()),
        limit,
    };
    crate::arch::place_below(limit, size, kernel_end.raw_value())
        .map(GuestAddress)
        .ok_or(does_not_fit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(mib: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&arch_memory_regions(mib << 20)).unwrap()
    }

    #[test]
    fn ram_starts_at_2_gib() {
        let regions = arch_memory_regions(256 << 20);

        assert_eq!(regions, [(GuestAddress(0x8000_0000), 256 << 20)]);
    }

    #[test]
    fn device_tree_takes_the_top_2_mib() {
        let mem = memory(128);

        let fdt = fdt_addr(ram_end(&mem));

        assert_eq!(fdt, DRAM_BASE + (126 << 20));
        assert_eq!(fdt % (2 << 20), 0);
    }

    #[test]
    fn initramfs_goes_right_below_the_device_tree() {
        let mem = memory(128);

        let addr = initrd_load_addr(&mem, 10_000, GuestAddress(DRAM_BASE + (4 << 20))).unwrap();

        assert_eq!(addr.0, DRAM_BASE + (126 << 20) - 0x3000);
    }

    #[test]
    fn initramfs_overlapping_the_kernel_does_not_fit() {
        let mem = memory(16);

        let err = initrd_load_addr(&mem, 10 << 20, GuestAddress(DRAM_BASE + (8 << 20)));

        assert!(matches!(
            err,
            Err(Error::InitrdDoesNotFit { available, .. }) if available == 6 << 20
        ));
    }
}

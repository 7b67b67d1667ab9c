//! Guest memory: anonymous private mappings laid out by the architecture and registered with KVM.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion};

/// Smallest guest RAM bulkhead accepts, MiB. A 6.1 kernel with an initramfs needs more than this
/// to boot; the bound only rejects configurations that cannot work at all.
pub const MIN_MEMORY_MIB: u32 = 16;

/// Largest guest RAM bulkhead accepts, MiB (1 TiB).
pub const MAX_MEMORY_MIB: u32 = 1 << 20;

/// Errors from creating or registering guest memory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The requested size is outside [`MIN_MEMORY_MIB`, `MAX_MEMORY_MIB`].
    #[error("guest memory of {0} MiB is out of range ({MIN_MEMORY_MIB}..={MAX_MEMORY_MIB} MiB)")]
    Size(u32),
    /// mmap of the guest RAM failed.
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Mmap {
        /// Size asked for, MiB.
        mib: u32,
        /// The error from vm-memory.
        source: vm_memory::mmap::FromRangesError,
    },
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error(
        "cannot register guest memory slot {slot} (GPA {gpa:#x}, {size} bytes) with KVM: {source}"
    )]
    Register {
        /// The memory slot.
        slot: u32,
        /// Guest physical address of the region.
        gpa: u64,
        /// Size of the region, bytes.
        size: u64,
        /// The KVM error.
        source: kvm_ioctls::Error,
    },
}

/// Maps `mib` MiB of anonymous guest RAM in the regions `layout` gives for a size in bytes.
///
/// Pages are not touched here: the host commits them when the guest first uses them.
///
/// # Errors
/// [`Error::Size`] for sizes outside the accepted range, [`Error::Mmap`] when the host refuses.
pub fn create_guest_memory(
    mib: u32,
    layout: fn(u64) -> Vec<(GuestAddress, usize)>,
) -> Result<GuestMemoryMmap, Error> {
    if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&mib) {
        return Err(Error::Size(mib));
    }
    let ranges = layout(u64::from(mib) << 20);
    GuestMemoryMmap::from_ranges(&ranges).map_err(|source| Error::Mmap { mib, source })
}

/// Registers every region of `mem` with the VM, one KVM memory slot per region (slots 0, 1, ...).
///
/// # Errors
/// [`Error::Register`] naming the slot that KVM refused.
pub fn register_guest_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), Error> {
    for (slot, region) in mem.iter().enumerate() {
        let slot = slot as u32;
        let gpa = region.start_addr().0;
        let size = region.len();
        let desc = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: region.as_ptr() as u64,
        };
        // SAFETY: the host mapping [userspace_addr, +memory_size) belongs to `mem`, which the VMM
        // keeps alive for as long as the VM exists (the Vmm owns both and drops the VM first).
        unsafe { vm.set_user_memory_region(desc) }.map_err(|source| Error::Register {
            slot,
            gpa,
            size,
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(size: u64) -> Vec<(GuestAddress, usize)> {
        vec![(GuestAddress(0), size as usize)]
    }

    #[test]
    fn size_zero_is_rejected() {
        let err = create_guest_memory(0, flat).unwrap_err();

        assert!(matches!(err, Error::Size(0)));
        assert!(err.to_string().contains("0 MiB"));
    }

    #[test]
    fn memory_has_the_requested_size() {
        let mem = create_guest_memory(32, flat).unwrap();

        assert_eq!(mem.iter().map(|r| r.len()).sum::<u64>(), 32 << 20);
    }
}

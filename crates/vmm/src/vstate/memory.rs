//! Guest memory: anonymous private mappings laid out by the architecture and registered with KVM.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_memory::mmap::FromRangesError;
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

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
    /// KVM_SET_USER_MEMORY_REGION refused a slot with EINVAL. Every slot bulkhead registers is
    /// page-aligned and apart from the others, so what KVM refuses is its end: beyond the highest
    /// guest frame the host's KVM can map (on x86, the guest-physical address width of the
    /// host, CPUID 0x80000008; nested hosts often offer less than bare metal).
    #[error(
        "cannot register {mib} MiB of guest memory: KVM refuses guest RAM that ends at GPA {end:#x} \
         (KVM_SET_USER_MEMORY_REGION: {source}), beyond the guest-physical address space this host \
         offers; ask for less memory"
    )]
    BeyondAddressSpace {
        /// Guest RAM asked for, MiB.
        mib: u64,
        /// First GPA after the refused slot.
        end: u64,
        /// The KVM error (EINVAL).
        source: kvm_ioctls::Error,
    },
}

/// Size of a huge page (a PMD mapping on x86_64 and on aarch64 with 4 KiB pages), bytes.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Maps `mib` MiB of anonymous guest RAM in the regions `layout` gives for a size in bytes.
///
/// Pages are not touched here: the host commits them when the guest first uses them. Each
/// region's host address is, as far as the host allows, aligned to [`HUGE_PAGE_BYTES`] (2 MiB),
/// like its GPA, so KVM may map the guest's RAM with 2 MiB pages in its nested page tables when
/// the host backs it with transparent huge pages: a 4 KiB-only mapping costs one vCPU exit per
/// 4 KiB the guest touches first. The alignment only changes where the memory lies; when the
/// host places a region elsewhere, it works unaligned.
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
    let regions = layout(u64::from(mib) << 20)
        .into_iter()
        .map(|(gpa, size)| map_region(gpa, size))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| Error::Mmap { mib, source })?;
    GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Mmap {
        mib,
        source: e.into(),
    })
}

/// Maps one region of `size` bytes of anonymous memory for `gpa`, at a 2 MiB-aligned host
/// address when the host's placement allows (see [`AlignedHole`]).
fn map_region(gpa: GuestAddress, size: usize) -> Result<GuestRegionMmap, FromRangesError> {
    let hole = AlignedHole::reserve(size);
    let region = GuestRegionMmap::from_range(gpa, size, None)?;
    drop(hole);
    let host = region.as_ptr() as usize;
    tracing::debug!(
        "guest RAM at GPA {:#x}: {size} bytes at host address {host:#x} ({}2 MiB-aligned)",
        gpa.0,
        if host % HUGE_PAGE_BYTES == 0 {
            ""
        } else {
            "not "
        }
    );
    Ok(region)
}

/// A 2 MiB-aligned hole of a given size inside an otherwise inaccessible reservation: the next
/// anonymous mapping of that size usually lands in it, as Linux places new mappings in the
/// highest free gap that fits and the reservation took the highest gap that fits the size plus
/// 2 MiB. Dropping it unmaps the reservation's remaining parts.
struct AlignedHole {
    /// The reserved (PROT_NONE) ranges around the hole: (host address, length in bytes).
    fences: [(usize, usize); 2],
}

impl AlignedHole {
    /// Reserves `size` + 2 MiB of address space and unmaps a 2 MiB-aligned `size` bytes of it;
    /// `None` when the host refuses the reservation (the region is then mapped anywhere).
    fn reserve(size: usize) -> Option<AlignedHole> {
        let total = size.checked_add(HUGE_PAGE_BYTES)?;
        // SAFETY: a new private anonymous PROT_NONE mapping at an address of the kernel's
        // choosing; it replaces nothing and no memory of ours refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let (base, end) = (base as usize, base as usize + total);
        // end - size = base + 2 MiB, so the aligned hole starts at or after base.
        let hole = (end - size) & !(HUGE_PAGE_BYTES - 1);
        // SAFETY: [hole, hole + size) lies inside the reservation made above, which nothing
        // else uses.
        unsafe { libc::munmap(hole as *mut libc::c_void, size) };
        Some(AlignedHole {
            fences: [(base, hole - base), (hole + size, end - hole - size)],
        })
    }

    /// Host address of the hole (2 MiB-aligned).
    #[cfg(test)]
    fn start(&self) -> usize {
        self.fences[0].0 + self.fences[0].1
    }
}

impl Drop for AlignedHole {
    fn drop(&mut self) {
        for (addr, len) in self.fences {
            if len > 0 {
                // SAFETY: each fence is a part of the PROT_NONE reservation this value made and
                // still owns; nothing else was mapped over it.
                unsafe { libc::munmap(addr as *mut libc::c_void, len) };
            }
        }
    }
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
        unsafe { vm.set_user_memory_region(desc) }.map_err(|source| {
            if source.errno() == libc::EINVAL {
                Error::BeyondAddressSpace {
                    mib: mem.iter().map(|r| r.len()).sum::<u64>() >> 20,
                    end: gpa.saturating_add(size),
                    source,
                }
            } else {
                Error::Register {
                    slot,
                    gpa,
                    size,
                    source,
                }
            }
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

    /// Maps `len` bytes at exactly `addr` unless something is mapped there; true when mapped
    /// (and unmaps it again).
    fn free_at(addr: usize, len: usize) -> bool {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; on success the new
        // mapping is ours and unmapped at once.
        unsafe {
            let p = libc::mmap(
                addr as *mut libc::c_void,
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return false;
            }
            libc::munmap(p, len);
            p as usize == addr
        }
    }

    /// Set in the child process that [`the_hole_is_2_mib_aligned_free_and_fenced_until_dropped`]
    /// runs itself in.
    const ISOLATED: &str = "BULKHEAD_TEST_ALIGNED_HOLE_ISOLATED";

    #[test]
    fn the_hole_is_2_mib_aligned_free_and_fenced_until_dropped() {
        // The checks map and unmap address space, which other tests' threads in this process
        // may take at any moment: run them in a child process with this test alone.
        if std::env::var_os(ISOLATED).is_none() {
            let module = module_path!().split_once("::").unwrap().1;
            let name = format!("{module}::the_hole_is_2_mib_aligned_free_and_fenced_until_dropped");
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args([name.as_str(), "--exact", "--test-threads=1"])
                .env(ISOLATED, "1")
                .status()
                .unwrap();
            assert!(status.success(), "the isolated run failed: {status}");
            return;
        }
        let size = 6 << 20;

        let hole = AlignedHole::reserve(size).unwrap();
        let start = hole.start();

        assert_eq!(start % HUGE_PAGE_BYTES, 0);
        assert!(free_at(start, size), "the hole is free for the guest RAM");
        let fenced: Vec<_> = hole.fences.iter().filter(|f| f.1 > 0).copied().collect();
        assert!(!fenced.is_empty());
        assert!(
            fenced.iter().all(|&(a, l)| !free_at(a, l)),
            "the fences hold"
        );
        drop(hole);
        assert!(
            fenced.iter().all(|&(a, l)| free_at(a, l)),
            "dropping unmaps them"
        );
    }

    #[test]
    fn guest_ram_beyond_the_host_address_space_is_a_clear_error() {
        // Arrange: 2 MiB at GPA 2^56, above the guest-physical space of any KVM (at most 52
        // bits on x86_64 and aarch64); any KVM serves, kvm_pvm included.
        let kvm = kvm_ioctls::Kvm::new().expect("these tests need /dev/kvm read-write");
        let vm = kvm.create_vm().unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(1 << 56), 2 << 20)]).unwrap();

        // Act
        let err = register_guest_memory(&vm, &mem).unwrap_err();

        // Assert
        let text = err.to_string();
        assert!(
            matches!(err, Error::BeyondAddressSpace { mib: 2, .. }),
            "{text}"
        );
        assert!(text.contains("ends at GPA 0x100000000200000"), "{text}");
        assert!(text.contains("ask for less memory"), "{text}");
    }

    #[test]
    fn memory_has_the_requested_size() {
        let mem = create_guest_memory(32, flat).unwrap();

        assert_eq!(mem.iter().map(|r| r.len()).sum::<u64>(), 32 << 20);
    }
}

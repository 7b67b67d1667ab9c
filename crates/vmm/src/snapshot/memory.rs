//! Guest RAM in a snapshot: written to a file region after region (pages of zeros left as
//! holes), restored as a private copy-on-write mapping of that file.
//!
//! Every VM restored from the same file shares the file's page cache for the pages it only
//! reads; a page a clone writes becomes its own anonymous copy (`MAP_PRIVATE`), so clones never
//! see each other's writes and the file is never changed.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemory, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

/// Page size the zero-page scan works in, bytes.
const PAGE_BYTES: usize = 4096;

/// Bytes copied out of guest memory per step while saving.
const CHUNK_BYTES: usize = 1 << 20;

/// Errors saving or mapping snapshot memory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The memory file could not be created, written, opened or inspected.
    #[error("memory file {path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Guest memory could not be read.
    #[error("cannot read guest memory at GPA {gpa:#x}: {source}")]
    Read {
        /// Where.
        gpa: u64,
        /// The error from vm-memory.
        source: vm_memory::GuestMemoryError,
    },
    /// The saved regions are not the layout this VMM gives a VM of that size.
    #[error(
        "snapshot memory regions {found:?} are not the layout of a {mib} MiB VM ({expected:?})"
    )]
    Layout {
        /// The VM's memory, MiB.
        mib: u64,
        /// The regions the snapshot lists (GPA, bytes).
        found: Vec<(u64, u64)>,
        /// The regions this VMM uses (GPA, bytes).
        expected: Vec<(u64, u64)>,
    },
    /// The memory file is not the size the snapshot says (a truncated copy would fault the
    /// VMM with SIGBUS when the guest touches the missing part).
    #[error("memory file {path} has {found} bytes; the snapshot says {expected}")]
    Size {
        /// The file.
        path: std::path::PathBuf,
        /// Bytes the snapshot's regions cover.
        expected: u64,
        /// Bytes in the file.
        found: u64,
    },
    /// The private mapping could not be made.
    #[error("cannot map the memory file {path}: {reason}")]
    Map {
        /// The file.
        path: std::path::PathBuf,
        /// What vm-memory reported.
        reason: String,
    },
}

/// One guest RAM region in the memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionState {
    /// Guest physical address of the region.
    pub gpa: u64,
    /// Size, bytes.
    pub size: u64,
    /// Where the region starts in the memory file, bytes.
    pub offset: u64,
}

/// Writes every region of `mem` to a new file at `path` (mode 0600), back to back in GPA order, leaving
/// pages that are all zeros as holes; returns where each region went. The file is flushed to
/// disk before this returns. The guest must not run meanwhile (its vCPUs are paused).
///
/// # Errors
/// [`Error::Io`], [`Error::Read`].
pub fn save(mem: &GuestMemoryMmap, path: &Path) -> Result<Vec<RegionState>, Error> {
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    let file = super::format::private_file(path).map_err(io)?;
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    file.set_len(total).map_err(io)?;
    let mut regions = Vec::new();
    let mut offset = 0;
    let mut chunk = vec![0u8; CHUNK_BYTES];
    for region in mem.iter() {
        let state = RegionState {
            gpa: region.start_addr().0,
            size: region.len(),
            offset,
        };
        save_region(mem, &state, &file, &mut chunk).map_err(|e| match e {
            SaveError::Io(source) => io(source),
            SaveError::Read(gpa, source) => Error::Read { gpa, source },
        })?;
        regions.push(state);
        offset += state.size;
    }
    file.sync_all().map_err(io)?;
    Ok(regions)
}

enum SaveError {
    Io(std::io::Error),
    Read(u64, vm_memory::GuestMemoryError),
}

/// Copies one region into `file` at its offset, chunk by chunk, skipping zero pages.
fn save_region(
    mem: &GuestMemoryMmap,
    region: &RegionState,
    file: &File,
    chunk: &mut [u8],
) -> Result<(), SaveError> {
    let mut done = 0u64;
    while done < region.size {
        let len = (region.size - done).min(chunk.len() as u64) as usize;
        let buf = &mut chunk[..len];
        let gpa = region.gpa + done;
        mem.read_slice(buf, GuestAddress(gpa))
            .map_err(|e| SaveError::Read(gpa, e))?;
        write_nonzero_runs(file, region.offset + done, buf).map_err(SaveError::Io)?;
        done += len as u64;
    }
    Ok(())
}

/// Writes the runs of pages of `buf` that are not all zeros to `file` at `at` + their offset.
fn write_nonzero_runs(file: &File, at: u64, buf: &[u8]) -> std::io::Result<()> {
    let mut run_start = None;
    for (i, page) in buf.chunks(PAGE_BYTES).enumerate() {
        let zero = page.iter().all(|&b| b == 0);
        match (zero, run_start) {
            (false, None) => run_start = Some(i * PAGE_BYTES),
            (true, Some(start)) => {
                file.write_all_at(&buf[start..i * PAGE_BYTES], at + start as u64)?;
                run_start = None;
            }
            _ => {}
        }
    }
    if let Some(start) = run_start {
        file.write_all_at(&buf[start..], at + start as u64)?;
    }
    Ok(())
}

/// Maps the memory file at `path` as the guest RAM of a restored VM: each region a private
/// (copy-on-write) mapping of its part of the file. `regions` must be exactly the layout
/// `layout` gives for their total size, and the file exactly as long as they are: both are
/// checked before anything is mapped.
///
/// # Errors
/// [`Error::Layout`], [`Error::Io`], [`Error::Size`], [`Error::Map`].
pub fn map_private(
    path: &Path,
    regions: &[RegionState],
    layout: fn(u64) -> Vec<(GuestAddress, usize)>,
) -> Result<GuestMemoryMmap, Error> {
    let total = check_layout(regions, layout)?;
    let io = |source| Error::Io {
        path: path.to_owned(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let found = file.metadata().map_err(io)?.len();
    if found != total {
        return Err(Error::Size {
            path: path.to_owned(),
            expected: total,
            found,
        });
    }
    let map_err = |reason: String| Error::Map {
        path: path.to_owned(),
        reason,
    };
    let mapped = regions
        .iter()
        .map(|r| map_region(&file, r).map_err(map_err))
        .collect::<Result<Vec<_>, _>>()?;
    GuestMemoryMmap::from_regions(mapped).map_err(|e| map_err(e.to_string()))
}

/// Checks `regions` against the layout of their total size; returns that size, bytes.
fn check_layout(
    regions: &[RegionState],
    layout: fn(u64) -> Vec<(GuestAddress, usize)>,
) -> Result<u64, Error> {
    let total = regions
        .iter()
        .try_fold(0u64, |sum, r| sum.checked_add(r.size))
        .unwrap_or(u64::MAX);
    let mib = total >> 20;
    let found: Vec<(u64, u64)> = regions.iter().map(|r| (r.gpa, r.size)).collect();
    let in_range = total & ((1 << 20) - 1) == 0
        && (u64::from(crate::vstate::memory::MIN_MEMORY_MIB)
            ..=u64::from(crate::vstate::memory::MAX_MEMORY_MIB))
            .contains(&mib);
    let expected: Vec<(u64, u64)> = if in_range {
        layout(total)
            .into_iter()
            .map(|(gpa, size)| (gpa.0, size as u64))
            .collect()
    } else {
        Vec::new()
    };
    let mut offset = 0;
    let contiguous = regions.iter().all(|r| {
        let ok = r.offset == offset;
        offset += r.size;
        ok
    });
    if !in_range || found != expected || !contiguous {
        return Err(Error::Layout {
            mib,
            found,
            expected,
        });
    }
    Ok(total)
}

/// A private read-write mapping of `region`'s part of `file`.
fn map_region(file: &File, region: &RegionState) -> Result<GuestRegionMmap, String> {
    let clone = file.try_clone().map_err(|e| e.to_string())?;
    let mapping = MmapRegionBuilder::new(region.size as usize)
        .with_file_offset(FileOffset::new(clone, region.offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        .build()
        .map_err(|e| e.to_string())?;
    GuestRegionMmap::new(mapping, GuestAddress(region.gpa))
        .ok_or_else(|| format!("region at GPA {:#x} overflows", region.gpa))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::arch_memory_regions;
    use crate::vstate::memory::create_guest_memory;

    fn file_blocks(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).unwrap().blocks()
    }

    #[test]
    fn saved_memory_maps_back_privately() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let mem = create_guest_memory(64, arch_memory_regions).unwrap();
        mem.write_obj(0x1234_5678u32, GuestAddress(0x10_0000))
            .unwrap();
        let regions = save(&mem, &path).unwrap();

        let clone_a = map_private(&path, &regions, arch_memory_regions).unwrap();
        let clone_b = map_private(&path, &regions, arch_memory_regions).unwrap();
        clone_a.write_obj(7u32, GuestAddress(0x10_0000)).unwrap();

        assert_eq!(clone_a.read_obj::<u32>(GuestAddress(0x10_0000)).unwrap(), 7);
        assert_eq!(
            clone_b.read_obj::<u32>(GuestAddress(0x10_0000)).unwrap(),
            0x1234_5678
        );
        let on_disk = map_private(&path, &regions, arch_memory_regions).unwrap();
        assert_eq!(
            on_disk.read_obj::<u32>(GuestAddress(0x10_0000)).unwrap(),
            0x1234_5678
        );
    }

    #[test]
    fn the_memory_file_is_for_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let mem = create_guest_memory(16, arch_memory_regions).unwrap();

        save(&mem, &path).unwrap();

        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn zero_pages_stay_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let mem = create_guest_memory(64, arch_memory_regions).unwrap();
        mem.write_obj(1u64, GuestAddress(0x20_0000)).unwrap();

        save(&mem, &path).unwrap();

        assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 << 20);
        // One 4 KiB page of data (512-byte blocks), not 64 MiB.
        assert!(file_blocks(&path) <= 64, "{} blocks", file_blocks(&path));
    }

    #[test]
    fn truncated_file_is_refused_before_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let mem = create_guest_memory(64, arch_memory_regions).unwrap();
        let regions = save(&mem, &path).unwrap();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len((64 << 20) - 4096).unwrap();

        let err = map_private(&path, &regions, arch_memory_regions).unwrap_err();

        assert!(matches!(err, Error::Size { .. }), "{err}");
    }

    #[test]
    fn regions_other_than_the_layout_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory");
        let mem = create_guest_memory(64, arch_memory_regions).unwrap();
        let mut regions = save(&mem, &path).unwrap();
        regions[0].gpa += 0x1000;

        let err = map_private(&path, &regions, arch_memory_regions).unwrap_err();

        assert!(matches!(err, Error::Layout { .. }), "{err}");
        let huge = [RegionState {
            gpa: 0,
            size: u64::MAX,
            offset: 0,
        }];
        assert!(matches!(
            map_private(&path, &huge, arch_memory_regions),
            Err(Error::Layout { .. })
        ));
    }
}

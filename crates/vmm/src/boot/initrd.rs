//! Loading the initramfs (initrd) into guest memory.
//!
//! It goes as high as possible in the RAM below the 32-bit MMIO gap, page aligned, above the
//! kernel, as boot loaders do; its GPA and size are passed to the kernel in
//! `boot_params.hdr.ramdisk_image`/`ramdisk_size`.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::{fmt_size, mem_size};
use crate::arch::{initrd_load_addr, InitrdPlacementError};

/// Errors loading the initramfs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Opening or reading the file failed.
    #[error("cannot read initramfs {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The file has no bytes.
    #[error("initramfs {} is empty", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// There is not enough guest RAM above the kernel.
    #[error(
        "initramfs {} is {}, does not fit in guest memory ({}; {} free above the kernel)",
        path.display(), fmt_size(*size), fmt_size(*mem_size), fmt_size(*available)
    )]
    TooBig {
        /// The file.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// Guest RAM in bytes.
        mem_size: u64,
        /// Bytes available for it.
        available: u64,
    },
    /// Copying into guest memory failed.
    #[error("cannot load initramfs {} at GPA {addr:#x}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Where it was going.
        addr: u64,
        /// The guest memory error.
        source: GuestMemoryError,
    },
}

/// An initramfs loaded into guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadedInitrd {
    /// Its GPA (page aligned).
    pub addr: GuestAddress,
    /// Its size in bytes.
    pub size: usize,
}

/// Loads the initramfs at `path` at the highest page-aligned GPA below the MMIO gap where it
/// fits above `kernel_end`.
///
/// ```
/// use std::io::Write;
/// use bulkhead_vmm::boot::load_initrd;
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
/// let mut file = tempfile::NamedTempFile::new().unwrap();
/// file.write_all(b"070701...").unwrap();
/// let initrd = load_initrd(&mem, file.path(), GuestAddress(0x40_0000)).unwrap();
/// assert_eq!((initrd.addr, initrd.size), (GuestAddress((64 << 20) - 0x1000), 9));
/// ```
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel_end: GuestAddress,
) -> Result<LoadedInitrd, super::Error> {
    Ok(load_file(mem, path, kernel_end)?)
}

fn load_file(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel_end: GuestAddress,
) -> Result<LoadedInitrd, Error> {
    let read_error = |source| Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(read_error)?;
    let size = file.metadata().map_err(read_error)?.len();
    if size == 0 {
        return Err(Error::Empty {
            path: path.to_path_buf(),
        });
    }
    let too_big = |available| Error::TooBig {
        path: path.to_path_buf(),
        size,
        mem_size: mem_size(mem),
        available,
    };
    let len = usize::try_from(size).map_err(|_| too_big(0))?;
    let addr = initrd_load_addr(mem, len, kernel_end).map_err(|err| match err {
        InitrdPlacementError::InitrdDoesNotFit { available, .. } => too_big(available),
    })?;
    mem.read_exact_volatile_from(addr, &mut file, len)
        .map_err(|source| Error::Write {
            path: path.to_path_buf(),
            addr: addr.0,
            source,
        })?;
    Ok(LoadedInitrd { addr, size: len })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use tempfile::NamedTempFile;

    use super::*;

    const MIB: u64 = 1 << 20;

    fn memory(size: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)]).unwrap()
    }

    fn sparse_file(size: u64) -> NamedTempFile {
        let file = NamedTempFile::new().unwrap();
        file.as_file().set_len(size).unwrap();
        file
    }

    #[test]
    fn loads_at_the_top_of_memory_and_copies_the_bytes() {
        let mem = memory(32 * MIB);
        let mut file = NamedTempFile::new().unwrap();
        file.write_all(&[0xab; 5000]).unwrap();

        let initrd = load_initrd(&mem, file.path(), GuestAddress(4 * MIB)).unwrap();

        assert_eq!(
            initrd,
            LoadedInitrd {
                addr: GuestAddress(32 * MIB - 0x2000),
                size: 5000
            }
        );
        let mut loaded = vec![0u8; 5000];
        mem.read_slice(&mut loaded, initrd.addr).unwrap();
        assert!(loaded.iter().all(|b| *b == 0xab));
    }

    #[test]
    fn initrd_bigger_than_memory_says_both_sizes() {
        let file = sparse_file(300 * MIB);

        let err = load_initrd(&memory(128 * MIB), file.path(), GuestAddress(2 * MIB)).unwrap_err();

        let expected = format!(
            "initramfs {} is 300 MiB, does not fit in guest memory ({})",
            file.path().display(),
            "128 MiB; 126 MiB free above the kernel"
        );
        assert_eq!(err.to_string(), expected);
    }

    #[test]
    fn empty_initrd_is_an_error() {
        let file = sparse_file(0);

        let err = load_initrd(&memory(16 * MIB), file.path(), GuestAddress(2 * MIB)).unwrap_err();

        assert_eq!(
            err.to_string(),
            format!("initramfs {} is empty", file.path().display())
        );
    }

    #[test]
    fn missing_initrd_names_the_path() {
        let err =
            load_initrd(&memory(16 * MIB), Path::new("/no/initrd"), GuestAddress(0)).unwrap_err();

        assert!(
            err.to_string()
                .starts_with("cannot read initramfs /no/initrd: "),
            "{err}"
        );
    }
}

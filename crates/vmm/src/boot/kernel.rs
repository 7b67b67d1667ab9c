//! Loading the guest kernel: an uncompressed ELF `vmlinux` or a `bzImage`.
//!
//! Both are loaded with linux-loader at [`HIMEM_START`] (1 MiB) and entered through the 64-bit
//! boot protocol (Documentation/x86/boot.rst, protocol 2.15):
//! - ELF: each `PT_LOAD` segment goes to its physical address; the entry is the ELF entry.
//! - bzImage: the real-mode setup sectors are skipped and the protected-mode part goes to
//!   `code32_start` (1 MiB); the 64-bit entry point is 0x200 bytes into it, which protocol 2.12+
//!   kernels announce with `XLF_KERNEL_64` in `xloadflags`. The setup header is kept: it is the
//!   starting point of `boot_params.hdr`.

use std::fmt;
use std::fs::File;
use std::io::{self, Read, Seek};
use std::path::{Path, PathBuf};

use linux_loader::loader::bootparam::{setup_header, XLF_KERNEL_64};
use linux_loader::loader::{self, BzImage, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryMmap};

use super::fmt_size;
use crate::arch::HIMEM_START;

/// Offset of the 64-bit entry point from the load address of a bzImage's protected-mode part.
pub const BZIMAGE_ENTRY_64_OFFSET: u64 = 0x200;
/// File offset of the bzImage `boot_flag` (0xAA55).
const BOOT_FLAG_OFFSET: usize = 0x1fe;
/// File offset of the bzImage setup header magic "HdrS".
const HDRS_OFFSET: usize = 0x202;
/// Bytes read from the start of the file to recognise its format.
const PREFIX_LEN: usize = HDRS_OFFSET + 4;
/// First boot protocol version with `xloadflags` (2.12).
const PROTOCOL_XLOADFLAGS: u16 = 0x020c;
/// ELF `e_ident[EI_CLASS]` of a 64-bit object.
const ELFCLASS64: u8 = 2;
/// ELF `e_machine` of x86_64.
const EM_X86_64: u16 = 62;

/// Kernel image formats the VMM boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFormat {
    /// Uncompressed `vmlinux` ELF executable.
    Elf,
    /// Compressed `bzImage` with a Linux setup header.
    BzImage,
}

impl fmt::Display for KernelFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KernelFormat::Elf => "ELF",
            KernelFormat::BzImage => "bzImage",
        })
    }
}

/// Errors recognising or loading a kernel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the image failed.
    #[error("cannot read the kernel image: {0}")]
    Read(io::Error),
    /// The file has no bytes.
    #[error("the kernel image is empty")]
    Empty,
    /// Neither ELF nor bzImage.
    #[error(
        "not an ELF vmlinux or bzImage (no ELF magic; no boot_flag 0xAA55 at 0x1FE with \"HdrS\" \
         at 0x202)"
    )]
    UnknownFormat,
    /// The image is of a known format but cannot be loaded as it is.
    #[error("invalid {format} kernel image: {detail}")]
    Invalid {
        /// Its format.
        format: KernelFormat,
        /// What is wrong.
        detail: String,
    },
    /// A bzImage too old for the 64-bit boot protocol.
    #[error(
        "the bzImage has no 64-bit entry point (boot protocol {version:#x}, xloadflags \
         {xloadflags:#x}); protocol 2.12+ with XLF_KERNEL_64 is needed"
    )]
    No64BitEntry {
        /// Boot protocol version from the setup header.
        version: u16,
        /// `xloadflags` from the setup header.
        xloadflags: u16,
    },
    /// The image is larger than the guest memory above 1 MiB.
    #[error(
        "the {} kernel image does not fit in guest memory ({})",
        fmt_size(*image_size), fmt_size(*mem_size)
    )]
    ImageDoesNotFit {
        /// Image file size in bytes.
        image_size: u64,
        /// Guest RAM in bytes.
        mem_size: u64,
    },
    /// The loaded kernel (with its BSS, or its decompression area) runs past guest RAM.
    #[error(
        "the kernel needs guest RAM from {start:#x} up to {end:#x} ({}), but the guest has {}",
        fmt_size(*end), fmt_size(*mem_size)
    )]
    NeedsMoreMemory {
        /// First GPA it needs.
        start: u64,
        /// End (exclusive GPA) of what it needs.
        end: u64,
        /// Guest RAM in bytes.
        mem_size: u64,
    },
    /// Any of the above, for the kernel at `path`.
    #[error("kernel {}: {error}", path.display())]
    File {
        /// The kernel file.
        path: PathBuf,
        /// What went wrong.
        error: Box<Error>,
    },
}

/// A kernel loaded into guest memory.
#[derive(Clone, Copy, Debug)]
pub struct LoadedKernel {
    /// GPA of the 64-bit entry point (RIP of the boot vCPU).
    pub entry: GuestAddress,
    /// End (exclusive GPA) of the loaded image; the initramfs goes above it.
    pub end: GuestAddress,
    /// The bzImage setup header (`None` for ELF), for `BootInfo::setup_header`.
    pub setup_header: Option<setup_header>,
    /// The format that was loaded.
    pub format: KernelFormat,
}

/// Reads up to [`PREFIX_LEN`] bytes from the start of `file` and rewinds it.
fn read_prefix(file: &mut File) -> io::Result<Vec<u8>> {
    file.rewind()?;
    let mut prefix = Vec::with_capacity(PREFIX_LEN);
    file.by_ref()
        .take(PREFIX_LEN as u64)
        .read_to_end(&mut prefix)?;
    file.rewind()?;
    Ok(prefix)
}

/// The format of an image starting with `prefix`.
fn format_of(prefix: &[u8]) -> Result<KernelFormat, Error> {
    if prefix.is_empty() {
        return Err(Error::Empty);
    }
    if prefix.starts_with(b"\x7fELF") {
        return Ok(KernelFormat::Elf);
    }
    let boot_flag = prefix.get(BOOT_FLAG_OFFSET..BOOT_FLAG_OFFSET + 2);
    let magic = prefix.get(HDRS_OFFSET..HDRS_OFFSET + 4);
    if boot_flag == Some(&[0x55, 0xaa][..]) && magic == Some(&b"HdrS"[..]) {
        return Ok(KernelFormat::BzImage);
    }
    Err(Error::UnknownFormat)
}

/// Recognises the kernel image in `file` by its magic numbers: ELF (`\x7fELF`) or bzImage
/// (`boot_flag` 0xAA55 at 0x1FE and "HdrS" at 0x202). Leaves the file at offset 0.
///
/// ```
/// use std::io::Write;
/// use bulkhead_vmm::boot::{detect_format, KernelFormat};
///
/// let mut file = tempfile::tempfile().unwrap();
/// file.write_all(b"\x7fELF\x02\x01\x01").unwrap();
/// assert_eq!(detect_format(&mut file).unwrap(), KernelFormat::Elf);
///
/// let mut text = tempfile::tempfile().unwrap();
/// text.write_all(b"#!/bin/sh\necho hello\n").unwrap();
/// let err = detect_format(&mut text).unwrap_err();
/// assert!(err.to_string().starts_with("not an ELF vmlinux or bzImage"));
/// ```
pub fn detect_format(file: &mut File) -> Result<KernelFormat, super::Error> {
    Ok(format_of(&read_prefix(file).map_err(Error::Read)?)?)
}

/// Rejects ELF files that are not 64-bit x86_64 executables before linux-loader reads them.
fn check_elf_header(prefix: &[u8]) -> Result<(), Error> {
    let invalid = |detail: &str| Error::Invalid {
        format: KernelFormat::Elf,
        detail: detail.to_string(),
    };
    let (Some(&class), Some(machine)) = (prefix.get(4), prefix.get(18..20)) else {
        return Err(invalid("the file ends inside the ELF header (truncated)"));
    };
    if class != ELFCLASS64 || u16::from_le_bytes([machine[0], machine[1]]) != EM_X86_64 {
        return Err(invalid("not a 64-bit x86_64 ELF executable"));
    }
    Ok(())
}

/// Turns a linux-loader error into ours: failures to copy the image into guest memory become
/// [`Error::ImageDoesNotFit`], the rest [`Error::Invalid`].
fn loader_error(err: loader::Error, format: KernelFormat, sizes: (u64, u64)) -> Error {
    let (image_size, mem_size) = sizes;
    match err {
        loader::Error::Elf(loader::elf::Error::ReadKernelImage)
        | loader::Error::Bzimage(loader::bzimage::Error::ReadBzImageCompressedKernel) => {
            Error::ImageDoesNotFit {
                image_size,
                mem_size,
            }
        }
        other => Error::Invalid {
            format,
            detail: loader_detail(&other),
        },
    }
}

/// linux-loader's message without its repeated "Kernel Loader: " prefixes.
fn loader_detail(err: &loader::Error) -> String {
    let inner = match err {
        loader::Error::Elf(e) => e.to_string(),
        loader::Error::Bzimage(e) => e.to_string(),
        other => other.to_string(),
    };
    inner.trim_start_matches("Kernel Loader: ").to_string()
}

/// Errors unless guest RAM covers `[start, end)` contiguously.
fn check_fits(mem: &GuestMemoryMmap, start: u64, end: u64, mem_size: u64) -> Result<(), Error> {
    let covered = end
        .checked_sub(start)
        .is_some_and(|len| mem.check_range(GuestAddress(start), len as usize));
    if covered {
        Ok(())
    } else {
        Err(Error::NeedsMoreMemory {
            start,
            end,
            mem_size,
        })
    }
}

fn load_elf(
    mem: &GuestMemoryMmap,
    file: &mut File,
    sizes: (u64, u64),
) -> Result<LoadedKernel, Error> {
    let result = Elf::load(mem, None, file, Some(GuestAddress(HIMEM_START)))
        .map_err(|e| loader_error(e, KernelFormat::Elf, sizes))?;
    check_fits(mem, HIMEM_START, result.kernel_end, sizes.1)?;
    Ok(LoadedKernel {
        entry: result.kernel_load,
        end: GuestAddress(result.kernel_end),
        setup_header: None,
        format: KernelFormat::Elf,
    })
}

fn load_bzimage(
    mem: &GuestMemoryMmap,
    file: &mut File,
    sizes: (u64, u64),
) -> Result<LoadedKernel, Error> {
    let result: KernelLoaderResult =
        BzImage::load(mem, None, file, Some(GuestAddress(HIMEM_START)))
            .map_err(|e| loader_error(e, KernelFormat::BzImage, sizes))?;
    let Some(header) = result.setup_header else {
        return Err(Error::Invalid {
            format: KernelFormat::BzImage,
            detail: "no setup header".to_string(),
        });
    };
    let (version, xloadflags) = (header.version, header.xloadflags);
    if version < PROTOCOL_XLOADFLAGS || u32::from(xloadflags) & XLF_KERNEL_64 == 0 {
        return Err(Error::No64BitEntry {
            version,
            xloadflags,
        });
    }
    let load = result.kernel_load.0;
    // init_size: linear memory the kernel needs from its load address to decompress and run.
    let needed_end = load + u64::from(header.init_size).max(result.kernel_end - load);
    check_fits(mem, load, needed_end, sizes.1)?;
    Ok(LoadedKernel {
        entry: GuestAddress(load + BZIMAGE_ENTRY_64_OFFSET),
        end: GuestAddress(result.kernel_end),
        setup_header: Some(header),
        format: KernelFormat::BzImage,
    })
}

fn load_from_file(mem: &GuestMemoryMmap, file: &mut File) -> Result<LoadedKernel, Error> {
    let prefix = read_prefix(file).map_err(Error::Read)?;
    let format = format_of(&prefix)?;
    let image_size = file.metadata().map_err(Error::Read)?.len();
    let sizes = (image_size, super::mem_size(mem));
    match format {
        KernelFormat::Elf => {
            check_elf_header(&prefix)?;
            load_elf(mem, file, sizes)
        }
        KernelFormat::BzImage => load_bzimage(mem, file, sizes),
    }
}

/// Loads the kernel at `path` (ELF `vmlinux` or bzImage, recognised by [`detect_format`]) into
/// `mem` at 1 MiB and returns its 64-bit entry point and end.
///
/// Errors name the file and say what is wrong: unreadable, empty, not a kernel, truncated, or
/// too large for the guest's memory.
///
/// ```
/// use bulkhead_vmm::boot::load_kernel;
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
/// let err = load_kernel(&mem, std::path::Path::new("/nonexistent/vmlinux")).unwrap_err();
/// assert!(err.to_string().starts_with("kernel /nonexistent/vmlinux: cannot read"));
/// ```
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, super::Error> {
    let in_file = |error| Error::File {
        path: path.to_path_buf(),
        error: Box::new(error),
    };
    let mut file = File::open(path).map_err(|e| in_file(Error::Read(e)))?;
    Ok(load_from_file(mem, &mut file).map_err(in_file)?)
}

#[cfg(test)]
#[path = "kernel_tests.rs"]
mod tests;

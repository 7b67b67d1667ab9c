//! Loading the arm64 kernel `Image` (arch/arm64/boot/Image).
//!
//! The image starts with a 64-byte header (Documentation/arch/arm64/booting.rst, "Call the
//! kernel image"), all fields little-endian:
//!
//! ```text
//! 0  code0, code1 (u32 each)   8  text_offset (u64)   16  image_size (u64)   24  flags (u64)
//! 32 res2, res3, res4 (u64)    56 magic "ARM\x64" (u32) 60 res5 (u32, PE header offset)
//! ```
//!
//! The image goes `text_offset` bytes above a 2 MiB aligned base in RAM and is entered at its
//! first byte; `image_size` bytes from there (BSS included) must be free RAM. Kernels older than
//! 3.17 leave `image_size` 0 and use a `text_offset` of 0x80000.

use std::fs::File;
use std::io::{self, Read, Seek};
use std::path::{Path, PathBuf};

use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use super::layout::{DRAM_BASE, KERNEL_ALIGN};
use super::memory::ram_end;

/// Size in bytes of the arm64 `Image` header.
pub const HEADER_SIZE: usize = 64;
/// The header's magic at offset 56: "ARM\x64" read as a little-endian u32.
pub const IMAGE_MAGIC: u32 = 0x644d_5241;
/// File offset of the magic.
const MAGIC_OFFSET: usize = 56;
/// `text_offset` of kernels that leave `image_size` 0 (before Linux 3.17).
const LEGACY_TEXT_OFFSET: u64 = 0x8_0000;
/// Bit 0 of `flags`: the kernel is big-endian.
const FLAG_BIG_ENDIAN: u64 = 1;
/// File offset of an x86 bzImage's setup header magic "HdrS" (Documentation/x86/boot.rst).
const BZIMAGE_HDRS_OFFSET: usize = 0x202;
/// ELF `e_machine` of AArch64.
const EM_AARCH64: u16 = 183;
/// ELF `e_machine` of x86_64.
const EM_X86_64: u16 = 62;

/// Errors recognising or loading an arm64 `Image`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the file failed.
    #[error("cannot read the kernel image: {0}")]
    Read(io::Error),
    /// Shorter than the header.
    #[error("the kernel image is {0} bytes, shorter than the 64-byte arm64 Image header")]
    TooShort(usize),
    /// An x86 kernel was given to the arm64 VMM.
    #[error(
        "this is an x86 {0}, but this VMM boots arm64 guests: use an arm64 kernel Image \
         (arch/arm64/boot/Image)"
    )]
    X86Kernel(&'static str),
    /// An ELF `vmlinux` was given instead of the `Image`.
    #[error(
        "this is an ELF vmlinux ({0}); the arm64 VMM boots the raw kernel Image \
         (arch/arm64/boot/Image)"
    )]
    Elf(&'static str),
    /// A compressed `Image.gz`.
    #[error("this is a gzip-compressed kernel (Image.gz): decompress it first")]
    Gzip,
    /// No "ARM\x64" at offset 56.
    #[error(
        "not an arm64 kernel Image: bad magic {found:#010x} at offset 56 (expected {IMAGE_MAGIC:#010x}, \
         \"ARM\\x64\")"
    )]
    BadMagic {
        /// The u32 found there.
        found: u32,
    },
    /// A big-endian kernel.
    #[error("the kernel Image is big-endian; only little-endian arm64 guests are supported")]
    BigEndian,
    /// The kernel with its BSS runs past guest RAM.
    #[error(
        "the kernel needs guest RAM up to {end:#x}, but guest RAM ends at {ram_end:#x}; give the \
         guest more memory"
    )]
    DoesNotFit {
        /// End (exclusive GPA) the kernel needs.
        end: u64,
        /// End (exclusive GPA) of guest RAM.
        ram_end: u64,
    },
    /// Copying the image into guest memory failed.
    #[error("cannot copy the kernel into guest memory at {addr:#x}: {source}")]
    Write {
        /// Load GPA.
        addr: u64,
        /// The guest memory error.
        source: GuestMemoryError,
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

/// The fields of the arm64 `Image` header the VMM uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// Bytes between the 2 MiB aligned load base and the image's first byte.
    pub text_offset: u64,
    /// Bytes of memory the kernel uses from its first byte, BSS included; `None` when the header
    /// leaves it 0 (pre-3.17 kernels: the file size is the best guess).
    pub image_size: Option<u64>,
}

/// A kernel `Image` loaded into guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadedKernel {
    /// GPA of the first instruction: the image's load address.
    pub entry: GuestAddress,
    /// End (exclusive GPA) of the memory the kernel uses; the initramfs goes above it.
    pub end: GuestAddress,
}

/// Reads a little-endian u32 at `offset` of `bytes` (which the caller made long enough).
fn le_u32(bytes: &[u8], offset: usize) -> u32 {
    let mut field = [0u8; 4];
    field.copy_from_slice(&bytes[offset..offset + 4]);
    u32::from_le_bytes(field)
}

/// Reads a little-endian u64 at `offset` of `bytes` (which the caller made long enough).
fn le_u64(bytes: &[u8], offset: usize) -> u64 {
    let mut field = [0u8; 8];
    field.copy_from_slice(&bytes[offset..offset + 8]);
    u64::from_le_bytes(field)
}

/// Names a kernel of another kind than an arm64 `Image` starting with `prefix`, if it is one.
fn foreign_format(prefix: &[u8]) -> Option<Error> {
    if prefix.starts_with(b"\x7fELF") && prefix.len() >= 20 {
        let machine = u16::from_le_bytes([prefix[18], prefix[19]]);
        return Some(match machine {
            EM_X86_64 => Error::X86Kernel("ELF vmlinux"),
            EM_AARCH64 => Error::Elf("AArch64"),
            _ => Error::Elf("not AArch64"),
        });
    }
    if prefix.starts_with(&[0x1f, 0x8b]) {
        return Some(Error::Gzip);
    }
    let hdrs = prefix.get(BZIMAGE_HDRS_OFFSET..BZIMAGE_HDRS_OFFSET + 4);
    if hdrs == Some(b"HdrS") {
        return Some(Error::X86Kernel("bzImage"));
    }
    None
}

/// Parses the header at the start of `prefix` (the first bytes of the file; at least
/// [`HEADER_SIZE`], more lets x86 kernels be recognised by their setup header).
///
/// # Errors
/// [`Error::X86Kernel`], [`Error::Elf`], [`Error::Gzip`] for other kernel formats,
/// [`Error::TooShort`], [`Error::BadMagic`], [`Error::BigEndian`].
pub fn parse_header(prefix: &[u8]) -> Result<ImageHeader, Error> {
    let found = (prefix.len() >= HEADER_SIZE).then(|| le_u32(prefix, MAGIC_OFFSET));
    if found != Some(IMAGE_MAGIC) {
        // Named formats first: their own headers say more than a bad magic would.
        return Err(match (foreign_format(prefix), found) {
            (Some(error), _) => error,
            (None, Some(found)) => Error::BadMagic { found },
            (None, None) => Error::TooShort(prefix.len()),
        });
    }
    if le_u64(prefix, 24) & FLAG_BIG_ENDIAN != 0 {
        return Err(Error::BigEndian);
    }
    let image_size = le_u64(prefix, 16);
    Ok(if image_size == 0 {
        ImageHeader {
            text_offset: LEGACY_TEXT_OFFSET,
            image_size: None,
        }
    } else {
        ImageHeader {
            text_offset: le_u64(prefix, 8),
            image_size: Some(image_size),
        }
    })
}

/// Where an image with `header` and `file_size` bytes goes in RAM starting at `ram_start` and
/// ending at `ram_end` (exclusive): returns its load GPA and the end of the memory it uses.
///
/// # Errors
/// [`Error::DoesNotFit`].
pub fn placement(
    header: &ImageHeader,
    file_size: u64,
    ram_start: u64,
    ram_end: u64,
) -> Result<(u64, u64), Error> {
    let base = ram_start.next_multiple_of(KERNEL_ALIGN);
    let used = header.image_size.unwrap_or(file_size).max(file_size);
    let load = base.saturating_add(header.text_offset);
    let end = load.saturating_add(used);
    if end > ram_end {
        return Err(Error::DoesNotFit { end, ram_end });
    }
    Ok((load, end))
}

/// Reads the start of `file` (up to the bzImage setup header) and rewinds it.
fn read_prefix(file: &mut File) -> io::Result<Vec<u8>> {
    let mut prefix = Vec::with_capacity(BZIMAGE_HDRS_OFFSET + 4);
    file.by_ref()
        .take(BZIMAGE_HDRS_OFFSET as u64 + 4)
        .read_to_end(&mut prefix)?;
    file.rewind()?;
    Ok(prefix)
}

/// Loads the arm64 kernel `Image` at `path` into `mem` (RAM from [`DRAM_BASE`]).
///
/// # Errors
/// [`Error::File`] wrapping what went wrong.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, Error> {
    load_file(mem, path).map_err(|error| Error::File {
        path: path.to_owned(),
        error: Box::new(error),
    })
}

fn load_file(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, Error> {
    let mut file = File::open(path).map_err(Error::Read)?;
    let file_size = file.metadata().map_err(Error::Read)?.len();
    let header = parse_header(&read_prefix(&mut file).map_err(Error::Read)?)?;
    let (load, end) = placement(&header, file_size, DRAM_BASE, ram_end(mem))?;
    mem.read_exact_volatile_from(GuestAddress(load), &mut file, file_size as usize)
        .map_err(|source| Error::Write { addr: load, source })?;
    Ok(LoadedKernel {
        entry: GuestAddress(load),
        end: GuestAddress(end),
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A 4 KiB image with a valid header: `text_offset`, `image_size`, flags 0.
    fn image(text_offset: u64, image_size: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; 4096];
        bytes[8..16].copy_from_slice(&text_offset.to_le_bytes());
        bytes[16..24].copy_from_slice(&image_size.to_le_bytes());
        bytes[56..60].copy_from_slice(b"ARM\x64");
        bytes
    }

    fn guest_memory(mib: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(DRAM_BASE), (mib << 20) as usize)]).unwrap()
    }

    fn file_with(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(bytes).unwrap();
        file
    }

    #[test]
    fn header_fields_are_read() {
        let bytes = image(0x10_0000, 0x200_0000);

        let header = parse_header(&bytes).unwrap();

        assert_eq!(header.text_offset, 0x10_0000);
        assert_eq!(header.image_size, Some(0x200_0000));
    }

    #[test]
    fn image_with_an_efi_stub_header_is_an_image() {
        let mut bytes = image(0, 0x20_0000);
        bytes[..2].copy_from_slice(b"MZ");

        let header = parse_header(&bytes).unwrap();

        assert_eq!(header.image_size, Some(0x20_0000));
    }

    #[test]
    fn zero_image_size_means_legacy_text_offset() {
        let bytes = image(0x1234, 0);

        let header = parse_header(&bytes).unwrap();

        assert_eq!(header.text_offset, 0x8_0000);
        assert_eq!(header.image_size, None);
    }

    #[test]
    fn bad_magic_is_reported_with_the_value_found() {
        let mut bytes = image(0, 0x1000);
        bytes[56..60].copy_from_slice(b"ARM\x65");

        let err = parse_header(&bytes).unwrap_err();

        assert!(matches!(err, Error::BadMagic { found: 0x654d_5241 }));
        assert!(err.to_string().contains("bad magic 0x654d5241"), "{err}");
    }

    #[test]
    fn x86_bzimage_is_named() {
        let mut bytes = vec![0u8; 1024];
        bytes[0x1fe..0x200].copy_from_slice(&[0x55, 0xaa]);
        bytes[0x202..0x206].copy_from_slice(b"HdrS");

        let err = parse_header(&bytes).unwrap_err();

        assert!(err.to_string().contains("x86 bzImage"), "{err}");
    }

    #[test]
    fn x86_elf_is_named() {
        let mut bytes = vec![0u8; 64];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[18..20].copy_from_slice(&EM_X86_64.to_le_bytes());

        let err = parse_header(&bytes).unwrap_err();

        assert!(matches!(err, Error::X86Kernel("ELF vmlinux")));
    }

    #[test]
    fn arm64_vmlinux_asks_for_the_image() {
        let mut bytes = vec![0u8; 64];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[18..20].copy_from_slice(&EM_AARCH64.to_le_bytes());

        let err = parse_header(&bytes).unwrap_err();

        assert!(err.to_string().contains("arch/arm64/boot/Image"), "{err}");
    }

    #[test]
    fn short_file_is_rejected() {
        let err = parse_header(&[0u8; 10]).unwrap_err();

        assert!(matches!(err, Error::TooShort(10)));
    }

    #[test]
    fn big_endian_kernel_is_rejected() {
        let mut bytes = image(0, 0x1000);
        bytes[24] = 1;

        assert!(matches!(parse_header(&bytes), Err(Error::BigEndian)));
    }

    #[test]
    fn image_goes_text_offset_above_a_2_mib_aligned_base() {
        let header = ImageHeader {
            text_offset: 0x8_0000,
            image_size: Some(0x40_0000),
        };

        let (load, end) = placement(&header, 0x1000, 0x8010_0000, 0x9000_0000).unwrap();

        assert_eq!(load, 0x8028_0000);
        assert_eq!(end, 0x8068_0000);
    }

    #[test]
    fn image_larger_than_ram_does_not_fit() {
        let header = ImageHeader {
            text_offset: 0,
            image_size: Some(64 << 20),
        };

        let err = placement(&header, 0x1000, DRAM_BASE, DRAM_BASE + (32 << 20)).unwrap_err();

        assert!(matches!(err, Error::DoesNotFit { .. }));
    }

    #[test]
    fn loaded_image_is_in_guest_memory_at_its_entry() {
        let bytes = image(0, 0x10_0000);
        let file = file_with(&bytes);
        let mem = guest_memory(16);

        let kernel = load_kernel(&mem, file.path()).unwrap();

        assert_eq!(kernel.entry, GuestAddress(DRAM_BASE));
        assert_eq!(kernel.end, GuestAddress(DRAM_BASE + 0x10_0000));
        let magic: u32 = mem.read_obj(GuestAddress(DRAM_BASE + 56)).unwrap();
        assert_eq!(magic, IMAGE_MAGIC);
    }

    #[test]
    fn load_error_names_the_file() {
        let file = file_with(&[0u8; 100]);
        let mem = guest_memory(16);

        let err = load_kernel(&mem, file.path()).unwrap_err();

        let msg = err.to_string();
        assert!(msg.contains(&file.path().display().to_string()), "{msg}");
        assert!(msg.contains("bad magic"), "{msg}");
    }
}

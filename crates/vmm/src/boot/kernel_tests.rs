//! Tests of kernel format detection and loading, on synthetic ELF and bzImage files.

use std::io::Write;

use tempfile::NamedTempFile;
use vm_memory::Bytes;

use super::*;
use crate::boot::Error as BootError;

const MIB: u64 = 1 << 20;

fn memory(size: u64) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)]).unwrap()
}

fn file_with(bytes: &[u8]) -> NamedTempFile {
    let mut file = NamedTempFile::new().unwrap();
    file.write_all(bytes).unwrap();
    file
}

/// A minimal x86_64 ELF executable: one PT_LOAD segment of `payload` at physical address
/// `paddr` with `memsz` bytes in memory, entry at `paddr`.
fn elf(paddr: u64, payload: &[u8], memsz: u64) -> Vec<u8> {
    const PHOFF: u64 = 64;
    const DATA: u64 = 0x100;
    let mut out = Vec::new();
    out.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    out.extend_from_slice(&2u16.to_le_bytes()); // e_type: EXEC
    out.extend_from_slice(&62u16.to_le_bytes()); // e_machine: x86_64
    out.extend_from_slice(&1u32.to_le_bytes()); // e_version
    out.extend_from_slice(&paddr.to_le_bytes()); // e_entry
    out.extend_from_slice(&PHOFF.to_le_bytes()); // e_phoff
    out.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    out.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    for half in [64u16, 56, 1, 64, 0, 0] {
        // e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
        out.extend_from_slice(&half.to_le_bytes());
    }
    out.extend_from_slice(&1u32.to_le_bytes()); // p_type: PT_LOAD
    out.extend_from_slice(&5u32.to_le_bytes()); // p_flags: R+X
    for quad in [DATA, paddr, paddr, payload.len() as u64, memsz, 0x1000] {
        // p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
        out.extend_from_slice(&quad.to_le_bytes());
    }
    out.resize(DATA as usize, 0);
    out.extend_from_slice(payload);
    out
}

/// A minimal bzImage: 4 setup sectors after the boot sector, then `payload` as the
/// protected-mode kernel.
fn bzimage(version: u16, xloadflags: u16, init_size: u32, payload: &[u8]) -> Vec<u8> {
    let setup_sects = 4u8;
    let mut out = vec![0u8; (usize::from(setup_sects) + 1) * 512];
    out[0x1f1] = setup_sects;
    out[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    out[0x202..0x206].copy_from_slice(b"HdrS");
    out[0x206..0x208].copy_from_slice(&version.to_le_bytes());
    out[0x211] = 0x01; // loadflags: LOADED_HIGH
    out[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
    out[0x22c..0x230].copy_from_slice(&0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    out[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
    out[0x260..0x264].copy_from_slice(&init_size.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

#[test]
fn detects_elf_and_bzimage_by_magic() {
    let mut elf_file = file_with(&elf(MIB, b"kernel", 6)).reopen().unwrap();
    let mut bz_file = file_with(&bzimage(0x20f, 1, 0x1000, b"payload"))
        .reopen()
        .unwrap();

    assert_eq!(detect_format(&mut elf_file).unwrap(), KernelFormat::Elf);
    assert_eq!(detect_format(&mut bz_file).unwrap(), KernelFormat::BzImage);
}

#[test]
fn random_bytes_are_not_a_kernel() {
    let bytes: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let file = file_with(&bytes);

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    let expected = format!(
        "kernel {}: not an ELF vmlinux or bzImage",
        file.path().display()
    );
    assert!(err.to_string().starts_with(&expected), "{err}");
}

#[test]
fn boot_sector_without_hdrs_is_not_a_bzimage() {
    let mut bytes = bzimage(0x20f, 1, 0x1000, b"x");
    bytes[0x202..0x206].copy_from_slice(b"NoHd");

    let err = detect_format(&mut file_with(&bytes).reopen().unwrap()).unwrap_err();

    assert!(
        matches!(err, BootError::Kernel(Error::UnknownFormat)),
        "{err}"
    );
}

#[test]
fn empty_file_is_reported_as_empty() {
    let file = file_with(b"");

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    assert!(
        err.to_string().ends_with(": the kernel image is empty"),
        "{err}"
    );
}

#[test]
fn missing_file_names_the_path() {
    let err = load_kernel(&memory(16 * MIB), Path::new("/no/such/vmlinux")).unwrap_err();

    assert!(
        err.to_string()
            .starts_with("kernel /no/such/vmlinux: cannot read"),
        "{err}"
    );
}

#[test]
fn truncated_elf_header_is_invalid() {
    let file = file_with(b"\x7fELF\x02\x01\x01\0");

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    assert!(
        err.to_string().contains("invalid ELF kernel image"),
        "{err}"
    );
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn elf_cut_before_its_program_headers_is_invalid() {
    let file = file_with(&elf(MIB, b"kernel", 6)[..70]);

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    assert!(
        err.to_string()
            .contains("invalid ELF kernel image: Unable to read program header"),
        "{err}"
    );
}

#[test]
fn elf_for_another_machine_is_invalid() {
    let mut image = elf(MIB, b"kernel", 6);
    image[18] = 183; // EM_AARCH64
    let file = file_with(&image);

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    assert!(err.to_string().contains("not a 64-bit x86_64 ELF"), "{err}");
}

#[test]
fn elf_loads_at_its_physical_address() {
    let mem = memory(16 * MIB);
    let file = file_with(&elf(2 * MIB, b"vmlinux!", 0x3000));

    let kernel = load_kernel(&mem, file.path()).unwrap();

    assert_eq!(kernel.format, KernelFormat::Elf);
    assert_eq!((kernel.entry.0, kernel.end.0), (2 * MIB, 2 * MIB + 0x3000));
    assert!(kernel.setup_header.is_none());
    let mut loaded = [0u8; 8];
    mem.read_slice(&mut loaded, GuestAddress(2 * MIB)).unwrap();
    assert_eq!(&loaded, b"vmlinux!");
}

#[test]
fn elf_larger_than_memory_does_not_fit() {
    let file = file_with(&elf(MIB, &vec![0x90; 3 * MIB as usize], 3 * MIB));

    let err = load_kernel(&memory(2 * MIB), file.path()).unwrap_err();

    assert!(
        err.to_string()
            .contains("kernel image does not fit in guest memory (2 MiB)"),
        "{err}"
    );
}

#[test]
fn elf_whose_bss_runs_past_memory_needs_more_memory() {
    let file = file_with(&elf(MIB, b"small", 8 * MIB));

    let err = load_kernel(&memory(4 * MIB), file.path()).unwrap_err();

    assert!(
        err.to_string()
            .contains("up to 0x900000 (9 MiB), but the guest has 4 MiB"),
        "{err}"
    );
}

#[test]
fn bzimage_loads_at_1_mib_with_64_bit_entry() {
    let mem = memory(16 * MIB);
    let file = file_with(&bzimage(0x20f, 1, 0x4000, b"compressed"));

    let kernel = load_kernel(&mem, file.path()).unwrap();

    assert_eq!(kernel.format, KernelFormat::BzImage);
    assert_eq!((kernel.entry.0, kernel.end.0), (MIB + 0x200, MIB + 10));
    let header = kernel.setup_header.unwrap();
    assert_eq!(
        ({ header.version }, { header.code32_start }),
        (0x20f, 0x10_0000)
    );
    let mut loaded = [0u8; 10];
    mem.read_slice(&mut loaded, GuestAddress(MIB)).unwrap();
    assert_eq!(&loaded, b"compressed");
}

#[test]
fn old_bzimage_without_64_bit_entry_is_refused() {
    let file = file_with(&bzimage(0x20a, 0, 0x4000, b"old"));

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    assert!(
        err.to_string()
            .contains("no 64-bit entry point (boot protocol 0x20a"),
        "{err}"
    );
}

#[test]
fn bzimage_whose_init_size_exceeds_memory_needs_more_memory() {
    let file = file_with(&bzimage(0x20f, 1, 32 << 20, b"payload"));

    let err = load_kernel(&memory(16 * MIB), file.path()).unwrap_err();

    assert!(
        matches!(&err, BootError::Kernel(Error::File { error, .. })
            if matches!(**error, Error::NeedsMoreMemory { .. })),
        "{err}"
    );
}

//! Where bulkhead finds its default kernel and image, and where sandboxes keep runtime files.
//!
//! | what | default | override |
//! |---|---|---|
//! | data dir | `$XDG_DATA_HOME/bulkhead` or `~/.local/share/bulkhead` | `BULKHEAD_DATA_DIR` |
//! | kernel | `<data>/kernel/<arch>/vmlinux` (`Image` on aarch64) | `BULKHEAD_KERNEL`, `--kernel` |
//! | initramfs | `<data>/images/default/initramfs.cpio.lz4` | `BULKHEAD_INITRD`, `--initrd` |
//! | runtime dir | `$XDG_RUNTIME_DIR/bulkhead` or `/tmp/bulkhead-<uid>` | `BULKHEAD_RUNTIME_DIR` |
//!
//! `scripts/setup.sh` puts the kernel and the default image in the data dir.

use std::env;
use std::path::{Path, PathBuf};

/// The architecture directory name used under `<data>/kernel/`.
pub const ARCH: &str = std::env::consts::ARCH;

/// The kernel file `scripts/build-kernel.sh` leaves under `<data>/kernel/<arch>/` that the VMM
/// boots: the ELF `vmlinux` on x86_64, the arm64 boot `Image` on aarch64 (the VMM loads no ELF
/// there; see `Documentation/arch/arm64/booting.rst`).
#[cfg(not(target_arch = "aarch64"))]
pub const KERNEL_FILE: &str = "vmlinux";
/// The kernel file `scripts/build-kernel.sh` leaves under `<data>/kernel/<arch>/` that the VMM
/// boots: the arm64 boot `Image` (the VMM loads no ELF on aarch64).
#[cfg(target_arch = "aarch64")]
pub const KERNEL_FILE: &str = "Image";

fn env_path(name: &str) -> Option<PathBuf> {
    env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// bulkhead's data directory.
pub fn data_dir() -> PathBuf {
    if let Some(dir) = env_path("BULKHEAD_DATA_DIR") {
        return dir;
    }
    let base = env_path("XDG_DATA_HOME").unwrap_or_else(|| home().join(".local/share"));
    base.join("bulkhead")
}

fn home() -> PathBuf {
    env_path("HOME").unwrap_or_else(|| PathBuf::from("/"))
}

/// The default guest kernel: `BULKHEAD_KERNEL`, else `<data>/kernel/<arch>/`[`KERNEL_FILE`].
pub fn default_kernel() -> PathBuf {
    env_path("BULKHEAD_KERNEL")
        .unwrap_or_else(|| data_dir().join("kernel").join(ARCH).join(KERNEL_FILE))
}

/// File name of the default initramfs in `<data>/images/default/` (LZ4-compressed, built by
/// `scripts/setup.sh`).
pub const DEFAULT_INITRD_FILE: &str = "initramfs.cpio.lz4";

/// Its gzip-compressed name in data dirs set up before the image moved to LZ4.
const OLD_DEFAULT_INITRD_FILE: &str = "initramfs.cpio.gz";

/// The default initramfs (the agent as PID 1 plus busybox): `BULKHEAD_INITRD`, else
/// `<data>/images/default/`[`DEFAULT_INITRD_FILE`]. A data dir that only has the older
/// `initramfs.cpio.gz` keeps booting that one until `scripts/setup.sh` runs again.
pub fn default_initrd() -> PathBuf {
    env_path("BULKHEAD_INITRD").unwrap_or_else(|| initrd_in(&data_dir().join("images/default")))
}

/// [`DEFAULT_INITRD_FILE`] in `dir`, or the older gzip file when only that one exists.
fn initrd_in(dir: &Path) -> PathBuf {
    let current = dir.join(DEFAULT_INITRD_FILE);
    let old = dir.join(OLD_DEFAULT_INITRD_FILE);
    if !current.exists() && old.exists() {
        old
    } else {
        current
    }
}

/// Parent directory of every sandbox's runtime directory.
pub fn runtime_dir() -> PathBuf {
    if let Some(dir) = env_path("BULKHEAD_RUNTIME_DIR") {
        return dir;
    }
    match env_path("XDG_RUNTIME_DIR") {
        Some(dir) => dir.join("bulkhead"),
        // SAFETY: getuid has no preconditions and cannot fail.
        None => PathBuf::from(format!("/tmp/bulkhead-{}", unsafe { libc::getuid() })),
    }
}

/// The `bulkhead-vmm` binary: `BULKHEAD_VMM`, else next to the running executable, else `PATH`.
pub fn vmm_binary() -> PathBuf {
    if let Some(path) = env_path("BULKHEAD_VMM") {
        return path;
    }
    let sibling = env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("bulkhead-vmm")));
    match sibling {
        Some(path) if path.is_file() => path,
        _ => PathBuf::from("bulkhead-vmm"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_image_is_the_lz4_file_even_when_missing() {
        // Arrange: an empty images/default/
        let dir = tempfile::tempdir().unwrap();

        // Act
        let chosen = initrd_in(dir.path());

        // Assert: the error a user then gets names the file setup.sh makes
        assert_eq!(chosen, dir.path().join("initramfs.cpio.lz4"));
    }

    #[test]
    fn a_data_dir_from_before_lz4_keeps_its_gzip_image() {
        // Arrange: only the file an older setup.sh wrote
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("initramfs.cpio.gz"), b"cpio").unwrap();

        // Act
        let chosen = initrd_in(dir.path());

        // Assert
        assert_eq!(chosen, dir.path().join("initramfs.cpio.gz"));
    }

    #[test]
    fn the_lz4_image_wins_once_setup_wrote_it() {
        // Arrange: both files, as after re-running setup.sh on an old data dir
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("initramfs.cpio.gz"), b"old").unwrap();
        std::fs::write(dir.path().join("initramfs.cpio.lz4"), b"new").unwrap();

        // Act
        let chosen = initrd_in(dir.path());

        // Assert
        assert_eq!(chosen, dir.path().join("initramfs.cpio.lz4"));
    }
}

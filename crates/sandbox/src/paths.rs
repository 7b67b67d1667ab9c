//! Where bulkhead finds its default kernel and image, and where sandboxes keep runtime files.
//!
//! | what | default | override |
//! |---|---|---|
//! | data dir | `$XDG_DATA_HOME/bulkhead` or `~/.local/share/bulkhead` | `BULKHEAD_DATA_DIR` |
//! | kernel | `<data>/kernel/<arch>/vmlinux` (`Image` on aarch64) | `BULKHEAD_KERNEL`, `--kernel` |
//! | initramfs | `<data>/images/default/initramfs.cpio.gz` | `BULKHEAD_INITRD`, `--initrd` |
//! | runtime dir | `$XDG_RUNTIME_DIR/bulkhead` or `/tmp/bulkhead-<uid>` | `BULKHEAD_RUNTIME_DIR` |
//!
//! `scripts/setup.sh` puts the kernel and the default image in the data dir.

use std::env;
use std::path::PathBuf;

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

/// The default initramfs (the agent as PID 1 plus busybox).
pub fn default_initrd() -> PathBuf {
    env_path("BULKHEAD_INITRD")
        .unwrap_or_else(|| data_dir().join("images/default/initramfs.cpio.gz"))
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

//! Host directories shared over virtio-fs, mounted where the kernel command line says.
//!
//! The host (`bulkhead run --mount HOST_DIR:GUEST_DIR[:ro]`, the sandbox crate's `mounts`
//! module) gives the VM one virtio-fs device per shared directory and passes, for each,
//!
//! ```text
//! bulkhead.mount=TAG:GUEST_DIR        read-write
//! bulkhead.mount=TAG:GUEST_DIR:ro     read-only
//! ```
//!
//! (the codec is [`bulkhead_protocol::boot`]). The agent mounts
//! them in command-line order (the host lists parents first), after switching into an image
//! root (`bulkhead.root=`) and before announcing readiness: it creates the directory
//! (`mkdir -p`), then `mount -t virtiofs TAG GUEST_DIR` with `nosuid,nodev`, plus `ro` for
//! read-only shares. The read-only flag is a convenience: the host's file server refuses every
//! change to a read-only share with `EROFS` whatever the guest mounts.
//!
//! A mount that fails (or a parameter that does not parse) is fatal: the agent writes the reason
//! to the debug port (the VMM's log) and reboots, so no command ever runs without the directory
//! it was promised.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use bulkhead_protocol::boot::Share;

/// Failed mounts.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// Creating the mount point failed.
    #[error("cannot create mount point {}: {source}", path.display())]
    Mkdir {
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// mount(2) failed.
    #[error("mount -t virtiofs {tag} {}: {source}", path.display())]
    Mount {
        /// The tag.
        tag: String,
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// Mounts `shares` in order.
///
/// # Errors
/// The first failed mount (earlier mounts stay).
pub fn mount_all(shares: &[Share]) -> Result<(), MountError> {
    shares.iter().try_for_each(mount_share)
}

fn mount_share(spec: &Share) -> Result<(), MountError> {
    fs::create_dir_all(&spec.guest_dir).map_err(|source| MountError::Mkdir {
        path: spec.guest_dir.clone(),
        source,
    })?;
    let failed = |source| MountError::Mount {
        tag: spec.tag.clone(),
        path: spec.guest_dir.clone(),
        source,
    };
    let invalid = || failed(io::Error::from_raw_os_error(libc::EINVAL));
    let tag = CString::new(spec.tag.as_str()).map_err(|_| invalid())?;
    let target = CString::new(spec.guest_dir.as_os_str().as_bytes()).map_err(|_| invalid())?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if spec.read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: every pointer is a NUL-terminated string that outlives the call; data is null.
    let rc = unsafe {
        libc::mount(
            tag.as_ptr(),
            target.as_ptr(),
            c"virtiofs".as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(failed(io::Error::last_os_error()));
    }
    Ok(())
}

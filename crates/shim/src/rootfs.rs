//! A container's root file system on the host: the mounts containerd passes in
//! `CreateTaskRequest.rootfs` (usually one `overlay` from its snapshotter) mounted on a
//! directory (the container's place in its pod's roots, [`crate::pod_roots`]), and unmounted on
//! delete.
//!
//! Mount options follow `mount(8)`: the flag words (`ro`, `nosuid`, `nodev`, `noexec`,
//! `rbind`, `bind`, ...) become `mount(2)` flags, everything else (`lowerdir=...`) its data.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::events::Mount;

/// Why a root file system could not be mounted or unmounted.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// A mount containerd passed is not one this shim mounts (a target below the root).
    #[error("rootfs mount {0:?}: only mounts of the root itself are supported")]
    Unsupported(String),
    /// A container or pod id that is not one plain path component.
    #[error("{0:?} is not a usable container or pod id (one path component of [A-Za-z0-9_.-])")]
    BadId(String),
    /// A path or option holds a NUL byte.
    #[error("rootfs mount: {0:?} holds a NUL byte")]
    Nul(String),
    /// `mount(2)` or `umount2(2)` failed.
    #[error("{what} {target}: {source}")]
    Sys {
        /// `mount` or `umount`.
        what: &'static str,
        /// Where.
        target: String,
        /// The OS error.
        source: io::Error,
    },
}

/// `mount(2)` flags and the remaining data string of `options`.
pub fn flags_and_data(options: &[String]) -> (libc::c_ulong, String) {
    let mut flags: libc::c_ulong = 0;
    let mut data = Vec::new();
    for option in options {
        match option.as_str() {
            "ro" => flags |= libc::MS_RDONLY,
            "rw" | "defaults" => {}
            "nosuid" => flags |= libc::MS_NOSUID,
            "nodev" => flags |= libc::MS_NODEV,
            "noexec" => flags |= libc::MS_NOEXEC,
            "noatime" => flags |= libc::MS_NOATIME,
            "relatime" => flags |= libc::MS_RELATIME,
            "bind" => flags |= libc::MS_BIND,
            "rbind" => flags |= libc::MS_BIND | libc::MS_REC,
            other => data.push(other),
        }
    }
    (flags, data.join(","))
}

/// Mounts `mounts` (in order) on `target`, the bundle's `rootfs`; nothing when `mounts` is
/// empty (the bundle's `rootfs` is already populated, as with `ctr run --rootfs`).
///
/// # Errors
/// [`RootfsError`]; the mounts made before the failing one are undone.
pub fn mount_all(mounts: &[Mount], target: &Path) -> Result<(), RootfsError> {
    for (done, m) in mounts.iter().enumerate() {
        if let Err(e) = mount_one(m, target) {
            for _ in 0..done {
                let _ = unmount(target);
            }
            return Err(e);
        }
    }
    Ok(())
}

fn mount_one(m: &Mount, target: &Path) -> Result<(), RootfsError> {
    if !m.target.is_empty() && m.target != "/" {
        return Err(RootfsError::Unsupported(m.target.clone()));
    }
    let (flags, data) = flags_and_data(&m.options);
    sys_mount(
        m.source.as_bytes(),
        target.as_os_str().as_bytes(),
        m.kind.as_bytes(),
        flags,
        data.as_bytes(),
    )
}

/// `mount(2)` of `source` on `target` with `flags` alone (a bind, or a propagation change,
/// for which `source` is ignored).
///
/// # Errors
/// [`RootfsError`].
pub fn mount_path(source: &Path, target: &Path, flags: libc::c_ulong) -> Result<(), RootfsError> {
    let (source, target) = (source.as_os_str().as_bytes(), target.as_os_str().as_bytes());
    sys_mount(source, target, b"none", flags, b"")
}

fn sys_mount(
    source: &[u8],
    target: &[u8],
    kind: &[u8],
    flags: libc::c_ulong,
    data: &[u8],
) -> Result<(), RootfsError> {
    let c = |s: &[u8]| {
        CString::new(s).map_err(|_| RootfsError::Nul(String::from_utf8_lossy(s).into_owned()))
    };
    let (source, dir, kind, data) = (c(source)?, c(target)?, c(kind)?, c(data)?);
    let data_ptr = match data.as_bytes().is_empty() {
        true => std::ptr::null(),
        false => data.as_ptr().cast(),
    };
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            dir.as_ptr(),
            kind.as_ptr(),
            flags,
            data_ptr,
        )
    };
    if rc != 0 {
        return Err(RootfsError::Sys {
            what: "mount",
            target: String::from_utf8_lossy(dir.as_bytes()).into_owned(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Unmounts what is mounted on `target` (lazily: a process still inside keeps it alive, the
/// path is free at once).
///
/// # Errors
/// [`RootfsError::Sys`].
pub fn unmount(target: &Path) -> Result<(), RootfsError> {
    let dir = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| RootfsError::Nul(target.display().to_string()))?;
    // SAFETY: umount2(2) with a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::umount2(dir.as_ptr(), libc::MNT_DETACH) };
    if rc != 0 {
        return Err(RootfsError::Sys {
            what: "umount",
            target: target.display().to_string(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_words_become_flags_and_the_rest_is_data() {
        // Arrange
        let options: Vec<String> = ["ro", "nosuid", "lowerdir=/a:/b", "upperdir=/u", "rbind"]
            .map(String::from)
            .into();

        // Act
        let (flags, data) = flags_and_data(&options);

        // Assert
        let expected = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_BIND | libc::MS_REC;
        assert_eq!(flags, expected);
        assert_eq!(data, "lowerdir=/a:/b,upperdir=/u");
    }

    #[test]
    fn a_mount_below_the_root_is_refused_before_anything_is_mounted() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let mounts = [Mount {
            kind: "bind".into(),
            source: "/tmp".into(),
            target: "/data".into(),
            options: vec!["rbind".into()],
        }];

        // Act
        let result = mount_all(&mounts, dir.path());

        // Assert
        assert!(matches!(result, Err(RootfsError::Unsupported(t)) if t == "/data"));
    }
}

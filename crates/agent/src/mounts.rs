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
//! where `TAG` is the device's mount tag (`[A-Za-z0-9_-]`, 1–36 bytes) and `GUEST_DIR` an absolute
//! path, percent-encoded (`%XX` for every byte outside `[A-Za-z0-9/._+,@~-]`). The agent mounts
//! them in command-line order (the host lists parents first), after switching into an image
//! root (`bulkhead.root=`) and before announcing readiness: it creates the directory
//! (`mkdir -p`), then `mount -t virtiofs TAG GUEST_DIR` with `nosuid,nodev`, plus `ro` for
//! read-only shares. The read-only flag is a convenience: the host's file server refuses every
//! change to a read-only share with `EROFS` whatever the guest mounts.
//!
//! A parameter that does not parse, or a mount that fails, is fatal: the agent writes the reason
//! to the debug port (the VMM's log) and reboots, so no command ever runs without the directory
//! it was promised.

use std::ffi::CString;
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Component, Path, PathBuf};

/// Kernel command-line key of a mount.
pub const MOUNT_KEY: &str = "bulkhead.mount";

/// Longest virtio-fs tag, in bytes (virtio 1.2 §5.11.4).
const MAX_TAG: usize = 36;

/// One `bulkhead.mount=` parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountSpec {
    /// The virtio-fs mount tag.
    pub tag: String,
    /// Where to mount it (absolute, no `.`/`..` components).
    pub target: PathBuf,
    /// Mount read-only.
    pub read_only: bool,
}

/// Bad parameters and failed mounts.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// A `bulkhead.mount=` value is malformed.
    #[error("bad bulkhead.mount={value}: {reason}")]
    Param {
        /// The raw value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
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

/// Every `bulkhead.mount=` parameter of `cmdline`, in order.
///
/// # Errors
/// [`MountError::Param`] for the first malformed one.
pub fn parse_cmdline(cmdline: &str) -> Result<Vec<MountSpec>, MountError> {
    cmdline
        .split_whitespace()
        .filter_map(|p| p.split_once('='))
        .filter(|(k, _)| *k == MOUNT_KEY)
        .map(|(_, v)| parse_value(v))
        .collect()
}

/// Parses `TAG:ENCODED_DIR[:ro]`.
pub(crate) fn parse_value(value: &str) -> Result<MountSpec, MountError> {
    let bad = |reason| MountError::Param {
        value: value.to_owned(),
        reason,
    };
    let (rest, read_only) = match value.strip_suffix(":ro") {
        Some(rest) => (rest, true),
        None => (value, false),
    };
    let (tag, encoded) = rest.split_once(':').ok_or(bad("expected TAG:DIR[:ro]"))?;
    let tag_ok = (1..=MAX_TAG).contains(&tag.len())
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !tag_ok {
        return Err(bad("the tag must be 1-36 of [A-Za-z0-9_-]"));
    }
    let decoded = percent_decode(encoded).ok_or(bad("bad %XX escape in DIR"))?;
    let target = PathBuf::from(OsString::from_vec(decoded));
    let plain = target
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !target.is_absolute() || !plain || target == Path::new("/") {
        return Err(bad(
            "DIR must be an absolute path other than / without . or ..",
        ));
    }
    Ok(MountSpec {
        tag: tag.to_owned(),
        target,
        read_only,
    })
}

/// Decodes `%XX` escapes; `None` for a truncated or non-hex escape.
fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Mounts every share `/proc/cmdline` asks for.
///
/// # Errors
/// The first bad parameter or failed mount (earlier mounts stay).
pub fn mount_from_cmdline() -> Result<usize, MountError> {
    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let specs = parse_cmdline(&cmdline)?;
    for spec in &specs {
        mount_share(spec)?;
    }
    Ok(specs.len())
}

fn mount_share(spec: &MountSpec) -> Result<(), MountError> {
    fs::create_dir_all(&spec.target).map_err(|source| MountError::Mkdir {
        path: spec.target.clone(),
        source,
    })?;
    let failed = |source| MountError::Mount {
        tag: spec.tag.clone(),
        path: spec.target.clone(),
        source,
    };
    let invalid = || failed(io::Error::from_raw_os_error(libc::EINVAL));
    let tag = CString::new(spec.tag.as_str()).map_err(|_| invalid())?;
    let target = CString::new(spec.target.as_os_str().as_bytes()).map_err(|_| invalid())?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_are_read_in_order_with_their_mode() {
        // Arrange
        let cmdline = "console=ttyS0 bulkhead.mount=mount1:/work quiet \
                       bulkhead.mount=mount0:/work/inner%20dir:ro\n";

        // Act
        let specs = parse_cmdline(cmdline).unwrap();

        // Assert
        assert_eq!(
            specs,
            [
                MountSpec {
                    tag: "mount1".into(),
                    target: "/work".into(),
                    read_only: false
                },
                MountSpec {
                    tag: "mount0".into(),
                    target: "/work/inner dir".into(),
                    read_only: true
                },
            ]
        );
    }

    #[test]
    fn escaped_colons_and_percent_signs_are_decoded() {
        // Arrange / Act
        let specs = parse_cmdline("bulkhead.mount=t:/a%3Ab%25c:ro").unwrap();

        // Assert
        assert_eq!(specs[0].target, PathBuf::from("/a:b%c"));
        assert!(specs[0].read_only);
    }

    #[test]
    fn no_parameter_means_no_mounts() {
        // Arrange / Act
        let specs = parse_cmdline("console=ttyS0 bulkhead.hostname=x").unwrap();

        // Assert
        assert!(specs.is_empty());
    }

    #[test]
    fn malformed_parameters_are_refused() {
        // Arrange
        let bad = [
            "bulkhead.mount=notag",
            "bulkhead.mount=:/work",
            "bulkhead.mount=t/x:/work",
            "bulkhead.mount=t:work",
            "bulkhead.mount=t:/",
            "bulkhead.mount=t:/a/../etc",
            "bulkhead.mount=t:/a%2",
            "bulkhead.mount=t:/a%zz",
        ];

        // Act
        let results: Vec<_> = bad.iter().map(|c| parse_cmdline(c)).collect();

        // Assert
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(MountError::Param { .. }))),
            "{results:?}"
        );
    }
}

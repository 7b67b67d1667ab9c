//! Host directories mounted into a sandbox over virtio-fs (`bulkhead run --mount
//! HOST_DIR:GUEST_DIR[:ro]`).
//!
//! Each [`Mount`] becomes one virtio-fs device of the VMM (a [`ShareConfig`] with the tag
//! `mountN`, N the mount's index) and one kernel command-line parameter telling the guest agent
//! where to mount it:
//!
//! ```text
//! bulkhead.mount=TAG:GUEST_DIR        read-write
//! bulkhead.mount=TAG:GUEST_DIR:ro     read-only
//! ```
//!
//! (encoded by [`bulkhead_protocol::boot`], which percent-encodes `GUEST_DIR`). Parameters come
//! parents first (fewer path components first), so a mount inside another mount's directory is
//! mounted on top of it, not hidden by it.
//!
//! Read-only is enforced by the VMM's file server (every write-type FUSE request fails with
//! `EROFS`); the agent also mounts such shares read-only, for early, clear errors. Files the
//! guest creates on a writable share belong, on the host, to the user running the VMM (or, when
//! that is root, to the directory's owner: a root-owned directory cannot be shared writable by
//! root, see [`MountError::RootOwned`]).
//!
//! Everything is checked on the host before the VM starts ([`check`]), so bad input is a clear
//! error rather than a VM that fails to boot.

use std::collections::HashSet;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use bulkhead_protocol::boot::Share;
use bulkhead_vmm::config::ShareConfig;

/// Prefix of the virtio-fs tags of mounts (`mount0`, `mount1`, ...).
pub const TAG_PREFIX: &str = "mount";

/// Most mounts per sandbox: each is a virtio-mmio device with its own interrupt line, and the
/// VMM has 19 for all devices.
pub const MAX_MOUNTS: usize = 8;

/// Longest guest directory, in bytes (before encoding): the kernel command line is 2 KiB.
pub const MAX_GUEST_PATH: usize = 160;

/// A host directory shared into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    /// The host directory (resolved to an absolute path by [`check`]).
    pub host: PathBuf,
    /// Where the guest sees it: an absolute path other than `/`, without `..` (`.` components
    /// and repeated or trailing slashes are dropped).
    pub guest: PathBuf,
    /// Refuse every change on the host side (`EROFS`).
    pub read_only: bool,
}

/// Invalid mounts.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The value of `--mount` is not `HOST_DIR:GUEST_DIR[:ro]`.
    #[error("--mount `{0}` is not HOST_DIR:GUEST_DIR[:ro]")]
    Syntax(String),
    /// The host directory does not exist.
    #[error("mount source {} does not exist", .0.display())]
    SourceMissing(PathBuf),
    /// The host directory cannot be resolved (permissions, a symlink loop, ...).
    #[error("mount source {}: {source}", path.display())]
    Source {
        /// The path given.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The host path is not a directory.
    #[error("mount source {} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    /// The guest path is relative.
    #[error("mount target {} is not an absolute path", .0.display())]
    GuestNotAbsolute(PathBuf),
    /// The guest path is `/`, has `.` or `..` components, or is too long.
    #[error("mount target {} is not usable: {reason}", path.display())]
    GuestInvalid {
        /// The guest path.
        path: PathBuf,
        /// Why.
        reason: &'static str,
    },
    /// Two mounts have the same guest path.
    #[error("mount target {} is given twice", .0.display())]
    DuplicateGuest(PathBuf),
    /// More mounts than devices the VMM can attach.
    #[error("{0} mounts given; at most {MAX_MOUNTS} are supported")]
    TooMany(usize),
    /// A writable share served by host root would create root-owned files on the host.
    #[error(
        "refusing to mount {} read-write: bulkhead runs as root and the directory is owned by \
         root, so the guest's files would belong to host root; chown it to an unprivileged user \
         or add :ro",
        .0.display()
    )]
    RootOwned(PathBuf),
}

impl FromStr for Mount {
    type Err = MountError;

    /// Parses `HOST_DIR:GUEST_DIR`, `HOST_DIR:GUEST_DIR:ro` or `...:rw`. The guest path is the
    /// part after the last remaining `:`, so a host path may contain colons.
    fn from_str(s: &str) -> Result<Mount, MountError> {
        let syntax = || MountError::Syntax(s.to_owned());
        let (rest, read_only) = match (s.strip_suffix(":ro"), s.strip_suffix(":rw")) {
            (Some(rest), _) => (rest, true),
            (None, Some(rest)) => (rest, false),
            (None, None) => (s, false),
        };
        let (host, guest) = rest.rsplit_once(':').ok_or_else(syntax)?;
        // A guest path of `ro`/`rw` is a mode given twice (`H:G:ro:ro`), not a path.
        if host.is_empty() || guest.is_empty() || guest == "ro" || guest == "rw" {
            return Err(syntax());
        }
        Ok(Mount {
            host: PathBuf::from(host),
            guest: PathBuf::from(guest),
            read_only,
        })
    }
}

/// What the VMM and the guest agent get for a list of mounts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prepared {
    /// The virtio-fs devices, in mount order.
    pub shares: Vec<ShareConfig>,
    /// The agent's `bulkhead.mount=` boot parameters, parents first.
    pub params: Vec<Share>,
}

/// Validates `mounts` and returns them with host paths made absolute (symlinks resolved) and
/// guest paths normalised.
///
/// # Errors
/// The first invalid mount's [`MountError`].
pub fn check(mounts: &[Mount]) -> Result<Vec<Mount>, MountError> {
    if mounts.len() > MAX_MOUNTS {
        return Err(MountError::TooMany(mounts.len()));
    }
    let mut seen = HashSet::new();
    let mut checked = Vec::with_capacity(mounts.len());
    for mount in mounts {
        let guest = guest_path(&mount.guest)?;
        if !seen.insert(guest.clone()) {
            return Err(MountError::DuplicateGuest(guest));
        }
        let host = host_dir(&mount.host, mount.read_only)?;
        checked.push(Mount {
            host,
            guest,
            read_only: mount.read_only,
        });
    }
    Ok(checked)
}

/// Checks `mounts` and builds the VMM's shares and the agent's boot parameters.
///
/// # Errors
/// As [`check`].
pub fn prepare(mounts: &[Mount]) -> Result<Prepared, MountError> {
    let mounts = check(mounts)?;
    let shares = mounts
        .iter()
        .enumerate()
        .map(|(i, m)| ShareConfig {
            tag: format!("{TAG_PREFIX}{i}"),
            path: m.host.clone(),
            read_only: m.read_only,
            owner: None,
            follow_host_mounts: false,
        })
        .collect();
    let mut order: Vec<usize> = (0..mounts.len()).collect();
    order.sort_by_key(|&i| mounts[i].guest.components().count());
    let params = order
        .into_iter()
        .map(|i| Share {
            tag: format!("{TAG_PREFIX}{i}"),
            guest_dir: mounts[i].guest.clone(),
            read_only: mounts[i].read_only,
        })
        .collect();
    Ok(Prepared { shares, params })
}

/// The guest path, normalised (no `.` components, trailing or doubled `/`), if it is absolute,
/// not `/`, without `..` components or control characters (newlines, tabs, escapes: they would
/// show up in `mount` tables and logs) and at most [`MAX_GUEST_PATH`] bytes.
fn guest_path(path: &Path) -> Result<PathBuf, MountError> {
    if !path.is_absolute() {
        return Err(MountError::GuestNotAbsolute(path.to_owned()));
    }
    let invalid = |reason| MountError::GuestInvalid {
        path: path.to_owned(),
        reason,
    };
    let mut normal = PathBuf::from("/");
    for component in path.components() {
        match component {
            Component::RootDir => {}
            Component::Normal(name) => normal.push(name),
            _ => return Err(invalid("it has .. components")),
        }
    }
    if normal == Path::new("/") {
        return Err(invalid("the guest's root cannot be replaced"));
    }
    if normal.as_os_str().len() > MAX_GUEST_PATH {
        return Err(invalid("it is longer than 160 bytes"));
    }
    if normal
        .as_os_str()
        .as_bytes()
        .iter()
        .any(u8::is_ascii_control)
    {
        return Err(invalid("it contains control characters"));
    }
    Ok(normal)
}

/// The host directory, absolute and with symlinks resolved.
fn host_dir(path: &Path, read_only: bool) -> Result<PathBuf, MountError> {
    let resolved = path.canonicalize().map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => MountError::SourceMissing(path.to_owned()),
        _ => MountError::Source {
            path: path.to_owned(),
            source,
        },
    })?;
    let meta = std::fs::metadata(&resolved).map_err(|source| MountError::Source {
        path: path.to_owned(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(MountError::NotADirectory(path.to_owned()));
    }
    // SAFETY: geteuid only reads the calling thread's credentials.
    let root = unsafe { libc::geteuid() } == 0;
    if root && !read_only && meta.uid() == 0 {
        return Err(MountError::RootOwned(path.to_owned()));
    }
    Ok(resolved)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn mount(host: &Path, guest: &str, read_only: bool) -> Mount {
        Mount {
            host: host.to_owned(),
            guest: PathBuf::from(guest),
            read_only,
        }
    }

    /// A directory the tests may share read-write whoever runs them (not root-owned as root).
    pub(crate) fn shareable_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: geteuid only reads credentials.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(dir.path(), Some(1000), Some(1000)).unwrap();
        }
        dir
    }

    #[test]
    fn mount_flags_parse_host_guest_and_mode() {
        // Arrange / Act
        let rw: Mount = "/src:/work".parse().unwrap();
        let ro: Mount = "/src:/work:ro".parse().unwrap();
        let explicit_rw: Mount = "/a:b:/work:rw".parse().unwrap();

        // Assert
        assert_eq!(rw, mount(Path::new("/src"), "/work", false));
        assert_eq!(ro, mount(Path::new("/src"), "/work", true));
        assert_eq!(explicit_rw, mount(Path::new("/a:b"), "/work", false));
    }

    #[test]
    fn malformed_mount_flags_are_refused() {
        // Arrange
        let bad = [
            "/src",
            ":/work",
            "/src:",
            "/src:ro",
            "",
            "/d:/x:ro:ro",
            "/d:/x:rw:ro",
        ];

        // Act
        let results: Vec<_> = bad.iter().map(|s| s.parse::<Mount>()).collect();

        // Assert
        assert!(
            results
                .iter()
                .all(|r| matches!(r, Err(MountError::Syntax(_)))),
            "{results:?}"
        );
    }

    #[test]
    fn a_missing_source_is_reported_as_missing() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");

        // Act
        let err = check(&[mount(&missing, "/work", false)]).unwrap_err();

        // Assert
        assert!(matches!(err, MountError::SourceMissing(_)), "{err:?}");
        assert!(err.to_string().contains("does not exist"), "{err}");
    }

    #[test]
    fn a_file_as_source_is_not_a_directory() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();

        // Act
        let err = check(&[mount(&file, "/work", true)]).unwrap_err();

        // Assert
        assert!(matches!(err, MountError::NotADirectory(_)), "{err:?}");
    }

    #[test]
    fn guest_paths_must_be_absolute_and_plain() {
        // Arrange
        let dir = shareable_dir();
        let cases = ["work", "/", "/a/../b", "//", "/mnt/a\nb", "/mnt/\x1b[2J"];

        // Act
        let errors: Vec<String> = cases
            .iter()
            .map(|g| {
                check(&[mount(dir.path(), g, false)])
                    .unwrap_err()
                    .to_string()
            })
            .collect();

        // Assert
        assert!(errors[0].contains("not an absolute path"), "{errors:?}");
        assert!(
            errors[1..].iter().all(|e| e.contains("is not usable")),
            "{errors:?}"
        );
    }

    #[test]
    fn the_same_guest_path_twice_is_refused() {
        // Arrange
        let dir = shareable_dir();
        let mounts = [
            mount(dir.path(), "/work", false),
            mount(dir.path(), "/work/", true),
        ];

        // Act
        let err = check(&mounts).unwrap_err();

        // Assert
        assert!(matches!(err, MountError::DuplicateGuest(_)), "{err:?}");
        assert!(err.to_string().contains("/work is given twice"), "{err}");
    }

    #[test]
    fn too_many_mounts_are_refused() {
        // Arrange
        let dir = shareable_dir();
        let mounts: Vec<Mount> = (0..=MAX_MOUNTS)
            .map(|i| mount(dir.path(), &format!("/m{i}"), true))
            .collect();

        // Act
        let err = check(&mounts).unwrap_err();

        // Assert
        assert!(matches!(err, MountError::TooMany(9)), "{err:?}");
    }

    #[test]
    fn shares_get_one_tag_each_and_the_boot_parameters_list_parents_first() {
        // Arrange
        let dir = shareable_dir();
        let mounts = [
            mount(dir.path(), "/work/inner dir", true),
            mount(dir.path(), "/work", false),
        ];

        // Act
        let prepared = prepare(&mounts).unwrap();

        // Assert
        let tags: Vec<&str> = prepared.shares.iter().map(|s| s.tag.as_str()).collect();
        assert_eq!(tags, ["mount0", "mount1"]);
        assert!(prepared.shares[0].read_only && !prepared.shares[1].read_only);
        assert_eq!(prepared.shares[0].path, dir.path().canonicalize().unwrap());
        let order: Vec<(&str, &Path, bool)> = prepared
            .params
            .iter()
            .map(|p| (p.tag.as_str(), p.guest_dir.as_path(), p.read_only))
            .collect();
        assert_eq!(
            order,
            [
                ("mount1", Path::new("/work"), false),
                ("mount0", Path::new("/work/inner dir"), true)
            ]
        );
    }

    #[test]
    fn root_cannot_share_a_root_owned_directory_read_write_needs_root() {
        // Arrange
        crate::testing::require_root();
        let dir = tempfile::tempdir().unwrap();

        // Act
        let rw = check(&[mount(dir.path(), "/work", false)]);
        let ro = check(&[mount(dir.path(), "/work", true)]);

        // Assert
        assert!(matches!(rw, Err(MountError::RootOwned(_))), "{rw:?}");
        assert!(ro.is_ok(), "{ro:?}");
    }
}

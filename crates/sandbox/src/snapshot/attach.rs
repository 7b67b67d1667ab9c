//! Attaching mounts and a workspace to a restored sandbox that is already running: a warm-pool
//! clone handed out for a create with `--mount`/`--workspace`.
//!
//! A restore attaches them as it starts the VMM (`--share TAG=DIR`, see [`super::slots`]). A
//! clone restored earlier has every share slot on an empty directory, unmounted in the guest.
//! [`Sandbox::attach_shares`] sends each directory to the running VMM over its control socket
//! (`attach_share`, the directory's descriptor passed with SCM_RIGHTS: a jailed VMM sees only
//! its private root), records the workspace like a start would, and returns the boot
//! parameters the agent mounts them from (`RestoredRequest::share_params`, sent with the
//! clone's new identity).
//!
//! For a jailed VMM the descriptor is a detached copy of the directory's mount (`open_tree(2)`
//! with `OPEN_TREE_CLONE`: `..` from its root goes nowhere), made `nosuid`, `nodev`, `noexec`
//! and, for a read-only share, read-only (`mount_setattr(2)`), as the jail's bind mounts of a
//! boot's shares are; where the kernel cannot (before Linux 5.12) the attach fails rather than
//! hand the VMM a way into the host's tree. Without the jail the VMM sees the host's files
//! anyway and gets the directory opened `O_PATH`.
//!
//! **Who serves them.** A jailed VMM acts as one uid/gid, chosen from its shares when it starts
//! ([`crate::jail`]); a clone's VMM started with none, so it runs as a fresh id or as the
//! configured [`SandboxConfig::jail_owner`]. A clone takes only shares that need exactly the
//! identity it runs as ([`check_attachable`]): a clone running as a real user serves that
//! user's creates and no others (a create without shares needs a fresh id), so no user can
//! reach, through the VMM it runs as, a sandbox that is not serving its directories. Any other
//! create restores a sandbox of its own.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use bulkhead_vmm::config::ShareConfig;
use bulkhead_vmm::control::{self, AttachShare, Request};

use super::slots::{self, Attached, ShareSlots};
use crate::jail::{self, JailError, ShareOwner};
use crate::sandbox::{Error, Sandbox, SandboxConfig, API_SOCKET};
use crate::workspace;

/// How long the VMM's control socket may take to take one directory.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);

/// `OPEN_TREE_CLONE` of `open_tree(2)` (`<linux/mount.h>`): a detached copy of the mount.
const OPEN_TREE_CLONE: libc::c_uint = 1;
/// `MOUNT_ATTR_RDONLY` of `mount_setattr(2)` (`<linux/mount.h>`).
const MOUNT_ATTR_RDONLY: u64 = 0x1;
/// `MOUNT_ATTR_NOSUID`.
const MOUNT_ATTR_NOSUID: u64 = 0x2;
/// `MOUNT_ATTR_NODEV`.
const MOUNT_ATTR_NODEV: u64 = 0x4;
/// `MOUNT_ATTR_NOEXEC`.
const MOUNT_ATTR_NOEXEC: u64 = 0x8;

/// The uid/gid a jailed clone's VMM runs as when `owner` is its
/// [`SandboxConfig::jail_owner`]: that owner, else (any) fresh id.
pub fn clone_identity(owner: Option<(u32, u32)>) -> (u32, u32) {
    owner.unwrap_or((jail::ID_BASE, jail::ID_BASE))
}

/// Whether `config`'s mounts and workspace can be attached to a running clone restored from a
/// snapshot with the share slots `slots` whose VMM runs as `vmm` (`None`: not jailed, it serves
/// every share as a boot would): enough slots, and (jailed) exactly the identity its shares
/// need ([`jail::identity`]; no shares need a fresh id). Checked before a clone is taken;
/// [`Sandbox::attach_shares`] checks again against the clone's VMM itself.
///
/// # Errors
/// [`Error::Snapshot`] for too few share slots; [`Error::Jail`] with
/// [`JailError::Identity`] for shares another user must serve (or none, for a clone that runs
/// as a real user); the errors of [`workspace::check`] and
/// [`mounts::check`](crate::mounts::check) for unusable directories.
pub fn check_attachable(
    config: &SandboxConfig,
    slots: ShareSlots,
    vmm: Option<(u32, u32)>,
) -> Result<(), Error> {
    let wanted = Wanted::of(config, slots)?;
    let Some(vmm) = vmm else {
        return Ok(());
    };
    let owners = wanted
        .shares
        .iter()
        .map(|share| {
            let meta = std::fs::metadata(&share.path)
                .map_err(|e| Error::Attach(format!("{}: {e}", share.path.display())))?;
            Ok((meta.uid(), meta.gid()))
        })
        .collect::<Result<Vec<_>, Error>>()?;
    check_identity(&wanted.shares, &owners, vmm)
}

/// What a create's mounts and workspace attach.
struct Wanted {
    /// The directories for the VMM, each with its slot's tag (resolved paths).
    shares: Vec<ShareConfig>,
    /// The agent's share parameters.
    params: Vec<String>,
    /// The workspace, for its records.
    ws: workspace::Prepared,
}

impl Wanted {
    /// `config`'s mounts and workspace, checked, and against `slots`.
    fn of(config: &SandboxConfig, slots: ShareSlots) -> Result<Wanted, Error> {
        let ws = workspace::prepare(config.workspace.as_ref(), &config.mounts)?;
        let Attached { shares, params } = slots::requested(config, &ws, slots)?;
        Ok(Wanted { shares, params, ws })
    }
}

impl Sandbox {
    /// Attaches `config`'s mounts and workspace to this running clone, restored from a
    /// snapshot with the share slots `slots` (see the module docs), and returns the agent's
    /// share parameters for them; an empty list when there are none.
    ///
    /// # Errors
    /// Those of [`check_attachable`], against the identity the VMM runs as (the owner of the
    /// runtime directory's `vmm/`) when `config.jail` is active; [`Error::RuntimeDir`] when
    /// that cannot be read; [`Error::Attach`] when a directory cannot be opened, or the VMM
    /// refuses it or does not answer within 10 s. The sandbox may then have some directories
    /// attached and none mounted: destroy it.
    pub fn attach_shares(
        &mut self,
        config: &SandboxConfig,
        slots: ShareSlots,
    ) -> Result<Vec<String>, Error> {
        let runtime = self.runtime_path().ok_or_else(|| Error::RuntimeDir {
            path: Default::default(),
            source: io::Error::other("the sandbox has no runtime directory"),
        })?;
        let runtime = runtime.to_owned();
        let jailed = jail::active(config.jail);
        let wanted = Wanted::of(config, slots)?;
        // Each directory is opened once, without following a symbolic link anywhere on its
        // (resolved) path; its owner and what the VMM gets are that directory, whatever
        // happens to the path meanwhile.
        let dirs = wanted
            .shares
            .iter()
            .map(|share| open_dir(&share.path, jailed).map_err(|e| attach_error(share, e)))
            .collect::<Result<Vec<OwnedFd>, Error>>()?;
        if jailed {
            let owners = dirs
                .iter()
                .zip(&wanted.shares)
                .map(|(dir, share)| owner_of(dir).map_err(|e| attach_error(share, e)))
                .collect::<Result<Vec<_>, Error>>()?;
            check_identity(&wanted.shares, &owners, vmm_identity(&runtime)?)?;
        }
        let socket = runtime.join(API_SOCKET);
        for (share, dir) in wanted.shares.iter().zip(dirs) {
            send_share(&socket, share, dir, jailed)?;
        }
        workspace::record(&runtime, &wanted.ws, None)?;
        Ok(wanted.params)
    }
}

/// The uid/gid the jailed VMM of the runtime directory `runtime` runs as: the owner of its
/// `vmm/`.
fn vmm_identity(runtime: &Path) -> Result<(u32, u32), Error> {
    let vmm_dir = runtime.join(jail::VMM_DIR);
    let meta = std::fs::metadata(&vmm_dir).map_err(|source| Error::RuntimeDir {
        path: vmm_dir.clone(),
        source,
    })?;
    Ok((meta.uid(), meta.gid()))
}

/// Refuses `shares`, whose directories belong to `dir_owners` (in order), unless a VMM running
/// as `running` serves them as one started with them would ([`jail::identity`],
/// [`jail::same_identity`]).
fn check_identity(
    shares: &[ShareConfig],
    dir_owners: &[(u32, u32)],
    running: (u32, u32),
) -> Result<(), Error> {
    let owners: Vec<ShareOwner> = shares
        .iter()
        .zip(dir_owners)
        .map(|(share, dir_owner)| ShareOwner {
            path: share.path.clone(),
            owner: share.owner.unwrap_or(*dir_owner),
            read_only: share.read_only,
        })
        .collect();
    // The slot only picks a fresh id, and any fresh id will do.
    let needed = jail::identity(&owners, 0)?;
    if !jail::same_identity(needed, running) {
        return Err(Error::Jail(JailError::Identity { needed, running }));
    }
    Ok(())
}

/// The owner of the open file `dir`.
fn owner_of(dir: &OwnedFd) -> io::Result<(u32, u32)> {
    let meta = File::from(dir.try_clone()?).metadata()?;
    Ok((meta.uid(), meta.gid()))
}

/// [`Error::Attach`] for `share`.
fn attach_error(share: &ShareConfig, e: impl std::fmt::Display) -> Error {
    Error::Attach(format!("{} ({}): {e}", share.path.display(), share.tag))
}

/// Sends `share`'s directory `dir` (for a `jailed` VMM: a detached, restricted copy of its
/// mount) to the VMM's control socket `socket` for the virtio-fs device `share.tag`.
fn send_share(socket: &Path, share: &ShareConfig, dir: OwnedFd, jailed: bool) -> Result<(), Error> {
    let refused = |e: String| attach_error(share, e);
    let dir = match jailed {
        true => detached_copy(&dir, share.read_only).map_err(|e| refused(e.to_string()))?,
        false => dir,
    };
    let request = Request::AttachShare(AttachShare {
        tag: share.tag.clone(),
        read_only: share.read_only,
        owner: share.owner,
    });
    let answer =
        control::send_with_fd(socket, &request, dir.as_fd(), ATTACH_TIMEOUT).map_err(refused)?;
    match answer.ok {
        true => Ok(()),
        false => Err(refused(answer.error.unwrap_or_default())),
    }
}

/// `struct mount_attr` of `mount_setattr(2)` (`<linux/mount.h>`).
#[repr(C)]
#[derive(Default)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// The directory `dir` as a detached copy of its mount (`open_tree(2)`), made `nosuid`,
/// `nodev`, `noexec` and, for `read_only`, read-only (`mount_setattr(2)`). Needs
/// `CAP_SYS_ADMIN` and Linux 5.12.
fn detached_copy(dir: &OwnedFd, read_only: bool) -> io::Result<OwnedFd> {
    let flags =
        OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_EMPTY_PATH as libc::c_uint;
    // SAFETY: open_tree reads the empty NUL-terminated path (AT_EMPTY_PATH: `dir` itself) and
    // returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, dir.as_raw_fd(), c"".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut attr = MountAttr {
        attr_set: MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        ..MountAttr::default()
    };
    if read_only {
        attr.attr_set |= MOUNT_ATTR_RDONLY;
    }
    // SAFETY: mount_setattr reads `attr` (its size given) and changes the mount of `tree`,
    // which the empty path with AT_EMPTY_PATH names.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}

/// `struct open_how` of `openat2(2)` (`<linux/openat2.h>`).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `RESOLVE_NO_SYMLINKS` of `openat2(2)`.
const RESOLVE_NO_SYMLINKS: u64 = 0x04;

/// The directory `path` (resolved already), opened `O_PATH` with no symbolic link followed on
/// the way (`openat2(2)`, Linux 5.6); without it, and only for an unjailed VMM, opened plainly.
fn open_dir(path: &Path, jailed: bool) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: RESOLVE_NO_SYMLINKS,
    };
    // SAFETY: openat2 reads the NUL-terminated path and `how` (its size given) and returns a
    // new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            c_path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENOSYS) if !jailed => open_path(path),
        _ => Err(err),
    }
}

/// `path` opened `O_PATH | O_DIRECTORY`.
fn open_path(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir: File = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(path)?;
    Ok(dir.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detached_copy_is_the_directory_restricted_and_read_only_when_asked_needs_root() {
        // Arrange: open_tree needs CAP_SYS_ADMIN.
        crate::testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"x").unwrap();

        // Act
        let opened = open_dir(dir.path(), true).unwrap();
        let ro = File::from(detached_copy(&opened, true).unwrap());
        let rw = File::from(detached_copy(&opened, false).unwrap());

        // Assert: the same directory, on a mount with the jail's flags.
        let want = std::fs::metadata(dir.path()).unwrap().ino();
        assert_eq!(ro.metadata().unwrap().ino(), want);
        let flags = |f: &File| {
            // SAFETY: statvfs is plain data; all zeroes is a valid value.
            let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
            // SAFETY: fstatvfs writes into `st` for a valid descriptor.
            assert_eq!(unsafe { libc::fstatvfs(f.as_raw_fd(), &mut st) }, 0);
            st.f_flag
        };
        let restricted = libc::ST_NOSUID | libc::ST_NODEV | libc::ST_NOEXEC;
        assert_eq!(
            flags(&ro) & (restricted | libc::ST_RDONLY),
            restricted | libc::ST_RDONLY
        );
        assert_eq!(flags(&rw) & (restricted | libc::ST_RDONLY), restricted);
    }

    #[test]
    fn a_share_directory_opens_only_without_a_symbolic_link_on_its_path() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", dir.path().join("link")).unwrap();

        // Act
        let real = open_dir(&dir.path().join("real"), true);
        let through_link = open_dir(&dir.path().join("link"), true);
        let missing = open_dir(&dir.path().join("gone"), true);

        // Assert
        assert!(real.is_ok());
        assert_eq!(through_link.unwrap_err().raw_os_error(), Some(libc::ELOOP));
        assert_eq!(missing.unwrap_err().raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn a_clone_serves_only_creates_whose_shares_need_its_identity() {
        // Arrange: a root-owned read-only directory (served as "others": any fresh id).
        let dir = tempfile::tempdir().unwrap();
        let share = |read_only| ShareConfig {
            tag: "mount0".into(),
            path: dir.path().to_owned(),
            read_only,
            owner: Some((0, 0)),
            follow_host_mounts: false,
        };
        let fresh = clone_identity(None);
        let user = clone_identity(Some((1000, 1000)));

        let root = [(0, 0)];

        // Act / Assert
        assert!(check_identity(&[], &[], fresh).is_ok());
        assert!(check_identity(&[share(true)], &root, fresh).is_ok());
        assert!(
            check_identity(&[], &[], user).is_err(),
            "a clone running as a user is for that user's shares only"
        );
        let users = ShareConfig {
            owner: None,
            ..share(false)
        };
        let theirs = [(1000, 1000)];
        assert!(check_identity(std::slice::from_ref(&users), &theirs, user).is_ok());
        assert!(check_identity(&[users], &theirs, fresh).is_err());
    }
}

//! [`ShareFs`]: one shared host directory, served by fuse-backend-rs's `PassthroughFs` behind
//! this device's policy (its `FileSystem` implementation is in [`filesystem`](super::filesystem)).
//!
//! Opening a share validates it once, up front: the directory exists and is a directory, the
//! identity it will be served as is allowed ([`Identity::resolve`]) and can read it, and a writable
//! share is never served as host root. The directory is then pinned by an `O_PATH` descriptor:
//! `PassthroughFs` (re)imports its root — at every FUSE_INIT and FUSE_DESTROY, which the guest
//! can send at will — from `/proc/self/fd/<that fd>/.`, never from the host path, so renaming or
//! replacing the path afterwards (even through another share) cannot move the root elsewhere.

use std::collections::HashMap;
use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use fuse_backend_rs::api::filesystem::Context;
use fuse_backend_rs::passthrough::{CachePolicy, Config, PassthroughFs};

use super::identity::{Assumed, Identity};
use super::Error;

/// A shared host directory as the FUSE server sees it: the passthrough file system plus the
/// share's policy (read-only, owner identity, single-component names).
pub struct ShareFs {
    inner: PassthroughFs<()>,
    identity: Identity,
    read_only: bool,
    path: PathBuf,
    /// Pins the share's root; `inner` imports it through `/proc/self/fd`.
    _root: File,
    /// A FUSE session is live: FUSE_INIT succeeded and no FUSE_DESTROY (or device reset) ended it.
    session: AtomicBool,
    /// The open flags of each file handle the guest holds, as given to the passthrough file
    /// system at open or create ([`ShareFs::io_flags`]).
    handle_flags: Mutex<HashMap<u64, u32>>,
}

impl std::fmt::Debug for ShareFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareFs")
            .field("path", &self.path)
            .field("read_only", &self.read_only)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl ShareFs {
    /// Opens `shared_dir` for serving, read-only or not, as `owner` (default: the directory's
    /// owner when the VMM runs as root, else the VMM's own uid:gid).
    ///
    /// # Errors
    /// [`Error::OpenDir`], [`Error::NotADirectory`], [`Error::OwnerNeedsRoot`],
    /// [`Error::RootOwner`], [`Error::OwnerCannotAccess`], [`Error::Passthrough`].
    pub fn open(
        shared_dir: &Path,
        read_only: bool,
        owner: Option<(u32, u32)>,
    ) -> Result<ShareFs, Error> {
        ShareFs::from_root(open_dir(shared_dir)?, shared_dir, read_only, owner)
    }

    /// Like [`ShareFs::open`], for a directory already open as `root` (any descriptor of it,
    /// `O_PATH` included: one received from the host at run time, see
    /// `crate::control::Request::AttachShare`); `shared_dir` names it in messages.
    ///
    /// # Errors
    /// As [`ShareFs::open`]; [`Error::NotADirectory`] when `root` is no directory.
    pub fn from_root(
        root: File,
        shared_dir: &Path,
        read_only: bool,
        owner: Option<(u32, u32)>,
    ) -> Result<ShareFs, Error> {
        let meta = root.metadata().map_err(|source| Error::OpenDir {
            path: shared_dir.to_owned(),
            source,
        })?;
        if !meta.is_dir() {
            return Err(Error::NotADirectory(shared_dir.to_owned()));
        }
        let process = Identity::process();
        let identity =
            Identity::resolve(owner, (meta.uid(), meta.gid()), process).map_err(|(uid, gid)| {
                Error::OwnerNeedsRoot {
                    uid,
                    gid,
                    euid: process.0,
                    egid: process.1,
                }
            })?;
        if identity.is_root() && !read_only {
            return Err(Error::RootOwner(shared_dir.to_owned()));
        }
        check_access(&root, &identity).map_err(|source| Error::OwnerCannotAccess {
            path: shared_dir.to_owned(),
            uid: identity.uid,
            gid: identity.gid,
            source,
        })?;
        let inner = PassthroughFs::new(passthrough_config(&root)).map_err(Error::Passthrough)?;
        Ok(ShareFs {
            inner,
            identity,
            read_only,
            path: shared_dir.to_owned(),
            _root: root,
            session: AtomicBool::new(false),
            handle_flags: Mutex::new(HashMap::new()),
        })
    }

    /// Whether the guest has a live FUSE session (virtio-fs mounted): FUSE_INIT succeeded and
    /// neither FUSE_DESTROY nor a device reset ended it since.
    pub fn session_live(&self) -> bool {
        self.session.load(Ordering::SeqCst)
    }

    /// Records that a FUSE session started (`true`, FUSE_INIT) or ended (`false`).
    pub(super) fn set_session(&self, live: bool) {
        self.session.store(live, Ordering::SeqCst);
    }

    /// The host identity the share is served as (the owner of the files the guest creates).
    pub fn identity(&self) -> Identity {
        self.identity
    }

    /// Whether every write-type operation fails with `EROFS`.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The shared directory as it was given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records the open flags of a new file handle (FUSE_OPEN, FUSE_CREATE).
    pub(super) fn record_handle(&self, handle: Option<u64>, flags: u32) {
        if let Some(handle) = handle {
            self.handles().insert(handle, flags);
        }
    }

    /// Forgets a released handle (`None`: every handle, as FUSE_DESTROY or a reset drops them).
    pub(super) fn forget_handle(&self, handle: Option<u64>) {
        match handle {
            Some(handle) => {
                self.handles().remove(&handle);
            }
            None => self.handles().clear(),
        }
    }

    /// The flags a FUSE_READ or FUSE_WRITE on `handle` is delegated with: the handle's own open
    /// flags, whatever the guest sent (`requested`, used only for a handle this share did not
    /// open, which the passthrough then refuses with `EBADF`). fuse-backend-rs 0.14's
    /// passthrough `read`/`write` call `fcntl(F_SETFL)` on the handle's descriptor when the
    /// request's flags differ from its open flags, and when that call fails they drop a `File`
    /// made from the borrowed descriptor, closing it: the descriptor is closed again when the
    /// handle is released, by then perhaps another file's (fuzzing found it: an open with
    /// `O_PATH`, then a read). Passing the open flags keeps that path from running, so the host
    /// descriptor's flags never change after the open either.
    pub(super) fn io_flags(&self, handle: u64, requested: u32) -> u32 {
        self.handles().get(&handle).copied().unwrap_or(requested)
    }

    fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u32>> {
        self.handle_flags.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The passthrough file system the policy delegates to.
    pub(super) fn inner(&self) -> &PassthroughFs<()> {
        &self.inner
    }

    /// Switches the calling thread to the share owner's credentials for one operation.
    pub(super) fn act(&self) -> io::Result<Assumed> {
        self.identity.assume()
    }

    /// `EROFS` on a read-only share.
    pub(super) fn writable(&self) -> io::Result<()> {
        if self.read_only {
            Err(errno(libc::EROFS))
        } else {
            Ok(())
        }
    }

    /// The context for `PassthroughFs::access`, which checks mode bits against its uid/gid: the
    /// owner's.
    pub(super) fn owner_context(&self) -> Context {
        Context {
            uid: self.identity.uid,
            gid: self.identity.gid,
            pid: 0,
        }
    }
}

/// The context every delegated operation gets. `PassthroughFs` switches to a context's uid/gid
/// around the system calls that create files unless they are 0; credentials are already switched
/// by [`ShareFs::act`], so they are 0 here and the guest's IDs are never used.
pub(super) const HOST_CONTEXT: Context = Context {
    uid: 0,
    gid: 0,
    pid: 0,
};

/// Checks that `name` is one path component: not empty, `.` or `..`, and without `/`.
///
/// # Errors
/// `EINVAL` otherwise.
pub fn check_name(name: &CStr) -> io::Result<()> {
    let bytes = name.to_bytes();
    let single = !bytes.is_empty() && bytes != b"." && bytes != b".." && !bytes.contains(&b'/');
    if single {
        Ok(())
    } else {
        Err(errno(libc::EINVAL))
    }
}

/// Whether `open(2)` flags could change the file: write access (`O_WRONLY`, `O_RDWR`, or the
/// invalid access mode 3), `O_TRUNC`, `O_APPEND` or `O_CREAT`.
pub fn opens_for_writing(flags: u32) -> bool {
    let flags = flags as i32;
    flags & libc::O_ACCMODE != libc::O_RDONLY
        || flags & (libc::O_TRUNC | libc::O_APPEND | libc::O_CREAT) != 0
}

/// Whether a `mknod` mode asks for something other than a regular file, FIFO or socket (a
/// character or block device, or an invalid type).
pub fn is_special_node(mode: u32) -> bool {
    !matches!(
        mode & libc::S_IFMT,
        0 | libc::S_IFREG | libc::S_IFIFO | libc::S_IFSOCK
    )
}

/// `mode` without the set-user-ID bit, and without set-group-ID unless it is for a
/// `directory` (where the bit only makes new entries inherit the group). The guest creates and
/// chmods host files as the share's owner: a set-ID bit would leave on the host an executable
/// that runs as that owner for any host user who can reach it, so the file server never sets
/// one.
pub fn without_set_id(mode: u32, directory: bool) -> u32 {
    match directory {
        true => mode & !libc::S_ISUID,
        false => mode & !(libc::S_ISUID | libc::S_ISGID),
    }
}

/// An `io::Error` from an errno value.
pub(super) fn errno(code: i32) -> io::Error {
    io::Error::from_raw_os_error(code)
}

/// Opens the shared directory as an `O_PATH` descriptor, following symlinks in the given path.
fn open_dir(path: &Path) -> Result<File, Error> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            Some(libc::ENOTDIR) => Error::NotADirectory(path.to_owned()),
            _ => Error::OpenDir {
                path: path.to_owned(),
                source,
            },
        })
}

/// Opens the directory for reading as `identity`: it needs read and search permission on it.
fn check_access(root: &File, identity: &Identity) -> io::Result<()> {
    let _creds = identity.assume()?;
    // SAFETY: a valid directory fd and a NUL-terminated path; the returned fd is checked and
    // owned by the File below.
    let fd = unsafe {
        libc::openat(
            root.as_raw_fd(),
            c".".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    drop(unsafe { File::from_raw_fd(fd) });
    Ok(())
}

/// The passthrough file system's options: root through the pinning fd, no xattrs (no way to set
/// `security.capability` or other privileged attributes), no writeback cache (guest writes reach
/// the host at once), close-to-open caching, the guest's open/opendir requests honoured.
fn passthrough_config(root: &File) -> Config {
    Config {
        root_dir: format!("/proc/self/fd/{}/.", root.as_raw_fd()),
        do_import: true,
        xattr: false,
        writeback: false,
        no_open: false,
        no_opendir: false,
        killpriv_v2: false,
        inode_file_handles: false,
        cache_policy: CachePolicy::Auto,
        ..Config::default()
    }
}

//! virtio-fs tests without KVM, at two levels:
//! - through the `FileSystem` trait of [`ShareFs`] directly, as the FUSE server calls it
//!   (read-only enforcement, containment, ownership);
//! - through the virtqueues ([`harness`]): raw FUSE messages on the request queue of an activated
//!   device driven by a real `EventManager`, replies read back from the used ring.
//!
//! The shares are temporary directories. When the tests run as root (as here), shares are served
//! as `nobody` (65534:65534), which owns the directory and its fixtures; otherwise as the test
//! process itself, and the tests that need root to switch identities say so and return.

use crate::devices::virtio::test_driver as driver;
mod harness;

mod device_api;
mod escape;
mod hostile;
mod ownership;
mod queue;
mod read_only;

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use fuse_backend_rs::abi::fuse_abi::{CreateIn, FsOptions, ROOT_ID};
use fuse_backend_rs::api::filesystem::{
    Context, Entry, FileSystem, ZeroCopyReader, ZeroCopyWriter,
};
use fuse_backend_rs::file_traits::FileReadWriteVolatile;

use super::identity::Identity;
use super::ShareFs;

/// `nobody:nogroup`, the owner of test shares when the tests run as root.
pub const NOBODY: (u32, u32) = (65534, 65534);
/// Contents of the `file` fixture.
pub const FILE_CONTENTS: &[u8] = b"hello from the host\n";

/// Whether the tests run as root (and can serve shares as another user).
pub fn running_as_root() -> bool {
    Identity::process().0 == 0
}

/// The uid:gid test shares are served as.
pub fn test_owner() -> (u32, u32) {
    if running_as_root() {
        NOBODY
    } else {
        Identity::process()
    }
}

/// `s` as a C string.
pub fn cstr(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// The guest's root user, as a FUSE request context.
pub fn guest_root() -> Context {
    Context {
        uid: 0,
        gid: 0,
        pid: 1,
    }
}

/// Makes `path` belong to the test owner (a no-op without root).
pub fn give_to_owner(path: &Path) {
    if running_as_root() {
        let (uid, gid) = NOBODY;
        std::os::unix::fs::lchown(path, Some(uid), Some(gid)).unwrap();
    }
}

/// A temporary directory holding a share (`share/`, owned by the test owner) and a directory
/// outside it (`outside/`, with `secret`), plus the share opened as a [`ShareFs`] and initialised
/// as FUSE_INIT would.
pub struct Share {
    base: tempfile::TempDir,
    pub fs: ShareFs,
}

impl Share {
    /// A share with the standard fixtures (`file`, `dir/`, `dir/inner`), read-only or not.
    pub fn new(read_only: bool) -> Share {
        let share = Share::with(populate, read_only, Some(test_owner()));
        share.init();
        share
    }

    /// A share whose directory `prepare` fills, opened with `owner`; not initialised.
    pub fn with(prepare: impl FnOnce(&Path), read_only: bool, owner: Option<(u32, u32)>) -> Share {
        let base = tempfile::tempdir().unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let root = base.path().join("share");
        std::fs::create_dir(&root).unwrap();
        give_to_owner(&root);
        let outside = base.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("secret"), b"host secret\n").unwrap();
        prepare(&root);
        let fs = ShareFs::open(&root, read_only, owner).unwrap();
        Share { base, fs }
    }

    /// FUSE_INIT.
    pub fn init(&self) {
        self.fs.init(FsOptions::empty()).unwrap();
    }

    /// The shared directory.
    pub fn root(&self) -> PathBuf {
        self.base.path().join("share")
    }

    /// The host path of `rel` inside the share.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root().join(rel)
    }

    /// The directory next to the share.
    pub fn outside_dir(&self) -> PathBuf {
        self.base.path().join("outside")
    }

    /// The host path of `rel` inside the directory next to the share.
    pub fn outside(&self, rel: &str) -> PathBuf {
        self.outside_dir().join(rel)
    }

    /// LOOKUP of `name` in `parent`, as the guest's root.
    pub fn lookup(&self, parent: u64, name: &str) -> io::Result<Entry> {
        self.fs.lookup(&guest_root(), parent, &cstr(name))
    }

    /// LOOKUP of `name` in the root; it must exist.
    pub fn node(&self, name: &str) -> u64 {
        self.lookup(ROOT_ID, name).unwrap().inode
    }

    /// CREATE of `name` in `parent` (mode 0644, umask 0), as the guest's root.
    pub fn create(&self, parent: u64, name: &CStr) -> io::Result<Entry> {
        let args = CreateIn {
            flags: (libc::O_RDWR | libc::O_CREAT) as u32,
            mode: libc::S_IFREG | 0o644,
            umask: 0,
            fuse_flags: 0,
        };
        self.fs
            .create(&guest_root(), parent, name, args)
            .map(|(entry, ..)| entry)
    }

    /// A snapshot of the host tree under the share's parent: every path with its type, mode,
    /// owner, size, mtime and contents (link targets for symlinks).
    pub fn host_tree(&self) -> Vec<String> {
        let mut out = Vec::new();
        snapshot(self.base.path(), &mut out);
        out.sort();
        out
    }
}

/// The standard fixtures, all owned by the test owner: `file`, `dir/`, `dir/inner`, `empty_dir/`.
pub fn populate(root: &Path) {
    for (rel, contents) in [
        ("file", FILE_CONTENTS),
        ("dir/inner", b"inner\n".as_slice()),
    ] {
        let path = root.join(rel);
        if let Some(parent) = path.parent().filter(|p| !p.exists()) {
            std::fs::create_dir(parent).unwrap();
            give_to_owner(parent);
        }
        std::fs::write(&path, contents).unwrap();
        give_to_owner(&path);
    }
    std::fs::create_dir(root.join("empty_dir")).unwrap();
    give_to_owner(&root.join("empty_dir"));
}

fn snapshot(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let contents = if meta.file_type().is_symlink() {
            std::fs::read_link(&path)
                .unwrap()
                .into_os_string()
                .into_encoded_bytes()
        } else if meta.is_file() {
            std::fs::read(&path).unwrap()
        } else {
            Vec::new()
        };
        out.push(format!(
            "{} mode={:o} owner={}:{} size={} mtime={}.{} {:?}",
            path.display(),
            meta.mode(),
            meta.uid(),
            meta.gid(),
            meta.size(),
            meta.mtime(),
            meta.mtime_nsec(),
            contents
        ));
        if meta.is_dir() {
            snapshot(&path, out);
        }
    }
}

/// The errno of a failed operation.
pub fn errno_of<T: std::fmt::Debug>(result: io::Result<T>) -> i32 {
    result.unwrap_err().raw_os_error().expect("an OS error")
}

/// The data side of a WRITE or READ the tests never expect the server to touch: every transfer
/// fails with `EFAULT`, so an operation that gets as far as moving data fails differently from
/// one the policy refused.
#[derive(Debug, Default)]
pub struct Untouched;

impl io::Read for Untouched {
    fn read(&mut self, _buf: &mut [u8]) -> io::Result<usize> {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }
}

impl io::Write for Untouched {
    fn write(&mut self, _buf: &[u8]) -> io::Result<usize> {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl ZeroCopyReader for Untouched {
    fn read_to(
        &mut self,
        _f: &mut dyn FileReadWriteVolatile,
        _count: usize,
        _off: u64,
    ) -> io::Result<usize> {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }
}

impl ZeroCopyWriter for Untouched {
    fn write_from(
        &mut self,
        _f: &mut dyn FileReadWriteVolatile,
        _count: usize,
        _off: u64,
    ) -> io::Result<usize> {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }

    fn available_bytes(&self) -> usize {
        0
    }
}

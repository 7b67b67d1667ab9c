//! The change set of a clone workspace: how the overlay's merged view differs from its lower
//! directory (the host's `DIR`), computed from the overlay's upper directory.
//!
//! overlayfs (`Documentation/filesystems/overlayfs.rst`) records every change in the upper
//! directory:
//! - a file or symbolic link written, created or `chmod`ed is copied up whole (the workspace
//!   is mounted with `metacopy=off`), so its upper copy holds the full new contents;
//! - a deletion is a *whiteout*: a character device 0/0 (or, on newer kernels, an empty file
//!   with the `trusted.overlay.whiteout` attribute) named like the deleted entry;
//! - a directory that replaces a deleted one is *opaque* (`trusted.overlay.opaque` = `y`): the
//!   lower directory's contents are hidden below it;
//! - renamed directories are copied (the workspace is mounted with `redirect_dir=off`, so no
//!   redirects exist).
//!
//! [`compute`] walks the upper directory and compares each entry with the same path in the lower
//! directory: a path absent there is added (`A`); a file or link present there is modified
//! (`M`) when its contents, link target or owner-executable bit differ (a copied-up but
//! unchanged file, e.g. after `touch` or `chmod 600`, is no change, as for git); a whiteout,
//! or an opaque directory hiding lower entries, deletes them (`D`, one record per file and link
//! plus one for the top directory of a deleted tree). Directories themselves are reported only
//! when files cannot express the change (a new directory with nothing reported below it, the top
//! of a deleted tree). Entries whose names are not UTF-8, and devices, FIFOs and sockets, are
//! listed as skipped. Only lower directories reached through real directories are compared,
//! so a lower symbolic link never leads the comparison outside the lower tree.

use std::ffi::CString;
use std::fs::{self, File, Metadata};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use bulkhead_protocol::{ChangeStatus, EntryKind, SkippedEntry};

/// The extended attribute marking an opaque directory.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
/// The extended attribute marking an empty regular file as a whiteout (overlayfs "xwhiteout").
pub const WHITEOUT_XATTR: &str = "trusted.overlay.whiteout";

/// Owner-executable permission bit: the only mode bit git records.
const OWNER_EXEC: u32 = 0o100;

/// Errors computing a change set.
#[derive(Debug, thiserror::Error)]
pub enum ChangesError {
    /// Reading the upper or lower directory failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// What the kernel said.
        source: io::Error,
    },
}

/// One changed path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Path relative to the workspace root, `/`-separated.
    pub path: String,
    /// Added, modified or deleted.
    pub status: ChangeStatus,
    /// The new entry's kind (`A`/`M`), or the old one's (`D`).
    pub kind: EntryKind,
    /// Permission bits of the new entry (`A`/`M`) or the old one (`D`).
    pub mode: u32,
    /// Size of the new file or link target, bytes; 0 for directories and deletions.
    pub size: u64,
}

impl Change {
    /// Whether contents (file bytes or link target) belong to this change.
    pub fn has_contents(&self) -> bool {
        self.status != ChangeStatus::Deleted && self.kind != EntryKind::Dir
    }
}

/// Every change, sorted by path (a path appears twice only for a kind change: `D` then `A`),
/// and the entries that could not be described.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeSet {
    /// The changes.
    pub changes: Vec<Change>,
    /// Entries left out, with the reason.
    pub skipped: Vec<SkippedEntry>,
}

/// Computes the change set of the overlay whose upper directory is `upper` and whose lower
/// directory is `lower` (see the module documentation).
///
/// # Errors
/// [`ChangesError::Io`] when a directory cannot be read or a file compared.
pub fn compute(upper: &Path, lower: &Path) -> Result<ChangeSet, ChangesError> {
    let mut walk = Walk {
        upper,
        lower,
        out: ChangeSet::default(),
    };
    walk.dir(Path::new(""), true, false)?;
    let rank = |c: &Change| u8::from(c.status != ChangeStatus::Deleted);
    walk.out
        .changes
        .sort_by(|a, b| (a.path.as_bytes(), rank(a)).cmp(&(b.path.as_bytes(), rank(b))));
    walk.out.skipped.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(walk.out)
}

struct Walk<'a> {
    upper: &'a Path,
    lower: &'a Path,
    out: ChangeSet,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ChangesError + 'a {
    move |source| ChangesError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// `lstat`, with "not there" (including a non-directory on the way) as `None`.
fn lstat(path: &Path) -> Result<Option<Metadata>, ChangesError> {
    match fs::symlink_metadata(path) {
        Ok(meta) => Ok(Some(meta)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => Ok(None),
        Err(e) => Err(io_err("stat", path)(e)),
    }
}

/// Sorted names in `dir`.
fn names(dir: &Path) -> Result<Vec<std::ffi::OsString>, ChangesError> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err("read directory", dir))? {
        names.push(entry.map_err(io_err("read directory", dir))?.file_name());
    }
    names.sort();
    Ok(names)
}

/// The value of extended attribute `name` of `path` (not following symlinks), if set.
fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let c_path = CString::new(path.as_os_str().as_bytes()).ok()?;
    let c_name = CString::new(name).ok()?;
    let mut buf = [0u8; 16];
    // SAFETY: both strings are NUL-terminated and outlive the call; `buf` is writable for
    // `buf.len()` bytes.
    let n = unsafe {
        libc::lgetxattr(
            c_path.as_ptr(),
            c_name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    usize::try_from(n).ok().map(|n| buf[..n].to_vec())
}

fn is_whiteout(path: &Path, meta: &Metadata) -> bool {
    let ft = meta.file_type();
    (ft.is_char_device() && meta.rdev() == 0)
        || (ft.is_file() && meta.len() == 0 && xattr(path, WHITEOUT_XATTR).is_some())
}

fn is_opaque(path: &Path) -> bool {
    xattr(path, OPAQUE_XATTR).as_deref() == Some(b"y")
}

fn kind_of(meta: &Metadata) -> Option<EntryKind> {
    let ft = meta.file_type();
    if ft.is_dir() {
        Some(EntryKind::Dir)
    } else if ft.is_file() {
        Some(EntryKind::File)
    } else if ft.is_symlink() {
        Some(EntryKind::Symlink)
    } else {
        None
    }
}

impl Walk<'_> {
    /// Walks the upper directory `rel`. `lower_dir` says whether the lower tree has a real
    /// directory at `rel` (reached through directories only); `opaque` whether the lower
    /// directory is hidden (this directory or one above it is opaque).
    fn dir(&mut self, rel: &Path, lower_dir: bool, opaque: bool) -> Result<(), ChangesError> {
        let upper_names = names(&self.upper.join(rel))?;
        if lower_dir && opaque {
            for name in names(&self.lower.join(rel))? {
                if upper_names.binary_search(&name).is_err() {
                    self.deleted_tree(&rel.join(&name))?;
                }
            }
        }
        for name in &upper_names {
            self.entry(&rel.join(name), lower_dir, opaque)?;
        }
        Ok(())
    }

    fn entry(&mut self, rel: &Path, lower_dir: bool, opaque: bool) -> Result<(), ChangesError> {
        let upper_path = self.upper.join(rel);
        let Some(meta) = lstat(&upper_path)? else {
            return Ok(()); // vanished meanwhile
        };
        let lower_path = self.lower.join(rel);
        let lower = match lower_dir {
            true => lstat(&lower_path)?,
            false => None,
        };
        if is_whiteout(&upper_path, &meta) {
            if let Some(lower) = lower {
                self.deleted(rel, &lower)?;
            }
            return Ok(());
        }
        let Some(kind) = kind_of(&meta) else {
            self.skip(rel, "a device, FIFO or socket: not exported");
            return Ok(());
        };
        if kind == EntryKind::Dir {
            let lower_is_dir = lower.as_ref().is_some_and(Metadata::is_dir);
            if let Some(lower) = lower.as_ref().filter(|_| !lower_is_dir) {
                self.deleted(rel, lower)?;
            }
            let before = self.out.changes.len();
            let child_opaque = opaque || is_opaque(&upper_path);
            self.dir(rel, lower_is_dir, child_opaque)?;
            if !lower_is_dir && self.out.changes.len() == before {
                self.push(rel, ChangeStatus::Added, &meta, EntryKind::Dir);
            }
            return Ok(());
        }
        match lower {
            None => self.push(rel, ChangeStatus::Added, &meta, kind),
            Some(lower) if kind_of(&lower) == Some(kind) => {
                if differs(&upper_path, &meta, &lower_path, &lower, kind)? {
                    self.push(rel, ChangeStatus::Modified, &meta, kind);
                }
            }
            Some(lower) => {
                self.deleted(rel, &lower)?;
                self.push(rel, ChangeStatus::Added, &meta, kind);
            }
        }
        Ok(())
    }

    /// Records the deletion of the lower entry at `rel` (a whole tree for a directory).
    fn deleted(&mut self, rel: &Path, lower: &Metadata) -> Result<(), ChangesError> {
        match kind_of(lower) {
            Some(EntryKind::Dir) => self.deleted_tree(rel),
            Some(kind) => {
                self.push(rel, ChangeStatus::Deleted, lower, kind);
                Ok(())
            }
            None => Ok(()), // a lower device or FIFO: nothing git or tar would carry
        }
    }

    /// Records the deletion of everything at and below lower `rel`.
    fn deleted_tree(&mut self, rel: &Path) -> Result<(), ChangesError> {
        let path = self.lower.join(rel);
        let Some(meta) = lstat(&path)? else {
            return Ok(());
        };
        if !meta.is_dir() {
            return self.deleted(rel, &meta);
        }
        self.push(rel, ChangeStatus::Deleted, &meta, EntryKind::Dir);
        let mut stack = vec![rel.to_owned()];
        while let Some(dir) = stack.pop() {
            for name in names(&self.lower.join(&dir))? {
                let child = dir.join(name);
                let Some(meta) = lstat(&self.lower.join(&child))? else {
                    continue;
                };
                match kind_of(&meta) {
                    Some(EntryKind::Dir) => stack.push(child),
                    Some(kind) => self.push(&child, ChangeStatus::Deleted, &meta, kind),
                    None => {}
                }
            }
        }
        Ok(())
    }

    fn push(&mut self, rel: &Path, status: ChangeStatus, meta: &Metadata, kind: EntryKind) {
        let Some(path) = rel.to_str() else {
            self.skip(rel, "the name is not UTF-8: not exported");
            return;
        };
        let size = match (status, kind) {
            (ChangeStatus::Deleted, _) | (_, EntryKind::Dir) => 0,
            _ => meta.len(),
        };
        self.out.changes.push(Change {
            path: path.to_owned(),
            status,
            kind,
            mode: meta.mode() & 0o7777,
            size,
        });
    }

    fn skip(&mut self, rel: &Path, reason: &str) {
        self.out.skipped.push(SkippedEntry {
            path: rel.to_string_lossy().into_owned(),
            reason: reason.to_owned(),
        });
    }
}

/// Whether the upper entry differs from the lower one of the same kind: another link target;
/// for files another owner-executable bit, size or contents.
fn differs(
    upper: &Path,
    upper_meta: &Metadata,
    lower: &Path,
    lower_meta: &Metadata,
    kind: EntryKind,
) -> Result<bool, ChangesError> {
    if kind == EntryKind::Symlink {
        let a = fs::read_link(upper).map_err(io_err("read link", upper))?;
        let b = fs::read_link(lower).map_err(io_err("read link", lower))?;
        return Ok(a != b);
    }
    if (upper_meta.mode() ^ lower_meta.mode()) & OWNER_EXEC != 0
        || upper_meta.len() != lower_meta.len()
    {
        return Ok(true);
    }
    same_bytes(upper, lower).map(|same| !same)
}

/// Whether two files have the same contents, read in 64 KiB blocks.
fn same_bytes(a: &Path, b: &Path) -> Result<bool, ChangesError> {
    let mut fa = File::open(a).map_err(io_err("open", a))?;
    let mut fb = File::open(b).map_err(io_err("open", b))?;
    let (mut ba, mut bb) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let n = read_full(&mut fa, &mut ba).map_err(io_err("read", a))?;
        let m = read_full(&mut fb, &mut bb).map_err(io_err("read", b))?;
        if n != m || ba[..n] != bb[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
    }
}

fn read_full(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
#[path = "changes_tests.rs"]
mod tests;

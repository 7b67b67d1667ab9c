//! Extracting an untrusted tar stream below one directory (rules in [`super`]).

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tar::{Archive, Entry, EntryType};

use super::guard::Guard;
use super::path::{cstr, lstat_at, open_subdir, EntryName};
use super::sparse::copy_with_holes;
use super::{lossy, ArchiveError, Limits, MAX_NAME};
use crate::fsops::ArchiveDone;
use crate::workspace::SkippedEntry;

/// How to extract.
#[derive(Debug, Clone, Default)]
pub struct UnpackOptions {
    /// Replace the archive's top-level name with this one (`cp -r SRC DST` where `DST` does
    /// not exist yet); the archive must then have a single top-level name.
    pub rename_root: Option<Vec<u8>>,
    /// Keep set-user-ID, set-group-ID and sticky bits (the guest does; the host drops them,
    /// as `tar` does for a user who is not root).
    pub keep_special_bits: bool,
    /// Bounds on the stream.
    pub limits: Limits,
}

/// Extracts the tar stream `src` below the directory `dest` (see the module rules). Returns
/// the totals and the entries left out.
pub fn unpack(
    src: impl Read,
    dest: &OwnedFd,
    options: &UnpackOptions,
) -> Result<ArchiveDone, ArchiveError> {
    let mut archive = Archive::new(Guard::new(src, options.limits));
    let mut x = Extractor {
        dest,
        options,
        done: ArchiveDone::default(),
        dirs: Vec::new(),
        cache: None,
        apparent: 0,
        root: None,
    };
    for entry in archive.entries().map_err(ArchiveError::Stream)? {
        let mut entry = entry.map_err(ArchiveError::Stream)?;
        x.entry(&mut entry)?;
    }
    x.finish_dirs()?;
    Ok(x.done)
}

struct Extractor<'a> {
    dest: &'a OwnedFd,
    options: &'a UnpackOptions,
    done: ArchiveDone,
    /// Directories extracted: modes and times are set at the end (a read-only directory
    /// would refuse its own children).
    dirs: Vec<(EntryName, u32, i64)>,
    /// The last parent directory opened, by its components.
    cache: Option<(Vec<Vec<u8>>, OwnedFd)>,
    /// Apparent file bytes so far.
    apparent: u64,
    /// The archive's top-level name.
    root: Option<Vec<u8>>,
}

impl Extractor<'_> {
    fn entry<R: Read>(&mut self, entry: &mut Entry<'_, R>) -> Result<(), ArchiveError> {
        let kind = entry.header().entry_type();
        if matches!(kind, EntryType::XGlobalHeader) {
            return Ok(());
        }
        self.done.entries += 1;
        if self.done.entries > self.options.limits.entries {
            return Err(ArchiveError::Limit {
                what: "entries",
                limit: self.options.limits.entries,
            });
        }
        let name = self.name(&entry.path_bytes())?;
        let mode = entry.header().mode().map_err(ArchiveError::Stream)? & self.mode_mask();
        let mtime = entry.header().mtime().map_err(ArchiveError::Stream)? as i64;
        let Some((leaf, parents)) = name.parts().split_last() else {
            return match kind {
                EntryType::Directory => Ok(()),
                _ => Err(refused(
                    &name,
                    "a non-directory entry names the destination itself",
                )),
            };
        };
        let shown = name.display();
        let leaf = cstr(leaf, &shown)?;
        match kind {
            EntryType::Directory => {
                let parent = self.parent(parents)?;
                make_dir(parent, &leaf, &shown)?;
                self.dirs.push((name, mode, mtime));
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let size = entry.size();
                self.apparent = self.apparent.saturating_add(size);
                if self.apparent > self.options.limits.file_bytes {
                    return Err(ArchiveError::Limit {
                        what: "bytes of file contents",
                        limit: self.options.limits.file_bytes,
                    });
                }
                let parent = self.parent(parents)?;
                self.done.bytes += write_file(parent, &leaf, &shown, entry, (mode, mtime))?;
            }
            EntryType::Symlink => {
                let target = link_target(entry, &name)?;
                let parent = self.parent(parents)?;
                make_symlink(parent, &leaf, &shown, &target)?;
            }
            EntryType::Link => {
                let target = link_target(entry, &name)?;
                let target = self.name(&target)?;
                self.hard_link(&target, parents, &leaf, &shown)?;
            }
            other => {
                self.done.entries -= 1;
                self.done.skipped.push(SkippedEntry {
                    path: shown,
                    reason: format!("{} entries are not extracted", type_name(other)),
                });
            }
        }
        Ok(())
    }

    fn mode_mask(&self) -> u32 {
        if self.options.keep_special_bits {
            0o7777
        } else {
            0o777
        }
    }

    /// Validates a name and applies the root rename.
    fn name(&mut self, raw: &[u8]) -> Result<EntryName, ArchiveError> {
        let name = EntryName::parse(raw)?;
        let Some(rename) = &self.options.rename_root else {
            return Ok(name);
        };
        let Some(first) = name.parts().first() else {
            return Ok(name);
        };
        match &self.root {
            None => self.root = Some(first.clone()),
            Some(root) if root != first => {
                return Err(refused(&name, "a second top-level name (one was expected)"))
            }
            Some(_) => {}
        }
        Ok(name.renamed(rename))
    }

    /// The directory holding an entry, opened without following symlinks; missing
    /// directories on the way are created (mode 0755 before the umask).
    fn parent(&mut self, parts: &[Vec<u8>]) -> Result<&OwnedFd, ArchiveError> {
        let hit = matches!(&self.cache, Some((key, _)) if key.as_slice() == parts);
        if !hit {
            let fd = walk(self.dest, parts, true)?;
            self.cache = Some((parts.to_vec(), fd));
        }
        Ok(&self.cache.as_ref().expect("filled above").1)
    }

    fn hard_link(
        &mut self,
        target: &EntryName,
        parents: &[Vec<u8>],
        leaf: &CStr,
        shown: &str,
    ) -> Result<(), ArchiveError> {
        let Some((target_leaf, target_parents)) = target.parts().split_last() else {
            return Err(refused(target, "a hard link to the destination itself"));
        };
        let target_dir = walk(self.dest, target_parents, false)?;
        let target_leaf = cstr(target_leaf, &target.display())?;
        let parent = self.parent(parents)?;
        remove_non_dir(parent, leaf, shown)?;
        // SAFETY: valid descriptors and NUL-terminated names for the call; flags 0 links a
        // symlink itself rather than its target.
        let rc = unsafe {
            libc::linkat(
                target_dir.as_raw_fd(),
                target_leaf.as_ptr(),
                parent.as_raw_fd(),
                leaf.as_ptr(),
                0,
            )
        };
        check(rc, "hard-link", shown)
    }

    /// Sets directory modes and times, deepest first.
    fn finish_dirs(&mut self) -> Result<(), ArchiveError> {
        self.cache = None;
        for (name, mode, mtime) in self.dirs.iter().rev() {
            let dir = walk(self.dest, name.parts(), false)?;
            let shown = name.display();
            set_mode_and_time(&dir, *mode, *mtime, &shown)?;
        }
        Ok(())
    }
}

fn refused(name: &EntryName, reason: &'static str) -> ArchiveError {
    ArchiveError::Refused {
        path: name.display(),
        reason,
    }
}

fn type_name(kind: EntryType) -> &'static str {
    match kind {
        EntryType::Char => "character device",
        EntryType::Block => "block device",
        EntryType::Fifo => "FIFO",
        _ => "unsupported",
    }
}

fn link_target<R: Read>(entry: &Entry<'_, R>, name: &EntryName) -> Result<Vec<u8>, ArchiveError> {
    let target = entry
        .link_name_bytes()
        .ok_or_else(|| refused(name, "a link without a target"))?;
    if target.is_empty() || target.len() > MAX_NAME || target.contains(&0) {
        return Err(refused(
            name,
            "a link target that is empty, too long or has a NUL",
        ));
    }
    Ok(target.into_owned())
}

fn check(rc: libc::c_int, op: &'static str, shown: &str) -> Result<(), ArchiveError> {
    if rc < 0 {
        return Err(ArchiveError::Io {
            op,
            path: shown.to_owned(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Opens `dest/parts...` component by component with `O_NOFOLLOW`, creating missing
/// directories when `create`.
fn walk(dest: &OwnedFd, parts: &[Vec<u8>], create: bool) -> Result<OwnedFd, ArchiveError> {
    let mut cur = dest.try_clone().map_err(|source| ArchiveError::Io {
        op: "duplicate",
        path: ".".to_owned(),
        source,
    })?;
    for (i, part) in parts.iter().enumerate() {
        let shown = lossy(&parts[..=i].join(&b'/'));
        let name = cstr(part, &shown)?;
        if create {
            // SAFETY: valid descriptor and NUL-terminated name for the call.
            let rc = unsafe { libc::mkdirat(cur.as_raw_fd(), name.as_ptr(), 0o755) };
            if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                check(rc, "create directory", &shown)?;
            }
        }
        cur = open_subdir(&cur, &name, &shown)?;
    }
    Ok(cur)
}

fn make_dir(parent: &OwnedFd, leaf: &CStr, shown: &str) -> Result<(), ArchiveError> {
    // SAFETY: valid descriptor and NUL-terminated name for the call.
    let rc = unsafe { libc::mkdirat(parent.as_raw_fd(), leaf.as_ptr(), 0o700) };
    if rc == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EEXIST) {
        return check(rc, "create directory", shown);
    }
    // Something is there: merge into a directory, refuse anything else.
    open_subdir(parent, leaf, shown)
        .map(drop)
        .map_err(|e| match e {
            ArchiveError::Symlink { .. } => e,
            _ => ArchiveError::Refused {
                path: shown.to_owned(),
                reason: "a non-directory is in the way of a directory",
            },
        })
}

/// Unlinks a file or symlink in the way (never a directory); nothing there is fine.
fn remove_non_dir(parent: &OwnedFd, leaf: &CStr, shown: &str) -> Result<(), ArchiveError> {
    let Ok(st) = lstat_at(parent, leaf) else {
        return Ok(());
    };
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        return Err(ArchiveError::Refused {
            path: shown.to_owned(),
            reason: "a directory is in the way of a non-directory",
        });
    }
    // SAFETY: valid descriptor and NUL-terminated name for the call.
    let rc = unsafe { libc::unlinkat(parent.as_raw_fd(), leaf.as_ptr(), 0) };
    check(rc, "replace", shown)
}

fn write_file<R: Read>(
    parent: &OwnedFd,
    leaf: &CStr,
    shown: &str,
    entry: &mut Entry<'_, R>,
    (mode, mtime): (u32, i64),
) -> Result<u64, ArchiveError> {
    remove_non_dir(parent, leaf, shown)?;
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: valid descriptor and NUL-terminated name for the call; checked below.
    let fd = unsafe { libc::openat(parent.as_raw_fd(), leaf.as_ptr(), flags, 0o600) };
    check(fd, "create", shown)?;
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    let mut file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let size = entry.size();
    let written = copy_with_holes(entry, &mut file, size).map_err(|source| ArchiveError::Io {
        op: "extract",
        path: shown.to_owned(),
        source,
    })?;
    set_mode_and_time(&file.into(), mode, mtime, shown)?;
    Ok(written)
}

fn make_symlink(
    parent: &OwnedFd,
    leaf: &CStr,
    shown: &str,
    target: &[u8],
) -> Result<(), ArchiveError> {
    remove_non_dir(parent, leaf, shown)?;
    let target = CString::new(target).map_err(|_| ArchiveError::Refused {
        path: shown.to_owned(),
        reason: "NUL byte in the link target",
    })?;
    // SAFETY: valid descriptor and NUL-terminated strings for the call. The target is stored
    // as given and never resolved here.
    let rc = unsafe { libc::symlinkat(target.as_ptr(), parent.as_raw_fd(), leaf.as_ptr()) };
    check(rc, "create symlink", shown)
}

fn set_mode_and_time(fd: &OwnedFd, mode: u32, mtime: i64, shown: &str) -> Result<(), ArchiveError> {
    // SAFETY: fchmod on a descriptor we own.
    let rc = unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) };
    check(rc, "chmod", shown)?;
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: mtime as _,
            tv_nsec: 0,
        },
    ];
    // SAFETY: a descriptor we own and a two-element timespec array alive for the call.
    let rc = unsafe { libc::futimens(fd.as_raw_fd(), times.as_ptr()) };
    check(rc, "set the time of", shown)
}

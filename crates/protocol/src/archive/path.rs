//! Entry names and symlink-free directory walks.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use super::{lossy, ArchiveError, MAX_NAME};

/// A validated, relative entry name: its non-empty components, none `.` or `..`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryName {
    parts: Vec<Vec<u8>>,
}

impl EntryName {
    /// Parses a tar entry name: `/`-separated, empty and `.` components dropped (so `./a/`
    /// is `a`); refused when absolute, with a `..` component or a NUL byte, or longer than
    /// [`MAX_NAME`] bytes. The empty result (`.` or `./`) names the extraction directory.
    pub fn parse(raw: &[u8]) -> Result<Self, ArchiveError> {
        let refuse = |reason| ArchiveError::Refused {
            path: lossy(raw),
            reason,
        };
        if raw.len() > MAX_NAME {
            return Err(refuse("name longer than 4096 bytes"));
        }
        if raw.contains(&0) {
            return Err(refuse("NUL byte in the name"));
        }
        if raw.first() == Some(&b'/') {
            return Err(refuse("absolute name"));
        }
        let mut parts = Vec::new();
        for part in raw.split(|b| *b == b'/') {
            match part {
                b"" | b"." => {}
                b".." => return Err(refuse("'..' component")),
                _ => parts.push(part.to_vec()),
            }
        }
        Ok(Self { parts })
    }

    /// The name's components.
    pub fn parts(&self) -> &[Vec<u8>] {
        &self.parts
    }

    /// The name with its first component replaced by `root` (no change when empty).
    pub fn renamed(mut self, root: &[u8]) -> Self {
        if let Some(first) = self.parts.first_mut() {
            *first = root.to_vec();
        }
        self
    }

    /// The name as `/`-joined bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.parts.join(&b'/')
    }

    /// Display form, invalid UTF-8 replaced by U+FFFD.
    pub fn display(&self) -> String {
        lossy(&self.to_bytes())
    }
}

pub(crate) fn cstr(name: &[u8], shown: &str) -> Result<CString, ArchiveError> {
    CString::new(name).map_err(|_| ArchiveError::Refused {
        path: shown.to_owned(),
        reason: "NUL byte in the name",
    })
}

/// `openat(dir, name, O_DIRECTORY | O_NOFOLLOW)`; a symlink is [`ArchiveError::Symlink`].
pub(crate) fn open_subdir(
    dir: &OwnedFd,
    name: &CStr,
    shown: &str,
) -> Result<OwnedFd, ArchiveError> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: `dir` is an open descriptor and `name` a NUL-terminated string, both alive for
    // the call; the result is checked before use.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) };
    if fd < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ELOOP) || is_symlink_at(dir, name) {
            return Err(ArchiveError::Symlink {
                path: shown.to_owned(),
            });
        }
        return Err(ArchiveError::Io {
            op: "open directory",
            path: shown.to_owned(),
            source: err,
        });
    }
    // SAFETY: `fd` was just returned by openat and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// True when `name` in `dir` is a symlink (`fstatat` with `AT_SYMLINK_NOFOLLOW`).
pub(crate) fn is_symlink_at(dir: &OwnedFd, name: &CStr) -> bool {
    lstat_at(dir, name).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK)
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
pub(crate) fn lstat_at(dir: &OwnedFd, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: all-zero bytes are a valid `stat` (plain integers).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor, NUL-terminated name and a writable `stat` for the call.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens the directory `path` without following any symlink on the way: each component
/// (starting at `/`, or at the current directory for a relative path) is opened with
/// `O_NOFOLLOW`. A path that is or passes through a symlink is [`ArchiveError::Symlink`];
/// `..` components are refused.
pub fn open_dir_nofollow(path: &Path) -> Result<OwnedFd, ArchiveError> {
    let shown = path.display().to_string();
    let start = if path.is_absolute() { "/" } else { "." };
    let mut dir = open_dir(Path::new(start)).map_err(|source| ArchiveError::Io {
        op: "open directory",
        path: start.to_owned(),
        source,
    })?;
    let mut walked = std::path::PathBuf::from(start);
    for comp in path.components() {
        match comp {
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(ArchiveError::Refused {
                    path: shown,
                    reason: "'..' component in the destination",
                })
            }
            Component::Normal(name) => {
                walked.push(name);
                let c = cstr(name.as_bytes(), &shown)?;
                dir = open_subdir(&dir, &c, &walked.display().to_string())?;
            }
        }
    }
    Ok(dir)
}

/// Opens a directory, following symlinks (for a destination the caller trusts, such as the
/// guest's own path).
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(path)?;
    Ok(file.into())
}

/// `OsStr` view of entry bytes.
pub(crate) fn os(bytes: &[u8]) -> &OsStr {
    OsStr::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_relative_without_dot_dot() {
        // Arrange
        let bad: [&[u8]; 4] = [b"/etc/passwd", b"a/../../x", b"..", b"a\0b"];

        // Act
        let results: Vec<_> = bad.iter().map(|n| EntryName::parse(n)).collect();

        // Assert
        assert!(results.iter().all(Result::is_err), "{results:?}");
        let ok = EntryName::parse(b"./src//a\xff/./b/").unwrap();
        assert_eq!(ok.to_bytes(), b"src/a\xff/b");
        assert_eq!(ok.renamed(b"dst").to_bytes(), b"dst/a\xff/b");
        assert!(EntryName::parse(b"./").unwrap().parts().is_empty());
    }

    #[test]
    fn a_destination_through_a_symlink_is_refused() {
        // Arrange
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("real")).unwrap();
        std::os::unix::fs::symlink("real", tmp.path().join("link")).unwrap();

        // Act
        let through = open_dir_nofollow(&tmp.path().join("link/"));
        let direct = open_dir_nofollow(&tmp.path().join("real"));

        // Assert
        assert!(
            matches!(through, Err(ArchiveError::Symlink { .. })),
            "{through:?}"
        );
        assert!(direct.is_ok(), "{direct:?}");
    }
}

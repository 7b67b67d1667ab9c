//! Reading an entry of the host's workspace directory by a path the guest named, without ever
//! leaving the directory: every component before the last must be a real directory (a symbolic
//! link there makes the entry "absent"), and the last is not followed.

use std::fs::{self, Metadata};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use bulkhead_protocol::EntryKind;

/// A file or symbolic link of the host directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostEntry {
    /// File or symlink.
    pub kind: EntryKind,
    /// Permission bits.
    pub mode: u32,
    /// Contents, or the link's target.
    pub data: Vec<u8>,
}

/// The entry at `rel` (validated: relative, plain components) below `root`, `None` when there
/// is none (or it is a directory, a device, or behind a symbolic link).
pub(crate) fn read(root: &Path, rel: &str) -> io::Result<Option<HostEntry>> {
    let Some((path, meta)) = locate(root, rel)? else {
        return Ok(None);
    };
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target = fs::read_link(&path)?;
        return Ok(Some(HostEntry {
            kind: EntryKind::Symlink,
            mode: meta.mode() & 0o7777,
            data: target.as_os_str().as_bytes().to_vec(),
        }));
    }
    if !ft.is_file() {
        return Ok(None);
    }
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)?;
    let mut data = Vec::with_capacity(meta.len() as usize);
    io::Read::read_to_end(&mut &file, &mut data)?;
    Ok(Some(HostEntry {
        kind: EntryKind::File,
        mode: meta.mode() & 0o7777,
        data,
    }))
}

/// The path and `lstat` of `rel` below `root`, walking only through real directories.
fn locate(root: &Path, rel: &str) -> io::Result<Option<(PathBuf, Metadata)>> {
    let mut path = root.to_owned();
    let parts: Vec<&str> = rel.split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        if part.is_empty() || *part == "." || *part == ".." {
            return Ok(None);
        }
        path.push(part);
        let meta = match fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        if i + 1 == parts.len() {
            return Ok(Some((path, meta)));
        }
        if !meta.is_dir() {
            return Ok(None);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_links_are_read_but_nothing_behind_a_link_or_outside() {
        // Arrange
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("secret"), "s").unwrap();
        let root = tempfile::tempdir().unwrap();
        fs::create_dir(root.path().join("dir")).unwrap();
        fs::write(root.path().join("dir/file"), "contents").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("out")).unwrap();

        // Act
        let file = read(root.path(), "dir/file").unwrap().unwrap();
        let link = read(root.path(), "out").unwrap().unwrap();
        let behind = read(root.path(), "out/secret").unwrap();
        let escape = read(root.path(), "../x").unwrap();
        let dir = read(root.path(), "dir").unwrap();

        // Assert
        assert_eq!(
            (file.kind, file.data.as_slice()),
            (EntryKind::File, &b"contents"[..])
        );
        assert_eq!(link.kind, EntryKind::Symlink);
        assert_eq!(link.data, outside.path().as_os_str().as_bytes());
        assert_eq!((behind, escape, dir), (None, None, None));
    }
}

//! File-system helpers: removing a build tree without ever crossing into another mount, and
//! hashing an image.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use sha2::{Digest, Sha256};

/// Bytes read at a time while hashing (1 MiB).
const HASH_CHUNK: usize = 1 << 20;

/// Removes `path` and everything below it that lives on the same file system as `path`
/// itself. Symbolic links are removed, never followed. A mount point found inside (a
/// bootstrap tool killed before it unmounted `/proc`, a bind mount) is left alone together
/// with its parents, and the call fails with the first such error: data outside the tree can
/// never be deleted through it. A missing `path` is success.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return fs::remove_file(path);
    }
    remove_dir_on_device(path, meta.dev())
}

fn remove_dir_on_device(dir: &Path, dev: u64) -> io::Result<()> {
    let mut first_error = None;
    for entry in fs::read_dir(dir)? {
        let result = entry.and_then(|entry| {
            let path = entry.path();
            let meta = fs::symlink_metadata(&path)?;
            if meta.dev() != dev {
                return Err(io::Error::other(format!(
                    "{} is a mount point; not removing it",
                    path.display()
                )));
            }
            if meta.is_dir() {
                remove_dir_on_device(&path, dev)
            } else {
                fs::remove_file(&path)
            }
        });
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => fs::remove_dir(dir),
    }
}

/// SHA-256 of the file at `path`, lowercase hex.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_CHUNK];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Whether a process with id `pid` exists (`kill(pid, 0)` does not fail with `ESRCH`).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for existence and permission; no pointers.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_tree_deletes_nested_content_but_not_symlink_targets() {
        // Arrange
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("precious"), b"keep").unwrap();
        let tree = tempfile::tempdir().unwrap();
        let root = tree.path().join("build");
        fs::create_dir_all(root.join("a/b")).unwrap();
        fs::write(root.join("a/b/file"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.join("a/link")).unwrap();

        // Act
        remove_tree(&root).unwrap();

        // Assert
        assert!(!root.exists());
        assert_eq!(fs::read(outside.path().join("precious")).unwrap(), b"keep");
    }

    #[test]
    fn remove_tree_of_a_missing_path_succeeds() {
        // Arrange
        let tree = tempfile::tempdir().unwrap();

        // Act
        let result = remove_tree(&tree.path().join("nothing"));

        // Assert
        assert!(result.is_ok());
    }

    #[test]
    fn sha256_matches_a_known_digest() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        fs::write(&path, b"abc").unwrap();

        // Act
        let digest = sha256_file(&path).unwrap();

        // Assert
        assert_eq!(
            digest,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn own_pid_is_alive_and_nonsense_pids_are_not() {
        // Arrange / Act / Assert
        assert!(pid_alive(std::process::id()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
    }
}

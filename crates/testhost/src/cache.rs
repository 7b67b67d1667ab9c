//! The on-disk artifact cache: where it lives, the lock that serializes writers, and atomic publication.
//!
//! Layout under the cache root (`${XDG_CACHE_HOME:-$HOME/.cache}/bulkhead/testhost`):
//!
//! ```text
//! .lock                                  flock(2) taken exclusively while preparing
//! <kernel-package>_<version>/            one extracted kernel package (see `kernel`)
//! initramfs/<sha256-key>.cpio.gz         one test host initramfs per distinct input set
//! .tmp-*                                 work directories; renamed into place when complete
//! ```
//!
//! Every entry is built in a `.tmp-*` directory (or file) and renamed into its final name, so a reader never
//! sees a half-written entry, and a crash leaves only `.tmp-*` debris that the next writer removes.

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Errors from locating, locking or writing the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Neither `XDG_CACHE_HOME` nor `HOME` is set to an absolute path.
    #[error("cannot locate the cache: set XDG_CACHE_HOME or HOME to an absolute path")]
    NoCacheHome,
    /// A filesystem operation on the cache failed.
    #[error("cache {what} {path}: {source}")]
    Io {
        /// What was being done (for example "create directory").
        what: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl CacheError {
    /// Builds a [`CacheError::Io`] for `path`.
    pub(crate) fn io(what: &'static str, path: &Path, source: std::io::Error) -> Self {
        CacheError::Io {
            what,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Returns the default cache root, `${XDG_CACHE_HOME:-$HOME/.cache}/bulkhead/testhost`.
///
/// Per the XDG Base Directory specification, a relative `XDG_CACHE_HOME` is ignored.
pub fn default_cache_root() -> Result<PathBuf, CacheError> {
    let xdg = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(PathBuf::from);
    cache_root_from(xdg, home)
}

/// Pure part of [`default_cache_root`]: picks the root from the two environment values.
fn cache_root_from(xdg: Option<PathBuf>, home: Option<PathBuf>) -> Result<PathBuf, CacheError> {
    let base = match (xdg, home) {
        (Some(x), _) if x.is_absolute() => x,
        (_, Some(h)) if h.is_absolute() => h.join(".cache"),
        _ => return Err(CacheError::NoCacheHome),
    };
    Ok(base.join("bulkhead").join("testhost"))
}

/// Creates `dir` and its parents.
pub(crate) fn create_dir_all(dir: &Path) -> Result<(), CacheError> {
    fs::create_dir_all(dir).map_err(|e| CacheError::io("create directory", dir, e))
}

/// An exclusive `flock(2)` on `<root>/.lock`, released when dropped.
///
/// Held for the whole of a prepare so that concurrent test processes wait for one download and one build
/// instead of racing.
#[derive(Debug)]
pub struct CacheLock {
    _file: File,
}

impl CacheLock {
    /// Blocks until the lock on `root` is held. Creates `root` if needed.
    pub fn acquire(root: &Path) -> Result<CacheLock, CacheError> {
        create_dir_all(root)?;
        let path = root.join(".lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| CacheError::io("open lock file", &path, e))?;
        loop {
            // SAFETY: flock on a file descriptor owned by `file`, which outlives the call.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(CacheLock { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(CacheError::io("lock", &path, err));
            }
        }
    }
}

/// Creates a fresh work directory `<root>/.tmp-<label>-<pid>`, removing leftovers of an earlier crash.
///
/// Callers hold the [`CacheLock`], so no other process uses the same name.
pub(crate) fn fresh_work_dir(root: &Path, label: &str) -> Result<PathBuf, CacheError> {
    let dir = root.join(format!(".tmp-{label}-{}", std::process::id()));
    remove_tree(&dir)?;
    create_dir_all(&dir)?;
    Ok(dir)
}

/// Removes `path` (file or directory tree) if it exists.
pub(crate) fn remove_tree(path: &Path) -> Result<(), CacheError> {
    let result = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    result.map_err(|e| CacheError::io("remove", path, e))
}

/// Atomically moves a completed work directory or file `from` to its final name `to`.
pub(crate) fn publish(from: &Path, to: &Path) -> Result<(), CacheError> {
    remove_tree(to)?;
    fs::rename(from, to).map_err(|e| CacheError::io("rename into place", to, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xdg_cache_home_wins_over_home() {
        // Arrange
        let xdg = Some(PathBuf::from("/x/cache"));
        let home = Some(PathBuf::from("/home/u"));

        // Act
        let root = cache_root_from(xdg, home).unwrap();

        // Assert
        assert_eq!(root, PathBuf::from("/x/cache/bulkhead/testhost"));
    }

    #[test]
    fn relative_xdg_cache_home_falls_back_to_home() {
        // Arrange
        let xdg = Some(PathBuf::from("rel/cache"));
        let home = Some(PathBuf::from("/home/u"));

        // Act
        let root = cache_root_from(xdg, home).unwrap();

        // Assert
        assert_eq!(root, PathBuf::from("/home/u/.cache/bulkhead/testhost"));
    }

    #[test]
    fn no_usable_environment_is_an_error() {
        // Act
        let result = cache_root_from(None, Some(PathBuf::from("relative")));

        // Assert
        assert!(matches!(result, Err(CacheError::NoCacheHome)));
    }

    /// Tries a non-blocking exclusive flock on `<root>/.lock` through a separate open file description.
    fn lock_is_free(root: &Path) -> bool {
        let file = File::open(root.join(".lock")).unwrap();
        // SAFETY: flock on a descriptor owned by `file`; the lock is released when `file` is closed.
        unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    }

    #[test]
    fn cache_lock_excludes_other_holders_until_dropped() {
        // Arrange
        let root = tempfile::tempdir().unwrap();
        let lock = CacheLock::acquire(root.path()).unwrap();

        // Act
        let free_while_held = lock_is_free(root.path());
        drop(lock);
        let free_after_drop = lock_is_free(root.path());

        // Assert
        assert!(!free_while_held);
        assert!(free_after_drop);
    }

    #[test]
    fn publish_replaces_an_existing_target() {
        // Arrange
        let root = tempfile::tempdir().unwrap();
        let work = fresh_work_dir(root.path(), "t").unwrap();
        fs::write(work.join("f"), b"new").unwrap();
        let target = root.path().join("entry");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("f"), b"old").unwrap();

        // Act
        publish(&work, &target).unwrap();

        // Assert
        assert_eq!(fs::read(target.join("f")).unwrap(), b"new");
        assert!(!work.exists());
    }
}

//! The per-host run directory (console log, QEMU log, control socket, scratch share) and the checks on the
//! directories shared into the test host.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::protocol::{self, Share};

/// Errors from checking shares or setting up the run directory.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A share directory cannot be used.
    #[error("share {path}: {reason}")]
    InvalidShare {
        /// The directory as given.
        path: PathBuf,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A file or directory of the run directory could not be created or written.
    #[error("test host run directory {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
}

/// Most 9p shares accepted (each is one virtio-9p-pci device on the 32-slot PCI bus).
const MAX_SHARES: usize = 20;

/// Directories of the test host's own root filesystem that a share may not cover.
const RESERVED: &[&str] = &[
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib",
    "/usr/lib64",
    "/proc",
    "/sys",
    "/dev",
    protocol::SCRATCH_MOUNT,
];

/// Prefix of run directory names in the temporary directory.
const RUN_DIR_PREFIX: &str = "bulkhead-testhost-";

/// Checks the share list and assigns mount tags `bh0`, `bh1`, ...
pub(crate) fn validate_shares(dirs: &[PathBuf]) -> Result<Vec<Share>, SetupError> {
    let mut paths: Vec<PathBuf> = Vec::new();
    for dir in dirs {
        let path = check_share(dir)?;
        if !paths.contains(&path) {
            paths.push(path);
        }
    }
    if paths.len() > MAX_SHARES {
        return Err(SetupError::InvalidShare {
            path: paths[MAX_SHARES].clone(),
            reason: "too many shares (at most 20)",
        });
    }
    Ok(paths
        .into_iter()
        .enumerate()
        .map(|(i, path)| Share {
            tag: format!("bh{i}"),
            path,
        })
        .collect())
}

/// Validates one share directory and returns its absolute, normalized path.
fn check_share(dir: &Path) -> Result<PathBuf, SetupError> {
    let invalid = |reason| SetupError::InvalidShare {
        path: dir.to_path_buf(),
        reason,
    };
    let abs = std::path::absolute(dir).map_err(|_| invalid("cannot make the path absolute"))?;
    let mut path = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => return Err(invalid("`..` is not allowed")),
            Component::CurDir => {}
            other => path.push(other),
        }
    }
    if path.to_str().is_none() {
        return Err(invalid("path is not UTF-8"));
    }
    if !path.is_dir() {
        return Err(invalid("not an existing directory"));
    }
    if is_reserved(&path) {
        return Err(invalid(
            "would cover the test host's own /, /bin, /lib, /usr/lib, /proc, /sys, /dev or /run/bulkhead",
        ));
    }
    Ok(path)
}

/// True if mounting over `path` would hide part of the test host's own root filesystem.
fn is_reserved(path: &Path) -> bool {
    RESERVED
        .iter()
        .map(Path::new)
        .any(|r| path.starts_with(r) || r.starts_with(path))
}

/// Creates `<tmp>/bulkhead-testhost-XXXXXX` with an `owner.pid` file.
pub(crate) fn create_run_dir() -> Result<tempfile::TempDir, SetupError> {
    let tmp = std::env::temp_dir();
    let dir = tempfile::Builder::new()
        .prefix(RUN_DIR_PREFIX)
        .tempdir_in(&tmp)
        .map_err(|source| SetupError::Io { path: tmp, source })?;
    write_file(
        &dir.path().join("owner.pid"),
        std::process::id().to_string().as_bytes(),
    )?;
    Ok(dir)
}

/// Removes run directories whose owner process is gone (left by processes killed while holding a host).
pub(crate) fn remove_stale_run_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let is_ours = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(RUN_DIR_PREFIX));
        let owner = fs::read_to_string(path.join("owner.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        if let (true, Some(pid)) = (is_ours, owner) {
            // SAFETY: kill with signal 0 only checks whether the process exists.
            let gone = unsafe { libc::kill(pid, 0) } != 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            if gone {
                let _ = fs::remove_dir_all(&path);
            }
        }
    }
}

pub(crate) fn make_dir(path: &Path) -> Result<(), SetupError> {
    fs::create_dir_all(path).map_err(|source| SetupError::Io {
        path: path.to_path_buf(),
        source,
    })
}

pub(crate) fn write_file(path: &Path, data: &[u8]) -> Result<(), SetupError> {
    if let Some(parent) = path.parent() {
        make_dir(parent)?;
    }
    fs::write(path, data).map_err(|source| SetupError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The last `lines` lines of `console.log` plus QEMU's own output, for error messages.
pub(crate) fn console_tail(run_dir: &Path, lines: usize) -> String {
    let console = fs::read(run_dir.join("console.log")).unwrap_or_default();
    let console = String::from_utf8_lossy(&console);
    let all: Vec<&str> = console.lines().collect();
    let start = all.len().saturating_sub(lines);
    let mut out = format!("--- last {} console lines ---\n", all.len() - start);
    for line in &all[start..] {
        out.push_str(&strip_escapes(line));
        out.push('\n');
    }
    let qemu = fs::read_to_string(run_dir.join("qemu.log")).unwrap_or_default();
    if !qemu.trim().is_empty() {
        out.push_str("--- QEMU output ---\n");
        out.push_str(qemu.trim_end());
        out.push('\n');
    }
    out
}

/// Drops ANSI escape sequences and carriage returns (SeaBIOS clears the screen on the console).
fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => {
                if chars.peek() == Some(&'[') {
                    chars.next();
                    for n in chars.by_ref() {
                        if n.is_ascii_alphabetic() {
                            break;
                        }
                    }
                } else {
                    chars.next();
                }
            }
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_and_system_directories_cannot_be_shared() {
        // Act
        let results: Vec<bool> = ["/", "/usr", "/lib/x86_64-linux-gnu", "/run", "/proc/1"]
            .iter()
            .map(|p| is_reserved(Path::new(p)))
            .collect();

        // Assert
        assert_eq!(results, vec![true; 5]);
    }

    #[test]
    fn project_directories_can_be_shared() {
        // Act
        let results: Vec<bool> = ["/work/main/target", "/tmp/x", "/usr/share/doc", "/run2"]
            .iter()
            .map(|p| is_reserved(Path::new(p)))
            .collect();

        // Assert
        assert_eq!(results, vec![false; 4]);
    }

    #[test]
    fn shares_are_deduplicated_and_tagged() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().to_path_buf();
        let a_again = dir.path().join(".");

        // Act
        let shares = validate_shares(&[a.clone(), a_again]).unwrap();

        // Assert
        assert_eq!(
            shares,
            vec![Share {
                tag: "bh0".into(),
                path: a
            }]
        );
    }

    #[test]
    fn missing_share_directory_is_refused() {
        // Act
        let result = validate_shares(&[PathBuf::from("/nonexistent/bulkhead-share")]);

        // Assert
        assert!(
            matches!(result, Err(SetupError::InvalidShare { reason, .. })
            if reason == "not an existing directory")
        );
    }

    #[test]
    fn console_tail_keeps_the_last_lines_without_escapes() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let log: String = (1..=50).map(|i| format!("\u{1b}[0mline {i}\r\n")).collect();
        fs::write(dir.path().join("console.log"), log).unwrap();

        // Act
        let tail = console_tail(dir.path(), 40);

        // Assert
        assert!(tail.contains("line 11\nline 12\n"));
        assert!(!tail.contains("line 10\n"));
        assert!(!tail.contains('\u{1b}'));
        assert!(tail.ends_with("line 50\n"));
    }
}

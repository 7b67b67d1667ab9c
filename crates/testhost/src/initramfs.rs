//! The test host's initramfs: a gzip-compressed cpio archive in the "newc" format, cached by its inputs.
//!
//! The format is the kernel's (`Documentation/driver-api/early-userspace/buffer-format.rst`): each entry is a
//! 110-byte ASCII header (`070701` and thirteen 8-digit hex fields), the NUL-terminated name padded to a
//! multiple of 4 bytes, then the data padded to a multiple of 4; a `TRAILER!!!` entry ends the archive.
//!
//! The cache key is a SHA-256 over a format version, `/init`'s text and every file's path, mode and content
//! hash, so any change of busybox, the libraries, the modules or the init script builds a new archive, and
//! nothing else does.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::cache::{self, CacheError};

/// Errors from reading inputs or writing the archive.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    /// An input file could not be read.
    #[error("reading {path} for the initramfs: {source}")]
    Read {
        /// The host file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// A path in the test host is not absolute UTF-8.
    #[error("initramfs path {0} is not absolute UTF-8")]
    BadPath(PathBuf),
    /// An entry is larger than the format's 32-bit size field (4 GiB).
    #[error("{0} is too large for a cpio newc entry")]
    TooLarge(String),
    /// Writing the archive failed.
    #[error("writing the initramfs: {0}")]
    Write(#[from] io::Error),
    /// A cache operation failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
}

/// Bumped whenever the archive layout changes in a way the inputs do not capture.
const FORMAT_VERSION: &str = "bulkhead-testhost initramfs v1";

/// Where a file's content comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A host file, read at build time.
    Host(PathBuf),
    /// Literal bytes.
    Inline(Vec<u8>),
}

/// One regular file in the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecFile {
    /// Absolute path inside the test host.
    pub guest: PathBuf,
    /// Content.
    pub source: Source,
    /// Permission bits, e.g. `0o755`.
    pub mode: u32,
}

/// Everything that goes into the archive besides the fixed skeleton (directories, `/dev/console`).
#[derive(Debug, Clone, Default)]
pub struct InitramfsSpec {
    /// Regular files, `/init` among them.
    pub files: Vec<SpecFile>,
}

/// A spec with every file's content loaded and its cache key computed.
#[derive(Debug)]
pub struct LoadedSpec {
    /// `(guest path without leading /, mode, content)`, sorted by path.
    files: Vec<(String, u32, Vec<u8>)>,
    /// Hex SHA-256 cache key.
    pub key: String,
}

impl InitramfsSpec {
    /// Reads every file and computes the cache key.
    pub fn load(&self) -> Result<LoadedSpec, InitramfsError> {
        let mut files = Vec::with_capacity(self.files.len());
        for f in &self.files {
            let name = f
                .guest
                .to_str()
                .and_then(|s| s.strip_prefix('/'))
                .ok_or_else(|| InitramfsError::BadPath(f.guest.clone()))?;
            let data = match &f.source {
                Source::Host(p) => fs::read(p).map_err(|source| InitramfsError::Read {
                    path: p.clone(),
                    source,
                })?,
                Source::Inline(d) => d.clone(),
            };
            files.push((name.to_string(), f.mode, data));
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        files.dedup_by(|a, b| a.0 == b.0);
        let key = cache_key(&files);
        Ok(LoadedSpec { files, key })
    }
}

/// SHA-256 over the format version and each file's path, mode and content hash.
fn cache_key(files: &[(String, u32, Vec<u8>)]) -> String {
    let mut h = Sha256::new();
    h.update(FORMAT_VERSION.as_bytes());
    for (name, mode, data) in files {
        h.update([0u8]);
        h.update(name.as_bytes());
        h.update(mode.to_le_bytes());
        h.update(Sha256::digest(data));
    }
    hex(&h.finalize())
}

/// Lower-case hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Directories always present (mode 0755 unless listed otherwise).
const SKELETON_DIRS: &[(&str, u32)] = &[
    ("bin", 0o755),
    ("dev", 0o755),
    ("etc", 0o755),
    ("proc", 0o555),
    ("root", 0o700),
    ("run", 0o755),
    ("sbin", 0o755),
    ("sys", 0o555),
    ("tmp", 0o1777),
    ("usr", 0o755),
    ("usr/bin", 0o755),
    ("usr/sbin", 0o755),
];

/// Returns the cached archive for `spec` under `<root>/initramfs/`, building it if absent.
///
/// The caller holds the [`cache::CacheLock`]. The archive is written to a temporary name and renamed.
pub fn ensure(root: &Path, spec: &LoadedSpec) -> Result<PathBuf, InitramfsError> {
    let dir = root.join("initramfs");
    let path = dir.join(format!("{}.cpio.gz", spec.key));
    if path.is_file() {
        return Ok(path);
    }
    cache::create_dir_all(&dir)?;
    let tmp = dir.join(format!(".tmp-{}-{}", spec.key, std::process::id()));
    let file = File::create(&tmp).map_err(|e| CacheError::io("create", &tmp, e))?;
    let gz = flate2::write::GzEncoder::new(BufWriter::new(file), flate2::Compression::default());
    let gz = write_archive(gz, spec)?;
    let mut buffered = gz.finish()?;
    buffered.flush()?;
    buffered
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    cache::publish(&tmp, &path)?;
    Ok(path)
}

/// Writes the skeleton, every parent directory, the files and the trailer.
fn write_archive<W: Write>(out: W, spec: &LoadedSpec) -> Result<W, InitramfsError> {
    let mut cpio = CpioWriter::new(out);
    let mut dirs: BTreeSet<String> = BTreeSet::new();
    for (name, mode) in SKELETON_DIRS {
        cpio.dir(name, *mode)?;
        dirs.insert(name.to_string());
    }
    cpio.char_dev("dev/console", 0o600, (5, 1))?;
    for (name, mode, data) in &spec.files {
        for parent in parents(name) {
            if dirs.insert(parent.clone()) {
                cpio.dir(&parent, 0o755)?;
            }
        }
        cpio.file(name, *mode, data)?;
    }
    cpio.finish()
}

/// The parent directories of a relative path, outermost first (`a/b/c` → `a`, `a/b`).
fn parents(name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut acc = String::new();
    let mut parts: Vec<&str> = name.split('/').collect();
    parts.pop();
    for p in parts {
        if !acc.is_empty() {
            acc.push('/');
        }
        acc.push_str(p);
        out.push(acc.clone());
    }
    out
}

/// `S_IFDIR`, `S_IFREG`, `S_IFCHR` from `<sys/stat.h>`.
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

/// A writer of cpio "newc" archives (all entries owned by root, mtime 0 for reproducible output).
#[derive(Debug)]
pub struct CpioWriter<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

/// One entry's header fields that vary.
struct Header<'a> {
    name: &'a str,
    mode: u32,
    nlink: u32,
    size: usize,
    rdev: (u32, u32),
}

impl<W: Write> CpioWriter<W> {
    /// Starts an archive on `out`.
    pub fn new(out: W) -> Self {
        CpioWriter {
            out,
            written: 0,
            next_ino: 1,
        }
    }

    /// Adds a directory (`name` relative, without leading `/`).
    pub fn dir(&mut self, name: &str, perm: u32) -> Result<(), InitramfsError> {
        self.entry(
            Header {
                name,
                mode: S_IFDIR | perm,
                nlink: 2,
                size: 0,
                rdev: (0, 0),
            },
            &[],
        )
    }

    /// Adds a regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> Result<(), InitramfsError> {
        self.entry(
            Header {
                name,
                mode: S_IFREG | perm,
                nlink: 1,
                size: data.len(),
                rdev: (0, 0),
            },
            data,
        )
    }

    /// Adds a character device node with device number `(major, minor)`.
    pub fn char_dev(
        &mut self,
        name: &str,
        perm: u32,
        rdev: (u32, u32),
    ) -> Result<(), InitramfsError> {
        self.entry(
            Header {
                name,
                mode: S_IFCHR | perm,
                nlink: 1,
                size: 0,
                rdev,
            },
            &[],
        )
    }

    /// Writes the `TRAILER!!!` entry and returns the underlying writer.
    pub fn finish(mut self) -> Result<W, InitramfsError> {
        self.next_ino = 0;
        self.entry(
            Header {
                name: "TRAILER!!!",
                mode: 0,
                nlink: 1,
                size: 0,
                rdev: (0, 0),
            },
            &[],
        )?;
        Ok(self.out)
    }

    fn entry(&mut self, h: Header<'_>, data: &[u8]) -> Result<(), InitramfsError> {
        let size = u32::try_from(h.size).map_err(|_| InitramfsError::TooLarge(h.name.into()))?;
        let ino = self.next_ino;
        self.next_ino = self.next_ino.wrapping_add(1);
        let fields = [
            ino,
            h.mode,
            0, // uid
            0, // gid
            h.nlink,
            0, // mtime
            size,
            0, // devmajor
            0, // devminor
            h.rdev.0,
            h.rdev.1,
            h.name.len() as u32 + 1,
            0, // check
        ];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.put(header.as_bytes())?;
        self.put(h.name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), InitramfsError> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> Result<(), InitramfsError> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0u8; 3][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn spec(files: &[(&str, &[u8])]) -> InitramfsSpec {
        InitramfsSpec {
            files: files
                .iter()
                .map(|(p, d)| SpecFile {
                    guest: p.into(),
                    source: Source::Inline(d.to_vec()),
                    mode: 0o755,
                })
                .collect(),
        }
    }

    #[test]
    fn newc_entry_layout_is_aligned_and_sized() {
        // Arrange
        let mut cpio = CpioWriter::new(Vec::new());

        // Act
        cpio.file("init", 0o755, b"hello").unwrap();
        let bytes = cpio.out;

        // Assert: 110-byte header + "init\0" (115) padded to 116, then 5 data bytes padded to 124.
        assert_eq!(&bytes[..6], b"070701");
        assert_eq!(&bytes[54..62], b"00000005", "c_filesize");
        assert_eq!(&bytes[94..102], b"00000005", "c_namesize includes the NUL");
        assert_eq!(&bytes[110..115], b"init\0");
        assert_eq!(&bytes[116..121], b"hello");
        assert_eq!(bytes.len(), 124);
    }

    #[test]
    fn cpio_tool_lists_and_extracts_our_archive() {
        // Arrange
        let loaded = spec(&[("/lib/x/libc.so.6", b"LIBC"), ("/init", b"#!/bin/sh\n")])
            .load()
            .unwrap();
        let archive = write_archive(Vec::new(), &loaded).unwrap();
        let dir = tempfile::tempdir().unwrap();

        // Act
        let mut child = Command::new("cpio")
            .args(["-idm", "--quiet"])
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&archive).unwrap();
        let status = child.wait().unwrap();

        // Assert
        assert!(status.success());
        assert_eq!(
            fs::read(dir.path().join("lib/x/libc.so.6")).unwrap(),
            b"LIBC"
        );
        assert_eq!(fs::read(dir.path().join("init")).unwrap(), b"#!/bin/sh\n");
    }

    #[test]
    fn same_inputs_give_the_same_key() {
        // Arrange
        let a = spec(&[("/init", b"x"), ("/bin/busybox", b"y")]);
        let b = spec(&[("/bin/busybox", b"y"), ("/init", b"x")]);

        // Act
        let (ka, kb) = (a.load().unwrap().key, b.load().unwrap().key);

        // Assert
        assert_eq!(ka, kb);
    }

    #[test]
    fn changed_init_script_changes_the_key() {
        // Arrange
        let a = spec(&[("/init", b"echo one")]);
        let b = spec(&[("/init", b"echo two")]);

        // Act
        let (ka, kb) = (a.load().unwrap().key, b.load().unwrap().key);

        // Assert
        assert_ne!(ka, kb);
    }

    #[test]
    fn changed_library_content_changes_the_key() {
        // Arrange
        let a = spec(&[("/lib/libc.so.6", b"v1")]);
        let b = spec(&[("/lib/libc.so.6", b"v2")]);

        // Act
        let (ka, kb) = (a.load().unwrap().key, b.load().unwrap().key);

        // Assert
        assert_ne!(ka, kb);
    }

    #[test]
    fn cached_archive_is_not_rebuilt() {
        // Arrange
        let root = tempfile::tempdir().unwrap();
        let loaded = spec(&[("/init", b"x")]).load().unwrap();
        let first = ensure(root.path(), &loaded).unwrap();
        fs::write(&first, b"marker").unwrap();

        // Act
        let second = ensure(root.path(), &loaded).unwrap();

        // Assert
        assert_eq!(first, second);
        assert_eq!(
            fs::read(&second).unwrap(),
            b"marker",
            "rebuilt despite equal inputs"
        );
    }

    #[test]
    fn relative_guest_path_is_rejected() {
        // Act
        let result = spec(&[("init", b"x")]).load();

        // Assert
        assert!(matches!(result, Err(InitramfsError::BadPath(_))));
    }
}

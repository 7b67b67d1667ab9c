//! Directory trees as tar streams: packing ([`pack`]) and safe extraction ([`unpack`]), used by
//! the agent in the guest and by the host (`bulkhead cp -r`).
//!
//! # Format
//!
//! A GNU tar stream (the `tar` crate's reader and writer). Entry names are bytes, relative,
//! rooted at one top-level name (the source's last component), for example `src/`,
//! `src/main.rs`. Directories, regular files, symlinks (the link itself, target stored
//! verbatim, never followed) and hard links (to an earlier entry of the same archive) are
//! carried with their permission bits and modification time. Files with holes (found with
//! `SEEK_DATA`/`SEEK_HOLE`) are GNU sparse entries (type `S`, the "old GNU" map of data
//! segments in the header and its extension blocks), so the zeros of a hole never travel.
//! Device nodes, FIFOs and sockets are left out and reported as skipped. The packer writes
//! every file's contents (a file with several names is packed once per name); hard-link entries
//! of other tools' archives are extracted.
//!
//! # Extraction rules
//!
//! The archive is untrusted input. [`unpack`] writes only below the directory it is given:
//! an entry name that is absolute, contains `..` or a NUL byte, or is longer than
//! [`MAX_NAME`] bytes is refused; every parent directory is opened component by component with
//! `O_NOFOLLOW`, so no write goes through a symlink, whether the archive created it or it was
//! there before; an existing file or symlink in an entry's place is replaced (unlinked first),
//! an existing directory is merged into, and a directory entry over a non-directory (or the
//! reverse) is an error. Hard-link targets must be inside the tree. Ownership is not restored:
//! files belong to whoever extracts (as `docker cp`). The stream is cut off past
//! [`Limits`] (entries, bytes, metadata sizes) with a clear error; on any error extraction
//! stops, and what was extracted so far stays.

mod guard;
mod pack;
mod path;
mod sparse;
mod unpack;

use std::io;

pub use pack::{pack, PackOptions};
pub use path::{open_dir, open_dir_nofollow, EntryName};
pub use unpack::{unpack, UnpackOptions};

/// Longest entry name or symlink target accepted, in bytes (Linux `PATH_MAX`).
pub const MAX_NAME: usize = 4096;

/// Errors of packing and extracting archives.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted (`open`, `mkdir`, ...).
        op: &'static str,
        /// The entry or file, invalid UTF-8 replaced by U+FFFD.
        path: String,
        /// What the kernel said.
        source: io::Error,
    },
    /// The tar stream is malformed or could not be read or written.
    #[error("tar stream: {0}")]
    Stream(io::Error),
    /// An entry's name or link target breaks the extraction rules.
    #[error("archive entry {path:?} refused: {reason}")]
    Refused {
        /// The entry name, invalid UTF-8 replaced by U+FFFD.
        path: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// Writing would go through a symlink.
    #[error("{path}: refusing to write through a symlink")]
    Symlink {
        /// The path that is (or passes through) a symlink.
        path: String,
    },
    /// The stream exceeds one of the [`Limits`].
    #[error("archive exceeds the limit of {limit} {what}")]
    Limit {
        /// What was counted (`entries`, `bytes of file contents`, ...).
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// The source to pack cannot be archived.
    #[error("{path}: {reason}")]
    Source {
        /// The source path.
        path: String,
        /// Why not.
        reason: &'static str,
    },
}

impl ArchiveError {
    /// The `io::Error` underneath, when there is one (for error classification).
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Stream(e) => Some(e),
            _ => None,
        }
    }
}

/// Bounds on an archive being extracted, against a hostile sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most entries (directories, files, links).
    pub entries: u64,
    /// Most bytes of file contents, summed over the apparent sizes of all files (holes
    /// included, since a reader sees them as zeros).
    pub file_bytes: u64,
    /// Most bytes of one metadata entry (GNU long name or link, PAX header).
    pub metadata_bytes: u64,
    /// Most sparse extension blocks (512 bytes, 21 data segments each) per file.
    pub sparse_blocks: u64,
}

impl Default for Limits {
    /// 1,000,000 entries; 1 TiB of file contents; 64 KiB per metadata entry; 10,000 sparse
    /// extension blocks (210,000 data segments) per file.
    fn default() -> Self {
        Self {
            entries: 1_000_000,
            file_bytes: 1 << 40,
            metadata_bytes: 64 * 1024,
            sparse_blocks: 10_000,
        }
    }
}

/// Display form of a byte path.
pub(crate) fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[cfg(test)]
mod tests;

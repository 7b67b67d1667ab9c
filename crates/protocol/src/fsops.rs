//! Messages of directory transfers (tar archives) and file-system requests (list, stat,
//! mkdir, remove).
//!
//! An `ArchiveWrite` ([`ArchiveWriteRequest`]) is followed by `Data` frames carrying a tar
//! stream and one `End`; the agent extracts it into the directory `path` and answers
//! [`ArchiveDone`] or `Error`. An `ArchiveRead` ([`ArchiveReadRequest`]) is answered with `Data`
//! frames carrying a tar stream of `path` and then [`ArchiveDone`] (or `Error`, possibly after
//! some `Data`). An `Fs` request ([`FsRequest`]) is answered with [`FileEntry`] frames and `End`
//! (`list`), one [`FileEntry`] (`stat`) or `Ack` (`mkdir`, `remove`); any of them may instead be
//! answered with `Error`. The archive format is in [`crate::archive`].

use serde::{Deserialize, Serialize};

use crate::bytes::ByteString;
use crate::workspace::SkippedEntry;

/// Extracts a tar stream into an existing guest directory. Followed by `Data` frames and `End`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveWriteRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Absolute guest path of an existing directory (bytes: a JSON string or
    /// `{"base64": ...}`), normalised by the agent (`.`, `..` and repeated `/` resolved
    /// lexically; symlinks in this path are followed, in the guest).
    pub path: ByteString,
}

/// Packs a guest file, symlink or directory tree into a tar stream; entry names start with
/// the last component of `path`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArchiveReadRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Absolute guest path (bytes), normalised by the agent; not `/`. A symlink here is
    /// archived as a link, not followed.
    pub path: ByteString,
}

/// Last frame of a successful archive transfer.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ArchiveDone {
    /// Entries packed or extracted (directories, files, links).
    pub entries: u64,
    /// Bytes of file contents packed or extracted, holes not counted.
    pub bytes: u64,
    /// Entries left out (device nodes, sockets, FIFOs), with the reason.
    #[serde(default)]
    pub skipped: Vec<SkippedEntry>,
}

/// What an [`FsRequest`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsOp {
    /// The entries of the directory `path`, sorted by name: `FileEntry` frames, then `End`.
    List,
    /// `path` itself (not followed when it is a symlink): one `FileEntry`.
    Stat,
    /// Creates the directory `path` (mode 0755 before the umask); with `parents`, missing
    /// parents too and no error when it exists. Answer: `Ack`.
    Mkdir,
    /// Removes `path` (a symlink is removed, not followed); a non-empty directory needs
    /// `recursive`. Answer: `Ack`.
    Remove,
}

/// A file-system request on one guest path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// The operation.
    pub op: FsOp,
    /// Absolute guest path (bytes), normalised by the agent.
    pub path: ByteString,
    /// `mkdir` only: create missing parents, and succeed when the directory exists.
    #[serde(default)]
    pub parents: bool,
    /// `remove` only: remove a directory with everything below it.
    #[serde(default)]
    pub recursive: bool,
}

/// Type of a [`FileEntry`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link.
    Symlink,
    /// Anything else (device node, FIFO, socket).
    Other,
}

/// One guest file, as `lstat(2)` sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// The last path component (bytes).
    pub name: ByteString,
    /// The whole path (bytes).
    pub path: ByteString,
    /// Type of the file.
    #[serde(rename = "type")]
    pub kind: FileType,
    /// Size in bytes (`st_size`; a symlink's is its target's length).
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Last modification, seconds since the Unix epoch.
    pub mtime: i64,
    /// A symlink's target (bytes); absent for other types.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<ByteString>,
}

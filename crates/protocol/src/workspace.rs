//! The workspace change-set request: what the guest changed in its clone workspace.
//!
//! A sandbox started with a *clone* workspace (`bulkhead run --workspace DIR:clone`) sees the
//! host directory `DIR` read-only as the lower layer of an overlay file system at `/workspace`;
//! every change the guest makes lands in the overlay's private upper directory. The host asks
//! the agent for those changes with one request per connection:
//!
//! ```text
//! H: WorkspaceChanges{version, contents, content_names}
//! G: (Change{path, status, kind, mode, size, data}  [Data* End when data])*
//!    ChangesEnd{changes, skipped} | Error
//! ```
//!
//! Records come sorted by `path` (byte order; a path twice only as `D` then `A`, for a kind
//! change). `data` is true for added or modified files and symbolic links whose contents the
//! request asked for: the file's bytes (or the link's target) follow as `Data` frames and one
//! `End`. The host must treat every field
//! as untrusted input (the guest may be compromised): see [`ChangeRecord`] for what a valid
//! record is.
//!
//! An agent older than this request answers `Error` ("unknown frame type 0x06") and closes the
//! connection; the request carries [`crate::PROTOCOL_VERSION`] like every other.

use serde::{Deserialize, Serialize};

/// Longest path in a [`ChangeRecord`], bytes (Linux `PATH_MAX`).
pub const MAX_CHANGE_PATH: usize = 4096;

/// Asks for the change set of the guest's clone workspace. First frame of its connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceChangesRequest {
    /// Must be [`crate::PROTOCOL_VERSION`].
    pub version: u32,
    /// Send the contents (`Data* End`) of every added or modified file and symbolic link.
    #[serde(default)]
    pub contents: bool,
    /// File names (last path component, e.g. `package.json`) whose contents are sent even when
    /// `contents` is false.
    #[serde(default)]
    pub content_names: Vec<String>,
    /// Send the target of every added or modified symbolic link even when `contents` is false.
    #[serde(default)]
    pub link_targets: bool,
}

/// How a path differs from the host directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ChangeStatus {
    /// New: the host directory has nothing at this path (or something of another kind, which
    /// then also gets a `D` record).
    #[serde(rename = "A")]
    Added,
    /// Same kind as in the host directory, different contents or executable bit.
    #[serde(rename = "M")]
    Modified,
    /// Gone from the guest's view.
    #[serde(rename = "D")]
    Deleted,
}

impl ChangeStatus {
    /// The one-letter code, as `git diff --name-status` prints it.
    pub fn letter(self) -> char {
        match self {
            ChangeStatus::Added => 'A',
            ChangeStatus::Modified => 'M',
            ChangeStatus::Deleted => 'D',
        }
    }
}

/// What kind of file system entry a record is about (for `D`: what the host directory has).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A symbolic link; its "contents" are its target.
    Symlink,
    /// A directory. Reported only when file records cannot express the change: a new directory
    /// with nothing reported below it (`A`), or the top of a deleted tree (`D`, after a `D`
    /// for every file and link below it).
    Dir,
}

/// One changed path. Valid records (the host checks): `path` is relative, `/`-separated, without
/// empty, `.` or `..` components, without NUL, at most [`MAX_CHANGE_PATH`] bytes, strictly
/// greater than the previous record's path; `data` only with status `A`/`M` and kind
/// `file`/`symlink`; `mode` at most `0o7777`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeRecord {
    /// Path relative to the workspace root, e.g. `src/main.rs`.
    pub path: String,
    /// Added, modified or deleted.
    pub status: ChangeStatus,
    /// The entry's kind (the new one for `A`/`M`, the old one for `D`).
    pub kind: EntryKind,
    /// Permission bits (`st_mode & 0o7777`) of the new entry; of the old one for `D`.
    pub mode: u32,
    /// Bytes of the new file (or of the link target), 0 for directories and deletions.
    pub size: u64,
    /// `Data* End` with the contents follow this record.
    #[serde(default)]
    pub data: bool,
}

/// An entry the agent could not describe (its name is not UTF-8, or it is a device, FIFO or
/// socket). The host reports it for review; it is never exported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedEntry {
    /// The path, with invalid UTF-8 replaced by U+FFFD (for display only).
    pub path: String,
    /// Why it was skipped.
    pub reason: String,
}

/// Last frame of a successful change-set request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangesEnd {
    /// Number of `Change` records sent.
    pub changes: u64,
    /// Entries that could not be described.
    #[serde(default)]
    pub skipped: Vec<SkippedEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{read_frame, Frame};

    #[test]
    fn change_records_use_git_letters_and_survive_a_frame_round_trip() {
        // Arrange
        let record = ChangeRecord {
            path: ".git/hooks/pre-commit".into(),
            status: ChangeStatus::Modified,
            kind: EntryKind::File,
            mode: 0o755,
            size: 12,
            data: true,
        };
        let frame = Frame::Change(record.clone());

        // Act
        let bytes = frame.encode().unwrap();
        let json = String::from_utf8_lossy(&bytes[5..]).into_owned();
        let decoded = read_frame(&mut &bytes[..]).unwrap();

        // Assert
        assert!(json.contains(r#""status":"M""#), "{json}");
        assert!(json.contains(r#""kind":"file""#), "{json}");
        assert_eq!(decoded, Some(frame));
    }

    #[test]
    fn the_request_needs_only_its_version() {
        // Arrange / Act
        let request: WorkspaceChangesRequest = serde_json::from_str(r#"{"version":1}"#).unwrap();

        // Assert
        assert!(!request.contents && request.content_names.is_empty() && !request.link_targets);
    }
}

//! Receiving a change set from the guest agent, checking every record as untrusted input, and
//! keeping the contents in a temporary directory of the sandbox's runtime directory.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use bulkhead_protocol::client::{AgentClient, ChangeEvent};
use bulkhead_protocol::workspace::MAX_CHANGE_PATH;
use bulkhead_protocol::{
    ChangeRecord, ChangeStatus, EntryKind, SkippedEntry, WorkspaceChangesRequest, PROTOCOL_VERSION,
};

use super::{io_err, WorkspaceError};

/// Bounds on what a guest may send in one change set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most records. Default 1,000,000.
    pub max_changes: usize,
    /// Most content bytes in all. Default 4 GiB.
    pub max_bytes: u64,
    /// Most skipped entries reported. Default 10,000.
    pub max_skipped: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_changes: 1_000_000,
            max_bytes: 4 << 30,
            max_skipped: 10_000,
        }
    }
}

/// One received record and where its contents are.
#[derive(Debug)]
pub(crate) struct Entry {
    /// The record (checked).
    pub record: ChangeRecord,
    /// The file holding its contents, when they were sent.
    pub contents: Option<PathBuf>,
}

impl Entry {
    /// The contents, when they were sent.
    pub fn read(&self) -> Result<Option<Vec<u8>>, WorkspaceError> {
        self.contents
            .as_ref()
            .map(|p| fs::read(p).map_err(io_err("read", p)))
            .transpose()
    }
}

/// A whole change set.
#[derive(Debug)]
pub(crate) struct Received {
    /// The records, in the agent's (checked) order.
    pub entries: Vec<Entry>,
    /// What the agent could not describe.
    pub skipped: Vec<SkippedEntry>,
    /// Holds the contents; removed on drop.
    _dir: tempfile::TempDir,
}

/// Asks the agent for the change set (with all contents, or only link targets and the
/// contents of files named `content_names`) and stores it below `scratch_parent`.
pub(crate) fn receive(
    client: &AgentClient,
    contents: bool,
    content_names: &[&str],
    scratch_parent: &Path,
    limits: Limits,
) -> Result<Received, WorkspaceError> {
    let dir = tempfile::Builder::new()
        .prefix("workspace-changes-")
        .tempdir_in(scratch_parent)
        .map_err(io_err("create a temporary directory in", scratch_parent))?;
    let request = WorkspaceChangesRequest {
        version: PROTOCOL_VERSION,
        contents,
        content_names: content_names.iter().map(|n| (*n).to_owned()).collect(),
        link_targets: true,
    };
    let mut stream = client.workspace_changes(&request)?;
    let mut entries: Vec<Entry> = Vec::new();
    let mut open: Option<(File, PathBuf)> = None;
    let mut total = 0u64;
    loop {
        match stream.next_event()? {
            ChangeEvent::Change(record) => {
                if open.is_some() {
                    return protocol("a record arrived inside another record's contents");
                }
                check(entries.last().map(|e| &e.record), &record)?;
                if entries.len() >= limits.max_changes {
                    return too_large(format!("more than {} changes", limits.max_changes));
                }
                let contents = if record.data {
                    let path = dir.path().join(entries.len().to_string());
                    let file = File::create(&path).map_err(io_err("create", &path))?;
                    open = Some((file, path.clone()));
                    Some(path)
                } else {
                    None
                };
                entries.push(Entry { record, contents });
            }
            ChangeEvent::Data(bytes) => {
                let Some((file, path)) = open.as_mut() else {
                    return protocol("contents without a record that announced them");
                };
                total += bytes.len() as u64;
                if total > limits.max_bytes {
                    return too_large(format!("more than {} bytes of contents", limits.max_bytes));
                }
                file.write_all(&bytes).map_err(io_err("write", path))?;
            }
            ChangeEvent::DataEnd => {
                if open.take().is_none() {
                    return protocol("an end of contents without contents");
                }
            }
            ChangeEvent::Done(end) => {
                if open.is_some() {
                    return protocol("the change set ended inside a record's contents");
                }
                if end.changes != entries.len() as u64 {
                    return protocol("the record count does not match");
                }
                let mut skipped = end.skipped;
                skipped.truncate(limits.max_skipped);
                return Ok(Received {
                    entries,
                    skipped,
                    _dir: dir,
                });
            }
        }
    }
}

fn protocol<T>(message: &str) -> Result<T, WorkspaceError> {
    Err(WorkspaceError::Protocol(message.to_owned()))
}

fn too_large<T>(message: String) -> Result<T, WorkspaceError> {
    Err(WorkspaceError::TooLarge(message))
}

/// Sort key of a record: path bytes, then deletions before additions of the same path.
fn key(record: &ChangeRecord) -> (&[u8], u8) {
    (
        record.path.as_bytes(),
        u8::from(record.status != ChangeStatus::Deleted),
    )
}

/// Checks `record` on its own and against the one before it.
pub(crate) fn check(
    prev: Option<&ChangeRecord>,
    record: &ChangeRecord,
) -> Result<(), WorkspaceError> {
    let bad = |why: &str| {
        Err(WorkspaceError::Protocol(format!(
            "record {:?}: {why}",
            record.path.chars().take(200).collect::<String>()
        )))
    };
    if !valid_path(&record.path) {
        return bad("not a relative path of plain components");
    }
    if record.mode > 0o7777 {
        return bad("mode out of range");
    }
    let has_contents = record.status != ChangeStatus::Deleted && record.kind != EntryKind::Dir;
    if record.data && !has_contents {
        return bad("contents for a deletion or a directory");
    }
    if prev.is_some_and(|p| key(p) >= key(record)) {
        return bad("out of order or repeated");
    }
    Ok(())
}

/// Relative, `/`-separated, no empty, `.` or `..` components, no NUL, at most
/// [`MAX_CHANGE_PATH`] bytes.
pub(crate) fn valid_path(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= MAX_CHANGE_PATH
        && !path.contains('\0')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(path: &str, status: ChangeStatus, kind: EntryKind, data: bool) -> ChangeRecord {
        ChangeRecord {
            path: path.into(),
            status,
            kind,
            mode: 0o644,
            size: 0,
            data,
        }
    }

    fn file(path: &str) -> ChangeRecord {
        record(path, ChangeStatus::Added, EntryKind::File, true)
    }

    #[test]
    fn hostile_paths_are_refused() {
        // Arrange
        let paths = [
            "/etc/passwd",
            "../outside",
            "a/../../b",
            "a//b",
            "a/./b",
            "",
            "trailing/",
            "nul\0byte",
        ];

        // Act
        let results: Vec<_> = paths.iter().map(|p| check(None, &file(p))).collect();

        // Assert
        assert!(results.iter().all(Result::is_err), "{results:?}");
        assert!(check(None, &file(&"a".repeat(MAX_CHANGE_PATH + 1))).is_err());
        assert!(check(None, &file("src/ok file.rs")).is_ok());
    }

    #[test]
    fn records_must_be_sorted_once_each_and_only_files_carry_contents() {
        // Arrange
        let deleted = record("x", ChangeStatus::Deleted, EntryKind::Dir, false);
        let readded = record("x", ChangeStatus::Added, EntryKind::File, true);
        let dir_with_data = record("d", ChangeStatus::Added, EntryKind::Dir, true);
        let deletion_with_data = record("d", ChangeStatus::Deleted, EntryKind::File, true);

        // Act / Assert
        assert!(check(Some(&deleted), &readded).is_ok(), "a kind change");
        assert!(
            check(Some(&readded), &deleted).is_err(),
            "deletion after addition"
        );
        assert!(check(Some(&file("b")), &file("a")).is_err(), "unsorted");
        assert!(check(Some(&file("a")), &file("a")).is_err(), "repeated");
        assert!(check(None, &dir_with_data).is_err());
        assert!(check(None, &deletion_with_data).is_err());
        let mut odd_mode = file("m");
        odd_mode.mode = 0o170_000;
        assert!(check(None, &odd_mode).is_err());
    }
}

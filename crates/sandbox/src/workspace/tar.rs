//! The tar export of a clone workspace's changes.
//!
//! A POSIX tar archive (GNU long names for paths over 100 bytes) whose first two members are
//! bulkhead's:
//!
//! - `.bulkhead-export/manifest.json`: the whole diff as JSON (every change with its status,
//!   kind and flag, and the skipped entries; the `WorkspaceDiff` type);
//! - `.bulkhead-export/deleted`: every deleted path (files, links and the tops of deleted
//!   directories), each followed by a NUL byte;
//!
//! followed by every added or modified file (with its permission bits), symbolic link, and new
//! empty directory, at its path relative to the workspace root. Guest changes under
//! `.bulkhead-export` itself are never archived (nor listed in `deleted`), so a guest cannot
//! forge bulkhead's members; they still appear in the manifest's changes. Delete first, then
//! extract (a path deleted and re-added as another kind is in both). To apply it to a copy of the
//! directory:
//!
//! ```sh
//! tar -xOf export.tar .bulkhead-export/deleted | (cd COPY && xargs -0r rm -rf --)
//! tar -xf export.tar -C COPY --exclude=.bulkhead-export
//! ```

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::ffi::OsStringExt;
use std::time::{SystemTime, UNIX_EPOCH};

use bulkhead_protocol::{ChangeStatus, EntryKind};

use super::receive::Received;

/// Directory of bulkhead's own members in the archive.
pub const EXPORT_DIR: &str = ".bulkhead-export";

/// Writes the archive of `received` with `manifest` (JSON) to `out`.
pub(crate) fn write(out: &mut dyn Write, manifest: &[u8], received: &Received) -> io::Result<()> {
    let mtime = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = tar::Builder::new(out);
    let header = |kind: tar::EntryType, mode: u32, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_mtime(mtime);
        h
    };
    let mut h = header(tar::EntryType::Regular, 0o644, manifest.len() as u64);
    builder.append_data(&mut h, format!("{EXPORT_DIR}/manifest.json"), manifest)?;
    let mut deleted = Vec::new();
    let archived = received
        .entries
        .iter()
        .filter(|e| !is_reserved(&e.record.path));
    for entry in archived
        .clone()
        .filter(|e| e.record.status == ChangeStatus::Deleted)
    {
        deleted.extend_from_slice(entry.record.path.as_bytes());
        deleted.push(0);
    }
    let mut h = header(tar::EntryType::Regular, 0o644, deleted.len() as u64);
    builder.append_data(&mut h, format!("{EXPORT_DIR}/deleted"), &deleted[..])?;
    for entry in archived {
        let record = &entry.record;
        if record.status == ChangeStatus::Deleted {
            continue;
        }
        let path = record.path.as_str();
        match (record.kind, &entry.contents) {
            (EntryKind::Dir, _) => {
                let mut h = header(tar::EntryType::Directory, record.mode | 0o700, 0);
                builder.append_data(&mut h, path, io::empty())?;
            }
            (EntryKind::Symlink, Some(contents)) => {
                let target = OsString::from_vec(std::fs::read(contents)?);
                let mut h = header(tar::EntryType::Symlink, 0o777, 0);
                builder.append_link(&mut h, path, target)?;
            }
            (EntryKind::File, Some(contents)) => {
                let file = File::open(contents)?;
                let size = file.metadata()?.len();
                let mut h = header(tar::EntryType::Regular, record.mode, size);
                builder.append_data(&mut h, path, file)?;
            }
            // Contents not sent: nothing to archive (cannot happen for a full export).
            (_, None) => {}
        }
    }
    builder.into_inner()?.flush()
}

/// Whether `path` (relative, `/`-separated) is [`EXPORT_DIR`] or below it.
fn is_reserved(path: &str) -> bool {
    path.split('/').next() == Some(EXPORT_DIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_export_dir_and_what_is_below_it_are_reserved() {
        assert!(is_reserved(".bulkhead-export"));
        assert!(is_reserved(".bulkhead-export/deleted"));
        assert!(is_reserved(".bulkhead-export/x/manifest.json"));
        assert!(!is_reserved("src/.bulkhead-export/deleted"));
        assert!(!is_reserved(".bulkhead-exported"));
    }
}

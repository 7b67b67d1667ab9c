//! `diff` and `export` of a sandbox's workspace, and their results.

use std::fmt::Write as _;
use std::fs;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use bulkhead_protocol::client::AgentClient;
use bulkhead_protocol::{ChangeStatus, EntryKind, SkippedEntry};
use serde::{Deserialize, Serialize};

use super::patch::{self, Blob};
use super::receive::{self, Limits, Received};
use super::snapshot::{self, Snapshot};
use super::{flags, hostfs, info, io_err, tar, WorkspaceError, WorkspaceMode, SNAPSHOT_FILE};
use crate::sandbox::{Error, Sandbox};

/// One changed path of a workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Path relative to the workspace root, `/`-separated.
    pub path: String,
    /// Added, modified or deleted (`A`, `M`, `D`).
    pub status: ChangeStatus,
    /// File, symlink or directory.
    pub kind: EntryKind,
    /// Why the path needs review before the changes reach the host ([`super::flags`]); `None`
    /// for ordinary paths.
    pub flag: Option<String>,
}

/// What changed in a workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceDiff {
    /// Direct or clone.
    pub mode: WorkspaceMode,
    /// The host directory.
    pub host: PathBuf,
    /// Every change, sorted by path (a kind change is a `D` and an `A` of the same path).
    pub changes: Vec<Change>,
    /// Entries the guest has that could not be exported (names that are not UTF-8, devices,
    /// FIFOs, sockets); each needs review.
    pub skipped: Vec<SkippedEntry>,
    /// True for direct workspaces: only flagged paths are tracked, so `changes` lists nothing
    /// else (the other changes are already in the host directory).
    pub flagged_only: bool,
    /// False when a direct workspace's snapshot walk stopped at its entry limit.
    pub complete: bool,
}

impl WorkspaceDiff {
    /// The changes flagged for review.
    pub fn flagged(&self) -> impl Iterator<Item = &Change> {
        self.changes.iter().filter(|c| c.flag.is_some())
    }

    /// Whether anything needs review (flagged changes or skipped entries).
    pub fn needs_review(&self) -> bool {
        self.flagged().next().is_some() || !self.skipped.is_empty()
    }

    /// `git diff --name-status`-style lines: `A\tpath`, directories with a trailing `/`, odd
    /// names C-quoted as git quotes them.
    pub fn name_status(&self) -> String {
        let mut out = String::new();
        for change in &self.changes {
            let _ = writeln!(
                out,
                "{}\t{}",
                change.status.letter(),
                display_path(&change.path, change.kind)
            );
        }
        out
    }

    /// The "flagged for review" section: one line per flagged change and skipped entry,
    /// indented by `indent`; empty when nothing needs review.
    pub fn review(&self, indent: &str) -> String {
        let mut out = String::new();
        for change in self.flagged() {
            let _ = writeln!(
                out,
                "{indent}{} {}  ({})",
                change.status.letter(),
                display_path(&change.path, change.kind),
                change.flag.as_deref().unwrap_or_default()
            );
        }
        for skipped in &self.skipped {
            let _ = writeln!(
                out,
                "{indent}? {}  ({})",
                patch::quote("", &skipped.path),
                skipped.reason
            );
        }
        out
    }
}

/// A path for display: C-quoted when odd (so control characters and newlines cannot forge
/// lines), directories with a trailing `/`.
fn display_path(path: &str, kind: EntryKind) -> String {
    let slash = if kind == EntryKind::Dir { "/" } else { "" };
    patch::quote("", &format!("{path}{slash}"))
}

/// What [`export`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportFormat {
    /// A git-style patch (`git apply`).
    Patch,
    /// A tar archive of the changed files with a deletion list (see the `tar` module docs).
    Tar,
}

impl FromStr for ExportFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "patch" => Ok(ExportFormat::Patch),
            "tar" => Ok(ExportFormat::Tar),
            other => Err(format!("unknown export format {other:?} (patch or tar)")),
        }
    }
}

/// The workspace changes of the sandbox whose agent `client` reaches and whose runtime
/// directory is `runtime_dir`: for a clone workspace the guest's change set, for a direct one
/// the flagged paths changed since the sandbox started.
///
/// # Errors
/// [`WorkspaceError::None`] without a workspace; agent, protocol and file errors.
pub fn diff(client: &AgentClient, runtime_dir: &Path) -> Result<WorkspaceDiff, WorkspaceError> {
    let info = info(runtime_dir)?.ok_or(WorkspaceError::None)?;
    if info.mode == WorkspaceMode::Direct {
        let path = runtime_dir.join(SNAPSHOT_FILE);
        let bytes = fs::read(&path).map_err(io_err("read", &path))?;
        let before: Snapshot = serde_json::from_slice(&bytes)
            .map_err(|e| io_err("parse", &path)(io::Error::other(e)))?;
        let after = snapshot::take(&info.host);
        return Ok(WorkspaceDiff {
            mode: info.mode,
            changes: snapshot::changes(&before, &after),
            host: info.host,
            skipped: Vec::new(),
            flagged_only: true,
            complete: before.complete && after.complete,
        });
    }
    let received = receive::receive(
        client,
        false,
        &["package.json"],
        runtime_dir,
        Limits::default(),
    )?;
    Ok(clone_diff(&info.host, &received))
}

/// Writes the changes of the sandbox's clone workspace to `out` as `format`; returns them.
///
/// # Errors
/// [`WorkspaceError::DirectExport`] for a direct workspace, and as [`diff`]; on error `out`
/// may hold part of the export.
pub fn export(
    client: &AgentClient,
    runtime_dir: &Path,
    format: ExportFormat,
    out: &mut dyn Write,
) -> Result<WorkspaceDiff, WorkspaceError> {
    let info = info(runtime_dir)?.ok_or(WorkspaceError::None)?;
    if info.mode == WorkspaceMode::Direct {
        return Err(WorkspaceError::DirectExport(info.host));
    }
    let received = receive::receive(client, true, &[], runtime_dir, Limits::default())?;
    let diff = clone_diff(&info.host, &received);
    let mut out = BufWriter::with_capacity(256 * 1024, out);
    let written = match format {
        ExportFormat::Patch => write_patch(&mut out, &diff, &received),
        ExportFormat::Tar => serde_json::to_vec_pretty(&diff)
            .map_err(io::Error::other)
            .and_then(|manifest| tar::write(&mut out, &manifest, &received)),
    };
    written
        .and_then(|()| out.flush())
        .map_err(io_err("write the export of", &info.host))?;
    Ok(diff)
}

/// The diff of a received change set, each change flagged by the rules.
fn clone_diff(host: &Path, received: &Received) -> WorkspaceDiff {
    let changes = received
        .entries
        .iter()
        .map(|entry| {
            let r = &entry.record;
            let mut flag = flags::path_flag(&r.path);
            if flag.is_none() && flags::is_package_json(&r.path) && r.kind != EntryKind::Dir {
                let old = hostfs::read(host, &r.path).ok().flatten().map(|e| e.data);
                let new = match r.status {
                    ChangeStatus::Deleted => None,
                    _ => entry.read().ok().flatten(),
                };
                flag = flags::package_json_flag(old.as_deref(), new.as_deref());
            }
            if flag.is_none() && r.kind == EntryKind::Symlink && r.status != ChangeStatus::Deleted {
                if let Some(target) = entry.read().ok().flatten() {
                    flag = flags::link_flag(&r.path, &target);
                }
            }
            Change {
                path: r.path.clone(),
                status: r.status,
                kind: r.kind,
                flag: flag.map(str::to_owned),
            }
        })
        .collect();
    WorkspaceDiff {
        mode: WorkspaceMode::Clone,
        host: host.to_owned(),
        changes,
        skipped: received.skipped.clone(),
        flagged_only: false,
        complete: true,
    }
}

/// Whether `path` is `.git` or inside one: `git apply` refuses such paths (git's
/// `verify_path`, compared case-insensitively), and one would fail the whole patch.
pub(crate) fn in_git_dir(path: &str) -> bool {
    path.split('/').any(|c| c.eq_ignore_ascii_case(".git"))
}

/// The patch: a preamble (ignored by `git apply`: every line is indented, paths quoted) naming
/// the flagged paths and what the patch leaves out, then one diff per file and link against the
/// host directory as it is now. Paths inside `.git/` are left out (`git apply` refuses them);
/// the tar export has them.
fn write_patch(out: &mut dyn Write, diff: &WorkspaceDiff, received: &Received) -> io::Result<()> {
    let host = patch::quote("", &diff.host.to_string_lossy());
    writeln!(
        out,
        "bulkhead workspace export: the sandbox's changes to {host}"
    )?;
    writeln!(
        out,
        "  apply with `git apply FILE` in that directory (or a copy of it)"
    )?;
    let review = diff.review("    ");
    if !review.is_empty() {
        writeln!(
            out,
            "\n  FLAGGED FOR REVIEW: these run code on the host implicitly:"
        )?;
        out.write_all(review.as_bytes())?;
    }
    // git apply refuses paths inside .git/, and git has no empty directories.
    let in_git: Vec<&Change> = diff
        .changes
        .iter()
        .filter(|c| {
            in_git_dir(&c.path) || (c.kind == EntryKind::Dir && c.status == ChangeStatus::Added)
        })
        .collect();
    if !in_git.is_empty() {
        writeln!(
            out,
            "\n  NOT IN THIS PATCH: {} change(s) inside .git/ or new empty directories (git apply \
             refuses the first and has no such thing as the second; export --tar has them):",
            in_git.len()
        )?;
        for change in in_git.iter().take(50) {
            writeln!(
                out,
                "    {} {}",
                change.status.letter(),
                display_path(&change.path, change.kind)
            )?;
        }
        if in_git.len() > 50 {
            writeln!(out, "    ... and {} more", in_git.len() - 50)?;
        }
    }
    writeln!(out)?;
    for entry in &received.entries {
        let r = &entry.record;
        if r.kind == EntryKind::Dir || in_git_dir(&r.path) {
            continue; // git has no directories (their files carry the change); see above
        }
        let old = match hostfs::read(&diff.host, &r.path)? {
            // A `D` then `A` of the same path: the `A` record adds only.
            Some(_) if r.status == ChangeStatus::Added => None,
            old => old,
        };
        let new = match r.status {
            ChangeStatus::Deleted => None,
            _ => entry.read().map_err(io::Error::other)?,
        };
        let old_blob = old.as_ref().map(|o| Blob {
            mode: patch::git_mode(o.kind, o.mode),
            data: &o.data,
        });
        let new_blob = new.as_deref().map(|data| Blob {
            mode: patch::git_mode(r.kind, r.mode),
            data,
        });
        patch::write_diff(out, &r.path, old_blob, new_blob)?;
    }
    Ok(())
}

impl Sandbox {
    /// The sandbox's workspace, if it has one.
    ///
    /// # Errors
    /// [`Error::Workspace`] when its record cannot be read.
    pub fn workspace_info(&self) -> Result<Option<super::WorkspaceInfo>, Error> {
        match self.runtime_path() {
            Some(dir) => Ok(info(dir)?),
            None => Ok(None),
        }
    }

    /// What changed in the sandbox's workspace (see [`diff`]).
    ///
    /// # Errors
    /// [`Error::Workspace`].
    pub fn workspace_diff(&self) -> Result<WorkspaceDiff, Error> {
        let dir = self.runtime_path().ok_or(WorkspaceError::None)?;
        Ok(diff(&self.client(), dir)?)
    }

    /// Writes the changes of the sandbox's clone workspace to `out` (see [`export`]).
    ///
    /// # Errors
    /// [`Error::Workspace`].
    pub fn export_workspace(
        &self,
        format: ExportFormat,
        out: &mut dyn Write,
    ) -> Result<WorkspaceDiff, Error> {
        let dir = self.runtime_path().ok_or(WorkspaceError::None)?;
        Ok(export(&self.client(), dir, format, out)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_inside_any_git_directory_are_recognised() {
        // Arrange / Act / Assert
        assert!(in_git_dir(".git/hooks/pre-commit"));
        assert!(in_git_dir("sub/.GIT/config"));
        assert!(in_git_dir("worktree/.git"));
        assert!(!in_git_dir(".github/workflows/ci.yml"));
        assert!(!in_git_dir("a.git/x"));
    }
}

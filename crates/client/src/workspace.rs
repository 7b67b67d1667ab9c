//! The JSON documents of workspaces and host directories in the bulkheadd API: what a create
//! request shares into the sandbox, and the answer of `GET /v1/sandboxes/{id}/workspace/diff`.

use serde::{Deserialize, Serialize};

/// Response header of `GET .../workspace/export` carrying what needs review: base64 (standard
/// alphabet, padded) of an [`ExportReview`] JSON document.
pub const REVIEW_HEADER: &str = "x-bulkhead-review";

/// Most entries of each list in the [`REVIEW_HEADER`] (the export itself has them all).
pub const MAX_REVIEW_ENTRIES: usize = 200;

/// How the sandbox gets the workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceMode {
    /// Shared read-write at `/workspace`: the guest's changes reach the host directory at once.
    #[default]
    Direct,
    /// Shared read-only under a private overlay at `/workspace`: changes stay in the sandbox
    /// until exported.
    Clone,
}

/// A host project directory shared at `/workspace` (`workspace` of `POST /v1/sandboxes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct WorkspaceSpec {
    /// Absolute host path, inside one of the daemon's `mount_roots`.
    pub path: String,
    /// `direct` (default) or `clone`.
    #[serde(default)]
    pub mode: WorkspaceMode,
}

/// A host directory shared at a guest path (one of `mounts` of `POST /v1/sandboxes`, like
/// `bulkhead run --mount HOST:GUEST[:ro]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MountSpec {
    /// Absolute host path of a directory, inside one of the daemon's `mount_roots`.
    pub host: String,
    /// Absolute guest path (not `/`, no `..`).
    pub guest: String,
    /// Read-only, enforced by the VMM's file server (`EROFS`).
    #[serde(default)]
    pub ro: bool,
}

/// How a path differs from the host directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ChangeStatus {
    /// Added.
    #[serde(rename = "A")]
    Added,
    /// Modified (contents, link target or executable bit).
    #[serde(rename = "M")]
    Modified,
    /// Deleted.
    #[serde(rename = "D")]
    Deleted,
}

/// The kind of a changed entry (the old one for a deletion).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    /// A regular file.
    File,
    /// A symbolic link.
    Symlink,
    /// A directory (a new empty one, or the top of a deleted tree).
    Dir,
}

/// One changed path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkspaceChange {
    /// Path relative to the workspace root.
    pub path: String,
    /// `A`, `M` or `D`.
    pub status: ChangeStatus,
    /// `file`, `symlink` or `dir`.
    pub kind: ChangeKind,
    /// The path runs code on the host implicitly (git hooks, Makefiles, CI, package.json
    /// scripts, IDE and coding-agent configuration): review it before applying.
    pub flagged: bool,
    /// Why it is flagged.
    pub reason: Option<String>,
}

/// An entry of the guest's workspace that cannot be exported (a name that is not UTF-8, a
/// device, FIFO or socket); always needs review.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SkippedPath {
    /// The path (invalid UTF-8 replaced by U+FFFD).
    pub path: String,
    /// Why it was left out.
    pub reason: String,
}

/// Answer of `GET /v1/sandboxes/{id}/workspace/diff`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkspaceDiffInfo {
    /// The workspace's mode.
    pub mode: WorkspaceMode,
    /// The host directory.
    pub path: String,
    /// True for `direct`: only the flagged paths are tracked (from a snapshot taken at start);
    /// every other change is already in the host directory and not listed.
    pub flagged_only: bool,
    /// False when a direct workspace's snapshot stopped at its entry limit.
    pub complete: bool,
    /// Every change, sorted by path.
    pub changes: Vec<WorkspaceChange>,
    /// Entries that cannot be exported.
    pub skipped: Vec<SkippedPath>,
}

/// `format` of `GET /v1/sandboxes/{id}/workspace/export`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ExportFormat {
    /// A git-style binary patch (`git apply`).
    Patch,
    /// A tar archive of the changed files plus `.bulkhead-export/deleted`.
    Tar,
}

impl ExportFormat {
    /// `patch` or `tar`.
    pub fn as_str(self) -> &'static str {
        match self {
            ExportFormat::Patch => "patch",
            ExportFormat::Tar => "tar",
        }
    }
}

/// What an export needs reviewed (the [`REVIEW_HEADER`] of `GET .../workspace/export`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExportReview {
    /// The flagged changes (at most [`MAX_REVIEW_ENTRIES`]).
    pub flagged: Vec<WorkspaceChange>,
    /// How many changes are flagged in all.
    pub flagged_total: usize,
    /// Entries that could not be exported (at most [`MAX_REVIEW_ENTRIES`]).
    pub skipped: Vec<SkippedPath>,
    /// How many entries were skipped in all.
    pub skipped_total: usize,
}

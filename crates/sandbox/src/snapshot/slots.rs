//! Share slots: idle virtio-fs devices that a snapshot keeps so that its restores can attach
//! host directories (`--mount`, `--workspace`) to them.
//!
//! A guest learns its virtio devices when it boots; a restore cannot add one. A sandbox started
//! with [`SandboxConfig::share_slots`] = N > 0 therefore gets N + 1 virtio-fs devices its agent
//! does not mount: tags `mount0` to `mount{N-1}` (the tags [`crate::mounts`] gives mounts; a
//! direct workspace is one of them) and `workspace` (a clone workspace's,
//! [`WORKSPACE_TAG`]). Each serves an empty directory of the runtime directory
//! ([`IDLE_DIR`]) read-only. Nothing in the guest has them mounted (no FUSE session), so the VM
//! can be snapshotted.
//!
//! A restore of such a snapshot reads the tags it has (its `state` file: the slots survive
//! a pause and resume of a restored sandbox), attaches its mounts and workspace to them (the
//! VMM's `--share TAG=DIR` of a restore), leaves the others on an empty directory of its own, and
//! sends the agent the boot parameters that a boot with those shares would have had
//! (`RestoredRequest::share_params`); the agent mounts them before it acknowledges the restore,
//! so no command runs without them.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use bulkhead_protocol::boot::BootParams;
use bulkhead_vmm::config::ShareConfig;

use crate::jail;
use crate::mounts::{MAX_MOUNTS, TAG_PREFIX};
use crate::sandbox::{Error, SandboxConfig};
use crate::workspace::{self, WORKSPACE_TAG};

/// The empty directory idle slots serve, in the runtime directory.
pub(crate) const IDLE_DIR: &str = "idle-share";

/// The idle devices of a sandbox with `slots` share slots (none for 0), serving
/// `runtime/`[`IDLE_DIR`], which is created for them.
///
/// # Errors
/// [`Error::Snapshot`] for more than [`MAX_MOUNTS`] slots; [`Error::RuntimeDir`] when the
/// directory cannot be made.
pub(crate) fn idle_shares(runtime: &Path, slots: u8) -> Result<Vec<ShareConfig>, Error> {
    if slots == 0 {
        return Ok(Vec::new());
    }
    if usize::from(slots) > MAX_MOUNTS {
        return Err(Error::Snapshot(format!(
            "{slots} share slots: at most {MAX_MOUNTS} (one virtio-fs device each, and the VM \
             has interrupt lines for few devices)"
        )));
    }
    let dir = idle_dir(runtime)?;
    let mut shares: Vec<ShareConfig> = (0..slots)
        .map(|i| idle(format!("{TAG_PREFIX}{i}"), &dir))
        .collect();
    shares.push(idle(WORKSPACE_TAG.to_owned(), &dir));
    Ok(shares)
}

/// Makes `runtime/`[`IDLE_DIR`] and returns its resolved path.
fn idle_dir(runtime: &Path) -> Result<PathBuf, Error> {
    let dir = runtime.join(IDLE_DIR);
    fs::create_dir(&dir).map_err(|source| Error::RuntimeDir {
        path: dir.clone(),
        source,
    })?;
    Ok(jail::resolved(&dir))
}

/// An idle slot: tag `tag` serving the empty directory `dir` read-only.
fn idle(tag: String, dir: &Path) -> ShareConfig {
    ShareConfig {
        tag,
        path: dir.to_owned(),
        read_only: true,
        owner: None,
        follow_host_mounts: false,
    }
}

/// Refuses share slots together with shares of the sandbox's own: those would be mounted at
/// boot, and a mounted share cannot be snapshotted.
///
/// # Errors
/// [`Error::Snapshot`] saying so.
pub(crate) fn check_boot(config: &SandboxConfig) -> Result<(), Error> {
    if config.share_slots > 0 && (!config.mounts.is_empty() || config.workspace.is_some()) {
        return Err(Error::Snapshot(
            "share slots are for a sandbox that will be snapshotted: it cannot have mounts or a \
             workspace of its own (its restores attach them)"
                .into(),
        ));
    }
    Ok(())
}

/// The share slots a snapshot has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShareSlots {
    /// How many mounts a restore may attach (a direct workspace is one).
    pub mounts: usize,
    /// Whether it may attach a clone workspace.
    pub workspace: bool,
}

impl ShareSlots {
    /// The slots among the virtio-fs tags `saved` of a snapshot: `mount0`, `mount1`, ... up to
    /// the first missing one, and `workspace`.
    pub fn of_tags(saved: &[String]) -> ShareSlots {
        ShareSlots {
            mounts: (0..)
                .take_while(|i| saved.contains(&format!("{TAG_PREFIX}{i}")))
                .count(),
            workspace: saved.iter().any(|t| t == WORKSPACE_TAG),
        }
    }

    /// The virtio-fs tags of these slots, as [`ShareSlots::of_tags`] reads them.
    pub fn tags(self) -> Vec<String> {
        let mut tags: Vec<String> = (0..self.mounts)
            .map(|i| format!("{TAG_PREFIX}{i}"))
            .collect();
        if self.workspace {
            tags.push(WORKSPACE_TAG.to_owned());
        }
        tags
    }

    /// The share slots of the snapshot in `dir` (from its `state` file).
    ///
    /// # Errors
    /// [`Error::Snapshot`] for a missing, truncated or corrupt state file.
    pub fn of_snapshot(dir: &Path) -> Result<ShareSlots, Error> {
        let saved = bulkhead_vmm::snapshot::share_tags(dir)
            .map_err(|e| Error::Snapshot(format!("{}: {e}", dir.display())))?;
        Ok(ShareSlots::of_tags(&saved))
    }

    /// Refuses `mounts` mounts (a direct workspace counted) and a clone workspace
    /// (`clone_workspace`) that these slots cannot take.
    ///
    /// # Errors
    /// [`Error::Snapshot`] saying how many there are and how to get more.
    pub fn check(self, mounts: usize, clone_workspace: bool) -> Result<(), Error> {
        let remake = "; create the template again with more (`bulkhead template create \
                      --share-slots N`)";
        if mounts > self.mounts {
            return Err(Error::Snapshot(format!(
                "the snapshot has {} share slots and this restore asks for {mounts} mounts (a \
                 direct workspace is one){remake}",
                self.mounts
            )));
        }
        if clone_workspace && !self.workspace {
            return Err(Error::Snapshot(format!(
                "the snapshot has no share slot for a clone workspace{remake}"
            )));
        }
        Ok(())
    }
}

/// What a restore attaches to a snapshot's slots.
#[derive(Debug, Default)]
pub(crate) struct Attached {
    /// A directory for every slot of the snapshot: the restore's shares, then idle ones.
    pub shares: Vec<ShareConfig>,
    /// The agent's share parameters (`RestoredRequest::share_params`).
    pub params: Vec<String>,
}

impl Attached {
    /// The VMM's `--share TAG=DIR:ro|:rw` arguments (the mode always given, so a directory
    /// whose name ends in `:ro` cannot be misread).
    pub(crate) fn args(&self) -> Vec<OsString> {
        self.shares
            .iter()
            .flat_map(|share| {
                let mut value = OsString::from(format!("{}=", share.tag));
                value.push(&share.path);
                value.push(if share.read_only { ":ro" } else { ":rw" });
                [OsString::from("--share"), value]
            })
            .collect()
    }
}

/// Attaches `config`'s mounts and the workspace `ws` to the share slots of a snapshot whose
/// virtio-fs devices have the tags `saved` (see the module docs); every saved tag left over
/// serves `runtime/`[`IDLE_DIR`].
///
/// # Errors
/// [`Error::Snapshot`] when the snapshot has too few slots; the errors of
/// [`mounts::prepare`](crate::mounts::prepare); [`Error::RuntimeDir`]; [`Error::BootParams`].
pub(crate) fn attach(
    config: &SandboxConfig,
    ws: &workspace::Prepared,
    saved: &[String],
    runtime: &Path,
) -> Result<Attached, Error> {
    let Attached { mut shares, params } = requested(config, ws, ShareSlots::of_tags(saved))?;
    let unused: Vec<&String> = saved
        .iter()
        .filter(|tag| !shares.iter().any(|s| &s.tag == *tag))
        .collect();
    if !unused.is_empty() {
        let dir = idle_dir(runtime)?;
        shares.extend(unused.into_iter().map(|tag| idle(tag.clone(), &dir)));
    }
    Ok(Attached { shares, params })
}

/// `config`'s mounts and the workspace `ws` on the share slots `slots`: each directory with its
/// slot's tag (symbolic links resolved, as a jailed VMM sees them) and the agent's share
/// parameters; nothing for the idle slots.
///
/// # Errors
/// [`Error::Snapshot`] when `slots` are too few; the errors of
/// [`mounts::prepare`](crate::mounts::prepare); [`Error::BootParams`].
pub(crate) fn requested(
    config: &SandboxConfig,
    ws: &workspace::Prepared,
    slots: ShareSlots,
) -> Result<Attached, Error> {
    let mount_count = config.mounts.len() + usize::from(ws.mount.is_some());
    slots.check(mount_count, ws.share.is_some())?;
    let prepared = ws.shares_with(&config.mounts)?;
    let shares = prepared
        .shares
        .into_iter()
        .map(|share| ShareConfig {
            path: jail::resolved(&share.path),
            ..share
        })
        .collect();
    let params = share_params(ws, prepared.params)?;
    Ok(Attached { shares, params })
}

/// The agent's share parameters (`RestoredRequest::share_params`) for the workspace `ws` and
/// the mounts `mounts`: the boot parameters a boot with them would have had.
///
/// # Errors
/// [`Error::BootParams`].
fn share_params(
    ws: &workspace::Prepared,
    mounts: Vec<bulkhead_protocol::boot::Share>,
) -> Result<Vec<String>, Error> {
    BootParams {
        workspace: ws.param.clone(),
        mounts,
        ..BootParams::default()
    }
    .share_params()
    .map_err(|e| Error::BootParams(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mounts::Mount;

    fn tags(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    fn config_with(mounts: Vec<Mount>) -> SandboxConfig {
        SandboxConfig {
            mounts,
            ..SandboxConfig::default()
        }
    }

    #[test]
    fn idle_slots_are_one_per_mount_and_one_for_the_workspace_all_read_only() {
        // Arrange
        let runtime = tempfile::tempdir().unwrap();

        // Act
        let shares = idle_shares(runtime.path(), 2).unwrap();

        // Assert
        let tags: Vec<&str> = shares.iter().map(|s| s.tag.as_str()).collect();
        assert_eq!(tags, ["mount0", "mount1", "workspace"]);
        assert!(shares.iter().all(|s| s.read_only));
        assert!(runtime.path().join(IDLE_DIR).is_dir());
        assert!(idle_shares(runtime.path(), 0).unwrap().is_empty());
        assert!(idle_shares(runtime.path(), 9).is_err());
    }

    #[test]
    fn a_restore_fills_slots_in_order_and_leaves_the_rest_idle() {
        // Arrange
        let runtime = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let config = config_with(vec![Mount {
            host: data.path().to_owned(),
            guest: PathBuf::from("/data"),
            read_only: true,
        }]);

        let saved = tags(&["mount0", "mount1", "workspace"]);

        // Act
        let attached = attach(&config, &Default::default(), &saved, runtime.path()).unwrap();

        // Assert
        let by_tag = |tag: &str| attached.shares.iter().find(|s| s.tag == tag).unwrap();
        assert_eq!(by_tag("mount0").path, data.path().canonicalize().unwrap());
        assert!(by_tag("mount0").read_only);
        let idle_path = runtime.path().join(IDLE_DIR).canonicalize().unwrap();
        assert_eq!(by_tag("mount1").path, idle_path);
        assert_eq!(by_tag("workspace").path, idle_path);
        assert_eq!(attached.shares.len(), 3);
        assert_eq!(attached.params, ["bulkhead.mount=mount0:/data:ro"]);
        let args = attached.args();
        assert_eq!(args.len(), 6);
        assert!(args[1].to_string_lossy().ends_with(":ro"));
    }

    #[test]
    fn more_mounts_than_slots_are_refused_with_the_way_out() {
        // Arrange
        let runtime = tempfile::tempdir().unwrap();
        let data = tempfile::tempdir().unwrap();
        let mount = |guest: &str| Mount {
            host: data.path().to_owned(),
            guest: PathBuf::from(guest),
            read_only: true,
        };
        let config = config_with(vec![mount("/a"), mount("/b")]);

        // Act
        let error = attach(
            &config,
            &Default::default(),
            &tags(&["mount0"]),
            runtime.path(),
        )
        .unwrap_err();

        // Assert
        let text = error.to_string();
        assert!(text.contains("1 share slots"), "{text}");
        assert!(text.contains("--share-slots"), "{text}");
        assert!(!runtime.path().join(IDLE_DIR).exists());
    }
}

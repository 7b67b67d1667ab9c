//! Attaching mounts and a workspace to a restored sandbox that is already running: a warm-pool
//! clone handed out for a create with `--mount`/`--workspace`.
//!
//! A restore attaches them as it starts the VMM (`--share TAG=DIR`, see [`super::slots`]). A
//! clone restored earlier has every share slot on an empty directory, unmounted in the guest.
//! [`Sandbox::attach_shares`] sends each directory to the running VMM over its control socket
//! (`attach_share`, the directory's descriptor passed with SCM_RIGHTS: a jailed VMM sees only
//! its private root), records the workspace like a start would, and returns the boot
//! parameters the agent mounts them from (`RestoredRequest::share_params`, sent with the
//! clone's new identity).
//!
//! The descriptor is a detached copy of the directory's mount where this process may make one
//! (`open_tree(2)` with `OPEN_TREE_CLONE`, as root): `..` from its root goes nowhere, as in the
//! jail's bind mounts. Otherwise (no root, an old kernel) it is the directory opened `O_PATH`;
//! the VMM's file server refuses `..` and multi-component names either way.
//!
//! **Who serves them.** A jailed VMM acts as one uid/gid, chosen from its shares when it starts
//! ([`crate::jail`]); a clone's VMM started with none, so it runs as a fresh id or as the
//! configured [`SandboxConfig::jail_owner`]. [`Sandbox::can_attach`] refuses shares that would
//! need another identity (a read-write share of another owner, a read-only one of a user other
//! than the VMM's): the caller then restores a sandbox of its own instead.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use bulkhead_vmm::config::ShareConfig;
use bulkhead_vmm::control::{self, AttachShare, Request};

use super::slots::{self, Attached, ShareSlots, IDLE_DIR};
use crate::jail::{self, JailError, ShareOwner};
use crate::sandbox::{Error, Sandbox, SandboxConfig, API_SOCKET};
use crate::workspace;

/// `OPEN_TREE_CLONE` of `open_tree(2)` (`<linux/mount.h>`): a detached copy of the mount.
const OPEN_TREE_CLONE: libc::c_uint = 1;

impl Sandbox {
    /// Whether `config`'s mounts and workspace can be attached to this running sandbox,
    /// restored from a snapshot with the share slots `slots` and not yet given any: enough
    /// slots, and (jailed) a VMM that runs as the user they need. Always true without mounts
    /// and workspace.
    ///
    /// # Errors
    /// [`Error::Snapshot`] for too few share slots; [`Error::Jail`] with
    /// [`JailError::Identity`] for shares another user must serve; the errors of
    /// [`workspace::check`] and [`mounts::check`](crate::mounts::check) for unusable
    /// directories; [`Error::RuntimeDir`] for a sandbox without a runtime directory.
    pub fn can_attach(&self, config: &SandboxConfig, slots: ShareSlots) -> Result<(), Error> {
        self.plan_attach(config, slots).map(drop)
    }

    /// Attaches `config`'s mounts and workspace to this running sandbox (see the module docs)
    /// and returns the agent's share parameters for them; an empty list when there are none.
    ///
    /// # Errors
    /// Those of [`Sandbox::can_attach`]; [`Error::Attach`] when a directory cannot be opened
    /// or the VMM refuses it. The sandbox may then have some directories attached and none
    /// mounted: destroy it.
    pub fn attach_shares(
        &mut self,
        config: &SandboxConfig,
        slots: ShareSlots,
    ) -> Result<Vec<String>, Error> {
        if config.mounts.is_empty() && config.workspace.is_none() {
            return Ok(Vec::new());
        }
        let plan = self.plan_attach(config, slots)?;
        let runtime = self.runtime()?.to_owned();
        let socket = runtime.join(API_SOCKET);
        for share in &plan.given {
            send_share(&socket, share)?;
        }
        workspace::record(&runtime, &plan.ws, None)?;
        Ok(plan.params)
    }

    /// The shares `config` attaches to this sandbox's slots, checked.
    fn plan_attach(&self, config: &SandboxConfig, slots: ShareSlots) -> Result<Plan, Error> {
        let ws = workspace::prepare(config.workspace.as_ref(), &config.mounts)?;
        if config.mounts.is_empty() && config.workspace.is_none() {
            return Ok(Plan {
                given: Vec::new(),
                params: Vec::new(),
                ws,
            });
        }
        let runtime = self.runtime()?;
        let saved = slots.tags();
        let Attached { shares, params } = slots::attach(config, &ws, &saved, runtime)?;
        // The slots left idle serve the empty directory they already serve.
        let idle = jail::resolved(&runtime.join(IDLE_DIR));
        let given: Vec<ShareConfig> = shares.into_iter().filter(|s| s.path != idle).collect();
        if jail::active(config.jail) {
            check_identity(runtime, &given)?;
        }
        Ok(Plan { given, params, ws })
    }

    fn runtime(&self) -> Result<&Path, Error> {
        self.runtime_path().ok_or_else(|| Error::RuntimeDir {
            path: Default::default(),
            source: io::Error::other("the sandbox has no runtime directory"),
        })
    }
}

/// What [`Sandbox::attach_shares`] attaches.
struct Plan {
    /// The directories for the VMM, each with its slot's tag.
    given: Vec<ShareConfig>,
    /// The agent's share parameters.
    params: Vec<String>,
    /// The workspace, for its records.
    ws: workspace::Prepared,
}

/// Refuses `shares` unless the jailed VMM of the runtime directory `runtime` (it owns `vmm/`)
/// runs as the identity they need ([`jail::identity`]; any fresh id serves shares that need a
/// fresh one).
fn check_identity(runtime: &Path, shares: &[ShareConfig]) -> Result<(), Error> {
    if shares.is_empty() {
        return Ok(());
    }
    let vmm_dir = runtime.join(jail::VMM_DIR);
    let meta = std::fs::metadata(&vmm_dir).map_err(|source| Error::RuntimeDir {
        path: vmm_dir.clone(),
        source,
    })?;
    let running = (meta.uid(), meta.gid());
    let owners = shares
        .iter()
        .map(|share| {
            let owner = match share.owner {
                Some(owner) => owner,
                None => {
                    let meta = std::fs::metadata(&share.path).map_err(|source| {
                        Error::Attach(format!("{}: {source}", share.path.display()))
                    })?;
                    (meta.uid(), meta.gid())
                }
            };
            Ok(ShareOwner {
                path: share.path.clone(),
                owner,
                read_only: share.read_only,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    // The slot only picks a fresh id, and any fresh id will do.
    let needed = jail::identity(&owners, 0)?;
    if !jail::same_identity(needed, running) {
        return Err(Error::Jail(JailError::Identity { needed, running }));
    }
    Ok(())
}

/// Opens `share`'s directory and sends it to the VMM's control socket `socket` for the
/// virtio-fs device `share.tag`.
fn send_share(socket: &Path, share: &ShareConfig) -> Result<(), Error> {
    let refused =
        |e: String| Error::Attach(format!("{} ({}): {e}", share.path.display(), share.tag));
    let dir =
        open_share(&share.path, share.follow_host_mounts).map_err(|e| refused(e.to_string()))?;
    let request = Request::AttachShare(AttachShare {
        tag: share.tag.clone(),
        read_only: share.read_only,
        owner: share.owner,
    });
    let answer = control::send_with_fd(socket, &request, dir.as_fd()).map_err(refused)?;
    match answer.ok {
        true => Ok(()),
        false => Err(refused(answer.error.unwrap_or_default())),
    }
}

/// `path` as a detached copy of its mount (with the mounts below it when `recursive`), or,
/// where `open_tree(2)` is refused (no root, an old kernel), opened `O_PATH`.
fn open_share(path: &Path, recursive: bool) -> io::Result<OwnedFd> {
    let c_path = CString::new(path.as_os_str().as_bytes())?;
    let mut flags = OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    // SAFETY: open_tree reads the NUL-terminated path and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c_path.as_ptr(), flags) };
    if fd >= 0 {
        // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EPERM | libc::ENOSYS | libc::EINVAL) => open_path(path),
        _ => Err(err),
    }
}

/// `path` opened `O_PATH | O_DIRECTORY`.
fn open_path(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir: File = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(path)?;
    Ok(dir.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_opens_as_a_descriptor_of_its_directory_with_or_without_root() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"x").unwrap();

        // Act
        let fd = open_share(dir.path(), false).unwrap();

        // Assert: the same directory (open_tree's copy keeps the inode).
        let got = File::from(fd).metadata().unwrap();
        let want = std::fs::metadata(dir.path()).unwrap();
        assert!(got.is_dir());
        assert_eq!(got.ino(), want.ino());
    }

    #[test]
    fn a_missing_share_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();

        let err = open_share(&dir.path().join("gone"), false).unwrap_err();

        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }
}

//! Jailing each sandbox's VMM (`bulkhead-vmm --jail-uid U --jail-gid G --jail-root DIR`, see
//! `bulkhead_vmm::jail`), which needs root: when this process's effective uid is 0 and
//! [`SandboxConfig::jail`](crate::SandboxConfig::jail) is on (the default), every VMM it starts —
//! `bulkhead run` as root, the daemon — runs in its own namespaces under a private root, as an
//! unprivileged uid/gid without capabilities. Without root nothing of this applies (see
//! `docs/security.md`, "What runs without root").
//!
//! **Which uid/gid** ([`identity`]): the virtio-fs server acts with the VMM's own identity once
//! it is not root, so a VM with shares must run as their owner:
//!
//! 1. with read-write shares (`--mount` without `:ro`, a direct workspace): their owner (the
//!    configured owner, else the directory's). They must all have the same one
//!    ([`JailError::MixedOwners`]); root cannot own one ([`JailError::RootOwned`]);
//! 2. else, with read-only shares: the owner of the first one not owned by root (the others are
//!    read with that user's rights);
//! 3. else — no shares, or only root-owned read-only ones, which are then read with the rights of
//!    "others" — [`SandboxConfig::jail_owner`](crate::SandboxConfig::jail_owner) when it is set
//!    (a warm pool's clones: see [`Sandbox::attach_shares`](crate::Sandbox::attach_shares)),
//!    else a fresh id from [`ID_BASE`]`..`[`ID_BASE`]` + `[`ID_COUNT`], picked from the
//!    runtime directory's inode number, so sandboxes that exist at the same time under one
//!    runtime parent get different ids (sandboxes under different parents may share one: their
//!    namespaces and private roots still keep them apart).
//!
//! A gid of 0 (a share of group root) is replaced by the fresh gid.
//!
//! **What the VMM may reach** in the runtime directory: the directory becomes `root:G`, mode
//! `0710` (the VMM may pass through it, not list or change it); the readiness listener
//! `vm.sock_1025` is chowned to U so the VMM can connect to it; `vmm/` (owned by U) receives the
//! timings report; `jail/` is the empty mount point of the VMM's root, which only the VMM's own
//! mount namespace sees mounted. Everything goes with the runtime directory when the sandbox is
//! destroyed; no mount outlives the VMM (they live in its mount namespace).
//!
//! Guest connections to host port P reach `<vm.sock>_P` as U: a listener of your own there must
//! let U connect — bind it with [`Sandbox::listen_on_host_port`](crate::Sandbox::listen_on_host_port),
//! or `chown` it to the VMM's uid (the owner of the runtime directory's `vmm/`), or make it mode
//! 0666.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use bulkhead_vmm::config::VmConfig;

/// First uid/gid of the range fresh jail ids come from: 1,900,000,000, above the ranges of
/// regular users (1000..60000), systemd's dynamic users (61184..65519), the usual subordinate
/// ids of user namespaces (100000 + 65536·N) and systemd-nspawn's container range (524288 up to
/// 1878982656), below 2^31.
pub const ID_BASE: u32 = 1_900_000_000;
/// Number of fresh ids: 2^24 (16,777,216), so the last is 1,916,777,215.
pub const ID_COUNT: u32 = 1 << 24;

/// Sub-directory of the runtime directory the jail's root is mounted on.
pub const ROOT_DIR: &str = "jail";
/// Sub-directory of the runtime directory the jailed VMM may write (its timings report).
pub const VMM_DIR: &str = "vmm";

/// Why a VMM cannot be jailed.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// Two read-write shares belong to different users: one VMM can act as only one of them.
    #[error(
        "read-write shares {} ({}:{}) and {} ({}:{}) belong to different users; a jailed VMM \
         acts as one user: share directories of one owner, or add :ro to one of them",
        first.0.display(), first.1.0, first.1.1, second.0.display(), second.1.0, second.1.1
    )]
    MixedOwners {
        /// A share and its owner.
        first: (PathBuf, (u32, u32)),
        /// Another share with another owner.
        second: (PathBuf, (u32, u32)),
    },
    /// A read-write share is owned by root: the VMM would need root to serve it.
    #[error("the read-write share {} is owned by root; chown it to an unprivileged user or add :ro", .0.display())]
    RootOwned(PathBuf),
    /// A running VMM cannot serve shares that need another user (see [`identity`]).
    #[error(
        "the shares must be served as {}:{}, but the running VMM acts as {}:{}",
        needed.0, needed.1, running.0, running.1
    )]
    Identity {
        /// The uid/gid the shares need.
        needed: (u32, u32),
        /// The uid/gid the VMM runs as.
        running: (u32, u32),
    },
    /// The configured owner of a jailed VMM is root.
    #[error("a jailed VMM cannot run as uid or gid 0 (jail_owner {}:{})", .0.0, .0.1)]
    RootJailOwner((u32, u32)),
    /// The runtime directory could not be prepared for the jail.
    #[error("cannot prepare the jail: {what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// A share of the VM and the user it is served as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareOwner {
    /// The shared host directory.
    pub path: PathBuf,
    /// Its owner `(uid, gid)`: the configured one, else the directory's.
    pub owner: (u32, u32),
    /// Shared read-only.
    pub read_only: bool,
}

/// The fresh id of slot `slot` (any number; it is reduced modulo [`ID_COUNT`]).
pub fn fresh_id(slot: u64) -> u32 {
    ID_BASE + (slot % u64::from(ID_COUNT)) as u32
}

/// The uid/gid a VM's VMM runs as, given its shares and a slot for a fresh id (see the module
/// docs for the rule).
///
/// # Errors
/// [`JailError::MixedOwners`], [`JailError::RootOwned`].
pub fn identity(shares: &[ShareOwner], slot: u64) -> Result<(u32, u32), JailError> {
    let fresh = fresh_id(slot);
    let mut writable = shares.iter().filter(|s| !s.read_only);
    let chosen = match writable.next() {
        Some(first) => {
            if first.owner.0 == 0 {
                return Err(JailError::RootOwned(first.path.clone()));
            }
            if let Some(other) = writable.find(|s| s.owner != first.owner) {
                return Err(JailError::MixedOwners {
                    first: (first.path.clone(), first.owner),
                    second: (other.path.clone(), other.owner),
                });
            }
            first.owner
        }
        None => shares
            .iter()
            .map(|s| s.owner)
            .find(|owner| owner.0 != 0)
            .unwrap_or((fresh, fresh)),
    };
    Ok((chosen.0, if chosen.1 == 0 { fresh } else { chosen.1 }))
}

/// Whether an id was picked from the fresh range ([`fresh_id`]).
pub fn is_fresh(id: u32) -> bool {
    (ID_BASE..ID_BASE.saturating_add(ID_COUNT)).contains(&id)
}

/// Whether a VMM running as `running` serves shares that need `needed` as a VMM started with
/// them would: the same ids, where any fresh id stands for any other (a fresh id has no files
/// of its own).
pub fn same_identity(needed: (u32, u32), running: (u32, u32)) -> bool {
    let same = |a: u32, b: u32| a == b || (is_fresh(a) && is_fresh(b));
    same(needed.0, running.0) && same(needed.1, running.1)
}

/// Environment variable that turns the jail's default off when it is `off` (for debugging).
pub const JAIL_ENV: &str = "BULKHEAD_JAIL";

/// The default of [`SandboxConfig::jail`](crate::SandboxConfig::jail): on unless [`JAIL_ENV`]
/// is `off`.
pub fn wanted_by_default() -> bool {
    std::env::var_os(JAIL_ENV).is_none_or(|v| v != "off")
}

/// Whether this process jails the VMMs it starts: asked for and running as root.
pub fn active(requested: bool) -> bool {
    // SAFETY: geteuid only reads the calling thread's credentials.
    requested && unsafe { libc::geteuid() } == 0
}

/// A sandbox's jail, prepared in its runtime directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Jail {
    uid: u32,
    gid: u32,
    root: PathBuf,
}

impl Jail {
    /// Chooses the VMM's uid/gid for `vm` and prepares the runtime directory `dir` (see the
    /// module docs); `listener` is the readiness listener the VMM must be able to connect to
    /// (none for a restore: the restored agent announced itself at its boot).
    pub(crate) fn prepare(
        dir: &Path,
        vm: &VmConfig,
        listener: Option<&Path>,
        owner: Option<(u32, u32)>,
    ) -> Result<Jail, JailError> {
        let slot = fs::metadata(dir).map_err(io_err("stat", dir))?.ino();
        let owners = vm
            .shares
            .iter()
            .map(|share| {
                let owner = match share.owner {
                    Some(owner) => owner,
                    None => {
                        let meta =
                            fs::metadata(&share.path).map_err(io_err("stat", &share.path))?;
                        (meta.uid(), meta.gid())
                    }
                };
                Ok(ShareOwner {
                    path: share.path.clone(),
                    owner,
                    read_only: share.read_only,
                })
            })
            .collect::<Result<Vec<_>, JailError>>()?;
        let (uid, gid) = match (identity(&owners, slot)?, owner) {
            (_, Some(owner)) if owner.0 == 0 || owner.1 == 0 => {
                return Err(JailError::RootJailOwner(owner))
            }
            ((uid, _), Some(owner)) if is_fresh(uid) => owner,
            (chosen, _) => chosen,
        };
        let root = dir.join(ROOT_DIR);
        fs::create_dir(&root).map_err(io_err("mkdir", &root))?;
        chown(&dir.join(VMM_DIR), Some(uid), Some(gid))?;
        if let Some(listener) = listener {
            chown(listener, Some(uid), Some(gid))?;
        }
        chown(dir, None, Some(gid))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o710))
            .map_err(io_err("chmod", dir))?;
        Ok(Jail { uid, gid, root })
    }

    /// The VMM's command-line arguments.
    pub(crate) fn args(&self) -> Vec<OsString> {
        vec![
            "--jail-uid".into(),
            self.uid.to_string().into(),
            "--jail-gid".into(),
            self.gid.to_string().into(),
            "--jail-root".into(),
            self.root.clone().into(),
        ]
    }
}

/// `path` with symbolic links resolved (a jailed VMM sees each file at its resolved path); the
/// directory only for a file that does not exist yet; `path` itself when neither resolves (the
/// VMM then reports it).
pub(crate) fn resolved(path: &Path) -> PathBuf {
    if let Ok(real) = fs::canonicalize(path) {
        return real;
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) if !dir.as_os_str().is_empty() => fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or_else(|_| path.to_owned()),
        _ => path.to_owned(),
    }
}

impl crate::Sandbox {
    /// Binds the listener for guest connections to host port `port` (`<vsock_path>_PORT`, see
    /// [`crate::Sandbox::vsock_path`]) so that the VMM may connect to it: a jailed VMM connects
    /// as its own uid, so as root the socket is handed to that uid/gid.
    ///
    /// # Errors
    /// [`crate::Error::RuntimeDir`] when the socket cannot be bound or handed over.
    pub fn listen_on_host_port(&self, port: u32) -> Result<UnixListener, crate::Error> {
        let path = PathBuf::from(format!("{}_{port}", self.vsock_path().display()));
        let err = |source| crate::Error::RuntimeDir {
            path: path.clone(),
            source,
        };
        let listener = UnixListener::bind(&path).map_err(err)?;
        if let Some(dir) = self.runtime_path() {
            hand_to_vmm(dir, &path).map_err(err)?;
        }
        Ok(listener)
    }

    /// Process ID (in this process's PID namespace) of the process that runs the VM — its vCPU
    /// threads and guest memory: when the VMM is jailed, the only child of
    /// [`vmm_pid`](crate::Sandbox::vmm_pid) (its supervisor); otherwise the VMM itself. Use it
    /// to measure the VM's memory or threads; signal [`vmm_pid`](crate::Sandbox::vmm_pid).
    /// `None` once the VMM was reaped.
    pub fn vm_pid(&self) -> Option<u32> {
        let pid = self.vmm_pid()?;
        Some(only_child(pid).unwrap_or(pid))
    }
}

/// The only child process of `pid` (from `/proc/PID/task/PID/children`); `None` when it has
/// none, several, or the list cannot be read.
fn only_child(pid: u32) -> Option<u32> {
    let list = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    let mut children = list.split_whitespace().filter_map(|c| c.parse().ok());
    match (children.next(), children.next()) {
        (Some(child), None) => Some(child),
        _ => None,
    }
}

/// As root, gives `path` to the owner of the runtime directory `dir`'s `vmm/`: the jailed VMM's
/// uid/gid (root itself when the VMM is not jailed, which changes nothing).
pub(crate) fn hand_to_vmm(dir: &Path, path: &Path) -> io::Result<()> {
    if !active(true) {
        return Ok(());
    }
    let vmm = fs::metadata(dir.join(VMM_DIR))?;
    std::os::unix::fs::chown(path, Some(vmm.uid()), Some(vmm.gid()))
}

/// Creates `dir/vmm/`, where every VMM (jailed or not) writes its timings report.
pub(crate) fn make_vmm_dir(dir: &Path) -> Result<(), crate::Error> {
    let path = dir.join(VMM_DIR);
    fs::create_dir(&path).map_err(|source| crate::Error::RuntimeDir { path, source })
}

fn chown(path: &Path, uid: Option<u32>, gid: Option<u32>) -> Result<(), JailError> {
    std::os::unix::fs::chown(path, uid, gid).map_err(io_err("chown", path))
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> JailError + 'a {
    move |source| JailError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(path: &str, owner: (u32, u32), read_only: bool) -> ShareOwner {
        ShareOwner {
            path: path.into(),
            owner,
            read_only,
        }
    }

    #[test]
    fn a_vm_without_shares_gets_a_fresh_id_from_the_range() {
        // Act
        let (uid, gid) = identity(&[], 7).unwrap();

        // Assert
        assert_eq!((uid, gid), (ID_BASE + 7, ID_BASE + 7));
    }

    #[test]
    fn fresh_ids_stay_inside_the_range() {
        assert_eq!(fresh_id(u64::from(ID_COUNT)), ID_BASE);
        assert_eq!(fresh_id(u64::MAX), ID_BASE + (ID_COUNT - 1));
        assert!(ID_BASE
            .checked_add(ID_COUNT - 1)
            .is_some_and(|last| last < 1 << 31));
    }

    #[test]
    fn read_write_shares_make_the_vmm_their_owner() {
        // Arrange
        let shares = [
            share("/srv/ro", (0, 0), true),
            share("/home/me/a", (1000, 1000), false),
            share("/home/me/b", (1000, 1000), false),
        ];

        // Act / Assert
        assert_eq!(identity(&shares, 7).unwrap(), (1000, 1000));
    }

    #[test]
    fn read_write_shares_of_two_users_are_refused_naming_both() {
        // Arrange
        let shares = [
            share("/home/a", (1000, 1000), false),
            share("/home/b", (1001, 1001), false),
        ];

        // Act
        let err = identity(&shares, 7).unwrap_err();

        // Assert
        let text = err.to_string();
        assert!(
            text.contains("/home/a (1000:1000)") && text.contains("/home/b (1001:1001)"),
            "{text}"
        );
    }

    #[test]
    fn a_root_owned_read_write_share_is_refused() {
        // Arrange
        let shares = [share("/srv/data", (0, 0), false)];

        // Act / Assert
        assert!(matches!(identity(&shares, 7), Err(JailError::RootOwned(_))));
    }

    #[test]
    fn read_only_shares_make_the_vmm_the_first_unprivileged_owner() {
        // Arrange
        let shares = [
            share("/srv/ro", (0, 0), true),
            share("/home/me/p", (1000, 1000), true),
            share("/home/you/q", (1001, 1001), true),
        ];

        // Act / Assert
        assert_eq!(identity(&shares, 7).unwrap(), (1000, 1000));
    }

    #[test]
    fn root_owned_read_only_shares_alone_leave_a_fresh_id() {
        // Arrange
        let shares = [share("/srv/ro", (0, 0), true)];

        // Act / Assert
        assert_eq!(identity(&shares, 7).unwrap(), (ID_BASE + 7, ID_BASE + 7));
    }

    #[test]
    fn a_share_of_group_root_gets_the_fresh_gid() {
        // Arrange
        let shares = [share("/home/me/p", (1000, 0), false)];

        // Act / Assert
        assert_eq!(identity(&shares, 7).unwrap(), (1000, ID_BASE + 7));
    }

    #[test]
    fn a_running_vmm_serves_shares_of_its_own_ids_and_any_fresh_id_stands_for_another() {
        assert!(same_identity((1000, 1000), (1000, 1000)));
        assert!(same_identity(
            (ID_BASE, ID_BASE),
            (ID_BASE + 9, ID_BASE + 9)
        ));
        assert!(same_identity((1000, ID_BASE), (1000, ID_BASE + 3)));
        assert!(!same_identity((1000, 1000), (ID_BASE, ID_BASE)));
        assert!(!same_identity((ID_BASE, ID_BASE), (1000, 1000)));
        assert!(!same_identity((1000, 1000), (1001, 1000)));
    }

    #[test]
    fn a_configured_owner_replaces_only_a_fresh_id_and_never_as_root_needs_root() {
        // Arrange: chown needs root.
        crate::testing::require_root();
        let vm: VmConfig = serde_json::from_str(r#"{"kernel": "/k"}"#).unwrap();
        let prepared = |owner| {
            let dir = tempfile::tempdir().unwrap();
            fs::create_dir(dir.path().join(VMM_DIR)).unwrap();
            Jail::prepare(dir.path(), &vm, None, owner).map(|j| (j.uid, j.gid))
        };

        // Act / Assert
        assert_eq!(prepared(Some((1234, 1235))).unwrap(), (1234, 1235));
        assert!(is_fresh(prepared(None).unwrap().0));
        assert!(matches!(
            prepared(Some((0, 5))),
            Err(JailError::RootJailOwner((0, 5)))
        ));
    }

    #[test]
    fn a_host_port_listener_is_handed_to_the_owner_of_vmm_dir_needs_root() {
        // Arrange: chown needs root.
        crate::testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join(VMM_DIR)).unwrap();
        std::os::unix::fs::chown(dir.path().join(VMM_DIR), Some(ID_BASE), Some(ID_BASE + 1))
            .unwrap();
        let path = dir.path().join("vm.sock_5000");
        let _listener = UnixListener::bind(&path).unwrap();

        // Act
        hand_to_vmm(dir.path(), &path).unwrap();

        // Assert
        let meta = fs::metadata(&path).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (ID_BASE, ID_BASE + 1));
    }

    #[test]
    fn prepare_chowns_only_what_the_vmm_needs_and_locks_the_directory_needs_root() {
        // Arrange: chown needs root.
        crate::testing::require_root();
        let dir = tempfile::tempdir().unwrap();
        let listener = dir.path().join("vm.sock_1025");
        fs::write(&listener, b"").unwrap();
        fs::create_dir(dir.path().join(VMM_DIR)).unwrap();
        let vm: VmConfig = serde_json::from_str(r#"{"kernel": "/k"}"#).unwrap();

        // Act
        let jail = Jail::prepare(dir.path(), &vm, Some(&listener), None).unwrap();

        // Assert
        let ino = fs::metadata(dir.path()).unwrap().ino();
        let id = fresh_id(ino);
        let meta = |p: &Path| {
            let m = fs::metadata(p).unwrap();
            (m.uid(), m.gid(), m.mode() & 0o7777)
        };
        assert_eq!(meta(dir.path()), (0, id, 0o710));
        assert_eq!(meta(&listener).0, id);
        assert_eq!(meta(&dir.path().join(VMM_DIR)).0, id);
        assert_eq!(meta(&dir.path().join(ROOT_DIR)).0, 0);
        let args: Vec<String> = jail
            .args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args[..4],
            ["--jail-uid", &id.to_string(), "--jail-gid", &id.to_string()]
        );
    }
}

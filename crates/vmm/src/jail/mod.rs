//! The VMM's jail: the second wall around a guest, after the VM itself.
//!
//! `bulkhead-vmm --jail-uid U --jail-gid G --jail-root DIR` (root only) confines itself before it
//! builds the VM, in the spirit of Firecracker's `jailer`:
//!
//! 1. **Namespaces**: new mount, PID, IPC, UTS and network namespaces (`unshare(2)`). The network
//!    namespace holds only a loopback device that is down: nothing is reachable.
//! 2. **Supervisor** ([`supervisor`]): the process forks. The parent — the pid its spawner knows —
//!    only waits for the child, forwards SIGTERM, SIGINT and SIGHUP to it, and exits with the
//!    child's exit code (or dies of the child's fatal signal), so exit statuses mean what they
//!    meant without the jail. The child is PID 1 of the new PID namespace: it sees no other
//!    process and no other process of the host can be named from it. It keeps SIGTERM, SIGINT
//!    and SIGHUP blocked until the VMM has its handlers ([`unblock_stop_signals`]): PID 1 would
//!    otherwise ignore them, and a stop request that arrives during the build is not lost.
//! 3. **A private root** ([`root`]): every mount is made private, a small tmpfs at `DIR` becomes
//!    the root (`pivot_root(2)`, or a move-mount plus `chroot` where the host's root is the
//!    initramfs, which `pivot_root` refuses), holding only what the [`MountPlan`] names, each
//!    bind-mounted at its own absolute path (so the configuration needs no rewriting) with
//!    `nosuid`, `nodev` and `noexec`, read-only unless the VM writes it; the device nodes
//!    `/dev/kvm`, `/dev/null`, `/dev/zero` and `/dev/urandom` on their own tmpfs; a `/proc` of the
//!    new PID namespace (the virtio-fs server reopens files through `/proc/self/fd`). The tmpfs
//!    roots are then made read-only. The host name is `bulkhead`.
//! 4. **Limits**: `RLIMIT_CORE` 0 (the open-files limit is raised before, see [`crate::limits`]).
//! 5. **Credentials** ([`creds`]), in two steps around the build. Before it: the capability
//!    bounding and ambient sets are emptied, `no_new_privs` and non-dumpable are set, the
//!    supplementary groups are dropped and all gids become G, and the *effective* uid becomes U
//!    with only `CAP_DAC_OVERRIDE` and `CAP_DAC_READ_SEARCH` effective: the VM's files are opened
//!    whatever their modes, the vsock socket is created as U, and the virtio-fs server takes U as
//!    its identity (it switches thread credentials only when it runs as root). After the build
//!    ([`Confined::drop_privileges`]) the real and saved uids become U too, which empties the
//!    permitted and effective sets; the result is checked with `capget(2)`.
//!
//! What stays reachable at run time: the already open descriptors (KVM, disks, shares, the vsock
//! listener), the bound paths as far as U's permissions allow, and connections to the
//! `<socket>_PORT` listeners next to the vsock socket — those U may connect to (see
//! `docs/security.md`).

mod creds;
mod plan;
mod root;
mod supervisor;

use std::io;
use std::path::{Path, PathBuf};

pub use plan::{Bind, Kind, MountPlan};
pub use supervisor::unblock_stop_signals;

/// Host name inside the jail's UTS namespace.
pub const HOSTNAME: &str = "bulkhead";

/// Errors from setting up the jail.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A path of the VM is relative or has `.`/`..` components.
    #[error("jail: {} is not an absolute path without . or .. components", .0.display())]
    RelativePath(PathBuf),
    /// A path of the VM resolves elsewhere (a symbolic link on the way): the jail would mount it
    /// where the VMM does not look.
    #[error("jail: {} resolves to {}; give the resolved path", path.display(), canonical.display())]
    NotCanonical {
        /// The configured path.
        path: PathBuf,
        /// Where it resolves to.
        canonical: PathBuf,
    },
    /// The host's root directory itself would have to be bind-mounted.
    #[error("jail: {} would expose the host's root directory", .0.display())]
    RootDirectory(PathBuf),
    /// One path is both a file (kernel, disk) and a directory (share) of the VM.
    #[error("jail: {} is used both as a file and as a directory", .0.display())]
    FileAndDir(PathBuf),
    /// A file the VM needs does not exist.
    #[error("jail: {} does not exist", .0.display())]
    Missing(PathBuf),
    /// The jail's uid or gid is 0.
    #[error("jail: the uid and gid must not be 0 (got {uid}:{gid})")]
    Privileged {
        /// The uid given.
        uid: u32,
        /// The gid given.
        gid: u32,
    },
    /// The KVM device is not a character device directly in `/dev`.
    #[error("jail: the KVM device {} is not a character device in /dev", .0.display())]
    KvmDevice(PathBuf),
    /// A capability or a uid/gid other than the jail's survived the privilege drop.
    #[error("jail: privileges remain after the drop: {0}")]
    PrivilegesRemain(String),
    /// A system call failed.
    #[error("jail: {what}: {source}")]
    Sys {
        /// What was being done, with its path.
        what: String,
        /// The OS error.
        source: io::Error,
    },
}

impl Error {
    /// A [`Error::Sys`] from the last OS error.
    fn last(what: impl Into<String>) -> Error {
        Error::Sys {
            what: what.into(),
            source: io::Error::last_os_error(),
        }
    }
}

/// `Ok` for a non-negative return value, else the last OS error described by `what`.
fn check(rc: libc::c_long, what: impl FnOnce() -> String) -> Result<(), Error> {
    if rc < 0 {
        return Err(Error::last(what()));
    }
    Ok(())
}

/// Who the jailed VMM runs as and where its root is built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JailConfig {
    /// The unprivileged uid the VMM runs as (not 0).
    pub uid: u32,
    /// The unprivileged gid the VMM runs as (not 0); its only group.
    pub gid: u32,
    /// An existing, empty directory the jail's tmpfs root is mounted on (in the VMM's own mount
    /// namespace only: the host sees it stay empty).
    pub root: PathBuf,
}

/// A process inside the jail, still allowed to open the VM's files; see
/// [`Confined::drop_privileges`].
#[derive(Debug)]
#[must_use = "the VMM keeps CAP_DAC_OVERRIDE until drop_privileges is called"]
pub struct Confined {
    uid: u32,
    gid: u32,
    supervisor: supervisor::Supervisor,
}

/// Enters the jail: namespaces, the supervisor fork, the private root, limits and the first
/// credential step (see the module docs). Returns only in the jailed child; the supervisor
/// exits from inside this call when the child ends. Must be called while the process has a
/// single thread.
///
/// # Errors
/// Any [`Error`]: before the fork, the process is unchanged but for its namespaces; after it,
/// the child should exit (the supervisor then exits with the same status).
pub fn enter(config: &JailConfig, plan: &MountPlan, kvm_device: &Path) -> Result<Confined, Error> {
    if config.uid == 0 || config.gid == 0 {
        return Err(Error::Privileged {
            uid: config.uid,
            gid: config.gid,
        });
    }
    root::check_sources(plan)?;
    let kvm = root::DeviceNode::of(kvm_device)?;
    creds::no_core_dumps()?;
    let namespaces = libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWNET;
    // SAFETY: unshare only changes the calling process's namespace membership.
    let rc = unsafe { libc::unshare(namespaces) };
    check(rc.into(), || "unshare(mount, pid, ipc, uts, net)".into())?;
    let supervisor = supervisor::fork_and_supervise()?;
    root::build(plan, &config.root, &kvm, (config.uid, config.gid))?;
    set_hostname()?;
    creds::enter(config.uid, config.gid)?;
    supervisor.die_with_it()?;
    Ok(Confined {
        uid: config.uid,
        gid: config.gid,
        supervisor,
    })
}

impl Confined {
    /// The second credential step, once the VM is built: real, effective and saved uids become
    /// the jail's, which clears every capability; then checks that none is left.
    ///
    /// # Errors
    /// [`Error::Sys`] when a call fails, [`Error::PrivilegesRemain`] when the check fails.
    pub fn drop_privileges(self) -> Result<(), Error> {
        creds::finish(self.uid, self.gid)?;
        self.supervisor.die_with_it()
    }
}

fn set_hostname() -> Result<(), Error> {
    // SAFETY: sethostname reads `len` bytes from the valid buffer of a &'static str.
    let rc = unsafe { libc::sethostname(HOSTNAME.as_ptr().cast(), HOSTNAME.len()) };
    check(rc.into(), || "sethostname".into())
}

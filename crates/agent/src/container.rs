//! Container execs ([`ContainerExec`]): the command runs in a container's root with its own
//! mount and PID namespaces, or enters those of the container's first process.
//!
//! Everything that can fail for a reason the host should hear about is checked here, in the
//! agent, before the fork ([`prepare`]): the root, the working directory inside it, the user
//! (from the container's own `/etc/passwd`), the limits. What runs between fork and exec
//! ([`Prepared::enter`]) is only system calls on values made beforehand, as `pre_exec` requires.
//!
//! A new container's namespaces, step by step:
//! 1. the connecting thread calls `unshare(CLONE_NEWPID)` ([`Prepared::enter_pid_namespace`]):
//!    its next child, the command, is PID 1 of a new PID namespace (this thread makes no other);
//! 2. in the child: `unshare(CLONE_NEWNS)`, every mount made private (nothing propagates back to
//!    the guest), then the root the container gets: by default an overlay with the given root
//!    below and a tmpfs (mounted over `/tmp` in this namespace only) above, so the container
//!    writes anywhere and the given root never changes; with `read_only_root` the root
//!    bind-mounted read-only. On it: `proc` mounted on `proc`, the guest's `/dev` bound on
//!    `dev` and `sysfs` mounted read-only on `sys` (each where the root has that directory);
//! 3. the root moved onto `/` and `chroot(".")` (`switch_root`'s way: the guest's root may be
//!    the initramfs, where `pivot_root(2)` is refused), then `chdir(cwd)`;
//! 4. limits (`setrlimit`), groups, gid, uid, and `PR_SET_NO_NEW_PRIVS` when asked.
//!
//! Joining ([`ContainerExec::join_pid`]): the thread enters the process's PID namespace
//! (`setns`), the child its mount namespace, which puts it at the container's root; steps 3's
//! `chdir` and 4 follow.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use bulkhead_protocol::container::{MAX_CONTAINER_GROUPS, MAX_CONTAINER_RLIMITS};
use bulkhead_protocol::{ByteString, ContainerExec, Rlimit};

use crate::user::{self, UserError};

/// Why a container exec is refused before any process exists.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// `root` is not an absolute path to an existing directory.
    #[error("container root {0:?} is not an absolute path to a directory")]
    Root(ByteString),
    /// `cwd` is not an existing directory inside the container.
    #[error("cwd {0:?} is not a directory in the container")]
    Cwd(ByteString),
    /// A path holds a NUL byte.
    #[error("{0:?} holds a NUL byte")]
    Nul(ByteString),
    /// Too many supplementary groups.
    #[error("{0} supplementary groups: at most {MAX_CONTAINER_GROUPS}")]
    Groups(usize),
    /// Too many resource limits.
    #[error("{0} resource limits: at most {MAX_CONTAINER_RLIMITS}")]
    Rlimits(usize),
    /// An `RLIMIT_*` name Linux does not have.
    #[error("unknown resource limit {0:?}")]
    UnknownRlimit(String),
    /// A soft limit above its hard limit.
    #[error("{kind}: soft limit {soft} is above the hard limit {hard}")]
    SoftAboveHard {
        /// The resource.
        kind: String,
        /// The soft limit.
        soft: u64,
        /// The hard limit.
        hard: u64,
    },
    /// The process to join does not exist or its namespaces cannot be opened.
    #[error("cannot join the namespaces of process {pid}: {source}")]
    Join {
        /// The process.
        pid: u32,
        /// What failed.
        source: io::Error,
    },
    /// The user could not be resolved in the container's `/etc/passwd`.
    #[error(transparent)]
    User(#[from] UserError),
}

/// A container exec checked and turned into what the child needs.
#[derive(Debug)]
pub struct Prepared {
    namespaces: Namespaces,
    cwd: CString,
    ids: Option<user::Ids>,
    groups: Vec<libc::gid_t>,
    rlimits: Vec<(i32, libc::rlimit)>,
    no_new_privileges: bool,
    home: Option<Vec<u8>>,
}

/// New namespaces over a root, or those of a running process.
#[derive(Debug)]
enum Namespaces {
    New(NewRoot),
    Join { pid: OwnedFd, mnt: OwnedFd },
}

/// The paths a new container's mounts use, as C strings.
#[derive(Debug)]
struct NewRoot {
    /// The container's root as given.
    root: CString,
    /// A writable root: `root` under an overlay whose upper layer is a tmpfs.
    overlay: bool,
    /// `proc`, `dev` and `sys` under the root the container gets (the overlay's, when writable).
    proc_dir: Option<CString>,
    dev_dir: Option<CString>,
    sys_dir: Option<CString>,
}

/// Where a writable root's overlay is mounted, in the container's own mount namespace: on a
/// tmpfs mounted over `/tmp` there (holding the upper and work layers), which nobody outside
/// sees and which goes with the namespace.
const OVERLAY_ROOT: &CStr = c"/tmp/root";

/// The overlay's options. The lower layer is the working directory, the container's root, made
/// so before the tmpfs hides `/tmp` (the root may be below it); overlayfs resolves a relative
/// layer path from the mounting process's working directory. No redirects, metacopy or index:
/// the lower layer may be a virtio-fs share.
const OVERLAY_OPTIONS: &CStr =
    c"lowerdir=.,upperdir=/tmp/upper,workdir=/tmp/work,redirect_dir=off,metacopy=off,index=off";

/// Checks `spec` with the request's `cwd` and `user` and prepares the child's work.
///
/// # Errors
/// [`ContainerError`].
pub fn prepare(
    spec: &ContainerExec,
    cwd: Option<&ByteString>,
    user_spec: Option<&str>,
) -> Result<Prepared, ContainerError> {
    if spec.groups.len() > MAX_CONTAINER_GROUPS {
        return Err(ContainerError::Groups(spec.groups.len()));
    }
    if spec.rlimits.len() > MAX_CONTAINER_RLIMITS {
        return Err(ContainerError::Rlimits(spec.rlimits.len()));
    }
    let rlimits = spec
        .rlimits
        .iter()
        .map(rlimit)
        .collect::<Result<Vec<_>, _>>()?;
    let root = Path::new(spec.root.as_os_str());
    if !root.is_absolute() || !root.is_dir() {
        return Err(ContainerError::Root(spec.root.clone()));
    }
    let (namespaces, view) = match spec.join_pid {
        None => (
            Namespaces::New(new_root(root, &spec.root, spec.read_only_root)?),
            root.to_owned(),
        ),
        Some(pid) => (join(pid)?, PathBuf::from(format!("/proc/{pid}/root"))),
    };
    let cwd_bytes = cwd.map_or(&b"/"[..], |c| c.as_bytes());
    let inside = view.join(
        OsStr::from_bytes(cwd_bytes)
            .to_string_lossy()
            .trim_start_matches('/'),
    );
    if !cwd_bytes.starts_with(b"/") || !inside.is_dir() {
        return Err(ContainerError::Cwd(ByteString::from(cwd_bytes.to_vec())));
    }
    let passwd = std::fs::read_to_string(view.join("etc/passwd")).unwrap_or_default();
    let ids = user_spec.map(|s| user::resolve(s, &passwd)).transpose()?;
    Ok(Prepared {
        namespaces,
        cwd: c_string(cwd_bytes)?,
        ids,
        groups: spec.groups.clone(),
        rlimits,
        no_new_privileges: spec.no_new_privileges,
        home: ids.map(|i| user::home_of(i.uid, &passwd).as_bytes().to_vec()),
    })
}

fn new_root(root: &Path, shown: &ByteString, read_only: bool) -> Result<NewRoot, ContainerError> {
    let base = match read_only {
        true => root.to_owned(),
        false => PathBuf::from(OVERLAY_ROOT.to_str().unwrap_or("/tmp/root")),
    };
    let dir = |name: &str| match root.join(name).is_dir() {
        true => c_string(base.join(name).as_os_str().as_bytes()).map(Some),
        false => Ok(None),
    };
    Ok(NewRoot {
        root: c_string(shown.as_bytes())?,
        overlay: !read_only,
        proc_dir: dir("proc")?,
        dev_dir: dir("dev")?,
        sys_dir: dir("sys")?,
    })
}

fn join(pid: u32) -> Result<Namespaces, ContainerError> {
    let open = |ns: &str| {
        File::open(format!("/proc/{pid}/ns/{ns}"))
            .map(OwnedFd::from)
            .map_err(|source| ContainerError::Join { pid, source })
    };
    Ok(Namespaces::Join {
        pid: open("pid")?,
        mnt: open("mnt")?,
    })
}

fn c_string(bytes: &[u8]) -> Result<CString, ContainerError> {
    CString::new(bytes).map_err(|_| ContainerError::Nul(ByteString::from(bytes.to_vec())))
}

/// The `setrlimit` resource and values of `limit`.
fn rlimit(limit: &Rlimit) -> Result<(i32, libc::rlimit), ContainerError> {
    let resource = match limit.kind.as_str() {
        "RLIMIT_AS" => libc::RLIMIT_AS,
        "RLIMIT_CORE" => libc::RLIMIT_CORE,
        "RLIMIT_CPU" => libc::RLIMIT_CPU,
        "RLIMIT_DATA" => libc::RLIMIT_DATA,
        "RLIMIT_FSIZE" => libc::RLIMIT_FSIZE,
        "RLIMIT_LOCKS" => libc::RLIMIT_LOCKS,
        "RLIMIT_MEMLOCK" => libc::RLIMIT_MEMLOCK,
        "RLIMIT_MSGQUEUE" => libc::RLIMIT_MSGQUEUE,
        "RLIMIT_NICE" => libc::RLIMIT_NICE,
        "RLIMIT_NOFILE" => libc::RLIMIT_NOFILE,
        "RLIMIT_NPROC" => libc::RLIMIT_NPROC,
        "RLIMIT_RSS" => libc::RLIMIT_RSS,
        "RLIMIT_RTPRIO" => libc::RLIMIT_RTPRIO,
        "RLIMIT_RTTIME" => libc::RLIMIT_RTTIME,
        "RLIMIT_SIGPENDING" => libc::RLIMIT_SIGPENDING,
        "RLIMIT_STACK" => libc::RLIMIT_STACK,
        other => return Err(ContainerError::UnknownRlimit(other.to_owned())),
    };
    if limit.soft > limit.hard {
        return Err(ContainerError::SoftAboveHard {
            kind: limit.kind.clone(),
            soft: limit.soft,
            hard: limit.hard,
        });
    }
    let value = libc::rlimit {
        rlim_cur: limit.soft as libc::rlim_t,
        rlim_max: limit.hard as libc::rlim_t,
    };
    Ok((resource as i32, value))
}

impl Prepared {
    /// The `HOME` of the request's user in the container's `/etc/passwd`, when a user was named.
    pub fn home(&self) -> Option<&OsStr> {
        self.home.as_deref().map(OsStr::from_bytes)
    }

    /// Puts the calling thread's future children into the container's PID namespace: a new
    /// one, or the joined process's. Call on the thread that spawns the command, right before.
    ///
    /// # Errors
    /// `unshare(2)` or `setns(2)` failed.
    pub fn enter_pid_namespace(&self) -> io::Result<()> {
        let rc = match &self.namespaces {
            // SAFETY: unshare(2) takes flags only; it changes this thread's namespace for
            // children, which is what is asked.
            Namespaces::New(_) => unsafe { libc::unshare(libc::CLONE_NEWPID) },
            // SAFETY: setns(2) on a descriptor we own.
            Namespaces::Join { pid, .. } => unsafe {
                libc::setns(pid.as_raw_fd(), libc::CLONE_NEWPID)
            },
        };
        check(rc)
    }

    /// The child's side, between fork and exec: mount namespace and root, working directory,
    /// limits, groups and ids. Only system calls on values made by [`prepare`].
    ///
    /// # Errors
    /// The first system call that failed.
    pub fn enter(&self) -> io::Result<()> {
        match &self.namespaces {
            Namespaces::New(root) => root.enter()?,
            Namespaces::Join { mnt, .. } => {
                // SAFETY: setns(2) on a descriptor we own; the child is single-threaded.
                let rc = unsafe { libc::setns(mnt.as_raw_fd(), libc::CLONE_NEWNS) };
                check(rc)?
            }
        }
        // SAFETY: every call below takes values owned by `self` or constants; none allocates.
        unsafe {
            check(libc::chdir(self.cwd.as_ptr()))?;
            for (resource, value) in &self.rlimits {
                check(libc::setrlimit(*resource as _, value))?;
            }
            if let Some(ids) = self.ids {
                check(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
                check(libc::setgid(ids.gid))?;
                check(libc::setuid(ids.uid))?;
            } else if !self.groups.is_empty() {
                check(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
            }
            if self.no_new_privileges {
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
            }
        }
        Ok(())
    }
}

impl NewRoot {
    fn enter(&self) -> io::Result<()> {
        // SAFETY: mount(2), mkdir(2), chdir(2) and chroot(2) on C strings owned by `self` or
        // literals; the child is single-threaded and has its own mount namespace after the
        // first call, so nothing it mounts is seen outside.
        unsafe {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            mount(None, c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
            let root = match self.overlay {
                false => {
                    let flags = libc::MS_BIND | libc::MS_REC;
                    mount(Some(&self.root), &self.root, None, flags, None)?;
                    let read_only = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
                    mount(None, &self.root, None, read_only, None)?;
                    self.root.as_c_str()
                }
                true => {
                    check(libc::chdir(self.root.as_ptr()))?;
                    let nosuid = libc::MS_NOSUID | libc::MS_NODEV;
                    mount(
                        Some(c"tmpfs"),
                        c"/tmp",
                        Some(c"tmpfs"),
                        nosuid,
                        Some(c"mode=0755"),
                    )?;
                    for dir in [c"/tmp/upper", c"/tmp/work", OVERLAY_ROOT] {
                        check(libc::mkdir(dir.as_ptr(), 0o755))?;
                    }
                    mount(
                        Some(c"overlay"),
                        OVERLAY_ROOT,
                        Some(c"overlay"),
                        0,
                        Some(OVERLAY_OPTIONS),
                    )?;
                    OVERLAY_ROOT
                }
            };
            let pseudo = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
            if let Some(dir) = &self.proc_dir {
                mount(Some(c"proc"), dir, Some(c"proc"), pseudo, None)?;
            }
            if let Some(dir) = &self.dev_dir {
                mount(Some(c"/dev"), dir, None, libc::MS_BIND | libc::MS_REC, None)?;
            }
            if let Some(dir) = &self.sys_dir {
                let flags = pseudo | libc::MS_RDONLY;
                mount(Some(c"sysfs"), dir, Some(c"sysfs"), flags, None)?;
            }
            check(libc::chdir(root.as_ptr()))?;
            mount(Some(c"."), c"/", None, libc::MS_MOVE, None)?;
            check(libc::chroot(c".".as_ptr()))?;
            check(libc::chdir(c"/".as_ptr()))?;
        }
        Ok(())
    }
}

/// `mount(2)` with an optional source, type and data.
///
/// # Safety
/// Only between fork and exec in a child with a mount namespace of its own, or where changing
/// the caller's mounts is intended.
unsafe fn mount(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let ptr = |s: Option<&CStr>| s.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is null or a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            ptr(source),
            target.as_ptr(),
            ptr(fstype),
            flags,
            ptr(data).cast(),
        )
    };
    check(rc)
}

/// `Ok` for a system call's 0 (or positive) result, the OS error for -1.
fn check(rc: libc::c_int) -> io::Result<()> {
    match rc {
        -1 => Err(io::Error::last_os_error()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(kind: &str, soft: u64, hard: u64) -> Rlimit {
        Rlimit {
            kind: kind.into(),
            soft,
            hard,
        }
    }

    #[test]
    fn limits_are_named_as_oci_names_them_and_soft_may_not_exceed_hard() {
        // Act
        let nofile = rlimit(&limit("RLIMIT_NOFILE", 10, u64::MAX));
        let unknown = rlimit(&limit("RLIMIT_BOGUS", 1, 1));
        let inverted = rlimit(&limit("RLIMIT_NPROC", 5, 4));

        // Assert
        let (resource, value) = nofile.unwrap();
        assert_eq!(resource, libc::RLIMIT_NOFILE as i32);
        assert_eq!((value.rlim_cur, value.rlim_max), (10, libc::RLIM_INFINITY));
        assert!(matches!(unknown, Err(ContainerError::UnknownRlimit(k)) if k == "RLIMIT_BOGUS"));
        assert!(matches!(
            inverted,
            Err(ContainerError::SoftAboveHard { .. })
        ));
    }

    #[test]
    fn a_relative_or_missing_root_and_a_missing_cwd_are_refused() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_str().unwrap();

        // Act
        let relative = prepare(&ContainerExec::new("rootfs"), None, None);
        let missing = prepare(&ContainerExec::new("/nonexistent/rootfs"), None, None);
        let cwd = prepare(&ContainerExec::new(root), Some(&"/nope".into()), None);
        let ok = prepare(&ContainerExec::new(root), None, None);

        // Assert
        assert!(matches!(relative, Err(ContainerError::Root(_))));
        assert!(matches!(missing, Err(ContainerError::Root(_))));
        assert!(matches!(cwd, Err(ContainerError::Cwd(_))));
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn the_user_is_looked_up_in_the_containers_passwd() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(
            dir.path().join("etc/passwd"),
            "app:x:1234:4321:App:/home/app:/bin/sh\n",
        )
        .unwrap();
        let spec = ContainerExec::new(dir.path().to_str().unwrap());

        // Act
        let app = prepare(&spec, None, Some("app")).unwrap();
        let unknown = prepare(&spec, None, Some("nobody-here"));

        // Assert
        assert_eq!(
            app.ids,
            Some(user::Ids {
                uid: 1234,
                gid: 4321
            })
        );
        assert_eq!(app.home(), Some(OsStr::new("/home/app")));
        assert!(matches!(unknown, Err(ContainerError::User(_))));
    }

    #[test]
    fn joining_a_process_that_does_not_exist_is_refused() {
        // Arrange
        let mut spec = ContainerExec::new("/");
        spec.join_pid = Some(u32::MAX);

        // Act
        let joined = prepare(&spec, None, None);

        // Assert
        assert!(matches!(
            joined,
            Err(ContainerError::Join { pid: u32::MAX, .. })
        ));
    }
}

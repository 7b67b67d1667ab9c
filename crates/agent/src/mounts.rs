//! Host directories shared over virtio-fs, mounted where the kernel command line says.
//!
//! The host (`bulkhead run --mount HOST_DIR:GUEST_DIR[:ro]`, the sandbox crate's `mounts`
//! module) gives the VM one virtio-fs device per shared directory and passes, for each,
//!
//! ```text
//! bulkhead.mount=TAG:GUEST_DIR        read-write
//! bulkhead.mount=TAG:GUEST_DIR:ro     read-only
//! ```
//!
//! (the codec is [`bulkhead_protocol::boot`]). The agent mounts
//! them in command-line order (the host lists parents first), after switching into an image
//! root (`bulkhead.root=`) and before announcing readiness: it creates the directory
//! (`mkdir -p`), then `mount -t virtiofs TAG GUEST_DIR` with `nosuid,nodev`, plus `ro` for
//! read-only shares. The read-only flag is a convenience: the host's file server refuses every
//! change to a read-only share with `EROFS` whatever the guest mounts.
//!
//! A mount that fails (or a parameter that does not parse) is fatal: the agent writes the reason
//! to the debug port (the VMM's log) and reboots, so no command ever runs without the directory
//! it was promised.
//!
//! Before a snapshot the host asks for the shares to be unmounted (`SharesRequest`, [`serve`]):
//! a share with a live FUSE session names host file descriptors of the VMM, which a snapshot
//! cannot carry. The agent refuses, unmounting nothing, while a process uses a file under one
//! (working or root directory, executable, open file, mapping: [`users_under`]); else it
//! unmounts them, children first. The restore mounts them again from its `share_params`; if
//! the snapshot fails instead, the host asks for them back (`mounted: true`).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use bulkhead_protocol::boot::Share;
use bulkhead_protocol::{write_frame, Ack, ErrorCode, Frame, SharesRequest, PROTOCOL_VERSION};

use crate::conn::Conn;
use crate::{log, mountinfo, workspace};

/// The shares mounted now, in mount order (parents first).
static MOUNTED: Mutex<Vec<Share>> = Mutex::new(Vec::new());

/// The shares the last unmount took, in mount order, for a mount-again.
static UNMOUNTED: Mutex<Vec<Share>> = Mutex::new(Vec::new());

/// Most processes an unmount refusal names.
const MAX_NAMED_USERS: usize = 8;

/// Failed mounts.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// Creating the mount point failed.
    #[error("cannot create mount point {}: {source}", path.display())]
    Mkdir {
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// mount(2) failed.
    #[error("mount -t virtiofs {tag} {}: {source}", path.display())]
    Mount {
        /// The tag.
        tag: String,
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// umount(2) failed (the shares unmounted before it are mounted again).
    #[error("umount {}: {source}", path.display())]
    Unmount {
        /// The mount point.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Mounting the clone workspace again failed.
    #[error("the clone workspace: {0}")]
    Workspace(String),
    /// The guest mounted something over, inside or from a share (a bind mount): unmounting the
    /// share would not end its FUSE session, or would take that mount away.
    #[error("the guest mounted {0}; unmount it first")]
    Covered(String),
    /// Processes use files under the shares, which therefore stay mounted.
    #[error("processes use files under the shared directories: {0}; end them first")]
    Busy(String),
}

/// Mounts `shares` in order.
///
/// # Errors
/// The first failed mount (earlier mounts stay).
pub fn mount_all(shares: &[Share]) -> Result<(), MountError> {
    for share in shares {
        mount_share(share)?;
        lock(&MOUNTED).push(share.clone());
    }
    Ok(())
}

fn lock(list: &'static Mutex<Vec<Share>>) -> MutexGuard<'static, Vec<Share>> {
    list.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves a [`SharesRequest`]: [`unmount_all`] or [`mount_again`], answered with `Ack` or an
/// `Error` saying why not.
pub fn serve(mut conn: Conn, req: &SharesRequest) {
    let reply = if req.version != PROTOCOL_VERSION {
        Frame::error(
            ErrorCode::UnsupportedVersion,
            format!(
                "unsupported protocol version {} (this agent speaks {PROTOCOL_VERSION})",
                req.version
            ),
        )
    } else {
        match if req.mounted {
            mount_again()
        } else {
            unmount_all()
        } {
            Ok(()) => Frame::Ack(Ack { bytes: 0 }),
            Err(e) => Frame::error(ErrorCode::Other, e.to_string()),
        }
    };
    let _ = write_frame(&mut conn, &reply);
}

/// Unmounts every share, children first, and the clone workspace (its changes kept, see
/// [`crate::workspace`]), unless a process uses a file under one.
///
/// # Errors
/// [`MountError::Busy`] naming the processes (nothing unmounted); [`MountError::Unmount`]
/// (what was unmounted before is mounted again).
pub fn unmount_all() -> Result<(), MountError> {
    let mut mounted = lock(&MOUNTED);
    let workspace = workspace::mounted_target();
    let mut ours: Vec<mountinfo::Ours> = mounted
        .iter()
        .map(|s| mountinfo::Ours {
            point: &s.guest_dir,
            fstype: "virtiofs",
        })
        .collect();
    ours.extend(workspace.as_deref().map(|point| mountinfo::Ours {
        point,
        fstype: "overlay",
    }));
    let targets: Vec<&Path> = ours.iter().map(|o| o.point).collect();
    let users = users_under(Path::new("/proc"), &targets, std::process::id());
    if !users.is_empty() {
        return Err(MountError::Busy(users.join(", ")));
    }
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let foreign = mountinfo::foreign(&mountinfo::parse(&table), &ours);
    if !foreign.is_empty() {
        return Err(MountError::Covered(foreign.join(", ")));
    }
    if let Some(path) = workspace {
        workspace::unmount().map_err(|source| MountError::Unmount { path, source })?;
    }
    let mut done: Vec<Share> = Vec::new();
    for share in mounted.iter().rev() {
        let unmounted = match unmount(&share.guest_dir) {
            // Not a mount point: the guest unmounted the share itself (its session ended).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                log!(
                    "share {} was not mounted at {}",
                    share.tag,
                    share.guest_dir.display()
                );
                continue;
            }
            other => other,
        };
        if let Err(source) = unmounted {
            for undone in done.iter().rev() {
                let _ = mount_share(undone);
            }
            if let Err(e) = workspace::mount_again() {
                log!("cannot mount the clone workspace again: {e}");
            }
            return Err(MountError::Unmount {
                path: share.guest_dir.clone(),
                source,
            });
        }
        done.push(share.clone());
    }
    done.reverse();
    lock(&UNMOUNTED).extend(done);
    mounted.clear();
    Ok(())
}

/// Mounts again what the unmounts since the last restore took: the clone workspace, then the
/// shares.
///
/// # Errors
/// The first failed mount.
pub fn mount_again() -> Result<(), MountError> {
    workspace::mount_again().map_err(|e| MountError::Workspace(e.to_string()))?;
    let shares = std::mem::take(&mut *lock(&UNMOUNTED));
    mount_all(&shares)
}

/// Forgets the unmounted shares: a restore mounts its own (its `share_params`).
pub fn forget_unmounted() {
    lock(&UNMOUNTED).clear();
}

/// umount(2) of `path`, without flags.
pub(crate) fn unmount(path: &Path) -> io::Result<()> {
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `target` is a NUL-terminated string that outlives the call.
    match unsafe { libc::umount2(target.as_ptr(), 0) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// The processes under the proc file system `proc` (except `own_pid`) that use a file under
/// one of `targets`: as working or root directory, executable, open file or mapping. Each
/// `PID (COMM)`, at most [`MAX_NAMED_USERS`] and then how many more.
pub fn users_under(proc: &Path, targets: &[&Path], own_pid: u32) -> Vec<String> {
    if targets.is_empty() {
        return Vec::new();
    }
    let Ok(entries) = fs::read_dir(proc) else {
        return Vec::new();
    };
    let under = |path: &Path| targets.iter().any(|t| path.starts_with(t));
    let mut users: Vec<String> = entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let dir = entry.path();
            (pid != own_pid && uses(&dir, &under)).then(|| {
                let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default();
                format!("{pid} ({})", comm.trim())
            })
        })
        .collect();
    users.sort();
    if users.len() > MAX_NAMED_USERS {
        let more = users.len() - MAX_NAMED_USERS;
        users.truncate(MAX_NAMED_USERS);
        users.push(format!("{more} more"));
    }
    users
}

/// Whether the process of `/proc/PID` (`dir`) uses a path for which `under` holds.
fn uses(dir: &Path, under: &impl Fn(&Path) -> bool) -> bool {
    let link_under = |path: PathBuf| fs::read_link(path).is_ok_and(|p| under(&p));
    let fds = fs::read_dir(dir.join("fd"))
        .map(|fds| fds.flatten().any(|fd| link_under(fd.path())))
        .unwrap_or(false);
    let maps = fs::read_to_string(dir.join("maps")).is_ok_and(|maps| {
        maps.lines()
            .filter_map(|line| line.split_whitespace().nth(5))
            .any(|path| under(Path::new(path)))
    });
    ["cwd", "root", "exe"]
        .iter()
        .any(|link| link_under(dir.join(link)))
        || fds
        || maps
}

fn mount_share(spec: &Share) -> Result<(), MountError> {
    fs::create_dir_all(&spec.guest_dir).map_err(|source| MountError::Mkdir {
        path: spec.guest_dir.clone(),
        source,
    })?;
    let failed = |source| MountError::Mount {
        tag: spec.tag.clone(),
        path: spec.guest_dir.clone(),
        source,
    };
    let invalid = || failed(io::Error::from_raw_os_error(libc::EINVAL));
    let tag = CString::new(spec.tag.as_str()).map_err(|_| invalid())?;
    let target = CString::new(spec.guest_dir.as_os_str().as_bytes()).map_err(|_| invalid())?;
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if spec.read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: every pointer is a NUL-terminated string that outlives the call; data is null.
    let rc = unsafe {
        libc::mount(
            tag.as_ptr(),
            target.as_ptr(),
            c"virtiofs".as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(failed(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A fake `/proc/PID` under `proc` whose `cwd` and fd 3 link to `cwd` and `fd3`.
    fn process(proc: &Path, pid: u32, comm: &str, cwd: &str, fd3: &str) {
        let dir = proc.join(pid.to_string());
        fs::create_dir_all(dir.join("fd")).unwrap();
        fs::write(dir.join("comm"), format!("{comm}\n")).unwrap();
        symlink(cwd, dir.join("cwd")).unwrap();
        symlink(fd3, dir.join("fd/3")).unwrap();
        fs::write(
            dir.join("maps"),
            "00400000-00452000 r-xp 00000000 08:02 173521 /bin/sh\n",
        )
        .unwrap();
    }

    #[test]
    fn processes_with_a_directory_or_file_under_a_share_are_named_and_others_not() {
        // Arrange
        let proc = tempfile::tempdir().unwrap();
        process(proc.path(), 1, "init", "/workspace", "/dev/null");
        process(proc.path(), 20, "sleep", "/workspace/src", "/dev/null");
        process(proc.path(), 21, "python3", "/", "/data/model.bin");
        process(proc.path(), 22, "sh", "/", "/workspace-other/x");
        fs::create_dir(proc.path().join("self")).unwrap();
        let targets = [Path::new("/workspace"), Path::new("/data")];

        // Act
        let users = users_under(proc.path(), &targets, 1);
        let none = users_under(proc.path(), &[], 1);

        // Assert
        assert_eq!(users, ["20 (sleep)", "21 (python3)"]);
        assert!(none.is_empty());
    }

    #[test]
    fn a_mapped_file_under_a_share_counts_and_long_lists_are_cut() {
        // Arrange
        let proc = tempfile::tempdir().unwrap();
        for pid in 100..112 {
            process(proc.path(), pid, "worker", "/", "/dev/null");
        }
        fs::write(
            proc.path().join("100/maps"),
            "7f00-7f10 r--p 00000000 00:2a 17 /data/lib.so\n",
        )
        .unwrap();
        fs::write(proc.path().join("101/maps"), "").unwrap();
        let targets = [Path::new("/data")];
        let everyone = [Path::new("/")];

        // Act
        let mapped = users_under(proc.path(), &targets, 1);
        let cut = users_under(proc.path(), &everyone, 1);

        // Assert
        assert_eq!(mapped, ["100 (worker)"]);
        assert_eq!(cut.len(), MAX_NAMED_USERS + 1);
        assert_eq!(cut.last().map(String::as_str), Some("4 more"));
    }
}

//! Booting from a root filesystem image: with `bulkhead.root=DEV` on the kernel command line
//! the agent, still running from the initramfs, builds an overlay root and moves itself into
//! it before serving anything.
//!
//! The boot parameters ([`bulkhead_protocol::boot`], the host's side is `bulkhead-sandbox`):
//! - `bulkhead.root=/dev/vdX`: an ext4 block device, mounted read-only as the lower layer.
//!   Every sandbox on an image shares the same file, so it is never written.
//! - `bulkhead.overlay=tmpfs` (the default when `bulkhead.root` is given) or
//!   `bulkhead.overlay=/dev/vdY`: where the writable upper layer lives; a device must hold
//!   an ext4 file system (the host formats the per-sandbox scratch disk).
//! - Without `bulkhead.root` nothing here happens and the initramfs stays the root.
//!
//! Layout, in the initramfs: `/.bulkhead/lower` (the image, `ro`), `/.bulkhead/rw` (tmpfs or
//! the scratch disk, holding `upper/` and `work/`) and `/.bulkhead/root`, the overlayfs merged
//! root. The pseudo-filesystems `init::setup` mounted (`/proc`, `/sys`, `/dev` with `pts`
//! and `shm`, `/tmp`, `/run`) are moved into it with `MS_MOVE`; the initramfs files are
//! deleted (its memory is freed; mount points are skipped); then the merged root is moved
//! onto `/` and the agent `chroot`s into it, like busybox's `switch_root`. The agent itself
//! keeps running: every later exec and file operation happens inside the new root, where
//! absolute symbolic links resolve within it by construction. The lower and upper mounts stay
//! reachable only through the overlay.
//!
//! Any failure (bad parameter, missing device, mount error) is returned; PID 1 then logs it
//! to the console and the debug port and reboots, so the VM ends before announcing readiness
//! and the host sees a failed start instead of a sandbox without its root.

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bulkhead_protocol::boot::{Overlay, RootParam};

/// Directory in the initramfs under which the layers are mounted.
pub const STAGING_DIR: &str = "/.bulkhead";

/// File-system type of the root image and of a scratch disk.
pub const DISK_FSTYPE: &str = "ext4";

/// ext4 options of the scratch disk: `noinit_itable` keeps the kernel's lazy-init thread from
/// zeroing the inode tables of a freshly formatted disk in the background, which would be
/// pure write traffic at boot for a disk that lives as long as the sandbox.
pub const SCRATCH_OPTIONS: &str = "noinit_itable";

/// How long to wait for a block device node to appear (1000 ms). virtio-mmio devices are
/// probed before init runs, so this only covers slow device-node creation.
pub const DEVICE_WAIT: Duration = Duration::from_millis(1000);

/// Interval between checks for a device node (10 ms).
const DEVICE_POLL: Duration = Duration::from_millis(10);

/// Mount points `init::setup` creates that move into the new root, in order.
pub const MOVED_MOUNTS: [&str; 5] = ["/proc", "/sys", "/dev", "/tmp", "/run"];

/// Errors preparing or entering the image root.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// A block device did not appear.
    #[error("{device}: no such block device after {} ms (is the disk attached?)", DEVICE_WAIT.as_millis())]
    DeviceMissing {
        /// The device path.
        device: String,
    },
    /// A directory could not be created.
    #[error("mkdir {}: {source}", path.display())]
    Mkdir {
        /// The directory.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// A mount failed.
    #[error("mount {fstype} {source_name} on {}: {error}", target.display())]
    Mount {
        /// File-system type, or `move` for `MS_MOVE`.
        fstype: String,
        /// What was mounted.
        source_name: String,
        /// Where.
        target: PathBuf,
        /// What failed.
        error: io::Error,
    },
    /// Switching into the new root failed.
    #[error("switching root: {op}: {source}")]
    Switch {
        /// The failing step.
        op: &'static str,
        /// What failed.
        source: io::Error,
    },
}

/// One step of building the new root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// `mkdir -p` the path.
    Mkdir(PathBuf),
    /// `mount(source, target, fstype, flags, data)`.
    Mount {
        /// Device or pseudo source name.
        source: String,
        /// Mount point.
        target: PathBuf,
        /// File-system type.
        fstype: &'static str,
        /// `MS_*` flags.
        flags: libc::c_ulong,
        /// File-system options.
        data: String,
    },
    /// `mount(from, to, NULL, MS_MOVE, NULL)`.
    Move {
        /// Current mount point.
        from: PathBuf,
        /// New mount point.
        to: PathBuf,
    },
}

/// The steps that build the merged root for `spec` under `staging` (normally
/// [`STAGING_DIR`]) and move the pseudo-filesystems into it. Pure: nothing is touched.
pub fn mount_plan(spec: &RootParam, staging: &Path) -> Vec<Step> {
    let lower = staging.join("lower");
    let rw = staging.join("rw");
    let merged = staging.join("root");
    let mut steps = vec![
        Step::Mkdir(lower.clone()),
        Step::Mkdir(rw.clone()),
        Step::Mkdir(merged.clone()),
        Step::Mount {
            source: spec.device.clone(),
            target: lower.clone(),
            fstype: DISK_FSTYPE,
            flags: libc::MS_RDONLY,
            data: String::new(),
        },
        match &spec.overlay {
            Overlay::Tmpfs => Step::Mount {
                source: "tmpfs".to_owned(),
                target: rw.clone(),
                fstype: "tmpfs",
                flags: 0,
                data: "mode=0755".to_owned(),
            },
            Overlay::Device(dev) => Step::Mount {
                source: dev.clone(),
                target: rw.clone(),
                fstype: DISK_FSTYPE,
                flags: 0,
                data: SCRATCH_OPTIONS.to_owned(),
            },
        },
        Step::Mkdir(rw.join("upper")),
        Step::Mkdir(rw.join("work")),
        Step::Mount {
            source: "overlay".to_owned(),
            target: merged.clone(),
            fstype: "overlay",
            flags: 0,
            data: format!(
                "lowerdir={},upperdir={},workdir={}",
                lower.display(),
                rw.join("upper").display(),
                rw.join("work").display()
            ),
        },
    ];
    for mount in MOVED_MOUNTS {
        let inside = merged.join(mount.trim_start_matches('/'));
        steps.push(Step::Mkdir(inside.clone()));
        steps.push(Step::Move {
            from: PathBuf::from(mount),
            to: inside,
        });
    }
    steps
}

/// The block devices `spec` needs.
fn devices(spec: &RootParam) -> Vec<&str> {
    let mut devices = vec![spec.device.as_str()];
    if let Overlay::Device(dev) = &spec.overlay {
        devices.push(dev);
    }
    devices
}

/// Builds the overlay root that the boot parameter `spec` asks for and switches the agent into
/// it. Call as PID 1 after `init::setup` and before starting any thread.
///
/// # Errors
/// The first failed step; the agent then reboots (no sandbox without its root).
pub fn enter(spec: &RootParam) -> Result<(), RootfsError> {
    for device in devices(spec) {
        wait_for_device(device, DEVICE_WAIT)?;
    }
    let staging = Path::new(STAGING_DIR);
    for step in mount_plan(spec, staging) {
        apply(&step)?;
    }
    // Freeing the initramfs is best effort: a leftover file costs memory, not correctness.
    let _ = remove_same_device_contents(Path::new("/"));
    switch_root(&staging.join("root"))
}

fn wait_for_device(device: &str, timeout: Duration) -> Result<(), RootfsError> {
    let deadline = Instant::now() + timeout;
    while !Path::new(device).exists() {
        if Instant::now() >= deadline {
            return Err(RootfsError::DeviceMissing {
                device: device.to_owned(),
            });
        }
        std::thread::sleep(DEVICE_POLL);
    }
    Ok(())
}

fn cstring(text: &str) -> io::Result<CString> {
    CString::new(text).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn path_cstring(path: &Path) -> io::Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Calls mount(2); `None` arguments are passed as NULL.
fn sys_mount(
    source: &Path,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = path_cstring(source)?;
    let target = path_cstring(target)?;
    let fstype = fstype.map(cstring).transpose()?;
    let data = data.map(cstring).transpose()?;
    let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every non-null pointer is a NUL-terminated string that outlives the call;
    // mount(2) accepts NULL for the type and data of MS_MOVE.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Performs one [`Step`].
pub fn apply(step: &Step) -> Result<(), RootfsError> {
    match step {
        Step::Mkdir(path) => fs::create_dir_all(path).map_err(|source| RootfsError::Mkdir {
            path: path.clone(),
            source,
        }),
        Step::Mount {
            source,
            target,
            fstype,
            flags,
            data,
        } => sys_mount(Path::new(source), target, Some(fstype), *flags, Some(data)).map_err(
            |error| RootfsError::Mount {
                fstype: (*fstype).to_owned(),
                source_name: source.clone(),
                target: target.clone(),
                error,
            },
        ),
        Step::Move { from, to } => {
            sys_mount(from, to, None, libc::MS_MOVE, None).map_err(|error| RootfsError::Mount {
                fstype: "move".to_owned(),
                source_name: from.display().to_string(),
                target: to.clone(),
                error,
            })
        }
    }
}

/// Moves the mount at `new_root` onto `/` and makes it this process's root and working
/// directory (`chdir`, `mount --move . /`, `chroot .`, `chdir /`).
fn switch_root(new_root: &Path) -> Result<(), RootfsError> {
    let fail = |op| move |source| RootfsError::Switch { op, source };
    std::env::set_current_dir(new_root).map_err(fail("chdir to the new root"))?;
    sys_mount(Path::new("."), Path::new("/"), None, libc::MS_MOVE, None)
        .map_err(fail("moving the new root onto /"))?;
    std::os::unix::fs::chroot(".").map_err(fail("chroot"))?;
    std::env::set_current_dir("/").map_err(fail("chdir /"))
}

/// Deletes everything below `dir` that is on `dir`'s file system, without following symbolic
/// links or entering mount points (which are left in place, with their parents). Returns
/// the first error; deletion goes on past errors.
pub fn remove_same_device_contents(dir: &Path) -> io::Result<()> {
    let dev = fs::symlink_metadata(dir)?.dev();
    remove_below(dir, dev)
}

fn remove_below(dir: &Path, dev: u64) -> io::Result<()> {
    let mut first_error = None;
    for entry in fs::read_dir(dir)? {
        let result = entry.and_then(|entry| {
            let path = entry.path();
            let meta = fs::symlink_metadata(&path)?;
            if meta.dev() != dev {
                return Ok(()); // a mount point: not ours to delete
            }
            if meta.is_dir() {
                remove_below(&path, dev)?;
                match fs::remove_dir(&path) {
                    // still holds a mount point somewhere below
                    Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => Ok(()),
                    other => other,
                }
            } else {
                fs::remove_file(&path)
            }
        });
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(overlay: Overlay) -> RootParam {
        RootParam {
            device: "/dev/vda".into(),
            overlay,
        }
    }

    #[test]
    fn plan_mounts_the_image_read_only_under_a_tmpfs_overlay() {
        // Arrange
        let staging = Path::new("/.bulkhead");

        // Act
        let plan = mount_plan(&spec(Overlay::Tmpfs), staging);

        // Assert
        let mounts: Vec<(&str, &str, libc::c_ulong)> = plan
            .iter()
            .filter_map(|s| match s {
                Step::Mount {
                    source,
                    fstype,
                    flags,
                    ..
                } => Some((source.as_str(), *fstype, *flags)),
                _ => None,
            })
            .collect();
        assert_eq!(
            mounts,
            [
                ("/dev/vda", "ext4", libc::MS_RDONLY),
                ("tmpfs", "tmpfs", 0),
                ("overlay", "overlay", 0)
            ]
        );
        assert!(plan.contains(&Step::Mount {
            source: "overlay".into(),
            target: "/.bulkhead/root".into(),
            fstype: "overlay",
            flags: 0,
            data:
                "lowerdir=/.bulkhead/lower,upperdir=/.bulkhead/rw/upper,workdir=/.bulkhead/rw/work"
                    .into(),
        }));
    }

    #[test]
    fn plan_puts_the_upper_layer_on_the_scratch_disk_when_asked() {
        // Arrange
        let staging = Path::new("/.bulkhead");

        // Act
        let plan = mount_plan(&spec(Overlay::Device("/dev/vdb".into())), staging);

        // Assert
        assert!(plan.contains(&Step::Mount {
            source: "/dev/vdb".into(),
            target: "/.bulkhead/rw".into(),
            fstype: "ext4",
            flags: 0,
            data: SCRATCH_OPTIONS.into(),
        }));
    }

    #[test]
    fn plan_moves_every_pseudo_filesystem_after_the_overlay_exists() {
        // Arrange
        let staging = Path::new("/.bulkhead");

        // Act
        let plan = mount_plan(&spec(Overlay::Tmpfs), staging);

        // Assert
        let overlay_at = plan
            .iter()
            .position(|s| {
                matches!(
                    s,
                    Step::Mount {
                        fstype: "overlay",
                        ..
                    }
                )
            })
            .unwrap();
        let moves: Vec<(usize, &Step)> = plan
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, Step::Move { .. }))
            .collect();
        assert_eq!(moves.len(), MOVED_MOUNTS.len());
        assert!(moves.iter().all(|(i, _)| *i > overlay_at));
        assert!(plan.contains(&Step::Move {
            from: "/dev".into(),
            to: "/.bulkhead/root/dev".into()
        }));
    }

    #[test]
    fn initramfs_cleanup_keeps_what_symlinks_point_to() {
        // Arrange
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("keep"), b"x").unwrap();
        let root = tempfile::tempdir().unwrap();
        fs::create_dir_all(root.path().join("bin/sub")).unwrap();
        fs::write(root.path().join("init"), b"agent").unwrap();
        fs::write(root.path().join("bin/sub/busybox"), b"bb").unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("link")).unwrap();

        // Act
        remove_same_device_contents(root.path()).unwrap();

        // Assert
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 0);
        assert!(outside.path().join("keep").exists());
    }

    #[test]
    fn a_missing_device_is_reported_after_the_timeout() {
        // Arrange
        let device = "/dev/bulkhead-test-no-such-device";

        // Act
        let err = wait_for_device(device, Duration::from_millis(30)).unwrap_err();

        // Assert
        assert!(err.to_string().contains(device), "{err}");
    }
}

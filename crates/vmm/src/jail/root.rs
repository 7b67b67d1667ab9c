//! The jail's root file system: private mounts, a tmpfs root with the [`MountPlan`]'s bind
//! mounts, four device nodes, a fresh `/proc`, and the switch into it.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::plan::{Bind, Kind, MountPlan};
use super::{check, Error};

/// Size limit of the root tmpfs: it holds only empty mount points.
const ROOT_TMPFS: &str = "mode=0755,size=1m";
/// Size limit of the `/dev` tmpfs: four device nodes.
const DEV_TMPFS: &str = "mode=0755,size=64k";
/// Host device nodes every jail gets besides KVM, world-readable and -writable as on the host.
const PLAIN_DEVICES: [&str; 3] = ["/dev/null", "/dev/zero", "/dev/urandom"];

/// A host character device to recreate in the jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct DeviceNode {
    /// Its name in `/dev`.
    name: PathBuf,
    /// Major/minor number.
    rdev: u64,
}

impl DeviceNode {
    /// The character device at `path`, which must be directly in `/dev`.
    ///
    /// # Errors
    /// [`Error::KvmDevice`] otherwise (the only device configurable is KVM's).
    pub(super) fn of(path: &Path) -> Result<DeviceNode, Error> {
        let not_a_device = || Error::KvmDevice(path.to_owned());
        let name = path
            .strip_prefix("/dev")
            .ok()
            .filter(|n| n.components().count() == 1)
            .ok_or_else(not_a_device)?;
        let meta = fs::metadata(path).map_err(|_| not_a_device())?;
        if !meta.file_type().is_char_device() {
            return Err(not_a_device());
        }
        Ok(DeviceNode {
            name: name.to_owned(),
            rdev: meta.rdev(),
        })
    }
}

/// Checks, before anything changes, that each source exists (or is a file to create whose
/// directory exists) and that its path is already resolved (no symbolic link on the way).
///
/// # Errors
/// [`Error::Missing`] or [`Error::NotCanonical`] for the first bad path.
pub(super) fn check_sources(plan: &MountPlan) -> Result<(), Error> {
    for bind in &plan.binds {
        let path = match (bind.path.exists(), bind.create) {
            (true, _) => bind.path.clone(),
            (false, true) => bind.path.parent().unwrap_or(&bind.path).to_owned(),
            (false, false) => return Err(Error::Missing(bind.path.clone())),
        };
        let canonical = fs::canonicalize(&path).map_err(|_| Error::Missing(path.clone()))?;
        if canonical != path {
            return Err(Error::NotCanonical { path, canonical });
        }
    }
    Ok(())
}

/// Builds the jail under `root` and makes it the process's root directory. `owner` gets the KVM
/// node (mode 0600).
pub(super) fn build(
    plan: &MountPlan,
    root: &Path,
    kvm: &DeviceNode,
    owner: (u32, u32),
) -> Result<(), Error> {
    // Nothing mounted in the jail propagates to the host. A share that follows the host's mounts
    // needs them to propagate in, so the copies of the host's mounts become slaves; each other
    // bind is then made private on its own (`bind_into`).
    let propagation = match plan.follows_host_mounts() {
        true => libc::MS_SLAVE,
        false => libc::MS_PRIVATE,
    };
    mount(None, Path::new("/"), None, libc::MS_REC | propagation, None)?;
    let sealed = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(
        Some(Path::new("tmpfs")),
        root,
        Some("tmpfs"),
        sealed,
        Some(ROOT_TMPFS),
    )?;
    for bind in &plan.binds {
        bind_into(root, bind)?;
    }
    let dev = root.join("dev");
    make_devices(&dev, kvm, owner)?;
    let proc = root.join("proc");
    mkdir(&proc)?;
    mount(Some(Path::new("proc")), &proc, Some("proc"), sealed, None)?;
    let read_only = libc::MS_REMOUNT | libc::MS_RDONLY;
    mount(
        None,
        &dev,
        None,
        read_only | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )?;
    mount(None, root, None, read_only | sealed, None)?;
    switch_root(root)
}

/// Mounts `bind.path` at the same path under `root` (recursively, as a slave, when it follows
/// the host's mounts; otherwise alone and private), then remounts it with its final flags (which
/// apply to the bind itself, not to mounts under it: a share that follows the host's mounts must
/// be read-only in the VMM, which refuses every write to it).
fn bind_into(root: &Path, bind: &Bind) -> Result<(), Error> {
    let target = under(root, &bind.path);
    if bind.create && !bind.path.exists() {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&bind.path)
            .map_err(|source| sys(format!("create {}", bind.path.display()), source))?;
    }
    match bind.kind {
        Kind::Dir => mkdir(&target)?,
        Kind::File => {
            if let Some(parent) = target.parent() {
                mkdir(parent)?;
            }
            if target.symlink_metadata().is_err() {
                fs::File::create(&target)
                    .map_err(|source| sys(format!("create {}", target.display()), source))?;
            }
        }
    }
    match bind.follow {
        // A recursive bind of a slave is a slave of the same master: the host's mounts under
        // the path, present and future, are seen here.
        true => mount(
            Some(&bind.path),
            &target,
            None,
            libc::MS_BIND | libc::MS_REC,
            None,
        )?,
        false => {
            mount(Some(&bind.path), &target, None, libc::MS_BIND, None)?;
            mount(None, &target, None, libc::MS_PRIVATE, None)?;
        }
    }
    let mut flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NOEXEC;
    // A disk may be a block device, which a nodev mount would make unusable.
    let block_device = fs::metadata(&bind.path).is_ok_and(|m| m.file_type().is_block_device());
    if !block_device {
        flags |= libc::MS_NODEV;
    }
    if !bind.writable {
        flags |= libc::MS_RDONLY;
    }
    mount(None, &target, None, flags, None)
}

/// A tmpfs at `dev` holding the KVM node (owned by `owner`, mode 0600) and null, zero and
/// urandom (mode 0666), each with the host device's major/minor numbers.
fn make_devices(dev: &Path, kvm: &DeviceNode, owner: (u32, u32)) -> Result<(), Error> {
    mkdir(dev)?;
    let flags = libc::MS_NOSUID | libc::MS_NOEXEC;
    mount(
        Some(Path::new("tmpfs")),
        dev,
        Some("tmpfs"),
        flags,
        Some(DEV_TMPFS),
    )?;
    let node = dev.join(&kvm.name);
    mknod(&node, kvm.rdev, 0o600)?;
    std::os::unix::fs::chown(&node, Some(owner.0), Some(owner.1))
        .map_err(|source| sys(format!("chown {}", node.display()), source))?;
    for host in PLAIN_DEVICES {
        let device = DeviceNode::of(Path::new(host))?;
        mknod(&dev.join(&device.name), device.rdev, 0o666)?;
    }
    Ok(())
}

/// Makes `root` the process's root directory and leaves the old one behind.
fn switch_root(root: &Path) -> Result<(), Error> {
    std::env::set_current_dir(root)
        .map_err(|source| sys(format!("chdir {}", root.display()), source))?;
    let dot = c".";
    // SAFETY: pivot_root reads two NUL-terminated paths that live across the call.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    if rc == 0 {
        // The old root is now stacked on the new one at "/": detach it.
        // SAFETY: umount2 reads one NUL-terminated path.
        let rc = unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) };
        check(rc.into(), || "detach the old root".into())?;
    } else if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // The host's root is the initramfs (rootfs), which cannot be pivoted away: move the
        // new root over it and chroot, as switch_root(8) does. Without capabilities (dropped
        // next) a chroot cannot be left.
        mount(
            Some(Path::new(".")),
            Path::new("/"),
            None,
            libc::MS_MOVE,
            None,
        )?;
        // SAFETY: chroot reads one NUL-terminated path.
        let rc = unsafe { libc::chroot(dot.as_ptr()) };
        check(rc.into(), || "chroot into the jail".into())?;
    } else {
        return Err(Error::last("pivot_root into the jail"));
    }
    std::env::set_current_dir("/").map_err(|source| sys("chdir /".into(), source))
}

/// `root` joined with the absolute `path`.
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

fn mkdir(path: &Path) -> Result<(), Error> {
    fs::create_dir_all(path).map_err(|source| sys(format!("mkdir {}", path.display()), source))
}

fn mknod(path: &Path, rdev: u64, mode: u32) -> Result<(), Error> {
    let c_path = c_path(path)?;
    // SAFETY: mknod reads one NUL-terminated path that lives across the call.
    let rc = unsafe { libc::mknod(c_path.as_ptr(), libc::S_IFCHR | mode, rdev) };
    check(rc.into(), || format!("mknod {}", path.display()))?;
    // mknod applied the umask.
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|source| sys(format!("chmod {}", path.display()), source))
}

/// mount(2) with optional source, file system type and data.
fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), Error> {
    let source = source.map(c_path).transpose()?;
    let target_c = c_path(target)?;
    let fstype = fstype.map(|t| CString::new(t).unwrap_or_default());
    let data = data.map(|d| CString::new(d).unwrap_or_default());
    let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string that lives across the call;
    // mount(2) only reads them.
    let rc = unsafe {
        libc::mount(
            ptr(&source),
            target_c.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    check(rc.into(), || {
        format!("mount {} (flags {flags:#x})", target.display())
    })
}

fn c_path(path: &Path) -> Result<CString, Error> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| Error::RelativePath(path.to_owned()))
}

fn sys(what: String, source: std::io::Error) -> Error {
    Error::Sys { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_must_be_a_character_device_directly_in_dev() {
        for path in ["/dev/null/x", "/tmp", "/dev", "/etc/passwd"] {
            // Act
            let result = DeviceNode::of(Path::new(path));

            // Assert
            assert!(matches!(result, Err(Error::KvmDevice(_))), "{path}");
        }
        assert!(DeviceNode::of(Path::new("/dev/null")).is_ok());
    }

    fn plan_of(path: &Path, create: bool) -> MountPlan {
        MountPlan {
            binds: vec![Bind {
                path: path.to_owned(),
                kind: Kind::File,
                writable: false,
                create,
                follow: false,
            }],
        }
    }

    #[test]
    fn sources_behind_a_symlink_are_refused_with_their_resolved_path() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let real = fs::canonicalize(dir.path()).unwrap();
        fs::write(real.join("vmlinux"), b"k").unwrap();
        std::os::unix::fs::symlink(&real, real.join("link")).unwrap();

        // Act
        let err = check_sources(&plan_of(&real.join("link/vmlinux"), false)).unwrap_err();

        // Assert
        match err {
            Error::NotCanonical { canonical, .. } => assert_eq!(canonical, real.join("vmlinux")),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn a_missing_source_is_refused_unless_the_vmm_creates_it() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let missing = fs::canonicalize(dir.path()).unwrap().join("console.log");

        // Act
        let refused = check_sources(&plan_of(&missing, false));
        let created = check_sources(&plan_of(&missing, true));

        // Assert
        assert!(matches!(refused, Err(Error::Missing(_))));
        assert!(created.is_ok(), "{created:?}");
    }
}

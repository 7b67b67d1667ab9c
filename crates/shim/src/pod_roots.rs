//! A pod's container roots on the host: one directory per pod, `<pods dir>/<pod id>`, that is a
//! shared mount of its own, with each container's root file system mounted in it at
//! `<pod id>/<container id>`.
//!
//! The pod's VM shares the directory read-only and follows the host's mounts under it
//! ([`bulkhead_sandbox::SandboxConfig::follow_host_mounts`]): since the directory is a shared
//! mount, a container root mounted in it after the VM booted propagates into the jailed VMM's
//! mount namespace, and the guest sees it at `/run/bulkhead/containers/<container id>`. That is
//! how a second container joins a running pod without a new virtio-fs device.
//!
//! A shim that was killed leaves its mounts; [`PodRoots::open`] of the same pod and
//! [`remove_stale`] (containerd's `delete` of a dead shim's task) take them down. Only empty
//! directories are ever removed, never a tree: a root that is still mounted keeps its files.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::events::Mount;
use crate::rootfs::{self, RootfsError};

/// The directory where pods' root directories are made, under a runtime directory.
pub const PODS_DIR: &str = "pods";

/// One pod's directory of container roots (see the module documentation).
#[derive(Debug)]
pub struct PodRoots {
    dir: PathBuf,
}

impl PodRoots {
    /// Makes `<pods>/<pod>` a shared mount of its own (bind-mounted on itself, private, then
    /// shared: its mounts propagate to the VMM's slave copy and nowhere else), clearing what a
    /// killed shim of the same pod left there first.
    ///
    /// # Errors
    /// [`RootfsError::BadId`] for a pod id that is not one path component; [`RootfsError::Sys`].
    pub fn open(pods: &Path, pod: &str) -> Result<PodRoots, RootfsError> {
        let dir = pods.join(component(pod)?);
        if dir.exists() {
            clear(&dir);
        }
        fs::create_dir_all(&dir).map_err(sys("mkdir", &dir))?;
        rootfs::mount_path(&dir, &dir, libc::MS_BIND)?;
        let made_shared = rootfs::mount_path(&dir, &dir, libc::MS_PRIVATE)
            .and_then(|()| rootfs::mount_path(&dir, &dir, libc::MS_SHARED));
        if let Err(e) = made_shared {
            let _ = rootfs::unmount(&dir);
            return Err(e);
        }
        Ok(PodRoots { dir })
    }

    /// The directory the VM shares.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Mounts container `id`'s root at `<pod>/<id>` and returns that path: containerd's rootfs
    /// `mounts`, or, when there are none (`ctr run --rootfs`), a bind of `bundle_rootfs`.
    ///
    /// # Errors
    /// [`RootfsError`]; nothing is left mounted or created.
    pub fn add(
        &self,
        id: &str,
        mounts: &[Mount],
        bundle_rootfs: &Path,
    ) -> Result<PathBuf, RootfsError> {
        let target = self.dir.join(component(id)?);
        fs::create_dir(&target).map_err(sys("mkdir", &target))?;
        let mounted = match mounts.is_empty() {
            true => rootfs::mount_path(bundle_rootfs, &target, libc::MS_BIND | libc::MS_REC),
            false => rootfs::mount_all(mounts, &target),
        };
        if let Err(e) = mounted {
            let _ = fs::remove_dir(&target);
            return Err(e);
        }
        Ok(target)
    }

    /// Unmounts container `id`'s root and removes its (then empty) directory.
    ///
    /// # Errors
    /// [`RootfsError`].
    pub fn remove(&self, id: &str) -> Result<(), RootfsError> {
        let target = self.dir.join(component(id)?);
        rootfs::unmount(&target)?;
        while rootfs::unmount(&target).is_ok() {}
        fs::remove_dir(&target).map_err(sys("rmdir", &target))
    }

    /// Unmounts the pod's directory (and whatever is still mounted in it) and removes it.
    ///
    /// # Errors
    /// [`RootfsError::Sys`].
    pub fn close(self) -> Result<(), RootfsError> {
        clear_children(&self.dir);
        rootfs::unmount(&self.dir)?;
        fs::remove_dir(&self.dir).map_err(sys("rmdir", &self.dir))
    }
}

/// What containerd's `delete` does for a task whose shim died: unmounts container `id`'s root
/// in pod `pod`, and the pod's directory when no other root is left in it. Missing pieces are
/// not errors (the shim may have died before making them).
pub fn remove_stale(pods: &Path, pod: &str, id: &str) {
    let (Ok(pod), Ok(id)) = (component(pod), component(id)) else {
        return;
    };
    let dir = pods.join(pod);
    take_down(&dir.join(id));
    let empty = fs::read_dir(&dir).is_ok_and(|mut entries| entries.next().is_none());
    if empty {
        clear(&dir);
    }
}

/// Takes down what a killed shim left in `dir`: each child's mounts, the directory's own, and
/// the empty directories.
fn clear(dir: &Path) {
    clear_children(dir);
    take_down(dir);
}

fn clear_children(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        take_down(&entry.path());
    }
}

/// Unmounts everything mounted on `path` and removes it if it is then an empty directory.
fn take_down(path: &Path) {
    while rootfs::unmount(path).is_ok() {}
    let _ = fs::remove_dir(path);
}

/// `name` if it is one plain path component (containerd's ids are `[A-Za-z0-9][A-Za-z0-9_.-]*`).
fn component(name: &str) -> Result<&str, RootfsError> {
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
    match plain {
        true => Ok(name),
        false => Err(RootfsError::BadId(name.to_owned())),
    }
}

fn sys<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> RootfsError + 'a {
    move |source| RootfsError::Sys {
        what,
        target: path.display().to_string(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_that_are_not_one_plain_path_component_are_refused() {
        for bad in ["", ".", "..", "a/b", "../x", "a\0b", "a b"] {
            // Act
            let result = component(bad);

            // Assert
            assert!(matches!(result, Err(RootfsError::BadId(_))), "{bad:?}");
        }
        assert_eq!(component("k8s_pod-1.a").unwrap(), "k8s_pod-1.a");
    }

    #[test]
    fn a_bad_container_id_is_refused_before_anything_is_made() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let roots = PodRoots {
            dir: dir.path().to_owned(),
        };

        // Act
        let result = roots.add("../escape", &[], dir.path());

        // Assert
        assert!(matches!(result, Err(RootfsError::BadId(_))));
        assert!(!dir.path().parent().unwrap().join("escape").exists());
    }
}

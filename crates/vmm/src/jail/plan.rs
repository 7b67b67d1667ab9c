//! The jail's mount plan: which host paths one VM needs and with which rights, derived from its
//! [`VmConfig`] alone (no file system access here, so it is unit-tested directly).

use std::path::{Component, Path, PathBuf};

use super::Error;
use crate::config::{SerialOutput, VmConfig};

/// What a bind mount's source is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file (or, for disks, a block device).
    File,
    /// A directory.
    Dir,
}

/// One host path bind-mounted into the jail at the same absolute path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    /// The absolute host path, which is also the path inside the jail.
    pub path: PathBuf,
    /// File or directory.
    pub kind: Kind,
    /// Mounted read-write; otherwise read-only.
    pub writable: bool,
    /// A file the VMM creates (serial console, debug port log): created empty on the host when
    /// missing, so that it can be bind-mounted.
    pub create: bool,
    /// A recursive bind that stays a slave of the host's mount: the mounts under `path`, those
    /// there now and those the host adds later, are seen in the jail (a read-only share with
    /// [`ShareConfig::follow_host_mounts`](crate::config::ShareConfig::follow_host_mounts)).
    /// Otherwise a private bind of `path`'s own mount.
    pub follow: bool,
}

/// Everything a VM's jail holds besides its device nodes, `/proc` and the empty root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MountPlan {
    /// Bind mounts, parents before children (a bind inside another is mounted on top of it).
    pub binds: Vec<Bind>,
}

impl MountPlan {
    /// The plan for `vm`, plus the directory of `timings_json` (the VMM renames the report into
    /// place there): kernel and initramfs read-only; disks and shares as configured; the
    /// directory of the vsock socket read-write (the VMM binds the socket there and connects to
    /// `<socket>_PORT` listeners); the serial console and debug port files read-write.
    ///
    /// # Errors
    /// [`Error::RelativePath`] for a path that is not absolute or has `.`/`..` components (the
    /// jail mounts every path at the same absolute path, so the VMM opens it unchanged).
    pub fn for_vm(vm: &VmConfig, timings_json: Option<&Path>) -> Result<MountPlan, Error> {
        let mut plan = MountPlan::default();
        plan.add(&vm.kernel, Kind::File, false, false)?;
        if let Some(initrd) = &vm.initrd {
            plan.add(initrd, Kind::File, false, false)?;
        }
        for disk in &vm.disks {
            plan.add(&disk.path, Kind::File, !disk.read_only, false)?;
            if let Some(backing) = &disk.backing {
                plan.add(backing, Kind::File, false, false)?;
            }
        }
        for share in &vm.shares {
            plan.add(&share.path, Kind::Dir, !share.read_only, false)?;
            if share.follow_host_mounts {
                plan.follow(&share.path);
            }
        }
        if let Some(vsock) = &vm.vsock {
            plan.add(&parent_of(&vsock.uds_path)?, Kind::Dir, true, false)?;
        }
        if let SerialOutput::File(path) = &vm.serial {
            plan.add(path, Kind::File, true, true)?;
        }
        if let Some(path) = &vm.debugcon {
            plan.add(path, Kind::File, true, true)?;
        }
        if let Some(path) = timings_json {
            plan.add(&parent_of(path)?, Kind::Dir, true, false)?;
        }
        plan.binds.sort_by(|a, b| {
            depth(&a.path)
                .cmp(&depth(&b.path))
                .then(a.path.cmp(&b.path))
        });
        plan.drop_covered();
        Ok(plan)
    }

    /// Drops binds that a directory bind above them already gives with the same rights (a
    /// read-only file inside a read-write directory stays: its bind narrows the rights; so does
    /// any bind that follows the host's mounts or lies under one that does).
    fn drop_covered(&mut self) {
        let dirs: Vec<(PathBuf, bool, bool)> = self
            .binds
            .iter()
            .filter(|b| b.kind == Kind::Dir)
            .map(|b| (b.path.clone(), b.writable, b.follow))
            .collect();
        self.binds.retain(|bind| {
            !dirs.iter().any(|(dir, writable, follow)| {
                *dir != bind.path
                    && bind.path.starts_with(dir)
                    && *writable == bind.writable
                    && !*follow
                    && !bind.follow
            })
        });
    }

    /// Marks the bind of `path` as one that follows the host's mounts.
    fn follow(&mut self, path: &Path) {
        if let Some(bind) = self.binds.iter_mut().find(|b| b.path == path) {
            bind.follow = true;
        }
    }

    /// Whether any bind follows the host's mounts (the jail's mounts are then slaves of the
    /// host's, not private).
    pub fn follows_host_mounts(&self) -> bool {
        self.binds.iter().any(|b| b.follow)
    }

    /// Adds a bind; the same path twice is one bind, read-write if either asked for it.
    fn add(&mut self, path: &Path, kind: Kind, writable: bool, create: bool) -> Result<(), Error> {
        check_absolute(path)?;
        if let Some(seen) = self.binds.iter_mut().find(|b| b.path == path) {
            if seen.kind != kind {
                return Err(Error::FileAndDir(path.to_owned()));
            }
            seen.writable |= writable;
            seen.create |= create;
            return Ok(());
        }
        self.binds.push(Bind {
            path: path.to_owned(),
            kind,
            writable,
            create,
            follow: false,
        });
        Ok(())
    }
}

/// Number of components below `/`.
fn depth(path: &Path) -> usize {
    path.components().count()
}

fn parent_of(path: &Path) -> Result<PathBuf, Error> {
    check_absolute(path)?;
    match path.parent() {
        Some(parent) if parent != Path::new("/") => Ok(parent.to_owned()),
        _ => Err(Error::RootDirectory(path.to_owned())),
    }
}

/// Absolute, without `.` or `..` components, and not `/` itself.
fn check_absolute(path: &Path) -> Result<(), Error> {
    let mut components = path.components();
    let rooted = components.next() == Some(Component::RootDir);
    let normal = components
        .clone()
        .all(|c| matches!(c, Component::Normal(_)));
    if !rooted || !normal || path.as_os_str().as_encoded_bytes().contains(&b'\0') {
        return Err(Error::RelativePath(path.to_owned()));
    }
    if components.next().is_none() {
        return Err(Error::RootDirectory(path.to_owned()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DiskConfig, ShareConfig, VsockConfig};

    fn vm() -> VmConfig {
        VmConfig {
            kernel: "/data/vmlinux".into(),
            initrd: Some("/data/initrd.gz".into()),
            cmdline: None,
            vcpus: 1,
            memory_mib: 128,
            serial: SerialOutput::Off,
            debugcon: None,
            vsock: Some(VsockConfig {
                guest_cid: 3,
                uds_path: "/run/sb-1/vm.sock".into(),
            }),
            disks: vec![
                DiskConfig {
                    path: "/images/root.ext4".into(),
                    read_only: true,
                    id: None,
                    backing: None,
                },
                DiskConfig {
                    path: "/run/sb-1/scratch.img".into(),
                    read_only: false,
                    id: None,
                    backing: None,
                },
            ],
            shares: vec![
                ShareConfig {
                    tag: "mount0".into(),
                    path: "/home/me/project".into(),
                    read_only: false,
                    owner: None,
                    follow_host_mounts: false,
                },
                ShareConfig {
                    tag: "mount1".into(),
                    path: "/srv/docs".into(),
                    read_only: true,
                    owner: None,
                    follow_host_mounts: false,
                },
            ],
        }
    }

    fn bind(path: &str, kind: Kind, writable: bool) -> Bind {
        Bind {
            path: path.into(),
            kind,
            writable,
            create: false,
            follow: false,
        }
    }

    #[test]
    fn a_vm_gets_exactly_its_files_with_their_rights_parents_first() {
        // Arrange
        let vm = vm();

        // Act
        let plan = MountPlan::for_vm(&vm, Some(Path::new("/run/sb-1/vmm/timings.json"))).unwrap();

        // Assert
        assert_eq!(
            plan.binds,
            [
                bind("/data/initrd.gz", Kind::File, false),
                bind("/data/vmlinux", Kind::File, false),
                bind("/images/root.ext4", Kind::File, false),
                bind("/run/sb-1", Kind::Dir, true),
                bind("/srv/docs", Kind::Dir, false),
                bind("/home/me/project", Kind::Dir, true),
            ]
        );
    }

    #[test]
    fn a_bind_inside_a_directory_with_the_same_rights_is_left_out_a_narrower_one_is_kept() {
        // Arrange
        let mut vm = vm();
        vm.kernel = "/run/sb-1/vmlinux".into();

        // Act
        let plan = MountPlan::for_vm(&vm, Some(Path::new("/run/sb-1/vmm/timings.json"))).unwrap();

        // Assert
        let inside: Vec<&Path> = plan
            .binds
            .iter()
            .map(|b| b.path.as_path())
            .filter(|p| p.starts_with("/run/sb-1") && *p != Path::new("/run/sb-1"))
            .collect();
        assert_eq!(inside, [Path::new("/run/sb-1/vmlinux")]);
    }

    #[test]
    fn console_files_are_created_and_writable() {
        // Arrange
        let mut vm = vm();
        vm.serial = SerialOutput::File("/logs/console.log".into());
        vm.debugcon = Some("/logs/debug.log".into());

        // Act
        let plan = MountPlan::for_vm(&vm, None).unwrap();

        // Assert
        let created: Vec<&Bind> = plan.binds.iter().filter(|b| b.create).collect();
        assert_eq!(created.len(), 2);
        assert!(created.iter().all(|b| b.writable && b.kind == Kind::File));
    }

    #[test]
    fn a_disk_given_twice_is_one_bind_writable_if_either_is() {
        // Arrange
        let mut vm = vm();
        vm.disks[1].path = "/images/root.ext4".into();

        // Act
        let plan = MountPlan::for_vm(&vm, None).unwrap();

        // Assert
        let disk: Vec<&Bind> = plan
            .binds
            .iter()
            .filter(|b| b.path == Path::new("/images/root.ext4"))
            .collect();
        assert_eq!(disk, [&bind("/images/root.ext4", Kind::File, true)]);
    }

    #[test]
    fn relative_and_dotted_paths_are_refused() {
        for path in ["vmlinux", "/data/../etc/vmlinux", "./vmlinux"] {
            // Arrange
            let mut vm = vm();
            vm.kernel = path.into();

            // Act
            let err = MountPlan::for_vm(&vm, None).unwrap_err();

            // Assert
            assert!(matches!(err, Error::RelativePath(_)), "{path}: {err}");
        }
    }

    #[test]
    fn the_host_root_is_never_bound() {
        // Arrange
        let mut vm = vm();
        vm.shares[1].path = "/".into();

        // Act
        let err = MountPlan::for_vm(&vm, None).unwrap_err();

        // Assert
        assert!(matches!(err, Error::RootDirectory(_)), "{err}");
    }

    #[test]
    fn a_socket_directly_in_the_root_directory_is_refused() {
        // Arrange
        let mut vm = vm();
        vm.vsock.as_mut().unwrap().uds_path = "/vm.sock".into();

        // Act
        let err = MountPlan::for_vm(&vm, None).unwrap_err();

        // Assert
        assert!(matches!(err, Error::RootDirectory(_)), "{err}");
    }

    #[test]
    fn one_path_as_file_and_directory_is_refused() {
        // Arrange
        let mut vm = vm();
        vm.shares[1].path = "/data/vmlinux".into();

        // Act
        let err = MountPlan::for_vm(&vm, None).unwrap_err();

        // Assert
        assert!(matches!(err, Error::FileAndDir(_)), "{err}");
    }

    #[test]
    fn a_share_that_follows_host_mounts_is_its_own_bind_even_inside_another() {
        // Arrange
        let mut vm = vm();
        vm.shares[1].path = "/run/sb-1/roots".into();
        vm.shares[1].follow_host_mounts = true;

        // Act
        let plan = MountPlan::for_vm(&vm, None).unwrap();

        // Assert
        let roots = plan
            .binds
            .iter()
            .find(|b| b.path == Path::new("/run/sb-1/roots"));
        assert!(roots.is_some_and(|b| b.follow && !b.writable));
        assert!(plan.follows_host_mounts());
        assert!(!MountPlan::for_vm(&self::vm(), None)
            .unwrap()
            .follows_host_mounts());
    }
}

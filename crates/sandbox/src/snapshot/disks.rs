//! The disks of a snapshot's VM: a restore opens each again by its path (the guest's page cache
//! and file system state in the snapshot's memory describe the file as it was), so the snapshot
//! records what each file was ([`DiskIdentity`]) and a restore refuses a file that changed since
//! (e.g. an image rebuilt under the same name).
//!
//! Every writable disk is saved with the snapshot, as `disk-<index>.img` in the snapshot
//! directory: the sandbox's own (its scratch disk, in its runtime directory, which dies with it)
//! is moved there; a data disk of the caller's (a regular file anywhere else) is copied, holes
//! kept, and the caller's file is not used again by any restore. Every restore gets a
//! copy-on-write disk over each saved one (bulkhead-vmm's `--disk OVERLAY:backing=SAVED`): a new
//! empty sparse overlay in its runtime directory takes the clone's writes, the saved disk, shared
//! read-only by every clone, the rest; nothing is copied before the clone runs. A snapshot of
//! the clone makes its overlay whole first. A writable data disk that is a block device cannot
//! be saved (its size is the device's, its holes unknown): the snapshot is refused. A restore
//! refuses a writable disk that was not saved (a snapshot of an older bulkhead), which every
//! clone would write to at once.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::files;
use crate::sandbox::Error;
use crate::storage::SCRATCH_FILE;

/// A disk of a snapshot's VM as it was when the snapshot was taken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskIdentity {
    /// The file the VMM opened (a restore opens it again).
    pub path: PathBuf,
    /// Whether the VM had it read-only.
    pub read_only: bool,
    /// Its device and inode numbers (`stat(2)`): another file at the same path differs.
    pub device: u64,
    /// See `device`.
    pub inode: u64,
    /// Its size, bytes.
    pub size: u64,
    /// Its modification time, ns since the Unix epoch: a file written in place differs.
    pub modified_ns: i128,
    /// For a writable disk saved with the snapshot: its file in the snapshot directory (the
    /// disk's contents at the snapshot, `size` bytes), each restore's backing image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved: Option<String>,
}

impl DiskIdentity {
    /// The identity of the file at `path` now.
    fn of(path: &Path, read_only: bool) -> std::io::Result<DiskIdentity> {
        let meta = fs::metadata(path)?;
        Ok(DiskIdentity {
            path: path.to_owned(),
            read_only,
            device: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            modified_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            saved: None,
        })
    }
}

/// The identities of the disks the snapshot in `dir` names, taken now (right after the
/// snapshot, with the VM stopped).
///
/// # Errors
/// [`Error::Snapshot`] when the state file cannot be read or a disk cannot be `stat`ed.
pub(super) fn identities(dir: &Path) -> Result<Vec<DiskIdentity>, Error> {
    let disks = bulkhead_vmm::snapshot::disks(dir)
        .map_err(|e| Error::Snapshot(format!("{}: {e}", dir.display())))?;
    disks
        .iter()
        .map(|d| {
            DiskIdentity::of(&d.path, d.read_only)
                .map_err(|e| Error::Snapshot(format!("the VM's disk {}: {e}", d.path.display())))
        })
        .collect()
}

/// Saves each writable disk of `disks` into the snapshot directory `dir` and records it there
/// ([`DiskIdentity::saved`]): one in the sandbox's runtime directory `runtime` (its scratch
/// disk, which dies with it) is moved, any other (a data disk of the caller's) copied with its
/// holes. Call with the VMM stopped.
///
/// # Errors
/// [`Error::Snapshot`] when a disk is no regular file or cannot be moved or copied.
pub(super) fn save(dir: &Path, runtime: &Path, disks: &mut [DiskIdentity]) -> Result<(), Error> {
    for (index, disk) in disks.iter_mut().enumerate() {
        if disk.read_only {
            continue;
        }
        let name = format!("disk-{index}.img");
        let target = dir.join(&name);
        // (An empty path is a prefix of every path.)
        let own = !runtime.as_os_str().is_empty() && disk.path.starts_with(runtime);
        let saved = match own {
            true => files::move_file(&disk.path, &target),
            false => copy_data_disk(&disk.path, &target),
        };
        saved.map_err(|e| {
            Error::Snapshot(format!(
                "cannot save the writable disk {} into {}: {e}",
                disk.path.display(),
                dir.display()
            ))
        })?;
        disk.saved = Some(name);
    }
    Ok(())
}

/// Copies the caller's data disk `src` to `dst`, holes kept; refuses anything but a regular
/// file.
fn copy_data_disk(src: &Path, dst: &Path) -> std::io::Result<()> {
    if !fs::metadata(src)?.is_file() {
        return Err(std::io::Error::other(
            "only a regular file can be saved with a snapshot (this is a device or another \
             special file); attach it read-only (`:ro`) or use a disk image file",
        ));
    }
    files::copy_sparse(src, dst)
}

/// The `--disk` arguments of a restore of the snapshot in `dir` into the runtime directory
/// `runtime`: for each saved disk a copy-on-write disk over the saved file, its overlay a new
/// sparse file there (the scratch disk's under its own name, [`SCRATCH_FILE`], where the daemon
/// looks for a dead VM's scratch disk; any other under the saved file's name); every other
/// disk at its path. Empty when no disk was saved (the VMM then opens the saved paths).
///
/// # Errors
/// [`Error::Snapshot`] when an overlay cannot be created.
pub(super) fn restore_args(
    dir: &Path,
    runtime: &Path,
    disks: &[DiskIdentity],
) -> Result<Vec<std::ffi::OsString>, Error> {
    if disks.iter().all(|d| d.saved.is_none()) {
        return Ok(Vec::new());
    }
    let mut args = Vec::new();
    for disk in disks {
        let arg = match &disk.saved {
            Some(name) => {
                let scratch = runtime.join(SCRATCH_FILE);
                let overlay = match disk.path.file_name() {
                    Some(n) if n == SCRATCH_FILE && !scratch.exists() => scratch,
                    _ => runtime.join(name),
                };
                new_overlay(&overlay, disk.size).map_err(|e| {
                    Error::Snapshot(format!(
                        "cannot create the disk {} over the saved disk {name}: {e}",
                        overlay.display()
                    ))
                })?;
                let mut arg = overlay.into_os_string();
                arg.push(":rw:backing=");
                arg.push(dir.join(name));
                arg
            }
            None => {
                let mut arg = disk.path.clone().into_os_string();
                arg.push(if disk.read_only { ":ro" } else { ":rw" });
                arg
            }
        };
        args.extend(["--disk".into(), arg]);
    }
    Ok(args)
}

/// A new empty sparse file of `size` bytes at `path`, mode 0600 (the overlay of a copy-on-write
/// disk).
fn new_overlay(path: &Path, size: u64) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?
        .set_len(size)
}

/// Refuses a restore of the snapshot in `dir` whose `disks` cannot be used as they are: a
/// writable one not saved with it, one whose file is missing or changed since the snapshot, or
/// a saved one that is missing or of another size.
///
/// # Errors
/// [`Error::Snapshot`] naming the disk and what to do.
pub(super) fn check(dir: &Path, disks: &[DiskIdentity]) -> Result<(), Error> {
    for disk in disks {
        let path = disk.path.display();
        if let Some(name) = &disk.saved {
            let saved = dir.join(name);
            let size = fs::metadata(&saved).map(|m| m.len());
            if size.as_ref().ok() != Some(&disk.size) {
                return Err(Error::Snapshot(format!(
                    "its saved disk {} is missing or damaged ({}): it cannot be restored; make \
                     the template again",
                    saved.display(),
                    match size {
                        Ok(n) => format!("{n} bytes, not {}", disk.size),
                        Err(e) => e.to_string(),
                    }
                )));
            }
            continue;
        }
        if !disk.read_only {
            return Err(Error::Snapshot(format!(
                "the snapshot's VM had the writable disk {path}: restores would all write to \
                 it; only read-only disks (a root filesystem image) can be restored"
            )));
        }
        let now = DiskIdentity::of(&disk.path, disk.read_only).map_err(|e| {
            Error::Snapshot(format!("the snapshot's disk {path} cannot be opened: {e}"))
        })?;
        if now != *disk {
            return Err(Error::Snapshot(format!(
                "the snapshot's disk {path} changed since the snapshot was taken (another file \
                 or new contents, e.g. an image built again): its guest would see a disk that \
                 is not the one it knew; make the template again"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn an_unchanged_read_only_disk_passes_and_a_changed_or_writable_one_is_refused() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rootfs.ext4");
        fs::write(&path, b"image").unwrap();
        let taken = DiskIdentity::of(&path, true).unwrap();
        let writable = DiskIdentity {
            read_only: false,
            ..taken.clone()
        };

        // Act
        let unchanged = check(dir.path(), std::slice::from_ref(&taken));
        let refused_writable = check(dir.path(), &[writable]);
        fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b" rebuilt")
            .unwrap();
        let changed = check(dir.path(), std::slice::from_ref(&taken));
        fs::remove_file(&path).unwrap();
        let missing = check(dir.path(), &[taken]);

        // Assert
        assert!(unchanged.is_ok(), "{unchanged:?}");
        let message = |r: Result<(), Error>| r.unwrap_err().to_string();
        assert!(message(refused_writable).contains("writable disk"));
        assert!(message(changed).contains("changed since the snapshot"));
        assert!(message(missing).contains("cannot be opened"));
    }

    #[test]
    fn an_own_writable_disk_is_saved_and_each_restore_gets_an_overlay_over_it() {
        // Arrange: a read-only image outside the runtime directory, a scratch disk inside it.
        let (root, runtime, snapshot, clone) = three_dirs();
        let image = root.path().join("rootfs.ext4");
        fs::write(&image, b"image").unwrap();
        let scratch = runtime.join("scratch.ext4");
        fs::write(&scratch, b"the guest's files").unwrap();
        let mut disks = vec![
            DiskIdentity::of(&image, true).unwrap(),
            DiskIdentity::of(&scratch, false).unwrap(),
        ];

        // Act
        save(&snapshot, &runtime, &mut disks).unwrap();
        let checked = check(&snapshot, &disks);
        let args = restore_args(&snapshot, &clone, &disks).unwrap();
        let overlay = fs::read(clone.join("scratch.ext4")).unwrap();
        let again = restore_args(&snapshot, &clone, &disks).unwrap();
        let saved_after_two_restores = fs::read(snapshot.join("disk-1.img")).unwrap();
        let truncated = fs::write(snapshot.join("disk-1.img"), b"short");
        let damaged = check(&snapshot, &disks);

        // Assert
        assert!(checked.is_ok(), "{checked:?}");
        assert!(
            !scratch.exists(),
            "the scratch disk moved into the snapshot"
        );
        assert_eq!(disks[1].saved.as_deref(), Some("disk-1.img"));
        let args: Vec<String> = args.iter().map(|a| a.to_string_lossy().into()).collect();
        let saved = snapshot.join("disk-1.img");
        let overlay_arg = |file: &str| {
            let path = clone.join(file);
            format!("{}:rw:backing={}", path.display(), saved.display())
        };
        assert_eq!(
            args,
            [
                "--disk".to_owned(),
                format!("{}:ro", image.display()),
                "--disk".to_owned(),
                overlay_arg("scratch.ext4"),
            ]
        );
        assert_eq!(
            overlay,
            vec![0; b"the guest's files".len()],
            "sparse, the disk's size"
        );
        let again: Vec<String> = again.iter().map(|a| a.to_string_lossy().into()).collect();
        assert_eq!(again[3], overlay_arg("disk-1.img"), "scratch.ext4 is taken");
        assert_eq!(saved_after_two_restores, b"the guest's files");
        truncated.unwrap();
        assert!(message_of(damaged).contains("missing or damaged"));
    }

    #[test]
    fn a_callers_data_disk_is_copied_and_left_alone_and_a_device_is_refused() {
        // Arrange: a writable data disk outside the runtime directory, with a hole.
        let (root, runtime, snapshot, clone) = three_dirs();
        let data = root.path().join("data.img");
        let file = fs::File::create(&data).unwrap();
        file.set_len(1 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&file, b"the caller's data", 512 << 10).unwrap();
        let mut disks = vec![DiskIdentity::of(&data, false).unwrap()];
        let mut device = vec![DiskIdentity::of(Path::new("/dev/null"), false).unwrap()];

        // Act
        let saved = save(&snapshot, &runtime, &mut disks);
        let args = restore_args(&snapshot, &clone, &disks).unwrap();
        let refused = save(&snapshot, &runtime, &mut device);

        // Assert: saved as disk-0.img with the same bytes, the caller's file still there and
        // unchanged, and the clone's overlay named after the saved file.
        assert!(saved.is_ok(), "{saved:?}");
        assert_eq!(disks[0].saved.as_deref(), Some("disk-0.img"));
        let copy = snapshot.join("disk-0.img");
        assert_eq!(fs::read(&copy).unwrap(), fs::read(&data).unwrap());
        assert_eq!(DiskIdentity::of(&data, false).unwrap(), {
            let mut before = disks[0].clone();
            before.saved = None;
            before
        });
        assert!(check(&snapshot, &disks).is_ok());
        let args: Vec<String> = args.iter().map(|a| a.to_string_lossy().into()).collect();
        let overlay = clone.join("disk-0.img");
        assert_eq!(
            args,
            [
                "--disk".to_owned(),
                format!("{}:rw:backing={}", overlay.display(), copy.display())
            ]
        );
        let message = message_of(refused);
        assert!(
            message.contains("/dev/null") && message.contains("regular file"),
            "{message}"
        );
        assert_eq!(device[0].saved, None);
    }

    /// A temporary directory holding a sandbox's runtime directory, a snapshot directory and a
    /// clone's runtime directory.
    fn three_dirs() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let [runtime, snapshot, clone] = ["run", "snap", "clone"].map(|d| root.path().join(d));
        for d in [&runtime, &snapshot, &clone] {
            fs::create_dir(d).unwrap();
        }
        (root, runtime, snapshot, clone)
    }

    fn message_of(result: Result<(), Error>) -> String {
        result.unwrap_err().to_string()
    }
}

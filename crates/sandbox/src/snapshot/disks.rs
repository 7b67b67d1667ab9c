//! The disks of a snapshot's VM: a restore opens each again by its path (the guest's page cache
//! and file system state in the snapshot's memory describe the file as it was), so the snapshot
//! records what each file was ([`DiskIdentity`]) and a restore refuses a file that changed since
//! (e.g. an image rebuilt under the same name), and a writable disk, which every clone would
//! write to at once.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox::Error;

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

/// Refuses a restore of a snapshot whose `disks` cannot be shared as they are: a writable one,
/// or one whose file is missing or changed since the snapshot.
///
/// # Errors
/// [`Error::Snapshot`] naming the disk and what to do.
pub(super) fn check(disks: &[DiskIdentity]) -> Result<(), Error> {
    for disk in disks {
        let path = disk.path.display();
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
        let unchanged = check(std::slice::from_ref(&taken));
        let refused_writable = check(&[writable]);
        fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b" rebuilt")
            .unwrap();
        let changed = check(std::slice::from_ref(&taken));
        fs::remove_file(&path).unwrap();
        let missing = check(&[taken]);

        // Assert
        assert!(unchanged.is_ok(), "{unchanged:?}");
        let message = |r: Result<(), Error>| r.unwrap_err().to_string();
        assert!(message(refused_writable).contains("writable disk"));
        assert!(message(changed).contains("changed since the snapshot"));
        assert!(message(missing).contains("cannot be opened"));
    }
}

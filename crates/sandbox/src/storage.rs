//! A sandbox's disks: a shared read-only root filesystem image, a private scratch disk for the
//! writable layer, and extra data disks.
//!
//! Order of the virtio-blk disks (the guest names them `/dev/vda`, `/dev/vdb`, ... in that
//! order):
//!
//! 1. the root image, read-only, when [`Storage::root_image`] is set; the kernel command line
//!    gets `bulkhead.root=/dev/vda` and the guest agent builds an overlay root on it (see the
//!    agent's `rootfs` module);
//! 2. the scratch disk, when [`Storage::scratch_mib`] is set: a sparse file `scratch.ext4` in
//!    the sandbox's runtime directory, formatted ext4 on the host (`mkfs.ext4`, no journal: it
//!    lives exactly as long as the sandbox) and passed as `bulkhead.overlay=/dev/vdb`; without
//!    it the writable layer is a tmpfs in guest RAM. It is deleted with the runtime directory;
//! 3. the data disks, as given.
//!
//! Everything is checked on the host before the VM starts, so bad input is a clear error
//! rather than a VM that fails to boot.

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_image::ext4::{self, InspectError};
use bulkhead_protocol::boot::{Overlay, RootParam};
use bulkhead_vmm::config::DiskConfig;
use bulkhead_vmm::devices::virtio::block::SECTOR_SIZE;

/// File name of the scratch disk in the sandbox's runtime directory.
pub const SCRATCH_FILE: &str = "scratch.ext4";

/// Guest device of the root image.
pub const ROOT_DEVICE: &str = "/dev/vda";

/// Guest device of the scratch disk (it follows the root image).
pub const SCRATCH_DEVICE: &str = "/dev/vdb";

/// Smallest scratch disk, in MiB (ext4 needs a few MiB of metadata).
pub const MIN_SCRATCH_MIB: u64 = 8;

/// Bytes in a MiB.
const MIB: u64 = 1 << 20;

/// What disks a sandbox gets. The default is none: the initramfs is the root, as before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Storage {
    /// Root filesystem image: an ext4 file (an image store's `rootfs.ext4`), attached
    /// read-only and shared by every sandbox using it.
    pub root_image: Option<PathBuf>,
    /// Size of the per-sandbox scratch disk holding the writable layer, in MiB (sparse: only
    /// what the guest writes takes space). `None`: the writable layer is a tmpfs.
    pub scratch_mib: Option<u64>,
    /// Extra data disks, attached after the root image and the scratch disk.
    pub data_disks: Vec<DiskConfig>,
}

/// Invalid storage requests and failures preparing the disks.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The root image does not exist.
    #[error("root image {} not found", path.display())]
    ImageNotFound {
        /// The path given.
        path: PathBuf,
    },
    /// The root image is not a whole ext4 file system.
    #[error("bad root image: {0}")]
    BadImage(#[from] InspectError),
    /// A scratch disk was asked for without a root image (nothing would use it).
    #[error("a scratch disk (--disk) needs a root image (--image)")]
    ScratchWithoutImage,
    /// The scratch disk is too small to hold a file system.
    #[error("scratch disk of {0} MiB is too small (at least {MIN_SCRATCH_MIB} MiB)")]
    ScratchTooSmall(u64),
    /// The scratch disk is larger than the free space where it would live.
    #[error("scratch disk of {requested_mib} MiB is larger than the {available_mib} MiB free in {}", dir.display())]
    ScratchTooLarge {
        /// Requested size.
        requested_mib: u64,
        /// Free space for unprivileged users on that file system.
        available_mib: u64,
        /// The directory the scratch file would be created in.
        dir: PathBuf,
    },
    /// A data disk does not exist.
    #[error("disk file {} not found", path.display())]
    DiskNotFound {
        /// The path given.
        path: PathBuf,
    },
    /// A data disk is neither a regular file nor a block device.
    #[error("disk file {} is not a regular file or block device", path.display())]
    NotADisk {
        /// The path given.
        path: PathBuf,
    },
    /// A data disk to be attached read-write cannot be opened for writing.
    #[error("disk file {} is not writable ({source}); attach it read-only with {}:ro", path.display(), path.display())]
    DiskNotWritable {
        /// The path given.
        path: PathBuf,
        /// Why it cannot be opened for writing.
        source: io::Error,
    },
    /// The same file (the same inode, whatever the path) is attached more than once, as root
    /// image or data disk, and not read-only every time: the guest would see one disk change
    /// under the other, and a root image would change for every later sandbox.
    #[error("disk file {} is attached more than once and not read-only every time; attach it once, or read-only (PATH:ro) each time", path.display())]
    DiskAttachedTwice {
        /// The path of the second attachment.
        path: PathBuf,
    },
    /// A data disk file's size is not a whole number of sectors: virtio-blk counts a disk's
    /// capacity in 512-byte sectors (virtio 1.2 §5.2.4), so the guest would not see its tail.
    #[error("disk file {} is {bytes} bytes, not a whole number of 512-byte sectors: the guest would not see its last {} bytes (pad it: truncate -s %512 {})", path.display(), bytes % SECTOR_SIZE, path.display())]
    DiskNotWholeSectors {
        /// The path given.
        path: PathBuf,
        /// Its size in bytes.
        bytes: u64,
    },
    /// A disk cannot be opened for reading.
    #[error("disk file {}: {source}", path.display())]
    DiskUnreadable {
        /// The path given.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Creating or sizing the scratch file failed.
    #[error("creating the scratch disk {}: {source}", path.display())]
    Scratch {
        /// The scratch file.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// Formatting the scratch disk failed.
    #[error("formatting the scratch disk with mkfs.ext4: {0}")]
    Mkfs(String),
}

/// The disks and boot parameter that [`prepare`] produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Prepared {
    /// virtio-blk disks in guest order.
    pub disks: Vec<DiskConfig>,
    /// The agent's root image and its writable layer (`bulkhead.root=`, `bulkhead.overlay=`).
    pub root: Option<RootParam>,
}

/// Checks everything that can be checked before the runtime directory exists: the root image
/// is a whole ext4 file system, every data disk exists and opens in its mode, the scratch size
/// is sane and fits into the free space under `runtime_parent`.
///
/// # Errors
/// The [`StorageError`] describing the first problem.
pub fn check(storage: &Storage, runtime_parent: &Path) -> Result<(), StorageError> {
    if let Some(image) = &storage.root_image {
        check_image(image)?;
    } else if storage.scratch_mib.is_some() {
        return Err(StorageError::ScratchWithoutImage);
    }
    for disk in &storage.data_disks {
        check_disk(disk)?;
    }
    check_writable_disks_attached_once(storage)?;
    if let Some(mib) = storage.scratch_mib {
        check_scratch_size(mib, runtime_parent)?;
    }
    Ok(())
}

fn check_image(path: &Path) -> Result<(), StorageError> {
    if !path.exists() {
        return Err(StorageError::ImageNotFound {
            path: path.to_owned(),
        });
    }
    ext4::inspect(path)?;
    Ok(())
}

/// Refuses a file attached twice unless every attachment is read-only (the root image always
/// is). Files are told apart by device and inode; paths that cannot be read are left to the
/// other checks.
fn check_writable_disks_attached_once(storage: &Storage) -> Result<(), StorageError> {
    let root = storage.root_image.iter().map(|path| (path.as_path(), true));
    let data = storage
        .data_disks
        .iter()
        .map(|disk| (disk.path.as_path(), disk.read_only));
    let mut seen: Vec<((u64, u64), bool)> = Vec::new();
    for (path, read_only) in root.chain(data) {
        let Ok(meta) = fs::metadata(path) else {
            continue;
        };
        let id = (meta.dev(), meta.ino());
        let clash = seen
            .iter()
            .any(|&(other, other_ro)| other == id && !(read_only && other_ro));
        if clash {
            return Err(StorageError::DiskAttachedTwice {
                path: path.to_owned(),
            });
        }
        seen.push((id, read_only));
    }
    Ok(())
}

fn check_disk(disk: &DiskConfig) -> Result<(), StorageError> {
    let path = &disk.path;
    let meta = fs::metadata(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => StorageError::DiskNotFound { path: path.clone() },
        _ => StorageError::DiskUnreadable {
            path: path.clone(),
            source,
        },
    })?;
    let file_type = meta.file_type();
    if !file_type.is_file() && !std::os::unix::fs::FileTypeExt::is_block_device(&file_type) {
        return Err(StorageError::NotADisk { path: path.clone() });
    }
    if file_type.is_file() && meta.len() % SECTOR_SIZE != 0 {
        return Err(StorageError::DiskNotWholeSectors {
            path: path.clone(),
            bytes: meta.len(),
        });
    }
    OpenOptions::new()
        .read(true)
        .write(!disk.read_only)
        .open(path)
        .map(drop)
        .map_err(|source| match source.kind() {
            _ if disk.read_only => StorageError::DiskUnreadable {
                path: path.clone(),
                source,
            },
            _ => StorageError::DiskNotWritable {
                path: path.clone(),
                source,
            },
        })
}

fn check_scratch_size(mib: u64, dir: &Path) -> Result<(), StorageError> {
    if mib < MIN_SCRATCH_MIB {
        return Err(StorageError::ScratchTooSmall(mib));
    }
    let existing = nearest_existing(dir);
    let available_mib = available_bytes(&existing).map_err(|source| StorageError::Scratch {
        path: existing.clone(),
        source,
    })? / MIB;
    if mib > available_mib {
        return Err(StorageError::ScratchTooLarge {
            requested_mib: mib,
            available_mib,
            dir: existing,
        });
    }
    Ok(())
}

/// `dir` or its nearest existing ancestor (the runtime directory is created on first use).
fn nearest_existing(dir: &Path) -> PathBuf {
    dir.ancestors()
        .find(|d| d.exists())
        .unwrap_or(Path::new("/"))
        .to_owned()
}

/// Bytes free for unprivileged users on the file system holding `path` (statvfs(3):
/// `f_bavail * f_frsize`).
fn available_bytes(path: &Path) -> io::Result<u64> {
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and outlives the call; `stat` is a valid out pointer.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Creates the scratch disk (if any) in `runtime_dir` and returns the disks in guest order and
/// the kernel parameters. Call after [`check`].
///
/// # Errors
/// [`StorageError::Scratch`] and [`StorageError::Mkfs`].
pub(crate) fn prepare(storage: &Storage, runtime_dir: &Path) -> Result<Prepared, StorageError> {
    let mut prepared = Prepared::default();
    if let Some(image) = &storage.root_image {
        prepared.disks.push(DiskConfig {
            path: image.clone(),
            read_only: true,
            id: Some("bulkhead-root".to_owned()),
            backing: None,
        });
        let mut overlay = Overlay::Tmpfs;
        if let Some(mib) = storage.scratch_mib {
            let path = runtime_dir.join(SCRATCH_FILE);
            make_scratch(&path, mib)?;
            prepared.disks.push(DiskConfig {
                path,
                read_only: false,
                id: Some("bulkhead-scratch".to_owned()),
                backing: None,
            });
            overlay = Overlay::Device(SCRATCH_DEVICE.to_owned());
        }
        prepared.root = Some(RootParam {
            device: ROOT_DEVICE.to_owned(),
            overlay,
        });
    }
    prepared.disks.extend(storage.data_disks.iter().cloned());
    Ok(prepared)
}

/// The `mkfs.ext4` arguments formatting the scratch file `path`: no journal (the disk dies
/// with the sandbox), no reserved blocks, inode tables initialised lazily (the guest mounts it
/// with `noinit_itable`), no discard pass over the sparse file.
pub fn scratch_mkfs_args(path: &Path) -> Vec<String> {
    [
        "-q",
        "-F",
        "-t",
        "ext4",
        "-O",
        "^has_journal",
        "-m",
        "0",
        "-E",
        "lazy_itable_init=1,nodiscard",
        "-L",
        "bulkhead-scratch",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain([path.display().to_string()])
    .collect()
}

fn make_scratch(path: &Path, mib: u64) -> Result<(), StorageError> {
    let scratch_err = |source| StorageError::Scratch {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(scratch_err)?;
    file.set_len(mib * MIB).map_err(scratch_err)?;
    drop(file);
    let output = Command::new("mkfs.ext4")
        .args(scratch_mkfs_args(path))
        .env("PATH", ext4::tool_path())
        .output()
        .map_err(|e| StorageError::Mkfs(format!("{e} (install e2fsprogs)")))?;
    if output.status.success() {
        return Ok(());
    }
    Err(StorageError::Mkfs(format!(
        "{}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(path: &Path, read_only: bool) -> DiskConfig {
        DiskConfig {
            path: path.to_owned(),
            read_only,
            id: None,
            backing: None,
        }
    }

    #[test]
    fn no_storage_means_no_disks_and_no_parameters() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();

        // Act
        let prepared = prepare(&Storage::default(), dir.path()).unwrap();

        // Assert
        assert_eq!(prepared, Prepared::default());
    }

    #[test]
    fn a_missing_image_is_reported_by_path() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage {
            root_image: Some(dir.path().join("nope.ext4")),
            ..Storage::default()
        };

        // Act
        let err = check(&storage, dir.path()).unwrap_err();

        // Assert
        assert!(matches!(err, StorageError::ImageNotFound { .. }), "{err}");
        assert!(err.to_string().contains("nope.ext4"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_ext4_is_refused() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("junk.img");
        fs::write(&image, vec![7u8; 8192]).unwrap();
        let storage = Storage {
            root_image: Some(image),
            ..Storage::default()
        };

        // Act
        let err = check(&storage, dir.path()).unwrap_err();

        // Assert
        assert!(err.to_string().contains("not an ext4"), "{err}");
    }

    #[test]
    fn scratch_without_image_and_absurd_sizes_are_refused() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let scratch_only = Storage {
            scratch_mib: Some(64),
            ..Storage::default()
        };

        // Act
        let without_image = check(&scratch_only, dir.path()).unwrap_err();
        let tiny = check_scratch_size(1, dir.path()).unwrap_err();
        let huge = check_scratch_size(u64::MAX / MIB, &dir.path().join("not/yet")).unwrap_err();

        // Assert
        assert!(matches!(without_image, StorageError::ScratchWithoutImage));
        assert!(matches!(tiny, StorageError::ScratchTooSmall(1)));
        assert!(
            matches!(&huge, StorageError::ScratchTooLarge { dir: d, .. } if d == dir.path()),
            "{huge}"
        );
    }

    #[test]
    fn data_disks_are_checked_for_existence_and_writability() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let missing = disk(&dir.path().join("missing.img"), false);
        let directory = disk(dir.path(), true);

        // Act
        let missing_err = check_disk(&missing).unwrap_err();
        let dir_err = check_disk(&directory).unwrap_err();

        // Assert
        assert!(matches!(missing_err, StorageError::DiskNotFound { .. }));
        assert!(matches!(dir_err, StorageError::NotADisk { .. }));
    }

    #[test]
    fn a_disk_file_that_ends_inside_a_sector_is_refused_with_the_bytes_the_guest_would_lose() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("odd.img");
        fs::write(&odd, vec![7u8; 1000]).unwrap();
        let whole = dir.path().join("whole.img");
        fs::write(&whole, vec![7u8; 1024]).unwrap();

        // Act
        let odd_err = check_disk(&disk(&odd, true)).unwrap_err();
        let whole_ok = check_disk(&disk(&whole, true));

        // Assert
        assert!(
            matches!(
                odd_err,
                StorageError::DiskNotWholeSectors { bytes: 1000, .. }
            ),
            "{odd_err}"
        );
        assert!(odd_err.to_string().contains("last 488 bytes"), "{odd_err}");
        assert!(whole_ok.is_ok(), "{whole_ok:?}");
    }

    #[test]
    fn a_file_attached_twice_is_refused_unless_read_only_each_time() {
        // Arrange: one file under two names (a hard link), and another file.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("data.img");
        fs::write(&file, vec![0u8; 4096]).unwrap();
        let link = dir.path().join("alias.img");
        fs::hard_link(&file, &link).unwrap();
        let other = dir.path().join("other.img");
        fs::write(&other, vec![0u8; 4096]).unwrap();
        let with = |root: Option<&Path>, disks: Vec<DiskConfig>| Storage {
            root_image: root.map(Path::to_owned),
            scratch_mib: None,
            data_disks: disks,
        };

        // Act
        let twice_rw = with(None, vec![disk(&file, false), disk(&link, false)]);
        let rw_and_ro = with(None, vec![disk(&file, true), disk(&file, false)]);
        let root_and_rw = with(Some(&file), vec![disk(&link, false)]);
        let all_ro = with(Some(&file), vec![disk(&file, true), disk(&link, true)]);
        let different = with(None, vec![disk(&file, false), disk(&other, false)]);

        // Assert
        for refused in [twice_rw, rw_and_ro, root_and_rw] {
            let err = check_writable_disks_attached_once(&refused).unwrap_err();
            assert!(
                matches!(err, StorageError::DiskAttachedTwice { .. }),
                "{err}"
            );
        }
        assert!(check_writable_disks_attached_once(&all_ro).is_ok());
        assert!(check_writable_disks_attached_once(&different).is_ok());
    }

    #[test]
    fn disks_come_in_guest_order_with_the_agent_parameters() {
        // Arrange: a root image without scratch keeps the tmpfs overlay.
        let dir = tempfile::tempdir().unwrap();
        let data = disk(&dir.path().join("data.img"), false);
        let storage = Storage {
            root_image: Some(dir.path().join("rootfs.ext4")),
            scratch_mib: None,
            data_disks: vec![data.clone()],
        };

        // Act
        let prepared = prepare(&storage, dir.path()).unwrap();

        // Assert
        assert_eq!(
            prepared.root,
            Some(RootParam {
                device: "/dev/vda".into(),
                overlay: Overlay::Tmpfs
            })
        );
        assert_eq!(prepared.disks.len(), 2);
        assert!(prepared.disks[0].read_only);
        assert_eq!(prepared.disks[1], data);
    }

    #[test]
    fn scratch_mkfs_makes_a_journal_less_ext4_of_the_file() {
        // Arrange / Act
        let args = scratch_mkfs_args(Path::new("/run/sb/scratch.ext4"));

        // Assert
        let joined = args.join(" ");
        assert!(joined.contains("-t ext4 -O ^has_journal"), "{joined}");
        assert!(joined.ends_with("/run/sb/scratch.ext4"), "{joined}");
    }
}

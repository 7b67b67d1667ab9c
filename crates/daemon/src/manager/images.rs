//! Root filesystem images for daemon sandboxes: a request's `image` names an image of the image
//! store (`bulkhead image build | ls | rm`, crate `bulkhead-image`), attached read-only as the
//! guest's `/dev/vda`; `disk_mib` adds a per-sandbox sparse scratch disk for the writable layer
//! (else the layer is a tmpfs in guest RAM). `bulkhead-sandbox`'s [`Storage`] does the rest, as
//! for `bulkhead run --image`.
//!
//! The scratch disk is `scratch.ext4` in the sandbox's runtime directory, so everything that
//! removes that directory (DELETE, TTL, shutdown, recovery) removes it too; a VM that ends by
//! itself keeps its runtime directory for its logs, but not its scratch disk
//! ([`remove_scratch`]).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use bulkhead_client::CreateSandbox;
use bulkhead_image::{ImageStore, StoreError};
use bulkhead_sandbox::storage::{self, MIN_SCRATCH_MIB, SCRATCH_FILE};
use bulkhead_sandbox::{Storage, StorageError};

use super::ManagerError;
use crate::config::Config;

/// `f_type` of tmpfs in statfs(2) (`TMPFS_MAGIC`, linux/magic.h).
const TMPFS_MAGIC: u64 = 0x0102_1994;
/// `f_type` of ramfs in statfs(2) (`RAMFS_MAGIC`, linux/magic.h).
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// The disks of `spec`: its image resolved in the daemon's image store and its scratch size,
/// checked (whole ext4 image, scratch size within bounds and the free space of the runtime
/// root). No image: no disks, the initramfs is the root.
///
/// # Errors
/// [`ManagerError::Invalid`] for bad names, unknown images, a `disk_mib` without an image or out
/// of range; [`ManagerError::Internal`] for a damaged or unreadable store.
pub fn storage_of(config: &Config, spec: &CreateSandbox) -> Result<Storage, ManagerError> {
    check_disk_mib(config, spec)?;
    let Some(name) = spec.image.as_deref() else {
        return Ok(Storage::default());
    };
    let store = config.image_store();
    let image = store.get(name).map_err(|e| store_error(&store, name, e))?;
    let storage = Storage {
        root_image: Some(image.rootfs),
        scratch_mib: spec.disk_mib,
        data_disks: Vec::new(),
    };
    storage::check(&storage, &config.vm_runtime_root()).map_err(|e| match e {
        StorageError::ScratchTooSmall(_) | StorageError::ScratchTooLarge { .. } => {
            ManagerError::Invalid(format!("disk_mib: {e}"))
        }
        other => ManagerError::Internal(format!("image {name:?}: {other}")),
    })?;
    Ok(storage)
}

/// Checks `disk_mib` alone (no file system access): it needs an image and must lie within
/// [`MIN_SCRATCH_MIB`]`..=max_disk_mib`.
///
/// # Errors
/// [`ManagerError::Invalid`].
pub fn check_disk_mib(config: &Config, spec: &CreateSandbox) -> Result<(), ManagerError> {
    let Some(mib) = spec.disk_mib else {
        return Ok(());
    };
    if spec.image.is_none() {
        return Err(ManagerError::Invalid(
            "disk_mib needs an image: the scratch disk holds the image's writable layer".into(),
        ));
    }
    if !(MIN_SCRATCH_MIB..=config.max_disk_mib).contains(&mib) {
        return Err(ManagerError::Invalid(format!(
            "disk_mib must be between {MIN_SCRATCH_MIB} and {}",
            config.max_disk_mib
        )));
    }
    Ok(())
}

/// The API error for a failed lookup of `name`: the client's mistake (400) unless the store
/// itself is broken (500).
fn store_error(store: &ImageStore, name: &str, err: StoreError) -> ManagerError {
    match err {
        StoreError::Spec(e) => ManagerError::Invalid(e.to_string()),
        StoreError::NotFound { .. } => {
            let names: Vec<String> = store
                .list()
                .unwrap_or_default()
                .into_iter()
                .map(|m| m.name)
                .collect();
            let known = match names.is_empty() {
                true => "none".to_owned(),
                false => names.join(", "),
            };
            ManagerError::Invalid(format!(
                "unknown image {name:?}: the daemon's image store has {known} (`bulkhead image build` adds images)"
            ))
        }
        StoreError::NotAnImage { .. } => ManagerError::Invalid(format!(
            "{name:?} is not an image of the daemon's image store (its directory has no manifest.json; \
             initramfs images are no longer selected by `image`)"
        )),
        other => ManagerError::Internal(other.to_string()),
    }
}

/// Whether the file system holding `path` (or its nearest existing ancestor) keeps its files in
/// RAM (tmpfs, ramfs). A scratch disk there is host memory, charged to the memory cgroup of the
/// process writing it, the VMM; unknown file systems count as not RAM-backed.
pub fn is_ram_backed(path: &Path) -> bool {
    let Some(existing) = path.ancestors().find(|d| d.exists()) else {
        return false;
    };
    let Ok(c_path) = CString::new(existing.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is NUL-terminated and outlives the call; `stat` is a valid out pointer.
    if unsafe { libc::statfs(c_path.as_ptr(), &mut stat) } != 0 {
        return false;
    }
    // f_type's C type differs between libcs (signed on glibc); compare the magic's 32 bits.
    let magic = u64::from(stat.f_type as u32);
    magic == TMPFS_MAGIC || magic == RAMFS_MAGIC
}

/// Deletes the scratch disk in the sandbox runtime directory `runtime_dir`, if any (a VM that
/// ended keeps its directory for `logs`, but its writable layer is of no further use). Logs
/// failures other than absence.
pub fn remove_scratch(runtime_dir: &Path) {
    let path = runtime_dir.join(SCRATCH_FILE);
    match std::fs::remove_file(&path) {
        Ok(()) => tracing::info!("removed the scratch disk {}", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::error!("cannot remove the scratch disk {}: {e}", path.display()),
    }
}

/// An image store with fake images, for tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::Path;

    use bulkhead_image::builder::{BuildError, RootfsBuilder};
    use bulkhead_image::ext4::{EXT4_MAGIC, MAGIC_OFFSET};
    use bulkhead_image::{BuildSpec, ImageStore, Progress};

    /// Writes a one-block (4 KiB) file with an ext4 superblock: enough for the store's and
    /// the sandbox's checks, which read the superblock only.
    struct OneBlockBuilder;

    impl RootfsBuilder for OneBlockBuilder {
        fn build(
            &self,
            _spec: &BuildSpec,
            _work_dir: &Path,
            image: &Path,
            _progress: &mut dyn FnMut(Progress),
        ) -> Result<(), BuildError> {
            let mut bytes = vec![0u8; 4096];
            bytes[1024 + 0x4] = 1; // s_blocks_count_lo = 1
            bytes[1024 + 0x18] = 2; // s_log_block_size = 2: 4 KiB blocks
            let magic = MAGIC_OFFSET as usize;
            bytes[magic..magic + 2].copy_from_slice(&EXT4_MAGIC.to_le_bytes());
            std::fs::write(image, bytes).expect("write the fake image");
            Ok(())
        }
    }

    /// The store in `images_dir` with one fake image per name.
    pub fn store_with(images_dir: &Path, names: &[&str]) -> ImageStore {
        let store = ImageStore::at_images_dir(images_dir);
        for name in names {
            let spec = BuildSpec::new(*name, "/nonexistent/agent");
            store
                .build_with(&OneBlockBuilder, &spec, &mut |_| {})
                .expect("build a fake image");
        }
        store
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_is_not_ram_backed_and_dev_shm_is() {
        // Arrange
        let proc_dir = Path::new("/proc/self");
        let shm = Path::new("/dev/shm");

        // Act
        let on_proc = is_ram_backed(proc_dir);
        let on_shm = is_ram_backed(shm);

        // Assert
        assert!(!on_proc);
        assert_eq!(on_shm, shm.exists(), "/dev/shm is tmpfs wherever it exists");
    }

    #[test]
    fn removing_a_missing_scratch_disk_is_not_an_error_and_an_existing_one_goes() {
        // Arrange
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(SCRATCH_FILE), b"x").unwrap();
        std::fs::write(dir.path().join("vmm.log"), b"log").unwrap();

        // Act
        remove_scratch(dir.path());
        remove_scratch(dir.path());

        // Assert
        assert!(!dir.path().join(SCRATCH_FILE).exists());
        assert!(dir.path().join("vmm.log").exists(), "the logs stay");
    }
}

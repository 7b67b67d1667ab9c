//! Root filesystem images for daemon sandboxes: a request's `image` names an image of the image
//! store (`bulkhead image build | ls | rm`, crate `bulkhead-image`), attached read-only as the
//! guest's `/dev/vda`; `disk_mib` adds a per-sandbox sparse scratch disk for the writable layer
//! (else the layer is a tmpfs in guest RAM). The sandbox spec's builder resolves and checks them,
//! as for `bulkhead run --image` (`bulkhead_sandbox::spec`); this module keeps what is the
//! daemon's own: whether scratch disks live in RAM, and freeing a dead VM's scratch disk.
//!
//! The scratch disk is `scratch.ext4` in the sandbox's runtime directory, so everything that
//! removes that directory (DELETE, TTL, shutdown, recovery) removes it too; a VM that ends by
//! itself keeps its runtime directory for its logs, but not its scratch disk
//! ([`remove_scratch`]).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use bulkhead_sandbox::storage::SCRATCH_FILE;

/// `f_type` of tmpfs in statfs(2) (`TMPFS_MAGIC`, linux/magic.h).
const TMPFS_MAGIC: u64 = 0x0102_1994;
/// `f_type` of ramfs in statfs(2) (`RAMFS_MAGIC`, linux/magic.h).
const RAMFS_MAGIC: u64 = 0x8584_58f6;

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

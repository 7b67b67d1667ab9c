//! Moving a jailed VMM's snapshot files out of its runtime directory.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use bulkhead_vmm::holes::next_data;
use bulkhead_vmm::snapshot::{MEMORY_FILE, STATE_FILE};

use crate::sandbox::Error;

/// Bytes copied per read while copying a memory file's data.
const COPY_CHUNK: usize = 1 << 20;

/// Makes the snapshot directory `dir` this user's only (0700) and each file in it (0600): guest
/// memory and disks hold whatever the guest held, secrets included, whatever the umask or a
/// rename across owners left.
///
/// # Errors
/// [`Error::Snapshot`] naming what could not be changed.
pub(super) fn restrict(dir: &Path) -> Result<(), Error> {
    let failed = |path: &Path, e: io::Error| {
        Error::Snapshot(format!(
            "cannot restrict the mode of {}: {e}",
            path.display()
        ))
    };
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|e| failed(dir, e))?;
    for entry in fs::read_dir(dir).map_err(|e| failed(dir, e))? {
        let path = entry.map_err(|e| failed(dir, e))?.path();
        if path.is_file() {
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
                .map_err(|e| failed(&path, e))?;
        }
    }
    Ok(())
}

/// Moves `from/state` and `from/memory` into `to` (created if missing), owned by this process's
/// user, then removes `from`. A rename where both are on one file system, else a copy that keeps
/// the memory file's holes (pages of zeros are never written).
///
/// # Errors
/// [`Error::Snapshot`] naming the file that could not be moved.
pub(super) fn move_snapshot(from: &Path, to: &Path) -> Result<(), Error> {
    let failed = |path: &Path, e: io::Error| {
        Error::Snapshot(format!(
            "cannot move {} into {}: {e}",
            path.display(),
            to.display()
        ))
    };
    fs::create_dir_all(to).map_err(|e| failed(to, e))?;
    for name in [MEMORY_FILE, STATE_FILE] {
        let (src, dst) = (from.join(name), to.join(name));
        move_file(&src, &dst).map_err(|e| failed(&src, e))?;
        // SAFETY: geteuid and getegid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        std::os::unix::fs::chown(&dst, Some(uid), Some(gid)).map_err(|e| failed(&dst, e))?;
    }
    fs::remove_dir(from).map_err(|e| failed(from, e))
}

/// `rename`, or on `EXDEV` a hole-keeping copy and the removal of `src`.
pub(super) fn move_file(src: &Path, dst: &Path) -> io::Result<()> {
    match fs::rename(src, dst) {
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            copy_sparse(src, dst)?;
            fs::remove_file(src)
        }
        other => other,
    }
}

/// Copies `src` to a new `dst` of the same length: a reflink where the file system shares
/// extents (`FICLONE`, ioctl_ficlone(2): btrfs, XFS; instant, no space taken until either is
/// written), else writing only its data segments (`lseek(SEEK_DATA/SEEK_HOLE)`, lseek(2)) and,
/// within them, only the 4 KiB blocks that are not all zeros (a file system that cannot report
/// holes, such as 9p, reports the whole file as data).
pub(super) fn copy_sparse(src: &Path, dst: &Path) -> io::Result<()> {
    let input = File::open(src)?;
    // Guest memory and disks: for this user only.
    let output = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(dst)?;
    // SAFETY: FICLONE takes the source descriptor as its argument; both descriptors are open
    // and owned by this function for the call. It changes nothing when it fails.
    if unsafe { libc::ioctl(output.as_raw_fd(), libc::FICLONE, input.as_raw_fd()) } == 0 {
        return output.sync_all();
    }
    let len = input.metadata()?.len();
    output.set_len(len)?;
    let mut buf = vec![0u8; COPY_CHUNK];
    let mut at = 0u64;
    while let Some((start, end)) = next_data(&input, at, len)? {
        copy_range(&input, &output, (start, end), &mut buf)?;
        at = end;
    }
    output.sync_all()
}

/// Copies bytes `range.0..range.1` of `input` to the same offsets of `output`.
fn copy_range(input: &File, output: &File, range: (u64, u64), buf: &mut [u8]) -> io::Result<()> {
    let (mut at, end) = range;
    while at < end {
        let want = usize::try_from(end - at)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = input.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while copied",
            ));
        }
        write_nonzero(output, &buf[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Block size below which [`write_nonzero`] writes zeros rather than leaving a hole, bytes.
const HOLE_BLOCK: usize = 4096;

/// Writes `bytes` at offset `at` of `output`, skipping each [`HOLE_BLOCK`]-aligned run of
/// zeros (the file was sized first: what is skipped reads as zeros and takes no space).
fn write_nonzero(output: &File, bytes: &[u8], at: u64) -> io::Result<()> {
    let mut run: Option<usize> = None; // start of the current run of data blocks
    let mut offset = 0;
    for block in bytes.chunks(HOLE_BLOCK) {
        let zero = block.iter().all(|&b| b == 0);
        match (zero, run) {
            (false, None) => run = Some(offset),
            (true, Some(start)) => {
                output.write_all_at(&bytes[start..offset], at + start as u64)?;
                run = None;
            }
            _ => {}
        }
        offset += block.len();
    }
    if let Some(start) = run {
        output.write_all_at(&bytes[start..], at + start as u64)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_sparse_copy_keeps_the_data_and_the_holes() {
        // Arrange: 8 MiB with 4 KiB of data at 1 MiB and 4 KiB at the end.
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let file = File::create(&src).unwrap();
        file.set_len(8 << 20).unwrap();
        file.write_all_at(&[7u8; 4096], 1 << 20).unwrap();
        file.write_all_at(&[9u8; 4096], (8 << 20) - 4096).unwrap();

        // Act
        copy_sparse(&src, &dst).unwrap();

        // Assert
        assert_eq!(fs::read(&src).unwrap(), fs::read(&dst).unwrap());
        let blocks = fs::metadata(&dst).unwrap().blocks();
        assert!(
            blocks < 1024,
            "{blocks} blocks of 512 bytes: the holes were filled"
        );
    }

    #[test]
    fn zeros_written_as_data_become_holes_in_the_copy() {
        // Arrange: 4 MiB of zeros really written (data to SEEK_DATA, as every byte is on a file
        // system that cannot report holes), with 5 bytes across a block boundary and 1 at the end.
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let file = File::create(&src).unwrap();
        file.write_all_at(&vec![0u8; 4 << 20], 0).unwrap();
        file.write_all_at(b"12345", (1 << 20) + 4094).unwrap();
        file.write_all_at(b"!", (4 << 20) - 1).unwrap();
        let src_blocks = fs::metadata(&src).unwrap().blocks();

        // Act
        copy_sparse(&src, &dst).unwrap();

        // Assert: the same bytes; three 4 KiB blocks of data (24 sectors), the rest holes.
        assert_eq!(fs::read(&src).unwrap(), fs::read(&dst).unwrap());
        let blocks = fs::metadata(&dst).unwrap().blocks();
        assert!(
            src_blocks >= 8192,
            "{src_blocks}: the source holds no real zeros"
        );
        assert!(
            blocks <= 64,
            "{blocks} blocks of 512 bytes: the zeros were copied"
        );
    }

    #[test]
    fn a_restricted_snapshot_directory_and_its_files_are_the_owners_only() {
        // Arrange: what a umask of 022 leaves.
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("snap");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        for name in ["memory", "disk-1.img"] {
            fs::write(dir.join(name), b"guest").unwrap();
            fs::set_permissions(dir.join(name), fs::Permissions::from_mode(0o644)).unwrap();
        }

        // Act
        restrict(&dir).unwrap();

        // Assert
        let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("memory")), 0o600);
        assert_eq!(mode(&dir.join("disk-1.img")), 0o600);
    }

    #[test]
    fn moving_a_snapshot_empties_the_source_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("vmm-snapshot"), dir.path().join("t/out"));
        fs::create_dir(&from).unwrap();
        fs::write(from.join(STATE_FILE), b"state").unwrap();
        fs::write(from.join(MEMORY_FILE), b"memory").unwrap();

        move_snapshot(&from, &to).unwrap();

        assert!(!from.exists());
        assert_eq!(fs::read(to.join(STATE_FILE)).unwrap(), b"state");
        assert_eq!(fs::read(to.join(MEMORY_FILE)).unwrap(), b"memory");
    }
}

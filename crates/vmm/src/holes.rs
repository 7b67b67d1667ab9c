//! Finding a file's data and holes (`lseek(2)` with `SEEK_DATA` and `SEEK_HOLE`): a
//! copy-on-write disk finds the clusters its overlay holds with it, and the host side copies
//! sparse snapshot files without filling their holes.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// The first data segment of `file` at or after byte `at`, as `(start, end)` byte offsets with
/// `end` at most `len` (the file's size), or `None` when only a hole follows. A file system
/// without `SEEK_DATA` reports the whole file as data.
///
/// # Errors
/// What `lseek(2)` reports other than `ENXIO` (no data after `at`), and an offset beyond
/// `off_t`.
pub fn next_data(file: &File, at: u64, len: u64) -> io::Result<Option<(u64, u64)>> {
    if at >= len {
        return Ok(None);
    }
    let Some(start) = seek(file, at, libc::SEEK_DATA)?.filter(|&s| s < len) else {
        return Ok(None);
    };
    let end = seek(file, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
    Ok(Some((start, end)))
}

/// `lseek(file, offset, whence)`: the new offset, or `None` for `ENXIO`. Moves the file
/// position, which is harmless to callers that read and write positionally (`pread`/`pwrite`).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    let offset =
        libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: lseek on a descriptor `file` keeps open; no memory is passed.
    let found = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
    if found >= 0 {
        return Ok(Some(found as u64));
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        _ => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    #[test]
    fn the_data_segments_of_a_sparse_file_are_found_and_the_holes_skipped() {
        // Arrange: 4 MiB with data at 1 MiB and in the last byte; holes elsewhere.
        let file = tempfile::tempfile().unwrap();
        let len = 4u64 << 20;
        file.set_len(len).unwrap();
        file.write_all_at(b"data", 1 << 20).unwrap();
        file.write_all_at(b"!", len - 1).unwrap();

        // Act
        let first = next_data(&file, 0, len).unwrap();
        let second = first.and_then(|(_, end)| next_data(&file, end, len).unwrap());
        let past = next_data(&file, len, len).unwrap();

        // Assert: each segment holds its data and ends before the next write (file systems
        // that track holes at a coarser grain may widen a segment, never miss one).
        let (start, end) = first.unwrap();
        assert!(
            start <= 1 << 20 && end >= (1 << 20) + 4 && end < len - 1,
            "{first:?}"
        );
        let (start, end) = second.unwrap();
        assert!(start < len && end == len, "{second:?}");
        assert_eq!(past, None);
    }
}

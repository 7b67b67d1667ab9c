//! Holes: finding a file's data segments (`SEEK_DATA`/`SEEK_HOLE`), writing them as GNU sparse
//! entries, and recreating holes on extraction.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use tar::{GnuExtSparseHeader, GnuSparseHeader, Header};

/// Tar block size, bytes.
const BLOCK: u64 = 512;

/// Most data segments packed as a sparse entry; a file with more is packed as a plain file.
const MAX_SEGMENTS: usize = 100_000;

/// One run of data in a sparse file: `(offset, length)` in bytes.
pub(crate) type Segment = (u64, u64);

/// The data segments of `file` (of `size` bytes), each but the last a multiple of 512 bytes
/// long (GNU tar's rule), or `None` when the file has no holes worth carrying (or the
/// filesystem cannot tell). Moves the file offset; callers read with `pread` or seek back.
pub(crate) fn data_segments(file: &File, size: u64) -> Option<Vec<Segment>> {
    let mut segments: Vec<Segment> = Vec::new();
    let mut pos = 0u64;
    while pos < size {
        let Some(start) = seek(file, pos, libc::SEEK_DATA)? else {
            break; // only a hole is left
        };
        let end = seek(file, start, libc::SEEK_HOLE)?
            .unwrap_or(size)
            .min(size);
        // Widen to 512-byte boundaries (the widened part reads as zeros) and merge.
        let start = start / BLOCK * BLOCK;
        let end = end.div_ceil(BLOCK).saturating_mul(BLOCK).min(size);
        match segments.last_mut() {
            Some(last) if last.0 + last.1 >= start => last.1 = end - last.0,
            _ => segments.push((start, end - start)),
        }
        if end <= pos {
            return None; // the filesystem answers nonsense: no holes then
        }
        pos = end;
    }
    let data: u64 = segments.iter().map(|s| s.1).sum();
    (data < size && segments.len() <= MAX_SEGMENTS).then_some(segments)
}

/// `lseek(fd, pos, whence)`: `Some(Some(offset))`, `Some(None)` for `ENXIO` (no more data),
/// `None` when the filesystem does not support it.
fn seek(file: &File, pos: u64, whence: libc::c_int) -> Option<Option<u64>> {
    let pos = libc::off_t::try_from(pos).ok()?;
    // SAFETY: lseek on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), pos, whence) };
    if rc >= 0 {
        return Some(Some(rc as u64));
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::ENXIO) => Some(None),
        _ => None,
    }
}

/// Turns `header` (a GNU header with the file's metadata) into a sparse entry header for
/// `segments` of a file of `size` bytes; returns the extension blocks that must follow it
/// (ahead of the data, which is what the returned reader prefix is for).
pub(crate) fn sparse_header(header: &mut Header, segments: &[Segment], size: u64) -> Vec<u8> {
    // GNU marks a trailing hole with an empty segment at the end of the file.
    let mut all = segments.to_vec();
    if all.last().is_none_or(|s| s.0 + s.1 < size) {
        all.push((size, 0));
    }
    header.set_entry_type(tar::EntryType::GNUSparse);
    header.set_size(segments.iter().map(|s| s.1).sum());
    let (first, rest) = all.split_at(all.len().min(4));
    if let Some(gnu) = header.as_gnu_mut() {
        gnu.set_real_size(size);
        fill(&mut gnu.sparse, first);
        gnu.set_is_extended(!rest.is_empty());
    }
    let mut ext_bytes = Vec::new();
    let chunks: Vec<&[Segment]> = rest.chunks(21).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let mut ext = GnuExtSparseHeader::new();
        fill(&mut ext.sparse, chunk);
        ext.set_is_extended(i + 1 < chunks.len());
        ext_bytes.extend_from_slice(ext.as_bytes());
    }
    ext_bytes
}

fn fill(slots: &mut [GnuSparseHeader], segments: &[Segment]) {
    for (slot, (offset, len)) in slots.iter_mut().zip(segments) {
        slot.set_offset(*offset);
        slot.set_length(*len);
    }
}

/// Reads the data segments of a file one after the other (what a sparse entry stores); a file
/// that shrank meanwhile reads as zeros, so the archive keeps the sizes its header promised.
pub(crate) struct SegmentReader<'a> {
    file: &'a File,
    segments: Vec<Segment>,
    index: usize,
    done: u64,
}

impl<'a> SegmentReader<'a> {
    pub(crate) fn new(file: &'a File, segments: Vec<Segment>) -> Self {
        Self {
            file,
            segments,
            index: 0,
            done: 0,
        }
    }
}

impl Read for SegmentReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while let Some(&(offset, len)) = self.segments.get(self.index) {
            let left = len - self.done;
            if left == 0 {
                self.index += 1;
                self.done = 0;
                continue;
            }
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = match self.file.read_at(&mut buf[..want], offset + self.done)? {
                0 => {
                    buf[..want].fill(0);
                    want
                }
                n => n,
            };
            self.done += n as u64;
            return Ok(n);
        }
        Ok(0)
    }
}

/// Writes file contents, turning all-zero 4 KiB blocks into holes (seeks), then sets the
/// length so a trailing hole stays a hole. Returns the bytes actually written.
pub(crate) fn copy_with_holes(src: &mut impl Read, dst: &mut File, size: u64) -> io::Result<u64> {
    let mut buf = vec![0u8; 1024 * 1024];
    let mut pos = 0u64;
    let mut written = 0u64;
    let mut file_pos = 0u64;
    loop {
        let n = read_full(src, &mut buf)?;
        if n == 0 {
            break;
        }
        for block in buf[..n].chunks(4096) {
            if !is_zero(block) {
                if file_pos != pos {
                    dst.seek(SeekFrom::Start(pos))?;
                }
                dst.write_all(block)?;
                written += block.len() as u64;
                file_pos = pos + block.len() as u64;
            }
            pos += block.len() as u64;
        }
    }
    if pos != size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("file contents ended after {pos} of {size} bytes"),
        ));
    }
    dst.set_len(size)?;
    Ok(written)
}

fn read_full(src: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match src.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// True when every byte is 0 (an OR over 8-byte words, which the compiler vectorises).
fn is_zero(block: &[u8]) -> bool {
    let mut words = block.chunks_exact(8);
    let acc = words.by_ref().fold(0u64, |acc, w| {
        acc | u64::from_ne_bytes(w.try_into().unwrap_or([0xff; 8]))
    });
    acc == 0 && words.remainder().iter().all(|b| *b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_with_a_hole_has_two_segments_and_zero_blocks_become_holes() {
        // Arrange
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("sparse");
        let file = File::create(&path).unwrap();
        file.write_at(b"head", 0).unwrap();
        file.write_at(b"tail", 64 << 20).unwrap();
        let size = (64 << 20) + 4;

        // Act
        let segments = data_segments(&file, size).expect("the file has a hole");
        let mut copy = File::create(tmp.path().join("copy")).unwrap();
        let mut reader = std::io::Cursor::new(vec![0u8; 8 << 20]);
        let written = copy_with_holes(&mut reader, &mut copy, 8 << 20).unwrap();

        // Assert
        assert_eq!(segments.first().map(|s| s.0), Some(0));
        assert_eq!(segments.last().map(|s| s.0 + s.1), Some(size));
        assert!(segments.iter().map(|s| s.1).sum::<u64>() < 1 << 20);
        assert_eq!(written, 0);
        assert_eq!(copy.metadata().unwrap().len(), 8 << 20);
    }
}

//! Copy-on-write disks: a writable overlay file over a read-only backing image of the same size,
//! so that many VMs start from one saved disk without copying it first (every clone of a
//! template with a scratch disk).
//!
//! The disk is split into clusters of [`CLUSTER_BYTES`]. A bitmap in memory records which
//! clusters the overlay holds; a read of a cluster it does not hold comes from the backing
//! image. The first write to a cluster that does not cover all of it copies the cluster up from
//! the backing image first (a cluster of zeros is not copied: the overlay is an empty sparse
//! file when the disk opens, so it reads as zeros already). A snapshot makes the overlay whole
//! ([`Backing::flatten`]): it copies every cluster the VM never wrote, after which the overlay is
//! a disk of its own and the snapshot names no backing image.
//!
//! The bitmap lives only as long as the VMM; a VMM that dies leaves an overlay that is useless
//! without it (the sandbox deletes it with its runtime directory).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::io::{open_locked, IoError};
use super::{Error, SECTOR_SIZE};
use crate::holes::next_data;

/// Bytes per cluster, the unit of copy-on-write (64 KiB, as qcow2's default cluster).
pub const CLUSTER_BYTES: u64 = 64 << 10;

/// A maximal run of bytes whose clusters are all in the overlay or all in the backing image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Byte offset on the disk.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The overlay holds these bytes (else the backing image does).
    pub in_overlay: bool,
}

/// The read-only image beneath a copy-on-write disk, and which clusters the overlay holds.
#[derive(Debug)]
pub struct Backing {
    file: File,
    path: PathBuf,
    size: u64,
    /// One bit per cluster, set when the overlay holds it.
    present: Mutex<Vec<u64>>,
}

impl Backing {
    /// Opens the backing image at `path` (`O_RDONLY`, a shared `flock`) for an overlay of
    /// `size` bytes, `overlay`, which must be a regular file with no data yet (a new sparse
    /// file of that size).
    ///
    /// # Errors
    /// The errors of [`DiskImage::open`](super::DiskImage::open) for the backing image,
    /// [`Error::BackingSize`] when the two differ in size, [`Error::OverlayNotEmpty`] (or
    /// [`Error::Open`] when the overlay's holes cannot be read).
    pub fn open(
        path: &Path,
        overlay: &File,
        overlay_path: &Path,
        size: u64,
    ) -> Result<Self, Error> {
        let (file, backing_size) = open_locked(path, true)?;
        // Whole sectors, as the overlay's size (a trailing part sector is never read).
        let backing_size = backing_size & !(SECTOR_SIZE - 1);
        if backing_size != size {
            return Err(Error::BackingSize {
                path: path.to_owned(),
                backing: backing_size,
                disk: size,
            });
        }
        let overlay_is_file = overlay.metadata().is_ok_and(|m| m.file_type().is_file());
        let overlay_data = next_data(overlay, 0, u64::MAX).map_err(|source| Error::Open {
            path: overlay_path.to_owned(),
            source,
        })?;
        if !overlay_is_file || overlay_data.is_some() {
            return Err(Error::OverlayNotEmpty(overlay_path.to_owned()));
        }
        let clusters = size.div_ceil(CLUSTER_BYTES);
        Ok(Backing {
            file,
            path: path.to_owned(),
            size,
            present: Mutex::new(vec![0; clusters.div_ceil(64) as usize]),
        })
    }

    /// The backing image's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The backing image, for reads of what the overlay does not hold.
    pub fn file(&self) -> &File {
        &self.file
    }

    fn bits(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        self.present.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the overlay holds cluster `cluster`.
    pub fn in_overlay(&self, cluster: u64) -> bool {
        is_set(&self.bits(), cluster)
    }

    /// `[offset, offset + len)` split where the clusters change between overlay and backing
    /// image, in order. The range lies inside the disk (requests are validated first).
    pub fn runs(&self, offset: u64, len: u64) -> Vec<Run> {
        let bits = self.bits();
        let end = offset + len;
        let mut runs: Vec<Run> = Vec::new();
        let mut at = offset;
        while at < end {
            let cluster = at / CLUSTER_BYTES;
            let next = ((cluster + 1) * CLUSTER_BYTES).min(end);
            let in_overlay = is_set(&bits, cluster);
            match runs.last_mut() {
                Some(run) if run.in_overlay == in_overlay => run.len += next - at,
                _ => runs.push(Run {
                    offset: at,
                    len: next - at,
                    in_overlay,
                }),
            }
            at = next;
        }
        runs
    }

    /// Readies `overlay` for a write of `[offset, offset + len)`: copies up the first and the
    /// last cluster the write touches when it covers only part of them and the overlay does not
    /// hold them yet. Call [`Self::wrote`] after the write.
    ///
    /// # Errors
    /// [`IoError::Read`] or [`IoError::Write`] of the copy.
    pub fn before_write(&self, overlay: &File, offset: u64, len: u64) -> Result<(), IoError> {
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let first = offset / CLUSTER_BYTES;
        let last = (end - 1) / CLUSTER_BYTES;
        for cluster in [first, last] {
            let start = cluster * CLUSTER_BYTES;
            let cluster_end = (start + CLUSTER_BYTES).min(self.size);
            let covered = offset <= start && end >= cluster_end;
            if !covered && !self.in_overlay(cluster) {
                self.copy_up(overlay, cluster)?;
            }
        }
        Ok(())
    }

    /// Records that the overlay now holds every cluster `[offset, offset + len)` touches (the
    /// partly covered ones were copied up by [`Self::before_write`]), also after a write that
    /// failed part way.
    pub fn wrote(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut bits = self.bits();
        for cluster in offset / CLUSTER_BYTES..=(offset + len - 1) / CLUSTER_BYTES {
            // Requests are validated against the capacity, so every cluster has its bit.
            if let Some(word) = bits.get_mut((cluster / 64) as usize) {
                *word |= 1 << (cluster % 64);
            }
        }
    }

    /// Copies cluster `cluster` from the backing image into `overlay` (unless it is all zeros,
    /// which the overlay reads already) and records it.
    fn copy_up(&self, overlay: &File, cluster: u64) -> Result<(), IoError> {
        let start = cluster * CLUSTER_BYTES;
        let len = (self.size - start).min(CLUSTER_BYTES) as usize;
        let mut buf = vec![0u8; len];
        self.file
            .read_exact_at(&mut buf, start)
            .map_err(|source| IoError::Read {
                offset: start,
                source,
            })?;
        if buf.iter().any(|&b| b != 0) {
            overlay
                .write_all_at(&buf, start)
                .map_err(|source| IoError::Write {
                    offset: start,
                    source,
                })?;
        }
        self.wrote(start, len as u64);
        Ok(())
    }

    /// Copies every cluster the overlay does not hold from the backing image into `overlay`
    /// (holes of the backing image are skipped), so that the overlay is the whole disk.
    ///
    /// # Errors
    /// [`IoError::Read`] or [`IoError::Write`] of a copy.
    pub fn flatten(&self, overlay: &File) -> Result<(), IoError> {
        let clusters = self.size.div_ceil(CLUSTER_BYTES);
        let mut cluster = 0;
        while cluster < clusters {
            if self.in_overlay(cluster) {
                cluster += 1;
                continue;
            }
            let start = cluster * CLUSTER_BYTES;
            let data = next_data(&self.file, start, self.size).map_err(|source| IoError::Read {
                offset: start,
                source,
            })?;
            match data.map(|(at, _)| at) {
                None => break,
                Some(at) if at >= start + CLUSTER_BYTES => cluster = at / CLUSTER_BYTES,
                Some(_) => {
                    self.copy_up(overlay, cluster)?;
                    cluster += 1;
                }
            }
        }
        Ok(())
    }
}

fn is_set(bits: &[u64], cluster: u64) -> bool {
    bits.get((cluster / 64) as usize)
        .is_some_and(|word| word & (1 << (cluster % 64)) != 0)
}

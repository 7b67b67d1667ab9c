//! The host side of the disk: the raw image file ([`DiskImage`]) and executing a validated
//! [`Request`] against it ([`execute`]).
//!
//! Data moves directly between the file and guest memory with `pread`/`pwrite` at
//! `sector × 512`, one call per contiguous piece of guest memory. The I/O is synchronous: it runs
//! on the event-loop thread that handles the queue notification.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::{Bytes, GuestMemory, GuestMemoryError, VolatileSlice};

use super::cow::Backing;
use super::request::{total_len, DiskLimits, Request, Segment};
use super::{
    Error, ID_BYTES, SECTOR_SHIFT, SECTOR_SIZE, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP,
};

/// Errors from executing a request.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// A guest buffer could not be accessed (validation makes this unexpected).
    #[error("guest memory: {0}")]
    Memory(#[from] GuestMemoryError),
    /// `pread` failed.
    #[error("read at byte offset {offset}: {source}")]
    Read {
        /// Byte offset in the image.
        offset: u64,
        /// The OS error.
        source: io::Error,
    },
    /// The image ended before the transfer did (it shrank since the device was created).
    #[error("the image ends before byte offset {0}")]
    UnexpectedEof(u64),
    /// `pwrite` failed or wrote nothing.
    #[error("write at byte offset {offset}: {source}")]
    Write {
        /// Byte offset in the image.
        offset: u64,
        /// The OS error.
        source: io::Error,
    },
    /// `fdatasync` failed.
    #[error("fdatasync: {0}")]
    Flush(io::Error),
    /// A write reached a read-only image (validation makes this unexpected).
    #[error("the image is read-only")]
    ReadOnly,
    /// A byte offset does not fit in `off_t`.
    #[error("byte offset {0} is out of range")]
    Offset(u64),
}

/// A raw disk image: a regular file or a host block device, opened once for the device's life;
/// optionally the writable overlay of a copy-on-write disk over a read-only backing image
/// ([`DiskImage::with_backing`], the [`super::cow`] module).
///
/// The image is locked with `flock` — exclusively when writable, shared when read-only — so two
/// VMs (or two disks of one VM) cannot write the same image, while many may read it (a backing
/// image too).
#[derive(Debug)]
pub struct DiskImage {
    file: File,
    path: PathBuf,
    capacity: u64,
    read_only: bool,
    backing: Option<Backing>,
}

impl DiskImage {
    /// Opens the image at `path` (`O_RDONLY` if `read_only`, else `O_RDWR`; always
    /// `O_CLOEXEC`). Its capacity is its size in whole 512-byte sectors: the trailing bytes of
    /// an image whose size is not a multiple of 512 are not visible to the guest (a warning is
    /// logged).
    ///
    /// # Errors
    /// [`Error::Open`] (also when `flock` fails for another reason than a conflicting lock),
    /// [`Error::NotADisk`], [`Error::Locked`], [`Error::Size`].
    pub fn open(path: &Path, read_only: bool) -> Result<DiskImage, Error> {
        let (file, size) = open_locked(path, read_only)?;
        if size % SECTOR_SIZE != 0 {
            tracing::warn!(
                "virtio-blk: {} is {size} bytes, not a multiple of 512; the last {} bytes are \
                 not visible to the guest",
                path.display(),
                size % SECTOR_SIZE
            );
        }
        Ok(DiskImage {
            file,
            path: path.to_owned(),
            capacity: size >> SECTOR_SHIFT,
            read_only,
            backing: None,
        })
    }

    /// Makes this (writable, empty, sparse) image the overlay of a copy-on-write disk whose
    /// unwritten clusters come from the read-only image at `backing`, of the same size.
    ///
    /// # Errors
    /// [`Error::ReadOnlyOverlay`] for a read-only image; the errors of [`Backing::open`].
    pub fn with_backing(mut self, backing: &Path) -> Result<DiskImage, Error> {
        if self.read_only {
            return Err(Error::ReadOnlyOverlay(self.path));
        }
        let size = self.capacity << SECTOR_SHIFT;
        self.backing = Some(Backing::open(backing, &self.file, &self.path, size)?);
        Ok(self)
    }

    /// The backing image of a copy-on-write disk, until [`Self::flatten`].
    pub fn backing_path(&self) -> Option<&Path> {
        self.backing.as_ref().map(Backing::path)
    }

    /// Makes a copy-on-write disk's overlay the whole disk (every cluster the VM never wrote
    /// copied from the backing image, then `fdatasync`) and forgets the backing image. Nothing
    /// to do for a plain image.
    ///
    /// # Errors
    /// [`IoError`] of a copy or of the sync; the disk then stays copy-on-write.
    pub fn flatten(&mut self) -> Result<(), IoError> {
        if let Some(backing) = &self.backing {
            backing.flatten(&self.file)?;
            self.flush()?;
            tracing::debug!(
                "virtio-blk: {} no longer needs {}",
                self.path.display(),
                backing.path().display()
            );
            self.backing = None;
        }
        Ok(())
    }

    /// The image path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether the image was opened read-only.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The limits requests are validated against.
    pub fn limits(&self) -> DiskLimits {
        DiskLimits {
            capacity: self.capacity,
            read_only: self.read_only,
        }
    }

    /// Reads from the image at `sector` into the guest buffers `data`, in order; returns the
    /// bytes read.
    ///
    /// # Errors
    /// [`IoError`]; guest buffers may then hold part of the data.
    pub fn read_into<M: GuestMemory>(
        &self,
        mem: &M,
        sector: u64,
        data: &[Segment],
    ) -> Result<u64, IoError> {
        let mut offset = byte_offset(sector)?;
        for seg in data {
            for slice in mem.get_slices(seg.addr, seg.len as usize) {
                let slice = slice?;
                self.read_slice(&slice, offset)?;
                offset += slice.len() as u64;
            }
        }
        Ok(total_len(data))
    }

    /// Fills `slice` from the disk at byte `offset`: from the image, or for a copy-on-write
    /// disk from the overlay or the backing image, cluster run by cluster run.
    fn read_slice<B: BitmapSlice>(
        &self,
        slice: &VolatileSlice<'_, B>,
        offset: u64,
    ) -> Result<(), IoError> {
        let Some(backing) = &self.backing else {
            return pread_exact(&self.file, slice, offset);
        };
        for run in backing.runs(offset, slice.len() as u64) {
            let part = slice
                .subslice((run.offset - offset) as usize, run.len as usize)
                .map_err(GuestMemoryError::from)?;
            let file = if run.in_overlay {
                &self.file
            } else {
                backing.file()
            };
            pread_exact(file, &part, run.offset)?;
        }
        Ok(())
    }

    /// Writes the guest buffers `data`, in order, to the image at `sector`.
    ///
    /// # Errors
    /// [`IoError::ReadOnly`] on a read-only image; other [`IoError`]s, after which part of the
    /// data may be on the image.
    pub fn write_from<M: GuestMemory>(
        &self,
        mem: &M,
        sector: u64,
        data: &[Segment],
    ) -> Result<(), IoError> {
        if self.read_only {
            return Err(IoError::ReadOnly);
        }
        let start = byte_offset(sector)?;
        let len = total_len(data);
        if let Some(backing) = &self.backing {
            backing.before_write(&self.file, start, len)?;
        }
        let written = self.write_segments(mem, start, data);
        // Also after a failed write: the clusters it covers whole may hold part of its data,
        // which must not mix with the backing image later; their contents are undefined for
        // the guest (the request failed), and the partly covered ones were copied up before.
        if let Some(backing) = &self.backing {
            backing.wrote(start, len);
        }
        written
    }

    /// Writes the guest buffers `data`, in order, to the image file at byte `start`.
    fn write_segments<M: GuestMemory>(
        &self,
        mem: &M,
        start: u64,
        data: &[Segment],
    ) -> Result<(), IoError> {
        let mut offset = start;
        for seg in data {
            for slice in mem.get_slices(seg.addr, seg.len as usize) {
                let slice = slice?;
                pwrite_all(&self.file, &slice, offset)?;
                offset += slice.len() as u64;
            }
        }
        Ok(())
    }

    /// Makes completed writes durable (`fdatasync`).
    ///
    /// # Errors
    /// [`IoError::Flush`].
    pub fn flush(&self) -> Result<(), IoError> {
        self.file.sync_data().map_err(IoError::Flush)
    }
}

/// The outcome of a request: its status byte and how many data bytes the device wrote into the
/// chain (the used length is that plus the status byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// `VIRTIO_BLK_S_*`.
    pub status: u8,
    /// Data bytes written into device-writable buffers.
    pub written: u32,
}

impl Completion {
    /// A failed request: [`VIRTIO_BLK_S_IOERR`], no data reported.
    pub const IOERR: Completion = Completion {
        status: VIRTIO_BLK_S_IOERR,
        written: 0,
    };
}

/// Executes `request` against `disk`; `id` is the NUL-padded device ID for GET_ID.
pub fn execute<M: GuestMemory>(
    request: &Request,
    disk: &DiskImage,
    id: &[u8; ID_BYTES],
    mem: &M,
) -> Completion {
    let result = match request {
        Request::In { sector, data } => disk.read_into(mem, *sector, data),
        Request::Out { sector, data } => disk.write_from(mem, *sector, data).map(|()| 0),
        Request::Flush => disk.flush().map(|()| 0),
        Request::GetId { data } => write_id(mem, id, data),
        Request::Unsupported { request_type } => {
            tracing::debug!("virtio-blk: unsupported request type {request_type}");
            return Completion {
                status: VIRTIO_BLK_S_UNSUPP,
                written: 0,
            };
        }
    };
    match result {
        Ok(written) => Completion {
            status: VIRTIO_BLK_S_OK,
            // Validation caps data at 16 MiB.
            written: u32::try_from(written).unwrap_or(u32::MAX),
        },
        Err(e) => {
            tracing::warn!("virtio-blk: {}: {e}", disk.path().display());
            Completion::IOERR
        }
    }
}

/// Writes as much of `id` as fits into `data`; returns the bytes written.
fn write_id<M: GuestMemory>(
    mem: &M,
    id: &[u8; ID_BYTES],
    data: &[Segment],
) -> Result<u64, IoError> {
    let mut rest: &[u8] = id;
    for seg in data {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(rest.len().min(seg.len as usize));
        mem.write_slice(now, seg.addr)?;
        rest = later;
    }
    Ok((ID_BYTES - rest.len()) as u64)
}

/// `sector × 512` in bytes, checked for overflow.
fn byte_offset(sector: u64) -> Result<u64, IoError> {
    sector
        .checked_mul(SECTOR_SIZE)
        .ok_or(IoError::Offset(sector))
}

fn off_t(offset: u64) -> Result<libc::off_t, IoError> {
    libc::off_t::try_from(offset).map_err(|_| IoError::Offset(offset))
}

/// Fills `slice` from `file` at byte `offset`, retrying short reads and EINTR.
fn pread_exact<B: BitmapSlice>(
    file: &File,
    slice: &VolatileSlice<'_, B>,
    offset: u64,
) -> Result<(), IoError> {
    let mut done = 0;
    while done < slice.len() {
        let at = offset + done as u64;
        let off = off_t(at)?;
        let rest = slice.offset(done).map_err(GuestMemoryError::from)?;
        let guard = rest.ptr_guard_mut();
        // SAFETY: `file` is an open descriptor for the call's duration. `guard` points at
        // `rest.len()` bytes of mapped guest memory (a `VolatileSlice` only covers memory that
        // stays mapped while it is borrowed), and the kernel writes at most that many bytes.
        // Guest memory is shared with the guest and never referenced as Rust data, so the
        // concurrent writes are sound.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                guard.as_ptr().cast::<libc::c_void>(),
                rest.len(),
                off,
            )
        };
        match n {
            0 => return Err(IoError::UnexpectedEof(at)),
            n if n < 0 => {
                let source = io::Error::last_os_error();
                if source.kind() != io::ErrorKind::Interrupted {
                    return Err(IoError::Read { offset: at, source });
                }
            }
            n => {
                let n = n as usize;
                rest.bitmap().mark_dirty(0, n);
                done += n;
            }
        }
    }
    Ok(())
}

/// Writes all of `slice` to `file` at byte `offset`, retrying short writes and EINTR.
fn pwrite_all<B: BitmapSlice>(
    file: &File,
    slice: &VolatileSlice<'_, B>,
    offset: u64,
) -> Result<(), IoError> {
    let mut done = 0;
    while done < slice.len() {
        let at = offset + done as u64;
        let off = off_t(at)?;
        let rest = slice.offset(done).map_err(GuestMemoryError::from)?;
        let guard = rest.ptr_guard();
        // SAFETY: `file` is an open descriptor for the call's duration; `guard` points at
        // `rest.len()` bytes of mapped guest memory that the kernel only reads.
        let n = unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                guard.as_ptr().cast::<libc::c_void>(),
                rest.len(),
                off,
            )
        };
        match n {
            0 => {
                let source = io::Error::from(io::ErrorKind::WriteZero);
                return Err(IoError::Write { offset: at, source });
            }
            n if n < 0 => {
                let source = io::Error::last_os_error();
                if source.kind() != io::ErrorKind::Interrupted {
                    return Err(IoError::Write { offset: at, source });
                }
            }
            n => done += n as usize,
        }
    }
    Ok(())
}

/// Opens the image at `path` for [`DiskImage::open`] (also a copy-on-write disk's backing
/// image, read-only): `O_CLOEXEC`, a regular file or block device, locked (`flock`, shared when
/// `read_only`); returns it and its size in bytes.
pub(super) fn open_locked(path: &Path, read_only: bool) -> Result<(File, u64), Error> {
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| Error::Open {
            path: path.to_owned(),
            source,
        })?;
    let file_type = file
        .metadata()
        .map_err(|source| Error::Size {
            path: path.to_owned(),
            source,
        })?
        .file_type();
    if !file_type.is_file() && !file_type.is_block_device() {
        return Err(Error::NotADisk(path.to_owned()));
    }
    lock(&file, read_only).map_err(|source| match source.kind() {
        io::ErrorKind::WouldBlock => Error::Locked {
            path: path.to_owned(),
            source,
        },
        _ => Error::Open {
            path: path.to_owned(),
            source,
        },
    })?;
    // Seeking to the end also sizes block devices, whose metadata length is 0.
    let size = (&file)
        .seek(SeekFrom::End(0))
        .map_err(|source| Error::Size {
            path: path.to_owned(),
            source,
        })?;
    Ok((file, size))
}

/// Takes the image's advisory lock without blocking: exclusive for a writable image, shared for
/// a read-only one.
fn lock(file: &File, read_only: bool) -> io::Result<()> {
    let mode = if read_only {
        libc::LOCK_SH
    } else {
        libc::LOCK_EX
    };
    // SAFETY: flock on a descriptor `file` keeps open; no memory is passed.
    let ret = unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

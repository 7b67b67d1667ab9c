//! virtio-blk (virtio 1.2 §5.2, device ID 2) backed by a raw disk image on the host.
//!
//! # The protocol in brief
//!
//! The device is a disk of `capacity` 512-byte sectors (§5.2.4: a `le64` at offset 0 of the
//! configuration space). The driver sends requests on one virtqueue, the *requestq* (§5.2.2).
//! Each request is one descriptor chain (§5.2.6) made of, in order:
//!
//! 1. a device-readable 16-byte header, [`RequestHeader`]: `le32 type`, `le32 reserved`,
//!    `le64 sector`;
//! 2. the data: device-readable for a write ([`VIRTIO_BLK_T_OUT`]), device-writable for a read
//!    ([`VIRTIO_BLK_T_IN`]) and for [`VIRTIO_BLK_T_GET_ID`] (20 bytes of device ID); absent for a
//!    cache flush ([`VIRTIO_BLK_T_FLUSH`]);
//! 3. one device-writable status byte, which the device sets to [`VIRTIO_BLK_S_OK`],
//!    [`VIRTIO_BLK_S_IOERR`] or [`VIRTIO_BLK_S_UNSUPP`].
//!
//! Data lengths are whole sectors, and `sector` is where the transfer starts on the disk (byte
//! offset `sector × 512`). The device returns the chain on the used ring with the number of bytes
//! it wrote into it: the data of a read plus the status byte.
//!
//! virtio does not tie the request's parts to descriptor boundaries (§2.6.4, message framing):
//! the header may share a descriptor with write data, and the status byte may end the last data
//! descriptor of a read. The parser therefore treats the chain as a stream of device-readable
//! bytes followed by a stream of device-writable bytes ([`request`]).
//!
//! # What this device offers
//!
//! Features (§5.2.3): `VIRTIO_F_VERSION_1`, [`VIRTIO_BLK_F_SEG_MAX`] (at most [`SEG_MAX`] data
//! segments per request), [`VIRTIO_BLK_F_BLK_SIZE`] (512), [`VIRTIO_BLK_F_FLUSH`] (`fdatasync` on
//! the image), and [`VIRTIO_BLK_F_RO`] for a read-only disk. Requests other than IN, OUT, FLUSH
//! and GET_ID (discard, write zeroes, secure erase, lifetime, ...) are answered with
//! [`VIRTIO_BLK_S_UNSUPP`].
//!
//! # The guest is hostile
//!
//! Every chain is validated before any I/O ([`request`]): header readable and complete, data in
//! the direction the request type needs, whole sectors, `sector + sectors ≤ capacity` with
//! overflow-checked arithmetic, at most [`MAX_DATA_BYTES`] of data and [`SEG_MAX`] + 2
//! descriptors, every guest-physical range inside guest memory. A chain that fails validation but
//! ends in a usable status byte gets [`VIRTIO_BLK_S_IOERR`]; a chain without one (its last
//! descriptor is device-readable, empty, outside guest memory, or the chain is cut short by a
//! loop or a bad `next` index) goes back to the used ring with length 0. Every chain goes back:
//! the queue never stalls on a bad request. A read-only disk refuses writes host-side (the image
//! is also opened `O_RDONLY`), whatever features the driver acknowledged.
//!
//! # Threading and I/O
//!
//! I/O is synchronous, on the event-loop thread, directly between the image file and guest memory
//! (`pread`/`pwrite`, no bounce buffer). A slow host disk therefore delays the other devices on
//! the same event loop; [`MAX_DATA_BYTES`] bounds how long one request can take.
//!
//! # Module layout
//! - [`device`]: the [`Block`] device — features, configuration space, activation, reset, the
//!   queue loop.
//! - [`request`]: parsing and validating one descriptor chain into a [`Request`].
//! - [`io`]: the disk image ([`DiskImage`]) and executing a [`Request`] against it.
//! - [`cow`]: copy-on-write disks, an overlay over a read-only backing image.
//! - [`event_handler`]: routes event-loop events to the device's methods.

use std::path::PathBuf;

pub mod cow;
pub mod device;
pub mod event_handler;
pub mod io;
pub mod request;

#[cfg(test)]
mod tests;

pub use device::{Block, BlockConfig};
pub use io::DiskImage;
pub use request::{Request, RequestHeader};

/// Bytes per sector: the unit of `capacity` and of a request's `sector` (virtio 1.2 §5.2.4).
pub const SECTOR_SIZE: u64 = 512;
/// log2([`SECTOR_SIZE`]).
pub const SECTOR_SHIFT: u32 = 9;

/// Size of the request queue, in descriptors.
pub const QUEUE_SIZE: u16 = 256;
/// Maximum size of each virtqueue: one request queue (virtio 1.2 §5.2.2).
pub const BLOCK_QUEUE_SIZES: [u16; 1] = [QUEUE_SIZE];

/// Most data segments (descriptors besides the header and the status byte) in one request,
/// advertised in `seg_max` (virtio 1.2 §5.2.4). Without indirect descriptors a chain cannot be
/// longer than the queue, so this is the queue size minus the header and status descriptors.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Most descriptors in one request chain; longer chains (possible through indirect tables) get
/// [`VIRTIO_BLK_S_IOERR`].
pub const MAX_DESCRIPTORS: usize = SEG_MAX as usize + 2;
/// Most data in one IN or OUT request, in bytes (16 MiB). virtio-blk has no length limit without
/// `VIRTIO_BLK_F_SIZE_MAX`; this one bounds how long a single request holds the event loop.
/// Linux never sends more than `max_sectors_kb` (1280 KiB by default); a guest that raises it
/// above 16384 gets [`VIRTIO_BLK_S_IOERR`] for the larger requests.
pub const MAX_DATA_BYTES: u32 = 16 << 20;

/// Length of the device ID returned by [`VIRTIO_BLK_T_GET_ID`], in bytes (virtio 1.2 §5.2.6).
pub const ID_BYTES: usize = 20;

/// Feature bit: `seg_max` is valid (virtio 1.2 §5.2.3).
pub const VIRTIO_BLK_F_SEG_MAX: u32 = 2;
/// Feature bit: the device is read-only.
pub const VIRTIO_BLK_F_RO: u32 = 5;
/// Feature bit: `blk_size` is valid.
pub const VIRTIO_BLK_F_BLK_SIZE: u32 = 6;
/// Feature bit: the device supports [`VIRTIO_BLK_T_FLUSH`].
pub const VIRTIO_BLK_F_FLUSH: u32 = 9;

/// Request type: read from the disk into the device-writable data (virtio 1.2 §5.2.6).
pub const VIRTIO_BLK_T_IN: u32 = 0;
/// Request type: write the device-readable data to the disk.
pub const VIRTIO_BLK_T_OUT: u32 = 1;
/// Request type: make completed writes durable.
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
/// Request type: return the device ID string ([`ID_BYTES`] bytes).
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;

/// Request status: success (virtio 1.2 §5.2.6).
pub const VIRTIO_BLK_S_OK: u8 = 0;
/// Request status: the request failed or was malformed.
pub const VIRTIO_BLK_S_IOERR: u8 = 1;
/// Request status: the request type is not supported.
pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;

/// Errors from creating a block device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The disk image cannot be opened.
    #[error("cannot open disk image {path}: {source}")]
    Open {
        /// The image path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The path is neither a regular file nor a block device.
    #[error("disk image {0} is neither a regular file nor a block device")]
    NotADisk(PathBuf),
    /// The image's size cannot be determined.
    #[error("cannot read the size of disk image {path}: {source}")]
    Size {
        /// The image path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Another process (or another disk of this VM) holds a conflicting lock on the image: a
    /// writable image must not be shared.
    #[error(
        "disk image {path} is in use by another VM or disk (a writable image cannot be shared): \
         {source}"
    )]
    Locked {
        /// The image path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The device ID does not fit in [`ID_BYTES`] bytes.
    #[error("block device id {id:?} is {len} bytes long; at most 20 are allowed")]
    IdTooLong {
        /// The rejected ID.
        id: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A copy-on-write disk's backing image is not the disk's size.
    #[error(
        "the backing image {path} is {backing} bytes, the disk {disk} bytes: they must be equal"
    )]
    BackingSize {
        /// The backing image.
        path: PathBuf,
        /// Its size, bytes.
        backing: u64,
        /// The overlay's size, bytes.
        disk: u64,
    },
    /// A copy-on-write disk's overlay holds data already or is not a regular file (it must be a
    /// new sparse file of the disk's size, on a file system with `SEEK_DATA`).
    #[error(
        "the copy-on-write disk {0} is not an empty sparse file (or its file system cannot tell \
         holes from data)"
    )]
    OverlayNotEmpty(PathBuf),
    /// A read-only disk was given a backing image.
    #[error("the disk {0} is read-only: only a writable disk can have a backing image")]
    ReadOnlyOverlay(PathBuf),
    /// Creating the device's activation eventfd failed.
    #[error("cannot create the block device's eventfd: {0}")]
    EventFd(std::io::Error),
}

//! virtio-fs (virtio 1.2 §5.11, device ID 26): a host directory shared with the guest, served
//! in-process by fuse-backend-rs's FUSE server over its passthrough file system.
//!
//! # The protocol in brief
//!
//! virtio-fs carries FUSE — the protocol Linux speaks to user-space file systems through
//! `/dev/fuse` — over virtqueues. The guest's FUSE client is the kernel (`mount -t virtiofs TAG
//! /mnt`, where `TAG` is the device's mount tag); the host side answers. The configuration space
//! (§5.11.4) holds the tag (36 bytes of UTF-8, NUL-padded, not NUL-terminated when it fills the
//! field) and `le32 num_request_queues`.
//!
//! Queues (§5.11.2): index 0 is the *hiprio* queue, which carries requests that must not wait
//! behind ordinary ones (FORGET, INTERRUPT); indices 1.. are request queues. This device has one
//! request queue.
//!
//! Each request is one descriptor chain (§5.11.6): device-readable buffers holding the FUSE
//! request — a 40-byte `fuse_in_header` (`len`, `opcode`, `unique`, `nodeid`, `uid`, `gid`,
//! `pid`) and the opcode's arguments — followed by device-writable buffers for the reply — a
//! 16-byte `fuse_out_header` (`len`, `error` as a negated errno, `unique`) and the opcode's
//! result. FORGET and BATCH_FORGET have no reply. The device returns each chain with the number
//! of reply bytes it wrote. FUSE addresses files by *node IDs* the server hands out in LOOKUP
//! replies (1 is the root of the share) and open files by *file handles* from OPEN/CREATE.
//!
//! # What serves the requests
//!
//! [`request`] maps each chain onto fuse-backend-rs's transport `Reader`/`Writer` and hands it to
//! its `Server`, which decodes the FUSE message, calls a `FileSystem` implementation and encodes
//! the reply. The file system is [`ShareFs`]: fuse-backend-rs's `PassthroughFs` (which works on
//! `O_PATH` file descriptors, one per node ID, and never resolves a path of more than one
//! component) behind this device's own policy layer ([`filesystem`]). DAX (the shared-memory
//! window of §5.11.6.3) is not offered.
//!
//! # Host-side enforcement (the guest is hostile)
//!
//! - **Read-only** shares refuse every operation that could change the host tree with `EROFS`
//!   (write, create, mknod, mkdir, symlink, link, unlink, rmdir, rename, setattr, setxattr,
//!   removexattr, fallocate, open with `O_WRONLY`/`O_RDWR`/`O_TRUNC`/`O_APPEND`/`O_CREAT`, access
//!   with `W_OK`), whatever the guest's mount flags say.
//! - **Containment**: names in requests must be single path components (not empty, `.`, `..`, and
//!   without `/`), so every host operation is one `*at` call relative to a directory the server
//!   already holds inside the share. The server never follows a symlink: lookups open with
//!   `O_PATH | O_NOFOLLOW`, only regular files and directories can be opened, and creation uses
//!   `O_EXCL`. Node IDs the guest invents are unknown to the server (`EBADF`), so hard links and
//!   renames only ever involve inodes inside the share. The root is pinned by a file descriptor
//!   taken when the device is created, so replacing the host path later does not move the share.
//! - **Ownership**: when the VMM runs as root, every operation runs with the share owner's
//!   credentials (effective uid/gid and supplementary groups switched per thread for the duration
//!   of the request), so files the guest creates belong to the owner, and the guest can do on the
//!   host exactly what the owner could: no chown to other users, no device nodes, no writes to
//!   files the owner cannot write. A writable share owned by root is refused unless an unprivileged
//!   owner is configured. Without root, the VMM's own identity is the owner.
//!
//! # Threading
//!
//! Requests are served synchronously on the event-loop thread, like virtio-blk's. FUSE requests
//! are at most 128 KiB of data (the guest's default `max_pages`, which this server does not
//! raise), which bounds how long one request holds the loop.
//!
//! # Module layout
//! - [`device`]: the [`Fs`] device — configuration space, activation, reset, the queue loop.
//! - [`request`]: serving one descriptor chain with the FUSE server.
//! - [`share`]: [`ShareFs`] — opening and validating the shared directory, the policy helpers.
//! - [`filesystem`]: the `FileSystem` implementation of [`ShareFs`] (policy + delegation).
//! - [`identity`]: whose credentials host operations run with.
//! - [`event_handler`]: routes event-loop events to the device's methods.

use std::path::PathBuf;

pub mod device;
pub mod event_handler;
pub mod filesystem;
pub mod identity;
pub mod request;
pub mod share;

#[cfg(test)]
mod tests;

pub use device::{Fs, FsConfig};
pub use share::ShareFs;

/// Size of each virtqueue, in descriptors. A guest request of 32 pages (128 KiB) plus headers
/// needs fewer than 40, so several requests fit without indirect descriptors.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the high-priority queue (virtio 1.2 §5.11.2).
pub const HIPRIO_QUEUE: usize = 0;
/// Index of the (only) request queue.
pub const REQUEST_QUEUE: usize = 1;
/// Maximum size of each virtqueue: hiprio, then one request queue.
pub const FS_QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE, QUEUE_SIZE];
/// Number of request queues, as advertised in `num_request_queues`.
pub const NUM_REQUEST_QUEUES: u32 = 1;

/// Size of the `tag` field of the configuration space, in bytes (virtio 1.2 §5.11.4).
pub const TAG_SIZE: usize = 36;
/// Offset of `le32 num_request_queues` in the configuration space.
pub const CONFIG_NUM_QUEUES_OFFSET: usize = TAG_SIZE;
/// Bytes of configuration space: the tag and `num_request_queues` (`notify_buf_size` needs
/// VIRTIO_FS_F_NOTIFICATION, not offered).
pub const CONFIG_SPACE_SIZE: usize = TAG_SIZE + 4;

/// Errors from creating a virtio-fs device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The mount tag is empty.
    #[error("the virtio-fs mount tag is empty")]
    EmptyTag,
    /// The mount tag does not fit in the configuration space.
    #[error("virtio-fs mount tag {tag:?} is {len} bytes long; at most 36 are allowed")]
    TagTooLong {
        /// The rejected tag.
        tag: String,
        /// Its length in bytes.
        len: usize,
    },
    /// The mount tag contains a NUL byte, which would end it early in the guest.
    #[error("virtio-fs mount tag {0:?} contains a NUL byte")]
    TagNul(String),
    /// The shared directory cannot be opened.
    #[error("cannot open shared directory {path}: {source}")]
    OpenDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The shared path is not a directory.
    #[error("shared path {0} is not a directory")]
    NotADirectory(PathBuf),
    /// A writable share would be served with host root's credentials.
    #[error(
        "refusing to share {0} read-write as host root: it is owned by root; configure an \
         unprivileged owner uid:gid for the files the guest creates"
    )]
    RootOwner(PathBuf),
    /// The owner differs from the VMM's identity, and the VMM lacks the privilege to act as it.
    #[error(
        "cannot serve the share as {uid}:{gid}: the VMM runs as {euid}:{egid} without root, so \
         the guest's files can only be owned by {euid}:{egid}"
    )]
    OwnerNeedsRoot {
        /// The requested owner's uid.
        uid: u32,
        /// The requested owner's gid.
        gid: u32,
        /// The VMM's effective uid.
        euid: u32,
        /// The VMM's effective gid.
        egid: u32,
    },
    /// The owner cannot read and search the shared directory.
    #[error("owner {uid}:{gid} cannot read shared directory {path}: {source}")]
    OwnerCannotAccess {
        /// The directory.
        path: PathBuf,
        /// The owner's uid.
        uid: u32,
        /// The owner's gid.
        gid: u32,
        /// The OS error.
        source: std::io::Error,
    },
    /// fuse-backend-rs's passthrough file system could not be set up (it needs `/proc/self/fd`).
    #[error("cannot set up the passthrough file system: {0}")]
    Passthrough(std::io::Error),
    /// A directory cannot be attached to a device whose share the guest has mounted.
    #[error("virtio-fs share {0} is mounted in the guest; a directory can only be attached to an idle one")]
    ShareInUse(String),
    /// Creating the device's activation eventfd failed.
    #[error("cannot create the virtio-fs device's eventfd: {0}")]
    EventFd(std::io::Error),
}

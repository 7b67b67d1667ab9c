//! virtio-vsock (virtio 1.2 §5.10) with a hybrid Unix-socket backend, compatible with Firecracker's
//! so that existing host clients work unchanged.
//!
//! # The protocol in brief
//!
//! The device connects stream sockets in the guest (`AF_VSOCK`) to the host. Every endpoint is a
//! (context ID, port) pair: the host is CID 2 ([`HOST_CID`]), the guest has the CID the VMM gave
//! it (≥ 3, read by the driver from the configuration space, a `le64 guest_cid`). Three virtqueues:
//! the guest posts empty buffers on **rx** (0) for packets to it, sends its packets on **tx** (1),
//! and posts buffers on **event** (2) for transport events.
//!
//! Each packet is a 44-byte little-endian header ([`packet::Header`]: CIDs, ports, payload `len`,
//! `type` = STREAM, `op`, `flags`, `buf_alloc`, `fwd_cnt`) followed by `len` payload bytes. A
//! connection starts with REQUEST, answered by RESPONSE (accepted) or RST (refused); RW carries
//! data; SHUTDOWN with RCV/SEND flags closes one or both directions, and the peer answers a full
//! SHUTDOWN with RST, which also aborts a connection at any time.
//!
//! Flow control is credit based: every packet advertises the sender's receive buffer size
//! (`buf_alloc`) and how many bytes it has consumed so far (`fwd_cnt`). A sender may have at most
//! `buf_alloc - (tx_cnt - fwd_cnt)` bytes in flight. CREDIT_UPDATE carries fresh values, and
//! CREDIT_REQUEST asks for them.
//!
//! # The hybrid backend
//!
//! Instead of host `AF_VSOCK` sockets (vhost-vsock), connections end in Unix stream sockets:
//! - **host → guest**: a client connects to the Unix socket at `uds_path` (created by the device,
//!   removed when it is dropped) and writes `CONNECT <port>\n`. The device picks an unused host
//!   port (counting up from 2^30, [`FIRST_LOCAL_PORT`]), sends REQUEST to the guest's `<port>`,
//!   and when the guest accepts, writes `OK <host port>\n` to the client; after that the socket
//!   carries the stream. If the guest refuses (RST) or does not answer within
//!   [`CONNECT_TIMEOUT`], the client socket is closed without `OK`.
//! - **guest → host**: a guest connection to CID 2, port P is connected to the Unix socket
//!   `<uds_path>_P`, where host software listens. RESPONSE if the connect succeeds, RST if not.
//!
//! # The event queue and snapshots
//!
//! The only event virtio 1.2 defines is TRANSPORT_RESET (§5.10.6.6), which tells the driver its
//! connections are gone. Host-side connections are not saved in a snapshot (their Unix sockets
//! belong to the process that took it), so a device restored from one sends this event once
//! ([`reset_event`]): the guest resets its connected sockets (listening ones survive) and
//! re-reads its CID. Until the guest has handled it (it re-posts the event buffer and notifies),
//! or [`RESET_ACK_TIMEOUT`] passes, the device holds packets for the guest, so a connection made
//! right after the restore is not reset with the old ones. Otherwise buffers posted on the event
//! queue stay there; the device has no device reset ([`VirtioDevice::reset`] returns `false`).
//!
//! # Module layout
//! - [`device`]: the [`Vsock`] device — features, configuration space, activation, queue draining.
//! - [`event_handler`]: routes event-loop events to the device's methods.
//! - `muxer`: the Unix listener, the connection table and the queue of packets for the guest.
//! - `connection`: one connection's state machine and credit accounting.
//! - [`packet`]: the packet header and protocol constants.
//! - [`reset_event`]: the TRANSPORT_RESET event a restored device sends.
//!
//! [`VirtioDevice::reset`]: super::VirtioDevice::reset

use std::io;
use std::path::PathBuf;
use std::time::Duration;

mod connection;
pub mod device;
pub mod event_handler;
mod muxer;
pub mod packet;
pub mod reset_event;
mod unix;

#[cfg(test)]
mod tests;

pub use connection::{ConnKey, ConnState, HalfClose};
pub use device::Vsock;

/// Size of each of the three virtqueues (rx, tx, event).
pub const VSOCK_QUEUE_SIZES: [u16; 3] = [256; 3];
/// Index of the receive queue (device → driver packets).
pub const RXQ_INDEX: usize = 0;
/// Index of the transmit queue (driver → device packets).
pub const TXQ_INDEX: usize = 1;
/// Index of the event queue.
pub const EVQ_INDEX: usize = 2;

/// The host's context ID (`VMADDR_CID_HOST`).
pub const HOST_CID: u64 = 2;
/// Smallest CID a guest may have (0–2 are reserved).
pub const MIN_GUEST_CID: u64 = 3;
/// Largest CID a guest may have (`u32::MAX` is `VMADDR_CID_ANY`; Linux keeps CIDs in 32 bits).
pub const MAX_GUEST_CID: u64 = u32::MAX as u64 - 1;

/// Receive buffer the device advertises per connection (`buf_alloc`), in bytes: the most guest
/// data it holds for a Unix socket that does not read.
pub const CONN_BUF_SIZE: u32 = 256 * 1024;
/// When the guest's view of our free receive space drops below this many bytes and we have freed
/// some since, we send a CREDIT_UPDATE.
pub const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_SIZE / 2;
/// Largest payload of one packet in either direction, in bytes (Linux's
/// `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`). Longer TX packets are rejected.
pub const MAX_PKT_DATA: u32 = 64 * 1024;

/// How long a host-initiated REQUEST (and a client's `CONNECT` line) may go unanswered: 10 s.
/// A guest with nothing listening answers RST at once, so this only bounds a guest that does
/// not answer at all. Firecracker uses 2 s; on an overloaded host (50 guests booting on two
/// CPUs in the nested test host) a listening guest took longer than that to answer, and the
/// client saw its connection closed as if nothing listened.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the device waits for the guest's RST after telling it the host client hung up.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);
/// Most simultaneous connections (including clients still sending `CONNECT`); more are refused.
pub const MAX_CONNECTIONS: usize = 1024;
/// First host port given to host-initiated connections (2^30, as Firecracker).
pub const FIRST_LOCAL_PORT: u32 = 1 << 30;
/// Longest `CONNECT <port>\n` line accepted, in bytes including the newline.
pub const MAX_CONNECT_LINE: usize = 32;
/// RSTs waiting for RX buffers beyond which the device stops reading the TX queue.
pub const RST_BACKLOG_LIMIT: usize = 32;
/// How long a restored device holds packets for the guest while waiting for it to acknowledge
/// the TRANSPORT_RESET event (5 s), counted from when the event loop first sees the device. A
/// Linux guest acknowledges within milliseconds of running; the bound keeps a guest that never
/// does (no event buffer posted, another driver) from losing its host connections for good.
pub const RESET_ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors from creating the vsock device.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The guest CID is reserved or out of range.
    #[error("guest CID {0} is invalid: it must be between 3 and 4294967294")]
    InvalidCid(u64),
    /// Something already exists at the socket path.
    #[error("vsock socket path {0} already exists; remove it (a previous VM may have left it)")]
    UdsPathExists(PathBuf),
    /// Binding or configuring the listening socket failed.
    #[error("cannot listen on vsock socket {path}: {source}")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Creating the device's eventfd or timerfd failed.
    #[error("cannot create the vsock device's event or timer fd: {0}")]
    EventFd(io::Error),
}

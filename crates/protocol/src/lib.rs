//! The wire protocol between the bulkhead host and `bulkhead-agent`, the guest's PID 1.
//!
//! # Primer
//!
//! The host reaches the agent over virtio-vsock. With the VMM's hybrid Unix-socket backend the
//! host connects to the VM's Unix socket, writes `CONNECT <port>\n`, reads `OK <hostport>\n`
//! and from then on has a plain byte stream to the guest's listener on `<port>`
//! ([`AGENT_PORT`]). A connection the guest opens to CID 2 port `P` arrives at the host
//! listener bound at `<socket path>_P`; the agent uses this once at boot to announce itself on
//! [`READY_PORT`].
//!
//! On every stream the bytes are *frames* ([`frame`]): a `u32` little-endian length of the
//! rest, a `u8` frame type and a payload. Control messages ([`messages`]) carry JSON; data
//! frames (stdout, stderr, stdin, file contents) carry raw bytes, never decoded.
//! Each connection carries exactly one request (an exec, a file write, a file read, a
//! shutdown, a workspace change set, [`workspace`], or the news that the VM was restored from a
//! snapshot, [`RestoredRequest`]); several commands at once use several connections.
//!
//! The full wire format, with every sequence and error case, is in `docs/agent-protocol.md`.
//!
//! This crate builds for the guest (static musl) and the host: it needs only `std`, `serde`
//! and, for the host-side [`client`], `libc::poll`.

#![deny(missing_docs)]

pub mod archive;
pub mod boot;
pub mod bytes;
pub mod client;
pub mod container;
pub mod frame;
pub mod fsops;
pub mod messages;
pub mod relay;
pub mod workspace;

pub use bytes::ByteString;
pub use container::{ContainerExec, Rlimit};
pub use frame::{read_frame, write_frame, Frame, FrameDecoder, FrameError, FrameType};
pub use fsops::{
    ArchiveDone, ArchiveReadRequest, ArchiveWriteRequest, FileEntry, FileType, FsOp, FsRequest,
};
pub use messages::{
    Ack, BootTimestamps, ConnectRequest, ErrorCode, ErrorMessage, ExecRequest, ExitStatus,
    FileReadRequest, FileWriteRequest, Ready, RestoredRequest, SharesRequest, ShutdownRequest,
    SignalRequest, Started, WindowSize, MAX_RESTORE_ENTROPY, MIN_RESTORE_ENTROPY,
};
pub use workspace::{
    ChangeRecord, ChangeStatus, ChangesEnd, EntryKind, SkippedEntry, WorkspaceChangesRequest,
};

/// The guest vsock port the agent listens on for host requests.
pub const AGENT_PORT: u32 = 1024;

/// The host vsock port the agent connects to (guest → CID 2) once at boot to send [`Ready`].
/// With the hybrid backend the host listens on the Unix socket `<vm socket path>_1025`.
pub const READY_PORT: u32 = 1025;

/// The host vsock port the agent connects to (guest → CID 2) for each connection a guest
/// program opens to its proxy (the egress relay, `bulkhead.egress=on`). With the hybrid backend
/// the host's egress proxy listens on the Unix socket `<vm socket path>_1026`.
pub const EGRESS_PORT: u32 = 1026;

/// The guest TCP port on `127.0.0.1` where the agent's egress relay listens; guest programs get
/// `HTTP_PROXY=http://127.0.0.1:3128`.
pub const GUEST_PROXY_PORT: u16 = 3128;

/// Version of this protocol. Carried in [`Ready`] and in every host request; a peer that sees
/// another version answers with an `Error` frame and closes the connection.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest payload of one frame, in bytes (1 MiB). The length field counts the type byte too,
/// so the largest valid length field is `MAX_FRAME + 1`. Larger frames are rejected on read
/// before their payload is read, and refused on write.
pub const MAX_FRAME: u32 = 1024 * 1024;

/// Size of the data frames both sides send (stdout, stderr, stdin, file contents), in bytes
/// (16 KiB). Receivers accept any size up to [`MAX_FRAME`].
pub const DATA_CHUNK: usize = 16 * 1024;

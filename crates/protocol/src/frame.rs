//! Framing: how messages and raw bytes travel on a byte stream.
//!
//! ```text
//! +----------------------+-----------+----------------------------+
//! | len: u32 little end. | type: u8  | payload: len - 1 bytes     |
//! +----------------------+-----------+----------------------------+
//! ```
//!
//! `len` counts the type byte and the payload, so it is at least 1 and at most
//! [`MAX_FRAME`]` + 1`. Control frames carry one JSON object (see [`crate::messages`]);
//! data frames (`Stdin`, `Stdout`, `Stderr`, `Data`) carry raw bytes; `StdinEof` and `End`
//! carry nothing. Any error while reading (oversized length, unknown type, bad JSON,
//! truncated frame) leaves the stream out of sync: the reader reports it and drops the
//! connection.

use std::fmt;
use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::fsops::{ArchiveDone, ArchiveReadRequest, ArchiveWriteRequest, FileEntry, FsRequest};
use crate::messages::{
    Ack, ConnectRequest, ErrorCode, ErrorMessage, ExecRequest, ExitStatus, FileReadRequest,
    FileWriteRequest, Ready, RestoredRequest, SharesRequest, ShutdownRequest, SignalRequest,
    Started, WindowSize,
};
use crate::workspace::{ChangeRecord, ChangesEnd, WorkspaceChangesRequest};
use crate::MAX_FRAME;

/// Bytes before the payload: the `u32` length and the `u8` type.
pub const HEADER_LEN: usize = 5;

/// Errors of framing and message decoding.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The underlying stream failed.
    #[error("frame I/O: {0}")]
    Io(#[from] io::Error),
    /// The length field is 0, so the frame has no type byte.
    #[error("frame length 0: a frame needs at least its type byte")]
    Empty,
    /// The payload is larger than [`MAX_FRAME`] bytes.
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Payload bytes announced (or offered, on write).
        len: u64,
        /// The limit, [`MAX_FRAME`].
        max: u32,
    },
    /// The type byte is not one of [`FrameType`].
    #[error("unknown frame type 0x{0:02x}")]
    UnknownType(u8),
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame: expected {expected} bytes, got {got}")]
    Truncated {
        /// Bytes the frame needed (header or header + payload).
        expected: u64,
        /// Bytes that arrived before end of stream.
        got: u64,
    },
    /// A control frame's payload is not the JSON object its type requires.
    #[error("malformed {kind} payload: {source}")]
    BadJson {
        /// Type of the offending frame.
        kind: FrameType,
        /// What serde_json reported.
        source: serde_json::Error,
    },
    /// A frame that must be empty (`StdinEof`, `End`) has a payload.
    #[error("{kind} frame must be empty, has {len} payload bytes")]
    UnexpectedPayload {
        /// Type of the offending frame.
        kind: FrameType,
        /// Its payload length in bytes.
        len: usize,
    },
}

/// The type byte of a frame. Values are part of the wire format (`docs/agent-protocol.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// Guest → host at boot, JSON [`Ready`].
    Ready = 0x01,
    /// Host → guest, JSON [`ExecRequest`].
    Exec = 0x02,
    /// Host → guest, JSON [`FileWriteRequest`].
    FileWrite = 0x03,
    /// Host → guest, JSON [`FileReadRequest`].
    FileRead = 0x04,
    /// Host → guest, JSON [`ShutdownRequest`].
    Shutdown = 0x05,
    /// Host → guest, JSON [`WorkspaceChangesRequest`].
    WorkspaceChanges = 0x06,
    /// Host → guest, JSON [`RestoredRequest`]: the VM was just restored from a snapshot.
    Restored = 0x07,
    /// Host → guest, JSON [`ArchiveWriteRequest`], then `Data` (a tar stream) and `End`.
    ArchiveWrite = 0x08,
    /// Host → guest, JSON [`ArchiveReadRequest`].
    ArchiveRead = 0x09,
    /// Host → guest, JSON [`FsRequest`] (list, stat, mkdir, remove).
    Fs = 0x0a,
    /// Host → guest, JSON [`ConnectRequest`]; after its `Ack` the connection carries raw bytes.
    Connect = 0x0b,
    /// Host → guest, JSON [`SharesRequest`]: unmount (or mount again) the virtio-fs shares.
    Shares = 0x0c,
    /// Guest → host, JSON [`Started`].
    Started = 0x10,
    /// Host → guest, raw bytes for the command's stdin.
    Stdin = 0x11,
    /// Host → guest, empty: close the command's stdin.
    StdinEof = 0x12,
    /// Host → guest, JSON [`SignalRequest`].
    Signal = 0x13,
    /// Guest → host, raw bytes the command wrote to stdout.
    Stdout = 0x14,
    /// Guest → host, raw bytes the command wrote to stderr.
    Stderr = 0x15,
    /// Guest → host, JSON [`ExitStatus`]; last frame of an exec.
    Exit = 0x16,
    /// Host → guest, JSON [`WindowSize`]: the terminal of a `tty` exec changed size.
    Resize = 0x17,
    /// Either way, raw file contents.
    Data = 0x20,
    /// Either way, empty: end of file contents.
    End = 0x21,
    /// Guest → host, JSON [`Ack`].
    Ack = 0x22,
    /// Guest → host, JSON [`FileEntry`]: one answer of an `Fs` list or stat.
    FileEntry = 0x23,
    /// Guest → host, JSON [`ArchiveDone`]: last frame of an archive transfer.
    ArchiveDone = 0x24,
    /// Guest → host, JSON [`ChangeRecord`]: one changed workspace path.
    Change = 0x30,
    /// Guest → host, JSON [`ChangesEnd`]: last frame of a change set.
    ChangesEnd = 0x31,
    /// Guest → host, JSON [`ErrorMessage`]; last frame of a failed request.
    Error = 0x7f,
}

impl FrameType {
    const ALL: [FrameType; 28] = [
        Self::Ready,
        Self::Exec,
        Self::FileWrite,
        Self::FileRead,
        Self::Shutdown,
        Self::WorkspaceChanges,
        Self::Restored,
        Self::ArchiveWrite,
        Self::ArchiveRead,
        Self::Fs,
        Self::Connect,
        Self::Shares,
        Self::Started,
        Self::Stdin,
        Self::StdinEof,
        Self::Signal,
        Self::Stdout,
        Self::Stderr,
        Self::Exit,
        Self::Resize,
        Self::Data,
        Self::End,
        Self::Ack,
        Self::FileEntry,
        Self::ArchiveDone,
        Self::Change,
        Self::ChangesEnd,
        Self::Error,
    ];

    /// The frame type for a type byte, or `None` for an unknown byte.
    pub fn from_byte(byte: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u8 == byte)
    }

    /// True for types whose payload is raw bytes.
    pub fn is_data(self) -> bool {
        matches!(self, Self::Stdin | Self::Stdout | Self::Stderr | Self::Data)
    }

    /// True for types whose payload must be empty.
    pub fn is_empty(self) -> bool {
        matches!(self, Self::StdinEof | Self::End)
    }
}

impl fmt::Display for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// See [`FrameType::Ready`].
    Ready(Ready),
    /// See [`FrameType::Exec`].
    Exec(ExecRequest),
    /// See [`FrameType::FileWrite`].
    FileWrite(FileWriteRequest),
    /// See [`FrameType::FileRead`].
    FileRead(FileReadRequest),
    /// See [`FrameType::Shutdown`].
    Shutdown(ShutdownRequest),
    /// See [`FrameType::WorkspaceChanges`].
    WorkspaceChanges(WorkspaceChangesRequest),
    /// See [`FrameType::Restored`].
    Restored(RestoredRequest),
    /// See [`FrameType::ArchiveWrite`].
    ArchiveWrite(ArchiveWriteRequest),
    /// See [`FrameType::ArchiveRead`].
    ArchiveRead(ArchiveReadRequest),
    /// See [`FrameType::Fs`].
    Fs(FsRequest),
    /// See [`FrameType::Shares`].
    Shares(SharesRequest),
    /// See [`FrameType::Connect`].
    Connect(ConnectRequest),
    /// See [`FrameType::Started`].
    Started(Started),
    /// See [`FrameType::Stdin`].
    Stdin(Vec<u8>),
    /// See [`FrameType::StdinEof`].
    StdinEof,
    /// See [`FrameType::Signal`].
    Signal(SignalRequest),
    /// See [`FrameType::Stdout`].
    Stdout(Vec<u8>),
    /// See [`FrameType::Stderr`].
    Stderr(Vec<u8>),
    /// See [`FrameType::Exit`].
    Exit(ExitStatus),
    /// See [`FrameType::Resize`].
    Resize(WindowSize),
    /// See [`FrameType::Data`].
    Data(Vec<u8>),
    /// See [`FrameType::End`].
    End,
    /// See [`FrameType::Ack`].
    Ack(Ack),
    /// See [`FrameType::FileEntry`].
    FileEntry(FileEntry),
    /// See [`FrameType::ArchiveDone`].
    ArchiveDone(ArchiveDone),
    /// See [`FrameType::Change`].
    Change(ChangeRecord),
    /// See [`FrameType::ChangesEnd`].
    ChangesEnd(ChangesEnd),
    /// See [`FrameType::Error`].
    Error(ErrorMessage),
}

impl Frame {
    /// An `Error` frame of class `code` with `message`.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Error(ErrorMessage::new(code, message))
    }

    /// This frame's type byte.
    pub fn kind(&self) -> FrameType {
        match self {
            Self::Ready(_) => FrameType::Ready,
            Self::Exec(_) => FrameType::Exec,
            Self::FileWrite(_) => FrameType::FileWrite,
            Self::FileRead(_) => FrameType::FileRead,
            Self::Shutdown(_) => FrameType::Shutdown,
            Self::WorkspaceChanges(_) => FrameType::WorkspaceChanges,
            Self::Restored(_) => FrameType::Restored,
            Self::ArchiveWrite(_) => FrameType::ArchiveWrite,
            Self::ArchiveRead(_) => FrameType::ArchiveRead,
            Self::Fs(_) => FrameType::Fs,
            Self::Connect(_) => FrameType::Connect,
            Self::Shares(_) => FrameType::Shares,
            Self::Started(_) => FrameType::Started,
            Self::Stdin(_) => FrameType::Stdin,
            Self::StdinEof => FrameType::StdinEof,
            Self::Signal(_) => FrameType::Signal,
            Self::Stdout(_) => FrameType::Stdout,
            Self::Stderr(_) => FrameType::Stderr,
            Self::Exit(_) => FrameType::Exit,
            Self::Resize(_) => FrameType::Resize,
            Self::Data(_) => FrameType::Data,
            Self::End => FrameType::End,
            Self::Ack(_) => FrameType::Ack,
            Self::FileEntry(_) => FrameType::FileEntry,
            Self::ArchiveDone(_) => FrameType::ArchiveDone,
            Self::Change(_) => FrameType::Change,
            Self::ChangesEnd(_) => FrameType::ChangesEnd,
            Self::Error(_) => FrameType::Error,
        }
    }

    /// Appends the encoded frame (header and payload) to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        match self {
            Self::Stdin(b) | Self::Stdout(b) | Self::Stderr(b) | Self::Data(b) => {
                encode_raw(self.kind(), b, out)
            }
            Self::StdinEof | Self::End => encode_raw(self.kind(), &[], out),
            Self::Ready(m) => encode_json(FrameType::Ready, m, out),
            Self::Exec(m) => encode_json(FrameType::Exec, m, out),
            Self::FileWrite(m) => encode_json(FrameType::FileWrite, m, out),
            Self::FileRead(m) => encode_json(FrameType::FileRead, m, out),
            Self::Shutdown(m) => encode_json(FrameType::Shutdown, m, out),
            Self::WorkspaceChanges(m) => encode_json(FrameType::WorkspaceChanges, m, out),
            Self::Restored(m) => encode_json(FrameType::Restored, m, out),
            Self::ArchiveWrite(m) => encode_json(FrameType::ArchiveWrite, m, out),
            Self::ArchiveRead(m) => encode_json(FrameType::ArchiveRead, m, out),
            Self::Fs(m) => encode_json(FrameType::Fs, m, out),
            Self::Connect(m) => encode_json(FrameType::Connect, m, out),
            Self::Shares(m) => encode_json(FrameType::Shares, m, out),
            Self::FileEntry(m) => encode_json(FrameType::FileEntry, m, out),
            Self::ArchiveDone(m) => encode_json(FrameType::ArchiveDone, m, out),
            Self::Started(m) => encode_json(FrameType::Started, m, out),
            Self::Signal(m) => encode_json(FrameType::Signal, m, out),
            Self::Exit(m) => encode_json(FrameType::Exit, m, out),
            Self::Resize(m) => encode_json(FrameType::Resize, m, out),
            Self::Ack(m) => encode_json(FrameType::Ack, m, out),
            Self::Change(m) => encode_json(FrameType::Change, m, out),
            Self::ChangesEnd(m) => encode_json(FrameType::ChangesEnd, m, out),
            Self::Error(m) => encode_json(FrameType::Error, m, out),
        }
    }

    /// The encoded frame (header and payload) as a new buffer.
    pub fn encode(&self) -> Result<Vec<u8>, FrameError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Builds a frame from its type and complete payload.
    pub fn decode(kind: FrameType, payload: Vec<u8>) -> Result<Self, FrameError> {
        if kind.is_empty() && !payload.is_empty() {
            return Err(FrameError::UnexpectedPayload {
                kind,
                len: payload.len(),
            });
        }
        Ok(match kind {
            FrameType::Stdin => Self::Stdin(payload),
            FrameType::Stdout => Self::Stdout(payload),
            FrameType::Stderr => Self::Stderr(payload),
            FrameType::Data => Self::Data(payload),
            FrameType::StdinEof => Self::StdinEof,
            FrameType::End => Self::End,
            FrameType::Ready => Self::Ready(json(kind, &payload)?),
            FrameType::Exec => Self::Exec(json(kind, &payload)?),
            FrameType::FileWrite => Self::FileWrite(json(kind, &payload)?),
            FrameType::FileRead => Self::FileRead(json(kind, &payload)?),
            FrameType::Shutdown => Self::Shutdown(json(kind, &payload)?),
            FrameType::WorkspaceChanges => Self::WorkspaceChanges(json(kind, &payload)?),
            FrameType::Restored => Self::Restored(json(kind, &payload)?),
            FrameType::ArchiveWrite => Self::ArchiveWrite(json(kind, &payload)?),
            FrameType::ArchiveRead => Self::ArchiveRead(json(kind, &payload)?),
            FrameType::Fs => Self::Fs(json(kind, &payload)?),
            FrameType::Connect => Self::Connect(json(kind, &payload)?),
            FrameType::Shares => Self::Shares(json(kind, &payload)?),
            FrameType::FileEntry => Self::FileEntry(json(kind, &payload)?),
            FrameType::ArchiveDone => Self::ArchiveDone(json(kind, &payload)?),
            FrameType::Started => Self::Started(json(kind, &payload)?),
            FrameType::Signal => Self::Signal(json(kind, &payload)?),
            FrameType::Exit => Self::Exit(json(kind, &payload)?),
            FrameType::Resize => Self::Resize(json(kind, &payload)?),
            FrameType::Ack => Self::Ack(json(kind, &payload)?),
            FrameType::Change => Self::Change(json(kind, &payload)?),
            FrameType::ChangesEnd => Self::ChangesEnd(json(kind, &payload)?),
            FrameType::Error => Self::Error(json(kind, &payload)?),
        })
    }
}

fn json<T: DeserializeOwned>(kind: FrameType, payload: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(payload).map_err(|source| FrameError::BadJson { kind, source })
}

fn encode_json<T: Serialize>(
    kind: FrameType,
    msg: &T,
    out: &mut Vec<u8>,
) -> Result<(), FrameError> {
    let payload = serde_json::to_vec(msg).map_err(|source| FrameError::BadJson { kind, source })?;
    encode_raw(kind, &payload, out)
}

/// Appends a frame of type `kind` with `payload` to `out` without building a [`Frame`]
/// (saves a copy for data frames). Fails when `payload` exceeds [`MAX_FRAME`] bytes.
pub fn encode_raw(kind: FrameType, payload: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    let len = payload.len() as u64;
    if len > u64::from(MAX_FRAME) {
        return Err(FrameError::TooLarge {
            len,
            max: MAX_FRAME,
        });
    }
    // `len <= MAX_FRAME` (1 MiB), so `len + 1` fits a u32.
    let wire_len = (len as u32) + 1;
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&wire_len.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(payload);
    Ok(())
}

/// Checks a header and returns the frame type and payload length in bytes.
pub fn parse_header(header: [u8; HEADER_LEN]) -> Result<(FrameType, usize), FrameError> {
    let wire_len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let Some(payload_len) = wire_len.checked_sub(1) else {
        return Err(FrameError::Empty);
    };
    if payload_len > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: u64::from(payload_len),
            max: MAX_FRAME,
        });
    }
    let kind = FrameType::from_byte(header[4]).ok_or(FrameError::UnknownType(header[4]))?;
    Ok((kind, payload_len as usize))
}

/// Writes one frame as a single `write_all` of header and payload.
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> Result<(), FrameError> {
    let bytes = frame.encode()?;
    w.write_all(&bytes)?;
    Ok(())
}

/// Reads one frame. `Ok(None)` means the stream ended cleanly between frames; an end of
/// stream inside a frame is [`FrameError::Truncated`]. An oversized length is rejected before
/// any payload is read (so a hostile peer can make the reader allocate at most 1 MiB).
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>, FrameError> {
    let mut header = [0u8; HEADER_LEN];
    let got = read_full(r, &mut header)?;
    if got == 0 {
        return Ok(None);
    }
    if got < HEADER_LEN {
        return Err(FrameError::Truncated {
            expected: HEADER_LEN as u64,
            got: got as u64,
        });
    }
    let (kind, len) = parse_header(header)?;
    // `len` is at most MAX_FRAME (1 MiB), checked by parse_header.
    let mut payload = Vec::with_capacity(len);
    let got = r.take(len as u64).read_to_end(&mut payload)?;
    if got < len {
        return Err(FrameError::Truncated {
            expected: (HEADER_LEN + len) as u64,
            got: (HEADER_LEN + got) as u64,
        });
    }
    Frame::decode(kind, payload).map(Some)
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Incremental decoder for event loops with non-blocking streams: push whatever bytes
/// arrived, then take complete frames out. An oversized or unknown header is reported as
/// soon as its 5 bytes are in, without waiting for the payload. After any error the decoder
/// (like the stream) is out of sync and must be dropped.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
}

impl FrameDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > 64 * 1024 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes pushed but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next complete frame, `Ok(None)` when more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let avail = &self.buf[self.start..];
        let Some(header) = avail.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let (kind, len) = parse_header(*header)?;
        if avail.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let payload = avail[HEADER_LEN..HEADER_LEN + len].to_vec();
        self.start += HEADER_LEN + len;
        Frame::decode(kind, payload).map(Some)
    }

    /// Call at end of stream: an error when a partial frame is left over.
    pub fn finish(&self) -> Result<(), FrameError> {
        match self.buffered() {
            0 => Ok(()),
            got => Err(FrameError::Truncated {
                expected: self.expected_len(),
                got: got as u64,
            }),
        }
    }

    fn expected_len(&self) -> u64 {
        let avail = &self.buf[self.start..];
        match avail.first_chunk::<4>() {
            Some(len) => 4 + u64::from(u32::from_le_bytes(*len)),
            None => HEADER_LEN as u64,
        }
    }
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;

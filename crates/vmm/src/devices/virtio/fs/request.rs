//! Serving one descriptor chain: the FUSE request in its device-readable buffers goes to the
//! server, the reply comes back in its device-writable buffers.
//!
//! The server (fuse-backend-rs's `Server::handle_message`) decodes and validates the message; it
//! answers most malformed requests with an error reply itself. Where it gives up without one (a
//! body shorter than the opcode's arguments, a reply that does not fit, ...), this module answers
//! with `EINVAL` or `EIO` so the guest's request does not hang, provided the request header was
//! readable (its `unique` identifies the reply) and the chain has room for a 16-byte reply header.
//! A chain that cannot even be mapped (a buffer outside guest memory, lengths that overflow) or
//! that holds less than a request header goes back unanswered, with used length 0. Every chain
//! goes back to the used ring either way (see [`device`](super::device)).
//!
//! Opcode numbers without a variant in fuse-backend-rs's `Opcode` enum below its `MaxOpcode`
//! (0, 7 and 19) are answered with `ENOSYS` here and never reach the server: its `From<u32>` for
//! `Opcode` transmutes them into an invalid enum value, which it does when `log` trace-level
//! logging is on.
//!
//! Whether the server wrote a reply before failing is read back from guest memory: the first 16
//! writable bytes are zeroed before the request is served, so a nonzero `len` with the request's
//! `unique` means it did. A guest that races with that only confuses itself; the used length is
//! never more than the chain's writable bytes.

use std::io;
use std::mem::size_of;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use fuse_backend_rs::abi::fuse_abi::{InHeader, Opcode, OutHeader};
use fuse_backend_rs::api::server::Server;
use fuse_backend_rs::transport::{Reader, VirtioFsWriter};
use virtio_queue::DescriptorChain;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryMmap};

use super::ShareFs;

/// The FUSE server of one share.
pub type FuseServer = Server<Arc<ShareFs>>;

/// Bytes of a `fuse_in_header`, the start of every request.
pub const IN_HEADER_SIZE: usize = size_of::<InHeader>();
/// Bytes of a `fuse_out_header`, the start of every reply.
pub const OUT_HEADER_SIZE: usize = size_of::<OutHeader>();

/// Opcodes below fuse-backend-rs's `Opcode::MaxOpcode` that have no `Opcode` variant.
const UNNAMED_OPCODES: [u32; 3] = [0, 7, 19];

/// Why a chain goes back unanswered.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A buffer lies outside guest memory, or the buffers' lengths overflow.
    #[error("cannot map the chain's buffers: {0}")]
    Map(fuse_backend_rs::transport::Error),
    /// The device-readable part is shorter than a `fuse_in_header`.
    #[error("the request is shorter than a FUSE header: {0}")]
    ShortHeader(io::Error),
}

/// Serves the FUSE request in `chain`; returns the used length (reply bytes written, 0 when
/// unanswered).
pub fn serve_chain(
    server: &FuseServer,
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> u32 {
    let head = chain.head_index();
    match Exchange::map(mem, chain) {
        Ok(exchange) => exchange.serve(server),
        Err(e) => {
            tracing::debug!("virtio-fs: chain {head} returned unanswered: {e}");
            0
        }
    }
}

/// A mapped request and its reply buffers.
struct Exchange<'a> {
    mem: &'a GuestMemoryMmap,
    header: InHeader,
    reader: Reader<'a>,
    writer: VirtioFsWriter<'a>,
    /// Where the reply header goes: the first [`OUT_HEADER_SIZE`] writable bytes, as guest ranges;
    /// empty when the chain has fewer writable bytes.
    reply_header: Vec<(GuestAddress, usize)>,
}

impl<'a> Exchange<'a> {
    fn map(
        mem: &'a GuestMemoryMmap,
        chain: DescriptorChain<&'a GuestMemoryMmap>,
    ) -> Result<Exchange<'a>, Error> {
        let reader = Reader::from_descriptor_chain(mem, chain.clone()).map_err(Error::Map)?;
        let writer = VirtioFsWriter::new(mem, chain.clone()).map_err(Error::Map)?;
        let header = reader
            .clone()
            .read_obj::<InHeader>()
            .map_err(Error::ShortHeader)?;
        Ok(Exchange {
            mem,
            header,
            reader,
            writer,
            reply_header: reply_header_ranges(chain),
        })
    }

    /// Hands the request to the server; answers it here if the server could not.
    fn serve(self, server: &FuseServer) -> u32 {
        let Exchange {
            mem,
            header,
            reader,
            writer,
            reply_header,
        } = self;
        let writable = writer.available_bytes();
        let slot = ReplySlot {
            mem,
            ranges: reply_header,
        };
        slot.clear();
        if UNNAMED_OPCODES.contains(&header.opcode) {
            return u32::try_from(slot.recover(&header, libc::ENOSYS)).unwrap_or(0);
        }
        let served = catch_unwind(AssertUnwindSafe(|| {
            server.handle_message(reader, writer.into(), None, None)
        }));
        let len = match served {
            Ok(Ok(len)) => len,
            Ok(Err(e)) => {
                tracing::debug!(
                    "virtio-fs: request {} (opcode {}) failed: {e}",
                    header.unique,
                    header.opcode
                );
                slot.recover(&header, errno_for(&e))
            }
            Err(_) => {
                tracing::error!(
                    "virtio-fs: the FUSE server panicked on opcode {}",
                    header.opcode
                );
                slot.recover(&header, libc::EIO)
            }
        };
        u32::try_from(len.min(writable)).unwrap_or(u32::MAX)
    }
}

/// The guest memory that holds a chain's reply header.
struct ReplySlot<'a> {
    mem: &'a GuestMemoryMmap,
    ranges: Vec<(GuestAddress, usize)>,
}

impl ReplySlot<'_> {
    /// Zeroes the reply header, so that a reply the server writes can be recognised.
    fn clear(&self) {
        self.write(&[0; OUT_HEADER_SIZE]);
    }

    /// After a failed request: the length of the reply the server already wrote, else of an error
    /// reply written here with `errno`; 0 for requests that take no reply or without room.
    fn recover(&self, request: &InHeader, errno: i32) -> usize {
        if let Some(written) = self.read().filter(|out| out.unique == request.unique) {
            if written.len as usize >= OUT_HEADER_SIZE {
                return written.len as usize;
            }
        }
        if !expects_reply(request.opcode) {
            return 0;
        }
        let reply = OutHeader {
            len: OUT_HEADER_SIZE as u32,
            error: -errno,
            unique: request.unique,
        };
        if self.write(reply.as_slice()) {
            OUT_HEADER_SIZE
        } else {
            0
        }
    }

    fn read(&self) -> Option<OutHeader> {
        let mut out = OutHeader::default();
        let bytes = out.as_mut_slice();
        let mut at = 0;
        for &(addr, len) in &self.ranges {
            self.mem
                .read_slice(bytes.get_mut(at..at + len)?, addr)
                .ok()?;
            at += len;
        }
        (at == OUT_HEADER_SIZE).then_some(out)
    }

    /// Writes `bytes` (a reply header) over the ranges; false if there is no room.
    fn write(&self, bytes: &[u8]) -> bool {
        let mut at = 0;
        for &(addr, len) in &self.ranges {
            let Some(part) = bytes.get(at..at + len) else {
                return false;
            };
            if self.mem.write_slice(part, addr).is_err() {
                return false;
            }
            at += len;
        }
        at == OUT_HEADER_SIZE
    }
}

/// The guest ranges of the first [`OUT_HEADER_SIZE`] device-writable bytes of `chain`, or none if
/// it has fewer.
fn reply_header_ranges(chain: DescriptorChain<&GuestMemoryMmap>) -> Vec<(GuestAddress, usize)> {
    let mut ranges = Vec::new();
    let mut need = OUT_HEADER_SIZE;
    for desc in chain.writable() {
        if need == 0 {
            break;
        }
        let take = need.min(desc.len() as usize);
        if take > 0 {
            ranges.push((desc.addr(), take));
            need -= take;
        }
    }
    if need == 0 {
        ranges
    } else {
        Vec::new()
    }
}

/// Whether the guest waits for a reply to `opcode` (FORGET and BATCH_FORGET take none).
fn expects_reply(opcode: u32) -> bool {
    opcode != Opcode::Forget as u32 && opcode != Opcode::BatchForget as u32
}

/// The errno for a request the server gave up on: `EINVAL` for a malformed message, `EIO` else.
fn errno_for(error: &fuse_backend_rs::Error) -> i32 {
    use fuse_backend_rs::Error as E;
    match error {
        E::DecodeMessage(_)
        | E::MissingParameter
        | E::InvalidCString(_)
        | E::InvalidHeaderLength
        | E::InvalidXattrSize(_) => libc::EINVAL,
        _ => libc::EIO,
    }
}

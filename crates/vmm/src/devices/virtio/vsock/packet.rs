//! The virtio-vsock packet header (virtio 1.2 §5.10.6) as a plain value, and the field values the
//! device understands.
//!
//! `virtio_vsock::packet::VsockPacket` locates a packet's header and data in a descriptor chain;
//! this module copies the header out of guest memory once ([`Header::from_packet`]) so that every
//! decision the device takes is based on one snapshot the guest cannot change under it.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use virtio_vsock::packet::{VsockPacket, PKT_HEADER_SIZE};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{Bytes, GuestMemory};

/// Size of the packet header in bytes (virtio 1.2 §5.10.6, `struct virtio_vsock_hdr`).
pub const HEADER_SIZE: usize = PKT_HEADER_SIZE;

/// The socket type of stream connections (`VIRTIO_VSOCK_TYPE_STREAM`), the only one supported.
pub const TYPE_STREAM: u16 = 1;

/// SHUTDOWN flag: the sender will receive no more data (`VIRTIO_VSOCK_SHUTDOWN_RCV`).
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data (`VIRTIO_VSOCK_SHUTDOWN_SEND`).
pub const SHUTDOWN_SEND: u32 = 2;
/// Both SHUTDOWN flags: the sender is closing the connection.
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// Packet operations (virtio 1.2 §5.10.6, `VIRTIO_VSOCK_OP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    /// Connection request.
    Request = 1,
    /// Connection accepted.
    Response = 2,
    /// Connection refused or aborted.
    Rst = 3,
    /// Half or full close; `flags` holds [`SHUTDOWN_RCV`] / [`SHUTDOWN_SEND`].
    Shutdown = 4,
    /// Stream data.
    Rw = 5,
    /// The sender's receive-buffer accounting (`buf_alloc`, `fwd_cnt`) changed.
    CreditUpdate = 6,
    /// Asks the receiver to send a [`Op::CreditUpdate`].
    CreditRequest = 7,
}

impl Op {
    /// The operation with wire value `value`, or `None` for values the spec does not define.
    pub fn from_wire(value: u16) -> Option<Op> {
        Some(match value {
            1 => Op::Request,
            2 => Op::Response,
            3 => Op::Rst,
            4 => Op::Shutdown,
            5 => Op::Rw,
            6 => Op::CreditUpdate,
            7 => Op::CreditRequest,
            _ => return None,
        })
    }
}

/// A copy of a packet header, fields in host byte order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Source context ID.
    pub src_cid: u64,
    /// Destination context ID.
    pub dst_cid: u64,
    /// Source port.
    pub src_port: u32,
    /// Destination port.
    pub dst_port: u32,
    /// Payload length in bytes.
    pub len: u32,
    /// Socket type ([`TYPE_STREAM`]).
    pub type_: u16,
    /// Operation (wire value of an [`Op`]).
    pub op: u16,
    /// Operation flags (SHUTDOWN flags).
    pub flags: u32,
    /// The sender's receive buffer size for this connection, in bytes.
    pub buf_alloc: u32,
    /// Bytes the sender has consumed from its receive buffer since the connection started
    /// (wraps at 2^32).
    pub fwd_cnt: u32,
}

impl Header {
    /// Copies the header of a parsed packet.
    pub fn from_packet<B: BitmapSlice>(pkt: &VsockPacket<'_, B>) -> Header {
        Header {
            src_cid: pkt.src_cid(),
            dst_cid: pkt.dst_cid(),
            src_port: pkt.src_port(),
            dst_port: pkt.dst_port(),
            len: pkt.len(),
            type_: pkt.type_(),
            op: pkt.op(),
            flags: pkt.flags(),
            buf_alloc: pkt.buf_alloc(),
            fwd_cnt: pkt.fwd_cnt(),
        }
    }

    /// Decodes the little-endian wire layout.
    pub fn from_bytes(b: &[u8; HEADER_SIZE]) -> Header {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap_or_default());
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    /// Encodes the little-endian wire layout.
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    /// The operation, if the wire value is a defined one.
    pub fn operation(&self) -> Option<Op> {
        Op::from_wire(self.op)
    }
}

/// Reads the header from the head descriptor of a TX chain that `VsockPacket` rejected (for
/// example because its data descriptor is too short), so the device can reset the connection the
/// packet claims to belong to. `None` when the head is device-writable, shorter than a header or
/// outside guest memory.
pub fn header_of_rejected_chain<M>(mut chain: DescriptorChain<M>) -> Option<Header>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let head = chain.next()?;
    if head.is_write_only() || (head.len() as usize) < HEADER_SIZE {
        return None;
    }
    let mut raw = [0u8; HEADER_SIZE];
    chain.memory().read_slice(&mut raw, head.addr()).ok()?;
    Some(Header::from_bytes(&raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_through_wire_layout() {
        let hdr = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1024,
            dst_port: 52,
            len: 7,
            type_: TYPE_STREAM,
            op: Op::Rw as u16,
            flags: SHUTDOWN_SEND,
            buf_alloc: 262_144,
            fwd_cnt: 99,
        };

        let bytes = hdr.to_bytes();

        assert_eq!(Header::from_bytes(&bytes), hdr);
        assert_eq!(&bytes[30..32], &[5, 0], "op sits at byte offset 30");
    }

    #[test]
    fn undefined_ops_are_rejected() {
        assert_eq!(Op::from_wire(0), None);
        assert_eq!(Op::from_wire(8), None);
        assert_eq!(Op::from_wire(7), Some(Op::CreditRequest));
    }
}

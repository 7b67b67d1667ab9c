//! The guest driver's side of one split virtqueue, on top of virtio-queue's mock driver
//! (`virtio_queue::mock::MockSplitQueue`), and the encoding of descriptor chains in fuzz inputs.
//!
//! The mock driver lays out the descriptor table and the avail ring and gives typed access to
//! both; this module publishes chains through it. Its used ring is not used: `MockSplitQueue`
//! computes the used ring's address from the avail ring's length in entries instead of bytes
//! (`SplitQueueRing::end`), so its used ring overlaps the avail ring. The device-side queue gets
//! a correctly placed used ring instead ([`Driver::device_queue`]), which [`Driver::pop_used`]
//! reads.
//!
//! # Chains in a fuzz input
//!
//! A chain is a count byte (`% (MAX_PARTS + 1)`, 0 = nothing published) and that many parts,
//! each a tag byte (`% 4`) and its fields:
//!
//! | tag | part | fields | descriptor |
//! |---|---|---|---|
//! | 0 | [`Part::Bytes`] | `u16` length (`% (MAX_BYTES + 1)`), the bytes | device-readable buffer holding them |
//! | 1 | [`Part::Fill`] | `u32` length (`% (MAX_FILL + 1)`), `u8` fill byte | device-readable buffer of that byte |
//! | 2 | [`Part::Write`] | `u32` length | device-writable buffer of that length |
//! | 3 | [`Part::Raw`] | `u64` addr, `u32` len, `u16` flags, `u16` next | exactly these fields |
//!
//! Parts 0–2 get buffers from the queue's buffer area and are linked with NEXT to the part after
//! them; a raw part is written as given (its own NEXT flag and `next` index decide where the
//! chain goes), so loops, bad indices, indirect tables and buffers outside memory are all
//! reachable.

use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::input::{Encoder, Input};

/// Most parts in one chain.
pub const MAX_PARTS: u8 = 16;
/// Longest [`Part::Bytes`] in bytes.
pub const MAX_BYTES: u16 = 8192;
/// Longest [`Part::Fill`] in bytes (64 KiB).
pub const MAX_FILL: u32 = 64 << 10;
/// Most buffer space a [`Part::Write`] reserves; a longer descriptor runs into the next buffers.
pub const MAX_RESERVE: u64 = 64 << 10;

/// Descriptor flag: the chain continues at `next` (virtio 1.2 §2.7.5).
pub const DESC_F_NEXT: u16 = 1;
/// Descriptor flag: device-writable buffer.
pub const DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer is an indirect descriptor table.
pub const DESC_F_INDIRECT: u16 = 4;

/// Bytes of guest memory [`Driver`] needs for the rings of a queue of `size` entries.
pub fn ring_bytes(size: u16) -> u64 {
    26 * u64::from(size) + 16
}

/// One descriptor of a chain, as the fuzz input describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// A device-readable buffer holding these bytes.
    Bytes(Vec<u8>),
    /// A device-readable buffer of `len` copies of `byte`.
    Fill {
        /// Length in bytes.
        len: u32,
        /// The fill byte.
        byte: u8,
    },
    /// A device-writable buffer of this many bytes.
    Write(u32),
    /// A descriptor written exactly as given.
    Raw {
        /// Guest-physical address.
        addr: u64,
        /// Length in bytes.
        len: u32,
        /// `DESC_F_*` flags.
        flags: u16,
        /// Index of the next descriptor (used with [`DESC_F_NEXT`]).
        next: u16,
    },
}

impl Part {
    /// Reads one part.
    pub fn read(input: &mut Input<'_>) -> Part {
        match input.u8() % 4 {
            0 => {
                let len = input.u16() % (MAX_BYTES + 1);
                Part::Bytes(input.bytes(usize::from(len)).to_vec())
            }
            1 => Part::Fill {
                len: input.u32() % (MAX_FILL + 1),
                byte: input.u8(),
            },
            2 => Part::Write(input.u32()),
            _ => Part::Raw {
                addr: input.u64(),
                len: input.u32(),
                flags: input.u16(),
                next: input.u16(),
            },
        }
    }

    /// Appends the part in the format [`Part::read`] reads.
    pub fn encode(&self, enc: &mut Encoder) {
        match self {
            Part::Bytes(b) => {
                enc.u8(0).u16(b.len() as u16).bytes(b);
            }
            Part::Fill { len, byte } => {
                enc.u8(1).u32(*len).u8(*byte);
            }
            Part::Write(len) => {
                enc.u8(2).u32(*len);
            }
            Part::Raw {
                addr,
                len,
                flags,
                next,
            } => {
                enc.u8(3).u64(*addr).u32(*len).u16(*flags).u16(*next);
            }
        }
    }
}

/// Reads a chain: a count byte and that many parts.
pub fn read_chain(input: &mut Input<'_>) -> Vec<Part> {
    let count = input.u8() % (MAX_PARTS + 1);
    (0..count).map(|_| Part::read(input)).collect()
}

/// Appends `parts` in the format [`read_chain`] reads.
pub fn encode_chain(enc: &mut Encoder, parts: &[Part]) {
    enc.u8(parts.len() as u8);
    for part in parts {
        part.encode(enc);
    }
}

/// A chain the device put in the used ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsedElem {
    /// Head descriptor index.
    pub id: u32,
    /// Bytes the device said it wrote.
    pub len: u32,
    /// (GPA, length) of the chain's device-writable buffers as published (empty when the
    /// queue is tainted).
    pub writes: Vec<(u64, u32)>,
}

/// Where a [`Driver`] keeps its rings and buffers in guest memory.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Entries in the queue (a power of two).
    pub size: u16,
    /// GPA of the rings ([`ring_bytes`] of them, 16-byte aligned).
    pub rings: u64,
    /// First GPA of the buffer area.
    pub bufs: u64,
    /// End (exclusive) of the buffer area.
    pub bufs_end: u64,
}

/// The driver side of one queue: publishes chains, reads the used ring and checks what the
/// device returned against what was published.
pub struct Driver<'m> {
    mem: &'m GuestMemoryMmap,
    mock: MockSplitQueue<'m, GuestMemoryMmap>,
    layout: Layout,
    used: u64,
    next_desc: u16,
    next_buf: u64,
    used_seen: u16,
    published: u16,
    /// Device-writable buffers of the chain in flight at each head index.
    in_flight: Vec<Option<Vec<(u64, u32)>>>,
    /// Descriptors published since the device last returned everything.
    outstanding_descs: usize,
    tainted: bool,
}

impl<'m> Driver<'m> {
    /// A queue laid out as `layout` says, with empty rings.
    pub fn new(mem: &'m GuestMemoryMmap, layout: Layout) -> Self {
        let mock = MockSplitQueue::create(mem, GuestAddress(layout.rings), layout.size);
        let avail_end = mock.avail_addr().0 + 6 + 2 * u64::from(layout.size);
        let used = (avail_end + 3) & !3;
        mem.write_slice(
            &vec![0u8; 6 + 8 * usize::from(layout.size)],
            GuestAddress(used),
        )
        .expect("the used ring is inside guest memory");
        Driver {
            mem,
            mock,
            layout,
            used,
            next_desc: 0,
            next_buf: layout.bufs,
            used_seen: 0,
            published: 0,
            in_flight: vec![None; usize::from(layout.size)],
            outstanding_descs: 0,
            tainted: false,
        }
    }

    /// The device side of the queue, configured as a driver would through the transport.
    pub fn device_queue(&self) -> Queue {
        let mut q: Queue = self.mock.create_queue().expect("the mock's queue is valid");
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q
    }

    /// GPAs of the descriptor table, avail ring and used ring.
    pub fn addresses(&self) -> (u64, u64, u64) {
        (
            self.mock.desc_table_addr().0,
            self.mock.avail_addr().0,
            self.used,
        )
    }

    /// Marks the queue as corrupted by the input (raw ring writes, raw indices): the
    /// bookkeeping checks are off from now on.
    pub fn taint(&mut self) {
        self.tainted = true;
    }

    /// Whether the checks are off ([`Driver::taint`], raw parts, descriptor reuse).
    pub fn is_tainted(&self) -> bool {
        self.tainted
    }

    /// Publishes `parts` as one chain (nothing for an empty list); returns the head index.
    pub fn push(&mut self, parts: &[Part]) -> Option<u16> {
        if parts.is_empty() {
            return None;
        }
        let size = self.layout.size;
        let indices: Vec<u16> = (0..parts.len())
            .map(|_| {
                let index = self.next_desc;
                self.next_desc = (self.next_desc + 1) % size;
                index
            })
            .collect();
        let mut writable = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            let link = indices.get(i + 1).copied();
            let desc = self.descriptor(part, link, &mut writable);
            self.mock
                .desc_table()
                .store(indices[i], RawDescriptor::from(desc))
                .expect("descriptor index inside the table");
        }
        let head = indices[0];
        self.outstanding_descs += parts.len();
        if self.outstanding_descs > usize::from(size) {
            // Descriptors of chains still in flight were overwritten.
            self.tainted = true;
        }
        self.in_flight[usize::from(head)] = Some(writable);
        self.publish(head);
        Some(head)
    }

    /// Puts `head` in the next avail ring slot and bumps the avail index.
    pub fn publish(&mut self, head: u16) {
        let avail = self.mock.avail();
        let idx = avail.idx().load();
        avail
            .ring()
            .ref_at(usize::from(idx % self.layout.size))
            .expect("slot inside the ring")
            .store(head);
        avail.idx().store(idx.wrapping_add(1));
        self.published = self.published.wrapping_add(1);
    }

    /// Overwrites the avail index with a value of the input's choosing (taints the queue).
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.tainted = true;
        self.mock.avail().idx().store(idx);
    }

    fn descriptor(
        &mut self,
        part: &Part,
        link: Option<u16>,
        writable: &mut Vec<(u64, u32)>,
    ) -> SplitDescriptor {
        let (addr, len, flags) = match part {
            Part::Bytes(bytes) => {
                let addr = self.alloc(bytes.len() as u64);
                self.mem
                    .write_slice(bytes, GuestAddress(addr))
                    .expect("buffer inside guest memory");
                (addr, bytes.len() as u32, 0)
            }
            Part::Fill { len, byte } => {
                let addr = self.alloc(u64::from(*len));
                self.mem
                    .write_slice(&vec![*byte; *len as usize], GuestAddress(addr))
                    .expect("buffer inside guest memory");
                (addr, *len, 0)
            }
            Part::Write(len) => {
                let addr = self.alloc(u64::from(*len));
                writable.push((addr, *len));
                (addr, *len, DESC_F_WRITE)
            }
            Part::Raw {
                addr,
                len,
                flags,
                next,
            } => {
                self.tainted = true;
                return SplitDescriptor::new(*addr, *len, *flags, *next);
            }
        };
        match link {
            Some(next) => SplitDescriptor::new(addr, len, flags | DESC_F_NEXT, next),
            None => SplitDescriptor::new(addr, len, flags, 0),
        }
    }

    /// Reserves buffer space (at most [`MAX_RESERVE`] bytes), wrapping around the buffer area.
    fn alloc(&mut self, len: u64) -> u64 {
        let reserve = (len.min(MAX_RESERVE) + 15) & !15;
        if self.next_buf + reserve > self.layout.bufs_end {
            self.next_buf = self.layout.bufs;
        }
        let addr = self.next_buf;
        self.next_buf += reserve;
        addr
    }

    /// Takes the chains the device returned since the last call, checking each against what was
    /// published (unless the queue is tainted): a head the driver published and has not got
    /// back, and a used length no larger than the chain's device-writable bytes (virtio 1.2
    /// §2.7.8).
    pub fn pop_used(&mut self) -> Vec<UsedElem> {
        let used_idx: u16 = self
            .mem
            .read_obj(GuestAddress(self.used + 2))
            .expect("used ring inside guest memory");
        let mut out = Vec::new();
        while self.used_seen != used_idx {
            let slot = self.used + 4 + 8 * u64::from(self.used_seen % self.layout.size);
            let id: u32 = self.mem.read_obj(GuestAddress(slot)).expect("used slot");
            let len: u32 = self
                .mem
                .read_obj(GuestAddress(slot + 4))
                .expect("used slot");
            self.used_seen = self.used_seen.wrapping_add(1);
            let writes = self.check_used(id, len);
            out.push(UsedElem { id, len, writes });
        }
        if self.used_seen == self.published {
            self.outstanding_descs = 0;
        }
        out
    }

    fn check_used(&mut self, id: u32, len: u32) -> Vec<(u64, u32)> {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| self.in_flight.get_mut(i))
            .and_then(Option::take);
        if self.tainted {
            return Vec::new();
        }
        let Some(writes) = slot else {
            panic!("the device returned head {id}, which is not a chain in flight");
        };
        let writable: u64 = writes.iter().map(|&(_, len)| u64::from(len)).sum();
        assert!(
            u64::from(len) <= writable,
            "the device reported writing {len} bytes into chain {id}, which has {writable} \
             device-writable bytes"
        );
        writes
    }

    /// Whether every published chain came back (always true once tainted).
    pub fn all_returned(&self) -> bool {
        self.tainted || self.used_seen == self.published
    }

    /// Chains published and not yet returned.
    pub fn pending(&self) -> u16 {
        self.published.wrapping_sub(self.used_seen)
    }

    /// Reads `len` bytes of guest memory at `addr` (empty if outside memory).
    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        match self.mem.read_slice(&mut buf, GuestAddress(addr)) {
            Ok(()) => buf,
            Err(_) => Vec::new(),
        }
    }
}

impl std::fmt::Debug for Driver<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("layout", &self.layout)
            .field("published", &self.published)
            .field("used_seen", &self.used_seen)
            .field("tainted", &self.tainted)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_encoding_round_trips() {
        let parts = vec![
            Part::Bytes(b"header".to_vec()),
            Part::Fill { len: 512, byte: 7 },
            Part::Write(1),
            Part::Raw {
                addr: 0x1000,
                len: 16,
                flags: DESC_F_NEXT,
                next: 3,
            },
        ];
        let mut enc = Encoder::new();
        encode_chain(&mut enc, &parts);
        let bytes = enc.finish();

        assert_eq!(read_chain(&mut Input::new(&bytes)), parts);
    }

    #[test]
    fn published_chain_is_what_the_device_queue_pops() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let layout = Layout {
            size: 8,
            rings: 0x1000,
            bufs: 0x2_0000,
            bufs_end: 0x8_0000,
        };
        let mut driver = Driver::new(&mem, layout);
        let mut queue = driver.device_queue();

        let head = driver.push(&[Part::Bytes(vec![1, 2, 3]), Part::Write(9)]);
        let chain = queue.pop_descriptor_chain(&mem).expect("a chain");
        let descs: Vec<_> = chain.clone().collect();
        queue.add_used(&mem, chain.head_index(), 4).unwrap();

        assert_eq!(head, Some(0));
        assert_eq!(descs.len(), 2);
        assert_eq!(descs[0].len(), 3);
        assert!(descs[1].is_write_only());
        let used = driver.pop_used();
        assert_eq!(used.len(), 1);
        assert_eq!((used[0].id, used[0].len), (0, 4));
        assert_eq!(used[0].writes.len(), 1);
        assert!(driver.all_returned());
    }
}

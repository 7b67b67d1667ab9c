//! A minimal driver side of a split virtqueue (virtio 1.2 §2.7) for tests: it owns a descriptor
//! table, avail ring and used ring in guest memory, hands out descriptors from a free list, each
//! with its own fixed buffer, and recycles them when the device returns a chain.
//!
//! `virtio_queue::mock::MockSplitQueue` is not used because its layout places the used ring
//! inside the avail ring for any queue size (`SplitQueueRing::end` counts ring entries as bytes),
//! which corrupts both rings once more than a few chains are in flight.
//!
//! Shared by the unit tests of every virtio device (vsock, block, fs).

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Bytes of buffer space behind each descriptor.
pub const SLOT_SIZE: u64 = 0x11000;

/// Descriptor flag: the chain continues at `next`.
pub const VIRTQ_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: device-writable buffer.
pub const VIRTQ_DESC_F_WRITE: u16 = 2;

/// One element of a chain to publish.
#[derive(Clone, Copy, Debug)]
pub enum Part<'a> {
    /// A device-readable buffer holding these bytes.
    Read(&'a [u8]),
    /// A device-writable buffer of this many bytes.
    Write(u32),
}

/// A chain the device put in the used ring.
#[derive(Clone, Debug)]
pub struct Used {
    /// Bytes the device reported writing.
    pub len: u32,
    /// (guest address, length) of each descriptor of the chain.
    pub descs: Vec<(u64, u32)>,
}

/// The driver's view of one split virtqueue.
#[derive(Debug)]
pub struct TestQueue {
    mem: GuestMemoryMmap,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    bufs: u64,
    free: Vec<u16>,
    avail_idx: u16,
    used_seen: u16,
}

impl TestQueue {
    /// A queue of `size` entries with rings at `base` and descriptor buffers from `bufs` on.
    pub fn new(mem: &GuestMemoryMmap, base: u64, bufs: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
        let ring_bytes = (used + 6 + 8 * u64::from(size) - base) as usize;
        mem.write_slice(&vec![0u8; ring_bytes], GuestAddress(base))
            .unwrap();
        TestQueue {
            mem: mem.clone(),
            size,
            desc,
            avail,
            used,
            bufs,
            free: (0..size).rev().collect(),
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// The device-side queue, configured as a driver would through the transport.
    pub fn device_queue(&self, max_size: u16) -> Queue {
        let mut q = Queue::new(max_size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
        q
    }

    /// Guest-physical addresses of the descriptor table, avail ring and used ring.
    pub fn addresses(&self) -> (u64, u64, u64) {
        (self.desc, self.avail, self.used)
    }

    /// Free descriptors.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Address of descriptor `index`'s buffer.
    pub fn slot_addr(&self, index: u16) -> u64 {
        self.bufs + u64::from(index) * SLOT_SIZE
    }

    /// Publishes a chain of `parts`, each in its own descriptor and buffer; returns the head.
    pub fn push(&mut self, parts: &[Part<'_>]) -> u16 {
        assert!(self.free.len() >= parts.len(), "descriptor table full");
        // push_raw pops descriptors off the end of the free list in this order.
        let descs: Vec<(u64, u32, u16)> = parts
            .iter()
            .enumerate()
            .map(|(i, part)| {
                let addr = self.slot_addr(self.free[self.free.len() - 1 - i]);
                match part {
                    Part::Read(bytes) => {
                        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
                        (addr, bytes.len() as u32, 0)
                    }
                    Part::Write(len) => (addr, *len, VIRTQ_DESC_F_WRITE),
                }
            })
            .collect();
        self.push_raw(&descs)
    }

    /// Publishes a chain of raw descriptors (address, length, flags); NEXT links are added.
    pub fn push_raw(&mut self, descs: &[(u64, u32, u16)]) -> u16 {
        let indices: Vec<u16> = descs
            .iter()
            .map(|_| self.free.pop().expect("descriptor table full"))
            .collect();
        for (i, (addr, len, flags)) in descs.iter().enumerate() {
            let (flags, next) = match indices.get(i + 1) {
                Some(next) => (flags | VIRTQ_DESC_F_NEXT, *next),
                None => (*flags, 0),
            };
            self.write_desc(indices[i], *addr, *len, flags, next);
        }
        let head = indices[0];
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
        head
    }

    fn write_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.desc + 16 * u64::from(index);
        self.mem.write_obj(addr, GuestAddress(at)).unwrap();
        self.mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        self.mem.write_obj(next, GuestAddress(at + 14)).unwrap();
    }

    /// Takes the next chain from the used ring and frees its descriptors.
    pub fn pop_used(&mut self) -> Option<Used> {
        let used_idx: u16 = self.mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        if used_idx == self.used_seen {
            return None;
        }
        let elem = self.used + 4 + 8 * u64::from(self.used_seen % self.size);
        let head = self.mem.read_obj::<u32>(GuestAddress(elem)).unwrap() as u16;
        let len: u32 = self.mem.read_obj(GuestAddress(elem + 4)).unwrap();
        self.used_seen = self.used_seen.wrapping_add(1);

        let mut descs = Vec::new();
        let mut seen = Vec::new();
        let mut index = head;
        // A chain a test made loop or point past the table ends at the first repeated or
        // out-of-range index.
        while index < self.size && !seen.contains(&index) {
            seen.push(index);
            let at = self.desc + 16 * u64::from(index);
            let addr: u64 = self.mem.read_obj(GuestAddress(at)).unwrap();
            let dlen: u32 = self.mem.read_obj(GuestAddress(at + 8)).unwrap();
            let flags: u16 = self.mem.read_obj(GuestAddress(at + 12)).unwrap();
            let next: u16 = self.mem.read_obj(GuestAddress(at + 14)).unwrap();
            descs.push((addr, dlen));
            self.free.push(index);
            if flags & VIRTQ_DESC_F_NEXT == 0 {
                break;
            }
            index = next;
        }
        Some(Used { len, descs })
    }

    /// Makes the last descriptor of the published chain at `head` point on to `next` (another
    /// descriptor of the chain for a loop, or an index past the table).
    pub fn link_tail(&mut self, head: u16, next: u16) {
        let mut index = head;
        loop {
            let at = self.desc + 16 * u64::from(index);
            let flags: u16 = self.mem.read_obj(GuestAddress(at + 12)).unwrap();
            if flags & VIRTQ_DESC_F_NEXT == 0 {
                self.mem
                    .write_obj(flags | VIRTQ_DESC_F_NEXT, GuestAddress(at + 12))
                    .unwrap();
                self.mem.write_obj(next, GuestAddress(at + 14)).unwrap();
                return;
            }
            index = self.mem.read_obj(GuestAddress(at + 14)).unwrap();
        }
    }

    /// Guest-physical address of the avail ring's `idx` field.
    pub fn avail_idx_addr(&self) -> u64 {
        self.avail + 2
    }

    /// Sets the avail ring's `used_event` (VIRTIO_RING_F_EVENT_IDX, virtio 1.2 §2.7.10): the
    /// driver wants an interrupt once the used index passes it.
    pub fn set_used_event(&self, idx: u16) {
        let at = self.avail + 4 + 2 * u64::from(self.size);
        self.mem.write_obj(idx, GuestAddress(at)).unwrap();
    }

    /// The used ring's `avail_event` (VIRTIO_RING_F_EVENT_IDX): the driver kicks once its avail
    /// index passes it.
    pub fn avail_event(&self) -> u16 {
        let at = self.used + 4 + 8 * u64::from(self.size);
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    /// The used ring's `idx`: how many chains the device has used in all (wrapping).
    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// The used ring's `flags` (VRING_USED_F_NO_NOTIFY while the device suppresses kicks).
    pub fn used_flags(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used)).unwrap()
    }

    /// Reads `len` bytes of guest memory at `addr`.
    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        buf
    }
}

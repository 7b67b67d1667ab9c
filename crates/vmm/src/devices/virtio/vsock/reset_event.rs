//! The TRANSPORT_RESET event (virtio 1.2 §5.10.6.6) a device restored from a snapshot puts on the
//! event queue: `struct virtio_vsock_event { le32 id; }` with `id` = 0. The driver then resets
//! every connected socket (its peers were host sockets of the process that took the snapshot),
//! re-reads `guest_cid`, posts the buffer again and notifies the event queue; listening sockets
//! survive.

use std::sync::atomic::Ordering;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// `VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`, the only event id virtio 1.2 defines (§5.10.6.6).
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;
/// Size of `struct virtio_vsock_event`, bytes.
pub const EVENT_SIZE: u32 = 4;
/// Offset of `avail_event` in the used ring after `size` elements (virtio 1.2 §2.7.8: flags, idx,
/// ring[size] of 8 bytes each).
fn avail_event_offset(size: u16) -> u64 {
    4 + 8 * u64::from(size)
}

/// Puts one TRANSPORT_RESET event into the next usable buffer of the event queue `queue` and
/// returns `true`; `false` if the driver has no buffer posted. A chain without a device-writable
/// first buffer of at least [`EVENT_SIZE`] bytes goes back with length 0 and the next one is
/// tried. Does not interrupt the guest.
///
/// Before the event is published, the queue's `avail_event` (VIRTIO_RING_F_EVENT_IDX, virtio 1.2
/// §2.7.10) is set to the driver's current available index, so the driver's next buffer on the
/// event queue, the one it posts after handling the event, comes with a notification: that is
/// how the device learns the driver has handled it.
pub(super) fn send(queue: &mut Queue, mem: &GuestMemoryMmap) -> bool {
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let written = write_event(chain, mem);
        if written {
            ask_for_next_notification(queue, mem);
        }
        let len = if written { EVENT_SIZE } else { 0 };
        if let Err(e) = queue.add_used(mem, head, len) {
            tracing::error!("vsock: cannot return an event buffer: {e}");
        }
        if written {
            return true;
        }
        tracing::debug!("vsock: event buffer {head} too small or not writable");
    }
    false
}

/// Writes the event into the chain's first device-writable buffer, if it is large enough.
fn write_event(chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> bool {
    let Some(desc) = chain.writable().next() else {
        return false;
    };
    if desc.len() < EVENT_SIZE {
        return false;
    }
    mem.write_obj(VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le(), desc.addr())
        .is_ok()
}

/// With VIRTIO_RING_F_EVENT_IDX, sets `avail_event` to the driver's available index: the driver
/// notifies once it adds a buffer past it. Without it the device never suppresses event-queue
/// notifications, so the driver notifies anyway.
fn ask_for_next_notification(queue: &Queue, mem: &GuestMemoryMmap) {
    if !queue.state().event_idx_enabled {
        return;
    }
    let avail_idx = match queue.avail_idx(mem, Ordering::Acquire) {
        Ok(idx) => idx.0,
        Err(e) => {
            tracing::warn!("vsock: cannot read the event queue's available index: {e}");
            return;
        }
    };
    let written = queue
        .used_ring()
        .checked_add(avail_event_offset(queue.size()))
        .map(GuestAddress)
        .map(|addr| mem.write_obj(avail_idx.to_le(), addr));
    if !matches!(written, Some(Ok(()))) {
        tracing::warn!("vsock: cannot set the event queue's avail_event");
    }
}

//! virtio devices (virtio 1.2) and the virtio-mmio transport they are reached through.
//!
//! A device implements [`VirtioDevice`]: its type, features, configuration space and queue sizes,
//! and what it does once the driver has set it up ([`VirtioDevice::activate`]). The transport
//! ([`mmio`]) owns the virtqueues' configuration until then and hands the queues, their
//! notification eventfds (ioeventfds) and the [`IrqTrigger`] to the device when the driver writes
//! DRIVER_OK.
//!
//! Devices are shared between the transport (called from vCPU threads on MMIO exits) and the VMM's
//! event loop (which runs their queue and backend processing) as `Arc<Mutex<_>>`. The convention,
//! as in Firecracker: `activate` stores what it is given and signals the device's own
//! `activate_evt`; the device's event handler, running on the event-loop thread, then registers the
//! queue eventfds and backend file descriptors with the event manager.
//!
//! # Snapshots
//! A device's state in a snapshot is what the transport saves
//! ([`mmio::MmioTransport::save`]): the driver-visible registers, each activated queue's ring
//! positions ([`VirtioDevice::queue_positions`]) and what identifies the device's backend
//! ([`VirtioDevice::device_state`]). Restoring builds the device as on a normal boot and
//! re-activates it with those positions ([`mmio::MmioTransport::restore`]). Devices serve their
//! queues to completion on the event-loop thread, so at the point a snapshot is taken (every vCPU
//! paused, taken from the event-loop thread) no device holds a descriptor chain it popped but has
//! not returned to the used ring: the saved `next_avail` never skips a request.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

pub mod block;
pub mod fs;
pub mod mmio;
#[cfg(test)]
pub(crate) mod test_driver;
pub mod vsock;

/// Feature bit: the device complies with virtio 1.x (virtio 1.2 §6.1). Required by the modern MMIO
/// transport.
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// Interrupt status bit: a used ring was updated (virtio 1.2 §4.2.2, InterruptStatus).
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x01;
/// Interrupt status bit: the device configuration changed.
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x02;

/// virtio device IDs (virtio 1.2 §5).
pub mod device_type {
    /// Block device (§5.2).
    pub const BLOCK: u32 = 2;
    /// Socket device (§5.10).
    pub const VSOCK: u32 = 19;
    /// File system device (§5.11).
    pub const FS: u32 = 26;
}

/// Errors from activating a device.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver configured a different number of queues than the device has.
    #[error("expected {expected} virtqueues, the driver set up {got}")]
    QueueCount {
        /// Queues the device needs.
        expected: usize,
        /// Queues handed over.
        got: usize,
    },
    /// Signalling the device's activation event failed.
    #[error("cannot signal device activation: {0}")]
    Signal(io::Error),
    /// Device-specific failure.
    #[error("{0}")]
    Device(String),
}

/// The device's interrupt line: an irqfd wired to the device's GSI plus the InterruptStatus
/// register the driver reads and acknowledges through the transport.
#[derive(Debug)]
pub struct IrqTrigger {
    status: AtomicU32,
    irq_evt: EventFd,
}

impl IrqTrigger {
    /// A trigger signalling `irq_evt` (which the VMM registers as an irqfd).
    pub fn new(irq_evt: EventFd) -> Self {
        IrqTrigger {
            status: AtomicU32::new(0),
            irq_evt,
        }
    }

    /// Sets `bit` ([`VIRTIO_MMIO_INT_VRING`] or [`VIRTIO_MMIO_INT_CONFIG`]) in InterruptStatus and
    /// injects the interrupt.
    ///
    /// # Errors
    /// The eventfd write error.
    pub fn trigger(&self, bit: u32) -> io::Result<()> {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.irq_evt.write(1)
    }

    /// Signals that used rings were updated.
    ///
    /// # Errors
    /// The eventfd write error.
    pub fn signal_used_queue(&self) -> io::Result<()> {
        self.trigger(VIRTIO_MMIO_INT_VRING)
    }

    /// Current InterruptStatus value.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Clears the bits the driver acknowledged (InterruptACK).
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// The eventfd behind the interrupt (for registering it as an irqfd).
    pub fn eventfd(&self) -> &EventFd {
        &self.irq_evt
    }
}

/// Everything a device receives when the driver sets DRIVER_OK.
#[derive(Debug)]
pub struct ActivateContext {
    /// Guest memory, for walking descriptor chains.
    pub mem: GuestMemoryMmap,
    /// The virtqueues as the driver configured them, in queue-index order.
    pub queues: Vec<virtio_queue::Queue>,
    /// One ioeventfd per queue, signalled when the driver writes the queue's index to QueueNotify.
    pub queue_evts: Vec<EventFd>,
    /// The device's interrupt.
    pub interrupt: Arc<IrqTrigger>,
}

/// Copies the bytes of a device configuration space (`config`) at byte `offset` into `data`, as a
/// driver's read of the config area sees them (virtio 1.2 §4.2.2, offset 0x100 onwards): bytes past
/// the end of the space, or at an offset that overflows, read as zero.
///
/// ```
/// # use bulkhead_vmm::devices::virtio::read_config_bytes;
/// let mut data = [0xff; 4];
/// read_config_bytes(&[1, 2, 3], 1, &mut data);
/// assert_eq!(data, [2, 3, 0, 0]);
/// ```
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, byte) in data.iter_mut().enumerate() {
        *byte = offset
            .checked_add(i as u64)
            .and_then(|pos| usize::try_from(pos).ok())
            .and_then(|pos| config.get(pos).copied())
            .unwrap_or(0);
    }
}

/// Where the device stands in one activated split virtqueue (virtio 1.2 §2.7): the driver-written
/// rings live in guest memory (and are saved with it); these are the device's private indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueuePosition {
    /// Index of the next available-ring entry the device will read (virtio 1.2 §2.7.6; the
    /// device's `last_avail_idx`).
    pub next_avail: u16,
    /// Index of the next used-ring entry the device will write; equals the used ring's `idx`
    /// (virtio 1.2 §2.7.8).
    pub next_used: u16,
    /// VIRTIO_RING_F_EVENT_IDX is in use on the queue (virtio 1.2 §2.7.10).
    pub event_idx: bool,
}

impl QueuePosition {
    /// The position of `queue`.
    pub fn of(queue: &Queue) -> Self {
        QueuePosition {
            next_avail: queue.next_avail(),
            next_used: queue.next_used(),
            event_idx: queue.state().event_idx_enabled,
        }
    }

    /// Applies the position to `queue` (a queue built from the same configuration).
    pub fn apply(&self, queue: &mut Queue) {
        queue.set_next_avail(self.next_avail);
        queue.set_next_used(self.next_used);
        queue.set_event_idx(self.event_idx);
    }
}

/// What identifies a device's backend in a snapshot. A restore onto a device whose state does not
/// match is refused ([`VirtioDevice::check_restore`]): the guest would otherwise see its disk
/// change size or its share change tag behind its back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceState {
    /// virtio-vsock (virtio 1.2 §5.10). Host-side connections are not saved.
    Vsock {
        /// The guest CID at the time of the snapshot (the restored device may have another: the
        /// driver re-reads it on TRANSPORT_RESET, virtio 1.2 §5.10.6.6).
        guest_cid: u64,
    },
    /// virtio-blk (virtio 1.2 §5.2); the image is reopened by path by the restored VM.
    Block {
        /// Disk size in 512-byte sectors (virtio 1.2 §5.2.4 `capacity`).
        capacity: u64,
        /// VIRTIO_BLK_F_RO.
        read_only: bool,
    },
    /// virtio-fs (virtio 1.2 §5.11); saved only without a live FUSE session.
    Fs {
        /// The mount tag (virtio 1.2 §5.11.4), which the guest driver read at probe time.
        tag: String,
    },
    /// A device with no backend state to check.
    Plain,
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// The virtio device ID ([`device_type`]).
    fn device_type(&self) -> u32;

    /// Maximum size of each virtqueue, one entry per queue.
    fn queue_max_sizes(&self) -> &[u16];

    /// Feature bits the device offers (must include [`VIRTIO_F_VERSION_1`]).
    fn avail_features(&self) -> u64;

    /// Records the features the driver accepted (a subset of [`Self::avail_features`]).
    fn set_acked_features(&mut self, acked: u64);

    /// Reads `data.len()` bytes of the device configuration space at `offset`; bytes beyond the end of
    /// the configuration space read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Writes the device configuration space; devices ignore writes to read-only fields.
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// Takes over the configured queues; called once, when the driver sets DRIVER_OK.
    ///
    /// # Errors
    /// [`ActivateError`]; the transport then sets DEVICE_NEEDS_RESET.
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError>;

    /// Returns the device to its pre-activation state when the driver resets it (writes 0 to
    /// Status). Returns `false` if the device cannot be reset, in which case it stays inert.
    fn reset(&mut self) -> bool {
        false
    }

    /// The config generation counter (virtio 1.2 §4.2.2 ConfigGeneration), bumped by devices whose
    /// configuration space changes at runtime.
    fn config_generation(&self) -> u32 {
        0
    }

    /// The position of each activated queue, in queue-index order; empty when the device is not
    /// activated. Called with every vCPU paused and on the event-loop thread (so no queue handler
    /// is running): every chain the device popped is back in the used ring.
    fn queue_positions(&self) -> Vec<QueuePosition>;

    /// What identifies the device's backend in a snapshot.
    fn device_state(&self) -> DeviceState;

    /// Whether `saved` (from a snapshot) may be restored onto this device.
    ///
    /// # Errors
    /// Why not, for the user. The default refuses any difference from [`Self::device_state`].
    fn check_restore(&self, saved: &DeviceState) -> Result<(), String> {
        let current = self.device_state();
        if *saved == current {
            Ok(())
        } else {
            Err(format!(
                "the snapshot's device is {saved:?}, this VM's is {current:?}"
            ))
        }
    }

    /// Whether the device's state can be saved now.
    ///
    /// # Errors
    /// Why not (for example a live session the snapshot cannot carry), for the user.
    fn can_snapshot(&self) -> Result<(), String> {
        Ok(())
    }

    /// Makes the device's backend ready to be saved, after [`Self::can_snapshot`] agreed (e.g.
    /// a copy-on-write disk copies what its overlay lacks); the VM may go on running afterwards.
    ///
    /// # Errors
    /// Why the backend cannot be saved, for the user.
    fn prepare_snapshot(&mut self) -> Result<(), String> {
        Ok(())
    }

    /// Tells a device just re-activated from a snapshot (by the transport, in the same lock as
    /// [`Self::activate`], before any vCPU runs) that its queues resume where the saved VM left
    /// them and host-side state (connections, sessions) did not survive.
    fn restored(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn irq_status_accumulates_and_acks() {
        let trigger = IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());

        trigger.signal_used_queue().unwrap();
        trigger.trigger(VIRTIO_MMIO_INT_CONFIG).unwrap();
        assert_eq!(trigger.status(), 3);
        assert_eq!(trigger.eventfd().read().unwrap(), 2);

        trigger.ack(VIRTIO_MMIO_INT_VRING);
        assert_eq!(trigger.status(), VIRTIO_MMIO_INT_CONFIG);
    }
}

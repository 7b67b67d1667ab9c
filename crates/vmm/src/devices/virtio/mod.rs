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

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

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

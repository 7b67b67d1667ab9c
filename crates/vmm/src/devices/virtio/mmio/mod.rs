//! The virtio-mmio transport, modern interface (virtio 1.2 §4.2 "Virtio Over MMIO", Version 2).
//!
//! # Primer
//! A virtio-mmio device is a 4 KiB window of guest-physical address space ([`MMIO_DEVICE_SIZE`])
//! plus one interrupt line. The guest learns about it from the kernel command line
//! ([`cmdline_device_param`]: `virtio_mmio.device=4K@0xd0000000:5`) or a device tree.
//!
//! - Offsets `0x000..0x100` are 32-bit control registers (§4.2.2): identification (MagicValue
//!   `"virt"`, Version 2, DeviceID, VendorID), feature negotiation in 32-bit halves selected by
//!   `*FeaturesSel`, per-queue configuration selected by QueueSel (QueueNumMax, QueueNum,
//!   QueueReady and the three ring GPAs), QueueNotify, InterruptStatus/InterruptACK, Status and
//!   ConfigGeneration.
//! - Offsets from `0x100` are the device-specific configuration space, passed to the device.
//!
//! The driver brings the device up as in §3.1.1: reset, ACKNOWLEDGE, DRIVER, features,
//! FEATURES_OK (re-read to see whether the device accepted them), queue set-up (§4.2.3.2),
//! DRIVER_OK. Status writes that skip, reorder or undo a step are ignored. At DRIVER_OK the transport validates every queue and
//! hands queues, notification eventfds and the interrupt to the device
//! ([`VirtioDevice::activate`](super::VirtioDevice::activate)).
//!
//! Queue notifications (a write of the queue index to QueueNotify at [`NOTIFY_REG_OFFSET`])
//! normally never reach this code: the VMM registers each of [`MmioTransport::queue_evts`] as a
//! KVM ioeventfd at `base + NOTIFY_REG_OFFSET` with datamatch = the queue index (as a 32-bit
//! value), so the kernel signals the eventfd without a vCPU exit to userspace. A write that does
//! reach the transport signals the same eventfd.
//!
//! # Hostile guests
//! Every register value comes from the guest. Accesses of the wrong width, to unknown offsets, in
//! the wrong device state or with invalid values are ignored (reads return 0) and logged at debug
//! level; none of them panics. Transitions that the spec lets a device refuse (FEATURES_OK with
//! features not offered, DRIVER_OK with a broken queue) are refused the way the spec says.
//!
//! # Locking
//! The transport sits on the MMIO bus behind its own mutex and locks the device's mutex inside
//! it. Code holding a device's lock (its event handler) must never take the transport's lock.
//!
//! # Snapshots
//! [`MmioTransport::save`] and [`MmioTransport::restore`] ([`persist`]) carry the registers, the
//! queue configuration and each activated queue's ring positions across a snapshot.

pub mod persist;
mod queue;
mod registers;
mod status;
mod transport;

#[cfg(test)]
mod persist_tests;
#[cfg(test)]
mod tests;

use std::io;

pub use transport::MmioTransport;

use super::ActivateError;

/// MagicValue: `"virt"` as a little-endian 32-bit value (virtio 1.2 §4.2.2).
pub const MMIO_MAGIC_VALUE: u32 = 0x7472_6976;

/// Version of the modern (non-legacy) virtio-mmio interface (virtio 1.2 §4.2.2).
pub const MMIO_VERSION: u32 = 2;

/// VendorID reported to the guest: `"BLHK"` as little-endian ASCII. Guest drivers ignore it.
pub const VENDOR_ID: u32 = 0x4b48_4c42;

/// Size in bytes of one device's MMIO window: control registers and configuration space (4 KiB).
pub const MMIO_DEVICE_SIZE: u64 = 0x1000;

/// Offset in bytes of QueueNotify in the window; register the queue ioeventfds at
/// `base + NOTIFY_REG_OFFSET`, datamatch = queue index (virtio 1.2 §4.2.2).
pub const NOTIFY_REG_OFFSET: u64 = 0x50;

/// Offset in bytes of the device-specific configuration space in the window (virtio 1.2 §4.2.2).
pub const CONFIG_SPACE_OFFSET: u64 = 0x100;

/// Errors from building the transport, and the reasons it refuses a driver's request (these are
/// logged, and shown to the guest through the Status register).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device reports device ID 0, which virtio reserves for "no device" (virtio 1.2 §5).
    #[error("the device reports device ID 0 (reserved)")]
    InvalidDeviceType,
    /// The device has no virtqueues.
    #[error("the device has no virtqueues")]
    NoQueues,
    /// The device does not offer VIRTIO_F_VERSION_1, which the modern transport requires.
    #[error("the device does not offer VIRTIO_F_VERSION_1")]
    NoVersion1,
    /// A queue's maximum size is not a power of two in 1..=32768 (virtio 1.2 §2.7).
    #[error("virtqueue {index}: invalid maximum size {max_size}")]
    QueueMaxSize {
        /// Queue index.
        index: usize,
        /// Maximum size the device reported, entries.
        max_size: u16,
    },
    /// Creating a queue notification eventfd failed.
    #[error("cannot create the notification eventfd of virtqueue {index}: {source}")]
    EventFd {
        /// Queue index.
        index: usize,
        /// The OS error.
        source: io::Error,
    },
    /// The driver wrote a Status value that is not a valid transition (virtio 1.2 §2.1, §3.1.1).
    #[error("status {written:#x} refused (current {current:#x}): {reason}")]
    StatusTransition {
        /// Status before the write.
        current: u32,
        /// Value the driver wrote.
        written: u32,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The driver accepted features the device did not offer (virtio 1.2 §2.2).
    #[error(
        "the driver accepted features {acked:#x} that the device does not offer ({offered:#x})"
    )]
    FeaturesNotOffered {
        /// Feature bits the driver wrote (bits 0-63; bits beyond 63 are never offered).
        acked: u64,
        /// Feature bits the device offers.
        offered: u64,
    },
    /// The driver did not accept VIRTIO_F_VERSION_1 (virtio 1.2 §6.1: a driver must accept it).
    #[error("the driver did not accept VIRTIO_F_VERSION_1")]
    Version1NotAccepted,
    /// A queue the device needs was not marked ready at DRIVER_OK.
    #[error("virtqueue {index} is not ready")]
    QueueNotReady {
        /// Queue index.
        index: usize,
    },
    /// QueueNum is not a power of two in 1..=QueueNumMax.
    #[error("virtqueue {index}: size {size} is not a power of two in 1..={max}")]
    QueueSize {
        /// Queue index.
        index: usize,
        /// QueueNum as the driver wrote it.
        size: u32,
        /// QueueNumMax.
        max: u16,
    },
    /// A ring address breaks the split-queue alignment rules (virtio 1.2 §2.7).
    #[error("virtqueue {index}: {source}")]
    QueueLayout {
        /// Queue index.
        index: usize,
        /// virtio-queue's reason.
        source: virtio_queue::Error,
    },
    /// A ring is not entirely inside guest RAM.
    #[error("virtqueue {index}: {area} at GPA {addr:#x} (+{len} bytes) is outside guest memory")]
    QueueOutsideMemory {
        /// Queue index.
        index: usize,
        /// Which part of the queue.
        area: &'static str,
        /// GPA the driver wrote.
        addr: u64,
        /// Size of the area in bytes.
        len: u64,
    },
    /// Duplicating a queue eventfd for the device failed.
    #[error("cannot duplicate a queue eventfd for the device: {0}")]
    CloneEventFd(io::Error),
    /// The device refused to activate.
    #[error("device activation failed: {0}")]
    Activate(ActivateError),
    /// The device cannot be saved in its current state ([`VirtioDevice::can_snapshot`]).
    ///
    /// [`VirtioDevice::can_snapshot`]: super::VirtioDevice::can_snapshot
    #[error("{0}")]
    SnapshotRefused(String),
    /// The device reported a number of queue positions other than its number of queues.
    #[error("the device reported {got} queue positions for its {expected} virtqueues")]
    SnapshotPositions {
        /// Queues of the device.
        expected: usize,
        /// Positions reported.
        got: usize,
    },
    /// A restore onto a transport the driver has already used; restore needs one fresh from
    /// [`MmioTransport::new`].
    #[error("cannot restore onto a transport already in use (status {status:#x})")]
    RestoreNotFresh {
        /// The transport's status.
        status: u32,
    },
    /// The snapshot is of another kind of device than the one restored onto.
    #[error(
        "the snapshot's device does not match this VM's: {what} is {saved} in the snapshot, \
         {current} here"
    )]
    RestoreMismatch {
        /// What differs ("device type", "offered features", "number of virtqueues").
        what: &'static str,
        /// The snapshot's value.
        saved: String,
        /// This device's value.
        current: String,
    },
    /// The device's backend differs from the snapshot's ([`VirtioDevice::check_restore`]).
    ///
    /// [`VirtioDevice::check_restore`]: super::VirtioDevice::check_restore
    #[error("the snapshot's device does not match this VM's: {0}")]
    RestoreDevice(String),
    /// The saved state is inconsistent: a corrupt or crafted snapshot.
    #[error("invalid virtio-mmio state in the snapshot: {0}")]
    RestoreInvalid(String),
}

/// The kernel command-line parameter that declares a virtio-mmio device to Linux
/// (`CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`): `virtio_mmio.device=<size>@<base>:<irq>`.
///
/// `base` is the window's GPA, `size` its length in bytes and `irq` its GSI. The size is written
/// with the largest of the `G`/`M`/`K` suffixes that divides it exactly (the kernel parses it with
/// `memparse`), the base in hexadecimal.
///
/// # Example
/// ```
/// use bulkhead_vmm::devices::virtio::mmio::{cmdline_device_param, MMIO_DEVICE_SIZE};
///
/// let param = cmdline_device_param(0xd000_0000, MMIO_DEVICE_SIZE, 5);
/// assert_eq!(param, "virtio_mmio.device=4K@0xd0000000:5");
/// ```
pub fn cmdline_device_param(base: u64, size: u64, irq: u32) -> String {
    format!("virtio_mmio.device={}@{base:#x}:{irq}", memparse_size(size))
}

/// `size` in bytes, with the largest binary suffix the kernel's `memparse` accepts that divides
/// it exactly.
fn memparse_size(size: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    UNITS
        .iter()
        .find(|(unit, _)| size != 0 && size % unit == 0)
        .map_or_else(
            || size.to_string(),
            |(unit, suffix)| format!("{}{suffix}", size / unit),
        )
}

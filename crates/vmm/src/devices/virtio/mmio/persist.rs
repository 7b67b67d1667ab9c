//! Saving and restoring a virtio-mmio transport and its device across a snapshot.
//!
//! What is saved ([`MmioTransportState`]): the driver-visible registers of virtio 1.2 §4.2.2
//! (Status, the feature words and selectors, QueueSel, InterruptStatus), every queue's
//! configuration as the driver wrote it (§4.2.3.2), and, for an activated device, each queue's
//! ring positions ([`QueuePosition`]). The rings themselves are in guest memory, saved with it.
//!
//! Restoring happens on a transport fresh from [`MmioTransport::new`], for a device built exactly
//! as on a normal boot (same MMIO slot, same irqfd and ioeventfd wiring), before any vCPU runs.
//! The saved state is untrusted (a corrupt or crafted file): it must be a state the transport can
//! reach, features go through the FEATURES_OK checks again (§2.2.1), and an activated device's
//! queues go through the same validation as at DRIVER_OK before the device is activated through
//! its normal path, so the event loop registers its eventfds as usual. Positions are taken as
//! they are: virtio-queue refuses an available index more than a queue size ahead
//! (`InvalidAvailRingIndex`) and writes used entries modulo the queue size, so a wrong position
//! can only stall that queue, never touch memory outside its rings.

use serde::{Deserialize, Serialize};

use super::queue::QueueConfig;
use super::status::{self, DRIVER_OK, FEATURES_OK};
use super::{Error, MmioTransport};
pub use crate::devices::virtio::{DeviceState, QueuePosition};
use crate::devices::virtio::{VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};

/// One virtqueue's configuration registers as the driver wrote them (virtio 1.2 §4.2.2:
/// QueueNum, QueueReady, QueueDesc/Driver/Device Low+High).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfigState {
    /// QueueNum (entries), as written; validated when the queue is built.
    pub size: u32,
    /// QueueReady.
    pub ready: bool,
    /// GPA of the descriptor table.
    pub desc: u64,
    /// GPA of the available ring (driver area).
    pub driver: u64,
    /// GPA of the used ring (device area).
    pub device: u64,
}

impl From<QueueConfig> for QueueConfigState {
    fn from(q: QueueConfig) -> Self {
        QueueConfigState {
            size: q.size,
            ready: q.ready,
            desc: q.desc,
            driver: q.driver,
            device: q.device,
        }
    }
}

impl From<QueueConfigState> for QueueConfig {
    fn from(q: QueueConfigState) -> Self {
        QueueConfig {
            size: q.size,
            ready: q.ready,
            desc: q.desc,
            driver: q.driver,
            device: q.device,
        }
    }
}

/// A virtio-mmio transport and its device in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmioTransportState {
    /// DeviceID (virtio 1.2 §5); must match the device restored onto.
    pub device_type: u32,
    /// DeviceFeatures (all 64 bits); must match the device restored onto.
    pub device_features: u64,
    /// Status (virtio 1.2 §2.1).
    pub status: u32,
    /// QueueSel.
    pub queue_sel: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// DriverFeatures, bits 0-63 (the features the driver accepted once FEATURES_OK is set).
    pub driver_features: u64,
    /// The driver wrote a non-zero DriverFeatures word beyond bit 63.
    pub driver_features_beyond_64: bool,
    /// The device was activated (DRIVER_OK accepted) and not reset since.
    pub activated: bool,
    /// InterruptStatus (virtio 1.2 §4.2.2): bits the driver has not acknowledged yet.
    pub interrupt_status: u32,
    /// Each queue's configuration, in queue-index order.
    pub queues: Vec<QueueConfigState>,
    /// Each queue's ring positions when `activated`, else empty.
    pub positions: Vec<QueuePosition>,
    /// What identifies the device's backend.
    pub device: DeviceState,
}

impl MmioTransport {
    /// Whether the device can be saved now (call it for every device before saving any: a save
    /// may do work first, e.g. a copy-on-write disk's copy).
    ///
    /// # Errors
    /// [`Error::SnapshotRefused`], from
    /// [`VirtioDevice::can_snapshot`](crate::devices::virtio::VirtioDevice::can_snapshot).
    pub fn check_snapshot(&self) -> Result<(), Error> {
        self.lock_device()
            .can_snapshot()
            .map_err(Error::SnapshotRefused)
    }

    /// State of the transport and its device. Call it on the event-loop thread with every vCPU
    /// paused, so neither the driver nor a queue handler is in the middle of something.
    ///
    /// # Errors
    /// [`Error::SnapshotRefused`] when the device cannot be saved now
    /// ([`Self::check_snapshot`]) or its backend cannot be readied
    /// ([`VirtioDevice::prepare_snapshot`](crate::devices::virtio::VirtioDevice::prepare_snapshot));
    /// [`Error::SnapshotPositions`] when the device's queue positions do not match its queues.
    pub fn save(&self) -> Result<MmioTransportState, Error> {
        self.check_snapshot()?;
        let (positions, device) = {
            let mut dev = self.lock_device();
            dev.prepare_snapshot().map_err(Error::SnapshotRefused)?;
            let positions = if self.activated {
                dev.queue_positions()
            } else {
                Vec::new()
            };
            (positions, dev.device_state())
        };
        if self.activated && positions.len() != self.queues.len() {
            return Err(Error::SnapshotPositions {
                expected: self.queues.len(),
                got: positions.len(),
            });
        }
        Ok(MmioTransportState {
            device_type: self.device_type,
            device_features: self.device_features,
            status: self.status,
            queue_sel: self.queue_sel,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            driver_features_beyond_64: self.driver_features_beyond_64,
            activated: self.activated,
            interrupt_status: self.interrupt.status(),
            queues: self.queues.iter().copied().map(Into::into).collect(),
            positions,
            device,
        })
    }

    /// Restores `state` onto this transport, fresh from [`MmioTransport::new`] for an equivalent
    /// device, before any vCPU runs.
    ///
    /// Checks that the device type, offered features, number of queues and backend match;
    /// restores the registers; when FEATURES_OK is set, re-checks and re-acknowledges the
    /// driver's features (virtio 1.2 §2.2.1); when the saved device was activated, builds every
    /// queue with the DRIVER_OK validation, applies the saved ring positions and activates the
    /// device through its normal path, then tells it it was restored
    /// ([`VirtioDevice::restored`](crate::devices::virtio::VirtioDevice::restored)). Unacknowledged
    /// interrupt bits are raised again (a spurious interrupt is harmless; a lost one would leave
    /// the driver waiting).
    ///
    /// # Errors
    /// [`Error::RestoreNotFresh`], [`Error::RestoreMismatch`], [`Error::RestoreDevice`],
    /// [`Error::RestoreInvalid`], the feature errors of FEATURES_OK, the queue errors of DRIVER_OK
    /// and [`Error::Activate`]. On error before the device is activated, the transport is back in
    /// its reset state; discard the VM either way.
    pub fn restore(&mut self, state: &MmioTransportState) -> Result<(), Error> {
        if self.activated || self.status != 0 {
            return Err(Error::RestoreNotFresh {
                status: self.status,
            });
        }
        self.check_same_device(state)?;
        check_consistent(state)?;
        self.apply_registers(state);
        let result = self.renegotiate_and_activate(state);
        if result.is_err() && !self.activated {
            self.reset();
        }
        result?;
        self.raise_saved_interrupts(state.interrupt_status);
        Ok(())
    }

    /// Refuses a state saved from another kind of device.
    fn check_same_device(&self, state: &MmioTransportState) -> Result<(), Error> {
        let mismatch = |what, saved: String, current: String| Error::RestoreMismatch {
            what,
            saved,
            current,
        };
        if state.device_type != self.device_type {
            return Err(mismatch(
                "device type",
                state.device_type.to_string(),
                self.device_type.to_string(),
            ));
        }
        if state.device_features != self.device_features {
            return Err(mismatch(
                "offered features",
                format!("{:#x}", state.device_features),
                format!("{:#x}", self.device_features),
            ));
        }
        if state.queues.len() != self.queues.len() {
            return Err(mismatch(
                "number of virtqueues",
                state.queues.len().to_string(),
                self.queues.len().to_string(),
            ));
        }
        self.lock_device()
            .check_restore(&state.device)
            .map_err(Error::RestoreDevice)
    }

    /// Copies the saved registers and queue configuration.
    fn apply_registers(&mut self, state: &MmioTransportState) {
        self.status = state.status;
        self.queue_sel = state.queue_sel;
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.driver_features = state.driver_features;
        self.driver_features_beyond_64 = state.driver_features_beyond_64;
        self.queues = state.queues.iter().copied().map(Into::into).collect();
    }

    /// Re-acknowledges the features (FEATURES_OK) and re-activates the device (activated).
    fn renegotiate_and_activate(&mut self, state: &MmioTransportState) -> Result<(), Error> {
        if state.status & FEATURES_OK != 0 {
            self.negotiate_features()?;
        }
        if !state.activated {
            return Ok(());
        }
        let mut queues = self.build_queues()?;
        for (index, (queue, position)) in queues.iter_mut().zip(&state.positions).enumerate() {
            let negotiated = queue.state().event_idx_enabled;
            if position.event_idx != negotiated {
                return Err(Error::RestoreInvalid(format!(
                    "virtqueue {index}: event_idx {} but VIRTIO_RING_F_EVENT_IDX {}",
                    position.event_idx,
                    if negotiated {
                        "was negotiated"
                    } else {
                        "was not negotiated"
                    }
                )));
            }
            position.apply(queue);
        }
        self.activate_queues(queues, true)
    }

    /// Raises the interrupt bits the driver had not acknowledged when the snapshot was taken.
    fn raise_saved_interrupts(&self, bits: u32) {
        if bits == 0 {
            return;
        }
        if let Err(e) = self.interrupt.trigger(bits) {
            tracing::warn!("virtio-mmio: cannot raise the restored interrupt: {e}");
        }
    }
}

/// Refuses a state the transport cannot have been in (virtio 1.2 §2.1, §3.1.1).
fn check_consistent(state: &MmioTransportState) -> Result<(), Error> {
    let invalid = |reason: String| Err(Error::RestoreInvalid(reason));
    if !status::is_reachable(state.status) {
        return invalid(format!("status {:#x} is not reachable", state.status));
    }
    if state.activated && state.status & DRIVER_OK == 0 {
        return invalid(format!(
            "the device is activated but status {:#x} lacks DRIVER_OK",
            state.status
        ));
    }
    let failed_activation = status::DEVICE_NEEDS_RESET | DRIVER_OK;
    if !state.activated
        && state.status & DRIVER_OK != 0
        && state.status & failed_activation != failed_activation
    {
        return invalid(format!(
            "status {:#x} has DRIVER_OK but the device is not activated",
            state.status
        ));
    }
    let expected_positions = if state.activated {
        state.queues.len()
    } else {
        0
    };
    if state.positions.len() != expected_positions {
        return invalid(format!(
            "{} queue positions for {expected_positions} activated virtqueues",
            state.positions.len()
        ));
    }
    if state.interrupt_status & !(VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG) != 0 {
        return invalid(format!(
            "undefined InterruptStatus bits {:#x}",
            state.interrupt_status
        ));
    }
    Ok(())
}

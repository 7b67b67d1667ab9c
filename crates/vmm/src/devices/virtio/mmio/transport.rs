//! [`MmioTransport`]: the register file of one virtio-mmio device and the device's lifecycle
//! (virtio 1.2 §4.2.2 registers, §4.2.3 initialization, §2.1 status).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tracing::{debug, warn};
use virtio_bindings::virtio_config::VIRTIO_F_NOTIFICATION_DATA;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::queue::{set_high, set_low, QueueConfig};
use super::registers::Register;
use super::status::{
    self, Transition, DEVICE_NEEDS_RESET, DRIVER, DRIVER_OK, FAILED, FEATURES_OK, INIT_STEPS,
};
use super::{Error, CONFIG_SPACE_OFFSET, MMIO_MAGIC_VALUE, MMIO_VERSION, VENDOR_ID};
use crate::devices::bus::BusDevice;
use crate::devices::virtio::{
    ActivateContext, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG,
};

/// A virtio device behind the modern virtio-mmio register interface, as a [`BusDevice`] on the
/// MMIO bus (offsets relative to the start of its [`MMIO_DEVICE_SIZE`](super::MMIO_DEVICE_SIZE)
/// window).
///
/// It owns the driver-visible transport state (status, feature words, queue configuration) and
/// one notification eventfd per queue. At DRIVER_OK it validates the queues and activates the
/// device; at reset (Status ← 0) it resets the device and its own state.
///
/// Reset of a device that cannot be reset ([`VirtioDevice::reset`] returns `false`): the
/// transport keeps DEVICE_NEEDS_RESET set (the reset never completes from the driver's point of
/// view, §2.4: status does not read back 0), refuses every further initialization step, and
/// asks the device again on each later write of 0. The device keeps the queues it was given.
pub struct MmioTransport {
    mem: GuestMemoryMmap,
    device: Arc<Mutex<dyn VirtioDevice>>,
    pub(super) interrupt: Arc<IrqTrigger>,
    /// DeviceID, read once from the device.
    pub(super) device_type: u32,
    /// Features the device offers, read once from the device.
    pub(super) device_features: u64,
    /// QueueNumMax of each queue, read once from the device.
    max_sizes: Vec<u16>,
    /// Notification eventfd of each queue (kept across resets; the device gets duplicates).
    queue_evts: Vec<EventFd>,
    pub(super) queues: Vec<QueueConfig>,
    pub(super) queue_sel: u32,
    pub(super) device_features_sel: u32,
    pub(super) driver_features_sel: u32,
    /// Feature bits 0-63 the driver wrote to DriverFeatures.
    pub(super) driver_features: u64,
    /// The driver wrote a non-zero DriverFeatures word beyond bit 63 (never offered here).
    pub(super) driver_features_beyond_64: bool,
    /// Device status (§2.1).
    pub(super) status: u32,
    /// The device was activated and has not been reset since.
    pub(super) activated: bool,
}

impl fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device_type)
            .field("status", &format_args!("{:#x}", self.status))
            .field("activated", &self.activated)
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// A transport for `device`, which reaches guest memory `mem` and interrupts through
    /// `interrupt`. Creates one non-blocking notification eventfd per queue.
    ///
    /// # Errors
    /// [`Error::InvalidDeviceType`], [`Error::NoQueues`], [`Error::NoVersion1`] or
    /// [`Error::QueueMaxSize`] for a device the modern transport cannot present;
    /// [`Error::EventFd`] when an eventfd cannot be created.
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        interrupt: Arc<IrqTrigger>,
    ) -> Result<Self, Error> {
        let (device_type, device_features, max_sizes) = {
            let dev = lock(&device);
            (
                dev.device_type(),
                dev.avail_features(),
                dev.queue_max_sizes().to_vec(),
            )
        };
        check_device(device_type, device_features, &max_sizes)?;
        let queue_evts = (0..max_sizes.len())
            .map(|index| {
                EventFd::new(libc::EFD_NONBLOCK).map_err(|source| Error::EventFd { index, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            mem,
            device,
            interrupt,
            device_type,
            device_features,
            queues: max_sizes.iter().map(|&max| QueueConfig::new(max)).collect(),
            max_sizes,
            queue_evts,
            queue_sel: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            driver_features_beyond_64: false,
            status: 0,
            activated: false,
        })
    }

    /// The notification eventfd of each queue, in queue-index order. Register eventfd `i` as a
    /// KVM ioeventfd at `base + NOTIFY_REG_OFFSET` (4 bytes) with datamatch `i as u32`.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device behind the transport.
    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    /// The device's interrupt (its eventfd is the irqfd to register for the device's GSI).
    pub fn interrupt(&self) -> &Arc<IrqTrigger> {
        &self.interrupt
    }

    /// The device status the driver sees (virtio 1.2 §2.1 bits).
    pub fn status(&self) -> u32 {
        self.status
    }

    /// Whether the device is activated (the driver set DRIVER_OK and activation succeeded, and
    /// no reset happened since).
    pub fn is_activated(&self) -> bool {
        self.activated
    }

    pub(super) fn lock_device(&self) -> MutexGuard<'_, dyn VirtioDevice + 'static> {
        lock(&self.device)
    }

    fn read_register(&self, reg: Register) -> u32 {
        match reg {
            Register::MagicValue => MMIO_MAGIC_VALUE,
            Register::Version => MMIO_VERSION,
            Register::DeviceId => self.device_type,
            Register::VendorId => VENDOR_ID,
            Register::DeviceFeatures => {
                feature_word(self.device_features, self.device_features_sel)
            }
            Register::QueueNumMax => self.selected_max_size().map_or(0, u32::from),
            Register::QueueReady => self.selected_queue().map_or(0, |q| u32::from(q.ready)),
            Register::InterruptStatus => self.interrupt.status(),
            Register::Status => self.status,
            Register::ConfigGeneration => self.lock_device().config_generation(),
            // No shared memory regions: a length of -1 means "no such region" (§4.2.2).
            Register::ShmLenLow
            | Register::ShmLenHigh
            | Register::ShmBaseLow
            | Register::ShmBaseHigh => u32::MAX,
            // VIRTIO_F_RING_RESET is never offered.
            Register::QueueReset => 0,
            Register::DeviceFeaturesSel
            | Register::DriverFeatures
            | Register::DriverFeaturesSel
            | Register::QueueSel
            | Register::QueueNum
            | Register::QueueNotify
            | Register::InterruptAck
            | Register::QueueDescLow
            | Register::QueueDescHigh
            | Register::QueueDriverLow
            | Register::QueueDriverHigh
            | Register::QueueDeviceLow
            | Register::QueueDeviceHigh
            | Register::ShmSel => {
                debug!("virtio-mmio: read of write-only register {reg:?}");
                0
            }
        }
    }

    fn write_register(&mut self, reg: Register, value: u32) {
        match reg {
            Register::DeviceFeaturesSel => self.device_features_sel = value,
            Register::DriverFeaturesSel => self.driver_features_sel = value,
            Register::DriverFeatures => self.write_driver_features(value),
            Register::QueueSel => self.queue_sel = value,
            Register::QueueNum => self.update_idle_queue(|q| q.size = value),
            Register::QueueDescLow => self.update_idle_queue(|q| set_low(&mut q.desc, value)),
            Register::QueueDescHigh => self.update_idle_queue(|q| set_high(&mut q.desc, value)),
            Register::QueueDriverLow => self.update_idle_queue(|q| set_low(&mut q.driver, value)),
            Register::QueueDriverHigh => {
                self.update_idle_queue(|q| set_high(&mut q.driver, value));
            }
            Register::QueueDeviceLow => self.update_idle_queue(|q| set_low(&mut q.device, value)),
            Register::QueueDeviceHigh => {
                self.update_idle_queue(|q| set_high(&mut q.device, value));
            }
            Register::QueueReady => self.write_queue_ready(value),
            Register::QueueNotify => self.notify(value),
            Register::InterruptAck => self.interrupt.ack(value),
            Register::Status => self.write_status(value),
            // No shared memory regions; VIRTIO_F_RING_RESET is never offered.
            Register::ShmSel | Register::QueueReset => {}
            Register::MagicValue
            | Register::Version
            | Register::DeviceId
            | Register::VendorId
            | Register::DeviceFeatures
            | Register::QueueNumMax
            | Register::InterruptStatus
            | Register::ShmLenLow
            | Register::ShmLenHigh
            | Register::ShmBaseLow
            | Register::ShmBaseHigh
            | Register::ConfigGeneration => {
                debug!("virtio-mmio: write of read-only register {reg:?} ignored");
            }
        }
    }

    /// DriverFeatures is writable between DRIVER and FEATURES_OK (§3.1.1 step 4).
    fn write_driver_features(&mut self, value: u32) {
        let state = self.status & (DRIVER | FEATURES_OK | FAILED | DEVICE_NEEDS_RESET);
        if state != DRIVER {
            debug!(
                "virtio-mmio: DriverFeatures write in status {:#x} ignored",
                self.status
            );
            return;
        }
        match self.driver_features_sel {
            0 => set_low(&mut self.driver_features, value),
            1 => set_high(&mut self.driver_features, value),
            _ => self.driver_features_beyond_64 |= value != 0,
        }
    }

    /// The selected queue's configuration, if QueueSel names a queue.
    fn selected_queue(&self) -> Option<&QueueConfig> {
        self.queues.get(usize::try_from(self.queue_sel).ok()?)
    }

    fn selected_max_size(&self) -> Option<u16> {
        self.max_sizes
            .get(usize::try_from(self.queue_sel).ok()?)
            .copied()
    }

    /// The selected queue, if it exists and queue configuration is allowed: after FEATURES_OK
    /// and before DRIVER_OK (§3.1.1 step 7), with no FAILED or DEVICE_NEEDS_RESET.
    fn configurable_queue(&mut self) -> Option<&mut QueueConfig> {
        let state = self.status & (FEATURES_OK | DRIVER_OK | FAILED | DEVICE_NEEDS_RESET);
        if state != FEATURES_OK {
            debug!(
                "virtio-mmio: queue configuration in status {:#x} ignored",
                self.status
            );
            return None;
        }
        let queue = self.queues.get_mut(usize::try_from(self.queue_sel).ok()?);
        if queue.is_none() {
            debug!(
                "virtio-mmio: configuration of absent queue {} ignored",
                self.queue_sel
            );
        }
        queue
    }

    /// Applies `update` to the selected queue if it may be configured and is not ready: the
    /// driver must not change a queue's size or addresses while QueueReady is set (§4.2.2.2).
    fn update_idle_queue(&mut self, update: impl FnOnce(&mut QueueConfig)) {
        match self.configurable_queue() {
            Some(queue) if !queue.ready => update(queue),
            Some(_) => debug!("virtio-mmio: change of a ready queue ignored"),
            None => {}
        }
    }

    fn write_queue_ready(&mut self, value: u32) {
        let Some(queue) = self.configurable_queue() else {
            return;
        };
        match value {
            0 => queue.ready = false,
            1 => queue.ready = true,
            _ => debug!("virtio-mmio: QueueReady value {value:#x} ignored"),
        }
    }

    /// A QueueNotify write that was not handled by the ioeventfd in the kernel. With
    /// VIRTIO_F_NOTIFICATION_DATA the queue index is the low 16 bits (§4.2.3.3).
    fn notify(&self, value: u32) {
        let index = if self.negotiated(VIRTIO_F_NOTIFICATION_DATA) {
            value & 0xffff
        } else {
            value
        };
        let evt = usize::try_from(index)
            .ok()
            .and_then(|i| self.queue_evts.get(i));
        match evt {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    warn!("virtio-mmio: cannot signal queue {index}: {e}");
                }
            }
            None => debug!("virtio-mmio: notification of absent queue {index} ignored"),
        }
    }

    /// Whether feature `bit` was negotiated (accepted by the driver and FEATURES_OK set).
    fn negotiated(&self, bit: u32) -> bool {
        self.status & FEATURES_OK != 0 && self.driver_features & (1 << bit) != 0
    }

    fn write_status(&mut self, value: u32) {
        match status::transition(self.status, value) {
            Ok(Transition::Unchanged) => {}
            Ok(Transition::Reset) => self.reset(),
            Ok(Transition::Fail) => self.status |= FAILED,
            Ok(Transition::Advance(bits)) => self.advance(bits),
            Err(e) => debug!("virtio-mmio: {e}"),
        }
    }

    /// Performs the initialization steps in `bits`, in order, stopping at the first refused one.
    fn advance(&mut self, bits: u32) {
        for step in INIT_STEPS.into_iter().filter(|step| bits & step != 0) {
            let done = match step {
                FEATURES_OK => self.negotiate_features(),
                DRIVER_OK => self.activate(),
                _ => Ok(()),
            };
            if let Err(e) = done {
                self.refuse(step, &e);
                return;
            }
            self.status |= step;
        }
    }

    /// Reports a refused step to the driver: FEATURES_OK simply stays clear (the driver re-reads
    /// Status, §3.1.1 step 6); a failed DRIVER_OK leaves the device needing a reset (§2.1.2).
    fn refuse(&mut self, step: u32, error: &Error) {
        warn!(
            "virtio-mmio device type {}: status step {step:#x} refused: {error}",
            self.device_type
        );
        if step == DRIVER_OK {
            self.status |= DRIVER_OK;
            self.set_needs_reset();
        }
    }

    /// Checks the driver's features (§2.2.1) and hands them to the device.
    pub(super) fn negotiate_features(&mut self) -> Result<(), Error> {
        let acked = self.driver_features;
        if acked & !self.device_features != 0 || self.driver_features_beyond_64 {
            return Err(Error::FeaturesNotOffered {
                acked,
                offered: self.device_features,
            });
        }
        if acked & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(Error::Version1NotAccepted);
        }
        self.lock_device().set_acked_features(acked);
        Ok(())
    }

    /// Validates every queue and activates the device with them.
    fn activate(&mut self) -> Result<(), Error> {
        let queues = self.build_queues()?;
        self.activate_queues(queues, false)
    }

    /// Activates the device with `queues` (validated), the notification eventfds and the
    /// interrupt. With `restored`, tells the device in the same lock that it resumes a snapshot
    /// ([`VirtioDevice::restored`]), so its event handler never sees it activated but not
    /// restored.
    pub(super) fn activate_queues(
        &mut self,
        queues: Vec<Queue>,
        restored: bool,
    ) -> Result<(), Error> {
        let queue_evts = self
            .queue_evts
            .iter()
            .map(EventFd::try_clone)
            .collect::<Result<Vec<_>, _>>()
            .map_err(Error::CloneEventFd)?;
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            queues,
            queue_evts,
            interrupt: Arc::clone(&self.interrupt),
        };
        let mut device = self.lock_device();
        device.activate(ctx).map_err(Error::Activate)?;
        if restored {
            device.restored();
        }
        drop(device);
        self.activated = true;
        Ok(())
    }

    /// Every queue of the device, validated; all of them must be ready.
    pub(super) fn build_queues(&self) -> Result<Vec<Queue>, Error> {
        let event_idx = self.negotiated(VIRTIO_RING_F_EVENT_IDX);
        self.queues
            .iter()
            .zip(&self.max_sizes)
            .enumerate()
            .map(|(index, (config, &max))| {
                let mut queue = config.build(index, max, &self.mem)?;
                queue.set_event_idx(event_idx);
                Ok(queue)
            })
            .collect()
    }

    /// Sets DEVICE_NEEDS_RESET; if the driver had set DRIVER_OK, raises a configuration change
    /// interrupt so it notices (§2.1.2).
    fn set_needs_reset(&mut self) {
        let newly_set = self.status & DEVICE_NEEDS_RESET == 0;
        self.status |= DEVICE_NEEDS_RESET;
        if newly_set && self.status & DRIVER_OK != 0 {
            if let Err(e) = self.interrupt.trigger(VIRTIO_MMIO_INT_CONFIG) {
                warn!("virtio-mmio: cannot raise the configuration interrupt: {e}");
            }
        }
    }

    /// Status ← 0 (§2.4): resets an activated device, then the transport's state; status reads
    /// back 0 when done. InterruptStatus and every QueueReady are cleared (§4.2.2.1).
    pub(super) fn reset(&mut self) {
        if self.activated && !self.lock_device().reset() {
            warn!(
                "virtio-mmio device type {}: the device cannot be reset; it stays inert",
                self.device_type
            );
            self.set_needs_reset();
            return;
        }
        self.activated = false;
        self.status = 0;
        self.queue_sel = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.driver_features_beyond_64 = false;
        for (queue, &max) in self.queues.iter_mut().zip(&self.max_sizes) {
            *queue = QueueConfig::new(max);
        }
        self.interrupt.ack(u32::MAX);
    }
}

impl BusDevice for MmioTransport {
    /// Control registers (below 0x100) are read 32 bits at a time (§4.2.2.2); other widths and
    /// unknown offsets read as 0. The configuration space is read at any width.
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let Some(config_offset) = offset.checked_sub(CONFIG_SPACE_OFFSET) {
            data.fill(0);
            self.lock_device().read_config(config_offset, data);
            return;
        }
        if data.len() != 4 {
            debug!(
                "virtio-mmio: {}-byte read at {offset:#x} (registers are 32-bit)",
                data.len()
            );
            data.fill(0);
            return;
        }
        let value = match Register::decode(offset) {
            Some(reg) => self.read_register(reg),
            None => {
                debug!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// Control registers (below 0x100) are written 32 bits at a time; other widths and unknown
    /// offsets are ignored. The configuration space is written at any width.
    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(config_offset) = offset.checked_sub(CONFIG_SPACE_OFFSET) {
            self.lock_device().write_config(config_offset, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            debug!(
                "virtio-mmio: {}-byte write at {offset:#x} ignored (registers are 32-bit)",
                data.len()
            );
            return;
        };
        match Register::decode(offset) {
            Some(reg) => self.write_register(reg, u32::from_le_bytes(bytes)),
            None => debug!("virtio-mmio: write of unknown register {offset:#x} ignored"),
        }
    }
}

/// Locks a device, recovering from a poisoned lock: a panic on another thread must not turn every
/// later guest access into a second panic.
fn lock(device: &Arc<Mutex<dyn VirtioDevice>>) -> MutexGuard<'_, dyn VirtioDevice + 'static> {
    device.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Checks that the device can be presented by the modern transport.
fn check_device(device_type: u32, features: u64, max_sizes: &[u16]) -> Result<(), Error> {
    if device_type == 0 {
        return Err(Error::InvalidDeviceType);
    }
    if max_sizes.is_empty() {
        return Err(Error::NoQueues);
    }
    if features & (1 << VIRTIO_F_VERSION_1) == 0 {
        return Err(Error::NoVersion1);
    }
    match max_sizes.iter().position(|&max| Queue::new(max).is_err()) {
        Some(index) => Err(Error::QueueMaxSize {
            index,
            max_size: max_sizes[index],
        }),
        None => Ok(()),
    }
}

/// The 32-bit word `sel` of a 64-bit feature set (DeviceFeatures, §4.2.2); words beyond bit 63
/// are 0.
fn feature_word(features: u64, sel: u32) -> u32 {
    match sel {
        0 => features as u32,
        1 => (features >> 32) as u32,
        _ => 0,
    }
}

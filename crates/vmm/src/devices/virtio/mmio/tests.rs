//! Transport tests: a driver written after Linux's `virtio_mmio.c` probe and `vm_setup_vq`
//! sequence talks to a dummy device through the bus interface; rings come from virtio-queue's
//! mock driver.

use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_mmio as reg;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::status::{ACKNOWLEDGE, DEVICE_NEEDS_RESET, DRIVER, DRIVER_OK, FEATURES_OK};
use super::*;
use crate::devices::bus::BusDevice;
use crate::devices::virtio::{
    ActivateContext, ActivateError, DeviceState, IrqTrigger, QueuePosition, VirtioDevice,
    VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING,
};

/// Device ID the dummy reports (virtio-blk).
const DEVICE_ID: u32 = 2;
/// A device-specific feature bit the dummy offers.
const DEVICE_FEATURE: u64 = 1 << 5;
const OFFERED: u64 = (1 << VIRTIO_F_VERSION_1) | DEVICE_FEATURE;
/// QueueNumMax of the dummy's two queues.
const MAX_SIZES: [u16; 2] = [8, 4];
const MEM_SIZE: usize = 0x10_0000;

/// What the dummy saw of one queue at activation.
#[derive(Debug, PartialEq, Eq)]
struct SeenQueue {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    ready: bool,
}

#[derive(Default)]
struct DummyDevice {
    config: [u8; 8],
    acked: Option<u64>,
    activated_with: Option<Vec<SeenQueue>>,
    evts: Vec<EventFd>,
    fail_activation: bool,
    resettable: bool,
    resets: usize,
}

impl VirtioDevice for DummyDevice {
    fn device_type(&self) -> u32 {
        DEVICE_ID
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &MAX_SIZES
    }
    fn avail_features(&self) -> u64 {
        OFFERED
    }
    fn set_acked_features(&mut self, acked: u64) {
        self.acked = Some(acked);
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, byte) in data.iter_mut().enumerate() {
            let at = usize::try_from(offset).unwrap() + i;
            *byte = self.config.get(at).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, byte) in data.iter().enumerate() {
            let at = usize::try_from(offset).unwrap() + i;
            if let Some(slot) = self.config.get_mut(at) {
                *slot = *byte;
            }
        }
    }
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        if self.fail_activation {
            return Err(ActivateError::Device("refused by test".into()));
        }
        let seen = ctx.queues.iter().map(|q| SeenQueue {
            size: q.size(),
            desc: q.desc_table(),
            avail: q.avail_ring(),
            used: q.used_ring(),
            ready: q.ready(),
        });
        self.activated_with = Some(seen.collect());
        self.evts = ctx.queue_evts;
        Ok(())
    }
    fn reset(&mut self) -> bool {
        self.resets += 1;
        self.activated_with = None;
        self.resettable
    }
    fn config_generation(&self) -> u32 {
        7
    }
    fn queue_positions(&self) -> Vec<QueuePosition> {
        let position = QueuePosition {
            next_avail: 0,
            next_used: 0,
            event_idx: false,
        };
        self.activated_with
            .iter()
            .flatten()
            .map(|_| position)
            .collect()
    }
    fn device_state(&self) -> DeviceState {
        DeviceState::Plain
    }
}

/// The GPAs of a ring set built by the mock driver.
#[derive(Debug, Clone, Copy)]
struct Rings {
    desc: u64,
    avail: u64,
    used: u64,
}

/// The transport plus the driver-side helpers a guest kernel would use.
struct Harness {
    mem: GuestMemoryMmap,
    dev: Arc<Mutex<DummyDevice>>,
    transport: MmioTransport,
}

impl Harness {
    fn new(dummy: DummyDevice) -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let dev = Arc::new(Mutex::new(dummy));
        let irq = Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        let transport = MmioTransport::new(mem.clone(), dev.clone(), irq).unwrap();
        Harness {
            mem,
            dev,
            transport,
        }
    }

    fn read32(&mut self, offset: u32) -> u32 {
        let mut data = [0u8; 4];
        self.transport.read(u64::from(offset), &mut data);
        u32::from_le_bytes(data)
    }

    fn write32(&mut self, offset: u32, value: u32) {
        self.transport
            .write(u64::from(offset), &value.to_le_bytes());
    }

    /// `virtio_add_status`: read Status, write it back with `bit` added.
    fn add_status(&mut self, bit: u32) {
        let status = self.read32(reg::VIRTIO_MMIO_STATUS);
        self.write32(reg::VIRTIO_MMIO_STATUS, status | bit);
    }

    fn status(&mut self) -> u32 {
        self.read32(reg::VIRTIO_MMIO_STATUS)
    }

    /// Linux's `vm_finalize_features`: high word first, then low.
    fn write_driver_features(&mut self, features: u64) {
        self.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        self.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES, (features >> 32) as u32);
        self.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        self.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES, features as u32);
    }

    /// Reset, ACKNOWLEDGE, DRIVER, features = `features`, FEATURES_OK.
    fn negotiate(&mut self, features: u64) {
        self.write32(reg::VIRTIO_MMIO_STATUS, 0);
        self.add_status(ACKNOWLEDGE);
        self.add_status(DRIVER);
        self.write_driver_features(features);
        self.add_status(FEATURES_OK);
    }

    /// Mock-driver rings of `size` entries at GPA `start`.
    fn rings(&self, start: u64, size: u16) -> Rings {
        let mock = MockSplitQueue::create(&self.mem, GuestAddress(start), size);
        Rings {
            desc: mock.desc_table_addr().0,
            avail: mock.avail_addr().0,
            used: mock.used_addr().0,
        }
    }

    /// Linux's `vm_setup_vq` for queue `index` with `size` entries at `rings`.
    fn setup_queue(&mut self, index: u32, size: u32, rings: Rings) {
        self.write32(reg::VIRTIO_MMIO_QUEUE_SEL, index);
        self.write32(reg::VIRTIO_MMIO_QUEUE_NUM, size);
        self.write_addr(reg::VIRTIO_MMIO_QUEUE_DESC_LOW, rings.desc);
        self.write_addr(reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW, rings.avail);
        self.write_addr(reg::VIRTIO_MMIO_QUEUE_USED_LOW, rings.used);
        self.write32(reg::VIRTIO_MMIO_QUEUE_READY, 1);
    }

    fn write_addr(&mut self, low_reg: u32, addr: u64) {
        self.write32(low_reg, addr as u32);
        self.write32(low_reg + 4, (addr >> 32) as u32);
    }

    /// Negotiates the offered features and sets up both queues with valid rings.
    fn ready_for_driver_ok(&mut self) -> [Rings; 2] {
        self.ready_for_driver_ok_with([8, 4])
    }

    /// Negotiates the offered features and sets up both queues, QueueNum = `sizes`.
    fn ready_for_driver_ok_with(&mut self, sizes: [u32; 2]) -> [Rings; 2] {
        self.negotiate(OFFERED);
        let rings = [self.rings(0x1000, 8), self.rings(0x2000, 4)];
        self.setup_queue(0, sizes[0], rings[0]);
        self.setup_queue(1, sizes[1], rings[1]);
        rings
    }

    /// A device brought all the way to DRIVER_OK.
    fn activated(dummy: DummyDevice) -> Self {
        let mut h = Harness::new(dummy);
        h.ready_for_driver_ok();
        h.add_status(DRIVER_OK);
        assert!(h.transport.is_activated());
        h
    }

    fn seen_queues(&self) -> Option<Vec<SeenQueue>> {
        self.dev.lock().unwrap().activated_with.take()
    }
}

const INITIALIZED: u32 = ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK;

#[test]
fn linux_init_sequence_activates_the_device_with_the_driver_s_queues() {
    let mut h = Harness::new(DummyDevice::default());
    let rings = [h.rings(0x1000, 8), h.rings(0x2000, 2)];

    // vm_probe
    let magic = h.read32(reg::VIRTIO_MMIO_MAGIC_VALUE);
    let version = h.read32(reg::VIRTIO_MMIO_VERSION);
    let device_id = h.read32(reg::VIRTIO_MMIO_DEVICE_ID);
    h.read32(reg::VIRTIO_MMIO_VENDOR_ID);
    // register_virtio_device / virtio_dev_probe
    h.write32(reg::VIRTIO_MMIO_STATUS, 0);
    h.add_status(ACKNOWLEDGE);
    h.add_status(DRIVER);
    h.write32(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
    let features_high = h.read32(reg::VIRTIO_MMIO_DEVICE_FEATURES);
    h.write32(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    let features_low = h.read32(reg::VIRTIO_MMIO_DEVICE_FEATURES);
    h.write_driver_features((u64::from(features_high) << 32) | u64::from(features_low));
    h.add_status(FEATURES_OK);
    let features_ok = h.status() & FEATURES_OK != 0;
    // vm_find_vqs / vm_setup_vq
    for (index, size) in [(0, 8), (1, 2)] {
        h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, index);
        assert_eq!(h.read32(reg::VIRTIO_MMIO_QUEUE_READY), 0);
        assert_ne!(h.read32(reg::VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        h.setup_queue(index, size, rings[index as usize]);
    }
    h.add_status(DRIVER_OK);

    assert_eq!((magic, version, device_id), (0x7472_6976, 2, DEVICE_ID));
    assert!(features_ok);
    assert_eq!(h.status(), INITIALIZED);
    assert_eq!(h.dev.lock().unwrap().acked, Some(OFFERED));
    let expected: Vec<_> = [(8, rings[0]), (2, rings[1])]
        .into_iter()
        .map(|(size, r)| SeenQueue {
            size,
            desc: r.desc,
            avail: r.avail,
            used: r.used,
            ready: true,
        })
        .collect();
    assert_eq!(h.seen_queues(), Some(expected));
}

#[test]
fn device_features_are_shown_in_32_bit_halves() {
    let mut h = Harness::new(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
    let low = h.read32(reg::VIRTIO_MMIO_DEVICE_FEATURES);
    h.write32(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
    let high = h.read32(reg::VIRTIO_MMIO_DEVICE_FEATURES);
    h.write32(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, 2);
    let beyond = h.read32(reg::VIRTIO_MMIO_DEVICE_FEATURES);

    assert_eq!((low, high, beyond), (DEVICE_FEATURE as u32, 1, 0));
}

#[test]
fn identification_and_vendor_registers_read_their_values() {
    let mut h = Harness::new(DummyDevice::default());

    let vendor = h.read32(reg::VIRTIO_MMIO_VENDOR_ID);
    let generation = h.read32(reg::VIRTIO_MMIO_CONFIG_GENERATION);

    assert_eq!(vendor, VENDOR_ID);
    assert_eq!(generation, 7);
}

#[test]
fn narrow_reads_of_registers_return_zero() {
    let mut h = Harness::new(DummyDevice::default());
    let mut byte = [0xaa_u8; 1];
    let mut half = [0xaa_u8; 2];

    h.transport.read(0, &mut byte);
    h.transport.read(0, &mut half);

    assert_eq!(byte, [0]);
    assert_eq!(half, [0, 0]);
}

#[test]
fn narrow_writes_to_registers_are_ignored() {
    let mut h = Harness::new(DummyDevice::default());

    h.transport
        .write(u64::from(reg::VIRTIO_MMIO_STATUS), &[ACKNOWLEDGE as u8]);

    assert_eq!(h.status(), 0);
}

#[test]
fn unknown_and_legacy_register_offsets_read_zero() {
    let mut h = Harness::new(DummyDevice::default());

    let unaligned = h.read32(reg::VIRTIO_MMIO_MAGIC_VALUE + 1);
    let queue_pfn = h.read32(reg::VIRTIO_MMIO_QUEUE_PFN);

    assert_eq!((unaligned, queue_pfn), (0, 0));
}

#[test]
fn shared_memory_length_reads_as_no_region() {
    let mut h = Harness::new(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_SHM_SEL, 0);
    let low = h.read32(reg::VIRTIO_MMIO_SHM_LEN_LOW);
    let high = h.read32(reg::VIRTIO_MMIO_SHM_LEN_HIGH);

    assert_eq!((low, high), (u32::MAX, u32::MAX));
}

#[test]
fn features_the_device_does_not_offer_refuse_features_ok() {
    let mut h = Harness::new(DummyDevice::default());

    h.negotiate(OFFERED | (1 << 7));

    assert_eq!(h.status(), ACKNOWLEDGE | DRIVER);
    assert_eq!(h.dev.lock().unwrap().acked, None);
}

#[test]
fn features_beyond_bit_63_refuse_features_ok() {
    let mut h = Harness::new(DummyDevice::default());
    h.write32(reg::VIRTIO_MMIO_STATUS, ACKNOWLEDGE | DRIVER);
    h.write_driver_features(OFFERED);

    h.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, 2);
    h.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES, 1);
    h.add_status(FEATURES_OK);

    assert_eq!(h.status() & FEATURES_OK, 0);
}

#[test]
fn features_without_version_1_refuse_features_ok() {
    let mut h = Harness::new(DummyDevice::default());

    h.negotiate(DEVICE_FEATURE);

    assert_eq!(h.status(), ACKNOWLEDGE | DRIVER);
}

#[test]
fn driver_features_written_before_driver_are_ignored() {
    let mut h = Harness::new(DummyDevice::default());
    h.write32(reg::VIRTIO_MMIO_STATUS, ACKNOWLEDGE);
    h.write_driver_features(OFFERED);

    h.add_status(DRIVER);
    h.add_status(FEATURES_OK);

    // Nothing was accepted, so VIRTIO_F_VERSION_1 is missing and FEATURES_OK is refused.
    assert_eq!(h.status(), ACKNOWLEDGE | DRIVER);
}

#[test]
fn status_step_out_of_order_is_ignored() {
    let mut h = Harness::new(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_STATUS, ACKNOWLEDGE | DRIVER_OK);

    assert_eq!(h.status(), 0);
}

#[test]
fn driver_ok_with_queue_size_not_power_of_two_needs_reset() {
    let mut h = Harness::new(DummyDevice::default());
    h.ready_for_driver_ok_with([6, 4]);

    h.add_status(DRIVER_OK);

    assert!(!h.transport.is_activated());
    assert_eq!(h.seen_queues(), None);
    assert_eq!(h.status(), INITIALIZED | DEVICE_NEEDS_RESET);
    assert_eq!(
        h.read32(reg::VIRTIO_MMIO_INTERRUPT_STATUS),
        VIRTIO_MMIO_INT_CONFIG
    );
}

#[test]
fn driver_ok_with_queue_size_above_max_needs_reset() {
    let mut h = Harness::new(DummyDevice::default());
    h.ready_for_driver_ok_with([8, 8]); // QueueNumMax of queue 1 is 4

    h.add_status(DRIVER_OK);

    assert!(!h.transport.is_activated());
    assert_eq!(h.status() & DEVICE_NEEDS_RESET, DEVICE_NEEDS_RESET);
}

#[test]
fn driver_ok_with_a_queue_not_ready_needs_reset() {
    let mut h = Harness::new(DummyDevice::default());
    h.ready_for_driver_ok();
    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 1);
    h.write32(reg::VIRTIO_MMIO_QUEUE_READY, 0);

    h.add_status(DRIVER_OK);

    assert!(!h.transport.is_activated());
    assert_eq!(h.status() & DEVICE_NEEDS_RESET, DEVICE_NEEDS_RESET);
}

#[test]
fn driver_ok_with_rings_outside_guest_memory_needs_reset() {
    let mut h = Harness::new(DummyDevice::default());
    let rings = h.ready_for_driver_ok();
    let outside = Rings {
        used: MEM_SIZE as u64 + 0x1000,
        ..rings[0]
    };
    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
    h.write32(reg::VIRTIO_MMIO_QUEUE_READY, 0);
    h.setup_queue(0, 8, outside);

    h.add_status(DRIVER_OK);

    assert!(!h.transport.is_activated());
    assert_eq!(h.status() & DEVICE_NEEDS_RESET, DEVICE_NEEDS_RESET);
}

#[test]
fn device_refusing_activation_needs_reset() {
    let mut h = Harness::new(DummyDevice {
        fail_activation: true,
        ..DummyDevice::default()
    });
    h.ready_for_driver_ok();

    h.add_status(DRIVER_OK);

    assert!(!h.transport.is_activated());
    assert_eq!(h.status(), INITIALIZED | DEVICE_NEEDS_RESET);
}

#[test]
fn reset_after_activation_failure_allows_a_new_initialization() {
    let mut h = Harness::new(DummyDevice::default());
    h.ready_for_driver_ok_with([6, 4]);
    h.add_status(DRIVER_OK);

    h.ready_for_driver_ok();
    h.add_status(DRIVER_OK);

    assert!(h.transport.is_activated());
    assert_eq!(h.status(), INITIALIZED);
}

#[test]
fn queue_changes_while_ready_are_ignored() {
    let mut h = Harness::new(DummyDevice::default());
    h.ready_for_driver_ok();
    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 0);

    h.write32(reg::VIRTIO_MMIO_QUEUE_NUM, 6);
    h.add_status(DRIVER_OK);

    assert!(h.transport.is_activated());
    assert_eq!(h.seen_queues().unwrap()[0].size, 8);
}

#[test]
fn queue_configuration_before_features_ok_is_ignored() {
    let mut h = Harness::new(DummyDevice::default());
    h.write32(reg::VIRTIO_MMIO_STATUS, ACKNOWLEDGE | DRIVER);

    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
    h.write32(reg::VIRTIO_MMIO_QUEUE_READY, 1);

    assert_eq!(h.read32(reg::VIRTIO_MMIO_QUEUE_READY), 0);
}

#[test]
fn queue_configuration_after_driver_ok_is_ignored() {
    let mut h = Harness::activated(DummyDevice::default());
    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 1);

    h.write32(reg::VIRTIO_MMIO_QUEUE_READY, 0);

    assert_eq!(h.read32(reg::VIRTIO_MMIO_QUEUE_READY), 1);
}

#[test]
fn reset_after_activation_resets_the_device_and_the_transport() {
    let mut h = Harness::activated(DummyDevice {
        resettable: true,
        ..DummyDevice::default()
    });
    h.transport.interrupt().signal_used_queue().unwrap();

    h.write32(reg::VIRTIO_MMIO_STATUS, 0);

    assert_eq!(h.dev.lock().unwrap().resets, 1);
    assert!(!h.transport.is_activated());
    assert_eq!(h.status(), 0);
    assert_eq!(h.read32(reg::VIRTIO_MMIO_INTERRUPT_STATUS), 0);
    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 0);
    assert_eq!(h.read32(reg::VIRTIO_MMIO_QUEUE_READY), 0);
}

#[test]
fn reset_before_activation_does_not_call_device_reset() {
    let mut h = Harness::new(DummyDevice::default());
    h.ready_for_driver_ok();

    h.write32(reg::VIRTIO_MMIO_STATUS, 0);

    assert_eq!(h.dev.lock().unwrap().resets, 0);
    assert_eq!(h.status(), 0);
}

#[test]
fn device_that_cannot_reset_stays_inert_with_needs_reset() {
    let mut h = Harness::activated(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_STATUS, 0);
    h.add_status(ACKNOWLEDGE);

    assert_eq!(h.status(), INITIALIZED | DEVICE_NEEDS_RESET);
    assert!(h.transport.is_activated());
    assert_eq!(
        h.read32(reg::VIRTIO_MMIO_INTERRUPT_STATUS),
        VIRTIO_MMIO_INT_CONFIG
    );
}

#[test]
fn queue_notify_signals_that_queue_s_eventfd() {
    let mut h = Harness::activated(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 1);

    let evts = h.transport.queue_evts();
    assert!(evts[0].read().is_err()); // EAGAIN: not signalled
    assert_eq!(evts[1].read().unwrap(), 1);
}

#[test]
fn device_receives_eventfds_that_queue_notify_signals() {
    let mut h = Harness::activated(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 0);

    assert_eq!(h.dev.lock().unwrap().evts[0].read().unwrap(), 1);
}

#[test]
fn queue_notify_for_absent_queue_signals_nothing() {
    let mut h = Harness::activated(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_QUEUE_NOTIFY, 2);
    h.write32(reg::VIRTIO_MMIO_QUEUE_NOTIFY, u32::MAX);

    assert!(h.transport.queue_evts().iter().all(|e| e.read().is_err()));
}

#[test]
fn out_of_range_queue_select_reads_no_queue() {
    let mut h = Harness::new(DummyDevice::default());
    h.negotiate(OFFERED);

    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 2);
    h.write32(reg::VIRTIO_MMIO_QUEUE_READY, 1);
    let max = h.read32(reg::VIRTIO_MMIO_QUEUE_NUM_MAX);
    let ready = h.read32(reg::VIRTIO_MMIO_QUEUE_READY);

    assert_eq!((max, ready), (0, 0));
}

#[test]
fn queue_num_max_reports_each_queue_s_maximum() {
    let mut h = Harness::new(DummyDevice::default());

    h.write32(reg::VIRTIO_MMIO_QUEUE_SEL, 1);
    let max = h.read32(reg::VIRTIO_MMIO_QUEUE_NUM_MAX);

    assert_eq!(max, u32::from(MAX_SIZES[1]));
}

#[test]
fn config_space_reads_are_delegated_at_any_width() {
    let mut h = Harness::new(DummyDevice {
        config: [1, 2, 3, 4, 5, 6, 7, 8],
        ..DummyDevice::default()
    });
    let mut half = [0u8; 2];
    let mut past_end = [0xaa_u8; 4];

    h.transport.read(CONFIG_SPACE_OFFSET + 2, &mut half);
    h.transport.read(CONFIG_SPACE_OFFSET + 6, &mut past_end);

    assert_eq!(half, [3, 4]);
    assert_eq!(past_end, [7, 8, 0, 0]);
}

#[test]
fn config_space_writes_are_delegated() {
    let mut h = Harness::new(DummyDevice::default());

    h.transport.write(CONFIG_SPACE_OFFSET + 1, &[0xab]);

    assert_eq!(h.dev.lock().unwrap().config[1], 0xab);
}

#[test]
fn interrupt_status_shows_pending_causes_until_acknowledged() {
    let mut h = Harness::activated(DummyDevice::default());
    let irq = Arc::clone(h.transport.interrupt());
    irq.signal_used_queue().unwrap();
    irq.trigger(VIRTIO_MMIO_INT_CONFIG).unwrap();

    let before = h.read32(reg::VIRTIO_MMIO_INTERRUPT_STATUS);
    h.write32(reg::VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
    let after = h.read32(reg::VIRTIO_MMIO_INTERRUPT_STATUS);

    assert_eq!(before, VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG);
    assert_eq!(after, VIRTIO_MMIO_INT_CONFIG);
}

#[test]
fn hostile_accesses_everywhere_neither_panic_nor_activate() {
    let mut h = Harness::new(DummyDevice::default());

    for offset in 0..CONFIG_SPACE_OFFSET + 8 {
        for width in [1, 2, 4, 8] {
            let mut data = vec![0xff_u8; width];
            h.transport.write(offset, &data);
            h.transport.read(offset, &mut data);
        }
    }

    assert!(!h.transport.is_activated());
}

#[test]
fn new_rejects_a_device_without_version_1() {
    struct Legacy(DummyDevice);
    impl VirtioDevice for Legacy {
        fn device_type(&self) -> u32 {
            DEVICE_ID
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &MAX_SIZES
        }
        fn avail_features(&self) -> u64 {
            DEVICE_FEATURE
        }
        fn set_acked_features(&mut self, acked: u64) {
            self.0.set_acked_features(acked);
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            self.0.read_config(offset, data);
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            self.0.write_config(offset, data);
        }
        fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
            self.0.activate(ctx)
        }
        fn queue_positions(&self) -> Vec<QueuePosition> {
            self.0.queue_positions()
        }
        fn device_state(&self) -> DeviceState {
            self.0.device_state()
        }
    }
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));

    let result = MmioTransport::new(
        mem,
        Arc::new(Mutex::new(Legacy(DummyDevice::default()))),
        irq,
    );

    assert!(matches!(result, Err(Error::NoVersion1)));
}

#[test]
fn cmdline_param_uses_the_largest_exact_size_unit() {
    let page = cmdline_device_param(0xd000_0000, 0x1000, 5);
    let mib = cmdline_device_param(0xd000_1000, 2 << 20, 6);
    let odd = cmdline_device_param(0x1000, 0x1234, 23);

    assert_eq!(page, "virtio_mmio.device=4K@0xd0000000:5");
    assert_eq!(mib, "virtio_mmio.device=2M@0xd0001000:6");
    assert_eq!(odd, "virtio_mmio.device=4660@0x1000:23");
}

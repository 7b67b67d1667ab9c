//! Save/restore tests: a device is brought up through its transport's registers the way Linux's
//! `virtio_mmio` driver does, with driver-side rings from the shared test driver and the device's
//! real event handler on an `EventManager`; its state is saved, a fresh device and transport are
//! built on the same guest memory, and the state is restored onto them.

mod fs;
mod vsock;

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use virtio_bindings::virtio_mmio as reg;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::persist::{MmioTransportState, QueueConfigState};
use super::status::{ACKNOWLEDGE, DRIVER, DRIVER_OK, FEATURES_OK};
use super::{Error, MmioTransport, NOTIFY_REG_OFFSET};
use crate::devices::bus::BusDevice;
use crate::devices::virtio::block::{
    Block, BlockConfig, RequestHeader, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use crate::devices::virtio::test_driver::{Part, TestQueue};
use crate::devices::virtio::{DeviceState, IrqTrigger, VirtioDevice, VIRTIO_MMIO_INT_VRING};

/// Guest memory size (64 MiB).
const MEM_SIZE: usize = 0x400_0000;
/// Entries of the block test queue.
const BLOCK_QUEUE: u16 = 16;

/// Guest memory shared by the saved VM and the restored one.
fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap()
}

/// A device behind its transport, with the device's event loop.
struct Rig<D: VirtioDevice + MutEventSubscriber + 'static> {
    dev: Arc<Mutex<D>>,
    em: EventManager<Arc<Mutex<D>>>,
    transport: MmioTransport,
    /// The interrupt eventfd (the irqfd a VMM registers).
    irq: EventFd,
}

impl<D: VirtioDevice + MutEventSubscriber + 'static> Rig<D> {
    /// `device` behind a fresh transport, as the VMM builds it on boot and on restore.
    fn new(mem: &GuestMemoryMmap, device: D) -> Self {
        let dev = Arc::new(Mutex::new(device));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(IrqTrigger::new(irq.try_clone().unwrap()));
        let transport = MmioTransport::new(mem.clone(), dev.clone(), interrupt).unwrap();
        Rig {
            dev,
            em,
            transport,
            irq,
        }
    }

    /// `device` behind a fresh transport with `state` restored onto it, its event loop run.
    fn restored(mem: &GuestMemoryMmap, device: D, state: &MmioTransportState) -> Self {
        let mut rig = Rig::new(mem, device);
        rig.transport.restore(state).unwrap();
        rig.settle();
        rig
    }

    fn dev(&self) -> MutexGuard<'_, D> {
        self.dev.lock().unwrap()
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

    fn add_status(&mut self, bit: u32) {
        let status = self.read32(reg::VIRTIO_MMIO_STATUS);
        self.write32(reg::VIRTIO_MMIO_STATUS, status | bit);
    }

    /// Reset, ACKNOWLEDGE, DRIVER, every offered feature accepted, FEATURES_OK.
    fn negotiate(&mut self) {
        self.write32(reg::VIRTIO_MMIO_STATUS, 0);
        self.add_status(ACKNOWLEDGE);
        self.add_status(DRIVER);
        for word in [1, 0] {
            self.write32(reg::VIRTIO_MMIO_DEVICE_FEATURES_SEL, word);
            let offered = self.read32(reg::VIRTIO_MMIO_DEVICE_FEATURES);
            self.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES_SEL, word);
            self.write32(reg::VIRTIO_MMIO_DRIVER_FEATURES, offered);
        }
        self.add_status(FEATURES_OK);
        assert_ne!(self.read32(reg::VIRTIO_MMIO_STATUS) & FEATURES_OK, 0);
    }

    /// Linux's `vm_setup_vq` for each of `queues`, in index order, then DRIVER_OK.
    fn set_up_queues(&mut self, queues: &[&TestQueue], sizes: &[u16]) {
        for (index, (queue, size)) in queues.iter().zip(sizes).enumerate() {
            let (desc, avail, used) = queue.addresses();
            self.write32(reg::VIRTIO_MMIO_QUEUE_SEL, index as u32);
            self.write32(reg::VIRTIO_MMIO_QUEUE_NUM, u32::from(*size));
            for (low, addr) in [
                (reg::VIRTIO_MMIO_QUEUE_DESC_LOW, desc),
                (reg::VIRTIO_MMIO_QUEUE_AVAIL_LOW, avail),
                (reg::VIRTIO_MMIO_QUEUE_USED_LOW, used),
            ] {
                self.write32(low, addr as u32);
                self.write32(low + 4, (addr >> 32) as u32);
            }
            self.write32(reg::VIRTIO_MMIO_QUEUE_READY, 1);
        }
        self.add_status(DRIVER_OK);
        assert!(self.transport.is_activated());
        self.settle();
    }

    /// The driver notifies queue `index` (QueueNotify), and the event loop runs.
    fn notify(&mut self, index: u32) {
        self.transport
            .write(NOTIFY_REG_OFFSET, &index.to_le_bytes());
        self.settle();
    }

    /// Runs the event loop until no fd is ready.
    fn settle(&mut self) {
        for _ in 0..10_000 {
            if self.em.run_with_timeout(0).unwrap() == 0 {
                return;
            }
        }
        panic!("the event loop never went idle");
    }
}

/// Creates a 64 KiB disk image in `dir` whose sector `n` is filled with byte `n`.
fn write_image(dir: &Path) {
    let image: Vec<u8> = (0..128u8).flat_map(|n| [n; 512]).collect();
    std::fs::write(dir.join("disk.raw"), image).unwrap();
}

/// The writable disk image in `dir`.
fn disk_image(dir: &Path) -> BlockConfig {
    BlockConfig {
        path: dir.join("disk.raw"),
        read_only: false,
        id: None,
        backing: None,
    }
}

/// The wire form of a request header.
fn request(request_type: u32, sector: u64) -> [u8; RequestHeader::SIZE] {
    RequestHeader {
        request_type,
        reserved: 0,
        sector,
    }
    .to_bytes()
}

/// Publishes a one-sector read of `sector`: header, 512 data bytes, status byte.
fn push_read(q: &mut TestQueue, sector: u64) -> u16 {
    let header = request(VIRTIO_BLK_T_IN, sector);
    q.push(&[Part::Read(&header), Part::Write(512), Part::Write(1)])
}

/// Sector the saved VM wrote [`WRITTEN`] to.
const WRITTEN_SECTOR: u64 = 10;
/// What the saved VM wrote.
const WRITTEN: u8 = 0xab;

/// A block device brought up through its transport, which has served reads of sectors 0 and 1
/// and a write of [`WRITTEN`] to [`WRITTEN_SECTOR`].
struct SavedBlock {
    dir: tempfile::TempDir,
    mem: GuestMemoryMmap,
    q: TestQueue,
    state: MmioTransportState,
}

/// Serves two reads and a write, then saves the transport; the saved VM is gone afterwards (its
/// image lock released, as when its process exits). The guest reuses the write's data buffer
/// once the write completed, as drivers do: a device that ran the write again would write
/// other data.
fn saved_block() -> SavedBlock {
    let dir = tempfile::tempdir().unwrap();
    write_image(dir.path());
    let mem = guest_memory();
    let mut q = TestQueue::new(&mem, 0x1000, 0x10_0000, BLOCK_QUEUE);
    let mut rig = Rig::new(&mem, Block::new(disk_image(dir.path())).unwrap());
    rig.negotiate();
    rig.set_up_queues(&[&q], &[BLOCK_QUEUE]);
    for sector in 0..2 {
        push_read(&mut q, sector);
        rig.notify(0);
        q.pop_used().unwrap();
    }
    let header = request(VIRTIO_BLK_T_OUT, WRITTEN_SECTOR);
    q.push(&[
        Part::Read(&header),
        Part::Read(&[WRITTEN; 512]),
        Part::Write(1),
    ]);
    rig.notify(0);
    let write = q.pop_used().unwrap();
    mem.write_slice(&[0xee; 512], GuestAddress(write.descs[1].0))
        .unwrap();
    let state = rig.transport.save().unwrap();
    SavedBlock { dir, mem, q, state }
}

impl SavedBlock {
    /// A fresh block device for the same image.
    fn device(&self) -> Block {
        Block::new(disk_image(self.dir.path())).unwrap()
    }
}

#[test]
fn restored_block_device_continues_at_the_saved_ring_positions() {
    let mut saved = saved_block();
    let mut rig = Rig::restored(&saved.mem, saved.device(), &saved.state);
    let (q, state) = (&mut saved.q, &saved.state);

    let head = push_read(q, WRITTEN_SECTOR);
    rig.notify(0);

    assert_eq!(state.positions[0].next_avail, 3);
    assert_eq!(state.positions[0].next_used, 3);
    assert!(state.positions[0].event_idx, "Linux negotiates EVENT_IDX");
    assert_eq!(
        q.used_idx(),
        4,
        "the new request's used entry lands at index 3"
    );
    let used = q.pop_used().unwrap();
    assert_eq!(used.len, 513);
    assert_eq!(used.descs[0].0, q.slot_addr(head));
    assert_eq!(
        q.read(used.descs[1].0, 512),
        vec![WRITTEN; 512],
        "the completed write was not run again"
    );
    assert!(rig.dev().is_activated());
    assert_eq!(rig.read32(reg::VIRTIO_MMIO_STATUS), state.status);
}

#[test]
fn restore_refuses_the_state_of_another_device_type() {
    let saved = saved_block();
    let dir = tempfile::tempdir().unwrap();
    let vsock = crate::devices::virtio::vsock::Vsock::new(3, dir.path().join("v.sock")).unwrap();
    let mut rig = Rig::new(&saved.mem, vsock);

    let result = rig.transport.restore(&saved.state);

    let err = result.unwrap_err();
    assert!(matches!(
        err,
        Error::RestoreMismatch {
            what: "device type",
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "the snapshot's device does not match this VM's: device type is 2 in the snapshot, 19 here"
    );
    assert!(!rig.transport.is_activated());
}

#[test]
fn restore_refuses_a_state_with_another_number_of_queues() {
    let saved = saved_block();
    let mut state = saved.state.clone();
    state.queues.push(state.queues[0]);
    state.positions.push(state.positions[0]);
    let mut rig = Rig::new(&saved.mem, saved.device());

    let result = rig.transport.restore(&state);

    assert!(matches!(
        result,
        Err(Error::RestoreMismatch {
            what: "number of virtqueues",
            ..
        })
    ));
    assert!(!rig.transport.is_activated());
}

#[test]
fn restore_refuses_a_disk_of_another_size() {
    let saved = saved_block();
    let mut state = saved.state.clone();
    state.device = DeviceState::Block {
        capacity: 1,
        read_only: false,
    };
    let mut rig = Rig::new(&saved.mem, saved.device());

    let result = rig.transport.restore(&state);

    assert!(matches!(result, Err(Error::RestoreDevice(_))));
}

#[test]
fn restore_validates_the_saved_queues_like_driver_ok() {
    let saved = saved_block();
    let bad_size = QueueConfigState {
        size: 3,
        ..saved.state.queues[0]
    };
    let outside = QueueConfigState {
        device: MEM_SIZE as u64 - 8,
        ..saved.state.queues[0]
    };
    for (queue, expected) in [(bad_size, "size"), (outside, "outside")] {
        let mut state = saved.state.clone();
        state.queues[0] = queue;
        let mut rig = Rig::new(&saved.mem, saved.device());

        let result = rig.transport.restore(&state);

        let refused = match result {
            Err(Error::QueueSize { size: 3, .. }) => "size",
            Err(Error::QueueOutsideMemory { .. }) => "outside",
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(refused, expected);
        assert!(!rig.transport.is_activated());
        assert_eq!(rig.transport.status(), 0, "the transport is back in reset");
        assert!(!rig.dev().is_activated());
    }
}

#[test]
fn restore_refuses_inconsistent_registers_and_foreign_features() {
    let saved = saved_block();
    let skipped_steps = MmioTransportState {
        status: DRIVER_OK,
        ..saved.state.clone()
    };
    let not_activated = MmioTransportState {
        activated: false,
        ..saved.state.clone()
    };
    let foreign_feature = MmioTransportState {
        driver_features: saved.state.driver_features | 1 << 40,
        ..saved.state.clone()
    };
    let wrong_event_idx = {
        let mut state = saved.state.clone();
        state.positions[0].event_idx = false;
        state
    };

    let mut results = Vec::new();
    for state in [
        skipped_steps,
        not_activated,
        foreign_feature,
        wrong_event_idx,
    ] {
        let mut rig = Rig::new(&saved.mem, saved.device());
        results.push(rig.transport.restore(&state));
        assert!(!rig.dev().is_activated());
    }

    assert!(matches!(results[0], Err(Error::RestoreInvalid(_))));
    assert!(matches!(results[1], Err(Error::RestoreInvalid(_))));
    assert!(matches!(results[2], Err(Error::FeaturesNotOffered { .. })));
    assert!(matches!(results[3], Err(Error::RestoreInvalid(_))));
}

#[test]
fn restore_needs_a_fresh_transport() {
    let saved = saved_block();
    let mut rig = Rig::restored(&saved.mem, saved.device(), &saved.state);

    let again = rig.transport.restore(&saved.state);

    assert!(matches!(again, Err(Error::RestoreNotFresh { .. })));
}

#[test]
fn restore_of_a_device_in_the_middle_of_initialisation_lets_the_driver_finish() {
    let dir = tempfile::tempdir().unwrap();
    write_image(dir.path());
    let mem = guest_memory();
    let mut q = TestQueue::new(&mem, 0x1000, 0x10_0000, BLOCK_QUEUE);
    let state = {
        let mut rig = Rig::new(&mem, Block::new(disk_image(dir.path())).unwrap());
        rig.negotiate();
        rig.transport.save().unwrap()
    };
    let mut rig = Rig::new(&mem, Block::new(disk_image(dir.path())).unwrap());

    rig.transport.restore(&state).unwrap();
    rig.set_up_queues(&[&q], &[BLOCK_QUEUE]);
    push_read(&mut q, 7);
    rig.notify(0);

    assert!(!state.activated && state.positions.is_empty());
    assert_eq!(rig.dev().acked_features(), state.driver_features);
    let used = q.pop_used().unwrap();
    assert_eq!(q.read(used.descs[1].0, 512), vec![7u8; 512]);
}

#[test]
fn restore_raises_interrupts_the_driver_had_not_acknowledged() {
    let saved = saved_block();
    assert_eq!(saved.state.interrupt_status, VIRTIO_MMIO_INT_VRING);

    let mut rig = Rig::restored(&saved.mem, saved.device(), &saved.state);

    assert!(rig.irq.read().unwrap() > 0);
    assert_eq!(
        rig.read32(reg::VIRTIO_MMIO_INTERRUPT_STATUS),
        VIRTIO_MMIO_INT_VRING
    );
}

#[test]
fn transport_state_survives_a_json_round_trip() {
    let saved = saved_block();

    let json = serde_json::to_string(&saved.state).unwrap();
    let parsed: MmioTransportState = serde_json::from_str(&json).unwrap();

    assert_eq!(parsed, saved.state);
    assert!(json.contains(r#""device":{"kind":"block""#), "{json}");
}

#[test]
fn json_with_an_unknown_field_is_refused() {
    let saved = saved_block();
    let mut value = serde_json::to_value(&saved.state).unwrap();
    value["surprise"] = serde_json::json!(1);

    let parsed = serde_json::from_value::<MmioTransportState>(value);

    assert!(parsed.is_err());
}

//! The device as the transport and the VMM see it: creation, features, configuration space,
//! activation, reset, several disks, and a Linux-style bring-up through the MMIO transport.

use std::sync::{Arc, Mutex};

use event_manager::{EventManager, SubscriberOps};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::driver::{Part, TestQueue};
use super::{config, header, image_file, pattern, Harness, BUFS_BASE};
use crate::devices::bus::BusDevice;
use crate::devices::virtio::block::{
    Block, BlockConfig, Error, QUEUE_SIZE, SEG_MAX, VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_FLUSH,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN,
};
use crate::devices::virtio::mmio::{MmioTransport, CONFIG_SPACE_OFFSET, NOTIFY_REG_OFFSET};
use crate::devices::virtio::{
    ActivateContext, ActivateError, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1,
    VIRTIO_MMIO_INT_VRING,
};

const BASE_FEATURES: u64 = 1 << VIRTIO_F_VERSION_1
    | 1 << VIRTIO_RING_F_EVENT_IDX
    | 1 << VIRTIO_BLK_F_SEG_MAX
    | 1 << VIRTIO_BLK_F_BLK_SIZE
    | 1 << VIRTIO_BLK_F_FLUSH;

fn read_config(dev: &Block, offset: u64, len: usize) -> Vec<u8> {
    let mut data = vec![0xffu8; len];
    dev.read_config(offset, &mut data);
    data
}

/// A disk of `sectors` sectors in a sparse file.
fn sparse_harness(sectors: u64) -> Harness {
    let (dir, path) = image_file(&[]);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(sectors * 512)
        .unwrap();
    Harness::with_config(dir, config(&path))
}

#[test]
fn device_is_a_block_device_with_one_256_entry_queue() {
    let h = Harness::new(&[0u8; 512]);

    assert_eq!(h.dev().device_type(), 2);
    assert_eq!(h.dev().queue_max_sizes(), &[QUEUE_SIZE]);
    assert_eq!(QUEUE_SIZE, 256);
}

#[test]
fn writable_disk_offers_no_ro_feature_and_read_only_disk_does() {
    let rw = Harness::new(&[0u8; 512]);
    let ro = Harness::read_only(&[0u8; 512]);

    assert_eq!(rw.dev().avail_features(), BASE_FEATURES);
    assert_eq!(
        ro.dev().avail_features(),
        BASE_FEATURES | 1 << VIRTIO_BLK_F_RO
    );
}

#[test]
fn acked_features_are_limited_to_the_offered_ones() {
    let h = Harness::new(&[0u8; 512]);

    h.dev().set_acked_features(u64::MAX);

    assert_eq!(h.dev().acked_features(), BASE_FEATURES);
}

#[test]
fn capacity_reads_at_every_width_and_offset() {
    // 0x0001_0203 sectors: capacity bytes 03 02 01 00 00 00 00 00.
    let h = sparse_harness(0x0001_0203);
    let dev = h.dev();

    let whole = read_config(&dev, 0, 8);
    let low = read_config(&dev, 0, 4);
    let high = read_config(&dev, 4, 4);
    let middle = read_config(&dev, 1, 2);
    let byte = read_config(&dev, 2, 1);

    assert_eq!(whole, 0x0001_0203u64.to_le_bytes());
    assert_eq!(low, [3, 2, 1, 0]);
    assert_eq!(high, [0, 0, 0, 0]);
    assert_eq!(middle, [2, 1]);
    assert_eq!(byte, [1]);
    assert_eq!(dev.capacity(), 0x0001_0203);
}

#[test]
fn seg_max_and_blk_size_are_in_the_config_space_and_the_rest_reads_zero() {
    let h = Harness::new(&[0u8; 4096]);
    let dev = h.dev();

    let seg_max = read_config(&dev, 12, 4);
    let blk_size = read_config(&dev, 20, 4);
    let size_max_and_geometry = read_config(&dev, 8, 4)
        .into_iter()
        .chain(read_config(&dev, 16, 4))
        .collect::<Vec<_>>();
    let past_end = read_config(&dev, 24, 16);
    let far_away = read_config(&dev, u64::MAX, 4);

    assert_eq!(seg_max, SEG_MAX.to_le_bytes());
    assert_eq!(blk_size, 512u32.to_le_bytes());
    assert_eq!(size_max_and_geometry, [0u8; 8]);
    assert_eq!(past_end, [0u8; 16]);
    assert_eq!(far_away, [0u8; 4]);
}

#[test]
fn config_writes_are_ignored() {
    let h = Harness::new(&[0u8; 4096]);

    h.dev().write_config(0, &[0xff; 8]);

    assert_eq!(read_config(&h.dev(), 0, 8), 8u64.to_le_bytes());
}

#[test]
fn image_size_not_a_multiple_of_512_rounds_capacity_down() {
    let image = pattern(1000, 32);
    let mut h = Harness::new(&image);

    let capacity = h.dev().capacity();
    let (first_status, first) = h.read_sectors(0, 1);
    let (partial_status, _) = h.read_sectors(1, 1);

    assert_eq!(capacity, 1);
    assert_eq!(read_config(&h.dev(), 0, 8), 1u64.to_le_bytes());
    assert_eq!(first_status, VIRTIO_BLK_S_OK);
    assert_eq!(first, &image[..512]);
    assert_eq!(partial_status, VIRTIO_BLK_S_IOERR);
}

#[test]
fn id_longer_than_20_bytes_is_refused() {
    let (_dir, path) = image_file(&[0u8; 512]);
    let cfg = BlockConfig {
        id: Some("an-identifier-of-21-b".into()),
        backing: None,
        ..config(&path)
    };

    let result = Block::new(cfg);

    assert!(matches!(result, Err(Error::IdTooLong { len: 21, .. })));
}

#[test]
fn missing_image_and_directory_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let directory = BlockConfig {
        read_only: true,
        ..config(dir.path())
    };

    let missing = Block::new(config(&dir.path().join("nope.raw")));
    let not_a_disk = Block::new(directory);

    assert!(matches!(missing, Err(Error::Open { .. })));
    assert!(matches!(not_a_disk, Err(Error::NotADisk(_))));
}

#[test]
fn writable_image_cannot_be_opened_twice_but_read_only_ones_can() {
    let (_dir, path) = image_file(&[0u8; 512]);
    let ro = BlockConfig {
        read_only: true,
        ..config(&path)
    };
    let first = Block::new(config(&path)).unwrap();

    let second_rw = Block::new(config(&path));
    let while_rw = Block::new(ro.clone());
    drop(first);
    let ro_a = Block::new(ro.clone());
    let ro_b = Block::new(ro);

    assert!(matches!(second_rw, Err(Error::Locked { .. })));
    assert!(matches!(while_rw, Err(Error::Locked { .. })));
    assert!(ro_a.is_ok() && ro_b.is_ok());
}

#[test]
fn two_disks_serve_their_own_images() {
    let mut a = Harness::new(&[0u8; 4096]);
    let mut b = Harness::new(&[0u8; 4096]);
    let data = pattern(512, 33);

    a.write_sectors(0, &data);
    let (_, from_b) = b.read_sectors(0, 1);

    assert_eq!(&a.image()[..512], &data[..]);
    assert_eq!(from_b, [0u8; 512]);
    assert_eq!(b.image(), [0u8; 4096]);
}

#[test]
fn activation_with_the_wrong_queue_count_is_refused() {
    let (_dir, path) = image_file(&[0u8; 512]);
    let mut dev = Block::new(config(&path)).unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let q = TestQueue::new(&mem, 0x1000, 0x8000, 16);
    let evt = || EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let ctx = ActivateContext {
        mem: mem.clone(),
        queues: vec![q.device_queue(QUEUE_SIZE), q.device_queue(QUEUE_SIZE)],
        queue_evts: vec![evt(), evt()],
        interrupt: Arc::new(IrqTrigger::new(evt())),
    };

    let result = dev.activate(ctx);

    assert!(matches!(
        result,
        Err(ActivateError::QueueCount {
            expected: 1,
            got: 2
        })
    ));
    assert!(!dev.is_activated());
}

#[test]
fn second_activation_without_reset_is_refused() {
    let h = Harness::new(&[0u8; 512]);
    let ctx = ActivateContext {
        mem: h.mem.clone(),
        queues: vec![h.q.device_queue(QUEUE_SIZE)],
        queue_evts: vec![EventFd::new(libc::EFD_NONBLOCK).unwrap()],
        interrupt: h.interrupt.clone(),
    };

    let result = h.dev().activate(ctx);

    assert!(matches!(result, Err(ActivateError::Device(_))));
}

#[test]
fn after_reset_a_new_activation_serves_requests_queued_before_it() {
    let image = pattern(8 * 512, 34);
    let mut h = Harness::new(&image);
    h.read_sectors(0, 1);

    let reset = h.dev().reset();
    h.kick(); // A notification while inactive is ignored.
    h.q = TestQueue::new(&h.mem, 0x8000, BUFS_BASE, QUEUE_SIZE);
    let hdr = header(VIRTIO_BLK_T_IN, 3);
    h.q.push(&[Part::Read(&hdr), Part::Write(512), Part::Write(1)]);
    h.activate();
    let queued = h.pop_used();
    let queued_status = h.status(&queued);
    let queued_data = h.q.read(queued.descs[1].0, 512);
    let (later_status, later) = h.read_sectors(5, 1);

    assert!(reset);
    assert_eq!(queued_status, VIRTIO_BLK_S_OK);
    assert_eq!(queued_data, &image[3 * 512..4 * 512]);
    assert_eq!(
        later_status, VIRTIO_BLK_S_OK,
        "the new notification is watched"
    );
    assert_eq!(later, &image[5 * 512..6 * 512]);
}

// Register offsets and status bits of the virtio-mmio transport (virtio 1.2 §4.2.2, §2.1).
const DEVICE_ID: u64 = 0x008;
const DEVICE_FEATURES: u64 = 0x010;
const DEVICE_FEATURES_SEL: u64 = 0x014;
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM_MAX: u64 = 0x034;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const INTERRUPT_STATUS: u64 = 0x060;
const STATUS: u64 = 0x070;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_AVAIL_LOW: u64 = 0x090;
const QUEUE_USED_LOW: u64 = 0x0a0;
const ACKNOWLEDGE: u32 = 1;
const DRIVER: u32 = 2;
const DRIVER_OK: u32 = 4;
const FEATURES_OK: u32 = 8;

fn read32(t: &mut MmioTransport, offset: u64) -> u32 {
    let mut data = [0u8; 4];
    t.read(offset, &mut data);
    u32::from_le_bytes(data)
}

fn write32(t: &mut MmioTransport, offset: u64, value: u32) {
    t.write(offset, &value.to_le_bytes());
}

fn write64(t: &mut MmioTransport, low_offset: u64, value: u64) {
    write32(t, low_offset, value as u32);
    write32(t, low_offset + 4, (value >> 32) as u32);
}

/// Brings the device up as Linux's virtio_mmio + virtio_blk do, accepting every offered feature.
fn linux_init(t: &mut MmioTransport, q: &TestQueue) -> u64 {
    write32(t, STATUS, ACKNOWLEDGE);
    write32(t, STATUS, ACKNOWLEDGE | DRIVER);
    let mut features = 0u64;
    for sel in 0..2 {
        write32(t, DEVICE_FEATURES_SEL, sel);
        features |= u64::from(read32(t, DEVICE_FEATURES)) << (32 * sel);
    }
    for sel in 0..2 {
        write32(t, DRIVER_FEATURES_SEL, sel);
        write32(t, DRIVER_FEATURES, (features >> (32 * sel)) as u32);
    }
    write32(t, STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    write32(t, QUEUE_SEL, 0);
    let max = read32(t, QUEUE_NUM_MAX);
    write32(t, QUEUE_NUM, max);
    let (desc, avail, used) = q.addresses();
    write64(t, QUEUE_DESC_LOW, desc);
    write64(t, QUEUE_AVAIL_LOW, avail);
    write64(t, QUEUE_USED_LOW, used);
    write32(t, QUEUE_READY, 1);
    write32(t, STATUS, ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
    features
}

#[test]
fn linux_style_bring_up_through_the_mmio_transport_serves_a_read() {
    let image = pattern(16 * 512, 35);
    let (_dir, path) = image_file(&image);
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x200_0000)]).unwrap();
    let dev = Arc::new(Mutex::new(Block::new(config(&path)).unwrap()));
    let mut em = EventManager::<Arc<Mutex<Block>>>::new().unwrap();
    em.add_subscriber(dev.clone());
    let interrupt = Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
    let mut t = MmioTransport::new(mem.clone(), dev.clone(), interrupt.clone()).unwrap();
    let mut q = TestQueue::new(&mem, 0x1000, BUFS_BASE, QUEUE_SIZE);
    let run =
        |em: &mut EventManager<Arc<Mutex<Block>>>| while em.run_with_timeout(0).unwrap() > 0 {};

    let features = linux_init(&mut t, &q);
    run(&mut em);
    let mut capacity = [0u8; 8];
    t.read(CONFIG_SPACE_OFFSET, &mut capacity[..4]);
    t.read(CONFIG_SPACE_OFFSET + 4, &mut capacity[4..]);
    let hdr = header(VIRTIO_BLK_T_IN, 7);
    q.push(&[Part::Read(&hdr), Part::Write(1024), Part::Write(1)]);
    write32(&mut t, NOTIFY_REG_OFFSET, 0);
    run(&mut em);
    let used = q.pop_used().expect("the read completed");

    assert_eq!(read32(&mut t, DEVICE_ID), 2);
    assert_eq!(features, BASE_FEATURES);
    assert_eq!(read32(&mut t, STATUS) & DRIVER_OK, DRIVER_OK);
    assert_eq!(u64::from_le_bytes(capacity), 16);
    assert_eq!(used.len, 1025);
    assert_eq!(q.read(used.descs[1].0, 1024), &image[7 * 512..9 * 512]);
    assert_eq!(q.read(used.descs[2].0, 1)[0], VIRTIO_BLK_S_OK);
    assert_eq!(read32(&mut t, INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
}

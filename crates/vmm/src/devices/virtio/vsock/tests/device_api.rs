//! The device as the VMM and the transport see it: construction, features, configuration space,
//! activation, socket file lifetime.

use std::sync::{Arc, Mutex};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};

use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::vsock::{Error, Vsock, VSOCK_QUEUE_SIZES};
use crate::devices::virtio::{
    device_type, ActivateContext, ActivateError, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1,
};

fn new_device(cid: u64) -> (tempfile::TempDir, Result<Vsock, Error>) {
    let dir = tempfile::tempdir().unwrap();
    let dev = Vsock::new(cid, dir.path().join("v.sock"));
    (dir, dev)
}

#[test]
fn reserved_and_oversized_cids_are_refused() {
    for cid in [0, 1, 2, u64::from(u32::MAX), 1 << 32] {
        let (_dir, result) = new_device(cid);

        assert!(
            matches!(result, Err(Error::InvalidCid(c)) if c == cid),
            "cid {cid}"
        );
    }
}

#[test]
fn existing_socket_path_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.sock");
    std::fs::write(&path, b"stale").unwrap();

    let err = Vsock::new(3, &path).unwrap_err();

    assert!(matches!(err, Error::UdsPathExists(ref p) if *p == path));
    assert!(err.to_string().contains("already exists"), "{err}");
}

#[test]
fn socket_file_exists_while_the_device_lives_and_is_removed_on_drop() {
    let (dir, dev) = new_device(3);
    let path = dir.path().join("v.sock");
    let dev = dev.unwrap();
    assert!(path.exists());
    assert_eq!(dev.uds_path(), path);

    drop(dev);

    assert!(!path.exists());
}

#[test]
fn identity_features_and_queue_sizes() {
    let (_dir, dev) = new_device(3);
    let mut dev = dev.unwrap();

    dev.set_acked_features(u64::MAX);

    assert_eq!(dev.device_type(), device_type::VSOCK);
    assert_eq!(dev.device_type(), 19);
    assert_eq!(dev.queue_max_sizes(), &VSOCK_QUEUE_SIZES);
    assert_eq!(dev.queue_max_sizes().len(), 3);
    assert_eq!(
        dev.avail_features(),
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX
    );
    assert!(!dev.reset(), "driver reset is not supported");
}

#[test]
fn config_space_is_the_guest_cid_as_le64_and_read_only() {
    let (_dir, dev) = new_device(0x1234_5678);
    let mut dev = dev.unwrap();
    dev.write_config(0, &[0xff; 8]);

    let mut whole = [0u8; 8];
    dev.read_config(0, &mut whole);
    let mut low = [0u8; 4];
    dev.read_config(0, &mut low);
    let mut high = [0u8; 4];
    dev.read_config(4, &mut high);
    let mut past_end = [0xaau8; 4];
    dev.read_config(6, &mut past_end);

    assert_eq!(u64::from_le_bytes(whole), 0x1234_5678);
    assert_eq!(u32::from_le_bytes(low), 0x1234_5678);
    assert_eq!(u32::from_le_bytes(high), 0);
    assert_eq!(past_end, [0, 0, 0, 0]);
}

#[test]
fn activation_needs_three_queues() {
    let (_dir, dev) = new_device(3);
    let mut dev = dev.unwrap();
    let ctx = ActivateContext {
        mem: GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap(),
        queues: vec![virtio_queue::Queue::new(256).unwrap()],
        queue_evts: vec![EventFd::new(libc::EFD_NONBLOCK).unwrap()],
        interrupt: Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())),
    };

    let err = dev.activate(ctx).unwrap_err();

    assert!(matches!(
        err,
        ActivateError::QueueCount {
            expected: 3,
            got: 1
        }
    ));
    assert!(!dev.is_activated());
}

#[test]
fn fits_the_vmm_event_manager_and_the_mmio_transport() {
    let (_dir, dev) = new_device(3);
    let dev = Arc::new(Mutex::new(dev.unwrap()));
    let mut em: EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>> =
        EventManager::new().unwrap();
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
    let irq = Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));

    em.add_subscriber(dev.clone());
    let idle_events = em.run_with_timeout(0).unwrap();
    let transport = MmioTransport::new(mem, dev, irq);

    assert_eq!(idle_events, 0, "nothing to do before activation");
    assert!(transport.is_ok(), "{:?}", transport.err());
}

//! vsock across a snapshot: the TRANSPORT_RESET event, packets held until the guest has handled
//! it, and TX chains posted before the snapshot.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::{guest_memory, Rig};
use crate::devices::virtio::mmio::persist::MmioTransportState;
use crate::devices::virtio::test_driver::{Part, TestQueue};
use crate::devices::virtio::vsock::packet::{Header, Op, HEADER_SIZE, TYPE_STREAM};
use crate::devices::virtio::vsock::{
    Vsock, EVQ_INDEX, HOST_CID, RESET_ACK_TIMEOUT, RXQ_INDEX, TXQ_INDEX, VSOCK_QUEUE_SIZES,
};

const GUEST_CID: u64 = 3;
/// Entries per test queue.
const QUEUE: u16 = 64;

/// The guest's side of the three queues, the guest memory and the socket directory.
struct Guest {
    dir: tempfile::TempDir,
    mem: GuestMemoryMmap,
    rx: TestQueue,
    tx: TestQueue,
    ev: TestQueue,
}

impl Guest {
    fn new() -> Self {
        let mem = guest_memory();
        Guest {
            dir: tempfile::tempdir().unwrap(),
            rx: TestQueue::new(&mem, 0x1000, 0x10_0000, QUEUE),
            tx: TestQueue::new(&mem, 0x9000, 0x80_0000, QUEUE),
            ev: TestQueue::new(&mem, 0x1_1000, 0x100_0000, QUEUE),
            mem,
        }
    }

    /// A vsock device listening at `<dir>/<name>`.
    fn device(&self, name: &str) -> Vsock {
        Vsock::new(GUEST_CID, self.dir.path().join(name)).unwrap()
    }

    /// Posts `n` RX chains (header + 4 KiB).
    fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            self.rx
                .push(&[Part::Write(HEADER_SIZE as u32), Part::Write(4096)]);
        }
    }

    /// Posts one 4-byte event buffer filled with 0xff; returns its head.
    fn post_event_buffer(&mut self) -> u16 {
        let head = self.ev.push(&[Part::Write(4)]);
        self.mem
            .write_slice(&[0xff; 4], GuestAddress(self.ev.slot_addr(head)))
            .unwrap();
        head
    }

    /// Queues a REQUEST from guest port 5000 to host port `port`, without notifying.
    fn push_connect(&mut self, port: u32) {
        let hdr = Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: 5000,
            dst_port: port,
            type_: TYPE_STREAM,
            op: Op::Request as u16,
            buf_alloc: 64 * 1024,
            ..Header::default()
        };
        self.tx.push(&[Part::Read(&hdr.to_bytes())]);
    }

    /// Headers of the packets the device put on the RX queue since the last call.
    fn received(&mut self) -> Vec<Header> {
        let mut headers = Vec::new();
        while let Some(used) = self.rx.pop_used() {
            let raw = self.rx.read(used.descs[0].0, HEADER_SIZE);
            headers.push(Header::from_bytes(&raw.try_into().unwrap()));
        }
        headers
    }
}

/// Brings a vsock device up like Linux (EVENT_IDX negotiated), with 8 RX buffers and
/// `event_buffers` event buffers; the guest connects to host port 99 (nothing listens: the device
/// answers RST) so the rings have moved; then saves it. The saved device is dropped.
fn saved_vsock(guest: &mut Guest, event_buffers: usize) -> MmioTransportState {
    let mut rig = Rig::new(&guest.mem, guest.device("old.sock"));
    rig.negotiate();
    guest.post_rx(8);
    for _ in 0..event_buffers {
        guest.post_event_buffer();
    }
    rig.set_up_queues(&[&guest.rx, &guest.tx, &guest.ev], &[QUEUE; 3]);
    guest.push_connect(99);
    rig.notify(TXQ_INDEX as u32);
    let answers = guest.received();
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].operation(), Some(Op::Rst));
    while guest.tx.pop_used().is_some() {}
    guest.post_rx(1);
    rig.transport.save().unwrap()
}

#[test]
fn restored_vsock_sends_one_transport_reset_once_an_event_buffer_is_posted() {
    let mut guest = Guest::new();
    let state = saved_vsock(&mut guest, 0);
    let mut rig = Rig::restored(&guest.mem, guest.device("new.sock"), &state);
    let before_buffer = guest.ev.used_idx();

    let head = guest.post_event_buffer();
    guest.post_event_buffer();
    rig.irq.read().ok();
    rig.notify(EVQ_INDEX as u32);

    assert_eq!(before_buffer, 0, "no event without a buffer");
    assert_eq!(guest.ev.used_idx(), 1, "exactly one event");
    let used = guest.ev.pop_used().unwrap();
    assert_eq!(used.len, 4);
    assert_eq!(used.descs[0].0, guest.ev.slot_addr(head));
    assert_eq!(guest.ev.read(guest.ev.slot_addr(head), 4), [0, 0, 0, 0]);
    assert!(rig.irq.read().unwrap() > 0, "the guest is interrupted");
    assert_eq!(
        guest.ev.avail_event(),
        2,
        "the guest's next event buffer comes with a notification"
    );

    guest.post_event_buffer();
    rig.notify(EVQ_INDEX as u32);

    assert_eq!(guest.ev.used_idx(), 1, "still exactly one event");
    assert_eq!(state.positions.len(), VSOCK_QUEUE_SIZES.len());
}

#[test]
fn restored_vsock_holds_packets_for_the_guest_until_it_handled_the_reset() {
    let mut guest = Guest::new();
    let state = saved_vsock(&mut guest, 2);
    let mut rig = Rig::restored(&guest.mem, guest.device("new.sock"), &state);
    assert_eq!(guest.ev.used_idx(), 1, "the event went out on activation");
    let mut client = UnixStream::connect(guest.dir.path().join("new.sock")).unwrap();
    client.write_all(b"CONNECT 1234\n").unwrap();
    rig.settle();
    let while_held = guest.received();

    // The guest handles the event: it posts the buffer again and notifies the event queue.
    guest.ev.pop_used().unwrap();
    guest.post_event_buffer();
    rig.notify(EVQ_INDEX as u32);
    let after_ack = guest.received();

    assert!(while_held.is_empty(), "{while_held:?}");
    assert_eq!(after_ack.len(), 1);
    assert_eq!(after_ack[0].operation(), Some(Op::Request));
    assert_eq!(after_ack[0].dst_port, 1234);
    assert!(!rig.dev().is_rx_held());
    assert_eq!(guest.ev.used_idx(), 1);
}

#[test]
fn restored_vsock_releases_held_packets_when_the_guest_never_acknowledges() {
    let mut guest = Guest::new();
    let state = saved_vsock(&mut guest, 0);
    let mut rig = Rig::restored(&guest.mem, guest.device("new.sock"), &state);
    let mut client = UnixStream::connect(guest.dir.path().join("new.sock")).unwrap();
    client.write_all(b"CONNECT 1234\n").unwrap();
    rig.settle();
    let while_held = guest.received();

    let late = Instant::now() + RESET_ACK_TIMEOUT + Duration::from_secs(1);
    rig.dev().expire_connections(late);
    let after_timeout = guest.received();

    assert!(while_held.is_empty());
    assert_eq!(after_timeout.len(), 1);
    assert_eq!(after_timeout[0].operation(), Some(Op::Request));
}

#[test]
fn restored_vsock_serves_tx_chains_posted_before_the_snapshot_without_a_notification() {
    let mut guest = Guest::new();
    let state = {
        let mut rig = Rig::new(&guest.mem, guest.device("old.sock"));
        rig.negotiate();
        guest.post_rx(8);
        guest.post_event_buffer();
        rig.set_up_queues(&[&guest.rx, &guest.tx, &guest.ev], &[QUEUE; 3]);
        // Posted, but the snapshot comes before the device runs its queue handler.
        guest.push_connect(99);
        rig.transport.save().unwrap()
    };

    let rig = Rig::restored(&guest.mem, guest.device("new.sock"), &state);

    assert_eq!(state.positions[TXQ_INDEX].next_avail, 0);
    assert_eq!(guest.tx.used_idx(), 1, "the TX chain was served on restore");
    assert!(rig.dev().is_rx_held(), "its RST waits for the guest's ack");
    assert_eq!(guest.rx.used_idx(), 0);
    assert_eq!(state.positions[RXQ_INDEX].next_used, 0);
}

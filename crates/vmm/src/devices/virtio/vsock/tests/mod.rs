//! Device tests without KVM: guest memory with driver-side queues ([`driver`]), a real
//! `EventManager` running the device's event handler, and real Unix sockets on the host side.
//!
//! The event loop is driven with zero-timeout polls until no fd is ready ([`Harness::settle`]), so
//! every step is deterministic: a Unix socket write is visible to epoll as soon as it returns.
//! A loop that never settles (a busy fd) fails the test.

use crate::devices::virtio::test_driver as driver;

mod device_api;
mod flow_control;
mod guest_initiated;
mod host_initiated;
mod hostile;
mod notifications;

use std::io::{self, Read};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use event_manager::{EventManager, SubscriberOps};
use virtio_queue::QueueT;
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use self::driver::{Part, TestQueue, Used};
use super::packet::{Header, Op, HEADER_SIZE, TYPE_STREAM};
use super::unix::port_path;
use super::{Vsock, EVQ_INDEX, HOST_CID, RXQ_INDEX, TXQ_INDEX, VSOCK_QUEUE_SIZES};
use crate::devices::virtio::{ActivateContext, IrqTrigger, VirtioDevice};

/// The guest's CID in all tests.
pub const GUEST_CID: u64 = 3;
/// Entries per test queue.
const QUEUE_SIZE: u16 = 64;
/// RX chains the guest keeps posted (each uses two descriptors).
const RX_CHAINS: usize = 16;
/// Payload capacity of each RX buffer, as Linux's 4 KiB buffers.
pub const RX_DATA_SIZE: u32 = 4096;
/// Receive buffer the test guest advertises unless a test says otherwise.
pub const GUEST_BUF_ALLOC: u32 = 256 * 1024;

/// A packet the device sent to the guest.
#[derive(Clone, Debug)]
pub struct Packet {
    pub hdr: Header,
    pub data: Vec<u8>,
}

impl Packet {
    pub fn op(&self) -> Option<Op> {
        self.hdr.operation()
    }
}

/// The device, its event loop and the guest's side of its queues.
pub struct Harness {
    _dir: tempfile::TempDir,
    pub uds: PathBuf,
    pub dev: Arc<Mutex<Vsock>>,
    em: EventManager<Arc<Mutex<Vsock>>>,
    pub rx: TestQueue,
    pub tx: TestQueue,
    kicks: Vec<EventFd>,
    /// The device's interrupt eventfd (the irqfd a VMM registers): its counter is the number of
    /// interrupts since the last [`Harness::take_interrupts`].
    irq: EventFd,
    /// Whether [`Harness::recv`] replaces the RX buffers it takes back.
    pub repost_rx: bool,
    /// Every TX chain the device returned, in order.
    pub tx_used: Vec<Used>,
    /// RX chains returned with a length too short for a header.
    pub rx_short: Vec<Used>,
}

impl Harness {
    /// An activated device with [`RX_CHAINS`] RX buffers posted.
    pub fn new() -> Self {
        let mut h = Harness::with_rx_buffers(RX_CHAINS);
        h.settle();
        h
    }

    /// An activated device with `rx_chains` RX buffers posted (and not yet noticed).
    pub fn with_rx_buffers(rx_chains: usize) -> Self {
        Harness::activated(rx_chains, false)
    }

    /// As [`Harness::new`], with VIRTIO_RING_F_EVENT_IDX negotiated (as Linux does).
    pub fn with_event_idx() -> Self {
        let mut h = Harness::activated(RX_CHAINS, true);
        h.settle();
        h
    }

    fn activated(rx_chains: usize, event_idx: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x200_0000)]).unwrap();
        let rx = TestQueue::new(&mem, 0x1000, 0x10_0000, QUEUE_SIZE);
        let tx = TestQueue::new(&mem, 0x9000, 0x80_0000, QUEUE_SIZE);
        let ev = TestQueue::new(&mem, 0x1_1000, 0x100_0000, QUEUE_SIZE);
        let dev = Arc::new(Mutex::new(Vsock::new(GUEST_CID, &uds).unwrap()));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let kicks: Vec<EventFd> = (0..3)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
            .collect();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let ctx = ActivateContext {
            mem,
            queues: [&rx, &tx, &ev]
                .iter()
                .map(|q| {
                    let mut queue = q.device_queue(VSOCK_QUEUE_SIZES[0]);
                    queue.set_event_idx(event_idx);
                    queue
                })
                .collect(),
            queue_evts: kicks.iter().map(|k| k.try_clone().unwrap()).collect(),
            interrupt: Arc::new(IrqTrigger::new(irq.try_clone().unwrap())),
        };
        dev.lock().unwrap().activate(ctx).unwrap();
        let mut h = Harness {
            _dir: dir,
            uds,
            dev,
            em,
            rx,
            tx,
            kicks,
            irq,
            repost_rx: true,
            tx_used: Vec::new(),
            rx_short: Vec::new(),
        };
        h.settle();
        h.post_rx(rx_chains);
        h
    }

    /// The device, locked.
    pub fn dev(&self) -> MutexGuard<'_, Vsock> {
        self.dev.lock().unwrap()
    }

    /// Runs the event loop until no fd is ready.
    pub fn settle(&mut self) {
        for _ in 0..10_000 {
            if self.em.run_with_timeout(0).unwrap() == 0 {
                return;
            }
        }
        panic!("the event loop never went idle: some fd stays ready");
    }

    /// Interrupts the device raised since the last call (reads and resets the eventfd counter).
    pub fn take_interrupts(&mut self) -> u64 {
        self.irq.read().unwrap_or(0)
    }

    /// Signals queue `index` to the device (QueueNotify) and runs the loop.
    pub fn kick(&mut self, index: usize) {
        self.kicks[index].write(1).unwrap();
        self.settle();
    }

    /// Posts `n` RX chains (header + [`RX_DATA_SIZE`] bytes) without notifying.
    pub fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            self.rx
                .push(&[Part::Write(HEADER_SIZE as u32), Part::Write(RX_DATA_SIZE)]);
        }
    }

    /// Lets the device's clock read `now` once (as if its timer fired then), then runs an event
    /// through the loop so the device can stop watching and close what expired.
    pub fn expire_at(&mut self, now: Instant) {
        self.dev().expire_connections(now);
        self.kick(EVQ_INDEX);
    }

    /// Queues a TX packet without notifying.
    pub fn push_tx(&mut self, hdr: &Header, data: &[u8]) {
        let bytes = hdr.to_bytes();
        if data.is_empty() {
            self.tx.push(&[Part::Read(&bytes)]);
        } else {
            self.tx.push(&[Part::Read(&bytes), Part::Read(data)]);
        }
    }

    /// Sends one packet from the guest and lets the device handle it.
    pub fn send(&mut self, hdr: &Header, data: &[u8]) {
        self.push_tx(hdr, data);
        self.kick_tx();
    }

    /// Notifies the TX queue, runs the loop and takes back the used TX chains.
    pub fn kick_tx(&mut self) {
        self.kick(TXQ_INDEX);
        while let Some(used) = self.tx.pop_used() {
            self.tx_used.push(used);
        }
    }

    /// Takes the packets the device delivered; replaces the buffers (if [`Self::repost_rx`]) and
    /// runs the loop again so the device can use them.
    pub fn recv(&mut self) -> Vec<Packet> {
        let mut packets = Vec::new();
        while let Some(used) = self.rx.pop_used() {
            match self.decode(&used) {
                Some(packet) => packets.push(packet),
                None => self.rx_short.push(used),
            }
        }
        if self.repost_rx {
            self.post_rx(RX_CHAINS.min(self.rx.free_count() / 2));
            self.kick(RXQ_INDEX);
        }
        packets
    }

    fn decode(&self, used: &Used) -> Option<Packet> {
        let len = used.len as usize;
        let (hdr_addr, _) = *used.descs.first()?;
        if len < HEADER_SIZE {
            return None;
        }
        let raw: [u8; HEADER_SIZE] = self.rx.read(hdr_addr, HEADER_SIZE).try_into().ok()?;
        let hdr = Header::from_bytes(&raw);
        let data = match used.descs.get(1) {
            Some((data_addr, _)) => self.rx.read(*data_addr, len - HEADER_SIZE),
            None => Vec::new(),
        };
        assert_eq!(
            hdr.len as usize,
            data.len(),
            "used length matches header len"
        );
        Some(Packet { hdr, data })
    }

    /// Binds a host listener for guest connections to host port `port`.
    pub fn host_listener(&self, port: u32) -> UnixListener {
        UnixListener::bind(port_path(&self.uds, port)).unwrap()
    }

    /// Connects a host client to the device's socket.
    pub fn client(&self) -> UnixStream {
        let stream = UnixStream::connect(&self.uds).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream
    }
}

/// The guest side of one connection, with its credit bookkeeping.
#[derive(Clone, Copy, Debug)]
pub struct GuestConn {
    pub guest_port: u32,
    pub host_port: u32,
    /// Receive buffer the guest advertises.
    pub buf_alloc: u32,
    /// Data bytes the guest consumed.
    pub fwd_cnt: u32,
    /// The `fwd_cnt` last sent to the device.
    pub announced_fwd_cnt: u32,
    /// Data bytes the guest sent.
    pub tx_cnt: u32,
    /// Data bytes the guest received.
    pub rx_cnt: u32,
    /// The device's latest `buf_alloc` / `fwd_cnt`.
    pub dev_buf_alloc: u32,
    pub dev_fwd_cnt: u32,
}

impl GuestConn {
    pub fn new(guest_port: u32, host_port: u32) -> Self {
        GuestConn {
            guest_port,
            host_port,
            buf_alloc: GUEST_BUF_ALLOC,
            fwd_cnt: 0,
            announced_fwd_cnt: 0,
            tx_cnt: 0,
            rx_cnt: 0,
            dev_buf_alloc: 0,
            dev_fwd_cnt: 0,
        }
    }

    /// A header from this connection's guest end.
    pub fn hdr(&mut self, op: Op, len: u32) -> Header {
        self.announced_fwd_cnt = self.fwd_cnt;
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: self.guest_port,
            dst_port: self.host_port,
            len,
            type_: TYPE_STREAM,
            op: op as u16,
            flags: 0,
            buf_alloc: self.buf_alloc,
            fwd_cnt: self.fwd_cnt,
        }
    }

    /// Whether `p` belongs to this connection.
    pub fn owns(&self, p: &Packet) -> bool {
        p.hdr.dst_port == self.guest_port && p.hdr.src_port == self.host_port
    }

    /// Records the device's credit and accounts received data (consumed at once).
    pub fn observe(&mut self, p: &Packet) {
        self.dev_buf_alloc = p.hdr.buf_alloc;
        self.dev_fwd_cnt = p.hdr.fwd_cnt;
        self.rx_cnt = self.rx_cnt.wrapping_add(p.data.len() as u32);
        self.fwd_cnt = self.fwd_cnt.wrapping_add(p.data.len() as u32);
    }

    /// Observes every packet of this connection in `packets`.
    pub fn observe_all(&mut self, packets: &[Packet]) {
        for p in packets {
            if self.owns(p) {
                self.observe(p);
            }
        }
    }

    /// Bytes the device can still take from the guest.
    pub fn dev_credit(&self) -> u32 {
        let in_flight = self.tx_cnt.wrapping_sub(self.dev_fwd_cnt);
        self.dev_buf_alloc.saturating_sub(in_flight)
    }

    /// Bytes the device sent beyond what the guest's last advertised credit allowed (0 if none).
    pub fn overrun(&self) -> u32 {
        let in_flight = self.rx_cnt.wrapping_sub(self.announced_fwd_cnt);
        in_flight.saturating_sub(self.buf_alloc)
    }
}

/// Establishes a guest-initiated connection from guest port `guest_port` to a host listener on
/// `host_port`; returns the guest side and the accepted host stream.
pub fn connect_from_guest(
    h: &mut Harness,
    guest_port: u32,
    host_port: u32,
) -> (GuestConn, UnixStream) {
    let listener = h.host_listener(host_port);
    let mut g = GuestConn::new(guest_port, host_port);
    let request = g.hdr(Op::Request, 0);
    h.send(&request, &[]);
    let reply = h.recv();
    assert_eq!(reply.len(), 1, "{reply:?}");
    assert_eq!(reply[0].op(), Some(Op::Response));
    g.observe(&reply[0]);
    let (stream, _) = listener.accept().unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    (g, stream)
}

/// Reads from a stream until `n` bytes arrived (bounded by the stream's read timeout).
pub fn read_exactly(stream: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    stream.read_exact(&mut buf).unwrap();
    buf
}

/// Asserts the device closed `stream`: EOF with nothing before it, or a reset (the device closed
/// its end with unread client bytes in it).
pub fn assert_closed_without_data(stream: &mut UnixStream) {
    match read_to_eof(stream) {
        Ok(bytes) => assert!(bytes.is_empty(), "unexpected bytes {bytes:?}"),
        Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{e}"),
    }
}

/// Reads until EOF; returns what came before it (bounded by the stream's read timeout).
pub fn read_to_eof(stream: &mut UnixStream) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf)?;
    Ok(buf)
}

/// Reproducible test data.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

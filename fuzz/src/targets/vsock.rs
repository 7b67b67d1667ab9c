//! `vsock`: packets from the guest's TX queue into the vsock muxer and its connections' state
//! machines, with a real host side (Unix sockets) that the input also drives.
//!
//! The device is bulkhead's [`Vsock`] (guest CID 3) with its hybrid Unix-socket backend in a
//! temporary directory, activated with three queues laid out by the mock driver and run by a
//! real `EventManager`. Host software is a listener at `<uds>_1234` (guest connections to port
//! [`HOST_PORT`] succeed; to other ports they are refused) and host clients that connect to the
//! device's socket and send `CONNECT` lines.
//!
//! # Input
//! - byte 0: bit 0 = no host listener (every guest connection is refused);
//! - then operations, each an op byte (`% 10`) and its fields:
//!   - 0 *tx*: a chain ([`crate::queue`]) on the TX queue, then notify it (a packet is a
//!     44-byte header and the payload);
//!   - 1 *rx chain*: a chain on the RX queue, then notify it;
//!   - 2 *rx buffers*: `u8 % 17` standard RX chains (header + 4 KiB), then notify;
//!   - 3 *connect*: `u32` port: a host client sends `CONNECT <port>\n`;
//!   - 4 *client line*: `u8` length and bytes: a host client sends them as its first line;
//!   - 5 *host write*: `u8` stream, `u16` length (`% 8193`), fill byte: a host socket sends;
//!   - 6 *host close*: `u8` stream: bit 7 set = shut down its write side, else close it;
//!   - 7 *host read*: every host socket reads what is pending;
//!   - 8 *time*: `u8` steps of 100 ms: the device's clock moves on (connection time-outs);
//!   - 9 *event*: a chain on the event queue, then notify it.
//!
//! After every operation the host accepts the guest's new connections and the driver takes the
//! used chains back. Host sockets are non-blocking; at most [`MAX_HOST_STREAMS`] exist.
//!
//! # Checks
//! Unless the input wrote raw descriptors: every returned chain is one in flight, with a used
//! length within its device-writable bytes. Always: at most `MAX_CONNECTIONS` connections.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bulkhead_vmm::devices::virtio::vsock::packet::HEADER_SIZE;
use bulkhead_vmm::devices::virtio::vsock::{
    Vsock, EVQ_INDEX, MAX_CONNECTIONS, RXQ_INDEX, TXQ_INDEX,
};
use bulkhead_vmm::devices::virtio::{ActivateContext, IrqTrigger, VirtioDevice};
use event_manager::{EventManager, SubscriberOps};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::input::Input;
use crate::queue::{read_chain, Driver, Layout, Part};
use crate::{ignore_sigpipe, settle};

/// The guest's CID.
pub const GUEST_CID: u64 = 3;
/// The host port with a listener.
pub const HOST_PORT: u32 = 1234;
/// Guest memory size (4 MiB).
pub const MEM_SIZE: u64 = 0x40_0000;
/// Entries per queue.
pub const QUEUE_SIZE: u16 = 32;
/// Payload room of a standard RX buffer.
pub const RX_DATA: u32 = 4096;
/// Most host sockets (clients and accepted connections) at once.
pub const MAX_HOST_STREAMS: usize = 32;

/// Queue layouts: rx, tx, event.
pub const LAYOUTS: [Layout; 3] = [
    Layout {
        size: QUEUE_SIZE,
        rings: 0x1000,
        bufs: 0x1_0000,
        bufs_end: 0x10_0000,
    },
    Layout {
        size: QUEUE_SIZE,
        rings: 0x2000,
        bufs: 0x10_0000,
        bufs_end: 0x30_0000,
    },
    Layout {
        size: QUEUE_SIZE,
        rings: 0x3000,
        bufs: 0x30_0000,
        bufs_end: 0x40_0000,
    },
];

/// The path of the host listener for guest connections to `port`.
pub fn port_path(uds: &Path, port: u32) -> PathBuf {
    let mut name = uds.as_os_str().to_owned();
    name.push(format!("_{port}"));
    PathBuf::from(name)
}

/// The device, its event loop, the guest's queues and the host's sockets.
struct Rig<'m> {
    dev: Arc<Mutex<Vsock>>,
    em: EventManager<Arc<Mutex<Vsock>>>,
    kicks: Vec<EventFd>,
    queues: Vec<Driver<'m>>,
    uds: PathBuf,
    listener: Option<UnixListener>,
    streams: Vec<UnixStream>,
    clock: Duration,
}

impl Rig<'_> {
    fn notify(&mut self, index: usize) {
        self.kicks[index].write(1).expect("kick");
        settle(&mut self.em);
    }

    fn push(&mut self, index: usize, parts: &[Part]) {
        self.queues[index].push(parts);
        self.notify(index);
    }

    fn connect(&mut self, first_line: &[u8]) {
        if self.streams.len() >= MAX_HOST_STREAMS {
            return;
        }
        // The device's listen backlog (at least 128) is longer than MAX_HOST_STREAMS, so this
        // does not block.
        let Ok(mut stream) = UnixStream::connect(&self.uds) else {
            return;
        };
        stream.set_nonblocking(true).expect("non-blocking client");
        let _ = stream.write(first_line);
        self.streams.push(stream);
        settle(&mut self.em);
    }

    fn host_write(&mut self, index: usize, bytes: &[u8]) {
        if let Some(stream) = self.stream(index) {
            let _ = stream.write(bytes);
            settle(&mut self.em);
        }
    }

    fn host_close(&mut self, which: u8) {
        let index = usize::from(which & 0x7f);
        if which & 0x80 != 0 {
            if let Some(stream) = self.stream(index) {
                let _ = stream.shutdown(Shutdown::Write);
            }
        } else if !self.streams.is_empty() {
            self.streams.remove(index % self.streams.len());
        }
        settle(&mut self.em);
    }

    fn host_read(&mut self) {
        let mut buf = [0u8; 16 << 10];
        for stream in &mut self.streams {
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        settle(&mut self.em);
    }

    fn stream(&mut self, index: usize) -> Option<&mut UnixStream> {
        let len = self.streams.len();
        (len > 0).then(|| &mut self.streams[index % len])
    }

    fn accept(&mut self) {
        let Some(listener) = &self.listener else {
            return;
        };
        while self.streams.len() < MAX_HOST_STREAMS {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(true).expect("non-blocking stream");
                    self.streams.push(stream);
                }
                Err(_) => break,
            }
        }
    }

    fn advance(&mut self, steps: u8) {
        self.clock += Duration::from_millis(100) * u32::from(steps);
        self.dev
            .lock()
            .expect("device lock")
            .expire_connections(Instant::now() + self.clock);
        // An event through the loop lets the device update its watch list.
        self.notify(EVQ_INDEX);
    }

    fn take_used(&mut self) {
        for queue in &mut self.queues {
            queue.pop_used();
        }
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    ignore_sigpipe();
    let mut input = Input::new(data);
    let config = input.u8();
    let dir = tempfile::tempdir().expect("temporary directory");
    let uds = dir.path().join("v.sock");
    let listener = (config & 1 == 0).then(|| {
        let listener = UnixListener::bind(port_path(&uds, HOST_PORT)).expect("host listener");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        listener
    });
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
        .expect("guest memory");
    let dev = Arc::new(Mutex::new(
        Vsock::new(GUEST_CID, &uds).expect("create the vsock device"),
    ));
    let mut em = EventManager::new().expect("event manager");
    em.add_subscriber(dev.clone());
    let queues: Vec<Driver<'_>> = LAYOUTS.iter().map(|l| Driver::new(&mem, *l)).collect();
    let kicks: Vec<EventFd> = (0..3)
        .map(|_| EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))
        .collect();
    let ctx = ActivateContext {
        mem: mem.clone(),
        queues: queues.iter().map(Driver::device_queue).collect(),
        queue_evts: kicks.iter().map(|k| k.try_clone().expect("dup")).collect(),
        interrupt: Arc::new(IrqTrigger::new(
            EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        )),
    };
    dev.lock()
        .expect("device lock")
        .activate(ctx)
        .expect("activation");
    let mut rig = Rig {
        dev,
        em,
        kicks,
        queues,
        uds,
        listener,
        streams: Vec::new(),
        clock: Duration::ZERO,
    };
    settle(&mut rig.em);

    while !input.is_empty() {
        step(&mut rig, &mut input);
        rig.accept();
        rig.take_used();
    }

    let connections = rig.dev.lock().expect("device lock").connection_count();
    assert!(
        connections <= MAX_CONNECTIONS,
        "{connections} connections, more than the limit"
    );
}

fn step(rig: &mut Rig<'_>, input: &mut Input<'_>) {
    match input.u8() % 10 {
        0 => rig.push(TXQ_INDEX, &read_chain(input)),
        1 => rig.push(RXQ_INDEX, &read_chain(input)),
        2 => {
            for _ in 0..input.u8() % 17 {
                rig.queues[RXQ_INDEX]
                    .push(&[Part::Write(HEADER_SIZE as u32), Part::Write(RX_DATA)]);
            }
            rig.notify(RXQ_INDEX);
        }
        3 => {
            let line = format!("CONNECT {}\n", input.u32());
            rig.connect(line.as_bytes());
        }
        4 => {
            let len = usize::from(input.u8());
            let line = input.bytes(len).to_vec();
            rig.connect(&line);
        }
        5 => {
            let index = usize::from(input.u8());
            let len = usize::from(input.u16() % 8193);
            let fill = input.u8();
            rig.host_write(index, &vec![fill; len]);
        }
        6 => rig.host_close(input.u8()),
        7 => rig.host_read(),
        8 => rig.advance(input.u8()),
        _ => rig.push(EVQ_INDEX, &read_chain(input)),
    }
}

//! Device tests without KVM: guest memory with a driver-side request queue ([`driver`]), a real
//! `EventManager` running the device's event handler, and disk images in temporary files.
//!
//! The event loop is driven with zero-timeout polls until no fd is ready ([`Harness::settle`]),
//! so every step is deterministic.

use crate::devices::virtio::test_driver as driver;

mod cow;
mod device_api;
mod hostile;
mod io_path;
mod read_only;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use event_manager::{EventManager, SubscriberOps};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use self::driver::{Part, TestQueue, Used};
use super::request::RequestHeader;
use super::{Block, BlockConfig, QUEUE_SIZE};
use crate::devices::virtio::{ActivateContext, IrqTrigger, VirtioDevice};

/// Guest memory size (64 MiB).
const MEM_SIZE: u64 = 0x400_0000;
/// Where the test queue's rings start.
const RING_BASE: u64 = 0x1000;
/// Where the test queue's descriptor buffers start (256 × 68 KiB up to 0x120_0000).
const BUFS_BASE: u64 = 0x10_0000;
/// Guest memory no descriptor buffer uses, for raw descriptors: 32 MiB up to [`MEM_SIZE`].
pub const SCRATCH: u64 = 0x200_0000;

/// A temporary directory holding `image.raw` with `contents`.
pub fn image_file(contents: &[u8]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("image.raw");
    std::fs::write(&path, contents).unwrap();
    (dir, path)
}

/// A writable disk configuration for `path` without ID.
pub fn config(path: &Path) -> BlockConfig {
    BlockConfig {
        path: path.to_owned(),
        read_only: false,
        id: None,
        backing: None,
    }
}

/// The wire form of a request header.
pub fn header(request_type: u32, sector: u64) -> [u8; RequestHeader::SIZE] {
    RequestHeader {
        request_type,
        reserved: 0,
        sector,
    }
    .to_bytes()
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

/// An activated device, its event loop and the guest's side of its request queue.
pub struct Harness {
    _dir: tempfile::TempDir,
    /// The image file.
    pub path: PathBuf,
    pub dev: Arc<Mutex<Block>>,
    em: EventManager<Arc<Mutex<Block>>>,
    pub mem: GuestMemoryMmap,
    pub q: TestQueue,
    kick: EventFd,
    pub interrupt: Arc<IrqTrigger>,
}

impl Harness {
    /// A writable disk holding `image`.
    pub fn new(image: &[u8]) -> Self {
        let (dir, path) = image_file(image);
        Harness::with_config(dir, config(&path))
    }

    /// A read-only disk holding `image`.
    pub fn read_only(image: &[u8]) -> Self {
        let (dir, path) = image_file(image);
        let config = BlockConfig {
            read_only: true,
            ..config(&path)
        };
        Harness::with_config(dir, config)
    }

    /// A device created from `config` (whose image lives in `dir`), activated.
    pub fn with_config(dir: tempfile::TempDir, config: BlockConfig) -> Self {
        let path = config.path.clone();
        let dev = Arc::new(Mutex::new(Block::new(config).unwrap()));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        let q = TestQueue::new(&mem, RING_BASE, BUFS_BASE, QUEUE_SIZE);
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        let mut h = Harness {
            _dir: dir,
            path,
            dev,
            em,
            mem,
            q,
            kick,
            interrupt,
        };
        h.activate();
        h
    }

    /// Hands the current queue to the device, as the transport does at DRIVER_OK.
    pub fn activate(&mut self) {
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            queues: vec![self.q.device_queue(QUEUE_SIZE)],
            queue_evts: vec![self.kick.try_clone().unwrap()],
            interrupt: self.interrupt.clone(),
        };
        self.dev().activate(ctx).unwrap();
        self.settle();
    }

    /// The device, locked.
    pub fn dev(&self) -> MutexGuard<'_, Block> {
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

    /// Notifies the request queue (QueueNotify) and runs the loop.
    pub fn kick(&mut self) {
        self.kick.write(1).unwrap();
        self.settle();
    }

    /// Publishes one chain, notifies, and takes it back from the used ring.
    pub fn submit(&mut self, parts: &[Part<'_>]) -> Used {
        self.q.push(parts);
        self.kick();
        self.pop_used()
    }

    /// Publishes one chain of raw descriptors, notifies, and takes it back.
    pub fn submit_raw(&mut self, descs: &[(u64, u32, u16)]) -> Used {
        self.q.push_raw(descs);
        self.kick();
        self.pop_used()
    }

    /// The next chain on the used ring; there must be one.
    pub fn pop_used(&mut self) -> Used {
        self.q.pop_used().expect("the device returned no chain")
    }

    /// The status byte of a returned chain: the last byte of its last descriptor.
    pub fn status(&self, used: &Used) -> u8 {
        let (addr, len) = *used.descs.last().unwrap();
        self.q.read(addr + u64::from(len) - 1, 1)[0]
    }

    /// Reads `sectors` sectors at `sector` with one data descriptor; returns the status and the
    /// data buffer's contents.
    pub fn read_sectors(&mut self, sector: u64, sectors: u32) -> (u8, Vec<u8>) {
        let hdr = header(super::VIRTIO_BLK_T_IN, sector);
        let len = sectors * 512;
        let used = self.submit(&[Part::Read(&hdr), Part::Write(len), Part::Write(1)]);
        let data = self.q.read(used.descs[1].0, len as usize);
        (self.status(&used), data)
    }

    /// Writes `data` at `sector` with one data descriptor; returns the status.
    pub fn write_sectors(&mut self, sector: u64, data: &[u8]) -> u8 {
        let hdr = header(super::VIRTIO_BLK_T_OUT, sector);
        let used = self.submit(&[Part::Read(&hdr), Part::Read(data), Part::Write(1)]);
        self.status(&used)
    }

    /// The image file's contents.
    pub fn image(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }

    /// How many interrupts the device raised since the last call.
    pub fn interrupts(&self) -> u64 {
        self.interrupt.eventfd().read().unwrap_or(0)
    }
}

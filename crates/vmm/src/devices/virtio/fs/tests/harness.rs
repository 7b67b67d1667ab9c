//! An activated [`Fs`] device with its event loop and the guest's side of both queues, plus
//! builders for raw FUSE messages and decoders for the replies.
//!
//! The event loop is driven with zero-timeout polls until no fd is ready ([`Harness::settle`]),
//! so every step is deterministic.

use std::mem::size_of;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use event_manager::{EventManager, SubscriberOps};
use fuse_backend_rs::abi::fuse_abi::{
    AttrOut, CreateIn, EntryOut, InHeader, InitIn, Opcode, OpenIn, OpenOut, OutHeader, ReadIn,
    WriteIn, WriteOut,
};
use vm_memory::{ByteValued, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::driver::{Part, TestQueue, Used};
use super::{populate, test_owner};
use crate::devices::virtio::fs::{Fs, FsConfig, QUEUE_SIZE, REQUEST_QUEUE};
use crate::devices::virtio::{ActivateContext, IrqTrigger, VirtioDevice};

/// Guest memory size (64 MiB).
pub const MEM_SIZE: u64 = 0x400_0000;
/// Where the hiprio queue's rings start.
const HIPRIO_RINGS: u64 = 0x1000;
/// Where the request queue's rings start.
const REQUEST_RINGS: u64 = 0x4000;
/// Descriptor buffers of the hiprio queue (256 × 68 KiB up to 0x120_0000).
const HIPRIO_BUFS: u64 = 0x10_0000;
/// Descriptor buffers of the request queue (up to 0x250_0000).
const REQUEST_BUFS: u64 = 0x140_0000;
/// Guest memory no descriptor buffer uses, for raw descriptors: 16 MiB up to [`MEM_SIZE`].
pub const SCRATCH: u64 = 0x300_0000;

/// The mount tag of test devices.
pub const TAG: &str = "hostshare";

/// A reply the device put in the used ring.
#[derive(Debug)]
pub struct Reply {
    /// The used length.
    pub len: u32,
    /// The reply header (zeroes if the device wrote none).
    pub header: OutHeader,
    /// The bytes after the header, up to the used length.
    pub body: Vec<u8>,
}

impl Reply {
    /// The reply's body decoded as `T`.
    pub fn decode<T: ByteValued + Default>(&self) -> T {
        decode(&self.body)
    }
}

/// `T` from the start of `bytes` (unaligned).
pub fn decode<T: ByteValued + Default>(bytes: &[u8]) -> T {
    let mut value = T::default();
    value
        .as_mut_slice()
        .copy_from_slice(&bytes[..size_of::<T>()]);
    value
}

/// An activated device sharing a temporary directory, its event loop and the guest's queues.
pub struct Harness {
    dir: tempfile::TempDir,
    pub dev: Arc<Mutex<Fs>>,
    em: EventManager<Arc<Mutex<Fs>>>,
    pub mem: GuestMemoryMmap,
    /// hiprio, then the request queue.
    pub queues: [TestQueue; 2],
    kicks: [EventFd; 2],
    pub interrupt: Arc<IrqTrigger>,
    next_unique: u64,
}

impl Harness {
    /// A device sharing the standard fixtures, read-only or not, after FUSE_INIT.
    pub fn new(read_only: bool) -> Harness {
        let mut h = Harness::uninitialised(read_only);
        let reply = h.call(Opcode::Init, 0, init_in().as_slice(), 256);
        assert_eq!(reply.header.error, 0, "FUSE_INIT failed");
        h
    }

    /// A device sharing the standard fixtures, activated but without FUSE_INIT.
    pub fn uninitialised(read_only: bool) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("share");
        std::fs::create_dir(&root).unwrap();
        super::give_to_owner(&root);
        populate(&root);
        let config = FsConfig {
            tag: TAG.into(),
            shared_dir: root,
            read_only,
            owner: Some(test_owner()),
        };
        let dev = Arc::new(Mutex::new(Fs::new(config).unwrap()));
        let mut em = EventManager::new().unwrap();
        em.add_subscriber(dev.clone());
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        let queues = fresh_queues(&mem);
        let kicks = [0, 1].map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let interrupt = Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
        let mut h = Harness {
            dir,
            dev,
            em,
            mem,
            queues,
            kicks,
            interrupt,
            next_unique: 1,
        };
        h.activate();
        h
    }

    /// Sets up new, empty queues on the guest side (as a driver does after a reset).
    pub fn replace_queues(&mut self) {
        self.queues = fresh_queues(&self.mem);
    }

    /// Hands the current queues to the device, as the transport does at DRIVER_OK.
    pub fn activate(&mut self) {
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            queues: self
                .queues
                .iter()
                .map(|q| q.device_queue(QUEUE_SIZE))
                .collect(),
            queue_evts: self.kicks.iter().map(|k| k.try_clone().unwrap()).collect(),
            interrupt: self.interrupt.clone(),
        };
        self.dev().activate(ctx).unwrap();
        self.settle();
    }

    /// The device, locked.
    pub fn dev(&self) -> MutexGuard<'_, Fs> {
        self.dev.lock().unwrap()
    }

    /// The host path of `rel` in the shared directory.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join("share").join(rel)
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

    /// Notifies queue `index` (QueueNotify) and runs the loop.
    pub fn kick(&mut self, index: usize) {
        self.kicks[index].write(1).unwrap();
        self.settle();
    }

    /// Publishes a chain on the request queue, notifies, and takes it back from the used ring.
    pub fn submit(&mut self, parts: &[Part<'_>]) -> Used {
        self.queues[REQUEST_QUEUE].push(parts);
        self.kick(REQUEST_QUEUE);
        self.pop_used(REQUEST_QUEUE)
    }

    /// Publishes a chain of raw descriptors on the request queue, notifies, and takes it back.
    pub fn submit_raw(&mut self, descs: &[(u64, u32, u16)]) -> Used {
        self.queues[REQUEST_QUEUE].push_raw(descs);
        self.kick(REQUEST_QUEUE);
        self.pop_used(REQUEST_QUEUE)
    }

    /// The next chain on queue `index`'s used ring; there must be one.
    pub fn pop_used(&mut self, index: usize) -> Used {
        self.queues[index]
            .pop_used()
            .expect("the device returned no chain")
    }

    /// Sends `opcode` for `nodeid` with `args` on the request queue, with a `reply_room`-byte
    /// reply buffer; returns the reply.
    pub fn call(&mut self, opcode: Opcode, nodeid: u64, args: &[u8], reply_room: u32) -> Reply {
        let message = self.message(opcode, nodeid, args);
        let used = self.submit(&[Part::Read(&message), Part::Write(reply_room)]);
        self.reply(&used)
    }

    /// A FUSE request: a header with the next `unique`, then `args`.
    pub fn message(&mut self, opcode: Opcode, nodeid: u64, args: &[u8]) -> Vec<u8> {
        let unique = self.next_unique;
        self.next_unique += 1;
        message(opcode, unique, nodeid, args)
    }

    /// The `unique` of the last request built.
    pub fn last_unique(&self) -> u64 {
        self.next_unique - 1
    }

    /// Decodes the reply in a used chain whose last descriptor is the reply buffer.
    pub fn reply(&self, used: &Used) -> Reply {
        let (addr, _) = *used.descs.last().unwrap();
        let bytes = self.queues[REQUEST_QUEUE].read(addr, used.len as usize);
        let header = if bytes.len() >= size_of::<OutHeader>() {
            decode(&bytes)
        } else {
            OutHeader::default()
        };
        Reply {
            len: used.len,
            header,
            body: bytes
                .get(size_of::<OutHeader>()..)
                .unwrap_or_default()
                .to_vec(),
        }
    }

    /// LOOKUP of `name` (without NUL) in `parent`: the node ID.
    pub fn lookup(&mut self, parent: u64, name: &str) -> Reply {
        self.call(Opcode::Lookup, parent, &name_arg(name), 4096)
    }

    /// OPEN of `nodeid` with `flags`: the file handle, or the error.
    pub fn open(&mut self, nodeid: u64, flags: i32) -> Result<u64, i32> {
        let args = OpenIn {
            flags: flags as u32,
            fuse_flags: 0,
        };
        let reply = self.call(Opcode::Open, nodeid, args.as_slice(), 256);
        match reply.header.error {
            0 => Ok(reply.decode::<OpenOut>().fh),
            e => Err(e),
        }
    }

    /// How many interrupts the device raised since the last call.
    pub fn interrupts(&self) -> u64 {
        self.interrupt.eventfd().read().unwrap_or(0)
    }
}

/// Empty hiprio and request queues.
fn fresh_queues(mem: &GuestMemoryMmap) -> [TestQueue; 2] {
    [
        TestQueue::new(mem, HIPRIO_RINGS, HIPRIO_BUFS, QUEUE_SIZE),
        TestQueue::new(mem, REQUEST_RINGS, REQUEST_BUFS, QUEUE_SIZE),
    ]
}

/// A FUSE request message.
pub fn message(opcode: Opcode, unique: u64, nodeid: u64, args: &[u8]) -> Vec<u8> {
    let header = InHeader {
        len: (size_of::<InHeader>() + args.len()) as u32,
        opcode: opcode as u32,
        unique,
        nodeid,
        uid: 0,
        gid: 0,
        pid: 1,
        padding: 0,
    };
    [header.as_slice(), args].concat()
}

/// FUSE_INIT arguments of a 7.33 client.
pub fn init_in() -> InitIn {
    InitIn {
        major: 7,
        minor: 33,
        max_readahead: 128 << 10,
        flags: 0,
    }
}

/// A name argument: the bytes and a NUL.
pub fn name_arg(name: &str) -> Vec<u8> {
    [name.as_bytes(), b"\0"].concat()
}

/// READ arguments.
pub fn read_in(fh: u64, offset: u64, size: u32) -> ReadIn {
    ReadIn {
        fh,
        offset,
        size,
        ..ReadIn::default()
    }
}

/// WRITE arguments followed by the data.
pub fn write_args(fh: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    let args = WriteIn {
        fh,
        offset,
        size: data.len() as u32,
        ..WriteIn::default()
    };
    [args.as_slice(), data].concat()
}

/// CREATE arguments (read-write, mode 0644) followed by the name.
pub fn create_args(name: &str) -> Vec<u8> {
    let args = CreateIn {
        flags: libc::O_RDWR as u32,
        mode: libc::S_IFREG | 0o644,
        umask: 0,
        fuse_flags: 0,
    };
    [args.as_slice(), &name_arg(name)].concat()
}

/// Sizes of the fixed reply bodies the tests decode.
pub const ENTRY_OUT_SIZE: usize = size_of::<EntryOut>();
/// See [`ENTRY_OUT_SIZE`].
pub const ATTR_OUT_SIZE: usize = size_of::<AttrOut>();
/// See [`ENTRY_OUT_SIZE`].
pub const WRITE_OUT_SIZE: usize = size_of::<WriteOut>();

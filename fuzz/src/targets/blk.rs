//! `virtio_blk`: request chains on the virtio-blk request queue, parsed, validated and executed
//! on a small disk image.
//!
//! The device is bulkhead's [`Block`], activated with one queue laid out by the mock driver and
//! run by a real `EventManager`, serving an image in a memfd (an anonymous tmpfs file, opened by
//! the device through `/proc/self/fd/N` like any image path).
//!
//! # Input
//! - byte 0: bit 0 = read-only disk; bits 1–6 = disk size in sectors − 1 (1–64 sectors of 512
//!   bytes, filled with a known pattern);
//! - then operations, each an op byte (`% 6`) and its fields:
//!   - 0 *submit*: a chain ([`crate::queue`]); publish it, notify, run the loop;
//!   - 1 *queue*: a chain; publish it without notifying;
//!   - 2 *notify*: notify the queue and run the loop;
//!   - 3 *poke*: `u16` offset, `u8` length, the bytes: written to the scratch area at
//!     [`SCRATCH`] + offset (room for indirect tables and headers that raw descriptors point at);
//!   - 4 *avail*: `u16` written to the avail ring's index (a lying driver);
//!   - 5 *reset*: the driver resets the device and sets it up again with empty rings.
//!
//! At the end the driver notifies once more and runs the loop.
//!
//! # Checks
//! Unless the input wrote raw descriptors or ring fields ([`Driver::is_tainted`]): every chain
//! comes back, with a used length no larger than its device-writable bytes. Always: the image
//! keeps its size, and a read-only image keeps its contents.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use bulkhead_vmm::devices::virtio::block::{Block, BlockConfig};
use bulkhead_vmm::devices::virtio::{ActivateContext, IrqTrigger, VirtioDevice};
use event_manager::{EventManager, SubscriberOps};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::input::Input;
use crate::queue::{read_chain, Driver, Layout};
use crate::settle;

/// Guest memory size (4 MiB).
pub const MEM_SIZE: u64 = 0x40_0000;
/// Entries in the request queue.
pub const QUEUE_SIZE: u16 = 32;
/// Where the request queue's rings are.
pub const RINGS: u64 = 0x1000;
/// Buffer area of the queue's chains.
pub const BUFS: (u64, u64) = (0x1_0000, 0x30_0000);
/// Scratch area written by *poke* (up to [`MEM_SIZE`]).
pub const SCRATCH: u64 = 0x30_0000;

/// The queue layout of this target.
pub const LAYOUT: Layout = Layout {
    size: QUEUE_SIZE,
    rings: RINGS,
    bufs: BUFS.0,
    bufs_end: BUFS.1,
};

/// A disk image in a memfd, reachable by path as `/proc/self/fd/N`.
#[derive(Debug)]
pub struct MemImage {
    file: File,
    /// The path the device opens.
    pub path: PathBuf,
}

impl MemImage {
    /// An image holding `contents`.
    ///
    /// # Panics
    /// When the memfd cannot be created or written.
    pub fn new(contents: &[u8]) -> MemImage {
        // SAFETY: the name is a NUL-terminated string that outlives the call; MFD_CLOEXEC is a
        // valid flag.
        let fd = unsafe { libc::memfd_create(c"bulkhead-fuzz-disk".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just created and is owned by nothing else.
        let mut file = unsafe { File::from_raw_fd(fd) };
        file.write_all(contents).expect("write the disk image");
        let path = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        MemImage { file, path }
    }

    /// An empty sparse image of `len` bytes (a copy-on-write disk's overlay).
    ///
    /// # Panics
    /// When the memfd cannot be created or sized.
    pub fn sparse(len: u64) -> MemImage {
        let image = MemImage::new(&[]);
        image.file.set_len(len).expect("size the overlay");
        image
    }

    /// The image's current contents.
    pub fn contents(&self) -> Vec<u8> {
        let len = self.file.metadata().expect("image metadata").len();
        let mut buf = vec![0u8; len as usize];
        self.file
            .read_exact_at(&mut buf, 0)
            .expect("read the image");
        buf
    }
}

/// A recognisable disk pattern: each byte is its offset's low byte xor the sector number.
pub fn disk_pattern(sectors: u64) -> Vec<u8> {
    (0..sectors * 512)
        .map(|i| (i as u8) ^ ((i >> 9) as u8))
        .collect()
}

/// The device, its event loop and its interrupt.
struct Rig {
    dev: Arc<Mutex<Block>>,
    em: EventManager<Arc<Mutex<Block>>>,
    kick: EventFd,
    interrupt: Arc<IrqTrigger>,
}

impl Rig {
    fn activate(&mut self, mem: &GuestMemoryMmap, driver: &Driver<'_>) {
        let ctx = ActivateContext {
            mem: mem.clone(),
            queues: vec![driver.device_queue()],
            queue_evts: vec![self.kick.try_clone().expect("dup eventfd")],
            interrupt: self.interrupt.clone(),
        };
        self.dev
            .lock()
            .expect("device lock")
            .activate(ctx)
            .expect("activation");
        settle(&mut self.em);
    }

    fn notify(&mut self) {
        self.kick.write(1).expect("kick");
        settle(&mut self.em);
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let config = input.u8();
    let read_only = config & 1 != 0;
    let sectors = 1 + u64::from((config >> 1) & 0x3f);
    // A writable disk with bit 7 set is copy-on-write: an empty overlay over the pattern.
    let cow = !read_only && config & 0x80 != 0;
    let original = disk_pattern(sectors);
    let backing = cow.then(|| MemImage::new(&original));
    let image = match cow {
        true => MemImage::sparse(original.len() as u64),
        false => MemImage::new(&original),
    };
    let block = Block::new(BlockConfig {
        path: image.path.clone(),
        read_only,
        id: Some("fuzz-disk".into()),
        backing: backing.as_ref().map(|b| b.path.clone()),
    })
    .expect("create the block device");

    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
        .expect("guest memory");
    let dev = Arc::new(Mutex::new(block));
    let mut em = EventManager::new().expect("event manager");
    em.add_subscriber(dev.clone());
    let mut rig = Rig {
        dev,
        em,
        kick: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        interrupt: Arc::new(IrqTrigger::new(
            EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        )),
    };
    let mut driver = Driver::new(&mem, LAYOUT);
    rig.activate(&mem, &driver);

    while !input.is_empty() {
        match input.u8() % 6 {
            0 => {
                driver.push(&read_chain(&mut input));
                rig.notify();
            }
            1 => {
                driver.push(&read_chain(&mut input));
            }
            2 => rig.notify(),
            3 => poke(&mem, &mut input),
            4 => driver.set_avail_idx(input.u16()),
            _ => {
                rig.dev.lock().expect("device lock").reset();
                driver = Driver::new(&mem, LAYOUT);
                rig.activate(&mem, &driver);
            }
        }
        driver.pop_used();
    }
    rig.notify();
    driver.pop_used();

    assert!(
        driver.all_returned(),
        "virtio-blk left {} chains unreturned",
        driver.pending()
    );
    let now = image.contents();
    assert_eq!(now.len(), original.len(), "the disk image changed size");
    if read_only {
        assert!(now == original, "a read-only disk image was modified");
    }
    if let Some(backing) = &backing {
        assert!(
            backing.contents() == original,
            "a copy-on-write disk's backing image was modified"
        );
    }
}

/// *poke*: `u16` offset, `u8` length and the bytes, written at [`SCRATCH`] + offset.
pub fn poke(mem: &GuestMemoryMmap, input: &mut Input<'_>) {
    let offset = u64::from(input.u16());
    let len = usize::from(input.u8());
    let bytes = input.bytes(len);
    mem.write_slice(bytes, GuestAddress(SCRATCH + offset))
        .expect("scratch area inside guest memory");
}

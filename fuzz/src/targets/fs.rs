//! `virtio_fs`: FUSE requests on the virtio-fs queues, served by the device's FUSE server and
//! passthrough file system from a temporary share.
//!
//! The device is bulkhead's [`Fs`], activated with its hiprio and request queues laid out by the
//! mock driver and run by a real `EventManager`. Each input gets a fresh directory holding the
//! share (`file`, `dir/inner`, a FIFO `fifo`, and a symbolic link `escape` → `../outside`) and,
//! next to it, `outside/secret`, which the guest must not touch at all: inotify watches
//! `outside/` and `secret` for every event (open, read, write, attribute change, creation,
//! deletion, move). As root the share is served as `nobody`, who also owns `outside/`, so only
//! the device's containment keeps the guest out of it, not file permissions.
//!
//! The directories live on a private 64 MiB tmpfs when the process may create one (root: a
//! mount namespace of its own, invisible to the rest of the machine), so a guest that writes or
//! allocates without bound fills that tmpfs and never the host's disk. Otherwise they live in
//! the temporary directory with `RLIMIT_FSIZE` at 64 MiB ([`scratch_root`]).
//!
//! # Input
//! - byte 0: bit 0 = read-only share;
//! - then operations, each an op byte (`% 5`) and its fields:
//!   - 0 *request*: a FUSE request ([`Request`]): published, notified, served;
//!   - 1 *chain*: `u8` queue (bit 0: request queue, else hiprio), a chain ([`crate::queue`]),
//!     then notify;
//!   - 2 *poke*: `u16` offset, `u8` length, the bytes: written at [`SCRATCH`] + offset;
//!   - 3 *avail*: `u8` queue, `u16` written to its avail index;
//!   - 4 *reset*: the driver resets the device and sets it up again with empty rings.
//!
//! # Checks
//! Unless the input wrote raw descriptors or ring fields: every chain comes back, with a used
//! length within its device-writable bytes. Always: no inotify event on `outside/` or its
//! `secret`, and `outside/` still holds exactly `secret` with its contents.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use bulkhead_vmm::devices::virtio::fs::identity::Identity;
use bulkhead_vmm::devices::virtio::fs::{Fs, FsConfig, HIPRIO_QUEUE, REQUEST_QUEUE};
use bulkhead_vmm::devices::virtio::{ActivateContext, IrqTrigger, VirtioDevice};
use event_manager::{EventManager, SubscriberOps};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use crate::input::{Encoder, Input};
use crate::queue::{read_chain, Driver, Layout, Part};
use crate::settle;

/// Guest memory size (2 MiB).
pub const MEM_SIZE: u64 = 0x20_0000;
/// Entries per queue.
pub const QUEUE_SIZE: u16 = 32;
/// Scratch area written by *poke* (up to [`MEM_SIZE`]).
pub const SCRATCH: u64 = 0x18_0000;
/// Contents of `outside/secret`.
pub const SECRET: &[u8] = b"bulkhead-fuzz: outside the share";
/// Contents of the share's `file`.
pub const FILE_CONTENTS: &[u8] = b"hello from the host\n";
/// `nobody:nogroup`, the share's owner when the harness runs as root.
pub const NOBODY: (u32, u32) = (65534, 65534);
/// Size limit of the scratch tmpfs and of any file the harness's process writes (64 MiB).
pub const SCRATCH_BYTES: u64 = 64 << 20;

/// Queue layouts: hiprio, request.
pub const LAYOUTS: [Layout; 2] = [
    Layout {
        size: QUEUE_SIZE,
        rings: 0x1000,
        bufs: 0x1_0000,
        bufs_end: 0x4_0000,
    },
    Layout {
        size: QUEUE_SIZE,
        rings: 0x2000,
        bufs: 0x4_0000,
        bufs_end: SCRATCH,
    },
];

/// FUSE_INIT, the first request of every session.
pub const FUSE_INIT: u32 = 26;

/// One FUSE request as the input describes it.
///
/// Wire form: `u8` opcode (255: a `u32` opcode follows), `u8` node ID (255: a `u64` follows),
/// `u8` flags, then per flag: bit 0 a `u32` header `len` (otherwise the true length), bit 3 a
/// `u32` uid and `u32` gid (otherwise 0, 0); then `u16` argument length (`% 4097`) and the
/// arguments, and `u16` reply room (0: no device-writable buffer). Flag bit 1 puts the header and
/// the arguments in separate descriptors; bit 2 sends the request on the hiprio queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// FUSE opcode.
    pub opcode: u32,
    /// Node ID the request is about (1 = the share's root).
    pub nodeid: u64,
    /// Header `len` if not the true length.
    pub len: Option<u32>,
    /// Header and arguments in separate descriptors.
    pub split: bool,
    /// On the hiprio queue.
    pub hiprio: bool,
    /// Caller uid and gid if not 0, 0.
    pub ids: Option<(u32, u32)>,
    /// The opcode's arguments.
    pub args: Vec<u8>,
    /// Bytes of reply buffer.
    pub reply_room: u16,
}

impl Request {
    /// A request for `opcode` on `nodeid` with `args` and 4 KiB of reply room.
    pub fn new(opcode: u32, nodeid: u64, args: &[u8]) -> Request {
        Request {
            opcode,
            nodeid,
            args: args.to_vec(),
            reply_room: 4096,
            ..Request::default()
        }
    }

    /// Reads one request.
    pub fn read(input: &mut Input<'_>) -> Request {
        let opcode = match input.u8() {
            255 => input.u32(),
            op => u32::from(op),
        };
        let nodeid = match input.u8() {
            255 => input.u64(),
            node => u64::from(node),
        };
        let flags = input.u8();
        let len = (flags & 1 != 0).then(|| input.u32());
        let ids = (flags & 8 != 0).then(|| (input.u32(), input.u32()));
        let args_len = input.u16() % 4097;
        let args = input.bytes(usize::from(args_len)).to_vec();
        Request {
            opcode,
            nodeid,
            len,
            split: flags & 2 != 0,
            hiprio: flags & 4 != 0,
            ids,
            args,
            reply_room: input.u16(),
        }
    }

    /// Appends the request in the format [`Request::read`] reads.
    pub fn encode(&self, enc: &mut Encoder) {
        match u8::try_from(self.opcode) {
            Ok(op) if op != 255 => enc.u8(op),
            _ => enc.u8(255).u32(self.opcode),
        };
        match u8::try_from(self.nodeid) {
            Ok(node) if node != 255 => enc.u8(node),
            _ => enc.u8(255).u64(self.nodeid),
        };
        let flags = u8::from(self.len.is_some())
            | u8::from(self.split) << 1
            | u8::from(self.hiprio) << 2
            | u8::from(self.ids.is_some()) << 3;
        enc.u8(flags);
        if let Some(len) = self.len {
            enc.u32(len);
        }
        if let Some((uid, gid)) = self.ids {
            enc.u32(uid).u32(gid);
        }
        enc.u16(self.args.len() as u16).bytes(&self.args);
        enc.u16(self.reply_room);
    }

    /// The descriptor chain carrying this request with `unique`.
    fn parts(&self, unique: u64) -> Vec<Part> {
        let true_len = 40 + self.args.len() as u32;
        let (uid, gid) = self.ids.unwrap_or((0, 0));
        let mut header = Vec::with_capacity(40);
        header.extend_from_slice(&self.len.unwrap_or(true_len).to_le_bytes());
        header.extend_from_slice(&self.opcode.to_le_bytes());
        header.extend_from_slice(&unique.to_le_bytes());
        header.extend_from_slice(&self.nodeid.to_le_bytes());
        for field in [uid, gid, 1, 0] {
            header.extend_from_slice(&field.to_le_bytes());
        }
        let mut parts = if self.split {
            vec![Part::Bytes(header), Part::Bytes(self.args.clone())]
        } else {
            vec![Part::Bytes([header, self.args.clone()].concat())]
        };
        if self.reply_room > 0 {
            parts.push(Part::Write(u32::from(self.reply_room)));
        }
        parts
    }
}

/// The directory each input's share is created in: a private tmpfs of [`SCRATCH_BYTES`] when
/// the process can mount one in a mount namespace of its own, else the temporary directory
/// with the process's file size limit set to [`SCRATCH_BYTES`].
pub fn scratch_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = std::env::temp_dir().join("bulkhead-fuzz-fs");
        fs::create_dir_all(&root).expect("scratch directory");
        if !mount_private_tmpfs(&root) {
            limit_file_size();
        }
        root
    })
}

fn mount_private_tmpfs(root: &Path) -> bool {
    let target = CString::new(root.as_os_str().as_bytes()).expect("path without NUL");
    let options = CString::new(format!("size={SCRATCH_BYTES},mode=0755")).expect("options");
    // SAFETY: unshare(2) with CLONE_NEWNS only changes this thread's mount namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return false;
    }
    // SAFETY: every pointer is a NUL-terminated string (or null where mount(2) allows it) that
    // outlives the call. The first call keeps mounts made here out of the parent namespace.
    unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) == 0
            && libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                options.as_ptr().cast(),
            ) == 0
    }
}

fn limit_file_size() {
    let limit = libc::rlimit {
        rlim_cur: SCRATCH_BYTES,
        rlim_max: SCRATCH_BYTES,
    };
    // SAFETY: `limit` is a valid rlimit that outlives the call; ignoring SIGXFSZ makes writes
    // past the limit fail with EFBIG instead of killing the process.
    unsafe {
        libc::setrlimit(libc::RLIMIT_FSIZE, &limit);
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
}

/// The uid:gid the share is served as: `nobody` as root, else the process itself.
pub fn share_owner() -> (u32, u32) {
    if Identity::process().0 == 0 {
        NOBODY
    } else {
        Identity::process()
    }
}

/// Creates the share and `outside/` in `base`; returns the share's path.
fn populate(base: &Path, owner: (u32, u32)) -> PathBuf {
    let chown = |p: &Path| {
        if Identity::process().0 == 0 {
            std::os::unix::fs::lchown(p, Some(owner.0), Some(owner.1)).expect("chown fixture");
        }
    };
    fs::set_permissions(base, fs::Permissions::from_mode(0o755)).expect("chmod base");
    let share = base.join("share");
    let outside = base.join("outside");
    fs::create_dir(&share).expect("share");
    fs::create_dir(share.join("dir")).expect("dir");
    fs::write(share.join("file"), FILE_CONTENTS).expect("file");
    fs::write(share.join("dir/inner"), b"inner\n").expect("inner");
    let fifo = CString::new(share.join("fifo").as_os_str().as_bytes()).expect("path");
    // SAFETY: `fifo` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0, "mkfifo");
    std::os::unix::fs::symlink("../outside", share.join("escape")).expect("symlink");
    fs::create_dir(&outside).expect("outside");
    fs::write(outside.join("secret"), SECRET).expect("secret");
    fs::set_permissions(outside.join("secret"), fs::Permissions::from_mode(0o600))
        .expect("chmod secret");
    for p in [
        "share",
        "share/dir",
        "share/file",
        "share/dir/inner",
        "share/fifo",
    ] {
        chown(&base.join(p));
    }
    for p in ["share/escape", "outside", "outside/secret"] {
        chown(&base.join(p));
    }
    share
}

/// Panics unless `base` holds exactly `share` and `outside`, and `outside` exactly `secret` with
/// its contents.
fn check_outside_untouched(base: &Path) {
    let names = |dir: &Path| {
        let mut names: Vec<String> = fs::read_dir(dir)
            .expect("list directory")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        names(base),
        ["outside", "share"],
        "the guest changed the share's parent"
    );
    assert_eq!(
        names(&base.join("outside")),
        ["secret"],
        "the guest changed outside/"
    );
    let secret = fs::read(base.join("outside/secret")).expect("read secret");
    assert!(secret == SECRET, "the guest changed outside/secret");
}

/// The device, its event loop, the guest's queues.
struct Rig<'m> {
    dev: Arc<Mutex<Fs>>,
    em: EventManager<Arc<Mutex<Fs>>>,
    mem: &'m GuestMemoryMmap,
    queues: Vec<Driver<'m>>,
    kicks: Vec<EventFd>,
    interrupt: Arc<IrqTrigger>,
    unique: u64,
}

impl Rig<'_> {
    fn activate(&mut self) {
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            queues: self.queues.iter().map(Driver::device_queue).collect(),
            queue_evts: self
                .kicks
                .iter()
                .map(|k| k.try_clone().expect("dup"))
                .collect(),
            interrupt: self.interrupt.clone(),
        };
        self.dev
            .lock()
            .expect("device lock")
            .activate(ctx)
            .expect("activation");
        settle(&mut self.em);
    }

    fn push(&mut self, queue: usize, parts: &[Part]) {
        self.queues[queue].push(parts);
        self.kicks[queue].write(1).expect("kick");
        settle(&mut self.em);
    }

    fn request(&mut self, request: &Request) {
        self.unique += 1;
        let queue = if request.hiprio {
            HIPRIO_QUEUE
        } else {
            REQUEST_QUEUE
        };
        self.push(queue, &request.parts(self.unique));
    }

    fn reset(&mut self) {
        self.dev.lock().expect("device lock").reset();
        self.queues = LAYOUTS.iter().map(|l| Driver::new(self.mem, *l)).collect();
        self.activate();
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let read_only = input.u8() & 1 != 0;
    let base = tempfile::tempdir_in(scratch_root()).expect("input directory");
    let owner = share_owner();
    let share = populate(base.path(), owner);
    let watch = OutsideWatch::new(base.path());
    let dev = Fs::new(FsConfig {
        tag: "fuzz".into(),
        shared_dir: share,
        read_only,
        owner: Some(owner),
    })
    .expect("virtio-fs device");
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)])
        .expect("guest memory");
    let dev = Arc::new(Mutex::new(dev));
    let mut em = EventManager::new().expect("event manager");
    em.add_subscriber(dev.clone());
    let mut rig = Rig {
        dev,
        em,
        mem: &mem,
        queues: LAYOUTS.iter().map(|l| Driver::new(&mem, *l)).collect(),
        kicks: (0..2)
            .map(|_| EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))
            .collect(),
        interrupt: Arc::new(IrqTrigger::new(
            EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
        )),
        unique: 0,
    };
    rig.activate();

    while !input.is_empty() {
        match input.u8() % 5 {
            0 => rig.request(&Request::read(&mut input)),
            1 => {
                let queue = usize::from(input.u8() & 1);
                rig.push(queue, &read_chain(&mut input));
            }
            2 => {
                let offset = u64::from(input.u16());
                let len = usize::from(input.u8());
                let bytes = input.bytes(len);
                mem.write_slice(bytes, GuestAddress(SCRATCH + offset))
                    .expect("scratch inside guest memory");
            }
            3 => {
                let queue = usize::from(input.u8() & 1);
                rig.queues[queue].set_avail_idx(input.u16());
            }
            _ => rig.reset(),
        }
        for queue in &mut rig.queues {
            queue.pop_used();
        }
    }
    for queue in &rig.queues {
        assert!(
            queue.all_returned(),
            "virtio-fs left {} chains unreturned",
            queue.pending()
        );
    }
    watch.assert_quiet();
    check_outside_untouched(base.path());
}

/// An inotify instance watching `outside/` and `outside/secret` for every event.
struct OutsideWatch(std::fs::File);

impl OutsideWatch {
    fn new(base: &Path) -> OutsideWatch {
        // SAFETY: inotify_init1 takes flags only and returns a new descriptor or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(
            fd >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        for path in [base.join("outside"), base.join("outside/secret")] {
            let c_path = CString::new(path.as_os_str().as_bytes()).expect("path without NUL");
            // SAFETY: `fd` is an inotify descriptor and `c_path` a NUL-terminated path that
            // outlives the call.
            let wd = unsafe { libc::inotify_add_watch(fd, c_path.as_ptr(), libc::IN_ALL_EVENTS) };
            assert!(
                wd >= 0,
                "inotify_add_watch: {}",
                std::io::Error::last_os_error()
            );
        }
        OutsideWatch(file)
    }

    /// Panics if anything happened to `outside/` or `outside/secret` since [`OutsideWatch::new`].
    fn assert_quiet(&self) {
        let mut buf = [0u8; 4096];
        match std::io::Read::read(&mut &self.0, &mut buf) {
            Ok(n) if n >= 8 => {
                let mask = u32::from_ne_bytes(buf[4..8].try_into().expect("4 bytes"));
                panic!("the guest reached outside the share: inotify event mask {mask:#x}");
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "outside the share")]
    fn reading_the_secret_is_noticed() {
        let base = tempfile::tempdir_in(scratch_root()).unwrap();
        populate(base.path(), share_owner());
        let watch = OutsideWatch::new(base.path());

        fs::read(base.path().join("outside/secret")).unwrap();

        watch.assert_quiet();
    }

    #[test]
    fn a_session_inside_the_share_is_quiet() {
        let base = tempfile::tempdir_in(scratch_root()).unwrap();
        populate(base.path(), share_owner());
        let watch = OutsideWatch::new(base.path());

        fs::read(base.path().join("share/file")).unwrap();
        fs::read_link(base.path().join("share/escape")).unwrap();

        watch.assert_quiet();
    }
}

//! The virtio-fs device: configuration space, activation and reset, and the queue loop.
//!
//! Threading: the transport calls the [`VirtioDevice`] methods from vCPU threads; the event loop
//! calls the `on_*` methods through [`event_handler`](super::event_handler). Both hold the
//! device's mutex. `activate` only stores what the driver set up and signals `activate_evt`; the
//! event loop then watches both queues' notifications and serves what is already queued. Requests
//! from the hiprio queue and the request queue go to the same FUSE server.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events};
use fuse_backend_rs::api::server::Server;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::identity::Identity;
use super::request::{serve_chain, FuseServer};
use super::{
    Error, ShareFs, CONFIG_NUM_QUEUES_OFFSET, CONFIG_SPACE_SIZE, FS_QUEUE_SIZES,
    NUM_REQUEST_QUEUES, TAG_SIZE,
};
use crate::devices::virtio::{
    device_type, read_config_bytes, ActivateContext, ActivateError, DeviceState, IrqTrigger,
    QueuePosition, VirtioDevice, VIRTIO_F_VERSION_1,
};

/// How to create an [`Fs`] device: one shared host directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsConfig {
    /// The mount tag the guest names the share by (`mount -t virtiofs TAG DIR`): 1 to 36 bytes of
    /// UTF-8 without NUL.
    pub tag: String,
    /// The host directory to share.
    pub shared_dir: PathBuf,
    /// Refuse every write-type operation with `EROFS`, host-side.
    pub read_only: bool,
    /// `uid:gid` the share is served as and the files the guest creates get. `None`: the owner of
    /// `shared_dir` (or, when the VMM does not run as root, the VMM's own uid:gid). Without root
    /// only the VMM's own uid:gid is possible; as root, a writable share needs a non-root owner.
    pub owner: Option<(u32, u32)>,
}

/// What the driver handed over at DRIVER_OK.
#[derive(Debug)]
struct Active {
    mem: GuestMemoryMmap,
    /// hiprio, then the request queue.
    queues: Vec<Queue>,
    interrupt: Arc<IrqTrigger>,
}

/// What an event-loop fd belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSource {
    /// The device's activation eventfd.
    Activate,
    /// The notification eventfd of the queue with this index.
    Queue(usize),
    /// Anything else (stale).
    Unknown,
}

/// A virtio-fs device (device ID 26) sharing one host directory under one mount tag. Share it as
/// `Arc<Mutex<Fs>>` between the MMIO transport (as a [`VirtioDevice`]) and the event loop (as an
/// `event_manager::MutEventSubscriber`).
pub struct Fs {
    tag: String,
    config_space: [u8; CONFIG_SPACE_SIZE],
    fs: Arc<ShareFs>,
    server: FuseServer,
    acked_features: u64,
    activate_evt: EventFd,
    /// The queue notifications the event loop watches. Kept across a reset until the next
    /// activation's replace them, so they are never closed while still registered.
    queue_evts: Vec<EventFd>,
    /// The notifications handed over by the latest activation, not yet watched.
    pending_queue_evts: Vec<EventFd>,
    active: Option<Active>,
    /// The driver reset the device and the file server has not dropped the guest's node IDs and
    /// handles yet. That happens on the event loop before it serves the next request, not in
    /// [`VirtioDevice::reset`]: the reset runs on a vCPU thread, whose seccomp filter allows
    /// none of the file-system calls it takes.
    forget_pending: bool,
}

impl std::fmt::Debug for Fs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fs")
            .field("tag", &self.tag)
            .field("share", &self.fs)
            .field("acked_features", &self.acked_features)
            .field("active", &self.active.is_some())
            .finish_non_exhaustive()
    }
}

impl Fs {
    /// Validates `config`, opens the shared directory and creates the device.
    ///
    /// # Errors
    /// [`Error::EmptyTag`], [`Error::TagTooLong`], [`Error::TagNul`]; the share errors of
    /// [`ShareFs::open`]; [`Error::EventFd`].
    pub fn new(config: FsConfig) -> Result<Fs, Error> {
        let config_space = config_space(&config.tag)?;
        let fs = Arc::new(ShareFs::open(
            &config.shared_dir,
            config.read_only,
            config.owner,
        )?);
        let activate_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
        Ok(Fs {
            tag: config.tag,
            config_space,
            server: Server::new(fs.clone()),
            fs,
            acked_features: 0,
            activate_evt,
            queue_evts: Vec::new(),
            pending_queue_evts: Vec::new(),
            active: None,
            forget_pending: false,
        })
    }

    /// The mount tag.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The shared host directory.
    pub fn shared_dir(&self) -> &Path {
        self.fs.path()
    }

    /// Whether the share is read-only.
    pub fn is_read_only(&self) -> bool {
        self.fs.is_read_only()
    }

    /// The `uid:gid` the share is served as.
    pub fn owner(&self) -> (u32, u32) {
        let Identity { uid, gid, .. } = self.fs.identity();
        (uid, gid)
    }

    /// Serves `share` from now on instead of the directory the device was made with: how a
    /// host directory reaches an idle share slot of a running VM (a warm-pool clone handed
    /// out with mounts). The guest's driver knows the device by its tag only, so nothing
    /// changes for it until it mounts the tag.
    ///
    /// # Errors
    /// [`Error::ShareInUse`] while the guest has the device's current share mounted (its node
    /// IDs and handles name files of that share).
    pub fn attach_share(&mut self, share: ShareFs) -> Result<(), Error> {
        if self.fs.session_live() && !self.forget_pending {
            return Err(Error::ShareInUse(self.tag.clone()));
        }
        self.fs = Arc::new(share);
        self.server = Server::new(self.fs.clone());
        Ok(())
    }

    /// Whether the driver has activated the device (and not reset it since).
    pub fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    /// The features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// The device's activation eventfd (watched from [`event_handler`](super::event_handler)).
    pub(crate) fn activate_evt(&self) -> &EventFd {
        &self.activate_evt
    }

    /// Classifies an fd the event loop reported.
    pub fn event_source(&self, fd: RawFd) -> EventSource {
        if fd == self.activate_evt.as_raw_fd() {
            return EventSource::Activate;
        }
        match self.queue_evts.iter().position(|e| e.as_raw_fd() == fd) {
            Some(index) => EventSource::Queue(index),
            None => EventSource::Unknown,
        }
    }

    /// The driver activated the device: watch its queue notifications (replacing those of an
    /// earlier activation) and serve what is already queued.
    pub fn on_activate_event(&mut self, ops: &mut EventOps) {
        let _ = self.activate_evt.read();
        if !self.pending_queue_evts.is_empty() {
            for old in self.queue_evts.drain(..) {
                if let Err(e) = ops.remove(Events::new(&old, EventSet::IN)) {
                    tracing::warn!("virtio-fs: cannot unwatch an old queue notification: {e}");
                }
            }
            for evt in &self.pending_queue_evts {
                if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                    tracing::error!("virtio-fs: cannot watch a queue notification: {e}");
                }
            }
            self.queue_evts = std::mem::take(&mut self.pending_queue_evts);
        }
        for index in 0..FS_QUEUE_SIZES.len() {
            self.process_queue(index);
        }
    }

    /// The driver notified queue `index`.
    pub fn on_queue_event(&mut self, index: usize) {
        if let Some(evt) = self.queue_evts.get(index) {
            let _ = evt.read();
        }
        self.process_queue(index);
    }

    /// Serves every available request of queue `index`, then interrupts the guest if any chain
    /// was used.
    ///
    /// Notifications stay suppressed while the device drains the queue; after re-enabling them
    /// it looks once more, so a request added in between is not left waiting for a kick.
    fn process_queue(&mut self, index: usize) {
        if std::mem::take(&mut self.forget_pending) {
            self.fs.forget_all();
        }
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let Some(queue) = active.queues.get_mut(index) else {
            return;
        };
        let mem = &active.mem;
        let mut used_any = false;
        loop {
            if let Err(e) = queue.disable_notification(mem) {
                tracing::warn!("virtio-fs: cannot suppress queue notifications: {e}");
            }
            let served = drain(queue, mem, &self.server);
            used_any |= served > 0;
            match queue.enable_notification(mem) {
                // More arrived meanwhile; without progress it is an avail index the queue
                // refuses, and looping would spin.
                Ok(true) if served > 0 => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("virtio-fs: cannot re-enable queue notifications: {e}");
                    break;
                }
            }
        }
        if used_any && queue.needs_notification(mem).unwrap_or(true) {
            if let Err(e) = active.interrupt.signal_used_queue() {
                tracing::error!("virtio-fs: cannot interrupt the guest: {e}");
            }
        }
    }
}

/// Serves the available chains of `queue`; returns how many went to the used ring.
fn drain(queue: &mut Queue, mem: &GuestMemoryMmap, server: &FuseServer) -> usize {
    let mut served = 0;
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let len = serve_chain(server, mem, chain);
        if let Err(e) = queue.add_used(mem, head, len) {
            tracing::error!("virtio-fs: cannot return chain {head}: {e}");
        }
        served += 1;
    }
    served
}

/// The configuration space (virtio 1.2 §5.11.4): the NUL-padded tag and `num_request_queues`.
fn config_space(tag: &str) -> Result<[u8; CONFIG_SPACE_SIZE], Error> {
    if tag.is_empty() {
        return Err(Error::EmptyTag);
    }
    if tag.len() > TAG_SIZE {
        return Err(Error::TagTooLong {
            tag: tag.to_owned(),
            len: tag.len(),
        });
    }
    if tag.contains('\0') {
        return Err(Error::TagNul(tag.to_owned()));
    }
    let mut space = [0u8; CONFIG_SPACE_SIZE];
    space[..tag.len()].copy_from_slice(tag.as_bytes());
    space[CONFIG_NUM_QUEUES_OFFSET..].copy_from_slice(&NUM_REQUEST_QUEUES.to_le_bytes());
    Ok(space)
}

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        device_type::FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &FS_QUEUE_SIZES
    }

    /// VERSION_1 and RING_EVENT_IDX (virtio 1.2 §2.7.10); no notification queue
    /// (VIRTIO_FS_F_NOTIFICATION), no DAX window.
    fn avail_features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX
    }

    fn set_acked_features(&mut self, acked: u64) {
        self.acked_features = acked & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    /// Every field is read-only for the driver (virtio 1.2 §5.11.4.1).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            "virtio-fs: ignoring a {}-byte config write at {offset}",
            data.len()
        );
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        let expected = FS_QUEUE_SIZES.len();
        if ctx.queues.len() != expected || ctx.queue_evts.len() != expected {
            return Err(ActivateError::QueueCount {
                expected,
                got: ctx.queues.len().min(ctx.queue_evts.len()),
            });
        }
        if self.active.is_some() {
            return Err(ActivateError::Device("virtio-fs is already active".into()));
        }
        self.active = Some(Active {
            mem: ctx.mem,
            queues: ctx.queues,
            interrupt: ctx.interrupt,
        });
        self.pending_queue_evts = ctx.queue_evts;
        self.activate_evt.write(1).map_err(ActivateError::Signal)
    }

    /// The hiprio and request queues' positions. Requests are served synchronously on the
    /// event-loop thread (each chain popped is answered and put in the used ring before the next),
    /// so between events none is in flight.
    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.active
            .iter()
            .flat_map(|active| active.queues.iter().map(QueuePosition::of))
            .collect()
    }

    /// The mount tag: the guest's driver read it at probe time and knows the share by it.
    fn device_state(&self) -> DeviceState {
        DeviceState::Fs {
            tag: self.tag.clone(),
        }
    }

    /// Refused while the guest has the share mounted (a live FUSE session): its node IDs and
    /// file handles name host file descriptors of this process, which a snapshot cannot carry.
    /// A restored device starts without a session, ready for the guest to mount it.
    fn can_snapshot(&self) -> Result<(), String> {
        if self.fs.session_live() && !self.forget_pending {
            return Err(format!(
                "virtio-fs share {} is mounted in the guest; unmount it before a snapshot",
                self.tag
            ));
        }
        Ok(())
    }

    /// Drops the queues and the guest memory handle; every node ID and file handle the guest held
    /// is forgotten before the next request is served (the driver starts over with FUSE_INIT).
    /// Requests are served synchronously, so none is in flight. The watched queue notifications stay registered until the next
    /// activation replaces them (only the event loop may change registrations).
    fn reset(&mut self) -> bool {
        self.active = None;
        self.pending_queue_evts.clear();
        self.acked_features = 0;
        self.forget_pending = true;
        true
    }
}

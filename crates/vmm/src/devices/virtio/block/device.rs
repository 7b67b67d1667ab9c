//! The block device: features, configuration space, activation and reset, and the request
//! queue loop.
//!
//! Threading: the transport calls the [`VirtioDevice`] methods from vCPU threads; the event loop
//! calls the `on_*` methods through [`event_handler`](super::event_handler). Both hold the
//! device's mutex. `activate` only stores what the driver set up and signals `activate_evt`; the
//! event loop then starts watching the queue notification and serves what is already queued.

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::io::{execute, Completion, DiskImage};
use super::request::parse_chain;
use super::{
    Error, BLOCK_QUEUE_SIZES, ID_BYTES, SECTOR_SIZE, SEG_MAX, VIRTIO_BLK_F_BLK_SIZE,
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX,
};
use crate::devices::virtio::{
    device_type, read_config_bytes, ActivateContext, ActivateError, DeviceState, IrqTrigger,
    QueuePosition, VirtioDevice, VIRTIO_F_VERSION_1,
};

/// Offset of `le64 capacity` (in sectors) in the configuration space (virtio 1.2 §5.2.4).
pub const CONFIG_CAPACITY_OFFSET: usize = 0;
/// Offset of `le32 seg_max`.
pub const CONFIG_SEG_MAX_OFFSET: usize = 12;
/// Offset of `le32 blk_size`.
pub const CONFIG_BLK_SIZE_OFFSET: usize = 20;
/// Bytes of configuration space the device implements (up to and including `blk_size`); later
/// fields (topology, writeback, discard, ...) read as 0.
pub const CONFIG_SPACE_SIZE: usize = 24;

/// How to create a [`Block`] device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockConfig {
    /// The raw disk image: a regular file or a host block device.
    pub path: PathBuf,
    /// Expose the disk read-only (VIRTIO_BLK_F_RO; the image is opened `O_RDONLY`).
    pub read_only: bool,
    /// The device ID the guest reads with GET_ID (Linux: `/sys/block/vdX/serial`), at most
    /// [`ID_BYTES`] (20) bytes. `None` reads as an empty ID.
    pub id: Option<String>,
    /// A copy-on-write disk: `path` is a new, empty sparse overlay, and what the guest has not
    /// written comes from this read-only image of the same size ([`super::cow`]).
    pub backing: Option<PathBuf>,
}

/// What the driver handed over at DRIVER_OK.
#[derive(Debug)]
struct Active {
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Arc<IrqTrigger>,
}

/// What an event-loop fd belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSource {
    /// The device's activation eventfd.
    Activate,
    /// The request queue's notification eventfd.
    Queue,
    /// Anything else (stale).
    Unknown,
}

/// A virtio-blk device (device ID 2) serving one raw disk image. Create one per disk; share it as
/// `Arc<Mutex<Block>>` between the MMIO transport (as a [`VirtioDevice`]) and the event loop (as
/// an `event_manager::MutEventSubscriber`).
#[derive(Debug)]
pub struct Block {
    disk: DiskImage,
    id: [u8; ID_BYTES],
    config_space: [u8; CONFIG_SPACE_SIZE],
    acked_features: u64,
    activate_evt: EventFd,
    /// The queue notification the event loop watches. Kept across a reset until the next
    /// activation's replaces it, so it is never closed while still registered.
    queue_evt: Option<EventFd>,
    /// The notification handed over by the latest activation, not yet watched.
    pending_queue_evt: Option<EventFd>,
    active: Option<Active>,
}

impl Block {
    /// Opens the disk image described by `config` and creates the device.
    ///
    /// # Errors
    /// [`Error::IdTooLong`] for an ID longer than 20 bytes; the image errors of
    /// [`DiskImage::open`]; [`Error::EventFd`].
    pub fn new(config: BlockConfig) -> Result<Block, Error> {
        let id = id_bytes(config.id.as_deref())?;
        let mut disk = DiskImage::open(&config.path, config.read_only)?;
        if let Some(backing) = &config.backing {
            disk = disk.with_backing(backing)?;
        }
        let activate_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
        Ok(Block {
            config_space: config_space(disk.capacity()),
            disk,
            id,
            acked_features: 0,
            activate_evt,
            queue_evt: None,
            pending_queue_evt: None,
            active: None,
        })
    }

    /// The image path.
    pub fn path(&self) -> &Path {
        self.disk.path()
    }

    /// The backing image of a copy-on-write disk (until a snapshot made the overlay whole).
    pub fn disk_backing(&self) -> Option<&Path> {
        self.disk.backing_path()
    }

    /// Disk size in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.disk.capacity()
    }

    /// Whether the disk is read-only.
    pub fn is_read_only(&self) -> bool {
        self.disk.read_only()
    }

    /// The device ID as the guest reads it (20 bytes, NUL-padded).
    pub fn id(&self) -> &[u8; ID_BYTES] {
        &self.id
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
            EventSource::Activate
        } else if self.queue_evt.as_ref().map(AsRawFd::as_raw_fd) == Some(fd) {
            EventSource::Queue
        } else {
            EventSource::Unknown
        }
    }

    /// The driver activated the device: watch its queue notification (replacing the one of an
    /// earlier activation) and serve what is already queued.
    pub fn on_activate_event(&mut self, ops: &mut EventOps) {
        let _ = self.activate_evt.read();
        if let Some(evt) = self.pending_queue_evt.take() {
            if let Some(old) = self.queue_evt.take() {
                if let Err(e) = ops.remove(Events::new(&old, EventSet::IN)) {
                    tracing::warn!("virtio-blk: cannot unwatch the old queue notification: {e}");
                }
            }
            if let Err(e) = ops.add(Events::new(&evt, EventSet::IN)) {
                tracing::error!("virtio-blk: cannot watch the queue notification: {e}");
            }
            self.queue_evt = Some(evt);
        }
        self.process_queue();
    }

    /// The driver notified the request queue.
    pub fn on_queue_event(&mut self) {
        if let Some(evt) = &self.queue_evt {
            let _ = evt.read();
        }
        self.process_queue();
    }

    /// Serves every available request, then interrupts the guest if any chain was used.
    ///
    /// Notifications stay suppressed while the device drains the queue; after re-enabling them
    /// it looks once more, so a request added in between is not left waiting for a kick.
    fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mut used_any = false;
        loop {
            if let Err(e) = active.queue.disable_notification(&active.mem) {
                tracing::warn!("virtio-blk: cannot suppress queue notifications: {e}");
            }
            let served = drain(active, &self.disk, &self.id);
            used_any |= served > 0;
            match active.queue.enable_notification(&active.mem) {
                // More arrived meanwhile; without progress it is an avail index the queue
                // refuses, and looping would spin.
                Ok(true) if served > 0 => continue,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!("virtio-blk: cannot re-enable queue notifications: {e}");
                    break;
                }
            }
        }
        if used_any && active.queue.needs_notification(&active.mem).unwrap_or(true) {
            if let Err(e) = active.interrupt.signal_used_queue() {
                tracing::error!("virtio-blk: cannot interrupt the guest: {e}");
            }
        }
    }
}

/// Serves the available chains; returns how many went to the used ring.
fn drain(active: &mut Active, disk: &DiskImage, id: &[u8; ID_BYTES]) -> usize {
    let mem = &active.mem;
    let mut served = 0;
    while let Some(chain) = active.queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let len = serve_chain(chain, mem, disk, id);
        if let Err(e) = active.queue.add_used(mem, head, len) {
            tracing::error!("virtio-blk: cannot return chain {head}: {e}");
        }
        served += 1;
    }
    served
}

/// Parses, executes and completes one chain; returns the used length (data written + the
/// status byte, or 0 when the chain has no usable status byte).
fn serve_chain(
    chain: DescriptorChain<&GuestMemoryMmap>,
    mem: &GuestMemoryMmap,
    disk: &DiskImage,
    id: &[u8; ID_BYTES],
) -> u32 {
    let head = chain.head_index();
    let parsed = match parse_chain(chain, mem, disk.limits()) {
        Ok(parsed) => parsed,
        Err(e) => {
            tracing::debug!("virtio-blk: chain {head} returned unanswered: {e}");
            return 0;
        }
    };
    let completion = match &parsed.request {
        Ok(request) => execute(request, disk, id, mem),
        Err(e) => {
            tracing::debug!("virtio-blk: chain {head} rejected: {e}");
            Completion::IOERR
        }
    };
    match mem.write_obj(completion.status, parsed.status) {
        Ok(()) => completion.written.saturating_add(1),
        Err(e) => {
            tracing::warn!("virtio-blk: cannot write the status of chain {head}: {e}");
            0
        }
    }
}

/// The NUL-padded 20-byte device ID.
fn id_bytes(id: Option<&str>) -> Result<[u8; ID_BYTES], Error> {
    let mut bytes = [0u8; ID_BYTES];
    let id = id.unwrap_or_default();
    let dst = bytes.get_mut(..id.len()).ok_or_else(|| Error::IdTooLong {
        id: id.to_owned(),
        len: id.len(),
    })?;
    dst.copy_from_slice(id.as_bytes());
    Ok(bytes)
}

/// The configuration space (virtio 1.2 §5.2.4): capacity, `size_max` 0 (not offered),
/// `seg_max`, geometry 0 (not offered), `blk_size`.
fn config_space(capacity: u64) -> [u8; CONFIG_SPACE_SIZE] {
    let mut space = [0u8; CONFIG_SPACE_SIZE];
    let fields: [(usize, &[u8]); 3] = [
        (CONFIG_CAPACITY_OFFSET, &capacity.to_le_bytes()),
        (CONFIG_SEG_MAX_OFFSET, &SEG_MAX.to_le_bytes()),
        (CONFIG_BLK_SIZE_OFFSET, &(SECTOR_SIZE as u32).to_le_bytes()),
    ];
    for (offset, bytes) in fields {
        space[offset..offset + bytes.len()].copy_from_slice(bytes);
    }
    space
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        device_type::BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &BLOCK_QUEUE_SIZES
    }

    /// VERSION_1, RING_EVENT_IDX (§2.7.10), SEG_MAX, BLK_SIZE, FLUSH, and RO for a read-only
    /// disk (virtio 1.2 §5.2.3).
    fn avail_features(&self) -> u64 {
        let mut features = 1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_FLUSH;
        if self.disk.read_only() {
            features |= 1 << VIRTIO_BLK_F_RO;
        }
        features
    }

    fn set_acked_features(&mut self, acked: u64) {
        self.acked_features = acked & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    /// Every implemented field is read-only (`writeback` needs VIRTIO_BLK_F_CONFIG_WCE, not
    /// offered).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            "virtio-blk: ignoring a {}-byte config write at {offset}",
            data.len()
        );
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        let expected = BLOCK_QUEUE_SIZES.len();
        if ctx.queues.len() != expected || ctx.queue_evts.len() != expected {
            return Err(ActivateError::QueueCount {
                expected,
                got: ctx.queues.len().min(ctx.queue_evts.len()),
            });
        }
        if self.active.is_some() {
            return Err(ActivateError::Device("virtio-blk is already active".into()));
        }
        let (Some(queue), Some(queue_evt)) = (
            ctx.queues.into_iter().next(),
            ctx.queue_evts.into_iter().next(),
        ) else {
            return Err(ActivateError::QueueCount { expected, got: 0 });
        };
        self.active = Some(Active {
            mem: ctx.mem,
            queue,
            interrupt: ctx.interrupt,
        });
        self.pending_queue_evt = Some(queue_evt);
        self.activate_evt.write(1).map_err(ActivateError::Signal)
    }

    /// The request queue's position. Requests are served synchronously on the event-loop thread
    /// (`drain` pops a chain, executes it and puts it in the used ring before popping the next),
    /// so from that thread, between events, no request is in flight: the disk holds every write
    /// the used ring reports, and `next_avail` skips no request.
    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.active
            .iter()
            .map(|active| QueuePosition::of(&active.queue))
            .collect()
    }

    /// A copy-on-write disk becomes a disk of its own (its overlay made whole), so that the
    /// snapshot needs nothing but the overlay's file.
    fn prepare_snapshot(&mut self) -> Result<(), String> {
        self.disk
            .flatten()
            .map_err(|e| format!("virtio-blk {}: {e}", self.disk.path().display()))
    }

    /// The disk's size and whether it is read-only; the restored VM reopens its image by path.
    fn device_state(&self) -> DeviceState {
        DeviceState::Block {
            capacity: self.disk.capacity(),
            read_only: self.disk.read_only(),
        }
    }

    /// Drops the queue and the guest memory handle; the disk stays open. Requests are served
    /// synchronously, so none is in flight. The watched queue notification stays registered
    /// until the next activation replaces it (only the event loop may change registrations).
    fn reset(&mut self) -> bool {
        self.active = None;
        self.pending_queue_evt = None;
        self.acked_features = 0;
        true
    }
}

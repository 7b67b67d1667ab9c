//! The vsock device: features, configuration space, activation, and moving packets between the
//! virtqueues and the muxer.
//!
//! Threading: the transport calls the [`VirtioDevice`] methods from vCPU threads; the event loop
//! calls the `on_*` methods through [`event_handler`](super::event_handler). Both hold the
//! device's mutex. `activate` only stores the queues and signals `activate_evt`; the event loop
//! then starts watching the queue notifications and the host listener.
//!
//! Snapshots: the device never holds a chain it popped across events (TX chains go back at once,
//! an RX chain is either filled and returned or given back with `go_to_previous_position`, an
//! event buffer is returned as soon as it is written), so the queue positions saved between
//! events skip nothing. Connections are not saved. A restored device ([`VirtioDevice::restored`])
//! sends the guest a TRANSPORT_RESET event as soon as the event loop sees it activated (or, if
//! the guest has no event buffer posted, as soon as it posts one), drains the TX queue at once
//! (a chain posted before the snapshot may have been notified already and will not be notified
//! again), and holds packets for the guest until the guest has handled the event (see
//! [`RESET_ACK_TIMEOUT`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use event_manager::{EventOps, EventSet, Events};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use virtio_vsock::packet::VsockPacket;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::muxer::Muxer;
use super::packet::{header_of_rejected_chain, Header, HEADER_SIZE};
use super::reset_event;
use super::unix::set_nonblocking;
use super::{
    ConnKey, ConnState, Error, EVQ_INDEX, MAX_GUEST_CID, MAX_PKT_DATA, MIN_GUEST_CID,
    RESET_ACK_TIMEOUT, RXQ_INDEX, TXQ_INDEX, VSOCK_QUEUE_SIZES,
};
use crate::devices::virtio::{
    device_type, read_config_bytes, ActivateContext, ActivateError, DeviceState, IrqTrigger,
    QueuePosition, VirtioDevice, VIRTIO_F_VERSION_1,
};

/// What an event-loop fd belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventSource {
    /// The device's activation eventfd.
    Activate,
    /// The notification eventfd of queue `n`.
    Queue(usize),
    /// The host listener at `uds_path`.
    Listener,
    /// The connection-timeout timer.
    Timer,
    /// A client or connection socket.
    Socket,
}

/// What the driver handed over at DRIVER_OK.
struct Active {
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<IrqTrigger>,
}

/// The virtio-vsock device (device ID 19).
pub struct Vsock {
    guest_cid: u64,
    acked_features: u64,
    muxer: Muxer,
    activate_evt: EventFd,
    timer: TimerFd,
    /// The deadline the timer is armed for.
    timer_deadline: Option<Instant>,
    active: Option<Active>,
    /// Muxer sockets (and the listener) registered with the event loop, and for what.
    watched: HashMap<RawFd, EventSet>,
    /// Restored from a snapshot: a TRANSPORT_RESET event is owed to the guest and waits for the
    /// event loop, or for an event-queue buffer.
    reset_event_pending: bool,
    /// Restored from a snapshot: packets for the guest wait until the guest has handled the
    /// TRANSPORT_RESET event, or until this deadline.
    rx_hold_until: Option<Instant>,
}

impl std::fmt::Debug for Vsock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vsock")
            .field("guest_cid", &self.guest_cid)
            .field("uds_path", &self.muxer.uds_path())
            .field("activated", &self.active.is_some())
            .field("connections", &self.muxer.connection_count())
            .finish_non_exhaustive()
    }
}

impl Vsock {
    /// Creates the device for a guest with CID `guest_cid`, listening for host clients on the Unix
    /// socket `uds_path` (created here; removed when the device is dropped). Guest connections to
    /// host port P go to `<uds_path>_P`.
    ///
    /// # Errors
    /// [`Error::InvalidCid`] unless 3 ≤ `guest_cid` ≤ 2^32 − 2; [`Error::UdsPathExists`] if
    /// anything is at `uds_path`; [`Error::Bind`]; [`Error::EventFd`].
    pub fn new(guest_cid: u64, uds_path: impl Into<PathBuf>) -> Result<Vsock, Error> {
        if !(MIN_GUEST_CID..=MAX_GUEST_CID).contains(&guest_cid) {
            return Err(Error::InvalidCid(guest_cid));
        }
        let activate_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?;
        let timer = TimerFd::new().map_err(|e| Error::EventFd(e.into()))?;
        // A timer event can be stale by the time it is handled (re-armed meanwhile): reading it
        // must not block the event loop.
        set_nonblocking(&timer).map_err(Error::EventFd)?;
        let muxer = Muxer::new(guest_cid, &uds_path.into())?;
        Ok(Vsock {
            guest_cid,
            acked_features: 0,
            muxer,
            activate_evt,
            timer,
            timer_deadline: None,
            active: None,
            watched: HashMap::new(),
            reset_event_pending: false,
            rx_hold_until: None,
        })
    }

    /// The guest's context ID.
    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    /// The host listener's socket path.
    pub fn uds_path(&self) -> &Path {
        self.muxer.uds_path()
    }

    /// Whether the driver has activated the device.
    pub fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    /// Whether packets for the guest are held until it handles a TRANSPORT_RESET event (after a
    /// restore).
    pub fn is_rx_held(&self) -> bool {
        self.rx_hold_until.is_some()
    }

    /// Number of open connections.
    pub fn connection_count(&self) -> usize {
        self.muxer.connection_count()
    }

    /// The state of the connection between host port `local_port` and guest port `peer_port`.
    pub fn connection_state(&self, local_port: u32, peer_port: u32) -> Option<ConnState> {
        self.muxer.connection_state(ConnKey {
            local_port,
            peer_port,
        })
    }

    /// The guest's remaining receive credit on a connection, in bytes.
    pub fn peer_credit(&self, local_port: u32, peer_port: u32) -> Option<u32> {
        self.muxer.peer_credit(ConnKey {
            local_port,
            peer_port,
        })
    }

    /// The device's activation eventfd (watched from [`event_handler`](super::event_handler)).
    pub(crate) fn activate_evt(&self) -> &EventFd {
        &self.activate_evt
    }

    /// The timeout timer.
    pub(crate) fn timer(&self) -> &TimerFd {
        &self.timer
    }

    /// Classifies an fd the event loop reported.
    pub fn event_source(&self, fd: RawFd) -> EventSource {
        if fd == self.activate_evt.as_raw_fd() {
            return EventSource::Activate;
        }
        if fd == self.timer.as_raw_fd() {
            return EventSource::Timer;
        }
        if fd == self.muxer.listener_fd() {
            return EventSource::Listener;
        }
        let queue = self
            .active
            .as_ref()
            .and_then(|a| a.queue_evts.iter().position(|e| e.as_raw_fd() == fd));
        match queue {
            Some(index) => EventSource::Queue(index),
            None => EventSource::Socket,
        }
    }

    /// The driver activated the device: watch the queue notifications and catch up on them.
    pub fn on_activate_event(&mut self, ops: &mut EventOps) {
        let _ = self.activate_evt.read();
        let Some(active) = self.active.as_ref() else {
            return;
        };
        for evt in &active.queue_evts {
            if let Err(e) = ops.add(Events::new(evt, EventSet::IN)) {
                tracing::error!("vsock: cannot watch a queue notification: {e}");
            }
        }
        if self.reset_event_pending {
            // The guest may only now be about to run: its time to answer starts here.
            self.rx_hold_until = Some(Instant::now() + RESET_ACK_TIMEOUT);
            self.send_reset_event();
        }
        self.process_queues();
    }

    /// Queue `index` was notified. On the event queue this is either a buffer for an owed
    /// TRANSPORT_RESET event, or the guest re-posting the buffer of a delivered one: it has
    /// handled the event, and held packets may go.
    pub fn on_queue_event(&mut self, index: usize) {
        if let Some(evt) = self.active.as_ref().and_then(|a| a.queue_evts.get(index)) {
            let _ = evt.read();
        }
        if index != EVQ_INDEX {
            self.process_queues();
        } else if self.reset_event_pending {
            self.send_reset_event();
        } else if self.rx_hold_until.take().is_some() {
            tracing::debug!("vsock: the guest handled TRANSPORT_RESET; delivering held packets");
            self.process_queues();
        }
    }

    /// Puts the owed TRANSPORT_RESET event on the event queue and interrupts the guest; without
    /// a buffer, asks the guest to notify when it posts one. The interrupt is not subject to
    /// used_event suppression: a guest that misses it keeps its dead connections (Firecracker
    /// issue #4736).
    fn send_reset_event(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = &active.mem;
        let queue = &mut active.queues[EVQ_INDEX];
        let mut looked_again = false;
        loop {
            if reset_event::send(queue, mem) {
                self.reset_event_pending = false;
                if let Err(e) = active.interrupt.signal_used_queue() {
                    tracing::error!("vsock: cannot interrupt the guest: {e}");
                }
                return;
            }
            match queue.enable_notification(mem) {
                // A buffer arrived while notifications were being enabled.
                Ok(true) if !std::mem::replace(&mut looked_again, true) => {}
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!("vsock: cannot enable event queue notifications: {e}");
                    return;
                }
            }
        }
    }

    /// Host clients are waiting on the listener.
    pub fn on_listener_event(&mut self) {
        self.muxer.accept_clients();
    }

    /// The timer fired: expire overdue handshakes and connections.
    pub fn on_timer_event(&mut self) {
        let _ = self.timer.wait();
        self.timer_deadline = None;
        self.expire_connections(Instant::now());
    }

    /// Ends what is overdue at `now` (RST to the guest, client sockets closed; packets held for
    /// a TRANSPORT_RESET the guest did not acknowledge in time) and delivers the resulting
    /// packets.
    pub fn expire_connections(&mut self, now: Instant) {
        if self.rx_hold_until.is_some_and(|deadline| deadline <= now) {
            tracing::warn!(
                "vsock: the guest did not acknowledge TRANSPORT_RESET within {RESET_ACK_TIMEOUT:?}; \
                 delivering held packets"
            );
            self.rx_hold_until = None;
        }
        self.muxer.on_tick(now);
        self.process_queues();
    }

    /// A client or connection socket is ready.
    pub fn on_socket_event(&mut self, fd: RawFd, events: EventSet) {
        self.muxer.on_socket_event(fd, events);
        self.process_queues();
    }

    /// Brings the event loop's watch list and the timer in line with the muxer; call after every
    /// event.
    pub fn after_event(&mut self, ops: &mut EventOps) {
        self.sync_watch_list(ops);
        self.rearm_timer();
    }

    fn sync_watch_list(&mut self, ops: &mut EventOps) {
        let mut desired: HashMap<RawFd, EventSet> = self.muxer.watched_fds().collect();
        if self.active.is_some() {
            // Clients wait in the listen backlog until there are queues to serve them.
            desired.insert(self.muxer.listener_fd(), EventSet::IN);
        }
        self.watched.retain(|fd, set| {
            if desired.contains_key(fd) {
                return true;
            }
            if let Err(e) = ops.remove(Events::new_raw(*fd, *set)) {
                tracing::warn!("vsock: cannot unwatch fd {fd}: {e}");
            }
            false
        });
        for (fd, set) in desired {
            let result = match self.watched.get(&fd) {
                Some(old) if *old == set => continue,
                Some(_) => ops.modify(Events::new_raw(fd, set)),
                None => ops.add(Events::new_raw(fd, set)),
            };
            match result {
                Ok(()) => {
                    self.watched.insert(fd, set);
                }
                Err(e) => tracing::warn!("vsock: cannot watch fd {fd}: {e}"),
            }
        }
        // Only now that they are out of the watch list may their fd numbers be reused.
        self.muxer.close_released();
    }

    fn rearm_timer(&mut self) {
        let next = match (self.muxer.next_deadline(), self.rx_hold_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if next == self.timer_deadline {
            return;
        }
        self.timer_deadline = next;
        let result = match next {
            Some(deadline) => {
                let wait = deadline.saturating_duration_since(Instant::now());
                self.timer.reset(wait.max(Duration::from_millis(1)), None)
            }
            None => self.timer.clear(),
        };
        if let Err(e) = result {
            tracing::error!("vsock: cannot arm the connection timer: {e}");
        }
    }

    /// Takes guest packets off the TX queue and puts host packets on the RX queue until neither
    /// can make progress, then interrupts the guest if a queue it used asks for it.
    ///
    /// TX notifications (the guest's MMIO writes to QueueNotify, each a vCPU exit) stay
    /// suppressed while the device drains the queue; after re-enabling them it looks once more,
    /// so a packet added in between is not left waiting for a kick. The interrupt follows the
    /// driver's suppression: VRING_AVAIL_F_NO_INTERRUPT, or with VIRTIO_RING_F_EVENT_IDX the
    /// used_event index (virtio 1.2 §2.7.10).
    ///
    /// While packets for the guest are held (after a restore, until the guest handled
    /// TRANSPORT_RESET), RX buffers are not filled: the guest resets every connected socket when
    /// it handles the event, including ones completed just before (Firecracker issue #5882).
    fn process_queues(&mut self) {
        let rx_open = self.rx_hold_until.is_none();
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let (mut tx_used, mut rx_used) = (false, false);
        let mut rx_retry = true;
        loop {
            set_notifications(active, TXQ_INDEX, false);
            let tx = drain_tx(active, &mut self.muxer);
            let rx = rx_open && fill_rx(active, &mut self.muxer);
            tx_used |= tx.used;
            rx_used |= rx;
            // RX kicks stay on: with EVENT_IDX the driver kicks only past the avail_event the
            // device last published, so publish it after every fill (a device out of RX buffers
            // with packets pending waits for exactly that kick). Buffers added meanwhile are
            // used right away.
            if set_notifications(active, RXQ_INDEX, true) && self.muxer.has_pending_rx() {
                // Without progress it may be an avail index the queue refuses: look once only.
                if rx || std::mem::take(&mut rx_retry) {
                    continue;
                }
            }
            if tx.paused {
                // TX stopped because too many RSTs wait for RX buffers: go on only if RX made
                // room; the chains left over keep the guest's kicks coming.
                set_notifications(active, TXQ_INDEX, true);
                if rx {
                    continue;
                }
                break;
            }
            // More TX chains arrived while notifications were off. Without progress in this
            // round it is an avail index the queue refuses, and looping would spin.
            if !set_notifications(active, TXQ_INDEX, true) || !tx.used {
                break;
            }
        }
        let mut wants = |index: usize| {
            active.queues[index]
                .needs_notification(&active.mem)
                .unwrap_or(true)
        };
        // Both queues' used rings must be checked (each call records what was signalled).
        let tx_wants = tx_used && wants(TXQ_INDEX);
        let rx_wants = rx_used && wants(RXQ_INDEX);
        if tx_wants || rx_wants {
            if let Err(e) = active.interrupt.signal_used_queue() {
                tracing::error!("vsock: cannot interrupt the guest: {e}");
            }
        }
    }
}

/// Turns the driver's notifications of queue `index` off or on; when turning them on, whether
/// more chains are already available (so the caller must look again).
fn set_notifications(active: &mut Active, index: usize, enable: bool) -> bool {
    let queue = &mut active.queues[index];
    let result = if enable {
        queue.enable_notification(&active.mem)
    } else {
        queue.disable_notification(&active.mem).map(|()| false)
    };
    result.unwrap_or_else(|e| {
        tracing::warn!("vsock: cannot change notification suppression of queue {index}: {e}");
        false
    })
}

/// Result of draining the TX queue.
struct TxDrain {
    /// Some chains went to the used ring.
    used: bool,
    /// Stopped with chains left because the RST backlog is full.
    paused: bool,
}

/// Hands every available TX packet to the muxer. Each chain goes back to the used ring (length 0:
/// the device writes nothing into TX buffers), valid or not.
fn drain_tx(active: &mut Active, muxer: &mut Muxer) -> TxDrain {
    let mem = &active.mem;
    let queue = &mut active.queues[TXQ_INDEX];
    let mut used = false;
    loop {
        if muxer.rx_backlog_full() {
            return TxDrain { used, paused: true };
        }
        let Some(mut chain) = queue.pop_descriptor_chain(mem) else {
            return TxDrain {
                used,
                paused: false,
            };
        };
        let head = chain.head_index();
        let probe = chain.clone();
        match VsockPacket::from_tx_virtq_chain(mem, &mut chain, MAX_PKT_DATA) {
            Ok(pkt) => muxer.on_guest_packet(&Header::from_packet(&pkt), pkt.data_slice()),
            Err(e) => {
                tracing::debug!("vsock: malformed TX chain: {e}");
                if let Some(hdr) = header_of_rejected_chain(probe) {
                    muxer.on_rejected_packet(&hdr);
                }
            }
        }
        if let Err(e) = queue.add_used(mem, head, 0) {
            tracing::error!("vsock: cannot return a TX buffer: {e}");
        }
        used = true;
    }
}

/// Fills RX buffers with the muxer's packets while it has any. A malformed RX chain is returned
/// with length 0.
fn fill_rx(active: &mut Active, muxer: &mut Muxer) -> bool {
    let mem = &active.mem;
    let queue = &mut active.queues[RXQ_INDEX];
    let mut used = false;
    while muxer.has_pending_rx() {
        let Some(mut chain) = queue.pop_descriptor_chain(mem) else {
            break;
        };
        let head = chain.head_index();
        let len = match VsockPacket::from_rx_virtq_chain(mem, &mut chain, u32::MAX) {
            Ok(mut pkt) => match write_rx_packet(&mut pkt, muxer) {
                Some(len) => len,
                None => {
                    // Nothing to send after all: leave the buffer to the guest.
                    queue.go_to_previous_position();
                    break;
                }
            },
            Err(e) => {
                tracing::debug!("vsock: malformed RX chain: {e}");
                0
            }
        };
        if let Err(e) = queue.add_used(mem, head, len) {
            tracing::error!("vsock: cannot return an RX buffer: {e}");
        }
        used = true;
    }
    used
}

/// Asks the muxer for a packet and writes it into `pkt`; the used length, or `None` if the muxer
/// had nothing.
fn write_rx_packet<B: BitmapSlice>(pkt: &mut VsockPacket<'_, B>, muxer: &mut Muxer) -> Option<u32> {
    let data = pkt.data_slice()?.clone();
    let hdr = muxer.fill_rx(&data)?;
    if let Err(e) = pkt.set_header_from_raw(&hdr.to_bytes()) {
        tracing::error!("vsock: cannot write an RX header: {e}");
        return Some(0);
    }
    Some(HEADER_SIZE as u32 + hdr.len)
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        device_type::VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &VSOCK_QUEUE_SIZES
    }

    /// VIRTIO_F_VERSION_1 and VIRTIO_RING_F_EVENT_IDX (fewer notifications and interrupts,
    /// virtio 1.2 §2.7.10). Stream sockets are implied when no socket-type feature is negotiated
    /// (§5.10.3).
    fn avail_features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX
    }

    fn set_acked_features(&mut self, acked: u64) {
        self.acked_features = acked & self.avail_features();
    }

    /// The configuration space is `le64 guest_cid` (virtio 1.2 §5.10.4).
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    /// The configuration space is read-only.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            "vsock: ignoring a {}-byte config write at {offset}",
            data.len()
        );
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        let expected = VSOCK_QUEUE_SIZES.len();
        if ctx.queues.len() != expected || ctx.queue_evts.len() != expected {
            return Err(ActivateError::QueueCount {
                expected,
                got: ctx.queues.len().min(ctx.queue_evts.len()),
            });
        }
        if self.active.is_some() {
            return Err(ActivateError::Device("vsock is already active".into()));
        }
        self.active = Some(Active {
            mem: ctx.mem,
            queues: ctx.queues,
            queue_evts: ctx.queue_evts,
            interrupt: ctx.interrupt,
        });
        self.activate_evt.write(1).map_err(ActivateError::Signal)
    }

    /// Not supported: open connections and registered fds cannot be torn down from a vCPU
    /// thread. The device stays inert after a driver reset (as in Firecracker).
    fn reset(&mut self) -> bool {
        false
    }

    /// The rx, tx and event queues' positions. No chain is held between events (see the module
    /// documentation), so none is skipped.
    fn queue_positions(&self) -> Vec<QueuePosition> {
        self.active
            .iter()
            .flat_map(|active| active.queues.iter().map(QueuePosition::of))
            .collect()
    }

    fn device_state(&self) -> DeviceState {
        DeviceState::Vsock {
            guest_cid: self.guest_cid,
        }
    }

    /// Any vsock state is accepted: connections are not restored, and the driver re-reads the
    /// guest CID when it handles TRANSPORT_RESET (virtio 1.2 §5.10.6.6), so the CID may change.
    fn check_restore(&self, saved: &DeviceState) -> Result<(), String> {
        match saved {
            DeviceState::Vsock { guest_cid } => {
                if *guest_cid != self.guest_cid {
                    tracing::info!(
                        "vsock: guest CID changes from {guest_cid} to {} on restore",
                        self.guest_cid
                    );
                }
                Ok(())
            }
            other => Err(format!(
                "the snapshot's device is {other:?}, this VM's is vsock"
            )),
        }
    }

    /// Owes the guest a TRANSPORT_RESET event (its connections' host ends are gone) and holds
    /// packets for it until it has handled the event.
    fn restored(&mut self) {
        self.reset_event_pending = true;
        self.rx_hold_until = Some(Instant::now() + RESET_ACK_TIMEOUT);
    }
}

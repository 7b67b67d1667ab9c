//! One stream connection between a guest vsock socket and a host Unix stream: its state machine,
//! flow-control counters and the bytes waiting for the Unix side.
//!
//! Life of a connection (transitions are driven by guest packets, Unix socket readiness and the
//! muxer's clock):
//!
//! ```text
//!  host client "CONNECT p"              guest REQUEST to host port p
//!          |                                     |
//!          v                                     v
//!     LocalInit --guest RESPONSE--+     PeerInit --our RESPONSE delivered--+
//!          |                      |                                        |
//!  guest RST / timeout            +---------------> Established <----------+
//!          v                                            |
//!        (gone)                    client hung up (EOF + POLLHUP): SHUTDOWN(both) sent
//!                                                       v
//!                                                    Closing --guest RST/SHUTDOWN or timeout--> (gone)
//! ```
//!
//! In `Established`, half-closes are tracked in [`HalfClose`]. Any protocol violation or socket
//! error ends the connection with an RST ([`Verdict::Reset`]).
//!
//! Credit (virtio 1.2 §5.10.6, flow control): as a receiver we advertise [`CONN_BUF_SIZE`] and
//! count what we have forwarded to the Unix socket in `fwd_cnt`; the guest must not have more than
//! `buf_alloc` bytes in flight, so `to_unix` never holds more than [`CONN_BUF_SIZE`] bytes. As a
//! sender we never put more bytes on the wire than `peer_buf_alloc - (tx_cnt - peer_fwd_cnt)`.

use std::collections::VecDeque;
use std::io;
use std::net::Shutdown;
use std::num::Wrapping;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use event_manager::EventSet;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{ReadVolatile, VolatileSlice};

use super::packet::{Header, Op, SHUTDOWN_BOTH, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM};
use super::unix::{peer_hung_up, send_nosignal};
use super::{CONN_BUF_SIZE, CREDIT_UPDATE_THRESHOLD, MAX_PKT_DATA, SHUTDOWN_TIMEOUT};

/// Identifies a connection: (host-side port, guest-side port). The CIDs are fixed per device.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct ConnKey {
    /// Port on the host side (`dst_port` of guest packets).
    pub local_port: u32,
    /// Port on the guest side (`src_port` of guest packets).
    pub peer_port: u32,
}

impl ConnKey {
    /// The connection a guest packet belongs to.
    pub fn of_guest_packet(hdr: &Header) -> ConnKey {
        ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        }
    }
}

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    /// Host-initiated: the client sent `CONNECT <port>`; our REQUEST is queued or with the guest,
    /// which must answer before `deadline`.
    LocalInit {
        /// When an unanswered REQUEST is given up (RST to the guest, client closed).
        deadline: Instant,
    },
    /// Guest-initiated: the Unix socket is connected; our RESPONSE has not reached the guest yet.
    PeerInit,
    /// Data may flow, subject to the half-closes recorded.
    Established(HalfClose),
    /// The host client hung up; we sent SHUTDOWN(RCV|SEND) and wait for the guest's RST.
    Closing {
        /// When we stop waiting and send the RST ourselves.
        deadline: Instant,
    },
}

/// Half-close bookkeeping of an established connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HalfClose {
    /// The guest sent SHUTDOWN with SEND: no more guest data will come.
    pub peer_done_sending: bool,
    /// The guest sent SHUTDOWN with RCV: it accepts no more data.
    pub peer_done_receiving: bool,
    /// The Unix peer shut its write side; we told the guest with SHUTDOWN(SEND).
    pub local_done_sending: bool,
    /// We applied shutdown(Write) to the Unix socket after flushing the guest's data.
    pub unix_write_shut: bool,
}

/// What the muxer must do with a connection after an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Keep it.
    Keep,
    /// Remove it and send an RST to the guest.
    Reset,
    /// Remove it silently (the guest already reset it).
    Drop,
}

/// The result of asking a connection for its next packet to the guest.
#[derive(Debug, PartialEq, Eq)]
pub enum RxFill {
    /// A packet was produced; its data (if `len > 0`) is already in the buffer given.
    Packet(Header),
    /// Nothing to send right now.
    Empty,
    /// The connection failed; remove it and send an RST.
    Reset,
}

/// Packets owed to the guest, sent in this priority order.
#[derive(Clone, Copy, Debug, Default)]
struct Pending {
    request: bool,
    response: bool,
    credit_update: bool,
    /// The Unix socket may have data for the guest.
    rw: bool,
    credit_request: bool,
}

/// One connection.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    key: ConnKey,
    state: ConnState,
    pending: Pending,
    /// Guest data not yet written to the Unix socket (at most [`CONN_BUF_SIZE`] bytes).
    to_unix: VecDeque<u8>,
    /// Guest data bytes received.
    rx_cnt: Wrapping<u32>,
    /// Guest data bytes written to the Unix socket (our `fwd_cnt`).
    fwd_cnt: Wrapping<u32>,
    /// The `fwd_cnt` carried by the last packet we sent, i.e. the guest's view of it.
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Data bytes sent to the guest.
    tx_cnt: Wrapping<u32>,
    /// The guest's receive buffer size, from its latest packet.
    peer_buf_alloc: u32,
    /// The guest's `fwd_cnt`, from its latest packet.
    peer_fwd_cnt: Wrapping<u32>,
    /// A CREDIT_REQUEST went out since the credit last ran dry.
    credit_requested: bool,
    /// Whether the muxer has this connection in its ready queue.
    pub queued: bool,
}

impl Connection {
    /// A host-initiated connection whose REQUEST is to be sent to guest port `key.peer_port`.
    pub fn local_init(stream: UnixStream, key: ConnKey, deadline: Instant) -> Self {
        let mut conn = Connection::new(stream, key, ConnState::LocalInit { deadline });
        conn.pending.request = true;
        conn
    }

    /// A guest-initiated connection (REQUEST `hdr`) whose Unix side is connected; the RESPONSE is
    /// to be sent.
    pub fn peer_init(stream: UnixStream, hdr: &Header) -> Self {
        let mut conn = Connection::new(stream, ConnKey::of_guest_packet(hdr), ConnState::PeerInit);
        conn.update_peer_credit(hdr);
        conn.pending.response = true;
        conn
    }

    fn new(stream: UnixStream, key: ConnKey, state: ConnState) -> Self {
        Connection {
            stream,
            key,
            state,
            pending: Pending::default(),
            to_unix: VecDeque::new(),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            tx_cnt: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            credit_requested: false,
            queued: false,
        }
    }

    /// The connection's key.
    pub fn key(&self) -> ConnKey {
        self.key
    }

    /// The current state.
    pub fn state(&self) -> ConnState {
        self.state
    }

    /// Gives up the Unix stream (to be closed once it is out of the event loop's watch list).
    pub fn into_stream(self) -> UnixStream {
        self.stream
    }

    /// The Unix stream's fd.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Whether the connection owes the guest a packet.
    pub fn has_pending_rx(&self) -> bool {
        let p = &self.pending;
        p.request || p.response || p.credit_update || p.rw || p.credit_request
    }

    /// The readiness to watch the Unix socket for; empty means "do not watch".
    pub fn interest(&self) -> EventSet {
        let mut set = EventSet::empty();
        if self.may_read_unix() && !self.pending.rw {
            set |= EventSet::IN;
        }
        if matches!(self.state, ConnState::Established(_)) && !self.to_unix.is_empty() {
            set |= EventSet::OUT;
        }
        set
    }

    /// When the connection times out, if it can.
    pub fn deadline(&self) -> Option<Instant> {
        match self.state {
            ConnState::LocalInit { deadline } | ConnState::Closing { deadline } => Some(deadline),
            _ => None,
        }
    }

    /// Whether the connection's handshake or close is overdue at `now` (it then ends in an RST).
    pub fn expired(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|deadline| deadline <= now)
    }

    /// Bytes the guest can still accept on this connection.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn update_peer_credit(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if self.peer_credit() > 0 {
            self.credit_requested = false;
        }
    }

    /// Whether host data may be read from the Unix socket for the guest now.
    fn may_read_unix(&self) -> bool {
        match self.state {
            ConnState::Established(hc) => {
                !hc.local_done_sending && !hc.peer_done_receiving && self.peer_credit() > 0
            }
            _ => false,
        }
    }

    /// Handles one validated guest packet (type STREAM, from the guest CID to the host CID) for
    /// this connection. `data` is the payload of RW packets.
    pub fn on_guest_packet<B: BitmapSlice>(
        &mut self,
        op: Op,
        hdr: &Header,
        data: Option<&VolatileSlice<'_, B>>,
    ) -> Verdict {
        self.update_peer_credit(hdr);
        match op {
            Op::Request => self.reset("REQUEST on an existing connection"),
            Op::Response => self.on_response(),
            Op::Rst => {
                tracing::debug!(
                    "vsock {:?} in {:?}: RST from the guest",
                    self.key,
                    self.state
                );
                Verdict::Drop
            }
            Op::Shutdown => self.on_shutdown(hdr.flags),
            Op::Rw => self.on_rw(data),
            Op::CreditUpdate => Verdict::Keep,
            Op::CreditRequest => {
                self.pending.credit_update = true;
                Verdict::Keep
            }
        }
    }

    /// LocalInit → Established: tell the client which host port it got.
    fn on_response(&mut self) -> Verdict {
        if !matches!(self.state, ConnState::LocalInit { .. }) {
            return self.reset("RESPONSE outside the handshake");
        }
        let reply = format!("OK {}\n", self.key.local_port);
        // The client has not been sent anything before, so its receive buffer takes these few
        // bytes at once; a short write means the client is gone.
        match send_nosignal(&self.stream, reply.as_bytes()) {
            Ok(n) if n == reply.len() => {
                self.state = ConnState::Established(HalfClose::default());
                Verdict::Keep
            }
            _ => self.reset("the client left before the guest answered"),
        }
    }

    fn on_shutdown(&mut self, flags: u32) -> Verdict {
        let ConnState::Established(mut hc) = self.state else {
            // Shutting down a connection that is not up (or answering our own SHUTDOWN while
            // Closing): the guest expects an RST.
            return self.reset("SHUTDOWN of a connection that is not established");
        };
        if flags & SHUTDOWN_RCV != 0 && !hc.peer_done_receiving {
            hc.peer_done_receiving = true;
            self.pending.rw = false;
            // Further client writes now fail with EPIPE instead of piling up unread.
            let _ = self.stream.shutdown(Shutdown::Read);
        }
        hc.peer_done_sending |= flags & SHUTDOWN_SEND != 0;
        self.state = ConnState::Established(hc);
        self.flush()
    }

    fn on_rw<B: BitmapSlice>(&mut self, data: Option<&VolatileSlice<'_, B>>) -> Verdict {
        let hc = match self.state {
            ConnState::Established(hc) => hc,
            // The client is gone; the guest just has not seen our SHUTDOWN yet.
            ConnState::Closing { .. } => return Verdict::Keep,
            _ => return self.reset("RW before the connection is established"),
        };
        let Some(data) = data else {
            return Verdict::Keep;
        };
        if hc.peer_done_sending {
            return self.reset("RW after the guest's SHUTDOWN(SEND)");
        }
        if self.to_unix.len() + data.len() > CONN_BUF_SIZE as usize {
            return self.reset("RW beyond the credit we gave");
        }
        let mut bytes = vec![0u8; data.len()];
        data.copy_to(&mut bytes[..]);
        self.rx_cnt += Wrapping(bytes.len() as u32);
        self.to_unix.extend(bytes);
        self.flush()
    }

    /// Writes buffered guest data to the Unix socket until it would block, then applies the
    /// guest's half-closes that were waiting for the buffer to drain.
    fn flush(&mut self) -> Verdict {
        while !self.to_unix.is_empty() {
            let (front, _) = self.to_unix.as_slices();
            match send_nosignal(&self.stream, front) {
                Ok(n) => {
                    self.to_unix.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!("vsock {:?}: writing to the Unix socket: {e}", self.key);
                    return Verdict::Reset;
                }
            }
        }
        if self.guest_view_of_free_space() < CREDIT_UPDATE_THRESHOLD
            && self.fwd_cnt != self.last_fwd_cnt_sent
        {
            self.pending.credit_update = true;
        }
        self.apply_peer_half_close()
    }

    /// Free receive space as the guest last heard it from us.
    fn guest_view_of_free_space(&self) -> u32 {
        CONN_BUF_SIZE.saturating_sub((self.rx_cnt - self.last_fwd_cnt_sent).0)
    }

    fn apply_peer_half_close(&mut self) -> Verdict {
        let ConnState::Established(mut hc) = self.state else {
            return Verdict::Keep;
        };
        if !self.to_unix.is_empty() {
            return Verdict::Keep;
        }
        if hc.peer_done_sending && hc.peer_done_receiving {
            // Full shutdown by the guest and all its data delivered: the reply is an RST.
            tracing::debug!("vsock {:?}: closed by the guest", self.key);
            return Verdict::Reset;
        }
        if hc.peer_done_sending && !hc.unix_write_shut {
            tracing::trace!("vsock {:?}: shutting the Unix write side", self.key);
            let _ = self.stream.shutdown(Shutdown::Write);
            hc.unix_write_shut = true;
            self.state = ConnState::Established(hc);
        }
        Verdict::Keep
    }

    /// Handles readiness of the Unix socket.
    pub fn on_unix_event(&mut self, events: EventSet) -> Verdict {
        if events.contains(EventSet::ERROR) {
            return self.reset("error on the Unix socket");
        }
        if events.intersects(EventSet::OUT | EventSet::HANG_UP) && !self.to_unix.is_empty() {
            let verdict = self.flush();
            if verdict != Verdict::Keep {
                return verdict;
            }
        }
        if events.intersects(EventSet::IN | EventSet::HANG_UP) && self.may_read_unix() {
            self.pending.rw = true;
        }
        Verdict::Keep
    }

    /// Produces the next packet for the guest. `data` is the RX buffer's payload area, filled
    /// straight from the Unix socket for RW packets.
    pub fn next_rx<B: BitmapSlice>(&mut self, data: &VolatileSlice<'_, B>) -> RxFill {
        if self.pending.request {
            self.pending.request = false;
            return RxFill::Packet(self.header(Op::Request, 0, 0));
        }
        if self.pending.response {
            self.pending.response = false;
            self.state = ConnState::Established(HalfClose::default());
            return RxFill::Packet(self.header(Op::Response, 0, 0));
        }
        if self.pending.credit_update {
            self.pending.credit_update = false;
            return RxFill::Packet(self.header(Op::CreditUpdate, 0, 0));
        }
        if self.pending.rw {
            match self.read_unix(data) {
                RxFill::Empty => {}
                other => return other,
            }
        }
        if self.pending.credit_request {
            self.pending.credit_request = false;
            return RxFill::Packet(self.header(Op::CreditRequest, 0, 0));
        }
        RxFill::Empty
    }

    /// Reads host data into `data`, bounded by the guest's credit.
    fn read_unix<B: BitmapSlice>(&mut self, data: &VolatileSlice<'_, B>) -> RxFill {
        if !self.may_read_unix() {
            self.pending.rw = false;
            return RxFill::Empty;
        }
        let max = self
            .peer_credit()
            .min(MAX_PKT_DATA)
            .min(u32::try_from(data.len()).unwrap_or(u32::MAX)) as usize;
        if max == 0 {
            return RxFill::Empty;
        }
        let Ok(mut window) = data.subslice(0, max) else {
            return RxFill::Empty;
        };
        match self.stream.read_volatile(&mut window) {
            Ok(0) => {
                self.pending.rw = false;
                self.on_unix_eof()
            }
            Ok(n) => {
                self.tx_cnt += Wrapping(n as u32);
                if n < max || self.peer_credit() == 0 {
                    // Drained for now; epoll says when there is more.
                    self.pending.rw = false;
                }
                if self.peer_credit() == 0 && !self.credit_requested {
                    self.credit_requested = true;
                    self.pending.credit_request = true;
                }
                RxFill::Packet(self.header(Op::Rw, n as u32, 0))
            }
            Err(vm_memory::VolatileMemoryError::IOError(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                self.pending.rw = false;
                RxFill::Empty
            }
            Err(e) => {
                tracing::debug!("vsock {:?}: reading the Unix socket: {e}", self.key);
                RxFill::Reset
            }
        }
    }

    /// The client shut its write side (or hung up): tell the guest.
    fn on_unix_eof(&mut self) -> RxFill {
        let ConnState::Established(mut hc) = self.state else {
            return RxFill::Empty;
        };
        if peer_hung_up(&self.stream) {
            self.to_unix.clear();
            self.state = ConnState::Closing {
                deadline: Instant::now() + SHUTDOWN_TIMEOUT,
            };
            return RxFill::Packet(self.header(Op::Shutdown, 0, SHUTDOWN_BOTH));
        }
        hc.local_done_sending = true;
        self.state = ConnState::Established(hc);
        RxFill::Packet(self.header(Op::Shutdown, 0, SHUTDOWN_SEND))
    }

    /// Logs why the connection ends with an RST and says so.
    fn reset(&self, reason: &str) -> Verdict {
        tracing::debug!("vsock {:?} in {:?}: RST: {reason}", self.key, self.state);
        Verdict::Reset
    }

    /// A header from the host side of this connection (the muxer fills in the CIDs).
    fn header(&mut self, op: Op, len: u32, flags: u32) -> Header {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        Header {
            src_port: self.key.local_port,
            dst_port: self.key.peer_port,
            len,
            type_: TYPE_STREAM,
            op: op as u16,
            flags,
            buf_alloc: CONN_BUF_SIZE,
            fwd_cnt: self.fwd_cnt.0,
            ..Header::default()
        }
    }
}

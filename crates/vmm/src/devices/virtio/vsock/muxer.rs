//! The host side of the device: the listener at `uds_path`, host clients that have not finished
//! their `CONNECT <port>` line yet, the connection table, and the packets owed to the guest.
//!
//! The muxer never blocks: every socket is non-blocking, and it tells the event loop which file
//! descriptors to watch ([`Muxer::watched_fds`]). Streams of connections that ended are kept open
//! until the event loop has stopped watching them ([`Muxer::close_released`]), so a recycled fd
//! number can never be confused with an old registration.
//!
//! Packets for the guest are produced lazily, one per RX buffer ([`Muxer::fill_rx`]): RSTs first,
//! then connections in round-robin order, one packet each, so one busy connection cannot starve
//! the others.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Instant;

use event_manager::EventSet;
use vm_memory::bitmap::BitmapSlice;
use vm_memory::VolatileSlice;

use super::connection::{ConnKey, ConnState, Connection, RxFill, Verdict};
use super::packet::{Header, Op, TYPE_STREAM};
use super::unix::{connect_nonblocking, port_path, HostListener};
use super::{
    Error, CONNECT_TIMEOUT, FIRST_LOCAL_PORT, HOST_CID, MAX_CONNECTIONS, MAX_CONNECT_LINE,
    RST_BACKLOG_LIMIT,
};

/// Most clients accepted per listener event (the rest wait for the next round).
const ACCEPT_BATCH: usize = 32;

/// A host client that connected to `uds_path` and is still sending `CONNECT <port>\n`.
#[derive(Debug)]
struct Handshake {
    stream: UnixStream,
    line: Vec<u8>,
    deadline: Instant,
}

/// Outcome of reading a client's connect line.
enum LineRead {
    /// Not complete yet.
    Pending,
    /// A valid `CONNECT <port>`.
    Port(u32),
    /// Garbage, too long, or the client went away.
    Invalid,
}

impl Handshake {
    /// Reads the line one byte at a time, so that bytes the client sends after the newline stay in
    /// the socket for the guest.
    fn read_line(&mut self) -> LineRead {
        loop {
            let mut byte = [0u8; 1];
            match self.stream.read(&mut byte) {
                Ok(0) => return LineRead::Invalid,
                Ok(_) if byte[0] == b'\n' => {
                    return parse_connect_line(&self.line).map_or(LineRead::Invalid, LineRead::Port)
                }
                Ok(_) if self.line.len() + 1 >= MAX_CONNECT_LINE => return LineRead::Invalid,
                Ok(_) => self.line.push(byte[0]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return LineRead::Pending,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return LineRead::Invalid,
            }
        }
    }
}

/// Parses `CONNECT <port>` (the newline already stripped; surrounding whitespace tolerated).
fn parse_connect_line(line: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(line).ok()?;
    let mut words = text.split_whitespace();
    match (words.next(), words.next(), words.next()) {
        (Some("CONNECT"), Some(port), None) => port.parse().ok(),
        _ => None,
    }
}

/// The connection table and the Unix-socket side of the device.
#[derive(Debug)]
pub struct Muxer {
    guest_cid: u64,
    listener: HostListener,
    handshakes: HashMap<RawFd, Handshake>,
    conns: HashMap<ConnKey, Connection>,
    by_fd: HashMap<RawFd, ConnKey>,
    /// Connections that owe the guest a packet, in service order.
    ready: VecDeque<ConnKey>,
    /// RSTs owed to the guest for connections that are already gone (or never existed).
    rsts: VecDeque<Header>,
    /// Streams of ended connections/handshakes, closed once no longer watched.
    released: Vec<UnixStream>,
    next_local_port: u32,
}

impl Muxer {
    /// Creates the listener at `uds_path` for a guest with CID `guest_cid`.
    ///
    /// # Errors
    /// See [`HostListener::bind`].
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, Error> {
        Ok(Muxer {
            guest_cid,
            listener: HostListener::bind(uds_path)?,
            handshakes: HashMap::new(),
            conns: HashMap::new(),
            by_fd: HashMap::new(),
            ready: VecDeque::new(),
            rsts: VecDeque::new(),
            released: Vec::new(),
            next_local_port: FIRST_LOCAL_PORT,
        })
    }

    /// The host listener's path.
    pub fn uds_path(&self) -> &Path {
        self.listener.path()
    }

    /// The host listener's fd.
    pub fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// Number of live connections (not counting clients still sending their connect line).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// The state of connection `key`, if it exists.
    pub fn connection_state(&self, key: ConnKey) -> Option<ConnState> {
        self.conns.get(&key).map(Connection::state)
    }

    /// The guest's remaining credit on connection `key`, in bytes.
    pub fn peer_credit(&self, key: ConnKey) -> Option<u32> {
        self.conns.get(&key).map(Connection::peer_credit)
    }

    fn socket_count(&self) -> usize {
        self.conns.len() + self.handshakes.len()
    }

    /// Accepts waiting host clients; past [`MAX_CONNECTIONS`] they are closed at once.
    pub fn accept_clients(&mut self) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok(Some(stream)) if self.socket_count() < MAX_CONNECTIONS => {
                    let handshake = Handshake {
                        stream,
                        line: Vec::new(),
                        deadline: Instant::now() + CONNECT_TIMEOUT,
                    };
                    self.handshakes
                        .insert(handshake.stream.as_raw_fd(), handshake);
                }
                Ok(Some(stream)) => {
                    tracing::warn!("vsock: {MAX_CONNECTIONS} connections open, refusing a client");
                    drop(stream);
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("vsock: accept on {}: {e}", self.uds_path().display());
                    return;
                }
            }
        }
    }

    /// Handles readiness of a client or connection socket.
    pub fn on_socket_event(&mut self, fd: RawFd, events: EventSet) {
        if self.handshakes.contains_key(&fd) {
            self.on_handshake_readable(fd);
        } else if let Some(&key) = self.by_fd.get(&fd) {
            if let Some(conn) = self.conns.get_mut(&key) {
                let verdict = conn.on_unix_event(events);
                self.apply(key, verdict);
            }
        }
    }

    fn on_handshake_readable(&mut self, fd: RawFd) {
        let Some(handshake) = self.handshakes.get_mut(&fd) else {
            return;
        };
        let outcome = handshake.read_line();
        if matches!(outcome, LineRead::Pending) {
            return;
        }
        let Some(handshake) = self.handshakes.remove(&fd) else {
            return;
        };
        match outcome {
            LineRead::Port(port) => self.open_host_conn(handshake.stream, port),
            _ => self.released.push(handshake.stream),
        }
    }

    /// Starts a host-initiated connection to guest port `peer_port`.
    fn open_host_conn(&mut self, stream: UnixStream, peer_port: u32) {
        let Some(local_port) = self.allocate_local_port() else {
            self.released.push(stream);
            return;
        };
        let key = ConnKey {
            local_port,
            peer_port,
        };
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        self.insert(Connection::local_init(stream, key, deadline));
    }

    /// The next host port, counting up from [`FIRST_LOCAL_PORT`], that no connection uses.
    fn allocate_local_port(&mut self) -> Option<u32> {
        for _ in 0..=MAX_CONNECTIONS {
            let port = self.next_local_port;
            self.next_local_port = port.checked_add(1).unwrap_or(FIRST_LOCAL_PORT);
            if !self.conns.keys().any(|k| k.local_port == port) {
                return Some(port);
            }
        }
        None
    }

    /// Handles a packet the guest put on the TX queue. `data` is the RW payload, if any.
    pub fn on_guest_packet<B: BitmapSlice>(
        &mut self,
        hdr: &Header,
        data: Option<&VolatileSlice<'_, B>>,
    ) {
        if hdr.src_cid != self.guest_cid {
            tracing::debug!(
                "vsock: dropping a packet with spoofed src_cid {}",
                hdr.src_cid
            );
            return;
        }
        let op = match hdr.operation() {
            Some(op) if hdr.dst_cid == HOST_CID && hdr.type_ == TYPE_STREAM => op,
            _ => return self.reject(hdr),
        };
        let key = ConnKey::of_guest_packet(hdr);
        match self.conns.get_mut(&key) {
            Some(conn) => {
                let verdict = conn.on_guest_packet(op, hdr, data);
                self.apply(key, verdict);
            }
            None => match op {
                Op::Request => self.open_guest_conn(hdr),
                Op::Rst => {}
                _ => self.queue_rst(hdr),
            },
        }
    }

    /// Handles a TX chain that failed validation but whose header could be read: the connection
    /// it names (if any) is reset.
    pub fn on_rejected_packet(&mut self, hdr: &Header) {
        if hdr.src_cid == self.guest_cid {
            self.reject(hdr);
        }
    }

    /// Answers an invalid packet: RST (never to an RST) and the end of its connection.
    fn reject(&mut self, hdr: &Header) {
        let key = ConnKey::of_guest_packet(hdr);
        tracing::debug!("vsock {key:?}: rejecting guest packet {hdr:?}");
        let is_rst = hdr.operation() == Some(Op::Rst);
        if hdr.dst_cid == HOST_CID && self.conns.contains_key(&key) {
            self.remove(key, !is_rst);
        } else if !is_rst {
            self.queue_rst(hdr);
        }
    }

    /// A guest REQUEST to host port P: connect to `<uds_path>_P`.
    fn open_guest_conn(&mut self, hdr: &Header) {
        if self.socket_count() >= MAX_CONNECTIONS {
            tracing::warn!("vsock: {MAX_CONNECTIONS} connections open, refusing the guest");
            return self.queue_rst(hdr);
        }
        let path = port_path(self.uds_path(), hdr.dst_port);
        match connect_nonblocking(&path) {
            Ok(stream) => self.insert(Connection::peer_init(stream, hdr)),
            Err(e) => {
                tracing::debug!("vsock: guest connect to {}: {e}", path.display());
                self.queue_rst(hdr);
            }
        }
    }

    fn insert(&mut self, conn: Connection) {
        let key = conn.key();
        self.by_fd.insert(conn.fd(), key);
        self.conns.insert(key, conn);
        self.requeue(key);
    }

    fn apply(&mut self, key: ConnKey, verdict: Verdict) {
        match verdict {
            Verdict::Keep => self.requeue(key),
            Verdict::Reset => self.remove(key, true),
            Verdict::Drop => self.remove(key, false),
        }
    }

    /// Puts `key` in the ready queue if it owes the guest a packet and is not there yet.
    fn requeue(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.get_mut(&key) {
            if conn.has_pending_rx() && !conn.queued {
                conn.queued = true;
                self.ready.push_back(key);
            }
        }
    }

    fn remove(&mut self, key: ConnKey, send_rst: bool) {
        let Some(conn) = self.conns.remove(&key) else {
            return;
        };
        tracing::trace!("vsock {key:?}: removed (rst {send_rst})");
        self.by_fd.remove(&conn.fd());
        if conn.queued {
            self.ready.retain(|k| *k != key);
        }
        self.released.push(conn.into_stream());
        if send_rst {
            self.rsts.push_back(self.host_header(key, Op::Rst));
        }
    }

    /// Queues an RST answering guest packet `hdr`, from the address it was sent to.
    fn queue_rst(&mut self, hdr: &Header) {
        let mut rst = self.host_header(ConnKey::of_guest_packet(hdr), Op::Rst);
        rst.src_cid = hdr.dst_cid;
        self.rsts.push_back(rst);
    }

    fn host_header(&self, key: ConnKey, op: Op) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            type_: TYPE_STREAM,
            op: op as u16,
            ..Header::default()
        }
    }

    /// Whether a packet for the guest may be waiting.
    pub fn has_pending_rx(&self) -> bool {
        !self.rsts.is_empty() || !self.ready.is_empty()
    }

    /// Whether so many RSTs wait for RX buffers that the device should stop taking guest packets
    /// (each may add one more) until the guest posts buffers.
    pub fn rx_backlog_full(&self) -> bool {
        self.rsts.len() >= RST_BACKLOG_LIMIT
    }

    /// Produces the next packet for the guest, writing any payload into `data` (the RX buffer's
    /// data area). `None` when nothing can be sent now.
    pub fn fill_rx<B: BitmapSlice>(&mut self, data: &VolatileSlice<'_, B>) -> Option<Header> {
        let mut budget = self.ready.len();
        loop {
            if let Some(rst) = self.rsts.pop_front() {
                return Some(rst);
            }
            if budget == 0 {
                return None;
            }
            budget -= 1;
            let key = self.ready.pop_front()?;
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            conn.queued = false;
            match conn.next_rx(data) {
                RxFill::Packet(mut hdr) => {
                    hdr.src_cid = HOST_CID;
                    hdr.dst_cid = self.guest_cid;
                    self.requeue(key);
                    return Some(hdr);
                }
                RxFill::Empty => self.requeue(key),
                RxFill::Reset => self.remove(key, true),
            }
        }
    }

    /// Expires handshakes and connections whose deadline is at or before `now`.
    pub fn on_tick(&mut self, now: Instant) {
        let stale: Vec<RawFd> = self
            .handshakes
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(fd, _)| *fd)
            .collect();
        for fd in stale {
            if let Some(handshake) = self.handshakes.remove(&fd) {
                self.released.push(handshake.stream);
            }
        }
        let expired: Vec<ConnKey> = self
            .conns
            .values()
            .filter(|c| c.expired(now))
            .map(|c| c.key())
            .collect();
        for key in expired {
            tracing::debug!("vsock {key:?}: handshake or close timed out");
            self.remove(key, true);
        }
    }

    /// The earliest deadline of any handshake or connection.
    pub fn next_deadline(&self) -> Option<Instant> {
        let handshakes = self.handshakes.values().map(|h| h.deadline);
        let conns = self.conns.values().filter_map(Connection::deadline);
        handshakes.chain(conns).min()
    }

    /// The sockets to watch and for what; sockets not listed must not be watched.
    pub fn watched_fds(&self) -> impl Iterator<Item = (RawFd, EventSet)> + '_ {
        let handshakes = self.handshakes.keys().map(|fd| (*fd, EventSet::IN));
        let conns = self
            .conns
            .values()
            .map(|c| (c.fd(), c.interest()))
            .filter(|(_, set)| !set.is_empty());
        handshakes.chain(conns)
    }

    /// Closes the streams of ended connections; call once they are no longer watched.
    pub fn close_released(&mut self) {
        self.released.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_line_parses_port_and_rejects_garbage() {
        assert_eq!(parse_connect_line(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect_line(b"CONNECT 4294967295\r"), Some(u32::MAX));
        assert_eq!(parse_connect_line(b"CONNECT"), None);
        assert_eq!(parse_connect_line(b"CONNECT 4294967296"), None);
        assert_eq!(parse_connect_line(b"CONNECT 52 53"), None);
        assert_eq!(parse_connect_line(b"connect 52"), None);
        assert_eq!(parse_connect_line(b"\xff\xfe"), None);
    }
}

//! The guest's one way out: a TCP listener on `127.0.0.1:3128` ([`GUEST_PROXY_PORT`]) whose
//! every connection is carried, byte for byte, over virtio-vsock to the host's egress proxy
//! (CID 2, port [`EGRESS_PORT`]).
//!
//! A sandbox has no network device, so no packet can leave it: no route, no DNS, no UDP. With
//! `bulkhead.egress=on` on the kernel command line the agent brings the loopback interface up and
//! starts this relay; the commands it runs get `HTTP_PROXY`/`HTTPS_PROXY` pointing here (the
//! host sets them), and everything they ask for is decided on the host. The relay itself
//! understands nothing of what it carries.
//!
//! At most [`MAX_RELAYS`] connections are relayed at once (the host's proxy has the same limit);
//! one more is closed at once.

use std::fs::File;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;

use bulkhead_protocol::{EGRESS_PORT, GUEST_PROXY_PORT};

use crate::{log, vsock};

/// Most connections relayed at once.
pub const MAX_RELAYS: usize = 256;

/// Stack of each relay thread: they only copy through a heap buffer.
const THREAD_STACK: usize = 64 * 1024;

/// Where relayed connections go.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// The host's proxy over vsock (PID-1 mode): CID 2, port [`EGRESS_PORT`].
    Vsock,
    /// A Unix socket (test mode).
    Unix(PathBuf),
}

impl Upstream {
    fn connect(&self) -> io::Result<OwnedFd> {
        match self {
            Upstream::Vsock => vsock::connect(vsock::HOST_CID, EGRESS_PORT),
            Upstream::Unix(path) => UnixStream::connect(path).map(OwnedFd::from),
        }
    }
}

/// Whether this guest's relay ([`start_guest_relay`]) runs.
static GUEST_RELAY: Mutex<bool> = Mutex::new(false);

/// Starts the guest's relay, `127.0.0.1:3128` → the host's proxy over vsock, unless it already
/// runs: at boot for `bulkhead.egress=on`, and when a restored guest is told that its host now
/// runs a proxy (`RestoredRequest::egress`; the snapshot's guest may have booted with the relay
/// or without it). Brings the loopback interface up first. The same thread-mask rule as for
/// [`start`] applies.
///
/// # Errors
/// When the loopback interface cannot be brought up or the listener cannot be bound.
pub fn start_guest_relay() -> io::Result<()> {
    let mut running = GUEST_RELAY.lock().unwrap_or_else(PoisonError::into_inner);
    if *running {
        return Ok(());
    }
    loopback_up()?;
    start(guest_address(), Upstream::Vsock)?;
    *running = true;
    Ok(())
}

/// The relay's listening address in the guest: `127.0.0.1:3128`.
pub fn guest_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], GUEST_PROXY_PORT))
}

/// Listens on `address` and relays every connection to `upstream`, on a thread of its own.
/// Call it after the reaper started (`crate::reaper::start`): the threads it makes inherit the
/// signal mask with SIGCHLD blocked, which only the reaper may take.
///
/// # Errors
/// When the listener cannot be bound (e.g. the loopback interface is down).
pub fn start(address: SocketAddr, upstream: Upstream) -> io::Result<()> {
    let listener = TcpListener::bind(address)?;
    let live = Arc::new(AtomicUsize::new(0));
    thread::Builder::new()
        .name("egress".into())
        .spawn(move || accept_loop(&listener, &upstream, &live))?;
    Ok(())
}

fn accept_loop(listener: &TcpListener, upstream: &Upstream, live: &Arc<AtomicUsize>) {
    for client in listener.incoming() {
        let client = match client {
            Ok(client) => client,
            Err(e) => {
                log!("egress: accept: {e}");
                continue;
            }
        };
        if live.fetch_add(1, Ordering::SeqCst) >= MAX_RELAYS {
            live.fetch_sub(1, Ordering::SeqCst);
            log!("egress: more than {MAX_RELAYS} connections; refusing one");
            continue;
        }
        let (upstream, live) = (upstream.clone(), Arc::clone(live));
        let spawned = thread::Builder::new()
            .name("egress-relay".into())
            .stack_size(THREAD_STACK)
            .spawn(move || {
                if let Err(e) = relay(client, &upstream) {
                    log!("egress: relay: {e}");
                }
                live.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            log!("egress: no thread for a connection: {e}");
        }
    }
}

/// Copies both ways between `client` and a new connection to `upstream` until both directions
/// reached end of file (each end's write side is shut down when its source ends).
fn relay(client: TcpStream, upstream: &Upstream) -> io::Result<()> {
    let host = match upstream.connect() {
        Ok(host) => File::from(host),
        Err(e) => {
            let _ = client.shutdown(Shutdown::Both);
            return Err(e);
        }
    };
    pump(client, host)
}

/// Copies both ways between the guest TCP connection `client` and the host connection `host`
/// (vsock or Unix stream) until both directions ended ([`bulkhead_protocol::relay::pump`]).
/// Used by the egress relay and by ingress ([`crate::ingress`]).
///
/// # Errors
/// A read or write error other than the peer going away.
pub fn pump(client: TcpStream, host: File) -> io::Result<()> {
    bulkhead_protocol::relay::pump(OwnedFd::from(client), OwnedFd::from(host))
}

/// Brings the loopback interface (`lo`) up, so `127.0.0.1` can be bound: a guest without a
/// network configuration starts with every interface down. Nothing is changed when it is up.
///
/// # Errors
/// The OS error of the `SIOCGIFFLAGS`/`SIOCSIFFLAGS` ioctls (netdevice(7)).
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: socket(2) takes no pointers; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let socket = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq naming "lo"; the kernel fills in its flags.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: reading the flags member of the union the kernel just filled.
    if unsafe { req.ifr_ifru.ifru_flags } & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    // SAFETY: reading and writing the flags member of the union the kernel just filled.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: `req` is a valid ifreq naming "lo" with its new flags.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

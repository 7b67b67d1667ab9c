//! Ingress: TCP ports on the host whose connections reach servers in the guest, as `docker run
//! -p` does, without a network device. Each accepted connection becomes one agent `Connect`
//! ([`AgentClient::connect_tcp`]): the agent connects to the port on the guest's `127.0.0.1` and
//! the bytes go both ways over virtio-vsock. A guest server listening on `0.0.0.0` or
//! `127.0.0.1` is reached; one that is not (yet) there closes the host connection at once.
//!
//! `bulkhead run -p` and the containerd shim (pod annotation `bulkhead.io/ports`) use it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use bulkhead_protocol::client::AgentClient;
use bulkhead_protocol::relay;

/// Most connections carried at once per published port; one more is closed at once.
pub const MAX_CONNECTIONS: usize = 256;

/// Stack of each copying thread (they copy through a heap buffer).
const THREAD_STACK: usize = 64 * 1024;

/// Errors of ingress.
#[derive(Debug, thiserror::Error)]
pub enum IngressError {
    /// A port mapping is not `[ADDRESS:]HOST_PORT:GUEST_PORT` or `PORT`.
    #[error("{0:?} is not a port mapping: [ADDRESS:]HOST_PORT:GUEST_PORT or PORT (ports 1-65535)")]
    BadMapping(String),
    /// The host port could not be bound (in use, or a privileged port without the right).
    #[error("listen on {address}: {source}")]
    Bind {
        /// The address asked for.
        address: SocketAddr,
        /// What bind(2) or listen(2) reported.
        source: io::Error,
    },
    /// The accepting thread could not be started.
    #[error("ingress thread: {0}")]
    Thread(io::Error),
}

/// One published port: connections to `host` reach TCP port `guest` in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortMapping {
    /// Where the host listens.
    pub host: SocketAddr,
    /// The guest's TCP port (on its loopback interface).
    pub guest: u16,
}

impl PortMapping {
    /// A mapping of guest port `guest` to the same `host` port on `address`.
    pub fn same_port(address: IpAddr, port: u16) -> PortMapping {
        PortMapping {
            host: SocketAddr::new(address, port),
            guest: port,
        }
    }

    /// Parses `[ADDRESS:]HOST_PORT:GUEST_PORT` or `PORT` (the same port on both sides), with
    /// `default_address` where none is given (an IPv6 address goes in brackets: `[::1]:80:80`).
    ///
    /// # Errors
    /// [`IngressError::BadMapping`].
    pub fn parse(text: &str, default_address: IpAddr) -> Result<PortMapping, IngressError> {
        let bad = || IngressError::BadMapping(text.to_owned());
        let port = |s: &str| s.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(bad);
        let (address, host, guest) = match text.strip_prefix('[') {
            Some(v6) => {
                let (address, rest) = v6.split_once("]:").ok_or_else(bad)?;
                let (host, guest) = rest.split_once(':').ok_or_else(bad)?;
                (address, host, guest)
            }
            None => match text.split(':').collect::<Vec<_>>()[..] {
                [both] => ("", both, both),
                [host, guest] => ("", host, guest),
                [address, host, guest] => (address, host, guest),
                _ => return Err(bad()),
            },
        };
        let address = match address {
            "" => default_address,
            a => IpAddr::from_str(a).map_err(|_| bad())?,
        };
        Ok(PortMapping {
            host: SocketAddr::new(address, port(host)?),
            guest: port(guest)?,
        })
    }

    /// Binds the host side.
    ///
    /// # Errors
    /// [`IngressError::Bind`].
    pub fn bind(&self) -> Result<TcpListener, IngressError> {
        TcpListener::bind(self.host).map_err(|source| IngressError::Bind {
            address: self.host,
            source,
        })
    }
}

/// Binds the host side of every mapping, each listener with its guest port: what
/// [`Published::serve`] takes. Nothing stays bound on an error.
///
/// # Errors
/// [`IngressError::Bind`] for the first mapping that cannot be bound.
pub fn bind_all(mappings: &[PortMapping]) -> Result<Vec<(TcpListener, u16)>, IngressError> {
    mappings
        .iter()
        .map(|m| m.bind().map(|listener| (listener, m.guest)))
        .collect()
}

/// The loopback address, where `bulkhead run -p` listens unless told otherwise.
pub const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Published ports: one accepting thread per port. Dropping it stops accepting (connections
/// already carried go on until either end closes them).
#[derive(Debug)]
pub struct Published {
    ports: Vec<Port>,
}

#[derive(Debug)]
struct Port {
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Published {
    /// Binds every mapping and starts accepting; nothing is left listening on an error.
    ///
    /// # Errors
    /// [`IngressError::Bind`], [`IngressError::Thread`].
    pub fn start(
        client: &AgentClient,
        mappings: &[PortMapping],
    ) -> Result<Published, IngressError> {
        Published::serve(client, bind_all(mappings)?)
    }

    /// Starts accepting on listeners bound by the caller (the shim binds them in the pod's
    /// network namespace), each with its guest port.
    ///
    /// # Errors
    /// [`IngressError::Thread`]; the listeners are closed.
    pub fn serve(
        client: &AgentClient,
        listeners: Vec<(TcpListener, u16)>,
    ) -> Result<Published, IngressError> {
        let mut published = Published { ports: Vec::new() };
        for (listener, guest) in listeners {
            let listener = Arc::new(listener);
            let stop = Arc::new(AtomicBool::new(false));
            let (l, s, c) = (listener.clone(), stop.clone(), client.clone());
            let thread = thread::Builder::new()
                .name(format!("ingress-{guest}"))
                .spawn(move || accept_loop(&l, &s, &c, guest))
                .map_err(IngressError::Thread)?;
            published.ports.push(Port {
                listener,
                stop,
                thread: Some(thread),
            });
        }
        Ok(published)
    }

    /// The host addresses listened on (with the ports the OS chose for port 0).
    pub fn addresses(&self) -> Vec<SocketAddr> {
        self.ports
            .iter()
            .filter_map(|p| p.listener.local_addr().ok())
            .collect()
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        for port in &mut self.ports {
            port.stop.store(true, Ordering::SeqCst);
            // SAFETY: shutdown(2) on a listening socket we own wakes the blocked accept(2)
            // (Linux: EINVAL); no pointers involved.
            unsafe { libc::shutdown(port.listener.as_raw_fd(), libc::SHUT_RDWR) };
            if let Some(thread) = port.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

fn accept_loop(listener: &TcpListener, stop: &AtomicBool, client: &AgentClient, guest: u16) {
    let live = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        if live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            live.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("ingress to guest port {guest}: over {MAX_CONNECTIONS} connections");
            continue;
        }
        let (client, live) = (client.clone(), live.clone());
        let spawned = thread::Builder::new()
            .name("ingress-conn".into())
            .stack_size(THREAD_STACK)
            .spawn(move || {
                carry(conn, &client, guest);
                live.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            tracing::warn!("ingress to guest port {guest}: no thread for a connection: {e}");
        }
    }
}

/// Carries one host connection to guest port `guest` until both directions ended.
fn carry(conn: TcpStream, client: &AgentClient, guest: u16) {
    let guest_side = match client.connect_tcp(guest) {
        Ok(stream) => stream,
        Err(e) => {
            tracing::debug!("ingress to guest port {guest}: {e}");
            let _ = conn.shutdown(Shutdown::Both);
            return;
        }
    };
    if let Err(e) = relay::pump(OwnedFd::from(conn), OwnedFd::from(guest_side)) {
        tracing::debug!("ingress to guest port {guest}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn mappings_parse_as_docker_run_p_writes_them() {
        // Act
        let one = PortMapping::parse("8080", LOCALHOST).unwrap();
        let two = PortMapping::parse("18080:80", LOCALHOST).unwrap();
        let any = PortMapping::parse("0.0.0.0:18080:80", LOCALHOST).unwrap();
        let v6 = PortMapping::parse("[::1]:18080:80", LOCALHOST).unwrap();

        // Assert
        assert_eq!(one, PortMapping::same_port(LOCALHOST, 8080));
        assert_eq!(two.host, "127.0.0.1:18080".parse().unwrap());
        assert_eq!(two.guest, 80);
        assert_eq!(any.host, "0.0.0.0:18080".parse().unwrap());
        assert_eq!(v6.host, "[::1]:18080".parse().unwrap());
        assert_eq!(v6.guest, 80);
    }

    #[test]
    fn bad_mappings_are_refused_with_the_text() {
        for bad in [
            "",
            "0",
            "80:0",
            "65536",
            "a:80",
            "1.2.3:80:80",
            "1:2:3:4",
            "[::1]80:80",
            "x:",
        ] {
            // Act
            let result = PortMapping::parse(bad, LOCALHOST);

            // Assert
            assert!(
                matches!(&result, Err(IngressError::BadMapping(t)) if t == bad),
                "{bad:?}: {result:?}"
            );
        }
    }

    #[test]
    fn a_connection_reaches_the_agent_and_a_port_nobody_serves_is_closed() {
        // Arrange: an agent stand-in that refuses every Connect (nothing listens in the guest).
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let agent = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let answering = thread::spawn(move || {
            let (mut conn, _) = agent.accept().unwrap();
            let request = bulkhead_protocol::read_frame(&mut conn).unwrap();
            let reply = bulkhead_protocol::Frame::error(
                bulkhead_protocol::ErrorCode::NotFound,
                "connection refused",
            );
            bulkhead_protocol::write_frame(&mut conn, &reply).unwrap();
            request
        });
        let client = AgentClient::unix(&socket);
        let mapping = PortMapping {
            host: "127.0.0.1:0".parse().unwrap(),
            guest: 8080,
        };
        let published = Published::start(&client, &[mapping]).unwrap();
        let address = published.addresses()[0];

        // Act
        let mut conn = TcpStream::connect(address).unwrap();
        let mut got = Vec::new();
        let read = conn.read_to_end(&mut got);
        drop(published);

        // Assert
        let request = answering.join().unwrap();
        assert_eq!(
            request,
            Some(bulkhead_protocol::Frame::Connect(
                bulkhead_protocol::ConnectRequest { port: 8080 }
            ))
        );
        assert!(read.is_ok_and(|n| n == 0) || got.is_empty(), "{got:?}");
        assert!(
            TcpStream::connect(address).is_err(),
            "still listening after the drop"
        );
    }
}

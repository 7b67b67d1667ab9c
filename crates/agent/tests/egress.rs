//! The agent's egress relay in test mode: bytes written to its TCP address reach the Unix socket
//! it relays to unchanged, both ways, and each end sees the other's end of file.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::Duration;

use common::Agent;

/// A free TCP port on 127.0.0.1 (bound and released; the agent binds it next).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The agent in test mode with its egress relay from `addr` to the Unix socket `proxy` (it is
/// listening once the agent announced itself).
fn agent_relaying(addr: &str, proxy: &Path) -> Agent {
    Agent::start_with(&[
        OsStr::new("--egress-listen"),
        OsStr::new(addr),
        OsStr::new("--egress-unix"),
        proxy.as_os_str(),
    ])
}

#[test]
fn the_relay_carries_both_directions_and_their_ends_of_file() {
    // Arrange: a stand-in host proxy that answers each request with its reversed bytes.
    let dir = tempfile::tempdir().unwrap();
    let proxy_path = dir.path().join("vm.sock_1026");
    let proxy = UnixListener::bind(&proxy_path).unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let _agent = agent_relaying(&addr, &proxy_path);
    let server = std::thread::spawn(move || {
        let (mut conn, _) = proxy.accept().unwrap();
        let mut request = Vec::new();
        conn.read_to_end(&mut request).unwrap();
        request.reverse();
        conn.write_all(&request).unwrap();
    });
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();

    // Act
    let mut client = TcpStream::connect(&addr).unwrap();
    client.write_all(&payload).unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    client.read_to_end(&mut answer).unwrap();
    server.join().unwrap();

    // Assert
    let mut expected = payload;
    expected.reverse();
    assert_eq!(answer.len(), expected.len());
    assert!(answer == expected, "the relayed bytes differ");
}

#[test]
fn a_relay_whose_host_side_is_gone_closes_the_guest_connection() {
    // Arrange: nothing listens at the proxy's path.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("vm.sock_1026");
    let addr = format!("127.0.0.1:{}", free_port());
    let _agent = agent_relaying(&addr, &missing);

    // Act
    let mut client = TcpStream::connect(&addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 16];
    let read = client.read(&mut buf);

    // Assert: end of file (or a reset), not a hang.
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
}

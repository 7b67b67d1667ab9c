//! Ingress in test mode: a `Connect` request reaches a TCP server on `127.0.0.1` (here the
//! host's loopback stands in for the guest's), carries its bytes both ways with their ends of
//! file, and a port with no server or port 0 is a clear error, not a hang.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};

use bulkhead_protocol::client::ClientError;
use bulkhead_protocol::ErrorCode;
use common::{noise, Agent};

#[test]
fn a_connect_carries_a_tcp_connection_both_ways_with_its_ends_of_file() {
    // Arrange: a server that answers each connection with its request reversed.
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let serving = std::thread::spawn(move || {
        let (mut conn, _) = server.accept().unwrap();
        let mut request = Vec::new();
        conn.read_to_end(&mut request).unwrap();
        request.reverse();
        conn.write_all(&request).unwrap();
    });
    let agent = Agent::start();
    let payload = noise(300_000, 7);

    // Act
    let mut stream = agent.client().connect_tcp(port).unwrap();
    stream.write_all(&payload).unwrap();
    stream.shutdown(Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    serving.join().unwrap();

    // Assert
    let mut expected = payload;
    expected.reverse();
    assert_eq!(answer.len(), expected.len());
    assert!(answer == expected, "the bytes came back changed");
}

#[test]
fn a_port_without_a_server_is_not_found_and_port_0_is_refused() {
    // Arrange: a port that was free a moment ago.
    let port = {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let agent = Agent::start();

    // Act
    let nobody = agent.client().connect_tcp(port);
    let zero = agent.client().connect_tcp(0);

    // Assert
    match nobody {
        Err(ClientError::Agent(e)) => {
            assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);
            assert!(e.message.contains(&port.to_string()), "{}", e.message);
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(
        matches!(zero, Err(ClientError::Agent(ref e)) if e.code == ErrorCode::InvalidRequest),
        "{zero:?}"
    );
}

//! Host clients connecting through `uds_path` with `CONNECT <port>\n`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::{
    assert_closed_without_data, read_exactly, read_to_eof, GuestConn, Harness, Packet, GUEST_CID,
};
use crate::devices::virtio::vsock::packet::Op;
use crate::devices::virtio::vsock::{CONNECT_TIMEOUT, FIRST_LOCAL_PORT, HOST_CID};

/// Sends `CONNECT <port>` from a new client and returns it with the guest's view of the REQUEST.
fn connect_from_host(h: &mut Harness, port: u32) -> (UnixStream, Vec<Packet>) {
    let mut client = h.client();
    client
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .unwrap();
    h.settle();
    (client, h.recv())
}

/// The guest end of the connection a REQUEST opened.
fn guest_side(request: &Packet) -> GuestConn {
    GuestConn::new(request.hdr.dst_port, request.hdr.src_port)
}

/// Reads the client's first line (up to and including the newline).
fn read_line(client: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while client.read(&mut byte).unwrap() == 1 {
        line.push(byte[0]);
        if byte[0] == b'\n' {
            break;
        }
    }
    String::from_utf8(line).unwrap()
}

#[test]
fn connect_sends_a_request_to_the_guest_port() {
    let mut h = Harness::new();

    let (_client, request) = connect_from_host(&mut h, 52);

    assert_eq!(request.len(), 1);
    let hdr = request[0].hdr;
    assert_eq!(request[0].op(), Some(Op::Request));
    assert_eq!((hdr.src_cid, hdr.dst_cid), (HOST_CID, GUEST_CID));
    assert_eq!((hdr.src_port, hdr.dst_port), (FIRST_LOCAL_PORT, 52));
}

#[test]
fn accepted_connect_answers_ok_with_the_host_port_and_carries_data() {
    let mut h = Harness::new();
    let (mut client, request) = connect_from_host(&mut h, 52);
    let mut g = guest_side(&request[0]);

    h.send(&g.hdr(Op::Response, 0), &[]);
    let ok = read_line(&mut client);
    client.write_all(b"hello guest").unwrap();
    h.settle();
    let at_guest = h.recv();
    h.send(&g.hdr(Op::Rw, 10), b"hello host");
    let at_host = read_exactly(&mut client, 10);

    assert_eq!(ok, "OK 1073741824\n");
    assert_eq!(at_guest.len(), 1);
    assert_eq!(at_guest[0].data, b"hello guest");
    assert_eq!(at_host, b"hello host");
}

#[test]
fn refused_connect_closes_the_client_without_ok() {
    let mut h = Harness::new();
    let (mut client, request) = connect_from_host(&mut h, 52);
    let mut g = guest_side(&request[0]);

    h.send(&g.hdr(Op::Rst, 0), &[]);

    assert_eq!(read_to_eof(&mut client).unwrap(), b"");
    assert_eq!(h.dev().connection_count(), 0);
    assert!(h.recv().is_empty(), "no RST answers an RST");
}

#[test]
fn unanswered_connect_times_out_with_rst_and_eof() {
    let mut h = Harness::new();
    let (mut client, request) = connect_from_host(&mut h, 52);

    h.expire_at(Instant::now() + CONNECT_TIMEOUT * 2);
    let reply = h.recv();

    assert_eq!(reply.len(), 1);
    assert_eq!(reply[0].op(), Some(Op::Rst));
    assert_eq!(reply[0].hdr.src_port, request[0].hdr.src_port);
    assert_eq!(read_to_eof(&mut client).unwrap(), b"");
}

#[test]
fn connect_not_yet_overdue_survives_the_clock() {
    let mut h = Harness::new();
    let (_client, _request) = connect_from_host(&mut h, 52);

    h.expire_at(Instant::now());

    assert_eq!(h.dev().connection_count(), 1);
}

#[test]
fn garbage_line_closes_the_client_and_bothers_no_guest() {
    let mut h = Harness::new();
    let mut client = h.client();

    client.write_all(b"HELLO 52\n").unwrap();
    h.settle();

    assert_eq!(read_to_eof(&mut client).unwrap(), b"");
    assert!(h.recv().is_empty());
}

#[test]
fn overlong_line_closes_the_client() {
    let mut h = Harness::new();
    let mut client = h.client();

    client.write_all(&[b'7'; 40]).unwrap();
    h.settle();

    assert_closed_without_data(&mut client);
    assert!(h.recv().is_empty());
}

#[test]
fn client_that_never_finishes_its_line_is_dropped_after_the_timeout() {
    let mut h = Harness::new();
    let mut client = h.client();
    client.write_all(b"CONN").unwrap();
    h.settle();

    h.expire_at(Instant::now() + CONNECT_TIMEOUT * 2);

    assert_closed_without_data(&mut client);
}

#[test]
fn concurrent_connects_get_distinct_host_ports() {
    let mut h = Harness::new();

    let (_a, first) = connect_from_host(&mut h, 52);
    let (_b, second) = connect_from_host(&mut h, 52);

    assert_eq!(first[0].hdr.src_port, FIRST_LOCAL_PORT);
    assert_eq!(second[0].hdr.src_port, FIRST_LOCAL_PORT + 1);
}

#[test]
fn bytes_sent_right_after_the_line_reach_the_guest() {
    let mut h = Harness::new();
    let mut client = h.client();
    client.write_all(b"CONNECT 52\nearly bytes").unwrap();
    h.settle();
    let request = h.recv();
    let mut g = guest_side(&request[0]);

    h.send(&g.hdr(Op::Response, 0), &[]);
    let ok = read_line(&mut client);
    let at_guest = h.recv();

    assert_eq!(ok, "OK 1073741824\n");
    assert_eq!(at_guest.len(), 1);
    assert_eq!(at_guest[0].data, b"early bytes");
}

#[test]
fn pending_connect_arms_the_timeout_timer_and_the_answer_disarms_it() {
    let mut h = Harness::new();
    let (_client, request) = connect_from_host(&mut h, 52);
    let armed_while_pending = h.dev().timer().is_armed().unwrap();
    let mut g = guest_side(&request[0]);

    h.send(&g.hdr(Op::Response, 0), &[]);
    let armed_after_answer = h.dev().timer().is_armed().unwrap();

    assert!(armed_while_pending);
    assert!(!armed_after_answer);
}

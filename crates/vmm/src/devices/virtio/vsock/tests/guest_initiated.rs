//! Guest connections to host port P, which end at the Unix socket `<uds_path>_P`.

use std::io::Write;
use std::net::Shutdown;
use std::time::Instant;

use super::{connect_from_guest, read_exactly, read_to_eof, GuestConn, Harness, GUEST_CID};
use crate::devices::virtio::vsock::packet::{Op, SHUTDOWN_BOTH, SHUTDOWN_SEND, TYPE_STREAM};
use crate::devices::virtio::vsock::{ConnState, HOST_CID, SHUTDOWN_TIMEOUT};

#[test]
fn request_to_a_listening_host_port_is_accepted() {
    let mut h = Harness::new();
    let listener = h.host_listener(1234);
    let mut g = GuestConn::new(5000, 1234);

    h.send(&g.hdr(Op::Request, 0), &[]);
    let reply = h.recv();

    assert_eq!(reply.len(), 1);
    let hdr = reply[0].hdr;
    assert_eq!(reply[0].op(), Some(Op::Response));
    assert_eq!((hdr.src_cid, hdr.dst_cid), (HOST_CID, GUEST_CID));
    assert_eq!((hdr.src_port, hdr.dst_port), (1234, 5000));
    assert_eq!(hdr.type_, TYPE_STREAM);
    assert_eq!(hdr.buf_alloc, crate::devices::virtio::vsock::CONN_BUF_SIZE);
    listener.set_nonblocking(true).unwrap();
    assert!(
        listener.accept().is_ok(),
        "the host listener got the connection"
    );
}

#[test]
fn request_without_a_host_listener_is_reset() {
    let mut h = Harness::new();
    let mut g = GuestConn::new(5000, 4321);

    h.send(&g.hdr(Op::Request, 0), &[]);
    let reply = h.recv();

    assert_eq!(reply.len(), 1);
    assert_eq!(reply[0].op(), Some(Op::Rst));
    assert_eq!((reply[0].hdr.src_port, reply[0].hdr.dst_port), (4321, 5000));
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn data_flows_both_ways() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    h.send(&g.hdr(Op::Rw, 4), b"ping");
    let at_host = read_exactly(&mut stream, 4);
    stream.write_all(b"pong").unwrap();
    h.settle();
    let at_guest = h.recv();

    assert_eq!(at_host, b"ping");
    assert_eq!(at_guest.len(), 1);
    assert_eq!(at_guest[0].op(), Some(Op::Rw));
    assert_eq!(at_guest[0].data, b"pong");
    assert_eq!(
        (at_guest[0].hdr.src_port, at_guest[0].hdr.dst_port),
        (1234, 5000)
    );
}

#[test]
fn guest_shutdown_send_gives_the_host_eof_but_keeps_the_other_direction() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);
    h.send(&g.hdr(Op::Rw, 5), b"bye\n\n");

    let mut shutdown = g.hdr(Op::Shutdown, 0);
    shutdown.flags = SHUTDOWN_SEND;
    h.send(&shutdown, &[]);
    let before_eof = read_to_eof(&mut stream).unwrap();
    stream.write_all(b"reply").unwrap();
    h.settle();
    let at_guest = h.recv();

    assert_eq!(before_eof, b"bye\n\n");
    assert_eq!(at_guest.len(), 1);
    assert_eq!(at_guest[0].data, b"reply");
}

#[test]
fn full_guest_shutdown_is_answered_with_rst_and_closes_the_socket() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    let mut shutdown = g.hdr(Op::Shutdown, 0);
    shutdown.flags = SHUTDOWN_BOTH;
    h.send(&shutdown, &[]);
    let reply = h.recv();

    assert_eq!(reply.len(), 1);
    assert_eq!(reply[0].op(), Some(Op::Rst));
    assert_eq!(read_to_eof(&mut stream).unwrap(), b"");
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn host_half_close_sends_shutdown_send_and_guest_data_still_arrives() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    stream.shutdown(Shutdown::Write).unwrap();
    h.settle();
    let notice = h.recv();
    h.send(&g.hdr(Op::Rw, 4), b"late");
    let at_host = read_exactly(&mut stream, 4);

    assert_eq!(notice.len(), 1);
    assert_eq!(notice[0].op(), Some(Op::Shutdown));
    assert_eq!(notice[0].hdr.flags, SHUTDOWN_SEND);
    assert_eq!(at_host, b"late");
}

#[test]
fn host_hang_up_sends_full_shutdown_and_the_guest_rst_ends_it() {
    let mut h = Harness::new();
    let (mut g, stream) = connect_from_guest(&mut h, 5000, 1234);

    drop(stream);
    h.settle();
    let notice = h.recv();
    let state = h.dev().connection_state(1234, 5000);
    h.send(&g.hdr(Op::Rst, 0), &[]);

    assert_eq!(notice.len(), 1);
    assert_eq!(notice[0].op(), Some(Op::Shutdown));
    assert_eq!(notice[0].hdr.flags, SHUTDOWN_BOTH);
    assert!(
        matches!(state, Some(ConnState::Closing { .. })),
        "{state:?}"
    );
    assert_eq!(h.dev().connection_count(), 0);
    assert!(h.recv().is_empty(), "no RST answers an RST");
}

#[test]
fn a_guest_that_never_answers_our_shutdown_is_reset_after_the_timeout() {
    let mut h = Harness::new();
    let (_g, stream) = connect_from_guest(&mut h, 5000, 1234);
    drop(stream);
    h.settle();
    let _shutdown = h.recv();

    h.expire_at(Instant::now() + SHUTDOWN_TIMEOUT * 2);
    let reply = h.recv();

    assert_eq!(reply.len(), 1);
    assert_eq!(reply[0].op(), Some(Op::Rst));
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn each_guest_connection_to_the_same_port_gets_its_own_socket() {
    let mut h = Harness::new();
    let listener = h.host_listener(1234);
    let mut a = GuestConn::new(5000, 1234);
    let mut b = GuestConn::new(5001, 1234);
    h.send(&a.hdr(Op::Request, 0), &[]);
    h.send(&b.hdr(Op::Request, 0), &[]);
    let replies = h.recv();
    let (mut sa, _) = listener.accept().unwrap();
    let (mut sb, _) = listener.accept().unwrap();

    h.send(&a.hdr(Op::Rw, 1), b"a");
    h.send(&b.hdr(Op::Rw, 1), b"b");

    assert_eq!(replies.len(), 2);
    assert!(replies.iter().all(|p| p.op() == Some(Op::Response)));
    assert_eq!(read_exactly(&mut sa, 1), b"a");
    assert_eq!(read_exactly(&mut sb, 1), b"b");
    assert_eq!(h.dev().connection_count(), 2);
}

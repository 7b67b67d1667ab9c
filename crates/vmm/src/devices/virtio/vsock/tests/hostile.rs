//! A guest that breaks the rules: malformed chains, spoofed or invalid headers, unknown
//! connections, packet floods. Nothing may panic, stall a queue or leak connections.

use super::driver::{Part, VIRTQ_DESC_F_WRITE};
use super::{connect_from_guest, read_exactly, read_to_eof, GuestConn, Harness};
use crate::devices::virtio::vsock::packet::{Op, HEADER_SIZE};
use crate::devices::virtio::vsock::{MAX_PKT_DATA, RST_BACKLOG_LIMIT, RXQ_INDEX};

/// Address of a scratch buffer in the test's guest memory, outside every queue's slots.
const SCRATCH: u64 = 0x1_8000;

#[test]
fn chain_shorter_than_a_header_is_returned_and_the_queue_keeps_working() {
    let mut h = Harness::new();
    let listener = h.host_listener(1234);

    h.tx.push_raw(&[(SCRATCH, 20, 0)]);
    h.kick_tx();
    let after_garbage = h.recv();
    let mut g = GuestConn::new(5000, 1234);
    h.send(&g.hdr(Op::Request, 0), &[]);
    let after_request = h.recv();

    assert_eq!(h.tx_used.len(), 2, "both chains returned");
    assert_eq!(h.tx_used[0].len, 0);
    assert!(after_garbage.is_empty(), "no header, nobody to reset");
    assert_eq!(after_request.len(), 1);
    assert_eq!(after_request[0].op(), Some(Op::Response));
    drop(listener);
}

#[test]
fn device_writable_tx_descriptor_is_returned_unused() {
    let mut h = Harness::new();

    h.tx.push_raw(&[(SCRATCH, HEADER_SIZE as u32, VIRTQ_DESC_F_WRITE)]);
    h.kick_tx();

    assert_eq!(h.tx_used.len(), 1);
    assert_eq!(h.tx_used[0].len, 0);
    assert!(h.recv().is_empty());
}

#[test]
fn spoofed_source_cid_is_ignored_and_spares_the_connection() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    let mut spoofed = g.hdr(Op::Rst, 0);
    spoofed.src_cid = 99;
    h.send(&spoofed, &[]);
    let replies = h.recv();
    h.send(&g.hdr(Op::Rw, 5), b"alive");

    assert!(replies.is_empty());
    assert_eq!(h.dev().connection_count(), 1);
    assert_eq!(read_exactly(&mut stream, 5), b"alive");
}

#[test]
fn unknown_op_resets_the_connection() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    let mut bogus = g.hdr(Op::Rw, 0);
    bogus.op = 42;
    h.send(&bogus, &[]);
    let replies = h.recv();

    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
    assert_eq!(read_to_eof(&mut stream).unwrap(), b"");
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn non_stream_type_is_reset_without_touching_the_host() {
    let mut h = Harness::new();
    let listener = h.host_listener(1234);
    listener.set_nonblocking(true).unwrap();
    let mut g = GuestConn::new(5000, 1234);

    let mut seqpacket = g.hdr(Op::Request, 0);
    seqpacket.type_ = 2;
    h.send(&seqpacket, &[]);
    let replies = h.recv();

    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
    assert!(listener.accept().is_err(), "no Unix connection was made");
}

#[test]
fn request_to_another_cid_is_reset_from_that_cid() {
    let mut h = Harness::new();
    let mut g = GuestConn::new(5000, 1234);

    let mut elsewhere = g.hdr(Op::Request, 0);
    elsewhere.dst_cid = 7;
    h.send(&elsewhere, &[]);
    let replies = h.recv();

    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
    assert_eq!(replies[0].hdr.src_cid, 7);
}

#[test]
fn len_beyond_the_data_descriptor_is_reset() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    let liar = g.hdr(Op::Rw, 1000).to_bytes();
    h.tx.push(&[Part::Read(&liar), Part::Read(&[1u8; 100])]);
    h.kick_tx();
    let replies = h.recv();

    assert_eq!(h.tx_used.last().map(|u| u.len), Some(0));
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
    assert_eq!(
        read_to_eof(&mut stream).unwrap(),
        b"",
        "no partial data leaked"
    );
}

#[test]
fn payload_over_the_packet_limit_is_reset() {
    let mut h = Harness::new();
    let (mut g, _stream) = connect_from_guest(&mut h, 5000, 1234);
    let big = vec![0u8; MAX_PKT_DATA as usize + 1];

    h.send(&g.hdr(Op::Rw, big.len() as u32), &big);
    let replies = h.recv();

    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn data_for_an_unknown_connection_is_reset() {
    let mut h = Harness::new();
    let mut g = GuestConn::new(5000, 1234);

    h.send(&g.hdr(Op::Rw, 3), b"who");
    let replies = h.recv();

    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
    assert_eq!(
        (replies[0].hdr.src_port, replies[0].hdr.dst_port),
        (1234, 5000)
    );
}

#[test]
fn data_before_our_response_is_reset() {
    let mut h = Harness::with_rx_buffers(0);
    let _listener = h.host_listener(1234);
    let mut g = GuestConn::new(5000, 1234);
    h.push_tx(&g.hdr(Op::Request, 0), &[]);
    h.push_tx(&g.hdr(Op::Rw, 2), b"hi");

    h.kick_tx();
    h.post_rx(2);
    h.kick(RXQ_INDEX);
    let replies = h.recv();

    let ops: Vec<_> = replies.iter().map(|p| p.op()).collect();
    assert_eq!(ops, vec![Some(Op::Rst)]);
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn malformed_rx_chain_is_returned_empty_and_the_next_one_used() {
    let mut h = Harness::with_rx_buffers(0);
    h.repost_rx = false;
    h.rx.push_raw(&[(SCRATCH, HEADER_SIZE as u32, 0)]);
    h.post_rx(1);
    let mut g = GuestConn::new(5000, 1234);

    h.send(&g.hdr(Op::Request, 0), &[]);
    let replies = h.recv();

    assert_eq!(h.rx_short.len(), 1);
    assert_eq!(h.rx_short[0].len, 0);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].op(), Some(Op::Rst));
}

#[test]
fn rst_flood_without_rx_buffers_pauses_tx_instead_of_growing() {
    let mut h = Harness::with_rx_buffers(0);
    h.repost_rx = false;
    let mut sent = 0;
    while h.tx.free_count() > 0 {
        let mut g = GuestConn::new(6000 + sent as u32, 1);
        h.push_tx(&g.hdr(Op::CreditRequest, 0), &[]);
        sent += 1;
    }
    assert!(
        sent > RST_BACKLOG_LIMIT,
        "the flood must exceed the backlog"
    );

    h.kick_tx();
    let taken_while_starved = h.tx_used.len();
    h.repost_rx = true;
    h.post_rx(16);
    h.kick(RXQ_INDEX);
    let mut rsts = 0;
    for _ in 0..100 {
        let batch = h.recv();
        if batch.is_empty() {
            break;
        }
        rsts += batch.iter().filter(|p| p.op() == Some(Op::Rst)).count();
    }
    while let Some(used) = h.tx.pop_used() {
        h.tx_used.push(used);
    }

    assert_eq!(taken_while_starved, RST_BACKLOG_LIMIT);
    assert_eq!(h.tx_used.len(), sent, "every chain is eventually returned");
    assert_eq!(rsts, sent);
}

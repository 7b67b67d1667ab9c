//! Credit-based flow control in both directions, isolation between connections, RX starvation,
//! and bulk transfers.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;

use super::{connect_from_guest, pattern, read_exactly, GuestConn, Harness, Packet};
use crate::devices::virtio::vsock::packet::Op;
use crate::devices::virtio::vsock::{CONN_BUF_SIZE, MAX_PKT_DATA, RXQ_INDEX};

/// Writes as much of `data[*written..]` as the socket takes without blocking.
fn write_some(stream: &mut UnixStream, data: &[u8], written: &mut usize) {
    match stream.write(&data[*written..]) {
        Ok(n) => *written += n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        Err(e) => panic!("client write: {e}"),
    }
}

/// Appends whatever the socket has without blocking.
fn read_available(stream: &mut UnixStream, out: &mut Vec<u8>) {
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => panic!("client read: {e}"),
        }
    }
}

/// Guest-side handling of packets for `g`: data is consumed and checked against the credit the
/// guest advertised; credit requests are answered. Returns the data.
fn guest_consume(h: &mut Harness, g: &mut GuestConn, packets: &[Packet]) -> Vec<u8> {
    let mut data = Vec::new();
    for p in packets {
        if !g.owns(p) {
            continue;
        }
        g.observe(p);
        assert_eq!(g.overrun(), 0, "device sent beyond the guest's credit");
        data.extend_from_slice(&p.data);
        if p.op() == Some(Op::CreditRequest) {
            let update = g.hdr(Op::CreditUpdate, 0);
            h.send(&update, &[]);
        }
    }
    data
}

#[test]
fn device_never_sends_more_than_the_guest_credit() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);
    g.buf_alloc = 8192;
    h.send(&g.hdr(Op::CreditUpdate, 0), &[]);

    stream.write_all(&pattern(64 * 1024, 1)).unwrap();
    h.settle();
    let first = h.recv();
    let first_bytes: usize = first.iter().map(|p| p.data.len()).sum();
    let asked_for_credit = first.iter().any(|p| p.op() == Some(Op::CreditRequest));
    for p in &first {
        g.observe(p);
    }
    h.send(&g.hdr(Op::CreditUpdate, 0), &[]);
    let second = h.recv();
    let second_bytes: usize = second.iter().map(|p| p.data.len()).sum();

    assert_eq!(first_bytes, 8192);
    assert!(
        asked_for_credit,
        "credit exhausted: the device asks for an update"
    );
    assert_eq!(
        second_bytes, 8192,
        "the update released exactly the consumed bytes"
    );
}

#[test]
fn credit_request_is_answered_with_the_forwarded_count() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);
    h.send(&g.hdr(Op::Rw, 1000), &[7u8; 1000]);
    read_exactly(&mut stream, 1000);

    h.send(&g.hdr(Op::CreditRequest, 0), &[]);
    let reply = h.recv();

    assert_eq!(reply.len(), 1);
    assert_eq!(reply[0].op(), Some(Op::CreditUpdate));
    assert_eq!(reply[0].hdr.buf_alloc, CONN_BUF_SIZE);
    assert_eq!(reply[0].hdr.fwd_cnt, 1000);
}

/// Sends guest data on `g` while the device gives credit, until it stops giving any; returns the
/// bytes sent.
fn fill_device_buffer(h: &mut Harness, g: &mut GuestConn) -> u32 {
    let chunk = vec![0x5a; MAX_PKT_DATA as usize];
    for _ in 0..1000 {
        let credit = g.dev_credit();
        if credit == 0 {
            let before = (g.dev_buf_alloc, g.dev_fwd_cnt);
            h.send(&g.hdr(Op::CreditRequest, 0), &[]);
            g.observe_all(&h.recv());
            if (g.dev_buf_alloc, g.dev_fwd_cnt) == before {
                return g.tx_cnt;
            }
            continue;
        }
        let n = credit.min(MAX_PKT_DATA);
        h.send(&g.hdr(Op::Rw, n), &chunk[..n as usize]);
        g.tx_cnt += n;
        g.observe_all(&h.recv());
    }
    panic!("the device kept giving credit to a connection nobody reads");
}

#[test]
fn stalled_connection_does_not_block_another() {
    let mut h = Harness::new();
    let (mut stalled, _stalled_stream) = connect_from_guest(&mut h, 5000, 1234);
    let (mut live, mut live_stream) = connect_from_guest(&mut h, 5001, 1235);

    let absorbed = fill_device_buffer(&mut h, &mut stalled);
    h.send(&live.hdr(Op::Rw, 6), b"to-b-1");
    let at_live_host = read_exactly(&mut live_stream, 6);
    live_stream.write_all(b"from-b").unwrap();
    h.settle();
    let at_guest = h.recv();

    assert!(absorbed >= CONN_BUF_SIZE, "absorbed only {absorbed} bytes");
    assert_eq!(
        h.dev().connection_count(),
        2,
        "the stalled connection is alive"
    );
    assert_eq!(at_live_host, b"to-b-1");
    let live_data: Vec<u8> = at_guest
        .iter()
        .filter(|p| live.owns(p))
        .flat_map(|p| p.data.clone())
        .collect();
    assert_eq!(live_data, b"from-b");
}

#[test]
fn guest_ignoring_the_device_credit_is_reset() {
    let mut h = Harness::new();
    let (mut g, _stream_not_read) = connect_from_guest(&mut h, 5000, 1234);
    let chunk = vec![1u8; MAX_PKT_DATA as usize];

    let mut reset_after = None;
    for sent in 1..200u32 {
        h.send(&g.hdr(Op::Rw, MAX_PKT_DATA), &chunk);
        if h.recv().iter().any(|p| p.op() == Some(Op::Rst)) {
            reset_after = Some(sent);
            break;
        }
    }

    assert!(reset_after.is_some(), "never reset");
    assert_eq!(h.dev().connection_count(), 0);
}

#[test]
fn guest_not_reading_one_connection_does_not_block_host_data_on_another() {
    let mut h = Harness::new();
    let (mut slow, mut slow_stream) = connect_from_guest(&mut h, 5000, 1234);
    let (live, mut live_stream) = connect_from_guest(&mut h, 5001, 1235);
    slow.buf_alloc = 4096;
    h.send(&slow.hdr(Op::CreditUpdate, 0), &[]);
    slow_stream.set_nonblocking(true).unwrap();
    let flood = pattern(1024 * 1024, 2);
    let mut written = 0;
    write_some(&mut slow_stream, &flood, &mut written);
    h.settle();
    let slow_packets = h.recv();

    live_stream.write_all(b"urgent").unwrap();
    h.settle();
    let live_packets = h.recv();

    let slow_bytes: usize = slow_packets
        .iter()
        .filter(|p| slow.owns(p))
        .map(|p| p.data.len())
        .sum();
    assert_eq!(slow_bytes, 4096, "slow connection held at its credit");
    let live_data: Vec<u8> = live_packets
        .iter()
        .filter(|p| live.owns(p))
        .flat_map(|p| p.data.clone())
        .collect();
    assert_eq!(live_data, b"urgent");
}

#[test]
fn without_rx_buffers_host_data_waits_until_the_guest_posts_some() {
    let mut h = Harness::with_rx_buffers(1);
    h.repost_rx = false;
    let (g, mut stream) = connect_from_guest(&mut h, 5000, 1234);

    stream.write_all(b"waiting").unwrap();
    h.settle();
    let while_starved = h.recv();
    h.post_rx(1);
    h.kick(RXQ_INDEX);
    let after = h.recv();

    assert!(while_starved.is_empty(), "no buffers, no packets");
    assert_eq!(after.len(), 1);
    assert!(g.owns(&after[0]));
    assert_eq!(after[0].data, b"waiting");
}

/// Sends `data` from a guest connection as fast as the device's credit allows, letting `read`
/// take what it will from the host client's socket each round, for at most `rounds` rounds.
/// Returns what the host received.
fn guest_to_host(
    data: &[u8],
    rounds: usize,
    mut read: impl FnMut(&mut UnixStream, &mut Vec<u8>),
) -> Vec<u8> {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);
    stream.set_nonblocking(true).unwrap();
    let mut sent = 0usize;
    let mut received = Vec::new();
    for _ in 0..rounds {
        if received.len() == data.len() {
            break;
        }
        while sent < data.len() && g.dev_credit() > 0 && h.tx.free_count() >= 2 {
            let n = (g.dev_credit().min(MAX_PKT_DATA) as usize).min(data.len() - sent);
            let hdr = g.hdr(Op::Rw, n as u32);
            h.push_tx(&hdr, &data[sent..sent + n]);
            g.tx_cnt += n as u32;
            sent += n;
        }
        h.kick_tx();
        read(&mut stream, &mut received);
        h.settle();
        g.observe_all(&h.recv());
    }
    received
}

#[test]
fn four_mib_from_guest_to_host_arrive_intact() {
    let data = pattern(4 << 20, 4);

    let received = guest_to_host(&data, 100_000, read_available);

    assert_eq!(received.len(), data.len());
    assert!(received == data, "payload corrupted");
}

#[test]
fn four_mib_from_guest_to_a_slow_host_reader_arrive_intact() {
    // Arrange: the host client reads at most 4 KiB per round, far slower than the guest sends,
    // so the Unix socket is full most of the time and only credit updates let the guest go on.
    let data = pattern(4 << 20, 5);
    let mut buf = vec![0u8; 4096];
    let read_4k = |stream: &mut UnixStream, out: &mut Vec<u8>| match stream.read(&mut buf) {
        Ok(n) => out.extend_from_slice(&buf[..n]),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        Err(e) => panic!("client read: {e}"),
    };

    // Act
    let received = guest_to_host(&data, 1_000_000, read_4k);

    // Assert
    assert_eq!(received.len(), data.len());
    assert!(received == data, "payload corrupted");
}

#[test]
fn four_mib_from_host_to_guest_arrive_intact() {
    let mut h = Harness::new();
    let (mut g, mut stream) = connect_from_guest(&mut h, 5000, 1234);
    stream.set_nonblocking(true).unwrap();
    let data = pattern(4 << 20, 5);
    let mut written = 0usize;
    let mut received = Vec::new();

    for _ in 0..100_000 {
        if received.len() == data.len() {
            break;
        }
        write_some(&mut stream, &data, &mut written);
        h.settle();
        let packets = h.recv();
        received.extend(guest_consume(&mut h, &mut g, &packets));
        if g.fwd_cnt.wrapping_sub(g.announced_fwd_cnt) >= g.buf_alloc / 2 {
            let update = g.hdr(Op::CreditUpdate, 0);
            h.send(&update, &[]);
        }
    }

    assert_eq!(received.len(), data.len());
    assert!(received == data, "payload corrupted");
}

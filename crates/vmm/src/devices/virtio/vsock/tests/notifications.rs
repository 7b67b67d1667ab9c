//! Notification suppression in both directions (virtio 1.2 §2.7.7, §2.7.10): with
//! VIRTIO_RING_F_EVENT_IDX the device interrupts only when the used index passes the driver's
//! `used_event`, and it leaves the driver's kicks on whenever it is not draining TX.

use super::{GuestConn, Harness};
use crate::devices::virtio::vsock::packet::Op;

/// VRING_USED_F_NO_NOTIFY (virtio 1.2 §2.7.7.2).
const USED_F_NO_NOTIFY: u16 = 1;

#[test]
fn a_driver_that_suppresses_interrupts_gets_its_packets_without_one() {
    let mut h = Harness::with_event_idx();
    h.take_interrupts();
    // The driver asks to be interrupted only after many more used chains.
    h.rx.set_used_event(h.rx.used_idx().wrapping_add(1000));
    h.tx.set_used_event(h.tx.used_idx().wrapping_add(1000));
    let mut g = GuestConn::new(5000, 4321);

    h.send(&g.hdr(Op::Request, 0), &[]);

    assert_eq!(h.take_interrupts(), 0);
    let reply = h.recv();
    assert_eq!(reply.len(), 1, "the RST is in the used ring all the same");
    assert_eq!(reply[0].op(), Some(Op::Rst));
}

#[test]
fn a_driver_that_asks_for_the_next_used_chain_gets_an_interrupt() {
    let mut h = Harness::with_event_idx();
    h.take_interrupts();
    h.rx.set_used_event(h.rx.used_idx());
    h.tx.set_used_event(h.tx.used_idx());
    let mut g = GuestConn::new(5000, 4321);

    h.send(&g.hdr(Op::Request, 0), &[]);

    assert!(h.take_interrupts() >= 1);
    assert_eq!(h.recv().len(), 1);
}

#[test]
fn without_event_idx_every_used_batch_interrupts() {
    let mut h = Harness::new();
    h.take_interrupts();
    let mut g = GuestConn::new(5000, 4321);

    h.send(&g.hdr(Op::Request, 0), &[]);

    assert!(h.take_interrupts() >= 1);
}

#[test]
fn tx_kicks_are_on_again_once_the_device_has_drained_the_queue() {
    // Without EVENT_IDX the device suppresses kicks with VRING_USED_F_NO_NOTIFY.
    let mut h = Harness::new();
    let mut g = GuestConn::new(5000, 4321);

    h.send(&g.hdr(Op::Request, 0), &[]);

    assert_eq!(h.tx_used.len(), 1, "the TX chain was used");
    assert_eq!(h.tx.used_flags() & USED_F_NO_NOTIFY, 0);
}

#[test]
fn with_event_idx_the_device_asks_for_a_kick_on_the_next_rx_buffer() {
    // A device that ran out of RX buffers with packets pending waits for the driver's kick; with
    // EVENT_IDX the driver kicks only when its avail index passes the device's avail_event.
    let mut h = Harness::with_event_idx();
    let mut g = GuestConn::new(5000, 4321);

    h.send(&g.hdr(Op::Request, 0), &[]);

    // Every consumed buffer was used (the RST): the next one the driver adds must kick.
    assert_eq!(h.rx.used_idx(), 1);
    assert_eq!(h.rx.avail_event(), h.rx.used_idx());
}

//! Malformed chains from a hostile guest: each gets IOERR (or, without a usable status byte, used
//! length 0), touches neither the image nor guest data, and leaves the queue working.

use vm_memory::{Address, Bytes, GuestAddress};

use super::driver::{VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE};
use super::{config, header, image_file, pattern, Harness, MEM_SIZE, SCRATCH};
use crate::devices::virtio::block::{
    MAX_DATA_BYTES, QUEUE_SIZE, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
};

const SECTORS: u64 = 64;
const W: u16 = VIRTQ_DESC_F_WRITE;
/// Byte the tests fill guest buffers with, to see whether the device wrote them.
const POISON: u8 = 0xa5;
const HDR: u64 = SCRATCH;
const DATA: u64 = SCRATCH + 0x1000;
/// Past the largest data buffer (16 MiB + 512 at [`DATA`]).
const STATUS: u64 = SCRATCH + 0x1f0_0000;

fn harness() -> Harness {
    Harness::new(&pattern(SECTORS as usize * 512, 11))
}

/// Writes a header at [`HDR`], `len` poison bytes at [`DATA`] and a poison status byte.
fn stage(h: &Harness, request_type: u32, sector: u64, len: usize) {
    h.mem
        .write_slice(&header(request_type, sector), GuestAddress(HDR))
        .unwrap();
    h.mem
        .write_slice(&vec![POISON; len], GuestAddress(DATA))
        .unwrap();
    h.mem.write_obj(POISON, GuestAddress(STATUS)).unwrap();
}

fn data_untouched(h: &Harness, len: usize) -> bool {
    h.q.read(DATA, len).iter().all(|&b| b == POISON)
}

fn status_byte(h: &Harness) -> u8 {
    h.q.read(STATUS, 1)[0]
}

/// A well-formed read still works (the queue is not stuck).
fn assert_queue_still_works(h: &mut Harness) {
    let expected = h.image()[512..1024].to_vec();
    let (status, data) = h.read_sectors(1, 1);
    assert_eq!(status, VIRTIO_BLK_S_OK, "follow-up request");
    assert_eq!(data, expected);
    assert_eq!(
        h.q.free_count(),
        usize::from(QUEUE_SIZE),
        "every chain came back"
    );
}

/// Submits IN of `len` bytes at `sector` into poisoned memory; returns the used length.
fn read_into_poison(h: &mut Harness, sector: u64, len: u32) -> u32 {
    stage(h, VIRTIO_BLK_T_IN, sector, len as usize);
    h.submit_raw(&[(HDR, 16, 0), (DATA, len, W), (STATUS, 1, W)])
        .len
}

#[test]
fn read_beyond_capacity_is_ioerr_and_writes_no_data() {
    let mut h = harness();

    let len = read_into_poison(&mut h, SECTORS - 1, 1024);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert_eq!(len, 1);
    assert!(data_untouched(&h, 1024));
    assert_queue_still_works(&mut h);
}

#[test]
fn read_starting_past_the_end_is_ioerr() {
    let mut h = harness();

    read_into_poison(&mut h, SECTORS, 512);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 512));
}

#[test]
fn sector_that_overflows_is_ioerr() {
    let mut h = harness();

    read_into_poison(&mut h, u64::MAX, 512);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 512));
    assert_queue_still_works(&mut h);
}

#[test]
fn write_beyond_capacity_or_overflowing_leaves_the_file_unchanged() {
    let mut h = harness();
    let before = h.image();
    let data = pattern(1024, 12);

    let past_end = h.write_sectors(SECTORS - 1, &data);
    let overflow = h.write_sectors(u64::MAX - 1, &data);

    assert_eq!(past_end, VIRTIO_BLK_S_IOERR);
    assert_eq!(overflow, VIRTIO_BLK_S_IOERR);
    assert_eq!(h.image(), before, "same bytes, same size");
}

#[test]
fn data_length_not_a_multiple_of_512_is_ioerr() {
    let mut h = harness();
    let before = h.image();

    read_into_poison(&mut h, 0, 500);
    let read_status = status_byte(&h);
    let write_status = h.write_sectors(0, &pattern(513, 13));

    assert_eq!(read_status, VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 500));
    assert_eq!(write_status, VIRTIO_BLK_S_IOERR);
    assert_eq!(h.image(), before);
}

#[test]
fn read_with_device_readable_data_is_ioerr() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);

    h.submit_raw(&[(HDR, 16, 0), (DATA, 512, 0), (STATUS, 1, W)]);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 512));
    assert_queue_still_works(&mut h);
}

#[test]
fn write_with_device_writable_data_is_ioerr() {
    let mut h = harness();
    let before = h.image();
    stage(&h, VIRTIO_BLK_T_OUT, 0, 512);

    h.submit_raw(&[(HDR, 16, 0), (DATA, 512, W), (STATUS, 1, W)]);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert_eq!(h.image(), before);
}

#[test]
fn readable_descriptor_after_a_writable_one_is_ioerr() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 1024);

    h.submit_raw(&[
        (HDR, 16, 0),
        (DATA, 512, W),
        (DATA + 512, 512, 0),
        (STATUS, 1, W),
    ]);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 1024));
}

#[test]
fn header_that_is_device_writable_is_ioerr() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);

    h.submit_raw(&[(HDR, 16, W), (DATA, 512, W), (STATUS, 1, W)]);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
}

#[test]
fn header_shorter_than_16_bytes_is_ioerr() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);

    h.submit_raw(&[(HDR, 8, 0), (DATA, 512, W), (STATUS, 1, W)]);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 512));
}

#[test]
fn data_buffer_outside_guest_memory_is_ioerr_and_writes_nothing() {
    let mut h = harness();
    let before = h.image();
    stage(&h, VIRTIO_BLK_T_OUT, 0, 0);
    // Starts 256 bytes before the end of guest memory.
    let straddling = MEM_SIZE - 256;

    h.submit_raw(&[(HDR, 16, 0), (straddling, 512, 0), (STATUS, 1, W)]);

    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert_eq!(h.image(), before);
    assert_queue_still_works(&mut h);
}

#[test]
fn chain_without_status_descriptor_is_returned_with_length_zero_and_the_queue_goes_on() {
    let mut h = harness();
    let before = h.image();
    stage(&h, VIRTIO_BLK_T_OUT, 0, 512);

    // Header and write data, both device-readable: nowhere to put a status.
    let used = h.submit_raw(&[(HDR, 16, 0), (DATA, 512, 0)]);

    assert_eq!(used.len, 0);
    assert_eq!(h.image(), before, "nothing executed");
    assert_queue_still_works(&mut h);
}

#[test]
fn empty_status_descriptor_is_returned_with_length_zero() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);

    let used = h.submit_raw(&[(HDR, 16, 0), (DATA, 512, W), (STATUS, 0, W)]);

    assert_eq!(used.len, 0);
    assert!(data_untouched(&h, 512));
    assert_queue_still_works(&mut h);
}

#[test]
fn status_byte_outside_guest_memory_is_returned_with_length_zero() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);

    let used = h.submit_raw(&[(HDR, 16, 0), (DATA, 512, W), (MEM_SIZE + 4096, 1, W)]);

    assert_eq!(used.len, 0);
    assert!(data_untouched(&h, 512));
    assert_queue_still_works(&mut h);
}

#[test]
fn looping_chain_is_returned_with_length_zero() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);
    let head =
        h.q.push_raw(&[(HDR, 16, 0), (DATA, 512, W), (STATUS, 1, W)]);
    h.q.link_tail(head, head);

    h.kick();
    let used = h.pop_used();

    assert_eq!(used.len, 0);
    assert!(data_untouched(&h, 512));
    assert_queue_still_works(&mut h);
}

#[test]
fn chain_pointing_past_the_descriptor_table_is_returned_with_length_zero() {
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 512);
    let head =
        h.q.push_raw(&[(HDR, 16, 0), (DATA, 512, W), (STATUS, 1, W)]);
    h.q.link_tail(head, u16::MAX);

    h.kick();
    let used = h.pop_used();

    assert_eq!(used.len, 0);
    assert!(data_untouched(&h, 512));
    assert_queue_still_works(&mut h);
}

#[test]
fn request_above_the_size_limit_is_ioerr_and_one_at_the_limit_succeeds() {
    let (dir, path) = image_file(&[]);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(2 * u64::from(MAX_DATA_BYTES))
        .unwrap();
    let mut h = Harness::with_config(dir, config(&path));
    let at_limit = MAX_DATA_BYTES;
    let above = MAX_DATA_BYTES + 512;

    let too_big = read_into_poison(&mut h, 0, above);
    let too_big_status = status_byte(&h);
    let untouched = data_untouched(&h, above as usize);
    let fits = read_into_poison(&mut h, 0, at_limit);

    assert_eq!(too_big_status, VIRTIO_BLK_S_IOERR);
    assert_eq!(too_big, 1);
    assert!(untouched);
    assert_eq!(status_byte(&h), VIRTIO_BLK_S_OK);
    assert_eq!(fits, at_limit + 1);
}

#[test]
fn chain_longer_than_seg_max_through_an_indirect_table_is_ioerr() {
    const VIRTQ_DESC_F_INDIRECT: u16 = 4;
    let mut h = harness();
    stage(&h, VIRTIO_BLK_T_IN, 0, 0);
    // An indirect table of 258 descriptors: header, 256 × 512 bytes of data, status.
    let table = SCRATCH + 0x20_0000;
    let mut entries = vec![(HDR, 16, 0)];
    entries.extend((0..256).map(|i| (DATA + i * 512, 512, W)));
    entries.push((STATUS, 1, W));
    for (i, &(addr, len, flags)) in entries.iter().enumerate() {
        let at = GuestAddress(table + 16 * i as u64);
        let last = i + 1 == entries.len();
        let flags = if last {
            flags
        } else {
            flags | VIRTQ_DESC_F_NEXT
        };
        h.mem.write_obj(addr, at).unwrap();
        h.mem.write_obj(len, at.unchecked_add(8)).unwrap();
        h.mem.write_obj(flags, at.unchecked_add(12)).unwrap();
        h.mem
            .write_obj((i + 1) as u16, at.unchecked_add(14))
            .unwrap();
    }
    h.mem
        .write_slice(&vec![POISON; 256 * 512], GuestAddress(DATA))
        .unwrap();

    let len = entries.len() as u32 * 16;
    let used = h.submit_raw(&[(table, len, VIRTQ_DESC_F_INDIRECT)]);

    assert_eq!(used.len, 1);
    assert_eq!(status_byte(&h), VIRTIO_BLK_S_IOERR);
    assert!(data_untouched(&h, 256 * 512));
}

#[test]
fn avail_index_far_ahead_of_the_device_does_not_spin_the_event_loop() {
    let mut h = harness();
    // An avail idx more than a queue size ahead: virtio-queue refuses to pop from it.
    h.mem
        .write_obj(1000u16, GuestAddress(h.q.avail_idx_addr()))
        .unwrap();

    h.kick();

    assert!(h.q.pop_used().is_none());
}

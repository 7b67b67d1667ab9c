//! Well-formed requests: reads, writes, flushes, GET_ID, unsupported types, framing.

use vm_memory::{Bytes, GuestAddress};

use super::driver::{Part, VIRTQ_DESC_F_WRITE};
use super::{config, header, image_file, pattern, Harness, SCRATCH};
use crate::devices::virtio::block::{
    BlockConfig, SEG_MAX, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};

const SECTORS: usize = 256;

#[test]
fn write_then_read_back_across_several_sectors() {
    let mut h = Harness::new(&vec![0u8; SECTORS * 512]);
    let data = pattern(5 * 512, 1);

    let write_status = h.write_sectors(3, &data);
    let (read_status, read) = h.read_sectors(3, 5);

    assert_eq!(write_status, VIRTIO_BLK_S_OK);
    assert_eq!(read_status, VIRTIO_BLK_S_OK);
    assert_eq!(read, data);
    assert_eq!(&h.image()[3 * 512..8 * 512], &data[..], "on the host file");
    assert!(
        h.image()[..3 * 512].iter().all(|&b| b == 0),
        "neighbours intact"
    );
}

#[test]
fn read_returns_the_image_bytes_and_reports_data_plus_status_as_used_length() {
    let image = pattern(SECTORS * 512, 2);
    let mut h = Harness::new(&image);
    let hdr = header(VIRTIO_BLK_T_IN, 10);

    let used = h.submit(&[Part::Read(&hdr), Part::Write(2048), Part::Write(1)]);

    assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
    assert_eq!(used.len, 2048 + 1);
    assert_eq!(h.q.read(used.descs[1].0, 2048), &image[10 * 512..14 * 512]);
}

#[test]
fn write_reports_only_the_status_byte_as_used_length() {
    let mut h = Harness::new(&vec![0u8; SECTORS * 512]);
    let hdr = header(VIRTIO_BLK_T_OUT, 0);
    let data = pattern(512, 3);

    let used = h.submit(&[Part::Read(&hdr), Part::Read(&data), Part::Write(1)]);

    assert_eq!(used.len, 1);
    assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
}

#[test]
fn read_of_the_last_sector_succeeds() {
    let image = pattern(SECTORS * 512, 4);
    let mut h = Harness::new(&image);

    let (status, data) = h.read_sectors(SECTORS as u64 - 1, 1);

    assert_eq!(status, VIRTIO_BLK_S_OK);
    assert_eq!(data, &image[(SECTORS - 1) * 512..]);
}

#[test]
fn chains_spanning_many_descriptors_of_mixed_sizes_move_the_right_bytes() {
    let mut h = Harness::new(&vec![0u8; SECTORS * 512]);
    // SEG_MAX (254) data descriptors, sizes alternating 100 and 412 bytes, so that no sector
    // lies in one descriptor; with the header and status, the chain fills the whole queue.
    let data = pattern(SEG_MAX as usize / 2 * 512, 5);
    let pieces: Vec<&[u8]> = data
        .chunks(512)
        .flat_map(|sector| [&sector[..100], &sector[100..]])
        .collect();
    let hdr = header(VIRTIO_BLK_T_OUT, 0);
    let mut out = vec![Part::Read(&hdr)];
    out.extend(pieces.iter().map(|p| Part::Read(p)));
    out.push(Part::Write(1));
    let hdr_in = header(VIRTIO_BLK_T_IN, 0);
    let mut inp = vec![Part::Read(&hdr_in)];
    inp.extend(pieces.iter().map(|p| Part::Write(p.len() as u32)));
    inp.push(Part::Write(1));

    let wrote = h.submit(&out);
    let read = h.submit(&inp);

    assert_eq!(h.status(&wrote), VIRTIO_BLK_S_OK);
    assert_eq!(&h.image()[..data.len()], &data[..]);
    assert_eq!(h.status(&read), VIRTIO_BLK_S_OK);
    assert_eq!(read.len as usize, data.len() + 1);
    let back: Vec<u8> = read.descs[1..=SEG_MAX as usize]
        .iter()
        .flat_map(|&(addr, len)| h.q.read(addr, len as usize))
        .collect();
    assert_eq!(back, data);
}

#[test]
fn header_data_and_status_may_share_descriptors() {
    let image = pattern(SECTORS * 512, 6);
    let mut h = Harness::new(&image);
    // One readable descriptor: header; one writable: 512 data bytes then the status byte.
    h.mem
        .write_slice(&header(VIRTIO_BLK_T_IN, 2), GuestAddress(SCRATCH))
        .unwrap();
    let buf = SCRATCH + 0x1000;

    let used = h.submit_raw(&[(SCRATCH, 16, 0), (buf, 513, VIRTQ_DESC_F_WRITE)]);

    assert_eq!(used.len, 513);
    assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
    assert_eq!(h.q.read(buf, 512), &image[1024..1536]);
}

#[test]
fn write_data_may_follow_the_header_in_the_same_descriptor() {
    let mut h = Harness::new(&vec![0u8; SECTORS * 512]);
    let data = pattern(512, 7);
    let mut request = header(VIRTIO_BLK_T_OUT, 5).to_vec();
    request.extend_from_slice(&data);

    let used = h.submit(&[Part::Read(&request), Part::Write(1)]);

    assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
    assert_eq!(&h.image()[5 * 512..6 * 512], &data[..]);
}

#[test]
fn several_requests_in_one_notification_are_all_served_with_one_interrupt() {
    let image = pattern(SECTORS * 512, 8);
    let mut h = Harness::new(&image);
    let _ = h.interrupts();
    let headers: Vec<_> = (0..8).map(|i| header(VIRTIO_BLK_T_IN, i * 2)).collect();
    for hdr in &headers {
        h.q.push(&[Part::Read(hdr), Part::Write(1024), Part::Write(1)]);
    }

    h.kick();

    for i in 0..8 {
        let used = h.pop_used();
        assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
        assert_eq!(
            h.q.read(used.descs[1].0, 1024),
            &image[i * 1024..(i + 1) * 1024]
        );
    }
    assert_eq!(h.interrupts(), 1);
}

#[test]
fn flush_succeeds_with_only_the_status_byte_used() {
    let mut h = Harness::new(&vec![0u8; SECTORS * 512]);
    h.write_sectors(0, &pattern(512, 9));
    let hdr = header(VIRTIO_BLK_T_FLUSH, 0);

    let used = h.submit(&[Part::Read(&hdr), Part::Write(1)]);

    assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
    assert_eq!(used.len, 1);
}

#[test]
fn get_id_returns_the_configured_id_nul_padded() {
    let (dir, path) = image_file(&[0u8; 512]);
    let cfg = BlockConfig {
        id: Some("scratch-disk".into()),
        backing: None,
        ..config(&path)
    };
    let mut h = Harness::with_config(dir, cfg);
    let hdr = header(VIRTIO_BLK_T_GET_ID, 0);

    let used = h.submit(&[Part::Read(&hdr), Part::Write(20), Part::Write(1)]);

    assert_eq!(h.status(&used), VIRTIO_BLK_S_OK);
    assert_eq!(used.len, 21);
    assert_eq!(
        h.q.read(used.descs[1].0, 20),
        b"scratch-disk\0\0\0\0\0\0\0\0"
    );
}

#[test]
fn get_id_of_twenty_bytes_has_no_terminator_and_no_id_reads_as_empty() {
    let (dir, path) = image_file(&[0u8; 512]);
    let full = BlockConfig {
        id: Some("0123456789abcdefghij".into()),
        backing: None,
        ..config(&path)
    };
    let mut with_id = Harness::with_config(dir, full);
    let mut without = Harness::new(&[0u8; 512]);
    let hdr = header(VIRTIO_BLK_T_GET_ID, 0);

    let a = with_id.submit(&[Part::Read(&hdr), Part::Write(20), Part::Write(1)]);
    let b = without.submit(&[Part::Read(&hdr), Part::Write(20), Part::Write(1)]);

    assert_eq!(with_id.q.read(a.descs[1].0, 20), b"0123456789abcdefghij");
    assert_eq!(without.status(&b), VIRTIO_BLK_S_OK);
    assert_eq!(without.q.read(b.descs[1].0, 20), [0u8; 20]);
}

#[test]
fn unsupported_request_types_get_unsupp() {
    let mut h = Harness::new(&vec![0u8; SECTORS * 512]);
    // DISCARD (11), WRITE_ZEROES (13), SECURE_ERASE (14), GET_LIFETIME (10), garbage.
    for request_type in [11, 13, 14, 10, 0xdead_beef] {
        let hdr = header(request_type, 0);

        let used = h.submit(&[Part::Read(&hdr), Part::Read(&[0u8; 16]), Part::Write(1)]);

        assert_eq!(h.status(&used), VIRTIO_BLK_S_UNSUPP, "type {request_type}");
        assert_eq!(used.len, 1);
    }
    assert!(h.image().iter().all(|&b| b == 0), "nothing written");
}

//! Malformed chains and messages from a hostile guest: each is answered with an error reply when
//! it can be (a readable request header and room for a reply header) and returned unanswered
//! (used length 0) when it cannot; the queue keeps working and nothing on the host changes.

use fuse_backend_rs::abi::fuse_abi::{EntryOut, InHeader, Opcode, OutHeader, ReadIn, ROOT_ID};
use vm_memory::{ByteValued, Bytes, GuestAddress};

use super::driver::{Part, VIRTQ_DESC_F_WRITE};
use super::harness::{message, name_arg, read_in, Harness, MEM_SIZE, SCRATCH};
use super::FILE_CONTENTS;
use crate::devices::virtio::fs::request::OUT_HEADER_SIZE;
use crate::devices::virtio::fs::{QUEUE_SIZE, REQUEST_QUEUE};

const W: u16 = VIRTQ_DESC_F_WRITE;
/// Byte the tests fill guest buffers with, to see whether the device wrote them.
const POISON: u8 = 0xa5;
const REQUEST: u64 = SCRATCH;
const REPLY: u64 = SCRATCH + 0x10_0000;

/// A well-formed request still works and every chain came back.
fn assert_queue_still_works(h: &mut Harness) {
    let reply = h.lookup(ROOT_ID, "file");
    assert_eq!(reply.header.error, 0, "follow-up request");
    assert_eq!(
        reply.decode::<EntryOut>().attr.size as usize,
        FILE_CONTENTS.len()
    );
    assert_eq!(
        h.queues[REQUEST_QUEUE].free_count(),
        usize::from(QUEUE_SIZE),
        "every chain came back"
    );
}

/// Writes `bytes` at [`REQUEST`] and `len` poison bytes at [`REPLY`].
fn stage(h: &Harness, bytes: &[u8], len: usize) {
    h.mem.write_slice(bytes, GuestAddress(REQUEST)).unwrap();
    h.mem
        .write_slice(&vec![POISON; len], GuestAddress(REPLY))
        .unwrap();
}

fn reply_untouched(h: &Harness, len: usize) -> bool {
    h.queues[REQUEST_QUEUE]
        .read(REPLY, len)
        .iter()
        .all(|&b| b == POISON)
}

#[test]
fn a_request_shorter_than_a_header_goes_back_unanswered() {
    let mut h = Harness::new(false);
    let msg = h.message(Opcode::Lookup, ROOT_ID, &name_arg("file"));
    stage(&h, &msg[..20], 64);

    let used = h.submit_raw(&[(REQUEST, 20, 0), (REPLY, 64, W)]);

    assert_eq!(used.len, 0);
    assert!(reply_untouched(&h, 64));
    assert_queue_still_works(&mut h);
}

#[test]
fn a_chain_without_readable_buffers_goes_back_unanswered() {
    let mut h = Harness::new(false);

    let used = h.submit(&[Part::Write(64), Part::Write(64)]);

    assert_eq!(used.len, 0);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_request_in_a_device_writable_buffer_is_not_served() {
    let mut h = Harness::new(false);
    let msg = h.message(Opcode::Lookup, ROOT_ID, &name_arg("file"));
    let unique = h.last_unique();
    stage(&h, &msg, 64);

    // Wrong directions: the request device-writable, the reply buffer device-readable. The device
    // takes the poison in the readable buffer as the request and answers it with an error in the
    // only writable buffer.
    let used = h.submit_raw(&[(REQUEST, msg.len() as u32, W), (REPLY, 64, 0)]);

    let answer: OutHeader = super::harness::decode(&h.queues[REQUEST_QUEUE].read(REQUEST, 16));
    assert!(
        reply_untouched(&h, 64),
        "wrote into a device-readable buffer"
    );
    assert!(used.len as usize <= msg.len());
    assert_ne!(
        answer.unique, unique,
        "served the request in the writable buffer"
    );
    assert!(answer.error < 0);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_truncated_body_is_answered_with_einval() {
    let mut h = Harness::new(false);
    // READ's arguments are 40 bytes; only 8 are sent.
    let msg = h.message(Opcode::Read, ROOT_ID, &read_in(1, 0, 4096).as_slice()[..8]);
    let unique = h.last_unique();

    let used = h.submit(&[Part::Read(&msg), Part::Write(256)]);
    let reply = h.reply(&used);

    assert_eq!(reply.len as usize, OUT_HEADER_SIZE);
    assert_eq!(reply.header.error, -libc::EINVAL);
    assert_eq!(reply.header.unique, unique);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_header_claiming_more_than_was_sent_is_answered_with_einval() {
    let mut h = Harness::new(false);
    let mut msg = h.message(Opcode::Lookup, ROOT_ID, &name_arg("file"));
    let mut header: InHeader = super::harness::decode(&msg);
    header.len = 4000;
    msg[..40].copy_from_slice(header.as_slice());

    let reply = {
        let used = h.submit(&[Part::Read(&msg), Part::Write(256)]);
        h.reply(&used)
    };

    assert_eq!(reply.header.error, -libc::EINVAL);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_name_without_its_nul_is_answered_with_einval() {
    let mut h = Harness::new(false);

    let reply = h.call(Opcode::Lookup, ROOT_ID, b"file", 256);

    assert_eq!(reply.header.error, -libc::EINVAL);
    assert_eq!(reply.len as usize, OUT_HEADER_SIZE);
    assert_queue_still_works(&mut h);
}

#[test]
fn an_unknown_opcode_is_answered_with_enosys() {
    let mut h = Harness::new(false);
    let mut msg = message(Opcode::Lookup, 77, ROOT_ID, &[]);
    msg[4..8].copy_from_slice(&9999u32.to_le_bytes());

    let used = h.submit(&[Part::Read(&msg), Part::Write(256)]);
    let reply = h.reply(&used);

    assert_eq!(reply.header.error, -libc::ENOSYS);
    assert_eq!(reply.header.unique, 77);
    assert_queue_still_works(&mut h);
}

#[test]
fn opcodes_missing_from_the_fuse_protocol_are_answered_with_enosys() {
    let mut h = Harness::new(false);

    let errors: Vec<(u32, i32, u64)> = [0u32, 7, 19]
        .into_iter()
        .map(|opcode| {
            let mut msg = message(Opcode::Lookup, u64::from(opcode) + 100, ROOT_ID, &[]);
            msg[4..8].copy_from_slice(&opcode.to_le_bytes());
            let used = h.submit(&[Part::Read(&msg), Part::Write(256)]);
            let reply = h.reply(&used);
            (opcode, reply.header.error, reply.header.unique)
        })
        .collect();

    let expected: Vec<(u32, i32, u64)> = [0u32, 7, 19]
        .into_iter()
        .map(|opcode| (opcode, -libc::ENOSYS, u64::from(opcode) + 100))
        .collect();
    assert_eq!(errors, expected);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_read_without_a_reply_buffer_goes_back_unanswered() {
    let mut h = Harness::new(false);
    let node = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;
    let fh = h.open(node, libc::O_RDONLY).unwrap();
    let msg = h.message(Opcode::Read, node, read_in(fh, 0, 4096).as_slice());

    let used = h.submit(&[Part::Read(&msg)]);

    assert_eq!(used.len, 0);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_reply_buffer_smaller_than_a_reply_header_is_not_overrun() {
    let mut h = Harness::new(false);
    let msg = h.message(Opcode::Lookup, ROOT_ID, &name_arg("file"));
    stage(&h, &msg, 64);

    let used = h.submit_raw(&[(REQUEST, msg.len() as u32, 0), (REPLY, 8, W)]);

    assert!(used.len <= 8, "used length {} > 8 writable bytes", used.len);
    let past_the_buffer = h.queues[REQUEST_QUEUE].read(REPLY + 8, 56);
    assert!(past_the_buffer.iter().all(|&b| b == POISON));
    assert_queue_still_works(&mut h);
}

#[test]
fn a_read_larger_than_the_reply_buffer_writes_only_the_buffer() {
    let mut h = Harness::new(false);
    let node = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;
    let fh = h.open(node, libc::O_RDONLY).unwrap();
    let args = ReadIn {
        size: 1 << 20,
        ..read_in(fh, 0, 0)
    };
    let msg = h.message(Opcode::Read, node, args.as_slice());
    stage(&h, &msg, 64);

    let used = h.submit_raw(&[(REQUEST, msg.len() as u32, 0), (REPLY, 24, W)]);

    assert!(used.len <= 24);
    assert!(h.queues[REQUEST_QUEUE]
        .read(REPLY + 24, 40)
        .iter()
        .all(|&b| b == POISON));
    assert_queue_still_works(&mut h);
}

#[test]
fn a_buffer_outside_guest_memory_goes_back_unanswered() {
    let mut h = Harness::new(false);
    let msg = h.message(Opcode::Lookup, ROOT_ID, &name_arg("file"));
    stage(&h, &msg, 64);

    let used = h.submit_raw(&[(REQUEST, msg.len() as u32, 0), (MEM_SIZE - 16, 64, W)]);

    assert_eq!(used.len, 0);
    assert_queue_still_works(&mut h);
}

#[test]
fn a_looping_chain_does_not_wedge_the_queue() {
    let mut h = Harness::new(false);
    let msg = h.message(Opcode::Lookup, ROOT_ID, &name_arg("file"));
    let head = h.queues[REQUEST_QUEUE].push(&[Part::Read(&msg), Part::Write(256)]);
    h.queues[REQUEST_QUEUE].link_tail(head, head);

    h.kick(REQUEST_QUEUE);

    assert!(
        h.queues[REQUEST_QUEUE].pop_used().is_some(),
        "the chain came back"
    );
    assert_queue_still_works(&mut h);
}

#[test]
fn forget_with_a_truncated_body_is_dropped_silently() {
    let mut h = Harness::new(false);
    let msg = h.message(Opcode::Forget, 2, &[1, 0]);

    let used = h.submit(&[Part::Read(&msg), Part::Write(64)]);

    assert_eq!(used.len, 0);
    assert_queue_still_works(&mut h);
}

#[test]
fn an_o_path_open_is_refused_and_reads_with_other_flags_leave_the_handle_working() {
    // Arrange
    let mut h = Harness::new(false);
    let node = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;
    let fh = h.open(node, libc::O_RDONLY).unwrap();
    // Flags a guest may send with a read that `fcntl(F_SETFL)` would act on or refuse.
    let odd_flags = (libc::O_DIRECT | libc::O_NONBLOCK | libc::O_APPEND | libc::O_PATH) as u32;
    let odd_read = ReadIn {
        flags: odd_flags,
        ..read_in(fh, 0, 4096)
    };

    // Act
    let o_path = h.open(node, libc::O_PATH);
    let first = h.call(Opcode::Read, node, odd_read.as_slice(), 16 + 4096);
    let second = h.call(
        Opcode::Read,
        node,
        read_in(fh, 0, 4096).as_slice(),
        16 + 4096,
    );

    // Assert
    assert_eq!(o_path, Err(-libc::EINVAL));
    assert_eq!(first.header.error, 0);
    assert_eq!(first.body, FILE_CONTENTS);
    assert_eq!(
        second.body, FILE_CONTENTS,
        "the handle's descriptor still reads"
    );
}

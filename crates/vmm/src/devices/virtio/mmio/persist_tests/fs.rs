//! virtio-fs across a snapshot: refused while the guest has the share mounted; restored without
//! a session, ready to be mounted again.

use std::mem::size_of;

use fuse_backend_rs::abi::fuse_abi::{InHeader, InitIn, Opcode, OutHeader};
use vm_memory::ByteValued;

use super::{guest_memory, Error, Rig};
use crate::devices::virtio::fs::{Fs, FsConfig, QUEUE_SIZE, REQUEST_QUEUE};
use crate::devices::virtio::test_driver::{Part, TestQueue};

const TAG: &str = "snapshare";

/// A read-only share of a new temporary directory (allowed whoever runs the tests).
fn share(dir: &tempfile::TempDir) -> Fs {
    Fs::new(FsConfig {
        tag: TAG.into(),
        shared_dir: dir.path().to_owned(),
        read_only: true,
        owner: None,
    })
    .unwrap()
}

/// A FUSE request: header, then `args`.
fn message(opcode: Opcode, unique: u64, args: &[u8]) -> Vec<u8> {
    let header = InHeader {
        len: (size_of::<InHeader>() + args.len()) as u32,
        opcode: opcode as u32,
        unique,
        nodeid: 0,
        uid: 0,
        gid: 0,
        pid: 1,
        padding: 0,
    };
    [header.as_slice(), args].concat()
}

/// Sends `opcode` on the request queue and returns the reply's `error` (0: success).
fn call(rig: &mut Rig<Fs>, q: &mut TestQueue, opcode: Opcode, args: &[u8]) -> i32 {
    let request = message(opcode, 1, args);
    q.push(&[Part::Read(&request), Part::Write(256)]);
    rig.notify(REQUEST_QUEUE as u32);
    let used = q.pop_used().unwrap();
    let reply = q.read(used.descs[1].0, size_of::<OutHeader>());
    let mut header = OutHeader::default();
    header.as_mut_slice().copy_from_slice(&reply);
    header.error
}

fn init(rig: &mut Rig<Fs>, q: &mut TestQueue) -> i32 {
    let args = InitIn {
        major: 7,
        minor: 33,
        max_readahead: 128 << 10,
        flags: 0,
    };
    call(rig, q, Opcode::Init, args.as_slice())
}

#[test]
fn mounted_share_refuses_a_snapshot_and_a_restored_one_can_be_mounted_again() {
    let dir = tempfile::tempdir().unwrap();
    let mem = guest_memory();
    let hiprio = TestQueue::new(&mem, 0x1000, 0x10_0000, QUEUE_SIZE);
    let mut requests = TestQueue::new(&mem, 0x4000, 0x140_0000, QUEUE_SIZE);
    let state = {
        let mut rig = Rig::new(&mem, share(&dir));
        rig.negotiate();
        rig.set_up_queues(&[&hiprio, &requests], &[QUEUE_SIZE; 2]);
        assert_eq!(init(&mut rig, &mut requests), 0);

        let mounted = rig.transport.save();
        let destroyed = call(&mut rig, &mut requests, Opcode::Destroy, &[]);
        let unmounted = rig.transport.save();

        let err = mounted.unwrap_err();
        assert!(matches!(err, Error::SnapshotRefused(_)));
        assert_eq!(
            err.to_string(),
            "virtio-fs share snapshare is mounted in the guest; unmount it before a snapshot"
        );
        assert_eq!(destroyed, 0);
        unmounted.unwrap()
    };

    let mut rig = Rig::restored(&mem, share(&dir), &state);
    let mounted_again = init(&mut rig, &mut requests);

    assert_eq!(state.positions[REQUEST_QUEUE].next_used, 2);
    assert_eq!(mounted_again, 0);
    assert_eq!(requests.used_idx(), 3);
    assert!(rig.transport.save().is_err(), "mounted again");
}

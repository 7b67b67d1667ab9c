//! FUSE through the virtqueues: raw messages on the request queue, replies checked in the used
//! ring.

use fuse_backend_rs::abi::fuse_abi::{
    AttrOut, EntryOut, ForgetIn, GetattrIn, InitOut, Opcode, WriteOut, ROOT_ID,
};
use vm_memory::ByteValued;

use super::harness::{
    create_args, init_in, read_in, write_args, Harness, ATTR_OUT_SIZE, ENTRY_OUT_SIZE,
    WRITE_OUT_SIZE,
};
use super::{test_owner, FILE_CONTENTS};
use crate::devices::virtio::fs::request::OUT_HEADER_SIZE;
use crate::devices::virtio::fs::{Error, ShareFs, HIPRIO_QUEUE, REQUEST_QUEUE};
use crate::devices::virtio::VirtioDevice;
use std::path::Path;

#[test]
fn init_is_answered_with_the_protocol_version() {
    let mut h = Harness::uninitialised(false);

    let reply = h.call(Opcode::Init, 0, init_in().as_slice(), 256);

    let out: InitOut = reply.decode();
    assert_eq!(reply.header.error, 0);
    assert_eq!(reply.header.unique, h.last_unique());
    assert_eq!(reply.header.len, reply.len);
    assert_eq!(out.major, 7);
    assert_eq!(h.interrupts(), 1);
}

#[test]
fn lookup_getattr_and_read_return_a_host_file() {
    let mut h = Harness::new(true);

    let entry: EntryOut = h.lookup(ROOT_ID, "file").decode();
    let getattr = GetattrIn::default();
    let attr = h.call(Opcode::Getattr, entry.nodeid, getattr.as_slice(), 256);
    let fh = h.open(entry.nodeid, libc::O_RDONLY).unwrap();
    let read_args = read_in(fh, 0, 4096);
    let read = h.call(Opcode::Read, entry.nodeid, read_args.as_slice(), 16 + 4096);

    assert_ne!(entry.nodeid, 0);
    assert_eq!(entry.attr.size as usize, FILE_CONTENTS.len());
    assert_eq!(attr.len as usize, OUT_HEADER_SIZE + ATTR_OUT_SIZE);
    assert_eq!(attr.decode::<AttrOut>().attr.ino, entry.attr.ino);
    assert_eq!(read.header.error, 0);
    assert_eq!(read.len as usize, OUT_HEADER_SIZE + FILE_CONTENTS.len());
    assert_eq!(read.body, FILE_CONTENTS);
}

#[test]
fn lookup_of_a_missing_name_is_enoent() {
    let mut h = Harness::new(false);

    let reply = h.lookup(ROOT_ID, "missing");

    assert_eq!(reply.header.error, -libc::ENOENT);
    assert_eq!(reply.len as usize, OUT_HEADER_SIZE);
}

#[test]
fn write_on_a_read_only_share_is_erofs_and_changes_nothing() {
    let mut h = Harness::new(true);
    let node = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;
    let fh = h.open(node, libc::O_RDONLY).unwrap();

    let reply = h.call(Opcode::Write, node, &write_args(fh, 0, b"overwritten"), 256);

    assert_eq!(reply.header.error, -libc::EROFS);
    assert_eq!(reply.len as usize, OUT_HEADER_SIZE);
    assert_eq!(std::fs::read(h.path("file")).unwrap(), FILE_CONTENTS);
}

#[test]
fn open_for_writing_on_a_read_only_share_is_erofs() {
    let mut h = Harness::new(true);
    let node = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;

    let result = h.open(node, libc::O_RDWR);

    assert_eq!(result, Err(-libc::EROFS));
}

#[test]
fn create_and_write_reach_the_host_file() {
    let mut h = Harness::new(false);

    let created = h.call(Opcode::Create, ROOT_ID, &create_args("new.txt"), 4096);
    let entry: EntryOut = created.decode();
    let open: fuse_backend_rs::abi::fuse_abi::OpenOut =
        super::harness::decode(&created.body[ENTRY_OUT_SIZE..]);
    let written = h.call(
        Opcode::Write,
        entry.nodeid,
        &write_args(open.fh, 0, b"from the guest"),
        256,
    );

    assert_eq!(created.header.error, 0);
    assert_eq!(written.len as usize, OUT_HEADER_SIZE + WRITE_OUT_SIZE);
    assert_eq!(written.decode::<WriteOut>().size, 14);
    assert_eq!(std::fs::read(h.path("new.txt")).unwrap(), b"from the guest");
    let meta = std::fs::metadata(h.path("new.txt")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.uid(), meta.gid()), test_owner());
}

#[test]
fn forget_on_the_hiprio_queue_needs_no_reply_and_the_device_keeps_serving() {
    let mut h = Harness::new(false);
    let node = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;
    let forget = h.message(Opcode::Forget, node, ForgetIn { nlookup: 1 }.as_slice());

    h.queues[HIPRIO_QUEUE].push(&[super::driver::Part::Read(&forget)]);
    h.kick(HIPRIO_QUEUE);

    assert_eq!(h.pop_used(HIPRIO_QUEUE).len, 0);
    let again = h.lookup(ROOT_ID, "file");
    assert_eq!(again.header.error, 0);
}

#[test]
fn every_chain_comes_back_on_the_request_queue() {
    let mut h = Harness::new(false);

    for _ in 0..300 {
        assert_eq!(h.lookup(ROOT_ID, "file").header.error, 0);
    }

    let free = h.queues[REQUEST_QUEUE].free_count();
    assert_eq!(free, usize::from(crate::devices::virtio::fs::QUEUE_SIZE));
}

#[test]
fn after_a_reset_the_driver_starts_over_with_init() {
    let mut h = Harness::new(false);
    let old = h.lookup(ROOT_ID, "file").decode::<EntryOut>().nodeid;

    assert!(h.dev().reset());
    h.replace_queues();
    h.activate();
    let stale = h.open(old, libc::O_RDONLY);
    let init = h.call(Opcode::Init, 0, init_in().as_slice(), 256);
    let lookup = h.lookup(ROOT_ID, "file");

    assert_eq!(stale, Err(-libc::EBADF));
    assert_eq!(init.header.error, 0);
    assert_eq!(lookup.header.error, 0);
}

#[test]
fn copy_file_range_is_not_served() {
    let mut h = Harness::new(false);

    let reply = h.call(Opcode::CopyFileRange, ROOT_ID, &[0; 56], 256);

    assert_eq!(reply.header.error, -libc::ENOSYS);
}

/// A directory holding `name`, given to the test owner, and its `O_PATH` descriptor.
fn other_dir(name: &str) -> (tempfile::TempDir, std::fs::File) {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(name), b"attached").unwrap();
    super::give_to_owner(dir.path());
    super::give_to_owner(&dir.path().join(name));
    let fd = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(dir.path())
        .unwrap();
    (dir, fd)
}

#[test]
fn a_directory_attached_to_an_unmounted_device_is_what_the_next_mount_sees() {
    // Arrange: activated, never mounted (no FUSE_INIT), as an idle share slot is.
    let mut h = Harness::uninitialised(true);
    let (_other, fd) = other_dir("new-file");
    let share = ShareFs::from_root(fd, Path::new("(attached)"), false, Some(test_owner())).unwrap();

    // Act
    h.dev().attach_share(share).unwrap();
    let init = h.call(Opcode::Init, 0, init_in().as_slice(), 256);
    let attached = h.lookup(ROOT_ID, "new-file");
    let old = h.lookup(ROOT_ID, "file");

    // Assert
    assert_eq!(init.header.error, 0);
    assert_eq!(attached.header.error, 0);
    assert_eq!(old.header.error, -libc::ENOENT);
    assert!(!h.dev().is_read_only());
}

#[test]
fn a_directory_cannot_replace_a_mounted_share() {
    // Arrange: FUSE_INIT done, as a guest that mounted the tag.
    let h = Harness::new(false);
    let (_other, fd) = other_dir("new-file");
    let share = ShareFs::from_root(fd, Path::new("(attached)"), true, Some(test_owner())).unwrap();

    // Act
    let refused = h.dev().attach_share(share);

    // Assert
    assert!(matches!(refused, Err(Error::ShareInUse(tag)) if tag == super::harness::TAG));
    assert!(!h.dev().is_read_only());
}

#[test]
fn a_descriptor_of_a_file_is_no_share() {
    let dir = tempfile::tempdir().unwrap();
    let file = std::fs::File::create(dir.path().join("f")).unwrap();

    let refused = ShareFs::from_root(file, Path::new("f"), true, Some(test_owner()));

    assert!(matches!(refused, Err(Error::NotADirectory(_))));
}

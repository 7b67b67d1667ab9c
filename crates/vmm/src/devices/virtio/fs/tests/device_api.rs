//! The device as the transport and the VMM builder see it: identity, features, configuration
//! space, activation, and the errors of a bad configuration.

use std::path::PathBuf;
use std::sync::Arc;

use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vmm_sys_util::eventfd::EventFd;

use super::harness::{Harness, TAG};
use super::{populate, test_owner};
use crate::devices::virtio::fs::{Error, Fs, FsConfig, CONFIG_SPACE_SIZE, FS_QUEUE_SIZES};
use crate::devices::virtio::{
    device_type, ActivateContext, ActivateError, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1,
};

fn config(tag: &str, shared_dir: PathBuf) -> FsConfig {
    FsConfig {
        tag: tag.into(),
        shared_dir,
        read_only: true,
        owner: Some(test_owner()),
    }
}

/// A directory with the standard fixtures, owned by the test owner.
fn shared_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    super::give_to_owner(dir.path());
    populate(dir.path());
    dir
}

#[test]
fn the_device_is_a_version_1_file_system_with_two_queues() {
    let h = Harness::new(false);
    let dev = h.dev();

    assert_eq!(dev.device_type(), device_type::FS);
    assert_eq!(dev.device_type(), 26);
    assert_eq!(dev.queue_max_sizes(), &FS_QUEUE_SIZES);
    assert_eq!(
        dev.avail_features(),
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX
    );
    assert!(dev.is_activated());
}

#[test]
fn the_configuration_space_holds_the_padded_tag_and_one_request_queue() {
    let h = Harness::new(false);
    let mut space = [0xffu8; CONFIG_SPACE_SIZE + 4];

    h.dev().read_config(0, &mut space);

    let mut tag = [0u8; 36];
    tag[..TAG.len()].copy_from_slice(TAG.as_bytes());
    assert_eq!(&space[..36], &tag);
    assert_eq!(&space[36..40], &1u32.to_le_bytes());
    assert_eq!(&space[40..], &[0; 4], "bytes past the end read as 0");
}

#[test]
fn a_36_byte_tag_fills_the_field_without_a_nul() {
    let dir = shared_dir();
    let tag = "t".repeat(36);

    let dev = Fs::new(config(&tag, dir.path().into())).unwrap();
    let mut field = [0u8; 36];
    dev.read_config(0, &mut field);

    assert_eq!(field, [b't'; 36]);
    assert_eq!(dev.tag(), tag);
}

#[test]
fn config_writes_are_ignored() {
    let h = Harness::new(false);

    h.dev().write_config(0, b"hijacked");

    let mut start = [0u8; 8];
    h.dev().read_config(0, &mut start);
    assert_eq!(&start, &TAG.as_bytes()[..8]);
}

#[test]
fn bad_tags_are_refused() {
    let dir = shared_dir();
    let new = |tag: &str| Fs::new(config(tag, dir.path().into()));

    assert!(matches!(new(""), Err(Error::EmptyTag)));
    assert!(matches!(
        new(&"x".repeat(37)),
        Err(Error::TagTooLong { len: 37, .. })
    ));
    assert!(matches!(new("a\0b"), Err(Error::TagNul(_))));
}

#[test]
fn a_missing_or_non_directory_share_is_refused() {
    let dir = shared_dir();

    let missing = Fs::new(config("t", dir.path().join("nope")));
    let file = Fs::new(config("t", dir.path().join("file")));

    assert!(
        matches!(&missing, Err(Error::OpenDir { source, .. }) if source.raw_os_error() == Some(libc::ENOENT)),
        "{missing:?}"
    );
    assert!(matches!(file, Err(Error::NotADirectory(_))), "{file:?}");
}

#[test]
fn the_accessors_report_the_configuration() {
    let dir = shared_dir();

    let dev = Fs::new(config("docs", dir.path().into())).unwrap();

    assert_eq!(dev.tag(), "docs");
    assert_eq!(dev.shared_dir(), dir.path());
    assert!(dev.is_read_only());
    assert_eq!(dev.owner(), test_owner());
    assert!(!dev.is_activated());
}

#[test]
fn activation_needs_both_queues() {
    let dir = shared_dir();
    let mut dev = Fs::new(config("t", dir.path().into())).unwrap();
    let mem =
        vm_memory::GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x10000)]).unwrap();
    let ctx = ActivateContext {
        mem,
        queues: vec![virtio_queue::Queue::new(256).unwrap()],
        queue_evts: vec![EventFd::new(libc::EFD_NONBLOCK).unwrap()],
        interrupt: Arc::new(IrqTrigger::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())),
    };

    let result = dev.activate(ctx);

    assert!(matches!(
        result,
        Err(ActivateError::QueueCount {
            expected: 2,
            got: 1
        })
    ));
    assert!(!dev.is_activated());
}

#[test]
fn acked_features_are_limited_to_the_offered_ones() {
    let h = Harness::new(false);

    h.dev().set_acked_features(u64::MAX);

    assert_eq!(
        h.dev().acked_features(),
        1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_RING_F_EVENT_IDX
    );
}

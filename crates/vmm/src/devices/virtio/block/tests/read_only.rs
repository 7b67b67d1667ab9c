//! A read-only disk: writes refused host-side whatever the driver negotiated; reads and flushes
//! work; the image is opened `O_RDONLY | O_CLOEXEC`.

use std::time::{Duration, SystemTime};

use super::driver::Part;
use super::{header, pattern, Harness};
use crate::devices::virtio::block::{
    VIRTIO_BLK_F_RO, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_FLUSH,
};
use crate::devices::virtio::VirtioDevice;

const SECTORS: usize = 16;

/// Sets the image's mtime to a fixed past time and returns it.
fn pin_mtime(h: &Harness) -> SystemTime {
    let past = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    std::fs::File::open(&h.path)
        .unwrap()
        .set_modified(past)
        .unwrap();
    past
}

fn mtime(h: &Harness) -> SystemTime {
    std::fs::metadata(&h.path).unwrap().modified().unwrap()
}

#[test]
fn write_is_ioerr_and_leaves_the_file_bytes_and_mtime_unchanged() {
    let image = pattern(SECTORS * 512, 21);
    let mut h = Harness::read_only(&image);
    let pinned = pin_mtime(&h);

    let status = h.write_sectors(2, &pattern(1024, 22));

    assert_eq!(status, VIRTIO_BLK_S_IOERR);
    assert_eq!(h.image(), image);
    assert_eq!(mtime(&h), pinned);
}

#[test]
fn write_is_refused_even_when_the_driver_did_not_accept_ro() {
    let image = pattern(SECTORS * 512, 23);
    let mut h = Harness::read_only(&image);
    let offered = h.dev().avail_features();
    h.dev()
        .set_acked_features(offered & !(1 << VIRTIO_BLK_F_RO));

    let status = h.write_sectors(0, &pattern(512, 24));

    assert_eq!(status, VIRTIO_BLK_S_IOERR);
    assert_eq!(h.image(), image);
}

#[test]
fn reads_and_flushes_succeed() {
    let image = pattern(SECTORS * 512, 25);
    let mut h = Harness::read_only(&image);
    let flush = header(VIRTIO_BLK_T_FLUSH, 0);

    let (read_status, data) = h.read_sectors(4, 2);
    let flushed = h.submit(&[Part::Read(&flush), Part::Write(1)]);

    assert_eq!(read_status, VIRTIO_BLK_S_OK);
    assert_eq!(data, &image[4 * 512..6 * 512]);
    assert_eq!(h.status(&flushed), VIRTIO_BLK_S_OK);
}

#[test]
fn image_is_opened_read_only_and_close_on_exec() {
    let h = Harness::read_only(&[0u8; 512]);

    let flags = open_flags_of(&h.path).expect("the device holds the image open");

    assert_eq!(flags & libc::O_ACCMODE, libc::O_RDONLY);
    assert_ne!(flags & libc::O_CLOEXEC, 0);
}

#[test]
fn writable_image_is_opened_read_write() {
    let h = Harness::new(&[0u8; 512]);

    let flags = open_flags_of(&h.path).expect("the device holds the image open");

    assert_eq!(flags & libc::O_ACCMODE, libc::O_RDWR);
}

/// The `open` flags of this process's descriptor for `path`, from `/proc/self/fdinfo`.
fn open_flags_of(path: &std::path::Path) -> Option<i32> {
    for entry in std::fs::read_dir("/proc/self/fd").ok()? {
        let entry = entry.ok()?;
        if std::fs::read_link(entry.path()).ok().as_deref() != Some(path) {
            continue;
        }
        let info =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", entry.file_name().to_str()?))
                .ok()?;
        let octal = info.lines().find_map(|l| l.strip_prefix("flags:"))?.trim();
        return i32::from_str_radix(octal, 8).ok();
    }
    None
}

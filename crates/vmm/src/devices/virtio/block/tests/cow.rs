//! Copy-on-write disks: reads from the backing image, writes (and copied-up clusters) in the
//! overlay, the backing image untouched, and a snapshot's flatten making the overlay whole.

use std::fs::File;
use std::path::Path;

use super::{config, pattern, Harness};
use crate::devices::virtio::block::cow::CLUSTER_BYTES;
use crate::devices::virtio::block::{Block, BlockConfig, Error, VIRTIO_BLK_S_OK};
use crate::devices::virtio::VirtioDevice;

/// Four whole clusters and a short fifth one (4 KiB), so the last cluster ends with the disk.
const DISK_BYTES: usize = 4 * CLUSTER_BYTES as usize + 4096;
/// Sectors per read of [`whole_disk`] (the test queue's buffers hold 68 KiB).
const CHUNK_SECTORS: u32 = 128;

/// A backing image `base.img` holding `base`, and a new empty sparse overlay `overlay.img` of
/// its size, in a temporary directory.
fn cow_files(base: &[u8]) -> (tempfile::TempDir, BlockConfig) {
    let dir = tempfile::tempdir().unwrap();
    let backing = dir.path().join("base.img");
    std::fs::write(&backing, base).unwrap();
    let overlay = dir.path().join("overlay.img");
    File::create(&overlay)
        .unwrap()
        .set_len(base.len() as u64)
        .unwrap();
    let config = BlockConfig {
        backing: Some(backing),
        ..config(&overlay)
    };
    (dir, config)
}

/// The whole disk as the guest reads it.
fn whole_disk(h: &mut Harness) -> Vec<u8> {
    let sectors = (DISK_BYTES / 512) as u32;
    let mut disk = Vec::new();
    let mut sector = 0;
    while sector < sectors {
        let n = CHUNK_SECTORS.min(sectors - sector);
        let (status, data) = h.read_sectors(u64::from(sector), n);
        assert_eq!(status, VIRTIO_BLK_S_OK);
        disk.extend(data);
        sector += n;
    }
    disk
}

/// Byte offset of the first data in `path` (`SEEK_DATA`), `None` when it is all hole.
fn first_data(path: &Path) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let file = File::open(path).unwrap();
    // SAFETY: lseek on a descriptor `file` keeps open; no memory is passed.
    let at = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_DATA) };
    u64::try_from(at).ok()
}

#[test]
fn a_copy_on_write_disk_reads_its_backing_image_and_writes_only_its_overlay() {
    // Arrange
    let base = pattern(DISK_BYTES, 7);
    let (dir, config) = cow_files(&base);
    let overlay = config.path.clone();
    let mut h = Harness::with_config(dir, config);
    let cluster_sectors = CLUSTER_BYTES / 512;
    // One sector inside cluster 1, and eight sectors across the border of clusters 2 and 3.
    let small = pattern(512, 8);
    let across = pattern(8 * 512, 9);
    let across_at = 3 * cluster_sectors - 4;

    // Act
    let untouched = whole_disk(&mut h);
    let small_status = h.write_sectors(cluster_sectors + 5, &small);
    let across_status = h.write_sectors(across_at, &across);
    let seen = whole_disk(&mut h);

    // Assert
    let mut expected = base.clone();
    let small_at = (cluster_sectors as usize + 5) * 512;
    expected[small_at..small_at + 512].copy_from_slice(&small);
    let across_byte = across_at as usize * 512;
    expected[across_byte..across_byte + across.len()].copy_from_slice(&across);
    assert_eq!(untouched, base, "before any write, the backing image");
    assert_eq!(
        (small_status, across_status),
        (VIRTIO_BLK_S_OK, VIRTIO_BLK_S_OK)
    );
    assert!(
        seen == expected,
        "the writes over the backing image's bytes"
    );
    let on_base = std::fs::read(h.dev().disk_backing().unwrap()).unwrap();
    assert!(on_base == base, "the backing image is unchanged");
    assert_eq!(
        first_data(&overlay),
        Some(CLUSTER_BYTES),
        "cluster 0, never written, is still a hole of the overlay"
    );
}

#[test]
fn a_snapshot_makes_the_overlay_the_whole_disk_and_it_stays_writable() {
    // Arrange: the backing image's cluster 3 is all zeros (a hole after the flatten too).
    let mut base = pattern(DISK_BYTES, 10);
    base[3 * CLUSTER_BYTES as usize..4 * CLUSTER_BYTES as usize].fill(0);
    let (dir, config) = cow_files(&base);
    let overlay = config.path.clone();
    let mut h = Harness::with_config(dir, config);
    let written = pattern(1024, 11);
    h.write_sectors(2, &written);

    // Act
    let prepared = h.dev().prepare_snapshot();
    let backing_after = h.dev().disk_backing().map(Path::to_owned);
    let later = pattern(512, 12);
    let later_status = h.write_sectors(4 * (CLUSTER_BYTES / 512), &later);

    // Assert
    let mut expected = base.clone();
    expected[1024..2048].copy_from_slice(&written);
    expected[4 * CLUSTER_BYTES as usize..4 * CLUSTER_BYTES as usize + 512].copy_from_slice(&later);
    assert_eq!(prepared, Ok(()));
    assert_eq!(backing_after, None, "no backing image after the flatten");
    assert_eq!(later_status, VIRTIO_BLK_S_OK);
    let file = std::fs::read(&overlay).unwrap();
    assert!(file == expected, "the overlay file alone holds the disk");
    assert!(whole_disk(&mut h) == expected, "and the guest reads it");
}

#[test]
fn a_backing_image_of_another_size_a_used_overlay_or_a_read_only_disk_is_refused() {
    // (A backing image may end in a part sector, which the guest never sees, as for any disk.)
    // Arrange
    let base = pattern(DISK_BYTES, 13);
    let (dir, good) = cow_files(&base);
    let short = dir.path().join("short.img");
    std::fs::write(&short, &base[..DISK_BYTES - 512]).unwrap();
    let used = dir.path().join("used.img");
    std::fs::write(&used, &base).unwrap();
    let part_sector = dir.path().join("part-sector.img");
    let mut longer = base.clone();
    longer.extend_from_slice(&[1; 100]);
    std::fs::write(&part_sector, &longer).unwrap();

    // Act
    let other_size = Block::new(BlockConfig {
        backing: Some(short.clone()),
        ..good.clone()
    });
    let not_empty = Block::new(BlockConfig {
        path: used.clone(),
        ..good.clone()
    });
    let read_only = Block::new(BlockConfig {
        read_only: true,
        ..good.clone()
    });
    // (Dropped at once: the device holds the overlay's lock.)
    let trailing_bytes = Block::new(BlockConfig {
        backing: Some(part_sector),
        ..good.clone()
    })
    .map(drop);

    // Assert
    assert!(
        matches!(&other_size, Err(Error::BackingSize { backing, disk, .. })
            if *backing == DISK_BYTES as u64 - 512 && *disk == DISK_BYTES as u64),
        "{other_size:?}"
    );
    assert!(
        matches!(&not_empty, Err(Error::OverlayNotEmpty(p)) if *p == used),
        "{not_empty:?}"
    );
    assert!(
        matches!(&read_only, Err(Error::ReadOnlyOverlay(_))),
        "{read_only:?}"
    );
    assert!(
        trailing_bytes.is_ok(),
        "a backing image's part sector at its end is not part of the disk: {trailing_bytes:?}"
    );
    assert!(
        Block::new(good).is_ok(),
        "the same files, as meant, are accepted"
    );
}

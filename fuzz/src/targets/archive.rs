//! `archive_unpack`: `bulkhead_protocol::archive::unpack`, which extracts the tar streams a
//! guest sends (`GET .../archive`, `bulkhead cp -r ID:/src DST`) on the host.
//!
//! The input is the tar stream. The harness extracts it into `dest/` of a fresh temporary
//! directory that also holds an empty `outside/` and, inside `dest/`, a symlink `planted` to
//! `../outside`; an odd first byte asks for the top-level name to be renamed (the `cp -r` case of
//! a destination that does not exist). Limits are small (256 entries, 1 MiB of file contents,
//! 4 KiB per metadata entry, 16 sparse extension blocks) so that inputs stay fast. After the
//! run, whatever it returned, nothing may exist outside `dest/` but the empty `outside/`.

use std::fs;
use std::os::unix::fs::symlink;

use bulkhead_protocol::archive::{self, Limits, UnpackOptions};

/// Runs one input.
///
/// # Panics
/// On a finding: a file, directory or link created outside the destination.
pub fn run(data: &[u8]) {
    let root = tempfile::tempdir().expect("temporary directory");
    let dest = root.path().join("dest");
    let outside = root.path().join("outside");
    fs::create_dir(&dest).expect("create dest");
    fs::create_dir(&outside).expect("create outside");
    symlink("../outside", dest.join("planted")).expect("plant a symlink");
    let fd = archive::open_dir_nofollow(&dest).expect("open dest");
    let rename = data.first().is_some_and(|b| b & 1 == 1);
    let options = UnpackOptions {
        rename_root: rename.then(|| b"renamed".to_vec()),
        keep_special_bits: false,
        limits: Limits {
            entries: 256,
            file_bytes: 1 << 20,
            metadata_bytes: 4096,
            sparse_blocks: 16,
        },
    };
    let _ = archive::unpack(data, &fd, &options);
    let mut top: Vec<_> = fs::read_dir(root.path())
        .expect("list the temporary directory")
        .map(|e| e.expect("entry").file_name())
        .collect();
    top.sort();
    assert_eq!(top, ["dest", "outside"], "written next to the destination");
    let escaped: Vec<_> = fs::read_dir(&outside)
        .expect("list outside")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(
        escaped.is_empty(),
        "written through the planted symlink: {escaped:?}"
    );
}

//! A read-only share refuses every write-type operation with EROFS, host-side, and the host tree
//! stays byte-identical (contents, modes, owners, mtimes); reading still works.

use std::io;

use fuse_backend_rs::abi::fuse_abi::{stat64, SetattrValid, ROOT_ID};
use fuse_backend_rs::api::filesystem::FileSystem;

use super::{cstr, errno_of, guest_root, Share, Untouched, FILE_CONTENTS};

type Attempt = fn(&Share) -> io::Result<()>;

/// Every write-type operation, by name, with valid arguments for a writable share.
fn write_attempts() -> Vec<(&'static str, Attempt)> {
    vec![
        ("create", |s| s.create(ROOT_ID, &cstr("new")).map(drop)),
        ("mkdir", |s| {
            let name = cstr("newdir");
            s.fs.mkdir(&guest_root(), ROOT_ID, &name, 0o755, 0)
                .map(drop)
        }),
        ("mknod fifo", |s| {
            let name = cstr("fifo");
            let mode = libc::S_IFIFO | 0o644;
            s.fs.mknod(&guest_root(), ROOT_ID, &name, mode, 0, 0)
                .map(drop)
        }),
        ("symlink", |s| {
            let (target, name) = (cstr("file"), cstr("link"));
            s.fs.symlink(&guest_root(), &target, ROOT_ID, &name)
                .map(drop)
        }),
        ("link", |s| {
            let file = s.node("file");
            s.fs.link(&guest_root(), file, ROOT_ID, &cstr("hardlink"))
                .map(drop)
        }),
        ("unlink", |s| {
            s.fs.unlink(&guest_root(), ROOT_ID, &cstr("file"))
        }),
        ("rmdir", |s| {
            s.fs.rmdir(&guest_root(), ROOT_ID, &cstr("empty_dir"))
        }),
        ("rename", |s| {
            let (old, new) = (cstr("file"), cstr("renamed"));
            s.fs.rename(&guest_root(), ROOT_ID, &old, ROOT_ID, &new, 0)
        }),
        ("setattr size", |s| setattr(s, SetattrValid::SIZE)),
        ("setattr mode", |s| setattr(s, SetattrValid::MODE)),
        ("setattr owner", |s| {
            setattr(s, SetattrValid::UID | SetattrValid::GID)
        }),
        ("setattr times", |s| {
            setattr(s, SetattrValid::MTIME_NOW | SetattrValid::MTIME)
        }),
        ("setxattr", |s| {
            let (file, name) = (s.node("file"), cstr("user.x"));
            s.fs.setxattr(&guest_root(), file, &name, b"v", 0)
        }),
        ("removexattr", |s| {
            let file = s.node("file");
            s.fs.removexattr(&guest_root(), file, &cstr("user.x"))
        }),
        ("open O_WRONLY", |s| open(s, libc::O_WRONLY)),
        ("open O_RDWR", |s| open(s, libc::O_RDWR)),
        ("open O_TRUNC", |s| open(s, libc::O_RDONLY | libc::O_TRUNC)),
        ("open O_APPEND", |s| {
            open(s, libc::O_RDONLY | libc::O_APPEND)
        }),
        ("write", |s| {
            let file = s.node("file");
            let (fh, ..) = s.fs.open(&guest_root(), file, libc::O_RDONLY as u32, 0)?;
            let fh = fh.unwrap_or_default();
            s.fs.write(
                &guest_root(),
                file,
                fh,
                &mut Untouched,
                4,
                0,
                None,
                false,
                0,
                0,
            )
            .map(drop)
        }),
        ("fallocate", |s| {
            let file = s.node("file");
            let (fh, ..) = s.fs.open(&guest_root(), file, libc::O_RDONLY as u32, 0)?;
            s.fs.fallocate(&guest_root(), file, fh.unwrap_or_default(), 0, 0, 4096)
        }),
        ("access W_OK", |s| {
            let file = s.node("file");
            s.fs.access(&guest_root(), file, libc::W_OK as u32)
        }),
    ]
}

fn setattr(share: &Share, valid: SetattrValid) -> io::Result<()> {
    let file = share.node("file");
    // SAFETY: stat64 is plain data; all-zero is a valid value.
    let attr: stat64 = unsafe { std::mem::zeroed() };
    share
        .fs
        .setattr(&guest_root(), file, attr, None, valid)
        .map(drop)
}

fn open(share: &Share, flags: i32) -> io::Result<()> {
    let file = share.node("file");
    share
        .fs
        .open(&guest_root(), file, flags as u32, 0)
        .map(drop)
}

#[test]
fn every_write_type_operation_fails_with_erofs() {
    let share = Share::new(true);

    let wrong: Vec<String> = write_attempts()
        .into_iter()
        .filter_map(|(name, attempt)| match attempt(&share) {
            Err(e) if e.raw_os_error() == Some(libc::EROFS) => None,
            other => Some(format!("{name}: {other:?}")),
        })
        .collect();

    assert!(wrong.is_empty(), "not refused with EROFS: {wrong:#?}");
}

#[test]
fn refused_operations_leave_the_host_tree_unchanged() {
    let share = Share::new(true);
    let before = share.host_tree();

    for (_, attempt) in write_attempts() {
        let _ = attempt(&share);
    }

    assert_eq!(share.host_tree(), before);
}

#[test]
fn the_same_operations_are_not_refused_on_a_writable_share() {
    // Guards against EROFS coming from somewhere other than the policy. Each attempt gets a fresh
    // share, as some change it.
    let refused: Vec<&str> = write_attempts()
        .into_iter()
        .filter(|(_, attempt)| {
            let result = attempt(&Share::new(false));
            result.is_err_and(|e| e.raw_os_error() == Some(libc::EROFS))
        })
        .map(|(name, _)| name)
        .collect();

    assert!(refused.is_empty(), "EROFS on a writable share: {refused:?}");
}

#[test]
fn reading_works_on_a_read_only_share() {
    let share = Share::new(true);
    let file = share.node("file");

    let (fh, ..) = share
        .fs
        .open(&guest_root(), file, libc::O_RDONLY as u32, 0)
        .unwrap();
    let (attr, _) = share.fs.getattr(&guest_root(), file, fh).unwrap();

    assert_eq!(attr.st_size as usize, FILE_CONTENTS.len());
    assert!(fh.is_some());
}

#[test]
fn access_for_reading_is_allowed_on_a_read_only_share() {
    let share = Share::new(true);
    let file = share.node("file");

    let result = share.fs.access(&guest_root(), file, libc::R_OK as u32);

    assert!(result.is_ok(), "{result:?}");
    assert_eq!(
        errno_of(share.fs.access(&guest_root(), file, libc::W_OK as u32)),
        libc::EROFS
    );
}

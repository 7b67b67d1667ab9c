//! Escape attempts through the FUSE `FileSystem` interface, on a writable share with a directory
//! `outside/` (holding `secret`) next to it: each fails, and nothing outside the share changes.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use fuse_backend_rs::abi::fuse_abi::{stat64, SetattrValid, ROOT_ID};
use fuse_backend_rs::api::filesystem::FileSystem;

use super::{cstr, errno_of, guest_root, populate, test_owner, Share, Untouched};

/// A writable share with the standard fixtures plus symlinks planted on the host: `to_secret` →
/// `<outside>/secret`, `to_outside` → `<outside>`, `to_missing` → `<outside>/missing`,
/// `to_proc_root` → `/proc/self/root`.
fn share_with_planted_links() -> Share {
    let share = Share::with(
        |root| {
            populate(root);
            let outside = root.parent().unwrap().join("outside");
            let links = [
                ("to_secret", outside.join("secret")),
                ("to_outside", outside.clone()),
                ("to_missing", outside.join("missing")),
                ("to_proc_root", "/proc/self/root".into()),
            ];
            for (name, target) in links {
                std::os::unix::fs::symlink(target, root.join(name)).unwrap();
            }
        },
        false,
        Some(test_owner()),
    );
    share.init();
    share
}

fn ino(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().ino()
}

#[test]
fn dot_dot_and_multi_component_names_are_refused_by_lookup() {
    let share = share_with_planted_links();
    let dir = share.node("dir");

    let refused: Vec<(u64, &str, i32)> = [
        (ROOT_ID, ".."),
        (ROOT_ID, "."),
        (ROOT_ID, "../outside"),
        (ROOT_ID, "dir/inner"),
        (ROOT_ID, "/etc"),
        (ROOT_ID, ""),
        (dir, ".."),
        (dir, "../../outside/secret"),
    ]
    .into_iter()
    .map(|(parent, name)| (parent, name, errno_of(share.lookup(parent, name))))
    .collect();

    assert!(
        refused.iter().all(|&(_, _, errno)| errno == libc::EINVAL),
        "{refused:?}"
    );
}

#[test]
fn every_name_taking_operation_refuses_dot_dot() {
    let share = share_with_planted_links();
    let (dotdot, ctx) = (cstr(".."), guest_root());
    let file = share.node("file");

    let results = [
        errno_of(share.create(ROOT_ID, &dotdot)),
        errno_of(share.fs.mkdir(&ctx, ROOT_ID, &dotdot, 0o755, 0)),
        errno_of(
            share
                .fs
                .mknod(&ctx, ROOT_ID, &dotdot, libc::S_IFIFO | 0o644, 0, 0),
        ),
        errno_of(share.fs.symlink(&ctx, &cstr("file"), ROOT_ID, &dotdot)),
        errno_of(share.fs.link(&ctx, file, ROOT_ID, &dotdot)),
        errno_of(share.fs.unlink(&ctx, ROOT_ID, &dotdot)),
        errno_of(share.fs.rmdir(&ctx, ROOT_ID, &dotdot)),
        errno_of(
            share
                .fs
                .rename(&ctx, ROOT_ID, &cstr("file"), ROOT_ID, &dotdot, 0),
        ),
        errno_of(
            share
                .fs
                .rename(&ctx, ROOT_ID, &dotdot, ROOT_ID, &cstr("x"), 0),
        ),
    ];

    assert_eq!(results, [libc::EINVAL; 9]);
}

#[test]
fn rename_out_of_the_share_fails_and_moves_nothing() {
    let share = share_with_planted_links();

    let result = share.fs.rename(
        &guest_root(),
        ROOT_ID,
        &cstr("file"),
        ROOT_ID,
        &cstr("../outside/stolen"),
        0,
    );

    assert_eq!(errno_of(result), libc::EINVAL);
    assert!(share.path("file").exists());
    assert!(!share.outside("stolen").exists());
}

#[test]
fn a_planted_symlink_is_returned_as_a_link_not_followed() {
    let share = share_with_planted_links();

    let entry = share.lookup(ROOT_ID, "to_secret").unwrap();
    let target = share.fs.readlink(&guest_root(), entry.inode).unwrap();

    assert_eq!(entry.attr.st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_ne!(entry.attr.st_ino, ino(&share.outside("secret")));
    assert_eq!(
        target,
        share.outside("secret").as_os_str().as_encoded_bytes()
    );
}

#[test]
fn a_planted_symlink_cannot_be_opened_or_read_through() {
    let share = share_with_planted_links();
    let link = share.node("to_secret");

    let opened = share.fs.open(&guest_root(), link, libc::O_RDONLY as u32, 0);
    let read = share
        .fs
        .read(&guest_root(), link, 0, &mut Untouched, 4096, 0, None, 0);

    assert!(opened.is_err(), "opened the link's target: {opened:?}");
    assert!(read.is_err());
}

#[test]
fn lookups_do_not_descend_through_symlinked_directories() {
    let share = share_with_planted_links();
    let to_outside = share.node("to_outside");
    let to_proc_root = share.node("to_proc_root");

    let secret = share.lookup(to_outside, "secret");
    let etc = share.lookup(to_proc_root, "etc");

    assert_eq!(errno_of(secret), libc::ENOTDIR);
    assert_eq!(errno_of(etc), libc::ENOTDIR);
}

#[test]
fn creating_through_planted_symlinks_creates_nothing_outside() {
    let share = share_with_planted_links();
    let ctx = guest_root();

    let created = share.create(ROOT_ID, &cstr("to_missing"));
    let made_dir = share.fs.mkdir(&ctx, ROOT_ID, &cstr("to_missing"), 0o755, 0);
    let made_node = share.fs.mknod(
        &ctx,
        ROOT_ID,
        &cstr("to_missing"),
        libc::S_IFREG | 0o644,
        0,
        0,
    );

    // CREATE without O_EXCL opens an existing name instead; a symlink cannot be opened.
    assert_eq!(errno_of(created), libc::EBADF);
    assert_eq!(errno_of(made_dir), libc::EEXIST);
    assert_eq!(errno_of(made_node), libc::EEXIST);
    assert!(!share.outside("missing").exists());
}

#[test]
fn setattr_on_a_planted_symlink_leaves_its_target_alone() {
    let share = share_with_planted_links();
    let link = share.node("to_secret");
    let secret = share.outside("secret");
    let before = std::fs::metadata(&secret).unwrap();
    // SAFETY: stat64 is plain data; all-zero is a valid value.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    attr.st_mode = 0o777;

    for valid in [SetattrValid::SIZE, SetattrValid::MODE, SetattrValid::MTIME] {
        let _ = share.fs.setattr(&guest_root(), link, attr, None, valid);
    }

    let after = std::fs::metadata(&secret).unwrap();
    assert_eq!(std::fs::read(&secret).unwrap(), b"host secret\n");
    assert_eq!(after.permissions().mode(), before.permissions().mode());
    assert_eq!(after.mtime(), before.mtime());
}

#[test]
fn node_ids_the_server_never_handed_out_cannot_be_linked_or_opened() {
    let share = share_with_planted_links();
    let invented = 0x5eed_0000;

    let linked = share
        .fs
        .link(&guest_root(), invented, ROOT_ID, &cstr("stolen"));
    let opened = share
        .fs
        .open(&guest_root(), invented, libc::O_RDONLY as u32, 0);

    assert_eq!(errno_of(linked), libc::EBADF);
    assert_eq!(errno_of(opened), libc::EBADF);
    assert!(!share.path("stolen").exists());
}

#[test]
fn device_nodes_cannot_be_created() {
    let share = share_with_planted_links();
    let ctx = guest_root();
    // /dev/sda (8:0) and /dev/mem (1:1).
    let (sda, mem) = (libc::makedev(8, 0) as u32, libc::makedev(1, 1) as u32);

    let block = share
        .fs
        .mknod(&ctx, ROOT_ID, &cstr("disk"), libc::S_IFBLK | 0o666, sda, 0);
    let chr = share
        .fs
        .mknod(&ctx, ROOT_ID, &cstr("mem"), libc::S_IFCHR | 0o666, mem, 0);

    assert_eq!(errno_of(block), libc::EPERM);
    assert_eq!(errno_of(chr), libc::EPERM);
    assert!(!share.path("disk").exists() && !share.path("mem").exists());
}

#[test]
fn the_root_stays_pinned_when_the_host_path_is_replaced() {
    let share = Share::with(populate, true, Some(test_owner()));
    let moved = share.root().with_file_name("moved");
    std::fs::rename(share.root(), &moved).unwrap();
    std::os::unix::fs::symlink(share.outside_dir(), share.root()).unwrap();

    share.init();

    assert_eq!(errno_of(share.lookup(ROOT_ID, "secret")), libc::ENOENT);
    let file = share.lookup(ROOT_ID, "file").unwrap();
    assert_eq!(file.attr.st_ino, ino(&moved.join("file")));
}

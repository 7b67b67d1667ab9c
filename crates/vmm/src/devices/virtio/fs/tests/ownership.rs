//! Files the guest's root creates on a writable share belong to the share's owner, never to host
//! root, and the guest can do on the host only what the owner could.
//!
//! Tests that serve a share as another user need root: they are named `..._needs_root`, fail
//! without it, and `scripts/test.sh` skips them when not run as root.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use fuse_backend_rs::abi::fuse_abi::{stat64, SetattrValid, ROOT_ID};
use fuse_backend_rs::api::filesystem::FileSystem;

use super::{cstr, errno_of, guest_root, populate, running_as_root, Share, NOBODY};
use crate::devices::virtio::fs::identity::Identity;
use crate::devices::virtio::fs::{Error, ShareFs};

/// Fails the calling test unless it runs as root (serving a share as another user needs it).
fn require_root() {
    assert!(running_as_root(), "this test needs root (its name ends in _needs_root; scripts/test.sh skips those when not root)");
}

fn owner_of(path: &Path) -> (u32, u32) {
    let meta = std::fs::symlink_metadata(path).unwrap();
    (meta.uid(), meta.gid())
}

#[test]
fn files_created_by_guest_root_belong_to_the_share_owner_needs_root() {
    require_root();
    let share = Share::new(false);
    let ctx = guest_root();

    share.create(ROOT_ID, &cstr("made_file")).unwrap();
    share
        .fs
        .mkdir(&ctx, ROOT_ID, &cstr("made_dir"), 0o755, 0)
        .unwrap();
    let fifo = libc::S_IFIFO | 0o644;
    share
        .fs
        .mknod(&ctx, ROOT_ID, &cstr("made_fifo"), fifo, 0, 0)
        .unwrap();
    share
        .fs
        .symlink(&ctx, &cstr("made_file"), ROOT_ID, &cstr("made_link"))
        .unwrap();

    let owners: Vec<(u32, u32)> = ["made_file", "made_dir", "made_fifo", "made_link"]
        .iter()
        .map(|name| owner_of(&share.path(name)))
        .collect();
    assert_eq!(owners, [NOBODY; 4]);
}

#[test]
fn the_default_owner_is_the_owner_of_the_shared_directory_needs_root() {
    require_root();
    let share = Share::with(
        |root| std::os::unix::fs::chown(root, Some(4242), Some(4243)).unwrap(),
        false,
        None,
    );
    share.init();

    share.create(ROOT_ID, &cstr("made")).unwrap();

    assert_eq!(owner_of(&share.path("made")), (4242, 4243));
}

#[test]
fn guest_root_cannot_give_a_file_to_host_root_needs_root() {
    require_root();
    let share = Share::new(false);
    let file = share.node("file");
    // SAFETY: stat64 is plain data; all-zero (uid 0, gid 0) is a valid value.
    let attr: stat64 = unsafe { std::mem::zeroed() };

    let result = share.fs.setattr(
        &guest_root(),
        file,
        attr,
        None,
        SetattrValid::UID | SetattrValid::GID,
    );

    assert_eq!(errno_of(result), libc::EPERM);
    assert_eq!(owner_of(&share.path("file")), NOBODY);
}

#[test]
fn guest_root_cannot_write_a_host_root_file_inside_the_share_needs_root() {
    require_root();
    let share = Share::with(
        |root| {
            populate(root);
            std::fs::write(root.join("root_file"), b"root's\n").unwrap();
        },
        false,
        Some(NOBODY),
    );
    share.init();
    let file = share.node("root_file");

    let opened = share.fs.open(&guest_root(), file, libc::O_WRONLY as u32, 0);

    assert_eq!(errno_of(opened), libc::EACCES);
    assert_eq!(std::fs::read(share.path("root_file")).unwrap(), b"root's\n");
}

#[test]
fn the_serving_thread_is_root_again_after_each_operation_needs_root() {
    require_root();
    let share = Share::new(false);
    let groups_before = nix_groups();

    share.create(ROOT_ID, &cstr("made")).unwrap();

    assert_eq!(Identity::process(), (0, 0));
    assert_eq!(nix_groups(), groups_before);
}

fn nix_groups() -> Vec<libc::gid_t> {
    let mut groups = vec![0; 256];
    // SAFETY: `groups` has room for 256 entries, the size passed.
    let n = unsafe { libc::getgroups(256, groups.as_mut_ptr()) };
    groups.truncate(usize::try_from(n).unwrap());
    groups
}

#[test]
fn hard_links_can_be_made_as_the_owner() {
    let share = Share::new(false);
    let file = share.node("file");

    let entry = share
        .fs
        .link(&guest_root(), file, ROOT_ID, &cstr("hard"))
        .unwrap();

    let host_ino = std::fs::metadata(share.path("hard")).unwrap().ino();
    assert_eq!(
        host_ino,
        std::fs::metadata(share.path("file")).unwrap().ino()
    );
    assert_eq!(entry.attr.st_ino, host_ino);
}

#[test]
fn new_files_get_the_mode_the_guest_asked_for_whatever_the_vmm_umask() {
    let share = Share::new(false);
    let ctx = guest_root();

    share
        .fs
        .mkdir(&ctx, ROOT_ID, &cstr("group_dir"), 0o775, 0)
        .unwrap();
    let fifo = libc::S_IFIFO | 0o666;
    share
        .fs
        .mknod(&ctx, ROOT_ID, &cstr("fifo"), fifo, 0, 0o002)
        .unwrap();

    let mode = |name: &str| std::fs::symlink_metadata(share.path(name)).unwrap().mode() & 0o777;
    assert_eq!(mode("group_dir"), 0o775);
    assert_eq!(mode("fifo"), 0o664);
}

#[test]
fn a_writable_share_owned_by_root_is_refused_needs_root() {
    require_root();
    let dir = tempfile::tempdir().unwrap();

    let default_owner = ShareFs::open(dir.path(), false, None);
    let root_owner = ShareFs::open(dir.path(), false, Some((0, 0)));

    assert!(
        matches!(default_owner, Err(Error::RootOwner(_))),
        "{default_owner:?}"
    );
    assert!(
        matches!(root_owner, Err(Error::RootOwner(_))),
        "{root_owner:?}"
    );
    assert!(ShareFs::open(dir.path(), true, None).is_ok());
}

#[test]
fn an_owner_who_cannot_read_the_directory_is_refused_needs_root() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();

    let result = ShareFs::open(dir.path(), true, Some(NOBODY));

    assert!(
        matches!(result, Err(Error::OwnerCannotAccess { uid: 65534, .. })),
        "{result:?}"
    );
}

#[test]
fn as_root_the_owner_is_the_configured_one_else_the_directory_owner() {
    let configured = Identity::resolve(Some((7, 8)), (1000, 1000), (0, 0)).unwrap();
    let default = Identity::resolve(None, (1000, 1001), (0, 0)).unwrap();

    assert_eq!((configured.uid, configured.gid), (7, 8));
    assert_eq!((default.uid, default.gid), (1000, 1001));
}

#[test]
fn without_root_the_owner_is_the_vmm_itself() {
    let default = Identity::resolve(None, (2000, 2000), (1000, 1000)).unwrap();
    let same = Identity::resolve(Some((1000, 1000)), (2000, 2000), (1000, 1000)).unwrap();
    let other = Identity::resolve(Some((2000, 2000)), (2000, 2000), (1000, 1000));

    assert_eq!((default.uid, default.gid), (1000, 1000));
    assert_eq!(same, default);
    assert_eq!(other, Err((2000, 2000)));
}

#[test]
fn the_guest_cannot_leave_a_set_id_file_on_the_host_but_a_directory_may_keep_its_group() {
    // Arrange: a writable share served as the caller (no root needed).
    let share = Share::new(false);
    let ctx = guest_root();
    let file = share.create(ROOT_ID, &cstr("tool")).unwrap();
    // SAFETY: stat64 is plain data; all-zero is a valid value.
    let mut attr: stat64 = unsafe { std::mem::zeroed() };
    attr.st_mode = libc::S_IFREG | libc::S_ISUID | libc::S_ISGID | 0o755;

    // Act: chmod 6755 of a file and of a directory, and set-ID bits asked for at creation.
    share
        .fs
        .setattr(&ctx, file.inode, attr, None, SetattrValid::MODE)
        .unwrap();
    let dir = share
        .fs
        .mkdir(&ctx, ROOT_ID, &cstr("team"), 0o775, 0)
        .unwrap();
    let mut dir_attr = attr;
    dir_attr.st_mode = libc::S_IFDIR | libc::S_ISUID | libc::S_ISGID | 0o775;
    share
        .fs
        .setattr(&ctx, dir.inode, dir_attr, None, SetattrValid::MODE)
        .unwrap();
    let args = fuse_backend_rs::abi::fuse_abi::CreateIn {
        flags: (libc::O_RDWR | libc::O_CREAT) as u32,
        mode: libc::S_IFREG | libc::S_ISUID | libc::S_ISGID | 0o755,
        umask: 0,
        fuse_flags: 0,
    };
    share
        .fs
        .create(&ctx, ROOT_ID, &cstr("made_setid"), args)
        .unwrap();

    // Assert
    let mode = |name: &str| std::fs::metadata(share.path(name)).unwrap().mode() & 0o7777;
    assert_eq!(mode("tool"), 0o755);
    assert_eq!(mode("made_setid"), 0o755);
    assert_eq!(
        mode("team") & 0o7000,
        libc::S_ISGID,
        "only the directory's setgid bit"
    );
}

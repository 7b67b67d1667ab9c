//! The archive API (`PUT`/`GET .../archive`) and the files API's list, stat, mkdir and remove,
//! through the Rust client over the daemon's socket. Sandboxes use the fake VMM, whose agent
//! runs on the host (see tests/common), so guest paths are host paths here.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use bulkhead_client::{Error, FileKind, PATH_NOT_FOUND};
use bulkhead_protocol::archive::{self, PackOptions, UnpackOptions};
use common::{rt, spec_with_labels, TestDaemon};

fn tree(root: &Path) {
    fs::create_dir_all(root.join("d/empty")).unwrap();
    fs::write(root.join(std::ffi::OsStr::from_bytes(b"n\xffme")), b"odd").unwrap();
    fs::write(root.join("d/x.sh"), b"echo x\n").unwrap();
    fs::set_permissions(root.join("d/x.sh"), fs::Permissions::from_mode(0o700)).unwrap();
    symlink("/etc/shadow", root.join("shadow")).unwrap();
}

#[test]
fn a_tree_goes_in_and_comes_back_through_the_archive_api() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let host = tempfile::tempdir().unwrap();
    tree(&host.path().join("src"));
    let mut tar = Vec::new();
    archive::pack(&host.path().join("src"), &PackOptions::default(), &mut tar).unwrap();
    let guest = daemon.dir.path().join("guest");
    fs::create_dir(&guest).unwrap();
    let guest_str = guest.to_str().unwrap().to_owned();

    // Act
    let (written, from_guest, listed, stat, odd) = rt.block_on(async {
        let id = client.create(&spec_with_labels(&[])).await.unwrap().id;
        let written = client
            .put_archive(&id, &guest_str, std::io::Cursor::new(tar))
            .await
            .unwrap();
        let mut from_guest = Vec::new();
        client
            .get_archive(&id, &format!("{guest_str}/src"), &mut from_guest)
            .await
            .unwrap();
        let listed = client
            .list_files(&id, &format!("{guest_str}/src"))
            .await
            .unwrap();
        let stat = client
            .stat(&id, &format!("{guest_str}/src/shadow"))
            .await
            .unwrap();
        let odd_path = [guest_str.as_bytes(), b"/src/n\xffme"].concat();
        let odd = client.stat(&id, &odd_path).await.unwrap();
        (written, from_guest, listed, stat, odd)
    });
    let back = host.path().join("back");
    fs::create_dir(&back).unwrap();
    let fd = archive::open_dir_nofollow(&back).unwrap();
    archive::unpack(&from_guest[..], &fd, &UnpackOptions::default()).unwrap();

    // Assert
    assert_eq!(written.entries, 6, "{written:?}");
    assert_eq!(fs::read(guest.join("src/d/x.sh")).unwrap(), b"echo x\n");
    let mode = fs::metadata(back.join("src/d/x.sh"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700);
    assert_eq!(
        fs::read_link(back.join("src/shadow")).unwrap(),
        Path::new("/etc/shadow")
    );
    assert!(back.join("src/d/empty").is_dir());
    let names: Vec<_> = listed.iter().map(|e| (e.name.as_bytes(), e.kind)).collect();
    assert_eq!(
        names,
        [
            (&b"d"[..], FileKind::Dir),
            (b"n\xffme", FileKind::File),
            (b"shadow", FileKind::Symlink)
        ]
    );
    assert_eq!(
        fs::read(back.join(OsStr::from_bytes(b"src/n\xffme"))).unwrap(),
        b"odd"
    );
    let stat = stat.expect("the link exists");
    let target = stat.link_target.as_ref().map(|t| t.as_bytes());
    assert_eq!(target, Some(&b"/etc/shadow"[..]));
    assert!(odd.is_some(), "stat of a non-UTF-8 path");
}

#[test]
fn mkdir_stat_and_remove_answer_as_a_user_expects() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let top = daemon.dir.path().join("top");
    let deep = top.join("a/b");
    let (top_s, deep_s) = (top.to_str().unwrap(), deep.to_str().unwrap());

    // Act
    let (made, exists_before, not_empty, removed, exists_after, no_sandbox) = rt.block_on(async {
        let id = client.create(&spec_with_labels(&[])).await.unwrap().id;
        let exists_before = client.exists(&id, deep_s).await.unwrap();
        let made = client.make_dir(&id, deep_s, true).await;
        let not_empty = client.remove(&id, top_s, false).await;
        let removed = client.remove(&id, top_s, true).await;
        let exists_after = client.exists(&id, top_s).await.unwrap();
        let no_sandbox = client.stat("nonexistent", top_s).await;
        (
            made,
            exists_before,
            not_empty,
            removed,
            exists_after,
            no_sandbox,
        )
    });

    // Assert
    assert!(made.is_ok(), "{made:?}");
    assert!(!exists_before);
    assert!(
        matches!(&not_empty, Err(Error::Api { status: 400, message, .. }) if message.contains("not empty")),
        "{not_empty:?}"
    );
    assert!(removed.is_ok(), "{removed:?}");
    assert!(!exists_after);
    assert!(
        matches!(&no_sandbox, Err(Error::Api { status: 404, code, .. }) if code != PATH_NOT_FOUND),
        "{no_sandbox:?}"
    );
}

#[test]
fn a_hostile_archive_is_refused_with_400_and_writes_nothing_outside() {
    // Arrange
    let daemon = TestDaemon::start();
    let client = daemon.client();
    let rt = rt();
    let guest = daemon.dir.path().join("guest");
    fs::create_dir(&guest).unwrap();
    let mut header = tar::Header::new_gnu();
    header.as_old_mut().name[..12].copy_from_slice(b"../../escape");
    header.set_size(1);
    header.set_mode(0o644);
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder.append(&header, &b"x"[..]).unwrap();
    let tar = builder.into_inner().unwrap();

    // Act
    let result = rt.block_on(async {
        let id = client.create(&spec_with_labels(&[])).await.unwrap().id;
        client
            .put_archive(&id, guest.to_str().unwrap(), std::io::Cursor::new(tar))
            .await
    });

    // Assert
    assert!(
        matches!(&result, Err(Error::Api { status: 400, message, .. }) if message.contains("'..'")),
        "{result:?}"
    );
    assert!(!daemon.dir.path().join("escape").exists());
    assert!(!daemon.dir.path().parent().unwrap().join("escape").exists());
}

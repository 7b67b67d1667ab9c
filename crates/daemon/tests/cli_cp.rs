//! `bulkhead cp -r` against a real daemon with the fake VMM (whose agent runs on the host, so
//! guest paths are host paths here). The CLI binary is the one `cargo build --workspace --bins`
//! put next to this test's own binaries.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{rt, spec_with_labels, TestDaemon};

/// `target/<profile>/bulkhead`, built alongside this test.
fn cli() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    dir.join("bulkhead")
}

fn cp(daemon: &TestDaemon, args: &[&OsStr]) -> Output {
    Command::new(cli())
        .arg("cp")
        .arg("--socket")
        .arg(&daemon.socket)
        .args(args)
        .output()
        .unwrap()
}

fn sandbox(daemon: &TestDaemon) -> String {
    rt().block_on(daemon.client().create(&spec_with_labels(&[])))
        .unwrap()
        .id
}

/// `bulkhead_tests::tree::listing` with this file's limit for compared contents.
fn listing(root: &Path) -> Vec<bulkhead_tests::tree::Entry> {
    bulkhead_tests::tree::listing(root, 4096)
}

#[test]
fn cp_r_copies_a_tree_in_and_back_out_identically() {
    // Arrange
    let daemon = TestDaemon::start();
    let id = sandbox(&daemon);
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("src");
    fs::create_dir_all(src.join("empty")).unwrap();
    fs::write(src.join("run.sh"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(src.join("run.sh"), fs::Permissions::from_mode(0o750)).unwrap();
    symlink("/etc/shadow", src.join("shadow")).unwrap();
    symlink("loop", src.join("loop")).unwrap();
    fs::write(src.join(OsStr::from_bytes(b"n\xffme")), b"odd").unwrap();
    fs::File::create(src.join("sparse"))
        .unwrap()
        .write_at(b"x", (64 << 20) - 1)
        .unwrap();
    // The guest path on the command line is not UTF-8 either.
    let guest = daemon
        .dir
        .path()
        .join(OsStr::from_bytes(b"guest-\xff-copy"));
    let remote = [format!("{id}:").as_bytes(), guest.as_os_str().as_bytes()].concat();
    let remote = OsStr::from_bytes(&remote);
    let back = host.path().join("back");

    // Act
    let copy_in = cp(&daemon, &["-r".as_ref(), src.as_os_str(), remote]);
    let copy_out = cp(&daemon, &["-r".as_ref(), remote, back.as_os_str()]);

    // Assert
    assert!(copy_in.status.success(), "{copy_in:?}");
    assert!(copy_out.status.success(), "{copy_out:?}");
    assert_eq!(listing(&guest), listing(&src));
    assert_eq!(listing(&back), listing(&src));
    assert!(fs::metadata(back.join("sparse")).unwrap().blocks() * 512 < 1 << 20);
}

#[test]
fn cp_r_into_a_destination_through_a_symlink_is_refused_with_exit_1() {
    // Arrange
    let daemon = TestDaemon::start();
    let id = sandbox(&daemon);
    let guest = daemon.dir.path().join("guest-src");
    fs::create_dir(&guest).unwrap();
    fs::write(guest.join("f"), b"x").unwrap();
    let host = tempfile::tempdir().unwrap();
    let elsewhere = host.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    symlink(&elsewhere, host.path().join("link")).unwrap();
    let remote = format!("{id}:{}", guest.display());

    // Act
    let through = cp(
        &daemon,
        &[
            "-r".as_ref(),
            remote.as_ref(),
            host.path().join("link/copy").as_os_str(),
        ],
    );
    let onto = cp(
        &daemon,
        &[
            "-r".as_ref(),
            remote.as_ref(),
            host.path().join("link").as_os_str(),
        ],
    );

    // Assert
    for out in [&through, &onto] {
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("symlink"),
            "{out:?}"
        );
    }
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
}

#[test]
fn cp_r_of_dir_slash_dot_copies_the_contents_into_an_existing_directory() {
    // Arrange
    let daemon = TestDaemon::start();
    let id = sandbox(&daemon);
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("src");
    fs::create_dir_all(src.join("sub")).unwrap();
    fs::write(src.join("sub/f"), b"x").unwrap();
    let guest = daemon.dir.path().join("guest-existing");
    fs::create_dir(&guest).unwrap();
    fs::write(guest.join("kept"), b"k").unwrap();
    let back = host.path().join("back");
    fs::create_dir(&back).unwrap();
    let src_contents = format!("{}/.", src.display());
    let remote = format!("{id}:{}", guest.display());
    let remote_contents = format!("{remote}/.");

    // Act
    let copy_in = cp(
        &daemon,
        &["-r".as_ref(), src_contents.as_ref(), remote.as_ref()],
    );
    let copy_out = cp(
        &daemon,
        &["-r".as_ref(), remote_contents.as_ref(), back.as_os_str()],
    );

    // Assert
    assert!(copy_in.status.success(), "{copy_in:?}");
    assert!(copy_out.status.success(), "{copy_out:?}");
    assert_eq!(fs::read(guest.join("sub/f")).unwrap(), b"x");
    assert!(!guest.join("src").exists());
    assert_eq!(fs::read(back.join("sub/f")).unwrap(), b"x");
    assert_eq!(fs::read(back.join("kept")).unwrap(), b"k");
}

#[test]
fn cp_of_a_directory_without_r_says_to_use_it() {
    // Arrange
    let daemon = TestDaemon::start();
    let id = sandbox(&daemon);
    let host = tempfile::tempdir().unwrap();
    let remote = format!("{id}:{}/x", daemon.dir.path().display());

    // Act
    let out = cp(&daemon, &[host.path().as_os_str(), remote.as_ref()]);

    // Assert
    assert_eq!(out.status.code(), Some(125), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cp -r"),
        "{out:?}"
    );
}

#[test]
fn cp_r_into_a_missing_guest_directory_is_refused_before_anything_is_sent() {
    // Arrange (the fake VMM's agent runs on this host, so guest paths are host paths)
    let daemon = TestDaemon::start();
    let id = sandbox(&daemon);
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("src");
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("f"), b"data").unwrap();
    let missing = host.path().join("no-such-dir");
    let remote = format!("{id}:{}/x", missing.display());

    // Act
    let out = cp(&daemon, &["-r".as_ref(), src.as_os_str(), remote.as_ref()]);

    // Assert
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(125), "{stderr}");
    assert!(
        stderr.contains("no such directory in the sandbox"),
        "{stderr}"
    );
    assert!(!missing.exists());
}

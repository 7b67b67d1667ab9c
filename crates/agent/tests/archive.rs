//! Directory transfers (tar streams) and file-system requests, end to end over a Unix socket.

mod common;

use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use bulkhead_protocol::archive::{self, PackOptions, UnpackOptions};
use bulkhead_protocol::client::ClientError;
use bulkhead_protocol::{ErrorCode, FileType};
use common::Agent;

/// A small tree with a symlink loop, a link to /etc/shadow, an empty directory, a sparse
/// file, odd modes and a name with a 0xff byte.
fn tree(root: &Path) {
    fs::create_dir_all(root.join("sub/empty")).unwrap();
    fs::write(root.join("sub/run.sh"), b"#!/bin/sh\n").unwrap();
    fs::set_permissions(root.join("sub/run.sh"), fs::Permissions::from_mode(0o751)).unwrap();
    symlink("b", root.join("a")).unwrap();
    symlink("a", root.join("b")).unwrap();
    symlink("/etc/shadow", root.join("shadow")).unwrap();
    fs::write(root.join(std::ffi::OsStr::from_bytes(b"n\xffme")), b"odd").unwrap();
    let sparse = fs::File::create(root.join("sparse")).unwrap();
    sparse.write_at(b"end", (256 << 20) - 3).unwrap();
}

/// `(relative name, type, mode, size, link target, contents of small files)`.
type Seen = (Vec<u8>, String, u32, u64, Vec<u8>, Vec<u8>);

/// Every entry below `root` as a user would compare it, sorted.
fn listing(root: &Path) -> Vec<Seen> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let kind = format!("{:?}", meta.file_type());
            if meta.is_dir() {
                stack.push(path.clone());
            }
            let target = fs::read_link(&path).map(|t| t.as_os_str().as_bytes().to_vec());
            let small = meta.is_file() && meta.len() < 4096;
            let contents = if small {
                fs::read(&path).unwrap()
            } else {
                Vec::new()
            };
            let size = if meta.is_dir() { 0 } else { meta.len() };
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec();
            let mode = if meta.is_symlink() {
                0
            } else {
                meta.mode() & 0o7777
            };
            out.push((rel, kind, mode, size, target.unwrap_or_default(), contents));
        }
    }
    out.sort();
    out
}

#[test]
fn a_tree_round_trips_through_the_agent_both_ways() {
    // Arrange
    let agent = Agent::start();
    let host = tempfile::tempdir().unwrap();
    tree(&host.path().join("src"));
    let mut tar = Vec::new();
    archive::pack(&host.path().join("src"), &PackOptions::default(), &mut tar).unwrap();
    let guest_dst = agent.dir().join("dst");
    fs::create_dir(&guest_dst).unwrap();
    let back = host.path().join("back");
    fs::create_dir(&back).unwrap();

    // Act
    let written = agent
        .client()
        .write_archive_from(guest_dst.to_str().unwrap(), &mut &tar[..])
        .unwrap();
    let mut from_guest = Vec::new();
    let read = agent
        .client()
        .read_archive_into(guest_dst.join("src").to_str().unwrap(), &mut from_guest)
        .unwrap();
    let fd = archive::open_dir_nofollow(&back).unwrap();
    archive::unpack(&from_guest[..], &fd, &UnpackOptions::default()).unwrap();

    // Assert
    let original = listing(&host.path().join("src"));
    assert_eq!(listing(&guest_dst.join("src")), original);
    assert_eq!(listing(&back.join("src")), original);
    assert_eq!(written.entries, read.entries);
    assert!(
        from_guest.len() < 1 << 20,
        "the hole travelled: {}",
        from_guest.len()
    );
    let blocks = fs::metadata(back.join("src/sparse")).unwrap().blocks();
    assert!(blocks * 512 < 1 << 20, "{blocks} blocks");
}

#[test]
fn a_hostile_archive_is_refused_and_writes_nothing_outside() {
    // Arrange
    let agent = Agent::start();
    let dst = agent.dir().join("dst");
    fs::create_dir(&dst).unwrap();
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.as_old_mut().name[..9].copy_from_slice(b"../escape");
    header.set_size(1);
    header.set_mode(0o644);
    header.set_cksum();
    builder.append(&header, &b"x"[..]).unwrap();
    let tar = builder.into_inner().unwrap();

    // Act
    let result = agent
        .client()
        .write_archive_from(dst.to_str().unwrap(), &mut &tar[..]);

    // Assert
    assert!(
        matches!(&result, Err(ClientError::Agent(e))
            if e.code == ErrorCode::InvalidRequest && e.message.contains("'..'")),
        "{result:?}"
    );
    assert!(!agent.dir().join("escape").exists());
}

#[test]
fn mkdir_list_stat_and_remove() {
    // Arrange
    let agent = Agent::start();
    let client = agent.client();
    let top = agent.dir().join("t");
    let deep = top.join("a/b");

    // Act
    client.mkdir(deep.to_str().unwrap(), true).unwrap();
    fs::write(top.join("f"), b"abc").unwrap();
    symlink("/etc/shadow", top.join("l")).unwrap();
    let listed = client.list(top.to_str().unwrap()).unwrap();
    let missing = client.stat(top.join("nope").to_str().unwrap());
    let not_empty = client.remove(top.to_str().unwrap(), false);
    client.remove(top.to_str().unwrap(), true).unwrap();

    // Assert
    let names: Vec<_> = listed
        .iter()
        .map(|e| (e.name.to_str().unwrap(), e.kind))
        .collect();
    assert_eq!(
        names,
        [
            ("a", FileType::Dir),
            ("f", FileType::File),
            ("l", FileType::Symlink)
        ]
    );
    assert_eq!(listed[1].size, 3);
    let target = listed[2].link_target.as_ref().map(|t| t.as_bytes());
    assert_eq!(target, Some(&b"/etc/shadow"[..]));
    assert!(
        matches!(&missing, Err(ClientError::Agent(e)) if e.code == ErrorCode::NotFound),
        "{missing:?}"
    );
    assert!(
        matches!(&not_empty, Err(ClientError::Agent(e)) if e.code == ErrorCode::InvalidRequest),
        "{not_empty:?}"
    );
    assert!(!top.exists());
}

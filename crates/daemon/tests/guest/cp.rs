//! Directory copies (the archive API, what `bulkhead cp -r` uses) with a real VM, in the nested
//! test host when this machine's KVM cannot boot guests (see the `bulkhead-tests` harness): the
//! issue's acceptance tree goes into the guest and comes back out identical.

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::common::real::{real_daemon, sh, small, vm_logs};
use crate::common::rt;
use bulkhead_protocol::archive::{self, PackOptions, UnpackOptions};
use bulkhead_tests::test_path;

const GIB: u64 = 1 << 30;

/// `bulkhead_tests::tree::listing` with this file's limit for compared contents.
fn listing(root: &Path) -> Vec<bulkhead_tests::tree::Entry> {
    bulkhead_tests::tree::listing(root, 1 << 20)
}

/// 1,000 files with two modes, a symlink loop, a link to /etc/shadow, an empty directory, a
/// 1 GiB sparse file and a name with a 0xff byte.
fn acceptance_tree(root: &Path) {
    fs::create_dir_all(root.join("many")).unwrap();
    for i in 0..1000 {
        let path = root.join(format!("many/f{i:04}"));
        fs::write(&path, format!("file {i}\n")).unwrap();
        let mode = if i % 2 == 0 { 0o600 } else { 0o755 };
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    }
    symlink("loop-b", root.join("loop-a")).unwrap();
    symlink("loop-a", root.join("loop-b")).unwrap();
    symlink("/etc/shadow", root.join("shadow")).unwrap();
    fs::create_dir(root.join("empty")).unwrap();
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o750)).unwrap();
    let sparse = fs::File::create(root.join("sparse")).unwrap();
    sparse.write_at(b"start", 0).unwrap();
    sparse.write_at(b"middle", GIB / 2).unwrap();
    sparse.set_len(GIB).unwrap();
    fs::write(root.join(OsStr::from_bytes(b"odd-\xff-name")), b"bytes").unwrap();
}

/// Compares two listings, reporting the first difference only (a whole listing is too long
/// for a useful message).
fn assert_same(got: &[bulkhead_tests::tree::Entry], want: &[bulkhead_tests::tree::Entry]) {
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g, w, "first difference");
    }
    assert_eq!(got.len(), want.len(), "entry counts");
}

#[test]
fn the_acceptance_tree_goes_into_a_real_guest_and_comes_back_identical() {
    bulkhead_tests::in_vm_host(
        test_path!(the_acceptance_tree_goes_into_a_real_guest_and_comes_back_identical),
        || {
            // Arrange
            let daemon = real_daemon("", &[]);
            let client = daemon.client();
            let rt = rt();
            let id = rt.block_on(client.create(&small(256))).unwrap().id;
            let host = tempfile::tempdir().unwrap();
            let src = host.path().join("src");
            acceptance_tree(&src);
            let back = host.path().join("back");
            fs::create_dir(&back).unwrap();
            sh(&daemon, &id, "mkdir /tmp/dst");
            let root_before = sh(&daemon, &id, "ls -A / /tmp");

            // Act
            let (packed, packer) = {
                let (reader, writer) = tokio::io::duplex(256 * 1024);
                let src = src.clone();
                let handle = rt.handle().clone();
                let packer = std::thread::spawn(move || {
                    let mut sink = tokio_util::io::SyncIoBridge::new_with_handle(writer, handle);
                    archive::pack(&src, &PackOptions::default(), &mut sink)
                });
                (
                    rt.block_on(client.put_archive(&id, "/tmp/dst", reader)),
                    packer,
                )
            };
            let packer = packer.join().unwrap();
            // A guest on tmpfs (the destination) keeps the hole; `/` is not touched.
            let mut from_guest = Vec::new();
            let fetched = rt.block_on(client.get_archive(&id, "/tmp/dst/src", &mut from_guest));
            let in_guest = sh(
                &daemon,
                &id,
                "cd /tmp/dst/src && stat -c '%s %b %B' sparse && readlink shadow && readlink loop-a && \
                 stat -c %a empty many/f0000 many/f0001 && find . | wc -l && ls -A /tmp/dst",
            );
            let root_after = sh(&daemon, &id, "ls -A / /tmp");
            let fd = archive::open_dir_nofollow(&back).unwrap();
            let unpacked = archive::unpack(&from_guest[..], &fd, &UnpackOptions::default());

            // Assert
            println!("in the guest:\n{in_guest}\nput: {packed:?}\nget: {fetched:?}");
            println!(
                "unpack: {unpacked:?}\narchive from the guest: {} bytes",
                from_guest.len()
            );
            let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
                println!(
                    "{}\n--- daemon\n{}",
                    vm_logs(&daemon.vms_dir()),
                    daemon.log()
                );
                panic!("{what}: {e}")
            };
            let packed = packed.unwrap_or_else(|e| fail("put_archive", &e));
            packer.unwrap_or_else(|e| fail("pack", &e));
            fetched.unwrap_or_else(|e| fail("get_archive", &e));
            unpacked.unwrap_or_else(|e| fail("unpack", &e));
            assert_eq!(packed.entries, 1000 + 8, "{packed:?}");
            assert!(
                from_guest.len() < 4 << 20,
                "the hole travelled: {} bytes",
                from_guest.len()
            );
            let mut lines = in_guest.lines();
            let sparse: Vec<u64> = lines
                .next()
                .unwrap_or_default()
                .split(' ')
                .filter_map(|n| n.parse().ok())
                .collect();
            assert_eq!(sparse.first(), Some(&GIB), "{in_guest}");
            assert!(
                sparse[1] * sparse[2] < 1 << 20,
                "allocated in the guest: {in_guest}"
            );
            let rest: Vec<&str> = lines.collect();
            assert_eq!(
                rest,
                ["/etc/shadow", "loop-b", "750", "600", "755", "1008", "src"],
                "{in_guest}"
            );
            assert_eq!(root_before, root_after, "written outside the destination");
            assert_same(&listing(&back.join("src")), &listing(&src));
            let copy = back.join("src/sparse");
            assert!(fs::metadata(&copy).unwrap().blocks() * 512 < 1 << 20);
            let mut middle = [0u8; 6];
            fs::File::open(&copy)
                .unwrap()
                .read_exact_at(&mut middle, GIB / 2)
                .unwrap();
            assert_eq!(&middle, b"middle");
            let top: Vec<_> = fs::read_dir(host.path()).unwrap().collect();
            assert_eq!(top.len(), 2, "written outside the destination on the host");
        },
    );
}

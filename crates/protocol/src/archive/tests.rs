use std::collections::BTreeMap;
use std::fs;
use std::io::Cursor;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use super::*;

/// One file as a user would compare it: type, permission bits, size, link target, contents
/// (files up to 1 MiB) and, for larger ones, the 512-byte blocks allocated.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    kind: &'static str,
    mode: u32,
    size: u64,
    target: Vec<u8>,
    contents: Vec<u8>,
}

fn snapshot(root: &Path) -> BTreeMap<Vec<u8>, Seen> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec();
            let kind = if meta.is_dir() {
                stack.push(path.clone());
                "dir"
            } else if meta.file_type().is_symlink() {
                "symlink"
            } else {
                "file"
            };
            let target = match kind {
                "symlink" => fs::read_link(&path)
                    .unwrap()
                    .as_os_str()
                    .as_bytes()
                    .to_vec(),
                _ => Vec::new(),
            };
            let contents = match kind {
                "file" if meta.len() <= 1 << 20 => fs::read(&path).unwrap(),
                _ => Vec::new(),
            };
            let size = if kind == "dir" { 0 } else { meta.len() };
            let mode = if kind == "symlink" {
                0
            } else {
                meta.mode() & 0o7777
            };
            out.insert(
                rel,
                Seen {
                    kind,
                    mode,
                    size,
                    target,
                    contents,
                },
            );
        }
    }
    out
}

/// Compares two snapshots entry by entry, reporting the first difference only.
fn assert_same_trees(a: &BTreeMap<Vec<u8>, Seen>, b: &BTreeMap<Vec<u8>, Seen>) {
    for (name, seen) in a {
        let shown = String::from_utf8_lossy(name);
        assert_eq!(Some(seen), b.get(name), "{shown}");
    }
    assert_eq!(a.len(), b.len(), "extra entries on the copy");
}

const GIB: u64 = 1 << 30;

/// The acceptance tree: 1,000 files, a symlink loop, a link to /etc/shadow, an empty
/// directory, a 1 GiB sparse file, odd modes and a name with a 0xff byte.
fn acceptance_tree(root: &Path) {
    fs::create_dir_all(root.join("many")).unwrap();
    for i in 0..1000 {
        let path = root.join(format!("many/f{i:04}"));
        fs::write(&path, format!("file {i}\n")).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600 + (i % 2) * 0o155)).unwrap();
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
    fs::write(
        root.join(std::ffi::OsStr::from_bytes(b"odd-\xff-name")),
        b"bytes",
    )
    .unwrap();
}

fn pack_to_vec(src: &Path, root_name: Option<&[u8]>) -> (Vec<u8>, ArchiveDone) {
    let mut out = Vec::new();
    let options = PackOptions {
        root_name: root_name.map(<[u8]>::to_vec),
    };
    let done = pack(src, &options, &mut out).unwrap();
    (out, done)
}

fn unpack_into(
    tar: &[u8],
    dest: &Path,
    rename: Option<&[u8]>,
) -> Result<ArchiveDone, ArchiveError> {
    let fd = open_dir_nofollow(dest).unwrap();
    let options = UnpackOptions {
        rename_root: rename.map(<[u8]>::to_vec),
        keep_special_bits: true,
        limits: Limits::default(),
    };
    unpack(Cursor::new(tar), &fd, &options)
}

use crate::fsops::ArchiveDone;

#[test]
fn a_tree_round_trips_with_modes_links_empty_dirs_holes_and_odd_names() {
    // Arrange
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    acceptance_tree(&src);
    let dest = tmp.path().join("dest");
    fs::create_dir(&dest).unwrap();

    // Act
    let (tar, packed) = pack_to_vec(&src, None);
    let unpacked = unpack_into(&tar, &dest, None).unwrap();

    // Assert
    assert!(
        tar.len() < 2 << 20,
        "the hole travelled: {} bytes",
        tar.len()
    );
    assert_same_trees(&snapshot(&src), &snapshot(&dest.join("src")));
    let copy = dest.join("src/sparse");
    let meta = fs::metadata(&copy).unwrap();
    assert_eq!(meta.len(), GIB);
    assert!(
        meta.blocks() * 512 < 1 << 20,
        "{} blocks allocated",
        meta.blocks()
    );
    let mut middle = [0u8; 6];
    fs::File::open(&copy)
        .unwrap()
        .read_exact_at(&mut middle, GIB / 2)
        .unwrap();
    assert_eq!(&middle, b"middle");
    assert_eq!(packed.entries, unpacked.entries);
    assert_eq!(packed.entries, 1000 + 8);
    let top: Vec<_> = fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(top.len(), 2, "written outside the destination: {top:?}");
}

#[test]
fn a_renamed_root_lands_under_the_new_name_and_replaces_files_in_the_way() {
    // Arrange
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("a"), b"new").unwrap();
    let dest = tmp.path().join("dest");
    fs::create_dir_all(dest.join("copy")).unwrap();
    fs::write(tmp.path().join("outside"), b"old").unwrap();
    symlink(tmp.path().join("outside"), dest.join("copy/a")).unwrap();

    // Act
    let (tar, _) = pack_to_vec(&src, None);
    unpack_into(&tar, &dest, Some(b"copy")).unwrap();

    // Assert: the symlink in the way was replaced, its target left alone.
    assert_eq!(fs::read(dest.join("copy/a")).unwrap(), b"new");
    assert!(!fs::symlink_metadata(dest.join("copy/a"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(tmp.path().join("outside")).unwrap(), b"old");
}

/// A tar stream built by hand, names unchecked: `(name, type, link target, contents)`.
/// `(name, type, link target, contents)` of a hand-made entry.
type RawEntry<'a> = (&'a [u8], tar::EntryType, &'a [u8], &'a [u8]);

fn hostile(entries: &[RawEntry<'_>]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, kind, target, data) in entries {
        let mut header = tar::Header::new_gnu();
        header.as_old_mut().name[..name.len()].copy_from_slice(name);
        header.as_old_mut().linkname[..target.len()].copy_from_slice(target);
        header.set_entry_type(*kind);
        header.set_mode(0o644);
        header.set_size(data.len() as u64);
        header.set_cksum();
        builder.append(&header, *data).unwrap();
    }
    builder.into_inner().unwrap()
}

#[test]
fn hostile_archives_write_nothing_outside_the_destination() {
    use tar::EntryType::{Block, Directory, Link, Regular, Symlink};
    // Arrange
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("dest");
    fs::create_dir(&dest).unwrap();
    fs::create_dir(tmp.path().join("outside")).unwrap();
    symlink(tmp.path().join("outside"), dest.join("planted")).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("dot-dot", hostile(&[(b"../escape", Regular, b"", b"x")])),
        ("absolute", hostile(&[(b"/tmp/escape", Regular, b"", b"x")])),
        (
            "through its own symlink",
            hostile(&[
                (b"d", Directory, b"", b""),
                (b"d/evil", Symlink, b"../../outside", b""),
                (b"d/evil/escape", Regular, b"", b"x"),
            ]),
        ),
        (
            "through a planted symlink",
            hostile(&[(b"planted/escape", Regular, b"", b"x")]),
        ),
        (
            "hard link out",
            hostile(&[(b"h", Link, b"../outside/x", b"")]),
        ),
    ];

    // Act
    let results: Vec<_> = cases
        .iter()
        .map(|(what, tar)| (*what, unpack_into(tar, &dest, None)))
        .collect();
    let device = unpack_into(&hostile(&[(b"sda", Block, b"", b"")]), &dest, None).unwrap();

    // Assert
    for (what, result) in &results {
        assert!(result.is_err(), "{what}: {result:?}");
    }
    assert_eq!(fs::read_dir(tmp.path().join("outside")).unwrap().count(), 0);
    assert!(!tmp.path().join("escape").exists());
    assert_eq!(device.skipped.len(), 1, "{device:?}");
    assert!(
        device.skipped[0].reason.contains("block device"),
        "{device:?}"
    );
}

#[test]
fn too_many_entries_is_a_clear_error() {
    // Arrange
    let tmp = tempfile::tempdir().unwrap();
    let names: Vec<Vec<u8>> = (0..5).map(|i| format!("f{i}").into_bytes()).collect();
    let borrowed: Vec<RawEntry<'_>> = names
        .iter()
        .map(|n| (&n[..], tar::EntryType::Regular, &b""[..], &b"x"[..]))
        .collect();
    let tar = hostile(&borrowed);
    let fd = open_dir_nofollow(tmp.path()).unwrap();
    let options = UnpackOptions {
        limits: Limits {
            entries: 3,
            ..Limits::default()
        },
        ..UnpackOptions::default()
    };

    // Act
    let err = unpack(Cursor::new(tar), &fd, &options).unwrap_err();

    // Assert
    assert!(err.to_string().contains("limit of 3 entries"), "{err}");
}

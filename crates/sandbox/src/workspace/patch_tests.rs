//! Patches checked with the real `git apply`: each test writes an old and a new tree, builds
//! the patch between them, applies it to the old tree and compares the result with the new
//! tree (contents, executable bits, link targets). Without git on the machine they print why
//! and pass without checking.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::process::Command;

use super::*;

/// A file system entry of a test tree.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    File(Vec<u8>, bool),
    Link(String),
}

fn file(data: &[u8]) -> Node {
    Node::File(data.to_vec(), false)
}

fn exec(data: &[u8]) -> Node {
    Node::File(data.to_vec(), true)
}

fn link(target: &str) -> Node {
    Node::Link(target.to_owned())
}

type Tree = BTreeMap<String, Node>;

fn tree(entries: &[(&str, Node)]) -> Tree {
    entries
        .iter()
        .map(|(p, n)| ((*p).to_owned(), n.clone()))
        .collect()
}

fn blob(node: &Node) -> Blob<'_> {
    match node {
        Node::File(data, x) => Blob {
            mode: if *x { MODE_EXEC } else { MODE_FILE },
            data,
        },
        Node::Link(target) => Blob {
            mode: MODE_LINK,
            data: target.as_bytes(),
        },
    }
}

fn patch(old: &Tree, new: &Tree) -> Vec<u8> {
    let mut out = Vec::new();
    let paths: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for path in paths {
        let (o, n) = (old.get(path).map(blob), new.get(path).map(blob));
        write_diff(&mut out, path, o, n).unwrap();
    }
    out
}

fn materialize(root: &Path, tree: &Tree) {
    for (path, node) in tree {
        let full = root.join(path);
        fs::create_dir_all(full.parent().unwrap()).unwrap();
        match node {
            Node::File(data, x) => {
                fs::write(&full, data).unwrap();
                let mode = if *x { 0o755 } else { 0o644 };
                fs::set_permissions(&full, fs::Permissions::from_mode(mode)).unwrap();
            }
            Node::Link(target) => symlink(target, &full).unwrap(),
        }
    }
}

/// Files and links below `root` (directories only through what they hold).
fn read_tree(root: &Path) -> Tree {
    let mut out = Tree::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).unwrap();
                out.insert(rel, link(target.to_str().unwrap()));
            } else {
                let x = meta.permissions().mode() & 0o100 != 0;
                out.insert(rel, Node::File(fs::read(&path).unwrap(), x));
            }
        }
    }
    out
}

/// Applies the patch from `old` to `new` with `git apply` on a materialized `old` and returns
/// the resulting tree and the patch text. Needs git (`scripts/setup.sh` installs it).
fn apply(old: &Tree, new: &Tree) -> (Tree, String) {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    fs::create_dir(&work).unwrap();
    materialize(&work, old);
    let patch_bytes = patch(old, new);
    let patch_file = dir.path().join("changes.patch");
    fs::write(&patch_file, &patch_bytes).unwrap();
    let out = Command::new("git")
        .arg("apply")
        .arg(&patch_file)
        .current_dir(&work)
        .env("GIT_CEILING_DIRECTORIES", dir.path())
        .output()
        .expect("these tests need git (scripts/setup.sh installs it)");
    let text = String::from_utf8_lossy(&patch_bytes).into_owned();
    assert!(
        out.status.success(),
        "git apply failed: {}\n--- patch\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    (read_tree(&work), text)
}

/// The patch text from `old` to `new`, after checking that `git apply` turns `old` into `new`.
fn check(old: &[(&str, Node)], new: &[(&str, Node)]) -> String {
    let (old, new) = (tree(old), tree(new));
    let (result, text) = apply(&old, &new);
    assert_eq!(result, new, "--- patch\n{text}");
    text
}

#[test]
fn text_edits_additions_and_deletions_apply_with_context() {
    // Arrange
    let long: String = (1..=40).map(|i| format!("line {i}\n")).collect();
    let edited = long
        .replace("line 5\n", "line five\n")
        .replace("line 30\n", "")
        + "appended\n";
    let old = [
        ("src/long.txt", file(long.as_bytes())),
        ("gone.txt", file(b"bye\n")),
        ("same.txt", file(b"same\n")),
    ];
    let new = [
        ("src/long.txt", file(edited.as_bytes())),
        ("src/new/deep.rs", file(b"fn main() {}\n")),
        ("same.txt", file(b"same\n")),
    ];

    // Act / Assert
    let text = check(&old, &new);
    assert!(text.contains("@@ -2,7 +2,7 @@"), "{text}");
    assert!(text.contains("deleted file mode 100644"), "{text}");
    assert!(!text.contains("same.txt"), "{text}");
}

#[test]
fn missing_final_newlines_and_crlf_survive() {
    // Arrange
    let old = [
        ("a", file(b"one\ntwo")),
        ("b", file(b"x\r\ny\r\n")),
        ("c", file(b"no newline")),
    ];
    let new = [
        ("a", file(b"one\ntwo\n")),
        ("b", file(b"x\r\nz\r\n")),
        ("c", file(b"still none, longer")),
        ("d", file(b"created without newline")),
    ];

    // Act / Assert
    let text = check(&old, &new);
    assert!(text.contains("\\ No newline at end of file"), "{text}");
}

#[test]
fn binary_files_use_literal_patches_with_full_ids() {
    // Arrange
    let big: Vec<u8> = (0..20_000u32)
        .flat_map(|i| (i * 7919).to_le_bytes())
        .collect();
    let mut changed = big.clone();
    changed[1000] ^= 0xff;
    changed.extend_from_slice(b"\0tail");
    let old = [("img.bin", file(&big)), ("old.bin", file(b"\0\x01\x02"))];
    let new = [("img.bin", file(&changed)), ("new.bin", file(b"\0\xff\0"))];

    // Act / Assert
    let text = check(&old, &new);
    assert!(text.contains("GIT binary patch\nliteral"), "{text}");
    assert!(
        text.contains(&format!("index {}..", blob_id(&big))),
        "{text}"
    );
}

#[test]
fn empty_files_modes_and_symbolic_links_apply() {
    // Arrange
    let old = [
        ("empty-gone", file(b"")),
        ("run.sh", file(b"#!/bin/sh\n")),
        ("tool", file(b"#!/bin/sh\necho 1\n")),
        ("link", link("run.sh")),
        ("retarget", link("a")),
        ("becomes-link", file(b"was a file\n")),
        ("becomes-file", link("x")),
    ];
    let new = [
        ("empty-new", file(b"")),
        ("run.sh", exec(b"#!/bin/sh\n")),
        ("tool", exec(b"#!/bin/sh\necho 2\n")),
        ("retarget", link("b")),
        ("new-link", link("../outside")),
        ("becomes-link", link("run.sh")),
        ("becomes-file", file(b"now a file\n")),
    ];

    // Act / Assert
    let text = check(&old, &new);
    assert!(text.contains("old mode 100644\nnew mode 100755"), "{text}");
    assert!(text.contains("new file mode 120000"), "{text}");
}

#[test]
fn odd_names_are_quoted_and_still_apply() {
    // Arrange
    let old = [
        ("with space.txt", file(b"a\n")),
        ("caf\u{e9}.txt", file(b"a\n")),
    ];
    let new = [
        ("with space.txt", file(b"b\n")),
        ("caf\u{e9}.txt", file(b"b\n")),
        ("quote\"back\\slash", file(b"new\n")),
        ("tab\there", file(b"new\n")),
    ];

    // Act / Assert
    let text = check(&old, &new);
    assert!(text.contains("\"a/caf\\303\\251.txt\""), "{text}");
    assert!(text.contains("--- a/with space.txt\t\n"), "{text}");
}

#[test]
fn quoting_escapes_newlines_and_control_characters() {
    // Arrange / Act
    let quoted = quote("a/", "x\ndiff --git a/evil b/evil\x1b[31m");

    // Assert
    assert_eq!(quoted, "\"a/x\\ndiff --git a/evil b/evil\\033[31m\"");
    assert_eq!(quote("", "plain/path.rs"), "plain/path.rs");
}

#[test]
fn blob_ids_match_git() {
    // Arrange / Act / Assert: `git hash-object` of an empty file and of "hello\n".
    assert_eq!(blob_id(b""), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
    assert_eq!(
        blob_id(b"hello\n"),
        "ce013625030ba8dba906f756967f9e9ca394464a"
    );
}

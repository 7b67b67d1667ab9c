//! Tests of [`super::compute`] on host directories laid out like an overlay's upper and lower
//! directories. Whiteouts (character devices 0/0) and opaque directories (`trusted.*`
//! attributes) need root: without it those tests print why and pass without checking.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, PermissionsExt};

use super::*;

/// An overlay-like pair of directories.
struct Layers {
    _dir: tempfile::TempDir,
    upper: PathBuf,
    lower: PathBuf,
}

impl Layers {
    fn new() -> Layers {
        let dir = tempfile::tempdir().unwrap();
        let (upper, lower) = (dir.path().join("upper"), dir.path().join("lower"));
        fs::create_dir(&upper).unwrap();
        fs::create_dir(&lower).unwrap();
        Layers {
            _dir: dir,
            upper,
            lower,
        }
    }

    fn write(root: &Path, rel: &str, contents: &str, mode: u32) {
        let path = root.join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, contents).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
    }

    fn lower(&self, rel: &str, contents: &str) {
        Self::write(&self.lower, rel, contents, 0o644);
    }

    fn upper(&self, rel: &str, contents: &str) {
        Self::write(&self.upper, rel, contents, 0o644);
    }

    /// Creates an overlay whiteout (character device 0/0) at upper `rel`; false without the
    /// privilege to.
    fn whiteout(&self, rel: &str) -> bool {
        let path = CString::new(self.upper.join(rel).as_os_str().as_bytes()).unwrap();
        // SAFETY: `path` is NUL-terminated and outlives the call.
        unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o600, 0) == 0 }
    }

    /// Marks upper directory `rel` opaque; false without the privilege to.
    fn opaque(&self, rel: &str) -> bool {
        let path = CString::new(self.upper.join(rel).as_os_str().as_bytes()).unwrap();
        let name = CString::new(OPAQUE_XATTR).unwrap();
        // SAFETY: both strings are NUL-terminated and outlive the call; the value is 1 byte.
        unsafe { libc::lsetxattr(path.as_ptr(), name.as_ptr(), b"y".as_ptr().cast(), 1, 0) == 0 }
    }
}

/// `(status letter, kind, path)` of each change.
fn summary(set: &ChangeSet) -> Vec<(char, EntryKind, &str)> {
    set.changes
        .iter()
        .map(|c| (c.status.letter(), c.kind, c.path.as_str()))
        .collect()
}

use EntryKind::{Dir, File as F, Symlink as L};

#[test]
fn new_edited_and_untouched_copied_up_files_are_told_apart() {
    // Arrange
    let layers = Layers::new();
    for name in ["keep.txt", "edit.txt", "copied.txt", "script.sh"] {
        layers.lower(name, "same\n");
    }
    layers.upper("edit.txt", "changed\n");
    layers.upper("copied.txt", "same\n"); // copied up by touch or chmod 600: no change
    Layers::write(&layers.upper, "script.sh", "same\n", 0o755); // chmod +x: modified
    layers.upper("src/new.rs", "fn main() {}\n");
    fs::create_dir_all(layers.upper.join("empty/inner")).unwrap();

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert
    assert_eq!(
        summary(&set),
        [
            ('M', F, "edit.txt"),
            ('A', Dir, "empty/inner"),
            ('M', F, "script.sh"),
            ('A', F, "src/new.rs"),
        ]
    );
    let script = &set.changes[2];
    assert_eq!((script.mode, script.size), (0o755, 5));
    assert!(set.skipped.is_empty());
}

#[test]
fn symbolic_links_compare_by_target() {
    // Arrange
    let layers = Layers::new();
    symlink("a", layers.lower.join("same")).unwrap();
    symlink("a", layers.lower.join("moved")).unwrap();
    symlink("a", layers.upper.join("same")).unwrap();
    symlink("b", layers.upper.join("moved")).unwrap();
    symlink("/etc/passwd", layers.upper.join("new")).unwrap();

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert
    assert_eq!(summary(&set), [('M', L, "moved"), ('A', L, "new")]);
    assert_eq!(set.changes[1].size, "/etc/passwd".len() as u64);
}

#[test]
fn whiteouts_delete_files_and_whole_trees_needs_root() {
    // Arrange
    let layers = Layers::new();
    layers.lower("gone.txt", "x");
    layers.lower("olddir/a", "x");
    layers.lower("olddir/sub/b", "x");
    layers.lower("kept/c", "x");
    fs::create_dir(layers.upper.join("kept")).unwrap();
    for rel in ["gone.txt", "olddir", "nothing"] {
        assert!(
            layers.whiteout(rel),
            "mknod c 0 0 needs root (scripts/test.sh skips *_needs_root when not root)"
        );
    }

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert: a whiteout over nothing (the lower entry vanished) is no change.
    assert_eq!(
        summary(&set),
        [
            ('D', F, "gone.txt"),
            ('D', Dir, "olddir"),
            ('D', F, "olddir/a"),
            ('D', F, "olddir/sub/b"),
        ]
    );
}

#[test]
fn an_opaque_directory_hides_the_lower_one_except_what_it_has_again_needs_root() {
    // Arrange
    let layers = Layers::new();
    layers.lower("dir/old", "x");
    layers.lower("dir/same", "kept\n");
    layers.lower("dir/sub/deep", "x");
    layers.upper("dir/same", "kept\n");
    layers.upper("dir/new", "y");
    fs::create_dir(layers.upper.join("dir/sub")).unwrap(); // hidden below the opaque parent
    assert!(
        layers.opaque("dir"),
        "trusted.* xattrs need root (scripts/test.sh skips *_needs_root when not root)"
    );

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert
    assert_eq!(
        summary(&set),
        [
            ('A', F, "dir/new"),
            ('D', F, "dir/old"),
            ('D', F, "dir/sub/deep"),
        ]
    );
}

#[test]
fn a_kind_change_is_a_deletion_then_an_addition_of_the_same_path_needs_root() {
    // Arrange
    let layers = Layers::new();
    layers.lower("f2d", "file that becomes a directory");
    layers.lower("d2f/inner", "x");
    layers.lower("f2l", "file that becomes a link");
    layers.upper("f2d/z", "z");
    layers.upper("d2f", "directory that became a file");
    symlink("target", layers.upper.join("f2l")).unwrap();
    assert!(
        layers.opaque("f2d"),
        "trusted.* xattrs need root (scripts/test.sh skips *_needs_root when not root)"
    );

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert
    assert_eq!(
        summary(&set),
        [
            ('D', Dir, "d2f"),
            ('A', F, "d2f"),
            ('D', F, "d2f/inner"),
            ('D', F, "f2d"),
            ('A', F, "f2d/z"),
            ('D', F, "f2l"),
            ('A', L, "f2l"),
        ]
    );
}

#[test]
fn a_lower_symlink_to_a_directory_is_never_followed() {
    // Arrange: the guest replaced the link `out` (to a directory outside) by a directory.
    let layers = Layers::new();
    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("secret"), "same\n").unwrap();
    symlink(outside.path(), layers.lower.join("out")).unwrap();
    layers.upper("out/secret", "same\n");

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert: compared with nothing (not with the link's target), so it is new.
    assert_eq!(summary(&set), [('D', L, "out"), ('A', F, "out/secret")]);
}

#[test]
fn odd_names_and_special_files_are_skipped_with_a_reason() {
    // Arrange
    let layers = Layers::new();
    let odd = std::ffi::OsStr::from_bytes(b"bad\xffname");
    fs::write(layers.upper.join(odd), "x").unwrap();
    let fifo = CString::new(layers.upper.join("fifo").as_os_str().as_bytes()).unwrap();
    // SAFETY: `fifo` is NUL-terminated and outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

    // Act
    let set = compute(&layers.upper, &layers.lower).unwrap();

    // Assert
    assert!(set.changes.is_empty(), "{:?}", set.changes);
    let skipped: Vec<(&str, bool)> = set
        .skipped
        .iter()
        .map(|s| (s.path.as_str(), s.reason.contains("UTF-8")))
        .collect();
    assert_eq!(skipped, [("bad\u{fffd}name", true), ("fifo", false)]);
}

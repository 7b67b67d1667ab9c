//! `bulkhead template create` and `bulkhead run --template` with host directories: the
//! template's share slots take a clone or direct `--workspace` and `--mount`s at restore time.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

use bulkhead_tests::{artifacts, describe, guest_test};

/// uid:gid of the direct workspace: root may not share a root-owned directory read-write.
const OWNER: (u32, u32) = (1000, 1000);

/// `bulkhead ARGS` with the test's kernel, agent initramfs and VMM, templates in `data`.
fn bulkhead(data: &Path, args: &[&str]) -> Output {
    let a = artifacts();
    Command::new(&a.cli)
        .args(args)
        .env("BULKHEAD_KERNEL", &a.vmlinux)
        .env("BULKHEAD_INITRD", &a.agent_initrd)
        .env("BULKHEAD_VMM", &a.vmm)
        .env("BULKHEAD_DATA_DIR", data)
        .output()
        .expect("run bulkhead")
}

guest_test!(
    fn a_clone_gets_a_workspace_and_mounts_with_read_only_and_export_kept() {
        // Arrange: a template with share slots, a project, a read-only data directory and a
        // directory for a direct workspace.
        let data = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        let (project, ro, direct) = (
            host.path().join("project"),
            host.path().join("ro"),
            host.path().join("direct"),
        );
        for dir in [&project, &ro, &direct] {
            fs::create_dir(dir).unwrap();
        }
        fs::write(project.join("README"), "old line\n").unwrap();
        fs::write(ro.join("f"), "ro-data\n").unwrap();
        std::os::unix::fs::chown(&direct, Some(OWNER.0), Some(OWNER.1)).unwrap();
        let patch = host.path().join("changes.patch");
        let created = bulkhead(
            data.path(),
            &[
                "template",
                "create",
                "t",
                "--",
                "sh",
                "-c",
                "echo 42 > /tmp/x",
            ],
        );
        assert!(created.status.success(), "{}", describe(&created));
        let clone_ws = format!("{}:clone", project.display());
        let ro_mount = format!("{}:/data:ro", ro.display());
        let script = "cat /tmp/x /data/f; \
                      if touch /data/new 2>/dev/null; then echo writable; else echo read-only; fi; \
                      cat /workspace/README; echo new line > /workspace/README; \
                      echo added > /workspace/NEW";

        // Act
        let clone = bulkhead(
            data.path(),
            &[
                "run",
                "--template",
                "t",
                "--workspace",
                &clone_ws,
                "--mount",
                &ro_mount,
                "--export-patch",
                patch.to_str().unwrap(),
                "--",
                "sh",
                "-c",
                script,
            ],
        );
        let direct_ws = direct.display().to_string();
        let direct_run = bulkhead(
            data.path(),
            &[
                "run",
                "--template",
                "t",
                "--workspace",
                &direct_ws,
                "--",
                "sh",
                "-c",
                "echo from-the-clone > /workspace/out && pwd",
            ],
        );

        // Assert: the clone saw the template's file, the mount (read-only) and the workspace;
        // its changes came back as a patch and left the project alone.
        assert!(clone.status.success(), "{}", describe(&clone));
        assert_eq!(
            String::from_utf8_lossy(&clone.stdout),
            "42\nro-data\nread-only\nold line\n"
        );
        assert!(!ro.join("new").exists());
        assert_eq!(
            fs::read_to_string(project.join("README")).unwrap(),
            "old line\n"
        );
        assert!(!project.join("NEW").exists());
        let text = fs::read_to_string(&patch).expect("the patch was written");
        for expected in ["-old line\n+new line", "diff --git a/NEW b/NEW", "+added"] {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
        assert!(direct_run.status.success(), "{}", describe(&direct_run));
        assert_eq!(String::from_utf8_lossy(&direct_run.stdout), "/workspace\n");
        assert_eq!(
            fs::read_to_string(direct.join("out")).unwrap(),
            "from-the-clone\n"
        );
    }
);

guest_test!(
    fn more_mounts_than_the_template_has_slots_are_refused_before_a_restore() {
        // Arrange: a template with one share slot.
        let data = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        let created = bulkhead(
            data.path(),
            &["template", "create", "one", "--share-slots", "1"],
        );
        assert!(created.status.success(), "{}", describe(&created));
        let mount = |guest: &str| format!("{}:{guest}:ro", host.path().display());
        let (a, b) = (mount("/a"), mount("/b"));

        // Act
        let out = bulkhead(
            data.path(),
            &[
                "run",
                "--template",
                "one",
                "--mount",
                &a,
                "--mount",
                &b,
                "--",
                "true",
            ],
        );

        // Assert
        assert_eq!(out.status.code(), Some(125), "{}", describe(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("1 share slots") && stderr.contains("--share-slots"),
            "{stderr}"
        );
    }
);

//! `bulkhead template create` and `bulkhead run --template` with host directories: the
//! template's share slots take a clone or direct `--workspace` and `--mount`s at restore time,
//! and the network flags give a clone an egress proxy of its own.

use std::fs;
use std::path::Path;
use std::process::Output;

use bulkhead_egress::policy::Verdict;
use bulkhead_egress::testing::{TestCa, TestServer};
use bulkhead_egress::GUEST_CA_CERT_PATH;
use bulkhead_tests::{artifacts, describe, field, guest_test};

/// uid:gid of the direct workspace: root may not share a root-owned directory read-write.
const OWNER: (u32, u32) = (1000, 1000);

/// A secret's value on the host: a clone's environment gets a placeholder instead.
const SECRET: &str = "bulkhead-template-secret-51c0";

/// `bulkhead ARGS` with the test's kernel, agent initramfs and VMM, templates in `data`.
fn bulkhead(data: &Path, args: &[&str]) -> Output {
    bulkhead_with_env(data, args, &[])
}

/// [`bulkhead`] with the variables `env` set too.
fn bulkhead_with_env(data: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let a = artifacts();
    a.cli_command()
        .args(args)
        .env("BULKHEAD_DATA_DIR", data)
        .envs(env.iter().copied())
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
    fn a_template_saves_its_writable_data_disk_and_each_clone_writes_to_its_own_copy() {
        // Arrange: a sparse 4 MiB data disk, to which the preparation writes 13 bytes.
        let data = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        let disk = host.path().join("data.img");
        fs::File::create(&disk)
            .and_then(|f| f.set_len(4 << 20))
            .unwrap();
        let disk_arg = disk.to_str().unwrap();
        let created = bulkhead(
            data.path(),
            &[
                "template",
                "create",
                "d",
                "--share-slots",
                "0",
                "--disk-file",
                disk_arg,
                "--",
                "sh",
                "-c",
                "printf template-data | dd of=/dev/vda conv=fsync 2>/dev/null",
            ],
        );
        assert!(created.status.success(), "{}", describe(&created));
        let file_after_template = fs::read(&disk).unwrap();
        let saved = data.path().join("templates/d/disk-0.img");
        let saved_before = fs::read(&saved).expect("the template's copy of the data disk");
        // Each clone reads the disk's first 13 bytes, writes its own, and reads them back
        // from its disk (not its page cache).
        let script = |mine: &str| {
            format!(
                "head -c 13 /dev/vda; echo; printf {mine} | dd of=/dev/vda conv=fsync \
                 2>/dev/null && echo 3 > /proc/sys/vm/drop_caches && head -c 13 /dev/vda"
            )
        };
        let clone = |mine: &str| {
            bulkhead(
                data.path(),
                &["run", "--template", "d", "--", "sh", "-c", &script(mine)],
            )
        };

        // Act
        let first = clone("clone-one-abc");
        let second = clone("clone-two-xyz");

        // Assert: both clones began from the template's bytes and kept their own writes; the
        // template's copy and the data disk's file are as the preparation left them.
        assert!(first.status.success(), "{}", describe(&first));
        assert!(second.status.success(), "{}", describe(&second));
        let stdout = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
        assert_eq!(stdout(&first), "template-data\nclone-one-abc");
        assert_eq!(stdout(&second), "template-data\nclone-two-xyz");
        assert_eq!(&file_after_template[..13], b"template-data");
        assert_eq!(
            fs::read(&disk).unwrap(),
            file_after_template,
            "a clone wrote to the file"
        );
        assert_eq!(
            fs::read(&saved).unwrap(),
            saved_before,
            "a clone wrote to the template's copy"
        );
        assert_eq!(saved_before, file_after_template);
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

guest_test!(
    fn a_clone_with_network_flags_gets_its_own_proxy_and_one_without_has_none() {
        // Arrange: a template booted without a network; the egress test server's plain-HTTP
        // port on the test host's loopback, allowed by CIDR and port.
        let data = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = runtime.block_on(TestServer::start(&TestCa::new()));
        let (http, other) = (server.http_port, server.tls_port);
        let created = bulkhead(data.path(), &["template", "create", "net"]);
        assert!(created.status.success(), "{}", describe(&created));
        let log = data.path().join("egress.jsonl");
        let (allowed, log_arg) = (format!("127.0.0.1/32:{http}"), log.display().to_string());
        let script = format!(
            "echo got=$(wget -q -O - http://127.0.0.1:{http}/echo-auth)
             echo denied=$(wget -q -O - http://127.0.0.1:{other}/ 2>&1 | grep -c 403)
             echo placeholder=$TOKEN
             echo ca=$(grep -c 'BEGIN CERTIFICATE' {GUEST_CA_CERT_PATH})"
        );
        let bare_script = "echo proxy_vars=$(env | grep -ci _proxy)
             wget -q -O - http://127.0.0.1:3128/ >/dev/null 2>&1; echo relay_exit=$?";

        // Act
        let with = bulkhead_with_env(
            data.path(),
            &[
                "run",
                "--template",
                "net",
                "--allow-cidr",
                &allowed,
                "--secret",
                "TOKEN=api.test",
                "--egress-log",
                &log_arg,
                "--",
                "sh",
                "-c",
                &script,
            ],
            &[("TOKEN", SECRET)],
        );
        let without = bulkhead(
            data.path(),
            &["run", "--template", "net", "--", "sh", "-c", bare_script],
        );

        // Assert: the clone fetched through its proxy (which logged both decisions), had a
        // placeholder for the secret and the proxy's CA; the bare clone has no way out.
        assert!(with.status.success(), "{}", describe(&with));
        let stdout = String::from_utf8_lossy(&with.stdout).into_owned();
        assert_eq!(field(&stdout, "got"), "echoed", "{}", describe(&with));
        assert_eq!(field(&stdout, "denied"), "1", "{}", describe(&with));
        let placeholder = field(&stdout, "placeholder");
        assert!(!placeholder.is_empty() && !placeholder.contains(SECRET));
        assert_eq!(field(&stdout, "ca"), "1", "{}", describe(&with));
        let entries = bulkhead_egress::read_log(&log).expect("the egress log");
        let decided = |port: u16, decision: Verdict| {
            entries
                .iter()
                .any(|e| e.port == port && e.decision == decision)
        };
        assert!(decided(http, Verdict::Allow), "{entries:?}");
        assert!(decided(other, Verdict::Deny), "{entries:?}");
        assert!(without.status.success(), "{}", describe(&without));
        let bare = String::from_utf8_lossy(&without.stdout).into_owned();
        assert_eq!(field(&bare, "proxy_vars"), "0", "{}", describe(&without));
        assert_ne!(field(&bare, "relay_exit"), "0", "something listens on 3128");
    }
);

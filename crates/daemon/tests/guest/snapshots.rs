//! The daemon's snapshots with real VMs, in the nested test host when this machine's KVM cannot
//! boot guests: pause and resume, and the warm pool's hand-outs and refills.

use std::time::{Duration, Instant};

use crate::common::real::{
    create, debian_image_daemon, http_server, pool_ready, real_daemon, real_pool_daemon,
    real_pool_daemon_from, sh, small, vm_logs,
};
use crate::common::{rt, wait_until};
use crate::vm_test;
use bulkhead_client::SandboxState;
use bulkhead_tests::test_path;

vm_test!(
    fn a_paused_real_vm_has_no_vmm_and_resumes_with_its_files_and_processes() {
        // Arrange: a sandbox with a network (a plain-HTTP test server on the test host's
        // loopback allowed), a file in guest RAM and a process left running.
        let server = http_server();
        let port = server.port;
        let daemon = real_daemon("", &[]);
        let client = daemon.client();
        let rt = rt();
        let request = bulkhead_client::CreateSandbox {
            network: Some(server.network()),
            ..small(64)
        };
        let sb = rt.block_on(client.create(&request)).unwrap();
        let fetch = format!("wget -q -O - http://127.0.0.1:{port}/");
        sh(
            &daemon,
            &sb.id,
            &format!(
                "{fetch} >/dev/null; echo 42 > /tmp/x; \
                 sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /tmp/pid"
            ),
        );
        let old_vmm = sb.vmm_pid.unwrap();

        // Act
        let paused = rt.block_on(client.pause(&sb.id));
        let vmm_after_pause = crate::common::alive(old_vmm);
        let resumed = rt.block_on(client.resume(&sb.id));
        let file = sh(&daemon, &sb.id, "cat /tmp/x");
        let sleeper = sh(&daemon, &sb.id, "kill -0 $(cat /tmp/pid) && echo alive");
        let fetched = sh(&daemon, &sb.id, &fetch);
        let log = rt.block_on(client.egress_log(&sb.id)).unwrap();
        let paused_again = rt.block_on(client.pause(&sb.id));
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        let fail = |e: bulkhead_client::Error| -> ! {
            panic!(
                "{e}\n{}\n--- daemon\n{}",
                vm_logs(&daemon.vms_dir()),
                daemon.log()
            )
        };
        assert_eq!(
            paused.unwrap_or_else(|e| fail(e)).state,
            SandboxState::Paused
        );
        assert!(
            !vmm_after_pause,
            "the VMM {old_vmm} still runs after the pause"
        );
        let resumed = resumed.unwrap_or_else(|e| fail(e));
        assert_eq!(resumed.state, SandboxState::Running);
        assert_eq!(file, "42\n");
        assert_eq!(sleeper, "alive\n", "the process started before the pause");
        assert!(
            fetched.contains("hello from the test server"),
            "no way out after the resume: {fetched:?}"
        );
        let allowed = log.lines().filter(|l| l.contains("\"allow\"")).count();
        assert_eq!(allowed, 2, "one request before the pause, one after: {log}");
        assert_eq!(
            paused_again.unwrap_or_else(|e| fail(e)).state,
            SandboxState::Paused
        );
        assert_eq!(
            crate::common::list(&daemon.state_dir.join("paused")),
            Vec::<std::path::PathBuf>::new()
        );
        let new_vmm = resumed.vmm_pid.unwrap();
        assert_eq!(daemon.leftovers(&[old_vmm, new_vmm]), Vec::<String>::new());
    }
);

vm_test!(
    /// A warm pool of one real clone: the create is a hand-out of the clone restored before it
    /// (the template's file is there, the request's hostname and environment apply), the pool
    /// refills, and shutdown leaves nothing. A create of the template with a network is a
    /// hand-out too: the clone gets an egress proxy of its own and reaches what it allows. A
    /// plain create (no hostname, network or shares: no round trip to the guest at the
    /// hand-out) gets a clone whose hostname is `bh-<its id>`.
    fn a_real_pooled_clone_is_handed_out_with_the_templates_files_and_its_own_hostname() {
        // Arrange: template `base` (its guest wrote /tmp/x), a daemon keeping a clone of it, a
        // plain-HTTP test server on the test host's loopback for the networked clone.
        let server = http_server();
        let port = server.port;
        let (mut daemon, _) = real_pool_daemon(1);
        let client = daemon.client();
        let rt = rt();
        let filled = wait_until(Duration::from_secs(300), || pool_ready(&daemon, 1));
        assert!(filled, "{}\n{}", vm_logs(&daemon.vms_dir()), daemon.log());
        let mut request = bulkhead_client::CreateSandbox {
            template: Some("base".into()),
            hostname: Some("pooled-1".into()),
            ..bulkhead_client::CreateSandbox::default()
        };
        request.env.insert("GREETING".into(), "hi".into());
        let networked = bulkhead_client::CreateSandbox {
            template: Some("base".into()),
            network: Some(server.network()),
            ..bulkhead_client::CreateSandbox::default()
        };
        let fetch = format!("cat /tmp/x; wget -q -O - http://127.0.0.1:{port}/");
        let plain = bulkhead_client::CreateSandbox {
            template: Some("base".into()),
            ..bulkhead_client::CreateSandbox::default()
        };

        // Act
        let started = Instant::now();
        let pooled = rt.block_on(client.create(&request)).unwrap();
        let create_time = started.elapsed();
        let seen = sh(&daemon, &pooled.id, "cat /tmp/x; hostname; echo $GREETING");
        let refilled = wait_until(Duration::from_secs(300), || pool_ready(&daemon, 1));
        rt.block_on(client.delete(&pooled.id)).unwrap();
        let with_network = create(&daemon, &networked);
        let fetched = sh(&daemon, &with_network.id, &fetch);
        let log = rt.block_on(client.egress_log(&with_network.id)).unwrap();
        rt.block_on(client.delete(&with_network.id)).unwrap();
        let refilled_again = wait_until(Duration::from_secs(300), || pool_ready(&daemon, 1));
        let plain = create(&daemon, &plain);
        let plain_seen = sh(&daemon, &plain.id, "cat /tmp/x; hostname");
        rt.block_on(client.delete(&plain.id)).unwrap();
        let vmms = vec![
            pooled.vmm_pid.unwrap(),
            with_network.vmm_pid.unwrap(),
            plain.vmm_pid.unwrap(),
        ];
        let stopped = daemon.terminate();

        // Assert
        assert!(
            handed_out(&daemon, &pooled.id),
            "not a hand-out (create took {create_time:?})\n{}",
            daemon.log()
        );
        assert_eq!(seen, "42\npooled-1\nhi\n");
        assert!(
            fetched.starts_with("42\n") && fetched.contains("hello from the test server"),
            "{fetched}"
        );
        assert_eq!(with_network.template.as_deref(), Some("base"));
        assert!(
            handed_out(&daemon, &with_network.id),
            "the networked create was no hand-out\n{}",
            daemon.log()
        );
        assert!(log.contains("\"allow\""), "{log}");
        assert!(refilled && refilled_again, "{}", daemon.log());
        assert!(handed_out(&daemon, &plain.id), "{}", daemon.log());
        assert_eq!(plain_seen, format!("42\nbh-{}\n", plain.id));
        assert!(stopped, "{}", daemon.log());
        assert_eq!(daemon.leftovers(&vmms), Vec::<String>::new());
    }
);

vm_test!(
    /// The fault test: `kill -9` of the daemon while its pool of real clones refills;
    /// the restarted daemon leaves no VMM of the old one running and fills the pool again.
    fn kill_9_while_the_pool_refills_leaves_no_real_vm_and_the_pool_refills() {
        // Arrange
        let (mut daemon, _) = real_pool_daemon(3);
        let client = daemon.client();
        let rt = rt();
        let ready = || rt.block_on(client.health()).unwrap().pool.unwrap();
        let one = wait_until(Duration::from_secs(300), || ready().ready >= 1);
        assert!(one, "{}\n{}", vm_logs(&daemon.vms_dir()), daemon.log());

        // Act
        let before = ready();
        let old = daemon.vm_cgroup_pids();
        daemon.kill9();
        daemon.spawn(&[]);
        let refilled = wait_until(Duration::from_secs(300), || pool_ready(&daemon, 3));
        let new = daemon.vm_cgroup_pids();
        let records = daemon.records().len();
        let stopped = daemon.terminate();

        // Assert
        assert!(
            before.ready < 3,
            "killed while the pool refilled: {before:?}"
        );
        assert!(!old.is_empty(), "clones ran when the daemon was killed");
        let orphans: Vec<u32> = old
            .iter()
            .copied()
            .filter(|p| crate::common::alive(*p))
            .collect();
        assert_eq!(
            orphans,
            Vec::<u32>::new(),
            "VMMs of the killed daemon still run"
        );
        assert!(refilled, "{}\n{}", vm_logs(&daemon.vms_dir()), daemon.log());
        assert!(
            !new.is_empty() && new.iter().all(|p| !old.contains(p)),
            "{new:?} {old:?}"
        );
        assert_eq!(records, 3, "one record per clone");
        assert!(stopped, "{}", daemon.log());
        let all: Vec<u32> = old.iter().chain(&new).copied().collect();
        assert_eq!(daemon.leftovers(&all), Vec::<String>::new());
    }
);

/// E2B's pause and resume with a userland: a sandbox on the tests' Debian image (no scratch
/// disk: its writable layer is in guest RAM) keeps a file python3 wrote and a running process
/// across a pause, its VMM gone in between.
#[test]
fn a_paused_sandbox_on_the_debian_image_resumes_with_its_files_and_processes() {
    // Prepared here: inside the test host only the paths are computed.
    let rootfs = bulkhead_tests::artifacts().debian_image();
    bulkhead_tests::in_vm_host(
        test_path!(a_paused_sandbox_on_the_debian_image_resumes_with_its_files_and_processes),
        || {
            // Arrange
            let (daemon, name) = debian_image_daemon(&rootfs);
            let client = daemon.client();
            let rt = rt();
            let spec = bulkhead_client::CreateSandbox {
                image: Some(name),
                ..small(256)
            };
            let sb = create(&daemon, &spec);
            sh(
                &daemon,
                &sb.id,
                "python3 -c \"open('/root/x', 'w').write('42')\"; \
                 sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /root/pid",
            );
            let old_vmm = sb.vmm_pid.unwrap();

            // Act
            let paused = rt.block_on(client.pause(&sb.id));
            let vmm_after_pause = crate::common::alive(old_vmm);
            let resumed = rt.block_on(client.resume(&sb.id));
            let seen = sh(
                &daemon,
                &sb.id,
                "cat /root/x; echo; kill -0 $(cat /root/pid) && echo alive",
            );
            rt.block_on(client.delete(&sb.id)).unwrap();

            // Assert
            let paused = paused.unwrap_or_else(|e| panic!("pause: {e}\n{}", daemon.log()));
            assert_eq!(paused.state, SandboxState::Paused);
            assert!(!vmm_after_pause, "the VMM {old_vmm} runs after the pause");
            let resumed =
                resumed.unwrap_or_else(|e| panic!("resume: {e}\n{}", vm_logs(&daemon.vms_dir())));
            assert_eq!(seen, "42\nalive\n");
            let new_vmm = resumed.vmm_pid.unwrap();
            assert_eq!(daemon.leftovers(&[old_vmm, new_vmm]), Vec::<String>::new());
        },
    );
}

vm_test!(
    fn a_sandbox_with_a_workspace_and_a_mount_pauses_once_nothing_uses_them_and_resumes_with_both()
    {
        // Arrange: a clone workspace (its changes an overlay in the guest) and a read-write
        // mount (owned by an unprivileged user for the jailed VMM), under a mount root the VMM
        // may enter; one guest process works in /workspace, another in /.
        let root = bulkhead_tests::socket_dir();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(root.path(), mode).unwrap();
        let (ws, data) = (root.path().join("ws"), root.path().join("data"));
        for dir in [&ws, &data] {
            std::fs::create_dir(dir).unwrap();
        }
        std::fs::write(ws.join("README"), "project\n").unwrap();
        std::fs::write(data.join("hello"), "hi\n").unwrap();
        std::os::unix::fs::chown(&data, Some(1000), Some(1000)).unwrap();
        let daemon = real_daemon("", &["--mount-root", root.path().to_str().unwrap()]);
        let client = daemon.client();
        let rt = rt();
        let request = bulkhead_client::CreateSandbox {
            workspace: Some(bulkhead_client::WorkspaceSpec {
                path: ws.display().to_string(),
                mode: bulkhead_client::WorkspaceMode::Clone,
            }),
            mounts: vec![bulkhead_client::MountSpec {
                host: data.display().to_string(),
                guest: "/data".into(),
                ro: false,
            }],
            ..small(128)
        };
        let sb = create(&daemon, &request);
        sh(
            &daemon,
            &sb.id,
            "echo before > /workspace/a; \
             (cd / && exec sleep 1000 </dev/null >/dev/null 2>&1) & echo $! > /tmp/idle; \
             (cd /workspace && exec sleep 1001 </dev/null >/dev/null 2>&1) & echo $! > /tmp/busy",
        );

        // Act
        let busy = rt.block_on(client.pause(&sb.id));
        let while_busy = sh(&daemon, &sb.id, "cat /data/hello; ls /workspace");
        sh(
            &daemon,
            &sb.id,
            "p=$(cat /tmp/busy); kill -9 $p; i=0; \
             while [ -e /proc/$p/cwd ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done",
        );
        let binding = sh(
            &daemon,
            &sb.id,
            "mkdir -p /opt/x && mount --bind /data /opt/x && echo bound",
        );
        let bound = rt.block_on(client.pause(&sb.id));
        sh(&daemon, &sb.id, "umount /opt/x");
        let paused = rt.block_on(client.pause(&sb.id));
        let resumed = rt.block_on(client.resume(&sb.id)).unwrap_or_else(|e| {
            panic!(
                "resume: {e}\n{}\n{}",
                vm_logs(&daemon.vms_dir()),
                daemon.log()
            )
        });
        let after = sh(
            &daemon,
            &sb.id,
            "cat /workspace/a /workspace/README /data/hello; kill -0 $(cat /tmp/idle) && \
             echo alive; echo after > /workspace/b; echo guest > /data/g",
        );
        let diff = rt.block_on(client.workspace_diff(&sb.id));
        rt.block_on(client.delete(&sb.id)).unwrap();

        // Assert
        assert_busy(&busy, "(sleep)");
        assert_eq!(binding, "bound\n");
        assert_busy(&bound, "/opt/x (a bind mount");
        assert_eq!(
            while_busy, "hi\nREADME\na\n",
            "the refused pause changed the guest"
        );
        let paused = paused.unwrap_or_else(|e| panic!("pause: {e}\n{}", daemon.log()));
        assert_eq!(paused.state, SandboxState::Paused);
        assert_eq!(after, "before\nproject\nhi\nalive\n");
        let diff = diff.unwrap_or_else(|e| panic!("diff: {e}"));
        let changed: Vec<&str> = diff.changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(
            changed,
            ["a", "b"],
            "the clone workspace's changes, before and after"
        );
        assert!(
            !ws.join("a").exists(),
            "a clone workspace wrote to the host"
        );
        assert_eq!(std::fs::read_to_string(data.join("g")).unwrap(), "guest\n");
        assert_eq!(
            daemon.leftovers(&[sb.vmm_pid.unwrap(), resumed.vmm_pid.unwrap()]),
            Vec::<String>::new()
        );
    }
);

vm_test!(
    /// A template create with a clone workspace and a read-write mount is handed a pooled
    /// clone: the pool's clones run as `share_owner` (the mount's owner), the directories are
    /// attached to the clone's idle share slots (its template is a paused sandbox that had a
    /// workspace and a mount), the guest reads and writes them, the workspace's diff works and
    /// the host's workspace stays untouched.
    fn a_pooled_clone_is_handed_out_with_a_workspace_and_a_mount_attached() {
        // Arrange: directories under a mount root the VMM may enter; the mounts' owned by an
        // unprivileged user (a jailed VMM serves a read-write share as its owner).
        let root = bulkhead_tests::socket_dir();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(root.path(), mode).unwrap();
        let dir = |name: &str| root.path().join(name);
        for name in ["ws0", "data0", "ws", "data"] {
            std::fs::create_dir(dir(name)).unwrap();
        }
        std::fs::write(dir("ws").join("README"), "project\n").unwrap();
        std::fs::write(dir("data").join("hello"), "hi\n").unwrap();
        for name in ["data0", "data"] {
            std::os::unix::fs::chown(dir(name), Some(1000), Some(1000)).unwrap();
        }
        let shares = |ws: &str, data: &str| bulkhead_client::CreateSandbox {
            workspace: Some(bulkhead_client::WorkspaceSpec {
                path: dir(ws).display().to_string(),
                mode: bulkhead_client::WorkspaceMode::Clone,
            }),
            mounts: vec![bulkhead_client::MountSpec {
                host: dir(data).display().to_string(),
                guest: "/data".into(),
                ro: false,
            }],
            ..small(64)
        };
        let pool = "[pool]\ntemplate = \"base\"\nsize = 1\nshare_owner = [1000, 1000]\n";
        let daemon = real_pool_daemon_from(
            &shares("ws0", "data0"),
            pool,
            &["--mount-root", root.path().to_str().unwrap()],
        );
        let client = daemon.client();
        let rt = rt();
        let filled = wait_until(Duration::from_secs(300), || pool_ready(&daemon, 1));
        assert!(filled, "{}\n{}", daemon.log(), vm_logs(&daemon.vms_dir()));
        let request = bulkhead_client::CreateSandbox {
            template: Some("base".into()),
            ..shares("ws", "data")
        };

        // Act
        let pooled = create(&daemon, &request);
        let seen = sh(
            &daemon,
            &pooled.id,
            "cat /workspace/README /data/hello; echo new > /workspace/b; echo guest > /data/g; \
             ls /workspace",
        );
        let diff = rt.block_on(client.workspace_diff(&pooled.id));
        rt.block_on(client.delete(&pooled.id)).unwrap();

        // Assert
        assert!(
            handed_out(&daemon, &pooled.id),
            "not a hand-out\n{}",
            daemon.log()
        );
        assert_eq!(seen, "project\nhi\nREADME\nb\n");
        let diff = diff.unwrap_or_else(|e| panic!("diff: {e}"));
        let changed: Vec<&str> = diff.changes.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(changed, ["b"]);
        assert!(
            !dir("ws").join("b").exists(),
            "a clone workspace wrote to the host"
        );
        let written = dir("data").join("g");
        assert_eq!(std::fs::read_to_string(&written).unwrap(), "guest\n");
        let owner = std::fs::metadata(&written).unwrap();
        assert_eq!(
            (
                std::os::unix::fs::MetadataExt::uid(&owner),
                std::os::unix::fs::MetadataExt::gid(&owner)
            ),
            (1000, 1000)
        );
    }
);

/// Whether the daemon logged sandbox `id`'s create as a hand-out from its warm pool.
fn handed_out(daemon: &crate::common::TestDaemon, id: &str) -> bool {
    daemon
        .log()
        .lines()
        .any(|l| l.contains(id) && l.contains("(from the pool)"))
}

/// `result` is a 409 `busy` whose message names `what`.
fn assert_busy(result: &Result<bulkhead_client::SandboxInfo, bulkhead_client::Error>, what: &str) {
    match result {
        Err(bulkhead_client::Error::Api {
            status,
            code,
            message,
        }) => {
            assert_eq!((*status, code.as_str()), (409, "busy"), "{message}");
            assert!(message.contains(what), "{message}");
        }
        other => panic!("a pause that should be refused for {what}: {other:?}"),
    }
}

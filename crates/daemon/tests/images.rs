//! Root filesystem images through the daemon, host-level (the fake VMM ignores the disks, but
//! the daemon resolves the image in its store and makes the scratch disk exactly as for a real
//! VM): the disks a sandbox is configured with, and the scratch disk's removal on DELETE, when
//! the VM ends by itself, and at a restart after `kill -9`. `tests/guest.rs` boots the real
//! Debian image.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use bulkhead_client::{CreateSandbox, ExecSpec, SandboxState};
use common::{alive, rt, wait_until, TestDaemon};

/// A daemon (fake VMM) whose image store holds the fake image `debian`; the store's directory
/// lives as long as the returned guard.
fn daemon_with_image(extra: &[&str]) -> (TestDaemon, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    bulkhead_image::testing::store_with(&images, &["debian"]);
    let config = dir.path().join("bulkheadd.toml");
    std::fs::write(&config, format!("images_dir = {:?}\n", images)).unwrap();
    let mut args = vec!["--config", config.to_str().unwrap()];
    args.extend_from_slice(extra);
    (TestDaemon::start_with(&args), dir)
}

fn on_debian(disk_mib: Option<u64>) -> CreateSandbox {
    CreateSandbox {
        memory_mib: 64,
        image: Some("debian".into()),
        disk_mib,
        ..CreateSandbox::default()
    }
}

/// Every file named `name` under `dir`.
fn files_named(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(dir) = stack.pop() {
        for path in common::list(&dir) {
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n == name) {
                found.push(path);
            }
        }
    }
    found
}

#[test]
fn an_image_sandbox_boots_the_store_image_read_only_with_a_scratch_disk_that_delete_removes() {
    // Arrange
    let (daemon, store) = daemon_with_image(&[]);
    let client = daemon.client();
    let rt = rt();

    // Act
    let sb = rt.block_on(client.create(&on_debian(Some(64)))).unwrap();
    let scratch = files_named(&daemon.vms_dir(), "scratch.ext4");
    let vm_json = files_named(&daemon.vms_dir(), "vm.json");
    let vm: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&vm_json[0]).unwrap()).unwrap();
    let scratch_bytes = std::fs::metadata(&scratch[0]).unwrap().len();
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert_eq!(sb.image.as_deref(), Some("debian"));
    assert_eq!(sb.disk_mib, Some(64));
    assert_eq!(scratch.len(), 1, "one scratch disk");
    assert_eq!(scratch_bytes, 64 << 20);
    let disks = vm["disks"].as_array().unwrap();
    let rootfs = store.path().join("images/debian/rootfs.ext4");
    assert_eq!(disks[0]["path"], rootfs.to_str().unwrap());
    assert_eq!(disks[0]["read_only"], true);
    assert_eq!(disks[1]["path"], scratch[0].to_str().unwrap());
    assert_eq!(disks[1]["read_only"], false);
    let cmdline = vm["cmdline"].as_str().unwrap_or_default();
    assert!(
        cmdline.contains("bulkhead.root=/dev/vda") && cmdline.contains("bulkhead.overlay=/dev/vdb"),
        "{cmdline}"
    );
    assert!(files_named(&daemon.vms_dir(), "scratch.ext4").is_empty());
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn without_disk_mib_the_image_sandbox_has_no_scratch_disk() {
    // Arrange
    let (daemon, _store) = daemon_with_image(&[]);
    let client = daemon.client();
    let rt = rt();

    // Act
    let sb = rt.block_on(client.create(&on_debian(None))).unwrap();
    let scratch = files_named(&daemon.vms_dir(), "scratch.ext4");
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert_eq!(sb.disk_mib, None);
    assert!(scratch.is_empty(), "{scratch:?}");
}

#[test]
fn a_vm_that_ends_by_itself_keeps_its_log_but_not_its_scratch_disk() {
    // Arrange: the fake VMM runs commands as its children, so $PPID is the VMM itself.
    let (daemon, _store) = daemon_with_image(&[]);
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&on_debian(Some(32)))).unwrap();

    // Act
    let _ = rt.block_on(client.exec_collect(&sb.id, &ExecSpec::new(["sh", "-c", "kill -9 $PPID"])));
    let failed = wait_until(Duration::from_secs(10), || {
        rt.block_on(client.get(&sb.id)).unwrap().state == SandboxState::Failed
    });
    // The failure is recorded before the scratch disk goes, under the same lifecycle lock.
    let scratch_gone = wait_until(Duration::from_secs(10), || {
        files_named(&daemon.vms_dir(), "scratch.ext4").is_empty()
    });
    let logs = rt.block_on(client.logs(&sb.id, 50)).unwrap();
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert!(failed);
    assert!(scratch_gone, "the dead VM's scratch disk stayed");
    assert!(logs.contains("fake-vmm: booting"), "{logs}");
    assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
}

#[test]
fn after_kill_9_a_restart_with_on_restart_destroy_leaves_no_scratch_disk() {
    // Arrange
    let (mut daemon, _store) = daemon_with_image(&[]);
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&on_debian(Some(16)))).unwrap();
    let before = files_named(&daemon.vms_dir(), "scratch.ext4").len();
    daemon.kill9();

    // Act
    daemon.spawn(&["--on-restart", "destroy"]);
    let after = rt.block_on(client.get(&sb.id));

    // Assert
    assert_eq!(before, 1);
    assert_eq!(after.unwrap_err().status(), Some(404));
    assert!(files_named(&daemon.vms_dir(), "scratch.ext4").is_empty());
    assert_eq!(
        daemon.leftovers(&[sb.vmm_pid.unwrap()]),
        Vec::<String>::new()
    );
}

#[test]
fn a_vm_that_died_while_the_daemon_was_down_is_failed_without_its_scratch_disk() {
    // Arrange
    let (mut daemon, _store) = daemon_with_image(&[]);
    let client = daemon.client();
    let rt = rt();
    let sb = rt.block_on(client.create(&on_debian(Some(16)))).unwrap();
    let vmm = sb.vmm_pid.unwrap();
    daemon.kill9();
    // SAFETY: kill(2) of the VMM, which this test created through the daemon.
    unsafe { libc::kill(vmm as libc::pid_t, libc::SIGKILL) };
    assert!(wait_until(Duration::from_secs(5), || !alive(vmm)));

    // Act: `alive` is false once the VMM's main thread is a zombie, which can be a moment
    // before its other threads are gone and its pidfd says so: the restarted daemon may adopt
    // it and see it end right after, so wait for `failed`.
    daemon.spawn(&[]);
    wait_until(Duration::from_secs(10), || {
        rt.block_on(client.get(&sb.id)).unwrap().state == SandboxState::Failed
    });
    let info = rt.block_on(client.get(&sb.id)).unwrap();
    // Removed at recovery, or (adopted) right after the failure is recorded.
    let scratch_gone = wait_until(Duration::from_secs(10), || {
        files_named(&daemon.vms_dir(), "scratch.ext4").is_empty()
    });
    let logs = files_named(&daemon.vms_dir(), "vmm.log");
    rt.block_on(client.delete(&sb.id)).unwrap();

    // Assert
    assert_eq!(info.state, SandboxState::Failed);
    assert_eq!(info.failure.unwrap().reason, "vanished");
    assert!(scratch_gone, "the dead VM's scratch disk stayed");
    assert_eq!(logs.len(), 1, "the log stays until DELETE");
    assert_eq!(daemon.leftovers(&[vmm]), Vec::<String>::new());
}

#[test]
fn an_unknown_image_is_a_404_and_bad_names_and_misplaced_disks_are_400s_that_name_the_problem() {
    // Arrange
    let (daemon, _store) = daemon_with_image(&[]);
    let client = daemon.client();
    let rt = rt();
    let image = |name: &str| CreateSandbox {
        image: Some(name.to_owned()),
        ..on_debian(None)
    };
    let requests = [
        (image("ubuntu"), 404, "unknown image \"ubuntu\""),
        (image("../images/debian"), 400, "invalid image name"),
        (on_debian(Some(2)), 400, "disk_mib must be between 8"),
        (
            CreateSandbox {
                image: None,
                ..on_debian(Some(64))
            },
            400,
            "disk_mib needs an image",
        ),
    ];

    // Act
    let errors: Vec<bulkhead_client::Error> = requests
        .iter()
        .map(|(spec, ..)| rt.block_on(client.create(spec)).unwrap_err())
        .collect();

    // Assert
    for ((_, status, needle), err) in requests.iter().zip(&errors) {
        assert_eq!(err.status(), Some(*status), "{err}");
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
    assert!(
        errors[0].to_string().contains("has debian"),
        "{}",
        errors[0]
    );
    assert_eq!(daemon.leftovers(&[]), Vec::<String>::new());
}

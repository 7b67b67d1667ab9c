//! Three ways a create fails, three answers a client can act on: a guest agent that never comes
//! up (504 `boot_timeout`), an image the daemon does not have (404 `image_not_found`) and a VMM
//! that dies during the boot (502 `vm_exited`). Nothing of the failed sandboxes is kept.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use bulkhead_client::{Client, CreateSandbox};
use common::{api_error, rt, TestDaemon};

/// An executable stand-in for `bulkhead-vmm` in `dir` running the shell `body` (its arguments,
/// `--config vm.json ...`, are ignored).
fn stand_in_vmm(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A daemon whose VMM is `vmm`, with a 2 s boot timeout.
fn daemon_with(dir: &Path, vmm: &Path) -> TestDaemon {
    let (kernel, image) = (dir.join("vmlinux"), dir.join("initramfs"));
    std::fs::write(&kernel, b"k").unwrap();
    std::fs::write(&image, b"i").unwrap();
    let config = dir.join(format!("{}.toml", vmm.display().to_string().len()));
    std::fs::write(&config, "boot_timeout_s = 2\n").unwrap();
    TestDaemon::start_real(
        vmm,
        &kernel,
        &image,
        &["--config", config.to_str().unwrap()],
    )
}

/// Creates a small sandbox; returns (status, code, message) of the refusal.
fn refusal(client: &Client, request: &CreateSandbox) -> (u16, String, String) {
    api_error(rt().block_on(client.create(request)))
}

#[test]
fn a_boot_timeout_a_missing_image_and_a_vmm_killed_during_the_boot_are_504_404_and_502() {
    // Arrange
    let dir = tempfile::tempdir().unwrap();
    let hangs = stand_in_vmm(dir.path(), "hangs", "exec sleep 600");
    let dies = stand_in_vmm(dir.path(), "dies", "kill -9 $$");
    let slow = daemon_with(dir.path(), &hangs);
    let dying = daemon_with(dir.path(), &dies);
    let fake = TestDaemon::start();
    let small = CreateSandbox {
        memory_mib: 64,
        ..CreateSandbox::default()
    };
    let missing_image = CreateSandbox {
        image: Some("nope".into()),
        ..small.clone()
    };

    // Act
    let timeout = refusal(&slow.client(), &small);
    let missing = refusal(&fake.client(), &missing_image);
    let killed = refusal(&dying.client(), &small);

    // Assert
    assert_eq!(
        (timeout.0, timeout.1.as_str()),
        (504, "boot_timeout"),
        "{}",
        timeout.2
    );
    assert!(
        timeout.2.contains("was not ready within 2s"),
        "{}",
        timeout.2
    );
    assert_eq!(
        (missing.0, missing.1.as_str()),
        (404, "image_not_found"),
        "{}",
        missing.2
    );
    assert!(
        missing.2.contains("unknown image \"nope\""),
        "{}",
        missing.2
    );
    assert_eq!(
        (killed.0, killed.1.as_str()),
        (502, "vm_exited"),
        "{}",
        killed.2
    );
    assert!(killed.2.contains("killed by signal 9"), "{}", killed.2);
    for daemon in [&slow, &dying, &fake] {
        assert!(daemon.records().is_empty(), "a failed create left a record");
    }
}

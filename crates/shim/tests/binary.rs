//! `containerd-shim-bulkhead-v2` run by hand, outside containerd.

use std::process::Command;

#[test]
fn the_shim_run_by_hand_says_containerd_starts_it_and_exits_2() {
    // Arrange: no TTRPC_ADDRESS, as in a shell.
    let mut shim = Command::new(env!("CARGO_BIN_EXE_containerd-shim-bulkhead-v2"));
    shim.args(["-namespace", "default", "-id", "c1", "start"])
        .env_remove("TTRPC_ADDRESS");

    // Act
    let out = shim.output().unwrap();

    // Assert
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("containerd starts this shim"), "{stderr}");
    assert!(!stderr.contains("NotPresent"), "{stderr}");
}

#[test]
fn the_shim_prints_its_version_without_containerd() {
    let out = Command::new(env!("CARGO_BIN_EXE_containerd-shim-bulkhead-v2"))
        .arg("-v")
        .env_remove("TTRPC_ADDRESS")
        .output()
        .unwrap();

    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("containerd-shim-bulkhead-v2 "),
        "{stdout}"
    );
}

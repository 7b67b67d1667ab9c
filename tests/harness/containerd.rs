//! containerd for the shim's end-to-end test in the test host: Debian's `containerd` and `ctr`,
//! and `bash` (which `scripts/containerd-demo.sh` is written in), copied into the shared target
//! directory ([`bin_dir`]), their libraries added to the test host's initramfs.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{artifacts, profile_dir, target_dir, workspace_root};

/// The host binaries the test host gets.
const BINARIES: [&str; 3] = ["/usr/bin/containerd", "/usr/bin/ctr", "/bin/bash"];

/// Where the copies are: on `PATH` for the demo script inside the test host.
pub fn bin_dir() -> PathBuf {
    target_dir().join("bulkhead-tests/containerd-bin")
}

/// Copies [`BINARIES`] into [`bin_dir`]; returns the binaries whose libraries the test host
/// needs, or None when containerd is not installed here (the test that needs it then fails
/// saying how to install it).
pub fn prepare() -> Option<Vec<PathBuf>> {
    if BINARIES.iter().any(|b| !Path::new(b).is_file()) {
        return None;
    }
    let dir = bin_dir();
    std::fs::create_dir_all(&dir).ok()?;
    for binary in BINARIES {
        let name = Path::new(binary).file_name()?;
        let copy = dir.join(name);
        let fresh = std::fs::metadata(&copy)
            .and_then(|c| Ok((c.len(), std::fs::metadata(binary)?.len())))
            .is_ok_and(|(a, b)| a == b);
        if !fresh {
            std::fs::copy(binary, &copy).ok()?;
        }
    }
    Some(BINARIES.iter().map(PathBuf::from).collect())
}

/// `scripts/containerd-demo.sh FLAGS -- CMD` as the test host runs it: containerd, an offline
/// image, and the runtime `io.containerd.bulkhead.v2` with this profile's shim, VMM and CLI
/// ([`profile_dir`]), kernel and agent initramfs ([`artifacts`]).
///
/// # Panics
/// When containerd is not installed on the host (no copies in [`bin_dir`]).
pub fn demo(flags: &[&str], cmd: &[&str]) -> Command {
    let a = artifacts();
    let bin = bin_dir();
    assert!(
        bin.join("containerd").is_file(),
        "containerd is not installed on the host: apt-get install containerd (scripts/setup.sh does)"
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = Command::new(bin.join("bash"));
    command
        .arg(workspace_root().join("scripts/containerd-demo.sh"))
        .arg("--bin")
        .arg(profile_dir())
        .args(flags)
        .arg("--")
        .args(cmd)
        .env("PATH", path)
        .env("BULKHEAD_KERNEL", &a.vmlinux)
        .env("BULKHEAD_INITRD", &a.agent_initrd)
        .env("BULKHEAD_VMM", &a.vmm);
    command
}

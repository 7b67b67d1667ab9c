//! The files guest tests boot: binaries under test, kernels, and initramfs images built once per
//! test process from the static (musl) guest binaries.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::{profile_dir, target_dir, workspace_root, INNER_ENV};

/// Paths of everything a guest test needs.
#[derive(Debug, Clone)]
pub struct Artifacts {
    /// `bulkhead-vmm` of this test's profile.
    pub vmm: PathBuf,
    /// `bulkhead` (the CLI) of this test's profile.
    pub cli: PathBuf,
    /// The default guest kernel as an ELF vmlinux.
    pub vmlinux: PathBuf,
    /// The same kernel as a bzImage.
    pub bzimage: PathBuf,
    /// Initramfs whose /init is `bulkhead-test-init` (reports and ends the VM).
    pub test_initrd: PathBuf,
    /// Initramfs whose /init is the bulkhead agent, with busybox and `bulkhead-test-init` (as a
    /// tool at /usr/bin/bulkhead-test-init).
    pub agent_initrd: PathBuf,
}

/// A stock distribution kernel without built-in virtio-vsock (Debian's, whose vsock and
/// virtio-mmio drivers are modules), copied from the test host's cache: a guest kernel the
/// bulkhead agent cannot work with.
///
/// # Panics
/// When the test host's artifacts cannot be prepared.
pub fn kernel_without_vsock() -> PathBuf {
    let copy = target_dir().join("bulkhead-tests/debian-kernel");
    if env::var_os(INNER_ENV).is_none() && !copy.is_file() {
        let prepared = bulkhead_testhost::prepare(
            &bulkhead_testhost::TestHostConfig::default().prepare_options(),
        )
        .unwrap_or_else(|e| panic!("cannot prepare the test host's Debian kernel: {e}"));
        std::fs::create_dir_all(copy.parent().expect("has a parent")).expect("create dir");
        std::fs::copy(&prepared.kernel, &copy).expect("copy the Debian kernel");
    }
    copy
}

/// The test artifacts, built on first use (outside the test host only; inside, the same paths are
/// already there through the shares).
///
/// # Panics
/// With instructions when the kernel, the binaries under test or the static guest binaries are
/// missing.
pub fn artifacts() -> &'static Artifacts {
    static ARTIFACTS: OnceLock<Artifacts> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let profile = profile_dir();
        let kernel_dir = data_home().join("bulkhead/kernel").join(env::consts::ARCH);
        let musl = target_dir().join("x86_64-unknown-linux-musl/release");
        let initrd_dir = target_dir().join("bulkhead-tests/initrd");
        let a = Artifacts {
            vmm: profile.join("bulkhead-vmm"),
            cli: profile.join("bulkhead"),
            vmlinux: kernel_dir.join("vmlinux"),
            bzimage: kernel_dir.join("bzImage"),
            test_initrd: initrd_dir.join("test-init.cpio.gz"),
            agent_initrd: initrd_dir.join("agent.cpio.gz"),
        };
        require(&a.vmm, "cargo build --workspace --bins");
        require(&a.cli, "cargo build --workspace --bins");
        require(&a.vmlinux, "scripts/setup.sh --no-run");
        require(&a.bzimage, "scripts/setup.sh --no-run");
        if env::var_os(INNER_ENV).is_none() {
            let test_init = musl.join("bulkhead-test-init");
            let agent = musl.join("bulkhead-agent");
            let build = "cargo build --release --target x86_64-unknown-linux-musl -p bulkhead-agent -p bulkhead-test-init";
            require(&test_init, build);
            require(&agent, build);
            build_initramfs(&test_init, &a.test_initrd, &[]);
            let tool = format!("{}:usr/bin/bulkhead-test-init", test_init.display());
            build_initramfs(&agent, &a.agent_initrd, &["--busybox", "--add", &tool]);
            kernel_without_vsock();
        }
        a
    })
}

/// `$XDG_DATA_HOME`, or `~/.local/share`.
pub(crate) fn data_home() -> PathBuf {
    env::var_os("XDG_DATA_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".local/share")
        })
}

fn require(path: &Path, how: &str) {
    assert!(
        path.is_file(),
        "{} is missing; build it first with `{how}` (scripts/test.sh does all of this)",
        path.display()
    );
}

fn build_initramfs(init: &Path, out: &Path, extra: &[&str]) {
    let script = workspace_root().join("scripts/build-initramfs.sh");
    let status = Command::new(&script)
        .arg("--init")
        .arg(init)
        .arg("--out")
        .arg(out)
        .args(extra)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        status.success(),
        "building {} failed: {status}",
        out.display()
    );
}

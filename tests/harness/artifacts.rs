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

/// Name of the Debian image the image tests boot, in its cached store.
pub const TEST_IMAGE_NAME: &str = "debian";

/// Packages of the test image on top of the image builder's defaults (none: the tests check
/// what the default image promises).
const TEST_IMAGE_EXTRA_PACKAGES: [&str; 0] = [];

impl Artifacts {
    /// A `bulkhead` command that boots the test kernel with the agent initramfs on the built
    /// VMM (`BULKHEAD_KERNEL`, `BULKHEAD_INITRD`, `BULKHEAD_VMM` set): the start of every test's
    /// `bulkhead run`, `bench` and `template` command line.
    pub fn cli_command(&self) -> Command {
        let mut command = Command::new(&self.cli);
        command
            .env("BULKHEAD_KERNEL", &self.vmlinux)
            .env("BULKHEAD_INITRD", &self.agent_initrd)
            .env("BULKHEAD_VMM", &self.vmm);
        command
    }

    /// The static guest agent the test images carry (the musl release build).
    pub fn musl_agent(&self) -> PathBuf {
        target_dir().join("x86_64-unknown-linux-musl/release/bulkhead-agent")
    }

    /// Data directory (`BULKHEAD_DATA_DIR`) of the cached test image store: under bulkhead's data
    /// directory (shared into the test host), keyed by the image's inputs — the image builder's
    /// version, the package list and the agent binary's sha256 — so the image is rebuilt only
    /// when one of them changes.
    pub fn test_image_data_dir(&self) -> PathBuf {
        let agent = std::fs::read(self.musl_agent()).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; build it with `cargo build --release --target x86_64-unknown-linux-musl -p bulkhead-agent`",
                self.musl_agent().display()
            )
        });
        let inputs = format!(
            "builder {} suite {} packages {:?}+{:?} agent {}",
            bulkhead_image::manifest::BUILDER_VERSION,
            bulkhead_image::DEFAULT_SUITE,
            bulkhead_image::DEFAULT_PACKAGES,
            TEST_IMAGE_EXTRA_PACKAGES,
            crate::sha256_hex(&agent)
        );
        let key = &crate::sha256_hex(inputs.as_bytes())[..16];
        test_images_root().join(key)
    }

    /// The test image's `rootfs.ext4`, built with `bulkhead image build debian` (root, network,
    /// about a minute with cached packages) when it is not cached yet. Inside the test host only
    /// the path is computed: the image was built outside before the test was delegated.
    ///
    /// # Panics
    /// When the build fails.
    pub fn debian_image(&self) -> PathBuf {
        static BUILT: OnceLock<PathBuf> = OnceLock::new();
        BUILT
            .get_or_init(|| {
                let data_dir = self.test_image_data_dir();
                let rootfs = data_dir
                    .join("images")
                    .join(TEST_IMAGE_NAME)
                    .join("rootfs.ext4");
                if env::var_os(INNER_ENV).is_none() && !rootfs.is_file() {
                    build_test_image(&self.cli, &self.musl_agent(), &data_dir);
                }
                rootfs
            })
            .clone()
    }
}

fn test_images_root() -> PathBuf {
    data_home().join("bulkhead/test-images")
}

fn build_test_image(cli: &Path, agent: &Path, data_dir: &Path) {
    eprintln!(
        "building the test image into {} (cached until its inputs change)",
        data_dir.display()
    );
    let status = Command::new(cli)
        .args([
            "image",
            "build",
            "debian",
            "--name",
            TEST_IMAGE_NAME,
            "--agent",
        ])
        .arg(agent)
        .env("BULKHEAD_DATA_DIR", data_dir)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", cli.display()));
    assert!(status.success(), "building the test image failed: {status}");
    // Older keys' images are never used again.
    if let Ok(entries) = std::fs::read_dir(test_images_root()) {
        for entry in entries.flatten() {
            if entry.path() != data_dir {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

//! A `bulkheadd` booting real VMs (`bulkhead-vmm`, the guest kernel, the agent image), for the
//! VM-level tests and the daemon benchmark. They run where guests can boot: here, or inside the
//! nested test host (see the `bulkhead-tests` harness), which has no cgroup mounts of its own, so
//! the unified hierarchy (cgroup v2) is mounted at `/sys/fs/cgroup` first.

use std::path::{Path, PathBuf};
use std::process::Command;

use bulkhead_client::{CreateSandbox, ExecSpec};
use bulkhead_tests::artifacts;

use super::{rt, TestDaemon};

/// Declares a test whose body boots real guests: through `bulkhead_tests::in_vm_host` (beside
/// other tests in one of the shared test hosts), or with `exclusive fn` through
/// `bulkhead_tests::in_vm_host_alone`, for the tests that need a whole test host (twenty guests
/// at once, a CPU-quota measurement, a guest filling its RAM).
#[macro_export]
macro_rules! vm_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[test]
        fn $name() {
            bulkhead_tests::in_vm_host(bulkhead_tests::test_path!($name), || $body);
        }
    };
    ($(#[$meta:meta])* exclusive fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[test]
        fn $name() {
            bulkhead_tests::in_vm_host_alone(bulkhead_tests::test_path!($name), || $body);
        }
    };
}

/// The egress tests' server (`bulkhead_egress::testing`) on the test host's loopback, served
/// for as long as this value lives; its plain-HTTP `port` answers `GET /` with a greeting.
pub struct HttpServer {
    /// The plain-HTTP port on 127.0.0.1.
    pub port: u16,
    _server: bulkhead_egress::testing::TestServer,
    _runtime: tokio::runtime::Runtime,
}

impl HttpServer {
    /// A network that reaches this server's plain-HTTP port and nothing else.
    pub fn network(&self) -> bulkhead_client::NetworkRequest {
        bulkhead_client::NetworkRequest {
            allow_cidr: vec![format!("127.0.0.1/32:{}", self.port)],
            ..Default::default()
        }
    }
}

/// Starts an [`HttpServer`] (with a test CA of its own for its TLS port).
pub fn http_server() -> HttpServer {
    let runtime = multi_rt();
    let ca = bulkhead_egress::testing::TestCa::new();
    let server = runtime.block_on(bulkhead_egress::testing::TestServer::start(&ca));
    HttpServer {
        port: server.http_port,
        _server: server,
        _runtime: runtime,
    }
}

/// A multi-threaded runtime, for tests that run many client calls at once (or serve a test
/// server beside the daemon).
pub fn multi_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Creates `request` on `daemon`, with the VMs' logs on failure.
pub fn create(daemon: &TestDaemon, request: &CreateSandbox) -> bulkhead_client::SandboxInfo {
    rt().block_on(daemon.client().create(request))
        .unwrap_or_else(|e| panic!("create: {e}\n{}", vm_logs(&daemon.vms_dir())))
}

/// The output of `sh -c script` in sandbox `id`, with the daemon's logs on failure.
pub fn sh(daemon: &TestDaemon, id: &str, script: &str) -> String {
    let out = rt()
        .block_on(
            daemon
                .client()
                .exec_collect(id, &ExecSpec::new(["sh", "-c", script])),
        )
        .unwrap_or_else(|e| panic!("{script}: {e}\n{}", vm_logs(&daemon.vms_dir())));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Mounts cgroup2 at /sys/fs/cgroup unless a hierarchy is there already.
pub fn ensure_cgroup2() {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() || base.join("memory").exists() {
        return;
    }
    let status = Command::new("mount")
        .args(["-t", "cgroup2", "none", "/sys/fs/cgroup"])
        .status()
        .expect("run mount");
    assert!(status.success(), "cannot mount cgroup2");
}

/// A daemon with real VMs, a boot timeout for slow nested guests, and room for many sandboxes.
/// `config` is more TOML for its configuration file.
pub fn real_daemon(config: &str, extra: &[&str]) -> TestDaemon {
    real_daemon_with_file(config, extra).0
}

/// [`real_daemon`], and its configuration file (rewrite it with [`real_config`] and restart the
/// daemon to change the configuration).
pub fn real_daemon_with_file(config: &str, extra: &[&str]) -> (TestDaemon, PathBuf) {
    ensure_cgroup2();
    let a = artifacts();
    let file = tempfile::NamedTempFile::new().expect("config file");
    let (_, path): (_, PathBuf) = file.keep().expect("keep config");
    std::fs::write(&path, real_config(config)).expect("write config");
    let mut args = vec!["--config", path.to_str().expect("UTF-8 temp path")];
    args.extend_from_slice(extra);
    let daemon = TestDaemon::start_real(&a.vmm, &a.vmlinux, &a.agent_initrd, &args);
    (daemon, path)
}

/// A [`real_daemon`] whose image store holds the tests crate's Debian image, and that image's
/// name for `CreateSandbox::image`. `rootfs` is `bulkhead_tests::artifacts().debian_image()`,
/// built outside the test host (inside it only the paths are computed).
pub fn debian_image_daemon(rootfs: &Path) -> (TestDaemon, String) {
    let image_dir = rootfs.parent().expect("<images>/<name>/rootfs.ext4");
    let images = image_dir.parent().expect("<images>");
    let name = image_dir.file_name().and_then(|n| n.to_str());
    let name = name.expect("a UTF-8 image name").to_owned();
    (
        real_daemon(&format!("images_dir = {images:?}\n"), &[]),
        name,
    )
}

/// The configuration of [`real_daemon`]: a boot timeout for slow nested guests, room for many
/// sandboxes, and `config` (top-level keys first, then tables).
pub fn real_config(config: &str) -> String {
    format!("boot_timeout_s = 300\nmax_sandboxes = 64\n{config}")
}

/// A 1-vCPU sandbox with `memory_mib` of guest RAM.
pub fn small(memory_mib: u32) -> CreateSandbox {
    CreateSandbox {
        memory_mib,
        ..CreateSandbox::default()
    }
}

/// The last 40 lines of every VM's `vmm.log` (VMM messages and serial console) under `vms`, for
/// failure messages.
pub fn vm_logs(vms: &Path) -> String {
    let mut out = String::new();
    let mut stack = vec![vms.to_owned()];
    while let Some(dir) = stack.pop() {
        for path in super::list(&dir) {
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n == "vmm.log") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                out.push_str(&format!("--- {}\n{tail}\n", path.display()));
            }
        }
    }
    out
}

/// A real daemon whose state dir has template `base` (a 64 MiB sandbox that wrote `42` to
/// `/tmp/x`, paused and copied there), restarted with a warm pool of `size` clones of it;
/// returns it with its configuration file.
pub fn real_pool_daemon(size: usize) -> (TestDaemon, PathBuf) {
    let (mut daemon, config) = real_daemon_with_file("", &[]);
    let sb = create(&daemon, &small(64));
    let client = daemon.client();
    let rt = super::rt();
    let wrote =
        rt.block_on(client.exec_collect(&sb.id, &ExecSpec::new(["sh", "-c", "echo 42 > /tmp/x"])));
    assert_eq!(
        wrote.map(|o| o.exit.code).ok(),
        Some(Some(0)),
        "{}",
        vm_logs(&daemon.vms_dir())
    );
    pause_into_template(&mut daemon, &sb.id);
    let pool = format!("[pool]\ntemplate = \"base\"\nsize = {size}\n");
    std::fs::write(&config, real_config(&pool)).unwrap();
    daemon.spawn(&[]);
    (daemon, config)
}

/// A real daemon (`extra`: more arguments) whose template `base` is a sandbox made as
/// `request` asks and paused at once (a request with mounts and a workspace gives the template
/// share slots for as many), restarted with `pool` (a `[pool]` table) as its configuration.
pub fn real_pool_daemon_from(request: &CreateSandbox, pool: &str, extra: &[&str]) -> TestDaemon {
    let (mut daemon, config) = real_daemon_with_file("", extra);
    let sb = create(&daemon, request);
    pause_into_template(&mut daemon, &sb.id);
    std::fs::write(&config, real_config(pool)).unwrap();
    daemon.spawn(&[]);
    daemon
}

/// Pauses sandbox `id`, copies its saved VM to the template `base`, deletes it and stops the
/// daemon.
fn pause_into_template(daemon: &mut TestDaemon, id: &str) {
    let client = daemon.client();
    let rt = super::rt();
    rt.block_on(client.pause(id))
        .unwrap_or_else(|e| panic!("pause: {e}\n{}", daemon.log()));
    let template = daemon.state_dir.join("templates/base");
    std::fs::create_dir_all(&template).unwrap();
    for file in super::list(&daemon.state_dir.join("paused").join(id)) {
        std::fs::copy(&file, template.join(file.file_name().unwrap())).unwrap();
    }
    rt.block_on(client.delete(id)).unwrap();
    assert!(daemon.terminate(), "{}", daemon.log());
}

/// Whether the daemon's pool has exactly `ready` clones ready and none being restored.
pub fn pool_ready(daemon: &TestDaemon, ready: usize) -> bool {
    let health = super::rt().block_on(daemon.client().health()).unwrap();
    health
        .pool
        .is_some_and(|p| p.ready == ready && p.restoring == 0)
}

/// Tests the Python SDK's integration suite runs (`sdk/python/tests/integration_real.py`).
pub const PYTHON_SDK_TESTS: usize = 14;

/// Runs the Python SDK's integration suite against `daemon`, whose `mount_roots` include
/// `root` (where the suite makes its workspace); returns its output.
pub fn run_python_sdk_suite(daemon: &TestDaemon, root: &Path) -> std::process::Output {
    let sdk = bulkhead_tests::python::sdk_dir();
    let mut path = std::ffi::OsString::from(sdk.join("src"));
    path.push(":");
    path.push(&sdk);
    bulkhead_tests::python::command()
        .args(["-m", "unittest", "-v", "tests.integration_real"])
        .env("PYTHONPATH", path)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("BULKHEAD_SOCKET", &daemon.socket)
        .env("BULKHEAD_SDK_TEST_ROOT", root)
        .output()
        .expect("run the Python SDK's integration suite")
}

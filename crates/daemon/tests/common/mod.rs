//! A real `bulkheadd` process on a socket in a temporary directory, for the host-level tests.
//! It boots sandboxes with `bulkhead-fake-vmm` (the agent's server in a process that speaks the
//! VMM's hybrid vsock handshake), so everything but KVM is exercised. Readiness is awaited the
//! way systemd does: the daemon's `READY=1` on a `NOTIFY_SOCKET` datagram socket.
#![allow(dead_code)]

pub mod real;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bulkhead_client::{Client, CreateSandbox, SandboxInfo};

/// How long the daemon may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A daemon under test and its directories.
pub struct TestDaemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub cgroup_parent: String,
    /// `--vmm`, `--kernel`, `--image`.
    vm: [PathBuf; 3],
    extra_args: Vec<String>,
    child: Option<Child>,
}

impl TestDaemon {
    /// Starts a daemon with the fake VMM and cgroups (`auto`, under a parent unique to the test).
    pub fn start() -> TestDaemon {
        Self::start_with(&[])
    }

    /// Like [`TestDaemon::start`] with extra flags.
    pub fn start_with(extra: &[&str]) -> TestDaemon {
        let dir = tempfile::Builder::new().prefix("bhd-").tempdir().unwrap();
        fs::write(dir.path().join("vmlinux"), b"fake kernel").unwrap();
        fs::write(dir.path().join("initramfs"), b"fake image").unwrap();
        let vm = [
            PathBuf::from(env!("CARGO_BIN_EXE_bulkhead-fake-vmm")),
            dir.path().join("vmlinux"),
            dir.path().join("initramfs"),
        ];
        Self::start_in(dir, vm, extra)
    }

    /// A daemon booting real VMs: `bulkhead-vmm`, a kernel and an agent image.
    pub fn start_real(vmm: &Path, kernel: &Path, image: &Path, extra: &[&str]) -> TestDaemon {
        let dir = tempfile::Builder::new().prefix("bhd-").tempdir().unwrap();
        let vm = [vmm.to_owned(), kernel.to_owned(), image.to_owned()];
        Self::start_in(dir, vm, extra)
    }

    fn start_in(dir: tempfile::TempDir, vm: [PathBuf; 3], extra: &[&str]) -> TestDaemon {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let mut daemon = TestDaemon {
            vm,
            socket: dir.path().join("bulkheadd.sock"),
            state_dir: dir.path().join("state"),
            cgroup_parent: format!("bulkhead-test-{}-{n}", std::process::id()),
            dir,
            extra_args: extra.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
        };
        daemon.spawn(&[]);
        daemon
    }

    /// Spawns the daemon process and waits for its READY=1.
    pub fn spawn(&mut self, more: &[&str]) {
        let notify_path = self
            .dir
            .path()
            .join(format!("notify-{}", COUNTER.fetch_add(1, Ordering::SeqCst)));
        let notify = UnixDatagram::bind(&notify_path).unwrap();
        notify.set_read_timeout(Some(READY_TIMEOUT)).unwrap();
        let d = self.dir.path();
        let child = Command::new(env!("CARGO_BIN_EXE_bulkheadd"))
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--vmm")
            .arg(&self.vm[0])
            .arg("--kernel")
            .arg(&self.vm[1])
            .arg("--image")
            .arg(&self.vm[2])
            .args(["--cgroups", "auto", "--cgroup-parent", &self.cgroup_parent])
            .args(&self.extra_args)
            .args(more)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("BULKHEAD_LOG", "debug")
            .stdin(Stdio::null())
            .stderr(fs::File::create(d.join("daemon.log")).unwrap())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let mut buf = [0u8; 256];
        // A signal for another thread of the test process can interrupt the wait (seen with four
        // tests at a time): it goes on, within the read timeout.
        let deadline = Instant::now() + READY_TIMEOUT;
        let n = loop {
            match notify.recv(&mut buf) {
                Err(e)
                    if e.kind() == std::io::ErrorKind::Interrupted && Instant::now() < deadline => {
                }
                result => {
                    break result.unwrap_or_else(|e| {
                        panic!("no READY=1 from bulkheadd: {e}\n{}", self.log())
                    })
                }
            }
        };
        assert!(String::from_utf8_lossy(&buf[..n]).contains("READY=1"));
    }

    /// A client of this daemon.
    pub fn client(&self) -> Client {
        Client::new(&self.socket)
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap()
    }

    /// SIGKILL: the daemon dies without any clean-up.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// SIGTERM and wait for the exit; returns whether it exited successfully.
    pub fn terminate(&mut self) -> bool {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        child.wait().unwrap().success()
    }

    /// The VM runtime root (`<socket dir>/vms`).
    pub fn vms_dir(&self) -> PathBuf {
        self.dir.path().join("vms")
    }

    /// Files in the record directory.
    pub fn records(&self) -> Vec<PathBuf> {
        list(&self.state_dir.join("sandboxes"))
    }

    /// Directories of this test's cgroups (the VM cgroups under the test's parent), in every
    /// hierarchy of the host.
    pub fn vm_cgroups(&self) -> Vec<PathBuf> {
        cgroup_roots()
            .iter()
            .flat_map(|root| list(&root.join(&self.cgroup_parent)))
            .filter(|p| p.is_dir())
            .collect()
    }

    /// The processes in this test's VM cgroups (VMMs, with the jail their supervisors).
    pub fn vm_cgroup_pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .vm_cgroups()
            .iter()
            .filter_map(|dir| fs::read_to_string(dir.join("cgroup.procs")).ok())
            .flat_map(|text| {
                text.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Every leftover a sandbox could leave: VMM processes, runtime files, records, cgroups.
    pub fn leftovers(&self, vmm_pids: &[u32]) -> Vec<String> {
        let mut left = Vec::new();
        for pid in vmm_pids {
            if alive(*pid) {
                left.push(format!("VMM process {pid}"));
            }
        }
        left.extend(
            list(&self.vms_dir())
                .iter()
                .map(|p| format!("runtime {}", p.display())),
        );
        left.extend(
            self.records()
                .iter()
                .map(|p| format!("record {}", p.display())),
        );
        left.extend(
            list(&self.state_dir.join("paused"))
                .iter()
                .map(|p| format!("saved VM {}", p.display())),
        );
        left.extend(
            self.vm_cgroups()
                .iter()
                .map(|p| format!("cgroup {}", p.display())),
        );
        left
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            let _ = child.wait();
        }
        for root in cgroup_roots() {
            let _ = fs::remove_dir(root.join(&self.cgroup_parent));
        }
    }
}

/// Where cgroup hierarchies are mounted: `/sys/fs/cgroup` (v2) or its per-controller v1 mounts.
pub fn cgroup_roots() -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return vec![base.to_owned()];
    }
    ["memory", "cpu", "cpuacct", "pids"]
        .iter()
        .map(|c| base.join(c))
        .filter(|p| p.exists())
        .collect()
}

/// A cgroup file of the sandbox `info` for `controller` (v1) or the unified hierarchy (v2).
pub fn cgroup_file(info: &SandboxInfo, controller: &str, file: &str) -> PathBuf {
    let path = info
        .limits
        .cgroup
        .as_deref()
        .expect("the sandbox has a cgroup (run as root)");
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return base.join(path).join(file);
    }
    base.join(controller).join(path).join(file)
}

pub fn list(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// True while process `pid` exists and is not a zombie (an orphaned VMM that was killed stays a
/// zombie until init reaps it).
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some(Some('Z' | 'X')))
}

/// Waits (polling every 20 ms) until `done` holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `target/<profile>/bulkhead`, the CLI built alongside these tests (`scripts/test.sh` runs
/// `cargo build --workspace --bins` first).
pub fn cli() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let cli = dir.join("bulkhead");
    assert!(
        cli.is_file(),
        "{} is missing: run `cargo build --workspace --bins` first",
        cli.display()
    );
    cli
}

/// A current-thread tokio runtime for the async client.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The status, code and message of the API error that `result` should be (panics otherwise).
pub fn api_error<T: std::fmt::Debug>(
    result: Result<T, bulkhead_client::Error>,
) -> (u16, String, String) {
    match result {
        Err(bulkhead_client::Error::Api {
            status,
            code,
            message,
        }) => (status, code, message),
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// A create request with `labels`.
pub fn spec_with_labels(labels: &[(&str, &str)]) -> CreateSandbox {
    CreateSandbox {
        memory_mib: 64,
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
        ..CreateSandbox::default()
    }
}

/// Live processes with argument `arg`.
pub fn processes_with_arg(arg: &str) -> Vec<u32> {
    list(Path::new("/proc"))
        .iter()
        .filter_map(|p| p.file_name()?.to_str()?.parse::<u32>().ok())
        .filter(|pid| alive(*pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == arg.as_bytes()))
                .unwrap_or(false)
        })
        .collect()
}

//! Starting QEMU for the test host, and making sure it never outlives us.
//!
//! QEMU is spawned from a dedicated thread that lives exactly as long as QEMU: the child sets
//! `PR_SET_PDEATHSIG(SIGKILL)` before exec, and Linux delivers that signal when the *thread* that forked it
//! exits (prctl(2)), so a short-lived spawning thread would kill QEMU early. If our process dies in any way
//! (panic, abort, SIGKILL), that thread dies and QEMU gets SIGKILL. [`QemuProcess::kill`] and `Drop` kill it
//! explicitly too.
//!
//! The thread waits with `waitid(WNOWAIT)` before reaping, and marks the process exited under a lock first,
//! so a `kill` never hits a recycled pid.

use std::ffi::OsString;
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::protocol::{Share, CONTROL_PORT};

/// The QEMU binary.
pub const QEMU: &str = "qemu-system-x86_64";

/// Errors from starting QEMU.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    /// QEMU is not installed.
    #[error("{QEMU} not found in PATH: install the qemu-system-x86 package (apt-get install qemu-system-x86)")]
    NotFound,
    /// Spawning QEMU or its thread failed.
    #[error("starting {QEMU}: {0}")]
    Spawn(std::io::Error),
    /// The log file for QEMU's stdout/stderr could not be created.
    #[error("creating QEMU log {path}: {source}")]
    Log {
        /// The log file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// How TCG maps vCPUs to host threads (QEMU `-accel tcg,thread=...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TcgThreads {
    /// One host thread runs all vCPUs round-robin. No host parallelism, and nested guests under
    /// stress stall or crash far more often (see "Flakiness" in the crate docs).
    Single,
    /// One host thread per vCPU (MTTCG): vCPUs run in parallel. The default.
    #[default]
    Multi,
}

/// The emulated CPU model of the test host by default: QEMU's `max`, every feature TCG emulates,
/// AMD SVM included (what makes `/dev/kvm` work inside).
pub const DEFAULT_CPU_MODEL: &str = "max";

/// Everything the QEMU command line is built from.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// QEMU `-cpu` value: a model and optional `+feature`/`-feature` flags, e.g. `max,-vgif`.
    pub cpu_model: String,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// Number of vCPUs.
    pub cpus: u8,
    /// TCG threading.
    pub tcg_threads: TcgThreads,
    /// Kernel image (`vmlinux` with a PVH note, or a bzImage).
    pub kernel: PathBuf,
    /// gzip cpio initramfs.
    pub initrd: PathBuf,
    /// Kernel command line.
    pub cmdline: String,
    /// File that receives the serial port (ttyS0, the console).
    pub console_log: PathBuf,
    /// Unix socket (listening, ours) that the control virtio-serial port connects to.
    pub control_socket: PathBuf,
    /// 9p shares: the scratch share and the caller's directories.
    pub shares: Vec<Share>,
}

/// Escapes a value for QEMU's `-opt key=value,...` syntax, where a literal comma is written `,,`.
pub fn qemu_opt_escape(value: &str) -> String {
    value.replace(',', ",,")
}

impl QemuConfig {
    /// Builds QEMU's arguments (without the program name).
    pub fn args(&self) -> Vec<OsString> {
        let mut a: Vec<String> = vec![
            "-accel".into(),
            match self.tcg_threads {
                TcgThreads::Single => "tcg,thread=single".into(),
                TcgThreads::Multi => "tcg,thread=multi".into(),
            },
            "-cpu".into(),
            self.cpu_model.clone(),
            "-smp".into(),
            self.cpus.to_string(),
            "-m".into(),
            self.memory_mib.to_string(),
            "-nographic".into(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-monitor".into(),
            "none".into(),
            "-no-reboot".into(),
            "-chardev".into(),
            format!(
                "file,id=con,path={}",
                qemu_opt_escape(&self.console_log.to_string_lossy())
            ),
            "-serial".into(),
            "chardev:con".into(),
            "-chardev".into(),
            format!(
                "socket,id=ctl,path={}",
                qemu_opt_escape(&self.control_socket.to_string_lossy())
            ),
            "-device".into(),
            "virtio-serial-pci,id=vser0".into(),
            "-device".into(),
            format!("virtserialport,bus=vser0.0,chardev=ctl,name={CONTROL_PORT}"),
        ];
        for (i, s) in self.shares.iter().enumerate() {
            a.push("-fsdev".into());
            a.push(format!(
                "local,id=fs{i},path={},security_model=none",
                qemu_opt_escape(&s.path.to_string_lossy())
            ));
            a.push("-device".into());
            a.push(format!(
                "virtio-9p-pci,fsdev=fs{i},mount_tag={}",
                qemu_opt_escape(&s.tag)
            ));
        }
        let mut args: Vec<OsString> = a.into_iter().map(OsString::from).collect();
        args.extend([
            "-kernel".into(),
            self.kernel.clone().into_os_string(),
            "-initrd".into(),
            self.initrd.clone().into_os_string(),
            "-append".into(),
            self.cmdline.clone().into(),
        ]);
        args
    }
}

/// Returns the path of `program` in `PATH`, if any.
pub fn find_in_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// What the waiter thread knows about QEMU.
#[derive(Debug, Default)]
struct State {
    /// Exit status (or 128+signal) once QEMU has exited; its pid is not reaped before this is set.
    exited: Option<i32>,
}

/// A running QEMU, killed when dropped.
#[derive(Debug)]
pub struct QemuProcess {
    pid: libc::pid_t,
    state: Arc<(Mutex<State>, Condvar)>,
    waiter: Option<JoinHandle<()>>,
}

impl QemuProcess {
    /// Spawns QEMU with `config`; its stdout and stderr go to `log`.
    pub fn spawn(config: &QemuConfig, log: &Path) -> Result<QemuProcess, QemuError> {
        let program = find_in_path(QEMU).ok_or(QemuError::NotFound)?;
        let out = File::create(log).map_err(|source| QemuError::Log {
            path: log.to_path_buf(),
            source,
        })?;
        let err = out.try_clone().map_err(QemuError::Spawn)?;
        let mut cmd = Command::new(program);
        cmd.args(config.args())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let state = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let (tx, rx) = mpsc::channel();
        let thread_state = Arc::clone(&state);
        let waiter = std::thread::Builder::new()
            .name("bulkhead-qemu".into())
            .spawn(move || spawn_and_wait(cmd, &tx, &thread_state))
            .map_err(QemuError::Spawn)?;
        let pid = rx
            .recv()
            .map_err(|_| QemuError::Spawn(std::io::Error::other("QEMU thread ended early")))?
            .map_err(QemuError::Spawn)?;
        Ok(QemuProcess {
            pid,
            state,
            waiter: Some(waiter),
        })
    }

    /// QEMU's process id.
    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// QEMU's exit status (128+signal if killed), or `None` while it runs.
    pub fn exit_status(&self) -> Option<i32> {
        self.lock().exited
    }

    /// Waits up to `timeout` for QEMU to exit; returns its status if it did.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        while state.exited.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            state = match self.state.1.wait_timeout(state, left) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        state.exited
    }

    /// Sends SIGKILL to QEMU unless it has already exited, and waits for it to be reaped.
    pub fn kill(&mut self) {
        {
            let state = self.lock();
            if state.exited.is_none() {
                // SAFETY: plain syscall. The pid is still ours: the waiter thread sets `exited` under this
                // lock before it reaps the child, so the pid cannot have been recycled.
                unsafe { libc::kill(self.pid, libc::SIGKILL) };
            }
        }
        if let Some(waiter) = self.waiter.take() {
            let _ = waiter.join();
        }
    }
}

impl Drop for QemuProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Body of the dedicated QEMU thread: spawn with a parent-death signal, report the pid, wait, reap.
fn spawn_and_wait(
    mut cmd: Command,
    tx: &mpsc::Sender<std::io::Result<libc::pid_t>>,
    state: &(Mutex<State>, Condvar),
) {
    // SAFETY: getpid is async-signal-safe and has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe calls
    // (prctl, getppid) without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl; then no signal would ever come.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    let pid = child.id() as libc::pid_t;
    let _ = tx.send(Ok(pid));
    let status = wait_no_reap(pid);
    {
        let mut s = state.0.lock().unwrap_or_else(|p| p.into_inner());
        s.exited = Some(status);
        let _ = child.wait();
    }
    state.1.notify_all();
}

/// Blocks until `pid` exits, without reaping it; returns its exit status or 128+signal.
fn wait_no_reap(pid: libc::pid_t) -> i32 {
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value for waitid to overwrite.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid, writable siginfo_t; `pid` is our unreaped child.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            // SAFETY: waitid succeeded with WEXITED, so the SIGCHLD fields of `info` are filled in.
            let (code, status) = unsafe { (info.si_code, info.si_status()) };
            return if code == libc::CLD_EXITED {
                status
            } else {
                128 + status
            };
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return -1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> QemuConfig {
        QemuConfig {
            cpu_model: DEFAULT_CPU_MODEL.into(),
            memory_mib: 2048,
            cpus: 2,
            tcg_threads: TcgThreads::Multi,
            kernel: "/c/vmlinux".into(),
            initrd: "/c/i.cpio.gz".into(),
            cmdline: "console=ttyS0 quiet panic=-1".into(),
            console_log: "/r/console.log".into(),
            control_socket: "/r/ctl.sock".into(),
            shares: vec![Share {
                tag: "bh0".into(),
                path: "/work/a,b".into(),
            }],
        }
    }

    fn joined(c: &QemuConfig) -> String {
        c.args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn command_line_has_tcg_svm_memory_and_cpus() {
        // Act
        let line = joined(&config());

        // Assert
        assert!(line.starts_with("-accel tcg,thread=multi -cpu max -smp 2 -m 2048 "));
        assert!(line.ends_with("-append console=ttyS0 quiet panic=-1"));
        assert!(line.contains("-no-reboot"));
    }

    #[test]
    fn cpu_model_and_its_feature_flags_reach_the_command_line() {
        // Arrange
        let mut c = config();
        c.cpu_model = "EPYC-Rome,-vgif".into();

        // Act
        let line = joined(&c);

        // Assert
        assert!(line.starts_with("-accel tcg,thread=multi -cpu EPYC-Rome,-vgif -smp 2 "));
    }

    #[test]
    fn console_is_the_serial_port_and_control_a_virtio_serial_port() {
        // Act
        let line = joined(&config());

        // Assert
        assert!(line.contains("-chardev file,id=con,path=/r/console.log -serial chardev:con"));
        assert!(line.contains("-chardev socket,id=ctl,path=/r/ctl.sock"));
        assert!(line.contains("virtserialport,bus=vser0.0,chardev=ctl,name=bulkhead.ctl"));
        assert_eq!(line.matches(" -serial ").count(), 1);
    }

    #[test]
    fn share_path_commas_are_escaped() {
        // Act
        let line = joined(&config());

        // Assert
        assert!(line.contains("local,id=fs0,path=/work/a,,b,security_model=none"));
        assert!(line.contains("virtio-9p-pci,fsdev=fs0,mount_tag=bh0"));
    }

    #[test]
    fn killed_child_is_reported_with_its_signal() {
        // Arrange
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let state = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let (tx, rx) = mpsc::channel();
        let s2 = Arc::clone(&state);
        let waiter = std::thread::spawn(move || spawn_and_wait(cmd, &tx, &s2));
        let pid = rx.recv().unwrap().unwrap();
        let mut process = QemuProcess {
            pid,
            state,
            waiter: Some(waiter),
        };

        // Act
        process.kill();

        // Assert
        assert_eq!(process.exit_status(), Some(128 + libc::SIGKILL));
    }
}

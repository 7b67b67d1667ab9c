//! [`TestHost`]: one booted QEMU test host that runs many commands.

use std::fs;
use std::io::{self, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::artifacts::{self, PrepareError, PrepareOptions, Prepared};
use crate::channel::{ChannelError, ControlChannel, Tailer};
use crate::protocol::{self, GuestMsg, HostMsg, Share, ShareCache, SCRATCH_TAG};
use crate::qemu::{
    find_in_path, QemuConfig, QemuError, QemuProcess, TcgThreads, DEFAULT_CPU_MODEL, QEMU,
};
use crate::rundir::{
    console_tail, create_run_dir, make_dir, remove_stale_run_dirs, validate_shares, write_file,
    SetupError,
};

/// Errors from starting, using or stopping a test host.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Fetching or building the kernel or initramfs failed.
    #[error("preparing the test host: {0}")]
    Prepare(#[from] PrepareError),
    /// A share or the per-host run directory could not be set up.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// QEMU could not be started.
    #[error(transparent)]
    Qemu(#[from] QemuError),
    /// The test host did not report ready in time.
    #[error("test host not ready after {timeout:?}\n{console}")]
    BootTimeout {
        /// The boot timeout.
        timeout: Duration,
        /// The end of the console log and QEMU's own output.
        console: String,
    },
    /// The test host's init reported a start-up failure (e.g. kvm-amd would not load, so no /dev/kvm).
    #[error("test host failed to start: {reason}\n{console}")]
    BootFailed {
        /// What init reported.
        reason: String,
        /// The end of the console log and QEMU's own output.
        console: String,
    },
    /// QEMU exited unexpectedly.
    #[error("QEMU exited with status {status}\n{console}")]
    QemuExited {
        /// QEMU's exit status (128+signal if killed).
        status: i32,
        /// The end of the console log and QEMU's own output.
        console: String,
    },
    /// The control channel failed.
    #[error("{source}\n{console}")]
    Channel {
        /// The channel error.
        source: ChannelError,
        /// The end of the console log and QEMU's own output.
        console: String,
    },
    /// Writing a command's script or reading its output in the scratch share failed.
    #[error("command files in the scratch share: {0}")]
    Scratch(io::Error),
    /// The command ran longer than its timeout and was killed (with its whole process group).
    #[error("command timed out after {timeout:?}")]
    CommandTimedOut {
        /// The timeout.
        timeout: Duration,
        /// What it had printed (empty for [`TestHost::run_streaming`], which already passed it on).
        output: CommandOutput,
    },
    /// The test host did not answer within the command's timeout plus a grace period, or its
    /// heartbeat stopped for [`SILENCE_LIMIT`] while a command ran (frozen); it was killed.
    #[error("test host unresponsive after {waited:?}; killed\n{console}")]
    Unresponsive {
        /// How long we waited.
        waited: Duration,
        /// The end of the console log and QEMU's own output.
        console: String,
    },
    /// An earlier failure left the test host unusable.
    #[error("test host unusable after an earlier failure")]
    Broken,
    /// The test host did not power off after `exit`; it was killed.
    #[error("test host did not power off within {0:?}; killed")]
    ShutdownTimedOut(Duration),
}

/// Settings of a test host.
#[derive(Debug, Clone)]
pub struct TestHostConfig {
    /// Guest RAM of the test host in MiB. Default 2048.
    pub memory_mib: u32,
    /// vCPUs of the test host. Default 2.
    pub cpus: u8,
    /// Host directories mounted inside at the same absolute path (relative paths are made absolute).
    pub shares: Vec<PathBuf>,
    /// Binaries whose shared libraries (per `ldd`) must be available inside.
    pub extra_libs_for: Vec<PathBuf>,
    /// 9p cache mode of the shares. Default [`ShareCache::Loose`].
    pub share_cache: ShareCache,
    /// How long one boot attempt may take until init reports ready (measured: 6-19 s). Default 90 s.
    pub boot_timeout: Duration,
    /// Boot attempts before [`TestHost::start`] gives up. Default 2.
    pub boot_attempts: u32,
    /// How QEMU runs the vCPUs. Default [`TcgThreads::Multi`].
    pub tcg_threads: TcgThreads,
    /// QEMU `-cpu` value. Default [`DEFAULT_CPU_MODEL`] (`max`).
    pub cpu_model: String,
    /// Artifact cache root; `None` means `${XDG_CACHE_HOME:-~/.cache}/bulkhead/testhost`.
    pub cache_dir: Option<PathBuf>,
    /// Kernel package to use; `None` asks apt what `linux-image-amd64` depends on.
    pub kernel_package: Option<String>,
    /// Extra kernel command line arguments, appended (e.g. `loglevel=7` to see the boot on the console).
    /// `MODULE.PARAM=VALUE` entries are also passed to that module when init loads it, as `modprobe`
    /// does (e.g. `kvm_amd.vgif=0`).
    pub kernel_args: Vec<String>,
    /// Whether the test host's kernel randomizes the address space of its processes (ASLR).
    /// Default `false`: the kernel boots with `norandmaps`. QEMU's TCG finds a translated block by
    /// the guest's virtual *and* physical PC, so a process whose code is mapped at a new random
    /// address has all of it translated again at every exec. Measured in this test host:
    /// `bulkhead-vmm --version` 50 ms with ASLR, 11 ms without; a template restore to first output
    /// 326 ms with, 169 ms without (8 alternating rounds each). Bare-metal hosts have no such cost,
    /// so without ASLR the test host's process start-up is closer to theirs. The nested guests'
    /// kernels and processes keep their own randomization.
    pub host_aslr: bool,
}

impl Default for TestHostConfig {
    fn default() -> Self {
        TestHostConfig {
            memory_mib: 2048,
            cpus: 2,
            shares: Vec::new(),
            extra_libs_for: Vec::new(),
            share_cache: ShareCache::default(),
            boot_timeout: Duration::from_secs(90),
            boot_attempts: 2,
            tcg_threads: TcgThreads::default(),
            cpu_model: DEFAULT_CPU_MODEL.into(),
            cache_dir: None,
            kernel_package: None,
            kernel_args: Vec::new(),
            host_aslr: false,
        }
    }
}

impl TestHostConfig {
    /// The options [`artifacts::prepare`] needs.
    pub fn prepare_options(&self) -> PrepareOptions {
        PrepareOptions {
            cache_dir: self.cache_dir.clone(),
            kernel_package: self.kernel_package.clone(),
            extra_libs_for: self.extra_libs_for.clone(),
        }
    }
}

/// What a command printed and how it ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOutput {
    /// Its stdout, byte for byte.
    pub stdout: Vec<u8>,
    /// Its stderr, byte for byte.
    pub stderr: Vec<u8>,
    /// Shell exit status: the script's exit code, or 128+N if killed by signal N.
    pub status: i32,
}

/// Kernel command line of the test host. `mitigations=off` cut boot-to-ready from ~9.0 s to ~6.5 s under TCG
/// (speculation mitigations are pure overhead in an emulated, single-tenant test host); `tsc=reliable`
/// skips the clocksource watchdog, which TCG's timing trips; `softlockup_panic=1` turns a livelocked
/// kernel (seen with multi-threaded TCG, see the crate docs) into a panic, so QEMU exits (`panic=-1` with
/// `-no-reboot`) and the failure is reported instead of a silent hang; `watchdog_thresh=60` (the maximum)
/// makes that a CPU stuck for 120 s, because a loaded 2-core machine starves TCG's vCPU threads for tens
/// of seconds and a 20 s threshold panicked healthy test hosts mid-test.
const CMDLINE: &str =
    "console=ttyS0 quiet panic=-1 mitigations=off tsc=reliable softlockup_panic=1 watchdog_thresh=60";

/// The kernel command line: [`CMDLINE`], `norandmaps` unless `aslr` (see
/// [`TestHostConfig::host_aslr`]), and then `extra`.
fn cmdline(extra: &[String], aslr: bool) -> String {
    let norandmaps = (!aslr).then_some("norandmaps");
    std::iter::once(CMDLINE)
        .chain(norandmaps)
        .chain(extra.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Extra time the host waits beyond a command's timeout before it declares the test host dead.
const GRACE: Duration = Duration::from_secs(60);

/// Longest silence on the control channel while a command runs before the host declares the test
/// host frozen (its heartbeat comes every [`protocol::HEARTBEAT_SECS`] s; a frozen emulator sends
/// none). Six missed beats: in a whole guest-test run (2026-12-05, 134 guest boots, with builds
/// beside it on the same two cores) the longest gap between beats of a live test host was
/// 10.5 s ([`TestHost::longest_silence`], printed in `scripts/test.sh`'s summary); each freeze
/// costs this long before the retry.
const SILENCE_LIMIT: Duration = Duration::from_secs(60);

/// Timeouts at least this long are treated as "no timeout" inside the test host.
const NO_TIMEOUT: Duration = Duration::from_secs(30 * 24 * 3600);

/// How often streaming output is polled while a command runs.
const POLL: Duration = Duration::from_millis(50);

/// The mutable part of a test host, behind one lock so that commands are serialized.
#[derive(Debug)]
struct Inner {
    qemu: QemuProcess,
    channel: ControlChannel,
    next_id: u64,
    broken: bool,
}

/// A booted test host: QEMU (TCG, `-cpu max`) running Debian's kernel with kvm-amd, so `/dev/kvm` works
/// inside. Commands run one at a time; the host is `Send + Sync` and can live in a `static`.
///
/// QEMU is killed when the `TestHost` is dropped, and also if this process dies (see [`crate::qemu`]).
#[derive(Debug)]
pub struct TestHost {
    inner: Mutex<Inner>,
    qemu_pid: i32,
    boot_time: Duration,
    failed_boots: Vec<String>,
    prepared: Prepared,
    run_dir: tempfile::TempDir,
    /// Longest wait for a heartbeat (or a command's end) seen so far, ms.
    longest_silence_ms: AtomicU64,
}

// Compile-time check: a TestHost can be shared between threads and live in a `static`.
const _: () = {
    fn send_sync<T: Send + Sync>() {}
    #[allow(dead_code)]
    fn check() {
        send_sync::<TestHost>();
    }
};

impl TestHost {
    /// Prepares the artifacts (cached), boots the test host and waits until init reports ready: modules
    /// loaded, `/dev/kvm` present, shares mounted.
    ///
    /// A boot that times out or ends with QEMU exiting (e.g. the kernel's soft-lockup detector panicking,
    /// `softlockup_panic=1`) is retried until [`TestHostConfig::boot_attempts`] is used up; the errors of the
    /// failed attempts are kept in [`TestHost::failed_boots`].
    pub fn start(cfg: TestHostConfig) -> Result<TestHost, Error> {
        let started = Instant::now();
        find_in_path(QEMU).ok_or(QemuError::NotFound)?;
        let prepared = artifacts::prepare(&cfg.prepare_options())?;
        let shares = validate_shares(&cfg.shares)?;
        remove_stale_run_dirs();
        let mut failed_boots = Vec::new();
        loop {
            match boot_once(&cfg, &prepared, &shares) {
                Ok((inner, run_dir)) => {
                    return Ok(TestHost {
                        qemu_pid: inner.qemu.pid(),
                        inner: Mutex::new(inner),
                        boot_time: started.elapsed(),
                        failed_boots,
                        prepared,
                        run_dir,
                        longest_silence_ms: AtomicU64::new(0),
                    })
                }
                Err(e @ (Error::BootTimeout { .. } | Error::QemuExited { .. }))
                    if failed_boots.len() + 1 < cfg.boot_attempts.max(1) as usize =>
                {
                    failed_boots.push(e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Errors of boot attempts that failed before the one that succeeded (normally empty).
    pub fn failed_boots(&self) -> &[String] {
        &self.failed_boots
    }
}

/// One boot attempt: a fresh run directory, QEMU, and the wait for `ready`.
fn boot_once(
    cfg: &TestHostConfig,
    prepared: &Prepared,
    shares: &[Share],
) -> Result<(Inner, tempfile::TempDir), Error> {
    let run_dir = create_run_dir()?;
    let scratch = run_dir.path().join("scratch");
    let mounts = protocol::mounts_script(shares, cfg.share_cache);
    write_file(&scratch.join("mounts.sh"), mounts.as_bytes())?;
    make_dir(&scratch.join("cmd"))?;
    let socket = run_dir.path().join("ctl.sock");
    let listener = UnixListener::bind(&socket).map_err(|source| SetupError::Io {
        path: socket.clone(),
        source,
    })?;
    let mut all_shares = vec![Share {
        tag: SCRATCH_TAG.into(),
        path: scratch,
    }];
    all_shares.extend_from_slice(shares);
    let config = QemuConfig {
        cpu_model: cfg.cpu_model.clone(),
        memory_mib: cfg.memory_mib,
        cpus: cfg.cpus,
        tcg_threads: cfg.tcg_threads,
        kernel: prepared.kernel.clone(),
        initrd: prepared.initramfs.clone(),
        cmdline: cmdline(&cfg.kernel_args, cfg.host_aslr),
        console_log: run_dir.path().join("console.log"),
        control_socket: socket,
        shares: all_shares,
    };
    let qemu = QemuProcess::spawn(&config, &run_dir.path().join("qemu.log"))?;
    let deadline = Instant::now() + cfg.boot_timeout;
    let channel = connect(&listener, &qemu, run_dir.path(), deadline, cfg.boot_timeout)?;
    let mut inner = Inner {
        qemu,
        channel,
        next_id: 0,
        broken: false,
    };
    wait_ready(&mut inner, run_dir.path(), deadline, cfg.boot_timeout)?;
    Ok((inner, run_dir))
}

impl TestHost {
    /// Runs `script` with `sh` inside the test host and returns its output and exit status.
    ///
    /// The script runs as root in `/`, with stdin from `/dev/null`, in its own session and process group;
    /// after `timeout` that whole group is killed and [`Error::CommandTimedOut`] returned (with the output so
    /// far). Put environment variables in the script (`export K=V`). Timeouts of 30 days or more mean none.
    pub fn run(&self, script: &str, timeout: Duration) -> Result<CommandOutput, Error> {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        let (status, timed_out) = self.execute(script, timeout, None, &mut stdout, &mut stderr)?;
        let output = CommandOutput {
            stdout,
            stderr,
            status,
        };
        if timed_out {
            return Err(Error::CommandTimedOut { timeout, output });
        }
        Ok(output)
    }

    /// Like [`TestHost::run`], but passes output to `stdout` and `stderr` while the command runs (polled
    /// every 50 ms) and returns only the exit status.
    pub fn run_streaming(
        &self,
        script: &str,
        timeout: Duration,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<i32, Error> {
        let (status, timed_out) = self.execute(script, timeout, Some(POLL), stdout, stderr)?;
        if timed_out {
            return Err(Error::CommandTimedOut {
                timeout,
                output: CommandOutput {
                    status,
                    ..CommandOutput::default()
                },
            });
        }
        Ok(status)
    }

    /// Powers the test host off (syncing its filesystems) and waits for QEMU to exit.
    pub fn shutdown(self) -> Result<(), Error> {
        let limit = Duration::from_secs(20);
        let mut inner = self.lock();
        if inner.qemu.exit_status().is_some() {
            return Ok(());
        }
        let sent = inner.channel.send(HostMsg::Exit);
        if sent.is_ok() && inner.qemu.wait_timeout(limit).is_some() {
            return Ok(());
        }
        inner.qemu.kill();
        Err(Error::ShutdownTimedOut(limit))
    }

    /// Time from [`TestHost::start`] until init reported ready (includes preparing the artifacts).
    pub fn boot_time(&self) -> Duration {
        self.boot_time
    }

    /// The longest time this test host has gone without a heartbeat while a command ran (from the
    /// command's start or the last heartbeat to the next heartbeat or the command's end). A healthy
    /// test host stays near [`protocol::HEARTBEAT_SECS`]; this is the evidence for
    /// [`SILENCE_LIMIT`], the silence after which it is declared frozen.
    pub fn longest_silence(&self) -> Duration {
        Duration::from_millis(self.longest_silence_ms.load(Ordering::Relaxed))
    }

    /// QEMU's process id.
    pub fn qemu_pid(&self) -> i32 {
        self.qemu_pid
    }

    /// The artifacts this host booted from.
    pub fn prepared(&self) -> &Prepared {
        &self.prepared
    }

    /// The run directory: `console.log` (ttyS0), `qemu.log`, `ctl.sock`, `scratch/` (removed on drop).
    pub fn run_dir(&self) -> &Path {
        self.run_dir.path()
    }

    /// The last `lines` lines of the console log and QEMU's own output.
    pub fn console_tail(&self, lines: usize) -> String {
        console_tail(self.run_dir.path(), lines)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one command; returns `(status, timed_out)`. `poll` enables streaming at that interval.
    fn execute(
        &self,
        script: &str,
        timeout: Duration,
        poll: Option<Duration>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<(i32, bool), Error> {
        let mut inner = self.lock();
        if inner.broken {
            return Err(Error::Broken);
        }
        inner.next_id += 1;
        let id = inner.next_id;
        let dir = self.run_dir.path().join("scratch/cmd").join(id.to_string());
        make_dir(&dir)?;
        write_file(&dir.join("script.sh"), script.as_bytes())?;
        let limit = (timeout < NO_TIMEOUT).then_some(timeout);
        let mut outputs = Outputs {
            tails: [
                Tailer::new(&dir.join("stdout")),
                Tailer::new(&dir.join("stderr")),
            ],
            sinks: [stdout, stderr],
        };
        let result = self.await_done(&mut inner, id, limit, poll, &mut outputs);
        if result.is_err() {
            // The command may still be running and its `done` line would confuse the next command: the
            // test host cannot be trusted any more.
            inner.broken = true;
            inner.qemu.kill();
        }
        let status = result?;
        outputs.pump()?;
        let timed_out = dir.join("timed-out").exists();
        let _ = fs::remove_dir_all(&dir);
        Ok((status, timed_out))
    }

    /// Records a silence that ended with a heartbeat or the command's end.
    fn note_silence(&self, silence: Duration) {
        let ms = u64::try_from(silence.as_millis()).unwrap_or(u64::MAX);
        self.longest_silence_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Sends `run` and waits for the matching `done`, pumping output when streaming.
    fn await_done(
        &self,
        inner: &mut Inner,
        id: u64,
        limit: Option<Duration>,
        poll: Option<Duration>,
        outputs: &mut Outputs<'_>,
    ) -> Result<i32, Error> {
        let run_dir = self.run_dir.path();
        let send = inner.channel.send(HostMsg::Run { id, timeout: limit });
        send.map_err(|e| channel_failure(&inner.qemu, run_dir, e))?;
        let started = Instant::now();
        let deadline = limit.map(|l| started + l + GRACE);
        let mut heard = started;
        loop {
            let mut wake = Instant::now() + poll.unwrap_or(Duration::from_secs(1));
            if let Some(d) = deadline {
                wake = wake.min(d);
            }
            let msg = inner.channel.recv(wake);
            match msg.map_err(|e| channel_failure(&inner.qemu, run_dir, e))? {
                Some(GuestMsg::Done { id: got, status }) if got == id => {
                    self.note_silence(heard.elapsed());
                    return Ok(status);
                }
                Some(GuestMsg::Alive { id: got }) if got == id => {
                    self.note_silence(heard.elapsed());
                    heard = Instant::now();
                }
                Some(other) => {
                    let line = format!("{other:?} while waiting for command {id}");
                    let garbled = ChannelError::Protocol(protocol::ProtocolError::Garbled(line));
                    return Err(channel_failure(&inner.qemu, run_dir, garbled));
                }
                None => {}
            }
            if poll.is_some() {
                outputs.pump()?;
            }
            if let Some(status) = inner.qemu.exit_status() {
                return Err(Error::QemuExited {
                    status,
                    console: console_tail(run_dir, 40),
                });
            }
            let silent = heard.elapsed() >= SILENCE_LIMIT;
            if silent || deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Unresponsive {
                    waited: started.elapsed(),
                    console: console_tail(run_dir, 40),
                });
            }
        }
    }
}

/// A command's output files and where their bytes go.
struct Outputs<'a> {
    tails: [Tailer; 2],
    sinks: [&'a mut dyn Write; 2],
}

impl Outputs<'_> {
    /// Passes new stdout and stderr bytes on.
    fn pump(&mut self) -> Result<(), Error> {
        for (tail, sink) in self.tails.iter_mut().zip(self.sinks.iter_mut()) {
            tail.pump(*sink).map_err(Error::Scratch)?;
        }
        Ok(())
    }
}

/// Turns a control channel error into [`Error::QemuExited`] when the channel closed because QEMU exited
/// (e.g. the kernel panicked), else into [`Error::Channel`].
fn channel_failure(qemu: &QemuProcess, run_dir: &Path, source: ChannelError) -> Error {
    let exited = match source {
        ChannelError::Closed => qemu.wait_timeout(Duration::from_secs(5)),
        _ => None,
    };
    let console = console_tail(run_dir, 40);
    match exited {
        Some(status) => Error::QemuExited { status, console },
        None => Error::Channel { source, console },
    }
}

/// Waits for QEMU to connect its control port's chardev to our socket.
fn connect(
    listener: &UnixListener,
    qemu: &QemuProcess,
    run_dir: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<ControlChannel, Error> {
    let accepted = ControlChannel::accept(listener, || {
        qemu.exit_status().is_some() || Instant::now() >= deadline
    })
    .map_err(|source| Error::Channel {
        source,
        console: console_tail(run_dir, 40),
    })?;
    match (accepted, qemu.exit_status()) {
        (Some(channel), _) => Ok(channel),
        (None, Some(status)) => Err(Error::QemuExited {
            status,
            console: console_tail(run_dir, 40),
        }),
        (None, None) => Err(Error::BootTimeout {
            timeout,
            console: console_tail(run_dir, 40),
        }),
    }
}

/// Waits for init's `ready` (or `fail`) line.
fn wait_ready(
    inner: &mut Inner,
    run_dir: &Path,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), Error> {
    loop {
        let wake = deadline.min(Instant::now() + Duration::from_millis(200));
        let msg = inner.channel.recv(wake);
        let msg = msg.map_err(|e| channel_failure(&inner.qemu, run_dir, e))?;
        match msg {
            Some(GuestMsg::Ready) => return Ok(()),
            Some(GuestMsg::Fail(reason)) => {
                return Err(Error::BootFailed {
                    reason,
                    console: console_tail(run_dir, 40),
                })
            }
            Some(other) => {
                return Err(Error::BootFailed {
                    reason: format!("unexpected {other:?} before ready"),
                    console: console_tail(run_dir, 40),
                })
            }
            None => {}
        }
        if let Some(status) = inner.qemu.exit_status() {
            return Err(Error::QemuExited {
                status,
                console: console_tail(run_dir, 40),
            });
        }
        if Instant::now() >= deadline {
            return Err(Error::BootTimeout {
                timeout,
                console: console_tail(run_dir, 40),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_turns_off_address_randomization_unless_asked() {
        // Act
        let default = cmdline(&["loglevel=7".into()], false);
        let with_aslr = cmdline(&[], true);

        // Assert
        assert_eq!(default, format!("{CMDLINE} norandmaps loglevel=7"));
        assert_eq!(with_aslr, CMDLINE);
    }
}

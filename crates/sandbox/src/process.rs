//! The `bulkhead-vmm` child process: spawning it, waiting for "agent ready or VMM exited" without
//! polling, and stopping it.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How [`spawn_vmm`] starts the VMM.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpawnOptions<'a> {
    /// With it the VMM receives SIGTERM when this process exits (PR_SET_PDEATHSIG), so a
    /// crashed client never leaves a VM behind. The kernel ties that signal to the *thread*
    /// that forked, so such VMMs are forked by one thread that lives as long as the process
    /// ([`spawn_on_keeper`]): a sandbox started on a short-lived worker thread survives it.
    pub kill_on_parent_exit: bool,
    /// `cgroup.procs` files the VMM joins between fork and exec (see
    /// [`crate::SandboxConfig::cgroup_procs`]).
    pub cgroup_procs: &'a [PathBuf],
    /// Where the VMM writes its timings report (`--timings-json`), if anywhere.
    pub timings_json: Option<&'a Path>,
    /// Where the VMM writes how the VM ended (`--exit-file`), if anywhere.
    pub exit_file: Option<&'a Path>,
    /// Extra arguments (the jail's).
    pub extra_args: &'a [std::ffi::OsString],
}

/// Spawns `vmm <launch> [--timings-json <file>] [--exit-file <file>] [extra args]` (`launch`:
/// `--config FILE`, or `--restore DIR ...`) with stdout/stderr appended to `log`.
pub(crate) fn spawn_vmm(
    vmm: &Path,
    launch: &[&OsStr],
    log: &Path,
    options: SpawnOptions<'_>,
) -> io::Result<Child> {
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", log.display())))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(vmm);
    cmd.args(launch)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    if let Some(report) = options.timings_json {
        cmd.arg("--timings-json").arg(report);
    }
    if let Some(exit_file) = options.exit_file {
        cmd.arg("--exit-file").arg(exit_file);
    }
    cmd.args(options.extra_args);
    if options.kill_on_parent_exit {
        // SAFETY: the closure runs in the child between fork and exec and only calls prctl, which
        // is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    if !options.cgroup_procs.is_empty() {
        let files = open_cgroup_procs(options.cgroup_procs)?;
        // SAFETY: the closure runs in the child between fork and exec; it only calls write(2) on
        // descriptors opened before the fork (owned by `files`, moved into the closure), which is
        // async-signal-safe, and allocates nothing.
        unsafe {
            cmd.pre_exec(move || join_cgroups(&files));
        }
    }
    if options.kill_on_parent_exit {
        spawn_on_keeper(cmd)
    } else {
        cmd.spawn()
    }
}

/// A spawn request for the keeper thread: the command and where to send the result.
type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `cmd` from the process-wide keeper thread, which never exits, so a PR_SET_PDEATHSIG
/// set in the child fires only when the whole process dies (prctl(2): "the parent" is the
/// thread that created the child).
fn spawn_on_keeper(cmd: Command) -> io::Result<Child> {
    static KEEPER: OnceLock<Option<Mutex<mpsc::Sender<SpawnJob>>>> = OnceLock::new();
    let gone = || io::Error::other("the VMM spawner thread could not start or is gone");
    let keeper = KEEPER.get_or_init(|| {
        let (jobs, inbox) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("bulkhead-vmm-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in inbox {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .ok()
            .map(|_| Mutex::new(jobs))
    });
    let (reply, result) = mpsc::channel();
    keeper
        .as_ref()
        .ok_or_else(gone)?
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, reply))
        .map_err(|_| gone())?;
    result.recv().map_err(|_| gone())?
}

/// Opens each `cgroup.procs` file for writing, before the fork (opening allocates).
fn open_cgroup_procs(paths: &[PathBuf]) -> io::Result<Vec<File>> {
    paths
        .iter()
        .map(|path| {
            File::options().write(true).open(path).map_err(|e| {
                io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display()))
            })
        })
        .collect()
}

/// In the forked child: moves the calling process into each cgroup. Writing `0` to
/// `cgroup.procs` moves the writer's own thread group (cgroup v1 and v2 alike).
fn join_cgroups(files: &[File]) -> io::Result<()> {
    for file in files {
        // SAFETY: `file` is an open descriptor; the buffer is a 1-byte static string.
        let n = unsafe { libc::write(file.as_raw_fd(), b"0".as_ptr().cast(), 1) };
        if n != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A pidfd for `child` (pidfd_open(2), Linux ≥ 5.3): readable once the process exits.
pub(crate) fn pidfd(child: &Child) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a freshly opened descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// What [`wait_either`] saw first.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// `ready_fd` is readable (a connection is waiting on the listener).
    Ready,
    /// The process behind `pidfd` exited.
    Exited,
    /// Neither happened within the timeout.
    TimedOut,
}

/// Blocks until `ready_fd` is readable, `pidfd` signals exit, or `timeout` passes.
pub(crate) fn wait_either(
    ready_fd: &impl AsRawFd,
    pidfd: &OwnedFd,
    timeout: Duration,
) -> io::Result<Woken> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: ready_fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: pidfd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        if fds[1].revents != 0 {
            return Ok(Woken::Exited);
        }
        if fds[0].revents != 0 {
            return Ok(Woken::Ready);
        }
        if n == 0 {
            return Ok(Woken::TimedOut);
        }
    }
}

/// Sends SIGTERM, waits up to `grace` for the process to exit (on its pidfd), then SIGKILLs it.
/// Returns its exit status.
pub(crate) fn terminate(child: &mut Child, grace: Duration) -> io::Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    // SAFETY: kill with a pid we own (not yet reaped, so it cannot have been recycled).
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let exited = match pidfd(child) {
        Ok(fd) => wait_pidfd(&fd, grace)?,
        Err(_) => false,
    };
    if !exited {
        tracing::warn!("bulkhead-vmm {} ignored SIGTERM; killing it", child.id());
        child.kill()?;
    }
    child.wait()
}

pub(crate) fn wait_pidfd(fd: &OwnedFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    /// State letter and pending-signal masks of `pid` from /proc.
    fn proc_state(pid: u32) -> String {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .filter(|l| {
                l.starts_with("State:") || l.starts_with("SigPnd:") || l.starts_with("ShdPnd:")
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn a_vmm_started_on_a_short_lived_thread_outlives_that_thread() {
        // Arrange: a stand-in VMM that ignores its arguments and waits.
        let dir = tempfile::tempdir().unwrap();
        let vmm = dir.path().join("vmm");
        std::fs::write(&vmm, "#!/bin/sh\nexec sleep 60\n").unwrap();
        std::fs::set_permissions(&vmm, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let options = SpawnOptions {
            kill_on_parent_exit: true,
            cgroup_procs: &[],
            timings_json: None,
            exit_file: None,
            extra_args: &[],
        };

        // Act: spawn from a worker thread, then wait until that thread is fully gone (the
        // kernel sends PR_SET_PDEATHSIG before it removes the thread from /proc).
        let (vmm_path, log) = (vmm.clone(), dir.path().join("log"));
        let worker = std::thread::spawn(move || {
            // SAFETY: gettid takes no arguments and cannot fail.
            let tid = unsafe { libc::gettid() };
            (
                spawn_vmm(
                    &vmm_path,
                    &[OsStr::new("--config"), OsStr::new("cfg")],
                    &log,
                    options,
                )
                .unwrap(),
                tid,
            )
        });
        let (mut child, tid) = worker.join().unwrap();
        let task = format!("/proc/self/task/{tid}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&task).exists() && Instant::now() < deadline {
            std::thread::yield_now();
        }

        // Assert: no signal was sent (it would be pending or would have ended the process).
        let state = proc_state(child.id());
        assert!(!Path::new(&task).exists(), "worker thread never exited");
        assert!(
            !state.contains("State:\tZ")
                && state.contains("SigPnd:\t0000000000000000")
                && state.contains("ShdPnd:\t0000000000000000"),
            "{state}"
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn exit_of_the_child_wakes_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join("l")).unwrap();
        let mut child = Command::new("true").spawn().unwrap();
        let fd = pidfd(&child).unwrap();

        let woken = wait_either(&listener, &fd, Duration::from_secs(30)).unwrap();

        assert_eq!(woken, Woken::Exited);
        assert!(child.wait().unwrap().success());
    }

    #[test]
    fn a_pending_connection_wakes_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l");
        let listener = UnixListener::bind(&path).unwrap();
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let fd = pidfd(&child).unwrap();
        let _client = std::os::unix::net::UnixStream::connect(&path).unwrap();

        let woken = wait_either(&listener, &fd, Duration::from_secs(30)).unwrap();

        assert_eq!(woken, Woken::Ready);
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn terminate_ends_a_running_child() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();

        let status = terminate(&mut child, Duration::from_secs(10)).unwrap();

        assert!(!status.success());
    }
}

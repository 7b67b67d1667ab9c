//! Turning an [`ExecRequest`] into a running process: validation, environment, user, cwd,
//! a new session (so pid = pgid = sid), and pipes (or a pseudo-terminal, [`crate::pty`]) for
//! stdio.

use std::ffi::OsStr;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use bulkhead_protocol::{ByteString, ErrorCode, ExecRequest, PROTOCOL_VERSION};

use crate::container::{self, ContainerError, Prepared};
use crate::pty::Pty;
use crate::reaper::{self, ExitWatch, ReaperError};
use crate::user::{self, UserError};

/// `PATH` given to commands whose request has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Exit code reported when the program does not exist (as a shell does).
pub const EXIT_NOT_FOUND: i32 = 127;

/// Exit code reported when the program exists but cannot be executed (as a shell does).
pub const EXIT_NOT_EXECUTABLE: i32 = 126;

/// Reasons a request is refused before any process exists (sent as an `Error` frame).
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The request's protocol version is not ours.
    #[error("unsupported protocol version {0} (this agent speaks {PROTOCOL_VERSION})")]
    Version(u32),
    /// `argv` is empty.
    #[error("argv is empty")]
    EmptyArgv,
    /// No pseudo-terminal could be opened for a `tty` exec.
    #[error("opening a pseudo-terminal: {0}")]
    Tty(io::Error),
    /// An `env` entry without `=` or with an empty name.
    #[error("bad env entry {0:?}: expected KEY=VALUE")]
    BadEnv(ByteString),
    /// `cwd` is not an existing directory.
    #[error("cwd {0:?} is not an existing directory")]
    BadCwd(ByteString),
    /// `user` could not be resolved.
    #[error(transparent)]
    User(#[from] UserError),
    /// A container exec's root, cwd, user or limits are not usable.
    #[error(transparent)]
    Container(#[from] ContainerError),
    /// The container's PID namespace could not be made or entered.
    #[error("entering the container's PID namespace: {0}")]
    Namespace(io::Error),
    /// fork/exec failed for another reason than a missing or non-executable program.
    #[error("spawn {program}: {source}")]
    Spawn {
        /// `argv[0]`.
        program: String,
        /// What failed.
        source: ReaperError,
    },
}

impl SpawnError {
    /// The error's class for the host.
    pub fn code(&self) -> ErrorCode {
        match self {
            SpawnError::Version(_) => ErrorCode::UnsupportedVersion,
            SpawnError::Tty(e) | SpawnError::Namespace(e) => ErrorCode::of_io(e),
            SpawnError::Container(ContainerError::Join { source, .. }) => ErrorCode::of_io(source),
            SpawnError::Container(_) => ErrorCode::InvalidRequest,
            SpawnError::EmptyArgv
            | SpawnError::BadEnv(_)
            | SpawnError::BadCwd(_)
            | SpawnError::User(_) => ErrorCode::InvalidRequest,
            SpawnError::Spawn {
                source: ReaperError::Spawn(e),
                ..
            } => ErrorCode::of_io(e),
            SpawnError::Spawn { .. } => ErrorCode::Other,
        }
    }
}

/// A running command.
#[derive(Debug)]
pub struct Spawned {
    /// Its pid, which is also its process group and session id.
    pub pid: libc::pid_t,
    /// Write end of its stdin pipe (with a tty: the terminal's master), when the request asked
    /// for stdin.
    pub stdin: Option<OwnedFd>,
    /// Read end of its stdout pipe (with a tty: the master, the terminal's one output).
    pub stdout: OwnedFd,
    /// Read end of its stderr pipe; `None` with a tty.
    pub stderr: Option<OwnedFd>,
    /// The terminal's master with a tty (for `Resize` and the end-of-file character).
    pub terminal: Option<OwnedFd>,
    /// Where its wait status arrives.
    pub exit: ExitWatch,
}

/// What became of a request.
#[derive(Debug)]
pub enum Outcome {
    /// The process runs.
    Running(Spawned),
    /// The program could not be executed; report `message` on stderr and exit `code`
    /// (127 not found, 126 not executable), like a shell.
    NotRunnable {
        /// Exit code to report.
        code: i32,
        /// Line for stderr, ending in `\n`.
        message: String,
    },
}

/// Validates `req`, builds the command and starts it.
pub fn spawn(req: &ExecRequest) -> Result<Outcome, SpawnError> {
    let (mut cmd, container) = build_command(req)?;
    let pty = match req.tty {
        true => Some(open_terminal(req, &mut cmd)?),
        false => None,
    };
    let program = req.argv[0].to_string_lossy().into_owned();
    if let Some(prepared) = &container {
        prepared
            .enter_pid_namespace()
            .map_err(SpawnError::Namespace)?;
    }
    let (mut child, exit) = match reaper::spawn(&mut cmd) {
        Ok(spawned) => spawned,
        Err(ReaperError::Spawn(e)) => return not_runnable(&program, e),
        Err(source) => return Err(SpawnError::Spawn { program, source }),
    };
    // The parent's copies of the slave (held by `cmd`) must go, or the master never sees EIO.
    drop(cmd);
    let pid = child.id() as libc::pid_t;
    let spawned = match pty {
        Some(pty) => Spawned {
            pid,
            stdin: match req.stdin {
                true => Some(pty.master.try_clone().map_err(pty_error)?),
                false => None,
            },
            stdout: pty.master.try_clone().map_err(pty_error)?,
            stderr: None,
            terminal: Some(pty.master),
            exit,
        },
        None => Spawned {
            pid,
            stdin: child.stdin.take().map(OwnedFd::from),
            stdout: child.stdout.take().map(OwnedFd::from).ok_or_else(no_pipe)?,
            stderr: Some(child.stderr.take().map(OwnedFd::from).ok_or_else(no_pipe)?),
            terminal: None,
            exit,
        },
    };
    Ok(Outcome::Running(spawned))
}

/// Opens the pseudo-terminal of a `tty` request and makes it `cmd`'s stdio and controlling
/// terminal; adds `TERM=xterm` unless the request names a `TERM`.
fn open_terminal(req: &ExecRequest, cmd: &mut Command) -> Result<Pty, SpawnError> {
    let pty = Pty::open(req.window.unwrap_or_default()).map_err(SpawnError::Tty)?;
    pty.attach(cmd).map_err(SpawnError::Tty)?;
    if !has_var(req, "TERM") {
        cmd.env("TERM", "xterm");
    }
    Ok(pty)
}

fn pty_error(e: io::Error) -> SpawnError {
    SpawnError::Spawn {
        program: String::new(),
        source: ReaperError::Spawn(e),
    }
}

/// True when the request's environment sets `name`.
fn has_var(req: &ExecRequest, name: &str) -> bool {
    req.env.iter().any(|e| {
        let bytes = e.as_bytes();
        bytes.len() > name.len() && bytes.starts_with(name.as_bytes()) && bytes[name.len()] == b'='
    })
}

fn no_pipe() -> SpawnError {
    SpawnError::Spawn {
        program: String::new(),
        source: ReaperError::Spawn(io::Error::other("stdio pipe missing")),
    }
}

fn not_runnable(program: &str, e: io::Error) -> Result<Outcome, SpawnError> {
    let code = match e.kind() {
        io::ErrorKind::NotFound => EXIT_NOT_FOUND,
        io::ErrorKind::PermissionDenied => EXIT_NOT_EXECUTABLE,
        _ => {
            return Err(SpawnError::Spawn {
                program: program.to_owned(),
                source: ReaperError::Spawn(e),
            })
        }
    };
    Ok(Outcome::NotRunnable {
        code,
        message: format!("bulkhead-agent: {program}: {e}\n"),
    })
}

/// Builds (but does not start) the command for `req`, with its container's preparation when it
/// is a container exec (whose PID namespace the spawning thread must enter first,
/// [`Prepared::enter_pid_namespace`]).
pub fn build_command(req: &ExecRequest) -> Result<(Command, Option<Arc<Prepared>>), SpawnError> {
    validate(req)?;
    let container = match &req.container {
        Some(spec) => Some(Arc::new(container::prepare(
            spec,
            req.cwd.as_ref(),
            req.user.as_deref(),
        )?)),
        None => None,
    };
    let mut cmd = Command::new(&req.argv[0]);
    cmd.args(&req.argv[1..]).env_clear();
    for entry in &req.env {
        let bytes = entry.as_bytes();
        match bytes.iter().position(|&b| b == b'=') {
            Some(eq) if eq > 0 => cmd.env(
                OsStr::from_bytes(&bytes[..eq]),
                OsStr::from_bytes(&bytes[eq + 1..]),
            ),
            _ => return Err(SpawnError::BadEnv(entry.clone())),
        };
    }
    if !has_var(req, "PATH") {
        cmd.env("PATH", DEFAULT_PATH);
    }
    match &container {
        Some(prepared) => container_command(req, &mut cmd, prepared),
        None => guest_command(req, &mut cmd)?,
    }
    cmd.stdin(if req.stdin {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: the closure only makes raw system calls (setsid, sigprocmask, signal, close_range) and
    // initialises a sigset on its own stack, all async-signal-safe, as required between fork
    // and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            // As PID 1 the agent blocks SIGTERM, SIGINT, SIGUSR1/2 and SIGPWR in every thread
            // (the reaper waits for them), and a blocked mask survives exec: without this the
            // command could never be stopped by SIGTERM or Ctrl-C forwarded from the host.
            let mut none = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
            libc::sigemptyset(none.as_mut_ptr());
            if libc::pthread_sigmask(libc::SIG_SETMASK, none.as_ptr(), std::ptr::null_mut()) != 0 {
                return Err(io::Error::other("cannot clear the signal mask"));
            }
            // An ignored signal stays ignored through exec: every command starts with the
            // default dispositions, as under a fresh init, whatever the agent inherited (in
            // test mode, a background job of a non-interactive shell ignores SIGINT and
            // SIGQUIT, and Ctrl-C on a command's terminal then did nothing). SIGKILL and
            // SIGSTOP refuse the call, harmlessly.
            for signo in 1..32 {
                libc::signal(signo, libc::SIG_DFL);
            }
            // Whatever the agent itself inherited or leaked stays out of the command: every
            // descriptor above stderr closes at exec. Kernels before 5.11 lack the flag
            // (ENOSYS/EINVAL); the agent opens everything close-on-exec anyway.
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            Ok(())
        });
    }
    if let Some(prepared) = &container {
        let prepared = Arc::clone(prepared);
        // SAFETY: `Prepared::enter` makes only system calls on values prepared before the fork
        // (no allocation, no locks), as required between fork and exec.
        unsafe { cmd.pre_exec(move || prepared.enter()) };
    }
    Ok((cmd, container))
}

/// An ordinary guest command: `cwd` and `user` in the guest's own file system.
fn guest_command(req: &ExecRequest, cmd: &mut Command) -> Result<(), SpawnError> {
    let cwd = req.cwd.as_ref().map_or(OsStr::new("/"), |c| c.as_os_str());
    if !Path::new(cwd).is_dir() {
        return Err(SpawnError::BadCwd(cwd.into()));
    }
    cmd.current_dir(cwd);
    if let Some(spec) = &req.user {
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        let ids = user::resolve(spec, &passwd)?;
        // The user's own HOME unless the request names one (without a user, root's
        // environment is the request's alone).
        if !has_var(req, "HOME") {
            cmd.env("HOME", user::home_of(ids.uid, &passwd));
        }
        cmd.uid(ids.uid).gid(ids.gid);
    }
    Ok(())
}

/// A container's command: its working directory and ids are set by [`Prepared::enter`] after
/// the root changed (the standard library would set them before); only `HOME` is set here.
fn container_command(req: &ExecRequest, cmd: &mut Command, prepared: &Prepared) {
    if let Some(home) = prepared.home().filter(|_| !has_var(req, "HOME")) {
        cmd.env("HOME", home);
    }
}

fn validate(req: &ExecRequest) -> Result<(), SpawnError> {
    if req.version != PROTOCOL_VERSION {
        return Err(SpawnError::Version(req.version));
    }
    if req.argv.is_empty() {
        return Err(SpawnError::EmptyArgv);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bulkhead_protocol::ExecRequest;

    use super::*;

    fn block_sigterm_in_this_thread() {
        let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigemptyset/sigaddset initialise and modify the set on our stack; the mask
        // change only affects this test's thread.
        unsafe {
            libc::sigemptyset(set.as_mut_ptr());
            libc::sigaddset(set.as_mut_ptr(), libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, set.as_ptr(), std::ptr::null_mut());
        }
    }

    /// A request for `echo $HOME` as this test's own uid and gid (allowed without root).
    fn echo_home_as_myself(env: &[&str]) -> (ExecRequest, u32) {
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let mut req = ExecRequest::new(["sh", "-c", "echo \"$HOME\""]);
        req.user = Some(format!("{uid}:{gid}"));
        req.env = env.iter().map(|e| (*e).into()).collect();
        (req, uid)
    }

    #[test]
    fn a_user_gets_the_home_of_its_passwd_entry_unless_the_request_sets_home() {
        // Arrange
        let (plain, uid) = echo_home_as_myself(&[]);
        let (explicit, _) = echo_home_as_myself(&["HOME=/srv/x"]);
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();

        // Act
        let plain = build_command(&plain).unwrap().0.output().unwrap();
        let explicit = build_command(&explicit).unwrap().0.output().unwrap();

        // Assert
        let expected = format!("{}\n", user::home_of(uid, &passwd));
        assert_eq!(String::from_utf8_lossy(&plain.stdout), expected);
        assert_eq!(explicit.stdout, b"/srv/x\n");
    }

    #[test]
    fn commands_start_with_no_signal_blocked_even_when_the_agent_blocks_some() {
        // Arrange: the agent as PID 1 blocks SIGTERM (and more) in all its threads.
        block_sigterm_in_this_thread();
        let req = ExecRequest::new(["grep", "^SigBlk:", "/proc/self/status"]);

        // Act
        let out = build_command(&req).unwrap().0.output().unwrap();

        // Assert
        let line = String::from_utf8(out.stdout).unwrap();
        assert_eq!(line.trim(), "SigBlk:\t0000000000000000", "{line:?}");
    }
}

//! Test harness: a real `bulkhead-agent --listen-unix` process in a temporary directory.

#![allow(dead_code)] // each test file uses a different subset

use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use bulkhead_protocol::client::{accept_ready, AgentClient};
use bulkhead_protocol::Ready;

/// Upper bound for anything that should take milliseconds (generous: loaded CI machines).
pub const PATIENCE: Duration = Duration::from_secs(20);

/// The agent under test: `$BULKHEAD_AGENT_BIN` if set (e.g. the static musl build), else the
/// binary Cargo built for these tests.
fn agent_binary() -> PathBuf {
    std::env::var_os("BULKHEAD_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_bulkhead-agent")))
}

pub struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub ready: Ready,
}

impl Agent {
    /// Starts the agent and waits for its Ready message.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`Agent::start`], with SIGINT and SIGQUIT ignored in the agent, as a background job
    /// of a non-interactive shell gets them (`nohup cmd &` in a script).
    pub fn start_ignoring_sigint() -> Self {
        Self::start_as(|command| {
            // SAFETY: signal(2) only, between fork and exec.
            unsafe {
                command.pre_exec(|| {
                    libc::signal(libc::SIGINT, libc::SIG_IGN);
                    libc::signal(libc::SIGQUIT, libc::SIG_IGN);
                    Ok(())
                })
            };
        })
    }

    /// Like [`Agent::start`], with extra command-line arguments.
    pub fn start_with(extra: &[&std::ffi::OsStr]) -> Self {
        Self::start_as(|command| {
            command.args(extra);
        })
    }

    /// Starts the agent with `adjust` applied to its command.
    fn start_as(adjust: impl FnOnce(&mut Command)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let ready_path = dir.path().join("agent.sock_1025");
        let ready_listener = UnixListener::bind(&ready_path).unwrap();
        let mut command = Command::new(agent_binary());
        command
            .arg("--listen-unix")
            .arg(&socket)
            .arg("--ready-unix")
            .arg(&ready_path);
        adjust(&mut command);
        let child = command.spawn().unwrap();
        let ready = accept_ready(&ready_listener, PATIENCE).unwrap();
        Self {
            child,
            dir,
            socket,
            ready,
        }
    }

    pub fn client(&self) -> AgentClient {
        AgentClient::unix(&self.socket)
    }

    /// A scratch directory the agent's commands can use too (same filesystem in test mode).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Number of descriptors the agent process has open.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }

    /// Waits (bounded) for the agent process to exit; true if it did.
    pub fn wait_exit(&mut self) -> bool {
        wait_until(|| matches!(self.child.try_wait(), Ok(Some(_))))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `condition` every 10 ms until it holds or [`PATIENCE`] passes.
pub fn wait_until(mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// True when no process is left in process group `pgid` (zombies included).
pub fn group_is_gone(pgid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence; no pointers.
    let rc = unsafe { libc::kill(-(pgid as libc::pid_t), 0) };
    rc == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// A deterministic pseudo-random buffer (xorshift64), every byte value included.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

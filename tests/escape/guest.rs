//! Running attack scripts in a guest, each bounded by the agent's timeout.

use std::time::Duration;

use bulkhead_protocol::client::ExecSession;
use bulkhead_protocol::ExecRequest;
use bulkhead_sandbox::Sandbox;

/// What a guest command did, as text.
#[derive(Debug)]
pub struct Run {
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Killing signal, when a signal ended it.
    pub signal: Option<i32>,
    /// Whether the agent killed it at its timeout.
    pub timed_out: bool,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl Run {
    /// stdout and stderr together, for searching and messages.
    pub fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// A request for `argv` with the agent's `timeout`.
pub fn request(argv: &[&str], timeout: Duration) -> ExecRequest {
    let mut request = ExecRequest::new(argv.iter().copied());
    request.timeout_ms = Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
    request
}

/// Runs `argv` in the guest and waits for it (at most `timeout`, enforced by the agent).
///
/// # Panics
/// When the command cannot be started or its output cannot be read.
pub fn exec(sandbox: &Sandbox, argv: &[&str], timeout: Duration) -> Run {
    let session = sandbox
        .exec(&request(argv, timeout))
        .unwrap_or_else(|e| panic!("exec {argv:?}: {e}"));
    collect(session)
}

/// Runs `sh -c script` in the guest (see [`exec`]).
pub fn sh(sandbox: &Sandbox, script: &str, timeout: Duration) -> Run {
    exec(sandbox, &["sh", "-c", script], timeout)
}

/// Runs `python3 -c script args...` in the guest (see [`exec`]).
pub fn python(sandbox: &Sandbox, script: &str, args: &[&str], timeout: Duration) -> Run {
    let mut argv = vec!["python3", "-c", script];
    argv.extend_from_slice(args);
    exec(sandbox, &argv, timeout)
}

/// Waits for a started command's whole output.
///
/// # Panics
/// When its output cannot be read.
pub fn collect(session: ExecSession) -> Run {
    let out = session.wait_with_output().expect("command output");
    Run {
        code: out.status.code,
        signal: out.status.signal,
        timed_out: out.status.timed_out,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

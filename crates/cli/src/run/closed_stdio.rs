//! Telling a closed stdout/stderr from one redirected to `/dev/null`.
//!
//! When a process starts with fd 1 or 2 closed (`bulkhead run -- echo hi >&-`), Rust's runtime
//! re-opens it on `/dev/null` before `main`, so that no file opened later lands on it. Writes
//! then "succeed" and the command's output vanishes with exit 0, where a local `echo hi >&-`
//! fails with EBADF. A constructor in `.init_array`, which the C runtime runs before Rust's
//! `main`, records which of the two were closed; [`Output`] then fails every write to them.

use std::io::{self, Write};
use std::sync::atomic::{AtomicU8, Ordering};

/// Which of fds 1 and 2 were closed at exec: [`STDOUT_BIT`] and [`STDERR_BIT`].
static CLOSED_AT_START: AtomicU8 = AtomicU8::new(0);

/// Bit of [`CLOSED_AT_START`] set when fd 1 (stdout) was closed at exec.
const STDOUT_BIT: u8 = 1;
/// Bit of [`CLOSED_AT_START`] set when fd 2 (stderr) was closed at exec.
const STDERR_BIT: u8 = 2;

/// Records which of fds 1 and 2 are closed; runs before the Rust runtime's set-up.
extern "C" fn record_closed_stdio() {
    for (fd, bit) in [
        (libc::STDOUT_FILENO, STDOUT_BIT),
        (libc::STDERR_FILENO, STDERR_BIT),
    ] {
        // SAFETY: F_GETFD only queries this process's descriptor table; no memory is passed.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
            CLOSED_AT_START.fetch_or(bit, Ordering::Relaxed);
        }
    }
}

#[used]
#[link_section = ".init_array"]
static RECORD_CLOSED_STDIO: extern "C" fn() = record_closed_stdio;

/// Where the command's stdout or stderr goes: ours, or nowhere when ours was closed at start.
pub(crate) enum Output<W> {
    /// Our stdout/stderr as the process got it.
    Open(W),
    /// It was closed at exec: every write fails with EBADF, naming `.0` ("stdout"/"stderr").
    Closed(&'static str),
}

impl Output<io::StdoutLock<'static>> {
    /// Our stdout, or [`Output::Closed`] when fd 1 was closed when bulkhead started.
    pub(crate) fn stdout() -> Self {
        Self::choose(STDOUT_BIT, "stdout", || io::stdout().lock())
    }
}

impl Output<io::Stderr> {
    /// Our stderr, or [`Output::Closed`] when fd 2 was closed when bulkhead started.
    pub(crate) fn stderr() -> Self {
        Self::choose(STDERR_BIT, "stderr", io::stderr)
    }
}

impl<W> Output<W> {
    /// [`Output::Closed`] (named `name`) if `bit` of [`CLOSED_AT_START`] is set, else `open()`.
    fn choose(bit: u8, name: &'static str, open: impl FnOnce() -> W) -> Self {
        if CLOSED_AT_START.load(Ordering::Relaxed) & bit != 0 {
            Output::Closed(name)
        } else {
            Output::Open(open())
        }
    }
}

/// Ok when fd 1 was open when bulkhead started, for verbs that must not start work whose
/// result they could not print.
///
/// # Errors
/// "writing to stdout failed: stdout was closed when bulkhead started (EBADF)".
pub(crate) fn check_stdout() -> Result<(), String> {
    match Output::stdout() {
        Output::Open(_) => Ok(()),
        Output::Closed(name) => Err(stdout_failed(closed_error(name))),
    }
}

/// Writes `text` to our stdout and flushes it, for verbs that print a listing, an ID or a log.
///
/// # Errors
/// "writing to stdout failed: ..." when stdout was closed when bulkhead started or the write
/// failed (e.g. ENOSPC on `>/dev/full`). A reader that went away kills these verbs with SIGPIPE
/// before any error is seen (see `dies_of_sigpipe` in `main.rs`).
pub(crate) fn print_stdout(text: &str) -> Result<(), String> {
    let mut out = Output::stdout();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(stdout_failed)
}

/// The message of a failed write to our stdout, the same in every verb.
pub(crate) fn stdout_failed(e: io::Error) -> String {
    format!("writing to stdout failed: {e}")
}

/// The error of a write to `name` ("stdout"/"stderr") that was closed at exec.
fn closed_error(name: &str) -> io::Error {
    io::Error::other(format!("{name} was closed when bulkhead started (EBADF)"))
}

impl<W: Write> Write for Output<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Output::Open(w) => w.write(buf),
            Output::Closed(name) => Err(closed_error(name)),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Output::Open(w) => w.flush(),
            Output::Closed(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_output_fails_every_write_and_names_itself() {
        let mut closed: Output<Vec<u8>> = Output::Closed("stdout");

        let err = closed.write_all(b"hi").unwrap_err();

        assert!(err.to_string().contains("stdout was closed"), "{err}");
    }

    #[test]
    fn an_open_output_passes_bytes_through_unchanged() {
        let mut open = Output::Open(Vec::new());

        open.write_all(b"a\0\xff").unwrap();

        assert!(matches!(open, Output::Open(v) if v == b"a\0\xff"));
    }

    /// Set in the child process of [`a_stdout_closed_at_exec_is_recorded_before_main`].
    const CHILD: &str = "BULKHEAD_TEST_CLOSED_STDOUT_CHILD";

    #[test]
    fn a_stdout_closed_at_exec_is_recorded_before_main() {
        if std::env::var_os(CHILD).is_some() {
            // In the child: fd 1 was closed at exec (the runtime re-opened it on /dev/null).
            let recorded = CLOSED_AT_START.load(Ordering::Relaxed);
            eprintln!("closed-at-start bits: {recorded}");
            assert!(matches!(Output::stdout(), Output::Closed("stdout")));
            assert!(matches!(Output::stderr(), Output::Open(_)));
            return;
        }
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child
            .args([
                "--exact",
                "run::closed_stdio::tests::a_stdout_closed_at_exec_is_recorded_before_main",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, "1");
        // SAFETY: close(2) is async-signal-safe; the closure touches no memory of the parent.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut child, || {
                libc::close(libc::STDOUT_FILENO);
                Ok(())
            });
        }

        let out = child.output().unwrap();

        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "child failed: {stderr}");
        assert!(
            stderr.contains("closed-at-start bits: 1"),
            "child did not run the check: {stderr}"
        );
    }
}

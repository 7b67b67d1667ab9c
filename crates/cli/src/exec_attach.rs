//! `bulkhead exec -i` / `-t` / `-it`: an attached exec (`POST .../exec/attach`) whose stdin
//! streams from ours for as long as it is open (no size limit; back-pressure), on a terminal
//! with `-t` (ours in raw mode, resizes forwarded).
//!
//! The exec ends with the command: its exit status is ours as soon as it arrives, whether or
//! not our stdin is still open (`sleep 100 | bulkhead exec -i ID -- echo hi` returns at once).

use std::io::Read;

use bulkhead_client::{AttachInput, Client, ExecEvent, ExecSpec, WindowSize};
use bulkhead_protocol::DATA_CHUNK;
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use tokio::sync::mpsc;

use crate::run::closed_stdio::Output;
use crate::run::output::write_out;
use crate::terminal::{self, RawMode};

/// Exit status when our stdout's reader went away (as a local pipeline's SIGPIPE).
pub(crate) const EXIT_READER_GONE: u8 = 128 + libc::SIGPIPE as u8;

/// What the input task sends to the command.
enum Input {
    Bytes(Vec<u8>),
    Eof,
    Resize(WindowSize),
}

/// What an attached exec takes from the command line.
pub struct Attach<'a> {
    /// The daemon.
    pub client: Client,
    /// The sandbox ID (or prefix).
    pub id: &'a str,
    /// Stream our stdin (`-i`).
    pub stdin: bool,
    /// A terminal (`-t`).
    pub tty: bool,
}

/// Runs `spec` attached; the exit status as `bulkhead exec`'s.
///
/// # Errors
/// `-t` without a terminal on stdin, the daemon's refusal, a broken connection.
pub async fn run(attach: Attach<'_>, mut spec: ExecSpec) -> Result<u8, String> {
    if attach.tty {
        terminal::require_stdin_tty()?;
        spec.tty = true;
        spec.window = terminal::size();
    }
    let exec = attach
        .client
        .exec_attach(attach.id, &spec)
        .await
        .map_err(|e| e.to_string())?;
    let _raw = match attach.tty {
        true => {
            restore_terminal_on_signals()?;
            Some(
                RawMode::enter()
                    .map_err(|e| format!("cannot put the terminal in raw mode: {e}"))?,
            )
        }
        false => None,
    };
    let (tx, rx) = mpsc::channel::<Input>(4);
    tokio::spawn(feed(exec.input, rx));
    if attach.stdin {
        let tx = tx.clone();
        std::thread::spawn(move || read_stdin(&tx));
    }
    let _resizes = match attach.tty {
        true => Some(terminal::watch_resizes(move |size| {
            let _ = tx.try_send(Input::Resize(size));
        })?),
        false => None,
    };
    relay_output(exec.output).await
}

/// Writes the command's output to ours until its exit status.
async fn relay_output(mut output: bulkhead_client::AttachOutput) -> Result<u8, String> {
    let mut sink = OutputSink::new();
    loop {
        let event = output.next_event().await.map_err(|e| e.to_string())?;
        if let Some(end) = sink.take(event) {
            terminal::restore();
            return end;
        }
    }
}

/// Our stdout and stderr for a daemon exec's output (`bulkhead exec`, attached or not).
pub(crate) struct OutputSink {
    stdout: Output<std::io::StdoutLock<'static>>,
    stderr: Output<std::io::Stderr>,
    lost: Option<std::io::Error>,
}

impl OutputSink {
    /// Our stdout and stderr.
    pub(crate) fn new() -> Self {
        OutputSink {
            stdout: Output::stdout(),
            stderr: Output::stderr(),
            lost: None,
        }
    }

    /// Writes `event`'s bytes out; `Some` with `bulkhead exec`'s exit status once the exec has
    /// ended: the command's status, [`EXIT_READER_GONE`] when our stdout's reader went away
    /// (dropping the stream makes the daemon end the command), or an error.
    pub(crate) fn take(&mut self, event: Option<ExecEvent>) -> Option<Result<u8, String>> {
        match event {
            Some(ExecEvent::Stdout(b)) => {
                write_out(&mut self.stdout, &b, &mut self.lost).then_some(Ok(EXIT_READER_GONE))
            }
            Some(ExecEvent::Stderr(b)) => {
                write_out(&mut self.stderr, &b, &mut self.lost);
                None
            }
            Some(ExecEvent::Exit(exit)) => Some(match self.lost.take() {
                Some(e) => Err(format!("writing the command's output failed: {e}")),
                None => Ok(crate::daemon_cmds::exit_code(&exit)),
            }),
            None => Some(Err("the exec ended without an exit status".into())),
        }
    }
}

/// Task: inputs → frames to the command, until the channel or the connection closes.
async fn feed(mut input: AttachInput, mut rx: mpsc::Receiver<Input>) {
    while let Some(item) = rx.recv().await {
        let sent = match item {
            Input::Bytes(bytes) => input.write_stdin(&bytes).await,
            Input::Eof => input.close_stdin().await,
            Input::Resize(size) => input.resize(size).await,
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Thread: our stdin → the input task, then end of file. Blocks in `read` while stdin is open;
/// the process exits with the command regardless.
fn read_stdin(tx: &mpsc::Sender<Input>) {
    let mut stdin = std::io::stdin().lock();
    let mut buf = vec![0u8; DATA_CHUNK];
    loop {
        match stdin.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.blocking_send(Input::Bytes(buf[..n].to_vec())).is_err() {
                    return;
                }
            }
        }
    }
    let _ = tx.blocking_send(Input::Eof);
}

/// With our terminal in raw mode, the signals that end `bulkhead` (SIGTERM, SIGHUP, and
/// SIGINT/SIGQUIT sent with `kill`: the keys travel to the guest) first put the terminal back,
/// then exit 128+N; the daemon kills the command when our connection closes.
fn restore_terminal_on_signals() -> Result<(), String> {
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGHUP, SIGINT, SIGQUIT])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            terminal::restore();
            std::process::exit(128 + sig);
        }
    });
    Ok(())
}

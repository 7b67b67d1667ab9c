//! Serving one exec connection: start the command, then one `poll(2)` loop moves stdin in,
//! stdout/stderr out, applies signals and the timeout, and waits for the exit status.
//!
//! All descriptors in the loop are non-blocking, so a slow host, a command that does not read
//! its stdin, or one that floods its output can never stall the loop: the timeout and a host
//! disconnect are always noticed. Back-pressure:
//! - output is read from the pipes only while less than [`OUT_HIGH_WATER`] bytes wait to be
//!   sent to the host;
//! - the connection is read only while no stdin bytes wait to be written to the command.
//!
//! `Exit` is sent once the command has exited *and* both output pipes are at end of file
//! (every process that inherited them closed them), like a shell pipeline. After a timeout,
//! the group is killed and `Exit` follows as soon as the leader is reaped and the bytes
//! already in the pipes are sent. With `kill_group_on_exit` (`docker run` semantics) the
//! leader's exit ends the run the same way: the rest of its group is killed and `Exit`
//! follows the bytes already in the pipes, whoever else still holds them open.
//!
//! A `tty` exec has one output, the terminal's master, whose end of file is the `EIO` a read
//! gets once every slave descriptor is closed; `Resize` frames set its size and `StdinEof`
//! types its end-of-file character.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use bulkhead_protocol::frame::encode_raw;
use bulkhead_protocol::{
    ErrorCode, ExecRequest, ExitStatus, Frame, FrameDecoder, FrameType, Started, DATA_CHUNK,
};

use crate::conn::Conn;
use crate::log;
use crate::oom;
use crate::pty;
use crate::reaper::ExitWatch;
use crate::spawn::{self, Outcome, Spawned};

/// Output bytes queued for the host above which the agent stops reading the output pipes.
pub const OUT_HIGH_WATER: usize = 256 * 1024;

/// Grace period between SIGHUP and SIGKILL after the host disconnects (500 ms).
pub const HANGUP_GRACE: Duration = Duration::from_millis(500);

/// Bytes read from the connection at a time.
const CONN_READ: usize = 64 * 1024;

/// Output chunks read from one pipe per wakeup (4 × 16 KiB = a default pipe buffer).
const CHUNKS_PER_WAKEUP: usize = 4;

/// Bounds the final read of output after the group was killed (timeout or
/// `kill_group_on_exit`), so a writer that escaped the process group cannot keep the loop busy:
/// 64 chunks of 16 KiB = 1 MiB per pipe, the largest pipe buffer an unprivileged process can
/// ask for (`/proc/sys/fs/pipe-max-size`, pipe(7)), so whatever the group left in a pipe fits.
const DRAIN_CHUNKS: usize = 64;

/// Runs the command `req` for the host on `conn`, until it has exited (or the host is gone).
pub fn serve(conn: Conn, req: &ExecRequest) {
    let outcome = match spawn::spawn(req) {
        Ok(outcome) => outcome,
        Err(e) => return reply_once(conn, &[Frame::error(e.code(), e.to_string())]),
    };
    match outcome {
        Outcome::NotRunnable { code, message } => reply_once(
            conn,
            &[
                Frame::Stderr(message.into_bytes()),
                Frame::Exit(ExitStatus {
                    code: Some(code),
                    signal: None,
                    timed_out: false,
                    oom_killed: false,
                }),
            ],
        ),
        Outcome::Running(child) => {
            oom::forget(child.pid as u32);
            let deadline = req
                .timeout_ms
                .map(|ms| Instant::now() + Duration::from_millis(ms));
            match ExecLoop::new(conn, child, deadline, req.kill_group_on_exit) {
                Ok(exec) => exec.run(),
                Err(e) => log!("exec: preparing the event loop: {e}"),
            }
        }
    }
}

/// Sends `frames` with blocking writes, ignoring a vanished host.
fn reply_once(mut conn: Conn, frames: &[Frame]) {
    for frame in frames {
        if bulkhead_protocol::write_frame(&mut conn, frame).is_err() {
            return;
        }
    }
}

/// Sends `signo` to every process in group `pgid`; a group that no longer exists is fine.
fn kill_group(pgid: libc::pid_t, signo: libc::c_int) {
    // SAFETY: kill(2) takes no pointers; a negative pid addresses the process group.
    unsafe { libc::kill(-pgid, signo) };
}

fn set_nonblocking(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: fcntl(2) with F_GETFL/F_SETFL on a descriptor we own; no pointers.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Converts a raw wait status to the protocol's [`ExitStatus`].
pub fn exit_status(raw: libc::c_int, timed_out: bool) -> ExitStatus {
    let (code, signal) = if libc::WIFEXITED(raw) {
        (Some(libc::WEXITSTATUS(raw)), None)
    } else if libc::WIFSIGNALED(raw) {
        (None, Some(libc::WTERMSIG(raw)))
    } else {
        (None, None)
    };
    ExitStatus {
        code,
        signal,
        timed_out,
        oom_killed: false,
    }
}

/// Bytes waiting to be sent to the host.
#[derive(Debug, Default)]
struct OutQueue {
    buf: Vec<u8>,
    sent: usize,
}

impl OutQueue {
    fn len(&self) -> usize {
        self.buf.len() - self.sent
    }

    fn push(&mut self, kind: FrameType, payload: &[u8]) {
        // Payloads here are at most DATA_CHUNK bytes, far below MAX_FRAME.
        let _ = encode_raw(kind, payload, &mut self.buf);
    }

    fn push_frame(&mut self, frame: &Frame) {
        let _ = frame.encode_into(&mut self.buf);
    }

    /// Sends what the socket takes now. `Err` means the host is gone.
    fn flush(&mut self, conn: &Conn) -> io::Result<()> {
        while self.len() > 0 {
            match conn.send_nonblocking(&self.buf[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if self.sent == self.buf.len() {
            self.buf.clear();
            self.sent = 0;
        }
        Ok(())
    }
}

/// The command's stdin: our write end and the bytes it has not taken yet.
#[derive(Debug)]
struct StdinPipe {
    pipe: std::fs::File,
    pending: Vec<u8>,
    close_when_drained: bool,
}

/// One output pipe and the frame type its bytes travel in.
#[derive(Debug)]
struct OutputPipe {
    pipe: std::fs::File,
    kind: FrameType,
}

/// Why the loop stopped early.
#[derive(Debug)]
enum Abort {
    /// The connection ended or failed (what was seen).
    HostGone(String),
    /// The host sent something that does not belong in an exec.
    Protocol(String),
}

/// Tags for the pollfd slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Conn,
    Stdin,
    Output(usize),
    Exit,
}

/// State of one running exec.
#[derive(Debug)]
struct ExecLoop {
    conn: Conn,
    decoder: FrameDecoder,
    read_buf: Vec<u8>,
    out: OutQueue,
    stdin: Option<StdinPipe>,
    outputs: [Option<OutputPipe>; 2],
    /// The terminal's master of a `tty` exec.
    terminal: Option<OwnedFd>,
    exit: ExitWatch,
    status: Option<libc::c_int>,
    pgid: libc::pid_t,
    deadline: Option<Instant>,
    timed_out: bool,
    /// End the run when the leader has been reaped (see [`ExecRequest::kill_group_on_exit`]).
    kill_group_on_exit: bool,
}

impl ExecLoop {
    fn new(
        conn: Conn,
        child: Spawned,
        deadline: Option<Instant>,
        kill_group_on_exit: bool,
    ) -> io::Result<Self> {
        let output = |fd: OwnedFd, kind| -> io::Result<OutputPipe> {
            set_nonblocking(&fd)?;
            Ok(OutputPipe {
                pipe: fd.into(),
                kind,
            })
        };
        let stdin = match child.stdin {
            Some(fd) => {
                set_nonblocking(&fd)?;
                Some(StdinPipe {
                    pipe: fd.into(),
                    pending: Vec::new(),
                    close_when_drained: false,
                })
            }
            None => None,
        };
        let mut out = OutQueue::default();
        out.push_frame(&Frame::Started(Started {
            pid: child.pid as u32,
        }));
        Ok(Self {
            conn,
            decoder: FrameDecoder::new(),
            read_buf: vec![0u8; CONN_READ],
            out,
            stdin,
            outputs: [
                Some(output(child.stdout, FrameType::Stdout)?),
                child
                    .stderr
                    .map(|fd| output(fd, FrameType::Stderr))
                    .transpose()?,
            ],
            terminal: child.terminal,
            exit: child.exit,
            status: None,
            pgid: child.pid,
            deadline,
            timed_out: false,
            kill_group_on_exit,
        })
    }

    fn run(mut self) {
        while !self.finished() {
            if let Err(abort) = self.step() {
                return self.abandon(abort);
            }
        }
        let raw = self.status.unwrap_or(0);
        let mut status = exit_status(raw, self.timed_out);
        // A `SIGKILL` the agent sent for a timeout is not the OOM killer's.
        status.oom_killed = !self.timed_out
            && status.signal == Some(libc::SIGKILL)
            && oom::was_killed(self.pgid as u32);
        self.out.push_frame(&Frame::Exit(status));
        self.flush_blocking();
    }

    /// True once `Exit` may be queued: the leader has been reaped and either both pipes are at
    /// end of file, or the group is dead (timeout, or killed here for `kill_group_on_exit`) and
    /// the output already in the pipes has been taken. Not a pure query: with
    /// `kill_group_on_exit` the first call after the leader's reaping kills the group.
    ///
    /// The group is signalled after its leader was reaped. While any process of the group is
    /// left, Linux does not hand its pgid out as a new pid, so the signal reaches only this
    /// group; an empty group just gets `ESRCH` (unless the pid counter wrapped around in between,
    /// the same window a late `Signal` frame has).
    fn finished(&mut self) -> bool {
        if self.status.is_none() {
            return false;
        }
        if !(self.timed_out || self.kill_group_on_exit) {
            return self.outputs.iter().all(Option::is_none);
        }
        if !self.timed_out {
            // The timeout already killed the group; here the leader's exit does.
            kill_group(self.pgid, libc::SIGKILL);
        }
        self.drain_outputs();
        true
    }

    /// One poll and the work it reveals.
    fn step(&mut self) -> Result<(), Abort> {
        let (mut fds, slots) = self.poll_set();
        let timeout = self.poll_timeout();
        // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfds.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(Abort::Protocol(format!("poll: {e}")));
        }
        self.check_deadline();
        for (pfd, slot) in fds.iter().zip(slots) {
            if pfd.revents != 0 {
                self.handle(slot, pfd.revents)?;
            }
        }
        Ok(())
    }

    fn poll_set(&self) -> (Vec<libc::pollfd>, Vec<Slot>) {
        let mut fds = Vec::with_capacity(5);
        let mut slots = Vec::with_capacity(5);
        let mut add = |fd: libc::c_int, events: libc::c_short, slot| {
            fds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
            slots.push(slot);
        };
        let stdin_busy = self.stdin.as_ref().is_some_and(|s| !s.pending.is_empty());
        let mut conn_events = if stdin_busy { 0 } else { libc::POLLIN };
        if self.out.len() > 0 {
            conn_events |= libc::POLLOUT;
        }
        add(self.conn.as_raw_fd(), conn_events, Slot::Conn);
        if let Some(stdin) = self.stdin.as_ref().filter(|s| !s.pending.is_empty()) {
            add(stdin.pipe.as_raw_fd(), libc::POLLOUT, Slot::Stdin);
        }
        if self.out.len() < OUT_HIGH_WATER {
            for (i, output) in self.outputs.iter().enumerate() {
                if let Some(o) = output {
                    add(o.pipe.as_raw_fd(), libc::POLLIN, Slot::Output(i));
                }
            }
        }
        if self.status.is_none() {
            add(self.exit.as_raw_fd(), libc::POLLIN, Slot::Exit);
        }
        (fds, slots)
    }

    /// Milliseconds until the deadline (rounded up), or -1 (no limit).
    fn poll_timeout(&self) -> libc::c_int {
        match self.deadline {
            Some(deadline) if !self.timed_out => {
                let left = deadline.saturating_duration_since(Instant::now());
                let ms = left.as_nanos().div_ceil(1_000_000);
                ms.min(i32::MAX as u128) as libc::c_int
            }
            _ => -1,
        }
    }

    fn check_deadline(&mut self) {
        if self.timed_out || self.deadline.is_none_or(|d| Instant::now() < d) {
            return;
        }
        kill_group(self.pgid, libc::SIGKILL);
        self.timed_out = true;
    }

    fn handle(&mut self, slot: Slot, revents: libc::c_short) -> Result<(), Abort> {
        match slot {
            Slot::Conn => {
                if revents & libc::POLLOUT != 0 {
                    self.out
                        .flush(&self.conn)
                        .map_err(|e| Abort::HostGone(format!("sending: {e}")))?;
                }
                if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.read_conn()?;
                }
            }
            Slot::Stdin => self.write_stdin(),
            Slot::Output(i) => {
                for _ in 0..CHUNKS_PER_WAKEUP {
                    if !self.read_output(i) || self.out.len() >= OUT_HIGH_WATER {
                        break;
                    }
                }
            }
            Slot::Exit => self.status = Some(self.exit.read_status().unwrap_or(0)),
        }
        Ok(())
    }

    fn read_conn(&mut self) -> Result<(), Abort> {
        match self.conn.recv_nonblocking(&mut self.read_buf) {
            Ok(0) => return Err(Abort::HostGone("end of stream".into())),
            Ok(n) => self.decoder.push(&self.read_buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(Abort::HostGone(format!("receiving: {e}"))),
        }
        loop {
            match self.decoder.next_frame() {
                Ok(Some(frame)) => self.on_host_frame(frame)?,
                Ok(None) => break,
                Err(e) => return Err(Abort::Protocol(e.to_string())),
            }
        }
        self.write_stdin();
        Ok(())
    }

    fn on_host_frame(&mut self, frame: Frame) -> Result<(), Abort> {
        match frame {
            Frame::Stdin(bytes) => {
                if let Some(stdin) = self.stdin.as_mut().filter(|s| !s.close_when_drained) {
                    stdin.pending.extend_from_slice(&bytes);
                }
            }
            Frame::StdinEof => match (self.stdin.as_mut(), &self.terminal) {
                // A terminal's input does not end; end of file is a character typed.
                (Some(stdin), Some(master)) => stdin.pending.push(pty::eof_char(master)),
                (Some(stdin), None) => stdin.close_when_drained = true,
                (None, _) => {}
            },
            Frame::Resize(size) => {
                if let Some(master) = &self.terminal {
                    if let Err(e) = pty::resize(master, size) {
                        log!("exec pid {}: resizing its terminal: {e}", self.pgid);
                    }
                }
            }
            Frame::Signal(s) if (1..=64).contains(&s.signo) => kill_group(self.pgid, s.signo),
            Frame::Signal(_) => {} // invalid signal numbers are ignored
            other => {
                return Err(Abort::Protocol(format!(
                    "unexpected {} frame during an exec",
                    other.kind()
                )))
            }
        }
        Ok(())
    }

    /// Moves pending stdin bytes into the pipe; closes it when drained after `StdinEof`, or
    /// when the command no longer reads it (EPIPE).
    fn write_stdin(&mut self) {
        let Some(stdin) = self.stdin.as_mut() else {
            return;
        };
        let mut written = 0;
        let mut broken = false;
        while written < stdin.pending.len() {
            match stdin.pipe.write(&stdin.pending[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    broken = true;
                    break;
                }
            }
        }
        stdin.pending.drain(..written);
        if broken || (stdin.close_when_drained && stdin.pending.is_empty()) {
            self.stdin = None;
        }
    }

    /// Reads one chunk of output and queues it; closes the pipe at end of file. True when a
    /// full chunk was read (more may be waiting).
    fn read_output(&mut self, i: usize) -> bool {
        let Some(output) = self.outputs[i].as_mut() else {
            return false;
        };
        let mut buf = [0u8; DATA_CHUNK];
        match output.pipe.read(&mut buf) {
            Ok(0) => self.outputs[i] = None,
            Ok(n) => {
                self.out.push(output.kind, &buf[..n]);
                return n == buf.len();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => self.outputs[i] = None,
        }
        false
    }

    /// After the group was killed: takes what is already in the pipes (until they are empty, at
    /// end of file, or [`DRAIN_CHUNKS`] were read), without waiting for more.
    fn drain_outputs(&mut self) {
        for i in 0..self.outputs.len() {
            for _ in 0..DRAIN_CHUNKS {
                if !self.read_output(i) {
                    break;
                }
            }
        }
    }

    /// Sends the rest of the queue, waiting for the socket as needed.
    fn flush_blocking(&mut self) {
        while self.out.len() > 0 {
            if self.out.flush(&self.conn).is_err() {
                return;
            }
            if self.out.len() == 0 {
                return;
            }
            let mut pfd = libc::pollfd {
                fd: self.conn.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd, exclusively borrowed for the call.
            let rc = unsafe { libc::poll(&mut pfd, 1, -1) };
            if rc > 0 && pfd.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
                return;
            }
        }
    }

    /// The host is gone (or broke the protocol): hang up the command's group, give it
    /// [`HANGUP_GRACE`] to exit, then kill whatever is left of the group.
    fn abandon(mut self, abort: Abort) {
        match &abort {
            Abort::Protocol(reason) => {
                log!(
                    "exec pid {}: {reason}; killing its process group",
                    self.pgid
                );
                self.out
                    .push_frame(&Frame::error(ErrorCode::Protocol, reason.clone()));
                let _ = self.out.flush(&self.conn);
            }
            Abort::HostGone(seen) => log!(
                "exec pid {}: host connection lost ({seen}); hanging up its process group",
                self.pgid
            ),
        }
        kill_group(self.pgid, libc::SIGHUP);
        kill_group(self.pgid, libc::SIGCONT);
        if self.status.is_none() {
            self.wait_exit(HANGUP_GRACE.as_millis() as libc::c_int);
        }
        kill_group(self.pgid, libc::SIGKILL);
        if self.status.is_none() {
            self.wait_exit(-1);
        }
        self.conn.shutdown();
    }

    /// Waits up to `timeout_ms` (-1: no limit) for the leader's status.
    fn wait_exit(&mut self, timeout_ms: libc::c_int) {
        let mut pfd = libc::pollfd {
            fd: self.exit.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd, exclusively borrowed for the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc > 0 {
            self.status = self.exit.read_status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_statuses_map_to_code_or_signal() {
        // Arrange: encodings from wait(2): exit code in bits 8..16, signal in bits 0..7.
        let exited_7 = 7 << 8;
        let killed_9 = 9;

        // Act
        let a = exit_status(exited_7, false);
        let b = exit_status(killed_9, true);

        // Assert
        assert_eq!((a.code, a.signal, a.timed_out), (Some(7), None, false));
        assert_eq!((b.code, b.signal, b.timed_out), (None, Some(9), true));
    }
}

//! One running command: its stdin/signal side ([`ExecWriter`]) and its output side
//! ([`ExecReader`]).

use std::io::{BufReader, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{classify, ClientError};
use crate::frame::{encode_raw, read_frame, write_frame, Frame, FrameType};
use crate::messages::{ExecRequest, ExitStatus, SignalRequest, WindowSize};
use crate::DATA_CHUNK;

/// Something the command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// Bytes the command wrote to stdout, exactly as written (no decoding, no line buffering).
    Stdout(Vec<u8>),
    /// Bytes the command wrote to stderr.
    Stderr(Vec<u8>),
    /// The command ended; always the last event.
    Exit(ExitStatus),
}

/// Everything a finished command produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// All stdout bytes.
    pub stdout: Vec<u8>,
    /// All stderr bytes.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub status: ExitStatus,
}

/// A started command. Use [`ExecSession::split`] to feed stdin from one thread while another
/// reads the output: the agent stops reading the connection while the command does not
/// consume its stdin, so one thread doing both can deadlock.
#[derive(Debug)]
pub struct ExecSession {
    pid: Option<u32>,
    writer: ExecWriter,
    reader: ExecReader,
}

impl ExecSession {
    /// Sends `request` on `stream`, an idle connection to the agent (from
    /// [`AgentClient::connect`](super::AgentClient::connect)), and waits for the agent's first
    /// answer: what [`AgentClient::exec`](super::AgentClient::exec) does on a connection it
    /// opens itself.
    pub fn start(stream: UnixStream, request: &ExecRequest) -> Result<Self, ClientError> {
        write_frame(&mut &stream, &Frame::Exec(request.clone())).map_err(classify)?;
        let read_half = stream.try_clone()?;
        let mut reader = ExecReader {
            stream: BufReader::with_capacity(64 * 1024, read_half),
            pending: None,
            done: false,
        };
        let pid = match read_frame(&mut reader.stream).map_err(classify)? {
            Some(Frame::Started(s)) => Some(s.pid),
            Some(Frame::Error(e)) => return Err(ClientError::Agent(e)),
            Some(other) => {
                reader.pending = Some(event_of(other)?);
                None
            }
            None => return Err(ClientError::Closed("starting the command")),
        };
        // The command may run for as long as it likes; its own timeout_ms bounds it.
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let control = Arc::new(stream.try_clone()?);
        let writer = ExecWriter {
            stream: Arc::new(Mutex::new(stream)),
            control,
        };
        Ok(Self {
            pid,
            writer,
            reader,
        })
    }

    /// Guest pid (= process group id) of the command; `None` when it could not be started
    /// (the events then carry the reason on stderr and exit code 126/127).
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// A handle for stdin and signals; clones share the connection.
    pub fn writer(&self) -> ExecWriter {
        self.writer.clone()
    }

    /// Separates the stdin/signal side from the output side, e.g. to use them on two threads.
    pub fn split(self) -> (ExecWriter, ExecReader) {
        (self.writer, self.reader)
    }

    /// The next output event; `Ok(None)` after the `Exit` event.
    pub fn next_event(&mut self) -> Result<Option<ExecEvent>, ClientError> {
        self.reader.next_event()
    }

    /// Reads all output until the command exits. With `stdin: true` in the request, close
    /// stdin first (or split the session) so the command can finish.
    pub fn wait_with_output(self) -> Result<ExecOutput, ClientError> {
        self.reader.collect_output()
    }
}

/// The host → guest side of a command: stdin and signals. Clones share one connection, and
/// each frame is written whole under a lock, so clones may be used from several threads.
#[derive(Debug, Clone)]
pub struct ExecWriter {
    stream: Arc<Mutex<UnixStream>>,
    /// A second handle on the same connection, for [`ExecWriter::disconnect`]: shutting down
    /// must not wait for the lock, which a write blocked on a command that does not read its
    /// stdin (or on a stalled guest) can hold indefinitely.
    control: Arc<UnixStream>,
}

impl ExecWriter {
    /// Sends `bytes` to the command's stdin (in frames of at most [`DATA_CHUNK`] bytes).
    /// Blocks while the command does not read. Without `stdin: true` in the request the agent
    /// drops these bytes.
    pub fn write_stdin(&self, bytes: &[u8]) -> Result<(), ClientError> {
        let mut buf = Vec::with_capacity(DATA_CHUNK.min(bytes.len()) + 8);
        for chunk in bytes.chunks(DATA_CHUNK) {
            buf.clear();
            encode_raw(FrameType::Stdin, chunk, &mut buf)?;
            self.send_bytes(&buf)?;
        }
        Ok(())
    }

    /// Closes the command's stdin (it reads end of file once the bytes sent so far are read).
    pub fn close_stdin(&self) -> Result<(), ClientError> {
        self.send(&Frame::StdinEof)
    }

    /// Delivers signal `signo` (e.g. 15 for SIGTERM) to the command's process group.
    pub fn signal(&self, signo: i32) -> Result<(), ClientError> {
        self.send(&Frame::Signal(SignalRequest { signo }))
    }

    /// Tells the agent that the terminal of a `tty` exec is now `size` (a `Resize` frame; the
    /// guest's foreground process group gets `SIGWINCH` from its kernel).
    pub fn resize(&self, size: WindowSize) -> Result<(), ClientError> {
        self.send(&Frame::Resize(size))
    }

    /// Drops the connection in both directions. The agent then sends SIGHUP and, shortly
    /// after, SIGKILL to the command's process group. Never blocks: a [`write_stdin`] blocked
    /// on the same connection (from another clone) fails, and a reader blocked on it sees the
    /// end of the stream.
    ///
    /// [`write_stdin`]: ExecWriter::write_stdin
    pub fn disconnect(&self) -> Result<(), ClientError> {
        self.control.shutdown(Shutdown::Both)?;
        Ok(())
    }

    fn send(&self, frame: &Frame) -> Result<(), ClientError> {
        self.send_bytes(&frame.encode()?)
    }

    fn send_bytes(&self, bytes: &[u8]) -> Result<(), ClientError> {
        let mut stream = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        stream.write_all(bytes).map_err(|e| classify(e.into()))
    }
}

/// The guest → host side of a command: its output events until `Exit`. Also an iterator.
#[derive(Debug)]
pub struct ExecReader {
    stream: BufReader<UnixStream>,
    pending: Option<ExecEvent>,
    done: bool,
}

impl ExecReader {
    /// Bounds each wait for the next event. There is none by default, as a command may stay
    /// silent for as long as it runs; a caller that knows how long silence may last (a
    /// benchmark running `true`, a health check) sets one so that a guest that stopped
    /// answering ends the session with [`ClientError::Timeout`] instead of a wait without end.
    /// `None` removes the bound; a zero duration is raised to 1 ms.
    ///
    /// # Errors
    /// [`ClientError::Io`] when the socket option cannot be set.
    pub fn set_event_timeout(&self, timeout: Option<Duration>) -> Result<(), ClientError> {
        let timeout = timeout.map(|t| t.max(Duration::from_millis(1)));
        self.stream.get_ref().set_read_timeout(timeout)?;
        Ok(())
    }

    /// The next output event; `Ok(None)` after the `Exit` event. The connection ending before
    /// `Exit` is [`ClientError::Closed`]; an `Error` frame is [`ClientError::Agent`].
    pub fn next_event(&mut self) -> Result<Option<ExecEvent>, ClientError> {
        if self.done {
            return Ok(None);
        }
        let event = match self.pending.take() {
            Some(event) => event,
            None => match read_frame(&mut self.stream) {
                Ok(Some(frame)) => event_of(frame).inspect_err(|_| self.done = true)?,
                Ok(None) => {
                    self.done = true;
                    return Err(ClientError::Closed("the command's exit status"));
                }
                Err(e) => {
                    self.done = true;
                    return Err(classify(e));
                }
            },
        };
        self.done = matches!(event, ExecEvent::Exit(_));
        Ok(Some(event))
    }

    /// Reads all remaining output until the command exits.
    pub fn collect_output(mut self) -> Result<ExecOutput, ClientError> {
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        loop {
            match self.next_event()? {
                Some(ExecEvent::Stdout(b)) => stdout.extend_from_slice(&b),
                Some(ExecEvent::Stderr(b)) => stderr.extend_from_slice(&b),
                Some(ExecEvent::Exit(status)) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        status,
                    })
                }
                None => return Err(ClientError::Closed("the command's exit status")),
            }
        }
    }
}

impl Iterator for ExecReader {
    type Item = Result<ExecEvent, ClientError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_event().transpose()
    }
}

fn event_of(frame: Frame) -> Result<ExecEvent, ClientError> {
    match frame {
        Frame::Stdout(b) => Ok(ExecEvent::Stdout(b)),
        Frame::Stderr(b) => Ok(ExecEvent::Stderr(b)),
        Frame::Exit(status) => Ok(ExecEvent::Exit(status)),
        Frame::Error(e) => Err(ClientError::Agent(e)),
        other => Err(ClientError::Unexpected {
            expected: "Stdout, Stderr, Exit or Error",
            got: other.kind(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::thread;

    use super::*;
    use crate::messages::Started;

    /// A started session whose fake agent answers the request and then never reads again;
    /// returns the session and the agent's end of the connection (kept open by the caller).
    fn session_with_a_deaf_agent() -> (ExecSession, UnixStream) {
        let (client, mut agent) = UnixStream::pair().unwrap();
        let answer = thread::spawn(move || {
            read_frame(&mut agent).unwrap().unwrap();
            write_frame(&mut agent, &Frame::Started(Started { pid: 7 })).unwrap();
            agent
        });
        let session = ExecSession::start(client, &ExecRequest::new(["cat"])).unwrap();
        (session, answer.join().unwrap())
    }

    #[test]
    fn disconnect_does_not_wait_for_a_stdin_write_blocked_on_a_command_that_does_not_read() {
        // Arrange: a stdin write that fills the socket buffers and blocks, holding the lock.
        let (session, _agent) = session_with_a_deaf_agent();
        let (writer, _reader) = session.split();
        let blocked = writer.clone();
        let (wrote, write_result) = mpsc::channel();
        thread::spawn(move || {
            let _ = wrote.send(blocked.write_stdin(&vec![b'x'; 16 << 20]));
        });
        let still_blocked = write_result.recv_timeout(Duration::from_millis(200));
        assert!(
            still_blocked.is_err(),
            "the write should block: {still_blocked:?}"
        );

        // Act: disconnect from another thread (a hang here would fail the bounded wait below).
        let (disconnected, disconnect_result) = mpsc::channel();
        thread::spawn(move || {
            let _ = disconnected.send(writer.disconnect());
        });
        let disconnect = disconnect_result.recv_timeout(Duration::from_secs(30));
        let write = write_result.recv_timeout(Duration::from_secs(30));

        // Assert
        assert!(matches!(disconnect, Ok(Ok(()))), "{disconnect:?}");
        assert!(
            matches!(write, Ok(Err(_))),
            "the blocked write must fail: {write:?}"
        );
    }

    #[test]
    fn a_silent_agent_ends_the_session_with_a_timeout_once_an_event_timeout_is_set() {
        // Arrange: the command started, then the agent says nothing more (a stalled guest).
        let (session, _agent) = session_with_a_deaf_agent();
        let (_writer, mut reader) = session.split();
        reader
            .set_event_timeout(Some(Duration::from_millis(50)))
            .unwrap();

        // Act
        let event = reader.next_event();

        // Assert
        assert!(matches!(event, Err(ClientError::Timeout)), "{event:?}");
        assert!(matches!(reader.next_event(), Ok(None)));
    }
}

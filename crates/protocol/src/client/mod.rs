//! Host-side client for the agent, blocking and `std`-only (plus `libc::poll` for the
//! ready handshake's timeout).
//!
//! ```no_run
//! use std::time::Duration;
//! use bulkhead_protocol::client::AgentClient;
//! use bulkhead_protocol::ExecRequest;
//!
//! let client = AgentClient::hybrid("/run/bulkhead/vm1/vsock.sock");
//! let out = client.exec(&ExecRequest::new(["uname", "-a"]))?.wait_with_output()?;
//! println!("{}", String::from_utf8_lossy(&out.stdout));
//! # Ok::<(), bulkhead_protocol::client::ClientError>(())
//! ```

mod exec;
mod files;
mod hybrid;
mod ready;
mod workspace;

use std::io::{self, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use exec::{ExecEvent, ExecOutput, ExecReader, ExecSession, ExecWriter};
pub use files::{ARCHIVE_TIMEOUT, MAX_LIST_ENTRIES};
pub use hybrid::connect_hybrid;
pub use ready::accept_ready;
pub use workspace::{ChangeEvent, ChangeStream, CHANGES_READ_TIMEOUT};

use crate::frame::{encode_raw, read_frame, write_frame, Frame, FrameError, FrameType};
use crate::messages::{
    ConnectRequest, ErrorMessage, ExecRequest, FileReadRequest, FileWriteRequest, RestoredRequest,
    ShutdownRequest,
};
use crate::{AGENT_PORT, DATA_CHUNK, PROTOCOL_VERSION};

/// Default bound on connecting and on each blocking read or write of a request (10 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the host-side client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The Unix socket could not be connected (no VMM there, or it refused).
    #[error("connect to {}: {source}", path.display())]
    Connect {
        /// Socket path tried.
        path: PathBuf,
        /// What connect(2) reported.
        source: io::Error,
    },
    /// The VMM closed the connection before answering `OK`: usually nothing listens on that
    /// guest port (yet).
    #[error("the VMM closed the connection after CONNECT {port}: is the guest listening on that vsock port?")]
    HandshakeClosed {
        /// Guest port asked for.
        port: u32,
    },
    /// The VMM answered something other than `OK <port>`.
    #[error("unexpected reply to CONNECT: {0:?} (expected \"OK <port>\")")]
    HandshakeGarbage(String),
    /// The peer did not answer within the timeout.
    #[error("timed out waiting for the agent")]
    Timeout,
    /// A frame could not be read or written.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The agent answered with an `Error` frame (its class in `code`).
    #[error("agent: {}", .0.message)]
    Agent(ErrorMessage),
    /// The agent sent a frame that does not belong at this point of the sequence.
    #[error("protocol violation: expected {expected}, got a {got} frame")]
    Unexpected {
        /// What the sequence allows here.
        expected: &'static str,
        /// Type of the frame that came.
        got: FrameType,
    },
    /// The connection ended before the sequence was complete.
    #[error("the agent closed the connection before {0}")]
    Closed(&'static str),
    /// The agent speaks another protocol version.
    #[error("agent speaks protocol version {agent}, this host speaks {host}")]
    VersionMismatch {
        /// Version the agent announced.
        agent: u32,
        /// [`PROTOCOL_VERSION`].
        host: u32,
    },
    /// Other I/O failure.
    #[error("agent connection: {0}")]
    Io(#[from] io::Error),
}

/// Maps a timed-out read/write to [`ClientError::Timeout`].
fn classify(err: FrameError) -> ClientError {
    match err {
        FrameError::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            ClientError::Timeout
        }
        other => ClientError::Frame(other),
    }
}

/// How to reach the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// Through the VMM's hybrid vsock Unix socket, then `CONNECT <port>`.
    Hybrid {
        /// The VM's vsock Unix socket.
        uds_path: PathBuf,
        /// Guest port, normally [`AGENT_PORT`].
        port: u32,
    },
    /// Straight to a Unix socket the agent listens on (`bulkhead-agent --listen-unix PATH`).
    Unix(PathBuf),
}

/// A handle on one VM's agent. Cheap: every call opens its own connection, so calls may run
/// concurrently from several threads (share it with `&` or clone it).
#[derive(Debug, Clone)]
pub struct AgentClient {
    endpoint: Endpoint,
    timeout: Duration,
}

impl AgentClient {
    /// A client for the agent behind the VM's hybrid vsock socket, on [`AGENT_PORT`].
    pub fn hybrid(uds_path: impl Into<PathBuf>) -> Self {
        Self::new(Endpoint::Hybrid {
            uds_path: uds_path.into(),
            port: AGENT_PORT,
        })
    }

    /// A client for an agent in test mode listening on the Unix socket `path`.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        Self::new(Endpoint::Unix(path.into()))
    }

    /// A client for `endpoint` with [`DEFAULT_TIMEOUT`].
    pub fn new(endpoint: Endpoint) -> Self {
        Self {
            endpoint,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Bounds connecting and each blocking read or write of a request (not the wait for a
    /// command's output, which only the command's `timeout_ms` bounds). Zero is raised to 1 ms.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// See [`connect_hybrid`].
    pub fn connect_hybrid(
        uds_path: &Path,
        port: u32,
        timeout: Duration,
    ) -> Result<UnixStream, ClientError> {
        connect_hybrid(uds_path, port, timeout)
    }

    /// Opens a new connection to the agent, with read and write timeouts set to the client's.
    pub fn connect(&self) -> Result<UnixStream, ClientError> {
        let stream = match &self.endpoint {
            Endpoint::Hybrid { uds_path, port } => connect_hybrid(uds_path, *port, self.timeout)?,
            Endpoint::Unix(path) => {
                UnixStream::connect(path).map_err(|source| ClientError::Connect {
                    path: path.clone(),
                    source,
                })?
            }
        };
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        Ok(stream)
    }

    /// Connects to TCP `port` on the guest's `127.0.0.1` (ingress, [`ConnectRequest`]) and
    /// returns the stream once the agent is connected: from then on its bytes are the TCP
    /// connection's, both ways (shut down its write side to end the host → guest direction; the
    /// guest's end shows as end of file). The stream has no timeouts. Nothing listening on the
    /// port is [`ClientError::Agent`] with [`ErrorCode::NotFound`](crate::ErrorCode::NotFound).
    pub fn connect_tcp(&self, port: u16) -> Result<UnixStream, ClientError> {
        let mut stream = self.connect()?;
        let request = Frame::Connect(ConnectRequest { port });
        write_frame(&mut stream, &request).map_err(classify)?;
        match read_frame(&mut stream).map_err(classify)? {
            Some(Frame::Ack(_)) => {}
            Some(Frame::Error(e)) => return Err(ClientError::Agent(e)),
            Some(other) => {
                return Err(ClientError::Unexpected {
                    expected: "Ack or Error",
                    got: other.kind(),
                })
            }
            None => return Err(ClientError::Closed("answering a connect")),
        }
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        Ok(stream)
    }

    /// Starts a command. Returns once the agent has started it (or reported that it could not
    /// run it: a missing program is not an error here but an exit with code 127 and a message
    /// on stderr, as from a shell). A request the agent rejects is [`ClientError::Agent`].
    pub fn exec(&self, request: &ExecRequest) -> Result<ExecSession, ClientError> {
        let stream = self.connect()?;
        ExecSession::start(stream, request)
    }

    /// Writes `contents` to the guest file `path` (absolute) with permission bits `mode`;
    /// returns the bytes written.
    pub fn write_file(&self, path: &str, mode: u32, contents: &[u8]) -> Result<u64, ClientError> {
        self.write_file_from(path, mode, &mut &contents[..])
    }

    /// Like [`Self::write_file`], streaming the contents from `source`.
    pub fn write_file_from(
        &self,
        path: &str,
        mode: u32,
        source: &mut impl Read,
    ) -> Result<u64, ClientError> {
        let mut stream = self.connect()?;
        let request = Frame::FileWrite(FileWriteRequest {
            version: PROTOCOL_VERSION,
            path: path.to_owned(),
            mode,
        });
        if let Err(e) = send_file_body(&mut stream, &request, source) {
            // The agent may have answered with an Error and closed: prefer its reason.
            return Err(agent_reason(&mut stream).unwrap_or(e));
        }
        match read_frame(&mut stream).map_err(classify)? {
            Some(Frame::Ack(ack)) => Ok(ack.bytes),
            Some(Frame::Error(e)) => Err(ClientError::Agent(e)),
            Some(other) => Err(ClientError::Unexpected {
                expected: "Ack or Error",
                got: other.kind(),
            }),
            None => Err(ClientError::Closed("acknowledging the file write")),
        }
    }

    /// Reads the whole guest file `path` (absolute, a regular file).
    pub fn read_file(&self, path: &str) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        self.read_file_into(path, &mut out)?;
        Ok(out)
    }

    /// Like [`Self::read_file`], streaming the contents into `sink`; returns the byte count.
    /// On error `sink` may hold a prefix of the file.
    pub fn read_file_into(&self, path: &str, sink: &mut impl Write) -> Result<u64, ClientError> {
        let stream = self.connect()?;
        let request = Frame::FileRead(FileReadRequest {
            version: PROTOCOL_VERSION,
            path: path.to_owned(),
        });
        write_frame(&mut &stream, &request).map_err(classify)?;
        let mut reader = BufReader::with_capacity(64 * 1024, stream);
        let mut total = 0u64;
        loop {
            match read_frame(&mut reader).map_err(classify)? {
                Some(Frame::Data(bytes)) => {
                    sink.write_all(&bytes)?;
                    total += bytes.len() as u64;
                }
                Some(Frame::End) => return Ok(total),
                Some(Frame::Error(e)) => return Err(ClientError::Agent(e)),
                Some(other) => {
                    return Err(ClientError::Unexpected {
                        expected: "Data, End or Error",
                        got: other.kind(),
                    })
                }
                None => return Err(ClientError::Closed("the end of the file")),
            }
        }
    }

    /// Asks the agent to sync and reboot the guest, which ends the VM. Succeeds on the agent's
    /// `Ack` and also when the connection just closes (the VM may be gone before the ack).
    pub fn shutdown(&self) -> Result<(), ClientError> {
        let mut stream = self.connect()?;
        let request = Frame::Shutdown(ShutdownRequest {
            version: PROTOCOL_VERSION,
        });
        write_frame(&mut stream, &request).map_err(classify)?;
        match read_frame(&mut stream) {
            Ok(Some(Frame::Ack(_)) | None) => Ok(()),
            Ok(Some(Frame::Error(e))) => Err(ClientError::Agent(e)),
            Ok(Some(other)) => Err(ClientError::Unexpected {
                expected: "Ack or Error",
                got: other.kind(),
            }),
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset => Ok(()),
            Err(e) => Err(classify(e)),
        }
    }

    /// Tells the agent that the VM was just restored from a snapshot (see [`RestoredRequest`]):
    /// it reseeds the guest's random number generator with `request.entropy`, sets the guest's
    /// wall clock and, when given, its hostname. Succeeds only on the agent's `Ack`, sent once
    /// all of that is done; an `Error` frame is [`ClientError::Agent`] (an agent older than this
    /// request answers with one of class [`crate::ErrorCode::Protocol`]), and a connection
    /// closed without an answer is [`ClientError::Closed`] (nothing says the guest changed).
    pub fn restored(&self, request: &RestoredRequest) -> Result<(), ClientError> {
        let mut stream = self.connect()?;
        write_frame(&mut stream, &Frame::Restored(request.clone())).map_err(classify)?;
        files::ack(stream, "acknowledging the restore")
    }

    /// Asks the agent to unmount its virtio-fs shares (`mounted: false`) or to mount again
    /// those it last unmounted (`mounted: true`; see [`crate::SharesRequest`]). Succeeds on the
    /// agent's `Ack`; an `Error` frame is [`ClientError::Agent`] (busy shares, or an agent older
    /// than this request: class [`crate::ErrorCode::Protocol`]).
    pub fn set_shares_mounted(&self, mounted: bool) -> Result<(), ClientError> {
        let mut stream = self.connect()?;
        let request = crate::SharesRequest {
            version: PROTOCOL_VERSION,
            mounted,
        };
        write_frame(&mut stream, &Frame::Shares(request)).map_err(classify)?;
        files::ack(stream, "changing the shares' mounts")
    }
}

/// Sends the FileWrite request, the contents as Data frames, and End.
fn send_file_body(
    stream: &mut UnixStream,
    request: &Frame,
    source: &mut impl Read,
) -> Result<(), ClientError> {
    let mut frame = Vec::with_capacity(DATA_CHUNK + 16);
    request.encode_into(&mut frame)?;
    let mut buf = vec![0u8; DATA_CHUNK];
    loop {
        let n = match source.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ClientError::Io(e)),
        };
        if n == 0 {
            break;
        }
        encode_raw(FrameType::Data, &buf[..n], &mut frame)?;
        stream.write_all(&frame).map_err(|e| classify(e.into()))?;
        frame.clear();
    }
    encode_raw(FrameType::End, &[], &mut frame)?;
    stream.write_all(&frame).map_err(|e| classify(e.into()))?;
    Ok(())
}

/// After a failed write: the agent's `Error` message, when it sent one.
fn agent_reason(stream: &mut UnixStream) -> Option<ClientError> {
    match read_frame(stream) {
        Ok(Some(Frame::Error(e))) => Some(ClientError::Agent(e)),
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::os::unix::net::UnixListener;
    use std::thread;

    use super::*;
    use crate::messages::Ack;
    use crate::ErrorCode;

    /// A fake agent on a Unix socket that answers one request with `frames`, then closes;
    /// its thread returns the request. Shared by the client modules' tests.
    pub(crate) fn fake_agent(
        frames: Vec<Frame>,
    ) -> (tempfile::TempDir, AgentClient, thread::JoinHandle<Frame>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let request = read_frame(&mut conn).unwrap().unwrap();
            for frame in &frames {
                write_frame(&mut conn, frame).unwrap();
            }
            request
        });
        (dir, AgentClient::unix(path), server)
    }

    fn restored_request() -> RestoredRequest {
        let mut request = RestoredRequest::new((0..32).collect(), 1_700_000_000_123_456_789);
        request.hostname = Some("clone-1".into());
        request
    }

    #[test]
    fn restored_sends_the_request_and_succeeds_on_ack() {
        // Arrange
        let (_dir, client, agent) = fake_agent(vec![Frame::Ack(Ack { bytes: 0 })]);
        let request = restored_request();

        // Act
        let result = client.restored(&request);

        // Assert
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(agent.join().unwrap(), Frame::Restored(request));
    }

    #[test]
    fn restored_fails_on_an_error_frame_with_the_agents_reason() {
        // Arrange
        let (_dir, client, _agent) = fake_agent(vec![Frame::error(
            ErrorCode::InvalidRequest,
            "entropy of 4 bytes",
        )]);

        // Act
        let result = client.restored(&restored_request());

        // Assert
        assert!(
            matches!(&result, Err(ClientError::Agent(e))
                if e.code == ErrorCode::InvalidRequest && e.message == "entropy of 4 bytes"),
            "{result:?}"
        );
    }

    #[test]
    fn restored_fails_when_the_agent_closes_without_an_answer() {
        // Arrange
        let (_dir, client, _agent) = fake_agent(Vec::new());

        // Act
        let result = client.restored(&restored_request());

        // Assert
        assert!(matches!(result, Err(ClientError::Closed(_))), "{result:?}");
    }

    #[test]
    fn restored_fails_on_a_frame_that_is_no_answer() {
        // Arrange
        let (_dir, client, _agent) = fake_agent(vec![Frame::End]);

        // Act
        let result = client.restored(&restored_request());

        // Assert
        assert!(
            matches!(
                result,
                Err(ClientError::Unexpected {
                    got: FrameType::End,
                    ..
                })
            ),
            "{result:?}"
        );
    }
}

//! An attached exec (`POST /v1/sandboxes/{id}/exec/attach`): stdin streamed for as long as
//! the caller likes, an optional terminal, over a connection upgraded to agent-protocol frames
//! (`docs/daemon.md`, `docs/agent-protocol.md`).

use bulkhead_protocol::{ExitStatus, Frame, FrameDecoder, SignalRequest, WindowSize, DATA_CHUNK};
use http_body_util::BodyExt;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};

use crate::exec::ExecEvent;
use crate::types::ExitInfo;
use crate::{api_error, Error};

/// Bytes read from the connection at a time.
const READ_CHUNK: usize = 64 * 1024;

type Io = TokioIo<Upgraded>;

/// The two halves of a running attached exec; use them from different tasks (a command that
/// does not read its stdin holds up [`AttachInput`] until it does, never the output).
#[derive(Debug)]
pub struct AttachedExec {
    /// The command's guest pid (also its process group and session).
    pub pid: u32,
    /// Stdin, signals and terminal size, to the command.
    pub input: AttachInput,
    /// The command's output and exit status.
    pub output: AttachOutput,
}

/// The caller → command half of an [`AttachedExec`].
#[derive(Debug)]
pub struct AttachInput {
    wr: WriteHalf<Io>,
}

/// The command → caller half of an [`AttachedExec`].
#[derive(Debug)]
pub struct AttachOutput {
    rd: ReadHalf<Io>,
    decoder: FrameDecoder,
    buf: Vec<u8>,
    done: bool,
}

impl AttachedExec {
    /// Takes over the upgraded connection of a `101` answer: reads the `Started` frame.
    pub(crate) async fn start(
        response: hyper::Response<hyper::body::Incoming>,
    ) -> Result<Self, Error> {
        let status = response.status();
        if status != hyper::StatusCode::SWITCHING_PROTOCOLS {
            let body = response.into_body().collect().await?.to_bytes();
            return Err(api_error(status, &body));
        }
        let upgraded = hyper::upgrade::on(response).await?;
        let (rd, wr) = tokio::io::split(TokioIo::new(upgraded));
        let mut output = AttachOutput {
            rd,
            decoder: FrameDecoder::new(),
            buf: vec![0u8; READ_CHUNK],
            done: false,
        };
        let pid = match output.next_frame().await? {
            Some(Frame::Started(started)) => started.pid,
            Some(Frame::Error(e)) => return Err(Error::Decode(e.message)),
            other => return Err(unexpected(other.as_ref(), "Started")),
        };
        Ok(AttachedExec {
            pid,
            input: AttachInput { wr },
            output,
        })
    }
}

impl AttachInput {
    /// Sends `bytes` to the command's stdin (with a terminal: typed keys, `0x03` is Ctrl-C).
    /// Waits while the command does not read (back-pressure).
    pub async fn write_stdin(&mut self, bytes: &[u8]) -> Result<(), Error> {
        for chunk in bytes.chunks(DATA_CHUNK) {
            self.send(&Frame::Stdin(chunk.to_vec())).await?;
        }
        Ok(())
    }

    /// Ends the command's stdin (with a terminal: types its end-of-file character, `^D`).
    pub async fn close_stdin(&mut self) -> Result<(), Error> {
        self.send(&Frame::StdinEof).await
    }

    /// Sends signal `signo` (1..=64) to the command's process group.
    pub async fn signal(&mut self, signo: i32) -> Result<(), Error> {
        self.send(&Frame::Signal(SignalRequest { signo })).await
    }

    /// Sets the size of the command's terminal (its foreground process group gets `SIGWINCH`).
    pub async fn resize(&mut self, size: WindowSize) -> Result<(), Error> {
        self.send(&Frame::Resize(size)).await
    }

    /// Half-closes the connection: nothing more will be sent (after [`Self::close_stdin`]
    /// the output keeps coming; without it the daemon takes this as leaving and kills the
    /// command).
    pub async fn shutdown(&mut self) -> Result<(), Error> {
        self.wr.shutdown().await.map_err(io_error)
    }

    async fn send(&mut self, frame: &Frame) -> Result<(), Error> {
        let bytes = frame
            .encode()
            .map_err(|e| Error::Decode(format!("encoding a frame: {e}")))?;
        self.wr.write_all(&bytes).await.map_err(io_error)?;
        self.wr.flush().await.map_err(io_error)
    }
}

impl AttachOutput {
    /// The next event; `Ok(None)` after `Exit`. A connection that ends without `Exit`, or an
    /// `Error` frame (the VM failed meanwhile), is an error.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>, Error> {
        if self.done {
            return Ok(None);
        }
        match self.next_frame().await? {
            Some(Frame::Stdout(bytes)) => Ok(Some(ExecEvent::Stdout(bytes))),
            Some(Frame::Stderr(bytes)) => Ok(Some(ExecEvent::Stderr(bytes))),
            Some(Frame::Exit(status)) => {
                self.done = true;
                Ok(Some(ExecEvent::Exit(exit_info(status))))
            }
            Some(Frame::Error(e)) => {
                self.done = true;
                Err(Error::Api {
                    status: 502,
                    code: "agent".into(),
                    message: e.message,
                })
            }
            None => Err(Error::Interrupted(
                "the daemon closed the attached exec's connection".into(),
            )),
            Some(other) => Err(unexpected(Some(&other), "output or Exit")),
        }
    }

    async fn next_frame(&mut self) -> Result<Option<Frame>, Error> {
        loop {
            if let Some(frame) = self
                .decoder
                .next_frame()
                .map_err(|e| Error::Decode(format!("bad frame from the daemon: {e}")))?
            {
                return Ok(Some(frame));
            }
            let n = self.rd.read(&mut self.buf).await.map_err(io_error)?;
            if n == 0 {
                return Ok(None);
            }
            self.decoder.push(&self.buf[..n]);
        }
    }
}

fn io_error(e: std::io::Error) -> Error {
    Error::Interrupted(format!("the attached exec's connection: {e}"))
}

fn exit_info(status: ExitStatus) -> ExitInfo {
    ExitInfo {
        code: status.code,
        signal: status.signal,
        timed_out: status.timed_out,
    }
}

fn unexpected(frame: Option<&Frame>, wanted: &str) -> Error {
    let got = frame.map_or("end of stream".to_owned(), |f| {
        format!("a {} frame", f.kind())
    });
    Error::Decode(format!("expected {wanted} from the daemon, got {got}"))
}

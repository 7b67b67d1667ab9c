//! The NDJSON stream of a running command.

use bytes::{Buf, BytesMut};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::Response;

use crate::types::{ExecLine, ExitInfo};
use crate::{api_error, decode_b64, Error};

/// Longest NDJSON line accepted, bytes (the daemon sends at most 16 KiB of output per line,
/// about 22 KiB as base64).
const MAX_LINE: usize = 1024 * 1024;

/// Something a running command did, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    /// Bytes it wrote to stdout.
    Stdout(Vec<u8>),
    /// Bytes it wrote to stderr.
    Stderr(Vec<u8>),
    /// It ended; always the last event.
    Exit(ExitInfo),
}

/// Everything a finished command wrote, and how it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// All stdout bytes.
    pub stdout: Vec<u8>,
    /// All stderr bytes.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub exit: ExitInfo,
}

/// A command's output as it comes. Dropping the stream closes the connection, and the daemon
/// then kills the command.
#[derive(Debug)]
pub struct ExecStream {
    body: Incoming,
    buf: BytesMut,
    done: bool,
}

impl ExecStream {
    pub(crate) async fn from_response(response: Response<Incoming>) -> Result<Self, Error> {
        let status = response.status();
        if !status.is_success() {
            let body = response.into_body().collect().await?.to_bytes();
            return Err(api_error(status, &body));
        }
        Ok(ExecStream {
            body: response.into_body(),
            buf: BytesMut::new(),
            done: false,
        })
    }

    /// The next event; `Ok(None)` after `Exit`. A stream that ends without `Exit` (e.g. the
    /// daemon died) or carries an `error` line is an error.
    pub async fn next_event(&mut self) -> Result<Option<ExecEvent>, Error> {
        if self.done {
            return Ok(None);
        }
        let line = self.next_line().await.inspect_err(|_| self.done = true)?;
        let event = match line {
            ExecLine::Stdout(b) => ExecEvent::Stdout(decode_b64(&b)?),
            ExecLine::Stderr(b) => ExecEvent::Stderr(decode_b64(&b)?),
            ExecLine::Exit(exit) => ExecEvent::Exit(exit),
            ExecLine::Error(e) => {
                self.done = true;
                return Err(Error::Api {
                    status: 200,
                    code: e.code,
                    message: e.message,
                });
            }
        };
        self.done = matches!(event, ExecEvent::Exit(_));
        Ok(Some(event))
    }

    /// Reads the rest of the stream.
    pub async fn collect_output(mut self) -> Result<ExecOutput, Error> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        loop {
            match self.next_event().await? {
                Some(ExecEvent::Stdout(b)) => stdout.extend_from_slice(&b),
                Some(ExecEvent::Stderr(b)) => stderr.extend_from_slice(&b),
                Some(ExecEvent::Exit(exit)) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        exit,
                    })
                }
                None => return Err(Error::Decode("the stream ended twice".into())),
            }
        }
    }

    async fn next_line(&mut self) -> Result<ExecLine, Error> {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let line = self.buf.split_to(pos + 1);
                return serde_json::from_slice(&line[..pos])
                    .map_err(|e| Error::Decode(format!("bad exec stream line: {e}")));
            }
            if self.buf.len() > MAX_LINE {
                return Err(Error::Decode("exec stream line too long".into()));
            }
            match self.body.frame().await {
                Some(frame) => {
                    let frame = frame.map_err(|e| Error::Interrupted(e.to_string()))?;
                    if let Ok(mut data) = frame.into_data() {
                        while data.has_remaining() {
                            let chunk = data.chunk();
                            self.buf.extend_from_slice(chunk);
                            let n = chunk.len();
                            data.advance(n);
                        }
                    }
                }
                None => return Err(Error::Interrupted("end of stream".into())),
            }
        }
    }
}

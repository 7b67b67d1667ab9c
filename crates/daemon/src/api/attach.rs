//! `POST /v1/sandboxes/{id}/exec/attach`: an exec whose stdin streams for as long as the caller
//! keeps it open, optionally on a terminal, over an upgraded connection (as Docker's attach
//! hijacks its connection with `Upgrade: tcp`).
//!
//! The request is an ordinary JSON [`ExecSpec`] with `Connection: Upgrade` and
//! `Upgrade: bulkhead-exec` ([`ATTACH_PROTOCOL`]); errors (bad spec, no sandbox, an agent
//! that refuses) are ordinary HTTP answers. Once the command has started the daemon answers
//! `101 Switching Protocols`, and from then on both directions carry frames of the agent
//! protocol (`docs/agent-protocol.md`, one codec for both hops):
//! - caller → daemon: `Stdin` (raw bytes), `StdinEof`, `Signal`, `Resize`; any other frame
//!   ends the exec (the command is killed);
//! - daemon → caller: `Started`, then `Stdout`/`Stderr` as the command writes, and last `Exit`
//!   (or `Error` when the VM failed meanwhile).
//!
//! Back-pressure instead of buffering: the connection is read only as fast as the command
//! takes its stdin (one frame in flight), and the command's output is read only as fast as
//! the caller takes it. The caller closing the connection before `Exit` kills the command; a
//! caller that half-closes after `StdinEof` still gets the rest of the output.

use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bulkhead_client::{ErrorBody, ExecSpec, ATTACH_PROTOCOL};
use bulkhead_protocol::client::{ClientError, ExecEvent, ExecReader, ExecSession, ExecWriter};
use bulkhead_protocol::{ErrorMessage, Frame, FrameDecoder, Started};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::error::{ApiError, ApiJson};
use super::exec::{cut_short, start, KillOnDrop, Stdin};
use crate::manager::Manager;

/// Frames queued between the agent reader thread and the connection, and between the
/// connection and the agent writer thread: small, so both directions apply back-pressure.
const QUEUE_FRAMES: usize = 4;

/// Bytes read from the caller's connection at a time.
const READ_CHUNK: usize = 64 * 1024;

/// Starts a command with streamed stdin (and a terminal when `tty` is set) and switches the
/// connection to frames (see the module docs).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/attach", tag = "exec", request_body = ExecSpec,
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("Upgrade" = String, Header, description = "`bulkhead-exec`"),
        ("Connection" = String, Header, description = "`Upgrade`")),
    responses(
        (status = 101, description = "The command runs; the connection now carries agent-protocol frames both ways (docs/agent-protocol.md): Stdin, StdinEof, Signal, Resize in; Started, Stdout, Stderr, Exit or Error out"),
        (status = 400, description = "Not an upgrade request, an invalid spec (e.g. with base64 `stdin`), an ambiguous ID prefix, or the agent refused it", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn exec_attach(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    mut request: Request,
) -> Result<Response, ApiError> {
    check_upgrade(request.headers())?;
    let on_upgrade = hyper::upgrade::on(&mut request);
    let ApiJson(spec) = ApiJson::<ExecSpec>::from_request(request, &()).await?;
    let session = start(&manager, &id, &spec, Stdin::Streamed).await?;
    let cut = cut_short(manager.clone(), id.clone());
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => relay(TokioIo::new(upgraded), session, cut).await,
            // The session drops here, which kills the command.
            Err(e) => tracing::debug!("exec attach: the upgrade failed: {e}"),
        }
    });
    Ok(Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, ATTACH_PROTOCOL)
        .body(Body::empty())
        .unwrap_or_else(|_| StatusCode::SWITCHING_PROTOCOLS.into_response()))
}

/// `Connection: Upgrade` and `Upgrade: bulkhead-exec`, or a 400 that says what is missing.
fn check_upgrade(headers: &HeaderMap) -> Result<(), ApiError> {
    let has = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|value| {
            value
                .to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    if has(header::CONNECTION, "upgrade") && has(header::UPGRADE, ATTACH_PROTOCOL) {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "this endpoint switches protocols: send `Connection: Upgrade` and `Upgrade: \
         {ATTACH_PROTOCOL}` (for buffered stdin use POST /v1/sandboxes/{{id}}/exec)"
    )))
}

/// Moves frames between the caller's connection `io` and the agent until the command's
/// `Exit` has been delivered or either side is gone.
/// `cut` names the error when the agent's stream fails ([`cut_short`]).
async fn relay<S>(
    io: S,
    session: ExecSession,
    cut: impl Fn(ClientError) -> ApiError + Send + 'static,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let pid = session.pid().unwrap_or(0);
    let (writer, reader) = session.split();
    let guard = KillOnDrop::new(writer.clone());
    let (mut rd, mut wr) = tokio::io::split(io);

    let (out_tx, mut out_rx) = mpsc::channel::<Frame>(QUEUE_FRAMES);
    let finished = guard.finished.clone();
    std::thread::spawn(move || {
        pump_output(reader, &out_tx, &cut);
        finished.store(true, Ordering::SeqCst);
    });
    let (in_tx, in_rx) = mpsc::channel::<Frame>(QUEUE_FRAMES);
    std::thread::spawn(move || feed_agent(in_rx, &writer));

    let output = async move {
        let started = Frame::Started(Started { pid });
        send(&mut wr, &started).await?;
        while let Some(frame) = out_rx.recv().await {
            let last = matches!(frame, Frame::Exit(_) | Frame::Error(_));
            send(&mut wr, &frame).await?;
            if last {
                break;
            }
        }
        wr.shutdown().await
    };
    let input = async move {
        match read_input(&mut rd, &in_tx).await {
            // The caller is done sending; keep delivering output.
            InputEnd::AfterEof => std::future::pending::<()>().await,
            InputEnd::Gone(reason) => tracing::debug!("exec attach pid {pid}: {reason}"),
        }
    };
    tokio::select! {
        result = output => {
            if let Err(e) = result {
                tracing::debug!("exec attach pid {pid}: writing to the caller: {e}");
            }
        }
        () = input => {}
    }
    // Dropping `guard` kills the command unless its exit was delivered.
    drop(guard);
}

async fn send<W: tokio::io::AsyncWrite + Unpin>(wr: &mut W, frame: &Frame) -> std::io::Result<()> {
    let bytes = frame.encode().map_err(std::io::Error::other)?;
    wr.write_all(&bytes).await?;
    wr.flush().await
}

/// How the caller's side of the connection ended.
enum InputEnd {
    /// End of stream after `StdinEof`: a half-close, the output still goes out.
    AfterEof,
    /// The caller went away or broke the protocol (why).
    Gone(String),
}

/// Reads frames from the caller and queues those an attached exec takes.
async fn read_input<R>(rd: &mut R, in_tx: &mpsc::Sender<Frame>) -> InputEnd
where
    R: tokio::io::AsyncRead + Unpin,
{
    let mut decoder = FrameDecoder::new();
    let mut buf = vec![0u8; READ_CHUNK];
    let mut stdin_closed = false;
    loop {
        let n = match rd.read(&mut buf).await {
            Ok(0) if stdin_closed => return InputEnd::AfterEof,
            Ok(0) => return InputEnd::Gone("the caller closed the connection".into()),
            Ok(n) => n,
            Err(e) => return InputEnd::Gone(format!("reading from the caller: {e}")),
        };
        decoder.push(&buf[..n]);
        loop {
            let frame = match decoder.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => return InputEnd::Gone(format!("bad frame from the caller: {e}")),
            };
            match frame {
                Frame::Stdin(_) | Frame::Signal(_) | Frame::Resize(_) => {}
                Frame::StdinEof => stdin_closed = true,
                other => {
                    return InputEnd::Gone(format!(
                        "the caller sent a {} frame, which an attached exec does not take",
                        other.kind()
                    ))
                }
            }
            if in_tx.send(frame).await.is_err() {
                return InputEnd::Gone("the agent connection ended".into());
            }
        }
    }
}

/// Thread body: the caller's frames → the agent (blocking writes: the back-pressure).
fn feed_agent(mut in_rx: mpsc::Receiver<Frame>, writer: &ExecWriter) {
    while let Some(frame) = in_rx.blocking_recv() {
        let sent = match frame {
            Frame::Stdin(bytes) => writer.write_stdin(&bytes),
            Frame::StdinEof => writer.close_stdin(),
            Frame::Signal(s) => writer.signal(s.signo),
            Frame::Resize(size) => writer.resize(size),
            _ => Ok(()),
        };
        if sent.is_err() {
            // The command has ended or the agent is gone: its status (or the error) is on
            // its way through the reader.
            return;
        }
    }
}

/// Thread body: agent events → frames for the caller, until the exit or an error.
fn pump_output(
    mut reader: ExecReader,
    out_tx: &mpsc::Sender<Frame>,
    cut: &dyn Fn(ClientError) -> ApiError,
) {
    loop {
        let frame = match reader.next_event() {
            Ok(Some(ExecEvent::Stdout(b))) => Frame::Stdout(b),
            Ok(Some(ExecEvent::Stderr(b))) => Frame::Stderr(b),
            Ok(Some(ExecEvent::Exit(status))) => Frame::Exit(status),
            Ok(None) => return,
            Err(e) => {
                let detail = cut(e).detail();
                Frame::Error(ErrorMessage::new(
                    bulkhead_protocol::ErrorCode::Other,
                    detail.message,
                ))
            }
        };
        let last = matches!(frame, Frame::Exit(_) | Frame::Error(_));
        if out_tx.blocking_send(frame).is_err() || last {
            return;
        }
    }
}

//! `POST /v1/sandboxes/{id}/exec` (NDJSON stream) and `.../exec/collect` (one JSON answer).
//!
//! The guest agent's client is blocking, so each command's output is read on its own thread and
//! handed to the HTTP response through a bounded channel (backpressure: a slow client slows the
//! reader, which slows the agent). When the HTTP client goes away, the response body (or the
//! collect handler) is dropped, which closes the agent connection; the agent then kills the
//! command's process group.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use bulkhead_client::{ErrorBody, ExecLine, ExecResult, ExecSpec, ExitInfo, SandboxState};
use bulkhead_protocol::client::{ClientError, ExecEvent, ExecReader, ExecSession, ExecWriter};
use bulkhead_protocol::{ExecRequest, ExitStatus};
use bytes::Bytes;
use tokio::sync::mpsc;

use super::error::{ApiError, ApiJson};
use crate::manager::{AgentHandle, Manager};

/// Output lines buffered between the agent reader and the HTTP response.
const CHANNEL_LINES: usize = 16;
/// Longest `timeout_s`, seconds (a year).
const MAX_TIMEOUT_S: f64 = 365.0 * 86_400.0;

/// Runs a command and streams its output as NDJSON lines: `{"stdout": base64}`,
/// `{"stderr": base64}`, and last `{"exit": {...}}` (or `{"error": {...}}` if the VM failed
/// meanwhile). Closing the connection kills the command.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "exec", request_body = ExecSpec,
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "NDJSON stream, one ExecLine per line", body = ExecLine,
            content_type = "application/x-ndjson"),
        (status = 400, description = "Invalid request, an ambiguous ID prefix, or the agent refused it", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn exec_stream(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    ApiJson(spec): ApiJson<ExecSpec>,
) -> Result<Response, ApiError> {
    let session = start(&manager, &id, &spec, Stdin::Buffered).await?;
    let (writer, reader) = session.split();
    let guard = KillOnDrop::new(writer);
    let (tx, rx) = mpsc::channel::<ExecLine>(CHANNEL_LINES);
    let finished = guard.finished.clone();
    let cut = cut_short(manager.clone(), id.clone());
    std::thread::Builder::new()
        .name("exec-stream".into())
        .spawn(move || pump(reader, &tx, &finished, &cut))
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    let stream = futures_util::stream::unfold((rx, guard), |(mut rx, guard)| async move {
        let line = rx.recv().await?;
        let mut json = serde_json::to_vec(&line).unwrap_or_default();
        json.push(b'\n');
        Some((Ok::<Bytes, Infallible>(Bytes::from(json)), (rx, guard)))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Runs a command and answers with all its output once it ends (for small outputs: beyond the
/// daemon's `max_collect_bytes` the command is killed and the answer is 413).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/collect", tag = "exec", request_body = ExecSpec,
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "The command ended", body = ExecResult),
        (status = 400, description = "Invalid request, an ambiguous ID prefix, or the agent refused it", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not running, or was paused while the command ran (`paused`)", body = ErrorBody),
        (status = 413, description = "Output larger than the limit; the command was killed", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached or the VM died", body = ErrorBody)))]
pub async fn exec_collect(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    ApiJson(spec): ApiJson<ExecSpec>,
) -> Result<Json<ExecResult>, ApiError> {
    let limit = manager.config().max_collect_bytes;
    let session = start(&manager, &id, &spec, Stdin::Buffered).await?;
    let (writer, reader) = session.split();
    let guard = KillOnDrop::new(writer);
    let finished = guard.finished.clone();
    let killer = guard.writer.clone();
    let cut = cut_short(manager.clone(), id.clone());
    let result =
        tokio::task::spawn_blocking(move || collect(reader, limit, &finished, &killer, &cut))
            .await
            .map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })?;
    drop(guard);
    result.map(Json)
}

/// Where an exec's stdin comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stdin {
    /// The spec's base64 `stdin` (or none: `/dev/null`).
    Buffered,
    /// Frames on an attached connection ([`super::attach`]); the spec has no `stdin`.
    Streamed,
}

/// Validates `spec`, starts the command and feeds its buffered stdin.
pub(super) async fn start(
    manager: &Manager,
    id: &str,
    spec: &ExecSpec,
    input: Stdin,
) -> Result<ExecSession, ApiError> {
    let (handle, preconnected) = manager.agent_for_exec(id)?;
    let (mut request, stdin) = protocol_request(spec, &handle)?;
    if input == Stdin::Streamed {
        if stdin.is_some() {
            return Err(ApiError::invalid(
                "an attached exec streams its stdin on the connection: leave `stdin` out",
            ));
        }
        request.stdin = true;
    }
    let client = handle.client;
    let started = tokio::task::spawn_blocking(move || match preconnected {
        Some(stream) => ExecSession::start(stream, &request),
        None => client.exec(&request),
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    manager.metrics().exec(started.is_ok());
    let session = started.map_err(ApiError::from_agent)?;
    if let Some(bytes) = stdin {
        let writer = session.writer();
        std::thread::spawn(move || {
            if writer.write_stdin(&bytes).is_ok() {
                let _ = writer.close_stdin();
            }
        });
    }
    Ok(session)
}

/// The agent request for `spec`, and the stdin bytes to send.
fn protocol_request(
    spec: &ExecSpec,
    handle: &AgentHandle,
) -> Result<(ExecRequest, Option<Vec<u8>>), ApiError> {
    if spec.argv.is_empty() || spec.argv[0].is_empty() {
        return Err(ApiError::invalid("argv must name a program"));
    }
    if spec.argv.iter().any(|a| a.as_bytes().contains(&0)) {
        return Err(ApiError::invalid("argv must not contain NUL bytes"));
    }
    bulkhead_sandbox::spec::check_env(&spec.env).map_err(|e| ApiError::invalid(e.to_string()))?;
    if let Some(cwd) = &spec.cwd {
        if !cwd.as_bytes().starts_with(b"/") || cwd.as_bytes().contains(&0) {
            return Err(ApiError::invalid("cwd must be an absolute path"));
        }
    }
    let timeout_ms = match spec.timeout_s {
        None => None,
        Some(t) if t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_S => {
            Some((t * 1000.0).ceil() as u64)
        }
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "timeout_s must be in (0, {MAX_TIMEOUT_S}]"
            )))
        }
    };
    let stdin = match &spec.stdin {
        None => None,
        Some(text) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(text)
                .map_err(|e| ApiError::invalid(format!("stdin is not base64: {e}")))?,
        ),
    };
    // The sandbox's command defaults, as for `bulkhead run` (`ExecDefaults::request`); unlike a
    // run, an exec ends when every holder of its output has closed it (`docker exec`).
    let mut request = handle.exec.request(
        spec.argv.clone(),
        &spec.env,
        spec.cwd.as_ref(),
        spec.user.as_deref(),
    );
    request.stdin = stdin.is_some();
    request.timeout_ms = timeout_ms;
    request.tty = spec.tty;
    request.window = spec.window;
    Ok((request, stdin))
}

/// Closes the agent connection (killing the command) when dropped before the command ended.
pub(super) struct KillOnDrop {
    pub(super) writer: ExecWriter,
    pub(super) finished: Arc<AtomicBool>,
}

impl KillOnDrop {
    pub(super) fn new(writer: ExecWriter) -> Self {
        KillOnDrop {
            writer,
            finished: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if !self.finished.load(Ordering::SeqCst) {
            tracing::debug!("exec client went away: closing the agent connection");
            let _ = self.writer.disconnect();
        }
    }
}

fn exit_info(status: ExitStatus) -> ExitInfo {
    ExitInfo {
        code: status.code,
        signal: status.signal,
        timed_out: status.timed_out,
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Thread body: agent events → NDJSON lines, until the exit, an error or the client leaving.
/// The error for an exec of sandbox `id` whose agent connection failed: a pause stops the VM
/// under every exec, so while the sandbox is pausing or paused that is what the error says (409
/// `paused`); anything else is the agent's error ([`ApiError::from_agent`]).
pub(super) fn cut_short(manager: Manager, id: String) -> impl Fn(ClientError) -> ApiError {
    move |err| {
        let state = manager.info(&id).map(|info| (info.state, info.id));
        match (state, &err) {
            (Ok((SandboxState::Pausing | SandboxState::Paused, full)), e)
                if !matches!(e, ClientError::Agent(_)) =>
            {
                ApiError::new(
                    StatusCode::CONFLICT,
                    "paused",
                    format!(
                        "sandbox {full} was paused while the command ran: the pause ended this \
                         exec's connection ({err})"
                    ),
                )
            }
            _ => ApiError::from_agent(err),
        }
    }
}

fn pump(
    mut reader: ExecReader,
    tx: &mpsc::Sender<ExecLine>,
    finished: &AtomicBool,
    cut: &dyn Fn(ClientError) -> ApiError,
) {
    loop {
        let line = match reader.next_event() {
            Ok(Some(ExecEvent::Stdout(b))) => ExecLine::Stdout(b64(&b)),
            Ok(Some(ExecEvent::Stderr(b))) => ExecLine::Stderr(b64(&b)),
            Ok(Some(ExecEvent::Exit(status))) => {
                finished.store(true, Ordering::SeqCst);
                ExecLine::Exit(exit_info(status))
            }
            Ok(None) => return,
            Err(e) => {
                finished.store(true, Ordering::SeqCst);
                ExecLine::Error(cut(e).detail())
            }
        };
        let last = matches!(line, ExecLine::Exit(_) | ExecLine::Error(_));
        if tx.blocking_send(line).is_err() || last {
            return;
        }
    }
}

/// Blocking: all output up to `limit` bytes; beyond it the command is killed (413).
fn collect(
    mut reader: ExecReader,
    limit: u64,
    finished: &AtomicBool,
    killer: &ExecWriter,
    cut: &dyn Fn(ClientError) -> ApiError,
) -> Result<ExecResult, ApiError> {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        let event = reader.next_event().map_err(|e| {
            finished.store(true, Ordering::SeqCst);
            cut(e)
        })?;
        match event {
            Some(ExecEvent::Stdout(b)) => stdout.extend_from_slice(&b),
            Some(ExecEvent::Stderr(b)) => stderr.extend_from_slice(&b),
            Some(ExecEvent::Exit(status)) => {
                finished.store(true, Ordering::SeqCst);
                return Ok(ExecResult {
                    stdout: b64(&stdout),
                    stderr: b64(&stderr),
                    exit: exit_info(status),
                });
            }
            None => return Err(cut(ClientError::Closed("the exit status"))),
        }
        if (stdout.len() + stderr.len()) as u64 > limit {
            let _ = killer.disconnect();
            finished.store(true, Ordering::SeqCst);
            return Err(ApiError::too_large(format!(
                "the command wrote more than {limit} bytes and was killed; use the streaming exec"
            )));
        }
    }
}

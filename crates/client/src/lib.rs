//! A typed async client of `bulkheadd`, the bulkhead host daemon: HTTP/1.1 + JSON over its Unix
//! socket (`docs/daemon.md` has the API; the daemon serves its OpenAPI document at
//! `GET /openapi.json`).
//!
//! ```no_run
//! use bulkhead_client::{Client, CreateSandbox, ExecSpec};
//!
//! # async fn demo() -> Result<(), bulkhead_client::Error> {
//! let client = Client::from_env(); // $BULKHEAD_SOCKET or /run/bulkhead/bulkheadd.sock
//! let sandbox = client.create(&CreateSandbox::default()).await?;
//! let out = client.exec_collect(&sandbox.id, &ExecSpec::new(["uname", "-a"])).await?;
//! print!("{}", String::from_utf8_lossy(&out.stdout));
//! client.delete(&sandbox.id).await?;
//! # Ok(()) }
//! ```
//!
//! Every call opens its own connection (cheap on a Unix socket), so a [`Client`] may be shared
//! and used concurrently.
#![deny(missing_docs)]

mod attach;
mod exec;
mod files;
mod http;
pub mod types;
pub mod workspace;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use bytes::Bytes;
use hyper::{Method, StatusCode};

pub use attach::{AttachInput, AttachOutput, AttachedExec};
pub use exec::{ExecEvent, ExecOutput, ExecStream};
pub use files::PATH_NOT_FOUND;
pub use types::{
    ArchiveWritten, ByteString, CreateSandbox, ErrorBody, ErrorDetail, ExecLine, ExecResult,
    ExecSpec, ExitInfo, Failure, FileInfo, FileKind, FileList, FileWritten, Health, Limits,
    NetworkRequest, NetworkRule, PoolStatus, SandboxInfo, SandboxState, SecretRef, SkippedFile,
    WindowSize, MAX_EXEC_STDIN_BYTES, MAX_JSON_BYTES,
};
pub use workspace::{
    ChangeKind, ChangeStatus, ExportFormat, ExportReview, MountSpec, SkippedPath, WorkspaceChange,
    WorkspaceDiffInfo, WorkspaceMode, WorkspaceSpec, MAX_REVIEW_ENTRIES, REVIEW_HEADER,
};

/// Where the daemon listens unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/bulkhead/bulkheadd.sock";

/// Environment variable naming the daemon's socket.
pub const SOCKET_ENV: &str = "BULKHEAD_SOCKET";

/// The `Upgrade` token of `POST /v1/sandboxes/{id}/exec/attach`: after `101 Switching
/// Protocols` the connection carries agent-protocol frames (`docs/daemon.md`).
pub const ATTACH_PROTOCOL: &str = "bulkhead-exec";

/// Request header carrying a file's permission bits (octal, e.g. `644`) on `PUT .../files`.
pub const MODE_HEADER: &str = "x-bulkhead-mode";

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The daemon's socket could not be connected.
    #[error("cannot connect to bulkheadd at {}: {source} (is the daemon running? set --socket or BULKHEAD_SOCKET)", path.display())]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// What connect(2) said.
        source: std::io::Error,
    },
    /// The HTTP exchange failed (e.g. the daemon closed the connection).
    #[error("talking to bulkheadd: {0}")]
    Http(#[from] hyper::Error),
    /// The daemon answered with an error document.
    #[error("bulkheadd: {message} ({status} {code})")]
    Api {
        /// HTTP status code.
        status: u16,
        /// The error's machine-readable code.
        code: String,
        /// The daemon's explanation.
        message: String,
    },
    /// An exec stream ended before the command's exit status: the daemon stopped (or died), or
    /// the connection broke. The command may still have run.
    #[error("the exec stream ended before the command's exit status (did bulkheadd stop?): {0}")]
    Interrupted(String),
    /// An answer could not be decoded.
    #[error("unexpected answer from bulkheadd: {0}")]
    Decode(String),
    /// Writing a download (a workspace export) to its destination failed.
    #[error("writing the download: {0}")]
    Sink(std::io::Error),
}

impl Error {
    /// The HTTP status of an [`Error::Api`].
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A handle on one daemon. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    connections: std::sync::Arc<http::Connections>,
}

impl Client {
    /// A client for the daemon listening on `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            connections: std::sync::Arc::new(http::Connections::new(socket.into())),
        }
    }

    /// A client for `$BULKHEAD_SOCKET`, or [`DEFAULT_SOCKET`].
    pub fn from_env() -> Self {
        match std::env::var_os(SOCKET_ENV).filter(|v| !v.is_empty()) {
            Some(path) => Client::new(path),
            None => Client::new(DEFAULT_SOCKET),
        }
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        self.connections.socket()
    }

    /// `GET /healthz`.
    pub async fn health(&self) -> Result<Health, Error> {
        self.json(Method::GET, "/healthz", None).await
    }

    /// `POST /v1/sandboxes`: boots a sandbox; returns when its agent is ready (state
    /// `running`).
    pub async fn create(&self, request: &CreateSandbox) -> Result<SandboxInfo, Error> {
        self.json(Method::POST, "/v1/sandboxes", Some(to_json(request)?))
            .await
    }

    /// `GET /v1/sandboxes`: every sandbox carrying all of `labels`.
    pub async fn list(&self, labels: &BTreeMap<String, String>) -> Result<Vec<SandboxInfo>, Error> {
        let query: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("label={}", encode(&format!("{k}={v}"))))
            .collect();
        let path = match query.is_empty() {
            true => "/v1/sandboxes".to_owned(),
            false => format!("/v1/sandboxes?{}", query.join("&")),
        };
        self.json(Method::GET, &path, None).await
    }

    /// `GET /v1/sandboxes/{id}`.
    pub async fn get(&self, id: &str) -> Result<SandboxInfo, Error> {
        self.json(Method::GET, &sandbox_path(id, ""), None).await
    }

    /// `DELETE /v1/sandboxes/{id}`: destroys the sandbox (the VM, its cgroup and files).
    /// Idempotent: deleting an unknown or already deleted sandbox succeeds.
    pub async fn delete(&self, id: &str) -> Result<(), Error> {
        let (status, body) = self
            .raw(Method::DELETE, &sandbox_path(id, ""), None, &[])
            .await?;
        check(status, &body).map(|_| ())
    }

    /// `POST /v1/sandboxes/{id}/pause`: saves the sandbox's VM to the daemon's state directory
    /// and stops it (state `paused`: no VMM, no guest memory in use). Pausing a paused sandbox
    /// changes nothing.
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, Error> {
        self.json(Method::POST, &sandbox_path(id, "/pause"), None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/resume`: restores a paused sandbox (state `running` again, its
    /// processes and files as they were). Resuming a running sandbox changes nothing.
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, Error> {
        self.json(Method::POST, &sandbox_path(id, "/resume"), None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/exec`: starts a command and streams its output.
    pub async fn exec(&self, id: &str, spec: &ExecSpec) -> Result<ExecStream, Error> {
        let path = sandbox_path(id, "/exec");
        let call = http::Call {
            method: Method::POST,
            path: &path,
            body: Some(to_json(spec)?),
            headers: &[],
        };
        let response = self.connections.send(call).await?;
        ExecStream::from_response(response).await
    }

    /// `POST /v1/sandboxes/{id}/exec/attach`: starts a command whose stdin streams (no size
    /// limit, back-pressure), on a terminal when `spec.tty` is set; `spec.stdin` must be
    /// `None`.
    pub async fn exec_attach(&self, id: &str, spec: &ExecSpec) -> Result<AttachedExec, Error> {
        let path = sandbox_path(id, "/exec/attach");
        let headers = [("connection", "Upgrade"), ("upgrade", ATTACH_PROTOCOL)];
        let call = http::Call {
            method: Method::POST,
            path: &path,
            body: Some(to_json(spec)?),
            headers: &headers,
        };
        let response = self.connections.send(call).await?;
        AttachedExec::start(response).await
    }

    /// `POST /v1/sandboxes/{id}/exec/collect`: runs a command and returns all its output.
    pub async fn exec_collect(&self, id: &str, spec: &ExecSpec) -> Result<ExecOutput, Error> {
        let path = sandbox_path(id, "/exec/collect");
        let result: ExecResult = self.json(Method::POST, &path, Some(to_json(spec)?)).await?;
        Ok(ExecOutput {
            stdout: decode_b64(&result.stdout)?,
            stderr: decode_b64(&result.stderr)?,
            exit: result.exit,
        })
    }

    /// `PUT /v1/sandboxes/{id}/files?path=`: writes `contents` to the absolute guest `path` with
    /// permission bits `mode` (e.g. `0o644`); returns the bytes written.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: u32,
        contents: impl Into<Bytes>,
    ) -> Result<u64, Error> {
        let uri = format!("{}?path={}", sandbox_path(id, "/files"), encode(path));
        let mode = format!("{mode:o}");
        let headers = [(MODE_HEADER, mode.as_str())];
        let (status, body) = self
            .raw(Method::PUT, &uri, Some(contents.into()), &headers)
            .await?;
        let written: FileWritten = parse(&check(status, &body)?)?;
        Ok(written.bytes)
    }

    /// `GET /v1/sandboxes/{id}/files?path=`: the contents of the guest file `path`.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<Vec<u8>, Error> {
        let uri = format!("{}?path={}", sandbox_path(id, "/files"), encode(path));
        let (status, body) = self.raw(Method::GET, &uri, None, &[]).await?;
        Ok(check(status, &body)?.to_vec())
    }

    /// `GET /v1/sandboxes/{id}/logs?lines=`: the last `lines` lines (at most 10000) of the VMM's
    /// output, which includes the guest's serial console.
    pub async fn logs(&self, id: &str, lines: usize) -> Result<String, Error> {
        self.text(&format!("{}?lines={lines}", sandbox_path(id, "/logs")))
            .await
    }

    /// `GET /v1/sandboxes/{id}/egress`: the sandbox's egress log, JSON lines (one decision of
    /// its egress proxy each: time, host, port, method, path, decision, rule, reason, bytes).
    pub async fn egress_log(&self, id: &str) -> Result<String, Error> {
        self.text(&sandbox_path(id, "/egress")).await
    }

    /// `GET /v1/sandboxes/{id}/workspace/diff`: what changed in the sandbox's workspace.
    pub async fn workspace_diff(&self, id: &str) -> Result<WorkspaceDiffInfo, Error> {
        self.json(Method::GET, &sandbox_path(id, "/workspace/diff"), None)
            .await
    }

    /// `GET /v1/sandboxes/{id}/workspace/export?format=`: streams the export of the sandbox's
    /// clone workspace into `sink`; returns what needs review (from the [`REVIEW_HEADER`]). On
    /// error `sink` may hold part of the export.
    pub async fn workspace_export(
        &self,
        id: &str,
        format: ExportFormat,
        sink: &mut (impl tokio::io::AsyncWrite + Unpin),
    ) -> Result<ExportReview, Error> {
        use http_body_util::BodyExt as _;
        use tokio::io::AsyncWriteExt as _;
        let path = format!(
            "{}?format={}",
            sandbox_path(id, "/workspace/export"),
            format.as_str()
        );
        let call = http::Call {
            method: Method::GET,
            path: &path,
            body: None,
            headers: &[],
        };
        let response = self.connections.send(call).await?;
        let status = response.status();
        if !status.is_success() {
            let (_, body) = http::collect(response).await?;
            return Err(api_error(status, &body));
        }
        let review = match response.headers().get(REVIEW_HEADER) {
            Some(value) => {
                let bytes = decode_b64(value.to_str().unwrap_or_default())?;
                serde_json::from_slice(&bytes).map_err(|e| Error::Decode(e.to_string()))?
            }
            None => ExportReview::default(),
        };
        let mut body = response.into_body();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Error::Interrupted(e.to_string()))?;
            if let Ok(data) = frame.into_data() {
                sink.write_all(&data).await.map_err(Error::Sink)?;
            }
        }
        sink.flush().await.map_err(Error::Sink)?;
        Ok(review)
    }

    /// `GET /metrics`: Prometheus text exposition.
    pub async fn metrics(&self) -> Result<String, Error> {
        self.text("/metrics").await
    }

    /// `GET /openapi.json`.
    pub async fn openapi(&self) -> Result<serde_json::Value, Error> {
        self.json(Method::GET, "/openapi.json", None).await
    }

    /// Sends any request and returns the status and whole body, without interpreting them
    /// (for tools and tests). `path` includes the query string.
    pub async fn raw(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
        headers: &[(&str, &str)],
    ) -> Result<(StatusCode, Bytes), Error> {
        let call = http::Call {
            method,
            path,
            body,
            headers,
        };
        self.connections.exchange(call).await
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Bytes>,
    ) -> Result<T, Error> {
        let (status, bytes) = self.raw(method, path, body, &[]).await?;
        parse(&check(status, &bytes)?)
    }

    async fn text(&self, path: &str) -> Result<String, Error> {
        let (status, bytes) = self.raw(Method::GET, path, None, &[]).await?;
        let body = check(status, &bytes)?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}

/// `/v1/sandboxes/<id><suffix>` with `id` percent-encoded.
fn sandbox_path(id: &str, suffix: &str) -> String {
    format!("/v1/sandboxes/{}{suffix}", encode(id))
}

fn to_json(value: &impl serde::Serialize) -> Result<Bytes, Error> {
    serde_json::to_vec(value)
        .map(Bytes::from)
        .map_err(|e| Error::Decode(format!("cannot encode the request: {e}")))
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(body).map_err(|e| Error::Decode(e.to_string()))
}

/// The body of a 2xx answer, or the error document of any other as [`Error::Api`].
fn check(status: StatusCode, body: &Bytes) -> Result<Bytes, Error> {
    if status.is_success() {
        return Ok(body.clone());
    }
    Err(api_error(status, body))
}

pub(crate) fn api_error(status: StatusCode, body: &[u8]) -> Error {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(doc) => Error::Api {
            status: status.as_u16(),
            code: doc.error.code,
            message: doc.error.message,
        },
        Err(_) => Error::Api {
            status: status.as_u16(),
            code: "http".into(),
            message: String::from_utf8_lossy(body).into_owned(),
        },
    }
}

pub(crate) fn decode_b64(text: &str) -> Result<Vec<u8>, Error> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| Error::Decode(format!("bad base64: {e}")))
}

/// Percent-encodes everything but RFC 3986 unreserved characters and `/`.
pub fn encode(text: &str) -> String {
    encode_bytes(text.as_bytes())
}

/// [`encode`] for any bytes (a guest path need not be UTF-8).
pub fn encode_bytes(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        // Arrange / Act
        let encoded = encode("/tmp/a b&c=d/ü");

        // Assert
        assert_eq!(encoded, "/tmp/a%20b%26c%3Dd/%C3%BC");
    }

    #[test]
    fn an_error_document_becomes_an_api_error() {
        // Arrange
        let body = br#"{"error":{"code":"not_found","message":"no sandbox x"}}"#;

        // Act
        let err = api_error(StatusCode::NOT_FOUND, body);

        // Assert
        assert_eq!(err.status(), Some(404));
        assert_eq!(err.to_string(), "bulkheadd: no sandbox x (404 not_found)");
    }

    #[test]
    fn create_requests_reject_unknown_fields() {
        // Arrange / Act
        let result = serde_json::from_str::<CreateSandbox>(r#"{"vcpus":1,"memroy_mib":5}"#);

        // Assert
        assert!(result.unwrap_err().to_string().contains("memroy_mib"));
    }

    #[test]
    fn the_largest_stdin_fits_in_a_request_body() {
        // Arrange
        let mut spec = ExecSpec::new(["sh", "-c", "wc -c"]);
        spec.env.insert("LANG".into(), "C.UTF-8".into());
        spec.cwd = Some("/workspace".into());
        let stdin = vec![0xff; MAX_EXEC_STDIN_BYTES];
        spec.stdin = Some(base64::engine::general_purpose::STANDARD.encode(stdin));

        // Act
        let body = to_json(&spec).unwrap();

        // Assert
        assert!(body.len() <= MAX_JSON_BYTES, "{} bytes", body.len());
        assert_eq!(MAX_EXEC_STDIN_BYTES, 774_144, "the figure in the docs");
    }

    #[test]
    fn exec_lines_have_one_key() {
        // Arrange
        let line = ExecLine::Stdout("aGk=".into());

        // Act
        let json = serde_json::to_string(&line).unwrap();

        // Assert
        assert_eq!(json, r#"{"stdout":"aGk="}"#);
    }
}

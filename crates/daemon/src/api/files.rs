//! `PUT`/`GET /v1/sandboxes/{id}/files?path=`: whole guest files, streamed both ways.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bulkhead_client::{ErrorBody, FileWritten, MODE_HEADER};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::io::{StreamReader, SyncIoBridge};

use super::error::ApiError;
use crate::manager::Manager;

/// Longest guest path, bytes (Linux `PATH_MAX`).
const MAX_PATH: usize = 4096;
/// Permission bits of a written file when no mode header is given.
const DEFAULT_MODE: u32 = 0o644;

/// Writes the request body to the guest file `path` (absolute; missing parent directories are
/// created) with the permission bits of the `x-bulkhead-mode` header (octal, default `644`).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path without `..` components"),
        ("x-bulkhead-mode" = Option<String>, Header, description = "Octal permission bits, default 644")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "File contents"),
    responses(
        (status = 200, description = "Written", body = FileWritten),
        (status = 400, description = "Bad path or mode, an ambiguous ID prefix, or the guest refused", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 413, description = "Larger than the daemon's max_file_bytes", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn put_file(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<FileWritten>, ApiError> {
    let path = guest_path(query.as_deref())?;
    let mode = mode_of(&headers)?;
    let limit = manager.config().max_file_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large(limit));
    }
    let client = manager.agent(&id)?.client;
    let over = Arc::new(AtomicBool::new(false));
    let reader = SyncIoBridge::new(StreamReader::new(limited(body, limit, over.clone())));
    let written = tokio::task::spawn_blocking(move || {
        let mut reader = reader;
        client.write_file_from(&path, mode, &mut reader)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    if over.load(Ordering::SeqCst) {
        return Err(too_large(limit));
    }
    let bytes = written.map_err(ApiError::from_agent)?;
    Ok(Json(FileWritten { bytes }))
}

/// The contents of the guest file `path` (a regular file).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path without `..` components")),
    responses(
        (status = 200, description = "File contents", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 400, description = "Bad path, not a regular file, or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox or file", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn get_file(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let path = guest_path(query.as_deref())?;
    let client = manager.agent(&id)?.client;
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, ApiError>>(8);
    tokio::task::spawn_blocking(move || {
        let mut sink = ChannelSink { tx: tx.clone() };
        if let Err(e) = client.read_file_into(&path, &mut sink) {
            let _ = tx.blocking_send(Err(ApiError::from_agent(e)));
        }
    });
    // The first message tells success (data or a clean end) from failure.
    let first = match rx.recv().await {
        None => Bytes::new(),
        Some(Err(e)) => return Err(e),
        Some(Ok(bytes)) => bytes,
    };
    let rest = tokio_stream_of(rx).map(|item| item.map_err(|e| io::Error::other(e.message)));
    let stream = futures_util::stream::once(async move { Ok(first) }).chain(rest);
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

pub(super) fn tokio_stream_of<T: Send + 'static>(
    rx: mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// Writes each chunk into the channel (blocking): the agent reader's sink.
pub(super) struct ChannelSink {
    pub(super) tx: mpsc::Sender<Result<Bytes, ApiError>>,
}

impl Write for ChannelSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the HTTP client went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The request body as a byte stream that fails (setting `over`) past `limit` bytes.
pub(super) fn limited(
    body: Body,
    limit: u64,
    over: Arc<AtomicBool>,
) -> impl futures_util::Stream<Item = io::Result<Bytes>> + Send + Unpin + 'static {
    let mut total = 0u64;
    body.into_data_stream().map(move |chunk| {
        let chunk = chunk.map_err(io::Error::other)?;
        total += chunk.len() as u64;
        if total > limit {
            over.store(true, Ordering::SeqCst);
            return Err(io::Error::other("body too large"));
        }
        Ok(chunk)
    })
}

fn too_large(limit: u64) -> ApiError {
    ApiError::too_large(format!(
        "file larger than the daemon's limit of {limit} bytes"
    ))
}

/// The `path` query parameter: absolute, no `..` components, no NUL, at most 4096 bytes.
pub(super) fn guest_path(query: Option<&str>) -> Result<String, ApiError> {
    let path = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .find(|(k, _)| k == "path")
        .map(|(_, v)| v.into_owned())
        .ok_or_else(|| ApiError::invalid("the path query parameter is required"))?;
    let bad = !path.starts_with('/')
        || path.len() > MAX_PATH
        || path.contains('\0')
        || path.split('/').any(|c| c == "..");
    if bad {
        return Err(ApiError::invalid(format!(
            "path {path:?} must be absolute, without '..' components, at most {MAX_PATH} bytes"
        )));
    }
    Ok(path)
}

/// [`guest_path`] as bytes: the percent-decoded `path` parameter need not be UTF-8 (for the
/// archive and list/stat/mkdir/remove endpoints; `+` is a space, as in forms).
pub(super) fn guest_path_bytes(query: Option<&str>) -> Result<Vec<u8>, ApiError> {
    let raw = query
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("path="))
        .ok_or_else(|| ApiError::invalid("the path query parameter is required"))?;
    let path = percent_decode(raw.as_bytes())
        .ok_or_else(|| ApiError::invalid("the path query parameter has a bad %-escape"))?;
    let bad = path.first() != Some(&b'/')
        || path.len() > MAX_PATH
        || path.contains(&0)
        || path.split(|b| *b == b'/').any(|c| c == b"..");
    if bad {
        return Err(ApiError::invalid(format!(
            "path {:?} must be absolute, without '..' components, at most {MAX_PATH} bytes",
            String::from_utf8_lossy(&path)
        )));
    }
    Ok(path)
}

/// `%XX` escapes to bytes and `+` to a space; `None` for a malformed escape.
fn percent_decode(raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'%' => {
                let hex = std::str::from_utf8(raw.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(out)
}

fn mode_of(headers: &HeaderMap) -> Result<u32, ApiError> {
    let Some(value) = headers.get(MODE_HEADER) else {
        return Ok(DEFAULT_MODE);
    };
    value
        .to_str()
        .ok()
        .and_then(|s| u32::from_str_radix(s.trim_start_matches("0o"), 8).ok())
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "{MODE_HEADER} must be octal permission bits like 644"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_and_dot_dot_paths_are_refused() {
        // Arrange
        let queries = [
            "path=..%2F..%2Fetc%2Fpasswd",
            "path=/tmp/../etc/passwd",
            "path=tmp/x",
            "",
        ];

        // Act
        let results: Vec<_> = queries.iter().map(|q| guest_path(Some(q))).collect();

        // Assert
        assert!(results.iter().all(Result::is_err), "{results:?}");
        assert_eq!(guest_path(Some("path=%2Ftmp%2Fa%20b")).unwrap(), "/tmp/a b");
        let bytes: Vec<_> = queries.iter().map(|q| guest_path_bytes(Some(q))).collect();
        assert!(bytes.iter().all(Result::is_err), "{bytes:?}");
        assert_eq!(
            guest_path_bytes(Some("x=1&path=/t/n%FFme")).unwrap(),
            b"/t/n\xffme"
        );
    }

    #[test]
    fn modes_are_octal_and_bounded() {
        // Arrange
        let mut ok = HeaderMap::new();
        ok.insert(MODE_HEADER, "755".parse().unwrap());
        let mut bad = HeaderMap::new();
        bad.insert(MODE_HEADER, "999".parse().unwrap());

        // Act / Assert
        assert_eq!(mode_of(&ok).unwrap(), 0o755);
        assert!(mode_of(&bad).is_err());
        assert_eq!(mode_of(&HeaderMap::new()).unwrap(), 0o644);
    }
}

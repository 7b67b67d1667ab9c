//! Directory transfers as tar streams (`PUT`/`GET /v1/sandboxes/{id}/archive?path=`, as
//! Docker's archive API) and the files API beyond whole files: list, stat, mkdir, remove.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bulkhead_client::{
    ArchiveWritten, ErrorBody, FileInfo, FileKind, FileList, SkippedFile, PATH_NOT_FOUND,
};
use bulkhead_protocol::client::{AgentClient, ClientError};
use bulkhead_protocol::{ErrorCode, FileEntry, FileType};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::io::{StreamReader, SyncIoBridge};

use super::error::ApiError;
use super::files::{guest_path_bytes, limited, tokio_stream_of, ChannelSink};
use crate::manager::Manager;

/// Extracts the tar archive of the request body into the existing guest directory `path`.
/// Entries are checked in the guest: no absolute names, no `..`, nothing written through a
/// symlink; ownership is not restored (files belong to root in the guest).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/archive", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path of an existing directory")),
    request_body(content = Vec<u8>, content_type = "application/x-tar", description = "A tar stream (GNU sparse entries carry holes)"),
    responses(
        (status = 200, description = "Extracted", body = ArchiveWritten),
        (status = 400, description = "Bad path, a refused entry (absolute, `..`, through a symlink), or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox (`not_found`) or guest directory (`path_not_found`)", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 413, description = "Body larger than the daemon's max_file_bytes", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn put_archive(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
    body: Body,
) -> Result<Json<ArchiveWritten>, ApiError> {
    let path = guest_path_bytes(query.as_deref())?;
    let limit = manager.config().max_file_bytes;
    let client = manager.agent(&id)?.client;
    let over = Arc::new(AtomicBool::new(false));
    let reader = SyncIoBridge::new(StreamReader::new(limited(body, limit, over.clone())));
    let done = tokio::task::spawn_blocking(move || {
        let mut reader = reader;
        client.write_archive_from(path, &mut reader)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    if over.load(Ordering::SeqCst) {
        return Err(ApiError::too_large(format!(
            "archive larger than the daemon's limit of {limit} bytes"
        )));
    }
    let done = done.map_err(from_agent)?;
    Ok(Json(ArchiveWritten {
        entries: done.entries,
        bytes: done.bytes,
        skipped: done
            .skipped
            .into_iter()
            .map(|s| SkippedFile {
                path: s.path,
                reason: s.reason,
            })
            .collect(),
    }))
}

/// A tar archive of the guest `path` (file, symlink or directory tree), entries named from its
/// last component, symlinks as links, holes as GNU sparse entries. The bytes come from the
/// guest unchecked: extract them as untrusted input (`bulkhead cp -r` does).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/archive", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path, not /")),
    responses(
        (status = 200, description = "A tar stream", body = Vec<u8>, content_type = "application/x-tar"),
        (status = 400, description = "Bad path or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox (`not_found`) or guest path (`path_not_found`)", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn get_archive(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let path = guest_path_bytes(query.as_deref())?;
    let client = manager.agent(&id)?.client;
    let (tx, mut rx) = mpsc::channel::<Result<Bytes, ApiError>>(8);
    tokio::task::spawn_blocking(move || {
        let mut sink = ChannelSink { tx: tx.clone() };
        let shown = String::from_utf8_lossy(&path).into_owned();
        match client.read_archive_into(path, &mut sink) {
            Ok(done) => {
                for s in &done.skipped {
                    tracing::info!("archive of {shown}: skipped {}: {}", s.path, s.reason);
                }
            }
            Err(e) => {
                let _ = tx.blocking_send(Err(from_agent(e)));
            }
        }
    });
    let first = match rx.recv().await {
        None => Bytes::new(),
        Some(Err(e)) => return Err(e),
        Some(Ok(bytes)) => bytes,
    };
    let rest = tokio_stream_of(rx).map(|item| item.map_err(|e| std::io::Error::other(e.message)));
    let stream = futures_util::stream::once(async move { Ok(first) }).chain(rest);
    Ok((
        [(header::CONTENT_TYPE, "application/x-tar")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// The entries of the guest directory `path`, sorted by name (symlinks not followed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path of a directory")),
    responses(
        (status = 200, description = "The entries", body = FileList),
        (status = 400, description = "Bad path, not a directory, or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox (`not_found`) or directory (`path_not_found`)", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn list(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<FileList>, ApiError> {
    let path = guest_path_bytes(query.as_deref())?;
    let entries = blocking(&manager, &id, move |c| c.list(path)).await?;
    Ok(Json(FileList {
        entries: entries.into_iter().map(info).collect(),
    }))
}

/// The guest path itself, not followed when it is a symlink: `404 path_not_found` when it does
/// not exist (E2B's `files.exists`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path")),
    responses(
        (status = 200, description = "The file", body = FileInfo),
        (status = 400, description = "Bad path or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox (`not_found`) or path (`path_not_found`)", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn stat(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Json<FileInfo>, ApiError> {
    let path = guest_path_bytes(query.as_deref())?;
    let entry = blocking(&manager, &id, move |c| c.stat(path)).await?;
    Ok(Json(info(entry)))
}

/// Creates the guest directory `path`; with `parents=true`, missing parents too, and an
/// existing directory is no error.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path"),
        ("parents" = Option<bool>, Query, description = "Create missing parents (default false)")),
    responses(
        (status = 204, description = "Created"),
        (status = 400, description = "Bad path, it exists, or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox (`not_found`) or parent (`path_not_found`)", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn mkdir(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<StatusCode, ApiError> {
    let path = guest_path_bytes(query.as_deref())?;
    let parents = flag(query.as_deref(), "parents")?;
    blocking(&manager, &id, move |c| c.mkdir(path, parents)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Removes the guest path (a symlink itself, never its target); a non-empty directory needs
/// `recursive=true`.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("path" = String, Query, description = "Absolute guest path, not /"),
        ("recursive" = Option<bool>, Query, description = "Remove a directory with everything below it (default false)")),
    responses(
        (status = 204, description = "Removed"),
        (status = 400, description = "Bad path, a non-empty directory without recursive, or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox (`not_found`) or path (`path_not_found`)", body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached", body = ErrorBody)))]
pub async fn remove(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<StatusCode, ApiError> {
    let path = guest_path_bytes(query.as_deref())?;
    let recursive = flag(query.as_deref(), "recursive")?;
    blocking(&manager, &id, move |c| c.remove(path, recursive)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Runs a blocking agent call off the async threads.
async fn blocking<T: Send + 'static>(
    manager: &Manager,
    id: &str,
    call: impl FnOnce(&AgentClient) -> Result<T, ClientError> + Send + 'static,
) -> Result<T, ApiError> {
    let client = manager.agent(id)?.client;
    tokio::task::spawn_blocking(move || call(&client))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(from_agent)
}

/// Like [`ApiError::from_agent`], with a missing guest path as `404 path_not_found`.
fn from_agent(err: ClientError) -> ApiError {
    match err {
        ClientError::Agent(e) if e.code == ErrorCode::NotFound => {
            ApiError::new(StatusCode::NOT_FOUND, PATH_NOT_FOUND, e.message)
        }
        other => ApiError::from_agent(other),
    }
}

/// A boolean query parameter: `true`/`1` or `false`/`0`, absent is false.
fn flag(query: Option<&str>, name: &str) -> Result<bool, ApiError> {
    let value = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned());
    match value.as_deref() {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(other) => Err(ApiError::invalid(format!(
            "{name} must be true or false, not {other:?}"
        ))),
    }
}

fn info(entry: FileEntry) -> FileInfo {
    FileInfo {
        name: entry.name,
        path: entry.path,
        kind: match entry.kind {
            FileType::File => FileKind::File,
            FileType::Dir => FileKind::Dir,
            FileType::Symlink => FileKind::Symlink,
            FileType::Other => FileKind::Other,
        },
        size: entry.size,
        mode: entry.mode,
        mtime: entry.mtime,
        link_target: entry.link_target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_true_or_false() {
        // Arrange / Act / Assert
        assert!(flag(Some("path=/x&recursive=true"), "recursive").unwrap());
        assert!(!flag(Some("path=/x"), "recursive").unwrap());
        assert!(flag(Some("recursive=yes"), "recursive").is_err());
    }
}

//! `GET /v1/sandboxes/{id}/workspace/diff` and `.../workspace/export?format=patch|tar`.

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use bulkhead_client::{
    ChangeKind, ChangeStatus as ApiStatus, ErrorBody, ExportFormat as ApiFormat, ExportReview,
    SkippedPath, WorkspaceChange, WorkspaceDiffInfo, WorkspaceMode as ApiMode, MAX_REVIEW_ENTRIES,
    REVIEW_HEADER,
};
use bulkhead_protocol::{ChangeStatus, EntryKind};
use bulkhead_sandbox::workspace::{ExportFormat, WorkspaceDiff, WorkspaceError, WorkspaceMode};
use tokio_util::io::ReaderStream;

use super::error::ApiError;
use crate::manager::{Manager, WorkspaceFailure};

/// What changed in the sandbox's workspace. Clone workspaces: every path the guest added,
/// modified or deleted. Direct workspaces: only the flagged paths (those that run code on the
/// host implicitly), compared with a snapshot taken when the sandbox started; every other
/// change is already in the host directory.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/workspace/diff", tag = "workspace",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "The changes, flagged ones with a reason", body = WorkspaceDiffInfo),
        (status = 400, description = "An ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not running, or no workspace", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached or sent an invalid change set", body = ErrorBody)))]
pub async fn diff(
    State(manager): State<Manager>,
    Path(id): Path<String>,
) -> Result<Json<WorkspaceDiffInfo>, ApiError> {
    let diff = manager.workspace_diff(&id).await.map_err(failure)?;
    Ok(Json(info(&diff)))
}

/// The changes of the sandbox's clone workspace as a git patch (`git apply`) or a tar archive
/// (changed files plus `.bulkhead-export/deleted`). The `x-bulkhead-review` header carries
/// what needs review: base64 of an `ExportReview` JSON document.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/workspace/export", tag = "workspace",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("format" = ApiFormat, Query, description = "`patch` or `tar`")),
    responses(
        (status = 200, description = "The export", body = Vec<u8>, content_type = "application/octet-stream",
            headers(("x-bulkhead-review" = String, description = "base64 of the ExportReview JSON"))),
        (status = 400, description = "Missing or unknown format, or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not running, no workspace, or a direct workspace", body = ErrorBody),
        (status = 502, description = "The guest agent cannot be reached or sent an invalid change set", body = ErrorBody)))]
pub async fn export(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ApiError> {
    let format = format_of(query.as_deref())?;
    let (file, diff) = manager
        .workspace_export(&id, format)
        .await
        .map_err(failure)?;
    let review = serde_json::to_vec(&review(&diff))
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    let review = base64::engine::general_purpose::STANDARD.encode(review);
    let (kind, ext) = match format {
        ExportFormat::Patch => ("text/x-diff; charset=utf-8", "patch"),
        ExportFormat::Tar => ("application/x-tar", "tar"),
    };
    let stream = ReaderStream::new(tokio::fs::File::from_std(file));
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    let disposition = format!("attachment; filename=\"{id}.{ext}\"");
    if let Ok(value) = HeaderValue::from_str(&disposition) {
        headers.insert(header::CONTENT_DISPOSITION, value);
    }
    if let Ok(value) = HeaderValue::from_str(&review) {
        headers.insert(REVIEW_HEADER, value);
    }
    Ok(response)
}

fn format_of(query: Option<&str>) -> Result<ExportFormat, ApiError> {
    let mut format = None;
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match (key.as_ref(), value.as_ref()) {
            ("format", "patch") => format = Some(ExportFormat::Patch),
            ("format", "tar") => format = Some(ExportFormat::Tar),
            ("format", other) => {
                return Err(ApiError::invalid(format!(
                    "unknown format {other:?}: expected patch or tar"
                )))
            }
            (other, _) => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {other:?}"
                )))
            }
        }
    }
    format.ok_or_else(|| ApiError::invalid("the format query parameter (patch or tar) is required"))
}

fn failure(err: WorkspaceFailure) -> ApiError {
    let err = match err {
        WorkspaceFailure::Manager(e) => return e.into(),
        WorkspaceFailure::Workspace(WorkspaceError::Agent(e)) => return ApiError::from_agent(e),
        WorkspaceFailure::Workspace(e) => e,
    };
    let status = |status, code| ApiError::new(status, code, err.to_string());
    match &err {
        WorkspaceError::None => status(StatusCode::CONFLICT, "no_workspace"),
        WorkspaceError::DirectExport(_) => status(StatusCode::CONFLICT, "direct_workspace"),
        WorkspaceError::Protocol(_) => status(StatusCode::BAD_GATEWAY, "bad_change_set"),
        WorkspaceError::TooLarge(_) => status(StatusCode::BAD_GATEWAY, "change_set_too_large"),
        _ => status(StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    }
}

fn change(c: &bulkhead_sandbox::workspace::Change) -> WorkspaceChange {
    WorkspaceChange {
        path: c.path.clone(),
        status: match c.status {
            ChangeStatus::Added => ApiStatus::Added,
            ChangeStatus::Modified => ApiStatus::Modified,
            ChangeStatus::Deleted => ApiStatus::Deleted,
        },
        kind: match c.kind {
            EntryKind::File => ChangeKind::File,
            EntryKind::Symlink => ChangeKind::Symlink,
            EntryKind::Dir => ChangeKind::Dir,
        },
        flagged: c.flag.is_some(),
        reason: c.flag.clone(),
    }
}

fn skipped(diff: &WorkspaceDiff) -> impl Iterator<Item = SkippedPath> + '_ {
    diff.skipped.iter().map(|s| SkippedPath {
        path: s.path.clone(),
        reason: s.reason.clone(),
    })
}

/// The API document of a diff.
pub fn info(diff: &WorkspaceDiff) -> WorkspaceDiffInfo {
    WorkspaceDiffInfo {
        mode: match diff.mode {
            WorkspaceMode::Direct => ApiMode::Direct,
            WorkspaceMode::Clone => ApiMode::Clone,
        },
        path: diff.host.display().to_string(),
        flagged_only: diff.flagged_only,
        complete: diff.complete,
        changes: diff.changes.iter().map(change).collect(),
        skipped: skipped(diff).collect(),
    }
}

fn review(diff: &WorkspaceDiff) -> ExportReview {
    ExportReview {
        flagged: diff
            .flagged()
            .take(MAX_REVIEW_ENTRIES)
            .map(change)
            .collect(),
        flagged_total: diff.flagged().count(),
        skipped: skipped(diff).take(MAX_REVIEW_ENTRIES).collect(),
        skipped_total: diff.skipped.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_export_format_is_required_and_checked() {
        // Arrange / Act / Assert
        assert_eq!(format_of(Some("format=tar")).unwrap(), ExportFormat::Tar);
        assert_eq!(
            format_of(Some("format=patch")).unwrap(),
            ExportFormat::Patch
        );
        assert!(format_of(None).is_err());
        assert!(format_of(Some("format=zip")).is_err());
        assert!(format_of(Some("format=tar&x=1")).is_err());
    }
}

//! `/v1/sandboxes`: create, list, inspect, delete, pause, resume, logs, egress log.

use axum::extract::{Path, RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use bulkhead_client::{CreateSandbox, ErrorBody, SandboxInfo};

use super::error::{ApiError, ApiJson};
use crate::manager::Manager;

/// Default and largest `lines` of `GET .../logs`.
const DEFAULT_LOG_LINES: usize = 200;
const MAX_LOG_LINES: usize = 10_000;

/// Boots a sandbox, on a root filesystem image of the daemon's image store when `image` is
/// given (with a scratch disk of `disk_mib` for its writable layer), or restores it from the
/// template `template` of `<state_dir>/templates/`; answers once its guest agent is ready.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandbox,
    responses(
        (status = 201, description = "Running", body = SandboxInfo),
        (status = 400, description = "Invalid request (malformed JSON, unknown field, value out of range, invalid image, kernel or template name, disk_mib without image, a share outside mount_roots; with a template: vcpus or memory_mib other than the template's, or a setting not supported with a template yet)", body = ErrorBody),
        (status = 404, description = "A kernel, image or template the daemon does not have (code kernel_not_found, image_not_found or template_not_found; the message lists those it has)", body = ErrorBody),
        (status = 413, description = "Body larger than 1 MiB", body = ErrorBody),
        (status = 422, description = "Not enough host memory", body = ErrorBody),
        (status = 429, description = "Sandbox limit reached", body = ErrorBody),
        (status = 500, description = "The VM could not start for another reason (code start_failed), or the image store is damaged", body = ErrorBody),
        (status = 502, description = "The VM ended or its VMM died during the boot (code vm_exited; the message says how, from the VMM's exit report, and quotes its log)", body = ErrorBody),
        (status = 503, description = "The daemon is shutting down", body = ErrorBody),
        (status = 504, description = "The guest agent did not come up within the daemon's boot_timeout_s (code boot_timeout); the VM was destroyed", body = ErrorBody)))]
pub async fn create(
    State(manager): State<Manager>,
    ApiJson(spec): ApiJson<CreateSandbox>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    let info = manager.create(spec).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

/// Lists sandboxes, optionally only those with every given label (`?label=k=v&label=k2=v2`).
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(("label" = Option<Vec<String>>, Query, description = "`key=value`; repeat to require several labels")),
    responses(
        (status = 200, description = "Sandboxes, oldest first", body = Vec<SandboxInfo>),
        (status = 400, description = "A label filter is not key=value", body = ErrorBody)))]
pub async fn list(
    State(manager): State<Manager>,
    RawQuery(query): RawQuery,
) -> Result<Json<Vec<SandboxInfo>>, ApiError> {
    let mut labels = Vec::new();
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if key != "label" {
            return Err(ApiError::invalid(format!(
                "unknown query parameter {key:?}"
            )));
        }
        let (k, v) = value
            .split_once('=')
            .ok_or_else(|| ApiError::invalid(format!("label filter {value:?} is not key=value")))?;
        labels.push((k.to_owned(), v.to_owned()));
    }
    Ok(Json(manager.list(&labels)))
}

/// One sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "The sandbox", body = SandboxInfo),
        (status = 400, description = "An ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn get_one(
    State(manager): State<Manager>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(manager.info(&id)?))
}

/// Destroys a sandbox: its VMM, cgroup, runtime files and record. Idempotent.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 204, description = "Gone (or never existed)"),
        (status = 400, description = "An ambiguous ID prefix; nothing was destroyed", body = ErrorBody),
        (status = 500, description = "Clean-up failed; the sandbox is kept as failed", body = ErrorBody)))]
pub async fn delete(
    State(manager): State<Manager>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    manager.destroy(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pauses a running sandbox: saves its VM (memory, vCPU and device state) into the daemon's
/// state directory and stops its VMM, freeing its memory. The sandbox stays listed in state
/// `paused`, also across daemon restarts, until it is resumed or deleted (which deletes the
/// saved VM). Pausing a paused sandbox changes nothing.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "Paused", body = SandboxInfo),
        (status = 400, description = "An ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not running (code conflict); a sandbox whose VMM has no control socket (code not_supported); guest processes use files under its shared directories (code busy, naming them); nothing changed", body = ErrorBody),
        (status = 500, description = "Saving the VM failed; the VM is lost and the sandbox is failed (reason pause_failed)", body = ErrorBody)))]
pub async fn pause(
    State(manager): State<Manager>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(manager.pause(&id).await?))
}

/// Resumes a paused sandbox: a new VMM restores its saved VM, in its cgroup with the limits of
/// its create, under the same ID; its processes and files are as they were. Answers once its
/// agent is back; the saved VM is then deleted. Resuming a running sandbox changes nothing.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "Running", body = SandboxInfo),
        (status = 400, description = "An ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Neither paused nor running", body = ErrorBody),
        (status = 422, description = "Not enough host memory; the sandbox stays paused", body = ErrorBody),
        (status = 500, description = "The VM could not be restored (code start_failed); the sandbox stays paused with its saved VM, to retry or delete", body = ErrorBody),
        (status = 502, description = "The restored VM ended or its VMM died (code vm_exited); the sandbox stays paused with its saved VM", body = ErrorBody),
        (status = 503, description = "The daemon is shutting down", body = ErrorBody),
        (status = 504, description = "The restored guest's agent did not answer within boot_timeout_s (code boot_timeout); the sandbox stays paused with its saved VM", body = ErrorBody)))]
pub async fn resume(
    State(manager): State<Manager>,
    Path(id): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(manager.resume(&id).await?))
}

/// The sandbox's egress log: one JSON object per line for each decision of its egress proxy
/// (`time`, `host`, `port`, `via`, `method`, `path`, `decision`, `rule`, `reason`, `status`,
/// `secrets`, `bytes_up`, `bytes_down`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/egress", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with")),
    responses(
        (status = 200, description = "JSON lines, oldest first", body = String, content_type = "application/x-ndjson"),
        (status = 400, description = "An ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox has no network", body = ErrorBody)))]
pub async fn egress(
    State(manager): State<Manager>,
    Path(id): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    let text = manager.egress_log(&id)?;
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], text))
}

/// The last lines of the VMM's output, which includes the guest's serial console.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/logs", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox ID, or a prefix of it that no other ID starts with"),
        ("lines" = Option<usize>, Query, description = "How many lines (default 200, at most 10000)")),
    responses(
        (status = 200, description = "Log text", body = String, content_type = "text/plain"),
        (status = 400, description = "Bad `lines`, or an ambiguous ID prefix", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn logs(
    State(manager): State<Manager>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<impl IntoResponse, ApiError> {
    let mut lines = DEFAULT_LOG_LINES;
    for (key, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match (key.as_ref(), value.parse::<usize>()) {
            ("lines", Ok(n)) if n <= MAX_LOG_LINES => lines = n,
            _ => {
                return Err(ApiError::invalid(format!(
                    "expected lines=0..={MAX_LOG_LINES}"
                )))
            }
        }
    }
    let mut text = manager.logs(&id, lines)?;
    if !text.is_empty() {
        text.push('\n');
    }
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text))
}

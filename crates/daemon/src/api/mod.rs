//! The HTTP API (axum) and its OpenAPI document (utoipa), generated from the handlers'
//! annotations and the `bulkhead-client` types.

pub mod attach;
pub mod error;
pub mod exec;
pub mod files;
pub mod sandboxes;
pub mod system;
pub mod workspace;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post, put};
use axum::Router;
use utoipa::OpenApi;

use crate::manager::Manager;

/// Largest JSON request body, bytes (1 MiB; shared with the client, which checks exec stdin
/// against it before sending).
pub const MAX_JSON_BYTES: usize = bulkhead_client::MAX_JSON_BYTES;

/// The OpenAPI document of this API.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "bulkheadd API",
        description = "Local API of the bulkhead host daemon: KVM microVM sandboxes over a Unix socket. \
            Errors are `{\"error\": {\"code\", \"message\"}}`."
    ),
    paths(
        system::healthz,
        system::metrics,
        system::openapi,
        sandboxes::create,
        sandboxes::list,
        sandboxes::get_one,
        sandboxes::delete,
        sandboxes::pause,
        sandboxes::resume,
        sandboxes::logs,
        sandboxes::egress,
        exec::exec_stream,
        exec::exec_collect,
        attach::exec_attach,
        files::put_file,
        files::get_file,
        workspace::diff,
        workspace::export,
    ),
    components(schemas(
        bulkhead_client::CreateSandbox,
        bulkhead_client::SandboxInfo,
        bulkhead_client::SandboxState,
        bulkhead_client::Failure,
        bulkhead_client::Limits,
        bulkhead_client::ExecSpec,
        bulkhead_client::ExecLine,
        bulkhead_client::ExecResult,
        bulkhead_client::ExitInfo,
        bulkhead_client::FileWritten,
        bulkhead_client::Health,
        bulkhead_client::PoolStatus,
        bulkhead_client::ErrorBody,
        bulkhead_client::ErrorDetail,
        bulkhead_client::WorkspaceSpec,
        bulkhead_client::WorkspaceMode,
        bulkhead_client::MountSpec,
        bulkhead_client::NetworkRequest,
        bulkhead_client::NetworkRule,
        bulkhead_client::SecretRef,
        bulkhead_client::WorkspaceDiffInfo,
        bulkhead_client::WorkspaceChange,
        bulkhead_client::ChangeStatus,
        bulkhead_client::ChangeKind,
        bulkhead_client::SkippedPath,
        bulkhead_client::ExportFormat,
        bulkhead_client::ExportReview,
    )),
    tags(
        (name = "sandboxes", description = "Sandbox lifecycle"),
        (name = "exec", description = "Running commands"),
        (name = "files", description = "Guest files"),
        (name = "workspace", description = "Workspace diff and export"),
        (name = "system", description = "Health, metrics, this document"),
    )
)]
pub struct ApiDoc;

/// The routes, each documented in [`ApiDoc`].
pub fn router(manager: Manager) -> Router {
    Router::new()
        .route("/healthz", get(system::healthz))
        .route("/metrics", get(system::metrics))
        .route("/openapi.json", get(system::openapi))
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get_one).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v1/sandboxes/{id}/resume", post(sandboxes::resume))
        .route("/v1/sandboxes/{id}/logs", get(sandboxes::logs))
        .route("/v1/sandboxes/{id}/egress", get(sandboxes::egress))
        .route("/v1/sandboxes/{id}/exec", post(exec::exec_stream))
        .route("/v1/sandboxes/{id}/exec/collect", post(exec::exec_collect))
        .route("/v1/sandboxes/{id}/exec/attach", post(attach::exec_attach))
        .route(
            "/v1/sandboxes/{id}/files",
            put(files::put_file).get(files::get_file),
        )
        .route("/v1/sandboxes/{id}/workspace/diff", get(workspace::diff))
        .route(
            "/v1/sandboxes/{id}/workspace/export",
            get(workspace::export),
        )
        .fallback(system::not_found)
        .method_not_allowed_fallback(system::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_JSON_BYTES))
        .with_state(manager)
}

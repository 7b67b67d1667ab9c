//! `/healthz`, `/metrics`, `/openapi.json` and the JSON 404/405 answers.

use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Json;
use bulkhead_client::Health;
use utoipa::OpenApi;

use super::error::ApiError;
use super::ApiDoc;
use crate::manager::Manager;

/// Content type of the metrics (OpenMetrics text, which Prometheus reads).
const METRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Liveness: the daemon answers, how many sandboxes it holds and the state of its warm pool.
#[utoipa::path(get, path = "/healthz", tag = "system",
    responses((status = 200, description = "The daemon is up", body = Health)))]
pub async fn healthz(State(manager): State<Manager>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        sandboxes: manager.counts().iter().map(|(_, n)| n).sum(),
        pool: manager.pool_status(),
    })
}

/// Prometheus metrics: sandboxes by state, create latency, execs, VM exits by reason, the warm
/// pool's clones.
#[utoipa::path(get, path = "/metrics", tag = "system",
    responses((status = 200, description = "OpenMetrics text exposition", body = String,
        content_type = "application/openmetrics-text")))]
pub async fn metrics(State(manager): State<Manager>) -> impl IntoResponse {
    if let Some(pool) = manager.pool_status() {
        manager.metrics().pool(pool.ready, pool.restoring);
    }
    let text = manager.metrics().render(&manager.counts());
    ([(header::CONTENT_TYPE, METRICS_TYPE)], text)
}

/// This API's OpenAPI 3.1 document, generated from the code.
#[utoipa::path(get, path = "/openapi.json", tag = "system",
    responses((status = 200, description = "The OpenAPI document", body = Object)))]
pub async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// 404 for unknown paths.
pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no route for {method} {}", uri.path()),
    )
}

/// 405 for known paths with another method.
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}", uri.path()),
    )
}

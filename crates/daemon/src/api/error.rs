//! API errors: every 4xx/5xx answer is `{"error": {"code", "message"}}`.

use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bulkhead_client::{ErrorBody, ErrorDetail};
use bulkhead_protocol::client::ClientError;
use bulkhead_protocol::ErrorCode;
use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::manager::ManagerError;

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {code}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Machine-readable code.
    pub code: &'static str,
    /// Human-readable explanation.
    pub message: String,
}

impl ApiError {
    /// An error with `status`, `code` and `message`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 413 `payload_too_large`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    /// The same error as a JSON document (for NDJSON `error` lines).
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            code: self.code.to_owned(),
            message: self.message.clone(),
        }
    }

    /// An error talking to a guest agent. The agent's own refusal gets the status of its
    /// [`ErrorCode`] (404 for a missing path, 403 for a refused access, 400 for a bad request or
    /// an unclassified refusal, 507 when the guest ran out of space or memory, 502 when agent
    /// and daemon disagree on the protocol); anything else means the VM is unreachable (502).
    pub fn from_agent(err: ClientError) -> Self {
        match err {
            ClientError::Agent(e) => {
                let (status, code) = match e.code {
                    ErrorCode::NotFound => (StatusCode::NOT_FOUND, "not_found"),
                    ErrorCode::PermissionDenied => (StatusCode::FORBIDDEN, "guest_denied"),
                    ErrorCode::InvalidRequest => (StatusCode::BAD_REQUEST, "guest_rejected"),
                    ErrorCode::ResourceExhausted => {
                        (StatusCode::INSUFFICIENT_STORAGE, "guest_exhausted")
                    }
                    ErrorCode::UnsupportedVersion | ErrorCode::Protocol => {
                        (StatusCode::BAD_GATEWAY, "agent_protocol")
                    }
                    ErrorCode::Other => (StatusCode::BAD_REQUEST, "guest_rejected"),
                };
                Self::new(status, code, e.message)
            }
            other => Self::new(
                StatusCode::BAD_GATEWAY,
                "agent_unreachable",
                format!(
                    "cannot reach the guest agent: {other} (a guest that stopped answering may be \
                     out of memory or hung: `bulkhead logs ID` shows its console, \
                     `bulkhead rm ID` ends it)"
                ),
            ),
        }
    }
}

impl From<ManagerError> for ApiError {
    fn from(err: ManagerError) -> Self {
        let (status, code) = match &err {
            ManagerError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ManagerError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            ManagerError::Ambiguous { .. } => (StatusCode::BAD_REQUEST, "ambiguous_id"),
            ManagerError::UnknownName { what: "kernel", .. } => {
                (StatusCode::NOT_FOUND, "kernel_not_found")
            }
            ManagerError::UnknownName {
                what: "template", ..
            } => (StatusCode::NOT_FOUND, "template_not_found"),
            ManagerError::UnknownName { .. } => (StatusCode::NOT_FOUND, "image_not_found"),
            ManagerError::InsufficientMemory(_) => {
                (StatusCode::UNPROCESSABLE_ENTITY, "insufficient_memory")
            }
            ManagerError::TooMany(_) => (StatusCode::TOO_MANY_REQUESTS, "too_many_sandboxes"),
            ManagerError::Conflict { .. } => (StatusCode::CONFLICT, "conflict"),
            ManagerError::Unsupported(_) => (StatusCode::CONFLICT, "not_supported"),
            ManagerError::Busy(_) => (StatusCode::CONFLICT, "busy"),
            ManagerError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
            ManagerError::BootTimeout(_) => (StatusCode::GATEWAY_TIMEOUT, "boot_timeout"),
            ManagerError::VmExited(_) => (StatusCode::BAD_GATEWAY, "vm_exited"),
            ManagerError::StartFailed(_) => (StatusCode::INTERNAL_SERVER_ERROR, "start_failed"),
            ManagerError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, code, err.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!("{}", self.message);
        }
        let body = ErrorBody {
            error: self.detail(),
        };
        (self.status, Json(body)).into_response()
    }
}

/// A JSON request body: read whole (within the body limit: 413 beyond it), then parsed
/// strictly (400 with serde's message for malformed JSON, wrong types and unknown fields; every
/// request body is a JSON object, so an array — which serde would map to fields by position —
/// is refused too). The content type is not checked, so `curl -d` works.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                "invalid JSON body: expected a JSON object".to_owned(),
            ));
        }
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("invalid JSON body: {e}"),
            )
        })
    }
}

fn body_rejection(rejection: BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::too_large(format!(
            "request body larger than {} bytes",
            super::MAX_JSON_BYTES
        ));
    }
    ApiError::new(rejection.status(), "invalid_body", rejection.body_text())
}

//! What a route answers when it cannot do what was asked: a status code and
//! `{"error": "...", "retryable": bool}`.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::reactor::CommandError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or wrong bearer token")]
    Unauthorized,
    #[error("a request that changes state needs Content-Type: application/json")]
    UnsupportedMediaType,
    #[error("WebSocket from origin {0:?} refused: not this listener's origin nor in [admin] allowed_origins")]
    ForbiddenOrigin(String),
    #[error("request for host {0:?} refused: an admin API without a token answers loopback only (or an [admin] allowed_origins host)")]
    ForbiddenHost(String),
    #[error("no {kind} named {name:?}")]
    NotFound { kind: &'static str, name: String },
    #[error("no such route")]
    NoRoute,
    #[error("{0}")]
    BadRequest(String),
    /// The route needs something this process does not run (a worker has no graphs).
    #[error("this process has no {0}")]
    NotServed(&'static str),
    #[error("graph {graph} is {status}, not running on this node")]
    GraphNotRunning { graph: String, status: String },
    #[error("graph {graph} did not answer in time")]
    Timeout { graph: String },
    /// A command to a graph's one reactor, sent to a keyed graph, which has one per key
    /// over partitions spread across the nodes.
    #[error("graph {graph} is keyed: it has no single reactor to command; look a key up with GET /graphs/{graph}/keys/{{key}}, or see who owns which partition with GET /graphs/{graph}/partitions")]
    Keyed { graph: String },
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::ForbiddenOrigin(_) | Self::ForbiddenHost(_) => StatusCode::FORBIDDEN,
            Self::NotFound { .. } | Self::NoRoute => StatusCode::NOT_FOUND,
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::NotServed(_) => StatusCode::NOT_IMPLEMENTED,
            Self::GraphNotRunning { .. } | Self::Timeout { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Keyed { .. } => StatusCode::CONFLICT,
            Self::Command(CommandError::NotRunning { .. }) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Command(CommandError::UnknownSource { .. }) => StatusCode::BAD_REQUEST,
            Self::Command(CommandError::Fire { .. }) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Command(CommandError::CountNotStored { .. }) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Store(e) if e.is_retryable() => StatusCode::SERVICE_UNAVAILABLE,
            Self::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Whether the same request may succeed later: a graph restarting or taking over, a
    /// store coming back.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::GraphNotRunning { .. } | Self::Timeout { .. } => true,
            Self::Command(e) => e.is_retryable(),
            Self::Store(e) => e.is_retryable(),
            Self::Unauthorized
            | Self::UnsupportedMediaType
            | Self::ForbiddenOrigin(_)
            | Self::ForbiddenHost(_)
            | Self::NotFound { .. }
            | Self::NoRoute
            | Self::BadRequest(_)
            | Self::NotServed(_)
            | Self::Keyed { .. } => false,
        }
    }

    /// The JSON body every error carries.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": self.to_string(), "retryable": self.is_retryable()})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        if matches!(self, Self::Unauthorized) {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// The most of a plain-text error answer kept as its message.
const PLAIN_ERROR_LIMIT: usize = 16 * 1024;

/// Gives the answers axum makes on its own (a method a route does not take, a path that
/// is not UTF-8, a body over the size limit, a WebSocket request without its upgrade
/// headers) the JSON body every error carries, with their text as the message, so a
/// client reads each error the same way.
pub(super) async fn json_errors(response: Response) -> Response {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, PLAIN_ERROR_LIMIT)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_string())
        .unwrap_or_default();
    let error = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_lowercase()
    } else {
        text
    };
    let retryable = matches!(
        status,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = json!({"error": error, "retryable": retryable}).to_string();
    Response::from_parts(parts, Body::from(body))
}

//! `GET /ws`: the graph commands over a WebSocket, one JSON reply per JSON request, in
//! order.
//!
//! Request (a text frame):
//! `{"id": <any, optional>, "command": "list" | "state" | "fire" | "fire_with" | "pause" | "resume" | "restart", "graph": "<name>", "cache": {"<source>": <value>}}`
//! (`graph` for all but `list`; `cache` for `fire_with` only).
//!
//! Reply: `{"id": <echoed>, "ok": true, "result": <what the matching HTTP route answers>}`
//! or `{"id": <echoed>, "ok": false, "status": <HTTP status>, "error": "...", "retryable": bool}`.
//!
//! The upgrade request needs the bearer token like any protected route. The server
//! closes the socket when it shuts down.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use axum::routing::get;
use axum::Extension;
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};

use super::graphs::{execute, GraphRequest};
use super::{AdminState, ApiError, Scope};

#[derive(Debug, Deserialize)]
struct WsRequest {
    #[serde(default)]
    id: Value,
    #[serde(flatten)]
    request: GraphRequest,
}

/// The largest request a WebSocket takes, as for an HTTP body: a command is small, and
/// the library's own limit (64 MiB) would let one caller hold that much per socket.
const WS_MESSAGE_LIMIT: usize = 2 * 1024 * 1024;

pub(super) fn routes() -> Router<AdminState> {
    Router::new().route("/ws", get(upgrade))
}

async fn upgrade(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    ws: WebSocketUpgrade,
) -> Response {
    ws.max_message_size(WS_MESSAGE_LIMIT)
        .max_frame_size(WS_MESSAGE_LIMIT)
        .on_upgrade(move |socket| session(socket, state, scope))
}

async fn session(mut socket: WebSocket, state: AdminState, scope: Scope) {
    let shutdown = state.shutdown().clone();
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => {
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
            message = socket.recv() => message,
        };
        let reply = match message {
            Some(Ok(Message::Text(text))) => respond(&state, &scope, text.as_bytes()).await,
            Some(Ok(Message::Binary(bytes))) => respond(&state, &scope, &bytes).await,
            // Pings are answered by the library; a close or an error ends the session.
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_)) | Err(_)) | None => return,
        };
        if socket
            .send(Message::Text(reply.to_string().into()))
            .await
            .is_err()
        {
            return;
        }
    }
}

/// The reply to one request frame from a caller in `scope`.
pub async fn respond(state: &AdminState, scope: &Scope, frame: &[u8]) -> Value {
    let parsed: Result<WsRequest, _> = serde_json::from_slice(frame);
    let (id, result) = match parsed {
        Ok(WsRequest { id, request }) => (id, execute(state, scope, request).await),
        Err(e) => {
            // Echo the id of a request that is JSON but not a valid command.
            let id = serde_json::from_slice::<Value>(frame)
                .ok()
                .and_then(|v| v.get("id").cloned())
                .unwrap_or(Value::Null);
            (
                id,
                Err(ApiError::BadRequest(format!("invalid command: {e}"))),
            )
        }
    };
    match result {
        Ok(result) => json!({"id": id, "ok": true, "result": result}),
        Err(e) => json!({
            "id": id,
            "ok": false,
            "status": e.status().as_u16(),
            "error": e.to_string(),
            "retryable": e.is_retryable(),
        }),
    }
}

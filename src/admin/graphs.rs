//! Graph routes, and the commands behind them that the WebSocket shares.
//!
//! - `GET /graphs`: `[{"name", "state", "status", ...}]`, `status` as in
//!   [`GraphStatus`] (`failed` adds `error`, `restarting` adds `failures`).
//! - `GET /graphs/{name}`: the reactor's [`ReactorStatus`] (per source: value, dirty flag,
//!   health, queued, last sequence; `state`, `paused`, `fires`) plus `status`.
//! - `POST /graphs/{name}/fire`: fire now; answers [`FireReport`] `{"fire", "outputs"}`.
//! - `POST /graphs/{name}/fire-with`, body `{"source": value, ...}`: replace those cached
//!   values and fire; answers [`FireReport`].
//! - `POST /graphs/{name}/pause`, `/resume`: `{"graph", "paused"}`. A keyed graph's
//!   pause is stored: every node running it stops reading its partitions (or reads
//!   again) within [`crate::keyed::PAUSE_POLL`], and a node started later follows it.
//! - `POST /graphs/{name}/restart`: start the graph afresh now, a Failed one included;
//!   `{"graph", "restarting": true}`.
//!
//! A graph this node does not run (standby, restarting, failed) answers 503 to the
//! reactor commands, `restart` excepted; an unknown graph 404.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::health::describe;
use super::{AdminState, ApiError, Scope};
use crate::reactor::{FireReport, ReactorState, ReactorStatus};
use crate::supervisor::{GraphHandle, GraphStatus};

/// Longest a command waits for the reactor's answer.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest `GET /graphs` waits for the store to say whether a keyed graph is paused.
const PAUSED_LOOKUP: Duration = Duration::from_secs(1);

/// A graph command, as the routes and the WebSocket (tagged by `command`) express it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum GraphRequest {
    List,
    State {
        graph: String,
    },
    Fire {
        graph: String,
    },
    FireWith {
        graph: String,
        cache: BTreeMap<String, Value>,
    },
    Pause {
        graph: String,
    },
    Resume {
        graph: String,
    },
    Restart {
        graph: String,
    },
}

/// One entry of `GET /graphs`.
#[derive(Debug, Clone, Serialize)]
pub struct GraphSummary {
    pub name: String,
    pub state: ReactorState,
    #[serde(flatten)]
    pub status: GraphStatus,
}

/// `GET /graphs/{name}`.
#[derive(Debug, Clone, Serialize)]
pub struct GraphDetail {
    #[serde(flatten)]
    pub status: GraphStatus,
    #[serde(flatten)]
    pub reactor: ReactorStatus,
}

pub(super) fn routes() -> Router<AdminState> {
    Router::new()
        .route("/graphs", get(list))
        .route("/graphs/{name}", get(state))
        .route("/graphs/{name}/fire", post(fire))
        .route("/graphs/{name}/fire-with", post(fire_with))
        .route("/graphs/{name}/pause", post(pause))
        .route("/graphs/{name}/resume", post(resume))
        .route("/graphs/{name}/restart", post(restart))
}

impl GraphRequest {
    fn graph_mut(&mut self) -> Option<&mut String> {
        match self {
            Self::List => None,
            Self::State { graph }
            | Self::Fire { graph }
            | Self::FireWith { graph, .. }
            | Self::Pause { graph }
            | Self::Resume { graph }
            | Self::Restart { graph } => Some(graph),
        }
    }
}

/// Runs one command for a caller in `scope`; the answer is the JSON the matching route
/// returns.
pub async fn execute(
    state: &AdminState,
    scope: &Scope,
    mut request: GraphRequest,
) -> Result<Value, ApiError> {
    if let Some(graph) = request.graph_mut() {
        *graph = scope.resolve("graph", graph)?;
    }
    match request {
        GraphRequest::List => {
            let graphs: Vec<GraphSummary> = state
                .supervisor
                .iter()
                .flat_map(|s| s.graphs())
                .filter(|g| scope.sees(g.name()))
                .map(|g| GraphSummary {
                    name: g.name().to_string(),
                    state: g.state(),
                    status: g.status(),
                })
                .collect();
            let mut listed = match to_json(&graphs) {
                Value::Array(listed) => listed,
                _ => Vec::new(),
            };
            // Keyed graphs run on every node that declares them, a share of their
            // partitions each (`GET /graphs/{name}/partitions` says whose).
            let keyed: Vec<_> = state
                .keyed_graphs()
                .filter(|(name, _)| scope.sees(name))
                .collect();
            // Unknown (null) while the store cannot say, soon: the list is still
            // answered, within one limit for all the keyed graphs together.
            let paused = futures::future::join_all(keyed.iter().map(|(name, _)| async move {
                match state.store() {
                    Some(store) => tokio::time::timeout(PAUSED_LOOKUP, store.load_paused(name))
                        .await
                        .ok()
                        .and_then(Result::ok),
                    None => None,
                }
            }))
            .await;
            for ((name, partitions), paused) in keyed.into_iter().zip(paused) {
                listed.push(json!({
                    "name": name,
                    "status": "running",
                    "paused": paused,
                    "keyed": {"partitions": partitions},
                }));
            }
            Ok(Value::Array(listed))
        }
        GraphRequest::State { graph } => {
            let handle = running(state, &graph)?;
            let reactor = answer(&graph, handle.reactor().get_state()).await?;
            Ok(to_json(&GraphDetail {
                status: handle.status(),
                reactor,
            }))
        }
        GraphRequest::Fire { graph } => {
            let handle = running(state, &graph)?;
            let report: FireReport = answer(&graph, handle.reactor().force_fire()).await?;
            Ok(to_json(&report))
        }
        GraphRequest::FireWith { graph, cache } => {
            // Kept in the cache and its snapshots as any event is: no deeper.
            for (source, value) in &cache {
                crate::codec::json::check_depth(value)
                    .map_err(|e| ApiError::BadRequest(format!("source {source}: {e}")))?;
            }
            let handle = running(state, &graph)?;
            let report = answer(&graph, handle.reactor().fire_with(cache)).await?;
            Ok(to_json(&report))
        }
        GraphRequest::Pause { graph } if state.keyed_graph(&graph).is_some() => {
            pause_keyed(state, &graph, true).await
        }
        GraphRequest::Resume { graph } if state.keyed_graph(&graph).is_some() => {
            pause_keyed(state, &graph, false).await
        }
        GraphRequest::Pause { graph } => {
            let handle = running(state, &graph)?;
            answer(&graph, handle.reactor().pause()).await?;
            Ok(json!({"graph": graph, "paused": true}))
        }
        GraphRequest::Resume { graph } => {
            let handle = running(state, &graph)?;
            answer(&graph, handle.reactor().resume()).await?;
            Ok(json!({"graph": graph, "paused": false}))
        }
        GraphRequest::Restart { graph } => {
            lookup(state, &graph)?.restart();
            Ok(json!({"graph": graph, "restarting": true}))
        }
    }
}

/// A keyed graph has no one reactor to tell: its pause goes to the store, which every
/// node running the graph follows.
async fn pause_keyed(state: &AdminState, graph: &str, paused: bool) -> Result<Value, ApiError> {
    state.require_store()?.save_paused(graph, paused).await?;
    Ok(json!({"graph": graph, "paused": paused}))
}

/// weir's response types have string keys and JSON values only, so this cannot fail.
pub(super) fn to_json<T: Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

fn lookup(state: &AdminState, name: &str) -> Result<GraphHandle, ApiError> {
    if let Some(handle) = state.supervisor.as_ref().and_then(|s| s.graph(name)) {
        return Ok(handle);
    }
    Err(match state.keyed_graph(name) {
        Some(_) => ApiError::Keyed {
            graph: name.to_string(),
        },
        None => ApiError::NotFound {
            kind: "graph",
            name: name.to_string(),
        },
    })
}

/// The graph's handle if its reactor runs on this node. Commands to a graph that is not
/// running would wait in its queue until it runs again, perhaps never.
fn running(state: &AdminState, name: &str) -> Result<GraphHandle, ApiError> {
    let handle = lookup(state, name)?;
    match handle.status() {
        GraphStatus::Running => Ok(handle),
        status => Err(ApiError::GraphNotRunning {
            graph: name.to_string(),
            status: describe(&status),
        }),
    }
}

async fn answer<T>(
    graph: &str,
    reply: impl std::future::Future<Output = Result<T, crate::reactor::CommandError>>,
) -> Result<T, ApiError> {
    match tokio::time::timeout(COMMAND_TIMEOUT, reply).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ApiError::Timeout {
            graph: graph.to_string(),
        }),
    }
}

async fn list(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
) -> Result<Json<Value>, ApiError> {
    execute(&state, &scope, GraphRequest::List).await.map(Json)
}

async fn state(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(graph): Path<String>,
) -> Result<Json<Value>, ApiError> {
    execute(&state, &scope, GraphRequest::State { graph })
        .await
        .map(Json)
}

async fn fire(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(graph): Path<String>,
) -> Result<Json<Value>, ApiError> {
    execute(&state, &scope, GraphRequest::Fire { graph })
        .await
        .map(Json)
}

/// The body is JSON (the content type must say so, see [`super::auth`]).
async fn fire_with(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(graph): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let cache: BTreeMap<String, Value> = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "the body must be a JSON object of source name to value: {e}"
        ))
    })?;
    execute(&state, &scope, GraphRequest::FireWith { graph, cache })
        .await
        .map(Json)
}

async fn pause(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(graph): Path<String>,
) -> Result<Json<Value>, ApiError> {
    execute(&state, &scope, GraphRequest::Pause { graph })
        .await
        .map(Json)
}

async fn resume(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(graph): Path<String>,
) -> Result<Json<Value>, ApiError> {
    execute(&state, &scope, GraphRequest::Resume { graph })
        .await
        .map(Json)
}

async fn restart(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(graph): Path<String>,
) -> Result<Json<Value>, ApiError> {
    execute(&state, &scope, GraphRequest::Restart { graph })
        .await
        .map(Json)
}

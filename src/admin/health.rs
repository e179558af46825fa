//! `GET /healthz`, `GET /readyz` and `GET /metrics`: open on every listener.
//!
//! Readiness: the store and the broker answer a ping within [`PING_TIMEOUT`], every
//! background task the process needs (the cron scheduler) still runs, and every
//! graph this node runs is Live. A graph on standby (another node holds its lease) does
//! not make the node unready: standing by is its job. Anything else (Warming, Degraded,
//! Restarting, Failed) does. The 503 body lists each reason:
//! `{"ready": false, "reasons": ["store: ...", "graph prices: warming"]}`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::{AdminState, ApiError};
use crate::reactor::ReactorState;
use crate::supervisor::GraphStatus;

/// Longest a readiness probe waits for the store or the broker.
pub const PING_TIMEOUT: Duration = Duration::from_secs(2);

pub(super) fn routes() -> Router<AdminState> {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .merge(metrics_routes())
}

pub(super) fn metrics_routes() -> Router<AdminState> {
    Router::new().route("/metrics", get(metrics))
}

async fn metrics(State(state): State<AdminState>) -> Response {
    match &state.metrics {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => ApiError::NotServed("metrics recorder").into_response(),
    }
}

/// A background task readiness depends on, such as the cron scheduler.
#[derive(Debug, Clone)]
pub struct Watched {
    name: &'static str,
    stopped: Arc<AtomicBool>,
}

impl Watched {
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            stopped: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Watches the spawned task: if it ends before `shutdown` (it returned, or
    /// panicked), the process is unready and the end is logged. The handle returned
    /// ends with the task.
    pub fn watch(&self, task: JoinHandle<()>, shutdown: CancellationToken) -> JoinHandle<()> {
        let (name, stopped) = (self.name, self.stopped.clone());
        tokio::spawn(async move {
            let ended = task.await;
            if !shutdown.is_cancelled() {
                stopped.store(true, Ordering::SeqCst);
                match ended {
                    Err(e) if e.is_panic() => tracing::error!(task = name, "task panicked"),
                    _ => tracing::error!(task = name, "task stopped"),
                }
            }
        })
    }
}

/// Why this process is not ready; empty when it is.
pub async fn unready_reasons(state: &AdminState) -> Vec<String> {
    let store = async {
        let store = state.store.as_ref()?;
        match tokio::time::timeout(PING_TIMEOUT, store.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("store: {e}")),
            Err(_) => Some(format!("store: no answer within {PING_TIMEOUT:?}")),
        }
    };
    let broker = async {
        let broker = state.broker.as_ref()?;
        match tokio::time::timeout(PING_TIMEOUT, broker.ping()).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("broker: {e}")),
            Err(_) => Some(format!("broker: no answer within {PING_TIMEOUT:?}")),
        }
    };
    let (store, broker) = tokio::join!(store, broker);
    let mut reasons: Vec<String> = store.into_iter().chain(broker).collect();
    for task in &state.tasks {
        if task.stopped.load(Ordering::SeqCst) {
            reasons.push(format!("{}: stopped", task.name));
        }
    }
    if let Some(supervisor) = &state.supervisor {
        for graph in supervisor.graphs() {
            match graph.status() {
                GraphStatus::Standby => {}
                GraphStatus::Running => {
                    let reactor = graph.state();
                    if reactor != ReactorState::Live {
                        reasons.push(format!("graph {}: {}", graph.name(), reactor.as_str()));
                    }
                }
                status => reasons.push(format!("graph {}: {}", graph.name(), describe(&status))),
            }
        }
    }
    reasons
}

/// A status as one word (with the detail Failed carries).
pub fn describe(status: &GraphStatus) -> String {
    match status {
        GraphStatus::Standby => "standby".into(),
        GraphStatus::Running => "running".into(),
        GraphStatus::Restarting { failures } => format!("restarting after {failures} failures"),
        GraphStatus::Failed { error } => format!("failed: {error}"),
        GraphStatus::Stopped => "stopped".into(),
    }
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let reasons = unready_reasons(&state).await;
    if reasons.is_empty() {
        Json(json!({"ready": true})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"ready": false, "reasons": reasons})),
        )
            .into_response()
    }
}

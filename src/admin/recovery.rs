//! `GET /recovery-events?graph=&limit=`: the supervisor's recovery events, newest first;
//! every graph's without `graph`, at most `limit` (default 100, capped at 10,000).

use axum::extract::{Query, State};
use axum::routing::get;
use axum::Extension;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;

use super::graphs::to_json;
use super::{AdminState, ApiError, Scope};

/// Events one request returns without `limit`.
const RECOVERY_EVENTS_LIMIT: usize = 100;
/// Most events one request returns.
const MAX_LIMIT: usize = 10_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecoveryQuery {
    graph: Option<String>,
    limit: Option<usize>,
}

pub(super) fn routes() -> Router<AdminState> {
    Router::new().route("/recovery-events", get(list))
}

async fn list(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    query: Result<Query<RecoveryQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let store = state.require_store()?;
    let limit = query.limit.unwrap_or(RECOVERY_EVENTS_LIMIT).min(MAX_LIMIT);
    let graph = match &query.graph {
        Some(graph) => Some(scope.resolve("graph", graph)?),
        None => None,
    };
    let events = match (&scope, &graph) {
        (Scope::Tenant(tenant), None) => store.tenant_recovery_events(tenant, limit).await?,
        _ => store.recovery_events(graph.as_deref(), limit).await?,
    };
    Ok(Json(to_json(&events)))
}

//! Schedule routes, over the store.
//!
//! - `GET /schedules`: every schedule as stored, plus `next_fire` (RFC 3339 or null);
//!   then each whose stored record does not read back, as `{"id", "unreadable": why}`.
//! - `GET /schedules/{id}`: the same for one, plus its newest `executions`, then each
//!   of those whose stored record does not read back, as `{"scheduled_ms", "unreadable": why}`.
//! - `POST /schedules/{id}/pause`, `/resume`: `{"id", "enabled"}`; resuming fires from the
//!   next time after now.

use std::collections::HashMap;

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::Extension;
use axum::{Json, Router};
use chrono::{TimeZone, Utc};
use serde_json::{json, Value};

use super::graphs::to_json;
use super::{AdminState, ApiError, Scope};
use crate::cron::format_instant;
use crate::cron::scheduler::{set_enabled, shard_of, RegisterError};
use crate::cron::Schedule;
use crate::store::Store;

/// Executions shown with one schedule.
const EXECUTIONS_SHOWN: usize = 20;

pub(super) fn routes() -> Router<AdminState> {
    Router::new()
        .route("/schedules", get(list))
        .route("/schedules/{id}", get(show))
        .route("/schedules/{id}/pause", post(pause))
        .route("/schedules/{id}/resume", post(resume))
}

/// Next fire times of the shards' schedules, by id.
async fn next_fires(
    store: &dyn Store,
    shards: impl IntoIterator<Item = u32>,
) -> Result<HashMap<String, i64>, ApiError> {
    let mut next = HashMap::new();
    for shard in shards {
        next.extend(store.due_schedules(shard, i64::MAX, usize::MAX).await?);
    }
    Ok(next)
}

fn entry(schedule: &Schedule, next: &HashMap<String, i64>) -> Value {
    let mut value = to_json(schedule);
    value["next_fire"] = next
        .get(&schedule.id)
        .and_then(|ms| Utc.timestamp_millis_opt(*ms).single())
        .map(format_instant)
        .into();
    value
}

async fn list(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
) -> Result<Json<Value>, ApiError> {
    let store = state.require_store()?;
    let mut list = store.list_schedules().await?;
    list.schedules.retain(|s| scope.owns(s.tenant.as_deref()));
    let next = next_fires(store.as_ref(), 0..state.cron_shards().max(1)).await?;
    let mut entries: Vec<Value> = list.schedules.iter().map(|s| entry(s, &next)).collect();
    // A record that does not read back has no tenant to go by but its id's.
    entries.extend(
        list.unreadable
            .iter()
            .filter(|u| scope.sees(&u.id))
            .map(|u| json!({"id": u.id, "unreadable": unreadable_why(&scope, &u.error)})),
    );
    Ok(Json(Value::Array(entries)))
}

/// Why a stored record does not read back, as `scope` may see it: the error names the
/// store's key, which is for operators, not tenants.
fn unreadable_why(scope: &Scope, error: &crate::store::StoreError) -> String {
    match scope {
        Scope::All => error.to_string(),
        Scope::Tenant(_) => "its stored record does not read back".to_string(),
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        kind: "schedule",
        name: id.to_string(),
    }
}

async fn show(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = scope.resolve("schedule", &id)?;
    let store = state.require_store()?;
    let schedule = store
        .get_schedule(&id)
        .await?
        .filter(|s| scope.owns(s.tenant.as_deref()))
        .ok_or_else(|| not_found(&id))?;
    let next: HashMap<String, i64> = store
        .next_fire(shard_of(&id, state.cron_shards()), &id)
        .await?
        .map(|at| (id.clone(), at))
        .into_iter()
        .collect();
    let mut value = entry(&schedule, &next);
    let list = store.executions(&id, EXECUTIONS_SHOWN).await?;
    let mut executions: Vec<Value> = list.executions.iter().map(to_json).collect();
    executions.extend(list.unreadable.iter().map(
        |u| json!({"scheduled_ms": u.scheduled_ms, "unreadable": unreadable_why(&scope, &u.error)}),
    ));
    value["executions"] = Value::Array(executions);
    Ok(Json(value))
}

async fn toggle(
    state: &AdminState,
    scope: &Scope,
    id: &str,
    enabled: bool,
) -> Result<Json<Value>, ApiError> {
    let store = state.require_store()?;
    if *scope != Scope::All {
        let owned = store
            .get_schedule(id)
            .await?
            .is_some_and(|s| scope.owns(s.tenant.as_deref()));
        if !owned {
            return Err(not_found(id));
        }
    }
    let found = set_enabled(store.as_ref(), id, enabled, state.cron_shards())
        .await
        .map_err(|e| match e {
            RegisterError::Store(e) => ApiError::Store(e),
            RegisterError::Invalid(e) => {
                ApiError::BadRequest(format!("stored schedule {id:?} is invalid: {e}"))
            }
        })?;
    if !found {
        return Err(not_found(id));
    }
    Ok(Json(json!({"id": id, "enabled": enabled})))
}

async fn pause(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = scope.resolve("schedule", &id)?;
    toggle(&state, &scope, &id, false).await
}

async fn resume(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = scope.resolve("schedule", &id)?;
    toggle(&state, &scope, &id, true).await
}

//! `GET /workflows/{id}`: one workflow execution — status, each task's status, attempts
//! and executor (as `weir workflow status` prints it), plus its context.

use axum::extract::{Path, State};
use axum::routing::get;
use axum::Extension;
use axum::{Json, Router};
use serde_json::Value;

use super::{AdminState, ApiError, Scope};

pub(super) fn routes() -> Router<AdminState> {
    Router::new().route("/workflows/{id}", get(show))
}

async fn show(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let store = state.require_store()?;
    let execution = store
        .get_workflow_execution(&id)
        .await?
        // Another tenant's execution is not there, as far as this caller can tell.
        .filter(|e| scope.sees(&e.workflow))
        .ok_or_else(|| ApiError::NotFound {
            kind: "workflow execution",
            name: id.clone(),
        })?;
    let mut value = execution.summary();
    value["context"] = execution.context.clone();
    value["created_ms"] = execution.created_ms.into();
    value["updated_ms"] = execution.updated_ms.into();
    Ok(Json(value))
}

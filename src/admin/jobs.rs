//! Job routes, over the store.
//!
//! - `GET /jobs/{type}/{id}`: `{"type", "id", "state", "owner", "status"}`, as
//!   `weir job get` prints it. Jobs belong to no tenant: a tenant's token sees none.

use axum::extract::{Path, State};
use axum::routing::get;
use axum::Extension;
use axum::{Json, Router};

use super::{AdminState, ApiError, Scope};
use crate::jobs::JobView;

pub(super) fn routes() -> Router<AdminState> {
    Router::new().route("/jobs/{job_type}/{id}", get(show))
}

async fn show(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path((job_type, id)): Path<(String, String)>,
) -> Result<Json<JobView>, ApiError> {
    let not_found = || ApiError::NotFound {
        kind: "job",
        name: format!("{job_type}/{id}"),
    };
    if !scope.owns(None) {
        return Err(not_found());
    }
    let store = state.require_store()?;
    crate::jobs::view(store.as_ref(), &job_type, &id)
        .await?
        .map(Json)
        .ok_or_else(not_found)
}

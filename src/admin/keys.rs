//! Keys of keyed graphs, over the store.
//!
//! - `GET /graphs/{name}/keys/{key}`: `{"graph", "key", "partition", "owner", "state"}`:
//!   the key's state as last stored (at most one batch behind its owner) and the node
//!   owning its partition, whichever node is asked.

use axum::extract::{Path, State};
use axum::routing::get;
use axum::Extension;
use axum::{Json, Router};

use super::{AdminState, ApiError, Scope};
use crate::keyed::KeyView;

pub(super) fn routes() -> Router<AdminState> {
    Router::new().route("/graphs/{name}/keys/{key}", get(show))
}

async fn show(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path((name, key)): Path<(String, String)>,
) -> Result<Json<KeyView>, ApiError> {
    let graph = scope.resolve("graph", &name)?;
    let partitions = state
        .keyed_graph(&graph)
        .ok_or_else(|| ApiError::NotFound {
            kind: "keyed graph",
            name: graph.clone(),
        })?;
    let store = state.require_store()?;
    crate::keyed::view(store.as_ref(), &graph, partitions, &key)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound {
            kind: "key",
            name: format!("{graph}/{key}"),
        })
}

//! Keys of keyed graphs, over the store.
//!
//! - `GET /graphs/{name}/keys/{key}`: `{"graph", "key", "partition", "owner", "state"}`:
//!   the key's state as last stored (at most one batch behind its owner) and the node
//!   owning its partition, whichever node is asked.
//! - `GET /graphs/{name}/partitions`: `{"graph", "partitions": [{"partition", "owner"}]}`:
//!   which node owns each partition (`null` while none does), whichever node is asked.

use axum::extract::{Path, State};
use axum::routing::get;
use axum::Extension;
use axum::{Json, Router};

use futures::{StreamExt, TryStreamExt};

use super::{AdminState, ApiError, Scope};
use crate::keyed::KeyView;

/// Partition owners looked up at once for `/partitions`.
const OWNER_LOOKUPS_AT_ONCE: usize = 32;

pub(super) fn routes() -> Router<AdminState> {
    Router::new()
        .route("/graphs/{name}/keys/{key}", get(show))
        .route("/graphs/{name}/partitions", get(partitions))
}

/// The graph's partition count, for a keyed graph this process runs.
fn keyed(state: &AdminState, graph: &str) -> Result<u32, ApiError> {
    state.keyed_graph(graph).ok_or_else(|| ApiError::NotFound {
        kind: "keyed graph",
        name: graph.to_string(),
    })
}

async fn partitions(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let graph = scope.resolve("graph", &name)?;
    let partitions = keyed(&state, &graph)?;
    let store = state.require_store()?;
    let group = crate::keyed::ownership_group(&graph);
    let store = store.as_ref();
    let group = &group;
    // Looked up several at a time: one after another, a graph of many partitions would
    // take as many round trips.
    let owners: Vec<serde_json::Value> = futures::stream::iter(0..partitions as i32)
        .map(|partition| async move {
            let lease = crate::ownership::partition_lease(group, partition);
            let owner = store
                .current_lease(&lease)
                .await?
                .map(|l| crate::lease::holder_node(&l.holder).to_string());
            Ok::<_, ApiError>(serde_json::json!({"partition": partition, "owner": owner}))
        })
        .buffered(OWNER_LOOKUPS_AT_ONCE)
        .try_collect()
        .await?;
    Ok(Json(
        serde_json::json!({"graph": graph, "partitions": owners}),
    ))
}

async fn show(
    State(state): State<AdminState>,
    Extension(scope): Extension<Scope>,
    Path((name, key)): Path<(String, String)>,
) -> Result<Json<KeyView>, ApiError> {
    let graph = scope.resolve("graph", &name)?;
    let partitions = keyed(&state, &graph)?;
    let store = state.require_store()?;
    crate::keyed::view(store.as_ref(), &graph, partitions, &key)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound {
            kind: "key",
            name: format!("{graph}/{key}"),
        })
}

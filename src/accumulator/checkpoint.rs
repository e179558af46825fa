//! What an accumulator resumes from, and the store role that keeps it.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::lease::Fence;
use crate::store_error::StoreError;
use crate::transport::Position;

/// What an accumulator resumes from: source positions (with the last push id at
/// [`crate::accumulator::PUSH_PARTITION`]) and its own state, consistent with each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Checkpoint {
    pub positions: Vec<Position>,
    pub state: Option<serde_json::Value>,
    /// Fencing token of the graph lease its writer held, if the graph runs under one.
    #[serde(default)]
    pub token: Option<u64>,
}

/// Where accumulators keep their checkpoints, one per (graph, accumulator).
#[async_trait]
pub trait CheckpointStore: Send + Sync {
    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError>;

    /// Writes a checkpoint; with a `fence`, only while no newer token of its lease exists
    /// (else [`StoreError::Fenced`]).
    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError>;
}

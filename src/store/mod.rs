//! The state seam: accumulator checkpoints, reactor cache snapshots, recovery events and
//! leases. Backends: [`memory`] (the embedded default).

pub mod memory;
pub mod redis;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::reactor::CacheSnapshot;
use crate::transport::Position;

/// What an accumulator resumes from: source positions, its own state and the last
/// sequence number it emitted, all consistent with each other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Checkpoint {
    pub positions: Vec<Position>,
    pub sequence: u64,
    pub state: Option<serde_json::Value>,
}

/// One supervisor action, kept for operators to query.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryEvent {
    pub graph: String,
    /// `reactor`, or the accumulator's name.
    pub component: String,
    pub action: RecoveryAction,
    /// Consecutive failure count when this happened (1-based).
    pub attempt: u32,
    pub error: String,
    pub at_ms: i64,
    pub node_id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryAction {
    AccumulatorRestarted,
    GraphRespawned,
    GraphFailed,
}

impl RecoveryAction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AccumulatorRestarted => "accumulator_restarted",
            Self::GraphRespawned => "graph_respawned",
            Self::GraphFailed => "graph_failed",
        }
    }
}

/// A held lease. The fencing token grows with every acquisition of the same name, so a
/// consumer can reject work from a holder that has since lost the lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub token: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unreachable: {0}")]
    Unreachable(String),
    #[error("store operation {operation} failed: {reason}")]
    Operation {
        operation: &'static str,
        reason: String,
    },
    #[error("stored value under {key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unreachable(_) | Self::Operation { .. })
    }
}

/// Durable state for graphs. Keys are already tenant-qualified by the caller.
#[async_trait]
pub trait Store: Send + Sync {
    fn kind(&self) -> &'static str;

    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError>;

    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
    ) -> Result<(), StoreError>;

    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError>;

    async fn save_cache(&self, graph: &str, snapshot: &CacheSnapshot) -> Result<(), StoreError>;

    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError>;

    /// Newest first; `graph = None` lists every graph's.
    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError>;

    /// Takes the lease if it is free or expired; `None` if someone else holds it.
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError>;

    /// Extends a lease still held by the same holder with the same token.
    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError>;

    /// Releases the lease only if it is still this holder's (compare and set).
    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError>;

    async fn ping(&self) -> Result<(), StoreError>;
}

//! What the supervisor did to keep graphs running, kept for operators: recovery events
//! and the store role that logs them.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::store_error::StoreError;

/// One supervisor action, kept for operators to query.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecoveryEvent {
    pub graph: String,
    /// `reactor`, or the accumulator's name.
    pub component: String,
    pub action: RecoveryAction,
    /// Consecutive failure count when this happened (1-based); 0 for a wait on an
    /// unreachable store or broker, which never counts toward Failed.
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

/// Where recovery events are logged and read back (the admin API lists them).
#[async_trait]
pub trait RecoveryLog: Send + Sync {
    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError>;

    /// Newest first; `graph = None` lists every graph's.
    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError>;

    /// Newest first, of `tenant`'s graphs only: kept apart from every graph's list, so
    /// other tenants' events never crowd a tenant's out of it.
    async fn tenant_recovery_events(
        &self,
        tenant: &str,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError>;
}

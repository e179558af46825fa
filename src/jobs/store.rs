//! Where jobs keep their state: the [`JobStore`] role.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::lease::Fence;
use crate::store_error::StoreError;

/// A job as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: String,
    pub state: Value,
    /// When the pending timeout falls due, in ms since the Unix epoch.
    #[serde(default)]
    pub timeout_at_ms: Option<i64>,
    /// The partition the job's messages come from.
    pub partition: i32,
    /// The position (offset, stream sequence) of the last message applied to the job;
    /// one at or below it is a replay.
    pub position: i64,
}

/// What a new owner of a partition starts from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PartitionSnapshot {
    /// The last position applied; reading resumes after it.
    pub position: Option<i64>,
    /// Pending timeouts: (job id, due ms).
    pub timeouts: Vec<(String, i64)>,
    /// The lease token and time (ms) of the owner's last clean hand-over, if any.
    pub released: Option<(u64, i64)>,
}

/// One batch of a partition's changes, written at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PartitionChanges {
    /// The last position applied, when the batch applied messages.
    pub position: Option<i64>,
    /// Jobs written whole, their timeouts with them.
    pub put: Vec<JobRecord>,
    /// Jobs stopped: removed with their timeouts.
    pub removed: Vec<String>,
    /// Set by an owner handing the partition over: its lease token and the time.
    pub released: Option<(u64, i64)>,
}

impl PartitionChanges {
    pub fn is_empty(&self) -> bool {
        self.position.is_none()
            && self.put.is_empty()
            && self.removed.is_empty()
            && self.released.is_none()
    }
}

/// Job records, per type, with each partition's position and pending timeouts.
#[async_trait]
pub trait JobStore: Send + Sync {
    /// The records of these jobs, `None` for unknown ids, in the same order.
    async fn load_jobs(
        &self,
        job_type: &str,
        ids: &[String],
    ) -> Result<Vec<Option<JobRecord>>, StoreError>;

    /// What a new owner of the partition starts from.
    async fn load_partition(
        &self,
        job_type: &str,
        partition: i32,
    ) -> Result<PartitionSnapshot, StoreError>;

    /// Writes a batch: every record, timeout and removal with the partition's position,
    /// all or nothing, refused whole once the fence's lease has a newer token.
    async fn save_partition(
        &self,
        job_type: &str,
        partition: i32,
        changes: &PartitionChanges,
        fence: &Fence,
    ) -> Result<(), StoreError>;

    /// The ids of the type's jobs, sorted.
    async fn list_jobs(&self, job_type: &str) -> Result<Vec<String>, StoreError>;
}

//! The state seam: accumulator checkpoints, reactor cache snapshots, recovery events and
//! leases. Backends: [`memory`] (the embedded default).

pub(crate) mod behind;
pub mod memory;
pub mod redis;

use std::collections::BTreeSet;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::cron::Schedule;
use crate::dispatch::WorkflowExecution;
use crate::reactor::CacheSnapshot;
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

/// A held lease. The fencing token grows with every acquisition of the same name, so a
/// consumer can reject work from a holder that has since lost the lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub token: u64,
}

/// What a lease holder's write carries: the store refuses the write once the lease has
/// been taken with a newer token, so a holder that lost its lease (paused past its TTL,
/// cut off) cannot overwrite its successor's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub lease: String,
    pub token: u64,
}

impl From<&Lease> for Fence {
    fn from(lease: &Lease) -> Self {
        Self {
            lease: lease.name.clone(),
            token: lease.token,
        }
    }
}

/// One firing of a schedule: at most one record per (schedule, scheduled time).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Execution {
    pub schedule_id: String,
    pub scheduled_ms: i64,
    pub tick_id: String,
    pub status: ExecutionStatus,
    pub attempt: u32,
    /// Emission attempts allowed before the execution is marked failed; stored with the
    /// record so a new master applies the same cap.
    pub max_attempts: u32,
    pub node_id: String,
    pub fencing_token: u64,
    pub updated_ms: i64,
    pub error: Option<String>,
}

impl Execution {
    /// The execution's place in the index of unfinished executions: when it last
    /// changed, or 0 for a buffered one (due a look at every sweep); `None` once it is
    /// finished.
    pub fn open_since(&self) -> Option<i64> {
        match self.status {
            ExecutionStatus::Scheduled | ExecutionStatus::Running => Some(self.updated_ms),
            ExecutionStatus::Buffered => Some(0),
            ExecutionStatus::Completed
            | ExecutionStatus::Failed
            | ExecutionStatus::Skipped
            | ExecutionStatus::Missed => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionStatus {
    /// Claimed by a master; the tick is being emitted.
    Scheduled,
    /// The tick was emitted; its work is under way.
    Running,
    Completed,
    Failed,
    /// Not fired: the overlap policy dropped it.
    Skipped,
    /// Held back by `buffer_one` until the running execution ends.
    Buffered,
    /// An `at_most_once` tick that may or may not have gone out (its acknowledgement
    /// failed, or its master died before recording it): never emitted again.
    Missed,
}

/// Wakes a scheduler when schedules change.
pub struct ScheduleChanges {
    pub(crate) receiver: tokio::sync::mpsc::Receiver<()>,
}

impl ScheduleChanges {
    /// Waits for the next change: true for a change, false once the feed has ended
    /// (its connection dropped), after which the caller subscribes again.
    pub async fn changed(&mut self) -> bool {
        self.receiver.recv().await.is_some()
    }
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
    /// The writer's lease was taken with a newer token: it is no longer the holder.
    #[error("write refused: lease {lease} has a newer holder than token {token}")]
    Fenced { lease: String, token: u64 },
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

    /// Writes a checkpoint; with a `fence`, only while no newer token of its lease exists
    /// (else [`StoreError::Fenced`]).
    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError>;

    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError>;

    /// Writes a cache snapshot, fenced as [`Store::save_checkpoint`] is.
    async fn save_cache(
        &self,
        graph: &str,
        snapshot: &CacheSnapshot,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError>;

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

    /// Creates or replaces a schedule and wakes the schedulers.
    async fn put_schedule(&self, schedule: &Schedule) -> Result<(), StoreError>;

    async fn get_schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError>;

    async fn list_schedules(&self) -> Result<Vec<Schedule>, StoreError>;

    /// Removes a schedule and its pending fire time; false if there was none.
    async fn delete_schedule(&self, id: &str, shard: u32) -> Result<bool, StoreError>;

    /// Sets (or clears) a schedule's next fire time in its shard's sorted set.
    async fn set_next_fire(
        &self,
        shard: u32,
        id: &str,
        at_ms: Option<i64>,
    ) -> Result<(), StoreError>;

    /// Schedules of a shard due at or before `until_ms`, earliest first.
    async fn due_schedules(
        &self,
        shard: u32,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError>;

    /// The earliest next fire time in a shard.
    async fn earliest_fire(&self, shard: u32) -> Result<Option<i64>, StoreError>;

    /// Creates the execution record if none exists for its (schedule, scheduled time):
    /// true for the one caller that created it.
    async fn claim_execution(&self, execution: &Execution) -> Result<bool, StoreError>;

    /// [`Store::claim_execution`] for many records in one round trip. With a `fence`
    /// (a shard master's lease), refused once a newer master holds the shard.
    async fn claim_executions(
        &self,
        executions: &[Execution],
        fence: Option<&Fence>,
    ) -> Result<Vec<bool>, StoreError>;

    /// [`Store::put_execution`] and [`Store::set_next_fire`] for many records in one
    /// round trip, fenced as [`Store::claim_executions`] is.
    async fn record_fires(
        &self,
        shard: u32,
        executions: &[Execution],
        next_fires: &[(String, Option<i64>)],
        fence: Option<&Fence>,
    ) -> Result<(), StoreError>;

    /// Overwrites an execution record (status changes); with a `fence`, refused once a
    /// newer master holds its shard.
    async fn put_execution(
        &self,
        execution: &Execution,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError>;

    async fn get_execution(
        &self,
        schedule_id: &str,
        scheduled_ms: i64,
    ) -> Result<Option<Execution>, StoreError>;

    /// Unfinished executions (scheduled or running) last changed at or before
    /// `changed_by_ms`, and every buffered one, oldest change first, the first `skip`
    /// passed over, at most `limit`, as (schedule id, scheduled time): what orphan
    /// recovery looks at, without reading every schedule.
    async fn open_executions(
        &self,
        changed_by_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError>;

    /// Newest first.
    async fn executions(
        &self,
        schedule_id: &str,
        limit: usize,
    ) -> Result<Vec<Execution>, StoreError>;

    /// Announces a live node and its election priority for `ttl`.
    async fn register_node(
        &self,
        node: &str,
        priority: i64,
        ttl: Duration,
    ) -> Result<(), StoreError>;

    /// Nodes whose registration has not expired, with their priorities.
    async fn live_nodes(&self) -> Result<Vec<(String, i64)>, StoreError>;

    /// A feed of schedule changes, to wake sleeping schedulers.
    async fn watch_schedules(&self) -> Result<ScheduleChanges, StoreError>;

    /// Stores a new workflow execution unless one with its id exists: true if created.
    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError>;

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError>;

    /// Replaces the stored execution if its version is still `execution.version - 1`
    /// (compare and set); false if another writer changed it first.
    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError>;

    /// Records that the TaskReadyEvents of `tasks` were published for `execution`, so a
    /// repeated start or result does not dispatch them a second time while they run.
    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError>;

    /// The tasks of `execution` recorded by [`Store::mark_tasks_published`].
    async fn published_tasks(&self, execution: &str) -> Result<BTreeSet<String>, StoreError>;

    /// Files a workflow execution under the time it must have ended by.
    async fn set_workflow_deadline(
        &self,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError>;

    /// Executions whose deadline is at or before `until_ms`, earliest first.
    async fn due_workflow_deadlines(
        &self,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<String>, StoreError>;

    async fn clear_workflow_deadline(&self, execution: &str) -> Result<(), StoreError>;
}

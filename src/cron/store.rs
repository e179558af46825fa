//! The cron scheduler's records (executions of schedules), and the store role that keeps
//! them with the schedules, their fire times and the live nodes.

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::Schedule;
use crate::dispatch::{CronOrigin, RunStatus, TickOutcomes, WorkflowStore};
use crate::lease::{Fence, LeaseStore};
use crate::store_error::StoreError;

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

impl ExecutionStatus {
    /// Ended with its work's outcome: nothing the scheduler does changes it any more.
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Completed | Self::Failed)
    }
}

/// Wakes a scheduler when schedules change, naming each schedule changed.
pub struct ScheduleChanges {
    pub(crate) receiver: tokio::sync::mpsc::Receiver<String>,
}

/// Changes a feed holds for its reader. Past that a feed on Redis waits (and the server
/// drops a subscriber that falls too far behind, which ends the feed); one on the memory
/// store ends at once. Either way nothing is lost: whoever reads a feed that ended
/// takes every schedule to have changed.
pub(crate) const SCHEDULE_CHANGES_HELD: usize = 1024;

impl ScheduleChanges {
    /// Waits for the next change: the id of the schedule changed, or `None` once the feed
    /// has ended (its connection dropped), after which the caller subscribes again.
    pub async fn changed(&mut self) -> Option<String> {
        self.receiver.recv().await
    }

    /// A change already waiting, without waiting for one.
    pub fn waiting(&mut self) -> Option<String> {
        self.receiver.try_recv().ok()
    }

    /// Whether the feed has ended with no change left to read.
    pub fn ended(&self) -> bool {
        self.receiver.is_closed() && self.receiver.is_empty()
    }
}

/// Every stored schedule, as [`ScheduleStore::list_schedules`] read them.
#[derive(Debug, Default)]
pub struct ScheduleList {
    /// Those that read back, in id order.
    pub schedules: Vec<Schedule>,
    /// Those whose stored record does not read back (another version wrote it, say),
    /// in id order: listed by id, so one bad record hides none of the others.
    pub unreadable: Vec<UnreadableSchedule>,
}

/// A stored schedule whose record does not read back.
#[derive(Debug)]
pub struct UnreadableSchedule {
    pub id: String,
    /// Names the record's key and why it does not read.
    pub error: StoreError,
}

/// A stored schedule its shard's master left unfired because its record did not read
/// back or was invalid here: kept with the shard so that whichever master looks at it
/// next catches up from when it was first due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldBack {
    /// The fire time it was first due at.
    pub first_due_ms: i64,
    /// The next fire time stored for it meanwhile, when it is looked at again. Found due
    /// at another time, it was registered again or resumed meanwhile and starts afresh.
    pub retry_ms: i64,
}

/// A schedule's newest executions, as [`ScheduleStore::executions`] read them.
#[derive(Debug, Default)]
pub struct ExecutionList {
    /// Those that read back, newest first.
    pub executions: Vec<Execution>,
    /// Those whose stored record does not read back (another version wrote it, say),
    /// newest first: listed by time, so one bad record hides none of the others.
    pub unreadable: Vec<UnreadableExecution>,
}

impl ExecutionList {
    /// How many records were read, whether they read back or not.
    pub fn len(&self) -> usize {
        self.executions.len() + self.unreadable.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A stored execution whose record does not read back.
#[derive(Debug)]
pub struct UnreadableExecution {
    pub scheduled_ms: i64,
    /// Names the record's key and why it does not read.
    pub error: StoreError,
}

/// Where schedules, their next fire times, their executions and the live nodes are kept.
#[async_trait]
pub trait ScheduleStore: Send + Sync {
    /// Creates or replaces a schedule and tells the schedulers' change feeds.
    async fn put_schedule(&self, schedule: &Schedule) -> Result<(), StoreError>;

    async fn get_schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError>;

    /// Every stored schedule; one whose record does not read back is listed apart
    /// rather than failing the whole list.
    async fn list_schedules(&self) -> Result<ScheduleList, StoreError>;

    /// Removes a schedule, its pending fire time and what its shard held back of it;
    /// false if there was none.
    async fn delete_schedule(&self, id: &str, shard: u32) -> Result<bool, StoreError>;

    /// Sets (or clears) a schedule's next fire time in its shard's sorted set. Clearing
    /// it forgets what the shard held back of it too: the shard no longer fires it.
    async fn set_next_fire(
        &self,
        shard: u32,
        id: &str,
        at_ms: Option<i64>,
    ) -> Result<(), StoreError>;

    /// A schedule's next fire time in a shard's sorted set, if it has one there.
    async fn next_fire(&self, shard: u32, id: &str) -> Result<Option<i64>, StoreError>;

    /// Schedules of a shard due at or before `until_ms`, earliest first.
    async fn due_schedules(
        &self,
        shard: u32,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError>;

    /// Keeps what a shard holds back of a schedule moved into it from another shard,
    /// so that the shard's master catches it up from when it was first due. Unfenced:
    /// written before the schedule's next fire time, no master looks at it until then.
    async fn hold_back(&self, shard: u32, id: &str, held: HeldBack) -> Result<(), StoreError>;

    /// What a shard holds back of each of `ids`, in their order.
    async fn held_back(
        &self,
        shard: u32,
        ids: &[String],
    ) -> Result<Vec<Option<HeldBack>>, StoreError>;

    /// A page of about `count` of the schedules filed in a shard, in no order, and
    /// where the next page starts (`None` once the shard is listed through; `from` is
    /// `None` for the first page). A schedule filed in the shard for the whole listing
    /// is listed at least once, whatever is filed or fires meanwhile.
    async fn filed_schedules(
        &self,
        shard: u32,
        from: Option<&str>,
        count: usize,
    ) -> Result<(Vec<String>, Option<String>), StoreError>;

    /// The earliest next fire time in a shard.
    async fn earliest_fire(&self, shard: u32) -> Result<Option<i64>, StoreError>;

    /// Creates the execution record if none exists for its (schedule, scheduled time):
    /// true for the one caller that created it.
    async fn claim_execution(&self, execution: &Execution) -> Result<bool, StoreError>;

    /// [`ScheduleStore::claim_execution`] for many records in one round trip. With a `fence`
    /// (a shard master's lease), refused once a newer master holds the shard.
    async fn claim_executions(
        &self,
        executions: &[Execution],
        fence: Option<&Fence>,
    ) -> Result<Vec<bool>, StoreError>;

    /// [`ScheduleStore::put_execution`] and [`ScheduleStore::set_next_fire`] for many records in one
    /// round trip, with what the shard holds back set (or forgotten, `None`), under the
    /// shard master's lease (refused whole once a newer master holds the shard). Only
    /// claimed executions are updated, and one whose stored record has finished
    /// (completed or failed) keeps it: the state manager may end a tick's workflow before
    /// its master records having emitted the tick.
    async fn record_fires(
        &self,
        shard: u32,
        executions: &[Execution],
        next_fires: &[(String, Option<i64>)],
        held_back: &[(String, Option<HeldBack>)],
        fence: &Fence,
    ) -> Result<(), StoreError>;

    /// Overwrites an execution record (status changes). With a `fence` (a shard master's
    /// write), refused once a newer master holds its shard, and, as in
    /// [`ScheduleStore::record_fires`], only a stored, unfinished execution is updated;
    /// without one (the state manager recording a workflow's outcome), written as given.
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

    /// A schedule's newest `limit` executions; one whose record does not read back is
    /// listed apart rather than failing the whole list.
    async fn executions(
        &self,
        schedule_id: &str,
        limit: usize,
    ) -> Result<ExecutionList, StoreError>;

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
}

/// What the scheduler needs of a store: its own records, shard leases, and the workflow
/// executions its ticks started (to settle orphaned ticks).
pub trait CronStore: ScheduleStore + LeaseStore + WorkflowStore {}

impl<T: ScheduleStore + LeaseStore + WorkflowStore> CronStore for T {}

/// A workflow started by a tick has ended: the tick's execution record takes the
/// outcome. Any store of schedules can do it; the state manager calls it without
/// knowing of cron.
#[async_trait]
impl<T: ScheduleStore> TickOutcomes for T {
    async fn workflow_finished(
        &self,
        origin: &CronOrigin,
        execution_id: &str,
        status: RunStatus,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        let Some(mut execution) = self
            .get_execution(&origin.schedule_id, origin.scheduled_ms)
            .await?
        else {
            return Ok(());
        };
        execution.status = match status {
            RunStatus::Completed => ExecutionStatus::Completed,
            _ => ExecutionStatus::Failed,
        };
        if status == RunStatus::Failed {
            execution.error = Some(format!("workflow execution {execution_id} failed"));
        }
        execution.updated_ms = at_ms;
        // The state manager holds no shard lease: an unfenced write.
        self.put_execution(&execution, None).await
    }
}

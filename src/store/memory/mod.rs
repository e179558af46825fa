//! In-process store, the embedded default. State lives as long as the process.

mod cache;
mod checkpoint;
mod jobs;
mod keyed;
mod lease;
mod membership;
mod recovery;
mod schedule;
mod workflow;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{
    Backend, CacheStore, Checkpoint, CheckpointStore, Execution, Fence, FireNumbers, JobRecord,
    JobStore, KeyedChanges, KeyedStore, Lease, LeaseStore, MembershipStore, PartitionChanges,
    PartitionSnapshot, RecoveryEvent, RecoveryLog, ScheduleChanges, ScheduleStore, StoreError,
    WorkflowStore,
};
use crate::cron::{ExecutionList, HeldBack, Schedule, ScheduleList};
use crate::dispatch::WorkflowExecution;
use crate::reactor::CacheSnapshot;
use workflow::WorkflowDeadlines;

/// Execution records kept per schedule.
const EXECUTIONS_KEPT: usize = 1000;

/// Recovery events kept per process; older ones are dropped first.
const RECOVERY_EVENTS_KEPT: usize = 10_000;

#[derive(Default)]
pub struct MemoryStore {
    state: Mutex<State>,
    unreachable: AtomicBool,
    /// How long each cache snapshot write takes, in microseconds.
    cache_write_latency: AtomicU64,
    watchers: Mutex<Vec<tokio::sync::mpsc::Sender<String>>>,
}

#[derive(Default)]
struct State {
    checkpoints: HashMap<(String, String), Checkpoint>,
    caches: HashMap<String, CacheSnapshot>,
    recoveries: VecDeque<RecoveryEvent>,
    /// Per tenant, its graphs' events.
    tenant_recoveries: HashMap<String, VecDeque<RecoveryEvent>>,
    leases: HashMap<String, HeldLease>,
    fencing: HashMap<String, u64>,
    schedules: std::collections::BTreeMap<String, Schedule>,
    /// Per shard: its schedules' next fire times.
    due: HashMap<u32, ShardFires>,
    /// Per (shard, schedule id): what its master held back.
    held_back: HashMap<(u32, String), HeldBack>,
    executions: HashMap<String, VecDeque<Execution>>,
    /// Unfinished executions: (schedule id, scheduled ms) → [`Execution::open_since`].
    open: HashMap<(String, i64), i64>,
    nodes: HashMap<String, (i64, Instant)>,
    workflows: HashMap<String, WorkflowExecution>,
    published: HashMap<String, std::collections::BTreeSet<String>>,
    /// Workflow execution deadlines per workflow: (deadline ms, execution id), and by id.
    deadlines: HashMap<String, WorkflowDeadlines>,
    /// Jobs by (type, id), and each (type, partition)'s position and timeouts.
    jobs: HashMap<(String, String), JobRecord>,
    job_partitions: HashMap<(String, i32), JobPartition>,
    /// Group members and when their announcement expires.
    members: HashMap<String, HashMap<String, Instant>>,
    /// The partition count each group first ran with.
    partition_counts: HashMap<String, u32>,
    /// Keyed graphs' state by (graph, partition).
    keyed: HashMap<(String, i32), KeyedPartition>,
    /// Keyed graphs paused.
    keyed_paused: HashSet<String>,
}

/// One cron shard's next fire times, by time and by schedule id, so that each call
/// costs the log of the shard's size, not a walk over it.
#[derive(Default)]
struct ShardFires {
    by_time: BTreeSet<(i64, String)>,
    by_id: BTreeMap<String, i64>,
}

impl ShardFires {
    fn set(&mut self, id: &str, at: Option<i64>) {
        if let Some(was) = self.by_id.remove(id) {
            self.by_time.remove(&(was, id.to_string()));
        }
        if let Some(at) = at {
            self.by_id.insert(id.to_string(), at);
            self.by_time.insert((at, id.to_string()));
        }
    }
}

#[derive(Default)]
struct KeyedPartition {
    /// Written once per changed key per batch: a fast hash, as the graph's own key map
    /// has, rather than SipHash. Each snapshot boxed, so the table's slots stay small
    /// (a key and a pointer): a partition's keys run to hundreds of thousands, and a
    /// table of whole snapshots spreads over far more memory than the processor's
    /// caches hold, which every write of a key then waits on.
    keys: HashMap<Arc<str>, Box<CacheSnapshot>, foldhash::fast::RandomState>,
    positions: BTreeMap<String, i64>,
    released: Option<(u64, i64)>,
    /// Where idle keys expire: each key's time, and the keys by that time.
    touched: HashMap<Arc<str>, i64>,
    by_touch: BTreeSet<(i64, Arc<str>)>,
    fires: FireNumbers,
}

#[derive(Default)]
struct JobPartition {
    position: Option<i64>,
    /// Pending timeouts: job id → due ms.
    timeouts: HashMap<String, i64>,
    released: Option<(u64, i64)>,
}

impl State {
    fn track_open(open: &mut HashMap<(String, i64), i64>, execution: &Execution) {
        let key = (execution.schedule_id.clone(), execution.scheduled_ms);
        match execution.open_since() {
            Some(since) => open.insert(key, since),
            None => open.remove(&key),
        };
    }
}

struct HeldLease {
    holder: String,
    token: u64,
    expires: Instant,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes every call fail as an unreachable store's would, or answer again: a store
    /// outage, for tests of what a node does through one.
    pub fn set_reachable(&self, reachable: bool) {
        self.unreachable.store(!reachable, Ordering::SeqCst);
    }

    /// Makes each cache snapshot write take `latency`, as a store across a network
    /// does: for tests of what happens while one is under way.
    pub fn set_cache_write_latency(&self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.cache_write_latency.store(micros, Ordering::SeqCst);
    }

    fn state(&self) -> Result<MutexGuard<'_, State>, StoreError> {
        if self.unreachable.load(Ordering::SeqCst) {
            return Err(StoreError::Unreachable {
                what: "memory store".into(),
                source: "set unreachable".into(),
            });
        }
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Tells each schedule change feed that `id` changed. A feed too far behind to take
    /// it ends, which its reader takes as every schedule having changed.
    fn notify_watchers(&self, id: &str) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain(|w| w.try_send(id.to_string()).is_ok());
    }
}

#[async_trait]
impl Backend for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.state().map(|_| ())
    }
}

/// Refuses a write whose lease has been taken with a newer token since.
fn check_fence(state: &State, fence: Option<&Fence>) -> Result<(), StoreError> {
    match fence {
        Some(f) if state.fencing.get(&f.lease).is_some_and(|&t| t > f.token) => {
            Err(StoreError::Fenced {
                lease: f.lease.clone(),
                token: f.token,
            })
        }
        _ => Ok(()),
    }
}

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
use crate::graph::Key;
use crate::keyed::KeySlot;
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
    keys: StoredKeys,
    positions: BTreeMap<String, i64>,
    released: Option<(u64, i64)>,
    /// Where idle keys expire: each key's time, and the keys by that time.
    touched: HashMap<Key, i64>,
    by_touch: BTreeSet<(i64, Key)>,
    fires: FireNumbers,
}

/// A keyed partition's keys: each in a slot of its own, found by name through the
/// index, or written straight through the slot its owner was handed ([`KeySlot`]).
#[derive(Default)]
struct StoredKeys {
    /// A fast hash, as the graph's own key map has, rather than SipHash; small per key
    /// (a key and a number), as a partition's keys run to hundreds of thousands.
    index: HashMap<Key, usize, foldhash::fast::RandomState>,
    /// The slots, [`SLOTS_PER_CHUNK`] to a chunk, made as keys come and never moved: one
    /// table grown by doubling would copy every key's state each time, and leave as much
    /// memory again mapped until the allocator hands it back. `None` where a key was
    /// removed, until a new key takes the slot.
    chunks: Vec<Vec<Option<StoredKey>>>,
    free: Vec<usize>,
}

const SLOTS_PER_CHUNK: usize = 256;

struct StoredKey {
    /// A write through a slot checks that the slot still holds its key: a removed key's
    /// slot may hold another by now.
    key: Key,
    /// `None` until first written.
    state: Option<CacheSnapshot>,
}

impl StoredKeys {
    fn at(&self, at: usize) -> Option<&StoredKey> {
        self.chunks
            .get(at / SLOTS_PER_CHUNK)?
            .get(at % SLOTS_PER_CHUNK)?
            .as_ref()
    }

    fn at_mut(&mut self, at: usize) -> Option<&mut Option<StoredKey>> {
        self.chunks
            .get_mut(at / SLOTS_PER_CHUNK)?
            .get_mut(at % SLOTS_PER_CHUNK)
    }

    /// The key's slot, made for it if it has none.
    fn slot(&mut self, key: &Key) -> usize {
        if let Some(&at) = self.index.get(key) {
            // A name too long to be held inline lies on the heap: the slot takes the
            // caller's copy, so that the writes through it find the key by its pointer
            // instead of reading the stored copy's bytes.
            if key.is_heap_allocated() {
                if let Some(Some(stored)) = self.at_mut(at) {
                    stored.key = key.clone();
                }
            }
            return at;
        }
        let stored = StoredKey {
            key: key.clone(),
            state: None,
        };
        let at = match self.free.pop() {
            Some(at) => at,
            None => {
                if self
                    .chunks
                    .last()
                    .is_none_or(|c| c.len() == SLOTS_PER_CHUNK)
                {
                    self.chunks.push(Vec::with_capacity(SLOTS_PER_CHUNK));
                }
                let last = self.chunks.len() - 1;
                let chunk = &mut self.chunks[last];
                chunk.push(None);
                last * SLOTS_PER_CHUNK + chunk.len() - 1
            }
        };
        if let Some(slot) = self.at_mut(at) {
            *slot = Some(stored);
        }
        self.index.insert(key.clone(), at);
        at
    }

    fn get(&self, key: &str) -> Option<&CacheSnapshot> {
        self.at(*self.index.get(key)?)?.state.as_ref()
    }

    /// Reads what a write of the key replaces (the events its stored state holds,
    /// dropped with it), ahead of the write: a batch reading its keys so in a row has
    /// their cache misses outstanding at once, instead of waiting on each as it writes.
    fn warm(&self, key: &Key, slot: Option<KeySlot>) {
        let at = match slot {
            Some(slot) => Some(slot.index()),
            None => self.index.get(key).copied(),
        };
        let Some(stored) = at.and_then(|at| self.at(at)) else {
            return;
        };
        for (_, source) in stored.state.iter().flat_map(|s| s.sources.iter()) {
            std::hint::black_box(source.current.as_ref().map(Arc::strong_count));
        }
    }

    /// Writes the key through its slot if the slot still holds it (a removed key's
    /// slot may hold another by now), else finds it by name.
    fn write(&mut self, key: &Key, slot: Option<KeySlot>, snapshot: CacheSnapshot) {
        let held = |stored: &StoredKey| {
            std::ptr::eq(stored.key.as_str(), key.as_str()) || stored.key == *key
        };
        let at = match slot.map(KeySlot::index) {
            Some(at) if self.at(at).is_some_and(held) => at,
            _ => self.slot(key),
        };
        if let Some(Some(stored)) = self.at_mut(at) {
            stored.state = Some(snapshot);
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(at) = self.index.remove(key) {
            if let Some(slot) = self.at_mut(at) {
                *slot = None;
            }
            self.free.push(at);
        }
    }
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

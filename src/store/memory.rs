//! In-process store, the embedded default. State lives as long as the process.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{
    Checkpoint, Execution, Fence, Lease, RecoveryEvent, ScheduleChanges, Store, StoreError,
};
use crate::cron::Schedule;
use crate::dispatch::WorkflowExecution;
use crate::reactor::CacheSnapshot;

/// Execution records kept per schedule.
const EXECUTIONS_KEPT: usize = 1000;

/// Recovery events kept per process; older ones are dropped first.
const RECOVERY_EVENTS_KEPT: usize = 10_000;

#[derive(Default)]
pub struct MemoryStore {
    state: Mutex<State>,
    watchers: Mutex<Vec<tokio::sync::mpsc::Sender<()>>>,
}

#[derive(Default)]
struct State {
    checkpoints: HashMap<(String, String), Checkpoint>,
    caches: HashMap<String, CacheSnapshot>,
    recoveries: VecDeque<RecoveryEvent>,
    leases: HashMap<String, HeldLease>,
    fencing: HashMap<String, u64>,
    schedules: std::collections::BTreeMap<String, Schedule>,
    /// Per shard: (next fire ms, schedule id).
    due: HashMap<u32, std::collections::BTreeSet<(i64, String)>>,
    executions: HashMap<String, VecDeque<Execution>>,
    /// Unfinished executions: (schedule id, scheduled ms) → [`Execution::open_since`].
    open: HashMap<(String, i64), i64>,
    nodes: HashMap<String, (i64, Instant)>,
    workflows: HashMap<String, WorkflowExecution>,
    published: HashMap<String, std::collections::BTreeSet<String>>,
    /// Workflow execution deadlines: (deadline ms, execution id), and by id.
    deadlines: std::collections::BTreeSet<(i64, String)>,
    deadline_of: HashMap<String, i64>,
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

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify_watchers(&self) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        watchers.retain(|w| !w.is_closed());
        for w in watchers.iter() {
            // A full queue already holds a wake-up.
            let _ = w.try_send(());
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError> {
        Ok(self
            .state()
            .checkpoints
            .get(&(graph.to_string(), accumulator.to_string()))
            .cloned())
    }

    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let mut state = self.state();
        check_fence(&state, fence)?;
        state.checkpoints.insert(
            (graph.to_string(), accumulator.to_string()),
            checkpoint.clone(),
        );
        Ok(())
    }

    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError> {
        Ok(self.state().caches.get(graph).cloned())
    }

    async fn save_cache(
        &self,
        graph: &str,
        snapshot: &CacheSnapshot,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let mut state = self.state();
        check_fence(&state, fence)?;
        state.caches.insert(graph.to_string(), snapshot.clone());
        Ok(())
    }

    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError> {
        let mut state = self.state();
        if state.recoveries.len() == RECOVERY_EVENTS_KEPT {
            state.recoveries.pop_front();
        }
        state.recoveries.push_back(event.clone());
        Ok(())
    }

    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        Ok(self
            .state()
            .recoveries
            .iter()
            .rev()
            .filter(|e| graph.is_none_or(|g| e.graph == g))
            .take(limit)
            .cloned()
            .collect())
    }

    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        if let Some(held) = state.leases.get(name) {
            if held.expires > now && held.holder != holder {
                return Ok(None);
            }
            if held.expires > now && held.holder == holder {
                return Ok(Some(Lease {
                    name: name.to_string(),
                    holder: holder.to_string(),
                    token: held.token,
                }));
            }
        }
        let token = {
            let counter = state.fencing.entry(name.to_string()).or_insert(0);
            *counter += 1;
            *counter
        };
        state.leases.insert(
            name.to_string(),
            HeldLease {
                holder: holder.to_string(),
                token,
                expires: now + ttl,
            },
        );
        Ok(Some(Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            token,
        }))
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        match state.leases.get_mut(&lease.name) {
            Some(held) if held.holder == lease.holder && held.token == lease.token => {
                if held.expires <= now {
                    return Ok(false);
                }
                held.expires = now + ttl;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        let mut state = self.state();
        match state.leases.get(&lease.name) {
            Some(held) if held.holder == lease.holder && held.token == lease.token => {
                state.leases.remove(&lease.name);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn put_schedule(&self, schedule: &Schedule) -> Result<(), StoreError> {
        self.state()
            .schedules
            .insert(schedule.id.clone(), schedule.clone());
        self.notify_watchers();
        Ok(())
    }

    async fn get_schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError> {
        Ok(self.state().schedules.get(id).cloned())
    }

    async fn list_schedules(&self) -> Result<Vec<Schedule>, StoreError> {
        Ok(self.state().schedules.values().cloned().collect())
    }

    async fn delete_schedule(&self, id: &str, shard: u32) -> Result<bool, StoreError> {
        let existed = {
            let mut state = self.state();
            if let Some(set) = state.due.get_mut(&shard) {
                set.retain(|(_, s)| s != id);
            }
            state.schedules.remove(id).is_some()
        };
        self.notify_watchers();
        Ok(existed)
    }

    async fn set_next_fire(
        &self,
        shard: u32,
        id: &str,
        at_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        let mut state = self.state();
        let set = state.due.entry(shard).or_default();
        set.retain(|(_, s)| s != id);
        if let Some(at) = at_ms {
            set.insert((at, id.to_string()));
        }
        Ok(())
    }

    async fn due_schedules(
        &self,
        shard: u32,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let state = self.state();
        Ok(state
            .due
            .get(&shard)
            .map(|set| {
                set.iter()
                    .take_while(|(at, _)| *at <= until_ms)
                    .take(limit)
                    .map(|(at, id)| (id.clone(), *at))
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn earliest_fire(&self, shard: u32) -> Result<Option<i64>, StoreError> {
        Ok(self
            .state()
            .due
            .get(&shard)
            .and_then(|set| set.first().map(|(at, _)| *at)))
    }

    async fn claim_execution(&self, execution: &Execution) -> Result<bool, StoreError> {
        let mut state = self.state();
        let list = state
            .executions
            .entry(execution.schedule_id.clone())
            .or_default();
        if list
            .iter()
            .any(|e| e.scheduled_ms == execution.scheduled_ms)
        {
            return Ok(false);
        }
        let dropped = if list.len() == EXECUTIONS_KEPT {
            list.pop_front()
        } else {
            None
        };
        list.push_back(execution.clone());
        if let Some(old) = dropped {
            state.open.remove(&(old.schedule_id, old.scheduled_ms));
        }
        State::track_open(&mut state.open, execution);
        Ok(true)
    }

    async fn claim_executions(
        &self,
        executions: &[Execution],
        fence: Option<&Fence>,
    ) -> Result<Vec<bool>, StoreError> {
        check_fence(&self.state(), fence)?;
        let mut claimed = Vec::with_capacity(executions.len());
        for e in executions {
            claimed.push(self.claim_execution(e).await?);
        }
        Ok(claimed)
    }

    async fn record_fires(
        &self,
        shard: u32,
        executions: &[Execution],
        next_fires: &[(String, Option<i64>)],
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        check_fence(&self.state(), fence)?;
        for e in executions {
            self.put_execution(e, None).await?;
        }
        for (id, at) in next_fires {
            self.set_next_fire(shard, id, *at).await?;
        }
        Ok(())
    }

    async fn put_execution(
        &self,
        execution: &Execution,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let mut state = self.state();
        check_fence(&state, fence)?;
        let list = state
            .executions
            .entry(execution.schedule_id.clone())
            .or_default();
        match list
            .iter_mut()
            .find(|e| e.scheduled_ms == execution.scheduled_ms)
        {
            Some(e) => *e = execution.clone(),
            None => list.push_back(execution.clone()),
        }
        State::track_open(&mut state.open, execution);
        Ok(())
    }

    async fn open_executions(
        &self,
        changed_by_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let state = self.state();
        let mut open: Vec<(i64, &(String, i64))> = state
            .open
            .iter()
            .filter(|(_, since)| **since <= changed_by_ms)
            .map(|(key, since)| (*since, key))
            .collect();
        open.sort();
        Ok(open
            .into_iter()
            .skip(skip)
            .take(limit)
            .map(|(_, key)| key.clone())
            .collect())
    }

    async fn get_execution(
        &self,
        schedule_id: &str,
        scheduled_ms: i64,
    ) -> Result<Option<Execution>, StoreError> {
        Ok(self
            .state()
            .executions
            .get(schedule_id)
            .and_then(|l| l.iter().find(|e| e.scheduled_ms == scheduled_ms).cloned()))
    }

    async fn executions(
        &self,
        schedule_id: &str,
        limit: usize,
    ) -> Result<Vec<Execution>, StoreError> {
        let state = self.state();
        let mut list: Vec<Execution> = state
            .executions
            .get(schedule_id)
            .map(|l| l.iter().cloned().collect())
            .unwrap_or_default();
        list.sort_by_key(|e| std::cmp::Reverse(e.scheduled_ms));
        list.truncate(limit);
        Ok(list)
    }

    async fn register_node(
        &self,
        node: &str,
        priority: i64,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.state()
            .nodes
            .insert(node.to_string(), (priority, Instant::now() + ttl));
        Ok(())
    }

    async fn live_nodes(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        state.nodes.retain(|_, (_, expires)| *expires > now);
        Ok(state
            .nodes
            .iter()
            .map(|(n, (p, _))| (n.clone(), *p))
            .collect())
    }

    async fn watch_schedules(&self) -> Result<ScheduleChanges, StoreError> {
        let (tx, receiver) = tokio::sync::mpsc::channel(1);
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        Ok(ScheduleChanges { receiver })
    }

    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let mut state = self.state();
        if state.workflows.contains_key(&execution.id) {
            return Ok(false);
        }
        state
            .workflows
            .insert(execution.id.clone(), execution.clone());
        Ok(true)
    }

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError> {
        Ok(self.state().workflows.get(id).cloned())
    }

    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let mut state = self.state();
        match state.workflows.get_mut(&execution.id) {
            Some(stored) if stored.version + 1 == execution.version => {
                *stored = execution.clone();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError> {
        self.state()
            .published
            .entry(execution.to_string())
            .or_default()
            .extend(tasks.iter().cloned());
        Ok(())
    }

    async fn published_tasks(
        &self,
        execution: &str,
    ) -> Result<std::collections::BTreeSet<String>, StoreError> {
        Ok(self
            .state()
            .published
            .get(execution)
            .cloned()
            .unwrap_or_default())
    }

    async fn set_workflow_deadline(
        &self,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut state = self.state();
        if let Some(old) = state.deadline_of.insert(execution.to_string(), deadline_ms) {
            state.deadlines.remove(&(old, execution.to_string()));
        }
        state.deadlines.insert((deadline_ms, execution.to_string()));
        Ok(())
    }

    async fn due_workflow_deadlines(
        &self,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        Ok(self
            .state()
            .deadlines
            .iter()
            .take_while(|(at, _)| *at <= until_ms)
            .take(limit)
            .map(|(_, id)| id.clone())
            .collect())
    }

    async fn clear_workflow_deadline(&self, execution: &str) -> Result<(), StoreError> {
        let mut state = self.state();
        if let Some(at) = state.deadline_of.remove(execution) {
            state.deadlines.remove(&(at, execution.to_string()));
        }
        Ok(())
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

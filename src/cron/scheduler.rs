//! The cron scheduler. Every node registers with its election priority; per shard, the
//! live node with the highest priority holds the shard's lease (a lower-priority master
//! yields) and fires that shard's due schedules. The loop sleeps until the earliest due
//! time, a schedule change, or the next lease renewal; it never polls on a fixed period
//! shorter than that.
//!
//! Each firing is an execution record keyed by (schedule, scheduled time), claimed with
//! SET NX, then a [`CronTick`] published to the target. `at_most_once` schedules fire
//! only while the lease is known valid; `at_least_once` ones keep firing from local
//! state when the store is unreachable, with the same tick id so consumers can drop
//! duplicates.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use futures::StreamExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use super::expr::CronExpr;
use super::schedule::{Delivery, Overlap, Schedule, ScheduleError, Target};
use crate::codec::{CodecError, CronTick, PreparedTick};
use crate::metrics::LeaseRole;
use crate::store::{Execution, ExecutionStatus, Fence, Lease, Store, StoreError};
use crate::transport::{Outbound, Sink};

/// Due schedules taken from the store per pass.
const DUE_BATCH: usize = 10_000;
/// How far ahead of their time due ticks are planned and claimed.
const LOOKAHEAD: Duration = Duration::from_millis(250);
/// Schedule loads in flight at once.
const CONCURRENCY: usize = 1024;

/// Where the scheduler reads the time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> DateTime<Utc>;
}

/// The system's wall clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// Wall-clock time that advances with tokio's clock from a fixed start, so schedules can
/// be driven through hours of (paused) test time.
#[derive(Debug)]
pub struct TokioClock {
    start: DateTime<Utc>,
    origin: Instant,
}

impl TokioClock {
    pub fn starting_at(start: DateTime<Utc>) -> Self {
        Self {
            start,
            origin: Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> DateTime<Utc> {
        self.start + chrono::Duration::from_std(self.origin.elapsed()).unwrap_or_default()
    }
}

/// Scheduler settings; defaults give failover within a few seconds.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub node_id: String,
    pub priority: i64,
    pub shards: u32,
    /// Shard lease TTL; renewed every third of it. Also the node registration TTL.
    pub lease_ttl: Duration,
    /// An execution still `scheduled` this long after its claim was never emitted (or a
    /// workflow tick `running` this long whose execution never started): it is emitted
    /// again, up to `max_attempts`, then marked failed.
    pub orphan_after: Duration,
    pub max_attempts: u32,
    pub tenant: Option<String>,
    pub clock: Arc<dyn Clock>,
    /// Unfinished executions looked at per orphan sweep; successive sweeps carry on
    /// where the last stopped, so a long index is walked a batch at a time.
    pub sweep_batch: usize,
}

impl PartialEq for SchedulerConfig {
    fn eq(&self, other: &Self) -> bool {
        self.node_id == other.node_id
            && self.priority == other.priority
            && self.shards == other.shards
            && self.lease_ttl == other.lease_ttl
            && self.orphan_after == other.orphan_after
            && self.max_attempts == other.max_attempts
            && self.tenant == other.tenant
            && self.sweep_batch == other.sweep_batch
    }
}

impl SchedulerConfig {
    pub fn new(node_id: impl Into<String>) -> Self {
        Self {
            node_id: node_id.into(),
            priority: 0,
            shards: 1,
            lease_ttl: Duration::from_secs(3),
            orphan_after: Duration::from_secs(30),
            max_attempts: 3,
            tenant: None,
            clock: Arc::new(SystemClock),
            sweep_batch: 10_000,
        }
    }
}

/// The node that masters a shard among equals: the one whose hash with the shard is
/// highest (rendezvous hashing), so shards spread evenly and only the departed node's
/// shards move when one leaves. Every node computes the same answer.
pub fn shard_master(nodes: &[String], shard: u32) -> Option<&str> {
    nodes
        .iter()
        .max_by_key(|node| {
            let weight = mix(fnv1a(node.as_bytes()) ^ u64::from(shard).rotate_left(32));
            (weight, node.as_str())
        })
        .map(String::as_str)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// SplitMix64's finaliser: spreads close inputs (one node, shard after shard) apart.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The shard a schedule belongs to (FNV-1a, stable across processes and versions).
pub fn shard_of(id: &str, shards: u32) -> u32 {
    (fnv1a(id.as_bytes()) % u64::from(shards.max(1))) as u32
}

/// An emitted tick's execution: a topic tick is done once published; a workflow's runs
/// until its workflow ends.
fn emitted_status(schedule: &Schedule) -> ExecutionStatus {
    match schedule.target {
        Target::Topic(_) => ExecutionStatus::Completed,
        Target::Workflow(_) => ExecutionStatus::Running,
    }
}

/// A store call given at most `limit` (see [`Scheduler::bounded`]).
async fn within<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(StoreError::Unreachable(format!(
            "no answer within {limit:?}"
        )))
    })
}

pub fn tick_id(schedule_id: &str, scheduled: DateTime<Utc>) -> String {
    format!("{schedule_id}@{}", scheduled.timestamp_millis())
}

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Invalid(#[from] ScheduleError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Validates and stores a schedule, with its next fire time after now.
pub async fn register(
    store: &dyn Store,
    schedule: &Schedule,
    shards: u32,
) -> Result<Option<DateTime<Utc>>, RegisterError> {
    register_at(store, schedule, shards, Utc::now()).await
}

/// [`register`] with the next fire time computed after `now`.
pub async fn register_at(
    store: &dyn Store,
    schedule: &Schedule,
    shards: u32,
    now: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>, RegisterError> {
    let (expr, tz) = schedule.validate()?;
    store.put_schedule(schedule).await?;
    let next = if schedule.enabled {
        schedule.next_after(&expr, tz, now)
    } else {
        None
    };
    store
        .set_next_fire(
            shard_of(&schedule.id, shards),
            &schedule.id,
            next.map(|t| t.timestamp_millis()),
        )
        .await?;
    Ok(next)
}

/// Pauses or resumes a stored schedule. Returns false if there is no such schedule.
pub async fn set_enabled(
    store: &dyn Store,
    id: &str,
    enabled: bool,
    shards: u32,
) -> Result<bool, RegisterError> {
    let Some(mut schedule) = store.get_schedule(id).await? else {
        return Ok(false);
    };
    schedule.enabled = enabled;
    register(store, &schedule, shards).await?;
    Ok(true)
}

#[derive(Default)]
struct Shard {
    /// The shard's master lease, with its deadline, while this node holds it.
    held: Option<crate::lease::Held>,
}

impl Shard {
    fn lease(&self) -> Option<Lease> {
        self.held.as_ref().map(|held| held.lease.clone())
    }
}

struct Cached {
    schedule: Schedule,
    expr: CronExpr,
    tz: Tz,
}

pub struct Scheduler {
    store: Arc<dyn Store>,
    sink: Arc<dyn Sink>,
    config: SchedulerConfig,
    shards: Vec<Shard>,
    /// Schedules seen while the store was reachable, with their next fire time: what
    /// `at_least_once` keeps firing from when it is not.
    cache: HashMap<String, (Cached, Option<DateTime<Utc>>)>,
    /// Where in the index of unfinished executions the next orphan sweep starts.
    sweep_from: usize,
}

impl Scheduler {
    pub fn new(store: Arc<dyn Store>, sink: Arc<dyn Sink>, config: SchedulerConfig) -> Self {
        let shards = (0..config.shards.max(1))
            .map(|_| Shard::default())
            .collect();
        Self {
            store,
            sink,
            config,
            shards,
            cache: HashMap::new(),
            sweep_from: 0,
        }
    }

    /// Runs until cancelled, then releases the shard leases it holds.
    pub async fn run(mut self, cancel: CancellationToken) {
        let renew_every = self.config.lease_ttl / 3;
        // Subscribed again whenever the feed ends (Redis restarted, the connection
        // dropped); once it is, everything cached is read afresh, as a change may have
        // been missed meanwhile.
        let mut changes: Option<crate::store::ScheduleChanges> = None;
        let mut next_subscribe = Instant::now();
        let sweep_every = (self.config.orphan_after / 2).max(Duration::from_millis(100));
        let mut next_election = Instant::now();
        let mut next_sweep = Instant::now() + sweep_every;
        loop {
            if changes.is_none() && Instant::now() >= next_subscribe {
                // Bounded: behind a partition the subscription may never answer, and
                // this loop also fires at_least_once ticks from local state meanwhile.
                match tokio::time::timeout(renew_every, self.store.watch_schedules()).await {
                    Ok(Ok(c)) => {
                        changes = Some(c);
                        self.cache.clear();
                    }
                    Ok(Err(e)) => {
                        warn!(error = %e, "cannot watch schedule changes; retrying");
                        next_subscribe = Instant::now() + renew_every;
                    }
                    Err(_) => {
                        warn!("no answer subscribing to schedule changes; retrying");
                        next_subscribe = Instant::now() + renew_every;
                    }
                }
            }
            if Instant::now() >= next_election {
                self.elect().await;
                next_election = Instant::now() + renew_every;
            }
            if Instant::now() >= next_sweep {
                if let Err(e) = self.recover_orphans().await {
                    warn!(error = %e, "orphan recovery failed");
                }
                next_sweep = Instant::now() + sweep_every;
            }
            let next_due = self.fire_due().await;
            let mut wake = next_election.min(next_sweep);
            if changes.is_none() {
                wake = wake.min(next_subscribe);
            }
            if let Some(due) = next_due {
                let wait = (due - self.config.clock.now())
                    .to_std()
                    .unwrap_or_default()
                    .saturating_sub(LOOKAHEAD);
                wake = wake.min(Instant::now() + wait);
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep_until(wake) => {}
                changed = async {
                    match &mut changes {
                        Some(c) => c.changed().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if changed {
                        debug!("schedules changed");
                        self.cache.clear();
                    } else {
                        // The cache stays, for firing at_least_once schedules while the
                        // store is away; it is read afresh once subscribed again.
                        warn!("the schedule change feed ended; subscribing again");
                        changes = None;
                        next_subscribe = Instant::now();
                    }
                }
            }
        }
        let limit = self.config.lease_ttl / 3;
        for shard in &mut self.shards {
            if let Some(held) = shard.held.take() {
                let _ = within(limit, self.store.release_lease(&held.lease)).await;
                crate::metrics::lease_dropped(LeaseRole::Cron);
            }
        }
        changes.take();
    }

    /// A store call, given at most a third of the lease TTL: behind a partition a call
    /// may never be answered (the client reconnects and waits again), and the loop must
    /// go on to fire at_least_once schedules from local state meanwhile.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        within(self.config.lease_ttl / 3, call).await
    }

    /// Whether this node surely holds the shard's lease: before its deadline.
    fn holds(&self, shard: usize) -> bool {
        self.shards[shard]
            .held
            .as_ref()
            .is_some_and(|held| !held.deadline.passed())
    }

    /// Registers this node, then per shard: renew, yield to a higher priority, or take
    /// the lease if this node is the best live one.
    async fn elect(&mut self) {
        let ttl = self.config.lease_ttl;
        if let Err(e) = self
            .bounded(
                self.store
                    .register_node(&self.config.node_id, self.config.priority, ttl),
            )
            .await
        {
            warn!(error = %e, "node registration failed");
        }
        // The live nodes of the highest priority share the shards; a lower one masters
        // none while a higher one lives.
        let candidates: Option<Vec<String>> = match self.bounded(self.store.live_nodes()).await {
            Ok(nodes) => {
                let top = nodes.iter().map(|(_, p)| *p).max();
                Some(
                    nodes
                        .into_iter()
                        .filter(|(_, p)| Some(*p) == top)
                        .map(|(node, _)| node)
                        .collect(),
                )
            }
            Err(e) => {
                warn!(error = %e, "cannot list live nodes");
                None
            }
        };
        for i in 0..self.shards.len() {
            let name = format!("cron:shard:{i}");
            let me_best = candidates.as_ref().is_none_or(|nodes| {
                shard_master(nodes, i as u32).is_none_or(|node| node == self.config.node_id)
            });
            if let Some(held) = self.shards[i].held.clone() {
                if !me_best {
                    info!(
                        shard = i,
                        "yielding the schedule master to a higher-priority node"
                    );
                    let _ = self.bounded(self.store.release_lease(&held.lease)).await;
                    crate::metrics::lease_dropped(LeaseRole::Cron);
                    self.shards[i] = Shard::default();
                    continue;
                }
                // A confirmed renewal moves the deadline on from when it was sent.
                let renewal = crate::lease::renew(self.store.as_ref(), &held, ttl);
                match self.bounded(renewal).await {
                    Ok(true) => {}
                    Ok(false) => {
                        warn!(shard = i, "schedule master lease lost");
                        crate::metrics::lease_dropped(LeaseRole::Cron);
                        self.shards[i] = Shard::default();
                    }
                    // Keep the lease until its deadline; at_most_once stops firing
                    // then, at_least_once carries on from local state.
                    Err(e) => warn!(shard = i, error = %e, "lease renewal failed"),
                }
            } else if me_best {
                let acquiring =
                    crate::lease::acquire(self.store.as_ref(), &name, &self.config.node_id, ttl);
                match self.bounded(acquiring).await {
                    Ok(Some(held)) => {
                        info!(
                            shard = i,
                            token = held.lease.token,
                            "schedule master for shard"
                        );
                        crate::metrics::lease_acquired(LeaseRole::Cron);
                        self.shards[i] = Shard { held: Some(held) };
                    }
                    Ok(None) => {}
                    Err(e) => warn!(shard = i, error = %e, "cannot take the shard lease"),
                }
            }
        }
    }

    /// Fires what is due in the shards this node leads. Returns the earliest next fire.
    async fn fire_due(&mut self) -> Option<DateTime<Utc>> {
        let mut earliest: Option<DateTime<Utc>> = None;
        for shard in 0..self.shards.len() {
            let Some(lease) = self.shards[shard].lease() else {
                continue;
            };
            let store_up = self.holds(shard);
            let next = if store_up {
                match self.fire_shard_from_store(shard as u32, &lease).await {
                    Ok(next) => next,
                    Err(StoreError::Fenced { .. }) => {
                        // A newer master holds the shard: this one is deposed.
                        warn!(shard, "schedule master deposed; its writes were refused");
                        crate::metrics::lease_dropped(LeaseRole::Cron);
                        self.shards[shard] = Shard::default();
                        continue;
                    }
                    Err(e) => {
                        warn!(shard, error = %e, "store unreachable; firing at_least_once schedules from local state");
                        self.fire_shard_locally(shard as u32, &lease).await
                    }
                }
            } else {
                self.fire_shard_locally(shard as u32, &lease).await
            };
            if let Some(n) = next {
                earliest = Some(earliest.map_or(n, |e| e.min(n)));
            }
        }
        earliest
    }

    async fn fire_shard_from_store(
        &mut self,
        shard: u32,
        lease: &Lease,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        // Plan and claim a little ahead, so at the due instant only the publish remains.
        let now = self.config.clock.now();
        let horizon = now + chrono::Duration::from_std(LOOKAHEAD).unwrap_or_default();
        let due = self
            .bounded(
                self.store
                    .due_schedules(shard, horizon.timestamp_millis(), DUE_BATCH),
            )
            .await?;
        // Load what is not cached yet, many at a time.
        let missing: Vec<String> = due
            .iter()
            .filter(|(id, _)| !self.cache.contains_key(id))
            .map(|(id, _)| id.clone())
            .collect();
        let store = self.store.clone();
        let loading = futures::stream::iter(missing)
            .map(|id| {
                let store = store.clone();
                async move {
                    let found = store.get_schedule(&id).await;
                    (id, found)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<(String, Result<Option<Schedule>, StoreError>)>>();
        let loaded = self.bounded(async { Ok(loading.await) }).await?;
        for (id, found) in loaded {
            if let Some(schedule) = found? {
                match schedule.validate() {
                    Ok((expr, tz)) => {
                        self.cache.insert(id, (Cached { schedule, expr, tz }, None));
                    }
                    Err(e) => {
                        warn!(schedule = %id, error = %e, "stored schedule is invalid; not firing it")
                    }
                }
            }
        }
        // Plan every firing, claim them all in one round trip, publish the claimed ones
        // concurrently, then record statuses and next fire times in one more.
        let mut next_fires = Vec::with_capacity(due.len());
        let mut planned: Vec<(String, Execution)> = Vec::new();
        for (id, next_ms) in due {
            let Some((cached, _)) = self.cache.get(&id) else {
                next_fires.push((id, None));
                continue;
            };
            let schedule = &cached.schedule;
            if !schedule.enabled {
                next_fires.push((id, None));
                continue;
            }
            let last = Utc
                .timestamp_millis_opt(next_ms - 1)
                .single()
                .unwrap_or(now);
            // An at_least_once tick due within a failover (the previous master's lease
            // running out, then an election) is late, not missed: it goes out whatever
            // the catch-up policy says of downtime.
            let recent = match schedule.delivery {
                Delivery::AtLeastOnce => self.config.lease_ttl * 4 / 3 + LOOKAHEAD,
                _ => Duration::ZERO,
            };
            let (times, next) =
                schedule.due_and_next(&cached.expr, cached.tz, last, horizon, recent);
            // Only workflow executions stay running; a topic tick completes on publish.
            let mut busy = if schedule.overlap != Overlap::Allow
                && matches!(schedule.target, Target::Workflow(_))
            {
                let recent = self.bounded(self.store.executions(&id, 10)).await?;
                let running = recent.iter().any(|e| e.status == ExecutionStatus::Running);
                let buffered = recent.iter().any(|e| e.status == ExecutionStatus::Buffered);
                running.then_some(buffered)
            } else {
                None
            };
            for t in times {
                let mut execution = self.execution(schedule, t, lease);
                match (schedule.overlap, busy) {
                    (Overlap::BufferOne, Some(false)) => {
                        execution.status = ExecutionStatus::Buffered;
                        busy = Some(true);
                    }
                    (_, Some(_)) => {
                        execution.status = ExecutionStatus::Skipped;
                        execution.error = Some("previous execution still running".into());
                    }
                    _ => {}
                }
                planned.push((id.clone(), execution));
            }
            next_fires.push((id, next.map(|t| t.timestamp_millis())));
        }
        let executions: Vec<Execution> = planned.iter().map(|(_, e)| e.clone()).collect();
        let fence = Fence::from(lease);
        let claims = self
            .bounded(self.store.claim_executions(&executions, Some(&fence)))
            .await?;
        let mut claimed = Vec::with_capacity(planned.len());
        for ((id, execution), won) in planned.into_iter().zip(claims) {
            if won {
                if execution.status == ExecutionStatus::Scheduled {
                    claimed.push((id, execution));
                }
                continue;
            }
            // Claimed already. If a deposed master claimed it and died before emitting,
            // an at_least_once tick must not wait for orphan recovery: take it over now.
            let at_least_once = self
                .cache
                .get(&id)
                .is_some_and(|(c, _)| c.schedule.delivery == Delivery::AtLeastOnce);
            if !at_least_once {
                continue;
            }
            if let Some(mut existing) = self
                .bounded(self.store.get_execution(&id, execution.scheduled_ms))
                .await?
            {
                if existing.status == ExecutionStatus::Scheduled
                    && existing.fencing_token < lease.token
                {
                    existing.attempt += 1;
                    existing.fencing_token = lease.token;
                    existing.node_id = self.config.node_id.clone();
                    claimed.push((id, existing));
                }
            }
        }
        claimed.sort_by_key(|(_, e)| e.scheduled_ms);
        let mut fired = Vec::with_capacity(claimed.len());
        let mut batch = Vec::new();
        let mut pending = claimed.into_iter().peekable();
        while let Some((id, execution)) = pending.next() {
            let at = execution.scheduled_ms;
            batch.push((id, execution));
            if pending.peek().is_some_and(|(_, e)| e.scheduled_ms == at) {
                continue;
            }
            // Build every message now, so at the instant only the emission time is
            // written before each is handed to the broker client.
            let mut ready = Vec::with_capacity(batch.len());
            for (id, mut execution) in batch.drain(..) {
                let Some((cached, _)) = self.cache.get(&id) else {
                    continue;
                };
                match self.ready_tick(&cached.schedule, &execution) {
                    Ok(tick) => ready.push((execution, tick)),
                    Err(e) => {
                        warn!(schedule = %id, error = %e, "tick cannot be encoded");
                        execution.error = Some(e.to_string());
                        fired.push(execution);
                    }
                }
            }
            let wait = at - self.config.clock.now().timestamp_millis();
            if wait > 0 {
                tokio::time::sleep(Duration::from_millis(wait as u64)).await;
            }
            fired.extend(self.emit(ready, shard).await);
        }
        self.bounded(
            self.store
                .record_fires(shard, &fired, &next_fires, Some(&fence)),
        )
        .await?;
        for (id, next) in next_fires {
            if let Some(entry) = self.cache.get_mut(&id) {
                entry.1 = next.and_then(|ms| Utc.timestamp_millis_opt(ms).single());
            }
        }
        let earliest = self.bounded(self.store.earliest_fire(shard)).await?;
        Ok(earliest.and_then(|ms| Utc.timestamp_millis_opt(ms).single()))
    }

    /// The store is unreachable: fire `at_least_once` schedules this node knows.
    async fn fire_shard_locally(&mut self, shard: u32, lease: &Lease) -> Option<DateTime<Utc>> {
        let now = self.config.clock.now();
        let shards = self.config.shards;
        let mut earliest = None;
        let ids: Vec<String> = self.cache.keys().cloned().collect();
        for id in ids {
            if shard_of(&id, shards) != shard {
                continue;
            }
            let Some((cached, next)) = self.cache.get(&id) else {
                continue;
            };
            if cached.schedule.delivery != Delivery::AtLeastOnce || !cached.schedule.enabled {
                continue;
            }
            let schedule = cached.schedule.clone();
            let (expr, tz) = (cached.expr.clone(), cached.tz);
            let mut next = *next;
            while let Some(t) = next.filter(|t| *t <= now) {
                self.fire_without_store(&schedule, t, lease).await;
                next = schedule.next_after(&expr, tz, t);
            }
            if let Some(entry) = self.cache.get_mut(&id) {
                entry.1 = next;
            }
            if let Some(n) = next {
                earliest = Some(earliest.map_or(n, |e: DateTime<Utc>| e.min(n)));
            }
        }
        earliest
    }

    /// Emits the ticks of one scheduled instant: each is stamped and handed to the
    /// broker client in turn, then all acknowledgements are awaited together. Returns
    /// their records with the new status. An `at_most_once` tick whose lease lapsed
    /// meanwhile stays `scheduled` for the next master's orphan recovery; so does a tick
    /// the broker did not take.
    async fn emit(&self, ticks: Vec<(Execution, ReadyTick)>, shard: u32) -> Vec<Execution> {
        let holds = self.holds(shard as usize);
        let span = info_span!("cron_fire", shard, ticks = ticks.len());
        async move {
            let mut done = Vec::with_capacity(ticks.len());
            // Handed to the broker client, and their acknowledgements, in step.
            let mut handed = Vec::with_capacity(ticks.len());
            let mut acks = Vec::with_capacity(ticks.len());
            for (mut execution, tick) in ticks {
                if tick.delivery == Delivery::AtMostOnce && !holds {
                    execution.error = Some("lease lapsed before the tick was due".into());
                    done.push(execution);
                    continue;
                }
                let (delivery, emitted) = (tick.delivery, tick.emitted);
                let emitted_ms = self.config.clock.now().timestamp_millis();
                // Exempt from tokio's cooperative budget: otherwise the task yields every
                // so many sends, and the rest of the burst waits its turn for a core.
                let handing = self.sink.enqueue(tick.stamped(emitted_ms));
                match tokio::task::unconstrained(handing).await {
                    Ok(ack) => {
                        handed.push((execution, delivery, emitted, emitted_ms));
                        acks.push(ack);
                    }
                    Err(e) => {
                        warn!(schedule = %execution.schedule_id, error = %e, "tick not published");
                        execution.error = Some(e.to_string());
                        if delivery == Delivery::AtMostOnce {
                            missed(&mut execution);
                        }
                        done.push(execution);
                    }
                }
            }
            let acks = futures::future::join_all(acks).await;
            let now = self.config.clock.now().timestamp_millis();
            for ((mut execution, delivery, emitted, emitted_ms), acked) in
                handed.into_iter().zip(acks)
            {
                match acked {
                    Ok(_) => {
                        record_emission(delivery, emitted_ms - execution.scheduled_ms);
                        execution.status = emitted;
                    }
                    Err(e) => {
                        warn!(schedule = %execution.schedule_id, error = %e, "tick not published");
                        execution.error = Some(e.to_string());
                        // It may have reached the broker all the same: sending it again
                        // could deliver it twice.
                        if delivery == Delivery::AtMostOnce {
                            missed(&mut execution);
                        }
                    }
                }
                execution.updated_ms = now;
                done.push(execution);
            }
            done
        }
        .instrument(span)
        .await
    }

    fn execution(&self, schedule: &Schedule, scheduled: DateTime<Utc>, lease: &Lease) -> Execution {
        Execution {
            schedule_id: schedule.id.clone(),
            scheduled_ms: scheduled.timestamp_millis(),
            tick_id: tick_id(&schedule.id, scheduled),
            status: ExecutionStatus::Scheduled,
            attempt: 1,
            max_attempts: self.config.max_attempts,
            node_id: self.config.node_id.clone(),
            fencing_token: lease.token,
            updated_ms: self.config.clock.now().timestamp_millis(),
            error: None,
        }
    }

    /// A firing while the store is unreachable: no claim is possible, so only
    /// `at_least_once` schedules fire, with the tick id a claim would have used.
    async fn fire_without_store(
        &self,
        schedule: &Schedule,
        scheduled: DateTime<Utc>,
        lease: &Lease,
    ) {
        let execution = self.execution(schedule, scheduled, lease);
        if let Err(reason) = self.publish(schedule, &execution).await {
            warn!(schedule = %schedule.id, %reason, "tick not published");
        }
    }

    /// Executions claimed but never emitted (their master died between the claim and
    /// the publish), and workflow ticks still `running` whose workflow execution never
    /// started, are emitted again once they are older than `orphan_after`, until their
    /// stored attempt cap; then they are marked failed. A `running` one whose workflow
    /// ended takes its outcome. A `buffer_one` execution goes out once nothing of its
    /// schedule is running.
    async fn recover_orphans(&mut self) -> Result<(), StoreError> {
        let led: Vec<usize> = (0..self.shards.len()).filter(|&i| self.holds(i)).collect();
        if led.is_empty() {
            return Ok(());
        }
        let threshold = self.config.clock.now().timestamp_millis()
            - self.config.orphan_after.as_millis() as i64;
        // Only unfinished executions are looked at, found through the store's index, so
        // a sweep costs nothing per schedule that is firing normally.
        let batch = self.config.sweep_batch.max(1);
        let found = self
            .bounded(
                self.store
                    .open_executions(threshold, self.sweep_from, batch),
            )
            .await?;
        // Executions that rightly stay open (running workflows, buffered ticks, other
        // shards') would otherwise fill every batch and hide the rest: the next sweep
        // starts after this one, and from the front once the end is reached. What
        // leaves the index meanwhile only shifts the rest forward, to be met next pass.
        self.sweep_from = if found.len() < batch {
            0
        } else {
            self.sweep_from + found.len()
        };
        let mut open: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (id, scheduled_ms) in found {
            open.entry(id).or_default().push(scheduled_ms);
        }
        for (id, times) in open {
            let shard = shard_of(&id, self.config.shards) as usize;
            if !led.contains(&shard) {
                continue;
            }
            let Some(lease) = self.shards[shard].lease() else {
                continue;
            };
            // A master deposed meanwhile has its writes refused.
            let fence = Fence::from(&lease);
            let schedule = self.bounded(self.store.get_schedule(&id)).await?;
            let recent = self.bounded(self.store.executions(&id, 10)).await?;
            let mut running = recent.iter().any(|e| e.status == ExecutionStatus::Running);
            for scheduled_ms in times {
                let Some(mut execution) = self
                    .bounded(self.store.get_execution(&id, scheduled_ms))
                    .await?
                else {
                    continue;
                };
                let Some(schedule) = &schedule else {
                    execution.status = ExecutionStatus::Failed;
                    execution.error = Some("schedule removed before the tick was emitted".into());
                    execution.updated_ms = self.config.clock.now().timestamp_millis();
                    self.bounded(self.store.put_execution(&execution, Some(&fence)))
                        .await?;
                    continue;
                };
                if execution.status == ExecutionStatus::Buffered {
                    if running {
                        continue;
                    }
                    // The running execution ended: the buffered one goes now.
                    execution.fencing_token = lease.token;
                    if self.publish(schedule, &execution).await.is_ok() {
                        execution.status = ExecutionStatus::Running;
                        running = true;
                    }
                    execution.updated_ms = self.config.clock.now().timestamp_millis();
                    self.bounded(self.store.put_execution(&execution, Some(&fence)))
                        .await?;
                    continue;
                }
                if execution.updated_ms > threshold {
                    continue;
                }
                if execution.status == ExecutionStatus::Running {
                    if !self.settle_running(schedule, &mut execution).await? {
                        continue;
                    }
                    if execution.status != ExecutionStatus::Scheduled {
                        self.bounded(self.store.put_execution(&execution, Some(&fence)))
                            .await?;
                        continue;
                    }
                }
                if execution.status != ExecutionStatus::Scheduled {
                    continue;
                }
                if schedule.delivery == Delivery::AtMostOnce {
                    // Claimed and perhaps emitted by a master that died before recording
                    // it: emitting it now could deliver it twice.
                    warn!(schedule = %id, tick = %execution.tick_id, "at_most_once tick of a dead master marked missed");
                    missed(&mut execution);
                } else if execution.attempt >= execution.max_attempts {
                    warn!(schedule = %id, tick = %execution.tick_id, attempts = execution.attempt, "execution failed: never emitted");
                    execution.status = ExecutionStatus::Failed;
                    execution.error =
                        Some(format!("not emitted after {} attempts", execution.attempt));
                } else {
                    execution.attempt += 1;
                    execution.fencing_token = lease.token;
                    execution.node_id = self.config.node_id.clone();
                    info!(schedule = %id, tick = %execution.tick_id, attempt = execution.attempt, "re-emitting orphaned execution");
                    match self.publish(schedule, &execution).await {
                        Ok(()) => {
                            execution.status = emitted_status(schedule);
                            execution.error = None;
                        }
                        Err(reason) => execution.error = Some(reason),
                    }
                }
                execution.updated_ms = self.config.clock.now().timestamp_millis();
                self.bounded(self.store.put_execution(&execution, Some(&fence)))
                    .await?;
            }
        }
        Ok(())
    }

    /// A workflow tick `running` past the orphan threshold: its workflow execution
    /// (whose id is the tick id) tells what happened. Ended: the record takes its
    /// outcome. Never started (the tick was lost): the record goes back to `scheduled`
    /// for re-emission. Still running: nothing to do. Returns whether it changed.
    async fn settle_running(
        &self,
        schedule: &Schedule,
        execution: &mut Execution,
    ) -> Result<bool, StoreError> {
        if !matches!(schedule.target, Target::Workflow(_)) {
            return Ok(false);
        }
        let run = self
            .store
            .get_workflow_execution(&execution.tick_id)
            .await?;
        execution.status = match run.map(|r| r.status) {
            Some(crate::dispatch::RunStatus::Running) => return Ok(false),
            Some(crate::dispatch::RunStatus::Completed) => ExecutionStatus::Completed,
            Some(crate::dispatch::RunStatus::Failed) => ExecutionStatus::Failed,
            None => {
                info!(schedule = %schedule.id, tick = %execution.tick_id, "workflow tick never started its execution");
                ExecutionStatus::Scheduled
            }
        };
        execution.updated_ms = self.config.clock.now().timestamp_millis();
        Ok(true)
    }

    /// The tick of an execution as a message, all but its emission time.
    fn ready_tick(
        &self,
        schedule: &Schedule,
        execution: &Execution,
    ) -> Result<ReadyTick, CodecError> {
        let tick = CronTick {
            schedule_id: schedule.id.clone(),
            tick_id: execution.tick_id.clone(),
            scheduled_time_ms: execution.scheduled_ms,
            emitted_time_ms: 0,
            fencing_token: execution.fencing_token as i64,
            delivery: schedule.delivery.as_str().to_string(),
            attempt: execution.attempt as i32,
            payload: schedule.payload.to_string(),
            node_id: self.config.node_id.clone(),
            tenant: schedule.tenant.clone(),
        };
        let topic = match &schedule.target {
            Target::Topic(t) => t.clone(),
            Target::Workflow(w) => crate::dispatch::manager::workflow_start_topic(w),
        };
        let topic = match &schedule.tenant {
            Some(tenant) => format!("{tenant}.{topic}"),
            None => topic,
        };
        Ok(ReadyTick {
            encoded: PreparedTick::new(&tick)?,
            message: Outbound::new(topic, Bytes::new())
                .key(schedule.id.clone().into_bytes())
                .header(crate::wire::TICK_ID_HEADER, execution.tick_id.clone()),
            delivery: schedule.delivery,
            emitted: emitted_status(schedule),
        })
    }

    /// Publishes one tick now and waits for the broker's acknowledgement.
    async fn publish(&self, schedule: &Schedule, execution: &Execution) -> Result<(), String> {
        let tick = self
            .ready_tick(schedule, execution)
            .map_err(|e| e.to_string())?;
        let delivery = tick.delivery;
        let emitted_ms = self.config.clock.now().timestamp_millis();
        let span = info_span!("cron_fire", schedule = %schedule.id);
        self.sink
            .publish(tick.stamped(emitted_ms))
            .instrument(span)
            .await
            .map_err(|e| e.to_string())?;
        record_emission(delivery, emitted_ms - execution.scheduled_ms);
        Ok(())
    }
}

/// A claimed tick made ready ahead of its instant.
struct ReadyTick {
    encoded: PreparedTick,
    /// Topic, key and headers; the payload is written at emission.
    message: Outbound,
    delivery: Delivery,
    /// The execution's status once the broker has the tick.
    emitted: ExecutionStatus,
}

impl ReadyTick {
    fn stamped(self, emitted_ms: i64) -> Outbound {
        let mut message = self.message;
        message.payload = self.encoded.finish(emitted_ms).into();
        message
    }
}

/// Gives an `at_most_once` tick up for good.
fn missed(execution: &mut Execution) {
    execution.status = ExecutionStatus::Missed;
    metrics::counter!(crate::metrics::CRON_TICKS_MISSED_TOTAL).increment(1);
}

fn record_emission(delivery: Delivery, lateness_ms: i64) {
    let lateness = lateness_ms.max(0) as f64 / 1000.0;
    metrics::histogram!(crate::metrics::TICK_LATENESS_SECONDS).record(lateness);
    metrics::counter!(crate::metrics::CRON_TICKS_TOTAL, "delivery" => delivery.as_str())
        .increment(1);
}

/// For tick consumers: drops duplicates (same tick id) and ticks from a deposed master
/// (a fencing token lower than one already seen for the schedule). Its memory is
/// bounded: per schedule it keeps the newest [`TickGuard::DEFAULT_WINDOW`] scheduled
/// times (or the window given), and a tick older than all of a full window counts as a
/// duplicate, since ticks of a schedule arrive in time order but for redeliveries.
#[derive(Debug)]
pub struct TickGuard {
    schedules: HashMap<String, SeenTicks>,
    window: usize,
}

#[derive(Debug, Default)]
struct SeenTicks {
    highest_token: i64,
    times: std::collections::BTreeSet<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickVerdict {
    Accept,
    Duplicate,
    /// From a master that has since lost its lease.
    Stale,
}

impl Default for TickGuard {
    fn default() -> Self {
        Self::with_window(Self::DEFAULT_WINDOW)
    }
}

impl TickGuard {
    pub const DEFAULT_WINDOW: usize = 1024;

    /// Remembers the newest `window` scheduled times per schedule.
    pub fn with_window(window: usize) -> Self {
        Self {
            schedules: HashMap::new(),
            window: window.max(1),
        }
    }

    pub fn check(&mut self, tick: &CronTick) -> TickVerdict {
        let seen = self
            .schedules
            .entry(tick.schedule_id.clone())
            .or_insert_with(|| SeenTicks {
                highest_token: i64::MIN,
                times: Default::default(),
            });
        if tick.fencing_token < seen.highest_token {
            return TickVerdict::Stale;
        }
        seen.highest_token = tick.fencing_token;
        let at = tick.scheduled_time_ms;
        let full = seen.times.len() >= self.window;
        if seen.times.contains(&at) || (full && seen.times.first().is_some_and(|&o| at < o)) {
            return TickVerdict::Duplicate;
        }
        seen.times.insert(at);
        if seen.times.len() > self.window {
            seen.times.pop_first();
        }
        TickVerdict::Accept
    }

    /// Scheduled times remembered, over all schedules.
    pub fn remembered(&self) -> usize {
        self.schedules.values().map(|s| s.times.len()).sum()
    }
}

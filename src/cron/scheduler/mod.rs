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
//!
//! Here: the settings and the loop. Beside it: `clock` (where the time comes from),
//! `election` (shard masters and their leases), `register` (storing schedules),
//! `plan` (which due times fire, and how: a pure function), `claim` (what is due,
//! claimed in the store or fired from local state), `ahead` (a shard's schedules
//! known before they are due), `emit`
//! (ticks handed to the broker), `orphans` (claims never emitted, workflows never
//! started), `stranded` (schedules filed in a shard their id no longer maps to) and
//! `guard` (the consumers' [`TickGuard`]).

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
use crate::cron::store::{
    CronStore, Execution, ExecutionList, ExecutionStatus, HeldBack, ScheduleChanges, ScheduleStore,
};
use crate::lease::{Fence, Lease};
use crate::metrics::LeaseRole;
use crate::store_error::{StoreError, StoreErrorKind};
use crate::transport::{Outbound, Sink};

/// Due schedules taken from the store per pass.
const DUE_BATCH: usize = 10_000;
/// How long a stored schedule that cannot be read waits before it is read again.
const UNREADABLE_RETRY: Duration = Duration::from_secs(60);
/// Executions of a schedule read to tell whether one runs; more when those are all held
/// back or dropped by the overlap policy, up to as many as the stores keep per schedule.
const RECENT_EXECUTIONS: usize = 10;
const EXECUTIONS_KEPT: usize = 1000;
/// The most shards a config may set: each is a lease every node keeps trying for and a
/// due set its master reads.
pub const MOST_SHARDS: u32 = 1024;
/// How far ahead of their time due ticks are planned and claimed.
const LOOKAHEAD: Duration = Duration::from_millis(250);
/// Schedule loads in flight at once.
const CONCURRENCY: usize = 1024;

mod ahead;
mod claim;
mod clock;
mod election;
mod emit;
mod guard;
mod orphans;
mod plan;
mod register;
mod stranded;

pub use clock::{Clock, SystemClock, TokioClock};
pub use election::{shard_master, shard_of};
use emit::{missed, ReadyTick};
pub use guard::{TickGuard, TickVerdict};
pub use register::{declare, register, register_at, set_enabled, Declared, RegisterError};

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
        Err(StoreError::Unreachable {
            what: "store call".into(),
            source: format!("no answer within {limit:?}").into(),
        })
    })
}

pub fn tick_id(schedule_id: &str, scheduled: DateTime<Utc>) -> String {
    format!("{schedule_id}@{}", scheduled.timestamp_millis())
}

#[derive(Default)]
struct Shard {
    /// The shard's master lease, with its deadline, while this node holds it.
    held: Option<crate::lease::Held>,
    /// Cancelled by the lease's keeper once another master has taken the lease.
    lost: CancellationToken,
    /// Stops the keeper when the shard is given up (dropped with it).
    _keeper: Option<tokio_util::sync::DropGuard>,
    /// How far the shard's schedules are read into the cache; from the start after the
    /// lease is taken or the cache cleared.
    ahead: ahead::ReadAhead,
}

impl Shard {
    /// Keeps `held` renewed by a [`crate::lease::keep`] task that holds on past the
    /// deadline: while the store is away the shard goes on firing `at_least_once`
    /// schedules from local state; only a takeover ends it.
    fn kept(store: Arc<dyn CronStore>, held: crate::lease::Held, ttl: Duration) -> Self {
        let (lost, stop) = (CancellationToken::new(), CancellationToken::new());
        tokio::spawn(crate::lease::keep(
            store,
            held.clone(),
            ttl,
            crate::lease::AtDeadline::HoldOn,
            lost.clone(),
            stop.clone(),
        ));
        Self {
            held: Some(held),
            lost,
            _keeper: Some(stop.drop_guard()),
            ahead: ahead::ReadAhead::default(),
        }
    }

    /// The lease, unless its keeper found it taken over.
    fn lease(&self) -> Option<Lease> {
        if self.lost.is_cancelled() {
            return None;
        }
        self.held.as_ref().map(|held| held.lease.clone())
    }
}

struct Cached {
    schedule: Schedule,
    expr: CronExpr,
    tz: Tz,
}

/// Why this node last warned of a stored schedule it could not read or found invalid.
struct Warned {
    error: String,
    /// When it was to be looked at again; not found due by a while past it, it is gone.
    retry_ms: i64,
    /// The shard lease it was warned of under.
    token: u64,
}

pub struct Scheduler {
    store: Arc<dyn CronStore>,
    sink: Arc<dyn Sink>,
    config: SchedulerConfig,
    shards: Vec<Shard>,
    /// Schedules seen while the store was reachable (found due, or read ahead), with
    /// their next fire time: what `at_least_once` keeps firing from when it is not.
    cache: HashMap<String, (Cached, Option<DateTime<Utc>>)>,
    /// Stored schedules this node could not read or found invalid, looked at again
    /// [`UNREADABLE_RETRY`] later (when each was first due is kept in the store, with
    /// its shard): why each did not read, warned of again only when that changes.
    warned: HashMap<String, Warned>,
    /// Where in the index of unfinished executions the next orphan sweep starts.
    sweep_from: usize,
    /// The first shard past the configured count the next look for stranded
    /// schedules reads.
    stranded_from: u32,
}

impl Scheduler {
    pub fn new(store: Arc<dyn CronStore>, sink: Arc<dyn Sink>, config: SchedulerConfig) -> Self {
        let shards = (0..config.shards.max(1))
            .map(|_| Shard::default())
            .collect();
        Self {
            store,
            sink,
            stranded_from: config.shards.max(1),
            config,
            shards,
            cache: HashMap::new(),
            warned: HashMap::new(),
            sweep_from: 0,
        }
    }

    /// Runs until cancelled, then releases the shard leases it holds.
    pub async fn run(mut self, cancel: CancellationToken) {
        let renew_every = self.config.lease_ttl / 3;
        // Subscribed again whenever the feed ends (Redis restarted, the connection
        // dropped); once it is, everything cached is read afresh, as a change may have
        // been missed meanwhile.
        let mut changes: Option<ScheduleChanges> = None;
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
                        for shard in &mut self.shards {
                            shard.ahead = ahead::ReadAhead::default();
                        }
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
                if let Err(e) = self.move_stranded().await {
                    warn!(error = %e, "moving schedules out of shards past [cron] shards failed");
                }
                next_sweep = Instant::now() + sweep_every;
            }
            let (next_due, store_answered) = self.fire_due().await;
            let mut wake = next_election.min(next_sweep);
            if changes.is_none() {
                wake = wake.min(next_subscribe);
            }
            // Reading ahead between firings, while the store answers: not right before
            // a firing, nor while a pass waits out a store that does not answer; and cut
            // short if it runs into the next firing's look-ahead.
            let room = match next_due {
                None => Some(renew_every),
                Some(due) => (due - self.config.clock.now())
                    .to_std()
                    .ok()
                    .filter(|left| *left >= ahead::ROOM_TO_LOOK + LOOKAHEAD)
                    .map(|left| left - LOOKAHEAD),
            };
            if let Some(room) = room.filter(|_| store_answered) {
                let started = Instant::now();
                match within(room, self.read_ahead()).await {
                    // The next look after a pause as long as this one took: reading
                    // ahead takes at most half of the time between firings.
                    Ok(true) => wake = wake.min(Instant::now() + started.elapsed()),
                    Ok(false) => {}
                    Err(e) => {
                        warn!(error = %e, "cannot read the shard's schedules ahead; trying again")
                    }
                }
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
                    let ended = match changed {
                        Some(id) => {
                            // Only the schedules changed are read afresh: the rest stay
                            // known, to fire at_least_once should the store go away.
                            debug!(schedule = %id, "schedule changed");
                            self.changed(id);
                            while let Some(id) = changes.as_mut().and_then(|c| c.waiting()) {
                                self.changed(id);
                            }
                            // Ended right after those: subscribed again before the
                            // next look, rather than firing once more from what may
                            // have changed unseen since.
                            changes.as_ref().is_some_and(ScheduleChanges::ended)
                        }
                        None => true,
                    };
                    if ended {
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
            // Taken out (and dropped) first, which stops its keeper before the release.
            let held = std::mem::take(shard).held;
            if let Some(held) = held {
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

    /// A schedule's newest executions, enough of them to include the one running if any:
    /// the newest few, or, when those are all firings the overlap policy held back or
    /// dropped (so something ran when they were due), as many as the store keeps.
    async fn recent_executions(&self, id: &str) -> Result<ExecutionList, StoreError> {
        let mut recent = self
            .bounded(self.store.executions(id, RECENT_EXECUTIONS))
            .await?;
        let held_back = |e: &Execution| {
            matches!(
                e.status,
                ExecutionStatus::Skipped | ExecutionStatus::Buffered
            )
        };
        // Records that do not read back tell nothing of what runs, so ten of them are
        // looked behind as well: one still running there must hold the overlap policy's
        // firings back. That costs a long read at each look only until this version's
        // first firing of the schedule, whose record is readable.
        if recent.len() == RECENT_EXECUTIONS && recent.executions.iter().all(held_back) {
            recent = self
                .bounded(self.store.executions(id, EXECUTIONS_KEPT))
                .await?;
        }
        Ok(recent)
    }

    /// Whether this node surely holds the shard's lease: before its deadline.
    fn holds(&self, shard: usize) -> bool {
        let shard = &self.shards[shard];
        !shard.lost.is_cancelled()
            && shard
                .held
                .as_ref()
                .is_some_and(|held| !held.deadline.passed())
    }
}

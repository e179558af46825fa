//! The task that runs one accumulator: loads its checkpoint, opens its source, merges the
//! socket and source paths, emits boundaries, and commits positions once the reactor
//! reports them durable.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use serde_json::Value;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::time::Interval;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::checkpoint::{Checkpoint, CheckpointStore};
use super::commit::{CommitTracker, PointState};
use super::ReactorInput;
use super::{
    Accumulator, AccumulatorError, AccumulatorSpec, Boundary, Event, Health, PUSH_PARTITION,
};
use crate::stats::GraphStats;
use crate::transport::{now_ms, Message, Outbound, Position, Sink, Source, SourceFactory};
use crate::write_behind::{changes, WriteBehind};

/// An accumulator's socket path, shared by its incarnations one at a time.
pub(crate) type SocketReceiver = Arc<tokio::sync::Mutex<Socket>>;

/// The receiving end of a socket path. Pushes are taken from the channel in bursts,
/// which frees their queue slots in one go rather than one lock per push; those of a
/// burst not yet handled when an incarnation ends stay here for the next one, as they
/// would have stayed in the channel.
pub(crate) struct Socket {
    receiver: mpsc::Receiver<Value>,
    taken: Vec<Value>,
    /// The first push of `taken` not yet handed out.
    next: usize,
}

impl Socket {
    pub(crate) fn new(receiver: mpsc::Receiver<Value>) -> Self {
        Self {
            receiver,
            taken: Vec::new(),
            next: 0,
        }
    }

    /// Waits until a push is at hand; false once every sender is gone and nothing is
    /// left. Cancel-safe: nothing is taken from the channel unless it returns.
    async fn ready(&mut self) -> bool {
        if self.has_push() {
            return true;
        }
        self.taken.clear();
        self.next = 0;
        self.receiver.recv_many(&mut self.taken, PUSH_BATCH).await > 0
    }

    /// Whether the burst at hand has a push left.
    fn has_push(&self) -> bool {
        self.next < self.taken.len()
    }

    /// The next push of the burst at hand.
    fn next_push(&mut self) -> Option<Value> {
        let value = self.taken.get_mut(self.next).map(std::mem::take)?;
        self.next += 1;
        Some(value)
    }
}

/// Pushes taken from the socket's channel in one go, and handled before a stateful push
/// path writes its checkpoint.
pub(crate) const PUSH_BATCH: usize = 256;
/// Boundaries handed to the reactor in one go at most, and sequential queue slots taken
/// in one go at most. A burst of events then costs the reactor's channel one operation,
/// not one per boundary.
pub(crate) const HANDOFF: usize = 256;
/// Messages a source has ready taken in one go, before other work gets a turn.
const MESSAGE_BATCH: usize = 256;
/// Boundaries emitted and not yet durable past which the source is held, not read: each
/// holds its position until the reactor's snapshot is stored, and through a store outage
/// the list would otherwise grow with everything the broker delivers. Twice the inputs
/// after which the reactor snapshots however long its interval, so a graph whose store
/// answers never waits here. Core NATS, which keeps nothing unread, is read regardless,
/// and its oldest pending boundaries past the bound are given up.
pub const MOST_PENDING_BOUNDARIES: usize = 100_000;

/// How long a stopping accumulator takes to say it stopped, wait for what its reactor
/// makes durable as it stops, and store that checkpoint: within the supervisor's default
/// stop limit.
const LAST_CHECKPOINT_WAIT: std::time::Duration = std::time::Duration::from_secs(4);
/// Of that, what is kept for storing the checkpoint, however long the reactor takes.
const LAST_CHECKPOINT_STORE: std::time::Duration = std::time::Duration::from_secs(1);
/// How long a stopping reactor waits for the accumulators' last hand-overs, and an
/// accumulator for room in the reactor's channel to say it stopped.
pub(crate) const LAST_INPUTS_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Messages dead-lettered in a row for making the accumulator panic before a panic
/// counts as a failure of the graph: a state that makes every message panic would
/// otherwise send the whole stream to the dead-letter topic.
const POISONED_IN_A_ROW: u32 = 20;

/// Times an accumulator may panic on one source message; met again after that, the
/// message goes to the dead-letter topic instead. Twice, so a panic that passes (a
/// resource briefly missing) costs no message.
const PANICS_BEFORE_DEAD_LETTER: u32 = 2;

/// What became of a source message an accumulator incarnation panicked on. The next
/// incarnation reads it again from its checkpoint.
#[derive(Debug, Clone)]
enum Poisoned {
    /// Panicked on this many times, the last time with this message; at
    /// [`PANICS_BEFORE_DEAD_LETTER`] it goes to the dead-letter topic.
    Panicked { times: u32, reason: String },
    /// Dead-lettered: an incarnation reading it again (its checkpoint older) passes it by.
    DeadLettered,
}

/// What one source's accumulator incarnations share for the life of a reactor: the
/// numbers they hand out, so a restarted accumulator carries on where its predecessor
/// stopped, and the messages they panicked on. Only the incarnation holding the socket
/// path's lock hands numbers out, so there is one writer at a time (the lock orders one
/// incarnation's numbers before the next's): each number costs a load and a store, not
/// a locked read-modify-write.
#[derive(Debug, Default)]
pub(crate) struct SourceShared {
    /// Last boundary sequence emitted.
    sequence: AtomicU64,
    /// Last push id given out.
    push: AtomicI64,
    /// Source messages incarnations panicked on.
    panics: std::sync::Mutex<Panics>,
    /// Whether `panics` holds any, read on every message without taking the lock.
    any_panics: AtomicBool,
    /// Since when the current incarnation's source has been open (none while it is
    /// not): the supervisor tells a new outage from the one it restarted it after by it.
    live_since: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Whether the current incarnation's source delivered a message no earlier one had
    /// taken in: it got somewhere before it broke, whatever came before it.
    delivered_new: AtomicBool,
    /// The highest offset per partition an incarnation took in, merged as each ends:
    /// what its successor re-reads from an older checkpoint is no progress.
    reached: std::sync::Mutex<BTreeMap<i32, i64>>,
}

/// Source messages incarnations panicked on, until a checkpoint covers them.
#[derive(Debug, Default)]
struct Panics {
    by_position: HashMap<Position, Poisoned>,
    /// Messages dead-lettered for panics with no message handled since, after the last
    /// of them or from another partition: past [`POISONED_IN_A_ROW`], the state rather than the messages is
    /// taken to be at fault, and the panics count as failures of the graph.
    in_a_row: u32,
    last_dead_lettered: Option<Position>,
}

impl SourceShared {
    /// Starts push ids after the highest one the reactor has taken.
    pub(crate) fn after_push(push: i64) -> Self {
        Self {
            push: AtomicI64::new(push),
            ..Self::default()
        }
    }

    /// Raises the push floor to a restored checkpoint's.
    fn push_at_least(&self, push: i64) {
        self.push.fetch_max(push, Ordering::Relaxed);
    }

    /// The next push id: increasing and above every id given out before, also by an
    /// earlier run whose reactor or checkpoint recorded it. Microseconds of the wall
    /// clock where that is higher, so ids lost in a crash are not handed out again.
    /// `now_us` is the wall clock, read once per burst of pushes.
    fn next_push(&self, now_us: i64) -> i64 {
        let id = (self.push.load(Ordering::Relaxed) + 1).max(now_us);
        self.push.store(id, Ordering::Relaxed);
        id
    }

    /// Takes over what the graph's previous run learnt of the messages its accumulator
    /// panicked on: a graph run again (Failed and retried, say) over a state that makes
    /// every message panic would otherwise send another run of them to the dead-letter
    /// topic, and those it dead-lettered are passed by when read again.
    pub(crate) fn inherit_panics(&self, earlier: &SourceShared) {
        let panics = std::mem::take(&mut *earlier.poisoned());
        let any = !panics.by_position.is_empty() || panics.last_dead_lettered.is_some();
        *self.poisoned() = panics;
        self.any_panics.store(any, Ordering::Release);
    }

    fn poisoned(&self) -> std::sync::MutexGuard<'_, Panics> {
        self.panics.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a panic on the message at `position`. False when too many messages in a
    /// row were dead-lettered for panics: this one is not recorded, and the panic is a
    /// failure of the graph.
    fn panicked_on(&self, position: Position, reason: &str) -> bool {
        let mut panics = self.poisoned();
        if panics.in_a_row >= POISONED_IN_A_ROW {
            return false;
        }
        let times = match panics.by_position.get(&position) {
            Some(Poisoned::Panicked { times, .. }) => times + 1,
            _ => 1,
        };
        let reason = reason.to_string();
        panics
            .by_position
            .insert(position, Poisoned::Panicked { times, reason });
        self.any_panics.store(true, Ordering::Release);
        true
    }

    /// What became of the message at `position`, if an incarnation panicked on it.
    fn poisoned_at(&self, position: Position) -> Option<Poisoned> {
        if !self.any_panics.load(Ordering::Acquire) {
            return None;
        }
        self.poisoned().by_position.get(&position).cloned()
    }

    fn dead_lettered(&self, position: Position) {
        let mut panics = self.poisoned();
        panics.by_position.insert(position, Poisoned::DeadLettered);
        panics.in_a_row += 1;
        panics.last_dead_lettered = Some(position);
    }

    /// A message handled without a panic: forgets its own panics, and ends a run of
    /// dead-lettered ones if it comes after them or from another partition.
    fn handled(&self, position: Position) {
        if !self.any_panics.load(Ordering::Acquire) {
            return;
        }
        let mut panics = self.poisoned();
        if matches!(
            panics.by_position.get(&position),
            Some(Poisoned::Panicked { .. })
        ) {
            panics.by_position.remove(&position);
        }
        // Not one the run re-reads from its checkpoint before it.
        if panics
            .last_dead_lettered
            .is_some_and(|d| d.partition != position.partition || d.offset < position.offset)
        {
            panics.in_a_row = 0;
            panics.last_dead_lettered = None;
        }
        let any = !panics.by_position.is_empty() || panics.last_dead_lettered.is_some();
        self.any_panics.store(any, Ordering::Release);
    }

    /// Forgets the messages a checkpoint covers: they are not read again.
    fn forget_panics_through(&self, checkpoint: &[Position]) {
        if !self.any_panics.load(Ordering::Acquire) {
            return;
        }
        let mut panics = self.poisoned();
        panics.by_position.retain(|message, _| {
            !checkpoint
                .iter()
                .any(|p| p.partition == message.partition && p.offset >= message.offset)
        });
        let any = !panics.by_position.is_empty() || panics.last_dead_lettered.is_some();
        self.any_panics.store(any, Ordering::Release);
    }

    fn set_live(&self, live: bool) {
        let since = live.then(tokio::time::Instant::now);
        *self.live_since.lock().unwrap_or_else(|e| e.into_inner()) = since;
        if !live {
            self.delivered_new.store(false, Ordering::Relaxed);
        }
    }

    /// Whether the current incarnation's source delivered a message no earlier one had
    /// taken in (what it re-reads from its checkpoint does not count).
    pub(crate) fn delivered_new(&self) -> bool {
        self.delivered_new.load(Ordering::Relaxed)
    }

    fn reached(&self) -> std::sync::MutexGuard<'_, BTreeMap<i32, i64>> {
        self.reached.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long the current incarnation's source has been open.
    pub(crate) fn live_for(&self) -> std::time::Duration {
        self.live_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map(|since| since.elapsed())
            .unwrap_or_default()
    }

    fn next_sequence(&self) -> u64 {
        let sequence = self.sequence.load(Ordering::Relaxed) + 1;
        self.sequence.store(sequence, Ordering::Relaxed);
        sequence
    }
}

/// A run its source's failure ended, kept for the accumulator's next incarnation to
/// carry on. Its state holds what pushes added since the last stored checkpoint, which a
/// restart from that checkpoint would lose (pushes are never replayed), and it knows what
/// it took in, so the source reopens after that instead of delivering it again. Kept for
/// the life of one reactor incarnation: a new reactor holds none of its boundaries.
#[derive(Default)]
pub(crate) struct CarriedRun(std::sync::Mutex<Option<Running>>);

impl CarriedRun {
    fn put(&self, run: Running) {
        // What it took in counts as reached, as when a run ends: its successor's
        // redeliveries of it are no progress.
        run.merge_reached();
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(run);
    }

    fn take(&self) -> Option<Running> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Whether a run waits to be carried on.
    pub(crate) fn is_waiting(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

/// Everything one incarnation of an accumulator is wired to.
pub(crate) struct AccumulatorTask {
    pub graph: Arc<str>,
    pub key: String,
    pub index: usize,
    pub spec: AccumulatorSpec,
    pub source: Option<Arc<dyn SourceFactory>>,
    pub dead_letter_topic: String,
    pub dead_letters: Arc<dyn Sink>,
    pub store: Arc<dyn CheckpointStore>,
    pub socket: SocketReceiver,
    pub to_reactor: mpsc::Sender<ReactorInput>,
    pub permits: Option<Arc<Semaphore>>,
    pub shared: Arc<SourceShared>,
    /// Where a run a source failure ended waits for the next incarnation.
    pub carried: Arc<CarriedRun>,
    /// The graph's lease, when it runs under one: checkpoints carry its fence and stop
    /// at its deadline.
    pub lease: Option<crate::lease::Held>,
    pub durable: watch::Receiver<u64>,
    pub health: Arc<watch::Sender<Health>>,
    pub stats: Arc<GraphStats>,
    pub cancel: CancellationToken,
    /// Least time between the starts of two checkpoint writes.
    pub checkpoint_interval: std::time::Duration,
}

/// How taking a batch of messages ended.
enum Taken {
    All,
    ReactorGone,
    SourceFailed(crate::transport::TransportError),
}

/// What taking one event in left to await.
enum TakenIn {
    /// Nothing.
    Done,
    /// The staged boundaries fill a hand-over: it goes to the reactor now.
    HandOverDue,
    /// The accumulator rejected a source message: its dead letter goes out before the
    /// message counts as taken in.
    DeadLetterFirst(String),
}

struct Running {
    source_name: Arc<str>,
    accumulator: Box<dyn Accumulator>,
    stateful: bool,
    tracker: CommitTracker,
    /// Checkpoints go to the store behind the event path; the broker commit follows
    /// once one is stored, so an unreachable store holds back commits, not events.
    checkpoints: WriteBehind<Checkpoint>,
    /// Per checkpoint handed over and not yet stored (one replaced before the writer
    /// took it up folded into its successor): its version and the broker positions to
    /// commit once it is.
    unstored: VecDeque<(u64, Vec<Position>)>,
    /// Boundaries emitted and not yet handed to the reactor; each holds its queue slot.
    unsent: Vec<Boundary>,
    /// When the burst of source messages being taken was read: their boundaries' emit
    /// time. One clock reading per burst, since its messages are read a moment apart.
    received_ms: i64,
    /// A push changed the state since the last checkpoint handed over or the last mark.
    pushes_unstored: bool,
    /// A push changed the state the tracker's mark holds.
    pushes_marked: bool,
    /// When the state was last marked.
    last_mark: tokio::time::Instant,
    /// The source delivered a message no incarnation had taken in (told to
    /// [`SourceShared`] once).
    delivered_new: bool,
    /// What earlier incarnations took in, per partition, as this one started.
    reached: BTreeMap<i32, i64>,
    /// Events taken in and not yet added to the graph's count: added at each hand-over.
    events_uncounted: u64,
    /// Its source keeps nothing unread (core NATS): it cannot be held at the pending
    /// bound, so the oldest pending boundaries past it are given up instead.
    keeps_nothing_unread: bool,
    slots: QueueSlots,
    /// Where what this run took in is merged when it ends.
    shared: Arc<SourceShared>,
}

impl Running {
    /// Merges what this run took in into what the graph's run reached.
    fn merge_reached(&self) {
        let mut reached = self.shared.reached();
        for (&partition, &offset) in self.tracker.processed_offsets() {
            let highest = reached.entry(partition).or_insert(offset);
            *highest = (*highest).max(offset);
        }
    }

    /// Where its source resumes: after the last message taken in from each partition.
    fn resume_after(&self) -> Vec<Position> {
        self.tracker
            .processed_offsets()
            .iter()
            .filter(|(&partition, _)| partition != PUSH_PARTITION)
            .map(|(&partition, &offset)| Position { partition, offset })
            .collect()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.merge_reached();
    }
}

/// Queue slots this accumulator has taken and not yet given a boundary: given back when
/// it ends, so a restarted accumulator finds its queue's full capacity.
struct QueueSlots {
    permits: Option<Arc<Semaphore>>,
    held: usize,
}

impl Drop for QueueSlots {
    fn drop(&mut self) {
        if let (Some(permits), true) = (&self.permits, self.held > 0) {
            permits.add_permits(self.held);
        }
    }
}

impl AccumulatorTask {
    pub(crate) async fn run(mut self) -> Result<(), AccumulatorError> {
        let ended = self.incarnation().await;
        if ended.is_err() {
            // It hands over nothing more: a reactor stopping before the supervisor has
            // heard of the failure need not wait for it. Its successor says when it
            // starts, whether it carries this run on or starts from the checkpoint.
            let _ = self
                .to_reactor
                .try_send(ReactorInput::Stopped { source: self.index });
            if self.cancel.is_cancelled() {
                // Stopped as it failed (its source's open or a dead letter cut short):
                // no successor carries the run on, so its checkpoint is stored now.
                self.store_carried().await;
            }
        }
        if !self.carried.is_waiting() {
            // Its run is over: nothing of it is pending any more.
            self.stats.pending_boundaries(self.index, 0);
        }
        ended
    }

    /// Runs after `delay`, the backoff after a failure. Stopped meanwhile, it stores the
    /// checkpoint of the run it would have carried on, as a running one does at a stop.
    pub(crate) async fn run_after(
        self,
        delay: std::time::Duration,
    ) -> Result<(), AccumulatorError> {
        tokio::select! {
            // A stop and the end of the delay at once: the stop, so a stopping graph
            // does not open the source again.
            biased;
            _ = self.cancel.cancelled() => {
                self.store_carried().await;
                Ok(())
            }
            _ = tokio::time::sleep(delay) => self.run().await,
        }
    }

    /// Stores the checkpoint of the run waiting to be carried on, if one is, as a
    /// running accumulator does at a stop: what the reactor made durable, and what pushes
    /// added to the state since.
    pub(crate) async fn store_carried(&self) {
        let Some(mut run) = self.carried.take() else {
            return;
        };
        // What the reactor made durable so far counts, though it may have ended.
        let durable = *self.durable.borrow();
        self.commit(&mut run, durable);
        let deadline = tokio::time::Instant::now() + LAST_CHECKPOINT_WAIT;
        let mut durable_changes = Box::pin(changes(self.durable.clone()));
        self.store_last_checkpoint(&mut run, None, &mut durable_changes, deadline)
            .await;
        self.stats.pending_boundaries(self.index, 0);
    }

    async fn incarnation(&mut self) -> Result<(), AccumulatorError> {
        // Whatever fails from here, before the source is open, is no new outage.
        self.shared.set_live(false);
        self.set_health(Health::Starting).await;
        let (mut run, restored) = match self.carried.take() {
            Some(mut run) => {
                run.reached = self.shared.reached().clone();
                run.delivered_new = false;
                (run, None)
            }
            None => {
                let (run, checkpoint) = self.start_run().await?;
                (run, Some(checkpoint))
            }
        };
        // The previous incarnation's guard was dropped when it ended.
        let socket = self.socket.clone();
        let mut socket = socket.lock_owned().await;
        if let Some(checkpoint) = restored {
            // Under the socket's lock, as every change to the push ids is.
            if let Some(push) = checkpoint
                .positions
                .iter()
                .find(|p| p.partition == PUSH_PARTITION)
            {
                self.shared.push_at_least(push.offset);
            }
            self.shared.forget_panics_through(&run.resume_after());
        }

        // What the reactor made durable while a carried run waited counts now, and is
        // checkpointed whether or not the source opens: a long outage does not hold
        // back the checkpoint of what its run had made durable.
        let durable = *self.durable.borrow_and_update();
        self.commit(&mut run, durable);
        let mut source: Option<Box<dyn Source>> = None;
        if let Some(factory) = self.source.clone() {
            self.set_health(Health::Connecting).await;
            let resume_after = run.resume_after();
            let opened = match &self.lease {
                Some(held) => factory.open_fenced(&resume_after, held.lease.token).await,
                None => factory.open(&resume_after).await,
            };
            match opened {
                Ok(s) => {
                    run.keeps_nothing_unread = !s.keeps_unread();
                    source = Some(s);
                }
                Err(e) => {
                    self.set_health(Health::Disconnected).await;
                    self.carried.put(run);
                    return Err(AccumulatorError::Source {
                        source_name: factory.describe(),
                        source: e,
                    });
                }
            }
            self.set_health(Health::Live).await;
            self.shared.set_live(true);
        } else {
            self.set_health(Health::SocketOnly).await;
        }
        // Checkpoints stored while a carried run waited go to the broker now.
        let written = run.checkpoints.written();
        self.checkpoint_stored(&mut run, source.as_deref_mut(), written)
            .await;
        let mut durable_changes = crate::woken::woken(changes(self.durable.clone()));
        match self
            .read(&mut run, &mut source, &mut socket, &mut durable_changes)
            .await
        {
            Ok(()) => {}
            Err(e) if e.leaves_the_run_whole() => {
                drop(source);
                self.carried.put(run);
                return Err(e);
            }
            Err(e) => return Err(e),
        }
        let deadline = tokio::time::Instant::now() + LAST_CHECKPOINT_WAIT;
        if self.cancel.is_cancelled() {
            // Behind everything this incarnation handed over: the stopping reactor takes
            // all of it into the snapshot it stores last (pushes are never replayed).
            let stopped = ReactorInput::Stopped { source: self.index };
            let _ = tokio::time::timeout(LAST_INPUTS_WAIT, self.to_reactor.send(stopped)).await;
        }
        // Stopping, or the reactor is gone: what it made durable is checkpointed first.
        self.store_last_checkpoint(
            &mut run,
            source.as_deref_mut(),
            &mut durable_changes,
            deadline,
        )
        .await;
        Ok(())
    }

    /// A run from the stored checkpoint, and that checkpoint.
    async fn start_run(&self) -> Result<(Running, Checkpoint), AccumulatorError> {
        let checkpoint = self
            .store
            .load_checkpoint(&self.key, &self.spec.name)
            .await?
            .unwrap_or_default();
        let mut accumulator = (self.spec.factory)();
        let state_restored = checkpoint.state.is_some();
        accumulator.init(checkpoint.state.clone())?;
        let stateful = accumulator.checkpoint().is_some();
        let checkpoints = {
            let (store, graph, name) =
                (self.store.clone(), self.key.clone(), self.spec.name.clone());
            let lease = self.lease.clone();
            WriteBehind::spawn("checkpoint", self.checkpoint_interval, move |checkpoint| {
                let (store, graph, name) = (store.clone(), graph.clone(), name.clone());
                let lease = lease.clone();
                async move {
                    let fence = lease
                        .as_ref()
                        .map(crate::lease::Held::write_fence)
                        .transpose()?;
                    store
                        .save_checkpoint(&graph, &name, &checkpoint, fence.as_ref())
                        .await
                }
            })
        };
        let run = Running {
            source_name: Arc::from(self.spec.name.as_str()),
            accumulator,
            stateful,
            tracker: CommitTracker::new(&checkpoint.positions, state_restored),
            checkpoints,
            unstored: VecDeque::new(),
            unsent: Vec::new(),
            received_ms: 0,
            pushes_unstored: false,
            pushes_marked: false,
            last_mark: tokio::time::Instant::now(),
            delivered_new: false,
            reached: self.shared.reached().clone(),
            events_uncounted: 0,
            keeps_nothing_unread: false,
            slots: QueueSlots {
                permits: self.permits.clone(),
                held: 0,
            },
            shared: self.shared.clone(),
        };
        Ok((run, checkpoint))
    }

    /// Reads the socket path and the source until the accumulator stops or the reactor
    /// goes away (`Ok`), or until something fails.
    async fn read(
        &self,
        run: &mut Running,
        source: &mut Option<Box<dyn Source>>,
        socket: &mut Socket,
        durable_changes: &mut (impl futures::Stream<Item = u64> + Unpin),
    ) -> Result<(), AccumulatorError> {
        let mut flush = run.accumulator.flush_interval().map(|period| {
            let mut interval =
                tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        // Made once, not per turn of the loop: each would register a waiter afresh; and
        // polled only once woken, not on every turn.
        let cancel = self.cancel.clone();
        let mut stopping = crate::woken::woken(cancel.cancelled());
        let mut stored = crate::woken::woken(run.checkpoints.stored_versions());

        loop {
            // Enough waits for a stored snapshot: the source is held (a Kafka consumer
            // paused and polled, so it stays in its group) until some of it is durable.
            let at_bound = run.tracker.pending() >= MOST_PENDING_BOUNDARIES
                && source.is_some()
                && !run.keeps_nothing_unread;
            tokio::select! {
                biased;
                _ = &mut stopping => return Ok(()),
                durable = durable_changes.next() => match durable {
                    Some(durable) => self.commit(run, durable),
                    None => return Ok(()),
                },
                Some(version) = stored.next() => {
                    self.checkpoint_stored(run, source.as_deref_mut(), version).await;
                }
                pushed = socket.ready() => match pushed {
                    true => {
                        let taken = self.take_pushes(run, socket).await;
                        // Handed over even when a push failed: pushes are never replayed,
                        // and each boundary held has taken a slot in its queue.
                        let handed = self.hand_over(run).await;
                        if !taken? || !handed {
                            return Ok(());
                        }
                        if run.stateful {
                            // Pushes are never replayed: what they left in the state is
                            // stored now rather than at the next emission, and without
                            // waiting out the checkpoint interval.
                            run.pushes_unstored = true;
                            let durable = *self.durable.borrow();
                            self.commit(run, durable);
                        }
                    }
                    // The supervisor keeps a sender for the graph's lifetime.
                    false => return Ok(()),
                },
                read = read_or_hold(source, at_bound) => match read {
                    // Held while at the bound: looked at again.
                    None => {}
                    Some(Ok(message)) => {
                        let taken = self
                            .take_messages(run, source.as_deref_mut(), message)
                            .await;
                        // Handed over before any error ends this run, and before the
                        // reactor hears the source is down.
                        let handed = self.hand_over(run).await;
                        match taken? {
                            Taken::All if handed => {}
                            Taken::All | Taken::ReactorGone => return Ok(()),
                            Taken::SourceFailed(e) => return Err(self.source_failed(e).await),
                        }
                    }
                    Some(Err(e)) => return Err(self.source_failed(e).await),
                },
                _ = tick(&mut flush) => {
                    // Held before the flush empties the state, as for an event.
                    if !self.slot_held(run) && !self.hold_slot(run).await {
                        return Ok(());
                    }
                    if let Some(value) = run.accumulator.flush() {
                        if !self.emit(run, value, None, now_ms()).await
                            || !self.hand_over(run).await
                        {
                            return Ok(());
                        }
                    }
                }
            }
        }
    }

    /// Takes the burst of pushes at hand. Returns false when the reactor is gone.
    async fn take_pushes(
        &self,
        run: &mut Running,
        socket: &mut Socket,
    ) -> Result<bool, AccumulatorError> {
        // One clock reading for the burst: its pushes are a moment apart.
        let now_us = chrono::Utc::now().timestamp_micros();
        while socket.has_push() {
            // Held before the push leaves the socket: a push waiting for a slot when
            // the reactor goes away stays there for the next run.
            if !self.slot_held(run) && !self.hold_slot(run).await {
                return Ok(false);
            }
            let Some(value) = socket.next_push() else {
                break;
            };
            let (event, push) = self.push_event(value, now_us);
            match self.take_in(run, event, push, None)? {
                TakenIn::Done => {}
                rest => {
                    if !self.finish_taking_in(run, rest, push, None).await? {
                        return Ok(false);
                    }
                }
            }
        }
        Ok(true)
    }

    /// Takes `first` and what the source already holds, without waiting for more.
    async fn take_messages(
        &self,
        run: &mut Running,
        mut source: Option<&mut (dyn Source + '_)>,
        first: Message,
    ) -> Result<Taken, AccumulatorError> {
        run.received_ms = now_ms();
        let position = first.position;
        if !self.handle_message(run, first).await? {
            return Ok(Taken::ReactorGone);
        }
        self.note_progress(run, position);
        for _ in 1..MESSAGE_BATCH {
            match source.as_mut().and_then(|s| s.ready()) {
                Some(Ok(message)) => {
                    let position = message.position;
                    if !self.handle_message(run, message).await? {
                        return Ok(Taken::ReactorGone);
                    }
                    self.note_progress(run, position);
                }
                Some(Err(e)) => return Ok(Taken::SourceFailed(e)),
                None => break,
            }
        }
        Ok(Taken::All)
    }

    /// A message handled: progress, if no incarnation had taken it in before. Looked at
    /// only until the first such message of the run.
    fn note_progress(&self, run: &mut Running, position: Position) {
        if run.delivered_new
            || run
                .reached
                .get(&position.partition)
                .is_some_and(|&reached| position.offset <= reached)
        {
            return;
        }
        run.delivered_new = true;
        self.shared.delivered_new.store(true, Ordering::Relaxed);
    }

    /// The source failed: marked disconnected, and the error to end this run with.
    async fn source_failed(&self, error: crate::transport::TransportError) -> AccumulatorError {
        self.set_health(Health::Disconnected).await;
        AccumulatorError::Source {
            source_name: self
                .source
                .as_ref()
                .map(|s| s.describe())
                .unwrap_or_default(),
            source: error,
        }
    }

    async fn set_health(&self, health: Health) {
        self.health.send_replace(health);
        self.stats.health_changed(self.index, health);
        let _ = self
            .to_reactor
            .send(ReactorInput::Health {
                source: self.index,
                health,
            })
            .await;
    }

    /// A pushed value as the event it is taken in as, with its push id.
    fn push_event(&self, value: Value, now_us: i64) -> (Event, Position) {
        let id = self.shared.next_push(now_us);
        let pushed_at_ms = now_us.div_euclid(1000);
        let push = Position {
            partition: PUSH_PARTITION,
            offset: id,
        };
        let event = Event {
            value,
            position: None,
            time_ms: pushed_at_ms,
        };
        (event, push)
    }

    /// Returns false when the reactor is gone.
    async fn handle_message(
        &self,
        run: &mut Running,
        message: Message,
    ) -> Result<bool, AccumulatorError> {
        let position = message.position;
        if run.tracker.seen(position) {
            // The broker delivered again what this run or its checkpoint already holds
            // (its commit lagged, or JetStream's ack wait ran out): taken in again, it
            // would be folded into a state twice.
            self.stats.duplicate_dropped();
            return Ok(true);
        }
        let poisoned = self.shared.poisoned_at(position);
        match &poisoned {
            Some(Poisoned::DeadLettered) => {
                run.tracker.processed(position);
                return Ok(true);
            }
            Some(Poisoned::Panicked { times, reason }) if *times >= PANICS_BEFORE_DEAD_LETTER => {
                let reason = format!("the accumulator panicked on it {times} times: {reason}");
                self.dead_letter(&message, &reason).await?;
                self.shared.dead_lettered(position);
                run.tracker.processed(position);
                return Ok(true);
            }
            _ => {}
        }
        let value = match self.spec.format.decode(&message.payload) {
            Ok(value) => value,
            Err(e) => {
                self.dead_letter(&message, &e.to_string()).await?;
                run.tracker.processed(position);
                return Ok(true);
            }
        };
        let event = Event {
            value,
            position: Some(position),
            time_ms: message.timestamp_ms,
        };
        let handled = self.handle(run, event, position, Some(&message)).await;
        if handled.is_ok() {
            self.shared.handled(position);
        }
        handled
    }

    /// Takes one event in; `position` is its source position or its push id.
    async fn handle(
        &self,
        run: &mut Running,
        event: Event,
        position: Position,
        message: Option<&Message>,
    ) -> Result<bool, AccumulatorError> {
        if !self.slot_held(run) && !self.hold_slot(run).await {
            return Ok(false);
        }
        match self.take_in(run, event, position, message)? {
            TakenIn::Done => Ok(true),
            rest => self.finish_taking_in(run, rest, position, message).await,
        }
    }

    /// [`Self::handle`] once a slot is held, without awaiting anything: the event goes
    /// through the accumulator and its boundary, if any, is staged. What is left to
    /// await (a hand-over due, a dead letter to send first) is returned for
    /// [`Self::finish_taking_in`]. Kept apart from the awaits, which most events make
    /// none of, so that an event costs no future of their size.
    fn take_in(
        &self,
        run: &mut Running,
        event: Event,
        position: Position,
        message: Option<&Message>,
    ) -> Result<TakenIn, AccumulatorError> {
        debug_assert!(
            self.slot_held(run),
            "an event is taken in with its slot held"
        );
        run.events_uncounted += 1;
        let time_ms = event.time_ms;
        // Caught, so what this run emitted before still reaches the reactor: pushes
        // are never replayed. The supervisor then starts a new instance, from the
        // last checkpoint: the state this one holds may be half changed. It reads a
        // source message again, and dead-letters it if it panicked on it before.
        let accumulator = &mut run.accumulator;
        let outcome = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            accumulator.process(event)
        })) {
            Ok(outcome) => outcome,
            Err(panic) => {
                let reason = super::panic_message(panic.as_ref());
                return Err(match message {
                    Some(m) if self.shared.panicked_on(m.position, &reason) => {
                        AccumulatorError::PanickedOnMessage {
                            position: m.position,
                            reason,
                        }
                    }
                    Some(_) => AccumulatorError::Panicked(format!(
                        "{reason} (after {POISONED_IN_A_ROW} messages in a row dead-lettered for panics, the state is taken to be at fault)"
                    )),
                    None => AccumulatorError::Panicked(reason),
                });
            }
        };
        let outcome = match outcome {
            // Taken in only once its dead letter is out: a run carried past a failed
            // dead-letter publish reopens its source after what it took in, and would
            // otherwise never read this message again.
            Err(AccumulatorError::Rejected(reason)) if message.is_some() => {
                return Ok(TakenIn::DeadLetterFirst(reason));
            }
            outcome => outcome,
        };
        run.tracker.processed(position);
        match outcome {
            Ok(Some(value)) => Ok(if self.stage(run, value, Some(position), time_ms) {
                TakenIn::Done
            } else {
                TakenIn::HandOverDue
            }),
            Ok(None) => Ok(TakenIn::Done),
            Err(AccumulatorError::Rejected(reason)) => {
                warn!(graph = %self.graph, accumulator = %self.spec.name, %reason, "pushed event rejected");
                self.stats.dead_lettered();
                Ok(TakenIn::Done)
            }
            Err(e) => Err(e),
        }
    }

    /// What [`Self::take_in`] left to await. Returns false when the reactor is gone.
    async fn finish_taking_in(
        &self,
        run: &mut Running,
        taken: TakenIn,
        position: Position,
        message: Option<&Message>,
    ) -> Result<bool, AccumulatorError> {
        match taken {
            TakenIn::Done => Ok(true),
            TakenIn::HandOverDue => Ok(self.hand_over(run).await),
            TakenIn::DeadLetterFirst(reason) => {
                if let Some(m) = message {
                    self.dead_letter(m, &reason).await?;
                }
                run.tracker.processed(position);
                Ok(true)
            }
        }
    }

    /// Whether a slot is held already, or none is needed: what nearly every event finds,
    /// checked before [`Self::hold_slot`] so that it costs no future of its own, whose
    /// waits make it large to set up and drop.
    fn slot_held(&self, run: &Running) -> bool {
        self.permits.is_none() || run.slots.held > 0
    }

    /// Holds a slot in this source's queue for the boundary the next event (or flush)
    /// may emit, waiting for one while the queue is full. Taken before the event is
    /// processed rather than when its boundary is emitted: an event processed, its
    /// boundary then left waiting for a slot when the reactor went away, would count as
    /// processed and be committed with the next checkpoint, its boundary lost. Returns
    /// false when the reactor is gone.
    async fn hold_slot(&self, run: &mut Running) -> bool {
        let Some(permits) = &self.permits else {
            return true;
        };
        if run.slots.held > 0 {
            return true;
        }
        // Backpressure: slots are taken several at a time when the queue has them, so
        // most boundaries cost no atomic operation here.
        let free = permits.available_permits().clamp(1, HANDOFF);
        match permits.try_acquire_many(free as u32) {
            Ok(taken) => {
                taken.forget();
                run.slots.held = free;
            }
            Err(_) => {
                // Full: what this accumulator holds goes to the reactor first, so the
                // slots it took can be freed.
                if !self.hand_over(run).await {
                    return false;
                }
                tokio::select! {
                    _ = self.cancel.cancelled() => return false,
                    permit = permits.acquire() => match permit {
                        Ok(p) => p.forget(),
                        Err(_) => return false,
                    },
                }
                run.slots.held = 1;
            }
        }
        true
    }

    /// Adds a boundary to those the reactor gets at the next hand-over, in the queue
    /// slot held for it. Returns false when the reactor is gone.
    async fn emit(
        &self,
        run: &mut Running,
        value: Value,
        position: Option<crate::transport::Position>,
        event_time_ms: i64,
    ) -> bool {
        if !self.slot_held(run) && !self.hold_slot(run).await {
            return false;
        }
        self.stage(run, value, position, event_time_ms) || self.hand_over(run).await
    }

    /// [`Self::emit`] once a slot is held, without awaiting anything: the boundary joins
    /// those the reactor gets at the next hand-over. Returns whether there is room for
    /// more before that hand-over is due. Kept apart from the awaits, which most events
    /// make none of, so that an event costs no future of the hand-over's size.
    fn stage(
        &self,
        run: &mut Running,
        value: Value,
        position: Option<crate::transport::Position>,
        event_time_ms: i64,
    ) -> bool {
        if self.permits.is_some() {
            run.slots.held -= 1;
        }
        let sequence = self.shared.next_sequence();
        let positions = run.tracker.emitted(sequence, position);
        let from_source = position.is_some_and(|p| p.partition != PUSH_PARTITION);
        run.unsent.push(Boundary {
            source: run.source_name.clone(),
            sequence,
            positions,
            event_time_ms,
            // Pushed and flushed events were stamped a moment ago, and source messages
            // when their burst was read; reading the clock again would cost more than
            // the difference is worth.
            emit_time_ms: if from_source {
                run.received_ms
            } else {
                event_time_ms
            },
            value,
        });
        run.unsent.len() < HANDOFF
    }

    /// Hands the emitted boundaries to the reactor, in one go. Returns false when the
    /// reactor is gone.
    async fn hand_over(&self, run: &mut Running) -> bool {
        if run.events_uncounted > 0 {
            self.stats
                .events_received(std::mem::take(&mut run.events_uncounted));
        }
        if !run.unsent.is_empty() {
            if run.keeps_nothing_unread {
                run.tracker.forget_pending_past(MOST_PENDING_BOUNDARIES);
            }
            self.stats
                .pending_boundaries(self.index, run.tracker.pending());
        }
        let input = match run.unsent.len() {
            0 => return true,
            1 => match run.unsent.pop() {
                Some(boundary) => ReactorInput::Boundary {
                    source: self.index,
                    boundary,
                },
                None => return true,
            },
            _ => ReactorInput::Boundaries {
                source: self.index,
                boundaries: std::mem::take(&mut run.unsent),
            },
        };
        self.to_reactor.send(input).await.is_ok()
    }

    async fn dead_letter(&self, message: &Message, reason: &str) -> Result<(), AccumulatorError> {
        let mut outbound = Outbound::new(self.dead_letter_topic.clone(), message.payload.clone())
            .header(crate::wire::ERROR_HEADER, reason)
            .header(crate::wire::GRAPH_HEADER, &*self.graph)
            .header(crate::wire::ACCUMULATOR_HEADER, &self.spec.name)
            .header(crate::wire::SOURCE_TOPIC_HEADER, &*message.topic)
            .header(
                crate::wire::PARTITION_HEADER,
                message.position.partition.to_string(),
            )
            .header(
                crate::wire::OFFSET_HEADER,
                message.position.offset.to_string(),
            );
        outbound.key = message.key.clone();
        crate::transport::publish_dead_letter(self.dead_letters.as_ref(), outbound, &self.cancel)
            .await
            .map_err(|source| AccumulatorError::DeadLetter {
                topic: self.dead_letter_topic.clone(),
                source,
            })?;
        warn!(graph = %self.graph, accumulator = %self.spec.name, topic = %self.dead_letter_topic, %reason, "event dead-lettered");
        self.stats.dead_lettered();
        Ok(())
    }

    /// Hands the checkpoint that what is durable allows to the store's writer: at once,
    /// without the spacing between checkpoint writes, when it holds a state pushes
    /// changed, since pushes are never replayed.
    fn commit(&self, run: &mut Running, durable: u64) {
        let point = run.tracker.durable(durable, run.stateful);
        self.stats
            .pending_boundaries(self.index, run.tracker.pending());
        let Some(point) = point else {
            if run.stateful {
                self.mark(run);
            }
            return;
        };
        if self.source.is_none() && !run.stateful {
            // Push-only and stateless: nothing to resume from, since pushes are never
            // replayed and push ids are kept above the reactor's.
            return;
        }
        let (state, pushes) = match point.state {
            PointState::Marked(state) => (state, std::mem::take(&mut run.pushes_marked)),
            // Taken after the mark, the state holds what the marked one held.
            PointState::Current => (
                if run.stateful {
                    run.accumulator.checkpoint()
                } else {
                    None
                },
                std::mem::take(&mut run.pushes_unstored) | std::mem::take(&mut run.pushes_marked),
            ),
        };
        let checkpoint = Checkpoint {
            positions: run.tracker.committed(),
            state,
            token: self.lease.as_ref().map(|held| held.lease.token),
        };
        debug!(graph = %self.graph, accumulator = %self.spec.name, positions = ?checkpoint.positions, "checkpoint");
        let broker_positions: Vec<Position> = point
            .positions
            .into_iter()
            .filter(|p| p.partition != PUSH_PARTITION)
            .collect();
        let version = if pushes {
            run.checkpoints.submit_at_once(checkpoint)
        } else {
            run.checkpoints.submit(checkpoint)
        };
        match run.unstored.back_mut() {
            // The last checkpoint will not be stored on its own: its positions go with
            // this one's, so through a store outage the list stays as short as the
            // writer's attempts, not one entry per checkpoint.
            Some((last, positions)) if run.checkpoints.replaced(*last) => {
                *last = version;
                for p in broker_positions {
                    match positions.iter_mut().find(|q| q.partition == p.partition) {
                        Some(q) => q.offset = q.offset.max(p.offset),
                        None => positions.push(p),
                    }
                }
            }
            _ => run.unstored.push_back((version, broker_positions)),
        }
        if run.stateful {
            self.mark(run);
        }
    }

    /// Marks the state of a stateful accumulator whose boundaries are pending, for a
    /// checkpoint once they are durable: under a steady backlog some always are, and
    /// the state as it is would never be stored. Marked at most once per checkpoint
    /// interval, since it costs a copy of the state, except when pushes changed it,
    /// which are never replayed.
    fn mark(&self, run: &mut Running) {
        if !run.pushes_unstored && run.last_mark.elapsed() < self.checkpoint_interval {
            return;
        }
        let accumulator = &run.accumulator;
        if run.tracker.mark(|| accumulator.checkpoint()) {
            run.last_mark = tokio::time::Instant::now();
            run.pushes_marked = std::mem::take(&mut run.pushes_unstored);
        }
    }

    /// Stopping: the positions the reactor makes durable as it stops (through its last
    /// snapshot, which counts its last fires) are checkpointed and committed before the accumulator ends. Topic
    /// checkpoints are spaced out while running; without this, a restart would re-read up
    /// to one interval of events only to drop them as repeats.
    async fn store_last_checkpoint(
        &self,
        run: &mut Running,
        source: Option<&mut (dyn Source + '_)>,
        durable_changes: &mut (impl futures::Stream<Item = u64> + Unpin),
        deadline: tokio::time::Instant,
    ) {
        // The reactor's durable positions end with its run.
        let followed = tokio::time::timeout_at(deadline - LAST_CHECKPOINT_STORE, async {
            while let Some(durable) = durable_changes.next().await {
                self.commit(run, durable);
            }
        })
        .await;
        if followed.is_err() {
            // Whatever it reported so far still counts.
            let durable = *self.durable.borrow();
            self.commit(run, durable);
        }
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if !run.checkpoints.flush(left).await {
            warn!(graph = %self.graph, accumulator = %self.spec.name, "the last checkpoint was not stored; a restart re-reads from the one before");
        }
        // What was stored, the last or an earlier one, is committed either way.
        let written = run.checkpoints.written();
        self.checkpoint_stored(run, source, written).await;
    }

    /// Checkpoints up to `version` are stored: their positions go to the broker. The
    /// store first, so a crash between the two replays events (at-least-once) rather
    /// than skipping them.
    async fn checkpoint_stored(
        &self,
        run: &mut Running,
        source: Option<&mut (dyn Source + '_)>,
        version: u64,
    ) {
        let mut through: std::collections::BTreeMap<i32, i64> = Default::default();
        while run.unstored.front().is_some_and(|(v, _)| *v <= version) {
            let Some((_, positions)) = run.unstored.pop_front() else {
                break;
            };
            for p in positions {
                let offset = through.entry(p.partition).or_insert(p.offset);
                *offset = (*offset).max(p.offset);
            }
            self.stats.checkpoint_written();
        }
        let through: Vec<Position> = through
            .into_iter()
            .map(|(partition, offset)| Position { partition, offset })
            .collect();
        if let (Some(source), false) = (source, through.is_empty()) {
            if let Err(e) = source.commit(&through).await {
                // A later commit covers these positions too.
                warn!(graph = %self.graph, accumulator = %self.spec.name, error = %e, "commit failed");
            }
        }
    }
}

/// The next message, or, with `held`, none: the source is held until it has something
/// to say (a Kafka consumer polls, paused), and `None` returned to look again.
async fn read_or_hold(
    source: &mut Option<Box<dyn Source>>,
    held: bool,
) -> Option<Result<Message, crate::transport::TransportError>> {
    match source {
        Some(s) if held => s.hold().await.err().map(Err),
        _ => Some(next_message(source).await),
    }
}

async fn next_message(
    source: &mut Option<Box<dyn Source>>,
) -> Result<Message, crate::transport::TransportError> {
    match source {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn tick(interval: &mut Option<Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

//! The reactor task.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::task::Poll;

use futures::future::BoxFuture;
use futures::stream::{FuturesOrdered, StreamExt};
use serde_json::Value;
use smallvec::SmallVec;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::cache::{Consumed, InputCache, Inserted, Refire, Taken};
use super::CacheStore;
use super::{
    Command, CommandError, FireReason, FireReport, ReactorConfig, ReactorInput, ReactorState,
    ReactorStatus, SourceStatus, Strategy,
};
use crate::accumulator::task::{CarriedRun, SourceShared, HANDOFF, LAST_INPUTS_WAIT};
use crate::accumulator::{Boundary, Health, Positions, PUSH_PARTITION};
use crate::graph::{CompiledGraph, FireInput, FireValues, GraphDeclaration};
use crate::stats::{FireClock, GraphStats};
use crate::store_error::StoreError;
use crate::transport::{
    now_ms, HeaderValue, Outbound, PendingAck, Sink, TopicName, TransportError,
};
use crate::write_behind::WriteBehind;

/// Boundaries drained per wakeup before criteria are evaluated, so a burst becomes one
/// fire under the latest strategy instead of one fire per boundary.
const DRAIN_BATCH: usize = 4096;
/// Input channel slots at least. A slot holds up to [`HANDOFF`] boundaries (a burst),
/// or one (a trickle, a health change), so the channel is sized between the two.
const MIN_INPUT_SLOTS: usize = 256;

/// Longest a stopping reactor waits for its last cache snapshot to be stored.
const FINAL_SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long a command's fire waits for the store to take the snapshot counting it.
const COMMAND_COUNT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Inputs taken in after which a snapshot is due whatever `snapshot_interval` says.
/// Positions are committed only through stored snapshots, and a broker stops delivering
/// to a reader holding too much unacknowledged (JetStream: 100,000 messages): a long
/// interval must not stall the graph.
const SNAPSHOT_AFTER_INPUTS: usize = 50_000;
/// A stopping reactor starts at most this many fires more in one turn.
const STOP_CHECK_EVERY: u32 = 64;

#[derive(Debug, thiserror::Error)]
pub enum ReactorError {
    #[error("publishing outputs failed: {0}")]
    Publish(#[from] TransportError),
    #[error("restoring the input cache failed: {0}")]
    Restore(#[from] StoreError),
}

impl ReactorError {
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Publish(e) => e.is_retryable(),
            Self::Restore(e) => e.is_retryable(),
        }
    }
}

/// What the accumulators of one reactor incarnation are wired to.
pub(crate) struct Wiring {
    pub inputs: mpsc::Sender<ReactorInput>,
    /// Highest durable sequence per source.
    pub durable: Vec<watch::Receiver<u64>>,
    /// Queue slots per source (sequential strategy only).
    pub permits: Vec<Option<Arc<Semaphore>>>,
    pub shared: Vec<Arc<SourceShared>>,
    /// Per source, where a run its source's failure ended waits for the next incarnation.
    pub carried: Vec<Arc<CarriedRun>>,
}

pub(crate) struct Reactor {
    graph: Arc<str>,
    /// What publishing a fire's outputs takes, handed to each fire whole.
    publishing: Arc<Publishing>,
    config: ReactorConfig,
    compiled: Arc<CompiledGraph>,
    /// Cache snapshots go to the store behind the firing path: an unreachable store
    /// holds back commits, never fires.
    snapshots: WriteBehind<super::CacheSnapshot>,
    /// Per snapshot handed over and not yet stored (one replaced before the writer took
    /// it up folded into its successor): its version and, per source, the highest
    /// sequence it holds (durable once it is stored).
    unstored: VecDeque<(u64, Vec<u64>)>,
    cache: InputCache,
    health: Vec<Health>,
    /// Per source, whether its accumulator's incarnation said it hands over nothing more
    /// (it stopped with the graph, or ended on an error).
    stopped: Vec<bool>,
    durable: Vec<watch::Sender<u64>>,
    /// Durable sequence per source not yet told to its accumulator: published once per
    /// loop turn, not once per fire.
    durable_pending: Vec<u64>,
    /// What each accumulator was last told is durable.
    durable_told: Vec<u64>,
    permits: Vec<Option<Arc<Semaphore>>>,
    /// Queue slots freed since the last loop turn, per source.
    permits_pending: Vec<usize>,
    inputs: mpsc::Receiver<ReactorInput>,
    state: ReactorState,
    state_tx: watch::Sender<ReactorState>,
    paused: bool,
    fires: u64,
    /// Fires to make again under their own numbers, restored with the queues holding
    /// their inputs (sequential strategy), oldest first.
    refires: VecDeque<Refire>,
    in_flight: FuturesOrdered<BoxFuture<'static, Result<(), TransportError>>>,
    /// Boundaries taken by each in-flight fire, oldest first.
    unacknowledged: VecDeque<Consumed>,
    /// Boundaries of fires given up at shutdown while their graph was being retried: stored
    /// as not yet consumed, so the next run fires them again.
    abandoned: Vec<Consumed>,
    /// A fire was given up as the reactor stops (a plain flag: the token's own check
    /// takes a lock, too dear for every turn of the firing loop).
    fire_given_up: bool,
    cancel: CancellationToken,
    stats: Arc<GraphStats>,
    clock: FireClock,
    snapshot_pending: bool,
    /// Inputs taken in since the last snapshot was taken, repeats included (their
    /// positions too are committed through it).
    unsnapshotted: usize,
    last_snapshot: Instant,
}

impl Reactor {
    /// Builds a reactor from its declaration, restoring the cache from the store.
    pub(crate) async fn restore(
        decl: &GraphDeclaration,
        outputs: Arc<[(TopicName, Arc<dyn Sink>)]>,
        store: Arc<dyn CacheStore>,
        stats: Arc<GraphStats>,
        state_tx: watch::Sender<ReactorState>,
        lease: Option<crate::lease::Held>,
    ) -> Result<(Self, Wiring), ReactorError> {
        stats.state_changed(ReactorState::Starting);
        state_tx.send_replace(ReactorState::Starting);
        let key = decl.key();
        let names: Arc<[Arc<str>]> = decl
            .accumulators
            .iter()
            .map(|a| Arc::from(a.name.as_str()))
            .collect();
        let mut cache = InputCache::new(names.clone(), decl.reactor.strategy);
        let mut fires = 0;
        let mut refires = VecDeque::new();
        let mut paused = false;
        let mut queued = vec![0; names.len()];
        if let Some(snapshot) = store.load_cache(&key).await? {
            queued = cache.restore(&snapshot);
            fires = snapshot.fires;
            // With `latest` a requeued fire is only a dirty flag, and fires again merged
            // with whatever came after it: as a new fire.
            if decl.reactor.strategy == Strategy::Sequential {
                refires = snapshot.refires.clone();
            }
            paused = snapshot.paused;
            debug!(graph = %decl.name, fires, "input cache restored");
        }
        let slots = (decl.reactor.queue_capacity.max(DRAIN_BATCH) / HANDOFF).max(MIN_INPUT_SLOTS);
        let (inputs_tx, inputs) = mpsc::channel(slots);
        let mut durable = Vec::with_capacity(names.len());
        let mut durable_rx = Vec::with_capacity(names.len());
        let mut permits = Vec::with_capacity(names.len());
        let mut shared = Vec::with_capacity(names.len());
        for (i, _) in names.iter().enumerate() {
            let (tx, rx) = watch::channel(0);
            let last_push = cache
                .seen(i)
                .iter()
                .find(|p| p.partition == PUSH_PARTITION)
                .map_or(0, |p| p.offset);
            shared.push(Arc::new(SourceShared::after_push(last_push)));
            durable.push(tx);
            durable_rx.push(rx);
            permits.push(match decl.reactor.strategy {
                Strategy::Latest => None,
                Strategy::Sequential => Some(Arc::new(Semaphore::new(
                    decl.reactor.queue_capacity.saturating_sub(queued[i]),
                ))),
            });
        }
        let snapshots = {
            let key = key.clone();
            let lease = lease.clone();
            WriteBehind::spawn(
                "cache snapshot",
                std::time::Duration::ZERO,
                move |snapshot| {
                    let (store, key, lease) = (store.clone(), key.clone(), lease.clone());
                    async move {
                        let fence = lease
                            .as_ref()
                            .map(crate::lease::Held::write_fence)
                            .transpose()?;
                        store.save_cache(&key, &snapshot, fence.as_ref()).await
                    }
                },
            )
        };
        let reactor = Self {
            graph: Arc::from(decl.name.as_str()),
            publishing: Arc::new(Publishing {
                stamp: Stamp {
                    key: bytes::Bytes::from(decl.key().into_bytes()),
                    graph: HeaderValue::new(&decl.name),
                    fencing: lease
                        .as_ref()
                        .map(|held| HeaderValue::new(held.lease.token.to_string())),
                },
                lease,
                outputs,
                stats: stats.clone(),
            }),
            config: decl.reactor.clone(),
            compiled: decl.graph.clone(),
            snapshots,
            unstored: VecDeque::new(),
            cache,
            health: vec![Health::Starting; names.len()],
            stopped: vec![false; names.len()],
            durable_pending: durable.iter().map(|d| *d.borrow()).collect(),
            durable_told: durable.iter().map(|d| *d.borrow()).collect(),
            durable,
            permits_pending: vec![0; permits.len()],
            permits: permits.clone(),
            inputs,
            state: ReactorState::Starting,
            state_tx,
            paused,
            fires,
            refires,
            in_flight: FuturesOrdered::new(),
            unacknowledged: VecDeque::new(),
            abandoned: Vec::new(),
            fire_given_up: false,
            cancel: CancellationToken::new(),
            stats,
            clock: FireClock::new(),
            snapshot_pending: false,
            unsnapshotted: 0,
            last_snapshot: Instant::now(),
        };
        let wiring = Wiring {
            inputs: inputs_tx,
            durable: durable_rx,
            permits,
            carried: shared.iter().map(|_| Arc::default()).collect(),
            shared,
        };
        Ok((reactor, wiring))
    }

    pub(crate) async fn run(
        mut self,
        commands: &mut mpsc::Receiver<Command>,
        cancel: CancellationToken,
    ) -> Result<(), ReactorError> {
        self.cancel = cancel.clone();
        self.set_state(ReactorState::Warming);
        self.update_state();
        let snapshot_timer = tokio::time::sleep(self.config.snapshot_interval);
        tokio::pin!(snapshot_timer);
        // Made once, not per turn of the loop: each would register a waiter afresh; and
        // polled only once woken, not on every turn.
        let mut stopping = crate::woken::woken(cancel.cancelled());
        let mut stored = crate::woken::woken(self.snapshots.stored_versions());
        let mut timer_armed = false;
        let turns: Result<(), ReactorError> = async {
            loop {
                let mut fired: u32 = 0;
                while self.should_fire() {
                    // Stopping: no more fires than a few, however long the queues are, so
                    // the final snapshot comes in time (looked at every so often: the
                    // token's check takes a lock).
                    if fired > 0 && fired % STOP_CHECK_EVERY == 0 && cancel.is_cancelled() {
                        break;
                    }
                    let (values, taken) = self.cache.take();
                    self.fire(values, taken, FireReason::Criteria).await?;
                    fired += 1;
                }
                self.publish_progress();
                self.report_queues();
                if self.snapshot_pending {
                    let due = self.last_snapshot + self.config.snapshot_interval;
                    if due <= Instant::now() || self.unsnapshotted >= SNAPSHOT_AFTER_INPUTS {
                        self.snapshot();
                    } else if !timer_armed {
                        snapshot_timer.as_mut().reset(due);
                        timer_armed = true;
                    }
                }
                tokio::select! {
                    biased;
                    _ = &mut stopping => break,
                    Some(done) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                        done?;
                        self.acknowledged();
                    }
                    Some(command) = commands.recv() => self.command(command).await?,
                    Some(version) = stored.next() => {
                        self.snapshot_stored(version);
                        self.publish_progress();
                    }
                    input = self.inputs.recv() => match input {
                        Some(input) => {
                            let mut taken = self.apply(input);
                            while taken < DRAIN_BATCH {
                                match self.inputs.try_recv() {
                                    Ok(input) => taken += self.apply(input),
                                    Err(_) => break,
                                }
                            }
                        }
                        None => break,
                    },
                    _ = &mut snapshot_timer, if timer_armed => {
                        timer_armed = false;
                        if self.snapshot_pending {
                            self.snapshot();
                        }
                    }
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = turns {
            self.store_last_snapshot().await;
            return Err(e);
        }
        if cancel.is_cancelled() {
            self.take_last_inputs().await;
        }
        // Let acknowledged output count before the final snapshot; the supervisor bounds
        // how long this may take.
        while let Some(done) = self.in_flight.next().await {
            if let Err(e) = done {
                self.store_last_snapshot().await;
                return Err(e.into());
            }
            self.acknowledged();
        }
        self.store_last_snapshot().await;
        Ok(())
    }

    /// Ending, stopped or failed: fires acknowledged since the last snapshot are done, and
    /// a snapshot counting them (the fires still unacknowledged requeued in it) lets the
    /// accumulators checkpoint their inputs as they stop, so the broker does not replay
    /// them and the next run numbers its fires after theirs.
    async fn store_last_snapshot(&mut self) {
        if self.snapshot_pending || !self.unacknowledged.is_empty() {
            self.snapshot();
        }
        if !self.snapshots.flush(FINAL_SNAPSHOT_WAIT).await {
            warn!(graph = %self.graph, "the last cache snapshot was not stored; the next run replays from the last one stored");
        }
        // What was stored, the last or an earlier one, counts either way.
        self.snapshot_stored(self.snapshots.written());
        self.publish_progress();
    }

    fn set_state(&mut self, state: ReactorState) {
        if self.state != state {
            debug!(graph = %self.graph, from = ?self.state, to = ?state, "reactor state");
            self.state = state;
            // The metric first: whoever sees the new state sees it reported.
            self.stats.state_changed(state);
            self.state_tx.send_replace(state);
        }
    }

    fn update_state(&mut self) {
        let all_healthy = self.health.iter().all(|h| h.is_healthy());
        let next = match (self.state, all_healthy) {
            (ReactorState::Warming, true) | (ReactorState::Degraded, true) => ReactorState::Live,
            (ReactorState::Live, false) => ReactorState::Degraded,
            (state, _) => state,
        };
        self.set_state(next);
    }

    fn should_fire(&self) -> bool {
        !self.fire_given_up
            && matches!(self.state, ReactorState::Live | ReactorState::Degraded)
            && !self.paused
            && self.in_flight.len() < self.config.max_in_flight
            && self.cache.ready(self.config.criteria)
    }

    /// Takes one input in; returns how many inputs it counts for (boundaries, or 1).
    fn apply(&mut self, input: ReactorInput) -> usize {
        match input {
            ReactorInput::Boundary { source, boundary } => {
                if self.cache_boundary(source, boundary) {
                    self.stats.boundaries_cached(1);
                }
                1
            }
            ReactorInput::Boundaries { source, boundaries } => {
                let count = boundaries.len();
                let mut cached = 0;
                for boundary in boundaries {
                    cached += u64::from(self.cache_boundary(source, boundary));
                }
                if cached > 0 {
                    self.stats.boundaries_cached(cached);
                }
                count
            }
            ReactorInput::Health { source, health } => {
                self.health[source] = health;
                if health == Health::Starting {
                    // A new incarnation: it will say when it stops.
                    self.stopped[source] = false;
                }
                self.update_state();
                1
            }
            ReactorInput::Stopped { source } => {
                self.stopped[source] = true;
                1
            }
        }
    }

    /// Stopping: what the accumulators handed over before they stopped is taken into the
    /// cache, for the last snapshot to hold and the next run to fire. Left in the channel
    /// it would be lost where it cannot be replayed (pushes). Waits, at most
    /// [`LAST_INPUTS_WAIT`], for each accumulator still running (its source not reported
    /// down, which an incarnation does after its last hand-over) to say it stopped.
    async fn take_last_inputs(&mut self) {
        let deadline = Instant::now() + LAST_INPUTS_WAIT;
        while self
            .health
            .iter()
            .zip(&self.stopped)
            .any(|(health, stopped)| !stopped && *health != Health::Disconnected)
        {
            match tokio::time::timeout_at(deadline, self.inputs.recv()).await {
                Ok(Some(input)) => {
                    self.apply(input);
                }
                Ok(None) | Err(_) => break,
            }
        }
    }

    /// Caches a boundary; false if it was a repeat, dropped. The caller counts what was
    /// cached, once per input.
    fn cache_boundary(&mut self, source: usize, boundary: Boundary) -> bool {
        match self.cache.insert(source, boundary) {
            Inserted::Accepted => {
                self.snapshot_pending = true;
                self.unsnapshotted += 1;
                true
            }
            Inserted::Duplicate => {
                self.stats.duplicate_dropped();
                // A repeat's position is committed through a snapshot too: a replay of
                // repeats alone must not wait for a new event to be committed, nor hold
                // more unacknowledged than a broker delivers.
                self.snapshot_pending = true;
                self.unsnapshotted += 1;
                // The slot this boundary took is free again.
                self.permits_pending[source] += 1;
                false
            }
        }
    }

    async fn fire(
        &mut self,
        values: FireValues,
        taken: Taken,
        reason: FireReason,
    ) -> Result<FireReport, ReactorError> {
        if self.config.strategy == Strategy::Sequential {
            for &i in &taken {
                self.permits_pending[i] += 1;
            }
        }
        self.snapshot_pending = true;
        let fire = self.number(&taken, reason);
        let degraded = self.state == ReactorState::Degraded;
        let input = Arc::new(FireInput::new(
            self.graph.clone(),
            fire,
            degraded,
            self.cache.names().clone(),
            values,
        ));
        let consumed = Consumed::new(input.clone(), taken);
        let started = self.clock.start();
        let mut result = self.compiled.run(input.clone()).await;
        self.stats.fired(self.clock.since(started), reason);
        let mut retries = 0;
        while let Err(e) = &result {
            if retries == self.config.node_retries {
                break;
            }
            let delay = self.config.node_retry_backoff * 2u32.saturating_pow(retries);
            retries += 1;
            warn!(graph = %self.graph, fire, error = %e, retry = retries, ?delay, "fire failed; retrying");
            self.stats.fire_failed();
            tokio::select! {
                _ = self.cancel.cancelled() => {
                    // Shutting down: the inputs go back to the stored cache unconsumed,
                    // and no fire starts after this one, which would be requeued ahead
                    // of it.
                    self.abandoned.push(consumed);
                    self.fire_given_up = true;
                    return Ok(FireReport { fire, outputs: 0 });
                }
                _ = tokio::time::sleep(delay) => {}
            }
            result = self.compiled.run(input.clone()).await;
        }
        let publishing = &self.publishing;
        // Inline: most graphs publish one output per fire.
        let messages: SmallVec<[(Target, Outbound); 1]> = match result {
            Ok(outputs) => publishing
                .outputs
                .iter()
                .enumerate()
                .filter_map(|(i, (topic, _))| {
                    let message = Outbound::new(topic.clone(), outputs.encoded(i)?);
                    Some((
                        Target::Output(i),
                        publishing.stamp.apply(message, fire, degraded),
                    ))
                })
                .collect(),
            Err(e) => {
                // Retries did not help: the fire and its inputs go to the dead-letter
                // topic, and once that is acknowledged they count as handled, so one bad
                // value cannot wedge the graph.
                warn!(graph = %self.graph, fire, error = %e, "fire failed after its retries; dead-lettering its inputs");
                self.stats.fire_failed();
                let mut body = fire_identity(&input);
                body.insert("error".into(), Value::String(e.to_string()));
                body.insert("inputs".into(), input.inputs_json());
                let (topic, _) = Target::FireDeadLetter.resolve(&publishing.outputs);
                let letter = Outbound::new(
                    topic.into_owned(),
                    crate::codec::json::encode(&Value::Object(body)),
                )
                .header(crate::wire::ERROR_HEADER, e.to_string());
                self.stats.dead_lettered();
                smallvec::smallvec![(
                    Target::FireDeadLetter,
                    publishing.stamp.apply(letter, fire, degraded)
                )]
            }
        };
        let report = FireReport {
            fire,
            outputs: messages.len(),
        };
        // Handed to the sinks here, one after the other, and only the acknowledgements
        // awaited in flight: a fire's outputs then leave in fire order. Handed over from
        // futures polled together, they would not: once the task's cooperative budget
        // is spent, tokio wakes the futures it deferred last first, and a burst of
        // outputs would reach the broker reversed.
        let mut handed: SmallVec<[(Target, PendingAck); 1]> = SmallVec::new();
        let publishing = self.publishing.clone();
        for (target, message) in messages {
            // The sink's own hand-over is awaited here, not wrapped in a future of ours:
            // moved into the wait below, a larger one would be copied for every output.
            let handing = match publishing.sink_for(target) {
                Ok(sink) => self.acknowledging_while(sink.enqueue(message)).await,
                Err(e) => Err(e),
            };
            let handing = match handing {
                Err(e) if !e.is_retryable() => {
                    let refused = publishing.refused(target, fire, degraded, &input, e);
                    self.acknowledging_while(refused).await
                }
                handing => handing,
            };
            match handing {
                Ok(Some(ack)) => handed.push((target, ack)),
                // Stopping while the broker holds the hand-over back: as for a fire given
                // up on, its inputs go back to the stored cache unconsumed, and no fire
                // starts after it.
                Ok(None) => {
                    self.abandoned.push(consumed);
                    self.fire_given_up = true;
                    return Ok(FireReport { fire, outputs: 0 });
                }
                Err(e) => {
                    // Requeued in the snapshot the failing reactor stores.
                    self.unacknowledged.push_back(consumed);
                    return Err(e.into());
                }
            }
        }
        // A sink that published before returning (as in process) has nothing left to
        // await: no future is made for the fire's acknowledgements.
        if self.in_flight.is_empty() && handed.iter().all(|(_, ack)| ack.is_taken()) {
            publishing.stats.published(handed.len());
            return Ok(report);
        }
        let mut publish: BoxFuture<'static, Result<(), TransportError>> = Box::pin(async move {
            let count = handed.len();
            for (target, ack) in handed {
                match ack.await {
                    Ok(_) => {}
                    // Refused for good once sent (larger than the stream takes, say):
                    // what identifies the fire goes to the dead-letter topic instead.
                    Err(e) if !e.is_retryable() => {
                        let (topic, sink) = target.resolve(&publishing.outputs);
                        warn!(%topic, fire, error = %e, "output cannot be published; dead-lettering it");
                        let letter =
                            undeliverable_output(&publishing, &input, &topic, fire, degraded, &e);
                        sink.publish(letter).await?;
                        publishing.stats.dead_lettered();
                    }
                    Err(e) => return Err(e),
                }
            }
            publishing.stats.published(count);
            Ok(())
        });
        if self.in_flight.is_empty() {
            // Most sinks acknowledge quickly; skip the queue when this one already has.
            if let Poll::Ready(done) = futures::poll!(&mut publish) {
                if let Err(e) = done {
                    // Requeued in the snapshot the failing reactor stores.
                    self.unacknowledged.push_back(consumed);
                    return Err(e.into());
                }
                return Ok(report);
            }
        }
        self.in_flight.push_back(publish);
        self.unacknowledged.push_back(consumed);
        Ok(report)
    }

    /// Awaits a hand-over while taking in the acknowledgements of earlier fires still in
    /// flight: a client may hold a hand-over back until acknowledgements it has sent are
    /// awaited (async-nats counts them until then), and those are in flight here. `None`
    /// if the reactor is stopped first: a broker client holding the hand-over back (its
    /// server away) must not hold the stop up.
    async fn acknowledging_while(
        &mut self,
        handing: impl std::future::Future<Output = Result<PendingAck, TransportError>>,
    ) -> Result<Option<PendingAck>, TransportError> {
        tokio::pin!(handing);
        // Most sinks take a message at once: then there is nothing to wait beside, and
        // no copy of the shutdown token to make (each copy takes the token's lock).
        if let Poll::Ready(handed) = futures::poll!(&mut handing) {
            return handed.map(Some);
        }
        let cancel = self.cancel.clone();
        loop {
            tokio::select! {
                biased;
                handed = &mut handing => return handed.map(Some),
                Some(done) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    done?;
                    self.acknowledged();
                }
                _ = cancel.cancelled() => return Ok(None),
            }
        }
    }

    /// The number of a fire taking `taken`: a restored fire made again from its requeued
    /// inputs keeps its own, the rest count on. Should the queues no longer give the
    /// fires back as they were (a source that was empty then has an input now), the
    /// numbers left are dropped rather than put on other inputs.
    fn number(&mut self, taken: &Taken, reason: FireReason) -> u64 {
        if reason != FireReason::FireWith {
            let names = self.cache.names();
            let again = self.refires.front().is_some_and(|refire| {
                refire.sources.len() == taken.len()
                    && taken
                        .iter()
                        .zip(&refire.sources)
                        .all(|(&i, name)| *names[i] == **name)
            });
            match self.refires.pop_front() {
                Some(refire) if again => return refire.fire,
                Some(_) => self.refires.clear(),
                None => {}
            }
        }
        self.fires += 1;
        self.fires
    }

    /// The oldest in-flight fire's outputs are acknowledged. Its inputs become durable
    /// only with the next stored snapshot, which counts the fire: were they committed
    /// before, a crash would restore an older count, and later fires would take numbers
    /// consumers already saw on other outputs.
    fn acknowledged(&mut self) {
        self.unacknowledged.pop_front();
        // The last snapshot may hold the fire as requeued: until one counts it as done,
        // a restart would make it again.
        self.snapshot_pending = true;
    }

    /// Tells accumulators what became durable and which queue slots are free.
    fn publish_progress(&mut self) {
        for (i, pending) in self.durable_pending.iter().enumerate() {
            // Told only when it moved: sending takes the channel's lock.
            if *pending > self.durable_told[i] {
                self.durable_told[i] = *pending;
                self.durable[i].send_replace(*pending);
            }
        }
        for (i, freed) in self.permits_pending.iter_mut().enumerate() {
            if *freed > 0 {
                if let Some(p) = &self.permits[i] {
                    p.add_permits(*freed);
                }
                *freed = 0;
            }
        }
    }

    /// Once per loop turn, not per boundary: a gauge needs only the current depth.
    fn report_queues(&self) {
        for i in 0..self.cache.names().len() {
            self.stats.queue_depth(i, self.cache.queued(i));
        }
    }

    /// Hands a snapshot of the cache to the store's writer.
    fn snapshot(&mut self) {
        self.snapshot_counting(self.fires);
    }

    /// Before a command's fire, which takes no input to make it again: a snapshot counting
    /// the fire is stored first, so that a crash once its outputs are out cannot give its
    /// number to another fire, as the replayed inputs of a criteria fire would. False if
    /// the store did not take it in time; the command then fires nothing (a count stored
    /// later only leaves a number unused).
    async fn store_command_count(&mut self) -> bool {
        self.snapshot_counting(self.fires + 1);
        let stored = self.snapshots.flush(COMMAND_COUNT_WAIT).await;
        if stored {
            self.snapshot_stored(self.snapshots.written());
        }
        stored
    }

    /// A snapshot of the cache with `fires` as its count of fires made.
    fn snapshot_counting(&mut self, fires: u64) {
        let requeued = || self.unacknowledged.iter().chain(self.abandoned.iter());
        let mut snapshot = self.cache.snapshot(fires, requeued());
        snapshot.paused = self.paused;
        if self.config.strategy == Strategy::Sequential {
            // In the order the queues now hold their inputs: the requeued ones first,
            // then those restored and not fired again yet. A fire that took nothing (a
            // command's) puts nothing back in the queues, so nothing makes it again: listed,
            // it would stand between the fires after it and their numbers.
            snapshot.refires = requeued()
                .map(Consumed::refire)
                .filter(|refire| !refire.sources.is_empty())
                .chain(self.refires.iter().cloned())
                .collect();
        }
        self.last_snapshot = Instant::now();
        self.snapshot_pending = false;
        self.unsnapshotted = 0;
        let received = (0..self.cache.names().len())
            .map(|i| self.cache.received(i))
            .collect();
        let version = self.snapshots.submit(snapshot);
        match self.unstored.back_mut() {
            // The last snapshot will not be stored on its own, and this one holds all
            // it held: through a store outage the list stays as short as the writer's
            // attempts, not one entry per snapshot.
            Some(last) if self.snapshots.replaced(last.0) => *last = (version, received),
            _ => self.unstored.push_back((version, received)),
        }
    }

    /// Snapshots up to `version` are stored: everything they hold is either in the
    /// stored cache or re-queued there, so the accumulators may commit it.
    fn snapshot_stored(&mut self, version: u64) {
        while self.unstored.front().is_some_and(|(v, _)| *v <= version) {
            let Some((_, received)) = self.unstored.pop_front() else {
                break;
            };
            for (d, r) in self.durable_pending.iter_mut().zip(received) {
                *d = (*d).max(r);
            }
            self.stats.snapshot_written();
        }
    }

    fn count_not_stored(&self) -> CommandError {
        CommandError::CountNotStored {
            graph: self.graph.to_string(),
            waited: COMMAND_COUNT_WAIT,
        }
    }

    async fn command(&mut self, command: Command) -> Result<(), ReactorError> {
        match command {
            Command::ForceFire(reply) => {
                if !self.store_command_count().await {
                    let _ = reply.send(Err(self.count_not_stored()));
                    return Ok(());
                }
                let (values, taken) = self.cache.take();
                let report = self.fire(values, taken, FireReason::Force).await?;
                let _ = reply.send(Ok(report));
            }
            Command::FireWith(values, reply) => {
                let names = self.cache.names().clone();
                let mut injected = Vec::with_capacity(values.len());
                for (name, value) in values {
                    match names.iter().position(|n| **n == *name) {
                        Some(i) => injected.push((i, value)),
                        None => {
                            let _ = reply.send(Err(CommandError::UnknownSource {
                                graph: self.graph.to_string(),
                                source_name: name,
                            }));
                            return Ok(());
                        }
                    }
                }
                if !self.store_command_count().await {
                    let _ = reply.send(Err(self.count_not_stored()));
                    return Ok(());
                }
                let now = now_ms();
                for (i, value) in injected {
                    let boundary = Boundary {
                        source: names[i].clone(),
                        sequence: 0,
                        positions: Positions::new(),
                        event_time_ms: now,
                        emit_time_ms: now,
                        value,
                    };
                    self.cache.inject(i, boundary);
                }
                let values = self.cache.values();
                let report = self
                    .fire(values, Taken::new(), FireReason::FireWith)
                    .await?;
                let _ = reply.send(Ok(report));
            }
            Command::GetState(reply) => {
                let _ = reply.send(Ok(self.status()));
            }
            Command::Pause(reply) => {
                self.paused = true;
                // Stored with the cache, so a respawn or a failover keeps the graph paused.
                self.snapshot();
                let _ = reply.send(Ok(()));
            }
            Command::Resume(reply) => {
                self.paused = false;
                self.snapshot();
                let _ = reply.send(Ok(()));
            }
        }
        Ok(())
    }

    fn status(&self) -> ReactorStatus {
        let values = self.cache.values();
        let sources: BTreeMap<String, SourceStatus> = self
            .cache
            .names()
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let status = SourceStatus {
                    dirty: self.cache.dirty(i),
                    health: self.health[i],
                    last_sequence: self.cache.received(i),
                    seen: self.cache.seen(i),
                    queued: self.cache.queued(i),
                    value: values[i].as_ref().map(|b| b.value.clone()),
                };
                (name.to_string(), status)
            })
            .collect();
        ReactorStatus {
            graph: self.graph.to_string(),
            state: self.state,
            paused: self.paused,
            fires: self.fires,
            sources,
        }
    }
}

/// Where one of a fire's messages goes.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// An output binding, by index.
    Output(usize),
    /// The first output's dead-letter topic, for a fire that failed after its retries.
    FireDeadLetter,
}

impl Target {
    /// The message's topic and the sink taking it.
    fn resolve(self, outputs: &[(TopicName, Arc<dyn Sink>)]) -> (Cow<'_, str>, &Arc<dyn Sink>) {
        match self {
            Self::Output(i) => (Cow::Borrowed(outputs[i].0.as_str()), &outputs[i].1),
            Self::FireDeadLetter => (
                Cow::Owned(crate::wire::dead_letter_topic(&outputs[0].0)),
                &outputs[0].1,
            ),
        }
    }
}

/// What publishing a fire's outputs takes besides the fire: one shared bundle, so an
/// in-flight fire holds one reference rather than a copy of the lease and the stamp.
struct Publishing {
    stamp: Stamp,
    /// The graph's lease: nothing is published once its deadline passed.
    lease: Option<crate::lease::Held>,
    /// Per output binding: its topic and the sink taking it.
    outputs: Arc<[(TopicName, Arc<dyn Sink>)]>,
    stats: Arc<GraphStats>,
}

impl Publishing {
    /// The sink taking one of a fire's messages. Past the lease's deadline another node
    /// may run the graph: this one publishes nothing more.
    fn sink_for(&self, target: Target) -> Result<&Arc<dyn Sink>, TransportError> {
        let (topic, sink) = target.resolve(&self.outputs);
        if self
            .lease
            .as_ref()
            .is_some_and(|held| held.deadline.passed())
        {
            return Err(TransportError::Publish {
                topic: topic.into_owned(),
                source: "the graph's lease deadline passed".into(),
                retryable: true,
            });
        }
        Ok(sink)
    }

    /// In place of a message of the fire that the broker refused for good before
    /// sending (larger than it takes, say): what identifies the fire, on the output's
    /// dead-letter topic, so one bad output cannot wedge the graph.
    async fn refused(
        &self,
        target: Target,
        fire: u64,
        degraded: bool,
        input: &FireInput,
        error: TransportError,
    ) -> Result<PendingAck, TransportError> {
        let (topic, sink) = target.resolve(&self.outputs);
        warn!(%topic, fire, %error, "output cannot be published; dead-lettering it");
        let letter = undeliverable_output(self, input, &topic, fire, degraded, &error);
        let ack = sink.enqueue(letter).await?;
        let stats = self.stats.clone();
        Ok(PendingAck::awaited(async move {
            let position = ack.await?;
            stats.dead_lettered();
            Ok(position)
        }))
    }
}

/// The key and headers every message of a graph's fire carries: the graph's name as key
/// (one graph's outputs stay in one partition, in fire order), the graph, the fire
/// number, whether the reactor was degraded, and the lease's fencing token, so consumers
/// can drop what a deposed instance published.
#[derive(Debug)]
struct Stamp {
    key: bytes::Bytes,
    graph: HeaderValue,
    fencing: Option<HeaderValue>,
}

impl Stamp {
    fn apply(&self, mut message: Outbound, fire: u64, degraded: bool) -> Outbound {
        message.key = Some(self.key.clone());
        message
            .headers
            .reserve_exact(3 + usize::from(self.fencing.is_some()));
        let mut number = itoa::Buffer::new();
        message.headers.extend([
            (crate::wire::GRAPH_HEADER.into(), self.graph.clone()),
            (
                crate::wire::FIRE_HEADER.into(),
                HeaderValue::new(number.format(fire)),
            ),
            (
                crate::wire::DEGRADED_HEADER.into(),
                HeaderValue::new_static(if degraded { "true" } else { "false" }),
            ),
        ]);
        if let Some(token) = &self.fencing {
            message
                .headers
                .push((crate::wire::FENCING_HEADER.into(), token.clone()));
        }
        message
    }
}

/// The dead letter standing for an output `topic` refused for good: what identifies the
/// fire, the topic and the broker's error.
fn undeliverable_output(
    publishing: &Publishing,
    input: &FireInput,
    topic: &str,
    fire: u64,
    degraded: bool,
    error: &TransportError,
) -> Outbound {
    let mut body = fire_identity(input);
    body.insert("topic".into(), Value::String(topic.to_string()));
    body.insert("error".into(), Value::String(error.to_string()));
    let letter = Outbound::new(
        crate::wire::dead_letter_topic(topic),
        crate::codec::json::encode(&Value::Object(body)),
    )
    .header(crate::wire::ERROR_HEADER, error.to_string());
    publishing.stamp.apply(letter, fire, degraded)
}

/// What identifies a fire in a dead letter: the graph, the fire number and, per source,
/// the positions of the input the fire saw.
pub(crate) fn fire_identity(input: &FireInput) -> serde_json::Map<String, Value> {
    let positions: serde_json::Map<String, Value> = input
        .names
        .iter()
        .zip(&input.values)
        .map(|(name, boundary)| {
            let positions = boundary
                .as_ref()
                .map(|b| serde_json::to_value(&b.positions).unwrap_or(Value::Null))
                .unwrap_or(Value::Null);
            (name.to_string(), positions)
        })
        .collect();
    let mut identity = serde_json::Map::new();
    identity.insert("graph".into(), Value::String(input.graph.to_string()));
    identity.insert("fire".into(), Value::from(input.fire));
    identity.insert("positions".into(), Value::Object(positions));
    identity
}

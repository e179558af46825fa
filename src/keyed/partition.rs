//! The run loop of one owned partition of a keyed graph: every source's partition read
//! in one loop, each event fired through its key's input cache, and the keys' state
//! written with the sources' positions once the batch's outputs are acknowledged.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use hashbrown::hash_map::{EntryRef, HashMap};
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::store::{KeySlot, KeyedChanges, KeyedStore};
use super::KeyedTopics;
use crate::accumulator::Boundary;
use crate::codec::CodecError;
use crate::graph::dag::FireOutputs;
use crate::graph::{FireInput, FireValues, GraphDeclaration, Key, Keying};
use crate::lease::Held;
use crate::ownership::{PartitionError, PartitionWork, StoreRetry};
use crate::reactor::cache::{InputCache, Inserted};
use crate::store_error::{StoreError, StoreErrorKind};
use crate::transport::{
    now_ms, publish_dead_letter, Broker, HeaderValue, Message, Outbound, PendingAck, Position,
    Sink, Source, TopicName, TransportError,
};
use crate::wire;

/// Events applied before their batch is written, at most.
const MAX_BATCH: usize = 1024;
/// How long an applied event may wait for its batch to be written.
const LINGER: Duration = Duration::from_millis(5);
/// Events a source already holds, applied in one turn of the run loop, at most.
const BURST: usize = 64;
/// How often a partition whose graph expires idle keys looks for them.
const IDLE_SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Idle keys removed in one write, at most.
const IDLE_KEYS_PER_PAGE: usize = 1000;
/// Pages of idle keys removed in one look, at most: the partition reads nothing
/// meanwhile.
const IDLE_PAGES_PER_SWEEP: usize = 10;
/// Idle keys whose dead letters are out at once: a page may carry a letter for each of
/// its keys, and one round trip after another would hold the partition's events up for
/// seconds.
const IDLE_LETTERS_IN_FLIGHT: usize = 64;
/// The time idle keys are measured against: the least advanced source's latest event
/// time (ms), 0 until every source has handed over an event in this run. A source
/// working off a backlog holds it back, so a key whose events it has not reached yet is
/// not taken for idle because another source is ahead.
fn idle_clock(latest_ms: &[i64]) -> i64 {
    latest_ms.iter().copied().min().unwrap_or(0)
}

/// Runs the owned partitions of one keyed graph.
pub(crate) struct KeyedPartitions {
    decl: GraphDeclaration,
    graph: Arc<str>,
    /// The ownership group of the graph's partitions.
    group: String,
    /// The graph's name as every output's header carries it.
    graph_header: HeaderValue,
    keying: Keying,
    topics: KeyedTopics,
    names: Arc<[Arc<str>]>,
    /// Per source: its dead-letter topic.
    dead_letters: Vec<String>,
    /// Per output binding: the topic, qualified for the tenant.
    outputs: Vec<TopicName>,
    /// Per source: the consumer group it reads under.
    groups: Vec<String>,
    broker: Arc<dyn Broker>,
    sink: Arc<dyn Sink>,
    store: Arc<dyn KeyedStore>,
    /// Whether the graph is paused, as this node last read it from the store.
    paused: watch::Receiver<bool>,
}

impl KeyedPartitions {
    pub(crate) fn new(
        decl: GraphDeclaration,
        keying: Keying,
        topics: KeyedTopics,
        broker: Arc<dyn Broker>,
        store: Arc<dyn KeyedStore>,
        paused: watch::Receiver<bool>,
    ) -> Self {
        let names: Arc<[Arc<str>]> = decl
            .accumulators
            .iter()
            .map(|a| Arc::from(a.name()))
            .collect();
        let dead_letters = decl
            .accumulators
            .iter()
            .zip(&topics.sources)
            .map(|(a, t)| match &a.dead_letter {
                Some(topic) => decl.qualify_topic(topic),
                None => wire::dead_letter_topic(&t.topic),
            })
            .collect();
        let outputs = decl
            .outputs
            .iter()
            .map(|o| TopicName::from(decl.qualify_topic(&o.topic)))
            .collect();
        Self {
            graph: Arc::from(decl.key()),
            group: super::ownership_group(&decl.key()),
            graph_header: HeaderValue::new(decl.key()),
            groups: (0..decl.accumulators.len())
                .map(|index| decl.source_group(index))
                .collect(),
            sink: broker.sink(),
            names,
            dead_letters,
            outputs,
            keying,
            topics,
            decl,
            broker,
            store,
            paused,
        }
    }
}

#[async_trait]
impl PartitionWork for KeyedPartitions {
    async fn run(
        &self,
        partition: i32,
        held: Held,
        release: CancellationToken,
        lost: CancellationToken,
    ) {
        let held = &held;
        let (releasing, losing) = (&release, &lost);
        crate::ownership::serve_partition(
            &self.group,
            partition,
            &release,
            &lost,
            |stopping, _first| async move {
                let mut serving = Serving::start(self, partition, held, &stopping, losing).await?;
                serving.serve(releasing, losing).await
            },
        )
        .await;
    }
}

/// One key's reactor state in memory.
struct KeyState {
    cache: InputCache,
    fires: u64,
    /// When the key was last used, in events of this partition.
    used: u64,
    /// The key's time (ms), written with it where idle keys expire: its source's latest
    /// event time when the key last changed (the node's clock for a message without a
    /// time), so that events out of time order within a source cannot make it look idle.
    touched_ms: i64,
    /// The number of the batch that last listed the key, and where in its list.
    listed_in: u64,
    listed_at: usize,
    /// Where the store keeps the key, if it hands out slots.
    slot: Option<KeySlot>,
}

struct Serving<'a> {
    graph: &'a KeyedPartitions,
    partition: i32,
    held: &'a Held,
    /// Cancelled on release or loss: ends a publish retried while the broker is away.
    stopping: CancellationToken,
    /// Cancelled on loss only: ends the wait to run a failed fire again, or to make a
    /// failed store call again, which a release lets finish, so that the hand-over writes
    /// what the partition applied.
    lost: CancellationToken,
    /// The source read first next time: each in turn, so none starves the others.
    first_source: usize,
    fencing: HeaderValue,
    sources: Vec<Box<dyn Source>>,
    /// Per source: the last position applied.
    positions: Vec<Option<i64>>,
    /// Keys come from events: a seeded hash, and a fast one, since every event hashes
    /// its key.
    keys: HashMap<Key, KeyState, foldhash::fast::RandomState>,
    /// Whether the store may hold keys not in memory: not for a partition that never
    /// wrote a batch (it has no positions stored) until a key leaves memory.
    stored_keys: bool,
    events: u64,
    /// Per source: the latest broker time (ms) of an event applied from it, for the
    /// clock idle keys expire by.
    latest_ms: Vec<i64>,
    /// Where a key met afresh starts numbering its fires: raised to the high only when
    /// idle keys are removed, which is done right after a batch is written and before
    /// anything more is applied, so a run carried on from the stored positions after a
    /// crash numbers the keys it meets afresh as the run before did.
    fire_floor: u64,
    /// The highest fire number of any key the partition has in memory or has had,
    /// written with each batch where idle keys expire.
    fire_high: u64,
    /// Whether this run wrote a batch yet: the first, where idle keys do not expire,
    /// drops the times kept for expiry.
    wrote: bool,
    batch: Batch,
    /// The batch's write, gathered as it is applied: each key changed since the last
    /// write, listed once with the store's slot for it and the state it had when first
    /// listed. Most keys change once per batch, and the write then takes them as they
    /// are, with no look-up, and no copy of a list of a thousand states from the batch
    /// into the write, each copy a wait on memory the size of the list.
    changes: KeyedChanges,
    /// The number of the batch being gathered, from 1.
    batch_number: u64,
    /// When the burst being applied was read: its events' emit time. One clock reading
    /// per burst, since its events are read a moment apart.
    burst_ms: i64,
    /// The events of the burst being applied, decoded; kept for its capacity.
    burst: Vec<(Message, Result<Value, CodecError>)>,
    /// Idle keys kept because a dead letter of theirs was refused for good: how many of
    /// each one's letters went out before it, so that the next look sends only the rest.
    /// A key's entry goes as the key changes (its letters are then made afresh).
    idle_letters_sent: HashMap<Key, usize, foldhash::fast::RandomState>,
    /// The graph is paused: the sources are not read.
    paused: bool,
    /// Pauses and resumes, as the node reads them from the store, after the flag read
    /// at the start.
    pause_changes: watch::Receiver<bool>,
}

/// An output handed to the broker, awaiting its acknowledgement: enough to make it
/// again, should the broker refuse it for good.
struct Sent {
    output: usize,
    key: Key,
    fire: u64,
}

#[derive(Default)]
struct Batch {
    /// Where in the write's list of keys ([`Serving::changes`]) a key stands that
    /// changed again after it was listed: its state is taken afresh when the batch is
    /// written, so a key changed often takes one snapshot per batch, not one per event.
    /// A key changed many times is here as often; repeats are dropped at the write.
    retake: Vec<usize>,
    /// Outputs whose acknowledgement is still to come.
    acks: Vec<(PendingAck, Sent)>,
    /// Per source: the broker position to commit once written.
    commit: BTreeMap<usize, Position>,
    applied: usize,
    since: Option<Instant>,
}

impl<'a> Serving<'a> {
    async fn start(
        graph: &'a KeyedPartitions,
        partition: i32,
        held: &'a Held,
        stopping: &CancellationToken,
        lost: &CancellationToken,
    ) -> Result<Serving<'a>, PartitionError> {
        let stored = graph.store.load_positions(&graph.graph, partition).await?;
        let mut sources = Vec::with_capacity(graph.names.len());
        let mut positions = Vec::with_capacity(graph.names.len());
        let sources_of = graph.names.iter().zip(&graph.topics.sources);
        for ((name, topic), group) in sources_of.zip(&graph.groups) {
            let position = stored.get(&**name).copied();
            let subscription = topic
                .subscription(partition, group, position)
                .fenced(held.lease.token);
            sources.push(graph.broker.subscribe(&subscription).await?);
            positions.push(position);
        }
        // After a clean hand-over by the previous owner (the one token before ours): how
        // long the partition waited.
        if let Some((token, at_ms)) = graph.store.load_released(&graph.graph, partition).await? {
            if token + 1 == held.lease.token {
                let waited = Duration::from_millis((now_ms() - at_ms).max(0) as u64);
                crate::metrics::partition_resumed(&graph.group, waited);
            }
        }
        let fires = graph
            .store
            .load_fire_numbers(&graph.graph, partition)
            .await?;
        // The flag as the store has it now, rather than as the node last read it: a
        // partition taken over from a node that saw the pause is paused from its start.
        let mut pause_changes = graph.paused.clone();
        pause_changes.borrow_and_update();
        let paused = graph.store.load_paused(&graph.graph).await?;
        info!(graph = %graph.graph, partition, ?positions, paused, "keyed partition resumed");
        Ok(Serving {
            graph,
            partition,
            held,
            stopping: stopping.clone(),
            lost: lost.clone(),
            first_source: 0,
            fencing: HeaderValue::new(held.lease.token.to_string()),
            sources,
            positions,
            keys: HashMap::default(),
            stored_keys: !stored.is_empty(),
            events: 0,
            latest_ms: vec![0; graph.names.len()],
            fire_floor: fires.floor,
            fire_high: fires.high.max(fires.floor),
            wrote: false,
            batch: Batch::default(),
            changes: KeyedChanges::default(),
            batch_number: 1,
            burst_ms: 0,
            burst: Vec::with_capacity(BURST),
            idle_letters_sent: HashMap::default(),
            paused,
            pause_changes,
        })
    }

    async fn serve(
        &mut self,
        release: &CancellationToken,
        lost: &CancellationToken,
    ) -> Result<(), PartitionError> {
        let lost_token = lost;
        // Made once and polled again each turn: a new timer or token wait per event
        // would cost more than the event. The waits on tokens and on pauses are polled
        // only once woken: each poll of a waiting one takes its notifier's lock.
        let mut lost = crate::woken::woken(lost.cancelled());
        let mut release = crate::woken::woken(release.cancelled());
        let flush_timer = tokio::time::sleep(LINGER);
        tokio::pin!(flush_timer);
        let mut timer_armed = false;
        let mut pause_changes =
            crate::woken::woken(crate::write_behind::changes(self.pause_changes.clone()));
        let key_idle = self.graph.keying.key_idle;
        let mut idle_sweep = tokio::time::interval(IDLE_SWEEP_EVERY);
        idle_sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if let (Some(since), false) = (self.batch.since, timer_armed) {
                flush_timer.as_mut().reset(since + LINGER);
                timer_armed = true;
            }
            tokio::select! {
                biased;
                _ = &mut lost => return Ok(()),
                _ = &mut release => {
                    self.flush(true).await?;
                    return Ok(());
                }
                _ = &mut flush_timer, if timer_armed => {
                    timer_armed = false;
                    self.flush(false).await?;
                }
                // A paused partition removes nothing: its clock stands still as well.
                _ = idle_sweep.tick(), if key_idle.is_some() && !self.paused => {
                    if let Some(idle) = key_idle {
                        timer_armed = false;
                        self.flush(false).await?;
                        self.expire_idle(idle).await?;
                    }
                }
                Some(paused) = pause_changes.next() => {
                    // What was applied is still written on the flush timer: a pause leaves
                    // nothing half done.
                    if paused && !self.paused {
                        info!(graph = %self.graph.graph, partition = self.partition, "keyed partition paused: nothing is read until the graph is resumed");
                    } else if !paused && self.paused {
                        info!(graph = %self.graph.graph, partition = self.partition, "keyed partition reading again");
                    }
                    self.paused = paused;
                }
                read = next_unless_paused(&mut self.sources, self.first_source, self.paused) => {
                    // Paused: a source held (fetching stopped) or told of an error.
                    let Some((source, message)) = read else { continue };
                    self.first_source = (source + 1) % self.sources.len();
                    self.burst_ms = now_ms();
                    let read = self.read_burst(source, message?);
                    let mut burst = std::mem::take(&mut self.burst);
                    self.warm_keys(&burst);
                    for (message, value) in burst.drain(..) {
                        // A lease found taken over ends the burst: nothing more is
                        // published under its token, and what is left of the burst is
                        // read again by the next owner. The token is asked (under its
                        // lock) only once its wait woke.
                        if lost.may_be_ready() && lost_token.is_cancelled() {
                            break;
                        }
                        self.apply(source, message, value).await?;
                        // Events of several outputs can fill the batch's outputs
                        // before the burst ends: written then, not once it does.
                        if self.batch_full() {
                            timer_armed = false;
                            self.flush(false).await?;
                        }
                    }
                    self.burst = burst;
                    read?;
                }
            }
        }
    }

    /// Takes what the source already holds after `first`, decoded, into the burst: the
    /// events are then applied without another turn of the select, which costs about as
    /// much as an event; in bursts, so loss, release and the timer are still looked at
    /// between them. With several sources each is read in turn, event by event, so none
    /// runs ahead of the others while they all have a backlog. An error reading the
    /// source is returned once the events read before it are applied.
    fn read_burst(&mut self, source: usize, first: Message) -> Result<(), TransportError> {
        let format = &self.graph.decl.accumulators[source].format;
        let room = MAX_BATCH.saturating_sub(self.batch.applied.max(self.batch.acks.len()));
        let limit = if self.sources.len() == 1 {
            room.clamp(1, BURST)
        } else {
            1
        };
        let applied = self.positions[source];
        // A repeat (read again after a restart) is skipped before its value is looked
        // at: not decoded.
        let decode = |message: &Message| match applied {
            Some(at) if message.position.offset <= at => Ok(Value::Null),
            _ => format.decode(&message.payload),
        };
        let value = decode(&first);
        self.burst.push((first, value));
        while self.burst.len() < limit {
            match self.sources[source].ready() {
                Some(Ok(message)) => {
                    let value = decode(&message);
                    self.burst.push((message, value));
                }
                Some(Err(e)) => return Err(e),
                // Nothing at hand, or the read would yield the thread.
                None => break,
            }
        }
        Ok(())
    }

    /// Looks up the burst's keys before any of them is applied. A partition's keys
    /// spread over far more memory than the cache holds, so each look-up mostly waits on
    /// memory: made in a row, independent of each other, their waits overlap, and the
    /// applies after them find their keys cached.
    fn warm_keys(&self, burst: &[(Message, Result<Value, CodecError>)]) {
        if burst.len() < 2 {
            return;
        }
        for (message, value) in burst {
            let Ok(value) = value else { continue };
            if let Some(key) = super::key_of(&self.graph.keying.key, message.key.as_deref(), value)
            {
                if let Some(state) = self.keys.get(&*key) {
                    std::hint::black_box((state.used, state.listed_in));
                    state.cache.warm();
                }
            }
        }
    }

    fn batch_full(&self) -> bool {
        self.batch.applied >= MAX_BATCH || self.batch.acks.len() >= MAX_BATCH
    }

    /// The key's state, from memory or the store, with the key as the map holds it:
    /// one hash and one probe per event for a key in memory. The inner error: the key's
    /// stored state does not read back (written by another version, say), which holds
    /// up that key alone.
    async fn key_state(
        &mut self,
        key: &str,
    ) -> Result<Result<(Key, &mut KeyState), StoreError>, PartitionError> {
        self.events += 1;
        let graph = self.graph;
        let state = match self.keys.entry_ref(key) {
            EntryRef::Occupied(entry) => (entry.key().clone(), entry.into_mut()),
            EntryRef::Vacant(entry) => {
                let stored = if self.stored_keys {
                    // Mid-batch: a store away for a moment is waited for, as for the
                    // batch's write.
                    let (graph, partition, wanted) = (&self.graph, self.partition, [key.into()]);
                    let mut retry = StoreRetry::new(
                        &graph.group,
                        partition,
                        graph.keying.lease_ttl,
                        &self.lost,
                    );
                    loop {
                        self.held.check_deadline()?;
                        match graph
                            .store
                            .load_keys(&graph.graph, partition, &wanted)
                            .await
                        {
                            Ok(loaded) => break loaded.into_iter().next().flatten(),
                            Err(e) if e.kind() == StoreErrorKind::Corrupt => return Ok(Err(e)),
                            Err(e) => retry.after(e).await?,
                        }
                    }
                } else {
                    None
                };
                let mut cache =
                    InputCache::new(self.graph.names.clone(), self.graph.decl.reactor.strategy);
                let fires = match &stored {
                    Some(snapshot) => {
                        cache.restore(snapshot);
                        snapshot.fires
                    }
                    None => self.fire_floor,
                };
                self.fire_high = self.fire_high.max(fires);
                let entry = entry.insert_entry(KeyState {
                    cache,
                    fires,
                    used: 0,
                    touched_ms: 0,
                    listed_in: 0,
                    listed_at: 0,
                    slot: None,
                });
                let key = entry.key().clone();
                let state = entry.into_mut();
                state.slot = graph.store.key_slot(&graph.graph, self.partition, &key);
                (key, state)
            }
        };
        state.1.used = self.events;
        Ok(Ok(state))
    }

    async fn apply(
        &mut self,
        source: usize,
        message: Message,
        value: Result<Value, CodecError>,
    ) -> Result<(), PartitionError> {
        let offset = message.position.offset;
        self.batch.commit.insert(source, message.position);
        self.batch.since.get_or_insert_with(Instant::now);
        if self.positions[source].is_some_and(|p| offset <= p) {
            return Ok(());
        }
        self.positions[source] = Some(offset);
        self.batch.applied += 1;
        // A time ahead of this node's clock (a producer's clock, on Kafka) counts as now,
        // so one message cannot expire every other key at once. A message without a time
        // keeps its key alive and moves no clock.
        let at_ms = match message.timestamp_ms {
            t if t > 0 => {
                let latest = &mut self.latest_ms[source];
                *latest = (*latest).max(t.min(self.burst_ms));
                *latest
            }
            _ => self.burst_ms,
        };
        let value = match value {
            Ok(value) => value,
            Err(e) => return self.dead_letter(source, &message, &e.to_string()).await,
        };
        let Some(key) = super::key_of(&self.graph.keying.key, message.key.as_deref(), &value)
        else {
            let reason = match &self.graph.keying.key {
                crate::graph::KeySource::MessageKey => "the message has no key".to_string(),
                crate::graph::KeySource::Pointer(p) => format!("the event has no key at {p}"),
            };
            return self.dead_letter(source, &message, &reason).await;
        };
        if let Some(reason) = self.graph.topics.sources[source].misplaced(&key, self.partition) {
            return self
                .dead_letter(source, &message, &format!("key {reason}"))
                .await;
        }
        let source_name = self.graph.names[source].clone();
        let partition = self.partition;
        let criteria = self.graph.decl.reactor.criteria;
        let (batch_number, next_listed) = (self.batch_number, self.changes.keys.len());
        let emit_time_ms = self.burst_ms;
        let capacity = self.graph.decl.reactor.queue_capacity;
        // A key kept after idling, some of its inputs dead-lettered then: those are
        // recorded already, and no fire takes them now that the key has an event.
        let lettered = if self.idle_letters_sent.is_empty() {
            0
        } else {
            self.idle_letters_sent.remove(&*key).unwrap_or(0)
        };
        let (key, state) = match self.key_state(&key).await? {
            Ok(found) => found,
            // Its events go to the dead-letter topic, the partition's other keys on, and
            // the stored state stays as it is for an operator to look at.
            Err(unreadable) => {
                let reason = format!(
                    "the stored state of key {} cannot be read: {unreadable}",
                    crate::transport::quoted_key(&key)
                );
                if lettered > 0 {
                    self.idle_letters_sent.insert(Key::from(&*key), lettered);
                }
                return self.dead_letter(source, &message, &reason).await;
            }
        };
        if lettered > 0 {
            state.cache.drop_unfired(lettered);
        }
        let boundary = Boundary {
            source: source_name,
            sequence: 0,
            positions: smallvec::smallvec![Position { partition, offset }],
            event_time_ms: message.timestamp_ms,
            emit_time_ms,
            value,
        };
        // A key whose queue is full (its other sources have not sent it) cannot hold the
        // partition up, nor grow without bound: the event goes to the dead-letter topic.
        if state.cache.queued(source) >= capacity && !state.cache.is_repeat(source, &boundary) {
            let reason = format!(
                "the queue of key {} for source {} is full: {capacity} events wait for the \
                 graph's other sources (queue_capacity)",
                crate::transport::quoted_key(&key),
                boundary.source
            );
            if lettered > 0 {
                self.list_changed(&key);
            }
            return self.dead_letter(source, &message, &reason).await;
        }
        if state.cache.insert(source, boundary) == Inserted::Duplicate {
            if lettered > 0 {
                self.list_changed(&key);
            }
            return Ok(());
        }
        state.touched_ms = state.touched_ms.max(at_ms);
        // Inline: an event mostly makes one fire.
        let mut fires: smallvec::SmallVec<[_; 1]> = smallvec::SmallVec::new();
        while state.cache.ready(criteria) {
            let values = state.cache.take_values();
            state.fires += 1;
            fires.push((state.fires, values));
        }
        let fired_up_to = state.fires;
        if state.listed_in == batch_number {
            let at = state.listed_at;
            self.batch.retake.push(at);
        } else {
            (state.listed_in, state.listed_at) = (batch_number, next_listed);
            let snapshot = state.cache.snapshot(state.fires, std::iter::empty());
            let slot = state.slot;
            self.changes.keys.push((key.clone(), slot, snapshot));
        }
        self.fire_high = self.fire_high.max(fired_up_to);
        for (fire, values) in fires {
            self.fire(&key, fire, values).await?;
        }
        Ok(())
    }

    /// Lists a key changed in memory in the batch being gathered, for an event that
    /// changed it and then went no further (the fire's path lists its key itself).
    fn list_changed(&mut self, key: &Key) {
        let Some(state) = self.keys.get_mut(key) else {
            return;
        };
        if state.listed_in == self.batch_number {
            self.batch.retake.push(state.listed_at);
        } else {
            (state.listed_in, state.listed_at) = (self.batch_number, self.changes.keys.len());
            let snapshot = state.cache.snapshot(state.fires, std::iter::empty());
            self.changes.keys.push((key.clone(), state.slot, snapshot));
        }
    }

    /// Runs the graph for one key and hands its outputs to the broker.
    async fn fire(
        &mut self,
        key: &Key,
        fire: u64,
        values: FireValues,
    ) -> Result<(), PartitionError> {
        let input = Arc::new(
            FireInput::new(
                self.graph.graph.clone(),
                fire,
                false,
                self.graph.names.clone(),
                values,
            )
            .with_key(key.clone()),
        );
        let mut result = Self::run_graph(&self.graph.decl.graph, &input).await;
        let reactor = &self.graph.decl.reactor;
        let mut retries = 0;
        while let Err(reason) = &result {
            if retries == reactor.node_retries {
                break;
            }
            let delay = reactor.node_retry_backoff * 2u32.saturating_pow(retries);
            retries += 1;
            warn!(graph = %self.graph.graph, key = %key, fire, %reason, retry = retries, ?delay, "keyed fire failed; retrying");
            tokio::select! {
                _ = self.lost.cancelled() => return Err(PartitionError::StoppedRetrying),
                _ = tokio::time::sleep(delay) => {}
            }
            result = Self::run_graph(&self.graph.decl.graph, &input).await;
        }
        let outputs = match result {
            Ok(outputs) => outputs,
            Err(reason) => {
                // A node paused past its lease publishes nothing more, dead letters
                // included.
                self.held.check_deadline()?;
                // Kept for an operator, with what the fire saw and where it came from;
                // the key goes on.
                warn!(graph = %self.graph.graph, key = %key, fire, %reason, "keyed fire failed after its retries; dead-lettering its inputs");
                let mut record = crate::reactor::run::fire_identity(&input);
                record.insert("key".into(), Value::String(key.to_string()));
                record.insert("error".into(), Value::String(reason.clone()));
                record.insert("inputs".into(), input.inputs_json());
                let topic = wire::dead_letter_topic(&self.graph.outputs[0]);
                let mut message = Outbound::new(topic, Value::Object(record).to_string())
                    .header(wire::ERROR_HEADER, reason)
                    .header(wire::GRAPH_HEADER, self.graph.graph.to_string())
                    .header(wire::FIRE_HEADER, fire.to_string());
                // In the record either way; as the message key only where every broker
                // can carry it, or no broker might take the letter.
                if crate::transport::key_travels_everywhere(key.as_bytes()) {
                    message = message.key(key.to_string());
                }
                publish_dead_letter(self.graph.sink.as_ref(), message, &self.stopping).await?;
                return Ok(());
            }
        };
        for output in 0..outputs.len().min(self.graph.outputs.len()) {
            let Some(payload) = outputs.encoded(output) else {
                continue;
            };
            // Before each output: handing the one before over may have waited (for room
            // in the client's queue, say) past the lease.
            self.held.check_deadline()?;
            let sent = Sent {
                output,
                key: key.clone(),
                fire,
            };
            let message = self.output_message(&sent, payload);
            match self.graph.sink.enqueue(message).await {
                // Taken already (a sink publishing before it returns): nothing is left
                // for the batch's write to wait on.
                Ok(ack) if ack.is_taken() => {}
                Ok(ack) => self.batch.acks.push((ack, sent)),
                Err(e) if !e.is_retryable() => self.dead_letter_output(&sent, &e).await?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Runs the graph on one fire. A node that panics fails the fire like one returning
    /// an error: left to unwind the partition's task, it would be served again from the
    /// store and panic on the same input, over and over, repeating the outputs before it.
    async fn run_graph(
        graph: &crate::graph::CompiledGraph,
        input: &Arc<FireInput>,
    ) -> Result<FireOutputs, String> {
        let run = std::panic::AssertUnwindSafe(graph.run(input.clone()));
        match run.catch_unwind().await {
            Ok(Ok(outputs)) => Ok(outputs),
            Ok(Err(e)) => Err(format!("node {} failed: {}", e.node, e.error.0)),
            Err(panic) => Err(format!(
                "a node panicked: {}",
                crate::accumulator::panic_message(panic.as_ref())
            )),
        }
    }

    fn output_message(&self, sent: &Sent, payload: Vec<u8>) -> Outbound {
        let mut message = Outbound::new(self.graph.outputs[sent.output].clone(), payload)
            .key(bytes::Bytes::copy_from_slice(sent.key.as_bytes()));
        message.headers.reserve_exact(3);
        let mut fire = itoa::Buffer::new();
        message
            .header(wire::GRAPH_HEADER, self.graph.graph_header.clone())
            .header(wire::FIRE_HEADER, fire.format(sent.fire))
            .header(wire::FENCING_HEADER, self.fencing.clone())
    }

    /// An output the broker refuses for good (too large, say) is recorded on the
    /// output's dead-letter topic instead, so the partition goes on.
    async fn dead_letter_output(
        &mut self,
        sent: &Sent,
        error: &TransportError,
    ) -> Result<(), PartitionError> {
        self.held.check_deadline()?;
        let letter = crate::transport::undeliverable(&self.output_message(sent, Vec::new()), error);
        warn!(graph = %self.graph.graph, key = %sent.key, fire = sent.fire, topic = %letter.topic, %error, "output cannot be published; dead-lettered");
        publish_dead_letter(self.graph.sink.as_ref(), letter, &self.stopping).await?;
        Ok(())
    }

    async fn dead_letter(
        &mut self,
        source: usize,
        message: &Message,
        reason: &str,
    ) -> Result<(), PartitionError> {
        let at = Some(message.position.offset);
        let (payload, key) = (message.payload.clone(), message.key.clone());
        self.dead_letter_input(
            source,
            (payload, key),
            message.topic.to_string(),
            at,
            reason,
        )
        .await
    }

    /// An input of `source` on its dead-letter topic, with where it was read (the topic
    /// or subject, the partition, the offset) and `reason`.
    async fn dead_letter_input(
        &mut self,
        source: usize,
        (payload, key): (bytes::Bytes, Option<bytes::Bytes>),
        source_topic: String,
        offset: Option<i64>,
        reason: &str,
    ) -> Result<(), PartitionError> {
        // As for outputs: a node paused past its lease dead-letters nothing more, or the
        // owner after it would record the same event a second time.
        self.held.check_deadline()?;
        let letter = self.input_letter(source, (payload, key), source_topic, offset, reason);
        let topic = letter.topic.clone();
        publish_dead_letter(self.graph.sink.as_ref(), letter, &self.stopping).await?;
        warn!(graph = %self.graph.graph, partition = self.partition, %topic, %reason, "event dead-lettered");
        Ok(())
    }

    /// The dead letter of an input of `source`: see [`Self::dead_letter_input`].
    fn input_letter(
        &self,
        source: usize,
        (payload, key): (bytes::Bytes, Option<bytes::Bytes>),
        source_topic: String,
        offset: Option<i64>,
        reason: &str,
    ) -> Outbound {
        let topic = self.graph.dead_letters[source].clone();
        let mut outbound = Outbound::new(topic, payload)
            .header(wire::ERROR_HEADER, reason)
            .header(wire::GRAPH_HEADER, self.graph.graph.to_string())
            .header(
                wire::ACCUMULATOR_HEADER,
                self.graph.names[source].to_string(),
            )
            .header(wire::SOURCE_TOPIC_HEADER, source_topic)
            .header(wire::PARTITION_HEADER, self.partition.to_string());
        if let Some(offset) = offset {
            outbound = outbound.header(wire::OFFSET_HEADER, offset.to_string());
        }
        outbound.key = key;
        outbound
    }

    /// Awaits the batch's outputs, writes its keys with the sources' positions, commits
    /// the positions, and lets cold keys leave memory.
    async fn flush(&mut self, releasing: bool) -> Result<(), PartitionError> {
        if self.batch.commit.is_empty() && self.batch.acks.is_empty() && !releasing {
            return Ok(());
        }
        // Taken for the write, and handed back empty once it is done: the next batch
        // fills the same buffers. A batch's lists run to a thousand keys of a hundred
        // bytes or more each, and new ones per batch cost the allocator fresh pages,
        // which the kernel zeroes, every batch.
        let mut batch = std::mem::take(&mut self.batch);
        for (ack, sent) in batch.acks.drain(..) {
            match ack.await {
                Ok(_) => {}
                Err(e) if !e.is_retryable() => self.dead_letter_output(&sent, &e).await?,
                Err(e) => return Err(e.into()),
            }
        }
        self.batch_number += 1;
        let expiring = self.graph.keying.key_idle.is_some();
        let mut changes = std::mem::take(&mut self.changes);
        changes.released = releasing.then(|| (self.held.lease.token, now_ms()));
        // Times written while idle keys expired would go stale now that they do not.
        changes.drop_times = !expiring && !self.wrote;
        changes.fire_high = expiring.then_some(self.fire_high);
        batch.retake.sort_unstable();
        batch.retake.dedup();
        for &at in &batch.retake {
            let (key, _, snapshot) = &mut changes.keys[at];
            // Keys leave memory only after a batch is written: each listed is there.
            if let Some(state) = self.keys.get(key) {
                *snapshot = state.cache.snapshot(state.fires, std::iter::empty());
            }
        }
        batch.retake.clear();
        if expiring {
            for (key, _, _) in &changes.keys {
                if let Some(state) = self.keys.get(key) {
                    changes.touched.push((key.clone(), state.touched_ms));
                }
            }
        }
        for (i, position) in self.positions.iter().enumerate() {
            if let Some(position) = position {
                changes
                    .positions
                    .insert(self.graph.names[i].to_string(), *position);
            }
        }
        // The batch's outputs are out: a store away for a moment is waited for, not a
        // reason to serve the partition again from the store and repeat them.
        save(
            self.graph,
            self.partition,
            self.held,
            &self.lost,
            &mut changes,
        )
        .await?;
        self.wrote = true;
        self.changes = KeyedChanges::emptied(changes);
        for (source, position) in std::mem::take(&mut batch.commit) {
            if let Err(e) = self.sources[source].commit(&[position]).await {
                warn!(graph = %self.graph.graph, partition = self.partition, error = %e, "cannot commit a source position; a restart skips what it reads again");
            }
        }
        // Nothing is applied while a batch is written: the batch gathered meanwhile is
        // still empty, and takes the buffers back.
        self.batch = Batch {
            retake: batch.retake,
            acks: batch.acks,
            ..Batch::default()
        };
        self.evict();
        Ok(())
    }

    /// Removes the state of keys whose last event is more than `idle` older than the
    /// partition's [`idle_clock`], in memory and in the store, a page at a time. Runs
    /// between batches only, after one is written, so the store has the time of every
    /// key changed and no key it removes is half applied.
    async fn expire_idle(&mut self, idle: Duration) -> Result<(), PartitionError> {
        let idle_ms = i64::try_from(idle.as_millis()).unwrap_or(i64::MAX);
        let before_ms = idle_clock(&self.latest_ms).saturating_sub(idle_ms);
        if before_ms <= 0 {
            return Ok(());
        }
        // Keys a page keeps stay idle and the oldest, ahead of those not looked at yet: the
        // next page starts past them, so that kept keys are tried once per look and a
        // page full of them holds up none of the others.
        let mut kept = 0;
        for _ in 0..IDLE_PAGES_PER_SWEEP {
            match self.expire_idle_page(before_ms, kept).await? {
                Some(kept_in_page) => kept += kept_in_page,
                None => break,
            }
        }
        Ok(())
    }

    /// Removes up to a page of keys whose last event is before `before_ms`, past the
    /// `skip` oldest (kept by the pages before). When the page was full, so that more may
    /// be idle, the number of its keys kept.
    async fn expire_idle_page(
        &mut self,
        before_ms: i64,
        skip: usize,
    ) -> Result<Option<usize>, PartitionError> {
        // A copy of the reference: what it names outlives this borrow of `self`.
        let keyed = self.graph;
        let (graph, partition) = (&keyed.graph, self.partition);
        let idle = match keyed
            .store
            .idle_keys(graph, partition, before_ms, skip, IDLE_KEYS_PER_PAGE)
            .await
        {
            Ok(idle) => idle,
            Err(e) => {
                warn!(graph = %graph, partition, error = %e, "cannot look for idle keys; looking again later");
                return Ok(None);
            }
        };
        if idle.is_empty() {
            return Ok(None);
        }
        let full = idle.len() >= IDLE_KEYS_PER_PAGE;
        let Some(kept) = self.dead_letter_unfired(&idle).await? else {
            return Ok(None);
        };
        let kept_in_page = kept.len();
        let idle: Vec<String> = idle.into_iter().filter(|key| !kept.contains(key)).collect();
        let mut changes = KeyedChanges {
            expired: idle.iter().map(|key| Key::from(key.as_str())).collect(),
            fire_floor: Some(self.fire_high.max(self.fire_floor)),
            ..Default::default()
        };
        save(
            self.graph,
            self.partition,
            self.held,
            &self.lost,
            &mut changes,
        )
        .await?;
        self.fire_floor = self.fire_high.max(self.fire_floor);
        for key in &idle {
            self.keys.remove(key.as_str());
            self.idle_letters_sent.remove(key.as_str());
        }
        crate::metrics::keys_expired(graph, idle.len() as u64);
        Ok(full.then_some(kept_in_page))
    }

    /// Sends what the idle keys hold that no fire has taken yet (inputs queued for a
    /// join, or a latest value not fired) to their sources' dead-letter topics, before
    /// the keys are removed: an input is fired or recorded there, never dropped. The
    /// keys not in memory are read from the store; `None` when it cannot be read now, to
    /// remove nothing until the next look. Else the keys to keep for now: those a letter
    /// of was refused for good, to be tried again at the next look rather than lose the
    /// input or stop the partition. The letters go out again should the removal not be
    /// written (a crash, a store away, the partition let go of meanwhile).
    async fn dead_letter_unfired(
        &mut self,
        idle: &[String],
    ) -> Result<Option<HashSet<String>>, PartitionError> {
        let keyed = self.graph;
        let (graph, partition) = (&keyed.graph, self.partition);
        let stored_only: Vec<String> = idle
            .iter()
            .filter(|key| !self.keys.contains_key(key.as_str()))
            .cloned()
            .collect();
        let loaded = if stored_only.is_empty() {
            Vec::new()
        } else {
            match keyed.store.load_keys(graph, partition, &stored_only).await {
                Ok(loaded) => loaded,
                // One key's state unreadable (another version's, say) would fail the
                // page at every look, and no idle key would ever go: read them one by
                // one, and remove an unreadable one without letters, saying so.
                Err(e) if e.kind() == StoreErrorKind::Corrupt => {
                    let mut loaded = Vec::with_capacity(stored_only.len());
                    for key in &stored_only {
                        let wanted = std::slice::from_ref(key);
                        match keyed.store.load_keys(graph, partition, wanted).await {
                            Ok(mut one) => loaded.push(one.pop().flatten()),
                            Err(e) if e.kind() == StoreErrorKind::Corrupt => {
                                warn!(graph = %graph, partition, key = %key, error = %e, "idle key's stored state cannot be read; removed without dead-lettering what it held");
                                loaded.push(None);
                            }
                            Err(e) => {
                                warn!(graph = %graph, partition, error = %e, "cannot read idle keys before removing them; looking again later");
                                return Ok(None);
                            }
                        }
                    }
                    loaded
                }
                Err(e) => {
                    warn!(graph = %graph, partition, error = %e, "cannot read idle keys before removing them; looking again later");
                    return Ok(None);
                }
            }
        };
        let in_memory = idle.iter().filter_map(|key| {
            let state = self.keys.get(key.as_str())?;
            Some((key, state.cache.snapshot(state.fires, std::iter::empty())))
        });
        let stored = stored_only
            .iter()
            .zip(loaded)
            .filter_map(|(key, snapshot)| Some((key, snapshot?)));
        let latest = keyed.decl.reactor.strategy == crate::graph::Strategy::Latest;
        let mut unfired: Vec<(&String, usize, Arc<Boundary>)> = Vec::new();
        for (key, snapshot) in in_memory.collect::<Vec<_>>().into_iter().chain(stored) {
            for (name, slot) in snapshot.sources.iter() {
                let Some(source) = keyed.names.iter().position(|n| &**n == name) else {
                    continue;
                };
                let waiting = slot.queue.iter().cloned();
                let not_fired = slot.current.clone().filter(|_| latest && slot.dirty);
                for boundary in waiting.chain(not_fired) {
                    unfired.push((key, source, boundary));
                }
            }
        }
        // Each key's letters in order, the keys' side by side; of a key kept at an
        // earlier look, only those that did not go out then.
        let mut letters: Vec<(&String, Vec<Outbound>)> = Vec::new();
        for (key, source, boundary) in unfired {
            let letter = self.unfired_letter(key, source, &boundary);
            match letters.last_mut() {
                Some((last, of_key)) if *last == key => of_key.push(letter),
                _ => letters.push((key, vec![letter])),
            }
        }
        for (key, of_key) in &mut letters {
            if let Some(&sent) = self.idle_letters_sent.get(key.as_str()) {
                of_key.drain(..sent.min(of_key.len()));
            }
        }
        let sender = LetterSender {
            graph,
            partition,
            held: self.held,
            sink: self.graph.sink.as_ref(),
            stopping: &self.stopping,
        };
        let mut sending = Vec::with_capacity(letters.len());
        for (key, of_key) in letters {
            sending.push(sender.send_in_order(key, of_key));
        }
        let sent: Vec<(&String, usize, Result<(), PartitionError>)> =
            futures::stream::iter(sending)
                .buffered(IDLE_LETTERS_IN_FLIGHT)
                .collect()
                .await;
        // Let go of meanwhile: nothing is removed yet, and the next owner sends the
        // letters (again, for those that went).
        if self.stopping.is_cancelled() {
            return Ok(None);
        }
        let mut kept = HashSet::new();
        for (key, went, outcome) in sent {
            match outcome {
                Ok(()) => {}
                Err(PartitionError::Transport(e)) if !e.is_retryable() => {
                    warn!(graph = %graph, partition, key = %key, error = %e, "idle key's dead letter refused; the key is kept for now");
                    *self
                        .idle_letters_sent
                        .entry(Key::from(key.as_str()))
                        .or_default() += went;
                    kept.insert(key.clone());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Some(kept))
    }

    /// The dead letter of an input of an idle key that no fire took, for its source's
    /// dead-letter topic: its JSON value, where it was read, and why it was not fired.
    fn unfired_letter(&self, key: &str, source: usize, boundary: &Boundary) -> Outbound {
        let reason = format!(
            "key {} went key_idle_ms without an event and was removed; no fire had taken \
             this input yet (the graph's other sources had not sent the key enough \
             since its last fire)",
            crate::transport::quoted_key(key)
        );
        let payload = crate::codec::json::encode(&boundary.value).into();
        // In the error header either way; as the message key only where every broker
        // can carry it.
        let message_key = crate::transport::key_travels_everywhere(key.as_bytes())
            .then(|| bytes::Bytes::copy_from_slice(key.as_bytes()));
        let source_topic = self.graph.topics.sources[source].topic_for(key.as_bytes());
        let offset = boundary.positions.first().map(|at| at.offset);
        self.input_letter(
            source,
            (payload, message_key),
            source_topic,
            offset,
            &reason,
        )
    }

    /// Drops the least recently used keys beyond the limit; their state is stored.
    fn evict(&mut self) {
        let limit = self.graph.keying.max_keys_in_memory.max(1);
        if self.keys.len() <= limit {
            return;
        }
        self.stored_keys = true;
        // Down to nine tenths, so eviction runs once per many new keys, not per key.
        let keep = limit - limit / 10;
        let mut used: Vec<u64> = self.keys.values().map(|s| s.used).collect();
        let cut = self.keys.len() - keep;
        used.select_nth_unstable(cut - 1);
        let threshold = used[cut - 1];
        self.keys.retain(|_, s| s.used > threshold);
    }
}

/// What sends idle keys' dead letters, side by side.
struct LetterSender<'a> {
    graph: &'a str,
    partition: i32,
    held: &'a Held,
    sink: &'a dyn crate::transport::Sink,
    stopping: &'a CancellationToken,
}

impl LetterSender<'_> {
    /// Sends one idle key's dead letters in order, stopping at the first that does not
    /// go, or as the partition is let go of; with the number that went.
    async fn send_in_order<'k>(
        &self,
        key: &'k String,
        letters: Vec<Outbound>,
    ) -> (&'k String, usize, Result<(), PartitionError>) {
        for (went, letter) in letters.into_iter().enumerate() {
            // Let go of: no more letters, and the page removes nothing.
            if self.stopping.is_cancelled() {
                return (key, went, Err(PartitionError::StoppedRetrying));
            }
            // As for outputs: a node paused past its lease dead-letters nothing more,
            // or the owner after it would record the same input again.
            if let Err(e) = self.held.check_deadline() {
                return (key, went, Err(e.into()));
            }
            let topic = letter.topic.clone();
            if let Err(e) = publish_dead_letter(self.sink, letter, self.stopping).await {
                return (key, went, Err(e.into()));
            }
            warn!(graph = %self.graph, partition = self.partition, key = %key, %topic, "idle key's unfired input dead-lettered");
        }
        (key, 0, Ok(()))
    }
}

/// Writes `changes` to `partition` under its fence, waiting out a store away for a
/// moment for up to half the lease TTL (until `lost`).
async fn save(
    graph: &KeyedPartitions,
    partition: i32,
    held: &Held,
    lost: &CancellationToken,
    changes: &mut KeyedChanges,
) -> Result<(), PartitionError> {
    let mut retry = StoreRetry::new(&graph.group, partition, graph.keying.lease_ttl, lost);
    loop {
        let fence = held.write_fence()?;
        // Handing over: the next owner's wait counts from the write that lands.
        if let Some((_, at_ms)) = &mut changes.released {
            *at_ms = now_ms();
        }
        match graph
            .store
            .save_keys(&graph.graph, partition, changes, &fence)
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) => retry.after(e).await?,
        }
    }
}

/// The next message of any source, as [`next_message`]; while `paused`, no message: the
/// sources stop fetching instead (a Kafka consumer would go on filling its queue with
/// what the partition does not read), and `None` is answered once one of them has
/// something to look at again. A source failing while held answers its error.
async fn next_unless_paused(
    sources: &mut [Box<dyn Source>],
    first: usize,
    paused: bool,
) -> Option<(usize, Result<Message, TransportError>)> {
    if !paused {
        return Some(next_message(sources, first).await);
    }
    let (held, source, _) = futures::future::select_all(sources.iter_mut().map(|s| s.hold())).await;
    match held {
        Ok(()) => None,
        Err(e) => Some((source, Err(e))),
    }
}

/// The next message of any source, with the source's index, looking at `first` first
/// when several are ready. The other sources' reads are dropped before it is handled; a
/// source's read loses nothing when dropped.
async fn next_message(
    sources: &mut [Box<dyn Source>],
    first: usize,
) -> (usize, Result<Message, TransportError>) {
    if let [only] = sources {
        return (0, only.next().await);
    }
    let start = first % sources.len();
    let (before, from_first) = sources.split_at_mut(start);
    futures::future::select_all(
        from_first
            .iter_mut()
            .enumerate()
            .map(|(i, s)| (start + i, s))
            .chain(before.iter_mut().enumerate())
            .map(|(i, s)| s.next().map(move |m| (i, m)).boxed()),
    )
    .map(|(first, _, _)| first)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_working_off_a_backlog_holds_the_idle_clock_back() {
        let now = 1_000_000;
        // One source is at now, the other still reading events an hour old.
        assert_eq!(idle_clock(&[now - 10, now - 3_600_000]), now - 3_600_000);
        // One that has handed over nothing yet in this run may have a backlog too.
        assert_eq!(idle_clock(&[now - 10, 0]), 0);
        assert_eq!(idle_clock(&[now - 10]), now - 10);
    }
}

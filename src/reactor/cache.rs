//! The input cache: per source the value a fire sees, the queue (sequential strategy),
//! the dirty flag and the highest position taken per partition (for dropping replayed
//! boundaries).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::{Criteria, Strategy};
use crate::accumulator::Boundary;
use crate::graph::{FireInput, FireValues};
use crate::lease::Fence;
use crate::store_error::StoreError;
use crate::transport::Position;

/// Highest position taken per partition. A source is mostly read in one partition per
/// reader, and always so in a keyed graph's partition, where every key keeps its own: one
/// position is kept inline, so that costs a key no allocation and no cache line of its
/// own.
pub type SeenPositions = SmallVec<[Position; 1]>;

/// What the store keeps of a cache, so a respawned reactor resumes where it was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct CacheSnapshot {
    pub fires: u64,
    pub sources: SourceSnapshots,
    /// Paused by a command: a respawned or failed-over reactor stays paused.
    #[serde(default)]
    pub paused: bool,
    /// The fires whose inputs the queues hold again (unacknowledged when the snapshot
    /// was taken), oldest first: fired again from those inputs, each keeps its number,
    /// so a consumer sees a repeated output under the `weir-fire` it first had.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub refires: VecDeque<Refire>,
}

/// A fire to make again from requeued inputs: its number and the sources it took.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refire {
    pub fire: u64,
    pub sources: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SourceSnapshot {
    /// Highest position taken per partition: what a replay repeats.
    #[serde(default)]
    pub seen: SeenPositions,
    pub dirty: bool,
    /// Shared with the cache it was taken from: a snapshot copies no event.
    pub current: Option<Arc<Boundary>>,
    pub queue: Vec<Arc<Boundary>>,
}

/// A snapshot's sources by name, in name order: a map on the wire, a short list in
/// memory. A graph has few sources and a keyed graph takes a snapshot of every key it
/// changes, so a tree node per snapshot (about a kilobyte) would cost more than the
/// state it holds.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SourceSnapshots(SmallVec<[(Arc<str>, SourceSnapshot); 1]>);

impl SourceSnapshots {
    pub fn get(&self, name: &str) -> Option<&SourceSnapshot> {
        self.position(name).ok().map(|i| &self.0[i].1)
    }

    /// Sets a source's snapshot; returns the one it replaces.
    pub fn insert(
        &mut self,
        name: impl Into<Arc<str>>,
        snapshot: SourceSnapshot,
    ) -> Option<SourceSnapshot> {
        let name = name.into();
        match self.position(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, snapshot)),
            Err(i) => {
                self.0.insert(i, (name, snapshot));
                None
            }
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &SourceSnapshot)> {
        self.0.iter().map(|(name, s)| (&**name, s))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn position(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| (**n).cmp(name))
    }
}

impl std::ops::Index<&str> for SourceSnapshots {
    type Output = SourceSnapshot;

    fn index(&self, name: &str) -> &SourceSnapshot {
        self.get(name)
            .unwrap_or_else(|| panic!("no source {name:?} in the snapshot"))
    }
}

impl<N: Into<Arc<str>>> FromIterator<(N, SourceSnapshot)> for SourceSnapshots {
    fn from_iter<I: IntoIterator<Item = (N, SourceSnapshot)>>(iter: I) -> Self {
        let mut sources: SmallVec<[(Arc<str>, SourceSnapshot); 1]> = iter
            .into_iter()
            .map(|(name, snapshot)| (name.into(), snapshot))
            .collect();
        // Stable, so of two entries under one name the later one stays, as with insert.
        sources.sort_by(|a, b| a.0.cmp(&b.0));
        sources.dedup_by(|later, kept| {
            let same = later.0 == kept.0;
            if same {
                std::mem::swap(later, kept);
            }
            same
        });
        Self(sources)
    }
}

impl Serialize for SourceSnapshots {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for SourceSnapshots {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, SourceSnapshot>::deserialize(deserializer)?;
        Ok(Self(
            map.into_iter()
                .map(|(name, snapshot)| (Arc::from(name), snapshot))
                .collect(),
        ))
    }
}

/// The sources whose boundary one fire takes from the cache, in source order.
pub type Taken = SmallVec<[usize; 4]>;

/// The boundaries one fire took from the cache. What a fire takes of a source is the
/// boundary its input shows for it, so these are read from the fire's input rather than
/// held again, one reference per boundary.
#[derive(Debug)]
pub struct Consumed {
    input: Arc<FireInput>,
    sources: Taken,
}

impl Consumed {
    pub fn new(input: Arc<FireInput>, sources: Taken) -> Self {
        Self { input, sources }
    }

    /// The fire's number and the names of the sources it took, to make it again.
    pub fn refire(&self) -> Refire {
        Refire {
            fire: self.input.fire,
            sources: self
                .sources
                .iter()
                .map(|&i| self.input.names[i].to_string())
                .collect(),
        }
    }

    /// Each source taken from, with its boundary.
    pub fn boundaries(&self) -> impl Iterator<Item = (usize, &Arc<Boundary>)> {
        self.sources.iter().filter_map(|&i| {
            let boundary = self.input.values.get(i).and_then(Option::as_ref);
            debug_assert!(boundary.is_some(), "a fire took source {i} and shows none");
            Some((i, boundary?))
        })
    }
}

/// A source's boundaries waiting for fires (sequential strategy). Mostly it holds one at
/// most, queued and taken by the fire it makes, and a keyed graph keeps one per key: the
/// first is held inline and the rest behind a pointer, so such a queue costs no
/// allocation and a key's state stays small enough to take few cache lines.
#[derive(Debug, Default)]
struct Queue {
    /// Empty only when `rest` is.
    head: Option<Arc<Boundary>>,
    /// Made when a second boundary waits, and kept for the next time one does. Boxed,
    /// so an empty one costs a pointer in every key's state, not a deque's 32 bytes.
    #[allow(clippy::box_collection)]
    rest: Option<Box<VecDeque<Arc<Boundary>>>>,
}

impl Queue {
    fn push_back(&mut self, boundary: Arc<Boundary>) {
        if self.head.is_none() {
            self.head = Some(boundary);
        } else {
            self.rest.get_or_insert_default().push_back(boundary);
        }
    }

    fn pop_front(&mut self) -> Option<Arc<Boundary>> {
        let head = self.head.take()?;
        self.head = self.rest.as_mut().and_then(|rest| rest.pop_front());
        Some(head)
    }

    fn len(&self) -> usize {
        usize::from(self.head.is_some()) + self.rest.as_ref().map_or(0, |rest| rest.len())
    }

    fn is_empty(&self) -> bool {
        self.head.is_none()
    }

    fn iter(&self) -> impl Iterator<Item = &Arc<Boundary>> {
        self.head
            .iter()
            .chain(self.rest.iter().flat_map(|rest| rest.iter()))
    }
}

impl FromIterator<Arc<Boundary>> for Queue {
    fn from_iter<I: IntoIterator<Item = Arc<Boundary>>>(iter: I) -> Self {
        let mut queue = Queue::default();
        for boundary in iter {
            queue.push_back(boundary);
        }
        queue
    }
}

#[derive(Debug, Default)]
struct Slot {
    current: Option<Arc<Boundary>>,
    queue: Queue,
    dirty: bool,
    /// Highest sequence received in this run, for telling accumulators what is durable.
    received: u64,
    /// Highest position taken per partition, kept across restarts, by partition: a
    /// source has few partitions, and a keyed graph keeps a slot per key.
    seen: SeenPositions,
}

impl Slot {
    /// A boundary is a repeat when it covers positions and every one of them was taken
    /// before. Within a partition a replay comes in the original order, so a new event
    /// always lies beyond what was taken; a boundary without positions is never a repeat.
    fn is_repeat(&self, boundary: &Boundary) -> bool {
        !boundary.positions.is_empty()
            && boundary.positions.iter().all(|p| {
                self.seen_at(p.partition)
                    .is_some_and(|seen| p.offset <= seen)
            })
    }

    fn seen_at(&self, partition: i32) -> Option<i64> {
        self.seen
            .binary_search_by_key(&partition, |p| p.partition)
            .ok()
            .map(|i| self.seen[i].offset)
    }

    fn mark_seen(&mut self, position: Position) {
        match self
            .seen
            .binary_search_by_key(&position.partition, |p| p.partition)
        {
            Ok(i) => self.seen[i].offset = self.seen[i].offset.max(position.offset),
            Err(i) => self.seen.insert(i, position),
        }
    }
}

#[derive(Debug)]
pub struct InputCache {
    strategy: Strategy,
    names: Arc<[Arc<str>]>,
    slots: SmallVec<[Slot; 1]>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Accepted,
    /// Every position it covers was taken before, as after a replay.
    Duplicate,
}

impl InputCache {
    pub fn new(names: Arc<[Arc<str>]>, strategy: Strategy) -> Self {
        let slots = names.iter().map(|_| Slot::default()).collect();
        Self {
            strategy,
            names,
            slots,
        }
    }

    pub fn names(&self) -> &Arc<[Arc<str>]> {
        &self.names
    }

    /// Loads a stored snapshot. Sources no longer declared are ignored. Returns the
    /// number of queued boundaries restored per source.
    pub fn restore(&mut self, snapshot: &CacheSnapshot) -> Vec<usize> {
        let mut queued = vec![0; self.slots.len()];
        for (i, name) in self.names.iter().enumerate() {
            let Some(stored) = snapshot.sources.get(name) else {
                continue;
            };
            let slot = &mut self.slots[i];
            slot.seen.clear();
            for p in &stored.seen {
                slot.mark_seen(*p);
            }
            slot.current = stored.current.clone().map(restored);
            // A snapshot of the other strategy (the graph's config changed between runs)
            // keeps what no fire took yet, its positions committed already: the newest
            // queued input as the value to fire (latest), or the value not fired yet as
            // the one input queued (sequential).
            match self.strategy {
                Strategy::Latest => match stored.queue.last() {
                    Some(newest) => {
                        slot.current = Some(restored(newest.clone()));
                        slot.dirty = true;
                    }
                    None => slot.dirty = stored.dirty,
                },
                Strategy::Sequential => {
                    slot.queue = stored.queue.iter().cloned().map(restored).collect();
                    if slot.queue.is_empty() && stored.dirty {
                        if let Some(unfired) = &slot.current {
                            slot.queue.push_back(unfired.clone());
                        }
                    }
                    slot.dirty = !slot.queue.is_empty();
                    queued[i] = slot.queue.len();
                }
            }
        }
        queued
    }

    pub fn insert(&mut self, source: usize, boundary: Boundary) -> Inserted {
        let slot = &mut self.slots[source];
        slot.received = slot.received.max(boundary.sequence);
        if slot.is_repeat(&boundary) {
            return Inserted::Duplicate;
        }
        for p in &boundary.positions {
            slot.mark_seen(*p);
        }
        let boundary = Arc::new(boundary);
        match self.strategy {
            Strategy::Latest => slot.current = Some(boundary),
            Strategy::Sequential => slot.queue.push_back(boundary),
        }
        slot.dirty = true;
        Inserted::Accepted
    }

    /// Reads what an insert and a take are about to touch, for a caller that looks up
    /// many caches ahead of using them (a keyed graph, per burst of events): those reads
    /// wait on memory together instead of one at a time.
    pub fn warm(&self) {
        for slot in &self.slots {
            std::hint::black_box((slot.dirty, slot.current.as_ref().map(Arc::strong_count)));
        }
    }

    /// Drops the first `count` inputs no fire has taken yet, in the order a snapshot
    /// lists them (sources by name; each one's queue, then a latest value not fired):
    /// inputs recorded elsewhere already (dead-lettered), which no fire may take now.
    /// Replay detection is unaffected.
    pub fn drop_unfired(&mut self, mut count: usize) {
        let mut by_name: SmallVec<[usize; 4]> = (0..self.slots.len()).collect();
        by_name.sort_by(|a, b| self.names[*a].cmp(&self.names[*b]));
        for i in by_name {
            let slot = &mut self.slots[i];
            while count > 0 && slot.queue.pop_front().is_some() {
                count -= 1;
            }
            match self.strategy {
                Strategy::Sequential => slot.dirty = !slot.queue.is_empty(),
                Strategy::Latest => {
                    if count > 0 && slot.dirty && slot.current.is_some() {
                        slot.dirty = false;
                        count -= 1;
                    }
                }
            }
        }
    }

    /// Whether the criteria are met.
    pub fn ready(&self, criteria: Criteria) -> bool {
        match criteria {
            Criteria::WhenAny => self.slots.iter().any(|s| s.dirty),
            Criteria::WhenAll => self.slots.iter().all(|s| s.dirty),
        }
    }

    /// Takes a fire's inputs: the newest value per source (latest), or the head of each
    /// non-empty queue (sequential). Clears the dirty flags of what was taken.
    pub fn take(&mut self) -> (FireValues, Taken) {
        let mut taken = Taken::new();
        self.take_recording(Some(&mut taken));
        (self.values(), taken)
    }

    /// As [`take`](Self::take), for a caller that keeps no record of what each fire
    /// consumed (a keyed graph stores its keys only once their outputs are acknowledged).
    pub fn take_values(&mut self) -> FireValues {
        self.take_recording(None);
        self.values()
    }

    fn take_recording(&mut self, mut taken: Option<&mut Taken>) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            match self.strategy {
                Strategy::Latest => {
                    if slot.dirty {
                        slot.dirty = false;
                        if let (Some(_), Some(taken)) = (&slot.current, taken.as_mut()) {
                            taken.push(i);
                        }
                    }
                }
                Strategy::Sequential => {
                    if let Some(head) = slot.queue.pop_front() {
                        if let Some(taken) = taken.as_mut() {
                            taken.push(i);
                        }
                        slot.current = Some(head);
                    }
                    slot.dirty = !slot.queue.is_empty();
                }
            }
        }
    }

    /// The value each source would show a fire now.
    pub fn values(&self) -> FireValues {
        self.slots.iter().map(|s| s.current.clone()).collect()
    }

    /// Replaces one source's current value (for `FireWith`), clearing its flag; replay
    /// detection is unaffected.
    pub fn inject(&mut self, source: usize, boundary: Boundary) {
        let slot = &mut self.slots[source];
        slot.current = Some(Arc::new(boundary));
        if self.strategy == Strategy::Latest {
            slot.dirty = false;
        }
    }

    pub fn dirty(&self, source: usize) -> bool {
        self.slots[source].dirty
    }

    /// Whether `insert` would drop `boundary` as a repeat.
    pub fn is_repeat(&self, source: usize, boundary: &Boundary) -> bool {
        self.slots[source].is_repeat(boundary)
    }

    pub fn queued(&self, source: usize) -> usize {
        self.slots[source].queue.len()
    }

    /// Highest sequence received from the source in this run.
    pub fn received(&self, source: usize) -> u64 {
        self.slots[source].received
    }

    /// Highest position taken per partition.
    pub fn seen(&self, source: usize) -> Vec<Position> {
        self.slots[source].seen.to_vec()
    }

    /// A snapshot for the store. Boundaries taken by fires whose outputs are not yet
    /// acknowledged go back in as unconsumed, so a crash before the acknowledgement
    /// fires them again instead of losing them.
    pub fn snapshot<'a>(
        &self,
        fires: u64,
        unacknowledged: impl Iterator<Item = &'a Consumed>,
    ) -> CacheSnapshot {
        // Made only when some fire is unacknowledged: a keyed graph takes a snapshot per
        // changed key and has none.
        let mut requeue: Vec<Vec<Arc<Boundary>>> = Vec::new();
        for consumed in unacknowledged {
            for (i, b) in consumed.boundaries() {
                if requeue.is_empty() {
                    requeue.resize(self.slots.len(), Vec::new());
                }
                requeue[i].push(b.clone());
            }
        }
        let mut requeue = requeue.into_iter();
        let sources = self
            .names
            .iter()
            .zip(&self.slots)
            .map(|(name, slot)| {
                let requeue = requeue.next().unwrap_or_default();
                let mut stored = SourceSnapshot {
                    seen: slot.seen.clone(),
                    dirty: slot.dirty,
                    current: slot.current.clone(),
                    queue: Vec::new(),
                };
                match self.strategy {
                    Strategy::Latest => stored.dirty |= !requeue.is_empty(),
                    Strategy::Sequential => {
                        stored.queue = requeue;
                        stored.queue.extend(slot.queue.iter().cloned());
                        stored.dirty = !stored.queue.is_empty();
                    }
                }
                (name.clone(), stored)
            })
            .collect();
        CacheSnapshot {
            fires,
            sources,
            paused: false,
            refires: VecDeque::new(),
        }
    }
}

/// A boundary from a snapshot: already durable, so its sequence of another run must not
/// count as progress in this one.
fn restored(boundary: Arc<Boundary>) -> Arc<Boundary> {
    if boundary.sequence == 0 {
        return boundary;
    }
    let mut boundary = (*boundary).clone();
    boundary.sequence = 0;
    Arc::new(boundary)
}

/// Where a reactor keeps its cache snapshot, one per graph.
#[async_trait]
pub trait CacheStore: Send + Sync {
    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError>;

    /// Writes a cache snapshot, fenced as [`crate::accumulator::CheckpointStore::save_checkpoint`] is.
    async fn save_cache(
        &self,
        graph: &str,
        snapshot: &CacheSnapshot,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names() -> Arc<[Arc<str>]> {
        vec![Arc::from("a"), Arc::from("b")].into()
    }

    /// A boundary covering offset `sequence` of partition 0.
    fn b(source: &str, sequence: u64, value: i64) -> Boundary {
        at(source, sequence, &[(0, sequence as i64)], value)
    }

    fn at(source: &str, sequence: u64, positions: &[(i32, i64)], value: i64) -> Boundary {
        Boundary {
            source: Arc::from(source),
            sequence,
            positions: positions
                .iter()
                .map(|&(partition, offset)| Position { partition, offset })
                .collect(),
            event_time_ms: 0,
            emit_time_ms: 0,
            value: json!(value),
        }
    }

    fn value(v: &Option<Arc<Boundary>>) -> Option<i64> {
        v.as_ref().and_then(|b| b.value.as_i64())
    }

    #[test]
    fn dropping_unfired_inputs_takes_them_in_the_order_a_snapshot_lists_them() {
        // Declared b before a: a snapshot, and so its letters, list sources by name.
        let mut cache = InputCache::new(names_b_a(), Strategy::Sequential);
        cache.insert(0, b("b", 1, 10));
        cache.insert(1, b("a", 2, 20));
        cache.insert(1, b("a", 3, 30));
        cache.drop_unfired(2);
        assert_eq!(
            cache.queued(1),
            0,
            "a's two inputs listed first, both dropped"
        );
        assert!(!cache.dirty(1));
        assert_eq!(cache.queued(0), 1);
        assert!(cache.ready(Criteria::WhenAny));
        assert!(
            cache.is_repeat(1, &b("a", 3, 30)),
            "what was dropped is still seen"
        );
        let mut latest = InputCache::new(names_b_a(), Strategy::Latest);
        latest.insert(0, b("b", 1, 10));
        latest.insert(1, b("a", 2, 20));
        latest.drop_unfired(1);
        assert!(!latest.dirty(1), "a's value not fired is dropped first");
        assert!(latest.dirty(0));
    }

    fn names_b_a() -> Arc<[Arc<str>]> {
        vec![Arc::from("b"), Arc::from("a")].into()
    }

    #[test]
    fn a_snapshot_of_the_other_strategy_keeps_what_no_fire_took() {
        // Sequential, two inputs of `a` queued: restored under latest, the newer fires.
        let mut sequential = InputCache::new(names(), Strategy::Sequential);
        sequential.insert(0, b("a", 1, 10));
        sequential.insert(0, b("a", 2, 20));
        let mut latest = InputCache::new(names(), Strategy::Latest);
        latest.restore(&sequential.snapshot(0, std::iter::empty()));
        assert!(latest.ready(Criteria::WhenAny));
        assert!(!latest.dirty(1));
        assert_eq!(value(&latest.take().0[0]), Some(20));
        assert!(!latest.ready(Criteria::WhenAny));
        // Latest, a value of `a` not fired and one of `b` fired: restored under
        // sequential, the unfired one is queued, the fired one only shown.
        let mut latest = InputCache::new(names(), Strategy::Latest);
        latest.insert(1, b("b", 3, 30));
        latest.take();
        latest.insert(0, b("a", 4, 40));
        let mut sequential = InputCache::new(names(), Strategy::Sequential);
        let queued = sequential.restore(&latest.snapshot(1, std::iter::empty()));
        assert_eq!(queued, [1, 0]);
        assert!(!sequential.dirty(1));
        let (values, taken) = sequential.take();
        assert_eq!(taken.as_slice(), [0]);
        assert_eq!((value(&values[0]), value(&values[1])), (Some(40), Some(30)));
        assert!(!sequential.ready(Criteria::WhenAny));
        // Repeats of what either took are still known as such.
        assert_eq!(sequential.insert(0, b("a", 4, 40)), Inserted::Duplicate);
    }

    #[test]
    fn latest_keeps_the_newest() {
        let mut cache = InputCache::new(names(), Strategy::Latest);
        cache.insert(0, b("a", 1, 10));
        cache.insert(0, b("a", 2, 20));
        let (values, taken) = cache.take();
        assert_eq!(value(&values[0]), Some(20));
        assert_eq!(values[1], None);
        assert_eq!(taken.as_slice(), [0]);
        assert!(!cache.ready(Criteria::WhenAny));
    }

    #[test]
    fn sequential_takes_heads_in_order() {
        let mut cache = InputCache::new(names(), Strategy::Sequential);
        cache.insert(0, b("a", 1, 10));
        cache.insert(0, b("a", 2, 20));
        let (values, _) = cache.take();
        assert_eq!(value(&values[0]), Some(10));
        assert!(cache.dirty(0));
        let (values, _) = cache.take();
        assert_eq!(value(&values[0]), Some(20));
        assert!(!cache.dirty(0));
    }

    #[test]
    fn a_queue_drained_and_filled_again_keeps_its_order() {
        let mut cache = InputCache::new(names(), Strategy::Sequential);
        let mut sequence = 0;
        let mut taken = Vec::new();
        // Three queued, two taken, three more: the queue's inline head and the rest
        // behind it hand boundaries over in the order they came.
        for (push, take) in [(3, 2), (3, 4)] {
            for _ in 0..push {
                sequence += 1;
                cache.insert(0, b("a", sequence, sequence as i64));
            }
            assert_eq!(
                cache.snapshot(0, std::iter::empty()).sources["a"]
                    .queue
                    .len(),
                cache.queued(0)
            );
            for _ in 0..take {
                let (values, _) = cache.take();
                taken.extend(value(&values[0]));
            }
        }
        assert_eq!(taken, [1, 2, 3, 4, 5, 6]);
        assert_eq!(cache.queued(0), 0);
        assert!(!cache.dirty(0));
    }

    #[test]
    fn source_snapshots_are_a_map_by_name_on_the_wire() {
        let dirty = SourceSnapshot {
            dirty: true,
            ..Default::default()
        };
        let sources: SourceSnapshots = [("b", SourceSnapshot::default()), ("a", dirty.clone())]
            .into_iter()
            .collect();
        let wire = serde_json::to_value(&sources).unwrap();
        assert_eq!(wire["a"]["dirty"], json!(true));
        assert_eq!(wire["b"]["dirty"], json!(false));
        let back: SourceSnapshots = serde_json::from_value(wire).unwrap();
        assert_eq!(back, sources);
        assert_eq!(back.iter().map(|(n, _)| n).collect::<Vec<_>>(), ["a", "b"]);
        let mut replaced = back;
        assert_eq!(replaced.insert("a", SourceSnapshot::default()), Some(dirty));
        assert_eq!(replaced.len(), 2);
        assert!(replaced.get("c").is_none());
    }

    #[test]
    fn source_snapshots_collected_keep_the_last_entry_of_a_name() {
        let dirty = SourceSnapshot {
            dirty: true,
            ..Default::default()
        };
        let sources: SourceSnapshots = [
            ("c", SourceSnapshot::default()),
            ("a", SourceSnapshot::default()),
            ("c", dirty.clone()),
            ("b", SourceSnapshot::default()),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            sources.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        assert_eq!(sources["c"], dirty);
    }

    #[test]
    fn positions_seen_out_of_partition_order_are_all_kept() {
        let mut cache = InputCache::new(names(), Strategy::Latest);
        for (partition, offset) in [(5, 10), (1, 7), (3, 2), (1, 4), (5, 12)] {
            cache.insert(0, at("a", 0, &[(partition, offset)], 0));
        }
        let seen: Vec<(i32, i64)> = cache
            .seen(0)
            .iter()
            .map(|p| (p.partition, p.offset))
            .collect();
        assert_eq!(seen, [(1, 7), (3, 2), (5, 12)]);
        assert_eq!(
            cache.insert(0, at("a", 0, &[(1, 6), (5, 12)], 0)),
            Inserted::Duplicate
        );
    }

    #[test]
    fn when_all_needs_every_source() {
        let mut cache = InputCache::new(names(), Strategy::Latest);
        assert!(!cache.ready(Criteria::WhenAll));
        cache.insert(0, b("a", 1, 1));
        assert!(!cache.ready(Criteria::WhenAll));
        cache.insert(1, b("b", 1, 1));
        assert!(cache.ready(Criteria::WhenAll));
    }

    #[test]
    fn replayed_sequences_are_duplicates() {
        let mut cache = InputCache::new(names(), Strategy::Latest);
        assert_eq!(cache.insert(0, b("a", 5, 1)), Inserted::Accepted);
        assert_eq!(cache.insert(0, b("a", 5, 1)), Inserted::Duplicate);
        assert_eq!(cache.insert(0, b("a", 3, 1)), Inserted::Duplicate);
        assert_eq!(cache.insert(1, b("b", 3, 1)), Inserted::Accepted);
    }

    #[test]
    fn snapshot_requeues_unacknowledged_fires() {
        let mut cache = InputCache::new(names(), Strategy::Sequential);
        cache.insert(0, b("a", 1, 10));
        cache.insert(0, b("a", 2, 20));
        let (values, taken) = cache.take();
        let input = FireInput::new(Arc::from("g"), 1, false, names(), values);
        let consumed = Consumed::new(Arc::new(input), taken);
        let snapshot = cache.snapshot(1, [&consumed].into_iter());
        let a = &snapshot.sources["a"];
        assert_eq!(
            a.queue.iter().map(|b| b.sequence).collect::<Vec<_>>(),
            vec![1, 2]
        );
        let mut restored = InputCache::new(names(), Strategy::Sequential);
        assert_eq!(restored.restore(&snapshot), vec![2, 0]);
        assert_eq!(
            restored.seen(0),
            vec![Position {
                partition: 0,
                offset: 2
            }]
        );
        assert_eq!(
            restored.received(0),
            0,
            "restored sequences are of another run"
        );
        assert_eq!(restored.insert(0, b("a", 2, 20)), Inserted::Duplicate);
    }

    #[test]
    fn a_new_event_of_another_partition_is_never_a_repeat() {
        let mut cache = InputCache::new(names(), Strategy::Sequential);
        assert_eq!(
            cache.insert(0, at("a", 1, &[(0, 100)], 1)),
            Inserted::Accepted
        );
        assert_eq!(
            cache.insert(0, at("a", 2, &[(1, 3)], 2)),
            Inserted::Accepted
        );
        // A replay in another order, with a lower sequence: the old ones are repeats,
        // the new one of partition 2 is not.
        assert_eq!(
            cache.insert(0, at("a", 1, &[(1, 3)], 2)),
            Inserted::Duplicate
        );
        assert_eq!(
            cache.insert(0, at("a", 2, &[(2, 0)], 3)),
            Inserted::Accepted
        );
        assert_eq!(
            cache.insert(0, at("a", 3, &[(0, 100)], 1)),
            Inserted::Duplicate
        );
        assert_eq!(
            cache.insert(0, at("a", 4, &[(0, 101)], 4)),
            Inserted::Accepted
        );
        assert_eq!(cache.queued(0), 4);
    }

    #[test]
    fn a_boundary_with_one_new_position_is_taken() {
        let mut cache = InputCache::new(names(), Strategy::Latest);
        cache.insert(0, at("a", 1, &[(0, 5), (1, 5)], 1));
        assert_eq!(
            cache.insert(0, at("a", 2, &[(0, 5), (1, 6)], 2)),
            Inserted::Accepted
        );
        assert_eq!(
            cache.insert(0, at("a", 3, &[(0, 4), (1, 6)], 3)),
            Inserted::Duplicate
        );
    }

    #[test]
    fn boundaries_without_positions_are_never_repeats() {
        let mut cache = InputCache::new(names(), Strategy::Sequential);
        assert_eq!(cache.insert(0, at("a", 1, &[], 1)), Inserted::Accepted);
        assert_eq!(cache.insert(0, at("a", 1, &[], 1)), Inserted::Accepted);
        assert_eq!(cache.queued(0), 2);
    }
}

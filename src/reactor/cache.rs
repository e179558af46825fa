//! The input cache: per source the value a fire sees, the queue (sequential strategy),
//! the dirty flag and the last sequence number seen (for dropping replayed boundaries).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{Criteria, Strategy};
use crate::accumulator::Boundary;

/// What the store keeps of a cache, so a respawned reactor resumes where it was.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct CacheSnapshot {
    pub fires: u64,
    pub sources: BTreeMap<String, SourceSnapshot>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SourceSnapshot {
    pub last_sequence: u64,
    pub dirty: bool,
    pub current: Option<Boundary>,
    pub queue: Vec<Boundary>,
}

/// Boundaries taken from the cache by one fire.
pub type Consumed = Vec<(usize, Arc<Boundary>)>;

#[derive(Debug, Default)]
struct Slot {
    current: Option<Arc<Boundary>>,
    queue: VecDeque<Arc<Boundary>>,
    dirty: bool,
    last_sequence: u64,
}

#[derive(Debug)]
pub struct InputCache {
    strategy: Strategy,
    names: Arc<[Arc<str>]>,
    slots: Vec<Slot>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Accepted,
    /// Same source and a sequence number already seen, as after a replay.
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
            let Some(stored) = snapshot.sources.get(&**name) else {
                continue;
            };
            let slot = &mut self.slots[i];
            slot.last_sequence = stored.last_sequence;
            slot.current = stored.current.clone().map(Arc::new);
            match self.strategy {
                Strategy::Latest => slot.dirty = stored.dirty,
                Strategy::Sequential => {
                    slot.queue = stored.queue.iter().cloned().map(Arc::new).collect();
                    slot.dirty = !slot.queue.is_empty();
                    queued[i] = slot.queue.len();
                }
            }
        }
        queued
    }

    pub fn insert(&mut self, source: usize, boundary: Boundary) -> Inserted {
        let slot = &mut self.slots[source];
        if boundary.sequence <= slot.last_sequence {
            return Inserted::Duplicate;
        }
        slot.last_sequence = boundary.sequence;
        let boundary = Arc::new(boundary);
        match self.strategy {
            Strategy::Latest => slot.current = Some(boundary),
            Strategy::Sequential => slot.queue.push_back(boundary),
        }
        slot.dirty = true;
        Inserted::Accepted
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
    pub fn take(&mut self) -> (Vec<Option<Arc<Boundary>>>, Consumed) {
        let mut consumed = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            match self.strategy {
                Strategy::Latest => {
                    if slot.dirty {
                        slot.dirty = false;
                        if let Some(b) = &slot.current {
                            consumed.push((i, b.clone()));
                        }
                    }
                }
                Strategy::Sequential => {
                    if let Some(head) = slot.queue.pop_front() {
                        consumed.push((i, head.clone()));
                        slot.current = Some(head);
                    }
                    slot.dirty = !slot.queue.is_empty();
                }
            }
        }
        (self.values(), consumed)
    }

    /// The value each source would show a fire now.
    pub fn values(&self) -> Vec<Option<Arc<Boundary>>> {
        self.slots.iter().map(|s| s.current.clone()).collect()
    }

    /// Replaces one source's current value (for `FireWith`), clearing its flag; the
    /// sequence number is kept so replay detection is unaffected.
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

    pub fn queued(&self, source: usize) -> usize {
        self.slots[source].queue.len()
    }

    pub fn last_sequence(&self, source: usize) -> u64 {
        self.slots[source].last_sequence
    }

    /// A snapshot for the store. Boundaries taken by fires whose outputs are not yet
    /// acknowledged go back in as unconsumed, so a crash before the acknowledgement
    /// fires them again instead of losing them.
    pub fn snapshot<'a>(
        &self,
        fires: u64,
        unacknowledged: impl Iterator<Item = &'a Consumed>,
    ) -> CacheSnapshot {
        let mut requeue: Vec<Vec<Boundary>> = vec![Vec::new(); self.slots.len()];
        for consumed in unacknowledged {
            for (i, b) in consumed {
                requeue[*i].push((**b).clone());
            }
        }
        let sources = self
            .names
            .iter()
            .zip(&self.slots)
            .zip(requeue)
            .map(|((name, slot), requeue)| {
                let mut stored = SourceSnapshot {
                    last_sequence: slot.last_sequence,
                    dirty: slot.dirty,
                    current: slot.current.as_deref().cloned(),
                    queue: Vec::new(),
                };
                match self.strategy {
                    Strategy::Latest => stored.dirty |= !requeue.is_empty(),
                    Strategy::Sequential => {
                        stored.queue = requeue;
                        stored
                            .queue
                            .extend(slot.queue.iter().map(|b| (**b).clone()));
                        stored.dirty = !stored.queue.is_empty();
                    }
                }
                (name.to_string(), stored)
            })
            .collect();
        CacheSnapshot { fires, sources }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names() -> Arc<[Arc<str>]> {
        vec![Arc::from("a"), Arc::from("b")].into()
    }

    fn b(source: &str, sequence: u64, value: i64) -> Boundary {
        Boundary {
            source: Arc::from(source),
            sequence,
            position: None,
            event_time_ms: 0,
            emit_time_ms: 0,
            value: json!(value),
        }
    }

    fn value(v: &Option<Arc<Boundary>>) -> Option<i64> {
        v.as_ref().and_then(|b| b.value.as_i64())
    }

    #[test]
    fn latest_keeps_the_newest() {
        let mut cache = InputCache::new(names(), Strategy::Latest);
        cache.insert(0, b("a", 1, 10));
        cache.insert(0, b("a", 2, 20));
        let (values, consumed) = cache.take();
        assert_eq!(value(&values[0]), Some(20));
        assert_eq!(values[1], None);
        assert_eq!(consumed.len(), 1);
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
        let (_, consumed) = cache.take();
        let snapshot = cache.snapshot(1, [&consumed].into_iter());
        let a = &snapshot.sources["a"];
        assert_eq!(
            a.queue.iter().map(|b| b.sequence).collect::<Vec<_>>(),
            vec![1, 2]
        );
        let mut restored = InputCache::new(names(), Strategy::Sequential);
        assert_eq!(restored.restore(&snapshot), vec![2, 0]);
        assert_eq!(restored.last_sequence(0), 2);
        assert_eq!(restored.insert(0, b("a", 2, 20)), Inserted::Duplicate);
    }
}

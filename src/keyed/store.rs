//! Where keyed graphs keep each key's reactor state: the [`KeyedStore`] role.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::graph::Key;
use crate::lease::Fence;
use crate::reactor::CacheSnapshot;
use crate::store_error::StoreError;

/// One batch of a partition's changes, written at once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyedChanges {
    /// Each changed key's cache, dirty flags, queues and fire count; the key; and the
    /// slot the store handed out for the key, if any ([`KeyedStore::key_slot`]).
    pub keys: Vec<(Key, Option<KeySlot>, CacheSnapshot)>,
    /// Per source, the last position applied in the partition.
    pub positions: BTreeMap<String, i64>,
    /// Set by an owner handing the partition over: its lease token and the time (ms).
    pub released: Option<(u64, i64)>,
    /// Where idle keys expire: each changed key's time (ms), its source's latest event
    /// time when the key last changed (the node's clock for a message without one). A
    /// key's stored time only moves forward.
    pub touched: Vec<(Key, i64)>,
    /// Keys idle past the graph's `key_idle`: their state and time removed.
    pub expired: Vec<Key>,
    /// Set by an owner whose graph no longer expires idle keys: every key's time is
    /// dropped, so that times gone stale meanwhile expire no key should expiry come back.
    pub drop_times: bool,
    /// Where idle keys expire: the highest fire number of any key of the partition so
    /// far, written with each batch.
    pub fire_high: Option<u64>,
    /// Where idle keys expire: where keys met afresh number their fires from, written
    /// with each removal of idle keys (the high as it stands then), so a key that
    /// expired and came back never repeats a number it had.
    pub fire_floor: Option<u64>,
}

impl KeyedChanges {
    /// `changes` with nothing in it, keeping the room its lists have for the next
    /// batch's.
    pub(crate) fn emptied(changes: KeyedChanges) -> Self {
        let KeyedChanges {
            mut keys,
            mut touched,
            mut expired,
            ..
        } = changes;
        keys.clear();
        touched.clear();
        expired.clear();
        Self {
            keys,
            touched,
            expired,
            ..Self::default()
        }
    }
}

/// Where a store kept in this process holds one key of a partition
/// ([`KeyedStore::key_slot`]), handed to the partition's owner and given back with the
/// key's changes, so that the store writes the key where it is instead of finding it by
/// name: a partition's keys run to hundreds of thousands, and finding each changed key
/// in a table of them all costs every batch write a wait on memory per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySlot(usize);

impl KeySlot {
    pub(crate) fn new(index: usize) -> Self {
        Self(index)
    }

    pub(crate) fn index(self) -> usize {
        self.0
    }
}

/// A partition's fire numbers as last written: see [`KeyedChanges::fire_floor`] and
/// [`KeyedChanges::fire_high`]; 0 where never written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FireNumbers {
    pub floor: u64,
    pub high: u64,
}

/// Per graph and partition: every key's state, and how far each source was applied.
#[async_trait]
pub trait KeyedStore: Send + Sync {
    /// The stored state of these keys, `None` for keys never stored, in the same order.
    async fn load_keys(
        &self,
        graph: &str,
        partition: i32,
        keys: &[String],
    ) -> Result<Vec<Option<CacheSnapshot>>, StoreError>;

    /// Per source, the last position applied in the partition.
    async fn load_positions(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<BTreeMap<String, i64>, StoreError>;

    /// The partition's fire numbers as last written.
    async fn load_fire_numbers(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<FireNumbers, StoreError>;

    /// The lease token and time (ms) of the partition's last clean hand-over, if any.
    async fn load_released(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<Option<(u64, i64)>, StoreError>;

    /// Whether the graph is paused (`weir graph pause`): its partitions read nothing
    /// until it is resumed, on whichever node owns them.
    async fn load_paused(&self, graph: &str) -> Result<bool, StoreError>;

    /// Up to `limit` keys of the partition whose last event's time, as written in
    /// [`KeyedChanges::touched`], is before `before_ms`: the oldest first, past the `skip`
    /// oldest (keys a caller keeps for now, say).
    async fn idle_keys(
        &self,
        graph: &str,
        partition: i32,
        before_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError>;

    /// Pauses or resumes the graph on every node running it.
    async fn save_paused(&self, graph: &str, paused: bool) -> Result<(), StoreError>;

    /// The key's slot, for a store kept in this process: where the key stays until it
    /// is removed, written or not. `None` for a store elsewhere. A slot is a hint: a
    /// write finds a key by name whenever its slot no longer holds it.
    fn key_slot(&self, _graph: &str, _partition: i32, _key: &Key) -> Option<KeySlot> {
        None
    }

    /// Writes a batch, all or nothing, refused whole once the fence's lease has a newer
    /// token. Only the partition's owner writes, in order, so its positions only move
    /// forward. A write that succeeds may take the keys out of `changes` (a store in
    /// memory keeps their snapshots as they are); one that fails leaves `changes` whole,
    /// to be written again.
    async fn save_keys(
        &self,
        graph: &str,
        partition: i32,
        changes: &mut KeyedChanges,
        fence: &Fence,
    ) -> Result<(), StoreError>;
}

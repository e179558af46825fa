//! Keyed graphs' per-key state on the memory store.

use super::*;

#[async_trait]
impl KeyedStore for MemoryStore {
    async fn load_keys(
        &self,
        graph: &str,
        partition: i32,
        keys: &[String],
    ) -> Result<Vec<Option<CacheSnapshot>>, StoreError> {
        let state = self.state()?;
        let stored = state.keyed.get(&(graph.to_string(), partition));
        Ok(keys
            .iter()
            .map(|k| stored.and_then(|s| s.keys.get(k.as_str())).cloned())
            .collect())
    }

    async fn load_positions(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<BTreeMap<String, i64>, StoreError> {
        let state = self.state()?;
        Ok(state
            .keyed
            .get(&(graph.to_string(), partition))
            .map(|s| s.positions.clone())
            .unwrap_or_default())
    }

    async fn load_released(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<Option<(u64, i64)>, StoreError> {
        let state = self.state()?;
        Ok(state
            .keyed
            .get(&(graph.to_string(), partition))
            .and_then(|s| s.released))
    }

    async fn idle_keys(
        &self,
        graph: &str,
        partition: i32,
        before_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        let state = self.state()?;
        let Some(stored) = state.keyed.get(&(graph.to_string(), partition)) else {
            return Ok(Vec::new());
        };
        Ok(stored
            .by_touch
            .iter()
            .take_while(|(at, _)| *at < before_ms)
            .skip(skip)
            .take(limit)
            .map(|(_, key)| key.to_string())
            .collect())
    }

    async fn load_fire_numbers(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<FireNumbers, StoreError> {
        let state = self.state()?;
        Ok(state
            .keyed
            .get(&(graph.to_string(), partition))
            .map(|s| s.fires)
            .unwrap_or_default())
    }

    async fn load_paused(&self, graph: &str) -> Result<bool, StoreError> {
        Ok(self.state()?.keyed_paused.contains(graph))
    }

    async fn save_paused(&self, graph: &str, paused: bool) -> Result<(), StoreError> {
        let mut state = self.state()?;
        if paused {
            state.keyed_paused.insert(graph.to_string());
        } else {
            state.keyed_paused.remove(graph);
        }
        Ok(())
    }

    fn key_slot(&self, graph: &str, partition: i32, key: &Key) -> Option<KeySlot> {
        let mut state = self.state().ok()?;
        let stored = state
            .keyed
            .entry((graph.to_string(), partition))
            .or_default();
        Some(KeySlot::new(stored.keys.slot(key)))
    }

    async fn save_keys(
        &self,
        graph: &str,
        partition: i32,
        changes: &mut KeyedChanges,
        fence: &Fence,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        check_fence(&state, Some(fence))?;
        let stored = state
            .keyed
            .entry((graph.to_string(), partition))
            .or_default();
        for (key, slot, _) in &changes.keys {
            stored.keys.warm(key, *slot);
        }
        for (key, slot, snapshot) in changes.keys.drain(..) {
            stored.keys.write(&key, slot, snapshot);
        }
        if changes.drop_times {
            stored.touched.clear();
            stored.by_touch.clear();
        }
        for (key, at) in changes.touched.drain(..) {
            let was = stored.touched.get(&key).copied();
            if was.is_some_and(|was| was >= at) {
                continue;
            }
            if let Some(was) = was {
                stored.by_touch.remove(&(was, key.clone()));
            }
            stored.touched.insert(key.clone(), at);
            stored.by_touch.insert((at, key));
        }
        if let Some(high) = changes.fire_high {
            stored.fires.high = high;
        }
        if let Some(floor) = changes.fire_floor {
            stored.fires.floor = floor;
        }
        for key in changes.expired.drain(..) {
            stored.keys.remove(&key);
            if let Some(was) = stored.touched.remove(&key) {
                stored.by_touch.remove(&(was, key));
            }
        }
        if let Some(released) = changes.released {
            stored.released = Some(released);
        }
        for (source, &position) in &changes.positions {
            let at = stored.positions.entry(source.clone()).or_insert(position);
            *at = (*at).max(position);
        }
        Ok(())
    }
}

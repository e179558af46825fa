//! Reactor cache snapshots on the memory store.

use super::*;

#[async_trait]
impl CacheStore for MemoryStore {
    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError> {
        Ok(self.state()?.caches.get(graph).cloned())
    }

    async fn save_cache(
        &self,
        graph: &str,
        snapshot: &CacheSnapshot,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let latency = self.cache_write_latency.load(Ordering::SeqCst);
        if latency > 0 {
            tokio::time::sleep(Duration::from_micros(latency)).await;
        }
        let mut state = self.state()?;
        check_fence(&state, fence)?;
        state.caches.insert(graph.to_string(), snapshot.clone());
        Ok(())
    }
}

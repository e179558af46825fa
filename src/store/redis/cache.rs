//! Reactor cache snapshots on the Redis store.

use super::*;

#[async_trait]
impl CacheStore for RedisStore {
    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError> {
        self.get_json(self.key(&["cache", graph])).await
    }

    async fn save_cache(
        &self,
        graph: &str,
        snapshot: &CacheSnapshot,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        self.set_fenced_json(self.key(&["cache", graph]), snapshot, fence)
            .await
    }
}

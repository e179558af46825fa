//! Accumulator checkpoints on the Redis store.

use super::*;

#[async_trait]
impl CheckpointStore for RedisStore {
    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError> {
        self.get_json(self.key(&["ckpt", graph, accumulator])).await
    }

    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        self.set_fenced_json(self.key(&["ckpt", graph, accumulator]), checkpoint, fence)
            .await
    }
}

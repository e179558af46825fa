//! Accumulator checkpoints on the memory store.

use super::*;

#[async_trait]
impl CheckpointStore for MemoryStore {
    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError> {
        Ok(self
            .state()?
            .checkpoints
            .get(&(graph.to_string(), accumulator.to_string()))
            .cloned())
    }

    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        check_fence(&state, fence)?;
        state.checkpoints.insert(
            (graph.to_string(), accumulator.to_string()),
            checkpoint.clone(),
        );
        Ok(())
    }
}

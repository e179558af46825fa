//! The recovery log on the memory store.

use super::*;

#[async_trait]
impl RecoveryLog for MemoryStore {
    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError> {
        let mut state = self.state();
        if state.recoveries.len() == RECOVERY_EVENTS_KEPT {
            state.recoveries.pop_front();
        }
        state.recoveries.push_back(event.clone());
        Ok(())
    }

    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        Ok(self
            .state()
            .recoveries
            .iter()
            .rev()
            .filter(|e| graph.is_none_or(|g| e.graph == g))
            .take(limit)
            .cloned()
            .collect())
    }
}

//! The recovery log on the memory store.

use super::*;

#[async_trait]
impl RecoveryLog for MemoryStore {
    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError> {
        let mut guard = self.state()?;
        // Through the guard once, so the two lists borrow apart.
        let state = &mut *guard;
        let tenant_list = crate::tenant::of_key(&event.graph).map(|tenant| {
            state
                .tenant_recoveries
                .entry(tenant.to_string())
                .or_default()
        });
        for list in std::iter::once(&mut state.recoveries).chain(tenant_list) {
            if list.len() == RECOVERY_EVENTS_KEPT {
                list.pop_front();
            }
            list.push_back(event.clone());
        }
        Ok(())
    }

    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        Ok(self
            .state()?
            .recoveries
            .iter()
            .rev()
            .filter(|e| graph.is_none_or(|g| e.graph == g))
            .take(limit)
            .cloned()
            .collect())
    }

    async fn tenant_recovery_events(
        &self,
        tenant: &str,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        Ok(self
            .state()?
            .tenant_recoveries
            .get(tenant)
            .map(|list| list.iter().rev().take(limit).cloned().collect())
            .unwrap_or_default())
    }
}

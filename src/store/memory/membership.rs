//! Group membership on the memory store.

use super::*;

#[async_trait]
impl MembershipStore for MemoryStore {
    async fn join_group(&self, group: &str, member: &str, ttl: Duration) -> Result<(), StoreError> {
        self.state()?
            .members
            .entry(group.to_string())
            .or_default()
            .insert(member.to_string(), Instant::now() + ttl);
        Ok(())
    }

    async fn leave_group(&self, group: &str, member: &str) -> Result<(), StoreError> {
        if let Some(members) = self.state()?.members.get_mut(group) {
            members.remove(member);
        }
        Ok(())
    }

    async fn group_members(&self, group: &str) -> Result<Vec<String>, StoreError> {
        let now = Instant::now();
        let mut state = self.state()?;
        let Some(members) = state.members.get_mut(group) else {
            return Ok(Vec::new());
        };
        members.retain(|_, expires| *expires > now);
        let mut live: Vec<String> = members.keys().cloned().collect();
        live.sort();
        Ok(live)
    }

    async fn settle_partition_count(
        &self,
        group: &str,
        partitions: u32,
    ) -> Result<u32, StoreError> {
        Ok(*self
            .state()?
            .partition_counts
            .entry(group.to_string())
            .or_insert(partitions))
    }
}

//! Job records, partition positions and timeouts on the memory store.

use super::*;

#[async_trait]
impl JobStore for MemoryStore {
    async fn load_jobs(
        &self,
        job_type: &str,
        ids: &[String],
    ) -> Result<Vec<Option<JobRecord>>, StoreError> {
        let state = self.state()?;
        Ok(ids
            .iter()
            .map(|id| state.jobs.get(&(job_type.to_string(), id.clone())).cloned())
            .collect())
    }

    async fn load_partition(
        &self,
        job_type: &str,
        partition: i32,
    ) -> Result<PartitionSnapshot, StoreError> {
        let state = self.state()?;
        let key = (job_type.to_string(), partition);
        let partition = state.job_partitions.get(&key);
        Ok(PartitionSnapshot {
            position: partition.and_then(|p| p.position),
            timeouts: partition
                .map(|p| {
                    let mut timeouts: Vec<(String, i64)> = p
                        .timeouts
                        .iter()
                        .map(|(id, due)| (id.clone(), *due))
                        .collect();
                    timeouts.sort_by_key(|(_, due)| *due);
                    timeouts
                })
                .unwrap_or_default(),
            released: partition.and_then(|p| p.released),
        })
    }

    async fn save_partition(
        &self,
        job_type: &str,
        partition: i32,
        changes: &PartitionChanges,
        fence: &Fence,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        check_fence(&state, Some(fence))?;
        let state = &mut *state;
        let stored = state
            .job_partitions
            .entry((job_type.to_string(), partition))
            .or_default();
        if let Some(position) = changes.position {
            stored.position = Some(position);
        }
        if let Some(released) = changes.released {
            stored.released = Some(released);
        }
        for record in &changes.put {
            match record.timeout_at_ms {
                Some(due) => stored.timeouts.insert(record.id.clone(), due),
                None => stored.timeouts.remove(&record.id),
            };
            state
                .jobs
                .insert((job_type.to_string(), record.id.clone()), record.clone());
        }
        for id in &changes.removed {
            stored.timeouts.remove(id);
            state.jobs.remove(&(job_type.to_string(), id.clone()));
        }
        Ok(())
    }

    async fn list_jobs(&self, job_type: &str) -> Result<Vec<String>, StoreError> {
        let state = self.state()?;
        let mut ids: Vec<String> = state
            .jobs
            .keys()
            .filter(|(t, _)| t == job_type)
            .map(|(_, id)| id.clone())
            .collect();
        ids.sort();
        Ok(ids)
    }
}

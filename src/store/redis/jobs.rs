//! Job records, partition positions and timeouts on the Redis store.
//!
//! Keys: `job:<type>:<id>` (the record, JSON), `jobs:<type>` (every id, a sorted set),
//! and per partition `jobs:<type>:position:<p>`, `jobs:<type>:timers:<p>` (id scored by
//! due ms) and `jobs:<type>:released:<p>` (`token:ms` of the last clean hand-over).

use super::*;

impl RedisStore {
    fn job_key(&self, job_type: &str, id: &str) -> String {
        self.key(&["job", job_type, id])
    }

    fn partition_key(&self, job_type: &str, what: &str, partition: i32) -> String {
        self.key(&["jobs", job_type, what, &partition.to_string()])
    }
}

#[async_trait]
impl JobStore for RedisStore {
    async fn load_jobs(
        &self,
        job_type: &str,
        ids: &[String],
    ) -> Result<Vec<Option<JobRecord>>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|id| self.job_key(job_type, id)).collect();
        let mut c = self.connection.clone();
        let raw: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("MGET", e))?;
        raw.into_iter()
            .zip(keys)
            .map(|(text, key)| {
                text.map(|text| {
                    serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                        key,
                        source: e.into(),
                    })
                })
                .transpose()
            })
            .collect()
    }

    async fn load_partition(
        &self,
        job_type: &str,
        partition: i32,
    ) -> Result<PartitionSnapshot, StoreError> {
        let mut c = self.connection.clone();
        let released_key = self.partition_key(job_type, "released", partition);
        // Scores are doubles, and Redis writes large ones in exponent form: read as such.
        let (position, timeouts, released): (Option<i64>, Vec<(String, f64)>, Option<String>) =
            redis::pipe()
                .get(self.partition_key(job_type, "position", partition))
                .zrange_withscores(self.partition_key(job_type, "timers", partition), 0, -1)
                .get(&released_key)
                .query_async(&mut c)
                .await
                .map_err(|e| store_error("load job partition", e))?;
        let released = match released {
            None => None,
            Some(text) => Some(
                text.split_once(':')
                    .and_then(|(token, at)| Some((token.parse().ok()?, at.parse().ok()?)))
                    .ok_or_else(|| StoreError::Corrupt {
                        key: released_key,
                        source: format!("{text:?} is not token:ms").into(),
                    })?,
            ),
        };
        Ok(PartitionSnapshot {
            position,
            timeouts: timeouts
                .into_iter()
                .map(|(id, due)| (id, due as i64))
                .collect(),
            released,
        })
    }

    async fn save_partition(
        &self,
        job_type: &str,
        partition: i32,
        changes: &PartitionChanges,
        fence: &Fence,
    ) -> Result<(), StoreError> {
        let index = self.key(&["jobs", job_type]);
        let timers = self.partition_key(job_type, "timers", partition);
        let mut writes = Vec::with_capacity(changes.put.len() * 3 + changes.removed.len() * 3 + 2);
        for record in &changes.put {
            writes.push(Write::Set(
                self.job_key(job_type, &record.id),
                Self::encode(record)?,
            ));
            writes.push(Write::Zadd(index.clone(), 0, record.id.clone()));
            writes.push(match record.timeout_at_ms {
                Some(due) => Write::Zadd(timers.clone(), due, record.id.clone()),
                None => Write::Zrem(timers.clone(), record.id.clone()),
            });
        }
        for id in &changes.removed {
            writes.push(Write::Del(self.job_key(job_type, id)));
            writes.push(Write::Zrem(index.clone(), id.clone()));
            writes.push(Write::Zrem(timers.clone(), id.clone()));
        }
        if let Some(position) = changes.position {
            writes.push(Write::Set(
                self.partition_key(job_type, "position", partition),
                position.to_string(),
            ));
        }
        if let Some((token, at)) = changes.released {
            writes.push(Write::Set(
                self.partition_key(job_type, "released", partition),
                format!("{token}:{at}"),
            ));
        }
        self.apply_writes("save job partition", writes, Some(fence))
            .await
    }

    async fn list_jobs(&self, job_type: &str) -> Result<Vec<String>, StoreError> {
        let mut c = self.connection.clone();
        c.zrange(self.key(&["jobs", job_type]), 0, -1)
            .await
            .map_err(|e| store_error("ZRANGE", e))
    }
}

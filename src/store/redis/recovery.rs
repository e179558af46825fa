//! The recovery log on the Redis store.

use super::*;

/// Recovery events kept per graph and in the global list.
const RECOVERY_EVENTS_KEPT: isize = 10_000;

#[async_trait]
impl RecoveryLog for RedisStore {
    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError> {
        let text = serde_json::to_string(event).map_err(|e| StoreError::Operation {
            operation: "encode",
            source: e.into(),
        })?;
        let per_graph = self.key(&["recovery", &event.graph]);
        let all = self.key(&["recovery"]);
        let mut c = self.connection.clone();
        redis::pipe()
            .atomic()
            .lpush(&per_graph, &text)
            .ltrim(&per_graph, 0, RECOVERY_EVENTS_KEPT - 1)
            .lpush(&all, &text)
            .ltrim(&all, 0, RECOVERY_EVENTS_KEPT - 1)
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("LPUSH", e))
    }

    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let key = match graph {
            Some(g) => self.key(&["recovery", g]),
            None => self.key(&["recovery"]),
        };
        let mut c = self.connection.clone();
        let raw: Vec<String> = c
            .lrange(&key, 0, limit as isize - 1)
            .await
            .map_err(|e| store_error("LRANGE", e))?;
        raw.into_iter()
            .map(|text| {
                serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                    key: key.clone(),
                    source: e.into(),
                })
            })
            .collect()
    }
}

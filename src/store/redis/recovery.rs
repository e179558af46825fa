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
        let per_tenant = crate::tenant::of_key(&event.graph).map(|t| self.tenant_list(t));
        let mut pipe = redis::pipe();
        pipe.atomic();
        for list in [Some(&per_graph), Some(&all), per_tenant.as_ref()]
            .into_iter()
            .flatten()
        {
            pipe.lpush(list, &text)
                .ltrim(list, 0, RECOVERY_EVENTS_KEPT - 1);
        }
        let mut c = self.connection.clone();
        pipe.query_async::<()>(&mut c)
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
        self.recovery_list(key, limit).await
    }

    async fn tenant_recovery_events(
        &self,
        tenant: &str,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        self.recovery_list(self.tenant_list(tenant), limit).await
    }
}

impl RedisStore {
    /// The list of a tenant's graphs' recovery events (apart from `recovery:<graph>`,
    /// whose second segment is a graph key).
    fn tenant_list(&self, tenant: &str) -> String {
        self.key(&["recovery-tenant", tenant])
    }

    /// The newest `limit` events of the list at `key`.
    async fn recovery_list(
        &self,
        key: String,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
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

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
            retryable: false,
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
        let mut events = self.recovery_list(self.tenant_list(tenant), limit).await?;
        if events.len() < limit {
            // A store written to before the per-tenant lists holds the tenant's earlier
            // events only in the list of all. Both lists get each event together, so the
            // tenant's newest there are the ones just read, and the rest follow them;
            // the two lists are read together, so an event recorded meanwhile shifts
            // neither against the other.
            let (own, all) = self.recovery_lists_together(tenant).await?;
            let listed = own.len();
            events = own;
            events.extend(
                all.into_iter()
                    .filter(|e| crate::tenant::of_key(&e.graph) == Some(tenant))
                    .skip(listed)
                    .take(limit.saturating_sub(listed)),
            );
            events.truncate(limit);
        }
        Ok(events)
    }
}

impl RedisStore {
    /// The list of a tenant's graphs' recovery events (apart from `recovery:<graph>`,
    /// whose second segment is a graph key).
    fn tenant_list(&self, tenant: &str) -> String {
        self.key(&["recovery-tenant", tenant])
    }

    /// A tenant's list and the list of all, read in one transaction.
    async fn recovery_lists_together(
        &self,
        tenant: &str,
    ) -> Result<(Vec<RecoveryEvent>, Vec<RecoveryEvent>), StoreError> {
        let (own_key, all_key) = (self.tenant_list(tenant), self.key(&["recovery"]));
        let mut c = self.connection.clone();
        let (own, all): (Vec<String>, Vec<String>) = redis::pipe()
            .atomic()
            .lrange(&own_key, 0, -1)
            .lrange(&all_key, 0, -1)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("LRANGE", e))?;
        Ok((decode_events(&own_key, own)?, decode_events(&all_key, all)?))
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
        decode_events(&key, raw)
    }
}

/// The events of the list at `key`, as stored there.
fn decode_events(key: &str, raw: Vec<String>) -> Result<Vec<RecoveryEvent>, StoreError> {
    raw.into_iter()
        .map(|text| {
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                key: key.to_string(),
                source: e.into(),
            })
        })
        .collect()
}

//! In-process store, the embedded default. State lives as long as the process.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Checkpoint, Lease, RecoveryEvent, Store, StoreError};
use crate::reactor::CacheSnapshot;

/// Recovery events kept per process; older ones are dropped first.
const RECOVERY_EVENTS_KEPT: usize = 10_000;

#[derive(Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    checkpoints: HashMap<(String, String), Checkpoint>,
    caches: HashMap<String, CacheSnapshot>,
    recoveries: VecDeque<RecoveryEvent>,
    leases: HashMap<String, HeldLease>,
    fencing: HashMap<String, u64>,
}

struct HeldLease {
    holder: String,
    token: u64,
    expires: Instant,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError> {
        Ok(self
            .state()
            .checkpoints
            .get(&(graph.to_string(), accumulator.to_string()))
            .cloned())
    }

    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
    ) -> Result<(), StoreError> {
        self.state().checkpoints.insert(
            (graph.to_string(), accumulator.to_string()),
            checkpoint.clone(),
        );
        Ok(())
    }

    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError> {
        Ok(self.state().caches.get(graph).cloned())
    }

    async fn save_cache(&self, graph: &str, snapshot: &CacheSnapshot) -> Result<(), StoreError> {
        self.state()
            .caches
            .insert(graph.to_string(), snapshot.clone());
        Ok(())
    }

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

    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        if let Some(held) = state.leases.get(name) {
            if held.expires > now && held.holder != holder {
                return Ok(None);
            }
            if held.expires > now && held.holder == holder {
                return Ok(Some(Lease {
                    name: name.to_string(),
                    holder: holder.to_string(),
                    token: held.token,
                }));
            }
        }
        let token = {
            let counter = state.fencing.entry(name.to_string()).or_insert(0);
            *counter += 1;
            *counter
        };
        state.leases.insert(
            name.to_string(),
            HeldLease {
                holder: holder.to_string(),
                token,
                expires: now + ttl,
            },
        );
        Ok(Some(Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            token,
        }))
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
        let now = Instant::now();
        let mut state = self.state();
        match state.leases.get_mut(&lease.name) {
            Some(held) if held.holder == lease.holder && held.token == lease.token => {
                if held.expires <= now {
                    return Ok(false);
                }
                held.expires = now + ttl;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        let mut state = self.state();
        match state.leases.get(&lease.name) {
            Some(held) if held.holder == lease.holder && held.token == lease.token => {
                state.leases.remove(&lease.name);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

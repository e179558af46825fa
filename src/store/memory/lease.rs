//! Leases and their fencing tokens on the memory store.

use super::*;

#[async_trait]
impl LeaseStore for MemoryStore {
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let now = Instant::now();
        let mut state = self.state()?;
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
        let mut state = self.state()?;
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

    async fn current_lease(&self, name: &str) -> Result<Option<Lease>, StoreError> {
        let state = self.state()?;
        Ok(state
            .leases
            .get(name)
            .filter(|held| held.expires > Instant::now())
            .map(|held| Lease {
                name: name.to_string(),
                holder: held.holder.clone(),
                token: held.token,
            }))
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        let mut state = self.state()?;
        match state.leases.get(&lease.name) {
            Some(held) if held.holder == lease.holder && held.token == lease.token => {
                state.leases.remove(&lease.name);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

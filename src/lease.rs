//! Leases as their holders see them: which process holds one, until when it surely
//! does, and the task that keeps it.
//!
//! A holder may act on a lease only before its [`Deadline`]: the send time of the last
//! acquisition or renewal the store confirmed, plus the TTL. The store starts the TTL
//! when it receives the command, never earlier, so the lease cannot have expired in the
//! store before the deadline passes here. A process paused past its deadline (a long GC
//! pause, SIGSTOP, a VM migration) finds it passed when it resumes, and stops before
//! publishing or writing anything more; the store's fencing check refuses whatever
//! slips through.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::store_error::StoreError;

/// A held lease. The fencing token grows with every acquisition of the same name, so a
/// consumer can reject work from a holder that has since lost the lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub token: u64,
}

/// What a lease holder's write carries: the store refuses the write once the lease has
/// been taken with a newer token, so a holder that lost its lease (paused past its TTL,
/// cut off) cannot overwrite its successor's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub lease: String,
    pub token: u64,
}

impl From<&Lease> for Fence {
    fn from(lease: &Lease) -> Self {
        Self {
            lease: lease.name.clone(),
            token: lease.token,
        }
    }
}

/// Where leases are taken, renewed and released. Every acquisition of a name gets a
/// larger fencing token than the one before.
#[async_trait]
pub trait LeaseStore: Send + Sync {
    /// Takes the lease if it is free or expired; `None` if someone else holds it.
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError>;

    /// Extends a lease still held by the same holder with the same token.
    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError>;

    /// Releases the lease only if it is still this holder's (compare and set).
    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError>;
}

/// Random per process: two processes given the same node id by mistake are still two
/// holders, and never share a lease.
static INSTANCE: LazyLock<u32> = LazyLock::new(rand::random);

/// The holder name this process uses for leases: the node id and the process instance.
pub fn holder(node_id: &str) -> String {
    format!("{node_id}#{:08x}", *INSTANCE)
}

/// The node id part of a holder name.
pub fn holder_node(holder: &str) -> &str {
    holder.rsplit_once('#').map_or(holder, |(node, _)| node)
}

/// Until when a lease is surely held. Clones share it: the keeper moves it on, the
/// holder's publishers and writers look at it.
#[derive(Debug, Clone)]
pub struct Deadline {
    at: Arc<Mutex<Instant>>,
}

impl Deadline {
    /// For a lease the store confirmed for a command sent at `sent`.
    pub fn new(sent: Instant, ttl: Duration) -> Self {
        Self {
            at: Arc::new(Mutex::new(sent + ttl)),
        }
    }

    /// A renewal sent at `sent` was confirmed.
    pub fn confirm(&self, sent: Instant, ttl: Duration) {
        let mut at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        *at = (*at).max(sent + ttl);
    }

    pub fn at(&self) -> Instant {
        *self.at.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn passed(&self) -> bool {
        Instant::now() >= self.at()
    }
}

/// A held lease with what its holder's writes carry.
#[derive(Debug, Clone)]
pub struct Held {
    pub lease: Lease,
    pub deadline: Deadline,
}

impl Held {
    pub fn fence(&self) -> Fence {
        Fence::from(&self.lease)
    }

    /// The fence a store write carries; refused here already once the deadline passed,
    /// since another node may hold the lease by then.
    pub fn write_fence(&self) -> Result<Fence, StoreError> {
        let fence = self.fence();
        if self.deadline.passed() {
            return Err(StoreError::Fenced {
                lease: fence.lease,
                token: fence.token,
            });
        }
        Ok(fence)
    }
}

/// Takes the lease `name` for this process if it is free; `None` if another holds it.
pub async fn acquire(
    store: &dyn LeaseStore,
    name: &str,
    node_id: &str,
    ttl: Duration,
) -> Result<Option<Held>, StoreError> {
    let sent = Instant::now();
    let lease = store.acquire_lease(name, &holder(node_id), ttl).await?;
    Ok(lease.map(|lease| Held {
        lease,
        deadline: Deadline::new(sent, ttl),
    }))
}

/// Renews a held lease once; true if the store confirmed it, moving the deadline on
/// from the send time. A late confirmation may leave the deadline passed: the deadline,
/// not this answer, says whether the holder may act.
pub async fn renew(store: &dyn LeaseStore, held: &Held, ttl: Duration) -> Result<bool, StoreError> {
    let sent = Instant::now();
    let renewed = store.renew_lease(&held.lease, ttl).await?;
    if renewed {
        held.deadline.confirm(sent, ttl);
    }
    Ok(renewed)
}

/// Keeps a lease: renews it every third of the TTL, and cancels `lost` when it is
/// taken over or its deadline passes unconfirmed.
pub async fn keep(
    store: Arc<dyn LeaseStore>,
    held: Held,
    ttl: Duration,
    lost: CancellationToken,
    cancel: CancellationToken,
) {
    let period = ttl / 3;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep_until(held.deadline.at()) => {
                if held.deadline.passed() {
                    warn!(lease = %held.lease.name, "lease deadline passed unconfirmed");
                    lost.cancel();
                    return;
                }
            }
            _ = tokio::time::sleep(period) => {}
        }
        let renewal =
            tokio::time::timeout_at(held.deadline.at(), renew(store.as_ref(), &held, ttl));
        match renewal.await {
            Ok(Ok(true)) if !held.deadline.passed() => {}
            Ok(Ok(true)) => {
                warn!(lease = %held.lease.name, "lease renewal confirmed after its deadline");
                lost.cancel();
                return;
            }
            Ok(Ok(false)) => {
                warn!(lease = %held.lease.name, "lease taken over");
                lost.cancel();
                return;
            }
            // Unconfirmed: the deadline stays where it was and decides.
            Ok(Err(e)) => warn!(lease = %held.lease.name, error = %e, "lease renewal failed"),
            Err(_) => {
                warn!(lease = %held.lease.name, "lease renewal unanswered by its deadline");
                lost.cancel();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;

    #[test]
    fn holders_of_one_node_id_differ_by_process_only() {
        assert!(holder("n1").starts_with("n1#"));
        assert_eq!(holder_node(&holder("n1")), "n1");
        assert_eq!(holder_node("plain"), "plain");
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_runs_from_the_send_time() {
        let sent = Instant::now();
        let deadline = Deadline::new(sent, Duration::from_secs(3));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(!deadline.passed());
        // A renewal sent earlier than the one already confirmed moves nothing back.
        deadline.confirm(sent, Duration::from_secs(1));
        assert_eq!(deadline.at(), sent + Duration::from_secs(3));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(deadline.passed());
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_lease_is_lost_once_the_store_stops_confirming() {
        let store: Arc<dyn LeaseStore> = Arc::new(MemoryStore::new());
        let ttl = Duration::from_secs(3);
        let held = acquire(store.as_ref(), "g", "n1", ttl)
            .await
            .unwrap()
            .unwrap();
        let (lost, cancel) = (CancellationToken::new(), CancellationToken::new());
        let keeper = tokio::spawn(keep(
            store.clone(),
            held.clone(),
            ttl,
            lost.clone(),
            cancel.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!lost.is_cancelled(), "renewed all along");
        // Another holder takes it once it is released behind the keeper's back.
        store.release_lease(&held.lease).await.unwrap();
        let other = store.acquire_lease("g", "n2#1", ttl).await.unwrap();
        assert!(other.is_some());
        tokio::time::timeout(ttl, lost.cancelled()).await.unwrap();
        keeper.await.unwrap();
    }
}

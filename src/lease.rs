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

    /// Who holds the lease now, if anyone: for operators asking where something runs.
    async fn current_lease(&self, name: &str) -> Result<Option<Lease>, StoreError>;
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
        self.check_deadline()?;
        Ok(self.fence())
    }

    /// Refused as [`Held::write_fence`] is once the deadline passed, for a holder about to
    /// publish rather than write: nothing is made when it has not.
    pub fn check_deadline(&self) -> Result<(), StoreError> {
        if self.deadline.passed() {
            return Err(StoreError::Fenced {
                lease: self.lease.name.clone(),
                token: self.lease.token,
            });
        }
        Ok(())
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

/// What a keeper does once a lease's deadline passes unconfirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtDeadline {
    /// Gives the lease up: `lost` is cancelled and the holder stops (a graph).
    GiveUp,
    /// Holds on and goes on renewing; only a takeover cancels `lost`. The holder decides
    /// what it may still do without a sure lease (a cron shard fires its
    /// `at_least_once` schedules from local state while the store is away).
    HoldOn,
}

/// Keeps a lease: renews it every third of the TTL, and cancels `lost` when it is
/// taken over, or (with [`AtDeadline::GiveUp`]) when its deadline passes unconfirmed.
/// Stops when `cancel` fires.
pub async fn keep(
    store: Arc<dyn LeaseStore>,
    held: Held,
    ttl: Duration,
    at_deadline: AtDeadline,
    lost: CancellationToken,
    cancel: CancellationToken,
) {
    let period = ttl / 3;
    let give_up = at_deadline == AtDeadline::GiveUp;
    // Whether the passed deadline was reported (holding on).
    let mut past_deadline = false;
    loop {
        if give_up && held.deadline.passed() {
            warn!(lease = %held.lease.name, "lease deadline passed unconfirmed");
            lost.cancel();
            return;
        }
        let next = Instant::now() + period;
        let wake = if held.deadline.passed() {
            next
        } else {
            next.min(held.deadline.at())
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep_until(wake) => {}
        }
        if held.deadline.passed() && !past_deadline {
            warn!(lease = %held.lease.name, "lease deadline passed unconfirmed");
            if give_up {
                lost.cancel();
                return;
            }
            past_deadline = true;
        }
        // A renewal may take until the deadline, or a period once it has passed.
        let answer_by = held.deadline.at().max(Instant::now() + period);
        let renewal = tokio::time::timeout_at(
            if give_up {
                held.deadline.at()
            } else {
                answer_by
            },
            renew(store.as_ref(), &held, ttl),
        );
        match renewal.await {
            Ok(Ok(true)) if !held.deadline.passed() => {
                if past_deadline {
                    warn!(lease = %held.lease.name, "lease confirmed again");
                    past_deadline = false;
                }
            }
            Ok(Ok(true)) if give_up => {
                warn!(lease = %held.lease.name, "lease renewal confirmed after its deadline");
                lost.cancel();
                return;
            }
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                warn!(lease = %held.lease.name, "lease taken over");
                lost.cancel();
                return;
            }
            // Unconfirmed: the deadline stays where it was and decides.
            Ok(Err(e)) => warn!(lease = %held.lease.name, error = %e, "lease renewal failed"),
            Err(_) if give_up => {
                warn!(lease = %held.lease.name, "lease renewal unanswered by its deadline");
                lost.cancel();
                return;
            }
            Err(_) => warn!(lease = %held.lease.name, "lease renewal unanswered"),
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
            AtDeadline::GiveUp,
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

    /// A lease store that can be cut off.
    struct Flaky {
        inner: MemoryStore,
        down: std::sync::atomic::AtomicBool,
    }

    impl Flaky {
        fn check(&self) -> Result<(), StoreError> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Unreachable {
                    what: "test store".into(),
                    source: "cut off".into(),
                });
            }
            Ok(())
        }
    }

    #[async_trait]
    impl LeaseStore for Flaky {
        async fn acquire_lease(
            &self,
            name: &str,
            holder: &str,
            ttl: Duration,
        ) -> Result<Option<Lease>, StoreError> {
            self.check()?;
            self.inner.acquire_lease(name, holder, ttl).await
        }

        async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
            self.check()?;
            self.inner.renew_lease(lease, ttl).await
        }

        async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
            self.check()?;
            self.inner.release_lease(lease).await
        }

        async fn current_lease(&self, name: &str) -> Result<Option<Lease>, StoreError> {
            self.check()?;
            self.inner.current_lease(name).await
        }
    }

    /// Keeps a lease on a store that is cut off after a while and back 10 s later;
    /// returns whether `lost` was cancelled while it was away, and after.
    async fn cut_off_for_a_while(at_deadline: AtDeadline) -> (bool, bool) {
        let store = Arc::new(Flaky {
            inner: MemoryStore::new(),
            down: false.into(),
        });
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
            at_deadline,
            lost.clone(),
            cancel.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!lost.is_cancelled(), "renewed while the store answered");
        store.down.store(true, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(held.deadline.passed());
        let while_away = lost.is_cancelled();
        store.down.store(false, std::sync::atomic::Ordering::SeqCst);
        // The store let the lease expire meanwhile: the next renewal is refused.
        tokio::time::sleep(ttl).await;
        let after = lost.is_cancelled();
        cancel.cancel();
        keeper.await.unwrap();
        (while_away, after)
    }

    #[tokio::test(start_paused = true)]
    async fn giving_up_loses_the_lease_at_its_deadline() {
        assert_eq!(cut_off_for_a_while(AtDeadline::GiveUp).await, (true, true));
    }

    #[tokio::test(start_paused = true)]
    async fn holding_on_loses_the_lease_only_once_the_store_says_so() {
        assert_eq!(cut_off_for_a_while(AtDeadline::HoldOn).await, (false, true));
    }
}

//! Partitions owned one node at a time, through leases: the scale-out of work that is
//! split by key (the jobs of a type, a keyed graph).
//!
//! Every node serving a group announces itself in the store ([`MembershipStore`]) and
//! sees the live members. Partition `p` belongs to the `p mod n`-th of the `n` live node
//! ids, sorted: every node computes the same spread from the same list, so no
//! coordinator is needed. The same holds on every broker, Kafka included: the hand-over
//! below runs in weir's own code, with a fencing token per partition, rather than in a
//! consumer group's rebalance callback. Nor does a consumer group pick the owners: a
//! group coordinator that stalls (one Kafka-compatible broker assigned nothing for over a
//! minute once a member left during a rebalance) would stall every partition with it.
//!
//! A node takes the lease of each partition it should own once that lease is free, and
//! runs the partition ([`PartitionWork`]) while it keeps the lease. A partition it
//! should no longer own (a node joined) is handed over in order: its work is told to
//! release (it finishes what is in flight, stores its state and commits its positions),
//! and only once the work returned is the lease released, so the next owner starts from
//! everything the last one did. A node that dies holds its leases until they expire;
//! its writes are fenced by the lease tokens, so a node paused past its TTL cannot
//! overwrite its successor's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use crate::lease::{self, holder_node, AtDeadline, Held, LeaseStore};
use crate::store_error::StoreError;

/// Where the members of a group announce themselves.
#[async_trait]
pub trait MembershipStore: Send + Sync {
    /// Announces `member` of `group` as live for `ttl`.
    async fn join_group(&self, group: &str, member: &str, ttl: Duration) -> Result<(), StoreError>;

    /// Withdraws `member` at once, so the others take its partitions without waiting
    /// for its announcement to expire.
    async fn leave_group(&self, group: &str, member: &str) -> Result<(), StoreError>;

    /// The members whose announcement has not expired, sorted.
    async fn group_members(&self, group: &str) -> Result<Vec<String>, StoreError>;

    /// Records `partitions` as the group's partition count unless one is recorded
    /// already; returns the recorded count.
    async fn settle_partition_count(&self, group: &str, partitions: u32)
        -> Result<u32, StoreError>;
}

/// Why a group's partitions cannot be owned with the count they have now.
#[derive(Debug, thiserror::Error)]
pub enum PartitionCountError {
    /// A key's partition is its hash modulo the count: with another count keys would be
    /// read on other partitions than the one their stored state is in, and two owners
    /// would each keep a state for them.
    #[error(
        "{group} first ran with {recorded} partitions and has {now} now: keys would be read \
         on other partitions than their stored state; keep {recorded} partitions, or run \
         it under a new name"
    )]
    Changed {
        group: String,
        recorded: u32,
        now: u32,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Checks the group runs with the partition count it first ran with, recording it on
/// the first run.
pub async fn check_partition_count(
    store: &dyn MembershipStore,
    group: &str,
    partitions: u32,
) -> Result<(), PartitionCountError> {
    let recorded = store.settle_partition_count(group, partitions).await?;
    if recorded != partitions {
        return Err(PartitionCountError::Changed {
            group: group.to_string(),
            recorded,
            now: partitions,
        });
    }
    Ok(())
}

/// What owning partitions needs of a store: leases and membership.
pub trait OwnershipStore: LeaseStore + MembershipStore {}

impl<T: LeaseStore + MembershipStore + ?Sized> OwnershipStore for T {}

/// What runs an owned partition.
#[async_trait]
pub trait PartitionWork: Send + Sync + 'static {
    /// Runs `partition` under the lease `held` until one of:
    /// - `release`: the partition is handed over. Finish what is in flight, store the
    ///   state, commit positions, then return; the lease is released after.
    /// - `lost`: the lease is gone (taken over, or its deadline passed). Stop at once and
    ///   write nothing more; writes still under way are refused by their fence.
    ///
    /// Failures are the work's to retry: it returns when told to, or once it finds its
    /// writes fenced (the partition has a newer owner).
    async fn run(
        &self,
        partition: i32,
        held: Held,
        release: CancellationToken,
        lost: CancellationToken,
    );
}

/// How long a handed-over partition's work may take to finish, by default.
pub const RELEASE_TIMEOUT: Duration = Duration::from_secs(30);

/// How a group's partitions are owned.
#[derive(Debug, Clone)]
pub struct OwnershipSettings {
    /// The group's name, which names its leases (`<group>.<partition>`) and its members'
    /// announcements: `jobs.<type>`.
    pub group: String,
    pub partitions: u32,
    pub node_id: String,
    /// Lease and membership TTL: how long a dead node's partitions wait for a new owner.
    pub ttl: Duration,
    /// How long a handed-over partition's work may take to finish before its lease is
    /// released anyway (its writes stay fenced).
    pub release_timeout: Duration,
}

impl OwnershipSettings {
    pub fn new(group: impl Into<String>, partitions: u32, node_id: impl Into<String>) -> Self {
        Self {
            group: group.into(),
            partitions: partitions.max(1),
            node_id: node_id.into(),
            ttl: Duration::from_secs(6),
            release_timeout: RELEASE_TIMEOUT,
        }
    }

    /// The lease of one partition.
    pub fn lease_name(&self, partition: i32) -> String {
        partition_lease(&self.group, partition)
    }
}

/// The lease owning `partition` of `group`.
pub fn partition_lease(group: &str, partition: i32) -> String {
    format!("{group}.{partition}")
}

/// The partitions node `node` should own among the live `nodes` (sorted, distinct):
/// every `nodes.len()`th, from its place in the list; none when it is not among them.
pub fn spread(partitions: u32, nodes: &[String], node: &str) -> Vec<i32> {
    let Some(place) = nodes.iter().position(|m| m == node) else {
        return Vec::new();
    };
    (0..partitions as usize)
        .filter(|p| p % nodes.len() == place)
        .map(|p| p as i32)
        .collect()
}

/// Why a partition's work stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    /// Lost while waiting to run a failed fire again: the fire is left to whoever
    /// serves the partition next, from the positions written.
    #[error("lost the partition while waiting to run a failed fire again")]
    StoppedRetrying,
}

/// Serves one partition through `attempt` (given a token cancelled on release or loss,
/// and whether this is the first attempt) until an attempt returns `Ok`, finds its
/// writes fenced (the partition has a newer owner), or `release` or `lost` fire while it
/// waits. After any other failure it starts again from the store, pausing 100 ms
/// doubling to 5 s: what was applied but not written is read again from the positions
/// written, so nothing is lost and nothing applied twice.
pub async fn serve_partition<F, Fut>(
    group: &str,
    partition: i32,
    release: &CancellationToken,
    lost: &CancellationToken,
    mut attempt: F,
) where
    F: FnMut(CancellationToken, bool) -> Fut,
    Fut: std::future::Future<Output = Result<(), PartitionError>>,
{
    let mut pause = Duration::from_millis(100);
    let mut first = true;
    loop {
        let stopping = Either::new(release, lost);
        let failure = match attempt(stopping.token.clone(), first).await {
            Ok(()) => return,
            Err(e) => e,
        };
        first = false;
        if let PartitionError::Store(StoreError::Fenced { .. }) = failure {
            warn!(%group, partition, "partition taken over; stopping");
            return;
        }
        warn!(%group, partition, error = %failure, "partition failed; starting again from the store");
        // A partition that failed because it was let go or lost is no failure to alert on.
        if !release.is_cancelled() && !lost.is_cancelled() {
            crate::metrics::partition_failed(group);
        }
        tokio::select! {
            _ = release.cancelled() => return,
            _ = lost.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Tries of a partition's store call (a batch's write, a key's or a job's load): a call
/// that fails with an error a retry may help with (a store away for a moment) is made
/// again after a pause, for up to half the lease TTL. Failing the attempt at once would
/// serve the partition again from what is stored, and publish again the outputs it
/// published since its last write. Past that budget the attempt fails after all: a
/// store that stays away, or keeps refusing the call while the lease renews, costs the
/// partition a restart from the store (retried with backoff) rather than an unbounded
/// wait, and a hand-over no more than the budget. Each try is bounded by the store's own
/// timeouts; the caller makes it after [`Held::write_fence`], which refuses once the
/// lease's deadline passed.
pub struct StoreRetry<'a> {
    group: &'a str,
    partition: i32,
    lost: &'a CancellationToken,
    budget: Duration,
    /// When the first try failed.
    since: Option<tokio::time::Instant>,
    pause: Duration,
}

impl<'a> StoreRetry<'a> {
    pub fn new(
        group: &'a str,
        partition: i32,
        lease_ttl: Duration,
        lost: &'a CancellationToken,
    ) -> Self {
        Self {
            group,
            partition,
            lost,
            budget: lease_ttl / 2,
            since: None,
            pause: Duration::from_millis(50),
        }
    }

    /// After a failed try: returns once the call is worth making again (the pause
    /// between tries doubles from 50 ms to 1 s), or the error to give up with, when no
    /// retry helps (the lease has a newer holder, a corrupt value), the budget is spent
    /// or the partition is lost meanwhile.
    pub async fn after(&mut self, error: StoreError) -> Result<(), PartitionError> {
        let since = *self.since.get_or_insert_with(tokio::time::Instant::now);
        let pause = self.pause;
        if !error.is_retryable() || since.elapsed() + pause > self.budget {
            return Err(error.into());
        }
        let (group, partition) = (self.group, self.partition);
        warn!(%group, partition, %error, ?pause, "cannot reach the store for the partition; trying again");
        tokio::select! {
            _ = self.lost.cancelled() => return Err(error.into()),
            _ = tokio::time::sleep(pause) => {}
        }
        self.pause = (pause * 2).min(Duration::from_secs(1));
        Ok(())
    }
}

/// A token cancelled once either of two is: what a partition's work waits on when any
/// reason to stop will do (a publish retried while the broker is away).
pub struct Either {
    pub token: CancellationToken,
    _watch: AbortOnDropHandle<()>,
}

impl Either {
    pub fn new(a: &CancellationToken, b: &CancellationToken) -> Self {
        let token = CancellationToken::new();
        let watch = {
            let (a, b, token) = (a.clone(), b.clone(), token.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = a.cancelled() => {}
                    _ = b.cancelled() => {}
                }
                token.cancel();
            })
        };
        Self {
            token,
            _watch: AbortOnDropHandle::new(watch),
        }
    }
}

/// A partition this node runs.
struct Owned {
    held: Held,
    release: CancellationToken,
    lost: CancellationToken,
    /// Aborted when dropped: an owner that stops without handing over (its task is
    /// aborted) leaves nothing running.
    work: AbortOnDropHandle<()>,
    /// Stops the lease keeper when the partition is dropped.
    _keeper: DropGuard,
}

/// Owns this node's share of the group's partitions until `cancel` fires, then hands
/// every partition over and leaves the group.
///
/// Stopping takes at most the release timeout, plus the store calls that release the
/// leases: every partition's work is told to release the moment `cancel` fires, a
/// hand-over already under way included, and all of them share one deadline counted
/// from then.
pub async fn own(
    store: Arc<dyn OwnershipStore>,
    settings: OwnershipSettings,
    work: Arc<dyn PartitionWork>,
    cancel: CancellationToken,
) {
    let member = lease::holder(&settings.node_id);
    let mut owned: BTreeMap<i32, Owned> = BTreeMap::new();
    let period = settings.ttl / 3;
    // Partitions due to this node that another still holds are looked at again soon:
    // their owner is handing them over.
    let retry = (settings.ttl / 24).max(Duration::from_millis(50));
    let mut stopped_at = None;
    loop {
        let round = balance(&store, &settings, &member, &mut owned, &work, &cancel);
        tokio::pin!(round);
        // A round handing partitions over may still be at it when the node is told to
        // stop: it finishes (the works it waits for were told to release too), and the
        // time the stop came is kept for the deadline of the rest.
        let finished = tokio::select! {
            outcome = &mut round => Some(outcome),
            _ = cancel.cancelled() => None,
        };
        let outcome = match finished {
            Some(outcome) => outcome,
            None => {
                stopped_at = Some(Instant::now());
                round.await
            }
        };
        let waiting = match outcome {
            Ok(pending) => pending,
            Err(e) => {
                warn!(group = %settings.group, error = %e, "cannot balance partitions");
                false
            }
        };
        if cancel.is_cancelled() {
            break;
        }
        let pause = if waiting { retry } else { period };
        tokio::select! {
            _ = cancel.cancelled() => {
                stopped_at = Some(Instant::now());
                break;
            }
            _ = tokio::time::sleep(pause) => {}
        }
    }
    let deadline = stopped_at.unwrap_or_else(Instant::now) + settings.release_timeout;
    if let Err(e) = store.leave_group(&settings.group, &member).await {
        warn!(group = %settings.group, error = %e, "cannot leave the group; its members see it gone within the TTL");
    }
    let all: Vec<(i32, Owned)> = std::mem::take(&mut owned).into_iter().collect();
    let partitions: Vec<i32> = all.iter().map(|(p, _)| *p).collect();
    info!(group = %settings.group, ?partitions, "stopping: handing partitions over");
    futures::future::join_all(
        all.into_iter()
            .map(|(partition, o)| hand_over(store.as_ref(), &settings, partition, o, deadline)),
    )
    .await;
}

/// One round: announce this node, drop what it should no longer own and take what it
/// should. Returns whether a partition due to this node is still held elsewhere. Once
/// `cancel` fired it hands nothing over and takes nothing: stopping hands over all.
async fn balance(
    store: &Arc<dyn OwnershipStore>,
    settings: &OwnershipSettings,
    member: &str,
    owned: &mut BTreeMap<i32, Owned>,
    work: &Arc<dyn PartitionWork>,
    cancel: &CancellationToken,
) -> Result<bool, StoreError> {
    // Partitions whose lease was lost: their work has stopped.
    let lost: Vec<i32> = owned
        .iter()
        .filter(|(_, o)| o.lost.is_cancelled() || o.work.is_finished())
        .map(|(p, _)| *p)
        .collect();
    for partition in lost {
        if let Some(o) = owned.remove(&partition) {
            warn!(group = %settings.group, partition, "partition lost");
            let deadline = Instant::now() + settings.release_timeout;
            hand_over(store.as_ref(), settings, partition, o, deadline).await;
        }
    }
    store
        .join_group(&settings.group, member, settings.ttl)
        .await?;
    // Spread over node ids: a node restarted after a kill is announced twice (its old
    // process until the announcement expires) but counts once.
    let mut nodes: Vec<String> = store
        .group_members(&settings.group)
        .await?
        .iter()
        .map(|m| holder_node(m).to_string())
        .collect();
    nodes.push(settings.node_id.clone());
    nodes.sort();
    nodes.dedup();
    if cancel.is_cancelled() {
        return Ok(false);
    }
    let due = spread(settings.partitions, &nodes, &settings.node_id);
    let surplus: Vec<i32> = owned.keys().filter(|p| !due.contains(p)).copied().collect();
    let surplus: Vec<(i32, Owned)> = surplus
        .into_iter()
        .filter_map(|p| owned.remove(&p).map(|o| (p, o)))
        .collect();
    if !surplus.is_empty() {
        let partitions: Vec<i32> = surplus.iter().map(|(p, _)| *p).collect();
        info!(group = %settings.group, ?partitions, "handing partitions over");
        // Together: each waits for its work to finish, which may take a while.
        let deadline = Instant::now() + settings.release_timeout;
        let handing_over = futures::future::join_all(
            surplus
                .into_iter()
                .map(|(partition, o)| hand_over(store.as_ref(), settings, partition, o, deadline)),
        );
        // Meanwhile this node keeps announcing itself: gone from the members' list, it
        // would have its other partitions spread over the rest, who would then wait
        // on leases it still holds.
        let announcing = async {
            loop {
                tokio::time::sleep(settings.ttl / 3).await;
                if let Err(e) = store
                    .join_group(&settings.group, member, settings.ttl)
                    .await
                {
                    warn!(group = %settings.group, error = %e, "cannot announce this node while handing partitions over");
                }
            }
        };
        tokio::select! {
            _ = handing_over => {}
            _ = announcing => {}
        }
    }
    // Told to stop during the hand-over: the stop hands over what is left.
    if cancel.is_cancelled() {
        return Ok(false);
    }
    let mut waiting = false;
    for partition in due {
        if owned.contains_key(&partition) {
            continue;
        }
        let name = settings.lease_name(partition);
        let Some(held) =
            lease::acquire(store.as_ref(), &name, &settings.node_id, settings.ttl).await?
        else {
            waiting = true;
            continue;
        };
        info!(group = %settings.group, partition, token = held.lease.token, "partition taken");
        crate::metrics::partition_taken(&settings.group);
        // A child of `cancel`: when the node stops, every work starts releasing at once.
        let release = cancel.child_token();
        let lost = CancellationToken::new();
        let keeper_stop = CancellationToken::new();
        let lease_store: Arc<dyn LeaseStore> = store.clone();
        tokio::spawn(lease::keep(
            lease_store,
            held.clone(),
            settings.ttl,
            AtDeadline::GiveUp,
            lost.clone(),
            keeper_stop.clone(),
        ));
        let task = {
            let work = work.clone();
            let (held, release, lost) = (held.clone(), release.clone(), lost.clone());
            tokio::spawn(async move { work.run(partition, held, release, lost).await })
        };
        owned.insert(
            partition,
            Owned {
                held,
                release,
                lost,
                work: AbortOnDropHandle::new(task),
                _keeper: keeper_stop.drop_guard(),
            },
        );
    }
    Ok(waiting)
}

/// Lets a partition's work finish (until `deadline`), stops its keeper, then releases
/// its lease.
async fn hand_over(
    store: &dyn OwnershipStore,
    settings: &OwnershipSettings,
    partition: i32,
    owned: Owned,
    deadline: Instant,
) {
    let Owned {
        held,
        release,
        lost,
        work,
        _keeper,
    } = owned;
    release.cancel();
    crate::metrics::partition_dropped(&settings.group);
    match tokio::time::timeout_at(deadline, work).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            warn!(group = %settings.group, partition, error = %e, "partition work failed");
        }
        // Dropping the work aborts it; its writes stay fenced.
        Err(_) => {
            warn!(group = %settings.group, partition, "partition work did not finish in time; its lease is released anyway");
        }
    }
    drop(_keeper);
    if !lost.is_cancelled() {
        if let Err(e) = store.release_lease(&held.lease).await {
            warn!(group = %settings.group, partition, error = %e, "cannot release the partition; it frees within the TTL");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::store::memory::MemoryStore;

    /// A partition's work that takes `finish` to finish once told to release.
    struct SlowToRelease {
        finish: Duration,
        running: AtomicUsize,
        releasing: AtomicUsize,
        finished: AtomicUsize,
    }

    #[async_trait]
    impl PartitionWork for SlowToRelease {
        async fn run(
            &self,
            _partition: i32,
            _held: Held,
            release: CancellationToken,
            lost: CancellationToken,
        ) {
            self.running.fetch_add(1, Ordering::SeqCst);
            tokio::select! {
                _ = release.cancelled() => {}
                _ = lost.cancelled() => return,
            }
            self.releasing.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.finish).await;
            self.finished.fetch_add(1, Ordering::SeqCst);
        }
    }

    async fn wait_until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..600 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{what} did not happen");
    }

    /// Node `a` owns all four partitions, whose works take `finish` to finish once told
    /// to release; `b` joins, so `a` hands two over; 11 s into that, `a` is told to
    /// stop. Returns how long `a` took to stop from then, and how many works finished.
    async fn stop_mid_hand_over(finish: Duration) -> (Duration, usize) {
        let store: Arc<dyn OwnershipStore> = Arc::new(MemoryStore::new());
        let slow = |finish| {
            Arc::new(SlowToRelease {
                finish,
                running: AtomicUsize::new(0),
                releasing: AtomicUsize::new(0),
                finished: AtomicUsize::new(0),
            })
        };
        let work = slow(finish);
        let settings = |node: &str| OwnershipSettings::new("slow", 4, node);
        let stop_a = CancellationToken::new();
        let a = tokio::spawn(own(
            store.clone(),
            settings("a"),
            work.clone(),
            stop_a.clone(),
        ));
        wait_until("a owning every partition", || {
            work.running.load(Ordering::SeqCst) == 4
        })
        .await;
        let stop_b = CancellationToken::new();
        let b = tokio::spawn(own(
            store.clone(),
            settings("b"),
            slow(Duration::ZERO),
            stop_b.clone(),
        ));
        wait_until("a handing two partitions over", || {
            work.releasing.load(Ordering::SeqCst) == 2
        })
        .await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        // However long the hand-over takes, `a` stays a member: `b` never counts on
        // partitions `a` still holds.
        for _ in 0..10 {
            let members = store.group_members("slow").await.unwrap();
            assert!(
                members.iter().any(|m| holder_node(m) == "a"),
                "a left the members during its hand-over: {members:?}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        stop_a.cancel();
        let stopping = Instant::now();
        tokio::time::timeout(RELEASE_TIMEOUT * 3, a)
            .await
            .expect("a stops")
            .unwrap();
        let took = stopping.elapsed();
        stop_b.cancel();
        b.await.unwrap();
        (took, work.finished.load(Ordering::SeqCst))
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_stopping_mid_hand_over_lets_every_partition_finish_together() {
        // Each takes 20 s: all four finish, the last about 20 s after the stop, where
        // handing the rest over only after the hand-over under way took 39 s.
        let (took, finished) = stop_mid_hand_over(Duration::from_secs(20)).await;
        assert_eq!(finished, 4, "none was cut off");
        assert!(took < Duration::from_secs(21), "stopped in {took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_stopping_mid_hand_over_stops_within_the_release_timeout_of_the_stop() {
        // Works that never finish are cut off at one release timeout after the stop,
        // the hand-over under way and the rest alike.
        let (took, finished) = stop_mid_hand_over(Duration::from_secs(3600)).await;
        assert_eq!(finished, 0);
        assert!(
            took <= RELEASE_TIMEOUT + Duration::from_secs(1),
            "stopped in {took:?}"
        );
    }

    fn members(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn every_partition_has_exactly_one_member() {
        for count in 1..5 {
            let names: Vec<String> = (0..count).map(|i| format!("n{i}")).collect();
            let mut seen = Vec::new();
            for n in &names {
                seen.extend(spread(6, &names, n));
            }
            seen.sort();
            assert_eq!(seen, (0..6).collect::<Vec<_>>(), "{count} members");
        }
        assert_eq!(spread(6, &members(&["a", "b"]), "c"), Vec::<i32>::new());
        assert_eq!(spread(6, &members(&["a", "b"]), "b"), vec![1, 3, 5]);
    }

    #[tokio::test(start_paused = true)]
    async fn each_failure_of_a_partition_counts_until_it_is_served_through() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        // The test runs on one thread, which the local recorder covers.
        let _recording = metrics::set_default_local_recorder(&recorder);
        let (release, lost) = (CancellationToken::new(), CancellationToken::new());
        let mut attempts = 0;
        serve_partition("jobs.counter", 2, &release, &lost, |_, _| {
            attempts += 1;
            let failing = attempts <= 3;
            async move {
                if failing {
                    Err(PartitionError::Store(store_away()))
                } else {
                    Ok(())
                }
            }
        })
        .await;
        assert_eq!(attempts, 4);
        let text = handle.render();
        assert!(
            text.contains(r#"weir_partition_failures_total{group="jobs.counter"} 3"#),
            "{text}"
        );

        // A partition taken over by a newer owner stops; that is no failure.
        serve_partition("graph.g", 0, &release, &lost, |_, _| async {
            Err(PartitionError::Store(StoreError::Fenced {
                lease: "weir:lease:graph.g:0".into(),
                token: 7,
            }))
        })
        .await;
        assert!(!handle.render().contains(r#"group="graph.g""#));
    }

    fn store_away() -> StoreError {
        StoreError::Unreachable {
            what: "redis GET".into(),
            source: "connection refused".into(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_call_is_tried_again_for_half_the_lease_ttl_then_given_up() {
        let lost = CancellationToken::new();
        let mut retry = StoreRetry::new("g", 0, Duration::from_secs(10), &lost);
        let started = tokio::time::Instant::now();
        let mut pauses = Vec::new();
        let mut before = started;
        let given_up = loop {
            match retry.after(store_away()).await {
                Ok(()) => {
                    pauses.push(before.elapsed().as_millis());
                    before = tokio::time::Instant::now();
                }
                Err(e) => break e,
            }
        };
        // Pauses double from 50 ms up to 1 s; the next one would end past 5 s.
        assert_eq!(pauses, [50, 100, 200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(started.elapsed(), Duration::from_millis(4550));
        assert!(
            matches!(
                given_up,
                PartitionError::Store(StoreError::Unreachable { .. })
            ),
            "{given_up:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_call_no_retry_helps_is_given_up_at_once() {
        let lost = CancellationToken::new();
        let mut retry = StoreRetry::new("g", 0, Duration::from_secs(10), &lost);
        let started = tokio::time::Instant::now();
        let fenced = StoreError::Fenced {
            lease: "weir:lease:g:0".into(),
            token: 3,
        };
        let given_up = retry.after(fenced).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert!(
            matches!(given_up, PartitionError::Store(StoreError::Fenced { .. })),
            "{given_up:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_call_waiting_to_be_tried_again_is_given_up_when_the_partition_is_lost() {
        let lost = CancellationToken::new();
        let mut retry = StoreRetry::new("g", 0, Duration::from_secs(10), &lost);
        for _ in 0..5 {
            retry.after(store_away()).await.expect("within the budget");
        }
        // The next pause is 1 s; the partition is lost 10 ms into it.
        let started = tokio::time::Instant::now();
        let losing = lost.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            losing.cancel();
        });
        assert!(retry.after(store_away()).await.is_err());
        assert_eq!(started.elapsed(), Duration::from_millis(10));
    }
}

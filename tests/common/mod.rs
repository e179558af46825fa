//! Helpers shared by the end-to-end tests on the embedded backends.
#![allow(dead_code)]

#[cfg(feature = "it")]
pub mod certs;
#[cfg(feature = "it")]
pub mod nodes;
#[cfg(feature = "it")]
pub mod servers;
#[cfg(feature = "it")]
pub mod services;

#[allow(unused_imports)]
pub use weir::testing::{eventually, settle, TestDriver as Harness};

/// The config of graph `name`: one JSON source on `input`, each event fired on its own
/// through `snapshot` to `output`.
pub fn passthrough_graph_toml(name: &str, input: &str, output: &str) -> String {
    format!(
        r#"[[graph]]
name = "{name}"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "{output}"
[[graph.accumulator]]
name = "a"
topic = "{input}"
format = "json"
"#
    )
}

/// A node running in this process, as a task serving until its token is cancelled.
pub struct TaskNode {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl TaskNode {
    /// Spawns what `serve` makes of the node's stop token.
    pub fn spawn<F>(serve: impl FnOnce(tokio_util::sync::CancellationToken) -> F) -> Self
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(serve(stop.clone()));
        Self { stop, task }
    }

    /// Stops the node the way SIGTERM does: partitions handed over, then gone.
    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(20), self.task)
            .await
            .expect("node stops in time")
            .unwrap();
    }

    /// Kills the node: its partitions keep their leases until they expire.
    pub fn kill(self) {
        self.task.abort();
    }
}

/// A store whose partition writes (`save_keys`, `save_partition`) and loads
/// (`load_keys`, `load_jobs`) fail on demand with an error a retry may help with, as
/// Redis away for a moment fails them; every other call, and every one once the
/// failures asked for are spent, goes to the store it wraps.
pub struct FlakyStore {
    inner: std::sync::Arc<dyn weir::store::Store>,
    /// Partition writes left to fail, whatever they carry.
    writes: std::sync::atomic::AtomicUsize,
    /// Partition writes handing a partition over (carrying the release mark) left to
    /// fail, and the partitions whose hand-over already failed once.
    releases: std::sync::atomic::AtomicUsize,
    released_once: std::sync::Mutex<std::collections::HashSet<i32>>,
    /// Loads of keys or jobs left to fail, and left to pass before them.
    loads: std::sync::atomic::AtomicUsize,
    loads_passing: std::sync::atomic::AtomicUsize,
    /// Keys whose stored state does not read back (written by another version, say):
    /// a load of keys naming one fails with no retry helping.
    unreadable: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Lease renewals wait while set, as a node paused mid-renewal does: its lease runs
    /// out while it holds it.
    renewals_held: std::sync::atomic::AtomicBool,
}

impl FlakyStore {
    pub fn new(inner: std::sync::Arc<dyn weir::store::Store>) -> Self {
        Self {
            inner,
            writes: Default::default(),
            releases: Default::default(),
            released_once: Default::default(),
            loads: Default::default(),
            loads_passing: Default::default(),
            unreadable: Default::default(),
            renewals_held: Default::default(),
        }
    }

    /// Lease renewals wait (up to 30 s each) while `held`.
    pub fn hold_renewals(&self, held: bool) {
        self.renewals_held
            .store(held, std::sync::atomic::Ordering::SeqCst);
    }

    /// From now on the stored state of `key` does not read back.
    pub fn make_unreadable(&self, key: &str) {
        self.unreadable.lock().unwrap().insert(key.to_string());
    }

    /// The next `count` partition writes fail.
    pub fn fail_writes(&self, count: usize) {
        self.writes
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// The next `count` writes handing a partition over fail, each partition's once.
    pub fn fail_releases(&self, count: usize) {
        self.releases
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// Of the loads of keys or jobs from now, `count` fail once `passing` went through.
    pub fn fail_loads(&self, passing: usize, count: usize) {
        use std::sync::atomic::Ordering::SeqCst;
        self.loads_passing.store(passing, SeqCst);
        self.loads.store(count, SeqCst);
    }

    /// Failures asked for and not spent yet.
    pub fn failures_left(&self) -> usize {
        use std::sync::atomic::Ordering::SeqCst;
        self.writes.load(SeqCst) + self.releases.load(SeqCst) + self.loads.load(SeqCst)
    }

    fn fails(&self, partition: i32, releasing: bool) -> Result<(), weir::store_error::StoreError> {
        if Self::take(&self.writes) {
            return Err(Self::away("partition write"));
        }
        if releasing {
            let mut failed = self.released_once.lock().unwrap();
            if !failed.contains(&partition) && Self::take(&self.releases) {
                failed.insert(partition);
                return Err(Self::away("partition hand-over"));
            }
        }
        Ok(())
    }

    fn load_fails(&self) -> Result<(), weir::store_error::StoreError> {
        if !Self::take(&self.loads_passing) && Self::take(&self.loads) {
            return Err(Self::away("load"));
        }
        Ok(())
    }

    /// Takes one failure from `left`, if any is left.
    fn take(left: &std::sync::atomic::AtomicUsize) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        left.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn away(what: &str) -> weir::store_error::StoreError {
        weir::store_error::StoreError::Unreachable {
            what: format!("flaky store: {what}"),
            source: "the store is away for a moment".into(),
        }
    }
}

#[async_trait::async_trait]
impl weir::keyed::KeyedStore for FlakyStore {
    async fn load_keys(
        &self,
        graph: &str,
        partition: i32,
        keys: &[String],
    ) -> Result<Vec<Option<weir::reactor::CacheSnapshot>>, weir::store_error::StoreError> {
        self.load_fails()?;
        let unreadable = self.unreadable.lock().unwrap().clone();
        if let Some(key) = keys.iter().find(|k| unreadable.contains(*k)) {
            return Err(weir::store_error::StoreError::Corrupt {
                key: key.clone(),
                source: "not a cache snapshot".into(),
            });
        }
        self.inner.load_keys(graph, partition, keys).await
    }

    async fn load_positions(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<std::collections::BTreeMap<String, i64>, weir::store_error::StoreError> {
        self.inner.load_positions(graph, partition).await
    }

    async fn load_released(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<Option<(u64, i64)>, weir::store_error::StoreError> {
        self.inner.load_released(graph, partition).await
    }

    async fn idle_keys(
        &self,
        graph: &str,
        partition: i32,
        before_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, weir::store_error::StoreError> {
        self.inner
            .idle_keys(graph, partition, before_ms, skip, limit)
            .await
    }

    async fn load_fire_numbers(
        &self,
        graph: &str,
        partition: i32,
    ) -> Result<weir::keyed::FireNumbers, weir::store_error::StoreError> {
        self.inner.load_fire_numbers(graph, partition).await
    }

    async fn load_paused(&self, graph: &str) -> Result<bool, weir::store_error::StoreError> {
        self.inner.load_paused(graph).await
    }

    async fn save_paused(
        &self,
        graph: &str,
        paused: bool,
    ) -> Result<(), weir::store_error::StoreError> {
        self.inner.save_paused(graph, paused).await
    }

    fn key_slot(
        &self,
        graph: &str,
        partition: i32,
        key: &weir::graph::Key,
    ) -> Option<weir::keyed::KeySlot> {
        self.inner.key_slot(graph, partition, key)
    }

    async fn save_keys(
        &self,
        graph: &str,
        partition: i32,
        changes: &mut weir::keyed::KeyedChanges,
        fence: &weir::lease::Fence,
    ) -> Result<(), weir::store_error::StoreError> {
        self.fails(partition, changes.released.is_some())?;
        self.inner.save_keys(graph, partition, changes, fence).await
    }
}

#[async_trait::async_trait]
impl weir::jobs::JobStore for FlakyStore {
    async fn load_jobs(
        &self,
        job_type: &str,
        ids: &[String],
    ) -> Result<Vec<Option<weir::jobs::JobRecord>>, weir::store_error::StoreError> {
        self.load_fails()?;
        self.inner.load_jobs(job_type, ids).await
    }

    async fn load_partition(
        &self,
        job_type: &str,
        partition: i32,
    ) -> Result<weir::jobs::PartitionSnapshot, weir::store_error::StoreError> {
        self.inner.load_partition(job_type, partition).await
    }

    async fn save_partition(
        &self,
        job_type: &str,
        partition: i32,
        changes: &weir::jobs::PartitionChanges,
        fence: &weir::lease::Fence,
    ) -> Result<(), weir::store_error::StoreError> {
        self.fails(partition, changes.released.is_some())?;
        self.inner
            .save_partition(job_type, partition, changes, fence)
            .await
    }

    async fn list_jobs(
        &self,
        job_type: &str,
    ) -> Result<Vec<String>, weir::store_error::StoreError> {
        self.inner.list_jobs(job_type).await
    }
}

#[async_trait::async_trait]
impl weir::lease::LeaseStore for FlakyStore {
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: std::time::Duration,
    ) -> Result<Option<weir::lease::Lease>, weir::store_error::StoreError> {
        self.inner.acquire_lease(name, holder, ttl).await
    }

    async fn renew_lease(
        &self,
        lease: &weir::lease::Lease,
        ttl: std::time::Duration,
    ) -> Result<bool, weir::store_error::StoreError> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        while self.renewals_held.load(std::sync::atomic::Ordering::SeqCst)
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        self.inner.renew_lease(lease, ttl).await
    }

    async fn release_lease(
        &self,
        lease: &weir::lease::Lease,
    ) -> Result<bool, weir::store_error::StoreError> {
        self.inner.release_lease(lease).await
    }

    async fn current_lease(
        &self,
        name: &str,
    ) -> Result<Option<weir::lease::Lease>, weir::store_error::StoreError> {
        self.inner.current_lease(name).await
    }
}

#[async_trait::async_trait]
impl weir::ownership::MembershipStore for FlakyStore {
    async fn join_group(
        &self,
        group: &str,
        member: &str,
        ttl: std::time::Duration,
    ) -> Result<(), weir::store_error::StoreError> {
        self.inner.join_group(group, member, ttl).await
    }

    async fn leave_group(
        &self,
        group: &str,
        member: &str,
    ) -> Result<(), weir::store_error::StoreError> {
        self.inner.leave_group(group, member).await
    }

    async fn group_members(
        &self,
        group: &str,
    ) -> Result<Vec<String>, weir::store_error::StoreError> {
        self.inner.group_members(group).await
    }

    async fn settle_partition_count(
        &self,
        group: &str,
        partitions: u32,
    ) -> Result<u32, weir::store_error::StoreError> {
        self.inner.settle_partition_count(group, partitions).await
    }
}

/// Waits (a minute at most) until `done` counts `wanted`, then asserts that took longer
/// than `ttl`, counted from `started`: a test of a lease kept through a backlog proves
/// nothing if the backlog was worked off within the lease.
pub async fn work_off_past_ttl(
    started: tokio::time::Instant,
    ttl: std::time::Duration,
    wanted: usize,
    done: impl Fn() -> usize,
) {
    let deadline = started + std::time::Duration::from_secs(60);
    while done() < wanted {
        assert!(
            tokio::time::Instant::now() < deadline,
            "backlog not worked off"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        started.elapsed() > ttl,
        "the backlog took {:?}, within the lease TTL of {ttl:?}: make it longer",
        started.elapsed()
    );
}

/// Refuses what goes to a dead-letter topic while `down` is set, as a broker that is
/// away does (retryable) or, with `for_good`, as one that will never take it (an ACL
/// denying the topic), and counts what it refused; passes the rest on.
pub struct DeadLettersDown {
    pub inner: std::sync::Arc<dyn weir::transport::Sink>,
    pub down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub for_good: bool,
}

#[async_trait::async_trait]
impl weir::transport::Sink for DeadLettersDown {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        use std::sync::atomic::Ordering;
        if message.topic.ends_with(".dlq") && self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(weir::transport::TransportError::Publish {
                topic: message.topic.to_string(),
                source: if self.for_good {
                    "topic authorization failed".into()
                } else {
                    "broker unreachable".into()
                },
                retryable: !self.for_good,
            });
        }
        self.inner.publish(message).await
    }
}

/// A broker whose messages go out through `sink` (a [`DeadLettersDown`], say); the rest
/// is `broker`'s.
pub struct WithSink {
    pub broker: std::sync::Arc<dyn weir::transport::Broker>,
    pub sink: std::sync::Arc<dyn weir::transport::Sink>,
}

#[async_trait::async_trait]
impl weir::transport::Broker for WithSink {
    fn kind(&self) -> &'static str {
        self.broker.kind()
    }

    async fn subscribe(
        &self,
        subscription: &weir::transport::Subscription,
    ) -> Result<Box<dyn weir::transport::Source>, weir::transport::TransportError> {
        self.broker.subscribe(subscription).await
    }

    fn sink(&self) -> std::sync::Arc<dyn weir::transport::Sink> {
        self.sink.clone()
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<weir::transport::PartitionedTopic, weir::transport::TransportError> {
        self.broker.partitioned(topic, partitions).await
    }

    async fn ping(&self) -> Result<(), weir::transport::TransportError> {
        self.broker.ping().await
    }

    fn redelivery_wait(&self) -> Option<std::time::Duration> {
        self.broker.redelivery_wait()
    }
}

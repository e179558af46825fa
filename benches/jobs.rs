//! Distributed jobs, one node in this process: messages applied per second, and store
//! round trips per message, over Kafka, NATS JetStream or the memory broker, with state
//! in Redis.
//!
//! Run `scripts/services` first, then `cargo bench --bench jobs`. Environment:
//! `WEIR_BENCH_MESSAGES` (default 200000), `WEIR_BENCH_JOBS` (default 10000),
//! `WEIR_BENCH_BROKERS` (default `kafka,nats`; `memory` too), `WEIR_TEST_REDIS`,
//! `WEIR_TEST_KAFKA`, `WEIR_TEST_NATS`.
//!
//! The job topic is filled first; the clock runs from the node's start until every
//! partition's stored position reaches the last message published to it. Every call the
//! node makes on its store is one Redis round trip (a command, a pipeline or a script),
//! counted by a wrapper around the store.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use weir::jobs::{JobClient, JobHandlers, JobType, JobsStore};
use weir::lease::{Lease, LeaseStore};
use weir::ownership::MembershipStore;
use weir::store::redis::RedisStore;
use weir::store::{Fence, JobRecord, JobStore, PartitionChanges, PartitionSnapshot, StoreError};
use weir::transport::{Broker, PartitionLayout};

const PARTITIONS: u32 = 6;
/// Publishes awaiting acknowledgement at once while filling the topic.
const WINDOW: usize = 4096;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The node's store, counting its calls: each is one round trip on Redis.
struct Counting {
    inner: Arc<RedisStore>,
    calls: AtomicU64,
}

impl Counting {
    fn count(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl JobStore for Counting {
    async fn load_jobs(
        &self,
        job_type: &str,
        ids: &[String],
    ) -> Result<Vec<Option<JobRecord>>, StoreError> {
        self.count();
        self.inner.load_jobs(job_type, ids).await
    }

    async fn load_partition(
        &self,
        job_type: &str,
        partition: i32,
    ) -> Result<PartitionSnapshot, StoreError> {
        self.count();
        self.inner.load_partition(job_type, partition).await
    }

    async fn save_partition(
        &self,
        job_type: &str,
        partition: i32,
        changes: &PartitionChanges,
        fence: &Fence,
    ) -> Result<(), StoreError> {
        self.count();
        self.inner
            .save_partition(job_type, partition, changes, fence)
            .await
    }

    async fn list_jobs(&self, job_type: &str) -> Result<Vec<String>, StoreError> {
        self.count();
        self.inner.list_jobs(job_type).await
    }
}

#[async_trait]
impl LeaseStore for Counting {
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        self.count();
        self.inner.acquire_lease(name, holder, ttl).await
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
        self.count();
        self.inner.renew_lease(lease, ttl).await
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        self.count();
        self.inner.release_lease(lease).await
    }

    async fn current_lease(&self, name: &str) -> Result<Option<Lease>, StoreError> {
        self.count();
        self.inner.current_lease(name).await
    }
}

#[async_trait]
impl MembershipStore for Counting {
    async fn join_group(&self, group: &str, member: &str, ttl: Duration) -> Result<(), StoreError> {
        self.count();
        self.inner.join_group(group, member, ttl).await
    }

    async fn leave_group(&self, group: &str, member: &str) -> Result<(), StoreError> {
        self.count();
        self.inner.leave_group(group, member).await
    }

    async fn group_members(&self, group: &str) -> Result<Vec<String>, StoreError> {
        self.count();
        self.inner.group_members(group).await
    }

    async fn settle_partition_count(
        &self,
        group: &str,
        partitions: u32,
    ) -> Result<u32, StoreError> {
        self.count();
        self.inner.settle_partition_count(group, partitions).await
    }
}

async fn broker(kind: &str) -> Arc<dyn Broker> {
    match kind {
        "memory" => Arc::new(weir::transport::memory::MemoryBroker::new(1)),
        "kafka" => {
            let settings = weir::transport::kafka::KafkaSettings {
                brokers: std::env::var("WEIR_TEST_KAFKA")
                    .unwrap_or_else(|_| "127.0.0.1:9092".into()),
                retention: Some(Duration::from_secs(3600)),
                ..Default::default()
            };
            Arc::new(weir::transport::kafka::KafkaBroker::connect(settings).expect("kafka"))
        }
        "nats" => {
            let settings = weir::transport::nats::NatsSettings {
                url: std::env::var("WEIR_TEST_NATS")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
                jetstream: true,
                retention: Some(Duration::from_secs(3600)),
                ..Default::default()
            };
            Arc::new(
                weir::transport::nats::NatsBroker::connect(settings)
                    .await
                    .expect("nats"),
            )
        }
        other => panic!("unknown broker {other}"),
    }
}

async fn run(kind: &str, messages: usize, jobs: usize, redis_url: &str) {
    let broker = broker(kind).await;
    let prefix = format!("benchjobs{:08x}", rand::random::<u32>());
    let job_type = format!("bench{:08x}", rand::random::<u32>());
    let redis = Arc::new(
        RedisStore::connect(redis_url, &prefix)
            .await
            .expect("redis"),
    );
    let topic = broker
        .partitioned(&weir::wire::job_topic(&job_type), PARTITIONS)
        .await
        .expect("job topic");
    let client = JobClient::new(broker.as_ref(), &job_type, PARTITIONS)
        .await
        .unwrap();
    // Fill: every job put, then messages round-robin over the jobs.
    let ids: Vec<String> = (0..jobs).map(|i| format!("job-{i}")).collect();
    let mut last: HashMap<i32, i64> = HashMap::new();
    let fill_started = Instant::now();
    let total = jobs + messages;
    let mut pending = futures::stream::FuturesOrdered::new();
    let message = json!({"px": 101.25, "qty": 3});
    let state = json!({});
    for n in 0..total {
        let id = ids[n % jobs].clone();
        let client = client.clone();
        let (message, state) = (message.clone(), state.clone());
        pending.push_back(async move {
            let position = if n < jobs {
                client.put(&id, &state).await
            } else {
                client.send(&id, &message).await
            };
            (id, position.expect("publish"))
        });
        if pending.len() >= WINDOW || n + 1 == total {
            while let Some((id, position)) = futures::StreamExt::next(&mut pending).await {
                let partition = match topic.layout {
                    PartitionLayout::Native => position.partition,
                    PartitionLayout::Subjects => topic.partition_of(id.as_bytes()),
                };
                let highest = last.entry(partition).or_insert(i64::MIN);
                *highest = (*highest).max(position.offset);
                if pending.len() < WINDOW / 2 && n + 1 != total {
                    break;
                }
            }
        }
    }
    let fill = fill_started.elapsed();
    let store = Arc::new(Counting {
        inner: redis.clone(),
        calls: AtomicU64::new(0),
    });
    let mut job = JobType::new(
        &job_type,
        JobHandlers::default().get("builtin::count").unwrap(),
    );
    job.partitions = PARTITIONS;
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let node_store: Arc<dyn JobsStore> = store.clone();
    let node = tokio::spawn(weir::jobs::serve(
        job,
        topic.clone(),
        broker.clone(),
        node_store,
        "bench".into(),
        cancel.clone(),
    ));
    loop {
        let mut behind = 0;
        for (partition, highest) in &last {
            let stored = redis
                .load_partition(&job_type, *partition)
                .await
                .unwrap()
                .position
                .unwrap_or(i64::MIN);
            if stored < *highest {
                behind += 1;
            }
        }
        if behind == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(600), "stuck");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = started.elapsed();
    let calls = store.calls.load(Ordering::Relaxed);
    let sample = redis.load_jobs(&job_type, &ids[..1]).await.unwrap();
    let expected = (messages / jobs + usize::from(messages % jobs > 0)) as u64;
    assert_eq!(
        sample[0].as_ref().and_then(|r| r.state["count"].as_u64()),
        Some(expected),
        "job-0 applied every message once"
    );
    println!(
        "jobs {kind:>6}: {total} messages ({jobs} puts + {messages} messages) over {jobs} jobs, \
         {PARTITIONS} partitions: filled in {:.2} s; applied in {:.2} s = {:.0} messages/s on one node; \
         {calls} store round trips = {:.4} per message",
        fill.as_secs_f64(),
        took.as_secs_f64(),
        total as f64 / took.as_secs_f64(),
        calls as f64 / total as f64,
    );
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(40), node).await;
    common::remove_prefix(redis_url, &prefix).await;
    common::delete_topics(&broker, &[format!("{}.*", topic.topic)]).await;
}

#[tokio::main]
async fn main() {
    let messages = env("WEIR_BENCH_MESSAGES", 200_000usize);
    let jobs = env("WEIR_BENCH_JOBS", 10_000usize).max(1);
    let brokers: String = env("WEIR_BENCH_BROKERS", "kafka,nats".to_string());
    let redis_url =
        std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    for kind in brokers.split(',').map(str::trim).filter(|k| !k.is_empty()) {
        run(kind, messages, jobs, &redis_url).await;
    }
}

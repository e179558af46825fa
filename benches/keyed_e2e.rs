//! A keyed graph end to end on Kafka with `weir run` processes and state in Redis: one
//! node against two on the same graph in one run, then the pause a SIGKILL causes.
//!
//! Run `scripts/services` first, then `cargo bench --bench keyed_e2e`. Environment:
//! `WEIR_BENCH_EVENTS` (default 200000), `WEIR_BENCH_KEYS` (default 10000),
//! `WEIR_BENCH_KILLS` (default 5), `WEIR_BENCH_WEIR` (the `weir` binary; default the
//! one cargo builds with the bench), `WEIR_TEST_KAFKA`, `WEIR_TEST_REDIS`.
//!
//! Throughput: the input topic (6 partitions) is filled with the events first; the
//! clock runs from the nodes' start until the positions every partition has stored in
//! Redis reach the last event. Pause: with two nodes and a steady 2,000 events/s coming
//! in, one node is SIGKILLed; the pause lasts until every partition it owned has stored
//! a position beyond the one it had at the kill, on the survivor. The lease TTL is 6 s,
//! the usual Kafka session timeout, so the target is under 8 s.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use weir::keyed::KeyedStore;
use weir::lease::{holder_node, LeaseStore};
use weir::ownership::partition_lease;
use weir::store::redis::RedisStore;
use weir::transport::kafka::{KafkaBroker, KafkaSettings};
use weir::transport::{Broker, PartitionedTopic};

const PARTITIONS: u32 = 6;
const LEASE_TTL_MS: u64 = 6000;
const STEADY_RATE: u64 = 2000;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn weir_binary() -> PathBuf {
    std::env::var("WEIR_BENCH_WEIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_BIN_EXE_weir")))
}

struct Setup {
    prefix: String,
    graph: String,
    input: String,
    config: tempfile::NamedTempFile,
    kafka: String,
    redis_url: String,
}

impl Setup {
    fn new(kafka: &str, redis_url: &str) -> Self {
        let prefix = format!("benchkeyed{:08x}", rand::random::<u32>());
        let graph = format!("g{prefix}");
        let input = format!("{prefix}.in");
        let text = format!(
            r#"
[broker]
kind = "kafka"
brokers = "{kafka}"
retention_ms = 3600000
[store]
kind = "redis"
url = "{redis_url}"
prefix = "{prefix}"
[supervision]
graph_lease_ttl_ms = {LEASE_TTL_MS}
[[graph]]
name = "{graph}"
key = "/user"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "{prefix}.out"
partitions = {PARTITIONS}
[[graph.accumulator]]
name = "a"
topic = "{input}"
"#
        );
        let mut config = tempfile::NamedTempFile::new().unwrap();
        config.write_all(text.as_bytes()).unwrap();
        Self {
            prefix,
            graph,
            input,
            config,
            kafka: kafka.to_string(),
            redis_url: redis_url.to_string(),
        }
    }

    fn start(&self, node: &str) -> Child {
        Command::new(weir_binary())
            .args(["run", "--config"])
            .arg(self.config.path())
            .env("WEIR__NODE__ID", node)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("weir starts")
    }

    async fn store(&self) -> RedisStore {
        RedisStore::connect(&self.redis_url, &self.prefix)
            .await
            .expect("redis")
    }

    fn broker(&self) -> Arc<dyn Broker> {
        Arc::new(
            KafkaBroker::connect(KafkaSettings {
                brokers: self.kafka.clone(),
                retention: Some(Duration::from_secs(3600)),
                ..Default::default()
            })
            .expect("kafka"),
        )
    }

    /// Per partition, the position stored for source `a`.
    async fn positions(&self, store: &RedisStore) -> BTreeMap<i32, i64> {
        let mut positions = BTreeMap::new();
        for p in 0..PARTITIONS as i32 {
            let stored = store.load_positions(&self.graph, p).await.expect("redis");
            positions.insert(p, stored.get("a").copied().unwrap_or(-1));
        }
        positions
    }

    /// The node holding each partition now.
    async fn owners(&self, store: &RedisStore) -> BTreeMap<i32, Option<String>> {
        let group = weir::keyed::ownership_group(&self.graph);
        let mut owners = BTreeMap::new();
        for p in 0..PARTITIONS as i32 {
            let lease = store
                .current_lease(&partition_lease(&group, p))
                .await
                .expect("redis");
            owners.insert(p, lease.map(|l| holder_node(&l.holder).to_string()));
        }
        owners
    }
}

fn stop(mut children: Vec<Child>) {
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Fills the input with `events` over `keys` users; the last offset per partition.
async fn fill(
    broker: &Arc<dyn Broker>,
    topic: &PartitionedTopic,
    events: usize,
    keys: usize,
) -> BTreeMap<i32, i64> {
    let sink = broker.sink();
    let mut last = BTreeMap::new();
    let mut pending = Vec::with_capacity(4096);
    for n in 0..events {
        let user = format!("u{}", n % keys);
        let event = json!({"user": user, "n": n});
        pending.push(
            sink.enqueue(topic.outbound(&user, event.to_string()))
                .await
                .expect("enqueue"),
        );
        if pending.len() == 4096 || n + 1 == events {
            for ack in pending.drain(..) {
                let at = ack.await.expect("ack");
                let slot = last.entry(at.partition).or_insert(-1);
                *slot = (*slot).max(at.offset);
            }
        }
    }
    last
}

async fn throughput(kafka: &str, redis_url: &str, nodes: usize, events: usize, keys: usize) -> f64 {
    let setup = Setup::new(kafka, redis_url);
    let broker = setup.broker();
    let topic = broker
        .partitioned(&setup.input, PARTITIONS)
        .await
        .expect("topic");
    let last = fill(&broker, &topic, events, keys).await;
    let store = setup.store().await;
    let started = Instant::now();
    let children: Vec<Child> = (0..nodes).map(|i| setup.start(&format!("n{i}"))).collect();
    loop {
        let positions = setup.positions(&store).await;
        if last
            .iter()
            .all(|(p, l)| positions.get(p).is_some_and(|at| at >= l))
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(900),
            "stuck at {positions:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rate = events as f64 / started.elapsed().as_secs_f64();
    stop(children);
    common::remove_prefix(redis_url, &setup.prefix).await;
    common::delete_topics(&broker, std::slice::from_ref(&setup.input)).await;
    rate
}

async fn kill_pauses(kafka: &str, redis_url: &str, kills: usize, keys: usize) -> Vec<Duration> {
    let setup = Setup::new(kafka, redis_url);
    let broker = setup.broker();
    let topic = broker
        .partitioned(&setup.input, PARTITIONS)
        .await
        .expect("topic");
    let store = setup.store().await;
    let mut nodes: Vec<Option<Child>> = vec![Some(setup.start("n0")), Some(setup.start("n1"))];
    // A steady stream of events while nodes die and come back.
    let producing = CancellationToken::new();
    let producer = {
        let (broker, topic, producing) = (broker.clone(), topic.clone(), producing.clone());
        tokio::spawn(async move {
            let sink = broker.sink();
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            let mut n = 0u64;
            while !producing.is_cancelled() {
                tick.tick().await;
                for _ in 0..STEADY_RATE / 100 {
                    let user = format!("u{}", n % keys as u64);
                    let event = json!({"user": user, "n": n});
                    let _ = sink.publish(topic.outbound(&user, event.to_string())).await;
                    n += 1;
                }
            }
        })
    };
    let mut pauses = Vec::new();
    for kill in 0..kills {
        // Both nodes own a share.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let owners = setup.owners(&store).await;
            let holding: std::collections::BTreeSet<&str> =
                owners.values().flatten().map(String::as_str).collect();
            if holding.len() == 2 && owners.values().all(Option::is_some) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "nodes never both owned partitions: {owners:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let victim = kill % 2;
        let owners = setup.owners(&store).await;
        let theirs: Vec<i32> = owners
            .iter()
            .filter(|(_, o)| o.as_deref() == Some(&format!("n{victim}")))
            .map(|(p, _)| *p)
            .collect();
        let before = setup.positions(&store).await;
        let killed_at = Instant::now();
        if let Some(mut child) = nodes[victim].take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        loop {
            let positions = setup.positions(&store).await;
            if theirs.iter().all(|p| positions[p] > before[p]) {
                break;
            }
            assert!(
                killed_at.elapsed() < Duration::from_secs(120),
                "never resumed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        pauses.push(killed_at.elapsed());
        nodes[victim] = Some(setup.start(&format!("n{victim}")));
    }
    producing.cancel();
    let _ = producer.await;
    stop(nodes.into_iter().flatten().collect());
    common::remove_prefix(redis_url, &setup.prefix).await;
    pauses
}

#[tokio::main]
async fn main() {
    let events = env("WEIR_BENCH_EVENTS", 200_000usize);
    let keys = env("WEIR_BENCH_KEYS", 10_000usize).max(1);
    let kills = env("WEIR_BENCH_KILLS", 5usize);
    let kafka = std::env::var("WEIR_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let redis_url =
        std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let one = throughput(&kafka, &redis_url, 1, events, keys).await;
    let two = throughput(&kafka, &redis_url, 2, events, keys).await;
    println!(
        "keyed e2e kafka: {events} events over {keys} keys: one node {one:.0} events/s, \
         two nodes {two:.0} events/s = {:.2} x",
        two / one
    );
    if kills > 0 {
        let mut pauses = kill_pauses(&kafka, &redis_url, kills, keys).await;
        pauses.sort();
        println!(
            "keyed e2e kafka: pause from SIGKILL to processing resumed on the survivor, {} kills, \
             lease TTL {LEASE_TTL_MS} ms: p50 {:.2} s, max {:.2} s",
            pauses.len(),
            pauses[pauses.len() / 2].as_secs_f64(),
            pauses[pauses.len() - 1].as_secs_f64()
        );
    }
}

//! Distributed jobs across `weir run` processes on real services (Kafka and NATS
//! JetStream, Redis): 100 jobs × 50 messages through a SIGKILL, a node joining again, a
//! rolling restart, a node paused past its lease, and Redis, NATS and Kafka restarted
//! under load; every job ends with `count` exactly 50, and timeouts fire at most once
//! per due time. Jobs on core NATS are refused at start.
#![cfg(feature = "it")]

mod common;

use std::io::Write;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::servers::Server;
use common::services;
use serde_json::{json, Value};
use weir::jobs::JobClient;
use weir::store::Store;
use weir::transport::Broker;

const JOBS: usize = 100;
const MESSAGES: u64 = 50;
const TICKERS: usize = 10;
const TICK_MS: u64 = 1000;
const PARTITIONS: u32 = 6;

#[derive(Clone, Copy)]
enum Kind {
    Kafka,
    Nats,
}

struct Cluster {
    kind: Kind,
    /// The Redis and the broker (Kafka's bootstrap servers or NATS's URL) the nodes
    /// use: the shared ones, or a test's own.
    redis_url: String,
    broker_url: String,
    prefix: String,
    job_type: String,
    config: tempfile::NamedTempFile,
    nodes: common::nodes::Nodes,
    /// Last, so the nodes are gone before what they used is removed: the store's keys
    /// and the job type's topic.
    _cleanup: [services::Cleanup; 2],
}

impl Cluster {
    /// Three nodes on the shared services.
    fn new(kind: Kind) -> Self {
        let broker_url = match kind {
            Kind::Kafka => services::kafka_brokers(),
            Kind::Nats => services::nats_url(),
        };
        Self::on(kind, &services::redis_url(), &broker_url, 3)
    }

    /// `nodes` nodes on this Redis and this broker.
    fn on(kind: Kind, redis_url: &str, broker_url: &str, nodes: usize) -> Self {
        let prefix = services::unique("jobs");
        let job_type = services::unique("counter");
        let retention = services::TEST_RETENTION.as_millis();
        let broker = match kind {
            Kind::Kafka => {
                format!("kind = \"kafka\"\nbrokers = \"{broker_url}\"\nretention_ms = {retention}")
            }
            Kind::Nats => {
                format!("kind = \"nats\"\nurl = \"{broker_url}\"\nretention_ms = {retention}")
            }
        };
        let text = format!(
            r#"
[broker]
{broker}
[store]
kind = "redis"
url = "{redis}"
prefix = "{prefix}"
[[job]]
type = "{job_type}"
handler = "builtin::count"
partitions = {PARTITIONS}
lease_ttl_ms = 3000
"#,
            redis = redis_url,
        );
        let mut config = tempfile::NamedTempFile::new().unwrap();
        config.write_all(text.as_bytes()).unwrap();
        Self {
            nodes: common::nodes::Nodes::new(&prefix, config.path(), nodes),
            _cleanup: [services::cleanup(&prefix), services::cleanup(&job_type)],
            kind,
            redis_url: redis_url.to_string(),
            broker_url: broker_url.to_string(),
            prefix,
            job_type,
            config,
        }
    }

    async fn broker(&self) -> Arc<dyn Broker> {
        match self.kind {
            Kind::Kafka => Arc::new(
                weir::transport::kafka::KafkaBroker::connect(
                    weir::transport::kafka::KafkaSettings {
                        brokers: self.broker_url.clone(),
                        options: services::fast_group_options(),
                        retention: Some(services::TEST_RETENTION),
                        ..Default::default()
                    },
                )
                .expect("kafka client"),
            ),
            Kind::Nats => Arc::new(
                weir::transport::nats::NatsBroker::connect(weir::transport::nats::NatsSettings {
                    url: self.broker_url.clone(),
                    jetstream: true,
                    retention: Some(services::TEST_RETENTION),
                    ..Default::default()
                })
                .await
                .expect("nats reachable"),
            ),
        }
    }

    /// Starts nodes `n0`..`n<count>` and waits until they own every partition.
    async fn start_nodes(&mut self, count: usize) -> Running {
        let broker = self.broker().await;
        let client = JobClient::new(broker.as_ref(), &self.job_type, PARTITIONS)
            .await
            .unwrap();
        for node in 0..count {
            self.nodes.start(node);
        }
        let group = weir::jobs::ownership_group(&self.job_type);
        let redis = self.redis().await;
        let names: Vec<String> = (0..count).map(|n| format!("n{n}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        services::await_owners(&redis, &group, PARTITIONS, &names).await;
        Running {
            store: redis.clone(),
            redis,
            client,
            group,
        }
    }

    async fn redis(&self) -> Arc<weir::store::redis::RedisStore> {
        Arc::new(
            weir::store::redis::RedisStore::connect(&self.redis_url, &self.prefix)
                .await
                .expect("redis reachable"),
        )
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["job"])
            .args(args)
            .arg("--config")
            .arg(self.config.path())
            .output()
            .expect("weir job runs")
    }
}

/// The jobs' states; a connection broken by a Redis restart is made again, so a failed
/// read is tried again for a while.
/// A cluster's nodes started: the store (as the `Store` bundle and as Redis), a client
/// of the job type, and its ownership group.
struct Running {
    store: Arc<dyn Store>,
    redis: Arc<weir::store::redis::RedisStore>,
    client: JobClient,
    group: String,
}

async fn states(store: &dyn Store, job_type: &str, ids: &[String]) -> Vec<Option<Value>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store.load_jobs(job_type, ids).await {
            Ok(records) => return records.into_iter().map(|r| r.map(|r| r.state)).collect(),
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("cannot read the jobs: {e}"),
        }
    }
}

async fn await_counts(store: &dyn Store, job_type: &str, ids: &[String], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let behind: Vec<(String, Option<Value>)> = ids
            .iter()
            .cloned()
            .zip(states(store, job_type, ids).await)
            .filter(|(_, s)| s.as_ref().and_then(|s| s["count"].as_u64()) != Some(MESSAGES))
            .collect();
        if behind.is_empty() {
            return;
        }
        for (id, state) in &behind {
            let count = state.as_ref().and_then(|s| s["count"].as_u64());
            assert!(
                count.is_none_or(|c| c <= MESSAGES),
                "{id} applied a message twice: {state:?}"
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} jobs not at {MESSAGES}, e.g. {:?}",
            behind.len(),
            &behind[..behind.len().min(5)]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Puts the tickers (a timeout every `TICK_MS`) and the counted jobs; returns their ids
/// and when they were put.
async fn put_jobs(client: &JobClient) -> (Vec<String>, Vec<String>, Instant) {
    let ids: Vec<String> = (0..JOBS).map(|i| format!("job-{i}")).collect();
    let tickers: Vec<String> = (0..TICKERS).map(|i| format!("ticker-{i}")).collect();
    let started = Instant::now();
    for id in &tickers {
        client
            .put(id, &json!({ "every_ms": TICK_MS }))
            .await
            .unwrap();
    }
    for id in &ids {
        client.put(id, &json!({})).await.unwrap();
    }
    (ids, tickers, started)
}

/// One message to every job.
async fn send_round(client: &JobClient, ids: &[String], round: u64) {
    let message = json!({ "round": round });
    futures::future::try_join_all(ids.iter().map(|id| client.send(id, &message)))
        .await
        .unwrap();
}

/// Every job at exactly `MESSAGES` within `within` and still so a while later (nothing
/// applied twice afterwards); every ticker's timeouts fired at most once per due time,
/// and still firing: a ticker whose timeout was dropped when its partition moved would
/// have stopped.
async fn await_exactly_once(
    store: &dyn Store,
    job_type: &str,
    ids: &[String],
    tickers: &[String],
    started: Instant,
    within: Duration,
) {
    await_counts(store, job_type, ids, within).await;
    let timeouts = |states: Vec<Option<Value>>| -> Vec<u64> {
        states
            .iter()
            .map(|s| s.as_ref().and_then(|s| s["timeouts"].as_u64()).unwrap_or(0))
            .collect()
    };
    let before = timeouts(states(store, job_type, tickers).await);
    // Twice the lease TTL: time for a partition still changing hands to move.
    tokio::time::sleep(Duration::from_millis(6 * TICK_MS)).await;
    await_counts(store, job_type, ids, Duration::ZERO).await;
    let after = timeouts(states(store, job_type, tickers).await);
    for ((id, before), after) in tickers.iter().zip(before).zip(after) {
        assert!(
            after > before,
            "{id}: no timeout fired in {} ms (still at {after})",
            6 * TICK_MS
        );
    }
    await_timeouts_once_per_due_time(store, job_type, tickers, started).await;
}

/// Each ticker's timeouts fired, and at most once per due time since `started`.
async fn await_timeouts_once_per_due_time(
    store: &dyn Store,
    job_type: &str,
    tickers: &[String],
    started: Instant,
) {
    let elapsed = started.elapsed().as_millis() as u64;
    for (id, state) in tickers.iter().zip(states(store, job_type, tickers).await) {
        let timeouts = state.as_ref().and_then(|s| s["timeouts"].as_u64());
        let most = elapsed / TICK_MS + 1;
        assert!(
            timeouts.is_some_and(|t| (1..=most).contains(&t)),
            "{id}: {timeouts:?} timeouts in {elapsed} ms (at most {most})"
        );
    }
}

async fn jobs_survive_kills_joins_and_rolling_restarts(kind: Kind) {
    let mut cluster = Cluster::new(kind);
    let Running {
        store,
        redis,
        client,
        group,
    } = cluster.start_nodes(3).await;
    let (ids, tickers, started) = put_jobs(&client).await;
    for round in 0..MESSAGES {
        send_round(&client, &ids, round).await;
        match round {
            // Under load, owning partitions.
            10 => cluster.nodes.kill(0),
            // Back once its partitions went to the others: it takes some over again.
            20 => {
                services::await_owners(&redis, &group, PARTITIONS, &["n1", "n2"]).await;
                cluster.nodes.start(0);
            }
            30 => {
                for node in [1, 2] {
                    cluster.nodes.terminate(node);
                    cluster.nodes.start(node);
                }
            }
            // Paused past its lease while holding partitions: the others take them
            // over, and what it still holds in memory when it wakes is fenced off.
            40 => {
                services::await_owners(&redis, &group, PARTITIONS, &["n0", "n1", "n2"]).await;
                cluster.nodes.signal(2, "STOP");
            }
            44 => {
                services::await_owners(&redis, &group, PARTITIONS, &["n0", "n1"]).await;
                cluster.nodes.signal(2, "CONT");
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    await_exactly_once(
        store.as_ref(),
        &cluster.job_type,
        &ids,
        &tickers,
        started,
        Duration::from_secs(90),
    )
    .await;
    // The command line sees the same: one JSON line per job, every job listed.
    let got = cluster.cli(&["get", &cluster.job_type, "job-7"]);
    assert!(got.status.success(), "{got:?}");
    let view: Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(view["type"], cluster.job_type.as_str());
    assert_eq!(view["id"], "job-7");
    assert_eq!(view["state"]["count"], MESSAGES);
    assert_eq!(view["status"], "running");
    assert!(
        ["n0", "n1", "n2"].contains(&view["owner"].as_str().unwrap_or_default()),
        "{view}"
    );
    let listed = cluster.cli(&["list", &cluster.job_type]);
    assert!(listed.status.success(), "{listed:?}");
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout).lines().count(),
        JOBS + TICKERS
    );
    let missing = cluster.cli(&["get", &cluster.job_type, "nobody"]);
    assert_eq!(missing.status.code(), Some(2), "{missing:?}");
    for node in 0..3 {
        cluster.nodes.terminate(node);
    }
}

/// On Kafka a job type's output topic is made with its job topic's partition count, and
/// each job's output (a stopped counter's final state) lands in the partition its
/// messages came from, as on the memory broker.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_job_outputs_land_in_the_partition_their_messages_came_from() {
    let mut cluster = Cluster::new(Kind::Kafka);
    let output = format!("{}.out", cluster.job_type);
    writeln!(cluster.config, "output = \"{output}\"").unwrap();
    let Running { client, .. } = cluster.start_nodes(1).await;
    let ids: Vec<String> = (0..24).map(|i| format!("job-{i}")).collect();
    for id in &ids {
        client.put(id, &json!({})).await.unwrap();
        client.send(id, &json!({ "n": 1 })).await.unwrap();
        client.stop(id).await.unwrap();
    }
    let broker = cluster.broker().await;
    let jobs = broker
        .partitioned(&weir::wire::job_topic(&cluster.job_type), PARTITIONS)
        .await
        .unwrap();
    let mut subscription = weir::transport::Subscription::new(&output, services::unique("reader"));
    subscription.assignment = weir::transport::Assignment::All;
    let mut source = broker.subscribe(&subscription).await.unwrap();
    let mut seen = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen.len() < ids.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "outputs of {} jobs of {}",
            seen.len(),
            ids.len()
        );
        let Ok(next) = tokio::time::timeout(left, source.next()).await else {
            continue;
        };
        let message = next.unwrap();
        let key = message.key.clone().expect("an output keyed by its job");
        let output: Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(output["output"]["count"], 1, "{output}");
        assert_eq!(output["id"].as_str().map(str::as_bytes), Some(&key[..]));
        assert_eq!(
            message.position.partition,
            jobs.partition_of(&key),
            "{:?}",
            String::from_utf8_lossy(&key)
        );
        seen.insert(key, message.position.partition);
    }
    let partitions: std::collections::HashSet<i32> = seen.values().copied().collect();
    assert!(
        partitions.len() > 1,
        "24 jobs over one partition: {partitions:?}"
    );
    let made = broker.partitioned(&output, 1).await.unwrap();
    assert_eq!(
        made.partitions, PARTITIONS,
        "the job topic's partition count"
    );
    cluster.nodes.terminate(0);
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_jobs_survive_kills_joins_and_rolling_restarts() {
    jobs_survive_kills_joins_and_rolling_restarts(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_jobs_survive_kills_joins_and_rolling_restarts() {
    jobs_survive_kills_joins_and_rolling_restarts(Kind::Nats).await;
}

/// Redis stopped under load for longer than the lease TTL and started again, then (on
/// NATS) the broker restarted: the nodes lose their leases and stop, take the partitions
/// back from what was stored, and apply every message exactly once.
async fn jobs_survive_redis_and_broker_restarts(kind: Kind) {
    let mut redis_server = Server::redis();
    let mut nats_server = matches!(kind, Kind::Nats).then(|| Server::nats(""));
    let broker_url = match &nats_server {
        Some(server) => server.nats_url(),
        None => services::kafka_brokers(),
    };
    let mut cluster = Cluster::on(kind, &redis_server.redis_url(), &broker_url, 2);
    let Running {
        store,
        redis,
        client,
        group,
    } = cluster.start_nodes(2).await;
    let (ids, tickers, started) = put_jobs(&client).await;
    let mut tokens_before = Vec::new();
    for round in 0..MESSAGES {
        send_round(&client, &ids, round).await;
        match round {
            // Messages keep arriving while Redis is away.
            10 => {
                tokens_before = services::lease_tokens(&redis, &group, PARTITIONS).await;
                redis_server.stop();
            }
            // Away for longer than the lease TTL (3 s): every lease has run out.
            25 => {
                tokio::time::sleep(Duration::from_secs(4)).await;
                redis_server.start();
            }
            35 => {
                if let Some(server) = nats_server.as_mut() {
                    services::await_owners(&redis, &group, PARTITIONS, &["n0", "n1"]).await;
                    server.restart();
                    await_reconnected(&client).await;
                }
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    await_exactly_once(
        store.as_ref(),
        &cluster.job_type,
        &ids,
        &tickers,
        started,
        Duration::from_secs(120),
    )
    .await;
    // The outage cost every lease: each partition was taken again, under a newer token.
    let tokens_after = services::lease_tokens(&redis, &group, PARTITIONS).await;
    services::assert_every_token_rose(&tokens_before, &tokens_after);
    for node in 0..2 {
        cluster.nodes.terminate(node);
    }
}

/// Waits until the client publishes again after its server restarted, with a job of its
/// own (started twice at worst, which the test does not look at).
async fn await_reconnected(client: &JobClient) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let state = json!({});
    loop {
        let put = client.put("reconnect-probe", &state);
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), put).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the client did not reconnect to the restarted server"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_jobs_survive_a_redis_restart() {
    jobs_survive_redis_and_broker_restarts(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_jobs_survive_redis_and_nats_restarts() {
    jobs_survive_redis_and_broker_restarts(Kind::Nats).await;
}

/// The Kafka broker restarted under load (Tansu keeping its log in S3, as a broker keeps
/// it on disk): the nodes reconnect and resume from the positions stored with the jobs,
/// and every message is applied exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_jobs_survive_a_broker_restart() {
    let s3 = Server::s3();
    let mut kafka = Server::tansu_on_s3(&s3);
    let brokers = format!("127.0.0.1:{}", kafka.port);
    let mut cluster = Cluster::on(Kind::Kafka, &services::redis_url(), &brokers, 2);
    let Running { store, client, .. } = cluster.start_nodes(2).await;
    let (ids, tickers, started) = put_jobs(&client).await;
    for round in 0..MESSAGES {
        send_round(&client, &ids, round).await;
        // Between rounds, every message sent so far acknowledged: none is in flight to
        // be sent twice by the client across the restart.
        if round == 20 {
            kafka.restart();
            // The client's first publish after the restart may fail (the broker may have
            // lost its producer's sequence): nothing is sent twice, the probe aside.
            await_reconnected(&client).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    await_exactly_once(
        store.as_ref(),
        &cluster.job_type,
        &ids,
        &tickers,
        started,
        Duration::from_secs(120),
    )
    .await;
    for node in 0..2 {
        cluster.nodes.terminate(node);
    }
}

/// Jobs keep positions and one owner per partition, which core NATS cannot give: `weir
/// run` refuses them at start as bad input (exit 2), naming the fix.
#[test]
fn jobs_on_core_nats_are_refused_at_start() {
    let text = format!(
        r#"
[broker]
kind = "nats"
url = "{url}"
jetstream = false
[store]
kind = "memory"
[[job]]
type = "{job_type}"
handler = "builtin::count"
"#,
        url = services::nats_url(),
        job_type = services::unique("core"),
    );
    let mut config = tempfile::NamedTempFile::new().unwrap();
    config.write_all(text.as_bytes()).unwrap();
    let (code, err) = common::nodes::run_refused(config.path());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("broker.jetstream = true"), "{err}");
}

/// A job type started with another partition count than it first ran with is refused
/// at start (exit 2), naming both counts: its jobs' state is stored by partition, and a
/// job's partition is its id's hash modulo the count.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_type_started_with_another_partition_count_exits_2_naming_both() {
    // As a first run with 4 partitions left it; the config says 6.
    refused_with_another_partition_count(Kind::Nats, 4, None).await;
}

/// On Kafka the count is the topic's own: partitions added to the job type's topic
/// since its first run refuse it as a changed `partitions` does.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_type_whose_kafka_topic_gained_partitions_exits_2_naming_both() {
    refused_with_another_partition_count(Kind::Kafka, PARTITIONS, Some(PARTITIONS + 2)).await;
}

/// `weir run` on a job type recorded with `recorded` partitions, its topic made first
/// with `topic` partitions if given, exits 2 naming the recorded count and the one now.
async fn refused_with_another_partition_count(kind: Kind, recorded: u32, topic: Option<u32>) {
    use weir::ownership::MembershipStore;
    let cluster = Cluster::new(kind);
    let group = weir::jobs::ownership_group(&cluster.job_type);
    if let Some(partitions) = topic {
        let made = cluster
            .broker()
            .await
            .partitioned(&weir::wire::job_topic(&cluster.job_type), partitions)
            .await
            .unwrap();
        assert_eq!(made.partitions, partitions);
    }
    let settled = cluster
        .redis()
        .await
        .settle_partition_count(&group, recorded)
        .await
        .unwrap();
    assert_eq!(settled, recorded);
    let (code, err) = common::nodes::run_refused(cluster.config.path());
    assert_eq!(code, Some(2), "{err}");
    let now = topic.unwrap_or(PARTITIONS);
    assert!(
        err.contains(&group)
            && err.contains(&format!("{recorded} partitions"))
            && err.contains(&format!("{now} now")),
        "{err}"
    );
}

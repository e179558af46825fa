//! `weir run` on real services: crash safety under SIGKILL and stops under SIGTERM
//! (Kafka and NATS JetStream), graph failover between two processes, a frozen lease
//! holder fenced, and poison messages to the dead-letter topic.
#![cfg(feature = "it")]

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::services;
use serde_json::{json, Value};
use weir::store::CacheStore;
use weir::transport::{Assignment, Broker, Message, Outbound, Subscription};

const MAX_IN_FLIGHT: usize = 8;

enum Kind {
    Kafka,
    Nats,
}

struct Setup {
    kind: Kind,
    /// Of the input topic, on Kafka.
    partitions: i32,
    prefix: String,
    input: String,
    /// A second source, `b`, joined with `a` under `when_all`: every id is published to
    /// both topics, so each fire pairs an id with itself.
    joined: Option<String>,
    output: String,
    config: tempfile::NamedTempFile,
    _cleanup: services::Cleanup,
}

impl Setup {
    fn new(kind: Kind, lease_ttl_ms: u64) -> Self {
        Self::partitioned(kind, lease_ttl_ms, 1)
    }

    fn partitioned(kind: Kind, lease_ttl_ms: u64, partitions: i32) -> Self {
        Self::snapshotting(kind, lease_ttl_ms, partitions, 0)
    }

    fn snapshotting(
        kind: Kind,
        lease_ttl_ms: u64,
        partitions: i32,
        snapshot_interval_ms: u64,
    ) -> Self {
        Self::build(
            kind,
            lease_ttl_ms,
            partitions,
            snapshot_interval_ms,
            false,
            100,
            "",
        )
    }

    /// One partition read by a `batch` accumulator cutting batches of `size` by size
    /// alone, so that every run cuts the same batches from the same input.
    fn batched(kind: Kind, lease_ttl_ms: u64, size: u64) -> Self {
        let batch = format!("kind = \"batch\"\nbatch_size = {size}\nbatch_interval_ms = 0\n");
        Self::build(kind, lease_ttl_ms, 1, 200, false, 100, &batch)
    }

    /// One partition, a cache snapshot at every turn, and the accumulator's checkpoint
    /// writes `checkpoint_interval_ms` apart.
    fn checkpointing(kind: Kind, lease_ttl_ms: u64, checkpoint_interval_ms: u64) -> Self {
        Self::build(kind, lease_ttl_ms, 1, 0, false, checkpoint_interval_ms, "")
    }

    /// Two sources joined under `when_all`, one partition each.
    fn joined(kind: Kind, lease_ttl_ms: u64, snapshot_interval_ms: u64) -> Self {
        Self::build(kind, lease_ttl_ms, 1, snapshot_interval_ms, true, 100, "")
    }

    fn build(
        kind: Kind,
        lease_ttl_ms: u64,
        partitions: i32,
        snapshot_interval_ms: u64,
        joined: bool,
        checkpoint_interval_ms: u64,
        accumulator_options: &str,
    ) -> Self {
        let prefix = services::unique("it");
        let input = format!("{prefix}.in");
        let joined = joined.then(|| format!("{prefix}.in_b"));
        let output = format!("{prefix}.out");
        let criteria = if joined.is_some() {
            "when_all"
        } else {
            "when_any"
        };
        let second = joined
            .as_ref()
            .map(|topic| {
                format!(
                    r#"
[[graph.accumulator]]
name = "b"
topic = "{topic}"
format = "json"
"#
                )
            })
            .unwrap_or_default();
        let broker = match kind {
            Kind::Kafka => format!("{}\npartitions = {partitions}", services::kafka_table()),
            Kind::Nats => services::nats_table(),
        };
        let text = format!(
            r#"
[broker]
{broker}
[store]
kind = "redis"
url = "{redis}"
prefix = "{prefix}"
[supervision]
graph_lease_ttl_ms = {lease_ttl_ms}
backoff_base_ms = 200
[[graph]]
name = "prices"
criteria = "{criteria}"
strategy = "sequential"
function = "snapshot"
output = "{output}"
max_in_flight = {MAX_IN_FLIGHT}
snapshot_interval_ms = {snapshot_interval_ms}
checkpoint_interval_ms = {checkpoint_interval_ms}
[[graph.accumulator]]
name = "a"
topic = "{input}"
format = "json"
{accumulator_options}{second}"#,
            redis = services::redis_url(),
        );
        let mut config = tempfile::NamedTempFile::new().unwrap();
        config.write_all(text.as_bytes()).unwrap();
        Self {
            _cleanup: services::cleanup(&prefix),
            kind,
            partitions,
            prefix,
            input,
            joined,
            output,
            config,
        }
    }

    async fn broker(&self) -> Arc<dyn Broker> {
        match self.kind {
            Kind::Kafka => {
                let kafka = services::kafka_partitioned(self.partitions);
                kafka.ensure_topic(&self.input).await.unwrap();
                if let Some(joined) = &self.joined {
                    kafka.ensure_topic(joined).await.unwrap();
                }
                kafka
            }
            Kind::Nats => services::nats(true).await,
        }
    }

    fn start(&self, node: &str) -> Running {
        let log =
            std::fs::File::create(std::env::temp_dir().join(format!("{}-{node}.log", self.prefix)))
                .unwrap();
        Running(
            Command::new(env!("CARGO_BIN_EXE_weir"))
                .args(["run", "--config"])
                .arg(self.config.path())
                .env("WEIR__NODE__ID", node)
                .env("WEIR_LOG", "info")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("weir starts"),
        )
    }

    async fn lease_holder(&self) -> Option<String> {
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let value: Option<String> =
            redis::AsyncCommands::get(&mut c, format!("{}:lease:graph:prices", self.prefix))
                .await
                .unwrap();
        // `node#instance|token`: the node id part.
        value.map(|v| {
            let holder = v.split('|').next().unwrap_or_default();
            holder.split('#').next().unwrap_or_default().to_string()
        })
    }

    /// The stored checkpoint of the graph's accumulator `a`.
    async fn checkpoint(&self) -> Option<Value> {
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let value: Option<String> =
            redis::AsyncCommands::get(&mut c, format!("{}:ckpt:prices:a", self.prefix))
                .await
                .unwrap();
        value.map(|v| serde_json::from_str(&v).unwrap())
    }

    async fn wait_for_holder(&self, node: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while self.lease_holder().await.as_deref() != Some(node) {
            assert!(
                Instant::now() < deadline,
                "{node} did not take the graph lease"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A `weir run` process, killed when dropped: a test that fails part way leaves no
/// process running (or frozen) behind it.
struct Running(Child);

impl std::ops::Deref for Running {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Running {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads a topic from the start until `done` holds for what was read, or panics.
/// The reader never acknowledges, so JetStream hands it a message again after the ack
/// wait: such repeats share a position and are read once, so that only messages weir
/// itself published twice count as duplicates.
async fn read_until(
    broker: &Arc<dyn Broker>,
    topic: &str,
    within: Duration,
    mut done: impl FnMut(&[Message]) -> bool,
) -> Vec<Message> {
    let mut subscription = Subscription::new(topic, services::unique("reader"));
    subscription.assignment = Assignment::All;
    let mut source = broker.subscribe(&subscription).await.unwrap();
    let mut seen = Vec::new();
    let mut positions = std::collections::HashSet::new();
    let deadline = Instant::now() + within;
    while !done(&seen) {
        // Checked here too: with a backlog always ready, the timeout below never expires.
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            panic!("timed out reading {topic}: {} messages", seen.len());
        }
        match tokio::time::timeout(left, source.next()).await {
            Ok(Ok(m)) => {
                if positions.insert((m.position.partition, m.position.offset)) {
                    seen.push(m);
                }
            }
            Ok(Err(e)) => panic!("reading {topic}: {e}"),
            Err(_) => panic!("timed out reading {topic}: {} messages", seen.len()),
        }
    }
    seen
}

/// Reads the output until every id below `events` is in it, then what came after a
/// moment more, so that late repeats are counted too.
async fn read_every_id(broker: &Arc<dyn Broker>, output: &str, events: u64) -> Vec<Message> {
    // Parses each output once: re-reading everything per message would be quadratic.
    let mut distinct = std::collections::BTreeSet::new();
    let mut parsed = 0;
    let outputs = read_until(broker, output, Duration::from_secs(90), |seen| {
        distinct.extend(ids_in(&seen[parsed..]));
        parsed = seen.len();
        distinct.len() as u64 == events
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    read_until(broker, output, Duration::from_secs(30), |seen| {
        seen.len() >= outputs.len()
    })
    .await
}

fn fire_of(output: &Message) -> u64 {
    output
        .header("weir-fire")
        .and_then(|f| f.parse().ok())
        .expect("every output carries its fire number")
}

fn ids_in(outputs: &[Message]) -> Vec<u64> {
    outputs
        .iter()
        .filter_map(|m| {
            let v: Value = serde_json::from_slice(&m.payload).ok()?;
            v["inputs"]["a"]["id"].as_u64()
        })
        .collect()
}

async fn crash_safety(setup: Setup) {
    const EVENTS: u64 = 1500;
    let broker = setup.broker().await;
    let sink = broker.sink();
    let mut weir = setup.start("n1");
    let mut killed = false;
    let mut stored_at_kill = None;
    let store = services::redis(&setup.prefix).await;
    for id in 0..EVENTS {
        let event = json!({"id": id, "px": 100.0 + id as f64 / 100.0});
        sink.publish(Outbound::new(&setup.input, event.to_string()))
            .await
            .unwrap();
        if let Some(joined) = &setup.joined {
            sink.publish(Outbound::new(joined, event.to_string()))
                .await
                .unwrap();
        }
        if id % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if id == EVENTS / 2 {
            // Make sure the first process has been producing outputs, and has stored its
            // cache once, before going on to the kill.
            read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
                seen.len() >= 50
            })
            .await;
            let deadline = Instant::now() + Duration::from_secs(30);
            while store.load_cache("prices").await.unwrap().is_none() {
                assert!(Instant::now() < deadline, "no cache snapshot stored");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if id == EVENTS / 2 + 200 && !killed {
            // Killed once the events since are out: unless snapshots come at every turn,
            // some of their fires are acknowledged after the last one stored.
            let mut parsed = 0;
            read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
                let out = ids_in(&seen[parsed..]).contains(&(EVENTS / 2 + 150));
                parsed = seen.len();
                out
            })
            .await;
            weir.kill().unwrap();
            weir.wait().unwrap();
            killed = true;
            stored_at_kill = store.load_cache("prices").await.unwrap();
            weir = setup.start("n1");
        }
    }
    let outputs = read_every_id(&broker, &setup.output, EVENTS).await;
    weir.kill().unwrap();
    let _ = weir.wait();
    let ids = ids_in(&outputs);
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for id in &ids {
        *counts.entry(*id).or_default() += 1;
    }
    assert_eq!(
        counts.len() as u64,
        EVENTS,
        "every input appears in some output"
    );
    let duplicates: usize = counts.values().map(|c| c - 1).sum();
    eprintln!(
        "{} outputs for {EVENTS} events: {duplicates} duplicates",
        outputs.len()
    );
    // Only fires the cache stored at the kill does not count as done repeat: those it
    // requeued (awaiting acknowledgement then) and those after it.
    let stored = stored_at_kill.expect("a cache snapshot was stored before the kill");
    let first_undone = stored
        .refires
        .iter()
        .map(|r| r.fire)
        .chain([stored.fires + 1])
        .min()
        .unwrap();
    let mut first_fire: BTreeMap<u64, u64> = BTreeMap::new();
    for m in &outputs {
        let id = ids_in(std::slice::from_ref(m))[0];
        first_fire.entry(id).or_insert_with(|| fire_of(m));
    }
    for (id, count) in &counts {
        if *count > 1 {
            assert!(
                first_fire[id] >= first_undone,
                "input {id} (fire {}) repeated, though the stored cache counted fires \
                 up to {}",
                first_fire[id],
                first_undone - 1
            );
        }
    }
    if setup.joined.is_some() {
        // Each source read in its own order: a fire made again after the crash pairs
        // the inputs it paired before, whatever the two replays' interleaving.
        let mispaired: Vec<_> = outputs
            .iter()
            .filter_map(|m| {
                let v: Value = serde_json::from_slice(&m.payload).ok()?;
                let pair = (
                    v["inputs"]["a"]["id"].as_u64(),
                    v["inputs"]["b"]["id"].as_u64(),
                );
                (pair.0 != pair.1).then_some(pair)
            })
            .collect();
        assert!(
            mispaired.is_empty(),
            "{} fires paired different ids, the first {:?}",
            mispaired.len(),
            &mispaired[..mispaired.len().min(5)]
        );
    }
    if setup.partitions == 1 {
        // One source, or sources joined, each read in one order: a fire made again
        // after the crash takes the inputs and the number it had, so `weir-fire` tells
        // a consumer which outputs repeat, and a number never stands for two different
        // inputs.
        let mut fires: BTreeMap<u64, std::collections::BTreeSet<u64>> = BTreeMap::new();
        let mut numbers: BTreeMap<u64, std::collections::BTreeSet<u64>> = BTreeMap::new();
        for m in &outputs {
            let fire = fire_of(m);
            let id = ids_in(std::slice::from_ref(m))[0];
            fires.entry(fire).or_default().insert(id);
            numbers.entry(id).or_default().insert(fire);
        }
        let reused: Vec<_> = fires.iter().filter(|(_, ids)| ids.len() > 1).collect();
        assert!(
            reused.is_empty(),
            "{} fire numbers on several inputs, the first {:?}",
            reused.len(),
            &reused[..reused.len().min(5)]
        );
        let renumbered: Vec<_> = numbers.iter().filter(|(_, f)| f.len() > 1).collect();
        assert!(
            renumbered.is_empty(),
            "{} repeated inputs under new numbers, the first {:?}",
            renumbered.len(),
            &renumbered[..renumbered.len().min(5)]
        );
    }
}

/// A `batch` accumulator killed mid-stream: its partial batch is stored with the
/// positions folded into it, so the run after the kill goes on filling that batch.
/// Every input comes out, and every output is one of the batches the input makes
/// (ten consecutive ids): a batch lost at the kill would shift the cuts after it, and an
/// input folded twice would sit in two different batches.
async fn batch_crash_safety(kind: Kind) {
    const EVENTS: u64 = 1500;
    const SIZE: u64 = 10;
    let setup = Setup::batched(kind, 2000, SIZE);
    let broker = setup.broker().await;
    let sink = broker.sink();
    let mut weir = setup.start("n1");
    let batch_of = |m: &Message| -> Vec<u64> {
        let v: Value = serde_json::from_slice(&m.payload).expect("a JSON output");
        v["inputs"]["a"]
            .as_array()
            .expect("a batch")
            .iter()
            .map(|e| e["id"].as_u64().expect("an id"))
            .collect()
    };
    for id in 0..EVENTS {
        let event = json!({"id": id});
        sink.publish(Outbound::new(&setup.input, event.to_string()))
            .await
            .unwrap();
        if id % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Killed while batches are being filled, once some have come out: the kill
        // lands between a stored partial batch and the next.
        if id == EVENTS / 2 + 5 {
            read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
                seen.len() >= 20
            })
            .await;
            weir.kill().unwrap();
            weir.wait().unwrap();
            weir = setup.start("n1");
        }
    }
    let mut ids = std::collections::BTreeSet::new();
    let mut parsed = 0;
    let outputs = read_until(&broker, &setup.output, Duration::from_secs(90), |seen| {
        for m in &seen[parsed..] {
            ids.extend(batch_of(m));
        }
        parsed = seen.len();
        ids.len() as u64 == EVENTS
    })
    .await;
    weir.kill().unwrap();
    let _ = weir.wait();
    let cut_elsewhere: Vec<Vec<u64>> = outputs
        .iter()
        .map(batch_of)
        .filter(|batch| {
            let first = batch[0];
            first % SIZE != 0 || *batch != (first..first + SIZE).collect::<Vec<_>>()
        })
        .collect();
    assert!(
        cut_elsewhere.is_empty(),
        "{} outputs are not batches of ten consecutive ids from a multiple of ten, the first {:?}",
        cut_elsewhere.len(),
        &cut_elsewhere[..cut_elsewhere.len().min(3)]
    );
    eprintln!("{} batches out for {} made", outputs.len(), EVENTS / SIZE);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kafka_batch_accumulator_killed_mid_batch_loses_and_refolds_nothing() {
    batch_crash_safety(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nats_batch_accumulator_killed_mid_batch_loses_and_refolds_nothing() {
    batch_crash_safety(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_crash_loses_nothing() {
    crash_safety(Setup::new(Kind::Kafka, 2000)).await;
}

/// The replay after the kill reads the three partitions in whatever order the broker
/// hands them over, not the order they were first read in.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_three_partition_crash_and_replay_loses_nothing() {
    crash_safety(Setup::partitioned(Kind::Kafka, 2000, 3)).await;
}

/// Checkpoints written 5 s apart: the crash replays far more input than with the
/// default, whose positions the stored cache recognises, so the repeats stay within the
/// same bound.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_crash_with_checkpoints_far_apart_repeats_no_more() {
    crash_safety(Setup::checkpointing(Kind::Kafka, 2000, 5000)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_jetstream_crash_loses_nothing() {
    crash_safety(Setup::new(Kind::Nats, 2000)).await;
}

/// Stopped with SIGTERM under load and started again: the stop finishes the fires in
/// flight, stores the cache and the last checkpoint, and the restarted graph takes up
/// where it stopped, every input in exactly one output.
async fn a_stop_and_restart_under_load_repeats_nothing(kind: Kind) {
    const EVENTS: u64 = 1000;
    let setup = Setup::new(kind, 2000);
    let broker = setup.broker().await;
    let sink = broker.sink();
    let mut weir = setup.start("n1");
    for id in 0..EVENTS {
        sink.publish(Outbound::new(&setup.input, json!({"id": id}).to_string()))
            .await
            .unwrap();
        if id % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if id == EVENTS / 2 {
            // Stopped while it has outputs behind it and events still coming.
            let mut parsed = 0;
            read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
                let out = ids_in(&seen[parsed..]).contains(&(EVENTS / 4));
                parsed = seen.len();
                out
            })
            .await;
            common::servers::signal(&weir, "TERM");
            let deadline = Instant::now() + Duration::from_secs(30);
            let status = loop {
                if let Some(status) = weir.try_wait().unwrap() {
                    break status;
                }
                assert!(Instant::now() < deadline, "weir did not stop within 30 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            assert_eq!(status.code(), Some(130), "a stop's exit code: {status}");
            weir = setup.start("n1");
        }
    }
    let outputs = read_every_id(&broker, &setup.output, EVENTS).await;
    weir.kill().unwrap();
    let _ = weir.wait();
    let ids = ids_in(&outputs);
    assert_eq!(
        ids,
        (0..EVENTS).collect::<Vec<u64>>(),
        "each input once, in order"
    );
    let fires: Vec<u64> = outputs.iter().map(fire_of).collect();
    assert_eq!(
        fires,
        (1..=EVENTS).collect::<Vec<u64>>(),
        "fire numbers go on from where the stop left them"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kafka_graph_stopped_and_restarted_under_load_repeats_nothing() {
    a_stop_and_restart_under_load_repeats_nothing(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nats_graph_stopped_and_restarted_under_load_repeats_nothing() {
    a_stop_and_restart_under_load_repeats_nothing(Kind::Nats).await;
}

/// Killed a while after its last cache snapshot, with many fires acknowledged since: the
/// restarted graph numbers on from what the acknowledged fires took, not from the
/// snapshot's count.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_crash_between_snapshots_reuses_no_fire_number() {
    crash_safety(Setup::snapshotting(Kind::Kafka, 2000, 1, 1500)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_jetstream_crash_between_snapshots_reuses_no_fire_number() {
    crash_safety(Setup::snapshotting(Kind::Nats, 2000, 1, 1500)).await;
}

/// Two sources joined by `when_all`, killed between snapshots: the replays of the two
/// topics arrive interleaved as they please, and every fire still pairs what it paired
/// before, under the number it had.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_joined_sources_crash_between_snapshots_reuses_no_fire_number() {
    crash_safety(Setup::joined(Kind::Kafka, 2000, 1500)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_jetstream_joined_sources_crash_between_snapshots_reuses_no_fire_number() {
    crash_safety(Setup::joined(Kind::Nats, 2000, 1500)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn graph_fails_over_within_the_lease_ttl() {
    const TTL: Duration = Duration::from_millis(3000);
    let setup = Setup::new(Kind::Nats, TTL.as_millis() as u64);
    let broker = setup.broker().await;
    let mut first = setup.start("n1");
    let mut second = setup.start("n2");
    let deadline = Instant::now() + Duration::from_secs(30);
    let holder = loop {
        if let Some(h) = setup.lease_holder().await {
            break h;
        }
        assert!(Instant::now() < deadline, "no node took the graph lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let sink = broker.sink();
    sink.publish(Outbound::new(&setup.input, json!({"id": 1}).to_string()))
        .await
        .unwrap();
    read_until(&broker, &setup.output, Duration::from_secs(30), |seen| {
        ids_in(seen) == vec![1]
    })
    .await;
    // Only the holder runs the graph: the other keeps standing by.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(setup.lease_holder().await.as_deref(), Some(holder.as_str()));

    let (victim, survivor, survivor_name) = if holder == "n1" {
        (&mut first, &mut second, "n2")
    } else {
        (&mut second, &mut first, "n1")
    };
    victim.kill().unwrap();
    victim.wait().unwrap();
    let killed_at = Instant::now();
    loop {
        if setup.lease_holder().await.as_deref() == Some(survivor_name) {
            break;
        }
        assert!(
            killed_at.elapsed() < TTL + Duration::from_secs(3),
            "no takeover within the lease TTL"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took_over = killed_at.elapsed();
    assert!(
        took_over <= TTL + Duration::from_secs(1),
        "takeover took {took_over:?}"
    );
    sink.publish(Outbound::new(&setup.input, json!({"id": 2}).to_string()))
        .await
        .unwrap();
    let outputs = read_until(&broker, &setup.output, Duration::from_secs(30), |seen| {
        ids_in(seen).contains(&2)
    })
    .await;
    // The survivor restored the cache the holder stored after its fire: it numbers on
    // from that fire rather than starting again at 1.
    let fire_for = |id: u64| {
        outputs
            .iter()
            .find(|m| ids_in(std::slice::from_ref(*m)) == vec![id])
            .map(fire_of)
            .expect("an output for the id")
    };
    assert_eq!(
        fire_for(2),
        fire_for(1) + 1,
        "fire numbers go on after the takeover"
    );
    survivor.kill().unwrap();
    let _ = survivor.wait();
}

async fn poison_goes_to_the_dead_letter_topic(kind: Kind) {
    let setup = Setup::new(kind, 2000);
    let broker = setup.broker().await;
    let weir = setup.start("n1");
    let dead_letters = format!("{}.dlq", setup.input);
    poison_is_dead_lettered(&setup, &broker, &setup.input, &dead_letters).await;
    drop(weir);
}

/// Publishes an event, a poison message and another event to `subject`: the two events
/// fire, and the poison lands on `dead_letters` naming why.
async fn poison_is_dead_lettered(
    setup: &Setup,
    broker: &Arc<dyn Broker>,
    subject: &str,
    dead_letters: &str,
) {
    let sink = broker.sink();
    for payload in [
        json!({"id": 1}).to_string(),
        "{definitely not json".into(),
        json!({"id": 2}).to_string(),
    ] {
        sink.publish(Outbound::new(subject, payload)).await.unwrap();
    }
    let outputs = read_until(broker, &setup.output, Duration::from_secs(60), |seen| {
        ids_in(seen).len() >= 2
    })
    .await;
    assert_eq!(
        ids_in(&outputs),
        vec![1, 2],
        "good events keep flowing around the poison"
    );
    let dead = read_until(broker, dead_letters, Duration::from_secs(30), |seen| {
        !seen.is_empty()
    })
    .await;
    assert_eq!(&dead[0].payload[..], b"{definitely not json");
    assert!(dead[0]
        .header("weir-error")
        .is_some_and(|e| e.contains("invalid JSON")));
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_poison_message_is_dead_lettered() {
    poison_goes_to_the_dead_letter_topic(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_poison_message_is_dead_lettered() {
    poison_goes_to_the_dead_letter_topic(Kind::Nats).await;
}

/// An accumulator reading a wildcard subject sends its poison to `weir.dlq.<subject>`,
/// with `*` written `any` (a subject with a wildcard cannot be published to), and goes
/// on with the events after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_wildcard_subjects_poison_goes_to_its_dead_letter_subject() {
    let setup = Setup::new(Kind::Nats, 2000);
    let wildcard = format!("{}.*", setup.input);
    let text = std::fs::read_to_string(setup.config.path()).unwrap();
    let text = text.replace(
        &format!("topic = \"{}\"", setup.input),
        &format!("topic = \"{wildcard}\""),
    );
    std::fs::write(setup.config.path(), text).unwrap();
    let broker = setup.broker().await;
    // The stream capturing the wildcard made first, as weir makes it: a publish to one
    // subject before it would make a stream for that subject alone.
    drop(
        broker
            .subscribe(&Subscription::new(&wildcard, services::unique("g")))
            .await
            .unwrap(),
    );
    let weir = setup.start("n1");
    let subject = format!("{}.east", setup.input);
    let dead_letters = format!("weir.dlq.{}.any", setup.input);
    poison_is_dead_lettered(&setup, &broker, &subject, &dead_letters).await;
    drop(weir);
}

/// Two accumulators of one graph reading the same topic each see every event: neither
/// takes a share of the other's (on NATS they would otherwise share one durable).
#[tokio::test(flavor = "multi_thread")]
async fn two_accumulators_on_one_topic_each_read_all_of_it() {
    const EVENTS: u64 = 20;
    let setup = Setup::new(Kind::Nats, 3000);
    let second = format!(
        "[[graph.accumulator]]\nname = \"b\"\ntopic = \"{}\"\nformat = \"json\"\n",
        setup.input
    );
    std::fs::OpenOptions::new()
        .append(true)
        .open(setup.config.path())
        .unwrap()
        .write_all(second.as_bytes())
        .unwrap();
    let broker = setup.broker().await;
    let mut weir = setup.start("n1");
    publish_ids(&broker, &setup.input, 1..=EVENTS).await;
    let seen_by = |outputs: &[Message], source: &str| -> std::collections::BTreeSet<u64> {
        outputs
            .iter()
            .filter_map(|m| {
                let v: Value = serde_json::from_slice(&m.payload).ok()?;
                v["inputs"][source]["id"].as_u64()
            })
            .collect()
    };
    let outputs = read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
        seen_by(seen, "a").len() as u64 == EVENTS && seen_by(seen, "b").len() as u64 == EVENTS
    })
    .await;
    weir.kill().unwrap();
    let _ = weir.wait();
    assert_eq!(seen_by(&outputs, "b").len() as u64, EVENTS);
}

fn fencing_of(m: &Message) -> u64 {
    m.header("weir-fencing")
        .and_then(|t| t.parse().ok())
        .expect("outputs carry the fencing token")
}

async fn publish_ids(broker: &Arc<dyn Broker>, topic: &str, ids: std::ops::RangeInclusive<u64>) {
    let sink = broker.sink();
    for id in ids {
        sink.publish(Outbound::new(topic, json!({"id": id}).to_string()))
            .await
            .unwrap();
    }
}

/// A lease holder frozen past its TTL (SIGSTOP) and thawed after another node took
/// over publishes nothing more and writes nothing the store keeps.
async fn a_paused_lease_holder_is_fenced_when_it_resumes(kind: Kind) {
    const TTL: Duration = Duration::from_millis(3000);
    // The position of id 9, the last published: Kafka offsets count from 0, JetStream
    // stream sequences from 1.
    let last_position = match kind {
        Kind::Kafka => 8,
        Kind::Nats => 9,
    };
    let setup = Setup::new(kind, TTL.as_millis() as u64);
    let broker = setup.broker().await;
    let mut first = setup.start("n1");
    setup.wait_for_holder("n1", Duration::from_secs(30)).await;
    let mut second = setup.start("n2");
    publish_ids(&broker, &setup.input, 1..=3).await;
    let before = read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
        ids_in(seen).len() >= 3
    })
    .await;
    let old_token = fencing_of(&before[0]);
    common::servers::signal(&first, "STOP");
    // Published while the holder is frozen: a fetch or pull it had outstanding can be
    // answered into its socket, so it finds these events waiting when it thaws.
    publish_ids(&broker, &setup.input, 4..=6).await;
    setup.wait_for_holder("n2", TTL * 3).await;
    read_until(&broker, &setup.output, Duration::from_secs(60), |seen| {
        ids_in(seen).contains(&6)
    })
    .await;
    common::servers::signal(&first, "CONT");
    // The thawed node's timers, in-flight fires and writers all wake now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    publish_ids(&broker, &setup.input, 7..=9).await;
    let outputs = read_until(&broker, &setup.output, Duration::from_secs(30), |seen| {
        ids_in(seen).contains(&9)
    })
    .await;
    let by_old: Vec<u64> = ids_in(
        &outputs
            .iter()
            .filter(|m| fencing_of(m) == old_token)
            .cloned()
            .collect::<Vec<_>>(),
    );
    assert!(
        by_old.iter().all(|id| *id <= 3),
        "the paused holder published after losing its lease: {by_old:?}"
    );
    let new_token = outputs.iter().map(fencing_of).max().unwrap();
    assert!(new_token > old_token);
    // The stored checkpoint is the new holder's, and covers what it read.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let checkpoint = setup.checkpoint().await.unwrap_or_default();
        let offset = checkpoint["positions"][0]["offset"].as_i64().unwrap_or(0);
        if checkpoint["token"] == json!(new_token) && offset >= last_position {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "checkpoint not the new holder's: {checkpoint}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for child in [&mut first, &mut second] {
        child.kill().unwrap();
        let _ = child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nats_lease_holder_paused_past_its_ttl_is_fenced_when_it_resumes() {
    a_paused_lease_holder_is_fenced_when_it_resumes(Kind::Nats).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kafka_lease_holder_paused_past_its_ttl_is_fenced_when_it_resumes() {
    a_paused_lease_holder_is_fenced_when_it_resumes(Kind::Kafka).await;
}

/// Two processes given the same node id are two holders: one runs the graph, and each
/// event fires once.
#[tokio::test(flavor = "multi_thread")]
async fn two_processes_with_one_node_id_never_both_hold_the_lease() {
    let setup = Setup::new(Kind::Nats, 3000);
    let broker = setup.broker().await;
    let mut first = setup.start("twin");
    setup.wait_for_holder("twin", Duration::from_secs(30)).await;
    let mut second = setup.start("twin");
    // Long enough for the second to have tried for the lease a few times.
    tokio::time::sleep(Duration::from_secs(3)).await;
    publish_ids(&broker, &setup.input, 1..=20).await;
    let outputs = read_until(&broker, &setup.output, Duration::from_secs(30), |seen| {
        ids_in(seen).len() >= 20
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outputs = read_until(&broker, &setup.output, Duration::from_secs(30), |seen| {
        seen.len() >= outputs.len()
    })
    .await;
    assert_eq!(
        ids_in(&outputs),
        (1..=20).collect::<Vec<u64>>(),
        "each event fired once"
    );
    for child in [&mut first, &mut second] {
        child.kill().unwrap();
        let _ = child.wait();
    }
}

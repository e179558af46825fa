//! Guarantees under faults, against servers each test starts on spare ports and then
//! breaks: restarted, or refusing what is too large.
#![cfg(feature = "it")]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::servers::Server;
use common::services;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use weir::graph::NodeContext;
use weir::store::memory::MemoryStore;
use weir::transport::nats::{NatsBroker, NatsSettings};
use weir::transport::{publish_persistently, Assignment, Broker, Message, Outbound, Subscription};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, ReactorConfig, Runtime, Strategy, SupervisionPolicy,
    Supervisor,
};

async fn jetstream(server: &Server) -> Arc<NatsBroker> {
    Arc::new(
        NatsBroker::connect(NatsSettings {
            url: server.nats_url(),
            jetstream: true,
            ack_wait: Duration::from_secs(5),
            retention: Some(services::TEST_RETENTION),
        })
        .await
        .expect("test nats-server reachable"),
    )
}

/// A graph reading `<prefix>.in` that emits, per event `{"id": n, "size": s}`, the id
/// padded to `s` bytes, to `<prefix>.out`.
fn padding_graph(prefix: &str) -> weir::GraphDeclaration {
    GraphBuilder::new(format!("{prefix}g"))
        .reactor(ReactorConfig {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Sequential,
            snapshot_interval: Duration::ZERO,
            ..ReactorConfig::default()
        })
        .accumulator(AccumulatorSpec::passthrough("a").topic(format!("{prefix}.in")))
        .node("n", ["a"], |ctx: NodeContext| async move {
            let event = ctx.source("a").cloned().unwrap_or(Value::Null);
            let size = event["size"].as_u64().unwrap_or(0) as usize;
            Ok(Some(json!({"id": event["id"], "pad": "x".repeat(size)})))
        })
        .output("n", format!("{prefix}.out"))
        .build()
        .expect("valid graph")
}

fn supervisor(broker: Arc<dyn Broker>, cancel: &CancellationToken) -> Supervisor {
    let runtime = Runtime {
        broker,
        store: Arc::new(MemoryStore::new()),
        node_id: "faults".into(),
    };
    let policy = SupervisionPolicy {
        backoff_base: Duration::from_millis(200),
        ..SupervisionPolicy::default()
    };
    Supervisor::new(runtime, policy, cancel.clone())
}

/// Reads a topic from the start until `done` holds, once per position.
async fn read_until(
    broker: &Arc<dyn Broker>,
    topic: &str,
    within: Duration,
    mut done: impl FnMut(&[Message]) -> bool,
) -> Vec<Message> {
    let mut subscription = Subscription::new(topic, services::unique("reader"));
    subscription.assignment = Assignment::All;
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    let mut positions = BTreeSet::new();
    // A restarted server ends the reader's pull; a new one starts where it stopped.
    while !done(&seen) {
        assert!(
            Instant::now() < deadline,
            "timed out reading {topic}: {} messages",
            seen.len()
        );
        subscription.resume_after = seen
            .last()
            .map(|m: &Message| vec![m.position])
            .unwrap_or_default();
        let Ok(mut source) = broker.subscribe(&subscription).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        while !done(&seen) && Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_secs(2), source.next()).await {
                Ok(Ok(m)) => {
                    if positions.insert((m.position.partition, m.position.offset)) {
                        seen.push(m);
                    }
                }
                Ok(Err(_)) => break,
                Err(_) => {}
            }
        }
    }
    seen
}

fn ids(messages: &[Message]) -> BTreeSet<u64> {
    messages
        .iter()
        .filter_map(|m| serde_json::from_slice::<Value>(&m.payload).ok()?["id"].as_u64())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_over_nats_max_payload_is_dead_lettered_and_later_events_fire() {
    let server = Server::nats("max_payload: 65536");
    let nats = jetstream(&server).await;
    let broker: Arc<dyn Broker> = nats.clone();
    let prefix = services::unique("faults");
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    let sink = broker.sink();
    for (id, size) in [(1, 10), (2, 80_000), (3, 20)] {
        let event = json!({"id": id, "size": size});
        sink.publish(Outbound::new(format!("{prefix}.in"), event.to_string()))
            .await
            .unwrap();
    }
    let outputs = read_until(
        &broker,
        &format!("{prefix}.out"),
        Duration::from_secs(30),
        |seen| seen.len() >= 2,
    )
    .await;
    assert_eq!(ids(&outputs), BTreeSet::from([1, 3]));
    let dead = read_until(
        &broker,
        &format!("{prefix}.out.dlq"),
        Duration::from_secs(30),
        |seen| !seen.is_empty(),
    )
    .await;
    let error = dead[0].header("weir-error").unwrap_or_default();
    assert!(error.contains("payload"), "{error}");
    let body: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(body["graph"], json!(format!("{prefix}g")));
    assert_eq!(body["fire"], json!(2));
    assert!(body["positions"]["a"][0]["offset"].is_i64(), "{body}");
    let stats = graph.stats();
    assert_eq!(stats.dead_letters, 1, "{stats:?}");
    assert!(
        matches!(graph.status(), weir::supervisor::GraphStatus::Running),
        "no respawn: {:?}",
        graph.status()
    );
    cancel.cancel();
    supervisor.shutdown().await;
}

/// Publishes `{"id": n}` for each id, retrying each until the broker takes it.
async fn publish_ids(broker: &Arc<dyn Broker>, topic: &str, ids: std::ops::Range<u64>) {
    let sink = broker.sink();
    let never = CancellationToken::new();
    for id in ids {
        let event = json!({"id": id});
        publish_persistently(
            sink.as_ref(),
            Outbound::new(topic, event.to_string()),
            &never,
        )
        .await
        .expect("published once the server is back");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restarted_mid_stream_loses_no_input() {
    const EVENTS: u64 = 600;
    let mut server = Server::nats("");
    let nats = jetstream(&server).await;
    let broker: Arc<dyn Broker> = nats.clone();
    let prefix = services::unique("faults");
    let input = format!("{prefix}.in");
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    supervisor.spawn(padding_graph(&prefix)).unwrap();
    publish_ids(&broker, &input, 0..EVENTS / 2).await;
    read_until(
        &broker,
        &format!("{prefix}.out"),
        Duration::from_secs(30),
        |seen| seen.len() >= 50,
    )
    .await;
    let publisher = {
        let broker = broker.clone();
        let input = input.clone();
        tokio::spawn(async move { publish_ids(&broker, &input, EVENTS / 2..EVENTS).await })
    };
    let _server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    publisher.await.unwrap();
    let outputs = read_until(
        &broker,
        &format!("{prefix}.out"),
        Duration::from_secs(90),
        |seen| ids(seen).len() as u64 == EVENTS,
    )
    .await;
    assert_eq!(ids(&outputs).len() as u64, EVENTS);
    cancel.cancel();
    supervisor.shutdown().await;
}

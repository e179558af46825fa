//! Guarantees under faults, against servers each test starts on spare ports and then
//! breaks: restarted, stopped for long, or refusing what is too large.
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
use weir::transport::kafka::{KafkaBroker, KafkaSettings};
use weir::transport::nats::{NatsBroker, NatsSettings};
use weir::transport::{publish_persistently, Assignment, Broker, Message, Outbound, Subscription};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, ReactorConfig, Runtime, Strategy, SupervisionPolicy,
    Supervisor,
};

/// Stops the supervisor, then lets Kafka consumers close (on blocking threads, which
/// the runtime waits for at its end) while their broker still answers.
async fn shut_down(cancel: &CancellationToken, supervisor: Supervisor, broker: Arc<dyn Broker>) {
    cancel.cancel();
    supervisor.shutdown().await;
    drop(supervisor);
    drop(broker);
    tokio::time::sleep(Duration::from_secs(2)).await;
}

/// A Redis store on `server`, its keys under `prefix`.
async fn redis_store(server: &Server, prefix: &str) -> Arc<weir::store::redis::RedisStore> {
    Arc::new(
        weir::store::redis::RedisStore::connect(&server.redis_url(), prefix)
            .await
            .unwrap(),
    )
}

/// Waits (10 s at most) until the graph counts `count` outputs, each counted once its
/// acknowledgement is in, which can come after a reader saw the output.
async fn outputs_reach(graph: &weir::supervisor::GraphHandle, count: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while graph.stats().outputs < count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A Kafka client of a test's own Tansu.
fn kafka_client_of(server: &Server) -> Arc<dyn Broker> {
    Arc::new(
        KafkaBroker::connect(KafkaSettings {
            brokers: format!("127.0.0.1:{}", server.port),
            options: services::fast_group_options(),
            retention: Some(services::TEST_RETENTION),
            ..KafkaSettings::default()
        })
        .expect("kafka client"),
    )
}

async fn jetstream(server: &Server) -> Arc<NatsBroker> {
    jetstream_at(server.nats_url()).await
}

async fn jetstream_at(url: String) -> Arc<NatsBroker> {
    Arc::new(
        NatsBroker::connect(NatsSettings {
            url,
            jetstream: true,
            ack_wait: Duration::from_secs(5),
            retention: Some(services::TEST_RETENTION),
            ..Default::default()
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

/// A graph emitting `{"id": <the event's id>}` per event of its accumulator `a` (reading
/// `input`, or pushed to) to `<prefix>.out` through `sink`, storing its cache after every
/// fire.
fn id_graph(
    prefix: &str,
    input: Option<&str>,
    sink: Arc<dyn weir::transport::Sink>,
    queue_capacity: usize,
) -> weir::GraphDeclaration {
    let accumulator = AccumulatorSpec::passthrough("a");
    GraphBuilder::new(format!("{prefix}g"))
        .reactor(ReactorConfig {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Sequential,
            snapshot_interval: Duration::ZERO,
            queue_capacity,
            ..ReactorConfig::default()
        })
        .accumulator(match input {
            Some(topic) => accumulator.topic(topic),
            None => accumulator,
        })
        .node("n", ["a"], |ctx: NodeContext| async move {
            Ok(ctx.source("a").map(|event| json!({"id": event["id"]})))
        })
        .output_to("n", format!("{prefix}.out"), sink)
        .build()
        .expect("valid graph")
}

/// Waits (30 s at most) until the memory topic `output` holds an output for every id
/// below `count`; fails naming those missing.
async fn every_id_output(memory: &weir::transport::memory::MemoryBroker, output: &str, count: u64) {
    let out = || ids(&memory.messages(output));
    let deadline = Instant::now() + Duration::from_secs(30);
    while out().len() < count as usize {
        let seen = out();
        assert!(
            Instant::now() < deadline,
            "missing {:?}",
            (0..count)
                .filter(|id| !seen.contains(id))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
                        // Acknowledged as read, so the server neither holds back nor
                        // redelivers a long backlog.
                        if seen.len() % 256 == 0 {
                            let _ = source.commit(&[m.position]).await;
                        }
                        seen.push(m);
                    }
                }
                // A pull that went quiet may be stalled: start a fresh one.
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }
    seen
}

/// Reads a topic until every id below `count` was seen, parsing each message once; the
/// ids in the order they first appear.
async fn all_ids_read(broker: &Arc<dyn Broker>, topic: &str, count: u64) -> Vec<u64> {
    let mut distinct = BTreeSet::new();
    let mut first_seen = Vec::new();
    let mut parsed = 0;
    read_until(broker, topic, Duration::from_secs(90), |seen| {
        for message in &seen[parsed..] {
            let id = serde_json::from_slice::<Value>(&message.payload)
                .ok()
                .and_then(|event| event["id"].as_u64());
            if let Some(id) = id.filter(|id| distinct.insert(*id)) {
                first_seen.push(id);
            }
        }
        parsed = seen.len();
        distinct.len() as u64 == count
    })
    .await;
    first_seen
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
    an_output_too_large_is_dead_lettered_and_later_events_fire(nats, "payload").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_over_kafka_message_max_bytes_is_dead_lettered_and_later_events_fire() {
    let kafka = kafka_taking_at_most(65_536);
    an_output_too_large_is_dead_lettered_and_later_events_fire(kafka, "too large").await;
}

/// A client of the shared Kafka whose producer refuses messages over `bytes`, as a
/// broker refuses those over its `message.max.bytes`.
fn kafka_taking_at_most(bytes: usize) -> Arc<KafkaBroker> {
    let mut options = services::fast_group_options();
    options.insert("message.max.bytes".into(), bytes.to_string());
    Arc::new(
        KafkaBroker::connect(KafkaSettings {
            brokers: services::kafka_brokers(),
            options,
            retention: Some(services::TEST_RETENTION),
            ..KafkaSettings::default()
        })
        .unwrap(),
    )
}

/// Of three outputs, the middle one (80,000 bytes) is larger than the broker takes
/// (64 KiB): it is dead-lettered, with the broker's error naming `error_mentions`, and
/// the graph goes on without a respawn.
async fn an_output_too_large_is_dead_lettered_and_later_events_fire(
    broker: Arc<dyn Broker>,
    error_mentions: &str,
) {
    let prefix = services::unique("faults");
    // On the shared Kafka (the NATS case has a server of its own).
    let _cleanup = services::cleanup(&prefix);
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
    assert!(error.contains(error_mentions), "{error}");
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

/// Runs a graph on `broker`, restarts `server` (the broker's) once half the input is in
/// and the graph fires, goes on publishing meanwhile, and reads every input's output, in
/// the input's order: each output first seen at most `displaced` places from its input's.
async fn restarted_mid_stream_loses_no_input(
    broker: Arc<dyn Broker>,
    mut server: Server,
    events: u64,
    displaced: usize,
) {
    let prefix = services::unique("faults");
    let input = format!("{prefix}.in");
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    supervisor.spawn(padding_graph(&prefix)).unwrap();
    publish_id_bursts(&broker, &input, 0..events / 2).await;
    read_until(
        &broker,
        &format!("{prefix}.out"),
        Duration::from_secs(60),
        |seen| seen.len() >= 50,
    )
    .await;
    let publisher = {
        let broker = broker.clone();
        let input = input.clone();
        tokio::spawn(async move { publish_id_bursts(&broker, &input, events / 2..events).await })
    };
    let _server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    publisher.await.unwrap();
    outputs_follow_inputs(&broker, &prefix, events, displaced).await;
    shut_down(&cancel, supervisor, broker).await;
}

/// Reads every input's output and checks each is first seen at most `displaced` places
/// from its input's: publishes retried across a fault may have stored the input out of
/// id order, and the outputs follow the input as stored, replays aside.
async fn outputs_follow_inputs(
    broker: &Arc<dyn Broker>,
    prefix: &str,
    events: u64,
    displaced: usize,
) {
    let outputs = all_ids_read(broker, &format!("{prefix}.out"), events).await;
    let inputs = all_ids_read(broker, &format!("{prefix}.in"), events).await;
    let input_at: std::collections::HashMap<u64, usize> = inputs
        .iter()
        .enumerate()
        .map(|(at, id)| (*id, at))
        .collect();
    let misplaced = outputs
        .iter()
        .enumerate()
        .position(|(at, id)| input_at[id].abs_diff(at) > displaced);
    if let Some(at) = misplaced {
        let around = at.saturating_sub(5)..(at + 15).min(outputs.len());
        panic!(
            "outputs out of input order from {at}: outputs {:?}, inputs {:?}",
            &outputs[around.clone()],
            &inputs[around]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restarted_mid_stream_loses_no_input() {
    let server = Server::nats("");
    let broker: Arc<dyn Broker> = jetstream(&server).await;
    // No idempotent producer: an output lost with the connection comes out again behind
    // those of the fires in flight with it (`max_in_flight`, 64).
    restarted_mid_stream_loses_no_input(broker, server, 600, 64).await;
}

/// The broker stopped for 20 s under a running graph whose policy fails it after one
/// failure, restarted quickly: an unreachable broker is waited out, never counted, so
/// the graph is never Failed, and once the broker is back every input reaches an output.
async fn a_broker_down_long_never_fails_the_graph(broker: Arc<dyn Broker>, mut server: Server) {
    const OUTAGE: Duration = Duration::from_secs(20);
    let prefix = services::unique("faults");
    let input = format!("{prefix}.in");
    let cancel = CancellationToken::new();
    let store = Arc::new(MemoryStore::new());
    let runtime = Runtime {
        broker: broker.clone(),
        store: store.clone(),
        node_id: "faults".into(),
    };
    let policy = SupervisionPolicy {
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(200),
        max_failures: 1,
        ..SupervisionPolicy::default()
    };
    let supervisor = Supervisor::new(runtime, policy, cancel.clone());
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    publish_id_bursts(&broker, &input, 0..100).await;
    all_ids_read(&broker, &format!("{prefix}.out"), 100).await;
    // Every output acknowledged before the server goes: none is left to fail then.
    outputs_reach(&graph, 100).await;
    let mut server = tokio::task::spawn_blocking(move || {
        server.stop();
        server
    })
    .await
    .unwrap();
    let down_until = Instant::now() + OUTAGE;
    while Instant::now() < down_until {
        assert!(
            !matches!(graph.status(), weir::supervisor::GraphStatus::Failed { .. }),
            "failed while its broker was down: {:?}",
            graph.status()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _server = tokio::task::spawn_blocking(move || {
        server.start();
        server
    })
    .await
    .unwrap();
    publish_id_bursts(&broker, &input, 100..200).await;
    all_ids_read(&broker, &format!("{prefix}.out"), 200).await;
    // The outage was seen, as restarts of the source that count for nothing.
    let recoveries = {
        use weir::store::prelude::*;
        store.recovery_events(None, 100).await.unwrap()
    };
    assert!(!recoveries.is_empty(), "the outage went unnoticed");
    assert!(
        recoveries.iter().all(
            |e| e.attempt == 0 && e.action == weir::store::RecoveryAction::AccumulatorRestarted
        ),
        "waits are recorded, not counted: {recoveries:?}"
    );
    // What the restarted source read again was recognised, not fired twice: one output
    // per message in the input topic (a burst whose publish failed was sent again, so
    // it may hold an id twice).
    let inputs = read_until(&broker, &input, Duration::from_secs(30), |seen| {
        ids(seen).len() == 200
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let inputs = read_until(&broker, &input, Duration::from_secs(30), |seen| {
        seen.len() >= inputs.len()
    })
    .await;
    outputs_reach(&graph, inputs.len() as u64).await;
    assert_eq!(
        graph.stats().outputs,
        inputs.len() as u64,
        "{:?}",
        graph.stats()
    );
    assert!(
        !matches!(graph.status(), weir::supervisor::GraphStatus::Failed { .. }),
        "{:?}",
        graph.status()
    );
    shut_down(&cancel, supervisor, broker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_down_for_20_seconds_never_fails_the_graph() {
    let server = Server::nats("");
    let broker: Arc<dyn Broker> = jetstream(&server).await;
    a_broker_down_long_never_fails_the_graph(broker, server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_broker_down_for_20_seconds_never_fails_the_graph() {
    let s3 = Server::s3();
    let server = Server::tansu_on_s3(&s3);
    let broker = kafka_client_of(&server);
    a_broker_down_long_never_fails_the_graph(broker, server).await;
}

/// A graph over `<prefix>.in` whose node fails for the input `{"id": "bad"}`; the first
/// time only after `gate` opens, having set `holding` meanwhile.
fn gated_failing_graph(
    prefix: &str,
    gate: Arc<std::sync::atomic::AtomicBool>,
    holding: Arc<std::sync::atomic::AtomicBool>,
) -> weir::GraphDeclaration {
    use std::sync::atomic::Ordering;
    GraphBuilder::new(format!("{prefix}g"))
        .reactor(ReactorConfig {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Sequential,
            ..ReactorConfig::default()
        })
        .accumulator(AccumulatorSpec::passthrough("a").topic(format!("{prefix}.in")))
        .node("n", ["a"], move |ctx: NodeContext| {
            let gate = gate.clone();
            let holding = holding.clone();
            async move {
                let event = ctx.source("a").cloned().unwrap_or(Value::Null);
                if event["id"] != json!("bad") {
                    return Ok(Some(event));
                }
                holding.store(true, Ordering::SeqCst);
                while !gate.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(weir::NodeError::new("cannot take a bad event"))
            }
        })
        .output("n", format!("{prefix}.out"))
        .build()
        .expect("valid graph")
}

/// A fire fails while nats-server is down, so its dead letter cannot go out; the node
/// is stopped and started again on the same store before the server is back. The
/// failed input is not dropped: once the server is back it is dead-lettered, and the
/// inputs around it fire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_due_while_nats_is_down_survives_a_restart_of_the_node() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut server = Server::nats("");
    let broker: Arc<dyn Broker> = jetstream(&server).await;
    let prefix = services::unique("faults");
    let store = Arc::new(MemoryStore::new());
    let policy = SupervisionPolicy {
        backoff_base: Duration::from_millis(200),
        backoff_max: Duration::from_secs(1),
        ..SupervisionPolicy::default()
    };
    let start = |gate: bool| {
        let cancel = CancellationToken::new();
        let runtime = Runtime {
            broker: broker.clone(),
            store: store.clone(),
            node_id: "faults".into(),
        };
        let supervisor = Supervisor::new(runtime, policy.clone(), cancel.clone());
        let holding = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(AtomicBool::new(gate));
        let graph = supervisor
            .spawn(gated_failing_graph(&prefix, gate.clone(), holding.clone()))
            .unwrap();
        (supervisor, cancel, gate, holding, graph)
    };
    let (first, cancel, gate, holding, graph) = start(false);
    let sink = broker.sink();
    for id in [json!(1), json!("bad"), json!(3)] {
        sink.publish(Outbound::new(
            format!("{prefix}.in"),
            json!({ "id": id }).to_string(),
        ))
        .await
        .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holding.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the bad event never reached the node"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server = tokio::task::spawn_blocking(move || {
        server.stop();
        server
    })
    .await
    .unwrap();
    gate.store(true, Ordering::SeqCst);
    // The fire fails now, and its dead letter finds no server, through a few restarts.
    let deadline = Instant::now() + Duration::from_secs(30);
    while graph.stats().fire_failures == 0 {
        assert!(Instant::now() < deadline, "the fire never failed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    cancel.cancel();
    first.shutdown().await;
    drop(first);
    // The next node starts with the server still away, and meets it coming back.
    let (second, cancel, _, _, _) = start(true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let _server = tokio::task::spawn_blocking(move || {
        server.start();
        server
    })
    .await
    .unwrap();
    let dead = read_until(
        &broker,
        &format!("{prefix}.out.dlq"),
        Duration::from_secs(60),
        |seen| !seen.is_empty(),
    )
    .await;
    let body: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(body["inputs"]["a"]["id"], json!("bad"), "{body}");
    let outputs = read_until(
        &broker,
        &format!("{prefix}.out"),
        Duration::from_secs(60),
        |seen| ids(seen).len() >= 2,
    )
    .await;
    assert_eq!(ids(&outputs), BTreeSet::from([1, 3]));
    cancel.cancel();
    second.shutdown().await;
}

/// Publishes `{"id": n}` for each id in bursts handed to the client together, so a broker
/// storing each batch apart stores few; a burst that fails is sent again whole.
async fn publish_id_bursts(broker: &Arc<dyn Broker>, topic: &str, ids: std::ops::Range<u64>) {
    let sink = broker.sink();
    let ids: Vec<u64> = ids.collect();
    for burst in ids.chunks(50) {
        loop {
            let mut pending = Vec::new();
            for id in burst {
                let event = json!({"id": id});
                match sink.enqueue(Outbound::new(topic, event.to_string())).await {
                    Ok(ack) => pending.push(ack),
                    Err(_) => break,
                }
            }
            let sent = pending.len() == burst.len();
            let acked = futures::future::join_all(pending).await;
            if sent && acked.iter().all(Result::is_ok) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Tansu keeps its data in S3 (a local moto server) here, so it can be restarted with
/// what it stored, as a Kafka broker with its log on disk is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_broker_restarted_mid_stream_loses_no_input() {
    let s3 = Server::s3();
    let server = Server::tansu_on_s3(&s3);
    let broker = kafka_client_of(&server);
    restarted_mid_stream_loses_no_input(broker, server, 400, 0).await;
}

/// `GET path` on a local HTTP server; the status code.
async fn get_status(addr: std::net::SocketAddr, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return 0;
    };
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return 0;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// Redis refusing every write with `OOM` (memory full, no eviction) for a while: the
/// graph fires on, its checkpoint writes are waited out rather than failing it, and
/// once memory is freed the checkpoint catches up with what was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_refusing_writes_with_oom_is_waited_out_and_fails_no_graph() {
    use weir::store::prelude::*;
    let redis_server = Server::redis();
    let prefix = services::unique("faults");
    let store = redis_store(&redis_server, &prefix).await;
    let memory = weir::transport::memory::MemoryBroker::default();
    let runtime = Runtime {
        broker: Arc::new(memory.clone()),
        store: store.clone(),
        node_id: "faults".into(),
    };
    let cancel = CancellationToken::new();
    let supervisor = Supervisor::new(runtime, SupervisionPolicy::default(), cancel.clone());
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let watcher = {
        let status = graph.clone();
        tokio::spawn(async move {
            status
                .wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Failed { .. }))
                .await
        })
    };
    let publish = |ids: std::ops::Range<u64>| {
        let sink = memory.clone();
        let topic = format!("{prefix}.in");
        async move {
            for id in ids {
                let event = json!({"id": id}).to_string();
                weir::transport::Sink::publish(&sink, Outbound::new(topic.clone(), event))
                    .await
                    .unwrap();
            }
        }
    };
    let outputs = |count: usize| {
        let memory = memory.clone();
        let topic = format!("{prefix}.out");
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while memory.messages(&topic).len() < count {
                assert!(
                    Instant::now() < deadline,
                    "{} of {count} outputs",
                    memory.messages(&topic).len()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let checkpointed = || async {
        store
            .load_checkpoint(&format!("{prefix}g"), "a")
            .await
            .unwrap()
            .and_then(|c| c.positions.iter().map(|p| p.offset).max())
    };
    publish(0..10).await;
    outputs(10).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while checkpointed().await != Some(9) {
        assert!(Instant::now() < deadline, "first checkpoint never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = redis::Client::open(redis_server.redis_url()).unwrap();
    let admin = client.get_multiplexed_async_connection().await.unwrap();
    let config = |setting: &'static str, value: &'static str| {
        let mut admin = admin.clone();
        async move {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(setting)
                .arg(value)
                .query_async(&mut admin)
                .await
                .unwrap();
        }
    };
    config("maxmemory-policy", "noeviction").await;
    config("maxmemory", "1").await;
    let refused: Result<(), redis::RedisError> = redis::cmd("SET")
        .arg(format!("{prefix}probe"))
        .arg("x")
        .query_async(&mut admin.clone())
        .await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("OOM")),
        "{refused:?}"
    );
    publish(10..20).await;
    outputs(20).await;
    // Several checkpoint intervals with every write refused.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        checkpointed().await,
        Some(9),
        "nothing written while refused"
    );
    config("maxmemory", "0").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while checkpointed().await != Some(19) {
        assert!(
            Instant::now() < deadline,
            "checkpoint at {:?} after memory was freed",
            checkpointed().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(memory.messages(&format!("{prefix}.out")).len(), 20);
    assert!(!watcher.is_finished(), "the graph failed");
    watcher.abort();
    cancel.cancel();
    assert!(supervisor.shutdown().await, "stopped in time");
}

/// A command's fire is counted in the store before its outputs go: with Redis stopped
/// the command fails, naming the cause (retryable), and fires nothing; once Redis is
/// back the same command fires, numbered after every fire before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commands_fire_while_redis_is_stopped_fails_and_fires_nothing() {
    let mut redis_server = Server::redis();
    let prefix = services::unique("faults");
    let store = redis_store(&redis_server, &prefix).await;
    let memory = weir::transport::memory::MemoryBroker::new(1);
    let broker: Arc<dyn Broker> = Arc::new(memory.clone());
    let runtime = Runtime {
        broker: broker.clone(),
        store,
        node_id: "faults".into(),
    };
    let cancel = CancellationToken::new();
    let supervisor = Supervisor::new(runtime, SupervisionPolicy::default(), cancel.clone());
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    graph.push("a", json!({"id": 1})).await.unwrap();
    outputs_reach(&graph, 1).await;
    let output = format!("{prefix}.out");
    assert_eq!(memory.messages(&output).len(), 1);

    let mut redis_server = tokio::task::spawn_blocking(move || {
        redis_server.stop();
        redis_server
    })
    .await
    .unwrap();
    let refused = graph.reactor().force_fire().await;
    match &refused {
        Err(e @ weir::reactor::CommandError::CountNotStored { .. }) => {
            assert!(e.is_retryable(), "{e}");
            assert!(e.to_string().contains("fired nothing"), "{e}");
        }
        other => panic!("a command's fire with Redis stopped: {other:?}"),
    }
    assert_eq!(memory.messages(&output).len(), 1, "nothing fired");

    let redis_server = tokio::task::spawn_blocking(move || {
        redis_server.start();
        redis_server
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let fired = loop {
        match graph.reactor().force_fire().await {
            Ok(report) => break report,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("once Redis is back: {e}"),
        }
    };
    assert!(fired.fire >= 2, "{fired:?}");
    let outputs = memory.messages(&output);
    assert_eq!(outputs.len(), 2, "{outputs:?}");
    assert_eq!(
        outputs[1].header(weir::wire::FIRE_HEADER),
        Some(fired.fire.to_string().as_str())
    );
    cancel.cancel();
    assert!(supervisor.shutdown().await, "stopped in time");
    drop(redis_server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stopped_for_45_seconds_stalls_no_fire_and_loses_no_input() {
    const OUTAGE: Duration = Duration::from_secs(45);
    let nats_server = Server::nats("");
    let mut redis_server = Server::redis();
    let broker: Arc<dyn Broker> = jetstream(&nats_server).await;
    let prefix = services::unique("faults");
    let store = redis_store(&redis_server, &prefix).await;
    let runtime = Runtime {
        broker: broker.clone(),
        store,
        node_id: "faults".into(),
    };
    let cancel = CancellationToken::new();
    let policy = SupervisionPolicy {
        backoff_base: Duration::from_millis(200),
        ..SupervisionPolicy::default()
    };
    let supervisor = Arc::new(Supervisor::new(runtime.clone(), policy, cancel.clone()));
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    let admin = weir::admin::serve(
        weir::admin::AdminState::new()
            .with_supervisor(supervisor.clone())
            .with_runtime(&runtime),
        &weir::admin::Listen {
            metrics: None,
            admin: Some("127.0.0.1:0".parse().unwrap()),
            ..Default::default()
        },
        cancel.clone(),
    )
    .await
    .unwrap();
    let admin = admin.admin.unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    assert_eq!(get_status(admin, "/readyz").await, 200);

    // Never Failed, whatever happens below.
    let status = graph.clone();
    let watcher = tokio::spawn(async move {
        status
            .wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Failed { .. }))
            .await
    });
    // A cron schedule firing every second, at most once.
    let ticks_topic = format!("{prefix}.ticks");
    {
        use weir::cron::scheduler::{register, Scheduler, SchedulerConfig};
        let mut schedule = weir::cron::Schedule::new("every-second", "* * * * * *", "UTC");
        schedule.target = weir::cron::Target::Topic(ticks_topic.clone());
        register(runtime.store.as_ref(), &schedule, 1)
            .await
            .unwrap();
        let config = SchedulerConfig {
            lease_ttl: Duration::from_millis(1500),
            ..SchedulerConfig::new("faults")
        };
        tokio::spawn(
            Scheduler::new(runtime.store.clone(), broker.sink(), config).run(cancel.clone()),
        );
    }
    // Workflows: a state manager and a worker, with executions started all along.
    let flow = weir::dispatch::Workflow::new(
        &format!("{prefix}flow"),
        vec![weir::dispatch::TaskSpec::new("only", "builtin::echo")],
    )
    .unwrap();
    let executor = format!("{prefix}x");
    let manager = weir::dispatch::StateManager::new(
        runtime.store.clone(),
        broker.sink(),
        vec![flow.clone()],
        weir::dispatch::Router::new(Vec::new(), &executor).unwrap(),
        weir::dispatch::DispatchSettings {
            results_topic: format!("{prefix}.results"),
        },
    );
    tokio::spawn(manager.clone().run(broker.clone(), cancel.clone()));
    tokio::spawn(
        weir::worker::Worker::new(
            broker.clone(),
            runtime.store.clone(),
            weir::worker::HandlerRegistry::with_builtins(broker.sink()),
            vec![flow.clone()],
            weir::worker::WorkerSettings {
                executor: executor.clone(),
                concurrency: 4,
                worker_id: "faults-worker".into(),
                results_topic: format!("{prefix}.results"),
                tenant: None,
            },
        )
        .run(cancel.clone()),
    );
    let starts = {
        let (manager, name) = (manager.clone(), flow.name.clone());
        tokio::spawn(async move {
            let mut started = Vec::new();
            let begun = Instant::now();
            while begun.elapsed() < OUTAGE + Duration::from_secs(10) {
                // Refused while Redis is down: the caller sees the error.
                if let Ok(id) = manager.start(&name, json!({"n": started.len()})).await {
                    started.push(id);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            started
        })
    };
    // Steady load: 20 events every 100 ms, before, during and after the outage.
    let input = format!("{prefix}.in");
    let load = {
        let broker = broker.clone();
        tokio::spawn(async move {
            let mut next = 0;
            let started = Instant::now();
            while started.elapsed() < OUTAGE + Duration::from_secs(10) {
                publish_ids(&broker, &input, next..next + 20).await;
                next += 20;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            next
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let redis_server = tokio::task::spawn_blocking(move || {
        redis_server.stop();
        redis_server
    })
    .await
    .unwrap();
    let output = format!("{prefix}.out");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let early = graph.stats().outputs;
    assert_eq!(
        get_status(admin, "/readyz").await,
        503,
        "unready while Redis is down"
    );
    tokio::time::sleep(OUTAGE - Duration::from_secs(10)).await;
    let late = graph.stats().outputs;
    assert!(
        late > early + 100,
        "fires went on while Redis was down: {early} then {late}"
    );
    assert_eq!(get_status(admin, "/readyz").await, 503);
    let mut redis_server = redis_server;
    let redis_server = tokio::task::spawn_blocking(move || {
        redis_server.start();
        redis_server
    })
    .await
    .unwrap();
    let events = load.await.unwrap();
    all_ids_read(&broker, &output, events).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while get_status(admin, "/readyz").await != 200 {
        assert!(Instant::now() < deadline, "ready again once Redis is back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Once Redis is back, the positions are stored and committed.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let checkpoint = runtime
            .store
            .load_checkpoint(&format!("{prefix}g"), "a")
            .await
            .ok()
            .flatten();
        let stored = checkpoint
            .and_then(|c| c.positions.first().map(|p| p.offset))
            .unwrap_or(0);
        if stored as u64 >= events {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "checkpoint at {stored} of {events}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !watcher.is_finished(),
        "the graph was Failed: {:?}",
        graph.status()
    );
    watcher.abort();
    // Every workflow started completes once Redis is back.
    let started = starts.await.unwrap();
    assert!(started.len() > 10, "{} started", started.len());
    for id in &started {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let execution = manager.execution(id).await.ok().flatten();
            if execution
                .as_ref()
                .is_some_and(|e| e.status == weir::dispatch::RunStatus::Completed)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "execution {id} did not complete: {execution:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // No at_most_once tick went out twice.
    let ticks = read_until(&broker, &ticks_topic, Duration::from_secs(30), |seen| {
        seen.len() >= 10
    })
    .await;
    let mut times: Vec<i64> = ticks
        .iter()
        .map(|m| {
            weir::codec::avro::decode::<weir::codec::CronTick>(&m.payload)
                .unwrap()
                .scheduled_time_ms
        })
        .collect();
    let count = times.len();
    times.sort();
    times.dedup();
    assert_eq!(times.len(), count, "an at_most_once tick went out twice");
    cancel.cancel();
    supervisor.shutdown().await;
    drop(redis_server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_core_nats_source_is_disconnected_while_its_server_is_down() {
    let mut server = Server::nats("");
    let broker: Arc<dyn Broker> = Arc::new(
        NatsBroker::connect(NatsSettings {
            url: server.nats_url(),
            jetstream: false,
            ..NatsSettings::default()
        })
        .await
        .unwrap(),
    );
    let prefix = services::unique("faults");
    let reader = async_nats::connect(server.nats_url()).await.unwrap();
    let mut outputs = reader.subscribe(format!("{prefix}.out")).await.unwrap();
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let publish = |id: u64| {
        let sink = broker.sink();
        let input = format!("{prefix}.in");
        async move {
            sink.publish(Outbound::new(input, json!({"id": id}).to_string()))
                .await
                .unwrap();
        }
    };
    for id in [1, 2] {
        publish(id).await;
        assert_eq!(next_id(&mut outputs).await, Some(id), "every event fires");
    }
    let mut server = tokio::task::spawn_blocking(move || {
        server.stop();
        server
    })
    .await
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        graph.wait_for_state(weir::ReactorState::Degraded),
    )
    .await
    .expect("Degraded once the connection drops");
    assert_eq!(graph.health("a"), Some(weir::Health::Disconnected));
    let _server = tokio::task::spawn_blocking(move || {
        server.start();
        server
    })
    .await
    .unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        graph.wait_for_state(weir::ReactorState::Live),
    )
    .await
    .expect("Live again once the server is back");
    // Core NATS is at-most-once: what is published after the reader is back arrives.
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(3).await;
    assert_eq!(next_id(&mut outputs).await, Some(3));
    cancel.cancel();
    supervisor.shutdown().await;
}

/// A JetStream reader whose connection goes silent, neither closed nor reset (a path
/// that drops everything): its pull hears no heartbeat, so its accumulator is marked
/// disconnected and starts over within seconds, not after the client's pings give up
/// on the connection; once the path heals, every input reaches an output, those
/// published during the silence included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jetstream_reader_whose_connection_goes_silent_is_disconnected_and_loses_no_input() {
    use common::servers::Proxy;
    let server = Server::nats("");
    let direct: Arc<dyn Broker> = jetstream(&server).await;
    let proxy = Proxy::start(server.port).await;
    let through_proxy: Arc<dyn Broker> =
        jetstream_at(format!("nats://127.0.0.1:{}", proxy.port)).await;
    let prefix = services::unique("faults");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let cancel = CancellationToken::new();
    let supervisor = supervisor(through_proxy, &cancel);
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    publish_ids(&direct, &input, 0..20).await;
    all_ids_read(&direct, &output, 20).await;
    proxy.stall();
    // Two of the reader's heartbeats are 5 s; the client's own pings would take minutes.
    // Marked disconnected, it starts over at once, and is Connecting while its new
    // consumer waits on the silent path: any state but Live shows it let go.
    tokio::time::timeout(Duration::from_secs(15), async {
        while graph.health("a") == Some(weir::Health::Live) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the silent reader lets go of its connection within 15 s");
    publish_ids(&direct, &input, 20..40).await;
    proxy.heal();
    all_ids_read(&direct, &output, 40).await;
    cancel.cancel();
    supervisor.shutdown().await;
}

/// The id of the next message on a core subscription, waiting at most 20 s.
async fn next_id(outputs: &mut async_nats::Subscriber) -> Option<u64> {
    use futures::StreamExt;
    let message = tokio::time::timeout(Duration::from_secs(20), outputs.next())
        .await
        .expect("an output in time")
        .expect("subscribed");
    serde_json::from_slice::<Value>(&message.payload).unwrap()["id"].as_u64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_edited_after_a_redis_restart_applies() {
    use weir::cron::scheduler::{register, Scheduler, SchedulerConfig};
    use weir::cron::{Delivery, Schedule, Target};
    let mut redis_server = Server::redis();
    let prefix = services::unique("faults");
    let store = redis_store(&redis_server, &prefix).await;
    let broker = weir::transport::memory::MemoryBroker::default();
    let schedule = |version: u64| {
        let mut s = Schedule::new("edited", "* * * * * *", "UTC");
        s.target = Target::Topic("ticks".into());
        s.delivery = Delivery::AtLeastOnce;
        s.payload = json!({ "version": version });
        s
    };
    register(store.as_ref(), &schedule(1), 1).await.unwrap();
    let cancel = CancellationToken::new();
    let config = SchedulerConfig {
        lease_ttl: Duration::from_millis(1500),
        ..SchedulerConfig::new("cron-node")
    };
    let scheduler = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config).run(cancel.clone()),
    );
    let versions = |broker: &weir::transport::memory::MemoryBroker| -> Vec<u64> {
        broker
            .messages("ticks")
            .iter()
            .filter_map(|m| weir::codec::avro::decode::<weir::codec::CronTick>(&m.payload).ok())
            .filter_map(|t| serde_json::from_str::<Value>(&t.payload).ok()?["version"].as_u64())
            .collect()
    };
    let wait_for = |version: u64| {
        let broker = broker.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !versions(&broker).contains(&version) {
                assert!(Instant::now() < deadline, "no tick of version {version}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    wait_for(1).await;
    let redis_server = tokio::task::spawn_blocking(move || {
        redis_server.restart();
        redis_server
    })
    .await
    .unwrap();
    // The edit goes through once the store's connection is back.
    let deadline = Instant::now() + Duration::from_secs(30);
    while register(store.as_ref(), &schedule(2), 1).await.is_err() {
        assert!(Instant::now() < deadline, "Redis did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_for(2).await;
    cancel.cancel();
    let _ = scheduler.await;
    drop(redis_server);
}

/// How a node loses its Redis: its connections closed and new ones never answered (a
/// partition), or its connections kept open and silent (a path dropping every packet,
/// which only a timeout notices).
#[derive(Clone, Copy, Debug)]
enum RedisLoss {
    Cut,
    Stall,
}

impl RedisLoss {
    fn apply(self, proxy: &common::servers::Proxy) {
        match self {
            RedisLoss::Cut => proxy.cut(),
            RedisLoss::Stall => proxy.stall(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_master_cut_off_from_redis_stops_at_most_once_ticks_within_its_ttl() {
    a_cron_master_losing_redis_stops_at_most_once_ticks_within_its_ttl(RedisLoss::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_master_whose_redis_goes_silent_stops_at_most_once_ticks_within_its_ttl() {
    a_cron_master_losing_redis_stops_at_most_once_ticks_within_its_ttl(RedisLoss::Stall).await;
}

/// A cron master losing Redis (through a proxy): its at_most_once ticks stop within the
/// lease TTL and the standby takes over; at_least_once ticks go on; no at_most_once tick
/// goes out twice.
async fn a_cron_master_losing_redis_stops_at_most_once_ticks_within_its_ttl(loss: RedisLoss) {
    use common::servers::Proxy;
    use weir::codec::CronTick;
    use weir::cron::scheduler::{register, Scheduler, SchedulerConfig};
    use weir::cron::{Delivery, Schedule, Target};
    const TTL: Duration = Duration::from_millis(1500);
    let redis_server = Server::redis();
    let proxy = Proxy::start(redis_server.port).await;
    let prefix = services::unique("faults");
    let connect = |url: String| {
        let prefix = prefix.clone();
        async move {
            Arc::new(
                weir::store::redis::RedisStore::connect(&url, &prefix)
                    .await
                    .unwrap(),
            )
        }
    };
    let behind_proxy = connect(format!("redis://127.0.0.1:{}", proxy.port)).await;
    let direct = connect(redis_server.redis_url()).await;
    for (id, delivery) in [
        ("once", Delivery::AtMostOnce),
        ("least", Delivery::AtLeastOnce),
    ] {
        let mut s = Schedule::new(id, "* * * * * *", "UTC");
        s.target = Target::Topic(id.into());
        s.delivery = delivery;
        register(direct.as_ref(), &s, 1).await.unwrap();
    }
    let broker = weir::transport::memory::MemoryBroker::default();
    let cancel = CancellationToken::new();
    let node = |name: &str, priority: i64, store: Arc<weir::store::redis::RedisStore>| {
        let config = SchedulerConfig {
            priority,
            lease_ttl: TTL,
            ..SchedulerConfig::new(name)
        };
        tokio::spawn(Scheduler::new(store, Arc::new(broker.clone()), config).run(cancel.clone()))
    };
    let master = node("master", 10, behind_proxy);
    let standby = node("standby", 0, direct);
    let ticks = |topic: &str| -> Vec<CronTick> {
        broker
            .messages(topic)
            .iter()
            .map(|m| weir::codec::avro::decode::<CronTick>(&m.payload).unwrap())
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ticks("once").iter().any(|t| t.node_id == "master") {
        assert!(Instant::now() < deadline, "the master never fired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cut_at = chrono::Utc::now().timestamp_millis();
    loss.apply(&proxy);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let end = chrono::Utc::now().timestamp_millis();

    let once = ticks("once");
    let late: Vec<&CronTick> = once
        .iter()
        .filter(|t| t.node_id == "master" && t.emitted_time_ms > cut_at + TTL.as_millis() as i64)
        .collect();
    assert!(
        late.is_empty(),
        "at_most_once ticks after the TTL: {late:?}"
    );
    assert!(
        once.iter().any(|t| t.node_id == "standby"),
        "the standby took over"
    );
    let mut times: Vec<i64> = once.iter().map(|t| t.scheduled_time_ms).collect();
    let count = times.len();
    times.sort();
    times.dedup();
    assert_eq!(times.len(), count, "an at_most_once tick went out twice");

    // The cut-off master itself keeps them going, from what it holds: the standby's
    // ticks, which begin once the lease runs out, must not stand in for them.
    let least: std::collections::BTreeSet<i64> = ticks("least")
        .iter()
        .filter(|t| t.node_id == "master")
        .map(|t| t.scheduled_time_ms)
        .collect();
    // The last two seconds are left out: a tick may go out late, its store calls first
    // waiting out their bound.
    let first_second = cut_at / 1000 + 1;
    let last_second = end / 1000 - 2;
    for second in first_second..last_second {
        assert!(
            least.contains(&(second * 1000)),
            "no at_least_once tick from the master for {second} s (cut at {cut_at})"
        );
    }
    proxy.heal();
    cancel.cancel();
    let _ = tokio::join!(master, standby);
}

/// A Redis server of a test's own behind a proxy that can cut it off, a store on it
/// under a fresh prefix, and a memory broker.
struct CutOffRedis {
    _server: Server,
    proxy: common::servers::Proxy,
    prefix: String,
    store: Arc<weir::store::redis::RedisStore>,
    memory: weir::transport::memory::MemoryBroker,
    broker: Arc<dyn Broker>,
}

impl CutOffRedis {
    /// A supervisor over the memory broker and the store behind the proxy, with `policy`
    /// restarting after 200 ms rather than a second.
    fn supervisor(
        &self,
        node_id: &str,
        policy: SupervisionPolicy,
        cancel: &CancellationToken,
    ) -> Supervisor {
        self.supervisor_on(self.broker.clone(), node_id, policy, cancel)
    }

    /// [`supervisor`](Self::supervisor) over `broker` rather than the memory broker.
    fn supervisor_on(
        &self,
        broker: Arc<dyn Broker>,
        node_id: &str,
        policy: SupervisionPolicy,
        cancel: &CancellationToken,
    ) -> Supervisor {
        let runtime = Runtime {
            broker,
            store: self.store.clone(),
            node_id: node_id.into(),
        };
        let policy = SupervisionPolicy {
            backoff_base: Duration::from_millis(200),
            ..policy
        };
        Supervisor::new(runtime, policy, cancel.clone())
    }

    async fn start() -> Self {
        let server = Server::redis();
        let proxy = common::servers::Proxy::start(server.port).await;
        let prefix = services::unique("faults");
        let store = Arc::new(
            weir::store::redis::RedisStore::connect(
                &format!("redis://127.0.0.1:{}", proxy.port),
                &prefix,
            )
            .await
            .unwrap(),
        );
        let memory = weir::transport::memory::MemoryBroker::default();
        let broker: Arc<dyn Broker> = Arc::new(memory.clone());
        Self {
            _server: server,
            proxy,
            prefix,
            store,
            memory,
            broker,
        }
    }
}

/// Past 100,000 boundaries waiting for a stored snapshot, an accumulator reading Kafka
/// holds its consumer rather than reading on: through a Redis outage longer than
/// `max.poll.interval.ms` it reads nothing past the bound, and once Redis is back it
/// reads on, every input fires, and nothing is read twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_reader_held_through_a_long_redis_outage_reads_nothing_past_the_bound_and_loses_nothing(
) {
    use weir::accumulator::MOST_PENDING_BOUNDARIES;
    let cut = CutOffRedis::start().await;
    let _cleanup = services::cleanup(&cut.prefix);
    let kafka: Arc<dyn Broker> = services::kafka();
    let cancel = CancellationToken::new();
    let supervisor =
        cut.supervisor_on(kafka.clone(), "held", SupervisionPolicy::default(), &cancel);
    let (input, output) = (format!("{}.in", cut.prefix), format!("{}.out", cut.prefix));
    let decl = id_graph(
        &cut.prefix,
        Some(&input),
        Arc::new(cut.memory.clone()),
        4096,
    );
    let graph = supervisor.spawn(decl).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    cut.proxy.cut();
    let bound = MOST_PENDING_BOUNDARIES as u64;
    let total = bound + 5_000;
    let sink = kafka.sink();
    let ids: Vec<u64> = (0..total).collect();
    for burst in ids.chunks(5_000) {
        let mut acks = Vec::with_capacity(burst.len());
        for id in burst {
            let event = json!({"id": id});
            acks.push(
                sink.enqueue(Outbound::new(&input, event.to_string()))
                    .await
                    .expect("enqueued"),
            );
        }
        for ack in futures::future::join_all(acks).await {
            ack.expect("published");
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while graph.stats().pending_boundaries < bound {
        assert!(
            Instant::now() < deadline,
            "never reached the bound: {:?}",
            graph.stats()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What was handed over before the hold reaches the reactor.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held = graph.stats();
    assert!(held.boundaries < total, "read past the bound: {held:?}");
    // Longer than max.poll.interval.ms (7 s in tests).
    tokio::time::sleep(Duration::from_secs(10)).await;
    let later = graph.stats();
    assert_eq!(later.boundaries, held.boundaries, "read on while held");
    assert_eq!(later.duplicates, 0, "read twice while held");
    cut.proxy.heal();
    every_id_output(&cut.memory, &output, total).await;
    assert_eq!(graph.stats().duplicates, 0, "read twice");
    shut_down(&cancel, supervisor, kafka).await;
}

/// Redis cut off under a running graph (one without a lease): fires go on, while no
/// source position is committed to the broker, since none could be stored first; once
/// Redis is back the positions are stored, then committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_redis_is_cut_off_fires_go_on_and_the_broker_position_waits() {
    use weir::store::CheckpointStore;
    let cut = CutOffRedis::start().await;
    let cancel = CancellationToken::new();
    let supervisor = cut.supervisor("cut", SupervisionPolicy::default(), &cancel);
    let CutOffRedis {
        _server,
        proxy,
        prefix,
        memory,
        broker,
        store,
        ..
    } = cut;
    let decl = padding_graph(&prefix);
    let (graph_key, group) = (decl.key(), decl.source_group(0));
    let graph = supervisor.spawn(decl).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let committed = || memory.committed(&input, &group);
    let out = || ids(&memory.messages(&output));
    publish_ids(&broker, &input, 0..10).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while committed() != vec![10] {
        assert!(Instant::now() < deadline, "committed {:?}", committed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.cut();
    publish_ids(&broker, &input, 10..30).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while out() != (0..30).collect::<BTreeSet<u64>>() {
        assert!(Instant::now() < deadline, "fired {:?}", out());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Time for any commit that would come.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(committed(), vec![10], "committed before it was stored");
    proxy.heal();
    let deadline = Instant::now() + Duration::from_secs(30);
    while committed() != vec![30] {
        assert!(Instant::now() < deadline, "committed {:?}", committed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let checkpoint = store
        .load_checkpoint(&graph_key, "a")
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(checkpoint.positions[0].offset, 29);
    assert_eq!(memory.messages(&output).len(), 30, "nothing fired twice");
    cancel.cancel();
    supervisor.shutdown().await;
}

/// The memory broker, but the first publish of the output `{"id": fail_on}` is refused
/// as a broker that went away refuses it (retryable): the graph's reactor fails there.
struct FailsOnce {
    broker: weir::transport::memory::MemoryBroker,
    fail_on: u64,
    failed: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl weir::transport::Sink for FailsOnce {
    async fn publish(
        &self,
        message: Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        let id = serde_json::from_slice::<Value>(&message.payload)
            .ok()
            .and_then(|event| event["id"].as_u64());
        if id == Some(self.fail_on) && !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            return Err(weir::transport::TransportError::Publish {
                topic: message.topic.to_string(),
                source: "the broker went away".into(),
                retryable: true,
            });
        }
        weir::transport::Sink::publish(&self.broker, message).await
    }
}

/// The reactor fails while Redis is cut off, so its respawn cannot restore the stored
/// cache: it waits for Redis rather than starting without it, and the failure counts
/// toward nothing, even under a policy that fails a graph at its first counted failure.
/// Once Redis is back every input comes out, and no fire number stands for two inputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reactor_failing_while_redis_is_cut_off_waits_for_its_stored_cache() {
    let cut = CutOffRedis::start().await;
    let cancel = CancellationToken::new();
    let policy = SupervisionPolicy {
        max_failures: 1,
        ..SupervisionPolicy::default()
    };
    let supervisor = cut.supervisor("cut", policy, &cancel);
    let CutOffRedis {
        _server,
        proxy,
        prefix,
        memory,
        broker,
        ..
    } = cut;
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let sink = Arc::new(FailsOnce {
        broker: memory.clone(),
        fail_on: 15,
        failed: Default::default(),
    });
    let decl = id_graph(
        &prefix,
        Some(&input),
        sink.clone(),
        ReactorConfig::default().queue_capacity,
    );
    let graph = supervisor.spawn(decl).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let out = || ids(&memory.messages(&output));
    publish_ids(&broker, &input, 0..10).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while out().len() < 10 {
        assert!(Instant::now() < deadline, "fired {:?}", out());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Stored before the cut, so the respawn has a cache to wait for.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    publish_ids(&broker, &input, 10..30).await;
    let cut_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < cut_until {
        let status = graph.status();
        assert!(
            !matches!(status, weir::supervisor::GraphStatus::Failed { .. }),
            "failed while Redis was away: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        sink.failed.load(std::sync::atomic::Ordering::SeqCst),
        "the reactor reached the output that fails"
    );
    proxy.heal();
    let deadline = Instant::now() + Duration::from_secs(30);
    while out() != (0..30).collect::<BTreeSet<u64>>() {
        assert!(Instant::now() < deadline, "fired {:?}", out());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = graph.status();
    assert!(
        matches!(status, weir::supervisor::GraphStatus::Running),
        "running again: {status:?}"
    );
    let mut inputs_of_fire = std::collections::BTreeMap::new();
    for message in memory.messages(&output) {
        let fire = message.header("weir-fire").expect("numbered").to_string();
        let id = ids(std::slice::from_ref(&message));
        let earlier = inputs_of_fire.insert(fire.clone(), id.clone());
        assert!(
            earlier.as_ref().is_none_or(|earlier| *earlier == id),
            "fire {fire} stands for {earlier:?} and {id:?}"
        );
    }
    cancel.cancel();
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graph_holder_cut_off_from_redis_stops_within_its_ttl_and_takes_the_graph_back() {
    a_graph_holder_losing_redis_stops_within_its_ttl_and_takes_the_graph_back(RedisLoss::Cut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graph_holder_whose_redis_goes_silent_stops_within_its_ttl_and_takes_the_graph_back() {
    a_graph_holder_losing_redis_stops_within_its_ttl_and_takes_the_graph_back(RedisLoss::Stall)
        .await;
}

/// A graph's lease holder whose Redis goes away (the server fine) stops firing once its
/// lease's deadline passes, since another node may hold the graph by then, and takes the
/// graph up again under a newer fencing token once Redis is back. No input is lost.
async fn a_graph_holder_losing_redis_stops_within_its_ttl_and_takes_the_graph_back(
    loss: RedisLoss,
) {
    const TTL: Duration = Duration::from_millis(1500);
    let cut = CutOffRedis::start().await;
    let cancel = CancellationToken::new();
    let policy = SupervisionPolicy {
        graph_lease_ttl: Some(TTL),
        ..SupervisionPolicy::default()
    };
    let supervisor = cut.supervisor("holder", policy, &cancel);
    let CutOffRedis {
        _server,
        proxy,
        prefix,
        memory,
        broker,
        ..
    } = cut;
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let send = |id: u64| {
        let (broker, input) = (broker.clone(), input.clone());
        async move {
            let event = json!({"id": id, "size": 0}).to_string();
            broker
                .sink()
                .publish(Outbound::new(input, event))
                .await
                .unwrap();
        }
    };
    let fencing = |m: &Message| -> u64 {
        m.header(weir::wire::FENCING_HEADER)
            .and_then(|t| t.parse().ok())
            .expect("a leased graph's output carries its fencing token")
    };
    for id in 0..10 {
        send(id).await;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while ids(&memory.messages(&output)).len() < 10 {
        assert!(Instant::now() < deadline, "the first outputs never came");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_token = fencing(&memory.messages(&output)[0]);

    loss.apply(&proxy);
    // Past the deadline (at most the TTL after the loss) and the fires in flight then.
    tokio::time::sleep(TTL + Duration::from_millis(500)).await;
    let stopped_at = memory.messages(&output).len();
    for id in 10..40 {
        send(id).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        memory.messages(&output).len(),
        stopped_at,
        "a holder cut off from Redis fired past its lease's deadline"
    );

    proxy.heal();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ids(&memory.messages(&output)).len() < 40 {
        assert!(
            Instant::now() < deadline,
            "inputs missing after Redis came back: {:?}",
            (0..40)
                .filter(|id| !ids(&memory.messages(&output)).contains(id))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last = memory.messages(&output).last().map(fencing).unwrap();
    assert!(
        last > first_token,
        "taken up again under a newer token: {first_token} then {last}"
    );
    cancel.cancel();
    supervisor.shutdown().await;
}

/// librdkafka gives up on a producer after a fatal error (an idempotent producer whose
/// sequence the broker lost, say) and refuses every later message: the broker publishes
/// through a new producer from then on, but only once every publish handed to the old
/// one is settled, so nothing sent later overtakes what its sender must send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_producer_that_failed_fatally_is_replaced() {
    let broker = services::kafka();
    let topic = services::unique("fatal");
    let _cleanup = services::cleanup(&topic);
    let sink = broker.sink();
    let message = |payload: &'static str| Outbound::new(topic.as_str(), payload).key("k");
    sink.publish(message("before"))
        .await
        .expect("published before the failure");
    let held = sink
        .enqueue(message("held"))
        .await
        .expect("handed to the producer");
    broker.fail_producer_fatally();
    let failed = sink
        .publish(message("failed"))
        .await
        .expect_err("a fatally failed producer takes no message");
    assert!(failed.is_retryable(), "{failed}");
    let refused = sink
        .publish(message("refused"))
        .await
        .expect_err("refused while a publish made through the old producer is held");
    assert!(refused.is_retryable(), "{refused}");
    // Settled either way: sent before the failure, or failed with it.
    let held = held.await.is_ok();
    let never = CancellationToken::new();
    let publish = publish_persistently(sink.as_ref(), message("after"), &never);
    tokio::time::timeout(Duration::from_secs(30), publish)
        .await
        .expect("published within 30 s")
        .expect("published through the new producer");
    let expected: Vec<&[u8]> = if held {
        vec![b"before", b"held", b"after"]
    } else {
        vec![b"before", b"after"]
    };
    let read = read_until(
        &(broker.clone() as Arc<dyn Broker>),
        &topic,
        Duration::from_secs(30),
        |seen| seen.len() >= expected.len(),
    )
    .await;
    let payloads: Vec<&[u8]> = read.iter().map(|m| &m.payload[..]).collect();
    assert_eq!(payloads, expected);
    // Failing again at once (a cause that lasts): no new producer for a few seconds,
    // then one.
    broker.fail_producer_fatally();
    for attempt in ["failed again", "still failed"] {
        let failed = sink
            .publish(Outbound::new(topic.as_str(), attempt).key("k"))
            .await
            .expect_err("no new producer yet");
        assert!(failed.is_retryable(), "{failed}");
    }
    let publish = publish_persistently(sink.as_ref(), message("later"), &never);
    tokio::time::timeout(Duration::from_secs(30), publish)
        .await
        .expect("published within 30 s")
        .expect("published through a producer made later");
}

/// A consumer let go while its broker is paused (SIGSTOP) cannot finish leaving its
/// group; that must hold up neither the runtime's shutdown nor the process's exit.
#[test]
fn a_kafka_consumer_let_go_while_its_broker_is_paused_holds_up_no_shutdown() {
    let server = Server::tansu(None, &[]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let broker: Arc<dyn Broker> = Arc::new(
            KafkaBroker::connect(KafkaSettings {
                brokers: format!("127.0.0.1:{}", server.port),
                options: services::fast_group_options(),
                ..KafkaSettings::default()
            })
            .expect("kafka client"),
        );
        let topic = services::unique("paused-close");
        publish_ids(&broker, &topic, 0..1).await;
        // Read through the consumer group: the source is a member when it is let go.
        let mut source = broker
            .subscribe(&Subscription::new(
                &topic,
                services::unique("paused-close-group"),
            ))
            .await
            .expect("subscribed");
        let read = tokio::time::timeout(Duration::from_secs(30), source.next())
            .await
            .expect("a message within 30 s");
        assert!(read.is_ok(), "read the message");
        server.signal("STOP");
        drop(source);
        drop(broker);
    });
    let (shut, shut_down) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(runtime);
        let _ = shut.send(());
    });
    // Leaving the group waits for the broker's answer (librdkafka's own limit on it is
    // several seconds at best, none at worst); a runtime with nothing else to wait for
    // shuts down at once.
    let outcome = shut_down.recv_timeout(Duration::from_secs(2));
    server.signal("CONT");
    assert!(
        outcome.is_ok(),
        "the runtime's shutdown waited for a consumer leaving a paused broker's group"
    );
}

/// A Kafka consumer let go leaves its group, so the partitions it read pass to the other
/// member without waiting for its session (60 s here) to time out: what the way out of
/// every `weir` command relies on. (The broker the tests run on completes each join of a
/// group half a session after it begins, so "at once" is about 30 s here; a member that
/// did not leave would hold its partitions for the whole session first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_consumer_let_go_hands_its_partitions_over_before_its_session_times_out() {
    let mut options = services::fast_group_options();
    options.insert("session.timeout.ms".into(), "60000".into());
    options.insert("max.poll.interval.ms".into(), "70000".into());
    let broker: Arc<dyn Broker> = Arc::new(
        KafkaBroker::connect(KafkaSettings {
            brokers: services::kafka_brokers(),
            partitions: 2,
            options,
            retention: Some(services::TEST_RETENTION),
            ..KafkaSettings::default()
        })
        .expect("kafka client"),
    );
    let topic = services::unique("leave");
    let _cleanup = services::cleanup(&topic);
    let subscription = Subscription::new(&topic, services::unique("leave-group"));
    // Each member reports (member, partition, id) for every message it reads.
    let (reads, mut read) = tokio::sync::mpsc::unbounded_channel::<(usize, i32, u64)>();
    let mut members = Vec::new();
    for member in 0..2 {
        let mut source = broker.subscribe(&subscription).await.expect("subscribed");
        let reads = reads.clone();
        members.push(tokio::spawn(async move {
            loop {
                let message = match source.next().await {
                    Ok(message) => message,
                    Err(e) if e.is_retryable() => continue,
                    Err(e) => panic!("member {member} cannot read: {e}"),
                };
                let id = serde_json::from_slice::<Value>(&message.payload)
                    .ok()
                    .and_then(|v| v["id"].as_u64())
                    .expect("an id");
                if reads
                    .send((member, message.position.partition, id))
                    .is_err()
                {
                    break;
                }
            }
        }));
    }
    let sink = broker.sink();
    let mut next_id = 0u64;
    let mut publish = || {
        let id = next_id;
        next_id += 1;
        let message = Outbound {
            key: Some(format!("k{id}").into_bytes().into()),
            ..Outbound::new(&topic, json!({"id": id}).to_string())
        };
        let sink = sink.clone();
        async move {
            sink.publish(message).await.expect("published");
            id
        }
    };
    // Until each member reads a partition of its own (the group has settled: a join or
    // two, each half a session).
    let mut latest: [Option<i32>; 2] = [None, None];
    let deadline = Instant::now() + Duration::from_secs(120);
    while !matches!(latest, [Some(a), Some(b)] if a != b) {
        assert!(
            Instant::now() < deadline,
            "the group did not settle: {latest:?}"
        );
        publish().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        while let Ok((member, partition, _)) = read.try_recv() {
            latest[member] = Some(partition);
        }
    }
    let left = latest[0].expect("read");
    // Aborted, the task drops its source, whose consumer closes.
    members.remove(0).abort();
    let let_go_at = publish().await;
    // Before the 60 s session is out, the survivor reads what comes to the partition left.
    let deadline = Instant::now() + Duration::from_secs(50);
    loop {
        assert!(
            Instant::now() < deadline,
            "partition {left} was not handed over within 50 s"
        );
        publish().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut handed = false;
        while let Ok((member, partition, id)) = read.try_recv() {
            handed |= member == 1 && partition == left && id >= let_go_at;
        }
        if handed {
            break;
        }
    }
    for member in members {
        member.abort();
    }
}

/// A `weir` process a test started: killed, should the test end before the process does.
struct WeirProcess(std::process::Child);

impl WeirProcess {
    /// Starts `weir` with these arguments and `--config`, its output discarded.
    fn start(args: &[&str], config: &std::path::Path) -> Self {
        Self(
            std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
                .args(args)
                .arg("--config")
                .arg(config)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("weir starts"),
        )
    }

    /// Sends SIGTERM and waits for the exit status, at most `within`.
    async fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        common::servers::signal(&self.0, "TERM");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.0.try_wait().expect("the process's status") {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for WeirProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// A config for a `weir` process on the Kafka broker `brokers` (group timings for tests)
/// and the memory store, with `sections` after.
fn kafka_config(brokers: &str, sections: &str) -> tempfile::NamedTempFile {
    let config = tempfile::NamedTempFile::new().expect("config file");
    let text = format!(
        "[broker]\nkind = \"kafka\"\nbrokers = \"{brokers}\"\n{options}\n[store]\nkind = \"memory\"\n{sections}",
        options = services::fast_group_options_line(),
    );
    std::fs::write(config.path(), text).expect("config written");
    config
}

/// A worker is a member of its executor's consumer group, and leaving a group waits for
/// the broker. `weir worker` stopped with SIGTERM while its broker is paused still exits,
/// about as soon as the time weir gives its clients to close (5 s) is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_worker_stops_while_its_kafka_broker_is_paused() {
    let server = Server::tansu(None, &[]);
    let brokers = format!("127.0.0.1:{}", server.port);
    let prefix = services::unique("paused-worker");
    let executor = format!("{prefix}x");
    let config = kafka_config(
        &brokers,
        &format!(
            r#"[dispatch]
default_executor = "{executor}"
results_topic = "{prefix}.results"
"#
        ),
    );
    let mut worker = WeirProcess::start(&["worker", "--executor", &executor], config.path());
    // Paused only once the worker is a member of its group, since leaving is what waits:
    // a task event it cannot decode coming back on the dead-letter topic says it reads.
    let broker: Arc<dyn Broker> = Arc::new(
        KafkaBroker::connect(KafkaSettings {
            brokers: brokers.clone(),
            ..KafkaSettings::default()
        })
        .expect("kafka client"),
    );
    let tasks = weir::wire::executor_topic(&executor);
    publish_persistently(
        broker.sink().as_ref(),
        Outbound::new(tasks.clone(), "not a task event"),
        &CancellationToken::new(),
    )
    .await
    .expect("a task event published");
    read_until(
        &broker,
        &weir::wire::dead_letter_topic(&tasks),
        Duration::from_secs(60),
        |seen| !seen.is_empty(),
    )
    .await;
    drop(broker);
    server.signal("STOP");
    let status = worker.terminate(Duration::from_secs(15)).await;
    server.signal("CONT");
    let status =
        status.expect("weir worker exits within 15 s of SIGTERM while its broker is paused");
    assert_eq!(status.code(), Some(130), "{status}");
}

/// `weir run` stopped with SIGTERM while its Kafka broker is paused still exits, within
/// its shutdown limits: nothing it waits for on the way out (graphs stopping, clients
/// closing) waits on the broker without a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_run_stops_while_its_kafka_broker_is_paused() {
    let server = Server::tansu(None, &[]);
    let brokers = format!("127.0.0.1:{}", server.port);
    let prefix = services::unique("paused-exit");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let config = kafka_config(
        &brokers,
        &common::passthrough_graph_toml("paused", &input, &output),
    );
    let mut weir = WeirProcess::start(&["run"], config.path());
    {
        let broker: Arc<dyn Broker> = Arc::new(
            KafkaBroker::connect(KafkaSettings {
                brokers: brokers.clone(),
                ..KafkaSettings::default()
            })
            .expect("kafka client"),
        );
        publish_ids(&broker, &input, 0..1).await;
        // An output: the graph reads and publishes through the broker about to pause.
        read_until(&broker, &output, Duration::from_secs(60), |seen| {
            !seen.is_empty()
        })
        .await;
    }
    server.signal("STOP");
    let status = weir.terminate(Duration::from_secs(40)).await;
    server.signal("CONT");
    let status = status.expect("weir exits within 40 s of SIGTERM while its broker is paused");
    assert_eq!(status.code(), Some(130), "{status}");
}

/// A NATS server set up without JetStream answers, but takes no work-queue subscription.
/// `weir worker` and `weir run` with a workflow keep trying for a while, as they would
/// through a restart, then exit 1 naming the server. `weir run` used to stop at once
/// with status 0 when its workflow state manager could not start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_worker_and_run_on_a_nats_server_without_jetstream_exit_1_naming_it() {
    let server = Server::nats_without_jetstream();
    let url = server.nats_url();
    let config = tempfile::NamedTempFile::new().expect("config file");
    let text = format!(
        r#"[broker]
kind = "nats"
url = "{url}"
jetstream = true
[store]
kind = "memory"
[[workflow]]
name = "nightly"
[[workflow.task]]
id = "a"
handler = "builtin::echo"
"#
    );
    std::fs::write(config.path(), text).expect("config written");
    let exits = |args: &'static [&'static str]| {
        let path = config.path().to_path_buf();
        async move {
            let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_weir"))
                .args(args)
                .arg("--config")
                .arg(&path)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("weir runs");
            let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
                .await
                .unwrap_or_else(|_| panic!("weir {args:?} still running after 90 s"))
                .expect("weir's output");
            (args, out)
        }
    };
    let (worker, run) = tokio::join!(exits(&["worker", "--executor", "default"]), exits(&["run"]));
    for (args, out) in [worker, run] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "weir {args:?}: {err}");
        assert!(err.contains(&url), "weir {args:?} names {url}: {err}");
        assert!(
            err.contains("subscribing failed; retrying"),
            "weir {args:?} tried again: {err}"
        );
        assert!(
            err.contains("no JetStream answered"),
            "weir {args:?} says why: {err}"
        );
    }
}

/// Redis going silent (a hung connection, no error) while `weir run` serves a graph, a
/// keyed graph, a job type and a schedule: SIGTERM still ends it, every store call on the
/// way out being bounded, and the partition hand-overs together bounded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_run_stops_while_its_redis_is_silent() {
    use common::servers::Proxy;
    let redis_server = Server::redis();
    let proxy = Proxy::start(redis_server.port).await;
    let prefix = services::unique("silent-exit");
    let _cleanup = services::cleanup(&prefix);
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let config = tempfile::NamedTempFile::new().expect("config file");
    let text = format!(
        r#"[broker]
{broker}
[store]
kind = "redis"
url = "redis://127.0.0.1:{port}"
prefix = "{prefix}"
{plain}[[graph]]
name = "per_id"
key = "/id"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "{output}.keyed"
partitions = 2
[[graph.accumulator]]
name = "a"
topic = "{input}.keyed"
format = "json"
[[job]]
type = "{prefix}-count"
handler = "builtin::count"
partitions = 2
[[schedule]]
id = "{prefix}-tick"
cron = "* * * * * *"
timezone = "UTC"
topic = "{prefix}.ticks"
delivery = "at_least_once"
"#,
        broker = services::nats_table(),
        port = proxy.port,
        plain = common::passthrough_graph_toml("plain", &input, &output),
    );
    std::fs::write(config.path(), text).expect("config written");
    let broker: Arc<dyn Broker> = services::nats(true).await;
    let keyed_input = broker
        .partitioned(&format!("{input}.keyed"), 2)
        .await
        .expect("the keyed graph's input");
    let mut weir = WeirProcess::start(&["run"], config.path());
    publish_ids(&broker, &input, 0..1).await;
    publish_persistently(
        broker.sink().as_ref(),
        keyed_input.outbound("7", json!({"id": 7}).to_string()),
        &CancellationToken::new(),
    )
    .await
    .expect("published");
    // Outputs of both graphs: the keyed one is served by partitions it owns.
    read_until(&broker, &output, Duration::from_secs(60), |seen| {
        !seen.is_empty()
    })
    .await;
    read_until(
        &broker,
        &format!("{output}.keyed"),
        Duration::from_secs(60),
        |seen| !seen.is_empty(),
    )
    .await;
    proxy.stall();
    let stopping = Instant::now();
    let status = weir.terminate(Duration::from_secs(60)).await;
    proxy.heal();
    let status = status.expect("weir exits within 60 s of SIGTERM while Redis is silent");
    assert_eq!(status.code(), Some(130), "{status}");
    eprintln!("stopped in {:?} with Redis silent", stopping.elapsed());
}

/// Reads through one broker and publishes through another: a fault on the path of the
/// reads alone.
struct ReadsThrough {
    reads: Arc<dyn Broker>,
    writes: Arc<dyn Broker>,
}

#[async_trait::async_trait]
impl Broker for ReadsThrough {
    fn kind(&self) -> &'static str {
        self.reads.kind()
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn weir::transport::Source>, weir::transport::TransportError> {
        self.reads.subscribe(subscription).await
    }

    fn sink(&self) -> Arc<dyn weir::transport::Sink> {
        self.writes.sink()
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<weir::transport::PartitionedTopic, weir::transport::TransportError> {
        self.reads.partitioned(topic, partitions).await
    }

    async fn ping(&self) -> Result<(), weir::transport::TransportError> {
        self.reads.ping().await
    }

    fn redelivery_wait(&self) -> Option<Duration> {
        self.reads.redelivery_wait()
    }
}

/// A JetStream reader whose connection is closed while deliveries are on their way to
/// it, the client reconnecting at once: what the server had sent into the closed
/// connection never arrives, and the server counts it delivered. Acknowledging a later
/// message (ack-all) would acknowledge it too. The reader sees the gap in the consumer's
/// deliveries and reads again from its last stored position: every input reaches an
/// output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jetstream_reader_whose_connection_closes_mid_delivery_loses_no_input() {
    use common::servers::Proxy;
    const EVENTS: u64 = 40_000;
    let server = Server::nats("");
    let direct: Arc<dyn Broker> = jetstream(&server).await;
    let proxy = Proxy::start(server.port).await;
    let reads: Arc<dyn Broker> = jetstream_at(format!("nats://127.0.0.1:{}", proxy.port)).await;
    let prefix = services::unique("faults");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    // A backlog, so the reader is sent deliveries as fast as it takes them.
    let sink = direct.sink();
    let mut acks = Vec::new();
    for id in 0..EVENTS {
        let event = Outbound::new(input.as_str(), json!({ "id": id }).to_string());
        acks.push(sink.enqueue(event).await.unwrap());
        if acks.len() == 1000 {
            futures::future::try_join_all(acks.drain(..)).await.unwrap();
        }
    }
    futures::future::try_join_all(acks).await.unwrap();
    let cancel = CancellationToken::new();
    let broker = Arc::new(ReadsThrough {
        reads,
        writes: direct.clone(),
    });
    let supervisor = supervisor(broker, &cancel);
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    // Closed every so often while the graph works the backlog off.
    let cutting = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            proxy.cut();
            proxy.heal();
        }
    });
    all_ids_read(&direct, &output, EVENTS).await;
    cutting.abort();
    cancel.cancel();
    supervisor.shutdown().await;
}

/// `weir tail` reading a JetStream backlog through a connection closed every so often:
/// a read that fails after it printed some (deliveries lost with the connection) opens
/// its reader again after the last message printed, so it prints every message once,
/// in order, and stops at `--count`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weir_tail_through_a_connection_closing_mid_delivery_prints_each_message_once() {
    use common::servers::Proxy;
    use std::io::Write;
    const EVENTS: u64 = 20_000;
    let server = Server::nats("");
    let direct: Arc<dyn Broker> = jetstream(&server).await;
    let proxy = Proxy::start(server.port).await;
    let subject = services::unique("faults.tail.");
    let sink = direct.sink();
    let mut acks = Vec::new();
    for id in 0..EVENTS {
        let event = Outbound::new(subject.as_str(), json!({ "id": id }).to_string());
        acks.push(sink.enqueue(event).await.unwrap());
        if acks.len() == 1000 {
            futures::future::try_join_all(acks.drain(..)).await.unwrap();
        }
    }
    futures::future::try_join_all(acks).await.unwrap();
    let mut config = tempfile::NamedTempFile::new().unwrap();
    let url = format!("nats://127.0.0.1:{}", proxy.port);
    write!(config, "[broker]\n{}\n", services::nats_table_at(&url)).unwrap();
    let path = config.path().to_path_buf();
    let tail = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["tail", &subject, "--from-beginning", "--count"])
            .arg(EVENTS.to_string())
            .arg("--config")
            .arg(&path)
            .output()
            .unwrap()
    });
    // Cuts come in bursts, the later ones while the reader is being opened again after
    // the first and just after it is.
    let cutting = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for pause_ms in [15, 80, 0] {
                proxy.cut();
                proxy.heal();
                tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            }
        }
    });
    let tailed = tokio::time::timeout(Duration::from_secs(120), tail)
        .await
        .expect("weir tail stops after --count messages")
        .unwrap();
    cutting.abort();
    assert!(tailed.status.success(), "{tailed:?}");
    let printed: Vec<u64> = String::from_utf8(tailed.stdout)
        .unwrap()
        .lines()
        .map(|line| {
            serde_json::from_str::<Value>(line).unwrap()["id"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let missing: Vec<u64> = (0..EVENTS)
        .filter(|id| !printed.contains(id))
        .take(10)
        .collect();
    assert!(missing.is_empty(), "not printed: {missing:?}");
    assert_eq!(
        printed,
        (0..EVENTS).collect::<Vec<_>>(),
        "each once, in order"
    );
    drop(config);
}

/// Hands every message over, but the acknowledgement of the one with id `fail_on`
/// fails once, as a JetStream publish whose acknowledgement does not come in time.
struct AckFailsOnce {
    broker: weir::transport::memory::MemoryBroker,
    fail_on: u64,
    failed: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl weir::transport::Sink for AckFailsOnce {
    async fn publish(
        &self,
        message: Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        self.enqueue(message).await?.await
    }

    async fn enqueue(
        &self,
        message: Outbound,
    ) -> Result<weir::transport::PendingAck, weir::transport::TransportError> {
        let id = serde_json::from_slice::<Value>(&message.payload)
            .ok()
            .and_then(|event| event["id"].as_u64());
        if id == Some(self.fail_on) && !self.failed.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            let topic = message.topic;
            return Ok(weir::transport::PendingAck::awaited(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(weir::transport::TransportError::Publish {
                    topic: topic.to_string(),
                    source: "no acknowledgement in time".into(),
                    retryable: true,
                })
            }));
        }
        weir::transport::Sink::enqueue(&self.broker, message).await
    }
}

/// The reactor fails on an acknowledgement while a backlog waits in its queue: the
/// respawned graph fires every input, the queued ones and those in flight included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reactor_failing_on_an_acknowledgement_with_a_backlog_queued_loses_no_input() {
    const EVENTS: u64 = 5_000;
    let memory = weir::transport::memory::MemoryBroker::default();
    let broker: Arc<dyn Broker> = Arc::new(memory.clone());
    let prefix = services::unique("faults");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    publish_ids(&broker, &input, 0..EVENTS).await;
    let sink = Arc::new(AckFailsOnce {
        broker: memory.clone(),
        fail_on: 900,
        failed: Default::default(),
    });
    let decl = id_graph(
        &prefix,
        Some(&input),
        sink.clone(),
        ReactorConfig::default().queue_capacity,
    );
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    let graph = supervisor.spawn(decl).unwrap();
    every_id_output(&memory, &output, EVENTS).await;
    assert!(sink.failed.load(std::sync::atomic::Ordering::SeqCst));
    drop(graph);
    cancel.cancel();
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_at_nats_max_payload_is_dead_lettered_without_its_payload() {
    let server = Server::nats("max_payload: 65536");
    let nats = jetstream(&server).await;
    a_poison_message_at_the_limit_is_dead_lettered_without_its_payload(nats, 65_536).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_at_kafka_message_max_bytes_is_dead_lettered_without_its_payload() {
    let kafka = kafka_taking_at_most(65_536);
    a_poison_message_at_the_limit_is_dead_lettered_without_its_payload(kafka, 65_536).await;
}

/// A poison message just small enough for the broker makes a dead letter too large for
/// it, with the headers saying where it came from and why: the letter goes without the
/// payload, giving its size, and the events after the poison fire.
async fn a_poison_message_at_the_limit_is_dead_lettered_without_its_payload(
    broker: Arc<dyn Broker>,
    limit: usize,
) {
    let prefix = services::unique("faults");
    // On the shared Kafka (the NATS case has a server of its own).
    let _cleanup = services::cleanup(&prefix);
    // A long source name makes long headers on its dead letters.
    let input = format!("{prefix}.{}", "source".repeat(20));
    let output = format!("{prefix}.out");
    let decl = id_graph(
        &prefix,
        Some(&input),
        broker.sink(),
        ReactorConfig::default().queue_capacity,
    );
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    let graph = supervisor.spawn(decl).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let poison = format!("{{{}", "x".repeat(limit - 200));
    let sink = broker.sink();
    for payload in [
        json!({"id": 1}).to_string(),
        poison.clone(),
        json!({"id": 2}).to_string(),
    ] {
        sink.publish(Outbound::new(input.as_str(), payload))
            .await
            .expect("the poison alone fits");
    }
    let outputs = read_until(&broker, &output, Duration::from_secs(30), |seen| {
        ids(seen).len() == 2
    })
    .await;
    assert_eq!(ids(&outputs), BTreeSet::from([1, 2]));
    let dead = read_until(
        &broker,
        &weir::wire::dead_letter_topic(&input),
        Duration::from_secs(30),
        |seen| !seen.is_empty(),
    )
    .await;
    assert!(
        dead[0].payload.is_empty(),
        "{} bytes",
        dead[0].payload.len()
    );
    let omitted = poison.len().to_string();
    assert_eq!(
        dead[0].header(weir::wire::PAYLOAD_OMITTED_HEADER),
        Some(omitted.as_str())
    );
    assert!(dead[0]
        .header(weir::wire::ERROR_HEADER)
        .is_some_and(|e| e.contains("invalid JSON") && e.contains("payload left out")));
    assert_eq!(
        dead[0].header(weir::wire::SOURCE_TOPIC_HEADER),
        Some(input.as_str())
    );
    assert!(dead[0].header(weir::wire::OFFSET_HEADER).is_some());
    assert_eq!(graph.stats().dead_letters, 1);
    cancel.cancel();
    supervisor.shutdown().await;
}

/// The reactor fails on an acknowledgement while pushes wait for room in its queue:
/// the respawned graph fires every push, those taken from the socket before the
/// failure included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reactor_failing_on_an_acknowledgement_while_pushes_wait_loses_no_push() {
    const PUSHES: u64 = 3_000;
    let memory = weir::transport::memory::MemoryBroker::default();
    let broker: Arc<dyn Broker> = Arc::new(memory.clone());
    let prefix = services::unique("faults");
    let output = format!("{prefix}.out");
    let sink = Arc::new(AckFailsOnce {
        broker: memory.clone(),
        fail_on: 900,
        failed: Default::default(),
    });
    let decl = id_graph(&prefix, None, sink.clone(), 64);
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    let graph = supervisor.spawn(decl).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    for id in 0..PUSHES {
        // A push refused while the graph restarts is pushed again.
        while graph.push("a", json!({ "id": id })).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    every_id_output(&memory, &output, PUSHES).await;
    assert!(sink.failed.load(std::sync::atomic::Ordering::SeqCst));
    cancel.cancel();
    supervisor.shutdown().await;
}

/// Redis cut off under a graph reading JetStream for several of the stream's ack waits:
/// nothing is acknowledged meanwhile (no snapshot can be stored), so the server delivers
/// the unacknowledged messages again, ack wait after ack wait. The graph drops what it
/// already holds: every input has exactly one output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_delivered_again_while_redis_is_cut_off_fire_once() {
    let nats_server = Server::nats("");
    let broker: Arc<dyn Broker> = Arc::new(
        NatsBroker::connect(NatsSettings {
            url: nats_server.nats_url(),
            jetstream: true,
            ack_wait: Duration::from_secs(2),
            retention: Some(services::TEST_RETENTION),
            ..Default::default()
        })
        .await
        .expect("test nats-server reachable"),
    );
    let cut = CutOffRedis::start().await;
    let cancel = CancellationToken::new();
    let supervisor = cut.supervisor_on(
        broker.clone(),
        "faults",
        SupervisionPolicy::default(),
        &cancel,
    );
    let (proxy, prefix) = (&cut.proxy, &cut.prefix);
    let graph = supervisor.spawn(padding_graph(prefix)).unwrap();
    graph.wait_for_state(weir::ReactorState::Live).await;
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    publish_ids(&broker, &input, 0..50).await;
    all_ids_read(&broker, &output, 50).await;
    proxy.cut();
    publish_ids(&broker, &input, 50..100).await;
    // Three ack waits: each delivers the unacknowledged messages again.
    tokio::time::sleep(Duration::from_secs(7)).await;
    proxy.heal();
    all_ids_read(&broker, &output, 100).await;
    // Time for anything delivered late to come out too.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let published = graph.stats().outputs;
    let outputs = read_until(&broker, &output, Duration::from_secs(30), |seen| {
        seen.len() as u64 >= published
    })
    .await;
    let mut counts = std::collections::BTreeMap::<u64, usize>::new();
    for message in &outputs {
        for id in ids(std::slice::from_ref(message)) {
            *counts.entry(id).or_default() += 1;
        }
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.is_empty(), "outputs more than once: {repeated:?}");
    // The server did deliver them again: the graph dropped those as duplicates.
    let stats = graph.stats();
    assert!(stats.duplicates >= 50, "{stats:?}");
    cancel.cancel();
    supervisor.shutdown().await;
}

/// The Kafka producer fails fatally under a graph working off a backlog: the outputs it
/// held are published again through the producer made after it, every input reaches an
/// output, in input order, and the graph is never Failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_producer_failing_fatally_under_a_graph_loses_no_output() {
    const EVENTS: u64 = 10_000;
    let kafka = services::kafka();
    let broker: Arc<dyn Broker> = kafka.clone();
    let prefix = services::unique("faults");
    let _cleanup = services::cleanup(&prefix);
    publish_id_bursts(&broker, &format!("{prefix}.in"), 0..EVENTS).await;
    let cancel = CancellationToken::new();
    let supervisor = supervisor(broker.clone(), &cancel);
    let graph = supervisor.spawn(padding_graph(&prefix)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while graph.stats().outputs < 300 {
        assert!(Instant::now() < deadline, "{:?}", graph.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    kafka.fail_producer_fatally();
    let at_failure = graph.stats().outputs;
    assert!(
        at_failure < EVENTS,
        "the backlog was worked off before the failure"
    );
    outputs_follow_inputs(&broker, &prefix, EVENTS, 0).await;
    assert!(
        !matches!(graph.status(), weir::supervisor::GraphStatus::Failed { .. }),
        "{:?}",
        graph.status()
    );
    shut_down(&cancel, supervisor, broker).await;
}

//! The broker seam's conformance suite (Source, Sink), run against every backend: memory,
//! Kafka and NATS JetStream (the store's suites are in `store_conformance.rs`). The real
//! services run with `--features it` (started by `scripts/services`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use weir::graph::NodeContext;
use weir::store::memory::MemoryStore;
use weir::transport::memory::MemoryBroker;
use weir::transport::{Assignment, Broker, Message, Outbound, Source, Subscription};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, ReactorConfig, Runtime, Strategy, SupervisionPolicy,
    Supervisor,
};

const WAIT: Duration = Duration::from_secs(30);

async fn next(source: &mut Box<dyn Source>) -> Message {
    tokio::time::timeout(WAIT, source.next())
        .await
        .expect("a message within 30 s")
        .expect("consume")
}

/// Publish, consume with headers and keys, commit part way, resume after the commit.
async fn broker_conformance(
    broker: Arc<dyn Broker>,
    topic: &str,
    group: &str,
    assignment: Assignment,
) {
    let sink = broker.sink();
    for i in 0..5 {
        let message = Outbound::new(topic, format!("{{\"n\":{i}}}"))
            .key(b"k".to_vec())
            .header("weir-test", format!("h{i}"));
        sink.publish(message).await.expect("publish acknowledged");
    }
    let mut subscription = Subscription::new(topic, group);
    subscription.assignment = assignment;
    let mut source = broker.subscribe(&subscription).await.expect("subscribe");
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(next(&mut source).await);
    }
    let payloads: Vec<String> = seen
        .iter()
        .map(|m| String::from_utf8(m.payload.to_vec()).unwrap())
        .collect();
    assert_eq!(
        payloads,
        (0..5).map(|i| format!("{{\"n\":{i}}}")).collect::<Vec<_>>(),
        "one key, one partition: publish order is kept"
    );
    assert_eq!(seen[3].header("weir-test"), Some("h3"));
    assert_eq!(&*seen[0].topic, topic);
    let offsets: Vec<i64> = seen.iter().map(|m| m.position.offset).collect();
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{offsets:?}");

    // Commit through the third message; a new member of the group resumes after it.
    source.commit(&[seen[2].position]).await.expect("commit");
    drop(source);
    // Kafka commits asynchronously and a group needs a moment to hand partitions over.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut resumed = broker.subscribe(&subscription).await.expect("resubscribe");
    let first = next(&mut resumed).await;
    assert_eq!(
        first.position, seen[3].position,
        "resumes right after the commit"
    );
    assert_eq!(next(&mut resumed).await.position, seen[4].position);

    // Another group reads everything again.
    let mut other = broker
        .subscribe(&Subscription::new(topic, format!("{group}-other")))
        .await
        .unwrap();
    assert_eq!(next(&mut other).await.position, seen[0].position);

    broker.ping().await.expect("ping");
}

/// A graph working off a backlog has many fires' outputs awaiting acknowledgement at
/// once; they still reach the output topic in fire order, each input's output after the
/// one before it.
async fn graph_outputs_keep_fire_order(broker: Arc<dyn Broker>, prefix: &str) {
    const EVENTS: u64 = 2_000;
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let sink = broker.sink();
    let mut acks = Vec::new();
    for id in 0..EVENTS {
        let event = json!({ "id": id }).to_string();
        acks.push(sink.enqueue(Outbound::new(&input, event)).await.unwrap());
    }
    for ack in acks {
        ack.await.expect("input published");
    }
    let graph = GraphBuilder::new(format!("{prefix}g"))
        .reactor(ReactorConfig {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Sequential,
            ..ReactorConfig::default()
        })
        .accumulator(AccumulatorSpec::passthrough("a").topic(&input))
        .node("n", ["a"], |ctx: NodeContext| async move {
            Ok(ctx.source("a").map(|event| json!({ "id": event["id"] })))
        })
        .output("n", &output)
        .build()
        .expect("valid graph");
    let cancel = CancellationToken::new();
    let runtime = Runtime {
        broker: broker.clone(),
        store: Arc::new(MemoryStore::new()),
        node_id: "conformance".into(),
    };
    let supervisor = Supervisor::new(runtime, SupervisionPolicy::default(), cancel.clone());
    supervisor.spawn(graph).unwrap();
    let mut subscription = Subscription::new(&output, format!("{prefix}-reader"));
    subscription.assignment = Assignment::All;
    let mut reader = broker.subscribe(&subscription).await.expect("subscribe");
    let mut ids = Vec::new();
    let mut fires = Vec::new();
    while (ids.len() as u64) < EVENTS {
        let message = next(&mut reader).await;
        let event: Value = serde_json::from_slice(&message.payload).unwrap();
        ids.push(event["id"].as_u64().expect("an id"));
        fires.push(message.header("weir-fire").unwrap_or_default().to_string());
    }
    if let Some(at) = ids
        .iter()
        .zip(0..)
        .position(|(id, expected)| *id != expected)
    {
        panic!(
            "output {at} holds input {} (fire {}); around it: {:?}",
            ids[at],
            fires[at],
            &ids[at.saturating_sub(3)..(at + 10).min(ids.len())]
        );
    }
    cancel.cancel();
    supervisor.shutdown().await;
}

#[tokio::test]
async fn memory_graph_outputs_keep_fire_order() {
    graph_outputs_keep_fire_order(Arc::new(MemoryBroker::new(1)), "order.mem").await;
}

#[tokio::test]
async fn memory_broker_conforms() {
    broker_conformance(
        Arc::new(MemoryBroker::new(1)),
        "conf.mem",
        "g1",
        Assignment::Group,
    )
    .await;
    broker_conformance(
        Arc::new(MemoryBroker::new(3)),
        "conf.mem",
        "g1",
        Assignment::All,
    )
    .await;
}

#[cfg(feature = "it")]
mod services {
    use super::*;
    use common::services;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka_graph_outputs_keep_fire_order() {
        let prefix = services::unique("order");
        let _cleanup = services::cleanup(&prefix);
        graph_outputs_keep_fire_order(services::kafka(), &prefix).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_jetstream_graph_outputs_keep_fire_order() {
        let prefix = services::unique("order");
        let _cleanup = services::cleanup(&prefix);
        graph_outputs_keep_fire_order(services::nats(true).await, &prefix).await;
    }

    /// A graph whose fires have two outputs each and up to 4,096 fires awaiting
    /// acknowledgement, working off a backlog: more acknowledgements pending than the
    /// NATS client lets through by default (5,000), which must slow the graph, never
    /// stop it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nats_graph_with_more_acknowledgements_pending_than_the_client_allows_goes_on() {
        const EVENTS: u64 = 20_000;
        let prefix = services::unique("acks");
        let _cleanup = services::cleanup(&prefix);
        let broker: Arc<dyn Broker> = services::nats(true).await;
        let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
        let sink = broker.sink();
        let mut acks = Vec::new();
        for id in 0..EVENTS {
            let event = json!({ "id": id }).to_string();
            acks.push(sink.enqueue(Outbound::new(&input, event)).await.unwrap());
            if acks.len() == 1000 {
                for ack in acks.drain(..) {
                    ack.await.expect("input published");
                }
            }
        }
        for ack in acks {
            ack.await.expect("input published");
        }
        let graph = GraphBuilder::new(format!("{prefix}g"))
            .reactor(ReactorConfig {
                criteria: Criteria::WhenAny,
                strategy: Strategy::Sequential,
                max_in_flight: 4096,
                ..ReactorConfig::default()
            })
            .accumulator(AccumulatorSpec::passthrough("a").topic(&input))
            .node("n", ["a"], |ctx: NodeContext| async move {
                Ok(ctx.source("a").cloned())
            })
            .output("n", &output)
            .output("n", format!("{output}.copy"))
            .build()
            .expect("valid graph");
        let cancel = CancellationToken::new();
        let runtime = Runtime {
            broker: broker.clone(),
            store: Arc::new(MemoryStore::new()),
            node_id: "conformance".into(),
        };
        let supervisor = Supervisor::new(runtime, SupervisionPolicy::default(), cancel.clone());
        let handle = supervisor.spawn(graph).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while handle.stats().outputs < 2 * EVENTS {
            assert!(
                std::time::Instant::now() < deadline,
                "stuck at {} of {} outputs acknowledged",
                handle.stats().outputs,
                2 * EVENTS
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        cancel.cancel();
        supervisor.shutdown().await;
    }

    #[tokio::test]
    async fn kafka_broker_conforms() {
        let topic = services::unique("conf.kafka.");
        let _cleanup_topic = services::cleanup(&topic);
        broker_conformance(
            services::kafka(),
            &topic,
            &services::unique("g"),
            Assignment::Group,
        )
        .await;
    }

    #[tokio::test]
    async fn kafka_broker_conforms_with_direct_assignment() {
        let topic = services::unique("conf.kafka.");
        let _cleanup_topic = services::cleanup(&topic);
        broker_conformance(
            services::kafka(),
            &topic,
            &services::unique("g"),
            Assignment::All,
        )
        .await;
    }

    #[tokio::test]
    async fn nats_jetstream_broker_conforms() {
        let subject = services::unique("conf.js.");
        let _cleanup_subject = services::cleanup(&subject);
        broker_conformance(
            services::nats(true).await,
            &subject,
            &services::unique("g"),
            Assignment::Group,
        )
        .await;
    }

    /// A sole reader's durable (a `weir tail`, a graph's accumulator) is removed by the
    /// server once idle; a group member's is kept.
    #[tokio::test]
    async fn nats_sole_readers_do_not_leave_durables_behind() {
        use weir::transport::nats::{stream_name, SOLE_READER_IDLE_LIMIT};
        let broker = services::nats(true).await;
        let subject = services::unique("conf.idle.");
        let _cleanup_subject = services::cleanup(&subject);
        let client = async_nats::connect(services::nats_url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        for (assignment, expected) in [
            (Assignment::All, SOLE_READER_IDLE_LIMIT),
            (Assignment::Group, Duration::ZERO),
        ] {
            let group = services::unique("idle");
            let mut subscription = Subscription::new(&subject, &group);
            subscription.assignment = assignment.clone();
            let _source = broker.subscribe(&subscription).await.unwrap();
            let stream = js.get_stream(stream_name(&subject)).await.unwrap();
            let durables = durables_of(&stream, &group).await;
            assert_eq!(durables.len(), 1, "{durables:?}");
            let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer(&durables[0]).await.unwrap();
            let info = consumer.info().await.unwrap();
            assert_eq!(info.config.inactive_threshold, expected, "{assignment:?}");
        }
    }

    /// A sole reader removes its predecessors' durables and nothing else: a consumer
    /// whose name merely looks like one of theirs stays.
    #[tokio::test]
    async fn nats_sole_readers_remove_only_their_predecessors_durables() {
        use weir::transport::nats::stream_name;
        let broker = services::nats(true).await;
        let subject = services::unique("conf.tidy.");
        let _cleanup_subject = services::cleanup(&subject);
        let group = services::unique("tidy");
        let mut subscription = Subscription::new(&subject, &group);
        subscription.assignment = Assignment::All;
        let _first = broker.subscribe(&subscription).await.unwrap();
        let _second = broker.subscribe(&subscription).await.unwrap();
        let stream = stream_of(&subject).await;
        assert_eq!(
            durables_of(&stream, &group).await.len(),
            1,
            "the first's is gone"
        );
        let lookalike = format!("{}-r0000abcd", stream_name(&group));
        stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                durable_name: Some(lookalike.clone()),
                filter_subject: subject.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let _third = broker.subscribe(&subscription).await.unwrap();
        let durables = durables_of(&stream, &group).await;
        assert_eq!(durables.len(), 2, "{durables:?}");
        assert!(durables.contains(&lookalike), "{durables:?}");
        stream.delete_consumer(&lookalike).await.unwrap();
    }

    /// A holder deposed while paused subscribes again under its old fencing token before
    /// it notices: it leaves its successor's durable alone, and the successor reads on.
    /// The successor subscribing again removes both earlier durables.
    #[tokio::test]
    async fn nats_deposed_sole_reader_subscribing_again_leaves_its_successors_durable() {
        let broker = services::nats(true).await;
        let subject = services::unique("conf.fenced.");
        let _cleanup_subject = services::cleanup(&subject);
        let group = services::unique("fenced");
        let mut subscription = Subscription::new(&subject, &group);
        subscription.assignment = Assignment::All;
        let _deposed = broker
            .subscribe(&subscription.clone().fenced(5))
            .await
            .unwrap();
        let mut successor = broker
            .subscribe(&subscription.clone().fenced(6))
            .await
            .unwrap();
        let _deposed_again = broker
            .subscribe(&subscription.clone().fenced(5))
            .await
            .unwrap();
        let stream = stream_of(&subject).await;
        assert_eq!(
            durables_of(&stream, &group).await.len(),
            2,
            "the successor's and the deposed reader's latest"
        );
        broker
            .sink()
            .publish(Outbound::new(&subject, "after"))
            .await
            .unwrap();
        assert_eq!(&next(&mut successor).await.payload[..], b"after");
        let _successor_again = broker.subscribe(&subscription.fenced(6)).await.unwrap();
        assert_eq!(durables_of(&stream, &group).await.len(), 1);
    }

    /// The stream weir made for `subject`, as a plain client sees it.
    async fn stream_of(subject: &str) -> async_nats::jetstream::stream::Stream {
        let client = async_nats::connect(services::nats_url()).await.unwrap();
        async_nats::jetstream::new(client)
            .get_stream(weir::transport::nats::stream_name(subject))
            .await
            .unwrap()
    }

    /// The durable consumers of `group` on a stream.
    async fn durables_of(
        stream: &async_nats::jetstream::stream::Stream,
        group: &str,
    ) -> Vec<String> {
        use futures::TryStreamExt;
        let prefix = weir::transport::nats::stream_name(group);
        let names: Vec<String> = stream.consumer_names().try_collect().await.unwrap();
        names
            .into_iter()
            .filter(|name| name.starts_with(&prefix))
            .collect()
    }

    /// A sole reader deposed by a successor (a partition moved while its owner was
    /// paused) cannot pull its successor's messages: had it taken some and dropped them,
    /// the successor's ack-all would cover them and they would be lost. Every message
    /// reaches the successor, and the predecessor's durable is gone.
    #[tokio::test]
    async fn nats_deposed_sole_reader_takes_none_of_its_successors_messages() {
        let broker = services::nats(true).await;
        let subject = services::unique("conf.deposed.");
        let _cleanup_subject = services::cleanup(&subject);
        let group = services::unique("deposed");
        let mut subscription = Subscription::new(&subject, &group);
        subscription.assignment = Assignment::All;
        let sink = broker.sink();
        sink.publish(Outbound::new(&subject, "0")).await.unwrap();
        let mut deposed = broker.subscribe(&subscription).await.unwrap();
        let first = next(&mut deposed).await;
        assert_eq!(&first.payload[..], b"0");
        // Not read from for longer than its pull request lives (the client's 30 s), as if
        // paused: when its successor comes, it has no request waiting that the server
        // could end, and on waking it asks for more.
        tokio::time::sleep(Duration::from_secs(32)).await;
        let mut successor = broker.subscribe(&subscription).await.unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let pulling = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut taken = Vec::new();
                while !stop.is_cancelled() {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        read = deposed.next() => match read {
                            Ok(message) => taken.push(message.position.offset),
                            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                        },
                    }
                }
                taken
            }
        });
        for i in 1..=500 {
            let _ack = sink
                .enqueue(Outbound::new(&subject, i.to_string()))
                .await
                .unwrap();
        }
        sink.publish(Outbound::new(&subject, "501")).await.unwrap();
        let mut read = Vec::new();
        while read.len() < 502 {
            let message = next(&mut successor).await;
            read.push(String::from_utf8(message.payload.to_vec()).unwrap());
            if read.len() % 100 == 0 {
                let through = [message.position];
                successor.commit(&through).await.unwrap();
            }
        }
        let expected: Vec<String> = (0..=501).map(|i| i.to_string()).collect();
        assert_eq!(read, expected);
        stop.cancel();
        // It may still hold its own consumer's redeliveries of the first message.
        let taken = pulling.await.unwrap();
        let stolen: Vec<i64> = taken
            .into_iter()
            .filter(|offset| *offset != first.position.offset)
            .collect();
        assert!(stolen.is_empty(), "the deposed reader took {stolen:?}");
        let stream = stream_of(&subject).await;
        assert_eq!(durables_of(&stream, &group).await.len(), 1);
    }

    /// Streams weir creates age their messages out after the configured retention;
    /// without one they keep them.
    #[tokio::test]
    async fn nats_streams_weir_creates_have_the_configured_retention() {
        use weir::transport::nats::{stream_name, NatsBroker, NatsSettings};
        let client = async_nats::connect(services::nats_url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        for retention in [Some(Duration::from_secs(90)), None] {
            let broker = NatsBroker::connect(NatsSettings {
                url: services::nats_url(),
                retention,
                ..Default::default()
            })
            .await
            .unwrap();
            let subject = services::unique("conf.retention.");
            let _cleanup_subject = services::cleanup(&subject);
            broker
                .sink()
                .publish(Outbound::new(&subject, "1"))
                .await
                .unwrap();
            let mut stream = js.get_stream(stream_name(&subject)).await.unwrap();
            let info = stream.info().await.unwrap();
            assert_eq!(info.config.max_age, retention.unwrap_or_default());
            assert_eq!(info.state.messages, 1);
        }
    }

    /// JetStream delivers a message again once its ack wait passes unacknowledged; a
    /// graph acknowledges its inputs only through a stored cache snapshot and the
    /// checkpoint after it, so a graph whose two intervals are not well within the wait
    /// is refused when it is spawned, as the config refuses it, whoever built it.
    #[tokio::test]
    async fn a_graph_acknowledging_past_the_jetstream_ack_wait_is_refused() {
        use tokio_util::sync::CancellationToken;
        use weir::supervisor::SupervisorError;
        use weir::transport::nats::{NatsBroker, NatsSettings};
        use weir::{
            AccumulatorSpec, GraphBuilder, ReactorConfig, Runtime, SupervisionPolicy, Supervisor,
        };
        let graph = |name: &str, snapshot_ms: u64, accumulator: AccumulatorSpec| {
            GraphBuilder::new(name)
                .reactor(ReactorConfig {
                    snapshot_interval: Duration::from_millis(snapshot_ms),
                    checkpoint_interval: Duration::from_millis(500),
                    ..ReactorConfig::default()
                })
                .accumulator(accumulator)
                .node("n", ["a"], |ctx: weir::graph::NodeContext| async move {
                    Ok(ctx.source("a").cloned())
                })
                .output("n", format!("{name}.out"))
                .build()
                .expect("valid graph")
        };
        for jetstream in [true, false] {
            let broker = NatsBroker::connect(NatsSettings {
                url: services::nats_url(),
                jetstream,
                ack_wait: Duration::from_secs(5),
                retention: Some(services::TEST_RETENTION),
                ..Default::default()
            })
            .await
            .unwrap();
            let supervisor = Supervisor::new(
                Runtime {
                    broker: Arc::new(broker),
                    store: Arc::new(weir::store::memory::MemoryStore::new()),
                    node_id: "ack-wait".into(),
                },
                SupervisionPolicy::default(),
                CancellationToken::new(),
            );
            let subject = services::unique("conf.ackwait.");
            let _cleanup_subject = services::cleanup(&subject);
            let reading = |name: &str, snapshot_ms| {
                graph(
                    name,
                    snapshot_ms,
                    AccumulatorSpec::passthrough("a").topic(&subject),
                )
            };
            // 2 × (2,000 + 500) ms is the 5 s ack wait: accepted.
            supervisor
                .spawn(reading("within", 2000))
                .expect("within the ack wait");
            // 2 × (2,001 + 500) ms is past it.
            let refused = supervisor.spawn(reading("past", 2001));
            if jetstream {
                match refused {
                    Err(SupervisorError::AcknowledgedTooLate { graph, wait, .. }) => {
                        assert_eq!(graph, "past");
                        assert_eq!(wait, Duration::from_secs(5));
                    }
                    other => panic!("spawned past the ack wait: {:?}", other.err()),
                }
            } else {
                // Core NATS delivers once: no wait to keep within.
                refused.expect("core NATS redelivers nothing");
            }
            // A graph fed only by pushes reads nothing from the broker.
            supervisor
                .spawn(graph("pushed", 60_000, AccumulatorSpec::passthrough("a")))
                .expect("a push-only graph");
            supervisor.shutdown().await;
            if jetstream {
                // The stream the graphs' sources may have made.
                let client = async_nats::connect(services::nats_url()).await.unwrap();
                let js = async_nats::jetstream::new(client);
                let _ = js
                    .delete_stream(weir::transport::nats::stream_name(&subject))
                    .await;
            }
        }
    }

    /// Topics weir creates carry the configured `retention.ms`.
    #[tokio::test]
    async fn kafka_topics_weir_creates_have_the_configured_retention() {
        use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
        use rdkafka::client::DefaultClientContext;
        use rdkafka::ClientConfig;
        let broker = services::kafka();
        let topic = services::unique("conf.retention.");
        let _cleanup_topic = services::cleanup(&topic);
        broker
            .sink()
            .publish(Outbound::new(&topic, "1"))
            .await
            .unwrap();
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", services::kafka_brokers())
            .create()
            .unwrap();
        let described = admin
            .describe_configs([&ResourceSpecifier::Topic(&topic)], &AdminOptions::new())
            .await
            .unwrap();
        let resource = described.into_iter().next().unwrap().unwrap();
        let retention = resource.get("retention.ms").and_then(|e| e.value.clone());
        assert_eq!(
            retention,
            Some(services::TEST_RETENTION.as_millis().to_string())
        );
    }

    /// A stream that already captures a subject (made by its owner, with its own
    /// retention) is used as it is: weir makes no stream of its own for the subject and
    /// leaves the stream's limits alone, whatever retention weir is configured with.
    #[tokio::test]
    async fn an_existing_nats_stream_keeps_its_own_retention() {
        use weir::transport::nats::{stream_name, NatsBroker, NatsSettings};
        const OWN: Duration = Duration::from_secs(3600);
        let subject = services::unique("conf.owned.");
        let _cleanup_subject = services::cleanup(&subject);
        let own_stream = format!("{}_own", stream_name(&subject));
        let client = async_nats::connect(services::nats_url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: own_stream.clone(),
            subjects: vec![subject.clone()],
            max_age: OWN,
            ..Default::default()
        })
        .await
        .unwrap();
        let broker = NatsBroker::connect(NatsSettings {
            url: services::nats_url(),
            retention: Some(Duration::from_secs(90)),
            ..Default::default()
        })
        .await
        .unwrap();
        broker
            .sink()
            .publish(Outbound::new(&subject, "1"))
            .await
            .unwrap();
        let mut subscription = Subscription::new(&subject, services::unique("g"));
        subscription.assignment = Assignment::All;
        let mut source = broker.subscribe(&subscription).await.unwrap();
        assert_eq!(&next(&mut source).await.payload[..], b"1");
        let info = js
            .get_stream(&own_stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .clone();
        assert_eq!(info.config.max_age, OWN, "the stream's own retention");
        assert_eq!(
            info.state.messages, 1,
            "the message is in the owner's stream"
        );
        assert!(
            js.get_stream(stream_name(&subject)).await.is_err(),
            "no stream of weir's own for the subject"
        );
    }

    /// A topic made before weir first uses it keeps the retention it was made with.
    #[tokio::test]
    async fn an_existing_kafka_topic_keeps_its_own_retention() {
        use rdkafka::admin::TopicReplication;
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier};
        use rdkafka::client::DefaultClientContext;
        use rdkafka::ClientConfig;
        const OWN_MS: &str = "3600000";
        let topic = services::unique("conf.owned.");
        let _cleanup_topic = services::cleanup(&topic);
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", services::kafka_brokers())
            .create()
            .unwrap();
        let made =
            admin
                .create_topics(
                    [&NewTopic::new(&topic, 1, TopicReplication::Fixed(1))
                        .set("retention.ms", OWN_MS)],
                    &AdminOptions::new(),
                )
                .await
                .unwrap();
        made.into_iter().next().unwrap().unwrap();
        let broker = services::kafka();
        broker
            .sink()
            .publish(Outbound::new(&topic, "1"))
            .await
            .unwrap();
        broker.ensure_topic(&topic).await.unwrap();
        let mut subscription = Subscription::new(&topic, services::unique("g"));
        subscription.assignment = Assignment::All;
        let mut source = broker.subscribe(&subscription).await.unwrap();
        assert_eq!(&next(&mut source).await.payload[..], b"1");
        let described = admin
            .describe_configs([&ResourceSpecifier::Topic(&topic)], &AdminOptions::new())
            .await
            .unwrap();
        let resource = described.into_iter().next().unwrap().unwrap();
        let retention = resource.get("retention.ms").and_then(|e| e.value.clone());
        assert_eq!(
            retention.as_deref(),
            Some(OWN_MS),
            "the topic's own retention"
        );
    }

    #[tokio::test]
    async fn nats_core_delivers_while_subscribed() {
        // Core NATS is at-most-once: only what is published while subscribed arrives.
        let broker = services::nats(false).await;
        let subject = services::unique("conf.core.");
        let _cleanup_subject = services::cleanup(&subject);
        let mut source = broker
            .subscribe(&Subscription::new(&subject, "g"))
            .await
            .unwrap();
        broker
            .sink()
            .publish(Outbound::new(&subject, "1").header("weir-test", "x"))
            .await
            .unwrap();
        let message = next(&mut source).await;
        assert_eq!(&message.payload[..], b"1");
        assert_eq!(message.header("weir-test"), Some("x"));
        source.commit(&[message.position]).await.unwrap();
    }

    #[tokio::test]
    async fn redis_down_is_a_clear_retryable_error() {
        let err = weir::store::redis::RedisStore::connect("redis://127.0.0.1:1", "x")
            .await
            .err()
            .expect("nothing listens on port 1");
        assert!(err.is_retryable());
        assert!(err.to_string().contains("redis"), "{err}");
    }

    #[tokio::test]
    async fn nats_down_is_a_clear_error() {
        let settings = weir::transport::nats::NatsSettings {
            url: "nats://127.0.0.1:1".into(),
            jetstream: true,
            ..Default::default()
        };
        let err = weir::transport::nats::NatsBroker::connect(settings)
            .await
            .err()
            .unwrap();
        assert!(err.is_retryable());
        assert!(err.to_string().contains("nats://127.0.0.1:1"), "{err}");
    }
}

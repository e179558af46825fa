//! One conformance suite per seam, run against every backend: the broker seam (Source,
//! Sink) on memory, Kafka and NATS JetStream; the store seam on memory and Redis. The
//! real services run with `--features it` (started by `scripts/services`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use weir::store::{
    Checkpoint, Execution, ExecutionStatus, Fence, Lease, RecoveryAction, RecoveryEvent, Store,
    StoreError,
};
use weir::transport::memory::MemoryBroker;
use weir::transport::{Assignment, Broker, Message, Outbound, Position, Source, Subscription};

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

async fn store_conformance(store: Arc<dyn Store>, graph: &str) {
    // Checkpoints.
    assert_eq!(store.load_checkpoint(graph, "a").await.unwrap(), None);
    let checkpoint = Checkpoint {
        positions: vec![
            Position {
                partition: 0,
                offset: 41,
            },
            Position {
                partition: 2,
                offset: 7,
            },
        ],
        state: Some(serde_json::json!({"sum": 3})),
        token: None,
    };
    store
        .save_checkpoint(graph, "a", &checkpoint, None)
        .await
        .unwrap();
    assert_eq!(
        store.load_checkpoint(graph, "a").await.unwrap().as_ref(),
        Some(&checkpoint)
    );
    assert_eq!(store.load_checkpoint(graph, "b").await.unwrap(), None);

    // Cache snapshots.
    assert_eq!(store.load_cache(graph).await.unwrap(), None);
    let mut snapshot = weir::reactor::CacheSnapshot {
        fires: 9,
        ..Default::default()
    };
    snapshot.sources.insert(
        "a".into(),
        weir::reactor::SourceSnapshot {
            seen: vec![Position {
                partition: 0,
                offset: 3,
            }],
            dirty: true,
            current: Some(weir::Boundary {
                source: Arc::from("a"),
                sequence: 0,
                positions: vec![Position {
                    partition: 0,
                    offset: 3,
                }],
                event_time_ms: 1,
                emit_time_ms: 2,
                value: serde_json::json!([1, 2]),
            }),
            queue: Vec::new(),
        },
    );
    store.save_cache(graph, &snapshot, None).await.unwrap();
    assert_eq!(
        store.load_cache(graph).await.unwrap().as_ref(),
        Some(&snapshot)
    );

    // Recovery events: newest first, filterable by graph.
    let other = format!("{graph}-other");
    for (g, attempt) in [(graph, 1), (other.as_str(), 1), (graph, 2)] {
        let event = RecoveryEvent {
            graph: g.to_string(),
            component: "reactor".into(),
            action: RecoveryAction::GraphRespawned,
            attempt,
            error: "boom".into(),
            at_ms: 10,
            node_id: "n1".into(),
        };
        store.record_recovery(&event).await.unwrap();
    }
    let mine = store.recovery_events(Some(graph), 10).await.unwrap();
    assert_eq!(
        mine.iter().map(|e| e.attempt).collect::<Vec<_>>(),
        vec![2, 1]
    );
    assert_eq!(
        store.recovery_events(Some(graph), 1).await.unwrap().len(),
        1
    );
    let all = store.recovery_events(None, 100).await.unwrap();
    assert!(all.iter().any(|e| e.graph == other));

    // Leases: exclusive, renewable by the holder only, compare-and-set release, fencing.
    let name = format!("{graph}-lease");
    let ttl = Duration::from_millis(400);
    let first = store
        .acquire_lease(&name, "n1", ttl)
        .await
        .unwrap()
        .expect("free lease");
    assert!(store
        .acquire_lease(&name, "n2", ttl)
        .await
        .unwrap()
        .is_none());
    assert!(store.renew_lease(&first, ttl).await.unwrap());
    let impostor = Lease {
        holder: "n2".into(),
        ..first.clone()
    };
    assert!(!store.renew_lease(&impostor, ttl).await.unwrap());
    assert!(!store.release_lease(&impostor).await.unwrap());
    assert!(store.release_lease(&first).await.unwrap());
    let second = store
        .acquire_lease(&name, "n2", ttl)
        .await
        .unwrap()
        .expect("released");
    assert!(second.token > first.token, "fencing token grows");
    // Expiry hands the lease over with a higher token; the old holder can't renew.
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let third = store
        .acquire_lease(&name, "n1", ttl)
        .await
        .unwrap()
        .expect("expired");
    assert!(third.token > second.token);
    assert!(!store.renew_lease(&second, ttl).await.unwrap());
    assert!(!store.release_lease(&second).await.unwrap());
    // Writes fenced by a deposed holder's token are refused; the holder's go through.
    let (stale, current) = (Fence::from(&second), Fence::from(&third));
    let fenced = Checkpoint {
        token: Some(second.token),
        ..checkpoint.clone()
    };
    let refused = store
        .save_checkpoint(graph, "fenced", &fenced, Some(&stale))
        .await;
    assert!(
        matches!(refused, Err(StoreError::Fenced { .. })),
        "{refused:?}"
    );
    assert!(!refused.unwrap_err().is_retryable());
    assert_eq!(store.load_checkpoint(graph, "fenced").await.unwrap(), None);
    let kept = Checkpoint {
        token: Some(third.token),
        ..checkpoint.clone()
    };
    store
        .save_checkpoint(graph, "fenced", &kept, Some(&current))
        .await
        .unwrap();
    let cache_key = format!("{graph}-fenced");
    assert!(matches!(
        store.save_cache(&cache_key, &snapshot, Some(&stale)).await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(store.load_cache(&cache_key).await.unwrap(), None);
    store
        .save_cache(&cache_key, &snapshot, Some(&current))
        .await
        .unwrap();
    assert_eq!(
        store.load_checkpoint(graph, "fenced").await.unwrap(),
        Some(kept)
    );

    // Workflow execution deadlines: due earliest first, moved by a second set, cleared.
    let (early, late) = (format!("{graph}-wf-early"), format!("{graph}-wf-late"));
    store.set_workflow_deadline(&late, 2_000).await.unwrap();
    store.set_workflow_deadline(&early, 5_000).await.unwrap();
    store.set_workflow_deadline(&early, 1_000).await.unwrap();
    let due = |until| {
        let store = store.clone();
        let (early, late) = (early.clone(), late.clone());
        async move {
            store
                .due_workflow_deadlines(until, 10)
                .await
                .unwrap()
                .into_iter()
                .filter(|id| *id == early || *id == late)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(due(1_500).await, vec![early.clone()]);
    assert_eq!(due(3_000).await, vec![early.clone(), late.clone()]);
    store.clear_workflow_deadline(&early).await.unwrap();
    assert_eq!(due(i64::MAX).await, vec![late.clone()]);
    store.clear_workflow_deadline(&late).await.unwrap();

    // Published-task records, per workflow execution.
    let execution = format!("{graph}-wf");
    assert!(store.published_tasks(&execution).await.unwrap().is_empty());
    store
        .mark_tasks_published(&execution, &["a".to_string(), "b".to_string()])
        .await
        .unwrap();
    store
        .mark_tasks_published(&execution, &["b".to_string(), "c".to_string()])
        .await
        .unwrap();
    store.mark_tasks_published(&execution, &[]).await.unwrap();
    let published: Vec<String> = store
        .published_tasks(&execution)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(published, ["a", "b", "c"]);
    assert!(store
        .published_tasks(&format!("{execution}-other"))
        .await
        .unwrap()
        .is_empty());

    // Schedule executions: claimed once; the index of unfinished ones follows their
    // status (buffered ones always listed); history beyond its cap is dropped.
    let schedule = format!("{graph}-schedule");
    let execution = |scheduled_ms: i64, status: ExecutionStatus| Execution {
        schedule_id: schedule.clone(),
        scheduled_ms,
        tick_id: format!("{schedule}@{scheduled_ms}"),
        status,
        attempt: 1,
        max_attempts: 3,
        node_id: "n1".into(),
        fencing_token: 1,
        updated_ms: scheduled_ms + 100,
        error: None,
    };
    let claims = store
        .claim_executions(
            &[
                execution(1000, ExecutionStatus::Scheduled),
                execution(2000, ExecutionStatus::Buffered),
                execution(3000, ExecutionStatus::Skipped),
            ],
            None,
        )
        .await
        .unwrap();
    assert_eq!(claims, [true, true, true]);
    assert!(!store
        .claim_execution(&execution(1000, ExecutionStatus::Scheduled))
        .await
        .unwrap());
    let open = |by: i64| {
        let store = store.clone();
        async move { store.open_executions(by, 0, 100).await.unwrap() }
    };
    assert_eq!(
        open(1100).await,
        [(schedule.clone(), 2000), (schedule.clone(), 1000)]
    );
    assert_eq!(open(1099).await, [(schedule.clone(), 2000)]);
    assert_eq!(
        store.open_executions(i64::MAX, 0, 1).await.unwrap().len(),
        1
    );
    assert_eq!(
        store.open_executions(i64::MAX, 1, 5).await.unwrap(),
        [(schedule.clone(), 1000)]
    );
    assert!(store
        .open_executions(i64::MAX, 2, 5)
        .await
        .unwrap()
        .is_empty());
    store
        .put_execution(&execution(1000, ExecutionStatus::Completed), None)
        .await
        .unwrap();
    let mut running = execution(2000, ExecutionStatus::Running);
    running.updated_ms = 5000;
    store.record_fires(0, &[running], &[], None).await.unwrap();
    assert!(open(4999).await.is_empty());
    assert_eq!(open(5000).await, [(schedule.clone(), 2000)]);
    let later: Vec<Execution> = (0..1000)
        .map(|i| execution(10_000 + i, ExecutionStatus::Skipped))
        .collect();
    store.claim_executions(&later, None).await.unwrap();
    assert_eq!(store.executions(&schedule, 2000).await.unwrap().len(), 1000);
    assert_eq!(store.get_execution(&schedule, 1000).await.unwrap(), None);
    assert_eq!(store.get_execution(&schedule, 2000).await.unwrap(), None);
    assert!(open(i64::MAX).await.is_empty());

    // A deposed shard master's execution writes are refused, whole; its successor's
    // go through.
    let shard_lease = format!("{schedule}-shard");
    let old = store
        .acquire_lease(&shard_lease, "n1", Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    store.release_lease(&old).await.unwrap();
    let new = store
        .acquire_lease(&shard_lease, "n2", Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    let (stale, current) = (Fence::from(&old), Fence::from(&new));
    let claimed = store
        .claim_executions(
            &[execution(50_000, ExecutionStatus::Scheduled)],
            Some(&stale),
        )
        .await;
    assert!(
        matches!(claimed, Err(StoreError::Fenced { .. })),
        "{claimed:?}"
    );
    assert_eq!(store.get_execution(&schedule, 50_000).await.unwrap(), None);
    let refused = store
        .record_fires(
            0,
            &[execution(50_000, ExecutionStatus::Running)],
            &[(schedule.clone(), Some(60_000))],
            Some(&stale),
        )
        .await;
    assert!(
        matches!(refused, Err(StoreError::Fenced { .. })),
        "{refused:?}"
    );
    assert_eq!(store.get_execution(&schedule, 50_000).await.unwrap(), None);
    assert!(matches!(
        store
            .put_execution(&execution(50_000, ExecutionStatus::Running), Some(&stale))
            .await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(
        store
            .claim_executions(
                &[execution(50_000, ExecutionStatus::Scheduled)],
                Some(&current)
            )
            .await
            .unwrap(),
        [true]
    );
    store
        .put_execution(
            &execution(50_000, ExecutionStatus::Completed),
            Some(&current),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .get_execution(&schedule, 50_000)
            .await
            .unwrap()
            .map(|e| e.status),
        Some(ExecutionStatus::Completed)
    );

    store.ping().await.unwrap();
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

#[tokio::test]
async fn memory_store_conforms() {
    store_conformance(Arc::new(weir::store::memory::MemoryStore::new()), "g").await;
}

#[cfg(feature = "it")]
mod services {
    use super::*;
    use common::services;

    #[tokio::test]
    async fn kafka_broker_conforms() {
        let topic = services::unique("conf.kafka.");
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
            let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer(&stream_name(&group)).await.unwrap();
            let info = consumer.info().await.unwrap();
            assert_eq!(info.config.inactive_threshold, expected, "{assignment:?}");
        }
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

    /// Topics weir creates carry the configured `retention.ms`.
    #[tokio::test]
    async fn kafka_topics_weir_creates_have_the_configured_retention() {
        use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
        use rdkafka::client::DefaultClientContext;
        use rdkafka::ClientConfig;
        let broker = services::kafka();
        let topic = services::unique("conf.retention.");
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

    #[tokio::test]
    async fn nats_core_delivers_while_subscribed() {
        // Core NATS is at-most-once: only what is published while subscribed arrives.
        let broker = services::nats(false).await;
        let subject = services::unique("conf.core.");
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
    async fn redis_store_conforms() {
        let prefix = services::unique("weirtest");
        store_conformance(services::redis(&prefix).await, "g").await;
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

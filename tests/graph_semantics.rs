//! Reactor, accumulator and graph semantics on the embedded backends.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{eventually, settle, Harness};
use serde_json::{json, Value};
use tokio::sync::Notify;
use weir::graph::{FunctionRegistry, NodeContext};
use weir::reactor::CommandError;
use weir::transport::{Message, Position, Source, SourceFactory, TransportError};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, Health, ReactorConfig, ReactorState, Strategy,
};

/// A graph over the given accumulators whose one node records every source's value.
fn snapshot_graph(
    name: &str,
    accumulators: Vec<AccumulatorSpec>,
    config: ReactorConfig,
) -> weir::GraphDeclaration {
    let registry = FunctionRegistry::default();
    let mut builder = GraphBuilder::new(name).reactor(config);
    for acc in accumulators {
        builder = builder.accumulator(acc);
    }
    builder
        .function("snapshot", &registry, "snapshot")
        .output("snapshot", format!("{name}.out"))
        .build()
        .expect("valid graph")
}

fn config(criteria: Criteria, strategy: Strategy) -> ReactorConfig {
    ReactorConfig {
        criteria,
        strategy,
        ..ReactorConfig::default()
    }
}

fn inputs(outputs: &[Value], source: &str) -> Vec<Value> {
    outputs
        .iter()
        .map(|o| o["inputs"][source].clone())
        .collect()
}

#[tokio::test]
async fn when_all_fires_only_after_every_source_emitted() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "all",
        vec![
            AccumulatorSpec::passthrough("a"),
            AccumulatorSpec::passthrough("b"),
        ],
        config(Criteria::WhenAll, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    g.push("a", json!(2)).await.unwrap();
    eventually("a cached", || async { g.stats().boundaries == 2 }).await;
    settle().await;
    assert!(h.outputs("all.out").is_empty(), "fired before b emitted");
    g.push("b", json!(10)).await.unwrap();
    eventually("first fire", || async { h.outputs("all.out").len() == 1 }).await;
    let out = h.outputs("all.out");
    assert_eq!(out[0]["inputs"], json!({"a": 2, "b": 10}));
    // After a fire, both must emit again.
    g.push("b", json!(11)).await.unwrap();
    settle().await;
    assert_eq!(h.outputs("all.out").len(), 1);
    g.push("a", json!(3)).await.unwrap();
    eventually("second fire", || async { h.outputs("all.out").len() == 2 }).await;
    assert_eq!(h.outputs("all.out")[1]["inputs"], json!({"a": 3, "b": 11}));
}

#[tokio::test]
async fn latest_skips_intermediates() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "latest",
        vec![AccumulatorSpec::passthrough("a")],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    for i in 1..=5 {
        g.push("a", json!(i)).await.unwrap();
    }
    eventually("all cached", || async { g.stats().boundaries == 5 }).await;
    g.reactor().resume().await.unwrap();
    eventually("a fire", || async { h.outputs("latest.out").len() == 1 }).await;
    settle().await;
    let out = h.outputs("latest.out");
    assert_eq!(inputs(&out, "a"), vec![json!(5)]);
}

#[tokio::test]
async fn sequential_skips_none() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "seq",
        vec![AccumulatorSpec::passthrough("a")],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    for i in 1..=5 {
        g.push("a", json!(i)).await.unwrap();
    }
    eventually("all cached", || async { g.stats().boundaries == 5 }).await;
    g.reactor().resume().await.unwrap();
    eventually("five fires", || async { h.outputs("seq.out").len() == 5 }).await;
    let out = h.outputs("seq.out");
    assert_eq!(
        inputs(&out, "a"),
        (1..=5).map(|i| json!(i)).collect::<Vec<_>>()
    );
    let fires: Vec<u64> = out.iter().map(|o| o["fire"].as_u64().unwrap()).collect();
    assert_eq!(fires, vec![1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn outputs_carry_the_graph_as_key_and_its_fire_in_headers() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "stamped",
        vec![AccumulatorSpec::passthrough("a")],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for i in 1..=3 {
        g.push("a", json!(i)).await.unwrap();
    }
    eventually("three fires", || async {
        h.broker.messages("stamped.out").len() == 3
    })
    .await;
    for message in h.broker.messages("stamped.out") {
        let output: Value = serde_json::from_slice(&message.payload).unwrap();
        let fire = output["fire"].to_string();
        assert_eq!(message.key.as_deref(), Some(&b"stamped"[..]));
        assert_eq!(message.header(weir::wire::GRAPH_HEADER), Some("stamped"));
        assert_eq!(message.header(weir::wire::FIRE_HEADER), Some(fire.as_str()));
        assert_eq!(message.header(weir::wire::DEGRADED_HEADER), Some("false"));
    }
    let fires: Vec<String> = h
        .broker
        .messages("stamped.out")
        .iter()
        .filter_map(|m| m.header(weir::wire::FIRE_HEADER).map(str::to_string))
        .collect();
    assert_eq!(fires, ["1", "2", "3"]);
}

#[tokio::test]
async fn sequential_when_all_takes_the_head_of_each_queue() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "seqall",
        vec![
            AccumulatorSpec::passthrough("a"),
            AccumulatorSpec::passthrough("b"),
        ],
        config(Criteria::WhenAll, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for i in 1..=3 {
        g.push("a", json!(i)).await.unwrap();
    }
    eventually("a queued", || async { g.stats().boundaries == 3 }).await;
    settle().await;
    assert!(h.outputs("seqall.out").is_empty());
    g.push("b", json!("x")).await.unwrap();
    g.push("b", json!("y")).await.unwrap();
    eventually("two fires", || async { h.outputs("seqall.out").len() == 2 }).await;
    settle().await;
    let out = h.outputs("seqall.out");
    assert_eq!(out.len(), 2);
    assert_eq!(out[0]["inputs"], json!({"a": 1, "b": "x"}));
    assert_eq!(out[1]["inputs"], json!({"a": 2, "b": "y"}));
    let state = g.reactor().get_state().await.unwrap();
    assert_eq!(state.sources["a"].queued, 1);
    assert!(state.sources["a"].dirty);
    assert!(!state.sources["b"].dirty);
}

#[tokio::test]
async fn sequential_backpressure_never_drops() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "bp",
        vec![AccumulatorSpec::passthrough("a").topic("bp.in")],
        ReactorConfig {
            queue_capacity: 2,
            ..config(Criteria::WhenAny, Strategy::Sequential)
        },
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    for i in 0..10 {
        h.pipe_bytes("bp.in", json!(i).to_string().as_bytes()).await;
    }
    eventually("queue full", || async {
        g.reactor().get_state().await.unwrap().sources["a"].queued == 2
    })
    .await;
    settle().await;
    assert_eq!(
        g.reactor().get_state().await.unwrap().sources["a"].queued,
        2
    );
    g.reactor().resume().await.unwrap();
    eventually("ten fires", || async { h.outputs("bp.out").len() == 10 }).await;
    assert_eq!(
        inputs(&h.outputs("bp.out"), "a"),
        (0..10).map(|i| json!(i)).collect::<Vec<_>>()
    );
}

/// A source that opens only when released, then emits nothing.
struct GatedSource {
    open: Arc<Notify>,
}

struct Silent;

#[async_trait]
impl Source for Silent {
    async fn next(&mut self) -> Result<Message, TransportError> {
        std::future::pending().await
    }
    async fn commit(&mut self, _: &[Position]) -> Result<(), TransportError> {
        Ok(())
    }
}

#[async_trait]
impl SourceFactory for GatedSource {
    fn describe(&self) -> String {
        "gated".into()
    }
    async fn open(&self, _: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        self.open.notified().await;
        Ok(Box::new(Silent))
    }
}

#[tokio::test]
async fn warming_gates_firing() {
    let h = Harness::new();
    let gate = Arc::new(Notify::new());
    let g = h.spawn(snapshot_graph(
        "warm",
        vec![
            AccumulatorSpec::passthrough("pushed"),
            AccumulatorSpec::passthrough("slow")
                .source(Arc::new(GatedSource { open: gate.clone() })),
        ],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    g.push("pushed", json!(1)).await.unwrap();
    eventually("cached", || async { g.stats().boundaries == 1 }).await;
    settle().await;
    assert_eq!(g.state(), ReactorState::Warming);
    assert_eq!(g.health("slow"), Some(Health::Connecting));
    assert!(h.outputs("warm.out").is_empty(), "fired while warming");
    gate.notify_one();
    g.wait_for_state(ReactorState::Live).await;
    eventually("fire after live", || async {
        h.outputs("warm.out").len() == 1
    })
    .await;
    assert_eq!(h.outputs("warm.out")[0]["inputs"]["pushed"], json!(1));
}

/// Emits one event, then fails when told to.
struct OneThenFail {
    sent: bool,
    fail: Arc<Notify>,
}

#[async_trait]
impl Source for OneThenFail {
    async fn next(&mut self) -> Result<Message, TransportError> {
        if !self.sent {
            self.sent = true;
            return Ok(Message {
                topic: Arc::from("flaky"),
                position: Position {
                    partition: 0,
                    offset: 0,
                },
                key: None,
                payload: bytes::Bytes::from_static(b"\"tick\""),
                headers: vec![],
                timestamp_ms: 0,
            });
        }
        self.fail.notified().await;
        Err(TransportError::Unreachable {
            broker: "flaky".into(),
            source: "connection reset".into(),
        })
    }
    async fn commit(&mut self, _: &[Position]) -> Result<(), TransportError> {
        Ok(())
    }
}

struct FlakyFactory {
    opens: Arc<AtomicUsize>,
    fail: Arc<Notify>,
}

#[async_trait]
impl SourceFactory for FlakyFactory {
    fn describe(&self) -> String {
        "flaky".into()
    }
    async fn open(&self, _: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        self.opens.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(OneThenFail {
            sent: false,
            fail: self.fail.clone(),
        }))
    }
}

#[tokio::test(start_paused = true)]
async fn degraded_after_a_disconnect_then_live_again() {
    let h = Harness::new();
    let opens = Arc::new(AtomicUsize::new(0));
    let fail = Arc::new(Notify::new());
    let g = h.spawn(snapshot_graph(
        "deg",
        vec![
            AccumulatorSpec::passthrough("pushed"),
            AccumulatorSpec::passthrough("flaky").source(Arc::new(FlakyFactory {
                opens: opens.clone(),
                fail: fail.clone(),
            })),
        ],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    fail.notify_one();
    g.wait_for_state(ReactorState::Degraded).await;
    assert_eq!(g.health("flaky"), Some(Health::Disconnected));
    g.push("pushed", json!("while degraded")).await.unwrap();
    eventually("degraded fire", || async {
        h.outputs("deg.out")
            .iter()
            .any(|o| o["degraded"] == json!(true))
    })
    .await;
    let degraded_message = h
        .broker
        .messages("deg.out")
        .into_iter()
        .find(|m| serde_json::from_slice::<Value>(&m.payload).unwrap()["degraded"] == json!(true))
        .unwrap();
    assert_eq!(degraded_message.header("weir-degraded"), Some("true"));
    // The supervisor restarts the accumulator after the backoff; the graph is Live again.
    g.wait_for_state(ReactorState::Live).await;
    assert_eq!(opens.load(Ordering::SeqCst), 2);
    let events = h.store_recoveries().await;
    assert_eq!(events[0].component, "flaky");
    assert!(
        events[0].error.contains("connection reset"),
        "{}",
        events[0].error
    );
}

trait Recoveries {
    async fn store_recoveries(&self) -> Vec<weir::store::RecoveryEvent>;
}

impl Recoveries for Harness {
    async fn store_recoveries(&self) -> Vec<weir::store::RecoveryEvent> {
        use weir::store::prelude::*;
        self.store.recovery_events(None, 100).await.unwrap()
    }
}

#[tokio::test]
async fn pause_and_resume() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "pause",
        vec![AccumulatorSpec::passthrough("a")],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    assert!(g.reactor().get_state().await.unwrap().paused);
    g.push("a", json!(1)).await.unwrap();
    eventually("cached", || async { g.stats().boundaries == 1 }).await;
    settle().await;
    assert!(h.outputs("pause.out").is_empty());
    let state = g.reactor().get_state().await.unwrap();
    assert!(
        state.sources["a"].dirty,
        "boundaries keep accumulating while paused"
    );
    g.reactor().resume().await.unwrap();
    eventually("fire on resume", || async {
        h.outputs("pause.out").len() == 1
    })
    .await;
    assert!(!g.reactor().get_state().await.unwrap().paused);
}

#[tokio::test]
async fn force_fire_ignores_criteria() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "force",
        vec![
            AccumulatorSpec::passthrough("a"),
            AccumulatorSpec::passthrough("b"),
        ],
        config(Criteria::WhenAll, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(7)).await.unwrap();
    eventually("cached", || async { g.stats().boundaries == 1 }).await;
    let report = g.reactor().force_fire().await.unwrap();
    assert_eq!(report.fire, 1);
    assert_eq!(report.outputs, 1);
    eventually("output", || async { h.outputs("force.out").len() == 1 }).await;
    assert_eq!(
        h.outputs("force.out")[0]["inputs"],
        json!({"a": 7, "b": null})
    );
    assert!(!g.reactor().get_state().await.unwrap().sources["a"].dirty);
}

#[tokio::test]
async fn fire_with_an_injected_cache() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "inject",
        vec![
            AccumulatorSpec::passthrough("a"),
            AccumulatorSpec::passthrough("b"),
        ],
        config(Criteria::WhenAll, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    eventually("cached", || async { g.stats().boundaries == 1 }).await;
    let cache = BTreeMap::from([("b".to_string(), json!({"px": 99}))]);
    g.reactor().fire_with(cache).await.unwrap();
    eventually("output", || async { h.outputs("inject.out").len() == 1 }).await;
    assert_eq!(
        h.outputs("inject.out")[0]["inputs"],
        json!({"a": 1, "b": {"px": 99}})
    );
    let state = g.reactor().get_state().await.unwrap();
    assert_eq!(state.sources["b"].value, Some(json!({"px": 99})));

    let err = g
        .reactor()
        .fire_with(BTreeMap::from([("nope".to_string(), json!(1))]))
        .await
        .unwrap_err();
    assert!(matches!(err, CommandError::UnknownSource { .. }), "{err}");
}

#[tokio::test]
async fn get_state_returns_cache_flags_and_state() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "state",
        vec![
            AccumulatorSpec::passthrough("a"),
            AccumulatorSpec::passthrough("b"),
        ],
        config(Criteria::WhenAll, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    let state = g.reactor().get_state().await.unwrap();
    assert_eq!(state.state, ReactorState::Live);
    assert!(!state.paused);
    assert!(state
        .sources
        .values()
        .all(|s| !s.dirty && s.value.is_none()));
    g.push("a", json!("x")).await.unwrap();
    eventually("cached", || async { g.stats().boundaries == 1 }).await;
    let state = g.reactor().get_state().await.unwrap();
    assert!(state.sources["a"].dirty);
    assert!(!state.sources["b"].dirty);
    assert_eq!(state.sources["a"].value, Some(json!("x")));
    assert_eq!(state.sources["a"].last_sequence, 1);
    assert_eq!(state.sources["a"].health, Health::SocketOnly);
    assert_eq!(state.fires, 0);
}

/// Passes events through, panicking once on the value "poison".
struct PanicsOnce {
    armed: Arc<AtomicBool>,
}

impl weir::Accumulator for PanicsOnce {
    fn process(
        &mut self,
        event: weir::Event,
    ) -> Result<Option<Value>, weir::accumulator::AccumulatorError> {
        if event.value == json!("poison") && self.armed.swap(false, Ordering::SeqCst) {
            panic!("poisoned accumulator");
        }
        Ok(Some(event.value))
    }
}

#[tokio::test(start_paused = true)]
async fn accumulator_restart_keeps_the_reactor_and_drops_replayed_duplicates() {
    let h = Harness::new();
    let armed = Arc::new(AtomicBool::new(true));
    let flag = armed.clone();
    let g = h.spawn(snapshot_graph(
        "restart",
        vec![AccumulatorSpec::custom("a", move || PanicsOnce {
            armed: flag.clone(),
        })
        .topic("restart.in")],
        ReactorConfig {
            // No snapshot and no fire while paused: nothing becomes durable, nothing is
            // committed, so the restarted accumulator replays from the start.
            snapshot_interval: Duration::from_secs(3600),
            ..config(Criteria::WhenAny, Strategy::Latest)
        },
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    for v in [json!(1), json!(2)] {
        h.pipe_bytes("restart.in", v.to_string().as_bytes()).await;
    }
    // Taken in by the reactor before the panic: an accumulator hands over what it
    // emitted in batches, and a batch it had not handed over is simply read again.
    eventually("cached", || async { g.stats().boundaries == 2 }).await;
    for v in [json!("poison"), json!(3)] {
        h.pipe_bytes("restart.in", v.to_string().as_bytes()).await;
    }
    eventually("restart recorded", || async {
        !h.store_recoveries().await.is_empty()
    })
    .await;
    eventually("replay done", || async { g.stats().boundaries == 4 }).await;
    let stats = g.stats();
    // 1 and 2 were emitted before the panic and replayed after it.
    assert_eq!(stats.duplicates, 2, "{stats:?}");
    let state = g.reactor().get_state().await.unwrap();
    assert!(
        state.paused,
        "the reactor kept running (still paused) through the restart"
    );
    assert_eq!(state.sources["a"].value, Some(json!(3)));
    let events = h.store_recoveries().await;
    assert_eq!(events.len(), 1);
    assert_eq!(
        events[0].action,
        weir::store::RecoveryAction::AccumulatorRestarted
    );
    assert!(events[0].error.contains("poisoned accumulator"));
    g.reactor().resume().await.unwrap();
    eventually("fire", || async { h.outputs("restart.out").len() == 1 }).await;
    // Once the fire is acknowledged, the source position is committed.
    eventually("committed", || async {
        h.broker.committed("restart.in", "weir.restart") == vec![4]
    })
    .await;
}

/// Passes events through, panicking on every "poison".
struct AlwaysPanicsOnPoison;

impl weir::Accumulator for AlwaysPanicsOnPoison {
    fn process(
        &mut self,
        event: weir::Event,
    ) -> Result<Option<Value>, weir::accumulator::AccumulatorError> {
        if event.value == json!("poison") {
            panic!("cannot digest poison");
        }
        Ok(Some(event.value))
    }
}

#[tokio::test(start_paused = true)]
async fn messages_an_accumulator_always_panics_on_are_dead_lettered_and_the_rest_flow() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "poisoned",
        vec![AccumulatorSpec::custom("a", || AlwaysPanicsOnPoison).topic("poisoned.in")],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    // More poisoned messages than the failures that fail a graph.
    let mut sent = Vec::new();
    for i in 0..7 {
        sent.push(json!(i));
        sent.push(json!("poison"));
    }
    sent.push(json!(7));
    for value in &sent {
        h.pipe_bytes("poisoned.in", value.to_string().as_bytes())
            .await;
    }
    eventually("every good message fired", || async {
        h.outputs("poisoned.out").len() == 8
    })
    .await;
    assert_eq!(
        inputs(&h.outputs("poisoned.out"), "a"),
        (0..8).map(|i| json!(i)).collect::<Vec<_>>()
    );
    let dead = h.broker.messages("poisoned.in.dlq");
    assert_eq!(dead.len(), 7, "each poisoned message once");
    for message in &dead {
        assert_eq!(&message.payload[..], b"\"poison\"");
        let error = message
            .headers
            .iter()
            .find(|(k, _)| k == "weir-error")
            .unwrap();
        assert!(error.1.contains("panicked on it 2 times"), "{}", error.1);
        assert!(error.1.contains("cannot digest poison"), "{}", error.1);
    }
    assert_eq!(g.stats().dead_letters, 7);
    assert_eq!(g.status(), weir::supervisor::GraphStatus::Running);
    eventually("all committed", || async {
        h.broker.committed("poisoned.in", "weir.poisoned") == vec![sent.len() as i64]
    })
    .await;
}

/// An accumulator panicking on message after message, with none handled between, is
/// taken to be at fault itself: past a run of dead letters its panics fail the graph
/// rather than send the whole stream to the dead-letter topic.
#[tokio::test(start_paused = true)]
async fn an_accumulator_panicking_on_every_message_fails_its_graph() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "rotten",
        vec![AccumulatorSpec::custom("a", || AlwaysPanicsOnPoison).topic("rotten.in")],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for _ in 0..40 {
        h.pipe_bytes("rotten.in", b"\"poison\"").await;
    }
    let failed = g.wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Failed { .. }));
    tokio::time::timeout(Duration::from_secs(600), failed)
        .await
        .expect("the graph fails");
    assert_eq!(h.broker.messages("rotten.in.dlq").len(), 20);
}

/// A graph whose accumulator panics on every message, fed 60 of them and waited on
/// until it is Failed, after its one run of 20 dead letters.
async fn failed_over_a_rotten_state(h: &Harness, name: &str) -> weir::supervisor::GraphHandle {
    let topic = format!("{name}.in");
    let g = h.spawn(snapshot_graph(
        name,
        vec![AccumulatorSpec::custom("a", || AlwaysPanicsOnPoison).topic(topic.as_str())],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for _ in 0..60 {
        h.pipe_bytes(&topic, b"\"poison\"").await;
    }
    failed_within(&g, Duration::from_secs(600)).await;
    assert_eq!(h.broker.messages(&format!("{topic}.dlq")).len(), 20);
    g
}

async fn failed_within(g: &weir::supervisor::GraphHandle, limit: Duration) {
    use weir::supervisor::GraphStatus;
    let failed = g.wait_for_status(|s| matches!(s, GraphStatus::Failed { .. }));
    tokio::time::timeout(limit, failed)
        .await
        .expect("the graph fails");
}

/// A Failed graph retried over the same state is not let off the run of dead letters
/// it already sent: its panics go on counting as failures, and no more messages go to
/// the dead-letter topic.
#[tokio::test(start_paused = true)]
async fn a_failed_graph_retried_over_the_same_panics_dead_letters_no_more() {
    use weir::supervisor::GraphStatus;
    let h = Harness::new();
    let g = failed_over_a_rotten_state(&h, "rotten_again").await;
    let retried = g.wait_for_status(|s| !matches!(s, GraphStatus::Failed { .. }));
    tokio::time::timeout(Duration::from_secs(3600), retried)
        .await
        .expect("the failed graph is retried");
    failed_within(&g, Duration::from_secs(600)).await;
    assert_eq!(h.broker.messages("rotten_again.in.dlq").len(), 20);
}

/// An operator restarting a Failed graph has it look at its panics afresh: another run
/// of dead letters before its panics count as failures again.
#[tokio::test(start_paused = true)]
async fn an_operator_restart_of_a_failed_graph_looks_at_its_panics_afresh() {
    use weir::supervisor::GraphStatus;
    let h = Harness::new();
    let g = failed_over_a_rotten_state(&h, "rotten_restarted").await;
    g.restart();
    let restarted = g.wait_for_status(|s| !matches!(s, GraphStatus::Failed { .. }));
    tokio::time::timeout(Duration::from_secs(10), restarted)
        .await
        .expect("the graph restarts at once");
    failed_within(&g, Duration::from_secs(600)).await;
    assert_eq!(h.broker.messages("rotten_restarted.in.dlq").len(), 40);
}

#[tokio::test(start_paused = true)]
async fn pushes_taken_before_an_accumulator_panics_still_fire() {
    let h = Harness::new();
    let armed = Arc::new(AtomicBool::new(true));
    let flag = armed.clone();
    let g = h.spawn(snapshot_graph(
        "burst",
        vec![AccumulatorSpec::custom("a", move || PanicsOnce {
            armed: flag.clone(),
        })],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    // One burst: all four wait in the socket before the accumulator takes any, and it
    // hands the reactor what it emitted in one go.
    for v in [json!(1), json!(2), json!("poison"), json!(3)] {
        g.push("a", v).await.unwrap();
    }
    eventually("fired", || async { h.outputs("burst.out").len() == 3 }).await;
    // The event it panicked on is lost, as a pushed event is never replayed; those
    // before it still fire, and the new instance takes the one after it.
    assert_eq!(
        inputs(&h.outputs("burst.out"), "a"),
        [json!(1), json!(2), json!(3)]
    );
    let events = h.store_recoveries().await;
    assert_eq!(events.len(), 1);
    assert!(events[0].error.contains("poisoned accumulator"));
}

#[tokio::test]
async fn offsets_are_committed_only_after_outputs_are_durable() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "durable",
        vec![AccumulatorSpec::passthrough("a").topic("durable.in")],
        ReactorConfig {
            snapshot_interval: Duration::from_secs(3600),
            ..config(Criteria::WhenAny, Strategy::Sequential)
        },
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    for i in 0..3 {
        h.pipe_bytes("durable.in", json!(i).to_string().as_bytes())
            .await;
    }
    eventually("cached", || async { g.stats().boundaries == 3 }).await;
    settle().await;
    assert_eq!(h.broker.committed("durable.in", "weir.durable"), vec![0]);
    g.reactor().resume().await.unwrap();
    eventually("fires", || async { h.outputs("durable.out").len() == 3 }).await;
    eventually("committed", || async {
        h.broker.committed("durable.in", "weir.durable") == vec![3]
    })
    .await;
    use weir::store::prelude::*;
    let checkpoint = h
        .store
        .load_checkpoint("durable", "a")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        checkpoint.positions,
        vec![Position {
            partition: 0,
            offset: 2
        }]
    );
}

/// Positions are committed only through stored cache snapshots; with a snapshot
/// interval of an hour, a graph still snapshots once 50,000 inputs wait for one, so its
/// commits go on and a broker limiting what a reader holds unacknowledged never stalls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graph_snapshotting_hourly_still_commits_every_50000_inputs() {
    const INPUTS: u64 = 50_100;
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "hourly",
        vec![AccumulatorSpec::passthrough("a").topic("hourly.in")],
        ReactorConfig {
            snapshot_interval: Duration::from_secs(3600),
            ..config(Criteria::WhenAny, Strategy::Sequential)
        },
    ));
    g.wait_for_state(ReactorState::Live).await;
    for i in 0..INPUTS {
        h.pipe_bytes("hourly.in", json!(i).to_string().as_bytes())
            .await;
    }
    let committed = || h.broker.committed("hourly.in", "weir.hourly");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while committed().first().copied().unwrap_or(0) < 50_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "committed {:?} after {} fires",
            committed(),
            g.stats().fires
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(committed()[0] <= INPUTS as i64, "{:?}", committed());
}

/// Repeats are committed through snapshots too, and count towards the 50,000 inputs
/// after which one is due: a replay of repeats alone, with an hourly snapshot interval,
/// still commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_of_repeats_counts_towards_the_inputs_after_which_a_snapshot_is_due() {
    const INPUTS: i64 = 30_000;
    let h = Harness::new();
    let armed = Arc::new(AtomicBool::new(true));
    let flag = armed.clone();
    let g = h.spawn(snapshot_graph(
        "repeats",
        vec![AccumulatorSpec::custom("a", move || PanicsOnce {
            armed: flag.clone(),
        })
        .topic("repeats.in")],
        ReactorConfig {
            snapshot_interval: Duration::from_secs(3600),
            ..config(Criteria::WhenAny, Strategy::Latest)
        },
    ));
    g.wait_for_state(ReactorState::Live).await;
    // Paused, nothing fires: the inputs wait for a snapshot to become durable.
    g.reactor().pause().await.unwrap();
    for i in 0..INPUTS {
        h.pipe_bytes("repeats.in", json!(i).to_string().as_bytes())
            .await;
    }
    let committed = || h.broker.committed("repeats.in", "weir.repeats");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while g.stats().boundaries < INPUTS as u64 {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", g.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    settle().await;
    assert_eq!(committed(), vec![0], "fewer than 50,000 inputs wait");
    // The accumulator restarts and reads everything again: 30,000 repeats, the 20,000th
    // of which is the 50,000th input since the last snapshot, so the snapshot after it
    // commits the positions read again so far.
    h.pipe_bytes("repeats.in", json!("poison").to_string().as_bytes())
        .await;
    while committed()[0] < 20_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "committed {:?}, {:?}",
            committed(),
            g.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(g.stats().duplicates >= 20_000, "{:?}", g.stats());
}

/// Node that panics when source `a` holds "boom".
fn panicky_graph(name: &str) -> weir::GraphDeclaration {
    GraphBuilder::new(name)
        .accumulator(AccumulatorSpec::passthrough("a"))
        .accumulator(AccumulatorSpec::passthrough("b"))
        .reactor(ReactorConfig {
            snapshot_interval: Duration::ZERO,
            ..ReactorConfig::default()
        })
        .node("n", ["a", "b"], |ctx: NodeContext| async move {
            if ctx.source("a") == Some(&json!("boom")) {
                panic!("reactor blew up");
            }
            Ok(Some(json!({"a": ctx.source("a"), "b": ctx.source("b")})))
        })
        .output("n", format!("{name}.out"))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn reactor_failure_respawns_the_graph_with_the_cache_restored() {
    let h = Harness::new();
    let g = h.spawn(panicky_graph("respawn"));
    g.wait_for_state(ReactorState::Live).await;
    g.push("b", json!("kept")).await.unwrap();
    eventually("first fire", || async {
        h.outputs("respawn.out").len() == 1
    })
    .await;
    g.push("a", json!("boom")).await.unwrap();
    g.wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Restarting { .. }))
        .await;
    g.wait_for_status(|s| *s == weir::supervisor::GraphStatus::Running)
        .await;
    g.wait_for_state(ReactorState::Live).await;
    let state = g.reactor().get_state().await.unwrap();
    assert_eq!(
        state.sources["b"].value,
        Some(json!("kept")),
        "cache restored from the store"
    );
    assert_eq!(state.fires, 1, "fire count restored");
    let events = h.store_recoveries().await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].component, "reactor");
    assert_eq!(
        events[0].action,
        weir::store::RecoveryAction::GraphRespawned
    );
    assert!(
        events[0].error.contains("reactor blew up"),
        "{}",
        events[0].error
    );
    // Commands reach the new reactor through the same handle.
    g.push("a", json!("fine")).await.unwrap();
    eventually("fire after respawn", || async {
        h.outputs("respawn.out").len() == 2
    })
    .await;
    assert_eq!(
        h.outputs("respawn.out")[1],
        json!({"a": "fine", "b": "kept"})
    );
}

/// Emits one event each time it is opened; records when.
struct OnOpen {
    opened: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
}

#[async_trait]
impl SourceFactory for OnOpen {
    fn describe(&self) -> String {
        "on-open".into()
    }
    async fn open(&self, _: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        self.opened
            .lock()
            .unwrap()
            .push(tokio::time::Instant::now());
        Ok(Box::new(OneThenFail {
            sent: false,
            fail: Arc::new(Notify::new()),
        }))
    }
}

#[tokio::test(start_paused = true)]
async fn backoff_doubles_and_the_graph_fails_after_five_failures() {
    let h = Harness::new();
    let opened = Arc::new(std::sync::Mutex::new(Vec::new()));
    let decl = GraphBuilder::new("doomed")
        .accumulator(AccumulatorSpec::passthrough("a").source(Arc::new(OnOpen {
            opened: opened.clone(),
        })))
        .node("n", ["a"], |_ctx: NodeContext| async move {
            panic!("always fails");
        })
        .output("n", "doomed.out")
        .build()
        .unwrap();
    let g = h.spawn(decl);
    let status = g
        .wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Failed { .. }))
        .await;
    assert!(
        matches!(status, weir::supervisor::GraphStatus::Failed { ref error } if error.contains("always fails"))
    );
    let opened_handle = opened.clone();
    let opened = opened.lock().unwrap().clone();
    assert_eq!(opened.len(), 5, "one start plus four restarts");
    let gaps: Vec<u64> = opened.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
    assert_eq!(gaps, vec![1, 2, 4, 8]);
    let mut events = h.store_recoveries().await;
    events.reverse();
    let attempts: Vec<u32> = events.iter().map(|e| e.attempt).collect();
    assert_eq!(attempts, vec![1, 2, 3, 4, 5]);
    assert!(events[..4]
        .iter()
        .all(|e| e.action == weir::store::RecoveryAction::GraphRespawned));
    assert_eq!(events[4].action, weir::store::RecoveryAction::GraphFailed);
    assert_eq!(g.state(), ReactorState::Failed);
    // Failed stays failed until the retry interval (300 s by default) has passed.
    tokio::time::sleep(Duration::from_secs(290)).await;
    assert_eq!(opened_count(&opened_handle), 5);
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(
        opened_count(&opened_handle),
        6,
        "retried after failed_retry"
    );
}

fn opened_count(opened: &std::sync::Mutex<Vec<tokio::time::Instant>>) -> usize {
    opened.lock().unwrap().len()
}

/// Never opens: the broker it reads from is unreachable.
struct Unreachable {
    opens: Arc<AtomicUsize>,
}

#[async_trait]
impl SourceFactory for Unreachable {
    fn describe(&self) -> String {
        "away".into()
    }
    async fn open(&self, _: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        self.opens.fetch_add(1, Ordering::SeqCst);
        Err(TransportError::Unreachable {
            broker: "away".into(),
            source: "connection refused".into(),
        })
    }
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_broker_is_waited_out_and_never_fails_the_graph() {
    let h = Harness::with_policy(weir::SupervisionPolicy {
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(100),
        ..weir::SupervisionPolicy::default()
    });
    let opens = Arc::new(AtomicUsize::new(0));
    let g = h.spawn(snapshot_graph(
        "away",
        vec![
            AccumulatorSpec::passthrough("a").source(Arc::new(Unreachable {
                opens: opens.clone(),
            })),
        ],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    eventually("ten attempts", || async {
        opens.load(Ordering::SeqCst) >= 10
    })
    .await;
    assert!(
        !matches!(g.status(), weir::supervisor::GraphStatus::Failed { .. }),
        "{:?}",
        g.status()
    );
    assert_ne!(g.state(), ReactorState::Failed);
    let events = h.store_recoveries().await;
    assert!(events.len() >= 9);
    assert!(
        events.iter().all(
            |e| e.attempt == 0 && e.action == weir::store::RecoveryAction::AccumulatorRestarted
        ),
        "waits are recorded, not counted: {events:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_graph_restarts_on_command() {
    let h = Harness::with_policy(weir::SupervisionPolicy {
        max_failures: 1,
        ..weir::SupervisionPolicy::default()
    });
    // The node panics while its dependency is down.
    let down = Arc::new(AtomicBool::new(true));
    let flag = down.clone();
    let decl = GraphBuilder::new("again")
        .accumulator(AccumulatorSpec::passthrough("a"))
        .reactor(ReactorConfig {
            snapshot_interval: Duration::ZERO,
            ..ReactorConfig::default()
        })
        .node("n", ["a"], move |ctx: NodeContext| {
            let down = flag.load(Ordering::SeqCst);
            async move {
                assert!(!down, "dependency down");
                Ok(ctx.source("a").cloned())
            }
        })
        .output("n", "again.out")
        .build()
        .unwrap();
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!("lost")).await.unwrap();
    g.wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Failed { .. }))
        .await;
    assert_eq!(g.state(), ReactorState::Failed);
    settle().await;
    down.store(false, Ordering::SeqCst);
    g.restart();
    g.wait_for_state(ReactorState::Live).await;
    assert_eq!(g.status(), weir::supervisor::GraphStatus::Running);
    g.push("a", json!("fine")).await.unwrap();
    eventually("fires again", || async {
        h.outputs("again.out") == vec![json!("fine")]
    })
    .await;
}

/// A running graph told to restart is torn down and started again, each time it is
/// told, however soon after its start: a command that comes while the graph is still
/// starting (restoring its cache, opening its sources) is kept for when it can act on
/// it, not dropped. None of it is a failure.
#[tokio::test(start_paused = true)]
async fn a_running_graph_restarts_on_command_even_while_starting() {
    let h = Harness::new();
    let opens = Arc::new(AtomicUsize::new(0));
    let decl = GraphBuilder::new("respawned")
        .accumulator(
            AccumulatorSpec::passthrough("a").source(Arc::new(FlakyFactory {
                opens: opens.clone(),
                fail: Arc::new(Notify::new()),
            })),
        )
        .node("n", ["a"], |ctx: NodeContext| async move {
            Ok(ctx.source("a").cloned())
        })
        .output("n", "respawned.out")
        .build()
        .unwrap();
    let g = h.spawn(decl);
    // Before the graph's task has run at all.
    g.restart();
    eventually("started twice", || async {
        opens.load(Ordering::SeqCst) == 2
    })
    .await;
    g.wait_for_state(ReactorState::Live).await;
    for times in 3..=5 {
        g.restart();
        eventually("started again", || async {
            opens.load(Ordering::SeqCst) == times
        })
        .await;
        g.wait_for_state(ReactorState::Live).await;
    }
    settle().await;
    assert_eq!(opens.load(Ordering::SeqCst), 5, "one start per command");
    assert_eq!(g.status(), weir::supervisor::GraphStatus::Running);
    assert!(h.store_recoveries().await.is_empty(), "no failure recorded");
}

#[tokio::test(start_paused = true)]
async fn pause_survives_a_respawn_and_a_new_node() {
    let h = Harness::new();
    let g = h.spawn(panicky_graph("paused"));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    g.push("a", json!("boom")).await.unwrap();
    g.push("b", json!(1)).await.unwrap();
    eventually("cached", || async { g.stats().boundaries == 2 }).await;
    // A forced fire runs even while paused; the node panics and the graph respawns.
    let _ = g.reactor().force_fire().await;
    g.wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Restarting { .. }))
        .await;
    g.wait_for_state(ReactorState::Live).await;
    assert!(
        g.reactor().get_state().await.unwrap().paused,
        "after a respawn"
    );
    let h = h.restart().await;
    let g = h.spawn(panicky_graph("paused"));
    g.wait_for_state(ReactorState::Live).await;
    assert!(
        g.reactor().get_state().await.unwrap().paused,
        "on a new node"
    );
}

#[tokio::test(start_paused = true)]
async fn sixty_healthy_seconds_reset_the_failure_count() {
    let h = Harness::new();
    let g = h.spawn(panicky_graph("reset"));
    g.wait_for_state(ReactorState::Live).await;
    for _ in 0..4 {
        g.push("a", json!("boom")).await.unwrap();
        g.wait_for_status(|s| matches!(s, weir::supervisor::GraphStatus::Restarting { .. }))
            .await;
        g.wait_for_status(|s| *s == weir::supervisor::GraphStatus::Running)
            .await;
        g.wait_for_state(ReactorState::Live).await;
        tokio::time::sleep(Duration::from_secs(61)).await;
    }
    let attempts: Vec<u32> = h
        .store_recoveries()
        .await
        .iter()
        .map(|e| e.attempt)
        .collect();
    assert_eq!(attempts, vec![1, 1, 1, 1]);
    assert_eq!(g.status(), weir::supervisor::GraphStatus::Running);
}

#[tokio::test(start_paused = true)]
async fn batch_accumulator_flushes_on_interval() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "batch",
        vec![AccumulatorSpec::batch("a", 10, Duration::from_millis(100))],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    g.push("a", json!(2)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(h.outputs("batch.out").is_empty());
    eventually("flush", || async { h.outputs("batch.out").len() == 1 }).await;
    assert_eq!(h.outputs("batch.out")[0]["inputs"]["a"], json!([1, 2]));
}

#[tokio::test(start_paused = true)]
async fn polling_accumulator_emits_changes() {
    let h = Harness::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let g = h.spawn(snapshot_graph(
        "poll",
        vec![AccumulatorSpec::polling(
            "rate",
            Duration::from_secs(1),
            move || {
                let n = c.fetch_add(1, Ordering::SeqCst);
                async move { Some(json!(n / 2)) }
            },
        )],
        config(Criteria::WhenAny, Strategy::Latest),
    ));
    g.wait_for_state(ReactorState::Live).await;
    eventually("three distinct values", || async {
        h.outputs("poll.out").len() == 3
    })
    .await;
    assert_eq!(
        inputs(&h.outputs("poll.out"), "rate"),
        vec![json!(0), json!(1), json!(2)]
    );
    assert!(calls.load(Ordering::SeqCst) >= 5);
}

#[tokio::test]
async fn stateful_accumulator_resumes_from_its_checkpoint() {
    let h = Harness::new();
    let sum = || {
        AccumulatorSpec::stateful("sum", json!(0), |state, event| {
            let total = state.as_i64().unwrap_or(0) + event.as_i64().unwrap_or(0);
            *state = json!(total);
            Some(json!(total))
        })
        .topic("sum.in")
    };
    let g = h.spawn(snapshot_graph(
        "sum",
        vec![sum()],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for i in [1, 2, 3] {
        h.pipe_bytes("sum.in", json!(i).to_string().as_bytes())
            .await;
    }
    eventually("fires", || async { h.outputs("sum.out").len() == 3 }).await;
    use weir::store::prelude::*;
    eventually("checkpoint", || async {
        h.store
            .load_checkpoint("sum", "sum")
            .await
            .unwrap()
            .is_some_and(|c| c.state == Some(json!(6)))
    })
    .await;
    assert_eq!(
        inputs(&h.outputs("sum.out"), "sum"),
        vec![json!(1), json!(3), json!(6)]
    );
}

#[tokio::test]
async fn undecodable_events_go_to_the_dead_letter_topic() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "dlq",
        vec![AccumulatorSpec::passthrough("a").topic("dlq.in")],
        config(Criteria::WhenAny, Strategy::Sequential),
    ));
    g.wait_for_state(ReactorState::Live).await;
    h.pipe_bytes("dlq.in", b"1").await;
    h.pipe_bytes("dlq.in", b"{not json").await;
    h.pipe_bytes("dlq.in", b"2").await;
    eventually("good events flow", || async {
        h.outputs("dlq.out").len() == 2
    })
    .await;
    let dead = h.broker.messages("dlq.in.dlq");
    assert_eq!(dead.len(), 1);
    assert_eq!(&dead[0].payload[..], b"{not json");
    let error = dead[0]
        .headers
        .iter()
        .find(|(k, _)| k == "weir-error")
        .unwrap();
    assert!(error.1.contains("invalid JSON"), "{}", error.1);
    assert_eq!(g.stats().dead_letters, 1);
    eventually("dead letter committed", || async {
        h.broker.committed("dlq.in", "weir.dlq") == vec![3]
    })
    .await;
}

#[tokio::test]
async fn tenants_get_their_own_topics_and_keys() {
    let h = Harness::new();
    let registry = FunctionRegistry::default();
    let decl = GraphBuilder::new("prices")
        .tenant("acme")
        .accumulator(AccumulatorSpec::passthrough("a").topic("prices.in"))
        .function("snapshot", &registry, "snapshot")
        .output("snapshot", "prices.out")
        .build()
        .unwrap();
    let g = h.spawn(decl);
    assert_eq!(g.name(), "acme/prices");
    g.wait_for_state(ReactorState::Live).await;
    h.pipe_bytes("prices.in", b"1").await;
    h.pipe_bytes("acme.prices.in", b"2").await;
    eventually("tenant output", || async {
        h.outputs("acme.prices.out").len() == 1
    })
    .await;
    assert_eq!(h.outputs("acme.prices.out")[0]["inputs"]["a"], json!(2));
    assert!(h.outputs("prices.out").is_empty());
}

#[tokio::test]
async fn duplicate_graph_names_are_rejected() {
    let h = Harness::new();
    let make = || {
        snapshot_graph(
            "twice",
            vec![AccumulatorSpec::passthrough("a")],
            ReactorConfig::default(),
        )
    };
    h.spawn(make());
    assert!(h.supervisor.spawn(make()).is_err());
}

#[tokio::test]
async fn shutdown_is_bounded_and_stops_every_graph() {
    let h = Harness::new();
    let g = h.spawn(snapshot_graph(
        "stop",
        vec![AccumulatorSpec::passthrough("a")],
        ReactorConfig::default(),
    ));
    g.wait_for_state(ReactorState::Live).await;
    assert!(h.supervisor.shutdown().await);
    assert_eq!(g.status(), weir::supervisor::GraphStatus::Stopped);
    assert!(g.reactor().get_state().await.is_err());
    h.cancel.cancel();
}

#[tokio::test]
async fn a_leased_graph_working_off_a_backlog_longer_than_its_lease_keeps_it() {
    // One thread, and a backlog that takes longer than the lease TTL to work off: the
    // lease keeper shares the thread with the graph's accumulator and reactor. Should it
    // miss its renewals, the graph stops and starts again from its checkpoint, and part
    // of the backlog fires twice under a newer fencing token.
    const EVENTS: usize = 100_000;
    let ttl = Duration::from_millis(600);
    let policy = weir::SupervisionPolicy {
        graph_lease_ttl: Some(ttl),
        ..weir::SupervisionPolicy::default()
    };
    let h = Harness::with_policy(policy);
    for n in 0..EVENTS {
        h.pipe_bytes("backlog.in", n.to_string().as_bytes()).await;
    }
    let sequential = ReactorConfig {
        strategy: Strategy::Sequential,
        ..ReactorConfig::default()
    };
    let started = tokio::time::Instant::now();
    let graph = h.spawn(snapshot_graph(
        "backlog",
        vec![AccumulatorSpec::passthrough("a").topic("backlog.in")],
        sequential,
    ));
    common::work_off_past_ttl(started, ttl, EVENTS, || {
        h.broker.messages("backlog.out").len()
    })
    .await;
    assert!(h.supervisor.shutdown().await);
    let outputs = h.broker.messages("backlog.out");
    assert_eq!(outputs.len(), EVENTS, "some inputs fired twice");
    let tokens: std::collections::HashSet<_> =
        outputs.iter().map(|m| m.header("weir-fencing")).collect();
    assert_eq!(tokens.len(), 1, "the graph changed hands: {tokens:?}");
    drop(graph);
}

/// A restart told to a node that stands by (another node runs the graph) finds nothing
/// to restart there, and is not kept: when the node takes the graph over, it starts it
/// once.
#[tokio::test]
async fn a_restart_told_to_a_standby_is_not_kept_for_its_takeover() {
    use weir::supervisor::GraphStatus;
    let policy = weir::SupervisionPolicy {
        graph_lease_ttl: Some(Duration::from_millis(600)),
        ..weir::SupervisionPolicy::default()
    };
    let h = Harness::with_policy(policy.clone());
    let opens = Arc::new(AtomicUsize::new(0));
    let make = |source: AccumulatorSpec| {
        snapshot_graph("standing", vec![source], ReactorConfig::default())
    };
    let first = h.spawn(make(AccumulatorSpec::passthrough("a").topic("standing.in")));
    first.wait_for_state(ReactorState::Live).await;
    let runtime = weir::Runtime {
        broker: Arc::new(h.broker.clone()),
        store: h.store.clone(),
        node_id: "other-node".into(),
    };
    let other = weir::Supervisor::new(runtime, policy, tokio_util::sync::CancellationToken::new());
    let second = other
        .spawn(make(AccumulatorSpec::passthrough("a").source(Arc::new(
            FlakyFactory {
                opens: opens.clone(),
                fail: Arc::new(Notify::new()),
            },
        ))))
        .unwrap();
    settle().await;
    assert_eq!(second.status(), GraphStatus::Standby);
    second.restart();
    settle().await;
    assert!(h.supervisor.shutdown().await);
    second.wait_for_status(|s| *s == GraphStatus::Running).await;
    second.wait_for_state(ReactorState::Live).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        opens.load(Ordering::SeqCst),
        1,
        "started once on taking over"
    );
    assert!(other.shutdown().await);
}

/// Passes outputs on to the broker once open; until then holds them unacknowledged.
struct Gate {
    broker: weir::transport::memory::MemoryBroker,
    open: tokio::sync::watch::Receiver<bool>,
}

#[async_trait]
impl weir::transport::Sink for Gate {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<Position, TransportError> {
        self.enqueue(message).await?.await
    }

    async fn enqueue(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::PendingAck, TransportError> {
        let (mut open, broker) = (self.open.clone(), self.broker.clone());
        Ok(weir::transport::PendingAck::awaited(async move {
            let _ = open.wait_for(|open| *open).await;
            weir::transport::Sink::publish(&broker, message).await
        }))
    }
}

/// A sequential graph over source `a` whose outputs to `<name>.out` are acknowledged
/// only once `open` is true.
fn gated_sequential(
    h: &Harness,
    name: &str,
    open: tokio::sync::watch::Receiver<bool>,
) -> weir::GraphDeclaration {
    GraphBuilder::new(name)
        .accumulator(AccumulatorSpec::passthrough("a"))
        .reactor(ReactorConfig {
            strategy: Strategy::Sequential,
            snapshot_interval: Duration::ZERO,
            ..ReactorConfig::default()
        })
        .node("n", ["a"], |ctx: NodeContext| async move {
            Ok(ctx.source("a").cloned())
        })
        .output_to(
            "n",
            format!("{name}.out"),
            Arc::new(Gate {
                broker: h.broker.clone(),
                open,
            }),
        )
        .build()
        .unwrap()
}

/// The graph dies with its outputs unacknowledged (its stop waits for them in vain); a
/// supervisor on the same broker and store takes over.
async fn crashed_and_taken_over(h: &Harness) -> weir::Supervisor {
    h.supervisor.shutdown().await;
    let runtime = weir::Runtime {
        broker: Arc::new(h.broker.clone()),
        store: h.store.clone(),
        node_id: "test-node".into(),
    };
    weir::Supervisor::new(
        runtime,
        weir::SupervisionPolicy::default(),
        tokio_util::sync::CancellationToken::new(),
    )
}

/// The outputs on `topic`, each with its `weir-fire`, once there are `count`.
async fn fired(h: &Harness, topic: &str, count: usize) -> Vec<(String, Value)> {
    eventually("the outputs", || async {
        h.broker.messages(topic).len() == count
    })
    .await;
    h.broker
        .messages(topic)
        .iter()
        .map(|m| {
            let record: Value = serde_json::from_slice(&m.payload).unwrap();
            (m.header("weir-fire").unwrap().to_string(), record)
        })
        .collect()
}

fn numbered(fires: &[(u64, i64)]) -> Vec<(String, Value)> {
    fires
        .iter()
        .map(|(fire, value)| (fire.to_string(), json!(value)))
        .collect()
}

/// Fires whose outputs were never acknowledged when the graph died are made again from
/// their stored inputs under the numbers they had: `weir-fire` tells a consumer which
/// outputs repeat ones it may have seen, and fires after them number on.
#[tokio::test(start_paused = true)]
async fn fires_made_again_after_a_crash_keep_their_numbers() {
    let h = Harness::new();
    let (open_tx, open) = tokio::sync::watch::channel(false);
    let g = h.spawn(gated_sequential(&h, "again", open.clone()));
    g.wait_for_state(ReactorState::Live).await;
    for n in 1..=3 {
        g.push("a", json!(n)).await.unwrap();
    }
    eventually("three fires in flight", || async { g.stats().fires == 3 }).await;
    settle().await;
    let next = crashed_and_taken_over(&h).await;
    open_tx.send_replace(true);
    let g = next.spawn(gated_sequential(&h, "again", open)).unwrap();
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(4)).await.unwrap();
    assert_eq!(
        fired(&h, "again.out", 4).await,
        numbered(&[(1, 1), (2, 2), (3, 3), (4, 4)])
    );
    assert!(next.shutdown().await);
}

/// A command's fire among fires in flight when the graph dies takes no input, so it is
/// not made again; the fires after it still are, under the numbers they had.
#[tokio::test(start_paused = true)]
async fn a_commands_fire_in_flight_at_a_crash_leaves_the_later_fires_their_numbers() {
    let h = Harness::new();
    let (open_tx, open) = tokio::sync::watch::channel(false);
    let g = h.spawn(gated_sequential(&h, "between", open.clone()));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    eventually("the first fire in flight", || async {
        g.stats().fires == 1
    })
    .await;
    g.reactor()
        .fire_with(BTreeMap::from([("a".to_string(), json!(100))]))
        .await
        .unwrap();
    g.push("a", json!(3)).await.unwrap();
    eventually("three fires in flight", || async { g.stats().fires == 3 }).await;
    settle().await;
    let next = crashed_and_taken_over(&h).await;
    open_tx.send_replace(true);
    let g = next.spawn(gated_sequential(&h, "between", open)).unwrap();
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(4)).await.unwrap();
    assert_eq!(
        fired(&h, "between.out", 3).await,
        numbered(&[(1, 1), (3, 3), (4, 4)])
    );
    assert!(next.shutdown().await);
}

/// Publishes to the memory broker, noting for each message its `weir-fire` and the
/// count of fires the store held for `graph` as the message went.
struct CountAtPublish {
    broker: weir::transport::memory::MemoryBroker,
    store: Arc<weir::store::memory::MemoryStore>,
    graph: &'static str,
    seen: Arc<std::sync::Mutex<Vec<(u64, u64)>>>,
}

#[async_trait]
impl weir::transport::Sink for CountAtPublish {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<Position, TransportError> {
        use weir::reactor::CacheStore;
        let stored = self.store.load_cache(self.graph).await.unwrap();
        let fire = message
            .headers
            .iter()
            .find(|(name, _)| name == "weir-fire")
            .and_then(|(_, value)| value.parse().ok())
            .unwrap();
        self.seen
            .lock()
            .unwrap()
            .push((fire, stored.map_or(0, |s| s.fires)));
        weir::transport::Sink::publish(&self.broker, message).await
    }
}

/// A command's fire takes no input that a crash would replay to make it again, so the
/// store counts it before its outputs go: a crash after them cannot give its number to
/// another fire. (Snapshots are spaced an hour apart here; only the command's is not.)
#[tokio::test(start_paused = true)]
async fn a_commands_fire_is_counted_in_the_store_before_its_outputs_go() {
    let h = Harness::new();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let decl = GraphBuilder::new("counted")
        .accumulator(AccumulatorSpec::passthrough("a"))
        .reactor(ReactorConfig {
            strategy: Strategy::Sequential,
            snapshot_interval: Duration::from_secs(3600),
            ..ReactorConfig::default()
        })
        .node("n", ["a"], |ctx: NodeContext| async move {
            Ok(ctx.source("a").cloned())
        })
        .output_to(
            "n",
            "counted.out",
            Arc::new(CountAtPublish {
                broker: h.broker.clone(),
                store: h.store.clone(),
                graph: "counted",
                seen: seen.clone(),
            }),
        )
        .build()
        .unwrap();
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    eventually("the first output", || async {
        seen.lock().unwrap().len() == 1
    })
    .await;
    let forced = g.reactor().force_fire().await.unwrap();
    let with = g
        .reactor()
        .fire_with(BTreeMap::from([("a".to_string(), json!(7))]))
        .await
        .unwrap();
    assert_eq!((forced.fire, with.fire), (2, 3));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for &(fire, stored) in &seen[1..] {
        assert!(
            stored >= fire,
            "the command's fire {fire} went out with {stored} fires stored"
        );
    }
}

/// A fire stored as awaiting acknowledgement, acknowledged afterwards while nothing else
/// happens: a stop stores a snapshot counting it done, so the next run does not make it
/// again, and numbers on after it.
#[tokio::test(start_paused = true)]
async fn a_fire_acknowledged_after_its_snapshot_is_not_made_again_after_a_stop() {
    let h = Harness::new();
    let (open_tx, open) = tokio::sync::watch::channel(false);
    let g = h.spawn(gated_sequential(&h, "acked", open.clone()));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    eventually("the fire in flight", || async { g.stats().fires == 1 }).await;
    h.advance(Duration::from_secs(1)).await;
    open_tx.send_replace(true);
    eventually("its output", || async {
        h.broker.messages("acked.out").len() == 1
    })
    .await;
    h.advance(Duration::from_secs(1)).await;
    let h = h.restart().await;
    let g = h.spawn(gated_sequential(&h, "acked", open));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(2)).await.unwrap();
    eventually("the next output", || async {
        h.broker.messages("acked.out").len() >= 2
    })
    .await;
    h.advance(Duration::from_secs(1)).await;
    assert_eq!(fired(&h, "acked.out", 2).await, numbered(&[(1, 1), (2, 2)]));
}

/// A sink that, as the NATS JetStream client, counts each message handed over until its
/// acknowledgement is awaited, and holds further hand-overs back while `limit` are.
struct AcksCounted {
    broker: weir::transport::memory::MemoryBroker,
    pending: Arc<tokio::sync::Semaphore>,
}

#[async_trait]
impl weir::transport::Sink for AcksCounted {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<Position, TransportError> {
        self.enqueue(message).await?.await
    }

    async fn enqueue(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::PendingAck, TransportError> {
        let counted = self.pending.clone().acquire_owned().await.unwrap();
        let position = weir::transport::Sink::publish(&self.broker, message).await?;
        Ok(weir::transport::PendingAck::awaited(async move {
            // Acknowledged a moment after it is sent, as over a network.
            tokio::time::sleep(Duration::from_millis(1)).await;
            drop(counted);
            Ok(position)
        }))
    }
}

/// More fires may await acknowledgement (`max_in_flight`) than the sink lets be pending
/// before it holds hand-overs back: the reactor takes in acknowledgements while a
/// hand-over waits, so the graph slows down to the sink's pace rather than stopping.
#[tokio::test(start_paused = true)]
async fn a_sink_holding_hand_overs_back_until_acknowledgements_are_awaited_stops_nothing() {
    let h = Harness::new();
    let sink = Arc::new(AcksCounted {
        broker: h.broker.clone(),
        pending: Arc::new(tokio::sync::Semaphore::new(4)),
    });
    let g = h.spawn(
        GraphBuilder::new("counted")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .reactor(ReactorConfig {
                max_in_flight: 32,
                ..config(Criteria::WhenAny, Strategy::Sequential)
            })
            .node("n", ["a"], |ctx: NodeContext| async move {
                Ok(ctx.source("a").cloned())
            })
            .output_to("n", "counted.out", sink)
            .build()
            .unwrap(),
    );
    g.wait_for_state(ReactorState::Live).await;
    for n in 1..=100 {
        g.push("a", json!(n)).await.unwrap();
    }
    eventually("every input out", || async {
        h.broker.messages("counted.out").len() == 100
    })
    .await;
    let out: Vec<u64> = h
        .broker
        .messages("counted.out")
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect();
    assert_eq!(out, (1..=100).collect::<Vec<_>>(), "in fire order");
}

/// A sink whose client takes nothing until opened: every hand-over waits, as one to a
/// broker client whose buffer is full while its server is away.
struct HandOverGate {
    broker: weir::transport::memory::MemoryBroker,
    open: tokio::sync::watch::Receiver<bool>,
}

#[async_trait]
impl weir::transport::Sink for HandOverGate {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<Position, TransportError> {
        let _ = self.open.clone().wait_for(|open| *open).await;
        weir::transport::Sink::publish(&self.broker, message).await
    }
}

/// A graph stopped while its sink holds a fire's output back stops in time (it does not
/// wait out the hand-over), and the fire's input is kept: the next start fires it under
/// the same number.
#[tokio::test(start_paused = true)]
async fn a_stop_while_a_hand_over_waits_stops_in_time_and_keeps_the_input() {
    let h = Harness::new();
    let (open_tx, open) = tokio::sync::watch::channel(false);
    let broker = h.broker.clone();
    let decl = |open: tokio::sync::watch::Receiver<bool>| {
        GraphBuilder::new("held")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .reactor(ReactorConfig {
                snapshot_interval: Duration::ZERO,
                ..config(Criteria::WhenAny, Strategy::Sequential)
            })
            .node("n", ["a"], |ctx: NodeContext| async move {
                Ok(ctx.source("a").cloned())
            })
            .output_to(
                "n",
                "held.out",
                Arc::new(HandOverGate {
                    broker: broker.clone(),
                    open,
                }),
            )
            .build()
            .unwrap()
    };
    let g = h.spawn(decl(open.clone()));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(1)).await.unwrap();
    eventually("the fire", || async { g.stats().fires == 1 }).await;
    settle().await;
    assert!(
        h.supervisor.shutdown().await,
        "stopped within the shutdown timeout"
    );
    assert!(h.broker.messages("held.out").is_empty());
    let h = h.restart().await;
    open_tx.send_replace(true);
    let g = h.spawn(decl(open));
    g.wait_for_state(ReactorState::Live).await;
    eventually("the kept input's output", || async {
        h.broker.messages("held.out").len() == 1
    })
    .await;
    let out = &h.broker.messages("held.out")[0];
    assert_eq!(
        serde_json::from_slice::<Value>(&out.payload).unwrap(),
        json!(1)
    );
    assert_eq!(out.header("weir-fire"), Some("1"));
}

/// `max_in_flight` caps the fires whose outputs await acknowledgement: the rest wait in
/// their queue, unfired, until acknowledgements make room.
#[tokio::test(start_paused = true)]
async fn fires_awaiting_acknowledgement_stop_at_max_in_flight() {
    let h = Harness::new();
    let (open_tx, open) = tokio::sync::watch::channel(false);
    let g = h.spawn(
        GraphBuilder::new("capped")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .reactor(ReactorConfig {
                max_in_flight: 3,
                ..config(Criteria::WhenAny, Strategy::Sequential)
            })
            .node("n", ["a"], |ctx: NodeContext| async move {
                Ok(ctx.source("a").cloned())
            })
            .output_to(
                "n",
                "capped.out",
                Arc::new(Gate {
                    broker: h.broker.clone(),
                    open,
                }),
            )
            .build()
            .unwrap(),
    );
    g.wait_for_state(ReactorState::Live).await;
    for n in 1..=10 {
        g.push("a", json!(n)).await.unwrap();
    }
    eventually("three fires", || async { g.stats().fires == 3 }).await;
    h.advance(Duration::from_secs(5)).await;
    assert_eq!(g.stats().fires, 3, "no fire past the cap");
    let state = g.reactor().get_state().await.unwrap();
    assert_eq!(state.sources["a"].queued, 7, "the rest wait in the queue");
    open_tx.send_replace(true);
    eventually("every input out", || async {
        h.broker.messages("capped.out").len() == 10
    })
    .await;
    // The gate lets the three waiting through at once, in no set order.
    let mut out: Vec<u64> = h
        .broker
        .messages("capped.out")
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
        .collect();
    out.sort_unstable();
    assert_eq!(out, (1..=10).collect::<Vec<_>>());
}

/// A failing fire is run again `node_retries` times, waiting 100 ms, then twice as long
/// before each next try.
#[tokio::test(start_paused = true)]
async fn a_failing_fire_is_retried_with_doubling_backoff() {
    let h = Harness::new();
    let tries = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = tries.clone();
    let g = h.spawn(
        GraphBuilder::new("retried")
            .accumulator(AccumulatorSpec::passthrough("a"))
            .reactor(config(Criteria::WhenAny, Strategy::Sequential))
            .node("n", ["a"], move |ctx: NodeContext| {
                let seen = seen.clone();
                async move {
                    let mut tries = seen.lock().unwrap();
                    tries.push(tokio::time::Instant::now());
                    if tries.len() <= 3 {
                        return Err(weir::graph::NodeError::new("not yet"));
                    }
                    Ok(ctx.source("a").cloned())
                }
            })
            .output("n", "retried.out")
            .build()
            .unwrap(),
    );
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!("x")).await.unwrap();
    eventually("output", || async { h.outputs("retried.out").len() == 1 }).await;
    assert_eq!(h.outputs("retried.out"), [json!("x")]);
    assert!(h.outputs("retried.out.dlq").is_empty());
    let tries = tries.lock().unwrap().clone();
    let waits: Vec<Duration> = tries.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(
        waits,
        [
            Duration::from_millis(100),
            Duration::from_millis(200),
            Duration::from_millis(400)
        ]
    );
}

#[tokio::test]
async fn a_leased_graph_runs_once_and_fences_its_outputs() {
    use weir::supervisor::GraphStatus;
    let policy = weir::SupervisionPolicy {
        graph_lease_ttl: Some(Duration::from_millis(600)),
        ..weir::SupervisionPolicy::default()
    };
    let h = Harness::with_policy(policy.clone());
    let make = || {
        snapshot_graph(
            "leased",
            vec![AccumulatorSpec::passthrough("a").topic("leased.in")],
            ReactorConfig::default(),
        )
    };
    let first = h.spawn(make());
    first.wait_for_state(ReactorState::Live).await;
    // A second node on the same broker and store stands by.
    let runtime = weir::Runtime {
        broker: Arc::new(h.broker.clone()),
        store: h.store.clone(),
        node_id: "other-node".into(),
    };
    let other_cancel = tokio_util::sync::CancellationToken::new();
    let other = weir::Supervisor::new(runtime, policy, other_cancel.clone());
    let second = other.spawn(make()).unwrap();
    settle().await;
    assert_eq!(second.status(), GraphStatus::Standby);
    h.pipe_bytes("leased.in", b"1").await;
    eventually("output", || async { h.outputs("leased.out").len() == 1 }).await;
    let message = &h.broker.messages("leased.out")[0];
    assert_eq!(message.header("weir-fencing"), Some("1"));
    // The first node stops and releases the lease: the second takes over with a higher token.
    assert!(h.supervisor.shutdown().await);
    second.wait_for_status(|s| *s == GraphStatus::Running).await;
    second.wait_for_state(ReactorState::Live).await;
    h.pipe_bytes("leased.in", b"2").await;
    eventually("output from the second node", || async {
        h.outputs("leased.out").len() == 2
    })
    .await;
    assert_eq!(
        h.broker.messages("leased.out")[1].header("weir-fencing"),
        Some("2")
    );
    assert!(other.shutdown().await);
}

/// A graph declared in a config file whose source carries Avro (single-object encoding)
/// and names its own dead-letter topic: records come out as JSON, and what does not
/// decode goes to that topic, the source going on.
#[tokio::test(start_paused = true)]
async fn a_configured_avro_source_decodes_records_and_dead_letters_the_rest_where_told() {
    let schema = r#"{"type": "record", "name": "Quote", "fields": [
        {"name": "symbol", "type": "string"}, {"name": "px", "type": "double"}]}"#;
    let mut schema_file = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut schema_file, schema.as_bytes()).unwrap();
    let text = format!(
        r#"
[[graph]]
name = "quotes"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "quotes.out"
[[graph.accumulator]]
name = "a"
topic = "quotes.in"
format = "avro"
schema = "{}"
dead_letter = "quotes.rejected"
"#,
        schema_file.path().display()
    );
    let config =
        weir::config::Config::parse(&text, std::path::Path::new("weir.toml"), Vec::new()).unwrap();
    let mut graphs = config.graphs(&FunctionRegistry::default()).unwrap();
    let h = Harness::new();
    let g = h.spawn(graphs.remove(0));
    g.wait_for_state(ReactorState::Live).await;
    #[derive(serde::Serialize)]
    struct Quote {
        symbol: &'static str,
        px: f64,
    }
    let codec = weir::codec::avro::AvroCodec::new("event", schema).unwrap();
    let encoded = |symbol, px| codec.encode(&Quote { symbol, px }).unwrap();
    h.pipe_bytes("quotes.in", &encoded("ACME", 101.5)).await;
    h.pipe_bytes("quotes.in", b"{\"symbol\": \"not avro\"}")
        .await;
    h.pipe_bytes("quotes.in", &encoded("INIT", 7.25)).await;
    let quote = json!({"symbol": "ACME", "px": 101.5});
    let later = json!({"symbol": "INIT", "px": 7.25});
    eventually("both records out", || async {
        h.outputs("quotes.out").len() == 2
    })
    .await;
    assert_eq!(inputs(&h.outputs("quotes.out"), "a"), [quote, later]);
    let rejected = h.broker.messages("quotes.rejected");
    assert_eq!(rejected.len(), 1);
    assert_eq!(&rejected[0].payload[..], b"{\"symbol\": \"not avro\"}");
    assert!(rejected[0].header("weir-error").is_some());
    assert!(h.broker.messages("quotes.in.dlq").is_empty());
}

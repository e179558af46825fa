//! Nothing new is taken for a replay: after restarts, panics, source errors and replays
//! in a different order, every input reaches the outputs. On the embedded backends.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{eventually, settle, Harness};
use serde_json::{json, Value};
use tokio::sync::Notify;
use weir::accumulator::{Accumulator, AccumulatorError, Batch, Event, Passthrough};
use weir::graph::FunctionRegistry;
use weir::transport::{
    Assignment, BrokerSource, Message, Position, Source, SourceFactory, Subscription,
    TransportError,
};
use weir::{AccumulatorSpec, Criteria, GraphBuilder, ReactorConfig, ReactorState, Strategy};

/// A graph whose every boundary fires once (sequential, when_any) into `<name>.out`,
/// its cache snapshotted every turn: what it takes in is durable at once.
fn graph(name: &str, accumulator: AccumulatorSpec) -> weir::GraphDeclaration {
    graph_spacing_checkpoints(
        name,
        accumulator,
        ReactorConfig::default().checkpoint_interval,
    )
}

/// The same graph, with checkpoint writes `spacing` apart where they may be: the
/// spacing alone decides when positions are committed.
fn graph_spacing_checkpoints(
    name: &str,
    accumulator: AccumulatorSpec,
    spacing: Duration,
) -> weir::GraphDeclaration {
    graph_with(name, accumulator, Duration::ZERO, spacing)
}

/// The same graph, its cache snapshotted only on pause and resume: until one, nothing
/// it took in is durable.
fn graph_snapshotting_on_command(
    name: &str,
    accumulator: AccumulatorSpec,
) -> weir::GraphDeclaration {
    graph_with(
        name,
        accumulator,
        Duration::from_secs(3600),
        ReactorConfig::default().checkpoint_interval,
    )
}

fn graph_with(
    name: &str,
    accumulator: AccumulatorSpec,
    snapshot_interval: Duration,
    checkpoint_interval: Duration,
) -> weir::GraphDeclaration {
    let registry = FunctionRegistry::default();
    GraphBuilder::new(name)
        .reactor(ReactorConfig {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Sequential,
            snapshot_interval,
            checkpoint_interval,
            ..ReactorConfig::default()
        })
        .accumulator(accumulator)
        .function("snapshot", &registry, "snapshot")
        .output("snapshot", format!("{name}.out"))
        .build()
        .expect("valid graph")
}

/// Every value the source `a` showed the outputs, arrays (batches) flattened.
fn seen_inputs(h: &Harness, topic: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for output in h.outputs(topic) {
        match &output["inputs"]["a"] {
            Value::Array(items) => seen.extend(items.iter().map(Value::to_string)),
            other => {
                seen.insert(other.to_string());
            }
        }
    }
    seen
}

fn expected(values: &[Value]) -> BTreeSet<String> {
    values.iter().map(Value::to_string).collect()
}

/// A topic of the harness's broker whose reader fails once when told to, as a broker
/// connection that drops does, and which refuses to open while `refuse` is set.
struct Breakable {
    inner: BrokerSource,
    fail: Arc<Notify>,
    opens: Arc<AtomicUsize>,
    refuse: Arc<AtomicBool>,
}

impl Breakable {
    fn new(h: &Harness, topic: &str, group: &str) -> (Arc<Self>, Arc<Notify>) {
        let mut subscription = Subscription::new(topic, group);
        subscription.assignment = Assignment::All;
        let fail = Arc::new(Notify::new());
        let source = Self {
            inner: BrokerSource {
                broker: Arc::new(h.broker.clone()),
                subscription,
            },
            fail: fail.clone(),
            opens: Arc::new(AtomicUsize::new(0)),
            refuse: Arc::new(AtomicBool::new(false)),
        };
        (Arc::new(source), fail)
    }
}

#[async_trait]
impl SourceFactory for Breakable {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn open(&self, resume_after: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        self.opens.fetch_add(1, Ordering::SeqCst);
        if self.refuse.load(Ordering::SeqCst) {
            return Err(TransportError::Unreachable {
                broker: "test".into(),
                source: "connection refused".into(),
            });
        }
        Ok(Box::new(BreakableSource {
            inner: self.inner.open(resume_after).await?,
            fail: self.fail.clone(),
        }))
    }
}

struct BreakableSource {
    inner: Box<dyn Source>,
    fail: Arc<Notify>,
}

#[async_trait]
impl Source for BreakableSource {
    async fn next(&mut self) -> Result<Message, TransportError> {
        tokio::select! {
            biased;
            _ = self.fail.notified() => Err(TransportError::Unreachable {
                broker: "test".into(),
                source: "connection reset".into(),
            }),
            message = self.inner.next() => message,
        }
    }

    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
        self.inner.commit(through).await
    }
}

/// An accumulator that panics on the next event once armed, as a bug would: the
/// supervisor starts another from the stored checkpoint, which reads again what came
/// after it.
struct PanicsWhenArmed<A> {
    inner: A,
    armed: Arc<AtomicBool>,
}

impl<A: Accumulator> Accumulator for PanicsWhenArmed<A> {
    fn init(&mut self, state: Option<Value>) -> Result<(), AccumulatorError> {
        self.inner.init(state)
    }

    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        if self.armed.swap(false, Ordering::SeqCst) {
            panic!("armed to panic");
        }
        self.inner.process(event)
    }

    fn flush_interval(&self) -> Option<Duration> {
        self.inner.flush_interval()
    }

    fn flush(&mut self) -> Option<Value> {
        self.inner.flush()
    }

    fn checkpoint(&self) -> Option<Value> {
        self.inner.checkpoint()
    }
}

/// A stateful accumulator summing numbers, emitting the sum at each.
fn sum(name: &str) -> AccumulatorSpec {
    AccumulatorSpec::stateful(name, json!(0), |state, event| {
        let total = state.as_i64().unwrap_or(0) + event.as_i64().unwrap_or(0);
        *state = json!(total);
        Some(json!(total))
    })
}

/// The state stored with accumulator `a`'s checkpoint.
async fn stored_state(h: &Harness, graph: &str) -> Option<Value> {
    use weir::store::prelude::*;
    h.store
        .load_checkpoint(graph, "a")
        .await
        .unwrap()
        .and_then(|c| c.state)
}

async fn publish_all(h: &Harness, topic: &str, values: &[Value]) {
    for v in values {
        h.pipe_bytes(topic, v.to_string().as_bytes()).await;
    }
}

#[tokio::test(start_paused = true)]
async fn pushes_mixed_with_topic_events_then_a_source_error_lose_nothing() {
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "mix.in", "weir.mix");
    let opens = source.opens.clone();
    let g = h.spawn(graph(
        "mix",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "mix.in", &[json!("t0"), json!("t1")]).await;
    eventually("topic fires", || async { h.outputs("mix.out").len() == 2 }).await;
    for p in ["p0", "p1", "p2"] {
        g.push("a", json!(p)).await.unwrap();
    }
    eventually("push fires", || async { h.outputs("mix.out").len() == 5 }).await;
    fail.notify_one();
    eventually("reopened", || async { opens.load(Ordering::SeqCst) == 2 }).await;
    publish_all(&h, "mix.in", &[json!("t2"), json!("t3")]).await;
    g.push("a", json!("p3")).await.unwrap();
    let all = expected(&[
        json!("t0"),
        json!("t1"),
        json!("t2"),
        json!("t3"),
        json!("p0"),
        json!("p1"),
        json!("p2"),
        json!("p3"),
    ]);
    eventually("every input fired", || async {
        seen_inputs(&h, "mix.out") == all
    })
    .await;
}

/// What a stateful accumulator's state took in from pushes since its last stored
/// checkpoint outlasts a source error: pushes are never replayed, so a restart from that
/// checkpoint would lose it. Nothing the source delivered is read again either.
#[tokio::test(start_paused = true)]
async fn a_source_error_keeps_what_pushes_added_to_the_state() {
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "kept.in", "weir.kept");
    let opens = source.opens.clone();
    let g = h.spawn(graph_snapshotting_on_command(
        "kept",
        sum("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    // Nothing is durable until the reactor resumes, so no checkpoint holds the push.
    g.reactor().pause().await.unwrap();
    publish_all(&h, "kept.in", &[json!(1)]).await;
    eventually("1 taken in", || async { g.stats().boundaries == 1 }).await;
    g.push("a", json!(10)).await.unwrap();
    eventually("10 taken in", || async { g.stats().boundaries == 2 }).await;
    fail.notify_one();
    eventually("reopened", || async { opens.load(Ordering::SeqCst) == 2 }).await;
    g.reactor().resume().await.unwrap();
    publish_all(&h, "kept.in", &[json!(100)]).await;
    eventually("three fires", || async { h.outputs("kept.out").len() == 3 }).await;
    settle().await;
    let sums: Vec<Value> = h
        .outputs("kept.out")
        .iter()
        .map(|o| o["inputs"]["a"].clone())
        .collect();
    assert_eq!(sums, [json!(1), json!(11), json!(111)]);
    assert_eq!(g.stats().boundaries, 3, "nothing was read again");
    // A pause stores a snapshot: the carried run's checkpoints follow it.
    g.reactor().pause().await.unwrap();
    eventually("the state stored", || async {
        stored_state(&h, "kept").await == Some(json!(111))
    })
    .await;
}

/// A graph stopped while its source is down, waiting to reopen it, stores the state its
/// accumulator held, pushes' part in it included, as a running one does at a stop.
#[tokio::test(start_paused = true)]
async fn a_stop_while_the_source_is_down_stores_what_pushes_added_to_the_state() {
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "down.in", "weir.down");
    let (opens, refuse) = (source.opens.clone(), source.refuse.clone());
    let g = h.spawn(graph_snapshotting_on_command(
        "down",
        sum("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    g.reactor().pause().await.unwrap();
    publish_all(&h, "down.in", &[json!(1)]).await;
    eventually("1 taken in", || async { g.stats().boundaries == 1 }).await;
    g.push("a", json!(10)).await.unwrap();
    eventually("10 taken in", || async { g.stats().boundaries == 2 }).await;
    refuse.store(true, Ordering::SeqCst);
    fail.notify_one();
    eventually("an open refused", || async {
        opens.load(Ordering::SeqCst) >= 2
    })
    .await;
    let h = h.restart().await;
    assert_eq!(
        stored_state(&h, "down").await,
        Some(json!(11)),
        "the stop stored the state"
    );
    let (source, _fail) = Breakable::new(&h, "down.in", "weir.down");
    let g = h.spawn(graph_snapshotting_on_command(
        "down",
        sum("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    // The pause is stored with the cache; what it held fires now.
    g.reactor().resume().await.unwrap();
    publish_all(&h, "down.in", &[json!(100)]).await;
    eventually("the next sum fired", || async {
        h.outputs("down.out")
            .iter()
            .any(|o| o["inputs"]["a"] == json!(111))
    })
    .await;
}

/// Passes events through, rejecting the string "bad".
struct RejectsBad;

impl Accumulator for RejectsBad {
    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        if event.value == json!("bad") {
            return Err(AccumulatorError::Rejected("a bad quote".into()));
        }
        Ok(Some(event.value))
    }
}

/// A rejected message is taken in only once its dead letter is out: stopped while its
/// dead letter cannot go out, the graph dead-letters it after the restart rather than
/// passing it by.
#[tokio::test(start_paused = true)]
async fn a_rejected_message_whose_dead_letter_a_stop_cut_short_is_dead_lettered_after_the_restart()
{
    let h = Harness::new();
    let dead_letters = dead_letters_down(&h, false);
    let node = || node_refusing(&h, &dead_letters, weir::SupervisionPolicy::default());
    let picky = || {
        graph(
            "picky",
            AccumulatorSpec::custom("a", || RejectsBad).topic("picky.in"),
        )
    };
    let first = node();
    let g = first.spawn(picky()).unwrap();
    g.wait_for_state(ReactorState::Live).await;
    publish_all(
        &h,
        "picky.in",
        &[json!("good"), json!("bad"), json!("later")],
    )
    .await;
    eventually("the dead letter tried", || async {
        dead_letters.refused.load(Ordering::SeqCst) > 0
    })
    .await;
    // The good one waits with the dead letter's burst; the stop hands it over.
    assert!(first.shutdown().await, "stopped in time");
    assert!(h.broker.messages("picky.in.dlq").is_empty());

    dead_letters.down.store(false, Ordering::SeqCst);
    let second = node();
    let _g = second.spawn(picky()).unwrap();
    later_fires_after_bad_is_dead_lettered_once(&h, "picky").await;
    assert!(second.shutdown().await, "stopped in time");
}

/// A dead letter goes out at least once: a rejected message dead-lettered while the
/// store is away, so that no checkpoint past it is stored before the node goes down,
/// is dead-lettered again by the node reading the topic next.
#[tokio::test(start_paused = true)]
async fn a_message_dead_lettered_before_any_checkpoint_past_it_is_dead_lettered_again() {
    let h = Harness::new();
    let picky = || {
        graph(
            "again",
            AccumulatorSpec::custom("a", || RejectsBad).topic("again.in"),
        )
    };
    let g = h.spawn(picky());
    g.wait_for_state(ReactorState::Live).await;
    h.store.set_reachable(false);
    publish_all(&h, "again.in", &[json!("bad"), json!("later")]).await;
    eventually("the dead letter", || async {
        !h.broker.messages("again.in.dlq").is_empty()
    })
    .await;
    assert!(h.shutdown().await, "stopped in time, the store away");
    use weir::store::prelude::*;
    h.store.set_reachable(true);
    assert_eq!(
        h.store.load_checkpoint("again", "a").await.unwrap(),
        None,
        "no checkpoint past the message"
    );
    let h = h.restart().await;
    let _g = h.spawn(picky());
    eventually("the message dead-lettered again", || async {
        h.broker.messages("again.in.dlq").len() == 2
    })
    .await;
    for letter in h.broker.messages("again.in.dlq") {
        assert_eq!(letter.payload, json!("bad").to_string().as_bytes());
    }
    eventually("the later one fired", || async {
        fired(&h, "again").contains(&json!("later"))
    })
    .await;
    assert!(h.shutdown().await, "stopped in time");
}

/// A broker whose dead letters are refused (`for_good`: even without their payload)
/// until its `down` flag is cleared.
fn dead_letters_down(h: &Harness, for_good: bool) -> Arc<common::DeadLettersDown> {
    Arc::new(common::DeadLettersDown {
        inner: Arc::new(h.broker.clone()),
        down: Arc::new(AtomicBool::new(true)),
        refused: Arc::default(),
        for_good,
    })
}

/// A node on the harness's store whose broker sends dead letters through `dead_letters`.
fn node_refusing(
    h: &Harness,
    dead_letters: &Arc<common::DeadLettersDown>,
    policy: weir::SupervisionPolicy,
) -> weir::Supervisor {
    let runtime = weir::Runtime {
        broker: Arc::new(common::WithSink {
            broker: Arc::new(h.broker.clone()),
            sink: dead_letters.clone(),
        }),
        store: h.store.clone(),
        node_id: "test-node".into(),
    };
    weir::Supervisor::new(runtime, policy, tokio_util::sync::CancellationToken::new())
}

/// What graph `name` fired on, in order.
fn fired(h: &Harness, name: &str) -> Vec<Value> {
    h.outputs(&format!("{name}.out"))
        .iter()
        .map(|o| o["inputs"]["a"].clone())
        .collect()
}

/// Once its dead letters can go, graph `name` (fed "good", "bad", "later") fires on
/// "later" after "good", and "bad" is dead-lettered exactly once.
async fn later_fires_after_bad_is_dead_lettered_once(h: &Harness, name: &str) {
    eventually("the later one fired", || async {
        fired(h, name).contains(&json!("later"))
    })
    .await;
    assert_eq!(fired(h, name), [json!("good"), json!("later")]);
    let dead = h.broker.messages(&format!("{name}.in.dlq"));
    assert_eq!(dead.len(), 1, "the rejected message dead-lettered once");
    assert_eq!(dead[0].payload, json!("bad").to_string().as_bytes());
}

/// A broker that refuses a rejected message's dead letter for good, with its payload and
/// without: the source stops at that message rather than pass it by, the graph is
/// restarted with backoff and then marked Failed, and nothing after the message is
/// taken in. Once the letter can go, a restart dead-letters the message and goes on.
#[tokio::test(start_paused = true)]
async fn a_dead_letter_refused_for_good_stops_its_source_at_the_message_and_fails_the_graph() {
    let h = Harness::new();
    let dead_letters = dead_letters_down(&h, true);
    let policy = weir::SupervisionPolicy {
        max_failures: 3,
        ..weir::SupervisionPolicy::default()
    };
    let node = node_refusing(&h, &dead_letters, policy);
    let g = node
        .spawn(graph(
            "refused",
            AccumulatorSpec::custom("a", || RejectsBad).topic("refused.in"),
        ))
        .unwrap();
    g.wait_for_state(ReactorState::Live).await;
    publish_all(
        &h,
        "refused.in",
        &[json!("good"), json!("bad"), json!("later")],
    )
    .await;
    tokio::time::timeout(
        std::time::Duration::from_secs(600),
        g.wait_for_state(ReactorState::Failed),
    )
    .await
    .expect("the graph failed");
    // Each run tried the letter with its payload and then without.
    assert!(dead_letters.refused.load(Ordering::SeqCst) >= 2 * 3);
    assert_eq!(
        fired(&h, "refused"),
        [json!("good")],
        "nothing after the message was taken in"
    );
    assert!(h.broker.messages("refused.in.dlq").is_empty());

    dead_letters.down.store(false, Ordering::SeqCst);
    g.restart();
    later_fires_after_bad_is_dead_lettered_once(&h, "refused").await;
    assert!(node.shutdown().await, "stopped in time");
}

#[tokio::test(start_paused = true)]
async fn a_replay_of_three_partitions_in_another_order_loses_nothing() {
    // Unkeyed messages go round-robin: partitions 1, 2, 0, 1, ...
    let h = Harness::partitioned(3);
    let armed = Arc::new(AtomicBool::new(false));
    let accumulator = {
        let armed = armed.clone();
        AccumulatorSpec::custom("a", move || PanicsWhenArmed {
            inner: Passthrough,
            armed: armed.clone(),
        })
    };
    let g = h.spawn(graph_snapshotting_on_command(
        "multi",
        accumulator.topic("multi.in"),
    ));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "multi.in", &[json!("m1")]).await; // partition 1, fired and committed
    eventually("m1 fired", || async { h.outputs("multi.out").len() == 1 }).await;
    // The pause stores a snapshot counting m1's fire.
    g.reactor().pause().await.unwrap();
    eventually("m1 committed", || async {
        h.broker.committed("multi.in", "weir.multi") == vec![0, 1, 0]
    })
    .await;
    publish_all(&h, "multi.in", &[json!("m2")]).await; // partition 2, taken, not durable
    eventually("m2 cached", || async { g.stats().boundaries == 2 }).await;
    armed.store(true, Ordering::SeqCst);
    // The accumulator panics on the first of m3 and m4 it takes in: the next one
    // replays from the checkpoint, reading
    // partition 1 (m4) before partition 2 (m2, a repeat) and partition 0 (m3).
    publish_all(&h, "multi.in", &[json!("m3"), json!("m4")]).await;
    eventually("replay read", || async { g.stats().boundaries >= 4 }).await;
    g.reactor().resume().await.unwrap();
    let all = expected(&[json!("m1"), json!("m2"), json!("m3"), json!("m4")]);
    eventually("every input fired", || async {
        seen_inputs(&h, "multi.out") == all
    })
    .await;
    assert_eq!(g.stats().duplicates, 1, "m2 is the one repeat");
}

#[tokio::test(start_paused = true)]
async fn an_interval_batch_across_a_restart_loses_nothing() {
    let h = Harness::new();
    let interval = Duration::from_millis(100);
    let armed = Arc::new(AtomicBool::new(false));
    let accumulator = {
        let armed = armed.clone();
        AccumulatorSpec::custom("a", move || PanicsWhenArmed {
            inner: Batch::new(100, interval),
            armed: armed.clone(),
        })
    };
    let g = h.spawn(graph("batch", accumulator.topic("batch.in")));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "batch.in", &[json!(1), json!(2)]).await;
    eventually("first batch fired", || async {
        h.outputs("batch.out").len() == 1
    })
    .await;
    // Nothing fires from here on, so the checkpoint stays after event 2 while 3 and 4
    // leave in two batches of their own.
    g.reactor().pause().await.unwrap();
    for v in [3, 4] {
        publish_all(&h, "batch.in", &[json!(v)]).await;
        tokio::time::sleep(interval * 2).await;
    }
    eventually("two more batches", || async { g.stats().boundaries == 3 }).await;
    // The accumulator panics on event 5, and the next one replays from the checkpoint:
    // it takes 3 and 4, repeats, into one batch with 5.
    armed.store(true, Ordering::SeqCst);
    publish_all(&h, "batch.in", &[json!(5)]).await;
    tokio::time::sleep(interval * 2).await;
    g.reactor().resume().await.unwrap();
    let all = expected(&[json!(1), json!(2), json!(3), json!(4), json!(5)]);
    eventually("every input fired", || async {
        seen_inputs(&h, "batch.out") == all
    })
    .await;
}

/// A batch its interval flushed leaves the stored state too, though no position moved
/// with it: restarted, the accumulator does not send its events again with the next batch.
#[tokio::test(start_paused = true)]
async fn a_batch_its_interval_flushed_is_not_sent_again_after_a_restart() {
    let h = Harness::new();
    let interval = Duration::from_secs(30);
    let batch = || AccumulatorSpec::batch("a", 3, interval).topic("flushed.in");
    let g = h.spawn(graph("flushed", batch()));
    g.wait_for_state(ReactorState::Live).await;
    // Paused, so 4 and 5 are held when the first batch becomes durable and are stored
    // with its checkpoint.
    g.reactor().pause().await.unwrap();
    publish_all(
        &h,
        "flushed.in",
        &(1..=5).map(|v| json!(v)).collect::<Vec<_>>(),
    )
    .await;
    eventually("taken in", || async { g.stats().boundaries == 1 }).await;
    g.reactor().resume().await.unwrap();
    eventually("held events checkpointed", || async {
        stored_state(&h, "flushed").await == Some(json!([4, 5]))
    })
    .await;
    // The interval sends 4 and 5 on.
    tokio::time::sleep(interval).await;
    eventually("flushed batch fired", || async {
        h.outputs("flushed.out").len() == 2
    })
    .await;
    eventually("emptied state stored", || async {
        stored_state(&h, "flushed").await == Some(json!([]))
    })
    .await;
    let h = h.restart().await;
    let g = h.spawn(graph("flushed", batch()));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "flushed.in", &[json!(6), json!(7), json!(8)]).await;
    eventually("third batch fired", || async {
        h.outputs("flushed.out").len() == 3
    })
    .await;
    let batches: Vec<Value> = h
        .outputs("flushed.out")
        .iter()
        .map(|o| o["inputs"]["a"].clone())
        .collect();
    assert_eq!(batches, [json!([1, 2, 3]), json!([4, 5]), json!([6, 7, 8])]);
}

/// A source whose connection breaks now and then, each time after running a while, is
/// reopened after the shortest backoff each time, not after one grown by every break.
#[tokio::test(start_paused = true)]
async fn a_source_breaking_now_and_then_is_reopened_after_the_shortest_backoff() {
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "blips.in", "weir.blips");
    let opens = source.opens.clone();
    let g = h.spawn(graph(
        "blips",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for k in 0..8 {
        tokio::time::sleep(Duration::from_secs(20)).await;
        fail.notify_one();
        eventually("reopened", || async {
            opens.load(Ordering::SeqCst) == k + 2
        })
        .await;
        publish_all(&h, "blips.in", &[json!(k)]).await;
        // Within the 10 s `eventually` waits: a backoff doubled at each break would
        // be 16 s by the fifth.
        eventually("read after the break", || async {
            h.outputs("blips.out").len() == k + 1
        })
        .await;
    }
}

/// A topic of the harness's broker read as a core NATS subject is: what goes unread is
/// lost, so the reader must never be held back.
struct KeepsNothingUnread(BrokerSource);

#[async_trait]
impl SourceFactory for KeepsNothingUnread {
    fn describe(&self) -> String {
        self.0.describe()
    }

    async fn open(&self, resume_after: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        Ok(Box::new(KeepsNothingUnreadSource(
            self.0.open(resume_after).await?,
        )))
    }
}

struct KeepsNothingUnreadSource(Box<dyn Source>);

#[async_trait]
impl Source for KeepsNothingUnreadSource {
    async fn next(&mut self) -> Result<Message, TransportError> {
        self.0.next().await
    }

    fn ready(&mut self) -> Option<Result<Message, TransportError>> {
        self.0.ready()
    }

    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
        self.0.commit(through).await
    }

    fn keeps_unread(&self) -> bool {
        false
    }
}

/// A source that loses what goes unread (core NATS) is read through a store outage
/// whatever waits for a stored snapshot: holding it back would lose messages.
#[tokio::test(start_paused = true)]
async fn a_source_that_keeps_nothing_unread_is_read_through_a_store_outage() {
    use weir::accumulator::MOST_PENDING_BOUNDARIES;
    let h = Harness::new();
    let mut subscription = Subscription::new("lossy.in", "weir.lossy");
    subscription.assignment = Assignment::All;
    let source = KeepsNothingUnread(BrokerSource {
        broker: Arc::new(h.broker.clone()),
        subscription,
    });
    let g = h.spawn(graph(
        "lossy",
        AccumulatorSpec::passthrough("a").source(Arc::new(source)),
    ));
    g.wait_for_state(ReactorState::Live).await;
    h.store.set_reachable(false);
    let total = MOST_PENDING_BOUNDARIES as u64 + 5_000;
    for n in 0..total {
        h.pipe_bytes("lossy.in", n.to_string().as_bytes()).await;
    }
    eventually("everything read with nothing durable", || async {
        g.stats().boundaries == total
    })
    .await;
    // What it cannot hold it does not keep either: the oldest pending boundaries past
    // the bound are given up, so the list stops growing.
    let pending = g.stats().pending_boundaries;
    assert!(
        pending <= MOST_PENDING_BOUNDARIES as u64,
        "{pending} boundaries pending past the bound"
    );
    h.store.set_reachable(true);
    eventually("every input fired", || async { g.stats().outputs == total }).await;
    eventually("nothing left pending", || async {
        g.stats().pending_boundaries == 0
    })
    .await;
}

/// A source that breaks often, but delivers something new between breaks, is reopened
/// after the shortest backoff each time rather than one grown by every break.
#[tokio::test(start_paused = true)]
async fn a_source_breaking_often_between_new_messages_is_reopened_after_the_shortest_backoff() {
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "choppy.in", "weir.choppy");
    let opens = source.opens.clone();
    let g = h.spawn(graph(
        "choppy",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for k in 0..8 {
        publish_all(&h, "choppy.in", &[json!(k)]).await;
        eventually("read before the break", || async {
            h.outputs("choppy.out").len() == k + 1
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        fail.notify_one();
        // Within the 10 s `eventually` waits: a backoff doubled at each break would
        // be 16 s by the fifth.
        eventually("reopened", || async {
            opens.load(Ordering::SeqCst) == k + 2
        })
        .await;
    }
}

/// What a reopened source re-reads from an older checkpoint is no progress: a source
/// that breaks again and again with nothing new between waits longer each time.
#[tokio::test(start_paused = true)]
async fn a_source_breaking_again_with_nothing_new_waits_longer_each_time() {
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "stuck.in", "weir.stuck");
    let opens = source.opens.clone();
    // Nothing is durable, so nothing is checkpointed: each reopening reads the same
    // messages again.
    let g = h.spawn(graph_snapshotting_on_command(
        "stuck",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "stuck.in", &[json!(1), json!(2), json!(3)]).await;
    eventually("read", || async { h.outputs("stuck.out").len() == 3 }).await;
    let mut waits = Vec::new();
    for k in 0..5 {
        settle().await;
        let broke = tokio::time::Instant::now();
        fail.notify_one();
        while opens.load(Ordering::SeqCst) < k + 2 {
            assert!(broke.elapsed() < Duration::from_secs(120), "never reopened");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        waits.push(broke.elapsed().as_secs());
    }
    assert!(waits[4] >= 8, "backoffs {waits:?} did not grow");
}

/// A source's outages set its own backoff alone: after a run of them, a store outage
/// that stops the graph's reactor from restoring is retried after the shortest backoff.
#[tokio::test(start_paused = true)]
async fn a_flaky_source_does_not_lengthen_the_reactors_backoff() {
    use weir::supervisor::GraphStatus;
    let h = Harness::new();
    let (source, fail) = Breakable::new(&h, "flaky.in", "weir.flaky");
    let opens = source.opens.clone();
    let g = h.spawn(graph(
        "flaky",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    // Each after the source ran a while (its own backoff starts over), each within a
    // minute of the last (the graph's would not).
    for k in 0..6 {
        tokio::time::sleep(Duration::from_secs(15)).await;
        fail.notify_one();
        eventually("reopened", || async {
            opens.load(Ordering::SeqCst) == k + 2
        })
        .await;
    }
    h.store.set_reachable(false);
    g.restart();
    let restarting = g.wait_for_status(|s| matches!(s, GraphStatus::Restarting { .. }));
    tokio::time::timeout(Duration::from_secs(30), restarting)
        .await
        .expect("the reactor cannot restore its cache");
    h.store.set_reachable(true);
    // Within the 10 s `eventually` waits: six outages counted for the graph would
    // make it a minute.
    eventually("running again", || async {
        matches!(g.status(), GraphStatus::Running) && g.state() == ReactorState::Live
    })
    .await;
}

/// Through a store outage nothing becomes durable: the source is read up to a bound of
/// boundaries awaiting it, not for as long as the broker delivers, and once the store
/// answers again the rest flows and every position is committed.
#[tokio::test(start_paused = true)]
async fn a_store_outage_holds_the_reader_at_its_bound_and_loses_nothing() {
    use weir::accumulator::MOST_PENDING_BOUNDARIES;
    let h = Harness::new();
    let g = h.spawn(graph(
        "outage",
        AccumulatorSpec::passthrough("a").topic("outage.in"),
    ));
    g.wait_for_state(ReactorState::Live).await;
    h.store.set_reachable(false);
    let total = MOST_PENDING_BOUNDARIES as u64 + 5_000;
    for n in 0..total {
        h.pipe_bytes("outage.in", n.to_string().as_bytes()).await;
    }
    eventually("read up to the bound", || async {
        g.stats().boundaries >= MOST_PENDING_BOUNDARIES as u64
    })
    .await;
    h.advance(Duration::from_secs(5)).await;
    let read = g.stats().boundaries;
    assert!(read < total, "{read} of {total} read with nothing durable");
    h.store.set_reachable(true);
    eventually("every input fired", || async { g.stats().outputs == total }).await;
    eventually("every position committed", || async {
        h.broker.committed("outage.in", "weir.outage") == vec![total as i64]
    })
    .await;
    let fired: BTreeSet<String> = h
        .outputs("outage.out")
        .iter()
        .map(|o| o["inputs"]["a"].to_string())
        .collect();
    assert_eq!(fired.len() as u64, total);
}

#[tokio::test(start_paused = true)]
async fn a_push_only_batch_keeps_what_it_holds_across_a_restart() {
    let h = Harness::new();
    let batch = || AccumulatorSpec::batch("a", 4, Duration::ZERO);
    let g = h.spawn(graph("held", batch()));
    g.wait_for_state(ReactorState::Live).await;
    for v in [1, 2, 3] {
        g.push("a", json!(v)).await.unwrap();
    }
    eventually("held events checkpointed", || async {
        stored_state(&h, "held").await == Some(json!([1, 2, 3]))
    })
    .await;
    assert!(h.outputs("held.out").is_empty(), "the batch is not full");
    let h = h.restart().await;
    let g = h.spawn(graph("held", batch()));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(4)).await.unwrap();
    eventually("full batch fired", || async {
        h.outputs("held.out").len() == 1
    })
    .await;
    assert_eq!(h.outputs("held.out")[0]["inputs"]["a"], json!([1, 2, 3, 4]));
}

/// Pushes the accumulator handed over while the reactor was busy firing are not lost
/// when the graph stops before the reactor takes them in: the last snapshot holds them,
/// and the next run fires them.
#[tokio::test(start_paused = true)]
async fn pushes_waiting_for_a_busy_reactor_at_a_stop_fire_after_the_restart() {
    let slow_echo = || {
        GraphBuilder::new("busy")
            .reactor(ReactorConfig {
                criteria: Criteria::WhenAny,
                strategy: Strategy::Sequential,
                ..ReactorConfig::default()
            })
            .accumulator(AccumulatorSpec::passthrough("a"))
            .node("slow", ["a"], |ctx: weir::NodeContext| async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let a: Value = ctx.get("a")?.unwrap_or_default();
                Ok(Some(json!({ "a": a })))
            })
            .output("slow", "busy.out")
            .build()
            .expect("valid graph")
    };
    let h = Harness::new();
    let g = h.spawn(slow_echo());
    g.wait_for_state(ReactorState::Live).await;
    let pushed: Vec<Value> = (0..20).map(|n| json!(n)).collect();
    g.push("a", pushed[0].clone()).await.unwrap();
    // The first fire is under way; the rest wait for the reactor.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for v in &pushed[1..] {
        g.push("a", v.clone()).await.unwrap();
    }
    settle().await;
    let h = h.restart().await;
    let g = h.spawn(slow_echo());
    g.wait_for_state(ReactorState::Live).await;
    eventually("every push fired", || async {
        let fired: BTreeSet<String> = h
            .outputs("busy.out")
            .iter()
            .map(|o| o["a"].to_string())
            .collect();
        fired == expected(&pushed)
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_push_only_stateful_accumulator_keeps_its_state_across_a_restart() {
    let h = Harness::new();
    let sum = || {
        AccumulatorSpec::stateful("a", json!(0), |state, event| {
            let total = state.as_i64().unwrap_or(0) + event.as_i64().unwrap_or(0);
            *state = json!(total);
            Some(json!(total))
        })
    };
    let g = h.spawn(graph("total", sum()));
    g.wait_for_state(ReactorState::Live).await;
    for v in [1, 2, 3] {
        g.push("a", json!(v)).await.unwrap();
    }
    eventually("three fires", || async {
        h.outputs("total.out").len() == 3
    })
    .await;
    eventually("state checkpointed", || async {
        stored_state(&h, "total").await == Some(json!(6))
    })
    .await;
    let h = h.restart().await;
    let g = h.spawn(graph("total", sum()));
    g.wait_for_state(ReactorState::Live).await;
    g.push("a", json!(4)).await.unwrap();
    eventually("fire after restart", || async {
        h.outputs("total.out").len() == 4
    })
    .await;
    assert_eq!(h.outputs("total.out")[3]["inputs"]["a"], json!(10));
}

/// A stateful accumulator under a steady stream always has boundaries waiting for a
/// stored snapshot when one is stored, yet its state is checkpointed as it goes, with
/// exactly the positions folded into it: a crash replays from there, not from before
/// the stream began.
#[tokio::test(start_paused = true)]
async fn a_stateful_accumulator_under_a_steady_stream_checkpoints_as_it_goes() {
    let h = Harness::new();
    // Each snapshot write outlasts the gap between two messages.
    h.store.set_cache_write_latency(Duration::from_millis(50));
    let g = h.spawn(graph("stream", sum("a").topic("stream.in")));
    g.wait_for_state(ReactorState::Live).await;
    for _ in 0..200 {
        publish_all(&h, "stream.in", &[json!(1)]).await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The stream has not stopped: the last message's boundary waits for its snapshot.
    use weir::store::prelude::*;
    let checkpoint = h
        .store
        .load_checkpoint("stream", "a")
        .await
        .unwrap()
        .expect("a checkpoint while the stream flows");
    let through = checkpoint
        .positions
        .iter()
        .find(|p| p.partition == 0)
        .expect("a position")
        .offset;
    assert!(through > 100, "checkpointed as it went: through {through}");
    assert_eq!(
        checkpoint.state,
        Some(json!(through + 1)),
        "the state holds exactly the messages up to its position"
    );
}

#[tokio::test(start_paused = true)]
async fn state_left_by_pushes_is_stored_without_waiting_out_the_checkpoint_interval() {
    let h = Harness::new();
    // It also reads a topic, whose checkpoints are spaced (an hour apart here); pushes
    // are never replayed, so what they leave in the state must not wait with them.
    let sum = AccumulatorSpec::stateful("a", json!(0), |state, event| {
        let total = state.as_i64().unwrap_or(0) + event.as_i64().unwrap_or(0);
        *state = json!(total);
        Some(json!(total))
    })
    .topic("spaced.in");
    let g = h.spawn(graph_spacing_checkpoints(
        "spaced",
        sum,
        Duration::from_secs(3600),
    ));
    g.wait_for_state(ReactorState::Live).await;
    for v in [1, 2, 3] {
        g.push("a", json!(v)).await.unwrap();
        settle().await;
    }
    eventually(
        "the pushed state stored within the eventually limit",
        || async { stored_state(&h, "spaced").await == Some(json!(6)) },
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_stop_stores_the_last_topic_checkpoint_however_far_apart_checkpoints_are() {
    let h = Harness::new();
    // Checkpoints an hour apart: only the first is written while the graph runs.
    let declare = || {
        graph_spacing_checkpoints(
            "stopped",
            AccumulatorSpec::passthrough("a").topic("stopped.in"),
            Duration::from_secs(3600),
        )
    };
    let group = declare().source_group(0);
    let g = h.spawn(declare());
    g.wait_for_state(ReactorState::Live).await;
    let values: Vec<Value> = (0..5).map(|i| json!(i)).collect();
    for v in &values {
        publish_all(&h, "stopped.in", std::slice::from_ref(v)).await;
        settle().await;
    }
    eventually("five fires", || async {
        h.outputs("stopped.out").len() == 5
    })
    .await;
    assert_eq!(
        h.broker.committed("stopped.in", &group),
        vec![1],
        "while running, only the first checkpoint was written"
    );
    let h = h.restart().await;
    assert_eq!(
        h.broker.committed("stopped.in", &group),
        vec![5],
        "the stop committed every fired event"
    );
    let g = h.spawn(declare());
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "stopped.in", &[json!(5)]).await;
    eventually("the new event fired", || async {
        h.outputs("stopped.out").len() == 6
    })
    .await;
    assert_eq!(g.stats().duplicates, 0, "nothing was read again");
}

#[tokio::test(start_paused = true)]
async fn a_polling_source_resumes_from_its_position() {
    let h = Harness::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let poll = |calls: Arc<AtomicUsize>| {
        AccumulatorSpec::polling("a", Duration::from_secs(1), move || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move { Some(json!(n)) }
        })
    };
    let g = h.spawn(graph("poll", poll(calls.clone())));
    g.wait_for_state(ReactorState::Live).await;
    eventually("five polls fired", || async {
        h.outputs("poll.out").len() >= 5
    })
    .await;
    let h = h.restart().await;
    let fired = h.outputs("poll.out").len();
    let g = h.spawn(graph("poll", poll(calls.clone())));
    g.wait_for_state(ReactorState::Live).await;
    // The first poll after the restart comes at once and is a new value: it fires.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.outputs("poll.out").len(), fired + 1);
}

/// A poll skips values equal to the one before, across a restart too: the value it
/// last emitted is its checkpointed state.
#[tokio::test(start_paused = true)]
async fn a_polled_value_unchanged_across_a_restart_does_not_fire_again() {
    let h = Harness::new();
    let value = Arc::new(AtomicUsize::new(0));
    let poll = |value: Arc<AtomicUsize>| {
        AccumulatorSpec::polling("a", Duration::from_secs(1), move || {
            let v = value.load(Ordering::SeqCst);
            async move { Some(json!(v)) }
        })
    };
    let g = h.spawn(graph("same", poll(value.clone())));
    g.wait_for_state(ReactorState::Live).await;
    eventually("the first value fired", || async {
        h.outputs("same.out").len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let h = h.restart().await;
    let g = h.spawn(graph("same", poll(value.clone())));
    g.wait_for_state(ReactorState::Live).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        h.outputs("same.out").len(),
        1,
        "the unchanged value fired again"
    );
    value.store(1, Ordering::SeqCst);
    eventually("the changed value fired", || async {
        h.outputs("same.out").len() == 2
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_fast_poll_resumes_from_its_position_whatever_the_checkpoint_interval() {
    let h = Harness::new();
    let calls = Arc::new(AtomicUsize::new(0));
    // A poll numbers on from its checkpoint: were its checkpoints spaced out like a
    // topic's, the cache stored at the stop would be ahead of them, and the polls after
    // a restart would be taken for repeats and dropped.
    let declare = |calls: Arc<AtomicUsize>| {
        let poll = AccumulatorSpec::polling("a", Duration::from_millis(10), move || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move { Some(json!(n)) }
        });
        graph_spacing_checkpoints("fastpoll", poll, Duration::from_secs(3600))
    };
    let g = h.spawn(declare(calls.clone()));
    g.wait_for_state(ReactorState::Live).await;
    eventually("twenty polls fired", || async {
        h.outputs("fastpoll.out").len() >= 20
    })
    .await;
    let h = h.restart().await;
    let fired = h.outputs("fastpoll.out").len();
    let next = calls.load(Ordering::SeqCst);
    let g = h.spawn(declare(calls.clone()));
    g.wait_for_state(ReactorState::Live).await;
    eventually("a fire after the restart", || async {
        h.outputs("fastpoll.out").len() > fired
    })
    .await;
    assert_eq!(
        h.outputs("fastpoll.out")[fired]["inputs"]["a"],
        json!(next),
        "the first poll after the restart fired"
    );
}

#[tokio::test(start_paused = true)]
async fn partitions_added_while_a_graph_runs_are_read_and_survive_a_restart() {
    let h = Harness::partitioned(2);
    let (source, _) = Breakable::new(&h, "grow.in", "weir.grow");
    let g = h.spawn(graph(
        "grow",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "grow.in", &[json!("g0"), json!("g1")]).await;
    eventually("first fires", || async { h.outputs("grow.out").len() == 2 }).await;
    // Unkeyed messages go round-robin, so these land on the new partitions too.
    h.broker.add_partitions("grow.in", 2);
    let before = ["g2", "g3", "g4", "g5"].map(|v| json!(v));
    publish_all(&h, "grow.in", &before).await;
    let mut all = vec![json!("g0"), json!("g1")];
    all.extend(before);
    eventually("inputs on added partitions fired", || async {
        seen_inputs(&h, "grow.out") == expected(&all)
    })
    .await;
    // A node coming back reads all four partitions from its checkpoint.
    let h = h.restart().await;
    let (source, _) = Breakable::new(&h, "grow.in", "weir.grow");
    let g = h.spawn(graph(
        "grow",
        AccumulatorSpec::passthrough("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    let after = ["g6", "g7", "g8", "g9"].map(|v| json!(v));
    publish_all(&h, "grow.in", &after).await;
    all.extend(after);
    eventually("every input fired once", || async {
        seen_inputs(&h, "grow.out") == expected(&all)
    })
    .await;
    assert_eq!(
        h.outputs("grow.out").len(),
        all.len(),
        "nothing fired twice after the restart"
    );
}

/// A source that, when told, delivers again every message it delivered so far before
/// going on, as JetStream does with what is not acknowledged within its ack wait.
struct Redelivering {
    inner: BrokerSource,
    redeliver: Arc<Notify>,
}

#[async_trait]
impl SourceFactory for Redelivering {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn open(&self, resume_after: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        Ok(Box::new(RedeliveringSource {
            inner: self.inner.open(resume_after).await?,
            redeliver: self.redeliver.clone(),
            delivered: Vec::new(),
            again: std::collections::VecDeque::new(),
        }))
    }
}

struct RedeliveringSource {
    inner: Box<dyn Source>,
    redeliver: Arc<Notify>,
    delivered: Vec<Message>,
    again: std::collections::VecDeque<Message>,
}

#[async_trait]
impl Source for RedeliveringSource {
    async fn next(&mut self) -> Result<Message, TransportError> {
        loop {
            if let Some(message) = self.again.pop_front() {
                return Ok(message);
            }
            tokio::select! {
                biased;
                _ = self.redeliver.notified() => self.again.extend(self.delivered.iter().cloned()),
                message = self.inner.next() => {
                    let message = message?;
                    self.delivered.push(message.clone());
                    return Ok(message);
                }
            }
        }
    }

    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
        self.inner.commit(through).await
    }
}

fn running_sum(name: &str) -> AccumulatorSpec {
    AccumulatorSpec::stateful(name, json!(0), |state, event| {
        let total = state.as_i64().unwrap_or(0) + event.as_i64().unwrap_or(0);
        *state = json!(total);
        Some(json!(total))
    })
}

#[tokio::test(start_paused = true)]
async fn messages_delivered_again_before_their_commit_are_folded_into_a_state_once() {
    let h = Harness::new();
    let mut subscription = Subscription::new("again.in", "weir.again");
    subscription.assignment = Assignment::All;
    let redeliver = Arc::new(Notify::new());
    let source = Arc::new(Redelivering {
        inner: BrokerSource {
            broker: Arc::new(h.broker.clone()),
            subscription,
        },
        redeliver: redeliver.clone(),
    });
    // Nothing is durable, so nothing committed, until a snapshot on command.
    let g = h.spawn(graph_snapshotting_on_command(
        "again",
        running_sum("a").source(source),
    ));
    g.wait_for_state(ReactorState::Live).await;
    publish_all(&h, "again.in", &[json!(1), json!(2), json!(3)]).await;
    eventually("three fires", || async {
        h.outputs("again.out").len() == 3
    })
    .await;
    redeliver.notify_one();
    publish_all(&h, "again.in", &[json!(4)]).await;
    eventually("the fourth fire", || async {
        h.outputs("again.out").len() >= 4
    })
    .await;
    settle().await;
    let sums: Vec<Value> = h
        .outputs("again.out")
        .iter()
        .map(|o| o["inputs"]["a"].clone())
        .collect();
    assert_eq!(sums, [json!(1), json!(3), json!(6), json!(10)]);
}

//! What a graph cannot turn into output is dead-lettered, never dropped: fires whose graph
//! keeps failing, and outputs no retry can publish. On the embedded backends.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{eventually, Harness};
use serde_json::{json, Value};
use weir::graph::{NodeContext, NodeError};
use weir::transport::{Outbound, Position, Sink, TransportError};
use weir::{AccumulatorSpec, Criteria, GraphBuilder, ReactorConfig, ReactorState, Strategy};

fn reactor() -> ReactorConfig {
    ReactorConfig {
        criteria: Criteria::WhenAny,
        strategy: Strategy::Sequential,
        ..ReactorConfig::default()
    }
}

/// A graph reading `<name>.in` whose node fails `failures` times for each input equal
/// to "bad" (every time when `None`), and otherwise emits the input.
fn failing_graph(
    name: &str,
    failures: Option<usize>,
) -> (weir::GraphDeclaration, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let decl = GraphBuilder::new(name)
        .reactor(reactor())
        .accumulator(AccumulatorSpec::passthrough("a").topic(format!("{name}.in")))
        .node("n", ["a"], move |ctx: NodeContext| {
            let counter = counter.clone();
            async move {
                let value = ctx.source("a").cloned().unwrap_or(Value::Null);
                if value == json!("bad") {
                    let run = counter.fetch_add(1, Ordering::SeqCst);
                    if failures.is_none_or(|f| run < f) {
                        return Err(NodeError::new("cannot price a bad quote"));
                    }
                }
                Ok(Some(value))
            }
        })
        .output("n", format!("{name}.out"))
        .build()
        .expect("valid graph");
    (decl, runs)
}

#[tokio::test(start_paused = true)]
async fn a_failing_fire_is_retried_with_backoff() {
    let h = Harness::new();
    let (decl, runs) = failing_graph("retry", Some(2));
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    h.pipe_bytes("retry.in", json!("bad").to_string().as_bytes())
        .await;
    eventually("fired on the third run", || async {
        h.outputs("retry.out") == vec![json!("bad")]
    })
    .await;
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert!(h.broker.messages("retry.out.dlq").is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_fire_that_keeps_failing_is_dead_lettered_then_committed() {
    let h = Harness::new();
    let (decl, runs) = failing_graph("fails", None);
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    for v in ["good", "bad", "later"] {
        h.pipe_bytes("fails.in", json!(v).to_string().as_bytes())
            .await;
    }
    eventually("later events still fire", || async {
        h.outputs("fails.out") == vec![json!("good"), json!("later")]
    })
    .await;
    // The first run and the three retries of the default.
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    let dead = h.broker.messages("fails.out.dlq");
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].header("weir-error"),
        Some("node n failed: cannot price a bad quote")
    );
    assert_eq!(dead[0].header("weir-graph"), Some("fails"));
    let body: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(body["graph"], json!("fails"));
    assert_eq!(body["fire"], json!(2));
    assert_eq!(body["inputs"]["a"], json!("bad"));
    assert_eq!(
        body["positions"]["a"],
        json!([{"partition": 0, "offset": 1}])
    );
    eventually("every input committed", || async {
        h.broker.committed("fails.in", "weir.fails") == vec![3]
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn an_event_nested_deeper_than_weir_keeps_goes_to_the_dead_letter_topic() {
    let h = Harness::new();
    let (decl, _) = failing_graph("deep", Some(0));
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    // serde_json reads up to 128 levels; weir's stores wrap an event in a few of their
    // own and read it back the same way, so it takes no more than 100.
    let deep = format!("{}1{}", "[".repeat(120), "]".repeat(120));
    h.pipe_bytes("deep.in", deep.as_bytes()).await;
    h.pipe_bytes("deep.in", json!("after").to_string().as_bytes())
        .await;
    eventually("the next event fires", || async {
        h.outputs("deep.out") == vec![json!("after")]
    })
    .await;
    let dead = h.broker.messages("deep.in.dlq");
    assert_eq!(dead.len(), 1);
    assert_eq!(&dead[0].payload[..], deep.as_bytes());
    assert!(
        dead[0]
            .header("weir-error")
            .is_some_and(|e| e.contains("nested deeper than 100 levels")),
        "{:?}",
        dead[0].header("weir-error")
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_fires_inputs_stay_stored_until_its_dead_letter_is_acknowledged() {
    let h = Harness::new();
    let down = Arc::new(AtomicBool::new(true));
    let refused = Arc::new(AtomicUsize::new(0));
    let sink = Arc::new(common::DeadLettersDown {
        inner: Arc::new(h.broker.clone()),
        down: down.clone(),
        refused: refused.clone(),
        for_good: false,
    });
    let decl = GraphBuilder::new("waits")
        .reactor(reactor())
        .accumulator(AccumulatorSpec::passthrough("a").topic("waits.in"))
        .node("n", ["a"], |ctx: NodeContext| async move {
            match ctx.source("a").cloned().unwrap_or(Value::Null) {
                bad if bad == json!("bad") => Err(NodeError::new("cannot price a bad quote")),
                value => Ok(Some(value)),
            }
        })
        .output_to("n", "waits.out", sink)
        .build()
        .unwrap();
    let group = decl.source_group(0);
    let key = decl.key();
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    for v in ["good", "bad", "later"] {
        h.pipe_bytes("waits.in", json!(v).to_string().as_bytes())
            .await;
    }
    eventually("the dead letter tried", || async {
        refused.load(Ordering::SeqCst) > 0
    })
    .await;
    // The graph restarts with backoff while its dead letter cannot go out.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(
        refused.load(Ordering::SeqCst) > 1,
        "the dead letter retried"
    );
    assert_eq!(
        h.outputs("waits.out"),
        vec![json!("good")],
        "what was fired and acknowledged before a restart is not fired again"
    );
    assert!(h.broker.messages("waits.out.dlq").is_empty());
    // Each failing run stored its cache: the failed fire's input requeued under its
    // number, the good one's fire counted. What that holds may be committed.
    use weir::store::prelude::*;
    let stored = h.store.load_cache(&key).await.unwrap().unwrap();
    assert_eq!(stored.fires, 2);
    assert_eq!(
        stored.refires.iter().map(|r| r.fire).collect::<Vec<_>>(),
        [2]
    );
    down.store(false, Ordering::SeqCst);
    eventually("every input committed", || async {
        h.broker.committed("waits.in", &group) == vec![3]
    })
    .await;
    eventually("the dead letter out", || async {
        h.broker.messages("waits.out.dlq").len() == 1
    })
    .await;
    let dead = h.broker.messages("waits.out.dlq");
    let body: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(body["inputs"]["a"], json!("bad"));
    assert_eq!(body["fire"], json!(2));
    eventually("the later input out", || async {
        h.outputs("waits.out").len() == 2
    })
    .await;
    assert_eq!(h.outputs("waits.out"), vec![json!("good"), json!("later")]);
    assert_eq!(h.broker.messages("waits.out.dlq").len(), 1);
}

/// Takes what the memory broker takes, except messages larger than `limit` bytes, which
/// it refuses as a broker does: for good.
struct SizeLimited {
    inner: Arc<dyn Sink>,
    limit: usize,
}

#[async_trait]
impl Sink for SizeLimited {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
        if message.payload.len() > self.limit {
            return Err(TransportError::Publish {
                topic: message.topic.to_string(),
                source: "message too large".into(),
                retryable: false,
            });
        }
        self.inner.publish(message).await
    }
}

#[tokio::test(start_paused = true)]
async fn an_output_too_large_to_publish_is_dead_lettered_and_the_graph_goes_on() {
    let h = Harness::new();
    let sink = Arc::new(SizeLimited {
        inner: Arc::new(h.broker.clone()),
        limit: 1024,
    });
    let decl = GraphBuilder::new("large")
        .reactor(reactor())
        .accumulator(AccumulatorSpec::passthrough("a").topic("large.in"))
        .node("n", ["a"], |ctx: NodeContext| async move {
            let n = ctx.source("a").and_then(Value::as_u64).unwrap_or(0) as usize;
            Ok(Some(json!("x".repeat(n))))
        })
        .output_to("n", "large.out", sink)
        .build()
        .unwrap();
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    for n in [10, 5000, 20] {
        h.pipe_bytes("large.in", json!(n).to_string().as_bytes())
            .await;
    }
    eventually("the small ones fire", || async {
        h.outputs("large.out").len() == 2
    })
    .await;
    let dead = h.broker.messages("large.out.dlq");
    assert_eq!(dead.len(), 1);
    assert!(dead[0]
        .header("weir-error")
        .is_some_and(|e| e.contains("message too large")));
    let body: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(body["graph"], json!("large"));
    assert_eq!(body["fire"], json!(2));
    assert_eq!(body["topic"], json!("large.out"));
    assert_eq!(
        body["positions"]["a"],
        json!([{"partition": 0, "offset": 1}])
    );
    assert!(
        dead[0].payload.len() < 1024,
        "the payload itself is not in it"
    );
    eventually("every input committed", || async {
        h.broker.committed("large.in", "weir.large") == vec![3]
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        h.store_recoveries().await.is_empty(),
        "no respawn for an unpublishable output"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_fire_whose_dead_letter_is_too_large_is_recorded_under_that_letter() {
    // A fire that keeps failing is dead-lettered with its inputs; when those make the
    // letter larger than the broker takes, a record of the letter goes to the letter's
    // own dead-letter topic, naming that topic, and the graph goes on.
    let h = Harness::new();
    let sink = Arc::new(SizeLimited {
        inner: Arc::new(h.broker.clone()),
        limit: 1024,
    });
    let decl = GraphBuilder::new("bulky")
        .reactor(reactor())
        .accumulator(AccumulatorSpec::passthrough("a").topic("bulky.in"))
        .node("n", ["a"], |ctx: NodeContext| async move {
            match ctx.source("a") {
                Some(Value::String(text)) if text.len() > 100 => {
                    Err(NodeError::new("cannot price a bulky quote"))
                }
                other => Ok(other.cloned()),
            }
        })
        .output_to("n", "bulky.out", sink)
        .build()
        .unwrap();
    let g = h.spawn(decl);
    g.wait_for_state(ReactorState::Live).await;
    for value in [json!("small"), json!("x".repeat(2000)), json!("later")] {
        h.pipe_bytes("bulky.in", value.to_string().as_bytes()).await;
    }
    eventually("the others fire", || async {
        h.outputs("bulky.out") == vec![json!("small"), json!("later")]
    })
    .await;
    assert!(h.broker.messages("bulky.out.dlq").is_empty());
    let records = h.broker.messages("bulky.out.dlq.dlq");
    assert_eq!(records.len(), 1);
    let body: Value = serde_json::from_slice(&records[0].payload).unwrap();
    assert_eq!(body["topic"], json!("bulky.out.dlq"));
    assert_eq!(body["fire"], json!(2));
    assert!(body["error"]
        .as_str()
        .is_some_and(|e| e.contains("message too large")));
    eventually("every input committed", || async {
        h.broker.committed("bulky.in", "weir.bulky") == vec![3]
    })
    .await;
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

//! A keyed graph against the same graph unkeyed, in one process on the memory broker
//! and store, in one run: events per second, and memory per key.
//!
//! `cargo bench --bench keyed`. Environment: `WEIR_BENCH_EVENTS` (default 500000),
//! `WEIR_BENCH_KEYS` (default 100000), `WEIR_BENCH_RUNS` (default 3). The last line sums
//! the runs up: the lowest, median, mean and highest keyed / unkeyed ratio with every
//! key resident.
//!
//! Both graphs read one topic (6 partitions), pre-filled with the same JSON events
//! `{"user": "u<n mod keys>", "px": …}`, with `snapshot`, `sequential` and `when_any`:
//! one fire and one output per event. The topic holds first one event per user, the
//! keys' first pass, then `WEIR_BENCH_EVENTS` more. Two rates per graph, counted by its
//! outputs (each graph commits on a rhythm of its own, so commits would blur where a
//! phase ends): the first pass, from the graph's start until it has output as many
//! events as there are keys, over the outputs by then; and the rest, with every key
//! resident (as on a node that has run a while), from then until its last output. The
//! unkeyed graph runs under the supervisor, one instance; the
//! keyed one keeps a state per user, one node owning all partitions. Outputs are built
//! and handed to a sink that acknowledges and drops them, as a broker in another process
//! would take them: kept in the memory broker's log, they would grow both runs' memory by
//! about a kilobyte per event and measure the log rather than the graphs. Memory per key
//! is the growth of the resident set over the keyed run, divided by the keys: each key's
//! input cache in memory, and its stored copy in the memory store.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use weir::graph::{FunctionRegistry, KeySource, Keying};
use weir::keyed::KeyedGraphStore;
use weir::store::memory::MemoryStore;
use weir::transport::memory::MemoryBroker;
use weir::transport::{
    Broker, Outbound, PartitionedTopic, Position, Sink, Source, Subscription, TransportError,
};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, GraphDeclaration, Runtime, Strategy,
    SupervisionPolicy, Supervisor,
};

const PARTITIONS: u32 = 6;
/// The graphs' output topics end so; the events' topic does not.
const OUTPUT_SUFFIX: &str = ".out";

/// The memory broker, but for outputs: those are acknowledged and dropped.
#[derive(Clone)]
struct OutputsDropped {
    memory: MemoryBroker,
    dropped: Arc<AtomicI64>,
}

impl OutputsDropped {
    fn new(memory: MemoryBroker) -> Self {
        Self {
            memory,
            dropped: Arc::default(),
        }
    }

    /// The outputs taken so far.
    fn outputs(&self) -> Arc<AtomicI64> {
        self.dropped.clone()
    }
}

#[async_trait]
impl Sink for OutputsDropped {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
        if message.topic.ends_with(OUTPUT_SUFFIX) {
            let offset = self.dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(Position {
                partition: 0,
                offset,
            });
        }
        self.memory.publish(message).await
    }
}

#[async_trait]
impl Broker for OutputsDropped {
    fn kind(&self) -> &'static str {
        self.memory.kind()
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Source>, TransportError> {
        self.memory.subscribe(subscription).await
    }

    fn sink(&self) -> Arc<dyn Sink> {
        Arc::new(self.clone())
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<PartitionedTopic, TransportError> {
        self.memory.partitioned(topic, partitions).await
    }

    async fn ping(&self) -> Result<(), TransportError> {
        self.memory.ping().await
    }
}

/// The allocator of the `weir` binary, so both graphs allocate as they do in production.
#[global_allocator]
static ALLOCATOR: weir::allocator::Allocator = weir::allocator::Allocator;

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn declaration(name: &str, topic: &str, keys: Option<usize>) -> GraphDeclaration {
    let mut builder = GraphBuilder::new(name)
        .criteria(Criteria::WhenAny)
        .strategy(Strategy::Sequential)
        .accumulator(AccumulatorSpec::passthrough("a").topic(topic));
    if let Some(keys) = keys {
        let mut keying = Keying::new(KeySource::Pointer("/user".into()));
        keying.partitions = PARTITIONS;
        keying.max_keys_in_memory = keys + 1;
        builder = builder.keyed(keying);
    }
    builder
        .function("snapshot", &FunctionRegistry::default(), "snapshot")
        .output("snapshot", format!("{name}{OUTPUT_SUFFIX}"))
        .build()
        .expect("graph")
}

/// Where the events of a filled topic end, per partition.
struct Filled {
    /// The last offset of the keys' first pass.
    first_pass: Vec<i64>,
    /// The last offset.
    last: Vec<i64>,
}

/// Fills `topic` with one event per user of `keys`, then `events` more over them.
async fn fill(broker: &MemoryBroker, topic: &str, events: usize, keys: usize) -> Filled {
    let partitioned = broker.partitioned(topic, PARTITIONS).await.expect("topic");
    let sink = broker.sink();
    let mut last = vec![-1i64; partitioned.partitions as usize];
    let mut first_pass = last.clone();
    for n in 0..keys + events {
        if n == keys {
            first_pass = last.clone();
        }
        let user = format!("u{}", n % keys);
        let event = json!({"user": user, "px": 100.0 + (n % 100) as f64 / 100.0, "n": n});
        let at = sink
            .publish(partitioned.outbound(&user, event.to_string()))
            .await
            .expect("publish");
        let slot = &mut last[at.partition as usize];
        *slot = (*slot).max(at.offset);
    }
    Filled { first_pass, last }
}

/// A graph's rates over a filled topic, in events per second.
struct Rates {
    first_pass: f64,
    resident: f64,
}

/// Times the keys' first pass and the rest by the graph's `outputs` (one per event),
/// from `started`; then waits for `group` to commit the last event, so the graph stops
/// with nothing in flight.
async fn rates(
    broker: &MemoryBroker,
    (topic, group): (&str, &str),
    filled: &Filled,
    outputs: &AtomicI64,
    started: Instant,
) -> Rates {
    let events_in = |last: &[i64]| last.iter().map(|l| l + 1).sum::<i64>();
    let total = events_in(&filled.last);
    let out = || outputs.load(Ordering::Relaxed);
    output_at_least(events_in(&filled.first_pass), out).await;
    let resident_from = Instant::now();
    let first = out();
    let first_pass = first as f64 / started.elapsed().as_secs_f64();
    output_at_least(total, out).await;
    let resident = (total - first) as f64 / resident_from.elapsed().as_secs_f64();
    drained(broker, topic, group, &filled.last).await;
    Rates {
        first_pass,
        resident,
    }
}

/// Waits until `outputs()` reaches `count`, looking every 2 ms: the graphs share this
/// thread, so a closer look would take from them.
async fn output_at_least(count: i64, outputs: impl Fn() -> i64) {
    let deadline = Instant::now() + Duration::from_secs(600);
    while outputs() < count {
        assert!(
            Instant::now() < deadline,
            "stuck at {} outputs of {count}",
            outputs()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits until `group` has committed past every partition's last offset.
async fn drained(broker: &MemoryBroker, topic: &str, group: &str, last: &[i64]) {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let committed = broker.committed(topic, group);
        if committed.iter().zip(last).all(|(c, l)| *c > *l) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "stuck at {committed:?} of {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

async fn unkeyed(run: usize, events: usize, keys: usize) -> Rates {
    let memory = MemoryBroker::new(1);
    let topic = format!("plain{run}.in");
    let filled = fill(&memory, &topic, events, keys).await;
    let sink = OutputsDropped::new(memory.clone());
    let outputs = sink.outputs();
    let runtime = Runtime {
        broker: Arc::new(sink),
        store: Arc::new(MemoryStore::new()),
        node_id: "bench".into(),
    };
    let cancel = CancellationToken::new();
    let supervisor = Supervisor::new(runtime, SupervisionPolicy::default(), cancel.clone());
    let decl = declaration(&format!("plain{run}"), &topic, None);
    let group = format!("weir.{}", decl.key());
    let started = Instant::now();
    supervisor.spawn(decl).expect("spawn");
    let rates = rates(&memory, (&topic, &group), &filled, &outputs, started).await;
    cancel.cancel();
    supervisor.shutdown().await;
    rates
}

async fn keyed(run: usize, events: usize, keys: usize) -> (Rates, f64) {
    let memory = MemoryBroker::new(1);
    let topic = format!("keyed{run}.in");
    let filled = fill(&memory, &topic, events, keys).await;
    let sink = OutputsDropped::new(memory.clone());
    let outputs = sink.outputs();
    let broker: Arc<dyn Broker> = Arc::new(sink);
    let decl = declaration(&format!("keyed{run}"), &topic, Some(keys));
    let group = format!("weir.{}", decl.key());
    let topics = weir::keyed::topics(&decl, broker.as_ref())
        .await
        .expect("topics");
    let store: Arc<dyn KeyedGraphStore> = Arc::new(MemoryStore::new());
    let cancel = CancellationToken::new();
    let before = resident_bytes();
    let started = Instant::now();
    let node = tokio::spawn(weir::keyed::serve(
        decl,
        topics,
        broker,
        store,
        "bench".into(),
        cancel.clone(),
    ));
    let rates = rates(&memory, (&topic, &group), &filled, &outputs, started).await;
    let per_key = resident_bytes().saturating_sub(before) as f64 / keys as f64;
    cancel.cancel();
    let _ = node.await;
    (rates, per_key)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let events = env("WEIR_BENCH_EVENTS", 500_000usize);
    let keys = env("WEIR_BENCH_KEYS", 100_000usize).max(1);
    let runs = env("WEIR_BENCH_RUNS", 3usize).max(1);
    // Keyed / unkeyed with every key resident, per run: the figure the target is set on.
    let mut ratios = Vec::with_capacity(runs);
    for run in 0..runs {
        let plain = unkeyed(run, events, keys).await;
        let (keyed, per_key) = keyed(run, events, keys).await;
        println!(
            "keyed run {run}: {keys} keys, one core: first pass (each key's first event) \
             unkeyed {:.0} events/s, keyed {:.0} events/s = {:.2} x; then {events} events with \
             every key resident: unkeyed {:.0} events/s, keyed {:.0} events/s = {:.2} x \
             unkeyed; resident memory per key {per_key:.0} bytes",
            plain.first_pass,
            keyed.first_pass,
            keyed.first_pass / plain.first_pass,
            plain.resident,
            keyed.resident,
            keyed.resident / plain.resident,
        );
        ratios.push(keyed.resident / plain.resident);
    }
    // The ratio moves from run to run far more than most changes move it: over many
    // runs, the middle and the mean say more than any one run.
    ratios.sort_by(f64::total_cmp);
    let mean = ratios.iter().sum::<f64>() / ratios.len() as f64;
    println!(
        "keyed over {runs} runs, every key resident, keyed / unkeyed: lowest {:.2}, median \
         {:.2}, mean {mean:.2}, highest {:.2}; {} of {runs} runs at 0.7 or more",
        ratios[0],
        ratios[ratios.len() / 2],
        ratios[ratios.len() - 1],
        ratios.iter().filter(|r| **r >= 0.7).count(),
    );
}

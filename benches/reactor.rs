//! In-process path boundary → reactor → fire → sink, on a single-threaded runtime.
//!
//! - `throughput/latest_when_any_3`: events pushed round-robin into three accumulators.
//! - `throughput/sequential_when_all_3`: the same with queues and every-source fires.
//! - `ping_pong`: push one event, wait for the fire that saw it; p50/p99 over 100,000
//!   round trips after 20,000 to warm up are printed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use weir::graph::NodeContext;
use weir::transport::{Outbound, Position, Sink, TransportError};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, GraphHandle, ReactorConfig, ReactorState, Runtime,
    Strategy, SupervisionPolicy, Supervisor,
};

const SOURCES: [&str; 3] = ["a", "b", "c"];

/// The allocator of the `weir` binary, so the path allocates as it does in production.
#[global_allocator]
static ALLOCATOR: weir::allocator::Allocator = weir::allocator::Allocator;

/// Counts outputs and wakes whoever waits for one.
#[derive(Default)]
struct CountingSink {
    published: AtomicU64,
    notify: Notify,
}

#[async_trait]
impl Sink for CountingSink {
    async fn publish(&self, _message: Outbound) -> Result<Position, TransportError> {
        let n = self.published.fetch_add(1, Ordering::Relaxed);
        self.notify.notify_one();
        Ok(Position {
            partition: 0,
            offset: n as i64,
        })
    }
}

struct Pipeline {
    graph: GraphHandle,
    sink: Arc<CountingSink>,
    sockets: Vec<mpsc::Sender<Value>>,
    _supervisor: Supervisor,
}

async fn pipeline(criteria: Criteria, strategy: Strategy) -> Pipeline {
    let sink = Arc::new(CountingSink::default());
    let mut builder = GraphBuilder::new("bench").reactor(ReactorConfig {
        criteria,
        strategy,
        queue_capacity: 4096,
        snapshot_interval: Duration::from_secs(1),
        ..ReactorConfig::default()
    });
    for s in SOURCES {
        builder = builder.accumulator(AccumulatorSpec::passthrough(s));
    }
    let decl = builder
        .node("sum", SOURCES, |ctx: NodeContext| async move {
            let total: i64 = SOURCES
                .iter()
                .filter_map(|s| ctx.source(s).and_then(Value::as_i64))
                .sum();
            Ok(Some(Value::from(total)))
        })
        .output_to("sum", "bench.out", sink.clone())
        .build()
        .expect("bench graph");
    let supervisor = Supervisor::new(
        Runtime::embedded(),
        SupervisionPolicy::default(),
        CancellationToken::new(),
    );
    let graph = supervisor.spawn(decl).expect("spawn");
    graph.wait_for_state(ReactorState::Live).await;
    let sockets = SOURCES.iter().map(|s| graph.socket(s).unwrap()).collect();
    Pipeline {
        graph,
        sink,
        sockets,
        _supervisor: supervisor,
    }
}

/// Pushes `n` events round-robin and waits until the reactor has taken all of them and
/// fired for every one it must.
async fn push_batch(p: &Pipeline, n: u64, strategy: Strategy) {
    let start = p.graph.stats();
    for i in 0..n {
        let socket = &p.sockets[(i % 3) as usize];
        socket.send(json!(i)).await.expect("socket open");
    }
    loop {
        let s = p.graph.stats();
        let cached = s.boundaries - start.boundaries >= n;
        let drained = match strategy {
            Strategy::Latest => true,
            Strategy::Sequential => s.fires - start.fires >= n / 3,
        };
        if cached && drained {
            return;
        }
        tokio::task::yield_now().await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn throughput(c: &mut Criterion) {
    const BATCH: u64 = 30_000;
    let mut group = c.benchmark_group("throughput");
    group.throughput(Throughput::Elements(BATCH));
    group.measurement_time(Duration::from_secs(5));
    for (name, criteria, strategy) in [
        ("latest_when_any_3", Criteria::WhenAny, Strategy::Latest),
        (
            "sequential_when_all_3",
            Criteria::WhenAll,
            Strategy::Sequential,
        ),
    ] {
        let rt = runtime();
        let p = rt.block_on(pipeline(criteria, strategy));
        let before = p.graph.stats();
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| push_batch(&p, BATCH, strategy));
        });
        let after = p.graph.stats();
        // fires/s = the throughput above × this ratio.
        eprintln!(
            "{name}: {:.4} fires per event over {} events",
            (after.fires - before.fires) as f64 / (after.events - before.events) as f64,
            after.events - before.events
        );
    }
    group.finish();
}

/// One event in, one fire out: `notify_one` leaves a permit if the fire beats the wait.
async fn ping(p: &Pipeline) {
    p.sockets[0].send(json!(1)).await.expect("socket open");
    p.sink.notify.notified().await;
}

fn ping_pong(c: &mut Criterion) {
    let rt = runtime();
    let p = rt.block_on(pipeline(Criteria::WhenAny, Strategy::Latest));
    // Percentiles from a fixed run, then criterion's own measurement. The first round
    // trips of a process touch memory the allocator has just mapped: warmed up first, so
    // the percentiles are of the steady state, as criterion's figure is.
    let mut samples = Vec::with_capacity(100_000);
    rt.block_on(async {
        for _ in 0..20_000 {
            ping(&p).await;
        }
        for _ in 0..100_000 {
            let t = Instant::now();
            ping(&p).await;
            samples.push(t.elapsed());
        }
    });
    samples.sort();
    let pct = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize];
    eprintln!(
        "ping_pong: p50 {:?} p99 {:?} p999 {:?} over {} round trips",
        pct(0.50),
        pct(0.99),
        pct(0.999),
        samples.len()
    );
    c.bench_function("ping_pong", |b| b.to_async(&rt).iter(|| ping(&p)));
}

criterion_group!(benches, throughput, ping_pong);
criterion_main!(benches);

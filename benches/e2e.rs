//! End-to-end harness on real brokers: an external producer → weir (accumulator →
//! reactor → `snapshot` → sink) → an external consumer, over Kafka and over NATS
//! JetStream, with Redis as the store. In the same run, a bare client loop (consume →
//! produce, no weir) over the same broker gives the baseline.
//!
//! Then the pre-filled comparison: the input is filled with `WEIR_BENCH_PREFILLED` (default
//! 100000) JSON events of about 60 bytes first, then one process under test drains it
//! while this one reads the output: the raw-client loop (rdkafka and async-nats directly,
//! `e2e_parts/raw.rs`: this bench run again as a child) and `weir run` with the same
//! graph, 4,096 outputs awaiting acknowledgement in both. The rate counts from the first
//! output read to the last, so start-up (connecting, creating consumers) is left out of
//! both.
//!
//! Last, latency at a steady pace against the same raw-client loop: each of the two alone
//! in a process of its own, this one publishing `WEIR_BENCH_PACED_RATE` events a second
//! (default 2000) for `WEIR_BENCH_PACED_SECONDS` (default 5; 0 skips it) and reading the
//! outputs, after a warm-up the process under test has answered.
//!
//! Run `scripts/services` first, then `cargo bench --bench e2e`. Environment:
//! `WEIR_BENCH_EVENTS` (throughput phase, default 20000), `WEIR_BENCH_RATE` and
//! `WEIR_BENCH_SECONDS` (latency phase, default 1000 events/s for 5 s),
//! `WEIR_BENCH_PREFILLED` (0 skips that phase), `WEIR_BENCH_BROKERS` (default
//! `kafka,nats`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesOrdered, StreamExt};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use weir::graph::FunctionRegistry;
use weir::store::redis::RedisStore;
use weir::transport::kafka::{KafkaBroker, KafkaSettings};
use weir::transport::nats::{NatsBroker, NatsSettings};
use weir::transport::{Assignment, Broker, Outbound, Subscription};
use weir::{
    AccumulatorSpec, Criteria, GraphBuilder, ReactorConfig, Runtime, Strategy, SupervisionPolicy,
    Supervisor,
};

#[path = "e2e_parts/raw.rs"]
mod raw;

const WINDOW: usize = 256;
/// Events the paced comparison sends first, unmeasured, until the process under test
/// answers them.
const PACED_WARM_UP: usize = 200;

/// Set in the child running a raw-client loop: `raw-kafka` or `raw-nats`.
const ROLE: &str = "WEIR_BENCH_ROLE";

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn unique(prefix: &str) -> String {
    format!("{prefix}{:010x}", rand::random::<u64>() & 0xff_ffff_ffff)
}

struct Figures {
    events_per_second: f64,
    p50: Duration,
    p99: Duration,
}

async fn broker(kind: &str) -> Arc<dyn Broker> {
    match kind {
        "kafka" => Arc::new(
            KafkaBroker::connect(KafkaSettings {
                brokers: std::env::var("WEIR_TEST_KAFKA")
                    .unwrap_or_else(|_| "127.0.0.1:9092".into()),
                options: BTreeMap::new(),
                ..KafkaSettings::default()
            })
            .expect("kafka"),
        ),
        _ => Arc::new(
            NatsBroker::connect(NatsSettings {
                url: std::env::var("WEIR_TEST_NATS")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
                jetstream: true,
                ..Default::default()
            })
            .await
            .expect("nats"),
        ),
    }
}

/// The producer's timestamp inside an output: weir wraps the event in a snapshot record,
/// the bare loop forwards it as is.
fn sent_at(payload: &[u8], run: &str) -> Option<i64> {
    let v: Value = serde_json::from_slice(payload).ok()?;
    let event = if v["inputs"].is_object() {
        &v["inputs"]["a"]
    } else {
        &v
    };
    if event["run"].as_str() != Some(run) {
        return None;
    }
    event["sent_us"].as_i64()
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}

/// Publishes `events` (paced at `rate` per second, or as fast as acknowledgements
/// allow) and reads them back from `output`: throughput and latency.
async fn measure(
    broker: &Arc<dyn Broker>,
    input: &str,
    output: &str,
    events: usize,
    rate: Option<u32>,
) -> Figures {
    let mut subscription = Subscription::new(output, unique("reader"));
    subscription.assignment = Assignment::All;
    let mut reader = broker.subscribe(&subscription).await.expect("reader");
    let sink = broker.sink();
    let input = input.to_string();
    // Each phase reads the topic from the start; only its own events count.
    let run = unique("run");
    let tag = run.clone();
    let producer = tokio::spawn(async move {
        let mut in_flight = FuturesOrdered::new();
        let period = rate.map(|r| Duration::from_secs_f64(1.0 / f64::from(r)));
        let start = tokio::time::Instant::now();
        let mut sent = 0;
        while sent < events || !in_flight.is_empty() {
            let due = match period {
                Some(p) => start + p * sent as u32,
                None => start,
            };
            tokio::select! {
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    let done: Result<weir::transport::Position, weir::transport::TransportError> = done;
                    done.expect("publish");
                }
                _ = tokio::time::sleep_until(due), if sent < events && in_flight.len() < WINDOW => {
                    let payload = json!({"i": sent, "run": tag, "sent_us": now_us()}).to_string();
                    let sink = sink.clone();
                    let message = Outbound::new(input.clone(), payload);
                    in_flight.push_back(async move { sink.publish(message).await });
                    sent += 1;
                }
            }
        }
    });
    let mut latencies = Vec::with_capacity(events);
    let mut first = None;
    while latencies.len() < events {
        let message = tokio::time::timeout(Duration::from_secs(60), reader.next())
            .await
            .expect("outputs keep coming")
            .expect("read");
        let received = now_us();
        if let Some(sent) = sent_at(&message.payload, &run) {
            first.get_or_insert_with(Instant::now);
            latencies.push(Duration::from_micros((received - sent).max(0) as u64));
        }
    }
    producer.await.expect("producer");
    let elapsed = first.map(|f| f.elapsed()).unwrap_or_default();
    latencies.sort();
    let pct = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    Figures {
        events_per_second: events as f64 / elapsed.as_secs_f64().max(1e-9),
        p50: pct(0.5),
        p99: pct(0.99),
    }
}

/// The baseline: consume → produce with the same acknowledgement window, no weir.
fn bare_loop(
    broker: Arc<dyn Broker>,
    input: String,
    output: String,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut subscription = Subscription::new(&input, unique("bare"));
        subscription.assignment = Assignment::All;
        let mut source = broker.subscribe(&subscription).await.expect("bare source");
        let sink = broker.sink();
        let mut in_flight = FuturesOrdered::new();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    let position = done;
                    let _ = source.commit(&[position]).await;
                }
                message = source.next(), if in_flight.len() < WINDOW => {
                    let message = message.expect("bare consume");
                    let sink = sink.clone();
                    let out = Outbound::new(output.clone(), message.payload.clone());
                    let position = message.position;
                    in_flight.push_back(async move {
                        sink.publish(out).await.expect("bare publish");
                        position
                    });
                }
            }
        }
    })
}

async fn weir_graph(
    broker: Arc<dyn Broker>,
    input: &str,
    output: &str,
    prefix: &str,
    cancel: CancellationToken,
) -> Supervisor {
    let store = RedisStore::connect(
        &std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
        prefix,
    )
    .await
    .expect("redis");
    let runtime = Runtime {
        broker,
        store: Arc::new(store),
        node_id: "bench".into(),
    };
    let registry = FunctionRegistry::default();
    let decl = GraphBuilder::new("e2e")
        .reactor(ReactorConfig {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Sequential,
            max_in_flight: WINDOW,
            ..ReactorConfig::default()
        })
        .accumulator(AccumulatorSpec::passthrough("a").topic(input))
        .function("snapshot", &registry, "snapshot")
        .output("snapshot", output)
        .build()
        .expect("graph");
    let supervisor = Supervisor::new(runtime, SupervisionPolicy::default(), cancel);
    let graph = supervisor.spawn(decl).expect("spawn");
    graph.wait_for_state(weir::ReactorState::Live).await;
    supervisor
}

fn print(kind: &str, what: &str, throughput: &Figures, latency: &Figures) {
    println!(
        "{kind:5} {what:4}  {:>9.0} events/s   latency at pace: p50 {:>8.2} ms  p99 {:>8.2} ms",
        throughput.events_per_second,
        latency.p50.as_secs_f64() * 1e3,
        latency.p99.as_secs_f64() * 1e3,
    );
}

/// One measurement on fresh topics, so no phase reads another's backlog.
async fn phase(
    broker: &Arc<dyn Broker>,
    with_weir: bool,
    events: usize,
    rate: Option<u32>,
) -> Figures {
    let prefix = unique("bench");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let cancel = CancellationToken::new();
    let figures = if with_weir {
        let supervisor = weir_graph(broker.clone(), &input, &output, &prefix, cancel.clone()).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let figures = measure(broker, &input, &output, events, rate).await;
        supervisor.shutdown().await;
        figures
    } else {
        let bare = bare_loop(
            broker.clone(),
            input.clone(),
            output.clone(),
            cancel.clone(),
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let figures = measure(broker, &input, &output, events, rate).await;
        cancel.cancel();
        let _ = bare.await;
        figures
    };
    figures
}

async fn run(kind: &str) {
    let events: usize = env("WEIR_BENCH_EVENTS", 20_000);
    let rate: u32 = env("WEIR_BENCH_RATE", 1000);
    let seconds: usize = env("WEIR_BENCH_SECONDS", 5);
    let broker = broker(kind).await;
    let paced = rate as usize * seconds;

    let bare = (
        phase(&broker, false, events, None).await,
        phase(&broker, false, paced, Some(rate)).await,
    );
    print(kind, "bare", &bare.0, &bare.1);
    let weir = (
        phase(&broker, true, events, None).await,
        phase(&broker, true, paced, Some(rate)).await,
    );
    print(kind, "weir", &weir.0, &weir.1);
    println!(
        "{kind:5} weir/bare throughput {:.2}; latency weir adds at p99: {:.2} ms (p50 {:.2} ms)",
        weir.0.events_per_second / bare.0.events_per_second,
        (weir.1.p99.as_secs_f64() - bare.1.p99.as_secs_f64()) * 1e3,
        (weir.1.p50.as_secs_f64() - bare.1.p50.as_secs_f64()) * 1e3,
    );
}

fn kafka_brokers() -> String {
    std::env::var("WEIR_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

fn nats_url() -> String {
    std::env::var("WEIR_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

fn redis_url() -> String {
    std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A process under test, killed when dropped: at the end of its phase, or should the
/// bench fail midway.
struct UnderTest(std::process::Child);

impl Drop for UnderTest {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The process under test: this bench again as a raw-client loop, or `weir run`.
fn process_under_test(
    kind: &str,
    with_weir: bool,
    input: &str,
    output: &str,
    prefix: &str,
    events: usize,
    config: &mut tempfile::NamedTempFile,
) -> UnderTest {
    use std::io::Write;
    use std::process::{Command, Stdio};
    if !with_weir {
        return UnderTest(
            Command::new(std::env::current_exe().expect("this bench"))
                .arg("--bench")
                .env(ROLE, format!("raw-{kind}"))
                .env("WEIR_BENCH_INPUT", input)
                .env("WEIR_BENCH_OUTPUT", output)
                .env("WEIR_BENCH_PREFIX", prefix)
                .env("WEIR_BENCH_COUNT", events.to_string())
                .stdout(Stdio::null())
                .spawn()
                .expect("raw loop starts"),
        );
    }
    let broker = match kind {
        "kafka" => format!("kind = \"kafka\"\nbrokers = \"{}\"", kafka_brokers()),
        _ => format!("kind = \"nats\"\nurl = \"{}\"", nats_url()),
    };
    let text = format!(
        r#"
[broker]
{broker}
retention_ms = 3600000
[store]
kind = "redis"
url = "{redis}"
prefix = "{prefix}"
[[graph]]
name = "e2e"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "{output}"
max_in_flight = {awaited}
[[graph.accumulator]]
name = "a"
topic = "{input}"
"#,
        redis = redis_url(),
        awaited = raw::OUTPUTS_AWAITED,
    );
    config.write_all(text.as_bytes()).expect("config");
    UnderTest(
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["run", "--config"])
            .arg(config.path())
            .stdout(Stdio::null())
            .spawn()
            .expect("weir starts"),
    )
}

/// What one process under test did with a pre-filled input.
struct Drained {
    events_per_second: f64,
    /// Commands Redis processed meanwhile, per event: an upper bound on the round trips
    /// (a pipeline or script of several commands is one round trip).
    redis_commands_per_event: f64,
}

/// Commands the Redis server has processed since it started.
async fn redis_commands() -> u64 {
    let client = redis::Client::open(redis_url()).expect("redis url");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis reachable");
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut connection)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_commands_processed")
}

/// Fills a fresh input with `events` events, lets one process under test drain it, and
/// reads its outputs here: outputs per second from the first to the last.
async fn prefilled(
    kind: &str,
    broker: &Arc<dyn Broker>,
    events: usize,
    with_weir: bool,
) -> Drained {
    let prefix = unique("pre");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let sink = broker.sink();
    let mut acks = FuturesOrdered::new();
    for n in 0..events {
        let event = json!({"id": n, "px": 101.25, "qty": 3, "side": "buy"});
        acks.push_back(
            sink.enqueue(Outbound::new(input.clone(), event.to_string()))
                .await
                .expect("fill"),
        );
        if acks.len() >= raw::OUTPUTS_AWAITED || n + 1 == events {
            while let Some(ack) = acks.next().await {
                ack.expect("filled");
            }
        }
    }
    // Reading first: on NATS this makes the output's stream before anything publishes.
    let mut subscription = Subscription::new(&output, unique("reader"));
    subscription.assignment = Assignment::All;
    let mut source = broker.subscribe(&subscription).await.expect("reader");
    let mut config = tempfile::NamedTempFile::new().expect("config file");
    let commands_before = redis_commands().await;
    let mut child = process_under_test(
        kind,
        with_weir,
        &input,
        &output,
        &prefix,
        events,
        &mut config,
    );
    let mut seen = std::collections::HashSet::new();
    let mut first = None;
    let deadline = Instant::now() + Duration::from_secs(600);
    while seen.len() < events {
        assert!(Instant::now() < deadline, "outputs in time");
        // Looked at every second: a process under test that ended early (a raw-client
        // loop panicking on a consume error, say) sends nothing more.
        let Ok(message) = tokio::time::timeout(Duration::from_secs(1), source.next()).await else {
            if let Ok(Some(status)) = child.0.try_wait() {
                panic!(
                    "the process under test ended ({status}) after {} of {events} outputs",
                    seen.len()
                );
            }
            continue;
        };
        let message = message.expect("read");
        // A redelivery to this reader counts once.
        if seen.insert((message.position.partition, message.position.offset)) {
            first.get_or_insert_with(Instant::now);
        }
        // Acknowledged as it goes: JetStream stops delivering to a consumer with
        // 100,000 messages unacknowledged.
        if seen.len() % 4096 == 0 {
            source.commit(&[message.position]).await.expect("commit");
        }
    }
    let took = first.map_or(Duration::ZERO, |f| f.elapsed());
    drop(child);
    // Less the one INFO of this count.
    let commands = redis_commands().await.saturating_sub(commands_before + 1);
    remove_prefix(&prefix).await;
    Drained {
        events_per_second: (events - 1) as f64 / took.as_secs_f64().max(1e-9),
        redis_commands_per_event: commands as f64 / events as f64,
    }
}

async fn remove_prefix(prefix: &str) {
    if let Ok(client) = redis::Client::open(redis_url()) {
        if let Ok(mut c) = client.get_multiplexed_async_connection().await {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{prefix}:*"))
                .query_async(&mut c)
                .await
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: Result<i64, _> = redis::cmd("DEL").arg(&keys).query_async(&mut c).await;
            }
        }
    }
}

/// The child's part: one raw-client loop, as the parent's environment says.
async fn raw_role(role: &str) {
    let var = |name: &str| std::env::var(name).expect(name);
    let (input, output, prefix) = (
        var("WEIR_BENCH_INPUT"),
        var("WEIR_BENCH_OUTPUT"),
        var("WEIR_BENCH_PREFIX"),
    );
    let events: usize = var("WEIR_BENCH_COUNT").parse().expect("count");
    match role {
        "raw-kafka" => raw::kafka(&kafka_brokers(), &input, &output, &prefix, events).await,
        "raw-nats" => raw::nats(&nats_url(), &input, &output, &prefix, events).await,
        other => panic!("unknown role {other}"),
    }
}

async fn compare_prefilled(kind: &str, events: usize) {
    let broker = broker(kind).await;
    let raw = prefilled(kind, &broker, events, false)
        .await
        .events_per_second;
    let weir = prefilled(kind, &broker, events, true).await;
    println!(
        "{kind:5} pre-filled {events} events, {} outputs awaited: raw-client loop {raw:.0} ev/s, \
         weir run {:.0} ev/s: weir/raw {:.2}; Redis commands per event {:.4}",
        raw::OUTPUTS_AWAITED,
        weir.events_per_second,
        weir.events_per_second / raw,
        weir.redis_commands_per_event
    );
}

/// Latency at a steady pace, with the process under test (the raw-client loop, or
/// `weir run`) alone in a process of its own: this one publishes `rate` events a second
/// for `seconds` and reads the outputs; an output's latency runs from its event's publish
/// to its read, on this process's clock.
async fn paced_latency(
    kind: &str,
    broker: &Arc<dyn Broker>,
    rate: u32,
    seconds: usize,
    with_weir: bool,
) -> Figures {
    let prefix = unique("paced");
    let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
    let paced = rate as usize * seconds;
    // Reading first: on NATS this makes the output's stream before anything publishes.
    let mut subscription = Subscription::new(&output, unique("reader"));
    subscription.assignment = Assignment::All;
    let mut warm_reader = broker.subscribe(&subscription).await.expect("reader");
    // The warm-up events make the input (the raw loop looks it up as it starts); their
    // outputs coming back say the process under test is running.
    let sink = broker.sink();
    for n in 0..PACED_WARM_UP {
        let event = json!({"warm_up": n});
        sink.publish(Outbound::new(input.clone(), event.to_string()))
            .await
            .expect("warm-up event");
    }
    let mut config = tempfile::NamedTempFile::new().expect("config file");
    let child = process_under_test(
        kind,
        with_weir,
        &input,
        &output,
        &prefix,
        PACED_WARM_UP + paced,
        &mut config,
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut warmed = std::collections::HashSet::new();
    while warmed.len() < PACED_WARM_UP {
        let left = deadline.saturating_duration_since(Instant::now());
        let message = tokio::time::timeout(left, warm_reader.next())
            .await
            .expect("the process under test answers the warm-up in time")
            .expect("read");
        warmed.insert((message.position.partition, message.position.offset));
    }
    drop(warm_reader);
    let figures = measure(broker, &input, &output, paced, Some(rate)).await;
    drop(child);
    remove_prefix(&prefix).await;
    figures
}

async fn compare_paced(kind: &str, rate: u32, seconds: usize) {
    let broker = broker(kind).await;
    let raw = paced_latency(kind, &broker, rate, seconds, false).await;
    let weir = paced_latency(kind, &broker, rate, seconds, true).await;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{kind:5} paced {rate} events/s for {seconds} s, each alone in its process: raw-client \
         loop p50 {:.2} ms p99 {:.2} ms, weir run p50 {:.2} ms p99 {:.2} ms: weir adds {:.2} ms \
         at p99 ({:.2} ms at p50)",
        ms(raw.p50),
        ms(raw.p99),
        ms(weir.p50),
        ms(weir.p99),
        ms(weir.p99) - ms(raw.p99),
        ms(weir.p50) - ms(raw.p50),
    );
}

#[tokio::main]
async fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        raw_role(&role).await;
        return;
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` does not run this harness.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let brokers = std::env::var("WEIR_BENCH_BROKERS").unwrap_or_else(|_| "kafka,nats".into());
    let prefilled: usize = env("WEIR_BENCH_PREFILLED", 100_000);
    let paced_rate: u32 = env("WEIR_BENCH_PACED_RATE", 2000);
    let paced_seconds: usize = env("WEIR_BENCH_PACED_SECONDS", 5);
    for kind in brokers.split(',') {
        run(kind.trim()).await;
        if prefilled > 0 {
            compare_prefilled(kind.trim(), prefilled).await;
        }
        if paced_seconds > 0 {
            compare_paced(kind.trim(), paced_rate, paced_seconds).await;
        }
    }
}

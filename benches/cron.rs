//! Cron at scale, on Redis and NATS JetStream (run `scripts/services` first):
//! registers `WEIR_BENCH_SCHEDULES` schedules (default 100,000), each firing once a
//! minute at its own second, runs one scheduler for `WEIR_BENCH_SECONDS` (default 30),
//! and reports the registration rate, the scheduler's resident memory, and tick
//! lateness (emitted − scheduled) p50/p99 over every tick it fired.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use weir::codec::avro::decode;
use weir::codec::CronTick;
use weir::cron::scheduler::{register, Scheduler, SchedulerConfig};
use weir::cron::{Schedule, Target};
use weir::store::prelude::*;
use weir::store::redis::RedisStore;
use weir::transport::kafka::{KafkaBroker, KafkaSettings};
use weir::transport::nats::{NatsBroker, NatsSettings};
use weir::transport::{Assignment, Broker, Subscription};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident set size of this process, in MiB.
fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / (1024.0 * 1024.0)
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let count: usize = env("WEIR_BENCH_SCHEDULES", 100_000);
    let seconds: u64 = env("WEIR_BENCH_SECONDS", 30);
    let prefix = format!("weirbench{:08x}", rand::random::<u32>());
    let topic = format!("{prefix}.ticks");
    let redis_url =
        std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store: Arc<dyn Store> = Arc::new(
        RedisStore::connect(&redis_url, &prefix)
            .await
            .expect("redis"),
    );
    // `WEIR_BENCH_BROKER`: nats (JetStream, default), nats-core or kafka.
    let kind: String = env("WEIR_BENCH_BROKER", "nats".to_string());
    let broker: Arc<dyn Broker> = match kind.as_str() {
        "kafka" => Arc::new(
            KafkaBroker::connect(KafkaSettings {
                brokers: std::env::var("WEIR_TEST_KAFKA")
                    .unwrap_or_else(|_| "127.0.0.1:9092".into()),
                ..KafkaSettings::default()
            })
            .expect("kafka"),
        ),
        other => Arc::new(
            NatsBroker::connect(NatsSettings {
                url: std::env::var("WEIR_TEST_NATS")
                    .unwrap_or_else(|_| "nats://127.0.0.1:4222".into()),
                jetstream: other != "nats-core",
                ..Default::default()
            })
            .await
            .expect("nats"),
        ),
    };
    println!("broker: {kind}");

    let started = Instant::now();
    futures::stream::iter(0..count)
        .for_each_concurrent(256, |i| {
            let store = store.clone();
            let topic = topic.clone();
            async move {
                let mut s = Schedule::new(
                    format!("s{i}"),
                    format!("{} * * * * *", i % 60),
                    "Europe/London",
                );
                s.target = Target::Topic(topic);
                register(store.as_ref(), &s, 1).await.expect("register");
            }
        })
        .await;
    let took = started.elapsed();
    println!(
        "registered {count} schedules in {:.1} s: {:.0} schedules/s",
        took.as_secs_f64(),
        count as f64 / took.as_secs_f64()
    );

    let mut sub = Subscription::new(&topic, format!("{prefix}-reader"));
    sub.assignment = Assignment::All;
    let mut reader = broker.subscribe(&sub).await.expect("reader");
    let before = rss_mib();
    let cancel = CancellationToken::new();
    let scheduler = Scheduler::new(store.clone(), broker.sink(), SchedulerConfig::new("bench"));
    let task = tokio::spawn(scheduler.run(cancel.clone()));
    // Ticks due before the scheduler started were missed while it was not running;
    // steady-state lateness counts only the ones due after it was up.
    let steady_from = chrono::Utc::now().timestamp_millis() + 1000;
    let mut steady = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut lateness = Vec::new();
    // Received − scheduled: what a consumer sees, the broker's own delay included.
    let mut received = Vec::new();
    while Instant::now() < deadline {
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(200), reader.next()).await {
            let received_ms = chrono::Utc::now().timestamp_millis();
            if let Ok(tick) = decode::<CronTick>(&m.payload) {
                lateness.push(tick.emitted_time_ms - tick.scheduled_time_ms);
                if tick.scheduled_time_ms >= steady_from {
                    steady.push(tick.emitted_time_ms - tick.scheduled_time_ms);
                    received.push(received_ms - tick.scheduled_time_ms);
                }
            }
        }
    }
    let after = rss_mib();
    cancel.cancel();
    let _ = task.await;
    lateness.sort();
    steady.sort();
    received.sort();
    let pct = |v: &[i64], q: f64| {
        v.get(((v.len().max(1) - 1) as f64 * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    println!(
        "fired {} ticks in {seconds} s; lateness p50 {} ms, p99 {} ms, max {} ms",
        lateness.len(),
        pct(&lateness, 0.5),
        pct(&lateness, 0.99),
        lateness.last().copied().unwrap_or(0)
    );
    println!(
        "steady state ({} ticks due after start-up): lateness p50 {} ms, p99 {} ms, max {} ms",
        steady.len(),
        pct(&steady, 0.5),
        pct(&steady, 0.99),
        steady.last().copied().unwrap_or(0)
    );
    println!(
        "steady state, as received by a consumer: p50 {} ms, p99 {} ms, max {} ms",
        pct(&received, 0.5),
        pct(&received, 0.99),
        received.last().copied().unwrap_or(0)
    );
    println!("process memory: {before:.1} MiB before the scheduler, {after:.1} MiB after {seconds} s of firing");
    drop(reader);
    common::remove_prefix(&redis_url, &prefix).await;
    common::delete_topics(&broker, &[topic]).await;
}

//! Workflow dispatch on real brokers: the state manager (in this process) → TaskReadyEvents
//! → 1 and 2 `weir worker` processes running a no-op task (`builtin::echo`) → results →
//! the state manager, over Kafka and over NATS JetStream, with state in Redis. In the
//! same run, a bare publish → consume loop over the same broker gives the baseline.
//!
//! Run `scripts/services` first, then `cargo bench --bench dispatch`. Workers run the
//! `weir` binary cargo builds with the bench, unless `WEIR_BENCH_WEIR` names another.
//! Environment: `WEIR_BENCH_TASKS` (throughput phase, default 200000), `WEIR_BENCH_RATE` and
//! `WEIR_BENCH_SECONDS` (latency phase, default 2000 tasks/s for 5 s),
//! `WEIR_BENCH_BACKLOG` (ready tasks queued before the workers start, default 1000000;
//! 0 skips the phase), `WEIR_BENCH_BROKERS` (default `kafka,nats`), `WEIR_BENCH_WORKERS`
//! (worker processes per scenario, default `1,2`).
//!
//! Throughput counts an execution done when the state manager has applied its result
//! (the execution is completed in Redis), through a metrics recorder installed here.
//! Ready→started is computed from the messages: `ready_at_ms` of the TaskReadyEvent (read
//! from the executor topic by a separate consumer group) and `finished_at_ms −
//! duration_ms` of the result.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use tokio_util::sync::CancellationToken;
use weir::codec::avro::decode_one_or_batch;
use weir::codec::{ExecutionResult, TaskReadyEvent};
use weir::config::Config;
use weir::dispatch::manager::workflow_start_topic;
use weir::dispatch::{executor_topic, StateManager};
use weir::transport::{Assignment, Broker, Outbound, Subscription};

/// Starts (and bare-loop publishes) awaiting acknowledgement at once.
const WINDOW: usize = 256;
const WORKER_CONCURRENCY: usize = 256;
/// How long any one wait may take before the run is declared stuck. Draining the
/// backlog is the longest: 1,000,000 tasks at a slow 1,000/s is nearly 17 minutes.
const STUCK: Duration = Duration::from_secs(1800);

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn unique() -> String {
    format!("{:010x}", rand::random::<u64>() & 0xff_ffff_ffff)
}

/// Counts finished workflow executions as the state manager reports them: a cheap,
/// exact "done" signal that needs no scan of the store.
struct FinishedCounter(Arc<AtomicU64>);

impl Recorder for FinishedCounter {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() == weir::metrics::WORKFLOWS_FINISHED_TOTAL {
            Counter::from_arc(self.0.clone())
        } else {
            Counter::noop()
        }
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// Peak resident set (VmHWM) of a process, in MiB.
fn peak_rss_mib(pid: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// The `weir` binary cargo built along with this bench (same profile and features),
/// copied aside so a concurrent build cannot replace it mid-run.
fn weir_binary(dir: &Path) -> PathBuf {
    if let Ok(path) = std::env::var("WEIR_BENCH_WEIR") {
        return PathBuf::from(path);
    }
    let copy = dir.join("weir");
    std::fs::copy(env!("CARGO_BIN_EXE_weir"), &copy).expect("copy the weir binary");
    copy
}

/// Worker processes, killed when dropped (a panic included).
struct Workers {
    children: Vec<Child>,
    logs: Vec<PathBuf>,
}

impl Workers {
    fn spawn(bin: &Path, config: &Path, executor: &str, count: usize, dir: &Path) -> Self {
        let mut workers = Self {
            children: Vec::new(),
            logs: Vec::new(),
        };
        for i in 0..count {
            let log = dir.join(format!("{executor}-worker-{i}.log"));
            let file = std::fs::File::create(&log).expect("worker log");
            let child = Command::new(bin)
                .arg("worker")
                .arg("--config")
                .arg(config)
                .args(["--executor", executor])
                .args(["--concurrency", &WORKER_CONCURRENCY.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(file)
                .spawn()
                .expect("spawn weir worker");
            workers.children.push(child);
            workers.logs.push(log);
        }
        workers
    }

    /// Panics (with the worker's log) if one exited: the run would otherwise hang.
    fn check(&mut self) {
        for (child, log) in self.children.iter_mut().zip(&self.logs) {
            if let Ok(Some(status)) = child.try_wait() {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                panic!("worker {} exited ({status}):\n{text}", child.id());
            }
        }
    }

    /// Peak RSS of each worker, in MiB.
    fn peak_rss(&self) -> Vec<f64> {
        self.children
            .iter()
            .map(|c| peak_rss_mib(&c.id().to_string()))
            .collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One configuration: its own topics, workflow, executor and Redis prefix.
struct Setup {
    path: PathBuf,
    config: Config,
    name: String,
    executor: String,
    results_topic: String,
    prefix: String,
}

impl Setup {
    fn new(kind: &str, dir: &Path) -> Self {
        let id = unique();
        let name = format!("bench{id}");
        let executor = format!("bench{id}");
        let results_topic = format!("weirbench.{id}.results");
        let prefix = format!("weirbench{id}");
        let redis =
            std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let broker = match kind {
            "kafka" => format!(
                "kind = \"kafka\"\nbrokers = \"{}\"\npartitions = 2\n\
                 options = {{ \"session.timeout.ms\" = \"6000\", \"max.poll.interval.ms\" = \"7000\", \"heartbeat.interval.ms\" = \"1000\" }}\n",
                std::env::var("WEIR_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
            ),
            _ => format!(
                "kind = \"nats\"\nurl = \"{}\"\njetstream = true\n",
                std::env::var("WEIR_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
            ),
        };
        let text = format!(
            "[broker]\n{broker}\n\
             [store]\nkind = \"redis\"\nurl = \"{redis}\"\nprefix = \"{prefix}\"\n\n\
             [dispatch]\ndefault_executor = \"{executor}\"\nresults_topic = \"{results_topic}\"\n\n\
             [[workflow]]\nname = \"{name}\"\n\n\
             [[workflow.task]]\nid = \"noop\"\nhandler = \"builtin::echo\"\n"
        );
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, text).expect("write config");
        let config = Config::load(&path).expect("bench config parses");
        Self {
            path,
            config,
            name,
            executor,
            results_topic,
            prefix,
        }
    }

    fn topics(&self) -> Vec<String> {
        vec![
            executor_topic(&self.executor),
            format!("{}.dlq", executor_topic(&self.executor)),
            self.results_topic.clone(),
            workflow_start_topic(&self.name),
        ]
    }
}

/// What the side readers saw: ready time per task execution, start time per result,
/// and which workers reported.
#[derive(Default)]
struct Seen {
    ready: Mutex<HashMap<String, i64>>,
    started: Mutex<HashMap<String, i64>>,
    workers: Mutex<HashSet<String>>,
}

/// Reads a topic from its start with a group of its own (not the workers' or the state
/// manager's, so it takes nothing from them).
fn reader(
    broker: Arc<dyn Broker>,
    topic: String,
    seen: Arc<Seen>,
    ready: bool,
    cancel: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut subscription = Subscription::new(&topic, format!("weirbench-reader-{}", unique()));
        subscription.assignment = Assignment::All;
        let mut source = broker.subscribe(&subscription).await.expect("side reader");
        loop {
            let message = tokio::select! {
                _ = cancel.cancelled() => return,
                m = source.next() => match m {
                    Ok(m) => m,
                    // A busy machine can miss the broker's idle heartbeat; the source
                    // carries on after reporting it.
                    Err(e) if e.is_retryable() => continue,
                    Err(e) => panic!("side read: {e}"),
                },
            };
            // Acknowledged as read: the broker stops delivering to a reader holding too
            // many unacknowledged messages, and the topic holds every earlier phase's.
            source
                .commit(&[message.position])
                .await
                .expect("side commit");
            // Records travel alone or several to a message.
            if ready {
                let events = decode_one_or_batch::<TaskReadyEvent>(&message.payload);
                let mut seen = seen.ready.lock().unwrap();
                for event in events.into_iter().flatten() {
                    seen.insert(event.task_execution_id, event.ready_at_ms);
                }
            } else {
                let results = decode_one_or_batch::<ExecutionResult>(&message.payload);
                for result in results.into_iter().flatten() {
                    seen.started.lock().unwrap().insert(
                        result.task_execution_id,
                        result.finished_at_ms - result.duration_ms,
                    );
                    let mut workers = seen.workers.lock().unwrap();
                    if !workers.contains(&result.worker_id) {
                        workers.insert(result.worker_id);
                    }
                }
            }
        }
    })
}

/// Waits until the side readers have read what their topics held: a ready event and a
/// result for each of the `done` executions finished so far (nothing is being started
/// meanwhile).
async fn caught_up(seen: &Seen, done: usize) {
    let deadline = Instant::now() + STUCK;
    loop {
        let read = (
            seen.ready.lock().unwrap().len(),
            seen.started.lock().unwrap().len(),
        );
        if read.0 >= done && read.1 >= done {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "side readers at {read:?} of {done}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls until `done` holds, checking on the workers; panics when stuck.
async fn wait_until(what: &str, workers: &mut Workers, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + STUCK;
    while !done() {
        workers.check();
        assert!(Instant::now() < deadline, "stuck waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Starts `count` executions, `WINDOW` at once; returns their ids.
async fn start_many(manager: &StateManager, workflow: &str, count: usize) -> Vec<String> {
    futures::stream::iter(0..count)
        .map(|_| async {
            manager
                .start(workflow, serde_json::json!({}))
                .await
                .expect("start execution")
        })
        .buffer_unordered(WINDOW)
        .collect()
        .await
}

struct Run {
    workers: usize,
    tasks_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    latency_tasks: usize,
    worker_rss: Vec<f64>,
}

struct Backlog {
    size: usize,
    enqueue_per_second: f64,
    first_result_after: Duration,
    drain: Duration,
    drain_per_second: f64,
    worker_rss: Vec<f64>,
}

fn percentile(sorted: &[i64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q) as usize] as f64
}

/// The connections of one setup, with the state manager running in this process.
struct RunningManager {
    runtime: weir::supervisor::Runtime,
    manager: StateManager,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), weir::dispatch::DispatchError>>,
    /// A panicking run still stops its state manager.
    _stop: tokio_util::sync::DropGuard,
}

impl RunningManager {
    async fn start(setup: &Setup) -> Self {
        let runtime = setup.config.runtime().await.expect("connect");
        let manager = setup.config.state_manager(&runtime).expect("state manager");
        let cancel = CancellationToken::new();
        let task = tokio::spawn(manager.clone().run(runtime.broker.clone(), cancel.clone()));
        Self {
            runtime,
            manager,
            _stop: cancel.clone().drop_guard(),
            cancel,
            task,
        }
    }

    /// Stops the state manager and removes what the setup left in the services.
    async fn stop(self, setup: &Setup) {
        self.cancel.cancel();
        let _ = self.task.await;
        cleanup(setup, self.runtime.broker.clone()).await;
    }
}

/// Throughput and latency with `count` workers.
async fn scenario(
    kind: &str,
    count: usize,
    bin: &Path,
    dir: &Path,
    finished: &Arc<AtomicU64>,
) -> Run {
    let setup = Setup::new(kind, dir);
    // Executions finished before this scenario's, on topics of their own.
    let finished_before = finished.load(Ordering::Relaxed);
    let running = RunningManager::start(&setup).await;
    let (runtime, manager, cancel) = (&running.runtime, &running.manager, &running.cancel);
    let mut workers = Workers::spawn(bin, &setup.path, &setup.executor, count, dir);

    // Ready: every worker process has reported a result.
    let seen = Arc::new(Seen::default());
    let results_reader = reader(
        runtime.broker.clone(),
        setup.results_topic.clone(),
        seen.clone(),
        false,
        cancel.clone(),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while seen.workers.lock().unwrap().len() < count {
        workers.check();
        assert!(Instant::now() < deadline, "workers not ready after 120 s");
        start_many(manager, &setup.name, 16).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    results_reader.abort();
    // Let the warm-up executions finish so they do not count below.
    let settled = Instant::now();
    let mut last = finished.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = finished.load(Ordering::Relaxed);
        if now == last || settled.elapsed() > Duration::from_secs(10) {
            break;
        }
        last = now;
    }

    // Throughput: as fast as the starts are acknowledged; done when the state manager
    // has applied every result.
    let tasks: usize = env("WEIR_BENCH_TASKS", 200_000);
    let before = finished.load(Ordering::Relaxed);
    let began = Instant::now();
    start_many(manager, &setup.name, tasks).await;
    let target = before + tasks as u64;
    wait_until("throughput phase", &mut workers, || {
        finished.load(Ordering::Relaxed) >= target
    })
    .await;
    let elapsed = began.elapsed();
    let tasks_per_second = tasks as f64 / elapsed.as_secs_f64();
    eprintln!(
        "{kind} {count} worker(s): {tasks} tasks in {:.2} s = {tasks_per_second:.0} tasks/s",
        elapsed.as_secs_f64()
    );

    // Latency at a moderate pace, from the messages' own timestamps.
    let rate: u32 = env("WEIR_BENCH_RATE", 2000);
    let seconds: u32 = env("WEIR_BENCH_SECONDS", 5);
    let paced = (rate * seconds) as usize;
    let seen = Arc::new(Seen::default());
    let readers = [
        reader(
            runtime.broker.clone(),
            executor_topic(&setup.executor),
            seen.clone(),
            true,
            cancel.clone(),
        ),
        reader(
            runtime.broker.clone(),
            setup.results_topic.clone(),
            seen.clone(),
            false,
            cancel.clone(),
        ),
    ];
    // The readers start from the topics' beginnings, which hold every earlier phase's
    // messages: read up to now before the pace starts, or their catching up (in this
    // process, beside the state manager) would be measured as the tasks' latency.
    let done = finished.load(Ordering::Relaxed) - finished_before;
    caught_up(&seen, done as usize).await;
    let before = finished.load(Ordering::Relaxed);
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    let start = tokio::time::Instant::now();
    let mut starts = tokio::task::JoinSet::new();
    for i in 0..paced {
        tokio::time::sleep_until(start + period * i as u32).await;
        let (manager, name) = (manager.clone(), setup.name.clone());
        starts.spawn(async move {
            manager
                .start(&name, serde_json::json!({}))
                .await
                .expect("start execution")
        });
    }
    let ids: Vec<String> = starts.join_all().await;
    let target = before + paced as u64;
    wait_until("latency phase", &mut workers, || {
        finished.load(Ordering::Relaxed) >= target
    })
    .await;
    let task_ids: Vec<String> = ids
        .iter()
        .map(|id| weir::dispatch::manager::task_execution_id(id, "noop"))
        .collect();
    wait_until("side readers", &mut workers, || {
        let ready = seen.ready.lock().unwrap();
        let started = seen.started.lock().unwrap();
        task_ids
            .iter()
            .all(|t| ready.contains_key(t) && started.contains_key(t))
    })
    .await;
    let mut waits: Vec<i64> = {
        let ready = seen.ready.lock().unwrap();
        let started = seen.started.lock().unwrap();
        task_ids
            .iter()
            .map(|t| (started[t] - ready[t]).max(0))
            .collect()
    };
    waits.sort_unstable();
    for r in readers {
        r.abort();
    }
    let worker_rss = workers.peak_rss();
    drop(workers);
    running.stop(&setup).await;
    Run {
        workers: count,
        tasks_per_second,
        p50_ms: percentile(&waits, 0.5),
        p99_ms: percentile(&waits, 0.99),
        latency_tasks: paced,
        worker_rss,
    }
}

/// Ready tasks queued while no worker runs, then drained by two workers.
async fn backlog(
    kind: &str,
    size: usize,
    bin: &Path,
    dir: &Path,
    finished: &Arc<AtomicU64>,
) -> Backlog {
    let setup = Setup::new(kind, dir);
    let running = RunningManager::start(&setup).await;
    let manager = &running.manager;
    let began = Instant::now();
    let mut queued = 0;
    while queued < size {
        let chunk = (size - queued).min(50_000);
        start_many(manager, &setup.name, chunk).await;
        queued += chunk;
        eprintln!(
            "{kind} backlog: {queued} queued, {:.0}/s",
            queued as f64 / began.elapsed().as_secs_f64()
        );
    }
    let enqueue_per_second = size as f64 / began.elapsed().as_secs_f64();
    let before = finished.load(Ordering::Relaxed);
    let target = before + size as u64;
    let spawned = Instant::now();
    let mut workers = Workers::spawn(bin, &setup.path, &setup.executor, 2, dir);
    wait_until("the first backlog result", &mut workers, || {
        finished.load(Ordering::Relaxed) > before
    })
    .await;
    let first = Instant::now();
    let mut report = Instant::now();
    wait_until("the backlog to drain", &mut workers, || {
        let done = finished.load(Ordering::Relaxed);
        if report.elapsed() > Duration::from_secs(10) {
            eprintln!("{kind} backlog: {} of {size} done", done - before);
            report = Instant::now();
        }
        done >= target
    })
    .await;
    let drain = first.elapsed();
    let worker_rss = workers.peak_rss();
    drop(workers);
    running.stop(&setup).await;
    Backlog {
        size,
        enqueue_per_second,
        first_result_after: first - spawned,
        drain,
        drain_per_second: size as f64 / drain.as_secs_f64(),
        worker_rss,
    }
}

/// Bare client loop on a fresh topic: publish 100-byte messages (`WINDOW` awaiting
/// acknowledgement) while one consumer reads them; messages/s from first publish to
/// last read.
async fn bare_loop(broker: Arc<dyn Broker>, count: usize) -> f64 {
    let topic = format!("weirbench.{}.bare", unique());
    let mut subscription = Subscription::new(&topic, format!("weirbench-bare-{}", unique()));
    subscription.assignment = Assignment::All;
    let mut source = broker.subscribe(&subscription).await.expect("bare source");
    let sink = broker.sink();
    let began = Instant::now();
    let publisher = {
        let topic = topic.clone();
        tokio::spawn(async move {
            let payload = bytes::Bytes::from(vec![b'x'; 100]);
            futures::stream::iter(0..count)
                .map(|_| sink.publish(Outbound::new(topic.clone(), payload.clone())))
                .buffer_unordered(WINDOW)
                .for_each(|r| async move {
                    r.expect("bare publish");
                })
                .await;
        })
    };
    let mut read = 0;
    while read < count {
        let message = match tokio::time::timeout(Duration::from_secs(60), source.next())
            .await
            .expect("bare messages keep coming")
        {
            Ok(message) => message,
            // A busy machine can miss the broker's idle heartbeat; the source carries on
            // after reporting it.
            Err(e) if e.is_retryable() => continue,
            Err(e) => panic!("bare read: {e}"),
        };
        read += 1;
        // Committed now and then: a reader holding too many unacknowledged messages is
        // sent no more.
        if read % 100 == 0 || read == count {
            source
                .commit(&[message.position])
                .await
                .expect("bare commit");
        }
    }
    let rate = count as f64 / began.elapsed().as_secs_f64();
    publisher.await.expect("bare publisher");
    drop(source);
    common::delete_topics(&broker, &[topic]).await;
    rate
}

/// Removes what a configuration left: its Redis keys (SCAN + UNLINK on its own prefix)
/// and its topics or streams.
async fn cleanup(setup: &Setup, broker: Arc<dyn Broker>) {
    common::remove_prefix(&setup.config.store.url, &setup.prefix).await;
    common::delete_topics(&broker, &setup.topics()).await;
}

fn mib(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v:.0}"))
        .collect::<Vec<_>>()
        .join(" + ")
}

async fn run(kind: &str, bin: &Path, dir: &Path, finished: &Arc<AtomicU64>) {
    let tasks: usize = env("WEIR_BENCH_TASKS", 200_000);
    let size: usize = env("WEIR_BENCH_BACKLOG", 1_000_000);
    let bare = {
        let setup = Setup::new(kind, dir);
        let runtime = setup.config.runtime().await.expect("connect");
        bare_loop(runtime.broker.clone(), tasks).await
    };
    eprintln!("{kind} bare loop: {bare:.0} msg/s");
    let mut runs = Vec::new();
    let worker_counts: String = env("WEIR_BENCH_WORKERS", "1,2".to_string());
    for count in worker_counts
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
    {
        runs.push(scenario(kind, count, bin, dir, finished).await);
    }
    let backlog = if size > 0 {
        Some(backlog(kind, size, bin, dir, finished).await)
    } else {
        None
    };
    let name = match kind {
        "kafka" => "Kafka (Tansu)",
        _ => "NATS JetStream",
    };
    println!();
    println!("### {name}, state in Redis");
    println!();
    println!(
        "| workers | tasks/s ({tasks} no-op) | ready→started p50 / p99 (at pace) | bare loop | worker peak RSS |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for r in &runs {
        println!(
            "| {} | {:.0} | {:.0} / {:.0} ms ({} tasks) | {bare:.0} msg/s | {} MiB |",
            r.workers,
            r.tasks_per_second,
            r.p50_ms,
            r.p99_ms,
            r.latency_tasks,
            mib(&r.worker_rss)
        );
    }
    if let Some(b) = backlog {
        println!();
        println!(
            "| backlog | queued at | first result after | drain (2 workers) | drain tasks/s | worker peak RSS |"
        );
        println!("| --- | --- | --- | --- | --- | --- |");
        println!(
            "| {} | {:.0} starts/s | {:.1} s | {:.1} s | {:.0} | {} MiB |",
            b.size,
            b.enqueue_per_second,
            b.first_result_after.as_secs_f64(),
            b.drain.as_secs_f64(),
            b.drain_per_second,
            mib(&b.worker_rss)
        );
    }
    println!();
    println!("bench process peak RSS: {:.0} MiB", peak_rss_mib("self"));
}

/// The allocator the `weir` binary uses, for the state manager hosted here.
#[global_allocator]
static ALLOCATOR: weir::allocator::Allocator = weir::allocator::Allocator;

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not run this harness.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let finished = Arc::new(AtomicU64::new(0));
    metrics::set_global_recorder(FinishedCounter(finished.clone()))
        .expect("no other metrics recorder");
    let dir = tempfile::tempdir().expect("temp dir");
    let bin = weir_binary(dir.path());
    let brokers = std::env::var("WEIR_BENCH_BROKERS").unwrap_or_else(|_| "kafka,nats".into());
    // On a runtime worker, as `weir` runs its commands, not on the main thread.
    tokio::spawn(async move {
        for kind in brokers.split(',') {
            run(kind.trim(), &bin, dir.path(), &finished).await;
        }
    })
    .await
    .expect("bench run");
}

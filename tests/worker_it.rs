//! `weir run` (state manager) with `weir worker` processes on real services: a worker
//! killed with SIGKILL mid-task loses no task, and a state manager killed mid-workflow
//! leaves no execution stuck, over Kafka and NATS JetStream.
//! Also drives `weir workflow run --wait` and `weir workflow status`.
#![cfg(feature = "it")]

mod common;

use std::io::Write;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::services;
use serde_json::Value;
use weir::transport::{Broker, Subscription};

const TASKS: usize = 6;

struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits for `child` to exit, within `limit` (then it is killed and the test fails,
/// naming `what`), and
/// reads what it printed (a little: it must fit the pipe while the child runs).
async fn exited(child: &mut Child, limit: Duration, what: &str) -> (ExitStatus, Vec<u8>) {
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what}: not exited");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut stdout = Vec::new();
    if let Some(mut pipe) = child.stdout.take() {
        std::io::Read::read_to_end(&mut pipe, &mut stdout).unwrap();
    }
    (status, stdout)
}

fn config(kafka: bool, prefix: &str) -> tempfile::NamedTempFile {
    config_with(kafka, prefix, false)
}

/// With `chain`, each task depends on the one before, so a workflow advances one result
/// at a time through the state manager.
fn config_with(kafka: bool, prefix: &str, chain: bool) -> tempfile::NamedTempFile {
    let broker = if kafka {
        format!(
            "{}\npartitions = 2\n{}",
            services::kafka_table(),
            services::fast_group_options_line()
        )
    } else {
        format!("{}\nack_wait_ms = 3000", services::nats_table())
    };
    config_on(&broker, prefix, chain)
}

/// The config of [`config_with`] on the broker a `[broker]` table body describes.
fn config_on(broker: &str, prefix: &str, chain: bool) -> tempfile::NamedTempFile {
    let tasks: String = (0..TASKS)
        .map(|i| {
            let after = if chain && i > 0 {
                format!("depends_on = [\"t{}\"]\n", i - 1)
            } else {
                String::new()
            };
            format!(
                "[[workflow.task]]\nid = \"t{i}\"\nhandler = \"builtin::sleep\"\nmax_attempts = 3\ntimeout_ms = 20000\n{after}"
            )
        })
        .collect();
    let text = format!(
        r#"
[broker]
{broker}
[store]
kind = "redis"
url = "{redis}"
prefix = "{prefix}"
[dispatch]
default_executor = "{prefix}x"
results_topic = "{prefix}.results"
[[workflow]]
name = "{prefix}w"
{tasks}"#,
        redis = services::redis_url(),
    );
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(text.as_bytes()).unwrap();
    file
}

fn weir(config: &tempfile::NamedTempFile, prefix: &str, name: &str, args: &[&str]) -> Child {
    let log =
        std::fs::File::create(std::env::temp_dir().join(format!("{prefix}-{name}.log"))).unwrap();
    Command::new(env!("CARGO_BIN_EXE_weir"))
        .args(args)
        .arg("--config")
        .arg(config.path())
        .env("WEIR__NODE__ID", name)
        .env("WEIR_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("weir starts")
}

/// A reader of the results topic, from its start.
async fn results_reader(kafka: bool, prefix: &str) -> Box<dyn weir::transport::Source> {
    let broker: std::sync::Arc<dyn Broker> = if kafka {
        services::kafka()
    } else {
        services::nats(true).await
    };
    broker
        .subscribe(&Subscription::new(
            format!("{prefix}.results"),
            format!("{prefix}-reader"),
        ))
        .await
        .unwrap()
}

/// A state manager, workers `a` and `b` (processes 1 and 2) with two task slots each,
/// and a client (process `client`) running one workflow with one-and-a-half-second
/// tasks and waiting for it; started once the first task has reported, so the workers
/// are mid-task.
struct MidTask {
    processes: Processes,
    client: usize,
    results: Box<dyn weir::transport::Source>,
}

impl MidTask {
    async fn start(kafka: bool, file: &tempfile::NamedTempFile, prefix: &str) -> Self {
        let executor = format!("{prefix}x");
        let mut processes = Processes(Vec::new());
        processes.0.push(weir(file, prefix, "run", &["run"]));
        for name in ["a", "b"] {
            processes.0.push(weir(
                file,
                prefix,
                name,
                &["worker", "--executor", &executor, "--concurrency", "2"],
            ));
        }
        // Let the state manager and both workers join their groups.
        tokio::time::sleep(Duration::from_secs(if kafka { 8 } else { 2 })).await;
        let workflow = format!("{prefix}w");
        // Among the processes, so that it is killed too if the test fails part way.
        let client = processes.0.len();
        processes.0.push(weir(
            file,
            prefix,
            "client",
            &[
                "workflow",
                "run",
                &workflow,
                "--context",
                r#"{"sleep_ms": 1500}"#,
                "--wait",
            ],
        ));
        let mut results = results_reader(kafka, prefix).await;
        tokio::time::timeout(Duration::from_secs(60), results.next())
            .await
            .expect("a first result")
            .unwrap();
        Self {
            processes,
            client,
            results,
        }
    }
}

/// What `weir workflow run --wait` printed, checked: it exited 0, and the execution and
/// every one of its tasks completed.
fn completed(status: ExitStatus, stdout: &[u8]) -> Value {
    assert!(status.success(), "{status}");
    let summary: Value = serde_json::from_slice(stdout).expect("--wait prints JSON");
    assert_eq!(summary["status"], "completed", "{summary}");
    let tasks = summary["tasks"].as_object().unwrap();
    assert_eq!(tasks.len(), TASKS, "{summary}");
    for (id, t) in tasks {
        assert_eq!(t["status"], "completed", "task {id}: {t}");
    }
    summary
}

async fn killed_worker_loses_no_task(kafka: bool) {
    let prefix = services::unique("wk");
    let _cleanup = services::cleanup(&prefix);
    let file = config(kafka, &prefix);
    let executor = format!("{prefix}x");
    let MidTask {
        mut processes,
        client,
        ..
    } = MidTask::start(kafka, &file, &prefix).await;
    let worker_a = &mut processes.0[1];
    let status = Command::new("kill")
        .args(["-KILL", &worker_a.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let _ = worker_a.wait();
    let (status, stdout) = exited(
        &mut processes.0[client],
        Duration::from_secs(90),
        "workflow run --wait, 90 s after the kill",
    )
    .await;
    let summary = completed(status, &stdout);
    for (id, t) in summary["tasks"].as_object().unwrap() {
        assert_eq!(t["executor"], Value::String(executor.clone()), "task {id}");
    }
    // `weir workflow status` prints the same JSON.
    let id = summary["execution"].as_str().unwrap();
    let status_command = processes.0.len();
    processes
        .0
        .push(weir(&file, &prefix, "status", &["workflow", "status", id]));
    let (status, stdout) = exited(
        &mut processes.0[status_command],
        Duration::from_secs(60),
        "workflow status, within a minute",
    )
    .await;
    assert!(status.success(), "{status}");
    let again: Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(again, summary);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_worker_killed_mid_task_loses_no_task() {
    killed_worker_loses_no_task(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_worker_killed_mid_task_loses_no_task() {
    killed_worker_loses_no_task(false).await;
}

/// Reads every result reported on the results topic from its start, with a reader of
/// its own (one in a group, not polled while the test waited, may have been dropped from
/// it), checks that each attempt completed (none failed or was retried for being run
/// twice), and returns how many there were.
async fn every_result_completed(kafka: bool, prefix: &str) -> usize {
    let broker: std::sync::Arc<dyn Broker> = if kafka {
        services::kafka()
    } else {
        services::nats(true).await
    };
    let mut subscription = Subscription::new(format!("{prefix}.results"), services::unique("r"));
    subscription.assignment = weir::transport::Assignment::All;
    let mut everything = broker.subscribe(&subscription).await.unwrap();
    let mut reported = 0;
    while let Ok(Ok(message)) =
        tokio::time::timeout(Duration::from_secs(5), everything.next()).await
    {
        use weir::codec::{avro::decode_one_or_batch, ExecutionResult};
        for result in decode_one_or_batch::<ExecutionResult>(&message.payload).unwrap() {
            assert_eq!(result.status, "completed", "{result:?}");
            reported += 1;
        }
    }
    reported
}

/// A worker frozen (SIGSTOP) mid-task for longer than JetStream's ack wait, so that a
/// second worker runs its task again, then
/// woken to finish the task and report it late: the workflow completes, and every
/// attempt reported, the late duplicate included, completed.
async fn a_frozen_nats_worker_woken_late_fails_no_task() {
    let prefix = services::unique("wf");
    let _cleanup = services::cleanup(&prefix);
    let file = config_with(false, &prefix, true);
    let executor = format!("{prefix}x");
    let worker = |name: &str| {
        weir(
            &file,
            &prefix,
            name,
            &["worker", "--executor", &executor, "--concurrency", "1"],
        )
    };
    let mut processes = Processes(vec![weir(&file, &prefix, "run", &["run"]), worker("a")]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let workflow = format!("{prefix}w");
    let client = processes.0.len();
    processes.0.push(weir(
        &file,
        &prefix,
        "client",
        &[
            "workflow",
            "run",
            &workflow,
            "--context",
            r#"{"sleep_ms": 1500}"#,
            "--wait",
        ],
    ));
    let mut results = results_reader(false, &prefix).await;
    tokio::time::timeout(Duration::from_secs(60), results.next())
        .await
        .expect("a first result")
        .unwrap();
    // The chain's second task is under way on `a`, the only worker: frozen there, and a
    // second worker started to take the task over once the broker gives up on `a`.
    tokio::time::sleep(Duration::from_millis(500)).await;
    common::servers::signal(&processes.0[1], "STOP");
    processes.0.push(worker("b"));
    tokio::time::sleep(Duration::from_secs(12)).await;
    common::servers::signal(&processes.0[1], "CONT");
    let (status, stdout) = exited(
        &mut processes.0[client],
        Duration::from_secs(120),
        "workflow run --wait, 120 s after the freeze",
    )
    .await;
    completed(status, &stdout);
    drop(results);
    let reported = every_result_completed(false, &prefix).await;
    assert!(
        reported > TASKS,
        "{reported} results for {TASKS} tasks: the frozen worker's task never ran twice"
    );
}

/// Two workers of a Kafka group frozen (SIGSTOP) in turn past the session timeout while
/// a chained workflow runs, then woken: the workflow completes, and every attempt
/// reported completed. (Whether the frozen one held a task depends on which partition
/// the chain's next task went to; the NATS test below makes sure it does.)
async fn kafka_workers_frozen_in_turn_fail_no_task() {
    let prefix = services::unique("wf");
    let _cleanup = services::cleanup(&prefix);
    let file = config_with(true, &prefix, true);
    let MidTask {
        mut processes,
        client,
        results,
    } = MidTask::start(true, &file, &prefix).await;
    // The chain's next task is running on one of the two now; freeze both in turn, so
    // whichever holds it stays frozen past the broker's wait.
    for frozen in [1, 2] {
        common::servers::signal(&processes.0[frozen], "STOP");
        tokio::time::sleep(Duration::from_secs(10)).await;
        common::servers::signal(&processes.0[frozen], "CONT");
    }
    let (status, stdout) = exited(
        &mut processes.0[client],
        Duration::from_secs(120),
        "workflow run --wait, 120 s after the freezes",
    )
    .await;
    completed(status, &stdout);
    drop(results);
    let reported = every_result_completed(true, &prefix).await;
    assert!(reported >= TASKS, "{reported} results for {TASKS} tasks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_nats_worker_woken_late_reports_a_duplicate_and_fails_no_task() {
    a_frozen_nats_worker_woken_late_fails_no_task().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_kafka_workers_fail_no_task() {
    kafka_workers_frozen_in_turn_fail_no_task().await;
}

/// Workflow executions the chained tests run at once.
const EXECUTIONS: usize = 4;

/// Chained workflows under way: a state manager (process 0), one worker with eight
/// task slots (process 1), and `EXECUTIONS` clients each running a workflow of
/// two-second tasks and waiting for it, in a guard of their own so that they are killed
/// too if the test fails part way.
async fn chained_under_way(
    kafka: bool,
    file: &tempfile::NamedTempFile,
    prefix: &str,
) -> (Processes, Processes) {
    let executor = format!("{prefix}x");
    let mut processes = Processes(Vec::new());
    processes.0.push(weir(file, prefix, "run", &["run"]));
    processes.0.push(weir(
        file,
        prefix,
        "worker",
        &["worker", "--executor", &executor, "--concurrency", "8"],
    ));
    // Let the state manager and the worker join their groups.
    tokio::time::sleep(Duration::from_secs(if kafka { 8 } else { 2 })).await;
    let workflow = format!("{prefix}w");
    let waiting = Processes(
        (0..EXECUTIONS)
            .map(|i| {
                weir(
                    file,
                    prefix,
                    &format!("client{i}"),
                    &[
                        "workflow",
                        "run",
                        &workflow,
                        "--context",
                        r#"{"sleep_ms": 2000}"#,
                        "--wait",
                    ],
                )
            })
            .collect(),
    );
    (processes, waiting)
}

/// The broker restarted (nats-server on its file store, Tansu on S3) while chained
/// workflows run: the state manager, the worker and the clients waiting for their
/// executions ride it out, and every execution completes.
async fn chained_workflows_ride_out_a_broker_restart(
    mut server: common::servers::Server,
    broker: String,
) {
    let prefix = services::unique("rs");
    let _cleanup = services::cleanup(&prefix);
    let file = config_on(&broker, &prefix, true);
    let kafka = broker.contains("\"kafka\"");
    let (_processes, mut waiting) = chained_under_way(kafka, &file, &prefix).await;
    // A step or two in: each execution is part way through its six.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    for client in &mut waiting.0 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (status, stdout) = exited(client, left, "an execution 120 s after the restart").await;
        completed(status, &stdout);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chained_workflows_ride_out_a_nats_server_restart() {
    let server = common::servers::Server::nats("");
    let broker = format!(
        "{}\nack_wait_ms = 3000",
        services::nats_table_at(&server.nats_url())
    );
    chained_workflows_ride_out_a_broker_restart(server, broker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chained_workflows_ride_out_a_kafka_broker_restart() {
    let s3 = common::servers::Server::s3();
    let server = common::servers::Server::tansu_on_s3(&s3);
    let broker = format!(
        "kind = \"kafka\"\nbrokers = \"127.0.0.1:{}\"\npartitions = 2\n{}",
        server.port,
        services::fast_group_options_line()
    );
    chained_workflows_ride_out_a_broker_restart(server, broker).await;
}

/// `weir run` killed with SIGKILL while workflows are part way through their chains, and
/// started again: every execution still completes, whichever step the kill fell
/// between (a result applied but its dependents not yet published, say).
async fn a_killed_state_manager_leaves_no_workflow_stuck(kafka: bool) {
    let prefix = services::unique("sm");
    let _cleanup = services::cleanup(&prefix);
    let file = config_with(kafka, &prefix, true);
    let (mut processes, mut waiting) = chained_under_way(kafka, &file, &prefix).await;
    let mut results = results_reader(kafka, &prefix).await;
    // Killed once results are flowing: executions are then between their steps.
    for _ in 0..EXECUTIONS + 2 {
        tokio::time::timeout(Duration::from_secs(60), results.next())
            .await
            .expect("results while the workflows run")
            .unwrap();
    }
    // Six two-second steps each: the executions are still running at the kill, however
    // long the results reader took to join its group.
    assert!(
        waiting
            .0
            .iter_mut()
            .any(|c| c.try_wait().unwrap().is_none()),
        "every execution finished before the kill"
    );
    let state_manager = &mut processes.0[0];
    common::servers::signal(state_manager, "KILL");
    let _ = state_manager.wait();
    processes.0[0] = weir(&file, &prefix, "run-again", &["run"]);
    let deadline = Instant::now() + Duration::from_secs(120);
    for client in &mut waiting.0 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (status, stdout) = exited(client, left, "an execution 120 s after the restart").await;
        completed(status, &stdout);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_state_manager_killed_mid_workflow_leaves_none_stuck() {
    a_killed_state_manager_leaves_no_workflow_stuck(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_state_manager_killed_mid_workflow_leaves_none_stuck() {
    a_killed_state_manager_leaves_no_workflow_stuck(false).await;
}

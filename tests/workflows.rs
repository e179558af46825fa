//! Workflows end to end: state manager → TaskReadyEvents → workers → results, one suite
//! run on the embedded backends and, with `--features it`, over Kafka and over NATS
//! JetStream with state in Redis.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use weir::codec::avro::{decode, decode_one_or_batch, encode, BatchOf};
use weir::codec::{
    CronTick, ExecutionResult, ExecutionResultBatch, TaskReadyBatch, TaskReadyEvent,
};
use weir::cron::scheduler::{register, Scheduler, SchedulerConfig};
use weir::cron::{Schedule, Target};
use weir::dispatch::manager::workflow_start_topic;
use weir::dispatch::{
    DispatchSettings, Route, Router, RunStatus, StateManager, TaskSpec, Workflow, WorkflowExecution,
};
use weir::store::prelude::*;
use weir::store::ExecutionStatus;
use weir::store::StoreError;
use weir::transport::{Broker, Outbound, Position, Sink, Subscription, TransportError};
use weir::worker::{
    HandlerRegistry, TaskContext, TaskHandler, TaskOutcome, Worker, WorkerSettings,
};

/// One broker and store, and names no other test uses.
struct Env {
    broker: Arc<dyn Broker>,
    store: Arc<dyn Store>,
    prefix: String,
    cancel: CancellationToken,
    /// Kept until the test ends: on the shared services, what removes its names then
    /// (`services::Cleanup`, boxed since that module is built with the `it` feature only).
    cleanups: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Env {
    fn new(broker: Arc<dyn Broker>, store: Arc<dyn Store>) -> Self {
        Self {
            broker,
            store,
            prefix: format!("t{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff),
            cancel: CancellationToken::new(),
            cleanups: Vec::new(),
        }
    }

    fn name(&self, what: &str) -> String {
        format!("{}{what}", self.prefix)
    }

    fn results_topic(&self) -> String {
        format!("weir.results.{}", self.prefix)
    }

    fn new_state_manager(&self, workflows: &[Workflow], router: Router) -> StateManager {
        self.new_state_manager_over(self.store.clone(), workflows, router)
    }

    fn new_state_manager_over(
        &self,
        store: Arc<dyn DispatchStore>,
        workflows: &[Workflow],
        router: Router,
    ) -> StateManager {
        StateManager::new(
            store,
            self.broker.sink(),
            workflows.to_vec(),
            router,
            DispatchSettings {
                results_topic: self.results_topic(),
            },
        )
    }

    /// Runs the state manager; returns it, to start executions with.
    fn state_manager(&self, workflows: &[Workflow], router: Router) -> StateManager {
        self.state_manager_over(self.store.clone(), workflows, router)
    }

    fn state_manager_over(
        &self,
        store: Arc<dyn DispatchStore>,
        workflows: &[Workflow],
        router: Router,
    ) -> StateManager {
        let manager = self.new_state_manager_over(store, workflows, router);
        let run = manager
            .clone()
            .run(self.broker.clone(), self.cancel.clone());
        tokio::spawn(async move {
            if let Err(e) = run.await {
                eprintln!("state manager stopped: {e}");
            }
        });
        manager
    }

    fn worker(
        &self,
        executor: &str,
        concurrency: usize,
        handlers: HandlerRegistry,
        workflows: &[Workflow],
    ) {
        self.tenant_worker(None, executor, concurrency, handlers, workflows);
    }

    /// A worker running `tenant`'s tasks only (every tenant's but none's when `None`).
    fn tenant_worker(
        &self,
        tenant: Option<&str>,
        executor: &str,
        concurrency: usize,
        handlers: HandlerRegistry,
        workflows: &[Workflow],
    ) {
        let worker = Worker::new(
            self.broker.clone(),
            self.store.clone(),
            handlers,
            workflows.to_vec(),
            WorkerSettings {
                executor: executor.into(),
                concurrency,
                worker_id: format!("{executor}-worker"),
                results_topic: self.results_topic(),
                tenant: tenant.map(String::from),
            },
        );
        let (executor, cancel) = (executor.to_string(), self.cancel.clone());
        tokio::spawn(async move {
            // A test waiting on tasks that never run says why in its output.
            if let Err(e) = worker.run(cancel).await {
                eprintln!("worker {executor} stopped: {e}");
            }
        });
    }

    fn builtins(&self) -> HandlerRegistry {
        HandlerRegistry::with_builtins(self.broker.sink())
    }

    async fn finished(&self, id: &str, within: Duration) -> WorkflowExecution {
        let deadline = Instant::now() + within;
        loop {
            if let Some(e) = self.store.get_workflow_execution(id).await.unwrap() {
                if e.status != RunStatus::Running {
                    return e;
                }
            }
            assert!(
                Instant::now() < deadline,
                "execution {id} did not finish within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Reads `count` messages of a topic (from the start), failing after `within`.
    async fn read(
        &self,
        topic: &str,
        count: usize,
        within: Duration,
    ) -> Vec<weir::transport::Message> {
        let mut source = self
            .broker
            .subscribe(&Subscription::new(topic, self.name("reader")))
            .await
            .unwrap();
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        while out.len() < count {
            match tokio::time::timeout_at(deadline, source.next()).await {
                Ok(Ok(m)) => out.push(m),
                Ok(Err(e)) => panic!("reading {topic}: {e}"),
                Err(_) => panic!("read {} of {count} messages on {topic}", out.len()),
            }
        }
        out
    }
}

impl Env {
    /// Reads messages of a topic (from the start) until they hold `count` records,
    /// alone or in batches; fails after `within`.
    async fn read_records<T: BatchOf>(
        &self,
        topic: &str,
        count: usize,
        within: Duration,
    ) -> Vec<T> {
        let mut source = self
            .broker
            .subscribe(&Subscription::new(topic, self.name("reader")))
            .await
            .unwrap();
        let mut out = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        while out.len() < count {
            match tokio::time::timeout_at(deadline, source.next()).await {
                Ok(Ok(m)) => out.extend(decode_one_or_batch::<T>(&m.payload).unwrap()),
                Ok(Err(e)) => panic!("reading {topic}: {e}"),
                Err(_) => panic!("read {} of {count} records on {topic}", out.len()),
            }
        }
        out
    }
}

fn flow(name: &str, tasks: Vec<TaskSpec>) -> Workflow {
    Workflow::new(name, tasks).expect("valid workflow")
}

fn task(id: &str, handler: &str) -> TaskSpec {
    TaskSpec {
        backoff: Duration::from_millis(50),
        timeout: Duration::from_secs(10),
        ..TaskSpec::new(id, handler)
    }
}

/// Records when each task ran and how many ran at once.
#[derive(Default)]
struct Recorder {
    spans: Mutex<Vec<(String, Instant, Instant)>>,
    running: Mutex<(usize, usize)>,
    sleep: Duration,
    mark: String,
}

#[async_trait]
impl TaskHandler for Recorder {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        {
            let mut r = self.running.lock().unwrap();
            r.0 += 1;
            r.1 = r.1.max(r.0);
        }
        let began = Instant::now();
        tokio::time::sleep(self.sleep).await;
        self.running.lock().unwrap().0 -= 1;
        let id = task.namespace.rsplit("::").next().unwrap().to_string();
        self.spans
            .lock()
            .unwrap()
            .push((id.clone(), began, Instant::now()));
        TaskOutcome::Completed(json!({ format!("ran_{id}"): self.mark }))
    }
}

fn with(handlers: HandlerRegistry, name: &str, handler: Arc<dyn TaskHandler>) -> HandlerRegistry {
    let mut handlers = handlers;
    handlers.register(name, handler);
    handlers
}

const WAIT: Duration = Duration::from_secs(60);

async fn routing_sends_each_namespace_to_its_executor(env: &Env) {
    let (a, b) = (env.name("a"), env.name("b"));
    let w = flow(
        &env.name("route"),
        vec![
            task("billing", "mark"),
            task("report", "mark"),
            task("other", "mark"),
        ],
    );
    let router = Router::new(
        vec![
            Route::new("**::billing", &a).unwrap(),
            Route::new("*::*::*::report", &b).unwrap(),
        ],
        &a,
    )
    .unwrap();
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, router);
    for (executor, mark) in [(&a, "a"), (&b, "b")] {
        let recorder = Arc::new(Recorder {
            mark: mark.into(),
            ..Recorder::default()
        });
        env.worker(
            executor,
            4,
            with(env.builtins(), "mark", recorder),
            &workflows,
        );
    }
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    assert_eq!(done.context["ran_billing"], "a");
    assert_eq!(done.context["ran_report"], "b");
    assert_eq!(done.context["ran_other"], "a", "the default executor");
    let summary = done.summary();
    assert_eq!(summary["tasks"]["report"]["executor"], json!(b));
    assert_eq!(summary["tasks"]["billing"]["executor"], json!(a));
    let events = env.read(&format!("weir.tasks.{b}"), 1, WAIT).await;
    let event = decode::<TaskReadyEvent>(&events[0].payload).unwrap();
    assert_eq!(event.namespace, w.namespace("report"));
    assert_eq!(event.task_execution_id, format!("{id}/report"));
}

async fn concurrency_never_exceeds_the_limit(env: &Env) {
    let executor = env.name("busy");
    let tasks: Vec<TaskSpec> = (0..8).map(|i| task(&format!("t{i}"), "slow")).collect();
    let w = flow(&env.name("wide"), tasks);
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let recorder = Arc::new(Recorder {
        sleep: Duration::from_millis(200),
        ..Recorder::default()
    });
    env.worker(
        &executor,
        2,
        with(env.builtins(), "slow", recorder.clone()),
        &workflows,
    );
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed);
    let (_, most) = *recorder.running.lock().unwrap();
    assert_eq!(most, 2, "eight ready tasks, two at a time");
    assert_eq!(recorder.spans.lock().unwrap().len(), 8);
}

async fn a_task_failing_twice_completes_on_the_third_attempt(env: &Env) {
    let executor = env.name("retry");
    let w = flow(
        &env.name("flaky"),
        vec![TaskSpec {
            max_attempts: 3,
            backoff: Duration::from_millis(200),
            ..task("flaky", "builtin::fail")
        }],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(&executor, 4, env.builtins(), &workflows);
    let started = Instant::now();
    let id = manager
        .start(&w.name, json!({"fail_times": 2}))
        .await
        .unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    assert_eq!(done.tasks["flaky"].attempts, 3);
    // Backoff 200 ms, then 400 ms.
    assert!(started.elapsed() >= Duration::from_millis(600));
    let results = env.read(&env.results_topic(), 3, WAIT).await;
    let statuses: Vec<String> = results
        .iter()
        .map(|m| {
            decode::<weir::codec::ExecutionResult>(&m.payload)
                .unwrap()
                .status
        })
        .collect();
    assert_eq!(statuses, ["retry", "retry", "completed"]);
}

async fn a_task_failing_past_its_attempts_is_dead_lettered_and_fails_its_workflow(env: &Env) {
    let executor = env.name("doomed");
    let w = flow(
        &env.name("doomed"),
        vec![
            TaskSpec {
                max_attempts: 2,
                ..task("first", "builtin::fail")
            },
            task("after", "builtin::echo").after(["first"]),
        ],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(&executor, 4, env.builtins(), &workflows);
    let id = manager
        .start(&w.name, json!({"fail_times": 5}))
        .await
        .unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed);
    let summary = done.summary();
    assert_eq!(summary["status"], "failed");
    assert_eq!(summary["tasks"]["first"]["status"], "failed");
    assert_eq!(summary["tasks"]["first"]["attempts"], 2);
    assert_eq!(summary["tasks"]["after"]["status"], "pending");
    let dead = env
        .read(&format!("weir.tasks.{executor}.dlq"), 1, WAIT)
        .await;
    let event = decode::<TaskReadyEvent>(&dead[0].payload).unwrap();
    assert_eq!(event.execution_id, id);
    assert!(dead[0]
        .header("weir-error")
        .is_some_and(|e| e.contains("after 2 attempts")));
}

/// Every backend refuses a message this large: Kafka's and NATS's default limits are
/// 1 MB, and the memory broker of this suite is given the same.
const TOO_LARGE: usize = 2 * 1024 * 1024;

struct Huge;

#[async_trait]
impl TaskHandler for Huge {
    async fn run(&self, _: TaskContext) -> TaskOutcome {
        TaskOutcome::Completed(json!({ "blob": "x".repeat(TOO_LARGE) }))
    }
}

async fn a_result_too_large_to_publish_fails_its_task_and_is_dead_lettered(env: &Env) {
    let executor = env.name("huge");
    let w = flow(&env.name("huge"), vec![task("big", "huge")]);
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(
        &executor,
        4,
        with(env.builtins(), "huge", Arc::new(Huge)),
        &workflows,
    );
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
    assert_eq!(done.summary()["tasks"]["big"]["status"], "failed");
    let dead = env
        .read(&format!("weir.tasks.{executor}.dlq"), 1, WAIT)
        .await;
    let event = decode::<TaskReadyEvent>(&dead[0].payload).unwrap();
    assert_eq!(event.execution_id, id);
    assert!(dead[0]
        .header("weir-error")
        .is_some_and(|e| e.contains("result cannot be published")));
}

/// Returns an output nested `depth` objects deep.
struct Deep(usize);

#[async_trait]
impl TaskHandler for Deep {
    async fn run(&self, _: TaskContext) -> TaskOutcome {
        let mut output = json!(1);
        for _ in 0..self.0 {
            output = json!({ "a": output });
        }
        TaskOutcome::Completed(output)
    }
}

/// An output or a starting context nested deeper than weir reads JSON would be stored in
/// the execution, which could then never be loaded again and would stay running for
/// good: the task fails instead, and such a context is refused at the start.
async fn a_task_output_nested_too_deep_fails_its_task(env: &Env) {
    let executor = env.name("deep");
    let w = flow(
        &env.name("deep"),
        vec![TaskSpec {
            max_attempts: 1,
            ..task("nest", "deep")
        }],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(
        &executor,
        4,
        with(env.builtins(), "deep", Arc::new(Deep(101))),
        &workflows,
    );
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
    let task = &done.summary()["tasks"]["nest"];
    assert_eq!(task["status"], "failed");
    assert!(
        task["error"]
            .as_str()
            .is_some_and(|e| e.contains("nested deeper than 100")),
        "{task}"
    );
    let dead = env
        .read(&format!("weir.tasks.{executor}.dlq"), 1, WAIT)
        .await;
    assert!(dead[0]
        .header("weir-error")
        .is_some_and(|e| e.contains("nested deeper than 100")));

    let mut context = json!(1);
    for _ in 0..101 {
        context = json!({ "a": context });
    }
    let refused = manager.start(&w.name, context).await.unwrap_err();
    assert!(
        refused.to_string().contains("nested deeper than 100"),
        "{refused}"
    );
}

/// Deadlines of a workflow this node does not declare, more than a sweep's page of them
/// and due long before its own, are left unread for the nodes that do: its sweeps read
/// none of those executions, and its own workflow still times out.
async fn a_node_never_reads_the_deadlines_of_workflows_it_does_not_declare(env: &Env) {
    let other = flow(&env.name("elsewhere"), vec![task("t", "builtin::echo")])
        .with_timeout(Duration::from_secs(1));
    let nobody = Router::new(Vec::new(), &env.name("nobody")).unwrap();
    for n in 0..1_100 {
        let id = env.name(&format!("other-{n}"));
        let (execution, _) = WorkflowExecution::start(&id, &other, json!({}), None, &nobody, 0);
        assert!(env
            .store
            .create_workflow_execution(&execution)
            .await
            .unwrap());
        env.store
            .set_workflow_deadline(&other.key(), &id, n)
            .await
            .unwrap();
    }
    let counted = Arc::new(CountingReads::new(env.store.clone(), &env.name("other-")));
    a_workflow_running_past_its_timeout_fails_over(env, counted.clone()).await;
    assert_eq!(
        counted.reads(),
        0,
        "executions of an undeclared workflow read"
    );
    // Still there for the nodes that declare that workflow.
    assert_eq!(
        env.store
            .due_workflow_deadlines(&other.key(), i64::MAX, 0, 2_000)
            .await
            .unwrap()
            .len(),
        1_100
    );
}

/// An execution started again under its id, naming another workflow: the execution is
/// the first workflow's, and so is its deadline, not one from the other's timeout.
async fn a_repeated_start_naming_another_workflow_leaves_the_executions_deadline(env: &Env) {
    let executor = env.name("twice");
    let long = flow(&env.name("long"), vec![task("t", "builtin::sleep")])
        .with_timeout(Duration::from_secs(3600));
    let short = flow(&env.name("short"), vec![task("t", "builtin::sleep")])
        .with_timeout(Duration::from_secs(1));
    let manager = env.new_state_manager(
        &[long.clone(), short.clone()],
        Router::new(Vec::new(), &executor).unwrap(),
    );
    let id = env.name("started-twice");
    assert!(manager
        .start_with_id(&long.name, &id, json!({}), None)
        .await
        .unwrap());
    assert!(!manager
        .start_with_id(&short.name, &id, json!({}), None)
        .await
        .unwrap());
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let due_by = |ms: i64| {
        let store = env.store.clone();
        let workflow = long.key();
        async move {
            store
                .due_workflow_deadlines(&workflow, ms, 0, 10)
                .await
                .unwrap()
        }
    };
    assert!(due_by(now_ms + 60_000).await.is_empty(), "deadline moved");
    assert_eq!(due_by(now_ms + 7_200_000).await, [id]);
}

/// A store counting the reads of executions whose id starts with a given prefix.
struct CountingReads {
    store: Arc<dyn Store>,
    prefix: String,
    reads: std::sync::atomic::AtomicUsize,
}

impl CountingReads {
    fn new(store: Arc<dyn Store>, prefix: &str) -> Self {
        Self {
            store,
            prefix: prefix.to_string(),
            reads: Default::default(),
        }
    }

    fn reads(&self) -> usize {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[async_trait]
impl WorkflowStore for CountingReads {
    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        self.store.create_workflow_execution(execution).await
    }

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError> {
        if id.starts_with(&self.prefix) {
            self.reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.store.get_workflow_execution(id).await
    }

    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        self.store.update_workflow_execution(execution).await
    }

    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError> {
        self.store.mark_tasks_published(execution, tasks).await
    }

    async fn published_tasks(
        &self,
        execution: &str,
    ) -> Result<std::collections::BTreeSet<String>, StoreError> {
        self.store.published_tasks(execution).await
    }

    async fn set_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        self.store
            .set_workflow_deadline(workflow, execution, deadline_ms)
            .await
    }

    async fn due_workflow_deadlines(
        &self,
        workflow: &str,
        until_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        self.store
            .due_workflow_deadlines(workflow, until_ms, skip, limit)
            .await
    }

    async fn clear_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
    ) -> Result<(), StoreError> {
        self.store
            .clear_workflow_deadline(workflow, execution)
            .await
    }
}

#[async_trait]
impl TickOutcomes for CountingReads {
    async fn workflow_finished(
        &self,
        origin: &weir::dispatch::CronOrigin,
        execution_id: &str,
        status: RunStatus,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        self.store
            .workflow_finished(origin, execution_id, status, at_ms)
            .await
    }
}

/// Fails every run, counting them.
#[derive(Default)]
struct AlwaysFails {
    runs: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl TaskHandler for AlwaysFails {
    async fn run(&self, _: TaskContext) -> TaskOutcome {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        TaskOutcome::Failed("not today".into())
    }
}

/// A task waiting out its retry backoff when its execution ends (here, timed out) is
/// not run again: its next attempts would fail once more and dead-letter a task whose
/// execution had already failed for another reason.
async fn a_task_whose_execution_ended_during_its_backoff_is_not_run_again(env: &Env) {
    use std::sync::atomic::Ordering;
    let executor = env.name("late");
    let w = flow(
        &env.name("late"),
        vec![TaskSpec {
            max_attempts: 3,
            backoff: Duration::from_secs(3),
            ..task("first", "fails")
        }],
    )
    .with_timeout(Duration::from_millis(500));
    let warm_up = flow(&env.name("warm"), vec![task("w", "builtin::echo")]);
    let workflows = [w.clone(), warm_up.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let fails = Arc::new(AlwaysFails::default());
    env.worker(
        &executor,
        4,
        with(env.builtins(), "fails", fails.clone()),
        &workflows,
    );
    // Once the worker runs tasks (a Kafka group takes seconds to form), the task's
    // first run comes well before its execution's timeout.
    let warm = manager.start(&warm_up.name, json!({})).await.unwrap();
    env.finished(&warm, WAIT).await;
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
    assert!(
        done.summary()["tasks"]["first"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("timed out")),
        "{}",
        done.summary()
    );
    // Past the first backoff (3 s after the first run).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        fails.runs.load(Ordering::SeqCst),
        1,
        "run again after its end"
    );
}

/// Fails with an error larger than any broker takes.
struct LoudFailure;

#[async_trait]
impl TaskHandler for LoudFailure {
    async fn run(&self, _: TaskContext) -> TaskOutcome {
        TaskOutcome::Failed("x".repeat(TOO_LARGE))
    }
}

/// A task failing for good with an error too large for the broker: its dead letter,
/// refused with that error in a header, goes again without its payload and with the
/// error cut short, and the task fails its workflow rather than being run again on
/// every delivery.
async fn a_task_failing_with_an_error_too_large_to_publish_is_dead_lettered(env: &Env) {
    let executor = env.name("loud");
    let w = flow(
        &env.name("loud"),
        vec![TaskSpec {
            max_attempts: 1,
            ..task("shout", "loud")
        }],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(
        &executor,
        4,
        with(env.builtins(), "loud", Arc::new(LoudFailure)),
        &workflows,
    );
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
    let dead = env
        .read(&format!("weir.tasks.{executor}.dlq"), 1, WAIT)
        .await;
    let error = dead[0].header("weir-error").unwrap_or_default();
    assert!(
        error.contains("failed after 1 attempts"),
        "{}",
        &error[..200]
    );
    assert!(error.len() < 10_000, "{} bytes", error.len());
    assert!(dead[0].header(weir::wire::PAYLOAD_OMITTED_HEADER).is_some());
}

async fn a_workflow_running_past_its_timeout_fails(env: &Env) {
    a_workflow_running_past_its_timeout_fails_over(env, env.store.clone()).await;
}

/// The same, with the state manager over `store`.
async fn a_workflow_running_past_its_timeout_fails_over(env: &Env, store: Arc<dyn DispatchStore>) {
    let executor = env.name("slow");
    let w = flow(&env.name("slowflow"), vec![task("nap", "builtin::sleep")])
        .with_timeout(Duration::from_secs(1));
    let workflows = [w.clone()];
    let manager = env.state_manager_over(
        store,
        &workflows,
        Router::new(Vec::new(), &executor).unwrap(),
    );
    env.worker(&executor, 4, env.builtins(), &workflows);
    let id = manager
        .start(&w.name, json!({"sleep_ms": 8000}))
        .await
        .unwrap();
    let began = Instant::now();
    let done = env.finished(&id, WAIT).await;
    assert!(
        began.elapsed() < Duration::from_secs(6),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
    let nap = &done.summary()["tasks"]["nap"];
    assert_eq!(nap["status"], "failed");
    assert!(
        nap["error"]
            .as_str()
            .is_some_and(|e| e.contains("timed out")),
        "{nap}"
    );
}

async fn a_task_running_past_its_own_timeout_fails(env: &Env) {
    let executor = env.name("napper");
    let w = flow(
        &env.name("napflow"),
        vec![TaskSpec {
            timeout: Duration::from_millis(300),
            max_attempts: 1,
            ..task("nap", "builtin::sleep")
        }],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(&executor, 4, env.builtins(), &workflows);
    let id = manager
        .start(&w.name, json!({"sleep_ms": 20000}))
        .await
        .unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
    let nap = &done.summary()["tasks"]["nap"];
    assert_eq!(nap["error"], "timed out after 300 ms", "{nap}");
}

/// A task event of no tenant, or another tenant, on a tenant's executor topic (a
/// producer outside weir, a routing mistake) is set aside, never run.
async fn a_tenants_worker_sets_aside_tasks_of_other_tenants(env: &Env) {
    let (staged, served) = (env.name("staged"), env.name("served"));
    let tenant = env.name("acme");
    let w = flow(&env.name("stray"), vec![task("t", "builtin::echo")]);
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &staged).unwrap());
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let events: Vec<TaskReadyEvent> = env
        .read_records(&format!("weir.tasks.{staged}"), 1, WAIT)
        .await;
    let tenant_topic = format!("{tenant}.weir.tasks.{served}");
    env.broker
        .sink()
        .publish(Outbound::new(
            tenant_topic.clone(),
            encode(&events[0]).unwrap(),
        ))
        .await
        .unwrap();
    env.tenant_worker(Some(&tenant), &served, 4, env.builtins(), &workflows);
    let dead = env.read(&format!("{tenant_topic}.dlq"), 1, WAIT).await;
    assert!(
        dead[0]
            .header(weir::wire::ERROR_HEADER)
            .is_some_and(|e| e.contains("another tenant")),
        "{:?}",
        dead[0].header(weir::wire::ERROR_HEADER)
    );
    assert_eq!(
        decode::<TaskReadyEvent>(&dead[0].payload)
            .unwrap()
            .execution_id,
        id
    );
    let execution = env
        .store
        .get_workflow_execution(&id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        execution.status,
        RunStatus::Running,
        "{}",
        execution.summary()
    );
}

/// Acknowledges each message a few milliseconds late, as a broker across a network does:
/// what comes in meanwhile queues behind the messages awaiting acknowledgement, and
/// leaves several to a message.
struct SlowAcks(Arc<dyn Sink>);

#[async_trait]
impl Sink for SlowAcks {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.0.publish(message).await
    }
}

/// Task events that come in together travel several to a message, but never two of one
/// execution: a message set aside (dead-lettered, say) must not take a sibling with it.
async fn two_tasks_of_one_execution_never_share_a_message(env: &Env) {
    const EXECUTIONS: usize = 40;
    let executor = env.name("fanned");
    let tasks: Vec<TaskSpec> = (0..8)
        .map(|i| task(&format!("t{i}"), "builtin::echo"))
        .collect();
    let w = flow(&env.name("fan"), tasks);
    let workflows = [w.clone()];
    let manager = StateManager::new(
        env.store.clone(),
        Arc::new(SlowAcks(env.broker.sink())),
        workflows.to_vec(),
        Router::new(Vec::new(), &executor).unwrap(),
        DispatchSettings {
            results_topic: env.results_topic(),
        },
    );
    tokio::spawn(manager.clone().run(env.broker.clone(), env.cancel.clone()));
    // Started together, so their events come in together.
    let starts = (0..EXECUTIONS).map(|_| manager.start(&w.name, json!({})));
    for started in futures::future::join_all(starts).await {
        started.unwrap();
    }
    let mut source = env
        .broker
        .subscribe(&Subscription::new(
            format!("weir.tasks.{executor}"),
            env.name("reader"),
        ))
        .await
        .unwrap();
    let (mut events, mut shared) = (0, 0);
    let deadline = tokio::time::Instant::now() + WAIT;
    while events < EXECUTIONS * 8 {
        let message = tokio::time::timeout_at(deadline, source.next())
            .await
            .expect("every task event within the wait")
            .unwrap();
        let batch = decode_one_or_batch::<TaskReadyEvent>(&message.payload).unwrap();
        events += batch.len();
        shared += usize::from(batch.len() > 1);
        let executions: std::collections::BTreeSet<&str> =
            batch.iter().map(|e| e.execution_id.as_str()).collect();
        assert_eq!(
            executions.len(),
            batch.len(),
            "one message, one execution's tasks twice"
        );
    }
    assert_eq!(events, EXECUTIONS * 8);
    // Otherwise the check above saw no batch at all.
    assert!(shared > 0, "no message carried several task events");
}

/// With room for one task, a task waiting out its retry backoff leaves the slot to
/// another: the other finishes first.
async fn a_retrying_task_frees_its_slot_during_the_backoff(env: &Env) {
    let executor = env.name("one");
    let flaky = flow(
        &env.name("flaky"),
        vec![TaskSpec {
            max_attempts: 2,
            backoff: Duration::from_secs(3),
            ..task("flaky", "builtin::fail")
        }],
    );
    let quick = flow(&env.name("quick"), vec![task("quick", "builtin::echo")]);
    let workflows = [flaky.clone(), quick.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(&executor, 1, env.builtins(), &workflows);
    let slow = manager
        .start(&flaky.name, json!({"fail_times": 1}))
        .await
        .unwrap();
    // The first attempt has failed and its backoff begun.
    let deadline = Instant::now() + WAIT;
    loop {
        let e = env.store.get_workflow_execution(&slow).await.unwrap();
        if e.is_some_and(|e| e.tasks["flaky"].attempts >= 1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the first attempt never reported"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fast = manager.start(&quick.name, json!({})).await.unwrap();
    let fast = env.finished(&fast, WAIT).await;
    let slow = env.finished(&slow, WAIT).await;
    assert_eq!(fast.status, RunStatus::Completed);
    assert_eq!(slow.status, RunStatus::Completed, "{}", slow.summary());
    assert!(
        fast.updated_ms < slow.updated_ms,
        "the quick task waited for the retrying one's slot"
    );
}

/// A worker without the task's handler hands the task back for another worker; with no
/// worker that has it, the task is dead-lettered after `max_attempts` deliveries.
async fn a_task_no_worker_can_run_is_dead_lettered_after_its_deliveries(env: &Env) {
    let executor = env.name("nohandler");
    let w = flow(
        &env.name("nohandler"),
        vec![TaskSpec {
            max_attempts: 3,
            ..task("special", "special")
        }],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    env.worker(&executor, 2, env.builtins(), &workflows);
    let id = manager.start(&w.name, json!({})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Failed);
    let dead = env
        .read(&format!("weir.tasks.{executor}.dlq"), 1, WAIT)
        .await;
    assert!(dead[0]
        .header("weir-error")
        .is_some_and(|e| e.contains("delivered 3 times")));
    let deliveries = env.read(&format!("weir.tasks.{executor}"), 3, WAIT).await;
    assert_eq!(deliveries[2].header("weir-deliveries"), Some("3"));
}

async fn a_diamond_runs_in_dependency_order(env: &Env) {
    let executor = env.name("dag");
    let w = flow(
        &env.name("diamond"),
        vec![
            task("join", "rec").after(["left", "right"]),
            task("left", "rec").after(["start"]),
            task("right", "rec").after(["start"]),
            task("start", "rec"),
        ],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let recorder = Arc::new(Recorder {
        sleep: Duration::from_millis(100),
        mark: "x".into(),
        ..Recorder::default()
    });
    env.worker(
        &executor,
        4,
        with(env.builtins(), "rec", recorder.clone()),
        &workflows,
    );
    let id = manager.start(&w.name, json!({"seed": 1})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed);
    let spans: BTreeMap<String, (Instant, Instant)> = recorder
        .spans
        .lock()
        .unwrap()
        .iter()
        .map(|(id, a, b)| (id.clone(), (*a, *b)))
        .collect();
    assert_eq!(spans.len(), 4);
    for (task, before) in [
        ("left", "start"),
        ("right", "start"),
        ("join", "left"),
        ("join", "right"),
    ] {
        assert!(
            spans[task].0 >= spans[before].1,
            "{task} started before {before} ended"
        );
    }
    // Left and right overlap: fan-out runs them at once.
    assert!(spans["left"].0 < spans["right"].1 && spans["right"].0 < spans["left"].1);
    assert_eq!(done.context["seed"], 1);
    assert_eq!(done.context["ran_join"], "x");
}

/// A broker whose first subscribes to each topic fail as a server restarting would
/// make them fail, and every subscribe to `refused` as a topic the broker does not
/// allow; everything else goes through.
struct SubscribesFailAtFirst {
    inner: Arc<dyn Broker>,
    failures: usize,
    attempts: Mutex<BTreeMap<String, usize>>,
    refused: Option<String>,
}

#[async_trait]
impl Broker for SubscribesFailAtFirst {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn weir::transport::Source>, TransportError> {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap();
            let attempt = attempts.entry(subscription.topic.clone()).or_default();
            *attempt += 1;
            *attempt
        };
        if self.refused.as_ref() == Some(&subscription.topic) {
            return Err(TransportError::InvalidTopic {
                topic: subscription.topic.clone(),
                reason: "not allowed".into(),
            });
        }
        if attempt <= self.failures {
            return Err(TransportError::Unreachable {
                broker: self.inner.kind().into(),
                source: "server restarting".into(),
            });
        }
        self.inner.subscribe(subscription).await
    }

    fn sink(&self) -> Arc<dyn Sink> {
        self.inner.sink()
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<weir::transport::PartitionedTopic, TransportError> {
        self.inner.partitioned(topic, partitions).await
    }

    async fn ping(&self) -> Result<(), TransportError> {
        self.inner.ping().await
    }

    fn redelivery_wait(&self) -> Option<Duration> {
        self.inner.redelivery_wait()
    }
}

/// A worker and a state manager starting while subscribing fails for now (a server
/// restarting, a stream being created as another is deleted) try again, and the
/// workflow runs once the broker takes their subscriptions.
async fn subscribing_that_fails_for_now_at_start_is_tried_again(env: &Env) {
    let executor = env.name("patient");
    let w = flow(&env.name("patient"), vec![task("t", "builtin::echo")]);
    let workflows = [w.clone()];
    let flaky = Arc::new(SubscribesFailAtFirst {
        inner: env.broker.clone(),
        failures: 2,
        attempts: Mutex::default(),
        refused: None,
    });
    let starting = Env {
        broker: flaky.clone(),
        store: env.store.clone(),
        prefix: env.prefix.clone(),
        cancel: env.cancel.child_token(),
        cleanups: Vec::new(),
    };
    let manager = starting.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    starting.worker(&executor, 1, starting.builtins(), &workflows);
    let id = manager.start(&w.name, json!({"n": 1})).await.unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    // The start topic's subscription, made last, may still be waiting to try again.
    let topics = [
        format!("weir.tasks.{executor}"),
        w.topic(&env.results_topic()),
        w.topic(&workflow_start_topic(&w.name)),
    ];
    let deadline = Instant::now() + WAIT;
    loop {
        let attempts = flaky.attempts.lock().unwrap().clone();
        if topics.iter().all(|t| attempts.get(t) == Some(&3)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "each subscription made on its third attempt: {attempts:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Handler counting runs per execution.
#[derive(Default)]
struct Counter(Mutex<BTreeMap<String, u32>>);

#[async_trait]
impl TaskHandler for Counter {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        *self.0.lock().unwrap().entry(task.execution_id).or_default() += 1;
        TaskOutcome::Completed(Value::Null)
    }
}

async fn a_cron_triggered_workflow_runs_once_per_tick(env: &Env) {
    let executor = env.name("cron");
    let w = flow(&env.name("nightly"), vec![task("only", "count")]);
    let workflows = [w.clone()];
    env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let counter = Arc::new(Counter::default());
    env.worker(
        &executor,
        4,
        with(env.builtins(), "count", counter.clone()),
        &workflows,
    );
    let mut schedule = Schedule::new(env.name("every-second"), "* * * * * *", "UTC");
    schedule.target = Target::Workflow(w.name.clone());
    schedule.overlap = weir::cron::Overlap::Allow;
    schedule.payload = json!({"from": "cron"});
    register(env.store.as_ref(), &schedule, 1).await.unwrap();
    let scheduler_stop = CancellationToken::new();
    let scheduler = tokio::spawn(
        Scheduler::new(
            env.store.clone(),
            env.broker.sink(),
            SchedulerConfig {
                lease_ttl: Duration::from_millis(900),
                ..SchedulerConfig::new(env.name("node"))
            },
        )
        .run(scheduler_stop.clone()),
    );
    tokio::time::sleep(Duration::from_millis(3300)).await;
    scheduler_stop.cancel();
    scheduler.await.unwrap();
    let ticks: Vec<CronTick> = env
        .store
        .executions(&schedule.id, 100)
        .await
        .unwrap()
        .executions
        .into_iter()
        .map(|e| CronTick {
            schedule_id: e.schedule_id,
            tick_id: e.tick_id,
            scheduled_time_ms: e.scheduled_ms,
            emitted_time_ms: e.updated_ms,
            fencing_token: e.fencing_token as i64,
            delivery: "at_most_once".into(),
            attempt: 1,
            payload: r#"{"from": "cron"}"#.into(),
            node_id: e.node_id,
            tenant: None,
        })
        .collect();
    assert!(
        ticks.len() >= 2,
        "a schedule every second fired {} times",
        ticks.len()
    );
    // A redelivered tick starts nothing new.
    env.broker
        .sink()
        .publish(Outbound::new(
            workflow_start_topic(&w.name),
            encode(&ticks[0]).unwrap(),
        ))
        .await
        .unwrap();
    for tick in &ticks {
        let done = env.finished(&tick.tick_id, WAIT).await;
        assert_eq!(done.status, RunStatus::Completed);
        assert_eq!(done.context["from"], "cron");
    }
    // The cron executions take their workflow's outcome.
    let deadline = Instant::now() + WAIT;
    loop {
        let executions = env
            .store
            .executions(&schedule.id, 100)
            .await
            .unwrap()
            .executions;
        if executions
            .iter()
            .all(|e| e.status == ExecutionStatus::Completed)
        {
            break;
        }
        assert!(Instant::now() < deadline, "cron executions: {executions:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let runs = counter.0.lock().unwrap().clone();
    assert_eq!(runs.len(), ticks.len());
    assert!(runs.values().all(|&n| n == 1), "runs per tick: {runs:?}");
}

/// A state manager that stored an execution and stopped before publishing its ready
/// tasks: a repeated start publishes them, once, after the publish grace; within the
/// grace it asks to be retried, so a task still being published is not sent twice.
async fn a_start_stored_but_never_published_is_published_once(env: &Env) {
    let executor = env.name("stalled");
    let w = flow(&env.name("stalled"), vec![task("first", "builtin::echo")]);
    let router = Router::new(Vec::new(), &executor).unwrap();
    let manager = env.new_state_manager(std::slice::from_ref(&w), router.clone());
    let long_ago = weir::transport::now_ms() - 60_000;
    let id = env.name("stalled-run");
    let (stalled, _) = WorkflowExecution::start(&id, &w, json!({}), None, &router, long_ago);
    assert!(env.store.create_workflow_execution(&stalled).await.unwrap());
    assert!(!manager
        .start_with_id(&w.name, &id, json!({}), None)
        .await
        .unwrap());
    let events = env
        .read(&weir::dispatch::executor_topic(&executor), 1, WAIT)
        .await;
    let event: TaskReadyEvent = decode(&events[0].payload).unwrap();
    assert_eq!(event.execution_id, id);
    assert!(env
        .store
        .published_tasks(&id)
        .await
        .unwrap()
        .contains("first"));
    // Recorded now: a further repeat publishes nothing.
    manager
        .start_with_id(&w.name, &id, json!({}), None)
        .await
        .unwrap();

    let fresh = env.name("fresh-run");
    let (just_stored, _) = WorkflowExecution::start(
        &fresh,
        &w,
        json!({}),
        None,
        &router,
        weir::transport::now_ms(),
    );
    assert!(env
        .store
        .create_workflow_execution(&just_stored)
        .await
        .unwrap());
    let pending = manager
        .start_with_id(&w.name, &fresh, json!({}), None)
        .await
        .expect_err("its first publish may still be under way");
    assert!(pending.is_retryable(), "{pending}");
}

/// Two nodes declare one workflow each; their workers report on the same results topic.
/// Each result reaches the node that declares its workflow, so every execution ends.
async fn each_result_reaches_a_node_that_declares_its_workflow(env: &Env) {
    let executor = env.name("shared");
    let (left, right) = (
        flow(
            &env.name("left"),
            vec![task("one", "mark"), task("two", "mark")],
        ),
        flow(
            &env.name("right"),
            vec![task("one", "mark"), task("two", "mark")],
        ),
    );
    let router = || Router::new(Vec::new(), &executor).unwrap();
    let left_node = env.state_manager(std::slice::from_ref(&left), router());
    let right_node = env.state_manager(std::slice::from_ref(&right), router());
    let both = [left.clone(), right.clone()];
    let marker = Arc::new(Recorder {
        mark: "done".into(),
        ..Recorder::default()
    });
    env.worker(&executor, 8, with(env.builtins(), "mark", marker), &both);
    let mut ids = Vec::new();
    for _ in 0..6 {
        ids.push(left_node.start(&left.name, json!({})).await.unwrap());
        ids.push(right_node.start(&right.name, json!({})).await.unwrap());
    }
    for id in ids {
        let done = env.finished(&id, WAIT).await;
        assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
        assert_eq!(done.context["ran_two"], "done");
    }
}

/// Counts the runs of each execution's task, each run taking `sleep`.
#[cfg(feature = "it")]
#[derive(Default)]
struct RunCounter {
    runs: Mutex<BTreeMap<String, usize>>,
    sleep: Duration,
}

#[cfg(feature = "it")]
#[async_trait]
impl TaskHandler for RunCounter {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        *self
            .runs
            .lock()
            .unwrap()
            .entry(task.execution_id.clone())
            .or_default() += 1;
        tokio::time::sleep(self.sleep).await;
        TaskOutcome::Completed(json!({}))
    }
}

/// A message of several TaskReadyEvents, as a state manager sends when many tasks
/// become ready at once: a worker runs each task, and a task that fails for good is set
/// aside by itself, not with the batch it came in.
async fn a_batch_of_task_events_runs_each_task_and_sets_aside_only_its_failure(env: &Env) {
    // The state manager routes to an executor no worker serves; its events are then sent
    // on as one batch to the executor a worker serves.
    let (staged, served) = (env.name("staged"), env.name("served"));
    let w = flow(
        &env.name("batched"),
        vec![TaskSpec {
            max_attempts: 1,
            ..task("t", "builtin::fail")
        }],
    );
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &staged).unwrap());
    let mut ids = Vec::new();
    for fail_times in [0, 0, 1, 0, 0] {
        let context = json!({ "fail_times": fail_times });
        ids.push(manager.start(&w.name, context).await.unwrap());
    }
    let events: Vec<TaskReadyEvent> = env
        .read_records(&format!("weir.tasks.{staged}"), ids.len(), WAIT)
        .await;
    let batch = encode(&TaskReadyBatch { events }).unwrap();
    env.broker
        .sink()
        .publish(Outbound::new(format!("weir.tasks.{served}"), batch))
        .await
        .unwrap();
    env.worker(&served, 8, env.builtins(), &workflows);
    for (i, id) in ids.iter().enumerate() {
        let done = env.finished(id, WAIT).await;
        let expected = if i == 2 {
            RunStatus::Failed
        } else {
            RunStatus::Completed
        };
        assert_eq!(done.status, expected, "{}", done.summary());
    }
    let dead = env.read(&format!("weir.tasks.{served}.dlq"), 1, WAIT).await;
    let alone = decode::<TaskReadyEvent>(&dead[0].payload).unwrap();
    assert_eq!(alone.execution_id, ids[2]);
}

/// A message of several ExecutionResults, as a worker sends when many tasks finish at
/// once: the state manager applies each to its own execution.
async fn a_batch_of_results_advances_each_execution(env: &Env) {
    let executor = env.name("unserved");
    let w = flow(&env.name("reported"), vec![task("t", "builtin::echo")]);
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(manager.start(&w.name, json!({})).await.unwrap());
    }
    let events: Vec<TaskReadyEvent> = env
        .read_records(&format!("weir.tasks.{executor}"), ids.len(), WAIT)
        .await;
    let results = events
        .iter()
        .map(|event| {
            let output = json!({ "reported": event.execution_id });
            let mut result = completed_as(&event.execution_id, &event.namespace, output);
            result.task_execution_id = event.task_execution_id.clone();
            result
        })
        .collect();
    let batch = encode(&ExecutionResultBatch { results }).unwrap();
    env.broker
        .sink()
        .publish(Outbound::new(env.results_topic(), batch))
        .await
        .unwrap();
    for id in &ids {
        let done = env.finished(id, WAIT).await;
        assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
        assert_eq!(done.context["reported"], json!(id));
    }
}

/// A worker's report that `task` of execution `execution` completed with `output`, under
/// the namespace `workflow` gives the task.
fn completed(workflow: &Workflow, execution: &str, task: &str, output: Value) -> ExecutionResult {
    completed_as(execution, &workflow.namespace(task), output)
}

/// A worker's report that the task of `namespace` in `execution` completed with
/// `output`, made by hand.
fn completed_as(execution: &str, namespace: &str, output: Value) -> ExecutionResult {
    let task = namespace.rsplit("::").next().unwrap_or_default();
    ExecutionResult {
        execution_id: execution.into(),
        task_execution_id: format!("{execution}/{task}"),
        namespace: namespace.into(),
        attempt: 1,
        status: "completed".into(),
        error: None,
        duration_ms: 1,
        worker_id: "by-hand".into(),
        finished_at_ms: weir::transport::now_ms(),
        output: Some(output.to_string()),
    }
}

/// Two state managers share one execution's results. One applies a result from the copy
/// it remembers from before the other's change: that write is refused, and the result
/// is applied again to the stored state. No output is lost, and each task, the join
/// that needs both branches among them, is made ready exactly once.
async fn two_state_managers_sharing_the_results_lose_no_update(env: &Env) {
    let executor = env.name("unserved");
    let w = flow(
        &env.name("fanin"),
        vec![
            task("root", "builtin::echo"),
            task("x", "builtin::echo").after(["root"]),
            task("y", "builtin::echo").after(["root"]),
            task("join", "builtin::echo").after(["x", "y"]),
        ],
    );
    let router = || Router::new(Vec::new(), &executor).unwrap();
    let a = env.new_state_manager(std::slice::from_ref(&w), router());
    let b = env.new_state_manager(std::slice::from_ref(&w), router());
    let id = a.start(&w.name, json!({})).await.unwrap();
    a.apply_result(&completed(&w, &id, "root", json!({"root": "a"})))
        .await
        .unwrap();
    b.apply_result(&completed(&w, &id, "x", json!({"x": "b"})))
        .await
        .unwrap();
    // A remembers the execution as it stored it, with x not yet completed.
    a.apply_result(&completed(&w, &id, "y", json!({"y": "a"})))
        .await
        .unwrap();
    let stored = env
        .store
        .get_workflow_execution(&id)
        .await
        .unwrap()
        .unwrap();
    let summary = stored.summary();
    assert_eq!(summary["tasks"]["x"]["status"], "completed", "{summary}");
    assert_eq!(summary["tasks"]["y"]["status"], "completed", "{summary}");
    assert_eq!(summary["tasks"]["join"]["status"], "ready", "{summary}");
    // B remembers the execution from before y completed.
    b.apply_result(&completed(&w, &id, "join", json!({"join": "b"})))
        .await
        .unwrap();
    let done = env.finished(&id, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    assert_eq!(
        done.context,
        json!({"root": "a", "x": "b", "y": "a", "join": "b"})
    );
    let mut source = env
        .broker
        .subscribe(&Subscription::new(
            weir::dispatch::executor_topic(&executor),
            env.name("reader"),
        ))
        .await
        .unwrap();
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while events.len() < 4 {
        let message = tokio::time::timeout_at(deadline, source.next())
            .await
            .expect("every task event within the wait")
            .unwrap();
        events.extend(decode_one_or_batch::<TaskReadyEvent>(&message.payload).unwrap());
    }
    // Every event was published before its apply_result returned: nothing more comes.
    if let Ok(more) = tokio::time::timeout(Duration::from_secs(1), source.next()).await {
        events.extend(decode_one_or_batch::<TaskReadyEvent>(&more.unwrap().payload).unwrap());
    }
    let mut dispatched: Vec<String> = events.iter().map(|e| e.task_execution_id.clone()).collect();
    dispatched.sort();
    let expected: Vec<String> = ["join", "root", "x", "y"]
        .iter()
        .map(|task| format!("{id}/{task}"))
        .collect();
    assert_eq!(dispatched, expected, "{events:?}");
}

/// A tenant's results topic takes only that tenant's results: a completion of another
/// tenant's task published there, under the first tenant's namespace or under the other
/// tenant's own, leaves that task unfinished and its execution running.
async fn a_result_on_another_tenants_results_topic_is_not_applied(env: &Env) {
    let executor = env.name("unserved");
    let (acme, globex) = (env.name("acme"), env.name("globex"));
    // The same workflow name in both tenants, so acme's namespace names globex's task.
    let report = |tenant: &str| {
        flow(&env.name("report"), vec![task("t", "builtin::echo")]).with_tenant(tenant)
    };
    let (acme_flow, globex_flow) = (report(&acme), report(&globex));
    let workflows = [acme_flow.clone(), globex_flow.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let victim = manager.start(&globex_flow.key(), json!({})).await.unwrap();
    let own = manager.start(&acme_flow.key(), json!({})).await.unwrap();
    let acme_results = acme_flow.topic(&env.results_topic());
    for result in [
        completed(&acme_flow, &victim, "t", json!({"forged": "as acme"})),
        completed(&globex_flow, &victim, "t", json!({"forged": "as globex"})),
        // Last: once it is applied, the state manager has read the two before it.
        completed(&acme_flow, &own, "t", json!({"genuine": "acme"})),
    ] {
        env.broker
            .sink()
            .publish(Outbound::new(
                acme_results.clone(),
                encode(&result).unwrap(),
            ))
            .await
            .unwrap();
    }
    let done = env.finished(&own, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    assert_eq!(done.context["genuine"], "acme");
    // Results on one topic are applied concurrently: give the forged ones time to land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let execution = env
        .store
        .get_workflow_execution(&victim)
        .await
        .unwrap()
        .unwrap();
    let summary = execution.summary();
    assert_eq!(execution.status, RunStatus::Running, "{summary}");
    assert_eq!(summary["tasks"]["t"]["status"], "ready", "{summary}");
    assert_eq!(summary["tasks"]["t"]["attempts"], 0, "{summary}");
    assert_eq!(execution.context, json!({}), "{summary}");
}

/// A result names its task by workflow: one naming another workflow's task of the same
/// name, with this execution's id, is not applied to it; nor is one whose namespace is
/// not `tenant::package::workflow::task`.
async fn a_result_naming_another_workflows_task_is_not_applied(env: &Env) {
    let executor = env.name("unserved");
    let one = flow(&env.name("one"), vec![task("t", "builtin::echo")]);
    let other = flow(&env.name("other"), vec![task("t", "builtin::echo")]);
    let manager = env.state_manager(
        &[one.clone(), other.clone()],
        Router::new(Vec::new(), &executor).unwrap(),
    );
    let victim = manager.start(&other.name, json!({})).await.unwrap();
    manager
        .apply_result(&completed(&one, &victim, "t", json!({"forged": true})))
        .await
        .unwrap();
    let refused = manager
        .apply_result(&completed_as(&victim, "t", json!({"forged": true})))
        .await;
    assert!(
        matches!(refused, Err(weir::dispatch::DispatchError::BadNamespace(_))),
        "{refused:?}"
    );
    let execution = env
        .store
        .get_workflow_execution(&victim)
        .await
        .unwrap()
        .unwrap();
    let summary = execution.summary();
    assert_eq!(execution.status, RunStatus::Running, "{summary}");
    assert_eq!(summary["tasks"]["t"]["status"], "ready", "{summary}");
    assert_eq!(execution.context, json!({}), "{summary}");
    manager
        .apply_result(&completed(&other, &victim, "t", json!({"genuine": true})))
        .await
        .unwrap();
    let done = env.finished(&victim, WAIT).await;
    assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    assert_eq!(done.context, json!({"genuine": true}));
}

/// Tasks longer than the broker's patience with a silent consumer (Kafka's
/// `max.poll.interval.ms`, JetStream's ack wait), on two workers with one slot each: what
/// a worker has read ahead, or is running, is never handed to the other worker
/// meanwhile, so each task runs once. (The memory broker has one member per group.)
#[cfg(feature = "it")]
async fn a_task_read_ahead_behind_a_long_one_runs_once(env: &Env, tasks: usize) {
    let executor = env.name("long");
    let w = flow(&env.name("long"), vec![task("slow", "slow")]);
    let workflows = [w.clone()];
    let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
    let counter = Arc::new(RunCounter {
        sleep: Duration::from_secs(8),
        ..RunCounter::default()
    });
    for _ in 0..2 {
        env.worker(
            &executor,
            1,
            with(env.builtins(), "slow", counter.clone()),
            &workflows,
        );
    }
    let mut ids = Vec::new();
    for _ in 0..tasks {
        ids.push(manager.start(&w.name, json!({})).await.unwrap());
    }
    for id in &ids {
        let done = env.finished(id, WAIT).await;
        assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
    }
    let runs = counter.runs.lock().unwrap().clone();
    for id in &ids {
        assert_eq!(runs.get(id), Some(&1), "runs of each task: {runs:?}");
    }
}

macro_rules! suite {
    ($env:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn routing() {
            routing_sends_each_namespace_to_its_executor(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn concurrency() {
            concurrency_never_exceeds_the_limit(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retries() {
            a_task_failing_twice_completes_on_the_third_attempt(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn dead_letters() {
            a_task_failing_past_its_attempts_is_dead_lettered_and_fails_its_workflow(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn unpublishable_results() {
            a_result_too_large_to_publish_fails_its_task_and_is_dead_lettered(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn outputs_nested_too_deep() {
            a_task_output_nested_too_deep_fails_its_task(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn started_again_under_another_workflow() {
            a_repeated_start_naming_another_workflow_leaves_the_executions_deadline(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn other_workflows_deadlines_left_unread() {
            a_node_never_reads_the_deadlines_of_workflows_it_does_not_declare(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn ended_during_a_backoff() {
            a_task_whose_execution_ended_during_its_backoff_is_not_run_again(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn errors_too_large_to_publish() {
            a_task_failing_with_an_error_too_large_to_publish_is_dead_lettered(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn timeouts() {
            a_workflow_running_past_its_timeout_fails(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn batches_keep_an_executions_tasks_apart() {
            two_tasks_of_one_execution_never_share_a_message(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn task_timeouts() {
            a_task_running_past_its_own_timeout_fails(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn tenant_workers() {
            a_tenants_worker_sets_aside_tasks_of_other_tenants(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retry_backoff_frees_the_slot() {
            a_retrying_task_frees_its_slot_during_the_backoff(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn tasks_without_a_handler() {
            a_task_no_worker_can_run_is_dead_lettered_after_its_deliveries(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn failed_subscribes_at_start() {
            subscribing_that_fails_for_now_at_start_is_tried_again(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn diamond() {
            a_diamond_runs_in_dependency_order(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn stalled_start() {
            a_start_stored_but_never_published_is_published_once(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn results_across_nodes() {
            each_result_reaches_a_node_that_declares_its_workflow(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn batched_task_events() {
            a_batch_of_task_events_runs_each_task_and_sets_aside_only_its_failure(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn batched_results() {
            a_batch_of_results_advances_each_execution(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn cron_ticks() {
            a_cron_triggered_workflow_runs_once_per_tick(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn results_applied_from_a_stale_copy() {
            two_state_managers_sharing_the_results_lose_no_update(&$env).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn results_on_another_tenants_topic() {
            a_result_on_another_tenants_results_topic_is_not_applied(&$env).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn results_naming_another_workflow() {
            a_result_naming_another_workflows_task_is_not_applied(&$env).await;
        }
    };
}

mod memory {
    use super::*;
    use weir::store::memory::MemoryStore;
    use weir::transport::memory::MemoryBroker;

    fn env() -> Env {
        Env::new(
            Arc::new(MemoryBroker::with_max_message_bytes(1, 1_000_000)),
            Arc::new(MemoryStore::new()),
        )
    }

    suite!(env());

    /// A consumer the state manager cannot start (its start topic refused, after the
    /// results topic's loop started) ends it with the reason, as one failing later does:
    /// the node's token is cancelled, so what it started stops on it, and the run waits
    /// for that before it returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_consumer_that_cannot_start_stops_the_state_manager_on_its_token() {
        let env = env();
        let w = flow(&env.name("unstartable"), vec![task("a", "builtin::echo")]);
        let start_topic = w.topic(&workflow_start_topic(&w.name));
        let broker: Arc<dyn Broker> = Arc::new(SubscribesFailAtFirst {
            inner: env.broker.clone(),
            failures: 0,
            attempts: Mutex::default(),
            refused: Some(start_topic.clone()),
        });
        let manager = env.new_state_manager(&[w], Router::new(Vec::new(), "x").unwrap());
        let stopped = tokio::time::timeout(WAIT, manager.run(broker, env.cancel.clone()))
            .await
            .expect("the run returns");
        let e = stopped.expect_err("the start topic cannot be read");
        assert!(e.to_string().contains(&start_topic), "{e}");
        assert!(
            env.cancel.is_cancelled(),
            "the loops it started stop on the token"
        );
    }

    /// Refuses for good every message to one topic, keeping them; passes the rest on.
    struct Refusing {
        inner: Arc<dyn Sink>,
        topic: String,
        refused: Mutex<Vec<Outbound>>,
    }

    #[async_trait]
    impl Sink for Refusing {
        async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
            if message.topic == self.topic {
                let topic = message.topic.clone();
                self.refused.lock().unwrap().push(message);
                return Err(TransportError::Publish {
                    topic: topic.to_string(),
                    source: "not allowed".into(),
                    retryable: false,
                });
            }
            self.inner.publish(message).await
        }
    }

    /// A start that stored its execution but could not publish its first tasks fails
    /// the execution with the reason: started under a fresh id, nothing would publish
    /// those tasks later, and it would stay running for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_start_whose_first_tasks_cannot_be_published_fails_its_execution() {
        let env = env();
        let executor = env.name("refused");
        let w = flow(&env.name("refused"), vec![task("a", "builtin::echo")]);
        let sink = Arc::new(Refusing {
            inner: env.broker.sink(),
            topic: format!("weir.tasks.{executor}"),
            refused: Mutex::default(),
        });
        let manager = StateManager::new(
            env.store.clone(),
            sink.clone(),
            vec![w.clone()],
            Router::new(Vec::new(), &executor).unwrap(),
            DispatchSettings {
                results_topic: env.results_topic(),
            },
        );
        let refused = manager.start(&w.name, json!({})).await.unwrap_err();
        assert!(refused.to_string().contains("not allowed"), "{refused}");
        let sent = sink.refused.lock().unwrap().clone();
        let event = decode_one_or_batch::<TaskReadyEvent>(&sent[0].payload)
            .unwrap()
            .remove(0);
        let execution = env
            .store
            .get_workflow_execution(&event.execution_id)
            .await
            .unwrap()
            .expect("stored before its tasks were published");
        assert_eq!(
            execution.status,
            RunStatus::Failed,
            "{}",
            execution.summary()
        );
        let task = &execution.summary()["tasks"]["a"];
        assert!(
            task["error"]
                .as_str()
                .is_some_and(|e| e.contains("its start did not complete")),
            "{task}"
        );
    }

    /// A worker stopped while the dead letter of a task's last failed attempt cannot be
    /// published: the failure is not reported before its dead letter is out, so the next
    /// worker runs the task again, dead-letters it and fails the workflow. Reported first,
    /// the failure would make the next delivery find the task done, and no dead letter
    /// would ever be written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_letter_the_broker_refuses_is_written_by_the_next_worker() {
        use std::sync::atomic::Ordering;
        let env = env();
        let down = Arc::new(common::DeadLettersDown {
            inner: env.broker.sink(),
            down: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            refused: Arc::default(),
            for_good: false,
        });
        let executor = env.name("doomed");
        let w = flow(
            &env.name("doomed"),
            vec![TaskSpec {
                max_attempts: 1,
                ..task("first", "builtin::fail")
            }],
        );
        let workflows = [w.clone()];
        let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
        let settings = || WorkerSettings {
            executor: executor.clone(),
            concurrency: 1,
            worker_id: format!("{executor}-worker"),
            results_topic: env.results_topic(),
            tenant: None,
        };
        let first_stop = CancellationToken::new();
        let first = Worker::new(
            Arc::new(common::WithSink {
                broker: env.broker.clone(),
                sink: down.clone(),
            }),
            env.store.clone(),
            env.builtins(),
            workflows.to_vec(),
            settings(),
        );
        let first = tokio::spawn(first.run(first_stop.clone()));
        let id = manager
            .start(&w.name, json!({"fail_times": 5}))
            .await
            .unwrap();
        let deadline = Instant::now() + WAIT;
        while down.refused.load(Ordering::SeqCst) == 0 {
            assert!(Instant::now() < deadline, "no dead letter tried");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        first_stop.cancel();
        let _ = first.await;
        let execution = env
            .store
            .get_workflow_execution(&id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            execution.status,
            RunStatus::Running,
            "{}",
            execution.summary()
        );

        down.down.store(false, Ordering::SeqCst);
        env.worker(&executor, 1, env.builtins(), &workflows);
        let done = env.finished(&id, WAIT).await;
        assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
        let dead = env
            .read(&format!("weir.tasks.{executor}.dlq"), 1, WAIT)
            .await;
        let event = decode::<TaskReadyEvent>(&dead[0].payload).unwrap();
        assert_eq!(event.execution_id, id);
    }
}

#[cfg(feature = "it")]
mod kafka {
    use super::*;

    async fn env() -> Env {
        let prefix = common::services::unique("weir-wf-");
        let mut env = Env::new(
            common::services::kafka(),
            common::services::redis(&prefix).await,
        );
        env.cleanups = vec![
            Box::new(common::services::cleanup(&prefix)),
            Box::new(common::services::cleanup(&env.prefix)),
        ];
        env
    }

    suite!(env().await);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_tasks_keep_their_read_ahead() {
        // One partition: one worker runs them all, one at a time.
        a_task_read_ahead_behind_a_long_one_runs_once(&env().await, 3).await;
    }
}

#[cfg(feature = "it")]
mod nats {
    use super::*;

    async fn env() -> Env {
        env_and_store_prefix().await.0
    }

    /// An environment, and the prefix of its store's Redis keys, for tests that write
    /// keys as something else would.
    async fn env_and_store_prefix() -> (Env, String) {
        let prefix = common::services::unique("weir-wf-");
        let mut env = Env::new(
            common::services::nats(true).await,
            common::services::redis(&prefix).await,
        );
        env.cleanups = vec![
            Box::new(common::services::cleanup(&prefix)),
            Box::new(common::services::cleanup(&env.prefix)),
        ];
        (env, prefix)
    }

    /// Stores execution `id` in a form no node can read, as something else might.
    async fn store_unreadable_execution(
        redis: &mut redis::aio::MultiplexedConnection,
        prefix: &str,
        id: &str,
    ) {
        redis::cmd("HSET")
            .arg(format!("{prefix}:wf:{id}"))
            .arg("data")
            .arg("not json")
            .arg("v")
            .arg(1)
            .query_async::<()>(redis)
            .await
            .unwrap();
    }

    suite!(env().await);

    /// An execution stored in a form no node can read (written by something else, say)
    /// and due first: its deadline is dropped with an error logged, instead of stopping
    /// every sweep at it, and the node's own workflow still times out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreadable_execution_holds_up_no_timeout() {
        let (env, prefix) = env_and_store_prefix().await;
        let unreadable = env.name("unreadable");
        let client = redis::Client::open(common::services::redis_url()).unwrap();
        let mut redis = client.get_multiplexed_async_connection().await.unwrap();
        store_unreadable_execution(&mut redis, &prefix, &unreadable).await;
        // Filed under the workflow the node declares, whose sweep reads it first.
        let slowflow = env.name("slowflow");
        env.store
            .set_workflow_deadline(&slowflow, &unreadable, 0)
            .await
            .unwrap();
        a_workflow_running_past_its_timeout_fails(&env).await;
        let due = env
            .store
            .due_workflow_deadlines(&slowflow, i64::MAX, 0, 10)
            .await
            .unwrap();
        assert!(!due.contains(&unreadable), "{due:?}");
    }

    /// Versions before per-workflow deadlines filed every workflow's in one sorted set.
    /// What an upgraded node finds due there is filed under each execution's workflow
    /// and times out as before; due entries whose execution is gone or cannot be read
    /// are dropped. One not due yet stays: its execution may not exist yet.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadlines_filed_together_by_an_earlier_version_still_time_out() {
        let (env, prefix) = env_and_store_prefix().await;
        let executor = env.name("exec");
        let router = Router::new(Vec::new(), &executor).unwrap();
        let w = flow(&env.name("upgraded"), vec![task("t", "builtin::echo")])
            .with_timeout(Duration::from_secs(1));
        let other = flow(&env.name("undeclared"), vec![task("t", "builtin::echo")])
            .with_timeout(Duration::from_secs(1));
        let client = redis::Client::open(common::services::redis_url()).unwrap();
        let mut redis = client.get_multiplexed_async_connection().await.unwrap();
        let shared = format!("{prefix}:wf-deadlines");
        // Created long ago, as the earlier version left them: more than one look's worth.
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for n in 0..150 {
            for (spec, ids) in [(&w, &mut ours), (&other, &mut theirs)] {
                let id = env.name(&format!("{}-{n}", spec.name));
                let (execution, _) =
                    WorkflowExecution::start(&id, spec, json!({}), None, &router, 0);
                assert!(env
                    .store
                    .create_workflow_execution(&execution)
                    .await
                    .unwrap());
                redis::cmd("ZADD")
                    .arg(&shared)
                    .arg(1_000 + n)
                    .arg(&id)
                    .query_async::<()>(&mut redis)
                    .await
                    .unwrap();
                ids.push(id);
            }
        }
        let unreadable = env.name("unreadable");
        store_unreadable_execution(&mut redis, &prefix, &unreadable).await;
        // Filed by an earlier version about to create its execution: not due, so left.
        let starting = env.name("starting");
        let later = i64::MAX / 2;
        for (id, at) in [(&unreadable, 0), (&env.name("gone"), 1), (&starting, later)] {
            redis::cmd("ZADD")
                .arg(&shared)
                .arg(at)
                .arg(id)
                .query_async::<()>(&mut redis)
                .await
                .unwrap();
        }
        env.state_manager(std::slice::from_ref(&w), router);
        for id in &ours {
            let done = env.finished(id, WAIT).await;
            assert_eq!(done.status, RunStatus::Failed, "{}", done.summary());
        }
        let left: Vec<String> = redis::cmd("ZRANGE")
            .arg(&shared)
            .arg(0)
            .arg(-1)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(left, [starting]);
        // The undeclared workflow's wait, filed under it, for the nodes declaring it.
        let filed = env
            .store
            .due_workflow_deadlines(&other.key(), i64::MAX, 0, 1_000)
            .await
            .unwrap();
        assert_eq!(filed, theirs);
        for id in &theirs {
            let execution = env.store.get_workflow_execution(id).await.unwrap().unwrap();
            assert_eq!(execution.status, RunStatus::Running);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_tasks_keep_their_read_ahead() {
        // More than both workers read ahead, so some wait in the client.
        a_task_read_ahead_behind_a_long_one_runs_once(&env().await, 6).await;
    }

    /// A worker reads only a little ahead of what it runs: tasks waiting in the stream
    /// when a second worker joins are left for it, not hoarded by the first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_worker_leaves_the_tasks_it_has_no_room_for_to_another() {
        const TASKS: usize = 12;
        let env = env().await;
        let executor = env.name("shared");
        let w = flow(&env.name("shared"), vec![task("slow", "slow")]);
        let workflows = [w.clone()];
        let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
        let recorder = |mark: &str| {
            Arc::new(Recorder {
                mark: mark.into(),
                sleep: Duration::from_millis(250),
                ..Recorder::default()
            })
        };
        env.worker(
            &executor,
            1,
            with(env.builtins(), "slow", recorder("first")),
            &workflows,
        );
        let mut ids = Vec::new();
        for _ in 0..TASKS {
            ids.push(manager.start(&w.name, json!({})).await.unwrap());
        }
        // Long enough for the first worker to have taken every task, were it unbounded.
        tokio::time::sleep(Duration::from_millis(500)).await;
        env.worker(
            &executor,
            1,
            with(env.builtins(), "slow", recorder("second")),
            &workflows,
        );
        let mut by_second = 0;
        for id in ids {
            let done = env.finished(&id, WAIT).await;
            assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
            by_second += usize::from(done.context["ran_slow"] == "second");
        }
        // The first reads at most two messages ahead of its one slot: the second runs
        // about half of what is left when it joins. Unbounded, the first would have
        // read every task by then, and the second would run none.
        assert!(
            by_second >= TASKS / 4,
            "the second worker ran {by_second} of {TASKS}"
        );
    }

    /// Two workers share an executor; only one has the task's handler. Every task
    /// ends up on it: the other hands back what it cannot run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_without_the_handler_leaves_the_task_to_one_with_it() {
        let env = env().await;
        let executor = env.name("mixed");
        // Any worker of the group may take a handed-back task next: enough deliveries
        // that the one with the handler surely gets each.
        let w = flow(
            &env.name("mixed"),
            vec![TaskSpec {
                max_attempts: 20,
                ..task("special", "special")
            }],
        );
        let workflows = [w.clone()];
        let manager = env.state_manager(&workflows, Router::new(Vec::new(), &executor).unwrap());
        env.worker(&executor, 4, env.builtins(), &workflows);
        let able = Arc::new(Recorder {
            mark: "able".into(),
            ..Recorder::default()
        });
        env.worker(
            &executor,
            4,
            with(env.builtins(), "special", able),
            &workflows,
        );
        let mut ids = Vec::new();
        for _ in 0..8 {
            ids.push(manager.start(&w.name, json!({})).await.unwrap());
        }
        for id in ids {
            let done = env.finished(&id, WAIT).await;
            assert_eq!(done.status, RunStatus::Completed, "{}", done.summary());
            assert_eq!(done.context["ran_special"], "able");
        }
    }
}

//! A worker: a consumer-group member on its executor's topic (`weir.tasks.<key>`). It
//! runs at most `concurrency` tasks at once, reads at most twice that many messages
//! ahead (a message may carry several tasks), holds at most twice that many tasks, and
//! stops fetching beyond it; a task waiting out a retry backoff frees its slot. For
//! each TaskReadyEvent (alone or in a batch) it loads the execution's context from the
//! store, runs the task's handler with the task's timeout, and reports every attempt to
//! the results topic (results finished together share a message). A failed attempt
//! with attempts left is retried here after the task's backoff (doubling each time);
//! the last failure goes to `<topic>.dlq`. A message is acknowledged only after the
//! final results of all its tasks are published, so a worker killed mid-task has its
//! task delivered again.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::handlers::{HandlerRegistry, TaskContext, TaskOutcome};
use crate::codec::avro::{decode_one_or_batch, AvroRecord};
use crate::codec::{ExecutionResult, TaskReadyEvent};
use crate::dispatch::batch::{record_alone, Batcher};
use crate::dispatch::manager::dead_letter;
use crate::dispatch::WorkflowStore;
use crate::dispatch::{split_namespace, Reported, RunStatus, TaskStatus, Workflow};
use crate::metrics as names;
use crate::transport::concurrent::consume_concurrently;
use crate::transport::{
    now_ms, publish_persistently, subscribe_patiently, Broker, Message, Outbound, Sink,
    Subscription, TransportError, SUBSCRIBE_PATIENCE,
};
use crate::wire::{executor_topic, worker_group, DELIVERIES_HEADER};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("worker for executor {executor}: {source}")]
    Transport {
        executor: String,
        source: TransportError,
    },
}

impl WorkerError {
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Transport { source, .. } => source.is_retryable(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct WorkerSettings {
    pub executor: String,
    /// Tasks run at once, at most.
    pub concurrency: usize,
    /// Names this worker in results.
    pub worker_id: String,
    /// Where results go, before tenant qualification (`weir.results`).
    pub results_topic: String,
    /// The tenant whose tasks this worker runs: it reads `tenant.weir.tasks.<executor>`,
    /// reports on `tenant.<results_topic>`, and refuses any other tenant's task.
    pub tenant: Option<String>,
}

impl WorkerSettings {
    /// The topic this worker's tasks arrive on.
    pub fn tasks_topic(&self) -> String {
        crate::tenant::topic(self.tenant.as_deref(), &executor_topic(&self.executor))
    }

    /// The topic this worker reports on.
    pub fn results_topic(&self) -> String {
        crate::tenant::topic(self.tenant.as_deref(), &self.results_topic)
    }
}

/// Runs the tasks of one executor: reads its TaskReadyEvents, runs each task's handler
/// (looked up by name in its [`HandlerRegistry`]) and reports every attempt.
///
/// ```
/// use std::sync::Arc;
/// use tokio_util::sync::CancellationToken;
/// use weir::dispatch::{TaskSpec, Workflow, DEFAULT_EXECUTOR};
/// use weir::store::memory::MemoryStore;
/// use weir::transport::memory::MemoryBroker;
/// use weir::transport::Broker;
/// use weir::worker::{HandlerRegistry, Worker, WorkerSettings};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let broker = Arc::new(MemoryBroker::default());
/// let etl = Workflow::new("etl", vec![TaskSpec::new("load", "builtin::echo")]).unwrap();
/// let worker = Worker::new(
///     broker.clone(),
///     Arc::new(MemoryStore::new()),
///     HandlerRegistry::with_builtins(broker.sink()),
///     vec![etl],
///     WorkerSettings {
///         executor: DEFAULT_EXECUTOR.into(),
///         concurrency: 8,
///         worker_id: "worker-1".into(),
///         results_topic: weir::wire::RESULTS_TOPIC.into(),
///         tenant: None,
///     },
/// );
/// let stop = CancellationToken::new();
/// let running = tokio::spawn(worker.run(stop.clone()));
/// // … a state manager publishes TaskReadyEvents to weir.tasks.default …
/// stop.cancel();
/// running.await.unwrap().unwrap();
/// # }
/// ```
pub struct Worker {
    broker: Arc<dyn Broker>,
    shared: Arc<Shared>,
}

struct Shared {
    store: Arc<dyn WorkflowStore>,
    sink: Arc<dyn Sink>,
    /// Results, several to a message when tasks finish together.
    results: Batcher<ExecutionResult>,
    handlers: HandlerRegistry,
    workflows: BTreeMap<String, Workflow>,
    settings: WorkerSettings,
    /// One permit per task that may run at once. Held only while a handler runs: a task
    /// waiting out its retry backoff leaves its slot to another.
    capacity: Arc<tokio::sync::Semaphore>,
    /// One permit per task this worker holds at once, its execution loaded: the same
    /// bound as the read-ahead, however many tasks the messages read ahead carry.
    held: tokio::sync::Semaphore,
}

/// Task events read ahead of free capacity, per slot: read, they count as in progress
/// (kept alive on JetStream), so none is handed to another worker while it waits here.
const READ_AHEAD_PER_SLOT: usize = 2;

/// The worker's metric handles, labelled with its executor once rather than looked up
/// for every task.
struct TaskMetrics {
    wait: Histogram,
    started: Counter,
    in_use: Gauge,
    duration: Histogram,
    completed: Counter,
    retried: Counter,
    failed: Counter,
    dead_letters: Counter,
}

impl TaskMetrics {
    /// Handles of the recorder installed now: call once it is.
    fn new(executor: &str) -> Self {
        let label = || ("executor", executor.to_string());
        Self {
            wait: histogram!(names::TASK_WAIT_SECONDS, &[label()]),
            started: counter!(names::TASKS_STARTED_TOTAL, &[label()]),
            in_use: gauge!(names::WORKER_CAPACITY_IN_USE, &[label()]),
            duration: histogram!(names::TASK_DURATION_SECONDS, &[label()]),
            completed: counter!(names::TASKS_COMPLETED_TOTAL, &[label()]),
            retried: counter!(names::TASKS_RETRIED_TOTAL, &[label()]),
            failed: counter!(names::TASKS_FAILED_TOTAL, &[label()]),
            dead_letters: counter!(names::DEAD_LETTERS_TOTAL, &[label()]),
        }
    }
}

impl Worker {
    pub fn new(
        broker: Arc<dyn Broker>,
        store: Arc<dyn WorkflowStore>,
        handlers: HandlerRegistry,
        workflows: Vec<Workflow>,
        settings: WorkerSettings,
    ) -> Self {
        let shared = Shared {
            store,
            sink: broker.sink(),
            results: Batcher::new(broker.sink()),
            handlers,
            workflows: workflows.into_iter().map(|w| (w.key(), w)).collect(),
            capacity: Arc::new(tokio::sync::Semaphore::new(settings.concurrency.max(1))),
            held: tokio::sync::Semaphore::new(settings.concurrency.max(1) * READ_AHEAD_PER_SLOT),
            settings,
        };
        Self {
            broker,
            shared: Arc::new(shared),
        }
    }

    /// Runs until cancelled; running tasks get a bounded time to finish.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), WorkerError> {
        let settings = &self.shared.settings;
        let executor = settings.executor.clone();
        let error = |source| WorkerError::Transport {
            executor: executor.clone(),
            source,
        };
        let read_ahead = settings.concurrency.max(1) * READ_AHEAD_PER_SLOT;
        let topic = settings.tasks_topic();
        let group = match &settings.tenant {
            Some(tenant) => worker_group(&format!("{tenant}.{executor}")),
            None => worker_group(&executor),
        };
        let subscription = Subscription::work_queue(topic, group, read_ahead);
        let subscribed =
            subscribe_patiently(&*self.broker, &subscription, SUBSCRIBE_PATIENCE, &cancel).await;
        let Some(source) = subscribed.map_err(&error)? else {
            return Ok(());
        };
        gauge!(names::WORKER_CAPACITY, "executor" => executor.clone())
            .set(settings.concurrency as f64);
        let shared = self.shared.clone();
        let metrics = Arc::new(TaskMetrics::new(&executor));
        // Behind an `Arc`: a token's own clone takes its lock, and this is one per message.
        let stop = Arc::new(cancel.clone());
        consume_concurrently(source, read_ahead, cancel, move |message| {
            let (shared, metrics, stop) = (shared.clone(), metrics.clone(), stop.clone());
            async move { shared.execute(message, &metrics, &stop).await }
        })
        .await
        .map_err(error)
    }
}

impl Shared {
    /// Handles a message of one TaskReadyEvent or a batch of them; true once it is
    /// finished with: each task's result published, or the task dead-lettered, or
    /// dropped as a duplicate.
    async fn execute(
        &self,
        message: Message,
        metrics: &TaskMetrics,
        cancel: &CancellationToken,
    ) -> bool {
        let mut events = match decode_one_or_batch::<TaskReadyEvent>(&message.payload) {
            Ok(events) => events,
            Err(e) => {
                warn!(executor = %self.settings.executor, error = %e, "undecodable task event; dead-lettered");
                return self.dead_letter(&message, &e.to_string(), cancel).await;
            }
        };
        if events.len() == 1 {
            let event = events.pop().expect("one event");
            return self.execute_event(&message, event, metrics, cancel).await;
        }
        let each = events
            .into_iter()
            .map(|event| self.execute_event(&message, event, metrics, cancel));
        futures::future::join_all(each)
            .await
            .into_iter()
            .all(|done| done)
    }

    /// Runs one task of `message`; true once it is finished with.
    async fn execute_event(
        &self,
        message: &Message,
        event: TaskReadyEvent,
        metrics: &TaskMetrics,
        cancel: &CancellationToken,
    ) -> bool {
        // Set aside or handed back, a task goes alone, not with the batch it came in.
        let alone = || record_alone(message, &event, &event.task_execution_id);
        let _held = tokio::select! {
            _ = cancel.cancelled() => return false,
            held = self.held.acquire() => match held {
                Ok(held) => held,
                Err(_) => return false,
            },
        };
        let Some((tenant, workflow_name, task_id)) = split_namespace(&event.namespace) else {
            let why = format!(
                "namespace {:?} is not tenant::package::workflow::task",
                event.namespace
            );
            return self.dead_letter(&alone(), &why, cancel).await;
        };
        if tenant != self.settings.tenant.as_deref() {
            let why = format!(
                "task {} belongs to another tenant than this worker's",
                event.namespace
            );
            return self.dead_letter(&alone(), &why, cancel).await;
        }
        let workflow_key = crate::tenant::key(tenant, workflow_name);
        let execution = loop {
            match self.store.get_workflow_execution(&event.execution_id).await {
                Ok(found) => break found,
                Err(e) if e.is_retryable() => {
                    warn!(executor = %self.settings.executor, error = %e, "cannot load the execution's context; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return false,
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
                Err(e) => return self.dead_letter(&alone(), &e.to_string(), cancel).await,
            }
        };
        let Some(execution) = execution else {
            let why = format!("no workflow execution {}", event.execution_id);
            return self.dead_letter(&alone(), &why, cancel).await;
        };
        if execution.workflow != workflow_key {
            let why = format!(
                "execution {} is of workflow {}, not of {}",
                execution.id, execution.workflow, event.namespace
            );
            return self.dead_letter(&alone(), &why, cancel).await;
        }
        let Some(record) = execution.tasks.get(task_id) else {
            let why = format!("execution {} has no task {task_id}", execution.id);
            return self.dead_letter(&alone(), &why, cancel).await;
        };
        if execution.status != RunStatus::Running
            || matches!(
                record.status,
                TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Skipped
            )
        {
            debug!(task = %event.task_execution_id, "already done; dropped");
            return true;
        }
        let spec = self
            .workflows
            .get(&workflow_key)
            .and_then(|w| w.task(task_id));
        let handler = spec.and_then(|s| self.handlers.get(&s.handler));
        let (Some(spec), Some(handler)) = (spec, handler) else {
            let why = match spec {
                None => format!("this worker does not know task {}", event.namespace),
                Some(s) => format!("no handler registered as {:?}", s.handler),
            };
            let deliveries = message
                .header(DELIVERIES_HEADER)
                .and_then(|d| d.parse::<i32>().ok())
                .unwrap_or(1);
            if deliveries < event.max_attempts.max(1) {
                // Another worker of the executor may know it: handed back to the topic,
                // unkeyed so any partition and member may take it, counting this one.
                debug!(task = %event.task_execution_id, %why, deliveries, "left for another worker");
                let single = alone();
                let mut again = Outbound::new(single.topic.to_string(), single.payload)
                    .header(DELIVERIES_HEADER, (deliveries + 1).to_string());
                again.headers.extend(
                    message
                        .headers
                        .iter()
                        .filter(|(name, _)| name != DELIVERIES_HEADER)
                        .cloned(),
                );
                return publish_persistently(self.sink.as_ref(), again, cancel)
                    .await
                    .is_ok();
            }
            let why = format!("{why} (delivered {deliveries} times)");
            // Dead-lettered before the failure is reported: once the execution is failed,
            // a delivery of the task again finds it done and would dead-letter nothing.
            if !self.dead_letter(&alone(), &why, cancel).await {
                return false;
            }
            let report = self
                .report(
                    &event,
                    event.attempt.max(1) as u32,
                    Reported::Failed(why),
                    0,
                    cancel,
                )
                .await;
            return report != Report::Stopped;
        };
        metrics
            .wait
            .record((now_ms() - event.ready_at_ms).max(0) as f64 / 1000.0);
        // A redelivered task continues from the attempts already reported.
        let mut attempt = (event.attempt.max(1) as u32).max(record.attempts + 1);
        let max_attempts = spec.max_attempts.max(1);
        loop {
            let slot = tokio::select! {
                _ = cancel.cancelled() => return false,
                slot = self.capacity.acquire() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return false,
                },
            };
            metrics.started.increment(1);
            metrics.in_use.increment(1.0);
            let began = Instant::now();
            let task = TaskContext {
                execution_id: execution.id.clone(),
                namespace: event.namespace.clone(),
                attempt,
                context: execution.context.clone(),
            };
            let run = AssertUnwindSafe(handler.run(task)).catch_unwind();
            let outcome = match tokio::time::timeout(spec.timeout, run).await {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(_)) => TaskOutcome::Failed("the handler panicked".into()),
                Err(_) => {
                    TaskOutcome::Failed(format!("timed out after {} ms", spec.timeout.as_millis()))
                }
            };
            // Stored in the execution's context, an output nested deeper than weir reads
            // JSON could never be loaded back: the execution would stay running for good.
            let outcome = match outcome {
                TaskOutcome::Completed(output) => match crate::codec::json::check_depth(&output) {
                    Ok(()) => TaskOutcome::Completed(output),
                    Err(e) => TaskOutcome::Failed(format!("its output: {e}")),
                },
                other => other,
            };
            metrics.in_use.decrement(1.0);
            drop(slot);
            let took = began.elapsed();
            metrics.duration.record(took.as_secs_f64());
            let reported = match outcome {
                TaskOutcome::Completed(v) => Reported::Completed(Some(v)),
                TaskOutcome::Skipped => Reported::Skipped,
                TaskOutcome::Failed(e) if attempt < max_attempts => Reported::Retry(e),
                TaskOutcome::Failed(e) => Reported::Failed(e),
            };
            let duration_ms = took.as_millis() as i64;
            if let Reported::Failed(error) = &reported {
                // Dead-lettered before the failure is reported, as above.
                metrics.failed.increment(1);
                metrics.dead_letters.increment(1);
                let why = format!("failed after {attempt} attempts: {error}");
                if !self.dead_letter(&alone(), &why, cancel).await {
                    return false;
                }
            }
            match self
                .report(&event, attempt, reported.clone(), duration_ms, cancel)
                .await
            {
                Report::Sent => {}
                Report::Stopped => return false,
                Report::Refused(e) => {
                    // The result itself can never be published (larger than the broker
                    // takes): the task fails, with a result small enough to go, and is
                    // dead-lettered rather than delivered again forever.
                    let why = format!("its result cannot be published: {e}");
                    // A failure is dead-lettered already.
                    if !matches!(reported, Reported::Failed(_)) {
                        metrics.failed.increment(1);
                        metrics.dead_letters.increment(1);
                        if !self.dead_letter(&alone(), &why, cancel).await {
                            return false;
                        }
                    }
                    let failed = Reported::Failed(why);
                    return self
                        .report(&event, attempt, failed, duration_ms, cancel)
                        .await
                        != Report::Stopped;
                }
            }
            match reported {
                Reported::Retry(error) => {
                    metrics.retried.increment(1);
                    let delay = spec.retry_delay(attempt + 1);
                    debug!(task = %event.task_execution_id, attempt, %error, ?delay, "retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return false,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    // Its execution may have ended meanwhile (timed out, or failed by
                    // another task): another attempt would only fail it again and
                    // dead-letter a task whose execution is over.
                    if !self.still_to_run(&event.execution_id, task_id).await {
                        debug!(task = %event.task_execution_id, "its execution ended during the backoff; dropped");
                        return true;
                    }
                    attempt += 1;
                }
                Reported::Failed(_) => return true,
                Reported::Completed(_) | Reported::Skipped => {
                    metrics.completed.increment(1);
                    return true;
                }
            }
        }
    }

    /// Publishes one attempt's result, retrying while the broker is away.
    async fn report(
        &self,
        event: &TaskReadyEvent,
        attempt: u32,
        reported: Reported,
        duration_ms: i64,
        cancel: &CancellationToken,
    ) -> Report {
        let (error, output) = match &reported {
            Reported::Completed(v) => (None, v.as_ref().map(|v| v.to_string())),
            Reported::Retry(e) | Reported::Failed(e) => (Some(e.clone()), None),
            Reported::Skipped => (None, None),
        };
        let result = ExecutionResult {
            execution_id: event.execution_id.clone(),
            task_execution_id: event.task_execution_id.clone(),
            namespace: event.namespace.clone(),
            attempt: attempt as i32,
            status: reported.status().to_string(),
            error,
            duration_ms,
            worker_id: self.settings.worker_id.clone(),
            finished_at_ms: now_ms(),
            output,
        };
        let body = match ExecutionResult::codec().encode_body(&result) {
            Ok(b) => b,
            Err(e) => {
                warn!(executor = %self.settings.executor, error = %e, "cannot encode a result");
                return Report::Refused(e.to_string());
            }
        };
        let topic = self.settings.results_topic();
        let key = event.execution_id.as_bytes();
        // A result may share a message with any other task's result.
        match self
            .results
            .publish_persistently(&topic, key, &event.task_execution_id, &body, cancel)
            .await
        {
            Ok(_) => Report::Sent,
            Err(e) if !e.is_retryable() => {
                warn!(executor = %self.settings.executor, error = %e, "result refused by the broker");
                Report::Refused(e.to_string())
            }
            Err(e) => {
                warn!(executor = %self.settings.executor, error = %e, "result not published; the task will be delivered again");
                Report::Stopped
            }
        }
    }

    /// Whether the execution is still running with the task not done. A store that
    /// cannot answer is taken for yes: the attempt runs and reports as it would have.
    async fn still_to_run(&self, execution: &str, task: &str) -> bool {
        match self.store.get_workflow_execution(execution).await {
            Ok(Some(execution)) => {
                execution.status == RunStatus::Running
                    && execution.tasks.get(task).is_some_and(|record| {
                        !matches!(
                            record.status,
                            TaskStatus::Completed | TaskStatus::Failed | TaskStatus::Skipped
                        )
                    })
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }

    async fn dead_letter(&self, message: &Message, why: &str, cancel: &CancellationToken) -> bool {
        dead_letter(self.sink.as_ref(), message, why, cancel).await
    }
}

/// How publishing a result ended.
#[derive(Debug, PartialEq, Eq)]
enum Report {
    Sent,
    /// No retry can publish it; the reason.
    Refused(String),
    /// Shutdown came first: the task will be delivered again.
    Stopped,
}

//! The workflow state manager: starts executions, publishes a TaskReadyEvent for each
//! task whose dependencies completed, and advances executions from the workers'
//! results. Execution state lives in the store and every change is a compare-and-set
//! on its version, so any number of state managers (one per `weir run` node) can share
//! the results topic.
//!
//! Ready events are published after the state that made them ready is stored, and a
//! result is committed on the broker only after both, and then the published tasks are
//! recorded. A crash in between leaves ready tasks no attempt has reported on; the
//! redelivered result (or start) publishes those not recorded as published, so a
//! repeated start does not dispatch a running task again, and workers drop what is
//! already done.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use super::batch::{record_alone, Batcher};
use super::execution::{CronOrigin, Reported, WorkflowExecution};
use super::router::{executor_topic, Router};
use super::store::DispatchStore;
use super::workflow::{split_namespace, Workflow};
use crate::codec::avro::{decode, decode_one_or_batch, AvroRecord};
use crate::codec::{CodecError, CronTick, ExecutionResult, TaskReadyEvent};
use crate::store_error::StoreError;
use crate::transport::concurrent::consume_concurrently;
use crate::transport::{
    now_ms, publish_dead_letter, subscribe_patiently, Broker, Message, Outbound, Sink,
    Subscription, TransportError, SUBSCRIBE_PATIENCE,
};
use crate::wire::{results_group, state_manager_group};

/// Compare-and-set attempts before an update gives up (and the result is redelivered).
const MAX_CAS_ATTEMPTS: u32 = 64;
/// Results applied at once by one state manager.
const RESULTS_IN_FLIGHT: usize = 512;

/// Whether a publish of ready tasks records them as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marks {
    Record,
    /// The marks are read only when the same execution is started again or a result is
    /// applied again. The root tasks of an execution under a freshly drawn id are never
    /// started again, and no result makes them ready: their marks would go unread.
    NotNeeded,
}

/// How long after a change its ready tasks may still be on their way to the broker. A
/// repeated start or result within it waits for their publish to be recorded rather
/// than dispatching them a second time; after it, what is unrecorded is published.
const PUBLISH_GRACE_MS: i64 = 10_000;
/// Executions remembered by a state manager at most; beyond it they are read from the
/// store, so a large backlog costs reads rather than memory.
const RECENT_EXECUTIONS: usize = 20_000;

/// How often the state manager looks for executions past their workflow's timeout, and
/// how many it handles a look.
const DEADLINE_SWEEP: Duration = Duration::from_secs(1);
const DEADLINES_PER_SWEEP: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    #[error("unknown workflow {0:?}")]
    UnknownWorkflow(String),
    #[error("task namespace {0:?} is not tenant::package::workflow::task")]
    BadNamespace(String),
    #[error("no workflow execution {0:?}")]
    UnknownExecution(String),
    #[error("workflow execution {0} changed under too many concurrent updates")]
    Contended(String),
    #[error("ready tasks of workflow execution {0} are still being published")]
    PublishPending(String),
    #[error("workflow store: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Codec(#[from] CodecError),
}

impl DispatchError {
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::UnknownWorkflow(_)
            | Self::BadNamespace(_)
            | Self::UnknownExecution(_)
            | Self::Codec(_) => false,
            Self::Contended(_) | Self::PublishPending(_) => true,
            Self::Store(e) => e.is_retryable(),
            Self::Transport(e) => e.is_retryable(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Where workers report results (`weir.results`).
    pub results_topic: String,
}

impl Default for DispatchSettings {
    fn default() -> Self {
        Self {
            results_topic: crate::wire::RESULTS_TOPIC.into(),
        }
    }
}

/// Topic a schedule's ticks go to when its target is a workflow (qualified by the
/// tenant of both, see [`Workflow::topic`]).
pub use crate::wire::workflow_start_topic;

/// Task execution id: the execution and the task.
pub fn task_execution_id(execution: &str, task: &str) -> String {
    format!("{execution}/{task}")
}

/// The workflow state manager (see the module documentation). Clones share it.
#[derive(Clone)]
pub struct StateManager {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn DispatchStore>,
    /// TaskReadyEvents, several to a message when many become ready at once.
    ready: Batcher<TaskReadyEvent>,
    workflows: BTreeMap<String, Workflow>,
    router: Router,
    settings: DispatchSettings,
    /// Running executions as this state manager last stored them, saving a store read
    /// per result. Only a hint: every write is still compare-and-set, and a stale entry
    /// (another state manager wrote since) is dropped and read afresh.
    recent: std::sync::Mutex<std::collections::HashMap<String, WorkflowExecution>>,
}

impl StateManager {
    pub fn new(
        store: Arc<dyn DispatchStore>,
        sink: Arc<dyn Sink>,
        workflows: Vec<Workflow>,
        router: Router,
        settings: DispatchSettings,
    ) -> Self {
        let workflows = workflows.into_iter().map(|w| (w.key(), w)).collect();
        Self {
            inner: Arc::new(Inner {
                store,
                ready: Batcher::new(sink),
                workflows,
                router,
                settings,
                recent: Default::default(),
            }),
        }
    }

    /// A workflow by its key (`tenant/name`, or `name`).
    pub fn workflow(&self, key: &str) -> Option<&Workflow> {
        self.inner.workflows.get(key)
    }

    pub fn workflows(&self) -> impl Iterator<Item = &Workflow> {
        self.inner.workflows.values()
    }

    /// Starts an execution with a fresh id, returned. A start that fails after the
    /// execution was stored (its first tasks not published) fails the execution too:
    /// nothing would publish those tasks later, as a repeated start under a given id does,
    /// and it would stay running for good.
    pub async fn start(&self, workflow: &str, context: Value) -> Result<String, DispatchError> {
        let id = format!("{:016x}", rand::random::<u64>());
        if let Err(e) = self
            .start_execution(workflow, &id, context, None, Marks::NotNeeded)
            .await
        {
            self.abandon(&id, &e).await;
            return Err(e);
        }
        Ok(id)
    }

    /// Fails the execution `id`, if it was stored, for a start that did not complete.
    async fn abandon(&self, id: &str, why: &DispatchError) {
        let store = &self.inner.store;
        let reason = format!("its start did not complete: {why}");
        for _ in 0..MAX_CAS_ATTEMPTS {
            let mut execution = match store.get_workflow_execution(id).await {
                Ok(Some(execution)) => execution,
                Ok(None) => return,
                Err(e) => {
                    warn!(execution = %id, error = %e, "cannot fail an execution whose start did not complete");
                    return;
                }
            };
            if !execution.fail_unfinished(&reason, now_ms()) {
                return;
            }
            match store.update_workflow_execution(&execution).await {
                Ok(true) => {
                    warn!(execution = %id, %reason, "workflow execution failed");
                    self.forget(id);
                    if let Err(e) = self.finished(&execution).await {
                        warn!(execution = %id, error = %e, "cannot record a failed start's end");
                    }
                    return;
                }
                Ok(false) => continue,
                Err(e) => {
                    warn!(execution = %id, error = %e, "cannot fail an execution whose start did not complete");
                    return;
                }
            }
        }
    }

    /// Starts an execution under `id` unless one exists (then re-publishes its ready
    /// tasks that no attempt reported on). Returns whether it was created.
    pub async fn start_with_id(
        &self,
        workflow: &str,
        id: &str,
        context: Value,
        origin: Option<CronOrigin>,
    ) -> Result<bool, DispatchError> {
        self.start_execution(workflow, id, context, origin, Marks::Record)
            .await
    }

    async fn start_execution(
        &self,
        workflow: &str,
        id: &str,
        context: Value,
        origin: Option<CronOrigin>,
        root_marks: Marks,
    ) -> Result<bool, DispatchError> {
        let spec = self
            .workflow(workflow)
            .ok_or_else(|| DispatchError::UnknownWorkflow(workflow.to_string()))?;
        // Stored in the execution, a context nested deeper than weir reads JSON could
        // never be loaded back.
        crate::codec::json::check_depth(&context)?;
        let (execution, ready) =
            WorkflowExecution::start(id, spec, context, origin, &self.inner.router, now_ms());
        if let Some(timeout) = spec.timeout {
            // Filed before the execution exists: an entry without its execution is
            // dropped by the sweep, an execution without its entry would never time out.
            let deadline = execution.created_ms + timeout.as_millis() as i64;
            self.inner
                .store
                .set_workflow_deadline(&execution.workflow, id, deadline)
                .await?;
        }
        if self
            .inner
            .store
            .create_workflow_execution(&execution)
            .await?
        {
            metrics::counter!(crate::metrics::WORKFLOWS_STARTED_TOTAL, "workflow" => spec.key())
                .increment(1);
            self.remember(&execution);
            debug!(execution = %id, workflow, "workflow execution started");
            self.publish_ready(&execution, spec, &ready, root_marks)
                .await?;
            return Ok(true);
        }
        let existing = self
            .inner
            .store
            .get_workflow_execution(id)
            .await?
            .ok_or_else(|| DispatchError::UnknownExecution(id.to_string()))?;
        // A repeated start keeps the first one's deadline, from the execution's own
        // workflow's timeout, whichever workflow the start names.
        let timeout = self
            .workflow(&existing.workflow)
            .and_then(|workflow| workflow.timeout);
        if let Some(timeout) = timeout {
            let deadline = existing.created_ms + timeout.as_millis() as i64;
            self.inner
                .store
                .set_workflow_deadline(&existing.workflow, id, deadline)
                .await?;
        }
        let unreported = existing.unreported_ready(spec, None);
        self.publish_unpublished(&existing, spec, unreported, existing.created_ms)
            .await?;
        Ok(false)
    }

    pub async fn execution(&self, id: &str) -> Result<Option<WorkflowExecution>, DispatchError> {
        Ok(self.inner.store.get_workflow_execution(id).await?)
    }

    /// Applies a worker's result and publishes what became ready.
    pub async fn apply_result(&self, result: &ExecutionResult) -> Result<(), DispatchError> {
        let Some((tenant, workflow_name, task)) = split_namespace(&result.namespace) else {
            return Err(DispatchError::BadNamespace(result.namespace.clone()));
        };
        // The workflow the result names, tenant-qualified as executions name theirs.
        let named_workflow = crate::tenant::key(tenant, workflow_name);
        let task = task.to_string();
        let reported = match result.status.as_str() {
            "completed" => Reported::Completed(
                result
                    .output
                    .as_deref()
                    .map(serde_json::from_str)
                    .transpose()
                    .map_err(CodecError::Json)?,
            ),
            "skipped" => Reported::Skipped,
            "retry" => Reported::Retry(result.error.clone().unwrap_or_default()),
            _ => Reported::Failed(result.error.clone().unwrap_or_else(|| "failed".into())),
        };
        let mut remembered = self.recalled(&result.execution_id);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let from_memory = remembered.is_some();
            let stored = match remembered.take() {
                Some(execution) => Some(execution),
                None => {
                    self.inner
                        .store
                        .get_workflow_execution(&result.execution_id)
                        .await?
                }
            };
            let Some(mut execution) = stored else {
                warn!(execution = %result.execution_id, "result for an unknown workflow execution; dropped");
                return Ok(());
            };
            // A result names its task by workflow: one naming another workflow (another
            // tenant's, or one with a task of the same name) is not this execution's.
            if named_workflow != execution.workflow {
                warn!(execution = %execution.id, workflow = %execution.workflow, namespace = %result.namespace, "result names another workflow than its execution's; dropped");
                return Ok(());
            }
            let Some(spec) = self.workflow(&execution.workflow) else {
                return Err(DispatchError::UnknownWorkflow(execution.workflow));
            };
            let applied = execution.apply(
                spec,
                &task,
                result.attempt.max(1) as u32,
                reported.clone(),
                result.duration_ms,
                now_ms(),
            );
            if !applied.changed && from_memory {
                // Perhaps applied by another state manager: decide on the stored state.
                self.forget(&execution.id);
                continue;
            }
            if !applied.changed {
                // Already applied: publish what it made ready in case a crash came
                // between storing and publishing.
                let again = execution.unreported_ready(spec, Some(&task));
                return self
                    .publish_unpublished(&execution, spec, again, execution.updated_ms)
                    .await;
            }
            if !self
                .inner
                .store
                .update_workflow_execution(&execution)
                .await?
            {
                self.forget(&execution.id);
                continue;
            }
            if applied.finished {
                self.forget(&execution.id);
            } else {
                self.remember(&execution);
            }
            self.publish_ready(&execution, spec, &applied.ready, Marks::Record)
                .await?;
            if applied.finished {
                self.finished(&execution).await?;
                if spec.timeout.is_some() {
                    // Else the deadline sweep clears it once it falls due; a failure
                    // here leaves it to that.
                    if let Err(e) = self
                        .inner
                        .store
                        .clear_workflow_deadline(&execution.workflow, &execution.id)
                        .await
                    {
                        debug!(execution = %execution.id, error = %e, "deadline of a finished execution left to the sweep");
                    }
                }
            }
            return Ok(());
        }
        Err(DispatchError::Contended(result.execution_id.clone()))
    }

    fn recent(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, WorkflowExecution>> {
        self.inner.recent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the remembered execution out (saving a copy); it is remembered again once
    /// its update is stored, and meanwhile a concurrent result reads the store.
    fn recalled(&self, id: &str) -> Option<WorkflowExecution> {
        self.recent().remove(id)
    }

    fn remember(&self, execution: &WorkflowExecution) {
        let mut recent = self.recent();
        if recent.len() < RECENT_EXECUTIONS || recent.contains_key(&execution.id) {
            recent.insert(execution.id.clone(), execution.clone());
        }
    }

    fn forget(&self, id: &str) {
        self.recent().remove(id);
    }

    async fn publish_ready(
        &self,
        execution: &WorkflowExecution,
        workflow: &Workflow,
        tasks: &[String],
        marks: Marks,
    ) -> Result<(), DispatchError> {
        let publishes = tasks.iter().filter_map(|task| {
            let spec = workflow.task(task)?;
            let executor = execution.tasks.get(task)?.executor.clone();
            let topic = workflow.topic(&executor_topic(&executor));
            let event = TaskReadyEvent {
                execution_id: execution.id.clone(),
                task_execution_id: task_execution_id(&execution.id, task),
                namespace: workflow.namespace(task),
                attempt: 1,
                max_attempts: spec.max_attempts as i32,
                ready_at_ms: now_ms(),
            };
            Some(async move {
                let body = TaskReadyEvent::codec().encode_body(&event)?;
                // Keyed by task and never batched with a task of the same execution, so
                // one execution's parallel tasks spread over partitions and workers.
                let key = event.task_execution_id.into_bytes();
                self.inner
                    .ready
                    .publish(&topic, key, &execution.id, body)
                    .await?;
                metrics::counter!(crate::metrics::TASKS_DISPATCHED_TOTAL, "executor" => executor)
                    .increment(1);
                Ok::<(), DispatchError>(())
            })
        });
        futures::future::try_join_all(publishes).await?;
        if marks == Marks::NotNeeded {
            return Ok(());
        }
        if let Err(e) = self
            .inner
            .store
            .mark_tasks_published(&execution.id, tasks)
            .await
        {
            // The events are out; without the mark a repeated start may dispatch them
            // again, which workers tolerate.
            warn!(execution = %execution.id, error = %e, "could not record published tasks");
        }
        Ok(())
    }

    /// Publishes those of `tasks` (made ready by the change stored at `changed_ms`)
    /// whose events no earlier publish recorded: what a crash between storing and
    /// publishing left behind, and nothing that is running. Within the grace after the
    /// change their first publish may still be under way: a retryable error then.
    async fn publish_unpublished(
        &self,
        execution: &WorkflowExecution,
        workflow: &Workflow,
        mut tasks: Vec<String>,
        changed_ms: i64,
    ) -> Result<(), DispatchError> {
        if tasks.is_empty() {
            return Ok(());
        }
        let published = self.inner.store.published_tasks(&execution.id).await?;
        tasks.retain(|task| !published.contains(task));
        if tasks.is_empty() {
            return Ok(());
        }
        if now_ms() - changed_ms < PUBLISH_GRACE_MS {
            return Err(DispatchError::PublishPending(execution.id.clone()));
        }
        self.publish_ready(execution, workflow, &tasks, Marks::Record)
            .await
    }

    /// An execution ended: count it, and settle the cron execution that started it.
    async fn finished(&self, execution: &WorkflowExecution) -> Result<(), DispatchError> {
        // Debug, not info: at thousands of executions a second the metric below tells
        // operators more than a line each would.
        debug!(execution = %execution.id, workflow = %execution.workflow, status = execution.status.as_str(), "workflow execution finished");
        metrics::counter!(
            crate::metrics::WORKFLOWS_FINISHED_TOTAL,
            "workflow" => execution.workflow.clone(),
            "status" => execution.status.as_str()
        )
        .increment(1);
        let Some(origin) = &execution.origin else {
            return Ok(());
        };
        self.inner
            .store
            .workflow_finished(origin, &execution.id, execution.status, now_ms())
            .await?;
        Ok(())
    }

    /// The state manager: consumes results, and the start topics of every declared
    /// workflow (cron ticks), until cancelled.
    pub async fn run(
        self,
        broker: Arc<dyn Broker>,
        cancel: CancellationToken,
    ) -> Result<(), DispatchError> {
        let mut loops = tokio::task::JoinSet::new();
        // A consumer that cannot start ends the state manager as one failing later does:
        // the loops started before it stop on the token and are waited for, not aborted.
        let mut outcome = self.start_loops(&broker, &cancel, &mut loops).await;
        if let Err(e) = &outcome {
            warn!(error = %e, "state manager consumer cannot start");
            cancel.cancel();
        }
        while let Some(joined) = loops.join_next().await {
            if let Ok(Err(e)) = joined {
                warn!(error = %e, "state manager consumer stopped");
                cancel.cancel();
                // The first failure is the cause; the rest may follow from the stop.
                if outcome.is_ok() {
                    outcome = Err(e.into());
                }
            }
        }
        outcome
    }

    /// Subscribes to the results and start topics of every declared workflow, and
    /// starts a loop consuming each (and the timeout sweep) in `loops`.
    async fn start_loops(
        &self,
        broker: &Arc<dyn Broker>,
        cancel: &CancellationToken,
        loops: &mut tokio::task::JoinSet<Result<(), TransportError>>,
    ) -> Result<(), DispatchError> {
        // Nodes may declare different workflows while their workers report on one
        // results topic. Each workflow reads that topic in a consumer group of its own,
        // so every result reaches a node that declares its workflow, and a node skips
        // the results of workflows it does not run rather than claiming them.
        for workflow in self.workflows() {
            let results_topic = workflow.topic(&self.inner.settings.results_topic);
            let key = workflow.key();
            let (tenant, name) = (workflow.tenant.clone(), workflow.name.clone());
            let subscription = Subscription::work_queue(
                &results_topic,
                results_group(&results_topic, &key),
                RESULTS_IN_FLIGHT,
            );
            let subscribed =
                subscribe_patiently(&**broker, &subscription, SUBSCRIBE_PATIENCE, cancel).await?;
            // Shutdown came first: the loops already running are waited for below.
            let Some(results) = subscribed else {
                continue;
            };
            let me = self.clone();
            let sink = broker.sink();
            // Behind an `Arc`: a token's own clone takes its lock, once per message here.
            let stop = Arc::new(cancel.clone());
            loops.spawn(consume_concurrently(
                results,
                RESULTS_IN_FLIGHT,
                cancel.clone(),
                move |message| {
                    let (me, sink, stop, tenant, name) = (
                        me.clone(),
                        sink.clone(),
                        stop.clone(),
                        tenant.clone(),
                        name.clone(),
                    );
                    async move {
                        let results = match decode_one_or_batch::<ExecutionResult>(&message.payload)
                        {
                            Ok(results) => results,
                            Err(e) => {
                                return settle(Err(e.into()), &message, sink.as_ref(), &stop).await
                            }
                        };
                        // A message of several results is finished once each of them is.
                        let each = results.into_iter().map(|result| {
                            let (me, sink, stop, tenant, name, message) =
                                (&me, &sink, &stop, &tenant, &name, &message);
                            async move {
                                let applied = match split_namespace(&result.namespace) {
                                    // Another workflow's group applies it.
                                    Some((t, w, _)) if t != tenant.as_deref() || w != name => {
                                        return true
                                    }
                                    Some(_) => {
                                        retrying(stop, "apply result", || me.apply_result(&result))
                                            .await
                                    }
                                    None => {
                                        Err(DispatchError::BadNamespace(result.namespace.clone()))
                                    }
                                };
                                if applied.is_ok() {
                                    return true;
                                }
                                settle(
                                    applied,
                                    &record_alone(message, &result, &result.execution_id),
                                    sink.as_ref(),
                                    stop,
                                )
                                .await
                            }
                        });
                        futures::future::join_all(each)
                            .await
                            .into_iter()
                            .all(|done| done)
                    }
                },
            ));
        }
        for workflow in self.workflows() {
            let topic = workflow.topic(&workflow_start_topic(&workflow.name));
            let subscription =
                Subscription::work_queue(&topic, state_manager_group(&topic), RESULTS_IN_FLIGHT);
            let subscribed =
                subscribe_patiently(&**broker, &subscription, SUBSCRIBE_PATIENCE, cancel).await?;
            let Some(starts) = subscribed else {
                continue;
            };
            let me = self.clone();
            let sink = broker.sink();
            // Behind an `Arc`: a token's own clone takes its lock, once per message here.
            let stop = Arc::new(cancel.clone());
            let name = workflow.key();
            loops.spawn(consume_concurrently(
                starts,
                RESULTS_IN_FLIGHT,
                cancel.clone(),
                move |message| {
                    let (me, sink, stop, name) =
                        (me.clone(), sink.clone(), stop.clone(), name.clone());
                    async move {
                        let started = match decode::<CronTick>(&message.payload) {
                            Ok(tick) => {
                                retrying(&stop, "start workflow", || {
                                    me.start_from_tick(&name, &tick)
                                })
                                .await
                            }
                            Err(e) => Err(DispatchError::from(e)),
                        };
                        settle(started, &message, sink.as_ref(), &stop).await
                    }
                },
            ));
        }
        if self.workflows().any(|w| w.timeout.is_some()) {
            let me = self.clone();
            let stop = cancel.clone();
            loops.spawn(async move {
                me.time_out_overdue(stop).await;
                Ok(())
            });
        }
        Ok(())
    }

    /// Fails executions that outlive their workflow's timeout, looking every
    /// [`DEADLINE_SWEEP`] until cancelled.
    async fn time_out_overdue(&self, cancel: CancellationToken) {
        let mut every = tokio::time::interval(DEADLINE_SWEEP);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = every.tick() => {}
            }
            for workflow in self.inner.workflows.keys() {
                if let Err(e) = self.sweep_deadlines(workflow, &cancel).await {
                    warn!(workflow, error = %e, "workflow timeout sweep failed; trying again");
                }
            }
        }
    }

    /// Times out every execution of `workflow` due by now, a page at a time, until none
    /// is left; the deadlines of executions that finished in time but could not clear
    /// theirs are cleared here. Entries left in place (executions changing under too
    /// many concurrent updates) are paged past rather than read again in this sweep.
    /// Only the workflows this node declares are swept: the deadlines of any other wait
    /// for the nodes declaring it, unread.
    async fn sweep_deadlines(
        &self,
        workflow: &str,
        cancel: &CancellationToken,
    ) -> Result<(), DispatchError> {
        let store = &self.inner.store;
        let now = now_ms();
        let mut left = 0;
        loop {
            let due = store
                .due_workflow_deadlines(workflow, now, left, DEADLINES_PER_SWEEP)
                .await?;
            let page = due.len();
            for id in due {
                match self.time_out_if_overdue(&id, workflow).await {
                    Ok(true) => store.clear_workflow_deadline(workflow, &id).await?,
                    Ok(false) => left += 1,
                    Err(e) if e.is_retryable() => return Err(e),
                    Err(e) => {
                        // An execution this node cannot read or write, and no retry
                        // helps: kept first in line, it would hold up the rest.
                        error!(execution = %id, error = %e, "cannot time out a workflow execution; its deadline is dropped");
                        store.clear_workflow_deadline(workflow, &id).await?;
                    }
                }
            }
            if page < DEADLINES_PER_SWEEP || cancel.is_cancelled() {
                return Ok(());
            }
        }
    }

    /// Fails the execution, filed under `workflow`'s deadlines, if it is still running
    /// past that workflow's timeout. Whether its deadline is settled: false when the
    /// execution changed under too many concurrent updates to settle now (the next
    /// sweep looks again). A workflow without a timeout (one taken away since) settles
    /// it, and so does an execution of another workflow, whose deadline is filed under
    /// its own.
    async fn time_out_if_overdue(&self, id: &str, workflow: &str) -> Result<bool, DispatchError> {
        let store = &self.inner.store;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let Some(mut execution) = store.get_workflow_execution(id).await? else {
                return Ok(true);
            };
            if execution.workflow != workflow {
                return Ok(true);
            }
            let Some(timeout) = self.workflow(workflow).and_then(|w| w.timeout) else {
                return Ok(true);
            };
            if !execution.time_out(timeout.as_millis(), now_ms()) {
                return Ok(true);
            }
            if store.update_workflow_execution(&execution).await? {
                warn!(execution = %id, workflow = %execution.workflow, ?timeout, "workflow execution timed out");
                self.forget(id);
                self.finished(&execution).await?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// One execution per tick: the tick id is the execution id.
    async fn start_from_tick(&self, workflow: &str, tick: &CronTick) -> Result<(), DispatchError> {
        let context = serde_json::from_str(&tick.payload).map_err(CodecError::Json)?;
        let origin = CronOrigin {
            schedule_id: tick.schedule_id.clone(),
            scheduled_ms: tick.scheduled_time_ms,
        };
        self.start_with_id(workflow, &tick.tick_id, context, Some(origin))
            .await
            .map(|_| ())
    }
}

/// Retries retryable failures with a growing pause until they succeed, fail for good,
/// or shutdown begins.
async fn retrying<F, Fut>(
    cancel: &CancellationToken,
    what: &str,
    mut attempt: F,
) -> Result<(), DispatchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), DispatchError>>,
{
    let mut pause = Duration::from_millis(50);
    loop {
        match attempt().await {
            Err(e) if e.is_retryable() && !cancel.is_cancelled() => {
                warn!(error = %e, "{what} failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return Err(e),
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

/// Whether a message is finished: done, or poison (sent to `<topic>.dlq`). A failure
/// still retryable at shutdown leaves it for redelivery.
async fn settle(
    outcome: Result<(), DispatchError>,
    message: &Message,
    sink: &dyn Sink,
    cancel: &CancellationToken,
) -> bool {
    match outcome {
        Ok(()) => true,
        Err(e) if e.is_retryable() => {
            debug!(error = %e, "left for redelivery");
            false
        }
        Err(e) => {
            warn!(topic = %message.topic, error = %e, "message cannot be applied; dead-lettered");
            dead_letter(sink, message, &e.to_string(), cancel).await
        }
    }
}

/// Publishes a message to `<topic>.dlq` with its error; true once the broker has it.
pub(crate) async fn dead_letter(
    sink: &dyn Sink,
    message: &Message,
    error: &str,
    cancel: &CancellationToken,
) -> bool {
    let mut outbound = Outbound::new(
        crate::wire::dead_letter_topic(&message.topic),
        message.payload.clone(),
    )
    .header(crate::wire::ERROR_HEADER, error.to_string());
    outbound.key = message.key.clone();
    match publish_dead_letter(sink, outbound, cancel).await {
        Ok(_) => true,
        Err(e) => {
            warn!(error = %e, "dead-letter publish failed; the message stays for redelivery");
            false
        }
    }
}

//! The supervisor spawns each declared graph (accumulators + reactor), restarts a failed
//! accumulator in place, respawns the whole graph when its reactor fails (with the cache
//! restored from the store), backs off between attempts, marks a graph Failed when its
//! failure budget is spent, and records every recovery in the store.

mod backoff;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::{Id, JoinError, JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, info_span, warn, Instrument};

pub use backoff::SupervisionPolicy;

use crate::accumulator::runtime::{AccumulatorTask, SocketReceiver};
use crate::accumulator::{Health, SourceSpec};
use crate::graph::GraphDeclaration;
use crate::metrics::{GraphStats, LeaseRole, StatsSnapshot};
use crate::reactor::run::{Reactor, Wiring};
use crate::reactor::{Command, ReactorError, ReactorHandle, ReactorInput, ReactorState};
use crate::store::{RecoveryAction, RecoveryEvent, Store};
use crate::transport::{
    now_ms, Assignment, Broker, BrokerSource, Sink, SourceFactory, Subscription,
};

/// Socket and command queue depth per graph.
const COMMAND_QUEUE: usize = 64;
const SOCKET_QUEUE: usize = 1024;

/// The services graphs run on.
#[derive(Clone)]
pub struct Runtime {
    pub broker: Arc<dyn Broker>,
    pub store: Arc<dyn Store>,
    pub node_id: String,
}

impl Runtime {
    /// The embedded default: in-process broker and store, no services needed.
    pub fn embedded() -> Self {
        Self {
            broker: Arc::new(crate::transport::memory::MemoryBroker::default()),
            store: Arc::new(crate::store::memory::MemoryStore::new()),
            node_id: default_node_id(),
        }
    }
}

/// Host name and process id.
pub fn default_node_id() -> String {
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "weir".to_string());
    format!("{host}-{}", std::process::id())
}

/// Lifecycle of one supervised graph.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum GraphStatus {
    /// Another node holds the graph's lease; this one takes over if it lapses.
    Standby,
    Running,
    /// Waiting out the backoff after a failure.
    Restarting {
        failures: u32,
    },
    /// The failure budget is spent; the graph stays down until it is retried (after the
    /// policy's `failed_retry`, or on [`GraphHandle::restart`]).
    Failed {
        error: String,
    },
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("a graph named {0} is already running")]
    DuplicateGraph(String),
    #[error("the supervisor is shutting down")]
    ShuttingDown,
}

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("graph {graph} has no accumulator named {accumulator}")]
    UnknownAccumulator { graph: String, accumulator: String },
    #[error("graph {graph} has stopped")]
    Stopped { graph: String },
}

/// A running graph: push events, send reactor commands, watch its state.
#[derive(Clone)]
pub struct GraphHandle {
    name: String,
    reactor: ReactorHandle,
    sockets: Arc<BTreeMap<String, mpsc::Sender<Value>>>,
    status: watch::Receiver<GraphStatus>,
    state: watch::Receiver<ReactorState>,
    health: Arc<BTreeMap<String, watch::Receiver<Health>>>,
    stats: Arc<GraphStats>,
    restart: Arc<Notify>,
}

impl GraphHandle {
    /// Starts the graph afresh now: a Failed graph is tried again at once, a graph waiting
    /// out a backoff stops waiting, a running one is torn down and respawned with its
    /// cache restored. None of it counts as a failure.
    pub fn restart(&self) {
        self.restart.notify_waiters();
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn reactor(&self) -> &ReactorHandle {
        &self.reactor
    }

    /// Pushes an event into an accumulator's socket path, waiting if its queue is full.
    pub async fn push(&self, accumulator: &str, value: Value) -> Result<(), PushError> {
        let socket = self.socket(accumulator)?;
        socket.send(value).await.map_err(|_| PushError::Stopped {
            graph: self.name.clone(),
        })
    }

    /// The sender behind an accumulator's socket path, for pushing without lookups.
    pub fn socket(&self, accumulator: &str) -> Result<mpsc::Sender<Value>, PushError> {
        self.sockets
            .get(accumulator)
            .cloned()
            .ok_or_else(|| PushError::UnknownAccumulator {
                graph: self.name.clone(),
                accumulator: accumulator.to_string(),
            })
    }

    pub fn status(&self) -> GraphStatus {
        self.status.borrow().clone()
    }

    pub fn state(&self) -> ReactorState {
        *self.state.borrow()
    }

    pub fn health(&self, accumulator: &str) -> Option<Health> {
        self.health.get(accumulator).map(|h| *h.borrow())
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Waits until the reactor reaches `state`.
    pub async fn wait_for_state(&self, state: ReactorState) {
        let mut rx = self.state.clone();
        let _ = rx.wait_for(|s| *s == state).await;
    }

    /// Waits until the graph's status satisfies `f`.
    pub async fn wait_for_status(&self, f: impl Fn(&GraphStatus) -> bool) -> GraphStatus {
        let mut rx = self.status.clone();
        let reached = rx.wait_for(|s| f(s)).await.map(|s| s.clone());
        reached.unwrap_or_else(|_| self.status())
    }
}

/// Runs graphs until its cancellation token fires: restarts what fails, with backoff,
/// and records every recovery.
///
/// ```
/// use serde_json::json;
/// use tokio_util::sync::CancellationToken;
/// use weir::{AccumulatorSpec, GraphBuilder, ReactorState, Runtime, SupervisionPolicy, Supervisor};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // The embedded default: the memory broker and store.
/// let supervisor = Supervisor::new(
///     Runtime::embedded(),
///     SupervisionPolicy::default(),
///     CancellationToken::new(),
/// );
/// let graph = GraphBuilder::new("echo")
///     .accumulator(AccumulatorSpec::passthrough("in"))
///     .node("out", ["in"], |ctx: weir::NodeContext| async move {
///         Ok(ctx.source("in").cloned())
///     })
///     .output("out", "echo.out")
///     .build()
///     .unwrap();
/// let handle = supervisor.spawn(graph).unwrap();
/// handle.wait_for_state(ReactorState::Live).await;
/// handle.push("in", json!({"hello": "weir"})).await.unwrap();
/// assert!(supervisor.graph("echo").is_some());
/// assert!(supervisor.shutdown().await, "every graph stopped in time");
/// # }
/// ```
pub struct Supervisor {
    runtime: Runtime,
    policy: SupervisionPolicy,
    cancel: CancellationToken,
    tasks: TaskTracker,
    graphs: Mutex<BTreeMap<String, GraphHandle>>,
}

impl Supervisor {
    pub fn new(runtime: Runtime, policy: SupervisionPolicy, cancel: CancellationToken) -> Self {
        Self {
            runtime,
            policy,
            cancel,
            tasks: TaskTracker::new(),
            graphs: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// Starts supervising a graph. Must be called within a tokio runtime.
    pub fn spawn(&self, decl: GraphDeclaration) -> Result<GraphHandle, SupervisorError> {
        if self.cancel.is_cancelled() {
            return Err(SupervisorError::ShuttingDown);
        }
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        if graphs.contains_key(&decl.key()) {
            return Err(SupervisorError::DuplicateGraph(decl.key()));
        }
        let sources: Vec<&str> = decl.accumulators.iter().map(|a| a.name.as_str()).collect();
        let stats = Arc::new(GraphStats::new(&decl.key(), &sources));
        let (commands_tx, commands_rx) = mpsc::channel(COMMAND_QUEUE);
        let (status_tx, status_rx) = watch::channel(GraphStatus::Running);
        let (state_tx, state_rx) = watch::channel(ReactorState::Starting);
        let mut sockets = BTreeMap::new();
        let mut socket_rx = Vec::new();
        let mut health = BTreeMap::new();
        let mut health_tx = Vec::new();
        for spec in &decl.accumulators {
            let (tx, rx) = mpsc::channel(SOCKET_QUEUE);
            sockets.insert(spec.name.clone(), tx);
            socket_rx.push(Arc::new(tokio::sync::Mutex::new(rx)));
            let (htx, hrx) = watch::channel(Health::Starting);
            health.insert(spec.name.clone(), hrx);
            health_tx.push(Arc::new(htx));
        }
        let handle = GraphHandle {
            name: decl.key(),
            reactor: ReactorHandle {
                graph: decl.key(),
                commands: commands_tx,
            },
            sockets: Arc::new(sockets),
            status: status_rx,
            state: state_rx,
            health: Arc::new(health),
            stats: stats.clone(),
            restart: Arc::new(Notify::new()),
        };
        let graph = SupervisedGraph {
            wiring: GraphWiring::resolve(&decl, &self.runtime),
            decl,
            runtime: self.runtime.clone(),
            policy: self.policy.clone(),
            cancel: self.cancel.child_token(),
            stats,
            commands: Arc::new(tokio::sync::Mutex::new(commands_rx)),
            sockets: socket_rx,
            health: health_tx,
            status: status_tx,
            state: state_tx,
            restart: handle.restart.clone(),
        };
        let span = info_span!("graph", graph = %handle.name);
        self.tasks.spawn(graph.supervise().instrument(span));
        graphs.insert(handle.name.clone(), handle.clone());
        Ok(handle)
    }

    pub fn graph(&self, name: &str) -> Option<GraphHandle> {
        self.graphs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    pub fn graphs(&self) -> Vec<GraphHandle> {
        self.graphs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Stops every graph and waits for them, at most the policy's shutdown timeout plus
    /// a margin. Returns false if some task had to be abandoned.
    pub async fn shutdown(&self) -> bool {
        self.cancel.cancel();
        self.tasks.close();
        let limit = self.policy.shutdown_timeout + std::time::Duration::from_secs(1);
        tokio::time::timeout(limit, self.tasks.wait()).await.is_ok()
    }
}

/// Sources and sinks of one graph, resolved against the runtime once.
struct GraphWiring {
    sources: Vec<Option<Arc<dyn SourceFactory>>>,
    dead_letter_topics: Vec<String>,
    outputs: Arc<[(String, Arc<dyn Sink>)]>,
}

impl GraphWiring {
    fn resolve(decl: &GraphDeclaration, runtime: &Runtime) -> Self {
        let group = format!("weir.{}", decl.key().replace('/', "."));
        let mut sources = Vec::new();
        let mut dead_letter_topics = Vec::new();
        for spec in &decl.accumulators {
            let (source, default_dlq): (Option<Arc<dyn SourceFactory>>, String) = match &spec.source
            {
                SourceSpec::None => (
                    None,
                    decl.qualify_topic(&crate::wire::accumulator_dead_letter_topic(
                        &decl.name, &spec.name,
                    )),
                ),
                SourceSpec::Topic { topic, start } => {
                    let topic = decl.qualify_topic(topic);
                    let mut subscription = Subscription::new(topic.clone(), group.clone());
                    subscription.start = *start;
                    // One active instance per graph: read every partition directly.
                    subscription.assignment = Assignment::All;
                    let source = BrokerSource {
                        broker: runtime.broker.clone(),
                        subscription,
                    };
                    (
                        Some(Arc::new(source)),
                        crate::wire::dead_letter_topic(&topic),
                    )
                }
                SourceSpec::Custom(factory) => (
                    Some(factory.clone()),
                    decl.qualify_topic(&crate::wire::accumulator_dead_letter_topic(
                        &decl.name, &spec.name,
                    )),
                ),
            };
            sources.push(source);
            dead_letter_topics.push(match &spec.dead_letter {
                Some(t) => decl.qualify_topic(t),
                None => default_dlq,
            });
        }
        let outputs = decl
            .outputs
            .iter()
            .map(|o| {
                let sink = o.sink.clone().unwrap_or_else(|| runtime.broker.sink());
                (decl.qualify_topic(&o.topic), sink)
            })
            .collect();
        Self {
            sources,
            dead_letter_topics,
            outputs,
        }
    }
}

struct SupervisedGraph {
    decl: GraphDeclaration,
    wiring: GraphWiring,
    runtime: Runtime,
    policy: SupervisionPolicy,
    cancel: CancellationToken,
    stats: Arc<GraphStats>,
    commands: Arc<tokio::sync::Mutex<mpsc::Receiver<Command>>>,
    sockets: Vec<SocketReceiver>,
    health: Vec<Arc<watch::Sender<Health>>>,
    status: watch::Sender<GraphStatus>,
    state: watch::Sender<ReactorState>,
    restart: Arc<Notify>,
}

/// Consecutive failures, with the healthy-time reset. Waits on unreachable
/// infrastructure are counted apart: they set the backoff, never the failure budget.
#[derive(Default)]
struct FailureCount {
    count: u32,
    last: Option<Instant>,
    outages: u32,
    last_outage: Option<Instant>,
}

/// How one incarnation of the graph ended.
enum Ended {
    Cancelled,
    /// The reactor stopped; `retryable` when waiting may help (store or broker away).
    ReactorFailed {
        error: String,
        retryable: bool,
    },
    Failed,
    LeaseLost,
    /// A restart command.
    Restart,
}

/// Why the graph stopped running on this node.
#[derive(PartialEq, Eq)]
enum Outcome {
    Stop,
    Failed,
    Standby,
}

impl SupervisedGraph {
    async fn supervise(self) {
        let name = self.decl.key();
        info!(graph = %name, accumulators = self.decl.accumulators.len(), "graph starting");
        let mut failures = FailureCount::default();
        loop {
            let lease = match self.policy.graph_lease_ttl {
                Some(ttl) => match self.acquire_lease(ttl).await {
                    Some(held) => Some((held, ttl)),
                    None => break,
                },
                None => None,
            };
            let lost = CancellationToken::new();
            let renewer = lease.clone().map(|(held, ttl)| {
                tokio::spawn(crate::lease::keep(
                    self.runtime.store.clone(),
                    held,
                    ttl,
                    lost.clone(),
                    self.cancel.clone(),
                ))
            });
            let held = lease.as_ref().map(|(held, _)| held.clone());
            let outcome = self.run_while_leased(&mut failures, &lost, held).await;
            if lease.is_some() {
                // Released below, or lost: either way no longer held.
                crate::metrics::lease_dropped(LeaseRole::Graph);
            }
            if let Some(renewer) = renewer {
                renewer.abort();
            }
            if let Some((held, _)) = &lease {
                if outcome != Outcome::Standby {
                    if let Err(e) = self.runtime.store.release_lease(&held.lease).await {
                        warn!(graph = %name, error = %e, "lease not released; it will expire");
                    }
                }
            }
            match outcome {
                Outcome::Stop => break,
                Outcome::Failed => {
                    self.state.send_replace(ReactorState::Failed);
                    self.stats.state_changed(ReactorState::Failed);
                    tokio::select! {
                        _ = self.cancel.cancelled() => break,
                        _ = tokio::time::sleep(self.policy.failed_retry) => {
                            info!(graph = %name, "retrying the failed graph");
                        }
                        _ = self.restart.notified() => {
                            info!(graph = %name, "restarting the failed graph on request");
                        }
                    }
                    failures = FailureCount::default();
                }
                Outcome::Standby => warn!(graph = %name, "graph lease lost; standing by"),
            }
        }
        self.status.send_replace(GraphStatus::Stopped);
        info!(graph = %name, "graph stopped");
    }

    /// Waits until this process holds the graph's lease; `None` if cancelled first.
    async fn acquire_lease(&self, ttl: std::time::Duration) -> Option<crate::lease::Held> {
        self.status.send_replace(GraphStatus::Standby);
        let name = format!("graph:{}", self.decl.key());
        let retry = (ttl / 3).max(std::time::Duration::from_millis(50));
        loop {
            match crate::lease::acquire(
                self.runtime.store.as_ref(),
                &name,
                &self.runtime.node_id,
                ttl,
            )
            .await
            {
                Ok(Some(held)) => {
                    info!(graph = %self.decl.key(), token = held.lease.token, "graph lease acquired");
                    crate::metrics::lease_acquired(LeaseRole::Graph);
                    return Some(held);
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(graph = %self.decl.key(), error = %e, "cannot reach the store for the graph lease")
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return None,
                _ = tokio::time::sleep(retry) => {}
            }
        }
    }

    /// Runs incarnations, restarting after failures, until stopped, failed or the lease
    /// is lost.
    async fn run_while_leased(
        &self,
        failures: &mut FailureCount,
        lost: &CancellationToken,
        lease: Option<crate::lease::Held>,
    ) -> Outcome {
        loop {
            match self.incarnation(failures, lost, lease.clone()).await {
                Ended::Cancelled => return Outcome::Stop,
                Ended::Failed => return Outcome::Failed,
                Ended::LeaseLost => return Outcome::Standby,
                Ended::Restart => info!(graph = %self.decl.key(), "restarting on request"),
                Ended::ReactorFailed { error, retryable } => {
                    let Some(delay) = self
                        .failure(
                            failures,
                            "reactor",
                            RecoveryAction::GraphRespawned,
                            &error,
                            retryable,
                        )
                        .await
                    else {
                        return Outcome::Failed;
                    };
                    self.status.send_replace(GraphStatus::Restarting {
                        failures: failures.count,
                    });
                    if retryable {
                        self.state.send_replace(ReactorState::Degraded);
                        self.stats.state_changed(ReactorState::Degraded);
                    }
                    tokio::select! {
                        _ = self.cancel.cancelled() => return Outcome::Stop,
                        _ = lost.cancelled() => return Outcome::Standby,
                        _ = self.restart.notified() => {}
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// Counts a failure and records it. Returns the backoff before the restart, or `None`
    /// when the graph is now Failed. A `retryable` failure (store or broker unreachable)
    /// is waited out with backoff and never counts toward Failed.
    async fn failure(
        &self,
        failures: &mut FailureCount,
        component: &str,
        action: RecoveryAction,
        error: &str,
        retryable: bool,
    ) -> Option<std::time::Duration> {
        let now = Instant::now();
        let reset = |last: Option<Instant>| {
            last.is_some_and(|last| now.duration_since(last) >= self.policy.healthy_reset)
        };
        if reset(failures.last) {
            failures.count = 0;
        }
        if reset(failures.last_outage) {
            failures.outages = 0;
        }
        if retryable {
            failures.outages += 1;
            failures.last_outage = Some(now);
        } else {
            failures.count += 1;
            failures.last = Some(now);
        }
        let failed = !retryable && failures.count >= self.policy.max_failures;
        let action = if failed {
            RecoveryAction::GraphFailed
        } else {
            action
        };
        let event = RecoveryEvent {
            graph: self.decl.key(),
            component: component.to_string(),
            action,
            attempt: failures.count,
            error: error.to_string(),
            at_ms: now_ms(),
            node_id: self.runtime.node_id.clone(),
        };
        if let Err(e) = self.runtime.store.record_recovery(&event).await {
            warn!(graph = %event.graph, error = %e, "recovery event not recorded");
        }
        crate::metrics::recovery_recorded(&event.graph, action.as_str());
        if failed {
            error!(graph = %event.graph, %component, failures = failures.count, %error, "graph failed");
            self.status.send_replace(GraphStatus::Failed {
                error: format!("{component}: {error}"),
            });
            return None;
        }
        let delay = if retryable {
            self.policy.backoff(failures.outages)
        } else {
            self.policy.backoff(failures.count)
        };
        warn!(graph = %event.graph, %component, failures = failures.count, retryable, ?delay, %error, "restarting after failure");
        Some(delay)
    }

    /// Nested in the graph's span, so an accumulator's logs carry `graph` and `source`.
    fn source_span(&self, index: usize) -> tracing::Span {
        info_span!("accumulator", source = %self.decl.accumulators[index].name)
    }

    fn accumulator_task(
        &self,
        index: usize,
        wiring: &Wiring,
        lease: &Option<crate::lease::Held>,
        cancel: &CancellationToken,
    ) -> AccumulatorTask {
        AccumulatorTask {
            graph: Arc::from(self.decl.key().as_str()),
            key: self.decl.key(),
            index,
            spec: self.decl.accumulators[index].clone(),
            source: self.wiring.sources[index].clone(),
            dead_letter_topic: self.wiring.dead_letter_topics[index].clone(),
            dead_letters: self.runtime.broker.sink(),
            store: self.runtime.store.clone(),
            socket: self.sockets[index].clone(),
            to_reactor: wiring.inputs.clone(),
            permits: wiring.permits[index].clone(),
            counters: wiring.counters[index].clone(),
            lease: lease.clone(),
            durable: wiring.durable[index].clone(),
            health: self.health[index].clone(),
            stats: self.stats.clone(),
            cancel: cancel.clone(),
        }
    }

    async fn incarnation(
        &self,
        failures: &mut FailureCount,
        lost: &CancellationToken,
        lease: Option<crate::lease::Held>,
    ) -> Ended {
        let cancel = self.cancel.child_token();
        let restored = Reactor::restore(
            &self.decl,
            self.wiring.outputs.clone(),
            self.runtime.store.clone(),
            self.stats.clone(),
            self.state.clone(),
            lease.clone(),
        )
        .await;
        let (reactor, wiring) = match restored {
            Ok(r) => r,
            Err(e) => {
                return Ended::ReactorFailed {
                    error: e.to_string(),
                    retryable: e.is_retryable(),
                }
            }
        };
        let commands = self.commands.clone();
        let reactor_cancel = cancel.clone();
        let mut reactor_task: JoinHandle<Result<(), ReactorError>> = tokio::spawn(
            async move {
                let mut commands = commands.lock_owned().await;
                reactor.run(&mut commands, reactor_cancel).await
            }
            .instrument(info_span!("reactor")),
        );
        let mut accumulators = JoinSet::new();
        let mut ids: HashMap<Id, usize> = HashMap::new();
        for index in 0..self.decl.accumulators.len() {
            let task = self.accumulator_task(index, &wiring, &lease, &cancel);
            let handle = accumulators.spawn(task.run().instrument(self.source_span(index)));
            ids.insert(handle.id(), index);
        }
        self.status.send_replace(GraphStatus::Running);

        let ended = loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break Ended::Cancelled,
                _ = lost.cancelled() => break Ended::LeaseLost,
                _ = self.restart.notified() => break Ended::Restart,
                result = &mut reactor_task => {
                    if self.cancel.is_cancelled() {
                        break Ended::Cancelled;
                    }
                    let (error, retryable) = match result {
                        Ok(Ok(())) => ("reactor exited".to_string(), false),
                        Ok(Err(e)) => (e.to_string(), e.is_retryable()),
                        Err(e) => (describe_join_error(e), false),
                    };
                    break Ended::ReactorFailed { error, retryable };
                }
                Some(result) = accumulators.join_next_with_id() => {
                    if self.cancel.is_cancelled() {
                        break Ended::Cancelled;
                    }
                    let (id, error, retryable) = match result {
                        // Its reactor is gone: the reactor's end is what counts, once.
                        Ok((id, Ok(()))) if wiring.inputs.is_closed() => {
                            ids.remove(&id);
                            continue;
                        }
                        Ok((id, Ok(()))) => (id, "accumulator exited".to_string(), false),
                        Ok((id, Err(e))) => (id, e.to_string(), e.is_retryable()),
                        Err(e) => (e.id(), describe_join_error(e), false),
                    };
                    let Some(index) = ids.remove(&id) else { continue };
                    let name = self.decl.accumulators[index].name.clone();
                    self.health[index].send_replace(Health::Disconnected);
                    self.stats.health_changed(index, Health::Disconnected);
                    let _ = wiring.inputs.send(ReactorInput::Health { source: index, health: Health::Disconnected }).await;
                    let Some(delay) = self
                        .failure(failures, &name, RecoveryAction::AccumulatorRestarted, &error, retryable)
                        .await
                    else {
                        break Ended::Failed;
                    };
                    let task = self.accumulator_task(index, &wiring, &lease, &cancel);
                    let restart_cancel = cancel.clone();
                    let handle = accumulators.spawn(async move {
                        tokio::select! {
                            _ = restart_cancel.cancelled() => Ok(()),
                            _ = tokio::time::sleep(delay) => task.run().await,
                        }
                    }.instrument(self.source_span(index)));
                    ids.insert(handle.id(), index);
                }
            }
        };

        // Tear down this incarnation: stop accumulators first so their last boundaries
        // reach the reactor, then let the reactor finish its in-flight fires.
        cancel.cancel();
        let limit = self.policy.shutdown_timeout;
        let drained = tokio::time::timeout(limit, async {
            while accumulators.join_next().await.is_some() {}
            if !reactor_task.is_finished() {
                let _ = (&mut reactor_task).await;
            }
        })
        .await;
        if drained.is_err() {
            warn!(graph = %self.decl.key(), "tasks did not stop in time; aborting them");
            accumulators.abort_all();
            reactor_task.abort();
            while accumulators.join_next().await.is_some() {}
            let _ = reactor_task.await;
        }
        ended
    }
}

fn describe_join_error(e: JoinError) -> String {
    if e.is_panic() {
        let panic = e.into_panic();
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        format!("panicked: {message}")
    } else {
        "cancelled".to_string()
    }
}

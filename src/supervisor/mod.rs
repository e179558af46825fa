//! The supervisor spawns each declared graph (accumulators + reactor), restarts a failed
//! accumulator in place, respawns the whole graph when its reactor fails (with the cache
//! restored from the store), backs off between attempts, marks a graph Failed when its
//! failure budget is spent, and records every recovery in the store.
//!
//! Here: the [`Supervisor`]. Beside it: `runtime` (the services graphs run on), `handle`
//! (the [`GraphHandle`] callers hold), `graph` (one supervised graph: wiring,
//! incarnations, restarts, lease) and `backoff` (the [`SupervisionPolicy`]).

mod backoff;
mod graph;
mod handle;
mod runtime;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::{Id, JoinError, JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, info_span, warn, Instrument};

pub use backoff::SupervisionPolicy;
use graph::{GraphWiring, SupervisedGraph};
pub use handle::GraphHandle;
pub use runtime::{default_node_id, Runtime};

use crate::accumulator::task::{AccumulatorTask, Socket, SocketReceiver, SourceShared, PUSH_BATCH};
use crate::accumulator::{Health, SourceSpec};
use crate::graph::GraphDeclaration;
use crate::metrics::LeaseRole;
use crate::reactor::run::{Reactor, Wiring};
use crate::reactor::{Command, ReactorError, ReactorHandle, ReactorInput, ReactorState};
use crate::stats::{GraphStats, StatsSnapshot};
use crate::store::{RecoveryAction, RecoveryEvent, Store};
use crate::transport::{
    now_ms, Assignment, Broker, BrokerSource, Sink, SourceFactory, Subscription, TopicName,
};

/// Command queue depth per graph.
const COMMAND_QUEUE: usize = 64;
/// Socket channel depth per accumulator. Its accumulator takes pushes out of it a burst
/// at a time, so pushes accepted and not yet handled number at most 1,024: this plus
/// the burst. Pushes are never replayed: a crash loses those, besides what was handled
/// and not yet stored.
const SOCKET_QUEUE: usize = 1024 - PUSH_BATCH;

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
    #[error(
        "graph {graph}: its snapshot and checkpoint intervals add up to {lag:?}, more than \
         half of the broker's redelivery wait ({wait:?}); its inputs, acknowledged only once \
         a stored cache snapshot holds them, would be delivered again"
    )]
    AcknowledgedTooLate {
        graph: String,
        lag: Duration,
        wait: Duration,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("graph {graph} has no accumulator named {accumulator}")]
    UnknownAccumulator { graph: String, accumulator: String },
    #[error("graph {graph} has stopped")]
    Stopped { graph: String },
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
        let reads_the_broker = decl
            .accumulators
            .iter()
            .any(|a| matches!(a.source, SourceSpec::Topic { .. }));
        if let Some(wait) = self.runtime.broker.redelivery_wait() {
            let lag = decl
                .reactor
                .snapshot_interval
                .saturating_add(decl.reactor.checkpoint_interval);
            if reads_the_broker && lag.saturating_mul(2) > wait {
                return Err(SupervisorError::AcknowledgedTooLate {
                    graph: decl.key(),
                    lag,
                    wait,
                });
            }
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
            socket_rx.push(Arc::new(tokio::sync::Mutex::new(Socket::new(rx))));
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
            last_shared: Mutex::new(Vec::new()),
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

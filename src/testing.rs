//! Helpers for testing graphs and workflows without any service: the memory broker and
//! store, a supervisor over them, events piped into topics, outputs read back, and
//! workflows run to completion with in-process workers. Under `#[tokio::test(start_paused
//! = true)]` time only moves when every task waits, so timers (batch intervals,
//! snapshots, retries) run in virtual time.
//!
//! ```
//! use serde_json::json;
//! use weir::testing::TestDriver;
//! use weir::{AccumulatorSpec, GraphBuilder, ReactorState};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let driver = TestDriver::new();
//! let graph = driver.spawn(
//!     GraphBuilder::new("doubler")
//!         .accumulator(AccumulatorSpec::passthrough("n").topic("numbers"))
//!         .node("double", ["n"], |ctx: weir::NodeContext| async move {
//!             let n: i64 = ctx.get("n")?.unwrap_or_default();
//!             Ok(Some(json!({ "doubled": n * 2 })))
//!         })
//!         .output("double", "doubled")
//!         .build()
//!         .unwrap(),
//! );
//! graph.wait_for_state(ReactorState::Live).await;
//! driver.pipe("numbers", &json!(21)).await;
//! driver.eventually("an output", || async { !driver.outputs("doubled").is_empty() }).await;
//! assert_eq!(driver.outputs("doubled")[0]["doubled"], 42);
//! // The reactor's cache: what the next fire would see of each source.
//! let state = graph.reactor().get_state().await.unwrap();
//! assert_eq!(state.sources["n"].value, Some(json!(21)));
//! assert_eq!(state.fires, 1);
//! driver.shutdown().await;
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{DispatchError, DispatchSettings, Router, RunStatus, StateManager, Workflow};
use crate::dispatch::{WorkflowExecution, WorkflowStore};
use crate::graph::GraphDeclaration;
use crate::store::memory::MemoryStore;
use crate::supervisor::{GraphHandle, Runtime, SupervisionPolicy, Supervisor};
use crate::transport::memory::MemoryBroker;
use crate::transport::{Broker, Outbound, Sink};
use crate::worker::{HandlerRegistry, Worker, WorkerSettings};

/// How long [`TestDriver::eventually`] waits (virtual time under a paused clock).
const EVENTUALLY: Duration = Duration::from_secs(10);

/// Graphs on the memory broker and store, as a node runs them.
pub struct TestDriver {
    pub broker: MemoryBroker,
    pub store: Arc<MemoryStore>,
    pub supervisor: Supervisor,
    pub cancel: CancellationToken,
}

impl Default for TestDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl TestDriver {
    /// Topics of one partition, the default supervision policy.
    pub fn new() -> Self {
        Self::with_policy(SupervisionPolicy::default())
    }

    pub fn with_policy(policy: SupervisionPolicy) -> Self {
        Self::over(
            MemoryBroker::default(),
            Arc::new(MemoryStore::new()),
            policy,
        )
    }

    /// Topics of `partitions` partitions (unkeyed events go round-robin).
    pub fn partitioned(partitions: usize) -> Self {
        Self::over(
            MemoryBroker::new(partitions),
            Arc::new(MemoryStore::new()),
            SupervisionPolicy::default(),
        )
    }

    fn over(broker: MemoryBroker, store: Arc<MemoryStore>, policy: SupervisionPolicy) -> Self {
        let cancel = CancellationToken::new();
        let runtime = Runtime {
            broker: Arc::new(broker.clone()),
            store: store.clone(),
            node_id: "test-node".into(),
        };
        let supervisor = Supervisor::new(runtime, policy, cancel.clone());
        Self {
            broker,
            store,
            supervisor,
            cancel,
        }
    }

    /// Starts a graph; panics if it cannot (a test's graph is meant to be valid).
    pub fn spawn(&self, decl: GraphDeclaration) -> GraphHandle {
        match self.supervisor.spawn(decl) {
            Ok(graph) => graph,
            Err(e) => panic!("graph does not start: {e}"),
        }
    }

    /// Publishes a JSON event to a topic.
    pub async fn pipe(&self, topic: &str, event: &Value) {
        self.pipe_bytes(topic, event.to_string().as_bytes()).await;
    }

    /// Publishes raw bytes to a topic (an undecodable event, an Avro one).
    pub async fn pipe_bytes(&self, topic: &str, payload: &[u8]) {
        if let Err(e) = self
            .broker
            .publish(Outbound::new(topic, payload.to_vec()))
            .await
        {
            panic!("publish to {topic}: {e}");
        }
    }

    /// Everything published to a topic so far, decoded as JSON, in publish order.
    pub fn outputs(&self, topic: &str) -> Vec<Value> {
        self.broker
            .messages(topic)
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).unwrap_or(Value::Null))
            .collect()
    }

    /// Moves a paused clock on by `by`, letting everything due meanwhile run.
    pub async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
        settle().await;
    }

    /// Polls `check` until it holds; panics naming `what` after 10 s.
    pub async fn eventually<F, Fut>(&self, what: &str, check: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        eventually(what, check).await;
    }

    /// Stops every graph, as a node going down does, and starts a new supervisor on the
    /// same broker and store, as the node coming back does.
    pub async fn restart(self) -> Self {
        assert!(self.supervisor.shutdown().await, "graphs stopped in time");
        Self::over(self.broker, self.store, SupervisionPolicy::default())
    }

    /// Stops every graph; true if all stopped in time.
    pub async fn shutdown(&self) -> bool {
        let stopped = self.supervisor.shutdown().await;
        self.cancel.cancel();
        stopped
    }
}

/// Polls `check` every millisecond until it holds; panics naming `what` after 10 s
/// (virtual under a paused clock).
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let step = Duration::from_millis(1);
    for _ in 0..(EVENTUALLY.as_millis() / step.as_millis()) {
        if check().await {
            return;
        }
        tokio::time::sleep(step).await;
    }
    panic!("timed out waiting for {what}");
}

/// Lets every ready task run, so that "nothing happened" means something.
pub async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// Workflows on the memory broker and store: a state manager and one in-process worker
/// per executor the router names.
///
/// ```
/// use serde_json::json;
/// use weir::dispatch::{RunStatus, TaskSpec, Workflow};
/// use weir::testing::WorkflowDriver;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let etl = Workflow::new("etl", vec![TaskSpec::new("extract", "builtin::echo")]).unwrap();
/// let driver = WorkflowDriver::new(vec![etl], |handlers| handlers);
/// let done = driver.run("etl", json!({"day": "2026-01-01"})).await.unwrap();
/// assert_eq!(done.status, RunStatus::Completed);
/// # }
/// ```
pub struct WorkflowDriver {
    pub broker: MemoryBroker,
    pub store: Arc<MemoryStore>,
    state_manager: StateManager,
    cancel: CancellationToken,
}

impl WorkflowDriver {
    /// Starts the state manager and the workers; `handlers` adds task handlers to the
    /// built-in ones. Every task runs on the default executor.
    pub fn new(
        workflows: Vec<Workflow>,
        handlers: impl FnOnce(HandlerRegistry) -> HandlerRegistry,
    ) -> Self {
        let broker = MemoryBroker::default();
        let store = Arc::new(MemoryStore::new());
        let cancel = CancellationToken::new();
        let executor = crate::dispatch::DEFAULT_EXECUTOR;
        let router = match Router::new(Vec::new(), executor) {
            Ok(router) => router,
            Err(e) => panic!("router: {e}"),
        };
        let state_manager = StateManager::new(
            store.clone(),
            broker.sink(),
            workflows.clone(),
            router,
            DispatchSettings::default(),
        );
        tokio::spawn(
            state_manager
                .clone()
                .run(Arc::new(broker.clone()), cancel.clone()),
        );
        let handlers = handlers(HandlerRegistry::with_builtins(broker.sink()));
        let worker = Worker::new(
            Arc::new(broker.clone()),
            store.clone(),
            handlers,
            workflows,
            WorkerSettings {
                executor: executor.into(),
                concurrency: 16,
                worker_id: "test-worker".into(),
                results_topic: DispatchSettings::default().results_topic,
                tenant: None,
            },
        );
        tokio::spawn(worker.run(cancel.clone()));
        Self {
            broker,
            store,
            state_manager,
            cancel,
        }
    }

    /// Starts an execution of `workflow` and waits until it ends (at most a minute).
    pub async fn run(
        &self,
        workflow: &str,
        context: Value,
    ) -> Result<WorkflowExecution, DispatchError> {
        let id = self.state_manager.start(workflow, context).await?;
        for _ in 0..60_000 {
            if let Some(execution) = self.store.get_workflow_execution(&id).await? {
                if execution.status != RunStatus::Running {
                    return Ok(execution);
                }
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("workflow execution {id} did not end within a minute");
    }

    /// The state manager, to start executions without waiting for them.
    pub fn state_manager(&self) -> &StateManager {
        &self.state_manager
    }
}

impl Drop for WorkflowDriver {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

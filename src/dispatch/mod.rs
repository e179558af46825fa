//! Dispatch: routing ready tasks to executors by their namespace
//! (`tenant::package::workflow::task`).
//!
//! [`router`] matches namespaces against ordered glob rules; [`workflow`] declares and
//! validates workflows (DAGs of tasks); [`execution`] is one run's state and how a
//! result advances it; [`manager`] is the state manager that stores executions and
//! publishes TaskReadyEvents; `batch` sends the records that come in together (ready
//! events, results) several to a message.

pub(crate) mod batch;
pub mod execution;
pub mod manager;
pub mod router;
pub mod store;
pub mod workflow;

pub use execution::{CronOrigin, Reported, RunStatus, TaskRecord, TaskStatus, WorkflowExecution};
pub use manager::{DispatchError, DispatchSettings, StateManager};

/// The state manager's former name.
#[deprecated(note = "renamed `StateManager`")]
pub type Dispatcher = StateManager;
pub use router::{executor_topic, Route, RouteError, Router, DEFAULT_EXECUTOR};
pub use store::{DispatchStore, TickOutcomes, WorkflowStore};
pub use workflow::{split_namespace, TaskSpec, Workflow, WorkflowError};

//! Dispatch: routing ready tasks to executors by their namespace
//! (`tenant::package::workflow::task`).
//!
//! [`router`] matches namespaces against ordered glob rules; [`workflow`] declares and
//! validates workflows (DAGs of tasks).

pub mod router;
pub mod workflow;

pub use router::{Route, RouteError, Router};
pub use workflow::{TaskSpec, Workflow, WorkflowError};

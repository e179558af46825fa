//! Workers: what runs tasks.
//!
//! [`handlers`] holds the registry of task handlers by name and the built-ins used for
//! tests and demos; [`runner`] is the worker process itself (consume the executor's
//! topic, bounded concurrency, timeouts, retries, results, dead letters).

pub mod handlers;
pub mod runner;

pub use handlers::{HandlerRegistry, TaskContext, TaskHandler, TaskOutcome};
pub use runner::{Worker, WorkerError, WorkerSettings};

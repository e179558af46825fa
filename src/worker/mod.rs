//! Task handlers: what a worker runs for a task, registered by name.
//!
//! [`handlers`] holds the registry and the built-ins used for tests and demos.

pub mod handlers;

pub use handlers::{HandlerRegistry, TaskContext, TaskHandler, TaskOutcome};

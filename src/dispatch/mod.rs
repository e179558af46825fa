//! Dispatch: routing ready tasks to executors by their namespace
//! (`tenant::package::workflow::task`).
//!
//! [`router`] matches namespaces against ordered glob rules.

pub mod router;

pub use router::{Route, RouteError, Router};

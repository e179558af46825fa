//! weir: a message-broker-native stream processor and scheduler.
//!
//! Accumulators consume topics and emit boundaries; a reactor per graph fires a compiled
//! computation graph when its criteria are met and publishes the outputs back to topics.
//!
//! Layout:
//! - [`graph`]: declaring a graph with [`graph::GraphBuilder`], compiling and validating
//!   its node DAG, and the registry of named graph functions (`snapshot`).
//! - [`accumulator`]: the [`accumulator::Accumulator`] trait, the built-in kinds
//!   (passthrough, batch, polling, stateful), and the task running one accumulator with
//!   its socket and source paths, health, and commit-after-durable checkpoints.
//! - [`reactor`]: input cache (latest / sequential), dirty flags, criteria
//!   (when_any / when_all), states, and commands through [`reactor::ReactorHandle`].
//! - [`supervisor`]: runs graphs, restarts what fails with backoff, records recoveries.
//! - [`transport`]: the broker seam ([`transport::Source`], [`transport::Sink`],
//!   [`transport::Broker`]) and its backends; [`store`]: the state seam
//!   ([`store::Store`]) and its backends. Memory backends are the embedded default.
//! - [`lease`]: leases as their holders see them: one holder per process, the deadline
//!   from the last confirmed renewal, the task that keeps a lease.
//! - [`cron`]: schedules as data, next fire times with Vixie-cron DST rules.
//! - [`dispatch`]: workflows (DAGs of tasks), routing task namespaces to executor topics
//!   by ordered glob rules, executions in the store, and the state manager publishing
//!   TaskReadyEvents and applying results.
//! - [`worker`]: task handlers by name, with the built-ins, and the worker that runs them
//!   (bounded concurrency, timeouts, retries, dead letters).
//! - [`codec`]: Avro single-object encoding for weir's records (`schemas/`), JSON for
//!   user events.
//! - [`demo`]: the market-data example behind `weir demo`.
//! - [`config`]: the TOML file behind `weir run` (with `WEIR__…` overrides), validated,
//!   and the backends it names, connected.
//! - [`admin`]: the admin API (health, readiness, graphs, schedules, recovery events,
//!   WebSocket commands) and `/metrics` over HTTP, and its client.
//! - [`wire`]: the names on the wire: headers, derived topics and subjects, consumer
//!   groups, the dead-letter suffix.
//! - [`tenant`]: names and topics qualified per tenant, so tenants sharing a broker and
//!   a store never meet.
//! - [`secret`]: passwords and tokens that never print, and server URLs shown without
//!   their credentials.
//! - [`testing`]: graphs and workflows under test on the memory backends: events piped
//!   in, outputs read back, paused time, in-process workers.
//! - [`shutdown`], [`metrics`]: signals and metric names.
//!
//! The `weir` command line is an application over this library (`src/app/`, in the
//! binary): its arguments, commands and exit statuses.

pub mod accumulator;
pub mod admin;
pub mod codec;
pub mod config;
pub mod cron;
pub mod demo;
pub mod dispatch;
pub mod graph;
pub mod lease;
pub mod metrics;
pub mod reactor;
pub mod secret;
pub mod shutdown;
pub mod store;
pub mod supervisor;
pub mod tenant;
pub mod testing;
pub mod transport;
pub mod wire;
pub mod worker;

pub use accumulator::{Accumulator, AccumulatorSpec, Boundary, Event, Health};
pub use graph::{GraphBuilder, GraphDeclaration, NodeContext, NodeError};
pub use reactor::{Criteria, ReactorConfig, ReactorState, Strategy};
pub use supervisor::{GraphHandle, Runtime, SupervisionPolicy, Supervisor};

//! weir: a message-broker-native stream processor and scheduler.
//!
//! Accumulators consume topics and emit boundaries; a reactor per graph fires a compiled
//! computation graph when its criteria are met and publishes the outputs back to topics.
//!
//! Layout, from the modules that wire things together down to the leaves (each imports
//! only modules listed after it, and `tests/structure.rs` checks there is no import
//! cycle):
//! - [`config`]: the TOML file behind `weir run` (with `WEIR__…` overrides), validated
//!   and turned into domain types; [`connect`]: the backends it names, connected. [`admin`]: the admin API (health, readiness,
//!   graphs, schedules, recovery events, WebSocket commands) and `/metrics` over HTTP,
//!   and its client. [`demo`]: the market-data example behind `weir demo`.
//!   [`testing`]: graphs and workflows under test on the memory backends: events piped
//!   in, outputs read back, paused time, in-process workers.
//! - [`supervisor`]: runs graphs on a [`Runtime`] (a broker, a store, a node id),
//!   restarts what fails with backoff, records recoveries.
//! - [`store`]: the [`store::Store`] bundle of every store role and its backends
//!   (memory, the embedded default, and Redis), one file per role. Each role trait is
//!   owned by the module that uses it: [`accumulator::CheckpointStore`],
//!   [`reactor::CacheStore`], [`recovery::RecoveryLog`], [`lease::LeaseStore`],
//!   [`cron::ScheduleStore`], [`dispatch::WorkflowStore`], [`jobs::JobStore`],
//!   [`keyed::KeyedStore`], [`ownership::MembershipStore`].
//! - [`worker`]: task handlers by name, with the built-ins, and the worker that runs them
//!   (bounded concurrency, timeouts, retries, dead letters).
//! - [`jobs`]: distributed jobs: handlers by name (`builtin::count`), the run loop of an
//!   owned partition (state, timeouts and positions written together), the client
//!   behind `weir job`, and the [`jobs::JobStore`] role.
//! - [`keyed`]: keyed graphs, scaled out over the nodes: per owned partition, one loop
//!   over every source's partition, one input cache per key, state and positions
//!   written together; the [`keyed::KeyedStore`] role.
//! - [`ownership`]: partitions owned one node at a time through leases: membership, the
//!   spread over live nodes, hand-over in order.
//! - [`cron`]: schedules as data, next fire times with Vixie-cron DST rules, and the
//!   sharded scheduler that emits ticks.
//! - [`dispatch`]: workflows (DAGs of tasks), routing task namespaces to executor topics
//!   by ordered glob rules, executions in the store, and the state manager publishing
//!   TaskReadyEvents and applying results; records that come in together travel
//!   several to a message.
//! - [`reactor`]: input cache (latest / sequential), dirty flags, criteria
//!   (when_any / when_all), states, and commands through [`reactor::ReactorHandle`].
//! - [`graph`]: declaring a graph with [`graph::GraphBuilder`] (its sources, node DAG and
//!   firing rules), compiling and validating it, and the registry of named graph
//!   functions (`snapshot`).
//! - [`accumulator`]: the [`accumulator::Accumulator`] trait, the built-in kinds
//!   (passthrough, batch, polling, stateful), and the task running one accumulator with
//!   its socket and source paths, health, and commit-after-durable checkpoints.
//! - [`lease`]: leases as their holders see them: one holder per process, the deadline
//!   from the last confirmed renewal, the task that keeps a lease, fencing tokens.
//! - [`recovery`]: what the supervisor did, kept for operators.
//! - [`stats`]: what a running graph reports (reactor state, accumulator health, fire
//!   reasons) and the counters behind its metrics.
//! - [`codec`]: Avro single-object encoding for weir's records (`schemas/`), JSON for
//!   user events.
//! - [`transport`]: the broker seam ([`transport::Source`], [`transport::Sink`],
//!   [`transport::Broker`]) and its backends (memory, Kafka, NATS).
//! - [`wire`]: the names on the wire: headers, derived topics and subjects, consumer
//!   groups, the dead-letter suffix. [`tenant`]: names and topics qualified per tenant,
//!   so tenants sharing a broker and a store never meet.
//! - [`store_error`]: the error every store role returns. [`secret`]: passwords and
//!   tokens that never print, and server URLs shown without their credentials.
//!   [`shutdown`], [`metrics`]: signals and metric names. [`allocator`]: the binary's
//!   global allocator (mimalloc). `woken`: the rare branches of a busy loop's
//!   `select!`, polled only once they woke it.
//!
//! The `weir` command line is an application over this library (`src/app/`, in the
//! binary): its arguments, commands and exit statuses.

pub mod accumulator;
pub mod admin;
pub mod allocator;
pub mod codec;
pub mod config;
pub mod connect;
pub mod cron;
pub mod demo;
pub mod dispatch;
pub mod graph;
pub mod jobs;
pub mod keyed;
pub mod lease;
pub mod metrics;
pub mod ownership;
pub mod reactor;
pub mod recovery;
pub mod secret;
pub mod shutdown;
pub mod stats;
pub mod store;
pub mod store_error;
pub mod supervisor;
pub mod tenant;
pub mod testing;
pub mod transport;
pub mod wire;
mod woken;
pub mod worker;
mod write_behind;

pub use accumulator::{Accumulator, AccumulatorSpec, Boundary, Event, Health};
pub use graph::{GraphBuilder, GraphDeclaration, NodeContext, NodeError};
pub use reactor::{Criteria, ReactorConfig, ReactorState, Strategy};
pub use supervisor::{GraphHandle, Runtime, SupervisionPolicy, Supervisor};

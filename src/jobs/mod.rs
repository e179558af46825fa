//! Distributed jobs: long-lived state machines keyed by id, spread over the nodes.
//!
//! A job is an id with a JSON state, driven by its type's [`JobHandler`] through the
//! events `start`, `message`, `timeout` and `stop`. Every message to a job travels on the
//! type's partitioned topic (`weir.jobs.<type>`, message key = job id; on NATS the
//! subject `weir.jobs.<type>.<crc32(id) mod partitions>` with the id in the `weir-key`
//! header), so one partition holds each job's messages in order, `start` and `stop`
//! included (header `weir-job-event`). The partitions are owned one node at a time
//! ([`crate::ownership`]); the owner runs every job of its partitions.
//!
//! Exactly once: a job's state, its pending timeout and the position of the last
//! message applied to it are written together, with the partition's position, in one
//! fenced store write per batch ([`JobStore::save_partition`]). A new owner resumes from
//! that position and skips what a job already applied, so after a kill, a migration or
//! a rebalance each message is applied once; a timeout that fell due meanwhile fires
//! once, on the new owner. Outputs are published before the state that produced them is
//! written: at least once.

mod client;
mod handlers;
mod partition;
pub mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub use client::{view, JobClient, JobView};
pub use handlers::Count;
pub use store::{JobRecord, JobStore, PartitionChanges, PartitionSnapshot};

use crate::ownership::{OwnershipSettings, OwnershipStore};
use crate::transport::{Broker, PartitionLayout, PartitionedTopic, TransportError};

/// What happens to a job.
#[derive(Debug, Clone, PartialEq)]
pub enum JobEvent {
    /// The job is put: its state is the one given (`{}` when none was).
    Start,
    /// A message sent to the job, as JSON.
    Message(Value),
    /// The timeout the handler set fell due.
    Timeout,
    /// The job is removed after this.
    Stop,
}

/// What a handler does with the job's timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timer {
    /// Leaves the pending timeout (or none) as it is.
    Keep,
    Clear,
    /// Fires a timeout this long from now, replacing a pending one.
    After(Duration),
}

/// A handler's answer: the job's next state, its timeout, and outputs to publish.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub state: Value,
    pub timer: Timer,
    pub outputs: Vec<Value>,
}

impl Step {
    pub fn new(state: Value) -> Self {
        Self {
            state,
            timer: Timer::Keep,
            outputs: Vec::new(),
        }
    }

    pub fn timer(mut self, timer: Timer) -> Self {
        self.timer = timer;
        self
    }

    pub fn output(mut self, output: Value) -> Self {
        self.outputs.push(output);
        self
    }
}

/// A handler refused an event; the message goes to the type's dead-letter topic and the
/// job keeps its state.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason}")]
pub struct HandlerError {
    pub reason: String,
}

impl HandlerError {
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }
}

/// A job type's behaviour: `(state, event) -> (state, timeout, outputs)`. Called on the
/// partition's task, one event at a time per partition: keep it quick.
pub trait JobHandler: Send + Sync {
    fn handle(&self, state: Value, event: &JobEvent) -> Result<Step, HandlerError>;
}

/// Runs `handler` on one event. A handler that panics refuses the event, as one returning
/// an error does: left to unwind the partition's task, it would be served again from the
/// store and panic on the same message, over and over. A state it returns nested deeper
/// than weir reads JSON ([`crate::codec::json::MAX_DEPTH`]) is refused too: it could be
/// stored but never loaded back, and the job's partition would stop at every attempt to
/// load it.
pub fn run_handler(
    handler: &dyn JobHandler,
    state: Value,
    event: &JobEvent,
) -> Result<Step, HandlerError> {
    let run = std::panic::AssertUnwindSafe(|| handler.handle(state, event));
    let step = std::panic::catch_unwind(run).map_err(|panic| {
        HandlerError::new(format!(
            "it panicked: {}",
            crate::accumulator::panic_message(panic.as_ref())
        ))
    })??;
    crate::codec::json::check_depth(&step.state)
        .map_err(|e| HandlerError::new(format!("the state it returned: {e}")))?;
    Ok(step)
}

/// Job handlers by name, with the built-ins (`builtin::count`).
#[derive(Clone)]
pub struct JobHandlers {
    handlers: HashMap<String, Arc<dyn JobHandler>>,
}

impl Default for JobHandlers {
    fn default() -> Self {
        let mut handlers = Self {
            handlers: HashMap::new(),
        };
        handlers.register("builtin::count", Count);
        handlers
    }
}

impl JobHandlers {
    pub fn register(&mut self, name: impl Into<String>, handler: impl JobHandler + 'static) {
        self.handlers.insert(name.into(), Arc::new(handler));
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn JobHandler>> {
        self.handlers.get(name).cloned()
    }

    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        names.sort();
        names
    }
}

/// One job type as a node runs it.
#[derive(Clone)]
pub struct JobType {
    pub name: String,
    pub handler: Arc<dyn JobHandler>,
    /// Partitions of the type's topic when weir creates it.
    pub partitions: u32,
    /// Where the handler's outputs go; dropped when none.
    pub output: Option<String>,
    /// How long a dead node's partitions wait for a new owner.
    pub lease_ttl: Duration,
    /// Jobs kept in memory per owned partition, at most; the least recently used leave
    /// first (their state stays in the store).
    pub max_jobs_in_memory: usize,
}

impl JobType {
    pub fn new(name: impl Into<String>, handler: Arc<dyn JobHandler>) -> Self {
        Self {
            name: name.into(),
            handler,
            partitions: DEFAULT_PARTITIONS,
            output: None,
            lease_ttl: Duration::from_secs(6),
            max_jobs_in_memory: 100_000,
        }
    }
}

/// Partitions of a job type's topic unless configured.
pub const DEFAULT_PARTITIONS: u32 = 6;

/// The latest due time a job's timeout may have, in ms since the epoch (2^53, some
/// 285,000 years ahead): Redis keeps due times as doubles, exact up to there. A timeout
/// due later never falls due.
pub const LATEST_DUE_MS: i64 = 1 << 53;

/// The ownership group of a job type: it names the partitions' leases.
pub fn ownership_group(job_type: &str) -> String {
    format!("jobs.{job_type}")
}

/// A job type's topic, made with the type's partition count if the broker has none of
/// that name (one it has keeps its count), and, where the broker partitions a topic
/// itself (Kafka), the type's output topic with as many partitions: a job's outputs,
/// keyed by its id, then land in the partition its messages come from, written by that
/// partition's owner alone, rather than all in one partition written by every node.
pub async fn topics(
    job_type: &JobType,
    broker: &dyn Broker,
) -> Result<PartitionedTopic, TransportError> {
    let topic = broker
        .partitioned(&crate::wire::job_topic(&job_type.name), job_type.partitions)
        .await?;
    if topic.layout == PartitionLayout::Native {
        if let Some(output) = &job_type.output {
            broker.partitioned(output, topic.partitions).await?;
        }
    }
    Ok(topic)
}

/// What serving jobs needs of a store.
pub trait JobsStore: JobStore + OwnershipStore {}

impl<T: JobStore + OwnershipStore + ?Sized> JobsStore for T {}

/// Serves this node's share of a job type's partitions (of `topic`, from
/// [`Broker::partitioned`]) until `cancel` fires, then hands them over (state stored,
/// positions committed) before returning.
pub async fn serve(
    job_type: JobType,
    topic: PartitionedTopic,
    broker: Arc<dyn Broker>,
    store: Arc<dyn JobsStore>,
    node_id: String,
    cancel: CancellationToken,
) {
    let mut settings =
        OwnershipSettings::new(ownership_group(&job_type.name), topic.partitions, node_id);
    settings.ttl = job_type.lease_ttl;
    let job_store: Arc<dyn JobStore> = store.clone();
    let work = partition::JobPartitions::new(job_type, topic, broker, job_store);
    let ownership_store: Arc<dyn OwnershipStore> = store;
    crate::ownership::own(ownership_store, settings, Arc::new(work), cancel).await;
}

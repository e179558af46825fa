//! Accumulators: long-lived tasks that turn raw events into [`Boundary`]s for a reactor.
//!
//! Each accumulator has two input paths merged into one loop: the *socket* path (events
//! pushed in-process or through the admin API) and an optional *source* path (a broker
//! topic or a poll). [`kinds`] holds the built-in kinds, `task` the task that runs
//! one accumulator, [`commit`] the rule for which source positions are safe to commit.

pub mod checkpoint;
pub mod commit;
pub mod kinds;
pub(crate) mod task;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::transport::{Position, SourceFactory, StartFrom};

pub use crate::stats::Health;
pub use checkpoint::{Checkpoint, CheckpointStore};
pub use kinds::{Batch, Passthrough, PollSource, Stateful};
pub use task::MOST_PENDING_BOUNDARIES;

/// Events pushed through the socket path sit in this pseudo-partition of their
/// accumulator, at offsets that are their push ids: increasing, never reused, never
/// replayed. It is never committed to a broker.
pub const PUSH_PARTITION: i32 = -1;

/// The positions one boundary covers, one per partition: mostly one, held inline, so a
/// boundary costs no allocation for them.
pub type Positions = smallvec::SmallVec<[Position; 1]>;

/// A typed snapshot an accumulator emits: one source's new input for the reactor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Boundary {
    pub source: Arc<str>,
    /// Order of emission within one run of the graph. It ties a boundary to the commit
    /// it allows and means nothing across restarts (restored boundaries carry 0).
    pub sequence: u64,
    /// Per partition, the highest position among the events this boundary covers
    /// (pushes at [`PUSH_PARTITION`]). A replay is recognised by these: a boundary all of
    /// whose positions the reactor has already taken is a repeat; any newer one is not.
    #[serde(default)]
    pub positions: Positions,
    pub event_time_ms: i64,
    pub emit_time_ms: i64,
    pub value: Value,
}

/// One raw event, already decoded, on its way into [`Accumulator::process`].
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub value: Value,
    /// Set for events from the source path; pushed events have none.
    pub position: Option<Position>,
    pub time_ms: i64,
}

/// What travels from accumulators (and the supervisor) to the reactor.
#[derive(Debug)]
pub(crate) enum ReactorInput {
    Boundary {
        source: usize,
        boundary: Boundary,
    },
    /// Boundaries emitted in one go (a burst of pushes, say), in order: one hand-over
    /// instead of one per boundary.
    Boundaries {
        source: usize,
        boundaries: Vec<Boundary>,
    },
    Health {
        source: usize,
        health: Health,
    },
    /// The accumulator's incarnation hands over nothing more (it stopped with its graph,
    /// or ended on an error), so a stopping reactor has everything it will get once each
    /// running accumulator has said so.
    Stopped {
        source: usize,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum AccumulatorError {
    /// The event cannot be turned into a boundary; it goes to the dead-letter topic.
    #[error("event rejected: {0}")]
    Rejected(String),
    /// The stored state does not fit this accumulator.
    #[error("checkpoint state unusable: {0}")]
    BadCheckpoint(String),
    #[error("source {source_name} failed: {source}")]
    Source {
        source_name: String,
        #[source]
        source: crate::transport::TransportError,
    },
    #[error("dead-letter publish to {topic} failed: {source}")]
    DeadLetter {
        topic: String,
        #[source]
        source: crate::transport::TransportError,
    },
    #[error("store failed: {0}")]
    Store(#[from] crate::store_error::StoreError),
    /// The accumulator's own code panicked while processing a pushed event; a new
    /// instance takes over.
    #[error("panicked: {0}")]
    Panicked(String),
    /// The accumulator's own code panicked on a source message. A new instance takes
    /// over and reads the message again; one panicked on twice is dead-lettered, so a
    /// message that always panics never stops its source.
    #[error("panicked on the message at partition {} offset {}: {reason}", position.partition, position.offset)]
    PanickedOnMessage {
        position: crate::transport::Position,
        reason: String,
    },
}

/// What a caught panic says, as far as it says anything.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

impl AccumulatorError {
    /// A rejected event stays rejected; infrastructure failures may pass.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Rejected(_) | Self::BadCheckpoint(_) | Self::Panicked(_) => false,
            // Retried, a message panicked on goes to the dead-letter topic.
            Self::Source { .. } | Self::PanickedOnMessage { .. } => true,
            // A letter the broker refuses for good, even without the message's payload
            // (a topic it will not take), is refused again however often it is sent:
            // the source stays at the message and the graph counts the failure, so it
            // ends Failed rather than waiting on it unseen for ever.
            Self::DeadLetter { source, .. } => source.is_retryable(),
            Self::Store(e) => e.is_retryable(),
        }
    }

    /// Whether the run it ended left its state as it was before the failing step, so the
    /// next incarnation may carry that run on: a broker that failed to deliver changed
    /// nothing, nor did one that failed to take a dead letter (a message is taken in
    /// only once its dead letter is out, so the carried run reads it again), while a
    /// panic may have left the state half changed and the accumulator's own errors say
    /// nothing of it.
    pub(crate) fn leaves_the_run_whole(&self) -> bool {
        matches!(self, Self::Source { .. } | Self::DeadLetter { .. })
    }
}

/// Turns events into boundary values. Implementations are plain synchronous state
/// machines: the accumulator task owns all I/O.
pub trait Accumulator: Send + 'static {
    /// Restores user state from the last checkpoint (`None` on a first start).
    fn init(&mut self, state: Option<Value>) -> Result<(), AccumulatorError> {
        match state {
            None => Ok(()),
            Some(_) => Err(AccumulatorError::BadCheckpoint(
                "this accumulator keeps no state".into(),
            )),
        }
    }

    /// Handles one event; `Some` emits a boundary with that value.
    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError>;

    /// How often [`Accumulator::flush`] runs, for time-based emission.
    fn flush_interval(&self) -> Option<Duration> {
        None
    }

    fn flush(&mut self) -> Option<Value> {
        None
    }

    /// User state to persist with the source position. Returning `Some` makes the
    /// accumulator *stateful*: its position is committed only together with the state.
    fn checkpoint(&self) -> Option<Value> {
        None
    }
}

type AccumulatorFactory = Arc<dyn Fn() -> Box<dyn Accumulator> + Send + Sync>;

/// How source-path events are decoded.
#[derive(Clone, Default)]
pub enum EventFormat {
    #[default]
    Json,
    /// Avro single-object encoding of the given schema, turned into JSON.
    Avro(Arc<crate::codec::AvroCodec>),
}

impl EventFormat {
    pub fn decode(&self, bytes: &[u8]) -> Result<Value, crate::codec::CodecError> {
        match self {
            Self::Json => crate::codec::json::decode(bytes),
            Self::Avro(codec) => codec.decode_json(bytes),
        }
    }
}

/// Where an accumulator's source path reads from.
#[derive(Clone)]
pub enum SourceSpec {
    /// Push-only.
    None,
    /// A topic or subject on the graph's broker, consumed by the graph's group.
    Topic { topic: String, start: StartFrom },
    /// Anything else, e.g. [`PollSource`].
    Custom(Arc<dyn SourceFactory>),
}

/// Declaration of one accumulator: a name, how to build it, where it reads from.
#[derive(Clone)]
pub struct AccumulatorSpec {
    pub(crate) name: String,
    pub(crate) kind: &'static str,
    pub(crate) factory: AccumulatorFactory,
    pub(crate) source: SourceSpec,
    pub(crate) format: EventFormat,
    pub(crate) dead_letter: Option<String>,
}

impl std::fmt::Debug for AccumulatorSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match &self.source {
            SourceSpec::None => "socket only".to_string(),
            SourceSpec::Topic { topic, .. } => topic.clone(),
            SourceSpec::Custom(factory) => factory.describe(),
        };
        f.debug_struct("AccumulatorSpec")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("source", &source)
            .finish()
    }
}

impl AccumulatorSpec {
    /// Any [`Accumulator`] implementation.
    pub fn custom<A, F>(name: impl Into<String>, factory: F) -> Self
    where
        A: Accumulator,
        F: Fn() -> A + Send + Sync + 'static,
    {
        Self {
            name: name.into(),
            kind: "custom",
            factory: Arc::new(move || Box::new(factory())),
            source: SourceSpec::None,
            format: EventFormat::Json,
            dead_letter: None,
        }
    }

    /// Each event becomes a boundary as it is.
    pub fn passthrough(name: impl Into<String>) -> Self {
        Self {
            kind: "passthrough",
            ..Self::custom(name, || Passthrough)
        }
    }

    /// Collects events and emits them as one JSON array when `size` are held or
    /// `interval` has passed since the last emission, whichever comes first.
    pub fn batch(name: impl Into<String>, size: usize, interval: Duration) -> Self {
        Self {
            kind: "batch",
            ..Self::custom(name, move || Batch::new(size, interval))
        }
    }

    /// Folds events into a JSON state that is checkpointed with the source position.
    /// `fold` returns the value to emit, if any.
    pub fn stateful<F>(name: impl Into<String>, initial: Value, fold: F) -> Self
    where
        F: Fn(&mut Value, &Value) -> Option<Value> + Send + Sync + 'static,
    {
        let fold = Arc::new(fold);
        Self {
            kind: "stateful",
            ..Self::custom(name, move || Stateful::new(initial.clone(), fold.clone()))
        }
    }

    /// Calls `poll` every `interval` and emits what it returns, skipping values equal
    /// to the previous one.
    pub fn polling<F, Fut>(name: impl Into<String>, interval: Duration, poll: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Option<Value>> + Send + 'static,
    {
        let name = name.into();
        let source = PollSource::new(name.clone(), interval, poll);
        Self {
            kind: "polling",
            source: SourceSpec::Custom(Arc::new(source)),
            ..Self::custom(name, kinds::Deduplicating::default)
        }
    }

    /// Reads a topic or subject of the graph's broker, from the earliest retained
    /// message when the graph's group has no committed position.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.source = SourceSpec::Topic {
            topic: topic.into(),
            start: StartFrom::Earliest,
        };
        self
    }

    pub fn start(mut self, from: StartFrom) -> Self {
        if let SourceSpec::Topic { start, .. } = &mut self.source {
            *start = from;
        }
        self
    }

    pub fn source(mut self, factory: Arc<dyn SourceFactory>) -> Self {
        self.source = SourceSpec::Custom(factory);
        self
    }

    /// How source events are decoded (JSON by default).
    pub fn format(mut self, format: EventFormat) -> Self {
        self.format = format;
        self
    }

    /// Where undecodable or rejected events go (default: the source topic + `.dlq`).
    pub fn dead_letter(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter = Some(topic.into());
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn kind(&self) -> &'static str {
        self.kind
    }
}

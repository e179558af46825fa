//! The reactor: holds each source's boundaries in an input cache, decides when to fire
//! (criteria over dirty flags), runs the compiled graph and publishes its outputs.
//!
//! [`cache`] is the input cache with its strategies, [`run`] the reactor task. Commands
//! reach a running reactor through a [`ReactorHandle`].

pub mod cache;
pub(crate) mod run;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::accumulator::{Boundary, Health};

pub use cache::{CacheSnapshot, SourceSnapshot};
pub use run::ReactorError;

/// When a reactor fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Criteria {
    /// Any source has new data.
    #[default]
    WhenAny,
    /// Every declared source has new data since the last fire. Flags start unset for all
    /// declared sources, so nothing fires before each has emitted once.
    WhenAll,
}

/// How the input cache holds boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Keep the newest boundary per source; intermediates may be skipped.
    #[default]
    Latest,
    /// Queue every boundary per source (bounded); each fire takes the head of each queue
    /// it consumes. A full queue holds back that source's accumulator; nothing is dropped.
    Sequential,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReactorState {
    /// Restoring the cache.
    Starting,
    /// Some sources not yet healthy: receiving, not firing.
    Warming,
    Live,
    /// A source disconnected after Live: firing, outputs flagged degraded. Also the
    /// state while the graph waits out an unreachable store or broker.
    Degraded,
    /// The supervisor gave up after repeated failures; the graph is down until it is
    /// retried (after `failed_retry`, or on a restart command).
    Failed,
}

impl ReactorState {
    pub const ALL: [Self; 5] = [
        Self::Starting,
        Self::Warming,
        Self::Live,
        Self::Degraded,
        Self::Failed,
    ];

    /// The name used in JSON and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Warming => "warming",
            Self::Live => "live",
            Self::Degraded => "degraded",
            Self::Failed => "failed",
        }
    }
}

/// Why a reactor fired, as the `reason` label of `weir_fires_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FireReason {
    /// The criteria were met.
    Criteria = 0,
    /// A ForceFire command.
    Force = 1,
    /// A FireWith command.
    FireWith = 2,
}

impl FireReason {
    pub const ALL: [Self; 3] = [Self::Criteria, Self::Force, Self::FireWith];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Criteria => "criteria",
            Self::Force => "force",
            Self::FireWith => "fire_with",
        }
    }
}

/// Reactor settings of one graph. Defaults in [`ReactorConfig::default`].
#[derive(Debug, Clone, PartialEq)]
pub struct ReactorConfig {
    pub criteria: Criteria,
    pub strategy: Strategy,
    /// Per-source queue bound for [`Strategy::Sequential`].
    pub queue_capacity: usize,
    /// Fires whose outputs may await acknowledgement at once.
    pub max_in_flight: usize,
    /// Least time between cache snapshots to the store; zero snapshots after every batch.
    pub snapshot_interval: Duration,
    /// Times a fire whose graph failed is run again before its inputs are dead-lettered.
    pub node_retries: u32,
    /// Wait before the first retry of a failed fire; doubles with each retry.
    pub node_retry_backoff: Duration,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        Self {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Latest,
            queue_capacity: 1024,
            max_in_flight: 64,
            snapshot_interval: Duration::from_millis(200),
            node_retries: 3,
            node_retry_backoff: Duration::from_millis(100),
        }
    }
}

/// What travels from accumulators (and the supervisor) to the reactor.
#[derive(Debug)]
pub(crate) enum ReactorInput {
    Boundary { source: usize, boundary: Boundary },
    Health { source: usize, health: Health },
}

/// The outcome of a fire, as reported to the command that asked for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FireReport {
    pub fire: u64,
    pub outputs: usize,
}

/// One source's part of [`ReactorStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceStatus {
    pub dirty: bool,
    pub health: Health,
    /// Highest boundary sequence received since the reactor started.
    pub last_sequence: u64,
    /// Highest position taken per partition (pushes at partition -1): a replay of
    /// anything at or below them is dropped.
    #[serde(default)]
    pub seen: Vec<crate::transport::Position>,
    pub queued: usize,
    /// The value a fire would see now.
    pub value: Option<Value>,
}

/// Answer to [`ReactorHandle::get_state`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReactorStatus {
    pub graph: String,
    pub state: ReactorState,
    pub paused: bool,
    pub fires: u64,
    pub sources: BTreeMap<String, SourceStatus>,
}

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("graph {graph} is not running")]
    NotRunning { graph: String },
    #[error("unknown source {source_name} in graph {graph}")]
    UnknownSource { graph: String, source_name: String },
    #[error("graph {graph} failed while firing: {reason}")]
    Fire { graph: String, reason: String },
}

impl CommandError {
    /// A graph that is restarting may be running again shortly.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::NotRunning { .. })
    }
}

pub(crate) type Reply<T> = oneshot::Sender<Result<T, CommandError>>;

#[derive(Debug)]
pub(crate) enum Command {
    ForceFire(Reply<FireReport>),
    FireWith(BTreeMap<String, Value>, Reply<FireReport>),
    GetState(Reply<ReactorStatus>),
    Pause(Reply<()>),
    Resume(Reply<()>),
}

/// Sends commands to a graph's reactor. Stays valid across reactor respawns.
#[derive(Clone, Debug)]
pub struct ReactorHandle {
    pub(crate) graph: String,
    pub(crate) commands: mpsc::Sender<Command>,
}

impl ReactorHandle {
    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, CommandError> {
        let not_running = || CommandError::NotRunning {
            graph: self.graph.clone(),
        };
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| not_running())?;
        rx.await.map_err(|_| not_running())?
    }

    /// Fires now with the current cache, whatever the criteria say.
    pub async fn force_fire(&self) -> Result<FireReport, CommandError> {
        self.ask(Command::ForceFire).await
    }

    /// Replaces the named sources' cached values and fires with them.
    pub async fn fire_with(
        &self,
        cache: BTreeMap<String, Value>,
    ) -> Result<FireReport, CommandError> {
        self.ask(|reply| Command::FireWith(cache, reply)).await
    }

    pub async fn get_state(&self) -> Result<ReactorStatus, CommandError> {
        self.ask(Command::GetState).await
    }

    /// Stops evaluating criteria; boundaries keep accumulating.
    pub async fn pause(&self) -> Result<(), CommandError> {
        self.ask(Command::Pause).await
    }

    pub async fn resume(&self) -> Result<(), CommandError> {
        self.ask(Command::Resume).await
    }
}

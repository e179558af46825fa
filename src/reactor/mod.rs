//! The reactor: holds each source's boundaries in an input cache, decides when to fire
//! (criteria over dirty flags), runs the compiled graph and publishes its outputs.
//!
//! [`cache`] is the input cache with its strategies, `run` the reactor task. Commands
//! reach a running reactor through a [`ReactorHandle`].

pub mod cache;
pub(crate) mod run;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

pub(crate) use crate::accumulator::ReactorInput;
pub use crate::graph::firing::{Criteria, ReactorConfig, Strategy};
pub use crate::stats::{FireReason, Health, ReactorState};
pub use cache::{CacheSnapshot, CacheStore, Refire, SourceSnapshot};
pub use run::ReactorError;

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
    /// A command's fire is counted in the store before its outputs go, and the store
    /// did not take the count in time: nothing was fired.
    #[error(
        "graph {graph} fired nothing: the store did not take its fire count within {waited:?}"
    )]
    CountNotStored {
        graph: String,
        waited: std::time::Duration,
    },
}

impl CommandError {
    /// A graph that is restarting may be running again shortly.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::NotRunning { .. } | Self::CountNotStored { .. })
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

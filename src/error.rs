//! The binary's top-level error: what went wrong, mapped to an exit status.

use crate::config::ConfigError;
use crate::graph::GraphBuildError;
use crate::supervisor::SupervisorError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Graph(#[from] GraphBuildError),
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Schedule(#[from] crate::cron::ScheduleError),
    #[error("store: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error(transparent)]
    Cron(#[from] crate::cron::CronError),
    #[error(transparent)]
    Dispatch(#[from] crate::dispatch::DispatchError),
    #[error(transparent)]
    Worker(#[from] crate::worker::WorkerError),
    #[error("invalid argument: {0}")]
    Usage(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminError),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
}

impl Error {
    /// 2 for bad input (as clap does for bad arguments), 1 for everything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Usage(_) | Self::Graph(_) | Self::Schedule(_) | Self::Cron(_) => 2,
            Self::Dispatch(crate::dispatch::DispatchError::UnknownWorkflow(_)) => 2,
            Self::Config(e) if !e.is_retryable() => 2,
            Self::Admin(crate::admin::AdminError::Url { .. }) => 2,
            _ => 1,
        }
    }
}

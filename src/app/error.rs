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
    /// Ctrl-C or SIGTERM came before the command was done.
    #[error("interrupted: {0}")]
    Interrupted(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminError),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
}

impl Error {
    /// 2 for bad input (as clap does for bad arguments), 130 when interrupted (as a
    /// shell reports Ctrl-C), 1 for everything else: unreachable infrastructure above all.
    pub fn exit_code(&self) -> i32 {
        use crate::dispatch::DispatchError;
        match self {
            Self::Usage(_) | Self::Graph(_) | Self::Schedule(_) | Self::Cron(_) => 2,
            Self::Dispatch(
                DispatchError::UnknownWorkflow(_) | DispatchError::UnknownExecution(_),
            ) => 2,
            Self::Config(e) if !e.is_retryable() => 2,
            Self::Admin(
                crate::admin::AdminError::Url { .. }
                | crate::admin::AdminError::Unprotected { .. }
                | crate::admin::AdminError::Tls(_),
            ) => 2,
            Self::Interrupted(_) => INTERRUPTED,
            _ => 1,
        }
    }
}

/// The exit status after Ctrl-C or SIGTERM.
pub const INTERRUPTED: i32 = 130;

impl From<crate::cron::scheduler::RegisterError> for Error {
    fn from(e: crate::cron::scheduler::RegisterError) -> Self {
        match e {
            crate::cron::scheduler::RegisterError::Invalid(e) => Self::Schedule(e),
            crate::cron::scheduler::RegisterError::Store(e) => Self::Store(e),
        }
    }
}

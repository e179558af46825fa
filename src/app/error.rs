//! The binary's top-level error: what went wrong, mapped to an exit status.

use weir::config::ConfigError;
use weir::graph::GraphBuildError;
use weir::supervisor::SupervisorError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Graph(#[from] GraphBuildError),
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Schedule(#[from] weir::cron::ScheduleError),
    #[error("store: {0}")]
    Store(#[from] weir::store::StoreError),
    #[error(transparent)]
    Cron(#[from] weir::cron::CronError),
    #[error(transparent)]
    Dispatch(#[from] weir::dispatch::DispatchError),
    #[error(transparent)]
    Worker(#[from] weir::worker::WorkerError),
    /// An argument that cannot be taken (a flag's value out of its range or form).
    #[error("invalid argument: {0}")]
    Usage(String),
    /// Something a command was told to act on does not exist.
    #[error("no {what} {id:?}")]
    NotFound { what: &'static str, id: String },
    /// JSON given or stored that does not parse or serialise.
    #[error("{what}: {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// A job state that the job type's handler refuses.
    #[error("job type {job_type:?}: its handler {handler} refuses the state: {source}")]
    JobState {
        job_type: String,
        handler: String,
        #[source]
        source: weir::jobs::HandlerError,
    },
    /// Stored records that do not read back (written by another version, say); each
    /// was named as the command went on.
    #[error("{what} that could not be read: {count}")]
    Unreadable { what: &'static str, count: usize },
    /// Ctrl-C or SIGTERM came before the command was done.
    #[error("interrupted: {0}")]
    Interrupted(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Admin(#[from] weir::admin::AdminError),
    #[error(transparent)]
    Transport(#[from] weir::transport::TransportError),
    /// A message the broker's client did not take: it never left this process.
    #[error(transparent)]
    NotSent(weir::transport::TransportError),
    #[error(transparent)]
    Demo(#[from] weir::demo::DemoError),
    #[error(transparent)]
    PartitionCount(#[from] weir::ownership::PartitionCountError),
}

impl Error {
    /// What the user should know beyond the error itself: a message whose publish
    /// failed for now (an acknowledgement that did not come, a connection lost) may
    /// have been stored all the same.
    pub fn hint(&self) -> Option<&'static str> {
        if let Self::NotSent(_) = self {
            return None;
        }
        let publish = self.transport()?;
        (publish.kind() == weir::transport::TransportErrorKind::Publish && publish.is_retryable())
            .then_some(
                "the broker may have stored the message all the same: sending it again may \
             deliver it twice",
            )
    }

    /// The broker's error within this one, whichever part of weir met it.
    fn transport(&self) -> Option<&weir::transport::TransportError> {
        match self {
            Self::Transport(e)
            | Self::NotSent(e)
            | Self::Dispatch(weir::dispatch::DispatchError::Transport(e))
            | Self::Worker(weir::worker::WorkerError::Transport { source: e, .. }) => Some(e),
            _ => None,
        }
    }

    /// 2 for bad input (as clap does for bad arguments), 130 when interrupted (as a
    /// shell reports Ctrl-C), 1 for everything else: unreachable infrastructure above all.
    pub fn exit_code(&self) -> i32 {
        use weir::dispatch::DispatchError;
        match self {
            Self::Usage(_)
            | Self::NotFound { .. }
            | Self::Json { .. }
            | Self::JobState { .. }
            | Self::Unreadable { .. }
            | Self::Graph(_)
            | Self::Schedule(_)
            | Self::Cron(_) => 2,
            Self::Dispatch(
                DispatchError::UnknownWorkflow(_)
                | DispatchError::UnknownExecution(_)
                | DispatchError::Codec(_),
            ) => 2,
            Self::Config(e) if !e.is_retryable() => 2,
            // A stored record that does not read back: no retry can help.
            Self::Store(e) if e.kind() == weir::store_error::StoreErrorKind::Corrupt => 2,
            // A name the broker cannot take, or a setup that cannot serve it; settings
            // the broker's client refuses; a message the broker refuses for good (too
            // large, not allowed): trying again cannot help, so the input is at fault,
            // not the infrastructure.
            _ if self.transport().is_some_and(|e| {
                use weir::transport::TransportErrorKind::{InvalidTopic, Publish, Settings};
                match e.kind() {
                    InvalidTopic | Settings => true,
                    Publish => !e.is_retryable(),
                    _ => false,
                }
            }) =>
            {
                2
            }
            Self::PartitionCount(weir::ownership::PartitionCountError::Changed { .. }) => 2,
            Self::PartitionCount(weir::ownership::PartitionCountError::Store(e))
                if e.kind() == weir::store_error::StoreErrorKind::Corrupt =>
            {
                2
            }
            Self::Admin(e) if is_bad_admin_setting(e) => 2,
            Self::Demo(weir::demo::DemoError::Graph(_)) => 2,
            Self::Demo(weir::demo::DemoError::Admin(e)) if is_bad_admin_setting(e) => 2,
            Self::Interrupted(_) => INTERRUPTED,
            _ => 1,
        }
    }
}

/// An admin API setting that cannot work, as opposed to a listener that cannot start.
fn is_bad_admin_setting(e: &weir::admin::AdminError) -> bool {
    matches!(
        e,
        weir::admin::AdminError::Url { .. }
            | weir::admin::AdminError::Unprotected { .. }
            | weir::admin::AdminError::Tls(_)
    )
}

/// The exit status after Ctrl-C or SIGTERM.
pub const INTERRUPTED: i32 = 130;

impl From<weir::cron::scheduler::RegisterError> for Error {
    fn from(e: weir::cron::scheduler::RegisterError) -> Self {
        match e {
            weir::cron::scheduler::RegisterError::Invalid(e) => Self::Schedule(e),
            weir::cron::scheduler::RegisterError::Store(e) => Self::Store(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir::dispatch::DispatchError;
    use weir::transport::TransportError;
    use weir::worker::WorkerError;

    fn refused() -> TransportError {
        TransportError::InvalidTopic {
            topic: "weir.tasks.x".into(),
            reason: "the server refuses the stream".into(),
        }
    }

    fn away() -> TransportError {
        TransportError::Unreachable {
            broker: "nats nats://127.0.0.1:4222".into(),
            source: "no responders".into(),
        }
    }

    fn worker(source: TransportError) -> Error {
        Error::Worker(WorkerError::Transport {
            executor: "x".into(),
            source,
        })
    }

    #[test]
    fn a_broker_refusal_is_bad_input_whichever_part_of_weir_met_it() {
        assert_eq!(Error::Transport(refused()).exit_code(), 2);
        assert_eq!(
            Error::Dispatch(DispatchError::Transport(refused())).exit_code(),
            2
        );
        assert_eq!(worker(refused()).exit_code(), 2);
    }

    #[test]
    fn a_broker_away_is_unreachable_infrastructure_whichever_part_of_weir_met_it() {
        assert_eq!(Error::Transport(away()).exit_code(), 1);
        assert_eq!(
            Error::Dispatch(DispatchError::Transport(away())).exit_code(),
            1
        );
        assert_eq!(worker(away()).exit_code(), 1);
    }
}

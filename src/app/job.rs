//! `weir job …`: jobs of a declared type, through the broker (put, send, rm) and the
//! store (get, list).

use std::io::Write;

use serde_json::Value;

use crate::app::cli::JobCommand;
use crate::app::error::Error;
use weir::config::Config;
use weir::jobs::{run_handler, HandlerError, JobClient, JobEvent, JobHandlers};

pub async fn run(command: JobCommand, out: &mut impl Write) -> Result<(), Error> {
    match command {
        JobCommand::Put {
            config,
            job_type,
            id,
            state,
        } => {
            let config = Config::load(&config)?;
            let state = match state {
                Some(text) => json(&text, "--state is not JSON")?,
                None => serde_json::json!({}),
            };
            check_state(&config, &job_type, &state)?;
            client(&config, &job_type).await?.put(&id, &state).await?;
        }
        JobCommand::Send {
            config,
            job_type,
            id,
            message,
        } => {
            let config = Config::load(&config)?;
            let message = json(&message, "--message is not JSON")?;
            client(&config, &job_type)
                .await?
                .send(&id, &message)
                .await?;
        }
        JobCommand::Rm {
            config,
            job_type,
            id,
        } => {
            let config = Config::load(&config)?;
            client(&config, &job_type).await?.stop(&id).await?;
        }
        JobCommand::Get {
            config,
            job_type,
            id,
        } => {
            let store = declared(&config, &job_type)?.store().await?;
            let Some(view) = weir::jobs::view(store.as_ref(), &job_type, &id).await? else {
                return Err(Error::NotFound {
                    what: "job",
                    id: format!("{job_type}/{id}"),
                });
            };
            let line = serde_json::to_string(&view).map_err(|source| Error::Json {
                what: "job",
                source,
            })?;
            writeln!(out, "{line}")?;
        }
        JobCommand::List { config, job_type } => {
            let store = declared(&config, &job_type)?.store().await?;
            for id in store.list_jobs(&job_type).await? {
                writeln!(out, "{id}")?;
            }
        }
    }
    Ok(())
}

/// The config, once it declares `job_type`: a misspelt type is named as such rather
/// than answered with no job or an empty list.
fn declared(config: &std::path::Path, job_type: &str) -> Result<Config, Error> {
    let config = Config::load(config)?;
    config.job(job_type)?;
    Ok(config)
}

fn json(text: &str, what: &'static str) -> Result<Value, Error> {
    serde_json::from_str(text).map_err(|source| Error::Json { what, source })
}

/// A state the job type's handler refuses at `start` is refused here, with the handler's
/// reason, instead of being sent and dead-lettered by the node that owns the job.
/// Handlers are pure functions of a state and an event, so starting one on the state is
/// only a check. A handler this binary does not know (registered by another program
/// built on weir) is left to the nodes that run it.
fn check_state(config: &Config, job_type: &str, state: &Value) -> Result<(), Error> {
    let handler = &config.job(job_type)?.handler;
    let refused = |source| Error::JobState {
        job_type: job_type.to_string(),
        handler: handler.clone(),
        source,
    };
    // Whatever the handler: the node reads no start state nested deeper.
    weir::codec::json::check_depth(state).map_err(|e| refused(HandlerError::new(e.to_string())))?;
    let Some(known) = JobHandlers::default().get(handler) else {
        return Ok(());
    };
    run_handler(known.as_ref(), state.clone(), &JobEvent::Start)
        .map(drop)
        .map_err(refused)
}

/// A client of a declared job type, on the config's broker.
async fn client(config: &Config, job_type: &str) -> Result<JobClient, Error> {
    let partitions = config.job(job_type)?.partitions;
    let broker = config.connect_broker().await?;
    Ok(JobClient::new(broker.as_ref(), job_type, partitions).await?)
}

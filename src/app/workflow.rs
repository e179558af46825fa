//! `weir workflow …` and `weir worker`.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::app::cli::WorkflowCommand;
use crate::app::error::Error;
use weir::config::Config;
use weir::dispatch::RunStatus;
use weir::worker::{HandlerRegistry, Worker, WorkerSettings};

/// How often `weir workflow run --wait` looks at the execution.
const WAIT_POLL: Duration = Duration::from_millis(100);

pub async fn run(
    command: WorkflowCommand,
    cancel: CancellationToken,
    out: &mut impl Write,
) -> Result<(), Error> {
    match command {
        WorkflowCommand::Run {
            config,
            name,
            context,
            wait,
        } => {
            let context = match context {
                None => serde_json::json!({}),
                Some(text) => serde_json::from_str(&text).map_err(|source| Error::Json {
                    what: "--context is not JSON",
                    source,
                })?,
            };
            let config = Config::load(&config)?;
            let runtime = config.runtime().await?;
            let manager = config.state_manager(&runtime)?;
            let id = manager.start(&name, context).await?;
            if !wait {
                writeln!(out, "{id}")?;
                return Ok(());
            }
            eprintln!("execution {id} started");
            loop {
                if let Some(execution) = manager.execution(&id).await? {
                    if execution.status != RunStatus::Running {
                        writeln!(out, "{}", execution.summary())?;
                        return Ok(());
                    }
                }
                tokio::select! {
                    _ = cancel.cancelled() => return Err(Error::Interrupted(format!("stopped waiting for execution {id}"))),
                    _ = tokio::time::sleep(WAIT_POLL) => {}
                }
            }
        }
        WorkflowCommand::Status { config, id } => {
            let config = Config::load(&config)?;
            let store = config.store().await?;
            match store.get_workflow_execution(&id).await? {
                Some(execution) => {
                    writeln!(out, "{}", execution.summary())?;
                    Ok(())
                }
                None => Err(Error::NotFound {
                    what: "workflow execution",
                    id,
                }),
            }
        }
    }
}

/// `weir worker`: runs tasks of one executor until Ctrl-C or SIGTERM.
pub async fn worker(
    config: &Path,
    executor: String,
    concurrency: usize,
    tenant: Option<String>,
    handlers: impl FnOnce(&weir::supervisor::Runtime) -> HandlerRegistry,
    cancel: CancellationToken,
) -> Result<(), Error> {
    // The executor key names a topic: reject a bad one before connecting anywhere.
    weir::dispatch::Router::new(Vec::new(), &executor)
        .map_err(|e| Error::Usage(format!("--executor: {e}")))?;
    if let Some(tenant) = &tenant {
        weir::tenant::check(tenant).map_err(|e| Error::Usage(format!("--tenant: {e}")))?;
    }
    let config = Config::load(config)?;
    let runtime = config.runtime().await?;
    let registry = handlers(&runtime);
    config.check_handlers(&executor, tenant.as_deref(), &registry)?;
    let settings = WorkerSettings {
        executor: executor.clone(),
        concurrency,
        worker_id: runtime.node_id.clone(),
        results_topic: config.dispatch.results_topic.clone(),
        tenant,
    };
    // Health, readiness and metrics, before any metric handle exists.
    let admin = config.admin_state(&runtime);
    let servers = weir::admin::serve(admin, &config.listen(), cancel.clone()).await?;
    info!(%executor, tenant = ?settings.tenant, concurrency, broker = runtime.broker.kind(), "worker running");
    let worker = Worker::new(
        runtime.broker.clone(),
        runtime.store.clone(),
        registry,
        config.workflows()?,
        settings,
    );
    let outcome = worker.run(cancel.clone()).await;
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), servers.stopped()).await;
    outcome.map_err(Error::from)
}

//! `weir run`: the graphs of a config file, supervised until Ctrl-C or SIGTERM.

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::Config;
use crate::error::Error;
use crate::graph::FunctionRegistry;
use crate::supervisor::Supervisor;

/// Runs until `cancel` fires, then stops every graph within the shutdown timeout.
pub async fn run(
    config: Config,
    registry: &FunctionRegistry,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let graphs = config.graphs(registry)?;
    let runtime = config.runtime().await?;
    info!(
        node = %runtime.node_id,
        broker = runtime.broker.kind(),
        store = runtime.store.kind(),
        graphs = graphs.len(),
        "weir running"
    );
    let schedules = config.declared_schedules()?;
    let scheduler = if config.cron_enabled() {
        let settings = config.scheduler_config();
        for schedule in &schedules {
            let next =
                crate::cron::scheduler::register(runtime.store.as_ref(), schedule, settings.shards)
                    .await
                    .map_err(|e| {
                        Error::Usage(format!("registering schedule {}: {e}", schedule.id))
                    })?;
            info!(schedule = %schedule.id, next = ?next, "schedule registered");
        }
        let scheduler = crate::cron::scheduler::Scheduler::new(
            runtime.store.clone(),
            runtime.broker.sink(),
            settings,
        );
        Some(tokio::spawn(scheduler.run(cancel.clone())))
    } else {
        None
    };
    let supervisor = Supervisor::new(runtime, config.supervision_policy(), cancel.clone());
    for graph in graphs {
        supervisor.spawn(graph)?;
    }
    cancel.cancelled().await;
    if let Some(scheduler) = scheduler {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), scheduler).await;
    }
    if !supervisor.shutdown().await {
        tracing::warn!("some graph tasks did not stop in time");
    }
    Ok(())
}

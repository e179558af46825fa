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
    let supervisor = Supervisor::new(runtime, config.supervision_policy(), cancel.clone());
    for graph in graphs {
        supervisor.spawn(graph)?;
    }
    cancel.cancelled().await;
    if !supervisor.shutdown().await {
        tracing::warn!("some graph tasks did not stop in time");
    }
    Ok(())
}

//! `weir run`: the graphs of a config file, supervised until Ctrl-C or SIGTERM, with the
//! cron scheduler when schedules are declared, the workflow state manager when
//! workflows are, and this node's share of the partitions of each declared job type and
//! keyed graph.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::app::error::Error;
use weir::config::Config;
use weir::graph::FunctionRegistry;
use weir::jobs::{JobHandlers, JobsStore};
use weir::keyed::KeyedGraphStore;
use weir::supervisor::Supervisor;

/// Runs until `cancel` fires, then stops every graph within the shutdown timeout.
pub async fn run(
    config: Config,
    registry: &FunctionRegistry,
    job_handlers: &JobHandlers,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let (keyed_graphs, graphs): (Vec<_>, Vec<_>) = config
        .graphs(registry)?
        .into_iter()
        .partition(|g| g.keyed.is_some());
    let job_types = config.job_types(job_handlers)?;
    let runtime = config.runtime().await?;
    // Each keyed graph's sources, checked co-partitioned before anything runs.
    let mut keyed = Vec::new();
    for decl in keyed_graphs {
        let topics = weir::keyed::topics(&decl, runtime.broker.as_ref()).await?;
        weir::ownership::check_partition_count(
            runtime.store.as_ref(),
            &weir::keyed::ownership_group(&decl.key()),
            topics.partitions,
        )
        .await?;
        keyed.push((decl, topics));
    }
    // Each job type's topic, before anything runs: a broker that cannot hold one stops
    // the node at once.
    let mut job_topics = Vec::new();
    for job_type in job_types {
        let topic = weir::jobs::topics(&job_type, runtime.broker.as_ref()).await?;
        weir::ownership::check_partition_count(
            runtime.store.as_ref(),
            &weir::jobs::ownership_group(&job_type.name),
            topic.partitions,
        )
        .await?;
        job_topics.push((job_type, topic));
    }
    info!(
        node = %runtime.node_id,
        broker = runtime.broker.kind(),
        store = runtime.store.kind(),
        graphs = graphs.len(),
        "weir running"
    );
    // Before anything creates metric handles: they bind to the recorder present then.
    let supervisor = Arc::new(Supervisor::new(
        runtime.clone(),
        config.supervision_policy(),
        cancel.clone(),
    ));
    let scheduler_alive = weir::admin::health::Watched::new("cron scheduler");
    let mut admin = config
        .admin_state(&runtime)
        .with_supervisor(supervisor.clone())
        .with_keyed_graphs(
            keyed
                .iter()
                .map(|(decl, topics)| (decl.key(), topics.partitions))
                .collect(),
        );
    if config.cron_enabled() {
        admin = admin.with_task(scheduler_alive.clone());
    }
    let servers = weir::admin::serve(admin, &config.listen(), cancel.clone()).await?;
    let schedules = config.declared_schedules()?;
    let scheduler = if config.cron_enabled() {
        let settings = config.scheduler_config();
        for schedule in &schedules {
            let declared =
                weir::cron::scheduler::declare(runtime.store.as_ref(), schedule, settings.shards)
                    .await?;
            if declared.kept_paused {
                warn!(schedule = %schedule.id, "schedule stays paused as stored; `weir cron resume` resumes it");
            }
            info!(schedule = %schedule.id, next = ?declared.next, "schedule registered");
        }
        let scheduler = weir::cron::scheduler::Scheduler::new(
            runtime.store.clone(),
            runtime.broker.sink(),
            settings,
        );
        let task = tokio::spawn(scheduler.run(cancel.clone()));
        Some(scheduler_alive.watch(task, cancel.clone()))
    } else {
        None
    };
    let state_manager = if config.workflows.is_empty() {
        None
    } else {
        let manager = config.state_manager(&runtime)?;
        let broker = runtime.broker.clone();
        let cancel = cancel.clone();
        Some(tokio::spawn(async move {
            let outcome = manager.run(broker, cancel.clone()).await;
            if let Err(e) = &outcome {
                tracing::error!(error = %e, "workflow state manager stopped; stopping the node");
                cancel.cancel();
            }
            outcome
        }))
    };
    let jobs: Vec<_> = job_topics
        .into_iter()
        .map(|(job_type, topic)| {
            let store: Arc<dyn JobsStore> = runtime.store.clone();
            tokio::spawn(weir::jobs::serve(
                job_type,
                topic,
                runtime.broker.clone(),
                store,
                runtime.node_id.clone(),
                cancel.clone(),
            ))
        })
        .collect();
    let keyed: Vec<_> = keyed
        .into_iter()
        .map(|(decl, topics)| {
            let store: Arc<dyn KeyedGraphStore> = runtime.store.clone();
            tokio::spawn(weir::keyed::serve(
                decl,
                topics,
                runtime.broker.clone(),
                store,
                runtime.node_id.clone(),
                cancel.clone(),
            ))
        })
        .collect();
    for graph in graphs {
        supervisor.spawn(graph)?;
    }
    cancel.cancelled().await;
    // Job and keyed graph partitions are handed over first: their next owners wait.
    let handed_over = tokio::time::timeout(
        weir::ownership::RELEASE_TIMEOUT + std::time::Duration::from_secs(5),
        futures::future::join_all(jobs.into_iter().chain(keyed)),
    );
    if handed_over.await.is_err() {
        tracing::warn!("some job or keyed graph partitions were not handed over in time");
    }
    // A node whose state manager failed stops with its error, not as if asked to.
    let mut stopped = Ok(());
    if let Some(state_manager) = state_manager {
        let limit = std::time::Duration::from_secs(10);
        if let Ok(Ok(Err(e))) = tokio::time::timeout(limit, state_manager).await {
            stopped = Err(Error::from(e));
        }
    }
    if let Some(scheduler) = scheduler {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), scheduler).await;
    }
    if !supervisor.shutdown().await {
        tracing::warn!("some graph tasks did not stop in time");
    }
    servers.stopped().await;
    stopped
}

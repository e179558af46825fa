//! A task handler of your own, run by a `Worker`: a two-task workflow whose second task
//! sees what the first returned. Runs on the embedded default:
//! `cargo run --example task_handler`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use weir::dispatch::{DispatchSettings, RunStatus, StateManager, TaskSpec, Workflow};
use weir::store::memory::MemoryStore;
use weir::store::prelude::*;
use weir::transport::memory::MemoryBroker;
use weir::transport::Broker;
use weir::worker::{
    HandlerRegistry, TaskContext, TaskHandler, TaskOutcome, Worker, WorkerSettings,
};

/// Counts the words of the context's `text`.
struct WordCount;

#[async_trait]
impl TaskHandler for WordCount {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        match task.context["text"].as_str() {
            // Merged into the execution's context, for the tasks that depend on this one.
            Some(text) => {
                TaskOutcome::Completed(json!({ "words": text.split_whitespace().count() }))
            }
            None => TaskOutcome::Failed("the context has no text".into()),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let broker = MemoryBroker::default();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let cancel = CancellationToken::new();
    let workflow = Workflow::new(
        "report",
        vec![
            TaskSpec::new("count", "word_count"),
            // builtin::echo returns the context it sees, the count included.
            TaskSpec::new("summary", "builtin::echo").after(["count"]),
        ],
    )?;
    let router = weir::dispatch::Router::new(Vec::new(), "default")?;

    // The state manager: publishes ready tasks and applies their results.
    let manager = StateManager::new(
        store.clone(),
        broker.sink(),
        vec![workflow.clone()],
        router,
        DispatchSettings::default(),
    );
    tokio::spawn(
        manager
            .clone()
            .run(Arc::new(broker.clone()), cancel.clone()),
    );

    // A worker of the default executor, with the handler registered by name.
    let mut handlers = HandlerRegistry::with_builtins(broker.sink());
    handlers.register("word_count", Arc::new(WordCount));
    let worker = Worker::new(
        Arc::new(broker.clone()),
        store.clone(),
        handlers,
        vec![workflow],
        WorkerSettings {
            executor: "default".into(),
            concurrency: 4,
            worker_id: "example".into(),
            results_topic: DispatchSettings::default().results_topic,
            tenant: None,
        },
    );
    tokio::spawn(worker.run(cancel.clone()));

    let id = manager
        .start("report", json!({ "text": "the quick brown fox" }))
        .await?;
    let done = loop {
        match store.get_workflow_execution(&id).await? {
            Some(execution) if execution.status != RunStatus::Running => break execution,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    println!("{:?}: {}", done.status, done.context); // Completed: {"text": …, "words": 4, …}
    cancel.cancel();
    Ok(())
}

//! Helpers shared by the end-to-end tests on the embedded backends.
#![allow(dead_code)]

#[cfg(feature = "it")]
pub mod certs;
#[cfg(feature = "it")]
pub mod nodes;
#[cfg(feature = "it")]
pub mod servers;
#[cfg(feature = "it")]
pub mod services;

#[allow(unused_imports)]
pub use weir::testing::{eventually, settle, TestDriver as Harness};

/// A node running in this process, as a task serving until its token is cancelled.
pub struct TaskNode {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl TaskNode {
    /// Spawns what `serve` makes of the node's stop token.
    pub fn spawn<F>(serve: impl FnOnce(tokio_util::sync::CancellationToken) -> F) -> Self
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(serve(stop.clone()));
        Self { stop, task }
    }

    /// Stops the node the way SIGTERM does: partitions handed over, then gone.
    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(20), self.task)
            .await
            .expect("node stops in time")
            .unwrap();
    }

    /// Kills the node: its partitions keep their leases until they expire.
    pub fn kill(self) {
        self.task.abort();
    }
}

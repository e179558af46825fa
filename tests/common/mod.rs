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

/// Waits (a minute at most) until `done` counts `wanted`, then asserts that took longer
/// than `ttl`, counted from `started`: a test of a lease kept through a backlog proves
/// nothing if the backlog was worked off within the lease.
pub async fn work_off_past_ttl(
    started: tokio::time::Instant,
    ttl: std::time::Duration,
    wanted: usize,
    done: impl Fn() -> usize,
) {
    let deadline = started + std::time::Duration::from_secs(60);
    while done() < wanted {
        assert!(
            tokio::time::Instant::now() < deadline,
            "backlog not worked off"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        started.elapsed() > ttl,
        "the backlog took {:?}, within the lease TTL of {ttl:?}: make it longer",
        started.elapsed()
    );
}

/// Refuses what goes to a dead-letter topic while `down` is set, as a broker that is
/// away does (retryable), and counts what it refused; passes the rest on.
pub struct DeadLettersDown {
    pub inner: std::sync::Arc<dyn weir::transport::Sink>,
    pub down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub refused: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait::async_trait]
impl weir::transport::Sink for DeadLettersDown {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        use std::sync::atomic::Ordering;
        if message.topic.ends_with(".dlq") && self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(weir::transport::TransportError::Publish {
                topic: message.topic,
                source: "broker unreachable".into(),
                retryable: true,
            });
        }
        self.inner.publish(message).await
    }
}

/// A broker whose dead letters go through [`DeadLettersDown`]; the rest is `broker`'s.
pub struct WithDeadLettersDown {
    pub broker: std::sync::Arc<dyn weir::transport::Broker>,
    pub dead_letters: std::sync::Arc<DeadLettersDown>,
}

#[async_trait::async_trait]
impl weir::transport::Broker for WithDeadLettersDown {
    fn kind(&self) -> &'static str {
        self.broker.kind()
    }

    async fn subscribe(
        &self,
        subscription: &weir::transport::Subscription,
    ) -> Result<Box<dyn weir::transport::Source>, weir::transport::TransportError> {
        self.broker.subscribe(subscription).await
    }

    fn sink(&self) -> std::sync::Arc<dyn weir::transport::Sink> {
        self.dead_letters.clone()
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<weir::transport::PartitionedTopic, weir::transport::TransportError> {
        self.broker.partitioned(topic, partitions).await
    }

    async fn ping(&self) -> Result<(), weir::transport::TransportError> {
        self.broker.ping().await
    }

    fn redelivery_wait(&self) -> Option<std::time::Duration> {
        self.broker.redelivery_wait()
    }
}

//! Helpers shared by the end-to-end tests on the embedded backends.
#![allow(dead_code)]

#[cfg(feature = "it")]
pub mod certs;
#[cfg(feature = "it")]
pub mod servers;
#[cfg(feature = "it")]
pub mod services;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use weir::store::memory::MemoryStore;
use weir::transport::memory::MemoryBroker;
use weir::{GraphDeclaration, GraphHandle, Runtime, SupervisionPolicy, Supervisor};

pub struct Harness {
    pub broker: MemoryBroker,
    pub store: Arc<MemoryStore>,
    pub supervisor: Supervisor,
    pub cancel: CancellationToken,
}

impl Harness {
    pub fn new() -> Self {
        Self::with_policy(SupervisionPolicy::default())
    }

    pub fn with_policy(policy: SupervisionPolicy) -> Self {
        Self::over(
            MemoryBroker::default(),
            Arc::new(MemoryStore::new()),
            policy,
        )
    }

    /// A harness on a broker whose topics have `partitions` partitions.
    pub fn partitioned(partitions: usize) -> Self {
        Self::over(
            MemoryBroker::new(partitions),
            Arc::new(MemoryStore::new()),
            SupervisionPolicy::default(),
        )
    }

    /// Stops every graph, as a node going down does, and starts a new supervisor on the
    /// same broker and store, as the node coming back does.
    pub async fn restart(self) -> Self {
        assert!(self.supervisor.shutdown().await, "graphs stopped in time");
        Self::over(self.broker, self.store, SupervisionPolicy::default())
    }

    fn over(broker: MemoryBroker, store: Arc<MemoryStore>, policy: SupervisionPolicy) -> Self {
        let cancel = CancellationToken::new();
        let runtime = Runtime {
            broker: Arc::new(broker.clone()),
            store: store.clone(),
            node_id: "test-node".into(),
        };
        let supervisor = Supervisor::new(runtime, policy, cancel.clone());
        Self {
            broker,
            store,
            supervisor,
            cancel,
        }
    }

    pub fn spawn(&self, decl: GraphDeclaration) -> GraphHandle {
        self.supervisor.spawn(decl).expect("graph spawns")
    }

    /// Output payloads of a topic, decoded as JSON, in publish order.
    pub fn outputs(&self, topic: &str) -> Vec<Value> {
        self.broker
            .messages(topic)
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).expect("outputs are JSON"))
            .collect()
    }

    pub async fn publish(&self, topic: &str, payload: &[u8]) {
        use weir::transport::{Outbound, Sink};
        self.broker
            .publish(Outbound::new(topic, payload.to_vec()))
            .await
            .expect("publish");
    }
}

/// Polls `check` until it holds, failing the test after 10 s (virtual under paused time).
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..10_000 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Lets every ready task run, so "nothing happened" assertions mean something.
pub async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
}

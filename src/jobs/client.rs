//! Putting, messaging, stopping and looking up jobs from outside their owners: the
//! `weir job` commands and the admin API.

use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use super::store::JobStore;
use crate::lease::{holder_node, LeaseStore};
use crate::ownership::partition_lease;
use crate::store_error::StoreError;
use crate::transport::{Broker, PartitionedTopic, Position, Sink, TransportError};
use crate::wire;

/// A job as `weir job get` and `GET /jobs/{type}/{id}` show it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobView {
    #[serde(rename = "type")]
    pub job_type: String,
    pub id: String,
    pub state: Value,
    /// The node running the job now, if any.
    pub owner: Option<String>,
    /// `running` on its owner, or `unowned` while its partition has none (its owner
    /// died and the lease has not expired yet, or no node serves the type).
    pub status: &'static str,
}

/// Looks a job up: its stored state and the node owning its partition.
pub async fn view<S>(store: &S, job_type: &str, id: &str) -> Result<Option<JobView>, StoreError>
where
    S: JobStore + LeaseStore + ?Sized,
{
    let Some(record) = store
        .load_jobs(job_type, &[id.to_string()])
        .await?
        .into_iter()
        .next()
        .flatten()
    else {
        return Ok(None);
    };
    let lease = store
        .current_lease(&partition_lease(
            &super::ownership_group(job_type),
            record.partition,
        ))
        .await?;
    let owner = lease.map(|l| holder_node(&l.holder).to_string());
    Ok(Some(JobView {
        job_type: job_type.to_string(),
        id: id.to_string(),
        state: record.state,
        status: if owner.is_some() {
            "running"
        } else {
            "unowned"
        },
        owner,
    }))
}

/// Sends `start`, `stop` and messages to the jobs of one type.
#[derive(Clone)]
pub struct JobClient {
    topic: PartitionedTopic,
    sink: Arc<dyn Sink>,
}

impl JobClient {
    /// A client of `job_type`, whose topic is created with `partitions` partitions if it
    /// does not exist yet.
    pub async fn new(
        broker: &dyn Broker,
        job_type: &str,
        partitions: u32,
    ) -> Result<Self, TransportError> {
        Ok(Self {
            topic: broker
                .partitioned(&wire::job_topic(job_type), partitions)
                .await?,
            sink: broker.sink(),
        })
    }

    /// Puts the job with `state` (replacing one of the same id).
    pub async fn put(&self, id: &str, state: &Value) -> Result<Position, TransportError> {
        self.send_event(id, "start", state.to_string()).await
    }

    /// Sends the job a message.
    pub async fn send(&self, id: &str, message: &Value) -> Result<Position, TransportError> {
        self.send_event(id, "message", message.to_string()).await
    }

    /// Stops the job and removes it.
    pub async fn stop(&self, id: &str) -> Result<Position, TransportError> {
        self.send_event(id, "stop", String::new()).await
    }

    async fn send_event(
        &self,
        id: &str,
        event: &'static str,
        payload: String,
    ) -> Result<Position, TransportError> {
        let message = self
            .topic
            .outbound(id, payload)
            .header(wire::JOB_EVENT_HEADER, event);
        self.sink.publish(message).await
    }
}

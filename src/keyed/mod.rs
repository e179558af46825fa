//! Keyed graphs: one graph scaled out over the nodes, one reactor state per key.
//!
//! A keyed graph's sources are read partition by partition. Every node declaring the
//! graph owns a share of the partitions ([`crate::ownership`]) and runs, per owned
//! partition, one loop over the partition of every source: each event's key (a JSON
//! pointer, or the message key) picks the key's input cache, dirty flags and queues
//! ([`crate::reactor::cache::InputCache`]); criteria are evaluated and fires happen per key;
//! outputs carry the key as message key, so they stay partitioned by it (on Kafka an
//! output topic weir creates has the graph's partition count). Sources must be
//! co-partitioned: the same partition count, and producers placing a key in the same
//! partition of each (on Kafka, the key as message key; on NATS, the subject
//! `<topic>.<crc32(key) mod partitions>`).
//!
//! Per-key state and per-source positions are written together, fenced by the
//! partition's lease, once the outputs of the batch are acknowledged; the positions are
//! committed to the broker after. A new owner loads the positions and each key's state
//! as it meets the key, so every input reaches an output (at least once: what was in
//! flight when a node died is fired again) and each key's outputs keep its input order.
//!
//! A pause is stored per graph: every node looks every [`PAUSE_POLL`] and its
//! partitions stop reading their sources until the graph is resumed; a partition that
//! starts (on any node) reads the flag first.

mod partition;
pub mod store;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

pub use store::{FireNumbers, KeySlot, KeyedChanges, KeyedStore};

use crate::accumulator::SourceSpec;
use crate::graph::{GraphDeclaration, KeySource};
use crate::lease::{holder_node, LeaseStore};
use crate::ownership::{partition_lease, OwnershipSettings, OwnershipStore};
use crate::reactor::CacheSnapshot;
use crate::store_error::StoreError;
use crate::transport::{Broker, PartitionLayout, PartitionedTopic, TransportError};

/// What running keyed graphs needs of a store.
pub trait KeyedGraphStore: KeyedStore + OwnershipStore {}

impl<T: KeyedStore + OwnershipStore + ?Sized> KeyedGraphStore for T {}

/// The ownership group of a keyed graph: it names the partitions' leases.
pub fn ownership_group(graph: &str) -> String {
    format!("graph.{graph}")
}

/// A keyed graph's sources, each partitioned, with the partition count they share.
#[derive(Debug, Clone)]
pub struct KeyedTopics {
    pub sources: Vec<PartitionedTopic>,
    pub partitions: u32,
}

/// Readies each source of a keyed graph for reading partition by partition, and checks
/// they are co-partitioned: the same number of partitions, or an error naming each
/// topic's count.
pub async fn topics(
    decl: &GraphDeclaration,
    broker: &dyn Broker,
) -> Result<KeyedTopics, TransportError> {
    let Some(keying) = &decl.keyed else {
        return Err(TransportError::InvalidTopic {
            topic: decl.key(),
            reason: "the graph is not keyed".into(),
        });
    };
    let mut sources = Vec::with_capacity(decl.accumulators.len());
    for spec in &decl.accumulators {
        let SourceSpec::Topic { topic, .. } = &spec.source else {
            return Err(TransportError::InvalidTopic {
                topic: spec.name().to_string(),
                reason: "a keyed graph's accumulators read topics".into(),
            });
        };
        sources.push(
            broker
                .partitioned(&decl.qualify_topic(topic), keying.partitions)
                .await?,
        );
    }
    let partitions = sources.first().map_or(keying.partitions, |t| t.partitions);
    if sources.iter().any(|t| t.partitions != partitions) {
        let counts: Vec<String> = sources
            .iter()
            .map(|t| format!("{} has {}", t.topic, t.partitions))
            .collect();
        return Err(TransportError::InvalidTopic {
            topic: sources
                .iter()
                .map(|t| t.topic.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            reason: format!(
                "the sources of keyed graph {} must have as many partitions each: {}",
                decl.key(),
                counts.join(", ")
            ),
        });
    }
    // On a broker's own partitions (Kafka) an output topic weir creates gets the graph's
    // partition count: the key as message key then puts each output in the partition
    // its input came from, so a keyed graph downstream reads the outputs co-partitioned
    // with its other sources, and each output partition has one writer, the owner of
    // that partition. A topic that exists keeps its count.
    if sources
        .first()
        .is_some_and(|s| s.layout == PartitionLayout::Native)
    {
        for output in &decl.outputs {
            broker
                .partitioned(&decl.qualify_topic(&output.topic), partitions)
                .await?;
        }
    }
    Ok(KeyedTopics {
        sources,
        partitions,
    })
}

/// Runs this node's share of a keyed graph's partitions until `cancel` fires, then hands
/// them over (outputs acknowledged, state stored, positions committed) before returning.
pub async fn serve(
    decl: GraphDeclaration,
    topics: KeyedTopics,
    broker: Arc<dyn Broker>,
    store: Arc<dyn KeyedGraphStore>,
    node_id: String,
    cancel: CancellationToken,
) {
    let Some(keying) = decl.keyed.clone() else {
        return;
    };
    let mut settings =
        OwnershipSettings::new(ownership_group(&decl.key()), topics.partitions, node_id);
    settings.ttl = keying.lease_ttl;
    let keyed_store: Arc<dyn KeyedStore> = store.clone();
    let (paused_tx, paused) = tokio::sync::watch::channel(false);
    // Aborted with `serve` if that is dropped rather than cancelled: nothing of a
    // graph's node outlives it.
    let watching = AbortOnDropHandle::new(tokio::spawn(watch_paused(
        keyed_store.clone(),
        decl.key(),
        paused_tx,
        cancel.clone(),
    )));
    let work = partition::KeyedPartitions::new(decl, keying, topics, broker, keyed_store, paused);
    let ownership_store: Arc<dyn OwnershipStore> = store;
    crate::ownership::own(ownership_store, settings, Arc::new(work), cancel).await;
    // It stops on the same token, within one look at the store.
    let _ = watching.await;
}

/// How often a node looks whether a keyed graph was paused or resumed: how long a node
/// other than the one asked goes on reading after a pause, at most (plus one store
/// round trip).
pub const PAUSE_POLL: Duration = Duration::from_millis(500);

/// Tells the node's partitions of `graph` whether the graph is paused, as the store
/// says, until `cancel` fires: at every look, changed or not, since a partition that
/// started in between read the flag itself and may hold another value than the node's
/// last. While the store cannot be read they keep what it said last.
async fn watch_paused(
    store: Arc<dyn KeyedStore>,
    graph: String,
    paused: tokio::sync::watch::Sender<bool>,
    cancel: CancellationToken,
) {
    let mut unreadable = false;
    loop {
        let read = tokio::select! {
            _ = cancel.cancelled() => return,
            read = tokio::time::timeout(PAUSE_POLL * 4, store.load_paused(&graph)) => read,
        };
        match read {
            Ok(Ok(now)) => {
                if unreadable {
                    unreadable = false;
                    tracing::info!(%graph, paused = now, "the store says again whether the keyed graph is paused");
                }
                paused.send_replace(now);
            }
            Ok(Err(e)) if !unreadable => {
                unreadable = true;
                tracing::warn!(%graph, error = %e, "cannot read whether the keyed graph is paused; its partitions keep what the store said last");
            }
            Err(_) if !unreadable => {
                unreadable = true;
                tracing::warn!(%graph, "the store did not say in time whether the keyed graph is paused; its partitions keep what it said last");
            }
            _ => {}
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(PAUSE_POLL) => {}
        }
    }
}

/// The key of an event: from the message key or a JSON pointer into the event.
pub fn key_of<'a>(
    source: &KeySource,
    message_key: Option<&'a [u8]>,
    event: &'a Value,
) -> Option<Cow<'a, str>> {
    match source {
        KeySource::MessageKey => message_key
            .and_then(|k| std::str::from_utf8(k).ok())
            .filter(|k| !k.is_empty())
            .map(Cow::Borrowed),
        KeySource::Pointer(pointer) => match pointer.find(event)? {
            Value::String(s) => Some(Cow::Borrowed(s)),
            Value::Null => None,
            other => Some(Cow::Owned(other.to_string())),
        },
    }
}

/// One key of a keyed graph as the admin API and `weir graph state --key` show it: its
/// state as last stored (at most one batch behind its owner's memory) and its owner.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KeyView {
    pub graph: String,
    pub key: String,
    pub partition: i32,
    /// The node owning the key's partition now, if any.
    pub owner: Option<String>,
    /// Fires, and per source the current value, dirty flag and queue.
    pub state: Option<CacheSnapshot>,
}

/// Looks a key up over a keyed graph's partitions.
pub async fn view<S>(
    store: &S,
    graph: &str,
    partitions: u32,
    key: &str,
) -> Result<Option<KeyView>, StoreError>
where
    S: KeyedStore + LeaseStore + ?Sized,
{
    for partition in 0..partitions as i32 {
        let Some(state) = store
            .load_keys(graph, partition, &[key.to_string()])
            .await?
            .into_iter()
            .next()
            .flatten()
        else {
            continue;
        };
        let owner = store
            .current_lease(&partition_lease(&ownership_group(graph), partition))
            .await?
            .map(|l| holder_node(&l.holder).to_string());
        return Ok(Some(KeyView {
            graph: graph.to_string(),
            key: key.to_string(),
            partition,
            owner,
            state: Some(state),
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_come_from_a_pointer_or_the_message_key() {
        let event = json!({"user": "ann", "n": 7, "nested": {"id": 3}});
        let pointer = |p: &str| KeySource::Pointer(p.into());
        assert_eq!(
            key_of(&pointer("/user"), None, &event).as_deref(),
            Some("ann")
        );
        assert_eq!(
            key_of(&pointer("/nested/id"), None, &event).as_deref(),
            Some("3")
        );
        assert_eq!(key_of(&pointer("/missing"), None, &event), None);
        assert_eq!(
            key_of(&KeySource::MessageKey, Some(b"k1"), &event).as_deref(),
            Some("k1")
        );
        assert_eq!(key_of(&KeySource::MessageKey, None, &event), None);
    }
}

//! Publishing dispatch records several to a message: TaskReadyEvents from a state
//! manager, ExecutionResults from a worker.
//!
//! Every task costs the broker a publish, a delivery and an acknowledgement each way, and
//! at full load the broker's per-message work is what limits dispatch. So records for a
//! topic that are queued together, because they came in while earlier messages awaited
//! their acknowledgement or at the same instant, leave together, as one batch record
//! (`schemas/*_batch.avsc`) holding each record exactly as it travels alone. A record
//! that finds nothing queued goes at once, by itself, in the single-record format:
//! batching adds no wait. Consumers take either form
//! ([`crate::codec::avro::decode_one_or_batch`]). Records given the same `apart` value
//! (the tasks of one execution) never share a message, so a fan-out still spreads over
//! partitions and workers.
//!
//! Each publish still returns only once the broker has acknowledged the message that
//! carries its record, so a caller that commits its input after publishing keeps its
//! at-least-once guarantee. A batch the broker refuses is sent again record by record,
//! so each caller learns its own outcome: one oversized record fails alone. Each topic
//! has its own sending task, so a topic the broker cannot take holds up only its own
//! records.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::codec::avro::{encode, fingerprint_of, frame_batch, frame_single, AvroRecord, BatchOf};
use crate::transport::{Message, Outbound, Sink, TransportError};

/// Records in one message at most. A worker reads messages ahead of its free capacity,
/// so this also bounds how many tasks one message can hold back from other workers.
pub(crate) const MAX_RECORDS: usize = 64;
/// Bytes of record bodies in one message at most, well under the 1 MiB that Kafka and
/// nats-server take by default. A larger record goes alone.
const MAX_BYTES: usize = 128 * 1024;
/// Messages of one topic awaiting their acknowledgement at once. While this many are
/// out, new records queue and leave together: batches grow with the load.
const IN_FLIGHT: usize = 8;
/// Records queued for a topic's sending task at most; a caller beyond it waits for room.
const QUEUE: usize = 4096;

/// Publishes records of type `T`, batching those that come in together (see the module
/// documentation). A topic's sending task starts with its first publish and ends when
/// the batcher is dropped, once what it holds is sent.
pub(crate) struct Batcher<T: BatchOf> {
    sink: Arc<dyn Sink>,
    topics: Mutex<HashMap<String, mpsc::Sender<Entry>>>,
    record: PhantomData<fn() -> T>,
}

/// One record on its way: its key and body, what it must not share a message with, and
/// who waits for the outcome.
struct Entry {
    key: Vec<u8>,
    apart: String,
    body: Vec<u8>,
    sent: oneshot::Sender<Result<(), TransportError>>,
}

impl<T: BatchOf + 'static> Batcher<T> {
    pub(crate) fn new(sink: Arc<dyn Sink>) -> Self {
        Self {
            sink,
            topics: Mutex::new(HashMap::new()),
            record: PhantomData,
        }
    }

    /// The queue of `topic`'s sending task, started if it has none running.
    fn queue(&self, topic: &str) -> mpsc::Sender<Entry> {
        let mut topics = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(queue) = topics.get(topic).filter(|q| !q.is_closed()) {
            return queue.clone();
        }
        let (queue, entries) = mpsc::channel(QUEUE);
        tokio::spawn(send_batches::<T>(
            self.sink.clone(),
            topic.to_string(),
            entries,
        ));
        topics.insert(topic.to_string(), queue.clone());
        queue
    }

    /// Publishes one record, given as its body ([`crate::codec::AvroCodec::encode_body`]),
    /// and returns once the broker has acknowledged the message carrying it. A batch
    /// takes the key of its first record; records with the same `apart` go in separate
    /// messages.
    pub(crate) async fn publish(
        &self,
        topic: &str,
        key: Vec<u8>,
        apart: &str,
        body: Vec<u8>,
    ) -> Result<(), TransportError> {
        // Only a panic in a sending task leaves a record unanswered or a queue closed;
        // the next publish starts the topic's task again.
        let lost = || TransportError::Publish {
            topic: topic.to_string(),
            source: "the task sending this topic's records stopped".into(),
            retryable: true,
        };
        let (sent, outcome) = oneshot::channel();
        let entry = Entry {
            key,
            apart: apart.to_string(),
            body,
            sent,
        };
        self.queue(topic).send(entry).await.map_err(|_| lost())?;
        outcome.await.unwrap_or_else(|_| Err(lost()))
    }

    /// [`Batcher::publish`], retrying retryable failures with a growing pause until the
    /// broker takes the record, refuses it for good, or shutdown begins.
    pub(crate) async fn publish_persistently(
        &self,
        topic: &str,
        key: &[u8],
        apart: &str,
        body: &[u8],
        cancel: &CancellationToken,
    ) -> Result<(), TransportError> {
        let mut pause = Duration::from_millis(50);
        loop {
            match self
                .publish(topic, key.to_vec(), apart, body.to_vec())
                .await
            {
                Err(e) if e.is_retryable() && !cancel.is_cancelled() => {
                    warn!(topic, error = %e, "publish failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return Err(e),
                        _ = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
                other => return other,
            }
        }
    }
}

/// A topic's sending task: takes what is queued, up to [`IN_FLIGHT`] messages out at
/// once.
async fn send_batches<T: BatchOf>(
    sink: Arc<dyn Sink>,
    topic: String,
    mut entries: mpsc::Receiver<Entry>,
) {
    let mut out = FuturesUnordered::new();
    let mut open = true;
    while open || !out.is_empty() {
        tokio::select! {
            Some(()) = out.next(), if !out.is_empty() => {}
            first = entries.recv(), if open && out.len() < IN_FLIGHT => match first {
                None => open = false,
                Some(first) => {
                    for group in take_groups(first, &mut entries) {
                        out.push(send_group::<T>(sink.clone(), topic.clone(), group));
                    }
                }
            }
        }
    }
}

/// `first` and whatever else is queued now, up to [`MAX_RECORDS`], as messages to send:
/// in their order, each message within [`MAX_BYTES`] and holding no two records that
/// are to go apart.
fn take_groups(first: Entry, entries: &mut mpsc::Receiver<Entry>) -> Vec<Vec<Entry>> {
    let mut groups: Vec<(Vec<Entry>, usize)> = Vec::new();
    let mut next = Some(first);
    let mut taken = 0;
    while let Some(entry) = next.take() {
        taken += 1;
        let size = entry.body.len();
        let fits = groups.iter_mut().find(|(group, bytes)| {
            bytes + size <= MAX_BYTES && group.iter().all(|e| e.apart != entry.apart)
        });
        match fits {
            Some((group, bytes)) => {
                *bytes += size;
                group.push(entry);
            }
            None => groups.push((vec![entry], size)),
        }
        if taken < MAX_RECORDS {
            next = entries.try_recv().ok();
        }
    }
    groups.into_iter().map(|(group, _)| group).collect()
}

/// Sends one group as one message (a single record as itself) and tells each caller.
async fn send_group<T: BatchOf>(sink: Arc<dyn Sink>, topic: String, mut group: Vec<Entry>) {
    if group.len() == 1 {
        let entry = group.pop().expect("a group holds a record");
        send_alone::<T>(sink.as_ref(), topic, entry).await;
        return;
    }
    let payload = frame_batch::<T>(group.iter().map(|e| e.body.as_slice()));
    let key = group[0].key.clone();
    match sink
        .publish(Outbound::new(topic.clone(), payload).key(key))
        .await
    {
        Ok(_) => {
            for entry in group {
                // A caller that stopped waiting no longer needs the answer.
                let _ = entry.sent.send(Ok(()));
            }
        }
        Err(e) => {
            warn!(%topic, records = group.len(), error = %e, "a batch was not published; sending its records one by one");
            let sink = sink.as_ref();
            futures::future::join_all(
                group
                    .into_iter()
                    .map(|entry| send_alone::<T>(sink, topic.clone(), entry)),
            )
            .await;
        }
    }
}

async fn send_alone<T: BatchOf>(sink: &dyn Sink, topic: String, entry: Entry) {
    let message = Outbound::new(topic, frame_single::<T>(&entry.body)).key(entry.key);
    let _ = entry.sent.send(sink.publish(message).await.map(drop));
}

/// `message`, which holds `record`, as if `record` had travelled alone under `key`:
/// `message` itself unless it is a batch, else a copy carrying only `record`. What a
/// dead letter or a hand-back of one record of a batch sends, so that it concerns that
/// record only.
pub(crate) fn record_alone<T: BatchOf>(message: &Message, record: &T, key: &str) -> Message {
    if fingerprint_of(&message.payload) != Some(T::Batch::codec().fingerprint()) {
        return message.clone();
    }
    match encode(record) {
        Ok(payload) => Message {
            payload: payload.into(),
            key: Some(key.to_string().into_bytes().into()),
            ..message.clone()
        },
        // It was just decoded with the same schema, so this does not happen; the whole
        // batch is the next best record of it.
        Err(_) => message.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::avro::decode_one_or_batch;
    use crate::codec::TaskReadyEvent;
    use crate::transport::memory::MemoryBroker;
    use crate::transport::Broker;

    fn event(n: usize) -> TaskReadyEvent {
        TaskReadyEvent {
            execution_id: format!("e{n}"),
            task_execution_id: format!("e{n}/t"),
            namespace: "public::p::w::t".into(),
            attempt: 1,
            max_attempts: 1,
            ready_at_ms: n as i64,
        }
    }

    fn body(n: usize) -> Vec<u8> {
        TaskReadyEvent::codec().encode_body(&event(n)).unwrap()
    }

    /// The records of every message on `topic`, message by message.
    fn read(broker: &MemoryBroker, topic: &str) -> Vec<Vec<TaskReadyEvent>> {
        broker
            .messages(topic)
            .iter()
            .map(|m| decode_one_or_batch::<TaskReadyEvent>(&m.payload).unwrap())
            .collect()
    }

    #[tokio::test]
    async fn a_lone_record_travels_in_its_own_format() {
        let broker = MemoryBroker::new(1);
        let batcher = Batcher::<TaskReadyEvent>::new(broker.sink());
        batcher
            .publish("t", b"k".to_vec(), "e1", body(1))
            .await
            .unwrap();
        let messages = broker.messages("t");
        let message = &messages[0];
        let alone: TaskReadyEvent = crate::codec::avro::decode(&message.payload).unwrap();
        assert_eq!(alone, event(1));
        assert_eq!(message.key.as_deref(), Some(&b"k"[..]));
    }

    #[tokio::test]
    async fn records_published_together_share_messages_and_none_is_lost() {
        let broker = MemoryBroker::new(1);
        let batcher = Batcher::<TaskReadyEvent>::new(broker.sink());
        let total = 1000;
        let publishes = (0..total).map(|n| {
            let topic = if n % 2 == 0 { "even" } else { "odd" };
            let batcher = &batcher;
            async move {
                batcher
                    .publish(topic, Vec::new(), &format!("e{n}"), body(n))
                    .await
            }
        });
        for outcome in futures::future::join_all(publishes).await {
            outcome.unwrap();
        }
        let mut even = read(&broker, "even");
        let odd = read(&broker, "odd");
        assert!(
            even.len() + odd.len() < total,
            "{} messages for {total} records",
            even.len() + odd.len()
        );
        assert!(even.iter().chain(&odd).all(|m| m.len() <= MAX_RECORDS));
        even.extend(odd);
        let mut seen: Vec<i64> = even.into_iter().flatten().map(|e| e.ready_at_ms).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..total as i64).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn records_to_go_apart_never_share_a_message() {
        let broker = MemoryBroker::new(1);
        let batcher = Batcher::<TaskReadyEvent>::new(broker.sink());
        // Ten tasks of one execution and ten of others, all queued together.
        let publishes = (0..20).map(|n| {
            let apart = if n % 2 == 0 {
                "fan-out".to_string()
            } else {
                format!("e{n}")
            };
            let batcher = &batcher;
            async move { batcher.publish("t", Vec::new(), &apart, body(n)).await }
        });
        for outcome in futures::future::join_all(publishes).await {
            outcome.unwrap();
        }
        let messages = read(&broker, "t");
        assert_eq!(messages.iter().map(Vec::len).sum::<usize>(), 20);
        for message in &messages {
            let fan_out = message.iter().filter(|e| e.ready_at_ms % 2 == 0).count();
            assert!(
                fan_out <= 1,
                "{fan_out} tasks of one execution in a message"
            );
        }
        assert!(messages.len() < 20, "nothing was batched");
    }

    #[tokio::test]
    async fn a_refused_batch_is_sent_record_by_record_so_only_the_oversized_one_fails() {
        // The memory broker refuses messages over 1 KiB here; one record alone is larger.
        let broker = MemoryBroker::with_max_message_bytes(1, 1024);
        let batcher = Batcher::<TaskReadyEvent>::new(broker.sink());
        let mut large = event(0);
        large.namespace = "x".repeat(2000);
        let large = TaskReadyEvent::codec().encode_body(&large).unwrap();
        let outcomes = futures::future::join_all(
            std::iter::once(large)
                .chain((1..20).map(body))
                .enumerate()
                .map(|(n, body)| {
                    let batcher = &batcher;
                    async move {
                        batcher
                            .publish("t", Vec::new(), &format!("e{n}"), body)
                            .await
                    }
                }),
        )
        .await;
        assert!(!outcomes[0].as_ref().unwrap_err().is_retryable());
        assert!(outcomes[1..].iter().all(Result::is_ok), "{outcomes:?}");
        let delivered: usize = read(&broker, "t").iter().map(Vec::len).sum();
        assert_eq!(delivered, 19);
    }
}

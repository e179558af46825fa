//! Publishing dispatch records several to a message: TaskReadyEvents from a state
//! manager, ExecutionResults from a worker.
//!
//! Every task costs the broker a publish, a delivery and an acknowledgement each way, and
//! at full load the broker's per-message work is what limits dispatch. So records that
//! come in while earlier messages await their acknowledgement leave together, as one
//! batch record (`schemas/*_batch.avsc`) holding each record exactly as it travels
//! alone. A record that comes in while nothing is waiting goes at once, by itself, in
//! the single-record format: batching adds no wait, and at a moderate pace the wire
//! carries what it always did. Consumers take either form
//! ([`crate::codec::avro::decode_one_or_batch`]).
//!
//! Each publish still returns only once the broker has acknowledged the message that
//! carries its record, so a caller that commits its input after publishing keeps its
//! at-least-once guarantee. A batch the broker refuses is sent again record by record,
//! so each caller learns its own outcome: one oversized record fails alone.

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::codec::avro::{encode, fingerprint_of, frame_batch, frame_single, AvroRecord, BatchOf};
use crate::transport::{Message, Outbound, Sink, TransportError};

/// Records in one message at most. A worker reads messages ahead of its free capacity,
/// so this also bounds how many tasks one worker can hold back from the others.
pub(crate) const MAX_RECORDS: usize = 64;
/// Bytes of record bodies in one message at most, well under the 1 MiB that Kafka and
/// nats-server take by default. A larger record goes alone.
const MAX_BYTES: usize = 128 * 1024;
/// Messages awaiting their acknowledgement at once. While this many are out, new records
/// queue and leave together: batches grow with the load.
const IN_FLIGHT: usize = 8;
/// Records queued for the publishing task at most; a caller beyond it waits for room.
const QUEUE: usize = 4096;

/// Publishes records of type `T`, batching those that come in together (see the module
/// documentation). The task that sends them starts with the first publish and ends when
/// the batcher is dropped, once what it holds is sent.
pub(crate) struct Batcher<T: BatchOf> {
    sink: Arc<dyn Sink>,
    queue: OnceLock<mpsc::Sender<Entry>>,
    record: PhantomData<fn() -> T>,
}

/// One record on its way: where it goes, its body, and who waits for the outcome.
struct Entry {
    topic: String,
    key: Vec<u8>,
    body: Vec<u8>,
    sent: oneshot::Sender<Result<(), TransportError>>,
}

impl<T: BatchOf + 'static> Batcher<T> {
    pub(crate) fn new(sink: Arc<dyn Sink>) -> Self {
        Self {
            sink,
            queue: OnceLock::new(),
            record: PhantomData,
        }
    }

    /// Publishes one record, given as its body ([`crate::codec::AvroCodec::encode_body`]),
    /// and returns once the broker has acknowledged the message carrying it. A batch
    /// takes the key of its first record.
    pub(crate) async fn publish(
        &self,
        topic: String,
        key: Vec<u8>,
        body: Vec<u8>,
    ) -> Result<(), TransportError> {
        let queue = self.queue.get_or_init(|| {
            let (queue, entries) = mpsc::channel(QUEUE);
            tokio::spawn(send_batches::<T>(self.sink.clone(), entries));
            queue
        });
        let stopped = |topic: String| TransportError::Publish {
            topic,
            source: "the publishing task has stopped".into(),
            retryable: false,
        };
        let (sent, outcome) = oneshot::channel();
        let entry = Entry {
            topic,
            key,
            body,
            sent,
        };
        if let Err(refused) = queue.send(entry).await {
            return Err(stopped(refused.0.topic));
        }
        match outcome.await {
            Ok(outcome) => outcome,
            // Only a panic in the publishing task drops an entry unanswered.
            Err(_) => Err(stopped(String::new())),
        }
    }

    /// [`Batcher::publish`], retrying retryable failures with a growing pause until the
    /// broker takes the record, refuses it for good, or shutdown begins.
    pub(crate) async fn publish_persistently(
        &self,
        topic: &str,
        key: &[u8],
        body: &[u8],
        cancel: &CancellationToken,
    ) -> Result<(), TransportError> {
        let mut pause = Duration::from_millis(50);
        loop {
            match self
                .publish(topic.to_string(), key.to_vec(), body.to_vec())
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

/// The publishing task: takes what is queued, up to [`IN_FLIGHT`] messages out at once.
async fn send_batches<T: BatchOf>(sink: Arc<dyn Sink>, mut entries: mpsc::Receiver<Entry>) {
    let mut out = FuturesUnordered::new();
    let mut open = true;
    while open || !out.is_empty() {
        tokio::select! {
            Some(()) = out.next(), if !out.is_empty() => {}
            first = entries.recv(), if open && out.len() < IN_FLIGHT => match first {
                None => open = false,
                Some(first) => {
                    for (topic, group) in take_groups(first, &mut entries) {
                        out.push(send_group::<T>(sink.clone(), topic, group));
                    }
                }
            }
        }
    }
}

/// `first` and whatever else is queued now, up to [`MAX_RECORDS`], as messages to send:
/// grouped by topic in their order, each group within [`MAX_BYTES`].
fn take_groups(first: Entry, entries: &mut mpsc::Receiver<Entry>) -> Vec<(String, Vec<Entry>)> {
    let mut groups: Vec<(String, Vec<Entry>, usize)> = Vec::new();
    let mut next = Some(first);
    let mut taken = 0;
    while let Some(entry) = next.take() {
        taken += 1;
        let size = entry.body.len();
        let open = groups
            .iter_mut()
            .rev()
            .find(|(topic, _, _)| *topic == entry.topic)
            .filter(|(_, _, bytes)| bytes + size <= MAX_BYTES);
        match open {
            Some((_, group, bytes)) => {
                *bytes += size;
                group.push(entry);
            }
            None => groups.push((entry.topic.clone(), vec![entry], size)),
        }
        if taken < MAX_RECORDS {
            next = entries.try_recv().ok();
        }
    }
    groups
        .into_iter()
        .map(|(topic, group, _)| (topic, group))
        .collect()
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

/// `message`, which holds `record`, as if `record` had travelled alone: `message`
/// itself unless it is a batch, else a copy carrying only `record`. What a dead letter
/// or a hand-back of one record of a batch sends, so that it concerns that record only.
pub(crate) fn record_alone<T: BatchOf>(message: &Message, record: &T) -> Message {
    if fingerprint_of(&message.payload) != Some(T::Batch::codec().fingerprint()) {
        return message.clone();
    }
    match encode(record) {
        Ok(payload) => Message {
            payload: payload.into(),
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
            .publish("t".into(), b"k".to_vec(), body(1))
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
            batcher.publish(topic.into(), Vec::new(), body(n))
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
                .map(|body| batcher.publish("t".into(), Vec::new(), body)),
        )
        .await;
        assert!(!outcomes[0].as_ref().unwrap_err().is_retryable());
        assert!(outcomes[1..].iter().all(Result::is_ok), "{outcomes:?}");
        let delivered: usize = read(&broker, "t").iter().map(Vec::len).sum();
        assert_eq!(delivered, 19);
    }
}

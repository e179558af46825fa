//! The raw-client loop weir is measured against: consume → wrap as a snapshot record →
//! produce, with rdkafka and async-nats used directly (no weir). At most
//! [`OUTPUTS_AWAITED`] outputs await their acknowledgement; an input is acknowledged only
//! after its output (a stored offset on Kafka, ack-all every [`ACK_EVERY`] on JetStream).

use std::time::Duration;

use futures::stream::{FuturesOrdered, StreamExt};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message as _;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};

pub const OUTPUTS_AWAITED: usize = 4096;
pub const ACK_EVERY: usize = 256;

/// What weir's `snapshot` makes of an event: `{"graph", "fire", "degraded", "inputs"}`.
pub fn wrap(payload: &[u8], fire: u64) -> Vec<u8> {
    let event: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
    serde_json::to_vec(&json!({
        "graph": "raw",
        "fire": fire,
        "degraded": false,
        "inputs": {"a": event},
    }))
    .expect("encode")
}

/// The Kafka loop over every partition of `input`, until `events` outputs are
/// acknowledged.
pub async fn kafka(brokers: &str, input: &str, output: &str, group: &str, events: usize) {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(input), Duration::from_secs(10))
        .expect("metadata");
    let mut assignment = TopicPartitionList::new();
    for topic in metadata.topics() {
        for p in topic.partitions() {
            assignment
                .add_partition_offset(input, p.id(), Offset::Beginning)
                .expect("partition");
        }
    }
    consumer.assign(&assignment).expect("assign");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("acks", "all")
        .set("linger.ms", "1")
        .create()
        .expect("producer");
    let mut pending = FuturesOrdered::new();
    let mut fire = 0u64;
    let mut done = 0usize;
    while done < events {
        tokio::select! {
            Some((partition, offset)) = pending.next(), if !pending.is_empty() => {
                consumer
                    .store_offset(input, partition, offset)
                    .expect("store offset");
                done += 1;
            }
            message = consumer.recv(), if pending.len() < OUTPUTS_AWAITED => {
                let message = message.expect("consume");
                fire += 1;
                let body = wrap(message.payload().unwrap_or_default(), fire);
                let (partition, offset) = (message.partition(), message.offset());
                let delivery = loop {
                    match producer.send_result(FutureRecord::<(), [u8]>::to(output).payload(&body)) {
                        Ok(delivery) => break delivery,
                        Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                    }
                };
                pending.push_back(async move {
                    delivery.await.expect("delivered").expect("acknowledged");
                    (partition, offset)
                });
            }
        }
    }
    consumer
        .commit_consumer_state(rdkafka::consumer::CommitMode::Sync)
        .expect("commit");
}

/// The JetStream loop over `input` (a subject its stream captures), until `events`
/// outputs are acknowledged.
pub async fn nats(url: &str, input: &str, output: &str, durable: &str, events: usize) {
    use async_nats::jetstream::{self, consumer};
    let client = async_nats::connect(url).await.expect("nats");
    let js = jetstream::new(client);
    let stream = js
        .get_stream(weir::transport::nats::stream_name(input))
        .await
        .expect("input stream");
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(durable.to_string()),
            ack_policy: consumer::AckPolicy::All,
            deliver_policy: consumer::DeliverPolicy::All,
            filter_subject: input.to_string(),
            max_ack_pending: 100_000,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut pending = FuturesOrdered::new();
    let mut fire = 0u64;
    let mut done = 0usize;
    while done < events {
        tokio::select! {
            Some(message) = pending.next(), if !pending.is_empty() => {
                done += 1;
                let message: jetstream::Message = message;
                if done % ACK_EVERY == 0 || done == events {
                    message.ack().await.expect("ack");
                }
            }
            message = messages.next(), if pending.len() < OUTPUTS_AWAITED => {
                let message = message.expect("stream open").expect("consume");
                fire += 1;
                let body = wrap(&message.payload, fire);
                let ack = js
                    .publish(output.to_string(), body.into())
                    .await
                    .expect("publish");
                pending.push_back(async move {
                    ack.await.expect("acknowledged");
                    message
                });
            }
        }
    }
}

//! In-process broker: topics with partitions and offsets, consumer groups with committed
//! positions. A group member reads every partition of its topic (one member per group).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use tokio::sync::Notify;

use super::{
    now_ms, Acks, Assignment, Broker, FinishedPrefix, Message, Outbound, PartitionedTopic,
    Position, Sink, Source, StartFrom, Subscription, TransportError,
};

/// How many messages a source takes from the broker per lock.
const FETCH_BATCH: usize = 256;

#[derive(Clone)]
pub struct MemoryBroker {
    inner: Arc<Inner>,
}

struct Inner {
    partitions: usize,
    /// Largest payload taken, as a real broker has one; `None` takes any size.
    max_message_bytes: Option<usize>,
    topics: Mutex<HashMap<String, Arc<Topic>>>,
}

struct Topic {
    name: Arc<str>,
    log: Mutex<TopicLog>,
    appended: Notify,
}

struct TopicLog {
    partitions: Vec<Vec<Message>>,
    /// Next offset to read, per group and partition.
    committed: HashMap<String, Vec<i64>>,
    round_robin: usize,
}

impl Default for MemoryBroker {
    fn default() -> Self {
        Self::new(1)
    }
}

impl MemoryBroker {
    /// A broker whose topics are created with `partitions` partitions on first use.
    pub fn new(partitions: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                partitions: partitions.max(1),
                max_message_bytes: None,
                topics: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A broker that refuses messages (payload, key and headers) larger than `limit`
    /// bytes, for good, as Kafka and NATS refuse messages over their size limits.
    pub fn with_max_message_bytes(partitions: usize, limit: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                partitions: partitions.max(1),
                max_message_bytes: Some(limit),
                topics: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn topic(&self, name: &str) -> Arc<Topic> {
        self.topic_with(name, self.inner.partitions)
    }

    /// The topic, created with `partitions` partitions if it does not exist yet.
    fn topic_with(&self, name: &str, partitions: usize) -> Arc<Topic> {
        let mut topics = lock(&self.inner.topics);
        topics
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(Topic {
                    name: Arc::from(name),
                    log: Mutex::new(TopicLog {
                        partitions: vec![Vec::new(); partitions],
                        committed: HashMap::new(),
                        round_robin: 0,
                    }),
                    appended: Notify::new(),
                })
            })
            .clone()
    }

    /// Every message of a topic, partition by partition, for inspection and tests.
    pub fn messages(&self, topic: &str) -> Vec<Message> {
        let topic = self.topic(topic);
        let log = lock(&topic.log);
        log.partitions.iter().flatten().cloned().collect()
    }

    /// The positions a group will resume from, one per partition.
    pub fn committed(&self, topic: &str, group: &str) -> Vec<i64> {
        let topic = self.topic(topic);
        let log = lock(&topic.log);
        log.committed
            .get(group)
            .cloned()
            .unwrap_or_else(|| vec![0; log.partitions.len()])
    }

    /// Adds partitions to a topic, as an operator may to a Kafka topic while it is read.
    pub fn add_partitions(&self, topic: &str, added: usize) {
        let topic = self.topic(topic);
        {
            let mut log = lock(&topic.log);
            let count = log.partitions.len() + added;
            log.partitions.resize_with(count, Vec::new);
            for committed in log.committed.values_mut() {
                committed.resize(count, 0);
            }
        }
        topic.appended.notify_waiters();
    }

    /// Appends `message` to `partition` of its topic whatever its key says, as a producer
    /// whose partitioner places keys its own way would (Java's murmur2, say). A
    /// partition past the topic's count is an error.
    pub fn publish_to_partition(
        &self,
        message: Outbound,
        partition: i32,
    ) -> Result<Position, TransportError> {
        self.append_at(message, Some(partition))
    }

    fn append(&self, message: Outbound) -> Result<Position, TransportError> {
        self.append_at(message, None)
    }

    fn append_at(
        &self,
        message: Outbound,
        chosen: Option<i32>,
    ) -> Result<Position, TransportError> {
        validate_topic(&message.topic)?;
        if let Some(limit) = self.inner.max_message_bytes {
            // Key and headers count, as they do on Kafka and NATS.
            let size = message.payload.len()
                + message.key.as_ref().map_or(0, |key| key.len())
                + message
                    .headers
                    .iter()
                    .map(|(name, value)| name.len() + value.len())
                    .sum::<usize>();
            if size > limit {
                return Err(TransportError::Publish {
                    source: format!(
                        "message of {size} bytes is larger than the broker takes ({limit})"
                    )
                    .into(),
                    topic: message.topic.to_string(),
                    retryable: false,
                });
            }
        }
        let topic = self.topic(&message.topic);
        let position = {
            let mut log = lock(&topic.log);
            let count = log.partitions.len();
            let partition = match (chosen, &message.key) {
                (Some(chosen), _) => match usize::try_from(chosen) {
                    Ok(chosen) if chosen < count => chosen,
                    _ => {
                        return Err(TransportError::Publish {
                            source: format!(
                                "partition {chosen} does not exist: the topic has {count}"
                            )
                            .into(),
                            topic: message.topic.to_string(),
                            retryable: false,
                        })
                    }
                },
                // As librdkafka's default partitioner places keys.
                (None, Some(key)) => (super::crc32(key) % count as u32) as usize,
                (None, None) => {
                    log.round_robin = (log.round_robin + 1) % count;
                    log.round_robin
                }
            };
            let entries = &mut log.partitions[partition];
            let position = Position {
                partition: partition as i32,
                offset: entries.len() as i64,
            };
            entries.push(Message {
                topic: topic.name.clone(),
                position,
                key: message.key,
                payload: message.payload,
                headers: message.headers,
                timestamp_ms: now_ms(),
            });
            position
        };
        topic.appended.notify_waiters();
        Ok(position)
    }
}

fn validate_topic(topic: &str) -> Result<(), TransportError> {
    if topic.is_empty() || topic.chars().any(|c| c.is_whitespace()) {
        return Err(TransportError::InvalidTopic {
            topic: topic.to_string(),
            reason: "must be non-empty and contain no whitespace".into(),
        });
    }
    Ok(())
}

/// Poisoning only happens if a thread panicked while holding the lock; the data (a log of
/// appended messages) is still consistent, so keep going.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[async_trait]
impl Broker for MemoryBroker {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Source>, TransportError> {
        validate_topic(&subscription.topic)?;
        let topic = self.topic(&subscription.topic);
        let next = {
            let mut log = lock(&topic.log);
            let lengths: Vec<i64> = log.partitions.iter().map(|p| p.len() as i64).collect();
            let committed = log
                .committed
                .entry(subscription.group.clone())
                .or_insert_with(|| match subscription.start {
                    StartFrom::Earliest => vec![0; lengths.len()],
                    StartFrom::Latest => lengths.clone(),
                });
            committed.clone()
        };
        let mut next = next;
        if subscription.assignment != Assignment::Group {
            for p in &subscription.resume_after {
                if let Some(n) = next.get_mut(p.partition as usize) {
                    *n = p.offset + 1;
                }
            }
        }
        let partitions = match &subscription.assignment {
            Assignment::Partitions(wanted) => {
                for p in wanted {
                    if *p < 0 || *p as usize >= next.len() {
                        return Err(TransportError::Consume {
                            topic: subscription.topic.clone(),
                            source: format!("partition {p} does not exist").into(),
                            retryable: false,
                        });
                    }
                }
                wanted.clone()
            }
            Assignment::Group | Assignment::All => (0..next.len() as i32).collect(),
        };
        Ok(Box::new(MemorySource {
            topic,
            group: subscription.group.clone(),
            grows: !matches!(subscription.assignment, Assignment::Partitions(_)),
            partitions,
            next,
            buffer: VecDeque::new(),
            turn: 0,
            prefix: matches!(subscription.acks, Acks::Each { .. }).then(FinishedPrefix::default),
        }))
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<PartitionedTopic, TransportError> {
        validate_topic(topic)?;
        let log = self.topic_with(topic, partitions.max(1) as usize);
        let count = lock(&log.log).partitions.len();
        Ok(PartitionedTopic::native(topic, count as u32))
    }

    fn sink(&self) -> Arc<dyn Sink> {
        Arc::new(self.clone())
    }

    async fn ping(&self) -> Result<(), TransportError> {
        Ok(())
    }
}

#[async_trait]
impl Sink for MemoryBroker {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
        self.append(message)
    }
}

struct MemorySource {
    topic: Arc<Topic>,
    group: String,
    /// Whether partitions added to the topic are read too (every assignment but an
    /// explicit list of partitions).
    grows: bool,
    partitions: Vec<i32>,
    /// Next offset to fetch, per partition (not the committed position).
    next: Vec<i64>,
    buffer: VecDeque<Message>,
    turn: usize,
    /// With [`Acks::Each`]: delivered, unfinished messages hold commits back.
    prefix: Option<FinishedPrefix>,
}

impl MemorySource {
    /// Moves available messages into the local buffer, taking partitions in turn so a
    /// busy partition cannot starve the others.
    fn fetch(&mut self) -> bool {
        let log = lock(&self.topic.log);
        if self.grows && log.partitions.len() > self.next.len() {
            // Added partitions hold only what was written after this source started.
            for p in self.next.len()..log.partitions.len() {
                self.partitions.push(p as i32);
                self.next.push(0);
            }
        }
        for _ in 0..self.partitions.len() {
            self.turn = (self.turn + 1) % self.partitions.len();
            let p = self.partitions[self.turn] as usize;
            let entries = &log.partitions[p];
            let from = self.next[p] as usize;
            if from < entries.len() {
                let to = (from + FETCH_BATCH).min(entries.len());
                self.buffer.extend(entries[from..to].iter().cloned());
                self.next[p] = to as i64;
                return true;
            }
        }
        false
    }
}

#[async_trait]
impl Source for MemorySource {
    fn ready(&mut self) -> Option<Result<Message, TransportError>> {
        // A read dropped before it completes loses nothing.
        futures::FutureExt::now_or_never(self.next())
    }

    async fn next(&mut self) -> Result<Message, TransportError> {
        // As a read from a tokio channel spends the task's budget: a reader with a backlog
        // yields its thread every so often, so the tasks sharing it (lease keepers) run.
        tokio::task::consume_budget().await;
        loop {
            if let Some(message) = self.buffer.pop_front() {
                if let Some(prefix) = &mut self.prefix {
                    prefix.delivered(message.position);
                }
                return Ok(message);
            }
            let topic = self.topic.clone();
            let appended = topic.appended.notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            if self.fetch() {
                continue;
            }
            appended.await;
        }
    }

    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
        let prefix;
        let through = match &mut self.prefix {
            Some(open) => {
                prefix = open.finished(through);
                &prefix[..]
            }
            None => through,
        };
        let mut log = lock(&self.topic.log);
        let partitions = log.partitions.len();
        let committed = log
            .committed
            .entry(self.group.clone())
            .or_insert_with(|| vec![0; partitions]);
        for position in through {
            let p = position.partition as usize;
            if p >= committed.len() {
                return Err(TransportError::Commit {
                    topic: self.topic.name.to_string(),
                    source: format!("partition {} does not exist", position.partition).into(),
                });
            }
            committed[p] = committed[p].max(position.offset + 1);
        }
        Ok(())
    }
}

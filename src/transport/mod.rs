//! The broker seam: [`Source`] (consume with commit-after-durable) and [`Sink`] (publish
//! and wait for the acknowledgement), created by a [`Broker`].
//!
//! Backends: [`memory`] (the embedded default). Every backend keeps per-partition offsets
//! and commits only what the caller says is durable, so at-least-once behaves the same
//! everywhere.

pub mod concurrent;
pub mod kafka;
pub mod memory;
pub mod nats;
mod setup;

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Where a message sits in its topic: one partition's offset. For a JetStream-like log
/// with a single sequence, the partition is 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Position {
    pub partition: i32,
    pub offset: i64,
}

/// Message headers: names are mostly weir's own constants, so they borrow when they can.
pub type Headers = Vec<(Cow<'static, str>, HeaderValue)>;

/// A header's value. Most are short (a fire number, `true`, a graph's name): those are
/// kept inline, a constant is borrowed, and a longer one is shared on clone, so stamping
/// every output with the same few headers allocates nothing per message.
pub type HeaderValue = smol_str::SmolStr;

/// The topic an outbound message goes to. A graph publishes every fire to the same few
/// topics: a short name is kept inline and a longer one shared on clone, so addressing a
/// message allocates nothing.
pub type TopicName = smol_str::SmolStr;

/// A consumed message.
#[derive(Debug, Clone)]
pub struct Message {
    pub topic: Arc<str>,
    pub position: Position,
    pub key: Option<Bytes>,
    pub payload: Bytes,
    pub headers: Headers,
    pub timestamp_ms: i64,
}

impl Message {
    /// The first header with this name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A message to publish.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub topic: TopicName,
    pub key: Option<Bytes>,
    pub payload: Bytes,
    pub headers: Headers,
}

impl Outbound {
    pub fn new(topic: impl Into<TopicName>, payload: impl Into<Bytes>) -> Self {
        Self {
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
        }
    }

    pub fn key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    pub fn header(
        mut self,
        name: impl Into<Cow<'static, str>>,
        value: impl Into<HeaderValue>,
    ) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// Where a new consumer group starts when it has no committed position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartFrom {
    /// The oldest retained message, so a new graph never skips what came before it.
    #[default]
    Earliest,
    Latest,
}

/// Which partitions a consumer reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Assignment {
    /// Join the group; the broker spreads partitions over its members.
    #[default]
    Group,
    /// Read every partition directly, with the group's committed positions. For a
    /// consumer that is the only one of its group (a graph holding its lease): no
    /// group join, no rebalance.
    All,
    /// Read these partitions directly.
    Partitions(Vec<i32>),
}

/// What to consume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub topic: String,
    /// Consumer group (Kafka) or durable consumer name (JetStream).
    pub group: String,
    pub start: StartFrom,
    pub assignment: Assignment,
    /// Positions already processed: the consumer's own checkpoint, or, for a reader
    /// carrying its run on after its source broke, what that run took in (ahead of the
    /// checkpoint and of the broker's commit, since it still holds those messages). A
    /// source with [`Assignment::All`] starts right after them, whatever the broker
    /// last recorded: the checkpoint is written before the broker commit, so it is
    /// never behind.
    pub resume_after: Vec<Position>,
    pub acks: Acks,
    /// The fencing token of the lease a sole reader ([`Assignment::All`]) reads under,
    /// if any. On JetStream, where a sole reader removes its predecessors' consumers, one
    /// under an older token (a deposed holder reading again before it notices) leaves
    /// its successor's alone.
    pub fencing: Option<u64>,
}

/// What a commit acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Acks {
    /// Everything up to and including the given positions (a consumer that finishes
    /// messages in order, or commits only a finished prefix).
    #[default]
    Cumulative,
    /// Exactly the given positions, where the broker can acknowledge single messages
    /// (JetStream); elsewhere the same as `Cumulative`, so callers commit only finished
    /// prefixes. For members of a shared work queue that finish out of order, and read
    /// at most `prefetch` messages ahead.
    Each { prefetch: usize },
}

impl Subscription {
    pub fn new(topic: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            group: group.into(),
            start: StartFrom::Earliest,
            assignment: Assignment::Group,
            resume_after: Vec::new(),
            acks: Acks::Cumulative,
            fencing: None,
        }
    }

    /// Read under a lease with fencing token `token`.
    pub fn fenced(mut self, token: u64) -> Self {
        self.fencing = Some(token);
        self
    }

    /// A member of a shared work queue: acknowledges single messages and prefetches at
    /// most `prefetch` of them.
    pub fn work_queue(topic: impl Into<String>, group: impl Into<String>, prefetch: usize) -> Self {
        Self {
            acks: Acks::Each {
                prefetch: prefetch.max(1),
            },
            ..Self::new(topic, group)
        }
    }
}

/// A topic whose messages are spread over a fixed number of partitions by their key,
/// each partition read by one owner at a time (the partitions of a job type).
///
/// A key's partition is `crc32(key) mod partitions` (CRC-32/ISO-HDLC, the one of zlib,
/// Java's `CRC32` and Go's `crc32.ChecksumIEEE`): what librdkafka's default partitioner
/// does on Kafka, and what a NATS producer outside weir computes to pick the subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionedTopic {
    pub topic: String,
    pub partitions: u32,
    pub layout: PartitionLayout,
}

/// How a [`PartitionedTopic`]'s partitions appear on the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionLayout {
    /// The broker's own partitions of the topic (Kafka, memory); the producer's
    /// partitioner places each key.
    Native,
    /// One subject per partition, `<topic>.<partition>`, all captured by one stream
    /// (NATS JetStream); the producer names the partition in the subject.
    Subjects,
}

impl PartitionedTopic {
    pub fn native(topic: &str, partitions: u32) -> Self {
        Self {
            topic: topic.to_string(),
            partitions: partitions.max(1),
            layout: PartitionLayout::Native,
        }
    }

    pub fn subjects(topic: &str, partitions: u32) -> Self {
        Self {
            topic: topic.to_string(),
            partitions: partitions.max(1),
            layout: PartitionLayout::Subjects,
        }
    }

    /// The partition of a key.
    pub fn partition_of(&self, key: &[u8]) -> i32 {
        (crc32(key) % self.partitions.max(1)) as i32
    }

    /// Why a message of `key` read from `partition` does not belong there, if it does
    /// not: on subjects the producer names the partition, and one counting partitions
    /// differently would split a key's messages between two owners. On a broker's own
    /// partitions the producer's partitioner decides, and nothing is checked here (jobs
    /// check the partition their stored record names).
    pub fn misplaced(&self, key: &str, partition: i32) -> Option<String> {
        if self.layout != PartitionLayout::Subjects {
            return None;
        }
        let home = self.partition_of(key.as_bytes());
        (home != partition).then(|| {
            format!(
                "{} belongs to partition {home} of {}, not {partition}: producers and nodes disagree on the partition count",
                quoted_key(key),
                self.partitions
            )
        })
    }

    /// Where a message to `key` is published: the topic itself, or the subject of the
    /// key's partition.
    pub fn topic_for(&self, key: &[u8]) -> String {
        match self.layout {
            PartitionLayout::Native => self.topic.clone(),
            PartitionLayout::Subjects => self.partition_topic(self.partition_of(key)),
        }
    }

    /// A message to `key`.
    pub fn outbound(&self, key: &str, payload: impl Into<Bytes>) -> Outbound {
        Outbound::new(self.topic_for(key.as_bytes()), payload).key(key.to_string())
    }

    /// The topic or subject holding one partition.
    fn partition_topic(&self, partition: i32) -> String {
        match self.layout {
            PartitionLayout::Native => self.topic.clone(),
            PartitionLayout::Subjects => format!("{}.{partition}", self.topic),
        }
    }

    /// Reads one partition alone, right after `resume_after` (an offset already
    /// processed), else from the group's position or the earliest message.
    pub fn subscription(
        &self,
        partition: i32,
        group: &str,
        resume_after: Option<i64>,
    ) -> Subscription {
        let (assignment, position_partition) = match self.layout {
            PartitionLayout::Native => (Assignment::Partitions(vec![partition]), partition),
            // A subject of its own: its positions are the stream's, in "partition" 0.
            PartitionLayout::Subjects => (Assignment::All, 0),
        };
        Subscription {
            assignment,
            resume_after: resume_after
                .map(|offset| Position {
                    partition: position_partition,
                    offset,
                })
                .into_iter()
                .collect(),
            ..Subscription::new(self.partition_topic(partition), group)
        }
    }
}

/// CRC-32/ISO-HDLC (reflected, polynomial 0xEDB88320), bit by bit: keys are short.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// The cause a backend error keeps: the client's own error, or a message where the
/// client had none.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A broker operation failed. Each variant keeps the client's error as its `source`.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("broker {broker} unreachable: {source}")]
    Unreachable {
        broker: String,
        #[source]
        source: BoxError,
    },
    /// The client refused its settings (an unknown option, a file it cannot read):
    /// no retry helps until the config changes.
    #[error("broker {broker} settings refused: {source}")]
    Settings {
        broker: String,
        #[source]
        source: BoxError,
    },
    #[error("publish to {topic} failed: {source}")]
    Publish {
        topic: String,
        #[source]
        source: BoxError,
        retryable: bool,
    },
    #[error("consume from {topic} failed: {source}")]
    Consume {
        topic: String,
        #[source]
        source: BoxError,
        retryable: bool,
    },
    #[error("commit on {topic} failed: {source}")]
    Commit {
        topic: String,
        #[source]
        source: BoxError,
    },
    /// The name breaks the broker's rules (`reason` says which); no cause to keep.
    #[error("invalid topic or subject {topic:?}: {reason}")]
    InvalidTopic { topic: String, reason: String },
    #[error("source on {topic} is closed")]
    Closed { topic: String },
}

/// The class of a [`TransportError`], for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportErrorKind {
    Unreachable,
    Settings,
    Publish,
    Consume,
    Commit,
    InvalidTopic,
    Closed,
}

impl TransportError {
    pub fn kind(&self) -> TransportErrorKind {
        match self {
            Self::Unreachable { .. } => TransportErrorKind::Unreachable,
            Self::Settings { .. } => TransportErrorKind::Settings,
            Self::Publish { .. } => TransportErrorKind::Publish,
            Self::Consume { .. } => TransportErrorKind::Consume,
            Self::Commit { .. } => TransportErrorKind::Commit,
            Self::InvalidTopic { .. } => TransportErrorKind::InvalidTopic,
            Self::Closed { .. } => TransportErrorKind::Closed,
        }
    }

    /// Whether the same call may succeed later (the broker came back, a leader moved).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Unreachable { .. } | Self::Commit { .. } => true,
            Self::Publish { retryable, .. } | Self::Consume { retryable, .. } => *retryable,
            Self::Settings { .. } | Self::InvalidTopic { .. } | Self::Closed { .. } => false,
        }
    }
}

/// A consumer on one topic or subject. It delivers each partition in order: a position
/// at or before one already delivered is taken for a redelivery and dropped.
#[async_trait]
pub trait Source: Send {
    /// The next message, waiting for one if none is available.
    async fn next(&mut self) -> Result<Message, TransportError>;

    /// A message the source already holds, without waiting: `None` when there is none
    /// at hand. Also `None` (the default) for a source that could only tell by starting
    /// work it must not drop half done, such as a poll.
    fn ready(&mut self) -> Option<Result<Message, TransportError>> {
        None
    }

    /// Marks everything up to and including each position as processed, so a restarted
    /// consumer of the same group resumes right after it.
    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError>;

    /// Tells the broker that these delivered messages are still being worked on, so it
    /// does not redeliver them yet. Brokers that never redeliver to a live consumer
    /// need nothing.
    async fn keep_alive(&mut self, _positions: &[Position]) -> Result<(), TransportError> {
        Ok(())
    }

    /// Waits while the consumer has as many messages in flight as it may take, instead
    /// of reading. A source whose client must go on polling to stay in its group (Kafka's
    /// `max.poll.interval.ms`) stops fetching here and polls, keeping whatever still
    /// arrives for the next read. Returns to be called again; an error is reported as a
    /// failed read.
    async fn hold(&mut self) -> Result<(), TransportError> {
        std::future::pending().await
    }

    /// Whether what arrives while the source goes unread waits for it (a broker keeps
    /// it). False for core NATS, whose client drops what a subscriber does not take in
    /// time: such a source is read on whatever is pending.
    fn keeps_unread(&self) -> bool {
        true
    }
}

/// The acknowledgement of a message already handed to the broker client: a future to
/// await, or the broker's answer already there (a sink that publishes before returning),
/// which is held as it is rather than boxed in a future of its own, since every output of
/// such a sink would otherwise allocate one.
#[must_use = "an acknowledgement says whether the broker took the message"]
pub struct PendingAck(Acknowledgement);

enum Acknowledgement {
    /// `None` once awaited.
    Given(Option<Result<Position, TransportError>>),
    Awaited(futures::future::BoxFuture<'static, Result<Position, TransportError>>),
}

impl PendingAck {
    /// An acknowledgement the broker has already given (or refused).
    pub fn given(acknowledged: Result<Position, TransportError>) -> Self {
        Self(Acknowledgement::Given(Some(acknowledged)))
    }

    /// An acknowledgement still to come, from `acknowledged`.
    pub fn awaited(
        acknowledged: impl Future<Output = Result<Position, TransportError>> + Send + 'static,
    ) -> Self {
        Self(Acknowledgement::Awaited(Box::pin(acknowledged)))
    }

    /// Whether the broker has already taken the message: awaiting the acknowledgement
    /// would then return its position without waiting.
    pub fn is_taken(&self) -> bool {
        matches!(self.0, Acknowledgement::Given(Some(Ok(_))))
    }
}

impl Future for PendingAck {
    type Output = Result<Position, TransportError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match &mut self.0 {
            Acknowledgement::Given(acknowledged) => std::task::Poll::Ready(
                acknowledged
                    .take()
                    .expect("an acknowledgement is awaited once"),
            ),
            Acknowledgement::Awaited(future) => future.as_mut().poll(cx),
        }
    }
}

impl std::fmt::Debug for PendingAck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Acknowledgement::Given(acknowledged) => f
                .debug_tuple("PendingAck::Given")
                .field(acknowledged)
                .finish(),
            Acknowledgement::Awaited(_) => f.write_str("PendingAck::Awaited"),
        }
    }
}

/// A producer. `publish` returns once the broker has acknowledged the message.
#[async_trait]
pub trait Sink: Send + Sync {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError>;

    /// Hands the message to the broker client and returns once it is queued for
    /// sending, leaving the acknowledgement to await. A burst sent this way leaves in
    /// order, with no round trip between its messages, when each hand-over is awaited
    /// before the next starts (only the acknowledgements awaited together). Backends
    /// whose client has no such split publish the whole message here, and their
    /// callers then wait for each acknowledgement in turn.
    async fn enqueue(&self, message: Outbound) -> Result<PendingAck, TransportError> {
        Ok(PendingAck::given(self.publish(message).await))
    }
}

/// A connection to one broker, handing out sources and sinks.
#[async_trait]
pub trait Broker: Send + Sync {
    /// A short name for logs and errors: `memory`, `kafka`, `nats`.
    fn kind(&self) -> &'static str;

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Source>, TransportError>;

    fn sink(&self) -> Arc<dyn Sink>;

    /// Makes `topic` ready to be read partition by partition: created with `partitions`
    /// partitions where the broker creates topics (a topic that exists keeps its own
    /// count), or captured as one subject per partition.
    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<PartitionedTopic, TransportError>;

    /// Succeeds when the broker answers.
    async fn ping(&self) -> Result<(), TransportError>;

    /// How long the broker waits for a delivered message's acknowledgement before it
    /// delivers the message again, where it does (JetStream's ack wait). A graph
    /// acknowledges its inputs only once a stored cache snapshot holds them, so its
    /// snapshot and checkpoint intervals must stay well within this.
    fn redelivery_wait(&self) -> Option<Duration> {
        None
    }
}

/// Opens a source afresh, each time an accumulator (re)starts.
#[async_trait]
pub trait SourceFactory: Send + Sync {
    /// Where the source reads from, for logs, errors and dead-letter topics.
    fn describe(&self) -> String;

    /// `resume_after`: positions the caller has already processed, those of its
    /// checkpoint or later ones a run it carries on took in (see
    /// [`Subscription::resume_after`]).
    async fn open(&self, resume_after: &[Position]) -> Result<Box<dyn Source>, TransportError>;

    /// Opens it for a reader under a lease with fencing token `fencing` (see
    /// [`Subscription::fencing`]). A source that does not care opens as [`Self::open`].
    async fn open_fenced(
        &self,
        resume_after: &[Position],
        fencing: u64,
    ) -> Result<Box<dyn Source>, TransportError> {
        let _ = fencing;
        self.open(resume_after).await
    }
}

/// A [`SourceFactory`] subscribing on a broker.
pub struct BrokerSource {
    pub broker: Arc<dyn Broker>,
    pub subscription: Subscription,
}

#[async_trait]
impl SourceFactory for BrokerSource {
    fn describe(&self) -> String {
        self.subscription.topic.clone()
    }

    async fn open(&self, resume_after: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        let mut subscription = self.subscription.clone();
        subscription.resume_after = resume_after.to_vec();
        self.broker.subscribe(&subscription).await
    }

    async fn open_fenced(
        &self,
        resume_after: &[Position],
        fencing: u64,
    ) -> Result<Box<dyn Source>, TransportError> {
        let mut subscription = self.subscription.clone().fenced(fencing);
        subscription.resume_after = resume_after.to_vec();
        self.broker.subscribe(&subscription).await
    }
}

/// For brokers that only commit "through an offset": turns messages finished out of
/// order into the finished prefix of each partition, so [`Acks::Each`] never commits
/// past a message still being worked on.
#[derive(Debug, Default)]
pub(crate) struct FinishedPrefix {
    /// Delivered and not yet finished, per partition.
    open: std::collections::BTreeMap<i32, std::collections::BTreeSet<i64>>,
    /// Highest finished offset per partition.
    finished: std::collections::BTreeMap<i32, i64>,
    /// Highest offset already handed out for commit, per partition.
    committed: std::collections::BTreeMap<i32, i64>,
}

impl FinishedPrefix {
    pub(crate) fn delivered(&mut self, position: Position) {
        self.open
            .entry(position.partition)
            .or_default()
            .insert(position.offset);
    }

    /// A partition was taken away: its open offsets will be delivered again (here or
    /// elsewhere), so they must not hold back commits, and work delivered before the
    /// loss no longer counts when it finishes.
    pub(crate) fn revoke(&mut self, partition: i32) {
        self.open.remove(&partition);
        self.finished.remove(&partition);
        self.committed.remove(&partition);
    }

    /// Marks messages finished; returns the positions that may now be committed.
    pub(crate) fn finished(&mut self, positions: &[Position]) -> Vec<Position> {
        let mut touched = std::collections::BTreeSet::new();
        for p in positions {
            // Only what is delivered and open since the partition was (last) assigned
            // counts. A finish from before a rebalance may be far ahead of what the
            // partition, assigned again, has redelivered so far; counting it would
            // commit past messages not yet handled, lost if the partition moves again.
            let was_open = self
                .open
                .get_mut(&p.partition)
                .is_some_and(|open| open.remove(&p.offset));
            if !was_open {
                continue;
            }
            let highest = self.finished.entry(p.partition).or_insert(i64::MIN);
            *highest = (*highest).max(p.offset);
            touched.insert(p.partition);
        }
        let mut commit = Vec::new();
        for partition in touched {
            let finished = self.finished[&partition];
            let through = match self.open.get(&partition).and_then(|o| o.first()) {
                Some(&oldest_open) => finished.min(oldest_open - 1),
                None => finished,
            };
            let committed = self.committed.entry(partition).or_insert(i64::MIN);
            if through > *committed && through >= 0 {
                *committed = through;
                commit.push(Position {
                    partition,
                    offset: through,
                });
            }
        }
        commit
    }
}

/// Publishes `message`, retrying retryable failures (broker away, leader moving) with
/// pauses doubling from 50 ms to 5 s, until the broker has it, the failure is final, or
/// `cancel` fires. For messages that must not be dropped: results and dead letters.
pub async fn publish_persistently(
    sink: &dyn Sink,
    message: Outbound,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<Position, TransportError> {
    let mut pause = std::time::Duration::from_millis(50);
    loop {
        match sink.publish(message.clone()).await {
            Err(e) if e.is_retryable() && !cancel.is_cancelled() => {
                tracing::warn!(topic = %message.topic, error = %e, "publish failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return Err(e),
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

/// How long a consumer that is starting up keeps trying to subscribe while the broker
/// fails for now (a server restarting, JetStream electing a leader, a stream being
/// created as another is deleted) before it gives up, so that a process that cannot
/// start says so within a minute.
pub const SUBSCRIBE_PATIENCE: Duration = Duration::from_secs(30);

/// Subscribes, trying again after retryable failures with pauses doubling from 100 ms
/// to 5 s, for up to `patience` from the first attempt. The last failure once patience
/// runs out, or at once a failure no retry can help; `None` when `cancel` fires first,
/// even in the middle of an attempt.
pub async fn subscribe_patiently(
    broker: &dyn Broker,
    subscription: &Subscription,
    patience: Duration,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<Option<Box<dyn Source>>, TransportError> {
    let give_up = tokio::time::Instant::now() + patience;
    let mut pause = Duration::from_millis(100);
    loop {
        let attempt = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Ok(None),
            attempt = broker.subscribe(subscription) => attempt,
        };
        match attempt {
            Ok(source) => return Ok(Some(source)),
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < give_up => {
                tracing::warn!(topic = %subscription.topic, error = %e, "subscribing failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Publishes a dead letter carrying the message that could not be applied, as
/// [`publish_persistently`] does. The letter adds headers to the message, so one that
/// came in just under the broker's size limit can make a letter over it, refused for
/// good: retried, it would stop its source for good. A letter refused for good goes
/// again without the payload, [`crate::wire::PAYLOAD_OMITTED_HEADER`] giving its size
/// and the refusal added to its `weir-error`; its other headers (source topic,
/// partition, offset) still say where the message is.
pub async fn publish_dead_letter(
    sink: &dyn Sink,
    letter: Outbound,
    cancel: &tokio_util::sync::CancellationToken,
) -> Result<Position, TransportError> {
    match publish_persistently(sink, letter.clone(), cancel).await {
        Err(e) if !e.is_retryable() && !letter.payload.is_empty() => {
            tracing::warn!(topic = %letter.topic, bytes = letter.payload.len(), error = %e, "dead letter refused; sent again without the message's payload");
            publish_persistently(sink, without_payload(letter, &e), cancel).await
        }
        other => other,
    }
}

/// `letter` without its payload, the payload's size in its own header and why it was
/// left out in the error header.
fn without_payload(mut letter: Outbound, refusal: &TransportError) -> Outbound {
    let bytes = std::mem::take(&mut letter.payload).len();
    let mut why = format!("payload left out, the letter with it was refused: {refusal}");
    // A key that long may be what was refused; the headers still say where the message
    // is.
    if let Some(key) = letter.key.take_if(|key| key.len() > DEAD_LETTER_KEY_LIMIT) {
        why.push_str(&format!("; its key of {} bytes left out too", key.len()));
    }
    match letter
        .headers
        .iter_mut()
        .find(|(name, _)| name == crate::wire::ERROR_HEADER)
    {
        Some((_, error)) => {
            let kept = shortened(error.as_str(), REFUSED_LETTER_ERROR_LIMIT);
            *error = HeaderValue::from(format!("{kept}; {why}"));
        }
        None => letter
            .headers
            .push((crate::wire::ERROR_HEADER.into(), why.into())),
    }
    letter.header(crate::wire::PAYLOAD_OMITTED_HEADER, bytes.to_string())
}

/// The most of a key an error message quotes. A key is the user's data, as long as the
/// event it came in may be, and a dead letter carries its reason in a header: quoting it
/// whole could make the dead letter larger than the broker takes.
pub const QUOTED_KEY_LIMIT: usize = 128;

/// `key` as an error message quotes it: whole when short, else its first bytes up to
/// [`QUOTED_KEY_LIMIT`] (cut between characters) and its length.
pub fn quoted_key(key: &str) -> Cow<'_, str> {
    shortened(key, QUOTED_KEY_LIMIT)
}

/// The most of its error a dead letter sent again without its payload keeps. The error
/// can be as long as what was refused (a task's failure quoting its input, say), and
/// kept whole it would have the letter refused again.
pub const REFUSED_LETTER_ERROR_LIMIT: usize = 4096;

/// `text` whole when at most `limit` bytes, else its first bytes up to `limit` (cut
/// between characters) and its length.
fn shortened(text: &str, limit: usize) -> Cow<'_, str> {
    if text.len() <= limit {
        return Cow::Borrowed(text);
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}… ({} bytes)", &text[..end], text.len()))
}

/// The longest output key a dead letter carries; a longer one may be why the output was
/// refused, and would have its dead letter refused too.
pub const DEAD_LETTER_KEY_LIMIT: usize = 1024;

/// Whether every broker weir speaks can carry `key` as a message key. NATS carries it
/// in a header, and a header value cannot hold a line break.
pub fn key_travels_everywhere(key: &[u8]) -> bool {
    !key.iter().any(|&b| b == b'\r' || b == b'\n')
}

/// What goes out in place of an output no retry can publish (larger than the broker
/// takes, say): a record of it on the output's dead-letter topic, `{"topic", "error"}`,
/// with the output's key and headers and the cause in `weir-error`. Publishing that
/// instead lets the partition or graph that made the output go on. A key longer than
/// [`DEAD_LETTER_KEY_LIMIT`] bytes is left out, and the record gives its length as
/// `key_bytes`; a key with a line break (which NATS cannot carry) goes in the record as
/// `key` instead.
pub fn undeliverable(output: &Outbound, error: &TransportError) -> Outbound {
    let mut record = serde_json::Map::new();
    record.insert("topic".into(), output.topic.as_str().into());
    record.insert("error".into(), error.to_string().into());
    let key = match &output.key {
        Some(key) if key.len() > DEAD_LETTER_KEY_LIMIT => {
            record.insert("key_bytes".into(), key.len().into());
            None
        }
        Some(key) if !key_travels_everywhere(key) => {
            let shown = String::from_utf8_lossy(key).into_owned();
            record.insert("key".into(), shown.into());
            None
        }
        key => key.clone(),
    };
    let mut letter = Outbound::new(
        crate::wire::dead_letter_topic(&output.topic),
        serde_json::Value::Object(record).to_string(),
    );
    letter.key = key;
    letter.headers = output.headers.clone();
    letter.header(crate::wire::ERROR_HEADER, error.to_string())
}

/// Milliseconds since the Unix epoch, for message and boundary timestamps.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(partition: i32, offset: i64) -> Position {
        Position { partition, offset }
    }

    #[tokio::test]
    async fn an_acknowledgement_already_given_is_taken_only_when_the_broker_took_the_message() {
        let given = PendingAck::given(Ok(at(0, 7)));
        assert!(given.is_taken());
        assert_eq!(given.await.unwrap(), at(0, 7));

        let refused = PendingAck::given(Err(TransportError::Publish {
            topic: "t".into(),
            source: "too large".into(),
            retryable: false,
        }));
        assert!(!refused.is_taken());
        assert!(!refused.await.unwrap_err().is_retryable());

        let (tx, rx) = tokio::sync::oneshot::channel::<Position>();
        let awaited = PendingAck::awaited(async move { Ok(rx.await.unwrap_or(at(0, -1))) });
        assert!(!awaited.is_taken());
        tx.send(at(1, 2)).unwrap();
        assert_eq!(awaited.await.unwrap(), at(1, 2));
    }

    #[test]
    fn a_long_key_is_quoted_by_its_start_and_length() {
        assert_eq!(quoted_key("user-7"), "user-7");
        let exact = "k".repeat(QUOTED_KEY_LIMIT);
        assert_eq!(quoted_key(&exact), exact.as_str());
        // Two-byte characters: the cut falls between two of them, not inside one.
        let long = "é".repeat(QUOTED_KEY_LIMIT);
        let quoted = quoted_key(&long);
        let expected = format!(
            "{}… ({} bytes)",
            "é".repeat(QUOTED_KEY_LIMIT / 2),
            QUOTED_KEY_LIMIT * 2
        );
        assert_eq!(quoted, expected.as_str());
        let odd = format!("a{}", "é".repeat(QUOTED_KEY_LIMIT));
        assert!(
            quoted_key(&odd).starts_with(&format!("a{}…", "é".repeat(QUOTED_KEY_LIMIT / 2 - 1)))
        );
    }

    #[test]
    fn a_dead_letter_leaves_out_a_key_too_long_to_publish() {
        let refused = TransportError::Publish {
            topic: "out".into(),
            source: "message too large".into(),
            retryable: false,
        };
        let short = undeliverable(&Outbound::new("out", "x").key("k1"), &refused);
        assert_eq!(short.topic, "out.dlq");
        assert_eq!(short.key.as_deref(), Some(&b"k1"[..]));
        let huge = "k".repeat(DEAD_LETTER_KEY_LIMIT + 1);
        let letter = undeliverable(&Outbound::new("out", "x").key(huge), &refused);
        assert_eq!(letter.key, None);
        let record: serde_json::Value = serde_json::from_slice(&letter.payload).unwrap();
        assert_eq!(record["key_bytes"], DEAD_LETTER_KEY_LIMIT + 1);
        assert_eq!(record["topic"], "out");
        // Refused by NATS for its line break: the key goes in the record instead.
        let letter = undeliverable(&Outbound::new("out", "x").key("a\nb"), &refused);
        assert_eq!(letter.key, None);
        let record: serde_json::Value = serde_json::from_slice(&letter.payload).unwrap();
        assert_eq!(record["key"], "a\nb");
    }

    #[test]
    fn a_letter_sent_again_without_its_payload_leaves_out_a_key_too_long() {
        let refused = TransportError::Publish {
            topic: "in.dlq".into(),
            source: "message too large".into(),
            retryable: false,
        };
        let short = without_payload(Outbound::new("in.dlq", "xyz").key("k1"), &refused);
        assert!(short.payload.is_empty());
        assert_eq!(short.key.as_deref(), Some(&b"k1"[..]));
        let huge = "k".repeat(DEAD_LETTER_KEY_LIMIT + 1);
        let letter = without_payload(Outbound::new("in.dlq", "xyz").key(huge), &refused);
        assert_eq!(letter.key, None);
        let error = letter
            .headers
            .iter()
            .find(|(name, _)| name == crate::wire::ERROR_HEADER)
            .map(|(_, value)| value.as_str().to_string())
            .unwrap();
        assert!(
            error.contains(&format!("key of {} bytes", DEAD_LETTER_KEY_LIMIT + 1)),
            "{error}"
        );
    }

    #[test]
    fn a_letter_sent_again_without_its_payload_keeps_4_kib_of_its_error() {
        let refused = TransportError::Publish {
            topic: "t.dlq".into(),
            source: "message too large".into(),
            retryable: false,
        };
        // A failure quoting a huge input, a two-byte character across the limit.
        let error = format!("{}é{}", "e".repeat(4095), "x".repeat(100_000));
        let letter = Outbound::new("t.dlq", "payload").header(crate::wire::ERROR_HEADER, error);
        let letter = without_payload(letter, &refused);
        let kept = letter
            .headers
            .iter()
            .find(|(name, _)| name == crate::wire::ERROR_HEADER)
            .map(|(_, value)| value.as_str().to_string())
            .unwrap();
        let expected = format!(
            "{}… ({} bytes); payload left out, the letter with it was refused: ",
            "e".repeat(4095),
            4095 + 2 + 100_000
        );
        assert!(kept.starts_with(&expected), "{}", &kept[4000..4200]);
        assert!(
            kept.len() < REFUSED_LETTER_ERROR_LIMIT + 200,
            "{}",
            kept.len()
        );
        assert_eq!(REFUSED_LETTER_ERROR_LIMIT, 4096);
        assert!(letter.payload.is_empty());
        let omitted = letter
            .headers
            .iter()
            .find(|(name, _)| name == crate::wire::PAYLOAD_OMITTED_HEADER)
            .map(|(_, value)| value.as_str());
        assert_eq!(omitted, Some("7"));
    }

    #[test]
    fn keys_are_placed_by_crc32_as_librdkafka_and_zlib_do() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        let jobs = PartitionedTopic::subjects("weir.jobs.counter", 6);
        // Python: zlib.crc32(b"job-1") % 6 == 5
        assert_eq!(jobs.partition_of(b"job-1"), 5);
        assert_eq!(jobs.topic_for(b"job-1"), "weir.jobs.counter.5");
        assert_eq!(jobs.misplaced("job-1", 5), None);
        let misplaced = jobs.misplaced("job-1", 2).expect("job-1 is 5's");
        assert!(misplaced.contains("partition 5 of 6, not 2"), "{misplaced}");
        let native = PartitionedTopic::native("weir.jobs.counter", 6);
        assert_eq!(native.topic_for(b"job-1"), "weir.jobs.counter");
        assert_eq!(
            native.misplaced("job-1", 2),
            None,
            "the producer's partitioner decides"
        );
        assert_eq!(
            native.subscription(4, "g", Some(9)).assignment,
            Assignment::Partitions(vec![4])
        );
        assert_eq!(
            jobs.subscription(4, "g", Some(9)).resume_after,
            vec![at(0, 9)]
        );
    }

    #[test]
    fn only_the_finished_prefix_is_committed() {
        let mut prefix = FinishedPrefix::default();
        for o in 0..4 {
            prefix.delivered(at(0, o));
        }
        prefix.delivered(at(1, 7));
        assert_eq!(prefix.finished(&[at(0, 1)]), vec![], "offset 0 still open");
        assert_eq!(prefix.finished(&[at(0, 0)]), vec![at(0, 1)]);
        assert_eq!(prefix.finished(&[at(0, 3)]), vec![], "offset 2 still open");
        assert_eq!(prefix.finished(&[at(1, 7)]), vec![at(1, 7)]);
        assert_eq!(prefix.finished(&[at(0, 2)]), vec![at(0, 3)]);
    }

    #[test]
    fn a_revoked_partition_neither_holds_back_nor_commits() {
        let mut prefix = FinishedPrefix::default();
        for o in 10..13 {
            prefix.delivered(at(0, o));
        }
        prefix.delivered(at(1, 5));
        assert_eq!(prefix.finished(&[at(0, 10)]), vec![at(0, 10)]);
        prefix.revoke(0);
        // Work finished after the loss is the new owner's to commit.
        assert_eq!(prefix.finished(&[at(0, 12)]), vec![]);
        assert_eq!(prefix.finished(&[at(1, 5)]), vec![at(1, 5)]);
        // Assigned again and redelivered from the group's position: offset 11, open
        // before the loss, no longer holds back what follows.
        prefix.delivered(at(0, 13));
        assert_eq!(prefix.finished(&[at(0, 13)]), vec![at(0, 13)]);
    }

    #[test]
    fn work_from_before_a_rebalance_does_not_commit_past_the_redelivery() {
        let mut prefix = FinishedPrefix::default();
        for o in 100..110 {
            prefix.delivered(at(0, o));
        }
        prefix.revoke(0);
        // The same consumer gets the partition back and it is redelivered from 100.
        prefix.delivered(at(0, 100));
        // A handler from before the rebalance finishes 108: not delivered again yet,
        // so 101..107 have not been handled since and must stay uncommitted.
        assert_eq!(prefix.finished(&[at(0, 108)]), vec![]);
        assert_eq!(prefix.finished(&[at(0, 100)]), vec![at(0, 100)]);
        prefix.delivered(at(0, 101));
        prefix.delivered(at(0, 102));
        assert_eq!(prefix.finished(&[at(0, 102)]), vec![]);
        assert_eq!(prefix.finished(&[at(0, 101)]), vec![at(0, 102)]);
    }

    /// A memory broker whose subscribes fail until `failures` of them have.
    struct FailsToSubscribe {
        inner: memory::MemoryBroker,
        failures: usize,
        retryable: bool,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl FailsToSubscribe {
        fn new(failures: usize, retryable: bool) -> Self {
            Self {
                inner: memory::MemoryBroker::new(1),
                failures,
                retryable,
                calls: Default::default(),
            }
        }

        fn calls(&self) -> usize {
            self.calls.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    #[async_trait]
    impl Broker for FailsToSubscribe {
        fn kind(&self) -> &'static str {
            "memory"
        }

        async fn subscribe(
            &self,
            subscription: &Subscription,
        ) -> Result<Box<dyn Source>, TransportError> {
            let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if call >= self.failures {
                return self.inner.subscribe(subscription).await;
            }
            Err(if self.retryable {
                TransportError::Unreachable {
                    broker: "memory".into(),
                    source: "restarting".into(),
                }
            } else {
                TransportError::InvalidTopic {
                    topic: subscription.topic.clone(),
                    reason: "refused".into(),
                }
            })
        }

        fn sink(&self) -> Arc<dyn Sink> {
            self.inner.sink()
        }

        async fn partitioned(
            &self,
            topic: &str,
            partitions: u32,
        ) -> Result<PartitionedTopic, TransportError> {
            self.inner.partitioned(topic, partitions).await
        }

        async fn ping(&self) -> Result<(), TransportError> {
            Ok(())
        }
    }

    fn tasks() -> Subscription {
        Subscription::work_queue("tasks", "workers", 8)
    }

    #[tokio::test(start_paused = true)]
    async fn subscribing_rides_out_failures_for_now() {
        let broker = FailsToSubscribe::new(3, true);
        let cancel = tokio_util::sync::CancellationToken::new();
        let source = subscribe_patiently(&broker, &tasks(), SUBSCRIBE_PATIENCE, &cancel)
            .await
            .expect("subscribed");
        assert!(source.is_some());
        assert_eq!(broker.calls(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn subscribing_gives_up_once_its_patience_runs_out() {
        let broker = FailsToSubscribe::new(usize::MAX, true);
        let cancel = tokio_util::sync::CancellationToken::new();
        let started = tokio::time::Instant::now();
        let failed = subscribe_patiently(&broker, &tasks(), SUBSCRIBE_PATIENCE, &cancel).await;
        match failed {
            Err(TransportError::Unreachable { .. }) => {}
            Err(e) => panic!("failed otherwise: {e}"),
            Ok(_) => panic!("subscribed"),
        }
        let waited = started.elapsed();
        assert!(
            waited <= SUBSCRIBE_PATIENCE && waited >= SUBSCRIBE_PATIENCE - Duration::from_secs(5),
            "gave up after {waited:?}"
        );
        assert!(broker.calls() > 5, "{} attempts", broker.calls());
    }

    #[tokio::test(start_paused = true)]
    async fn a_subscription_no_retry_can_help_fails_at_once() {
        let broker = FailsToSubscribe::new(usize::MAX, false);
        let cancel = tokio_util::sync::CancellationToken::new();
        let failed = subscribe_patiently(&broker, &tasks(), SUBSCRIBE_PATIENCE, &cancel).await;
        match failed {
            Err(TransportError::InvalidTopic { .. }) => {}
            Err(e) => panic!("failed otherwise: {e}"),
            Ok(_) => panic!("subscribed"),
        }
        assert_eq!(broker.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn subscribing_stops_when_cancelled() {
        let broker = FailsToSubscribe::new(usize::MAX, true);
        let cancel = tokio_util::sync::CancellationToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.cancel();
        });
        let started = tokio::time::Instant::now();
        let stopped = subscribe_patiently(&broker, &tasks(), SUBSCRIBE_PATIENCE, &cancel).await;
        assert!(
            matches!(stopped, Ok(None)),
            "not stopped by the cancellation"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}

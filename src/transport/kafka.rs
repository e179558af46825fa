//! Kafka (rdkafka, classic consumer-group protocol). Offsets are stored and committed only
//! through [`Source::commit`]; auto-commit is off. Works against Apache Kafka, Redpanda
//! and other Kafka-compatible brokers.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::ClientContext;
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use rdkafka::{Offset, TopicPartitionList};

use super::{
    Acks, Assignment, BoxError, Broker, FinishedPrefix, HeaderValue, Message, Outbound,
    PartitionedTopic, PendingAck, Position, Sink, Source, StartFrom, Subscription, TransportError,
};

/// How long publishes wait, at most, for those made through a producer that failed
/// fatally to settle.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// The shortest time between two replacements of a fatally failed producer.
const RENEW_INTERVAL: Duration = Duration::from_secs(5);

/// How long a publish may wait for room in the producer's queue.
const PRODUCE_TIMEOUT: Duration = Duration::from_secs(30);
/// librdkafka's default `topic.metadata.refresh.interval.ms`.
const DEFAULT_METADATA_REFRESH: Duration = Duration::from_secs(300);
/// How long to wait before trying a full producer queue again.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(10);

/// Connection settings. `options` pass through to librdkafka (e.g.
/// `session.timeout.ms`, or `security.protocol` and `sasl.*` for a secured cluster),
/// overriding weir's defaults, for every client weir makes.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaSettings {
    pub brokers: String,
    /// Partitions of topics weir creates.
    pub partitions: i32,
    pub replication: i32,
    pub options: BTreeMap<String, String>,
    /// `retention.ms` of topics weir creates; `None`: the broker's default.
    pub retention: Option<Duration>,
}

impl std::fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSettings")
            .field("brokers", &self.brokers)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field("options", &shown_options(&self.options))
            .field("retention", &self.retention)
            .finish()
    }
}

/// librdkafka properties whose values are secrets (`sasl.password`,
/// `ssl.key.password`, `sasl.oauthbearer.client.secret`, an inline `ssl.key.pem`, …).
pub fn is_secret_option(key: &str) -> bool {
    key.contains("password")
        || key.contains("secret")
        || key == "ssl.key.pem"
        || key == "sasl.oauthbearer.config"
}

/// Options as they may be shown: secret values masked.
pub fn shown_options(options: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    options
        .iter()
        .map(|(k, v)| {
            let shown = if is_secret_option(k) {
                crate::secret::MASK
            } else {
                v.as_str()
            };
            (k.as_str(), shown)
        })
        .collect()
}

/// Remembers the last error librdkafka reported outside any request (authentication and
/// TLS failures among them), so a connection that fails can say why.
#[derive(Default, Clone)]
pub struct ClientErrors {
    last: Arc<Mutex<Option<String>>>,
    /// When each kind of error (by its code) was last logged as a warning.
    warned: Arc<Mutex<BTreeMap<Option<i32>, std::time::Instant>>>,
}

/// librdkafka reports a broker that stays down every time it tries again (several times
/// a second, from each client): one warning per kind of error (its code, whichever
/// broker it names) per this interval, over all of a `KafkaBroker`'s producers and
/// consumers, says as much, and the repeats go to the debug level.
const REPEATED_ERROR_WARNING_INTERVAL: Duration = Duration::from_secs(30);

impl ClientErrors {
    fn last(&self) -> Option<String> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether an error of this kind, reported at `now`, is the first in an interval.
    fn warn_now(&self, code: Option<RDKafkaErrorCode>, now: std::time::Instant) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        let kind = code.map(|c| c as i32);
        match warned.get(&kind) {
            Some(at) if now.saturating_duration_since(*at) < REPEATED_ERROR_WARNING_INTERVAL => {
                false
            }
            _ => {
                warned.insert(kind, now);
                true
            }
        }
    }
}

impl ClientContext for ClientErrors {
    fn error(&self, error: KafkaError, reason: &str) {
        if self.warn_now(error.rdkafka_error_code(), std::time::Instant::now()) {
            tracing::warn!(%error, reason, "kafka client error");
        } else {
            tracing::debug!(%error, reason, "kafka client error, repeated");
        }
        // "All brokers are down" follows the error that took them down; keep that one.
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::AllBrokersDown) {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
        }
    }
}

impl Default for KafkaSettings {
    fn default() -> Self {
        Self {
            brokers: "127.0.0.1:9092".into(),
            partitions: 1,
            replication: 1,
            options: BTreeMap::new(),
            retention: None,
        }
    }
}

#[derive(Clone)]
pub struct KafkaBroker {
    inner: Arc<Inner>,
}

/// A producer shared by the publishes in flight on it. Its last holder lets it go on a
/// thread of its own (see [`close_in_background`]).
struct SharedProducer(Option<FutureProducer<ClientErrors>>);

impl std::ops::Deref for SharedProducer {
    type Target = FutureProducer<ClientErrors>;

    fn deref(&self) -> &Self::Target {
        self.0
            .as_ref()
            .expect("a producer is held until it is dropped")
    }
}

impl Drop for SharedProducer {
    fn drop(&mut self) {
        if let Some(producer) = self.0.take() {
            close_in_background(producer);
        }
    }
}

/// Clients being closed on threads of their own.
static CLOSING: AtomicUsize = AtomicUsize::new(0);

/// Lets a client go on a thread of its own. Closing a consumer waits until the broker
/// confirms it left its group, and librdkafka puts no limit on that wait; a producer's
/// teardown flushes and joins the client's threads. On a runtime's blocking pool a
/// broker that never answers would hold up the runtime's shutdown for good, since a
/// runtime waits for its blocking tasks; a thread of its own holds up nothing, and a
/// process about to exit gives it a bounded time with [`let_clients_close`].
fn close_in_background<T: Send + 'static>(client: T) {
    /// Counts the close under way until the client is gone, on whichever thread, and
    /// even if dropping the client panics.
    struct Closing<T>(Option<T>);
    impl<T> Drop for Closing<T> {
        fn drop(&mut self) {
            struct Counted;
            impl Drop for Counted {
                fn drop(&mut self) {
                    CLOSING.fetch_sub(1, Ordering::SeqCst);
                }
            }
            let _counted = Counted;
            drop(self.0.take());
        }
    }
    CLOSING.fetch_add(1, Ordering::SeqCst);
    let closing = Closing(Some(client));
    if let Err(e) = std::thread::Builder::new()
        .name("weir-kafka-close".into())
        .spawn(move || drop(closing))
    {
        // The closure, and the client with it, is dropped here, on this thread.
        tracing::warn!(error = %e, "no thread to close a kafka client on; closing it in place");
    }
}

/// Waits, at most `within`, for the Kafka clients let go so far to finish closing
/// (consumers leaving their groups); returns how many have not.
pub async fn let_clients_close(within: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let closing = CLOSING.load(Ordering::SeqCst);
        if closing == 0 || tokio::time::Instant::now() >= deadline {
            return closing;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

struct Inner {
    settings: KafkaSettings,
    /// Replaced by a new one when librdkafka declares it fatally failed (an idempotent
    /// producer whose sequence the broker lost, for instance): such a producer refuses
    /// every later message.
    producer: RwLock<Arc<SharedProducer>>,
    /// The producer replaced last, alive while publishes handed to it are still held
    /// (awaited or not) by their senders, and when it was replaced.
    retired: Mutex<(Weak<SharedProducer>, Option<std::time::Instant>)>,
    producer_config: ClientConfig,
    /// The producer's errors outside any request.
    errors: ClientErrors,
    admin: AdminClient<DefaultClientContext>,
    /// Topics known to exist, so creation is tried once per topic.
    ensured: Mutex<HashSet<String>>,
    /// Publishes wait here while their topic is created.
    setup: super::setup::SetupGate,
}

fn unreachable(brokers: &str, e: impl Into<BoxError>) -> TransportError {
    TransportError::Unreachable {
        broker: format!("kafka {brokers}"),
        source: e.into(),
    }
}

/// Making a librdkafka client waits on no network, so a client it refuses to make was
/// refused for its settings.
fn refused_settings(brokers: &str, e: impl Into<BoxError>) -> TransportError {
    TransportError::Settings {
        broker: format!("kafka {brokers}"),
        source: e.into(),
    }
}

impl KafkaBroker {
    pub fn connect(settings: KafkaSettings) -> Result<Self, TransportError> {
        let mut producer_config = ClientConfig::new();
        // Idempotence keeps a partition's messages in the order they were handed over
        // when librdkafka retries a request: without it a retried batch can land behind
        // a later one, and a key's outputs would come out of order.
        producer_config
            .set("bootstrap.servers", &settings.brokers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("linger.ms", "1")
            .set("message.timeout.ms", "30000");
        for (k, v) in &settings.options {
            if is_producer_option(k) {
                producer_config.set(k, v);
            }
        }
        // Options only consumers take are otherwise first read at a subscribe, long
        // after start: checked here, so a bad one is a config error at once.
        let mut consumer_options = ClientConfig::new();
        for (k, v) in &settings.options {
            if is_consumer_option(k) {
                consumer_options.set(k, v);
            }
        }
        consumer_options
            .create_native_config()
            .map_err(|e| refused_settings(&settings.brokers, e))?;
        let errors = ClientErrors::default();
        let producer: FutureProducer<ClientErrors> = producer_config
            .create_with_context(errors.clone())
            .map_err(|e| refused_settings(&settings.brokers, e))?;
        let mut admin_config = ClientConfig::new();
        admin_config.set("bootstrap.servers", &settings.brokers);
        for (k, v) in &settings.options {
            if is_producer_option(k) && is_consumer_option(k) {
                admin_config.set(k, v);
            }
        }
        let admin: AdminClient<DefaultClientContext> = admin_config
            .create()
            .map_err(|e| refused_settings(&settings.brokers, e))?;
        Ok(Self {
            inner: Arc::new(Inner {
                settings,
                producer: RwLock::new(Arc::new(SharedProducer(Some(producer)))),
                retired: Mutex::new((Weak::new(), None)),
                producer_config,
                errors,
                admin,
                ensured: Mutex::new(HashSet::new()),
                setup: Default::default(),
            }),
        })
    }

    /// The producer in use.
    fn producer(&self) -> Arc<SharedProducer> {
        self.inner
            .producer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The producer a publish goes through. While a replaced producer still has
    /// publishes held by their senders, publishes are refused (retryable): a sender
    /// whose earlier outputs are failing on the old producer must see them fail before
    /// anything of its own can reach the broker through the new one, or its later
    /// outputs would overtake the ones it sends again. For [`SETTLE_LIMIT`] at most, so
    /// a sender retrying one publish while it holds another cannot stall every sender.
    fn producer_for(&self, topic: &str) -> Result<Arc<SharedProducer>, TransportError> {
        let draining = {
            let retired = self.inner.retired.lock().unwrap_or_else(|p| p.into_inner());
            retired.0.strong_count() > 0 && retired.1.is_some_and(|at| at.elapsed() < SETTLE_LIMIT)
        };
        if draining {
            return Err(TransportError::Publish {
                topic: topic.to_string(),
                source: "the kafka producer was replaced after a fatal error, and publishes \
                         made through the old one are not all settled yet"
                    .into(),
                retryable: true,
            });
        }
        Ok(self.producer())
    }

    /// The partition ids of a topic, from the cluster's metadata.
    pub async fn partitions_of(&self, topic: &str) -> Result<Vec<i32>, TransportError> {
        let producer = self.producer();
        let brokers = self.inner.settings.brokers.clone();
        let name = topic.to_string();
        tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(Some(&name), Timeout::After(Duration::from_secs(10)))
                .map_err(|e| unreachable(&brokers, e))?;
            let partitions: Vec<i32> = metadata
                .topics()
                .iter()
                .filter(|t| t.name() == name)
                .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                .collect();
            if partitions.is_empty() {
                return Err(TransportError::InvalidTopic {
                    topic: name,
                    reason: "the broker reports no partitions".into(),
                });
            }
            Ok(partitions)
        })
        .await
        .map_err(|e| unreachable(&self.inner.settings.brokers, e))?
    }

    /// How often clients refresh their metadata: librdkafka's
    /// `topic.metadata.refresh.interval.ms` as configured, or its default of 5 minutes.
    fn metadata_refresh(&self) -> Duration {
        self.inner
            .settings
            .options
            .get("topic.metadata.refresh.interval.ms")
            .and_then(|ms| ms.parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map_or(DEFAULT_METADATA_REFRESH, Duration::from_millis)
    }

    /// Creates the topic if it does not exist yet.
    pub async fn ensure_topic(&self, topic: &str) -> Result<(), TransportError> {
        self.ensure_topic_with(topic, self.inner.settings.partitions)
            .await
    }

    /// Creates the topic with `partitions` partitions if it does not exist yet.
    async fn ensure_topic_with(&self, topic: &str, partitions: i32) -> Result<(), TransportError> {
        if self
            .inner
            .ensured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(topic)
        {
            return Ok(());
        }
        let settings = &self.inner.settings;
        let retention_ms = settings.retention.map(|r| r.as_millis().to_string());
        let mut new_topic = NewTopic::new(
            topic,
            partitions,
            TopicReplication::Fixed(settings.replication),
        );
        if let Some(retention_ms) = &retention_ms {
            new_topic = new_topic.set("retention.ms", retention_ms);
        }
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let results = self
            .inner
            .admin
            .create_topics([&new_topic], &options)
            .await
            .map_err(|e| unreachable(&settings.brokers, e))?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                // The cluster busy or between controllers: the creation may even be
                // under way, and asking again settles it.
                Err((
                    name,
                    code @ (RDKafkaErrorCode::RequestTimedOut
                    | RDKafkaErrorCode::OperationTimedOut
                    | RDKafkaErrorCode::NotController
                    | RDKafkaErrorCode::BrokerNotAvailable
                    | RDKafkaErrorCode::LeaderNotAvailable
                    | RDKafkaErrorCode::NetworkException
                    | RDKafkaErrorCode::AllBrokersDown
                    | RDKafkaErrorCode::BrokerTransportFailure),
                )) => {
                    return Err(unreachable(
                        &settings.brokers,
                        format!("cannot create topic {name} yet: {code}"),
                    ))
                }
                Err((name, code)) => {
                    return Err(TransportError::InvalidTopic {
                        topic: name,
                        reason: format!("cannot create topic: {code}"),
                    })
                }
            }
        }
        self.inner
            .ensured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(topic.to_string());
        Ok(())
    }
}

/// librdkafka rejects consumer-only properties on a producer and vice versa; route the
/// pass-through options by their well-known prefixes.
fn is_producer_option(key: &str) -> bool {
    !(key.starts_with("session.")
        || key.starts_with("max.poll")
        || key.starts_with("group.")
        || key.starts_with("heartbeat.")
        || key.starts_with("fetch.")
        || key.starts_with("partition.assignment")
        || key.starts_with("auto.offset")
        || key.starts_with("enable.auto")
        || key.starts_with("isolation.")
        || key.starts_with("enable.partition.eof"))
}

fn is_consumer_option(key: &str) -> bool {
    !(key.starts_with("acks")
        || key.starts_with("linger.")
        || key.starts_with("batch.")
        || key.starts_with("compression.")
        || key.starts_with("message.timeout")
        || key.starts_with("enable.idempotence")
        || key.starts_with("queue.buffering")
        || key.starts_with("retries"))
}

#[async_trait]
impl Broker for KafkaBroker {
    fn kind(&self) -> &'static str {
        "kafka"
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Source>, TransportError> {
        let settings = &self.inner.settings;
        self.ensure_topic(&subscription.topic).await?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &settings.brokers)
            .set("group.id", &subscription.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set(
                "auto.offset.reset",
                match subscription.start {
                    StartFrom::Earliest => "earliest",
                    StartFrom::Latest => "latest",
                },
            )
            .set("enable.partition.eof", "false");
        for (k, v) in &settings.options {
            if is_consumer_option(k) {
                config.set(k, v);
            }
        }
        let context = GroupContext {
            revoked: Arc::default(),
            errors: self.inner.errors.clone(),
        };
        let revoked = context.revoked.clone();
        let consumer: StreamConsumer<GroupContext> = config
            .create_with_context(context)
            .map_err(|e| refused_settings(&settings.brokers, e))?;
        // Made at once, so that should setting the consumer up fail below, dropping the
        // source lets the consumer go off the async workers, as any source's does.
        let mut source = KafkaSource {
            topic: Arc::from(subscription.topic.as_str()),
            consumer: Some(consumer),
            prefix: matches!(subscription.acks, Acks::Each { .. }).then(FinishedPrefix::default),
            revoked,
            held: VecDeque::new(),
            paused: false,
            watch: None,
        };
        let direct = match &subscription.assignment {
            Assignment::Group => None,
            Assignment::Partitions(partitions) => Some(partitions.clone()),
            Assignment::All => Some(self.partitions_of(&subscription.topic).await?),
        };
        // A reader of every partition looks for partitions added while it runs, as often
        // as the client refreshes its metadata (a group member is given them by the group).
        source.watch = match (&subscription.assignment, &direct) {
            (Assignment::All, Some(partitions)) => {
                let every = self.metadata_refresh();
                Some(PartitionWatch {
                    broker: self.clone(),
                    every: tokio::time::interval_at(tokio::time::Instant::now() + every, every),
                    known: partitions.iter().copied().collect(),
                    lookup: None,
                })
            }
            _ => None,
        };
        match direct {
            Some(partitions) => {
                // Direct assignment: resume each partition from the group's committed
                // offset (or the start policy when there is none).
                let mut wanted = TopicPartitionList::new();
                for p in &partitions {
                    wanted.add_partition(&subscription.topic, *p);
                }
                // A broker round trip that blocks: off the async workers, which keep
                // leases renewed meanwhile. The source goes along, so the consumer is
                // let go as usual should the call fail.
                let brokers = settings.brokers.clone();
                let (returned, committed) = tokio::task::spawn_blocking(move || {
                    let committed = source.consumer().and_then(|consumer| {
                        consumer
                            .committed_offsets(wanted, Timeout::After(Duration::from_secs(10)))
                            .map_err(|e| unreachable(&brokers, e))
                    });
                    (source, committed)
                })
                .await
                .map_err(|e| unreachable(&settings.brokers, e))?;
                source = returned;
                let committed = committed?;
                let mut assignment = TopicPartitionList::new();
                for element in committed.elements() {
                    let resume = subscription
                        .resume_after
                        .iter()
                        .find(|p| p.partition == element.partition());
                    let offset = match (resume, element.offset()) {
                        (Some(p), _) => Offset::Offset(p.offset + 1),
                        (None, Offset::Offset(o)) if o >= 0 => Offset::Offset(o),
                        (None, _) => match subscription.start {
                            StartFrom::Earliest => Offset::Beginning,
                            StartFrom::Latest => Offset::End,
                        },
                    };
                    assignment
                        .add_partition_offset(&subscription.topic, element.partition(), offset)
                        .map_err(|e| unreachable(&settings.brokers, e))?;
                }
                source
                    .consumer()?
                    .assign(&assignment)
                    .map_err(|e| unreachable(&settings.brokers, e))?;
            }
            None => source
                .consumer()?
                .subscribe(&[&subscription.topic])
                .map_err(|e| unreachable(&settings.brokers, e))?,
        }
        Ok(Box::new(source))
    }

    fn sink(&self) -> Arc<dyn Sink> {
        Arc::new(self.clone())
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<PartitionedTopic, TransportError> {
        let wanted = i32::try_from(partitions.max(1)).unwrap_or(i32::MAX);
        self.ensure_topic_with(topic, wanted).await?;
        // A topic that existed before keeps its own count; every producer's partitioner
        // spreads keys over that.
        let found = self.partitions_of(topic).await?;
        if found.len() != partitions as usize {
            tracing::info!(
                topic,
                wanted = partitions,
                found = found.len(),
                "topic exists with another partition count; using it"
            );
        }
        Ok(PartitionedTopic::native(topic, found.len() as u32))
    }

    async fn ping(&self) -> Result<(), TransportError> {
        let producer = self.producer();
        let errors = self.inner.errors.clone();
        let brokers = self.inner.settings.brokers.clone();
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, Timeout::After(Duration::from_secs(3)))
                .map(|_| ())
                .map_err(|e| match errors.last() {
                    // "all brokers down" says little; the client's own error says why.
                    Some(cause) => unreachable(&brokers, format!("{e}: {cause}")),
                    None => unreachable(&brokers, e),
                })
        })
        .await
        .map_err(|e| unreachable(&self.inner.settings.brokers, e))?
    }
}

impl KafkaBroker {
    /// Makes the producer fail fatally, as librdkafka does when the broker lost an
    /// idempotent producer's sequence, so tests can see what follows.
    #[cfg(feature = "it")]
    #[doc(hidden)]
    pub fn fail_producer_fatally(&self) {
        let producer = self.producer();
        let reason = c"injected by a test";
        // SAFETY: the client pointer is alive while `producer` is held, and the reason
        // is a NUL-terminated string that librdkafka copies.
        unsafe {
            rdkafka::bindings::rd_kafka_test_fatal_error(
                producer.client().native_ptr(),
                rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER,
                reason.as_ptr(),
            );
        }
    }

    /// After a fatal error the producer takes no more messages, nor once the broker
    /// fenced it (`ProducerFenced` on every publish, seen from a Kafka-compatible broker
    /// restarted under load; librdkafka does not count it fatal for a producer without
    /// transactions, which weir's are); the next publishes go through a new one. Its failed messages fail as retryable, so their senders
    /// publish them again, after what they had already acknowledged.
    fn renew_if_unusable(&self, failed: &Arc<SharedProducer>, error: &KafkaError) {
        // The error that made it fatal reaches its own message as itself, the others
        // as "fatal".
        let cause = failed.client().fatal_error();
        let fenced = error.rdkafka_error_code() == Some(RDKafkaErrorCode::ProducerFenced);
        if cause.is_none() && !fenced && error.rdkafka_error_code() != Some(RDKafkaErrorCode::Fatal)
        {
            return;
        }
        // Every message of a failed producer fails: most find it renewed already.
        if !Arc::ptr_eq(&self.producer(), failed) {
            return;
        }
        let mut current = self
            .inner
            .producer
            .write()
            .unwrap_or_else(|p| p.into_inner());
        // Another publish of the same producer renewed it already.
        if !Arc::ptr_eq(&current, failed) {
            return;
        }
        let mut retired = self.inner.retired.lock().unwrap_or_else(|p| p.into_inner());
        // A cause that lasts (a permission the broker refuses, say) fails every new
        // producer at once: make one per interval, not one per publish.
        if retired.1.is_some_and(|at| at.elapsed() < RENEW_INTERVAL) {
            return;
        }
        match self
            .inner
            .producer_config
            .create_with_context(self.inner.errors.clone())
        {
            Ok(renewed) => {
                tracing::warn!(
                    ?cause,
                    fenced,
                    "kafka producer failed fatally or was fenced; publishing through a new one once the old one's publishes are settled"
                );
                *retired = (Arc::downgrade(failed), Some(std::time::Instant::now()));
                *current = Arc::new(SharedProducer(Some(renewed)));
            }
            Err(e) => {
                tracing::error!(?cause, error = %e, "kafka producer failed fatally and a new one cannot be made");
            }
        }
    }
}

#[async_trait]
impl Sink for KafkaBroker {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
        self.enqueue(message).await?.await
    }

    async fn enqueue(&self, message: Outbound) -> Result<PendingAck, TransportError> {
        let turn = self.inner.setup.enter(&message.topic).await;
        if turn.needs_setup() {
            self.ensure_topic(&message.topic).await?;
            turn.set_up();
        }
        let publish_error = |topic: &str, e: &KafkaError| TransportError::Publish {
            topic: topic.to_string(),
            retryable: is_retryable(e),
            source: e.clone().into(),
        };
        // The client's queue is bounded: while it is full, wait for room, as long as a
        // publish may take. The clock is read only once the queue is full.
        let mut deadline = None;
        let producer = self.producer_for(&message.topic)?;
        let delivery = loop {
            let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value.as_bytes()),
                });
            }
            let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&message.topic)
                .payload(&message.payload[..])
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(&key[..]);
            }
            match producer.send_result(record) {
                Ok(delivery) => break delivery,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                    if tokio::time::Instant::now()
                        < *deadline.get_or_insert_with(|| {
                            tokio::time::Instant::now() + PRODUCE_TIMEOUT
                        }) =>
                {
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, _)) => {
                    self.renew_if_unusable(&producer, &e);
                    return Err(publish_error(&message.topic, &e));
                }
            }
        };
        let topic = message.topic;
        let broker = self.clone();
        Ok(PendingAck::awaited(async move {
            match delivery.await {
                Ok(Ok(delivery)) => Ok(Position {
                    partition: delivery.partition,
                    offset: delivery.offset,
                }),
                Ok(Err((e, _))) => {
                    broker.renew_if_unusable(&producer, &e);
                    Err(publish_error(&topic, &e))
                }
                Err(_) => Err(TransportError::Publish {
                    topic: topic.to_string(),
                    source: "the producer was dropped before the broker acknowledged".into(),
                    retryable: true,
                }),
            }
        }))
    }
}

/// The next message of a consumer, as weir's [`Message`].
async fn receive(
    consumer: &StreamConsumer<GroupContext>,
    topic: &Arc<str>,
) -> Result<Message, TransportError> {
    let message = consumer.recv().await.map_err(|e| TransportError::Consume {
        topic: topic.to_string(),
        retryable: is_retryable(&e),
        source: e.into(),
    })?;
    let headers = message
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| {
                    let value = h
                        .value
                        .map(|v| HeaderValue::new(String::from_utf8_lossy(v)));
                    (crate::wire::header_name(h.key), value.unwrap_or_default())
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Message {
        topic: topic.clone(),
        position: Position {
            partition: message.partition(),
            offset: message.offset(),
        },
        key: message.key().map(Bytes::copy_from_slice),
        payload: Bytes::copy_from_slice(message.payload().unwrap_or_default()),
        headers,
        timestamp_ms: message.timestamp().to_millis().unwrap_or_default(),
    })
}

impl PartitionWatch {
    /// Starts a lookup of the topic's partitions, unless one is under way.
    fn look(&mut self, topic: &str) {
        if self.lookup.is_none() {
            let broker = self.broker.clone();
            let topic = topic.to_string();
            self.lookup = Some(tokio::spawn(
                async move { broker.partitions_of(&topic).await },
            ));
        }
    }

    /// Reads partitions the topic has gained from their beginning: everything in them
    /// was written after this source started.
    fn assign_added(
        &mut self,
        consumer: &StreamConsumer<GroupContext>,
        topic: &str,
        partitions: Vec<i32>,
    ) -> Result<(), TransportError> {
        let added: Vec<i32> = partitions
            .into_iter()
            .filter(|p| !self.known.contains(p))
            .collect();
        if added.is_empty() {
            return Ok(());
        }
        let mut list = TopicPartitionList::new();
        for p in &added {
            list.add_partition_offset(topic, *p, Offset::Beginning)
                .map_err(|e| unreachable(&self.broker.inner.settings.brokers, e))?;
        }
        consumer
            .incremental_assign(&list)
            .map_err(|e| unreachable(&self.broker.inner.settings.brokers, e))?;
        tracing::info!(topic, ?added, "reading partitions added to the topic");
        self.known.extend(added);
        Ok(())
    }
}

/// The answer of a partition lookup under way, once there is one; the lookup is done
/// with then.
async fn looked_up(
    lookup: &mut Option<tokio::task::JoinHandle<Result<Vec<i32>, TransportError>>>,
    brokers: &str,
) -> Result<Vec<i32>, TransportError> {
    let Some(pending) = lookup else {
        return std::future::pending().await;
    };
    let answer = pending.await;
    *lookup = None;
    answer.map_err(|e| unreachable(brokers, e))?
}

/// Whether the same call may succeed later. What the broker refuses for what the
/// message is (too large for the broker, or for its log segment as a record batch; a
/// topic policy; a record the topic cannot take, a compacted topic's unkeyed one) it
/// will refuse again: such an output is dead-lettered rather than retried forever.
fn is_retryable(e: &KafkaError) -> bool {
    !matches!(
        e.rdkafka_error_code(),
        Some(RDKafkaErrorCode::MessageSizeTooLarge)
            | Some(RDKafkaErrorCode::MessageBatchTooLarge)
            | Some(RDKafkaErrorCode::PolicyViolation)
            | Some(RDKafkaErrorCode::InvalidRecord)
            | Some(RDKafkaErrorCode::InvalidTopic)
            | Some(RDKafkaErrorCode::TopicAuthorizationFailed)
    )
}

/// Hears of rebalances, which happen inside the client's poll, and reports the
/// client's errors with the broker's other clients.
struct GroupContext {
    /// Partitions revoked since the source last looked.
    revoked: Arc<Mutex<Vec<i32>>>,
    errors: ClientErrors,
}

impl ClientContext for GroupContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.errors.error(error, reason);
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(partitions) = rebalance {
            self.revoked
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(partitions.elements().iter().map(|e| e.partition()));
        }
    }
}

struct KafkaSource {
    topic: Arc<str>,
    /// Always `Some` until dropped.
    consumer: Option<StreamConsumer<GroupContext>>,
    /// With [`Acks::Each`]: what is delivered and not finished, so commits stop short
    /// of it.
    prefix: Option<FinishedPrefix>,
    revoked: Arc<Mutex<Vec<i32>>>,
    /// Messages that arrived while the source was held, for the next reads.
    held: VecDeque<Message>,
    /// Whether the assigned partitions are paused (the source is held).
    paused: bool,
    /// With [`Assignment::All`]: partitions added to the topic are read too.
    watch: Option<PartitionWatch>,
}

/// Looks for partitions added to a topic read partition by partition.
struct PartitionWatch {
    broker: KafkaBroker,
    every: tokio::time::Interval,
    known: HashSet<i32>,
    /// The metadata lookup under way: a task of its own, so a read that is dropped
    /// (its caller had something else to do) does not lose it.
    lookup: Option<tokio::task::JoinHandle<Result<Vec<i32>, TransportError>>>,
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        // Closing a consumer waits for the broker (leaving the group), which must not
        // block an async worker thread.
        if let Some(consumer) = self.consumer.take() {
            close_in_background(consumer);
        }
    }
}

impl KafkaSource {
    /// Lets the finished-prefix bookkeeping drop partitions lost in a rebalance, and
    /// drops held messages of those partitions: their new owner reads them.
    fn forget_revoked(&mut self) {
        let revoked = std::mem::take(&mut *self.revoked.lock().unwrap_or_else(|p| p.into_inner()));
        if revoked.is_empty() {
            return;
        }
        self.held
            .retain(|m| !revoked.contains(&m.position.partition));
        if let Some(prefix) = &mut self.prefix {
            for partition in revoked {
                prefix.revoke(partition);
            }
        }
    }

    fn consumer(&self) -> Result<&StreamConsumer<GroupContext>, TransportError> {
        self.consumer
            .as_ref()
            .ok_or_else(|| TransportError::Closed {
                topic: self.topic.to_string(),
            })
    }

    /// The next message from the client, whatever the source's state; with a partition
    /// watch, adding partitions that appeared meanwhile.
    async fn receive(&mut self) -> Result<Message, TransportError> {
        let consumer = self
            .consumer
            .as_ref()
            .ok_or_else(|| TransportError::Closed {
                topic: self.topic.to_string(),
            })?;
        let Some(watch) = &mut self.watch else {
            return receive(consumer, &self.topic).await;
        };
        loop {
            tokio::select! {
                received = receive(consumer, &self.topic) => return received,
                _ = watch.every.tick() => watch.look(&self.topic),
                looked = looked_up(&mut watch.lookup, &watch.broker.inner.settings.brokers) => {
                    let added = looked
                        .and_then(|partitions| watch.assign_added(consumer, &self.topic, partitions));
                    if let Err(e) = added {
                        tracing::warn!(topic = %self.topic, error = %e, "cannot look for added partitions");
                    }
                }
            }
        }
    }

    /// Pauses or resumes fetching on every partition assigned now.
    fn set_paused(&mut self, pause: bool) -> Result<(), TransportError> {
        let consumer = self.consumer()?;
        let failed = |e: KafkaError| TransportError::Consume {
            topic: self.topic.to_string(),
            retryable: true,
            source: format!(
                "cannot {} partitions: {e}",
                if pause { "pause" } else { "resume" }
            )
            .into(),
        };
        let assigned = consumer.assignment().map_err(failed)?;
        if assigned.count() > 0 {
            if pause {
                consumer.pause(&assigned).map_err(failed)?;
            } else {
                consumer.resume(&assigned).map_err(failed)?;
            }
        }
        self.paused = pause;
        Ok(())
    }
}

#[async_trait]
impl Source for KafkaSource {
    fn ready(&mut self) -> Option<Result<Message, TransportError>> {
        // A read dropped before it completes loses nothing.
        futures::FutureExt::now_or_never(self.next())
    }

    async fn next(&mut self) -> Result<Message, TransportError> {
        // librdkafka hands over what it fetched without tokio's budget knowing: spent
        // here, as a read from a tokio channel spends it, a reader with a backlog yields
        // its thread every so often, so the tasks sharing it (lease keepers) still run.
        tokio::task::consume_budget().await;
        if !self.held.is_empty() {
            // Held messages of partitions lost meanwhile are their new owner's.
            self.forget_revoked();
        }
        // Fetching starts again only once what arrived while held is taken: resuming
        // and pausing at every message would throw away what the client fetched.
        let message = match self.held.pop_front() {
            Some(held) => held,
            None => {
                if self.paused {
                    self.set_paused(false)?;
                }
                self.receive().await?
            }
        };
        self.forget_revoked();
        if let Some(prefix) = &mut self.prefix {
            prefix.delivered(message.position);
        }
        Ok(message)
    }

    /// Pauses the assigned partitions and goes on polling: a member that stops polling
    /// for `max.poll.interval.ms` is taken out of its group and its messages in progress
    /// go to another member, while a paused one fetches nothing it cannot take yet.
    async fn hold(&mut self) -> Result<(), TransportError> {
        if !self.paused {
            self.set_paused(true)?;
        }
        let message = self.receive().await?;
        // Revocations heard while receiving drop what was held of those partitions; the
        // message just received belongs to the assignment since, so it stays.
        self.forget_revoked();
        self.held.push_back(message);
        // It arrived from a partition fetching despite the pause: one assigned since.
        self.set_paused(true)?;
        Ok(())
    }

    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
        self.forget_revoked();
        let prefix;
        let through = match &mut self.prefix {
            Some(open) => {
                prefix = open.finished(through);
                if prefix.is_empty() {
                    return Ok(());
                }
                &prefix[..]
            }
            None => through,
        };
        let mut list = TopicPartitionList::new();
        for p in through {
            list.add_partition_offset(&self.topic, p.partition, Offset::Offset(p.offset + 1))
                .map_err(|e| TransportError::Commit {
                    topic: self.topic.to_string(),
                    source: e.into(),
                })?;
        }
        self.consumer()?
            .commit(&list, CommitMode::Async)
            .map_err(|e| TransportError::Commit {
                topic: self.topic.to_string(),
                source: e.into(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_client_error_is_warned_of_once_per_interval() {
        let errors = ClientErrors::default();
        let start = std::time::Instant::now();
        let down = Some(RDKafkaErrorCode::AllBrokersDown);
        let failed = Some(RDKafkaErrorCode::BrokerTransportFailure);
        assert!(errors.warn_now(down, start));
        assert!(!errors.warn_now(down, start + Duration::from_millis(50)));
        // Another kind of error is warned of at once.
        assert!(errors.warn_now(failed, start + Duration::from_millis(60)));
        assert!(!errors.warn_now(down, start + REPEATED_ERROR_WARNING_INTERVAL / 2));
        assert!(errors.warn_now(down, start + REPEATED_ERROR_WARNING_INTERVAL));
        assert!(!errors.warn_now(down, start + REPEATED_ERROR_WARNING_INTERVAL * 3 / 2));
    }

    #[test]
    fn what_the_broker_refuses_for_the_message_itself_is_final() {
        let produced = |code| KafkaError::MessageProduction(code);
        for code in [
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::MessageBatchTooLarge,
            RDKafkaErrorCode::PolicyViolation,
            RDKafkaErrorCode::InvalidRecord,
            RDKafkaErrorCode::InvalidTopic,
            RDKafkaErrorCode::TopicAuthorizationFailed,
        ] {
            assert!(!is_retryable(&produced(code)), "{code:?}");
        }
        for code in [
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::RequestTimedOut,
            RDKafkaErrorCode::MessageTimedOut,
        ] {
            assert!(is_retryable(&produced(code)), "{code:?}");
        }
    }
}

//! NATS (async-nats). Two modes:
//! - JetStream (the default): durable, at-least-once. A subject is read and written
//!   through the existing stream that captures it, looked up by subject; only when none
//!   does (nor any part of it) does weir create a stream for it alone. Consumers are
//!   durable pull consumers filtered to their subject (wildcards included), with ack-all
//!   (or explicit acks for work queues), acknowledged only through [`Source::commit`].
//! - Core NATS: at-most-once. A message is gone once delivered; commits do nothing, and
//!   a crash loses what was in flight. Use it only where that is acceptable.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::context::CreateStreamErrorKind;
use async_nats::jetstream::{self, consumer, stream};
use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};

use bytes::Bytes;

use crate::secret::{redact_urls, scrub, split_credentials, Secret, UrlCredentials};
use crate::wire::KEY_HEADER;

use super::{
    Acks, Assignment, BoxError, Broker, Message, Outbound, PartitionedTopic, PendingAck, Position,
    Sink, Source, StartFrom, Subscription, TransportError,
};

/// How long a sole reader's durable consumer may go without pulling before the server
/// removes it.
pub const SOLE_READER_IDLE_LIMIT: Duration = Duration::from_secs(3600);

#[derive(Clone, PartialEq, Eq)]
pub struct NatsSettings {
    pub url: String,
    pub jetstream: bool,
    /// JetStream: how long a delivered message may stay unacknowledged (without a
    /// keep-alive) before it is delivered again.
    pub ack_wait: Duration,
    /// `max_age` of the streams weir creates; `None`: kept forever.
    pub retention: Option<Duration>,
    pub auth: NatsAuth,
}

impl std::fmt::Debug for NatsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSettings")
            .field("url", &redact_urls(&self.url))
            .field("jetstream", &self.jetstream)
            .field("ack_wait", &self.ack_wait)
            .field("retention", &self.retention)
            .field("auth", &self.auth)
            .finish()
    }
}

impl Default for NatsSettings {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            jetstream: true,
            ack_wait: Duration::from_secs(30),
            retention: None,
            auth: NatsAuth::default(),
        }
    }
}

/// How weir proves itself to a NATS server and checks the server in turn. Credentials
/// written in the URL count as `user`/`password` (or a lone `token`) unless these are set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsAuth {
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub token: Option<Secret>,
    pub nkey_seed_file: Option<PathBuf>,
    pub credentials_file: Option<PathBuf>,
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub tls_required: bool,
}

impl NatsAuth {
    /// Connection options carrying these credentials and TLS settings, for `url` with its
    /// own credentials already split off into `from_url`.
    async fn options(
        &self,
        from_url: UrlCredentials,
    ) -> Result<async_nats::ConnectOptions, String> {
        let mut options = async_nats::ConnectOptions::new();
        let user = self.user.clone().or(from_url.user);
        let password = self.password.clone().or(from_url.password);
        match (user, password, &self.token) {
            (_, _, Some(token)) => options = options.token(token.expose().to_string()),
            (Some(user), Some(password), None) => {
                options = options.user_and_password(user, password.expose().to_string())
            }
            // `nats://TOKEN@host`: a name without a password is a token.
            (Some(token), None, None) => options = options.token(token),
            (None, Some(password), None) => {
                options = options.user_and_password(String::new(), password.expose().to_string())
            }
            (None, None, None) => {}
        }
        if let Some(path) = &self.nkey_seed_file {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read nkey_seed_file {}: {e}", path.display()))?;
            options = options.nkey(seed.trim().to_string());
        }
        if let Some(path) = &self.credentials_file {
            options = options
                .credentials_file(path)
                .await
                .map_err(|e| format!("cannot read credentials_file {}: {e}", path.display()))?;
        }
        for (key, path) in [
            ("tls_ca_file", &self.tls_ca_file),
            ("tls_cert_file", &self.tls_cert_file),
            ("tls_key_file", &self.tls_key_file),
        ] {
            if let Some(path) = path {
                std::fs::metadata(path)
                    .map_err(|e| format!("cannot read {key} {}: {e}", path.display()))?;
            }
        }
        if let Some(ca) = &self.tls_ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => {
                options = options.add_client_certificate(cert.clone(), key.clone())
            }
            (None, None) => {}
            _ => return Err("tls_cert_file and tls_key_file go together".into()),
        }
        let tls = self.tls_required || self.tls_ca_file.is_some() || self.tls_cert_file.is_some();
        Ok(options.require_tls(tls))
    }
}

#[derive(Clone)]
pub struct NatsBroker {
    inner: Arc<Inner>,
}

struct Inner {
    url: String,
    client: async_nats::Client,
    jetstream: Option<jetstream::Context>,
    ack_wait: Duration,
    retention: Option<Duration>,
    /// Subject → the stream found or made to capture it.
    streams: Mutex<HashMap<String, String>>,
    /// Publishes wait here while their subject's stream is looked up.
    setup: super::setup::SetupGate,
}

/// How often a core NATS source looks at its connection.
const CONNECTION_CHECK: Duration = Duration::from_millis(250);

/// Publish acknowledgements the JetStream client lets be pending at once, across every
/// graph, keyed partition and job partition of the process. weir bounds its own (fires in
/// flight, a partition's batch); the client's bound must lie far beyond the sum, since a
/// publish waiting for room there may be held up by acknowledgements its own caller has
/// not awaited yet. The client's default, 5,000, is fewer than one graph of
/// `max_in_flight = 4096` with two outputs can hold, or the ticks of one cron instant
/// (up to 10,000 per shard).
const MAX_ACKS_PENDING: usize = 1 << 20;

/// How long connecting (TCP, TLS and authentication) may take at start.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a connection failed, in an operator's words where async-nats's are terse.
fn connect_failure(e: &async_nats::ConnectError) -> String {
    use async_nats::ConnectErrorKind as Kind;
    let cause = match e.kind() {
        Kind::AuthorizationViolation | Kind::Authentication => {
            "authentication failed (check user, password, token, nkey or credentials)"
        }
        Kind::Tls => "TLS failed (check the CA, the client certificate and the URL)",
        Kind::TimedOut => "timed out",
        Kind::Io => "connection failed",
        _ => "cannot connect",
    };
    format!("{cause}: {e}")
}

/// The JetStream stream that captures a subject: its name with dots and wildcards
/// replaced, which stream names may not contain.
pub fn stream_name(subject: &str) -> String {
    subject
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | ' ' | '/' | '\\' => '_',
            c => c,
        })
        .collect()
}

impl NatsBroker {
    pub async fn connect(settings: NatsSettings) -> Result<Self, TransportError> {
        let shown = redact_urls(&settings.url);
        let (url, from_url) = split_credentials(&settings.url);
        let secrets: Vec<Secret> = [
            settings.auth.password.clone(),
            settings.auth.token.clone(),
            from_url.password.clone(),
            from_url.user.clone().map(Secret::new),
        ]
        .into_iter()
        .flatten()
        .collect();
        let failed = |reason: String| TransportError::Unreachable {
            broker: format!("nats {shown}"),
            source: scrub(&reason, &secrets.iter().collect::<Vec<_>>()).into(),
        };
        let client = settings
            .auth
            .options(from_url)
            .await
            .map_err(|reason| TransportError::Settings {
                broker: format!("nats {shown}"),
                source: scrub(&reason, &secrets.iter().collect::<Vec<_>>()).into(),
            })?
            .connection_timeout(CONNECT_TIMEOUT)
            .connect(url.as_str())
            .await
            .map_err(|e| failed(connect_failure(&e)))?;
        let jetstream = settings.jetstream.then(|| {
            jetstream::ContextBuilder::new()
                .max_ack_inflight(MAX_ACKS_PENDING)
                .build(client.clone())
        });
        Ok(Self {
            inner: Arc::new(Inner {
                url: shown,
                client,
                jetstream,
                ack_wait: settings.ack_wait,
                retention: settings.retention,
                streams: Mutex::new(HashMap::new()),
                setup: Default::default(),
            }),
        })
    }

    fn unreachable(&self, e: impl Into<BoxError>) -> TransportError {
        TransportError::Unreachable {
            broker: format!("nats {}", self.inner.url),
            source: e.into(),
        }
    }

    /// The stream that captures `subject`: an existing one whose subjects cover it, or
    /// else one weir creates for it alone. Never a new stream overlapping another, which
    /// the server would refuse and which would store messages twice.
    async fn ensure_stream(
        &self,
        js: &jetstream::Context,
        subject: &str,
    ) -> Result<stream::Stream, TransportError> {
        let known = self
            .inner
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(subject)
            .cloned();
        let name = match known {
            Some(name) => name,
            None => {
                let name = self.stream_capturing(js, subject).await?;
                self.inner
                    .streams
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(subject.to_string(), name.clone());
                name
            }
        };
        js.get_stream(&name)
            .await
            .map_err(|e| self.unreachable(format!("stream {name}: {e}")))
    }

    /// Looks the subject up among the existing streams; creates a stream for it when none
    /// captures it or any part of it.
    async fn stream_capturing(
        &self,
        js: &jetstream::Context,
        subject: &str,
    ) -> Result<String, TransportError> {
        if let Some(name) = self.existing_stream(js, subject).await? {
            return Ok(name);
        }
        // The plain name may belong to a stream of another subject (`orders.new` and
        // `orders_new` sanitise alike); then the subject's hash tells them apart.
        let plain = stream_name(subject);
        let hashed = format!("{plain}_{:016x}", fnv1a(subject));
        for name in [plain, hashed] {
            let config = stream::Config {
                name: name.clone(),
                subjects: vec![subject.to_string()],
                max_age: self.inner.retention.unwrap_or_default(),
                ..Default::default()
            };
            let mut stream = match get_or_create_riding_out_server_failures(js, config).await {
                Ok(stream) => stream,
                Err(e) => {
                    // Another client (a reader, another node) may have made the subject's
                    // stream since the look-up: the server then refuses this one as
                    // overlapping it, and that stream is the one to use. A look-up
                    // failing as well says the server is away.
                    match self.existing_stream(js, subject).await {
                        Ok(Some(name)) => return Ok(name),
                        Err(lookup) if lookup.is_retryable() => return Err(lookup),
                        Ok(None) | Err(_) => {}
                    }
                    let why = format!("cannot create or open stream {name}: {e}");
                    if creation_failed_for_now(&e.kind()) {
                        return Err(self.unreachable(why));
                    }
                    return Err(TransportError::InvalidTopic {
                        topic: subject.to_string(),
                        reason: why,
                    });
                }
            };
            let info = stream
                .info()
                .await
                .map_err(|e| self.unreachable(format!("stream {name}: {e}")))?;
            if info.config.subjects.iter().any(|s| s == subject) {
                return Ok(name);
            }
        }
        Err(TransportError::InvalidTopic {
            topic: subject.to_string(),
            reason: "the stream names weir would give it are taken by other streams".into(),
        })
    }

    /// The existing stream whose subjects cover `subject`, if any; an error if a stream
    /// captures part of it but not all.
    async fn existing_stream(
        &self,
        js: &jetstream::Context,
        subject: &str,
    ) -> Result<Option<String>, TransportError> {
        let mut overlapping = Vec::new();
        let mut streams = js.streams();
        while let Some(info) = streams.try_next().await.map_err(|e| {
            let why = if no_jetstream_answered(&e) {
                " (no JetStream answered: is it enabled on the server, for this account?)"
            } else {
                ""
            };
            self.unreachable(format!("listing streams: {e}{why}"))
        })? {
            let subjects = &info.config.subjects;
            if subjects.iter().any(|s| subject_covers(s, subject)) {
                return Ok(Some(info.config.name));
            }
            if subjects.iter().any(|s| subjects_overlap(s, subject)) {
                overlapping.push(format!("{} {:?}", info.config.name, subjects));
            }
        }
        if overlapping.is_empty() {
            return Ok(None);
        }
        Err(TransportError::InvalidTopic {
            topic: subject.to_string(),
            reason: format!(
                "stream {} captures part of it but not all; weir will not create a \
                 stream overlapping another: widen that stream's subjects, or use a \
                 subject one stream captures whole",
                overlapping.join(", ")
            ),
        })
    }

    /// Removes the durables of earlier sole readers of `group_durable` (known by their
    /// description), so a deposed reader's consumer does not linger until the server's
    /// idle limit. Tidying only: each reader has a durable of its own, so one left behind
    /// takes nothing from its successor, and a failure here is logged rather than
    /// failing the subscribe. A reader under a lease (`fencing`) leaves those of readers
    /// under newer tokens: its successors'.
    async fn delete_sole_readers(
        &self,
        stream: &jetstream::stream::Stream,
        group_durable: &str,
        fencing: Option<u64>,
    ) {
        let consumers: Vec<consumer::Info> = match stream.consumers().try_collect().await {
            Ok(consumers) => consumers,
            Err(e) => {
                tracing::warn!(durable = %group_durable, error = %e, "cannot list the durables of earlier readers; the server removes them once idle");
                return;
            }
        };
        for name in consumers
            .iter()
            .filter(|c| {
                made_by_predecessor(c.config.description.as_deref(), group_durable, fencing)
            })
            .map(|c| &c.name)
        {
            match stream.delete_consumer(name).await {
                Ok(_) => {}
                // Its reader's idle limit, or another subscriber, came first.
                Err(e) if e.to_string().contains("not found") => {}
                Err(e) => {
                    tracing::warn!(durable = %name, error = %e, "cannot remove an earlier reader's durable; the server removes it once idle");
                }
            }
        }
    }
}

/// Whether every subject `subject` can stand for is also matched by `pattern`
/// (`orders.>` covers `orders.new` and `orders.*`; `orders.*` does not cover `orders.>`).
pub fn subject_covers(pattern: &str, subject: &str) -> bool {
    let subject: Vec<&str> = subject.split('.').collect();
    for (i, token) in pattern.split('.').enumerate() {
        if token == ">" {
            return subject.len() > i;
        }
        match (token, subject.get(i)) {
            (_, None) => return false,
            ("*", Some(&">")) => return false,
            ("*", Some(_)) => {}
            (literal, Some(other)) if literal != *other => return false,
            _ => {}
        }
    }
    pattern.split('.').count() == subject.len()
}

/// Whether some subject is matched by both patterns.
pub fn subjects_overlap(a: &str, b: &str) -> bool {
    let a: Vec<&str> = a.split('.').collect();
    let b: Vec<&str> = b.split('.').collect();
    for i in 0.. {
        match (a.get(i), b.get(i)) {
            (Some(&">"), Some(_)) | (Some(_), Some(&">")) => return true,
            (Some(x), Some(y)) if x != y && *x != "*" && *y != "*" => return false,
            (Some(_), Some(_)) => {}
            (None, None) => return true,
            _ => return false,
        }
    }
    unreachable!("the loop returns once either subject runs out of tokens")
}

/// The durable consumer of `group` on `subject` in a stream capturing `stream_subjects`.
/// A stream of that subject alone has one durable per group; in a stream shared by
/// several subjects, a group reading two of them (two sources of one graph) needs two.
fn durable_name(group: &str, subject: &str, stream_subjects: &[String]) -> String {
    let plain = stream_name(group);
    if stream_subjects.len() == 1 && stream_subjects[0] == subject {
        plain
    } else {
        format!("{plain}_{:016x}", fnv1a(subject))
    }
}

/// What a sole reader's durable adds to its group's: `-r` and 8 hex digits drawn at each
/// subscribe. Were the name the same for every reader, a reader deposed while paused
/// would, on waking, pull by that name from its successor's consumer: it would be handed
/// messages it then drops, and which its successor's ack-all later covers, so they would
/// be lost. Under a name of its own its pulls find no consumer.
const SOLE_READER_MARK: &str = "-r";

fn sole_reader_durable(group_durable: &str) -> String {
    format!(
        "{group_durable}{SOLE_READER_MARK}{:08x}",
        rand::random::<u32>()
    )
}

/// The description a sole reader's durable carries: how a successor knows its
/// predecessors' durables from any other consumer of the stream, whatever the names, and
/// the fencing token it reads under, if any.
fn sole_reader_description(group_durable: &str, fencing: Option<u64>) -> String {
    match fencing {
        Some(token) => format!("weir sole reader of {group_durable}{FENCING_MARK}{token}"),
        None => format!("weir sole reader of {group_durable}"),
    }
}

const FENCING_MARK: &str = " under fencing token ";

/// Whether the consumer `description` describes was made by a predecessor of a sole
/// reader of `group_durable` under `fencing`: a sole reader of that durable under no
/// token, or under one no newer than `fencing`. One under a newer token is the
/// successor of a reader deposed while it was paused, and stays.
fn made_by_predecessor(
    description: Option<&str>,
    group_durable: &str,
    fencing: Option<u64>,
) -> bool {
    let Some(rest) =
        description.and_then(|d| d.strip_prefix(&sole_reader_description(group_durable, None)))
    else {
        return false;
    };
    if rest.is_empty() {
        return true;
    }
    // Anything else after the durable's name is another durable's name, not a token.
    let Some(theirs) = rest
        .strip_prefix(FENCING_MARK)
        .and_then(|t| t.parse::<u64>().ok())
    else {
        return false;
    };
    fencing.is_none_or(|ours| theirs <= ours)
}

/// FNV-1a: a stable hash (the same on every node and version) for stream names.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn validate_subject(subject: &str) -> Result<(), TransportError> {
    if subject.is_empty()
        || subject.contains(char::is_whitespace)
        || subject.starts_with('.')
        || subject.ends_with('.')
    {
        return Err(TransportError::InvalidTopic {
            topic: subject.to_string(),
            reason: "a NATS subject is non-empty dot-separated tokens without whitespace".into(),
        });
    }
    Ok(())
}

/// weir's own header names, made once: making a name checks and copies it, which was a
/// noticeable share of every publish.
static WELL_KNOWN_HEADERS: std::sync::LazyLock<Vec<(&'static str, async_nats::HeaderName)>> =
    std::sync::LazyLock::new(|| {
        crate::wire::HEADERS
            .into_iter()
            .map(|name| (name, async_nats::HeaderName::from_static(name)))
            .collect()
    });

fn well_known(name: &str) -> Option<async_nats::HeaderName> {
    WELL_KNOWN_HEADERS
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, header)| header.clone())
}

/// A header name for NATS, refused (rather than left to panic in the client) when it
/// holds a character NATS headers cannot carry.
fn header_name(
    name: &str,
) -> Result<async_nats::HeaderName, async_nats::header::ParseHeaderNameError> {
    match well_known(name) {
        Some(header) => Ok(header),
        None => name.parse(),
    }
}

/// A header value as NATS can carry it: a line break would end the header (and the
/// client refuses one by panicking), so each becomes a space. Error messages are the
/// values that have them.
fn header_value(value: &str) -> std::borrow::Cow<'_, str> {
    if value.contains(['\r', '\n']) {
        std::borrow::Cow::Owned(value.replace(['\r', '\n'], " "))
    } else {
        std::borrow::Cow::Borrowed(value)
    }
}

/// The message key a publisher put in [`KEY_HEADER`].
fn key_of(headers: &super::Headers) -> Option<Bytes> {
    headers
        .iter()
        .find(|(name, _)| name == KEY_HEADER)
        .map(|(_, value)| Bytes::copy_from_slice(value.as_bytes()))
}

fn headers_of(message: &async_nats::Message) -> super::Headers {
    let Some(headers) = &message.headers else {
        return Vec::new();
    };
    headers
        .iter()
        .flat_map(|(name, values)| {
            let name = crate::wire::header_name(name.as_ref());
            values
                .iter()
                .map(move |v| (name.clone(), super::HeaderValue::new(v.as_str())))
        })
        .collect()
}

#[async_trait]
impl Broker for NatsBroker {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn redelivery_wait(&self) -> Option<Duration> {
        self.inner.jetstream.as_ref().map(|_| self.inner.ack_wait)
    }

    async fn subscribe(
        &self,
        subscription: &Subscription,
    ) -> Result<Box<dyn Source>, TransportError> {
        validate_subject(&subscription.topic)?;
        let topic: Arc<str> = Arc::from(subscription.topic.as_str());
        let Some(js) = &self.inner.jetstream else {
            let client = self.inner.client.clone();
            if client.connection_state() != async_nats::connection::State::Connected {
                return Err(self.unreachable("not connected"));
            }
            let subscriber = client
                .queue_subscribe(subscription.topic.clone(), subscription.group.clone())
                .await
                .map_err(|e| self.unreachable(e))?;
            let mut connection_check = tokio::time::interval(CONNECTION_CHECK);
            connection_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            return Ok(Box::new(CoreSource {
                topic,
                subscriber,
                client,
                url: self.inner.url.clone(),
                connection_check,
                last_id: 0,
            }));
        };
        let stream = self.ensure_stream(js, &subscription.topic).await?;
        let group_durable = durable_name(
            &subscription.group,
            &subscription.topic,
            &stream.cached_info().config.subjects,
        );
        let resume = subscription.resume_after.iter().map(|p| p.offset).max();
        let deliver_policy = match (&subscription.assignment, resume) {
            (Assignment::All, Some(seq)) => consumer::DeliverPolicy::ByStartSequence {
                start_sequence: (seq + 1).max(1) as u64,
            },
            _ => match subscription.start {
                StartFrom::Earliest => consumer::DeliverPolicy::All,
                StartFrom::Latest => consumer::DeliverPolicy::New,
            },
        };
        let sole_reader = subscription.assignment == Assignment::All;
        let description =
            sole_reader.then(|| sole_reader_description(&group_durable, subscription.fencing));
        let durable = if sole_reader {
            // The only reader of its durable: start one afresh at the checkpoint, so what
            // a crashed predecessor held unacknowledged comes again now, in order,
            // rather than after the ack wait.
            self.delete_sole_readers(&stream, &group_durable, subscription.fencing)
                .await;
            sole_reader_durable(&group_durable)
        } else {
            group_durable
        };
        let (ack_policy, prefetch) = match subscription.acks {
            Acks::Cumulative => (consumer::AckPolicy::All, None),
            Acks::Each { prefetch } => (consumer::AckPolicy::Explicit, Some(prefetch)),
        };
        // A sole reader's durable is made afresh at every subscribe, so nothing relies on
        // it outliving its reader: the server removes it once idle, rather than keeping
        // one per `weir tail` or per graph renamed away.
        let inactive_threshold = if sole_reader {
            SOLE_READER_IDLE_LIMIT
        } else {
            Duration::ZERO
        };
        let config = consumer::pull::Config {
            durable_name: Some(durable.clone()),
            description,
            ack_policy,
            deliver_policy,
            ack_wait: self.inner.ack_wait,
            max_ack_pending: 100_000,
            inactive_threshold,
            // The stream may capture more than this subject (an existing one, or a
            // wildcard's).
            filter_subject: subscription.topic.clone(),
            ..Default::default()
        };
        let consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(&durable, config)
            .await
            .map_err(|e| self.unreachable(format!("consumer {durable}: {e}")))?;
        // Counted from what the consumer had delivered when made (none, when made
        // afresh): a break before the first delivery loses messages too.
        let last_delivery = sole_reader.then(|| consumer.cached_info().delivered.consumer_sequence);
        let reading = match prefetch {
            None => Reading::Continuous(Box::new(
                consumer
                    .stream()
                    .expires(continuous_expires(
                        consumer.cached_info().config.max_expires,
                    ))
                    .heartbeat(continuous_heartbeat(
                        consumer.cached_info().config.max_expires,
                    ))
                    .messages()
                    .await
                    .map_err(|e| self.unreachable(format!("consumer {durable}: {e}")))?,
            )),
            Some(prefetch) => Reading::Sized {
                consumer: Box::new(consumer),
                prefetch,
                request: None,
                batch: None,
            },
        };
        Ok(Box::new(JetStreamSource {
            topic,
            reading,
            unacked: BTreeMap::new(),
            ack_wait: self.inner.ack_wait,
            last_delivery,
        }))
    }

    fn sink(&self) -> Arc<dyn Sink> {
        Arc::new(self.clone())
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<PartitionedTopic, TransportError> {
        validate_subject(topic)?;
        let Some(js) = &self.inner.jetstream else {
            return Err(TransportError::InvalidTopic {
                topic: topic.to_string(),
                reason: "partitions are owned one reader at a time with positions kept, which \
                         core NATS cannot do: enable JetStream (broker.jetstream = true)"
                    .into(),
            });
        };
        // One stream for every partition's subject, so the partitions share its limits
        // and a later subscription to one partition finds it.
        self.ensure_stream(js, &format!("{topic}.*")).await?;
        Ok(PartitionedTopic::subjects(topic, partitions))
    }

    async fn ping(&self) -> Result<(), TransportError> {
        self.inner
            .client
            .flush()
            .await
            .map_err(|e| self.unreachable(e))
    }
}

#[async_trait]
impl Sink for NatsBroker {
    async fn publish(&self, message: Outbound) -> Result<Position, TransportError> {
        self.enqueue(message).await?.await
    }

    async fn enqueue(&self, message: Outbound) -> Result<PendingAck, TransportError> {
        validate_subject(&message.topic)?;
        let mut headers = async_nats::HeaderMap::new();
        for (name, value) in &message.headers {
            let name = header_name(name).map_err(|e| TransportError::Publish {
                topic: message.topic.to_string(),
                source: format!("header name {name:?} cannot travel on NATS: {e}").into(),
                retryable: false,
            })?;
            headers.insert(name, header_value(value).as_ref());
        }
        // NATS messages have no key: it travels as a header, read back by every source.
        if let Some(key) = &message.key {
            let key = String::from_utf8_lossy(key);
            // Changed, it would be another key: refused instead.
            if key.contains(['\r', '\n']) {
                return Err(TransportError::Publish {
                    topic: message.topic.to_string(),
                    source: "a message key with a line break cannot travel on NATS".into(),
                    retryable: false,
                });
            }
            headers.insert(
                async_nats::HeaderName::from_static(KEY_HEADER),
                key.as_ref(),
            );
        }
        let Outbound { topic, payload, .. } = message;
        // A message larger than the server takes fails the same way however often it
        // is sent.
        let publish_error = |topic: &str, e: BoxError, too_large: bool| TransportError::Publish {
            topic: topic.to_string(),
            source: e,
            retryable: !too_large,
        };
        match &self.inner.jetstream {
            Some(js) => {
                let turn = self.inner.setup.enter(&topic).await;
                if turn.needs_setup() {
                    self.ensure_stream(js, &topic).await?;
                    turn.set_up();
                }
                let ack = js
                    .publish_with_headers(topic.to_string(), headers, payload)
                    .await
                    .map_err(|e| {
                        let too_large = jetstream_too_large(&e);
                        publish_error(&topic, e.into(), too_large)
                    })?;
                drop(turn);
                Ok(PendingAck::awaited(async move {
                    let ack = ack.await.map_err(|e| {
                        let too_large = jetstream_too_large(&e);
                        publish_error(&topic, e.into(), too_large)
                    })?;
                    Ok(Position {
                        partition: 0,
                        offset: ack.sequence as i64,
                    })
                }))
            }
            None => {
                self.inner
                    .client
                    .publish_with_headers(topic.to_string(), headers, payload)
                    .await
                    .map_err(|e| {
                        let too_large =
                            e.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded;
                        publish_error(&topic, e.into(), too_large)
                    })?;
                Ok(PendingAck::given(Ok(Position {
                    partition: 0,
                    offset: -1,
                })))
            }
        }
    }
}

/// Whether a JetStream request went unanswered, as when the server runs without
/// JetStream or the account has none: the client reports no responders.
fn no_jetstream_answered(e: &jetstream::context::RequestError) -> bool {
    use jetstream::context::RequestErrorKind::NoResponders;
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(error) = next {
        if error
            .downcast_ref::<jetstream::context::RequestError>()
            .is_some_and(|r| r.kind() == NoResponders)
            || error
                .downcast_ref::<async_nats::RequestError>()
                .is_some_and(|r| r.kind() == async_nats::RequestErrorKind::NoResponders)
        {
            return true;
        }
        next = error.source();
    }
    false
}

/// Tries a stream creation the server failed on its side again, up to this many times.
const SERVER_FAILURE_RETRIES: u32 = 3;

/// Creates or opens a stream, trying again, briefly (pauses of 50 ms doubling, 350 ms in
/// all), when the server fails on its side: nats-server answers a 5xx when it makes a
/// stream's store just as the account's last stream is deleted, a race that passes at
/// once, and callers that publish once (a command's line) should not see it.
async fn get_or_create_riding_out_server_failures(
    js: &jetstream::Context,
    config: stream::Config,
) -> Result<stream::Stream, async_nats::jetstream::context::CreateStreamError> {
    let mut pause = Duration::from_millis(50);
    let mut tries = 0;
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Err(e) if tries < SERVER_FAILURE_RETRIES && server_failed(&e.kind()) => {
                tries += 1;
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
            created => return created,
        }
    }
}

/// Whether the server failed on its side (a 5xx answer) rather than refused the stream.
fn server_failed(kind: &CreateStreamErrorKind) -> bool {
    matches!(kind, CreateStreamErrorKind::JetStream(api) if api.code() >= 500)
}

/// Whether a stream creation that failed may succeed if tried again: no answer in time,
/// JetStream not answering at all (restarting, electing a leader), or the server failing
/// on its side (a 5xx answer, such as its store's directory vanishing as the last stream
/// of the account is deleted while another is created): a moment's trouble, unlike a
/// refusal of the stream.
fn creation_failed_for_now(kind: &CreateStreamErrorKind) -> bool {
    match kind {
        CreateStreamErrorKind::TimedOut
        | CreateStreamErrorKind::JetStreamUnavailable
        | CreateStreamErrorKind::Response => true,
        kind => server_failed(kind),
    }
}

/// How long a work-queue member's pull request waits on the server for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// The pull requests of a reader with cumulative acknowledgements (every reader but a
/// work-queue member): how long each waits on the server, and how often the server
/// says it is still there while it has nothing to deliver. A reader that hears neither
/// a message nor a heartbeat for two heartbeats fails, and its owner (an accumulator,
/// a partition) starts over from its checkpoint. The server can lose a pull request (a
/// consumer made a moment before, on a server busy storing what was just published,
/// took nothing for good in some runs of the pre-filled bench, the raw client's loop
/// too): with the client's default heartbeat of 15 s, that was half a minute without a
/// message.
const CONTINUOUS_EXPIRES: Duration = Duration::from_secs(10);
const CONTINUOUS_HEARTBEAT: Duration = Duration::from_millis(2500);

/// The expiry of a continuous reader's pull requests, within the consumer's limit (set
/// by the server's `max_request_expires`; zero when there is none): a request over it
/// is refused.
fn continuous_expires(limit: Duration) -> Duration {
    if limit.is_zero() {
        CONTINUOUS_EXPIRES
    } else {
        CONTINUOUS_EXPIRES.min(limit)
    }
}

/// The heartbeat of a continuous reader's pull requests: at most half their expiry, as
/// the server requires.
fn continuous_heartbeat(limit: Duration) -> Duration {
    CONTINUOUS_HEARTBEAT.min(continuous_expires(limit) / 2)
}

struct JetStreamSource {
    topic: Arc<str>,
    reading: Reading,
    /// Delivered, not yet acknowledged: stream sequence → acker.
    unacked: BTreeMap<u64, Delivered>,
    /// After this long unacknowledged and not reported alive, the server delivers a
    /// message again.
    ack_wait: Duration,
    /// For the sole reader of its consumer: the consumer's delivery count at the last
    /// message read. See [`JetStreamSource::check_delivery`].
    last_delivery: Option<u64>,
}

struct Delivered {
    acker: jetstream::message::Acker,
    /// Until when the server leaves the message to this consumer.
    alive_until: tokio::time::Instant,
}

type BatchRequest =
    futures::future::BoxFuture<'static, Result<consumer::pull::Batch, consumer::pull::BatchError>>;

/// How a source gets its messages from the server.
enum Reading {
    /// A sole reader with ack-all: the client pulls ahead on its own.
    Continuous(Box<consumer::pull::Stream>),
    /// A work-queue member with explicit acks: it pulls only as many messages as it has
    /// room for below `prefetch`, so the server never hands it a message that would sit
    /// unread in the client while others of the group could take it, and that, not
    /// reported alive, would be delivered to another member meanwhile.
    Sized {
        consumer: Box<consumer::PullConsumer>,
        prefetch: usize,
        /// A pull request on its way; kept here so a read cancelled while it is sent
        /// does not lose the messages it asked for.
        request: Option<BatchRequest>,
        batch: Option<Box<consumer::pull::Batch>>,
    },
}

fn consume_error(topic: &str, reason: String) -> TransportError {
    TransportError::Consume {
        topic: topic.to_string(),
        source: reason.into(),
        retryable: true,
    }
}

impl JetStreamSource {
    /// Fails the read when deliveries are missing before this one. The server counts a
    /// message delivered once it has sent it; sent into a connection that then broke, it
    /// never arrives, and the client's new connection goes on with the messages after
    /// it. Acknowledging those (ack-all) would acknowledge the lost ones too. Failing
    /// instead has the reader start again from its last stored position, with a
    /// consumer of its own made afresh there, so the lost messages come again. Only a
    /// sole reader sees every delivery of its consumer and can tell. A count that goes
    /// back (the server's consumer state restored older) fails the read the same way.
    fn check_delivery(&mut self, delivery: u64) -> Result<(), TransportError> {
        let Some(last) = &mut self.last_delivery else {
            return Ok(());
        };
        if delivery != *last + 1 {
            return Err(consume_error(
                &self.topic,
                format!(
                    "the consumer's delivery {delivery} came after delivery {last}: what was \
                     delivered between never arrived (a connection broke while it was on its \
                     way), so the reader must read again from its last position"
                ),
            ));
        }
        *last = delivery;
        Ok(())
    }

    /// The next message from the server, pulling more when there is room for them.
    async fn receive(&mut self) -> Result<Option<jetstream::Message>, TransportError> {
        let unacked = &mut self.unacked;
        match &mut self.reading {
            Reading::Continuous(messages) => match messages.next().await {
                Some(Ok(m)) => Ok(Some(m)),
                Some(Err(e)) => Err(consume_error(&self.topic, e.to_string())),
                None => Ok(None),
            },
            Reading::Sized {
                consumer,
                prefetch,
                request,
                batch,
            } => loop {
                if let Some(open) = batch {
                    match open.next().await {
                        Some(Ok(m)) => return Ok(Some(m)),
                        Some(Err(e)) => {
                            *batch = None;
                            return Err(consume_error(&self.topic, e.to_string()));
                        }
                        // Delivered all it asked for, or expired.
                        None => *batch = None,
                    }
                }
                if request.is_none() {
                    // A message the server may have handed to another member by now (not
                    // finished, not reported alive) takes no room; its acker stays, in
                    // case its handler still finishes.
                    let now = tokio::time::Instant::now();
                    let held = unacked.values().filter(|d| d.alive_until > now).count();
                    let room = prefetch.saturating_sub(held);
                    // Pull once half the room is free, so requests stay large; until
                    // then the messages at hand keep the consumer busy. A commit frees
                    // room by ending this read; so does a held message expiring, which
                    // is when this wait looks again.
                    if room == 0 || (room < *prefetch / 2 && held > 0) {
                        let expiry = unacked
                            .values()
                            .map(|d| d.alive_until)
                            .filter(|at| *at > now)
                            .min();
                        match expiry {
                            Some(at) => tokio::time::sleep_until(at).await,
                            None => std::future::pending::<()>().await,
                        }
                        continue;
                    }
                    let consumer = consumer.as_ref().clone();
                    *request = Some(Box::pin(async move {
                        consumer
                            .batch()
                            .max_messages(room)
                            .expires(PULL_EXPIRES)
                            .messages()
                            .await
                    }));
                }
                let sent = match request.as_mut() {
                    Some(pending) => pending.await,
                    None => continue,
                };
                *request = None;
                match sent {
                    Ok(opened) => *batch = Some(Box::new(opened)),
                    Err(e) => return Err(consume_error(&self.topic, e.to_string())),
                }
            },
        }
    }
}

#[async_trait]
impl Source for JetStreamSource {
    fn ready(&mut self) -> Option<Result<Message, TransportError>> {
        // A read dropped before it completes loses nothing.
        futures::FutureExt::now_or_never(self.next())
    }

    async fn next(&mut self) -> Result<Message, TransportError> {
        let Some(message) = self.receive().await? else {
            return Err(TransportError::Closed {
                topic: self.topic.to_string(),
            });
        };
        let (sequence, timestamp_ms) = {
            let info = message
                .info()
                .map_err(|e| consume_error(&self.topic, e.to_string()))?;
            self.check_delivery(info.consumer_sequence)?;
            let ts = info.published.unix_timestamp_nanos() / 1_000_000;
            (info.stream_sequence, ts as i64)
        };
        let headers = headers_of(&message.message);
        let (message, acker) = message.split();
        let alive_until = tokio::time::Instant::now() + self.ack_wait;
        self.unacked
            .insert(sequence, Delivered { acker, alive_until });
        Ok(Message {
            topic: self.topic.clone(),
            position: Position {
                partition: 0,
                offset: sequence as i64,
            },
            key: key_of(&headers),
            payload: message.payload,
            headers,
            timestamp_ms,
        })
    }

    async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
        if matches!(self.reading, Reading::Sized { .. }) {
            for position in through {
                if let Some(delivered) = self.unacked.remove(&(position.offset.max(0) as u64)) {
                    delivered
                        .acker
                        .ack()
                        .await
                        .map_err(|e| TransportError::Commit {
                            topic: self.topic.to_string(),
                            source: e,
                        })?;
                }
            }
            return Ok(());
        }
        let Some(through) = through.iter().map(|p| p.offset).max() else {
            return Ok(());
        };
        let through = through.max(0) as u64;
        // With ack-all, acknowledging the newest covered message covers the older ones.
        let newest = self.unacked.range(..=through).next_back().map(|(s, _)| *s);
        let Some(newest) = newest else {
            return Ok(());
        };
        let rest = self.unacked.split_off(&(newest + 1));
        let covered = std::mem::replace(&mut self.unacked, rest);
        if let Some((_, delivered)) = covered.into_iter().next_back() {
            delivered
                .acker
                .ack()
                .await
                .map_err(|e| TransportError::Commit {
                    topic: self.topic.to_string(),
                    source: e,
                })?;
        }
        Ok(())
    }

    async fn keep_alive(&mut self, positions: &[Position]) -> Result<(), TransportError> {
        let alive_until = tokio::time::Instant::now() + self.ack_wait;
        for position in positions {
            if let Some(delivered) = self.unacked.get_mut(&(position.offset.max(0) as u64)) {
                delivered
                    .acker
                    .ack_with(jetstream::AckKind::Progress)
                    .await
                    .map_err(|e| TransportError::Commit {
                        topic: self.topic.to_string(),
                        source: e,
                    })?;
                delivered.alive_until = alive_until;
            }
        }
        Ok(())
    }
}

struct CoreSource {
    topic: Arc<str>,
    subscriber: async_nats::Subscriber,
    client: async_nats::Client,
    url: String,
    /// How often the connection is looked at: while it is down the subscription gets
    /// nothing, and its reader must know it is disconnected rather than idle.
    connection_check: tokio::time::Interval,
    /// Core NATS messages have no position and are never delivered again: each gets an
    /// id of its own, increasing and never reused, so none is taken for a replay.
    last_id: i64,
}

#[async_trait]
impl Source for CoreSource {
    fn keeps_unread(&self) -> bool {
        false
    }

    fn ready(&mut self) -> Option<Result<Message, TransportError>> {
        // A read dropped before it completes loses nothing.
        futures::FutureExt::now_or_never(self.next())
    }

    async fn next(&mut self) -> Result<Message, TransportError> {
        let message = loop {
            tokio::select! {
                message = self.subscriber.next() => match message {
                    Some(message) => break message,
                    None => {
                        return Err(TransportError::Closed {
                            topic: self.topic.to_string(),
                        })
                    }
                },
                _ = self.connection_check.tick() => {
                    if self.client.connection_state() == async_nats::connection::State::Disconnected {
                        return Err(TransportError::Unreachable {
                            broker: format!("nats {}", self.url),
                            source: "the connection dropped".into(),
                        });
                    }
                }
            }
        };
        // Microseconds of the wall clock, bumped to stay increasing: ids of an earlier
        // run stay below.
        self.last_id = (self.last_id + 1).max(chrono::Utc::now().timestamp_micros());
        let headers = headers_of(&message);
        Ok(Message {
            topic: self.topic.clone(),
            position: Position {
                partition: 0,
                offset: self.last_id,
            },
            key: key_of(&headers),
            headers,
            payload: message.payload,
            timestamp_ms: super::now_ms(),
        })
    }

    async fn commit(&mut self, _through: &[Position]) -> Result<(), TransportError> {
        // Core NATS has no acknowledgements: delivery is at-most-once.
        Ok(())
    }
}

/// Whether JetStream refused a message for its size: over the server's `max_payload`,
/// or over the stream's largest message.
fn jetstream_too_large(e: &jetstream::context::PublishError) -> bool {
    e.kind() == jetstream::context::PublishErrorKind::MaxPayloadExceeded
        || e.to_string().contains("message size exceeds maximum")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_lose_their_line_breaks_and_bad_names_are_refused() {
        assert_eq!(header_value("plain"), "plain");
        assert_eq!(
            header_value("node n failed:\r\nline two\nthree"),
            "node n failed:  line two three"
        );
        assert!(header_name(crate::wire::ERROR_HEADER).is_ok());
        assert!(header_name("x-custom").is_ok());
        assert!(header_name("bad: name").is_err());
    }

    #[test]
    fn a_stream_creation_the_server_failed_on_its_side_is_tried_again() {
        let answer = |code: u16, err_code: u64, description: &str| {
            let api: async_nats::jetstream::Error = serde_json::from_value(serde_json::json!({
                "code": code,
                "err_code": err_code,
                "description": description,
            }))
            .unwrap();
            CreateStreamErrorKind::JetStream(api)
        };
        // As nats-server answers when its store's directory vanished under it.
        assert!(creation_failed_for_now(&answer(
            500,
            10049,
            "could not create storage directory"
        )));
        assert!(creation_failed_for_now(&answer(
            503,
            10023,
            "insufficient resources"
        )));
        assert!(creation_failed_for_now(&CreateStreamErrorKind::TimedOut));
        // Refusals of the stream itself stay refusals.
        assert!(!creation_failed_for_now(&answer(
            400,
            10065,
            "subjects overlap with an existing stream"
        )));
        assert!(!creation_failed_for_now(&answer(
            400,
            10052,
            "invalid stream config"
        )));
        // Only the server's own failures are tried again at once, inside the creation;
        // a timeout is left to the caller, which knows how long it may wait.
        assert!(server_failed(&answer(
            500,
            10049,
            "could not create storage directory"
        )));
        assert!(!server_failed(&CreateStreamErrorKind::TimedOut));
        assert!(!server_failed(&answer(
            400,
            10065,
            "subjects overlap with an existing stream"
        )));
    }

    #[test]
    fn a_continuous_pull_stays_within_the_servers_expiry_limit() {
        let unlimited = Duration::ZERO;
        assert_eq!(continuous_expires(unlimited), CONTINUOUS_EXPIRES);
        assert_eq!(continuous_heartbeat(unlimited), CONTINUOUS_HEARTBEAT);
        let limit = Duration::from_secs(3);
        assert_eq!(continuous_expires(limit), limit);
        assert_eq!(continuous_heartbeat(limit), Duration::from_millis(1500));
    }

    #[test]
    fn a_wider_pattern_covers_a_subject() {
        assert!(subject_covers("orders.>", "orders.new"));
        assert!(subject_covers("orders.>", "orders.eu.new"));
        assert!(subject_covers("orders.>", "orders.*"));
        assert!(subject_covers("orders.>", "orders.>"));
        assert!(subject_covers("orders.*", "orders.new"));
        assert!(subject_covers("orders.new", "orders.new"));
        assert!(subject_covers(">", "a.b.c"));
        assert!(!subject_covers("orders.>", "orders"));
        assert!(!subject_covers("orders.*", "orders.>"));
        assert!(!subject_covers("orders.*", "orders.eu.new"));
        assert!(!subject_covers("orders.new", "orders.*"));
        assert!(!subject_covers("orders.new", "orders_new"));
        assert!(!subject_covers("orders.new.x", "orders.new"));
    }

    #[test]
    fn overlapping_patterns_share_a_subject() {
        assert!(subjects_overlap("orders.new", "orders.*"));
        assert!(subjects_overlap("orders.*", "*.new"));
        assert!(subjects_overlap("orders.>", "orders.eu.new"));
        assert!(subjects_overlap("a.b", "a.b"));
        assert!(!subjects_overlap("orders.new", "orders.old"));
        assert!(!subjects_overlap("orders.*", "orders.eu.new"));
        assert!(!subjects_overlap("orders.>", "orders"));
        assert!(!subjects_overlap("a.b", "a.b.c"));
    }

    #[test]
    fn a_group_gets_a_durable_per_subject_in_a_shared_stream() {
        let own = ["orders.new".to_string()];
        assert_eq!(durable_name("weir.g", "orders.new", &own), "weir_g");
        let shared = ["orders.>".to_string()];
        let a = durable_name("weir.g", "orders.a", &shared);
        let b = durable_name("weir.g", "orders.b", &shared);
        assert_ne!(a, b);
        assert!(a.starts_with("weir_g_"), "{a}");
    }

    #[test]
    fn each_sole_reader_has_a_durable_of_its_own() {
        let a = sole_reader_durable("weir_g");
        let b = sole_reader_durable("weir_g");
        assert_ne!(a, b);
        assert!(a.starts_with("weir_g-r"), "{a}");
        assert_ne!(
            sole_reader_description("weir_g", None),
            sole_reader_description("weir_g2", None)
        );
    }

    #[test]
    fn a_sole_reader_removes_durables_under_its_token_or_older_and_none_of_others() {
        let made = |fencing| sole_reader_description("weir_g", fencing);
        let predecessor = |theirs: &str, ours| made_by_predecessor(Some(theirs), "weir_g", ours);
        assert!(predecessor(&made(None), Some(5)));
        assert!(predecessor(&made(Some(4)), Some(5)));
        assert!(
            predecessor(&made(Some(5)), Some(5)),
            "its own earlier subscribe"
        );
        assert!(!predecessor(&made(Some(6)), Some(5)), "a successor's");
        assert!(predecessor(&made(Some(6)), None));
        let other = sole_reader_description("weir_g2", Some(1));
        assert!(!predecessor(&other, Some(5)));
        assert!(!predecessor(
            &sole_reader_description("weir_g2", None),
            None
        ));
        assert!(!made_by_predecessor(None, "weir_g", None));
    }

    #[test]
    fn stream_names_for_colliding_subjects_differ_by_hash() {
        assert_eq!(stream_name("orders.new"), stream_name("orders_new"));
        assert_ne!(fnv1a("orders.new"), fnv1a("orders_new"));
    }
}

//! `weir run` configuration: a TOML file, every key overridable by an environment
//! variable `WEIR__SECTION__KEY` (array entries by index: `WEIR__GRAPH__0__OUTPUT`).
//! Unknown keys and bad values are errors naming the key. A key defaults to what its
//! domain type's `Default` (or constructor) says; [`defaults`] holds only those no domain
//! type has.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::accumulator::{AccumulatorSpec, EventFormat};
use crate::codec::AvroCodec;
use crate::cron::scheduler::MOST_SHARDS;
use crate::graph::{FunctionRegistry, GraphBuilder, GraphDeclaration};
use crate::reactor::{Criteria, ReactorConfig, Strategy};
use crate::secret::Secret;
use crate::supervisor::{default_node_id, SupervisionPolicy};
use crate::transport::StartFrom;

/// The defaults of keys that no domain type holds: the `weir run` node's own choices.
/// Every other key defaults to its domain type's `Default` (or constructor), read where
/// the key is declared, so each default is written once.
mod env;

use env::{apply_override, override_key};

pub mod defaults {
    pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
    pub const KEY_PREFIX: &str = "weir";
    pub const FUNCTION: &str = "snapshot";
    pub const BATCH_SIZE: usize = 100;
    pub const BATCH_INTERVAL_MS: u64 = 1000;
    /// A node of `weir run` runs each graph under a lease, so that nodes sharing a
    /// config never run one graph twice.
    pub const GRAPH_LEASE_TTL_MS: u64 = 10_000;
    pub const CATCHUP_CAP: u32 = 100;
    pub const TIMEZONE: &str = "UTC";
    /// Seven days, Kafka's usual topic retention: weir's task and result streams would
    /// otherwise grow without end on JetStream.
    pub const RETENTION_MS: u64 = 7 * 24 * 60 * 60 * 1000;
    pub const WORKER_CONCURRENCY: usize = 16;
    /// How long a dead node's job partitions wait for a new owner.
    pub const JOB_LEASE_TTL_MS: u64 = 6_000;
}

/// The `WEIR__…` variables of an environment. Others are not weir's to judge, whatever
/// they hold; one of weir's whose value is not UTF-8 is an error naming it.
fn weir_variables(
    env: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, String)>, ConfigError> {
    env.into_iter()
        .filter_map(|(var, value)| {
            let var = var.into_string().ok().filter(|v| v.starts_with("WEIR__"))?;
            Some(match value.into_string() {
                Ok(value) => Ok((var, value)),
                Err(_) => Err(ConfigError::Env {
                    var,
                    message: "the value is not UTF-8".into(),
                }),
            })
        })
        .collect()
}

/// The longest duration a key takes, in milliseconds: 100 years. Longer ones, added to
/// the clock, would overflow it.
const MOST_MS: u64 = 100 * 365 * 24 * 60 * 60 * 1000;

/// The shortest lease a node may hold: renewed every third of its length, a shorter
/// one would expire between renewals (or renew in a busy loop).
const LEAST_LEASE_TTL_MS: u64 = 1000;
const LEASE_TOO_SHORT: &str = "must be at least 1000: a shorter lease expires between renewals";

/// The most events a source's queue holds per key or graph: far beyond memory, and within
/// what the queue's semaphore can count.
const MOST_QUEUED: usize = 1 << 30;

/// What keeps an admin token from ever matching a request, if anything: a request
/// header carries printable ASCII, without whitespace at its ends.
fn token_problem(token: &str) -> Option<&'static str> {
    if token.trim().is_empty() {
        Some("must not be empty (omit it for no auth)")
    } else if token.trim() != token {
        Some("must not start or end with whitespace: a request header cannot carry it, so no request would match")
    } else if !token.chars().all(|c| (' '..='~').contains(&c)) {
        Some("must be printable ASCII: a request header cannot carry other characters, so no request would match")
    } else {
        None
    }
}

/// Milliseconds of a default duration, for keys written in milliseconds.
fn ms(duration: Duration) -> u64 {
    duration.as_millis() as u64
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("config key {key}: {message}")]
    Invalid { key: String, message: String },
    #[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ConfigError>),
    #[error("cannot connect to the broker: {0}")]
    Broker(#[source] crate::transport::TransportError),
    #[error("cannot connect to the store: {0}")]
    Store(#[source] crate::store::StoreError),
}

impl ConfigError {
    /// Only a failed connection may succeed on a retry; bad config stays bad, and so do
    /// settings the broker's or the store's client refuses.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Broker(e) => e.is_retryable(),
            Self::Store(e) => e.is_retryable(),
            _ => false,
        }
    }
}

/// Where the TOML went wrong and why, without the line itself: toml quotes the
/// offending line, which may hold a password.
fn syntax_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return e.message().to_string();
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit('\n')
        .next()
        .map_or(0, |start| start.chars().count())
        + 1;
    format!("line {line}, column {column}: {}", e.message())
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub node: NodeConfig,
    pub broker: BrokerConfig,
    pub store: StoreConfig,
    pub supervision: SupervisionConfig,
    pub cron: CronConfig,
    pub metrics: MetricsConfig,
    pub admin: AdminConfig,
    #[serde(rename = "graph")]
    pub graphs: Vec<GraphConfig>,
    #[serde(rename = "schedule")]
    pub schedules: Vec<ScheduleConfig>,
    #[serde(rename = "route")]
    pub routes: Vec<RouteConfig>,
    #[serde(rename = "workflow")]
    pub workflows: Vec<WorkflowConfig>,
    pub dispatch: DispatchConfig,
    #[serde(rename = "job")]
    pub jobs: Vec<JobConfig>,
}

/// `[[job]]`: a job type this node serves.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    #[serde(rename = "type")]
    pub job_type: String,
    /// A handler registered by name (`builtin::count`).
    pub handler: String,
    /// Partitions of the type's topic when weir creates it.
    #[serde(default = "default_job_partitions")]
    pub partitions: u32,
    /// Where the handler's outputs go; dropped when absent.
    #[serde(default)]
    pub output: Option<String>,
    /// How long a dead node's partitions wait for a new owner.
    #[serde(default = "default_job_lease_ttl_ms")]
    pub lease_ttl_ms: u64,
    /// Jobs kept in memory per owned partition; the least recently used leave first.
    #[serde(default)]
    pub max_jobs_in_memory: Option<usize>,
}

fn default_job_partitions() -> u32 {
    crate::jobs::DEFAULT_PARTITIONS
}

fn default_job_lease_ttl_ms() -> u64 {
    defaults::JOB_LEASE_TTL_MS
}

impl JobConfig {
    /// The job type, with its handler from `handlers`.
    pub fn job_type(
        &self,
        index: usize,
        handlers: &crate::jobs::JobHandlers,
    ) -> Result<crate::jobs::JobType, ConfigError> {
        let handler = handlers.get(&self.handler).ok_or_else(|| {
            invalid(
                format!("job[{index}].handler"),
                format!(
                    "no job handler {:?} is registered (known: {})",
                    self.handler,
                    handlers.names().join(", ")
                ),
            )
        })?;
        let mut job_type = crate::jobs::JobType::new(&self.job_type, handler);
        job_type.partitions = self.partitions;
        job_type.output = self.output.clone();
        job_type.lease_ttl = Duration::from_millis(self.lease_ttl_ms);
        if let Some(max) = self.max_jobs_in_memory {
            job_type.max_jobs_in_memory = max;
        }
        Ok(job_type)
    }
}

/// Whether a job type's name can be a topic and subject token.
fn valid_job_type(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `[metrics]`: a listener serving only `GET /metrics`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `IP:port`, e.g. `127.0.0.1:9898`; absent means no metrics listener.
    pub listen: Option<std::net::SocketAddr>,
}

/// `[admin]`: the admin API (health, graphs, schedules, recovery events, `/metrics`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// `IP:port`, e.g. `127.0.0.1:9899`; absent means no admin listener.
    pub listen: Option<std::net::SocketAddr>,
    /// When set, every route but `/healthz`, `/readyz` and `/metrics` needs
    /// `Authorization: Bearer <token>`.
    pub token: Option<Secret>,
    /// Serve the admin API on a non-loopback address without a token (refused otherwise).
    pub allow_unauthenticated: bool,
    /// Web origins (`https://ops.example.com`) whose pages may open the WebSocket,
    /// besides the listener's own.
    pub allowed_origins: Vec<String>,
    /// TLS for the admin listener: a PEM certificate chain and its key.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// `[[admin.tokens]]`: tokens that admit their holder to one tenant's graphs,
    /// schedules, executions and recovery events only.
    pub tokens: Vec<TenantToken>,
}

impl AdminConfig {
    /// The tenant tokens as (token, tenant) pairs.
    pub fn tenant_tokens(&self) -> Vec<(String, String)> {
        self.tokens
            .iter()
            .map(|t| (t.token.expose().to_string(), t.tenant.clone()))
            .collect()
    }
}

/// One `[[admin.tokens]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantToken {
    pub token: Secret,
    pub tenant: String,
}

/// `[[workflow]]` with its `[[workflow.task]]` entries.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkflowConfig {
    pub name: String,
    #[serde(default)]
    pub tenant: Option<String>,
    /// An execution still running this long after its start fails; none by default.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    #[serde(rename = "task", default)]
    pub tasks: Vec<TaskConfig>,
}

fn task_defaults() -> crate::dispatch::TaskSpec {
    crate::dispatch::TaskSpec::new("", "")
}
fn default_max_attempts() -> u32 {
    task_defaults().max_attempts
}
fn default_timeout_ms() -> u64 {
    ms(task_defaults().timeout)
}
fn default_backoff_ms() -> u64 {
    ms(task_defaults().backoff)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskConfig {
    pub id: String,
    pub handler: String,
    #[serde(default)]
    pub depends_on: Vec<String>,
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default = "default_backoff_ms")]
    pub backoff_ms: u64,
}

impl WorkflowConfig {
    pub fn workflow(&self, index: usize) -> Result<crate::dispatch::Workflow, ConfigError> {
        let tasks = self
            .tasks
            .iter()
            .map(|t| crate::dispatch::TaskSpec {
                id: t.id.clone(),
                handler: t.handler.clone(),
                depends_on: t.depends_on.clone(),
                max_attempts: t.max_attempts,
                timeout: Duration::from_millis(t.timeout_ms),
                backoff: Duration::from_millis(t.backoff_ms),
            })
            .collect();
        let workflow = crate::dispatch::Workflow::new(&self.name, tasks)
            .map_err(|e| invalid(format!("workflow[{index}]"), e.to_string()))?;
        let workflow = match self.timeout_ms {
            Some(ms) => workflow.with_timeout(Duration::from_millis(ms)),
            None => workflow,
        };
        Ok(match &self.tenant {
            Some(t) => workflow.with_tenant(t),
            None => workflow,
        })
    }
}

/// `[[route]]`: task namespaces matching `pattern` go to `executor` (first match wins).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub pattern: String,
    pub executor: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DispatchConfig {
    /// Executor for namespaces no route matches.
    pub default_executor: String,
    /// Where workers report results and the state manager reads them.
    pub results_topic: String,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            default_executor: crate::dispatch::DEFAULT_EXECUTOR.into(),
            results_topic: crate::dispatch::DispatchSettings::default().results_topic,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CronConfig {
    /// Run the schedule master election and fire schedules (on by default when the
    /// file declares schedules).
    pub enabled: Option<bool>,
    pub shards: u32,
    pub lease_ttl_ms: u64,
    pub orphan_after_ms: u64,
    pub max_attempts: u32,
}

impl Default for CronConfig {
    fn default() -> Self {
        let scheduler = crate::cron::scheduler::SchedulerConfig::new("");
        Self {
            enabled: None,
            shards: scheduler.shards,
            lease_ttl_ms: ms(scheduler.lease_ttl),
            orphan_after_ms: ms(scheduler.orphan_after),
            max_attempts: scheduler.max_attempts,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CatchUpKind {
    #[default]
    Skip,
    Latest,
    All,
}

fn default_timezone() -> String {
    defaults::TIMEZONE.into()
}
fn default_catchup_cap() -> u32 {
    defaults::CATCHUP_CAP
}
fn default_overlap() -> crate::cron::Overlap {
    crate::cron::Overlap::Skip
}
fn default_delivery() -> crate::cron::Delivery {
    crate::cron::Delivery::AtMostOnce
}
fn default_enabled() -> bool {
    true
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    pub id: String,
    pub cron: String,
    #[serde(default = "default_timezone")]
    pub timezone: String,
    /// Topic or subject for the ticks (default `weir.cron.ticks`).
    #[serde(default)]
    pub topic: Option<String>,
    /// A workflow to start per tick, instead of a topic.
    #[serde(default)]
    pub workflow: Option<String>,
    #[serde(default)]
    pub payload: Option<toml::Value>,
    #[serde(default)]
    pub catchup: CatchUpKind,
    #[serde(default = "default_catchup_cap")]
    pub catchup_cap: u32,
    #[serde(default = "default_overlap")]
    pub overlap: crate::cron::Overlap,
    #[serde(default = "default_delivery")]
    pub delivery: crate::cron::Delivery,
    #[serde(default)]
    pub start: Option<String>,
    #[serde(default)]
    pub end: Option<String>,
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    #[serde(default)]
    pub tenant: Option<String>,
}

impl ScheduleConfig {
    /// The schedule this entry declares; `index` names it in errors.
    pub fn schedule(&self, index: usize) -> Result<crate::cron::Schedule, ConfigError> {
        use crate::cron::{CatchUp, Schedule, Target};
        let key = |field: &str| format!("schedule[{index}].{field}");
        let instant = |field: &str,
                       text: &Option<String>|
         -> Result<Option<chrono::DateTime<chrono::Utc>>, ConfigError> {
            text.as_ref()
                .map(|t| {
                    chrono::DateTime::parse_from_rfc3339(t)
                        .map(|d| d.with_timezone(&chrono::Utc))
                        .map_err(|e| invalid(key(field), format!("{t:?} is not RFC 3339: {e}")))
                })
                .transpose()
        };
        let target = match (&self.topic, &self.workflow) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    key("workflow"),
                    "give a topic or a workflow, not both",
                ))
            }
            (None, Some(w)) => Target::Workflow(w.clone()),
            (Some(t), None) => Target::Topic(t.clone()),
            (None, None) => Target::Topic(crate::wire::TICK_TOPIC.into()),
        };
        let payload = match &self.payload {
            None => serde_json::Value::Object(Default::default()),
            Some(v) => {
                serde_json::to_value(v).map_err(|e| invalid(key("payload"), e.to_string()))?
            }
        };
        if let Some(tenant) = &self.tenant {
            crate::tenant::check(tenant).map_err(|e| invalid(key("tenant"), e))?;
        }
        let schedule = Schedule {
            // Tenants' schedules of the same name are kept apart in the store and in
            // their ticks.
            id: crate::tenant::key(self.tenant.as_deref(), &self.id),
            cron: self.cron.clone(),
            timezone: self.timezone.clone(),
            enabled: self.enabled,
            // Set by `declare`, which alone registers what a node's config declares;
            // `weir cron add --paused` builds its schedule here too, as an operator.
            paused_by_config: false,
            start: instant("start", &self.start)?,
            end: instant("end", &self.end)?,
            target,
            payload,
            catchup: match self.catchup {
                CatchUpKind::Skip => CatchUp::Skip,
                CatchUpKind::Latest => CatchUp::Latest,
                CatchUpKind::All => CatchUp::All {
                    cap: self.catchup_cap,
                },
            },
            overlap: self.overlap,
            delivery: self.delivery,
            tenant: self.tenant.clone(),
        };
        if matches!(self.catchup, CatchUpKind::All)
            && self.catchup_cap > crate::cron::MOST_CAUGHT_UP
        {
            return Err(invalid(
                key("catchup_cap"),
                format!(
                    "must be at most {}: a schedule keeps its newest 1000 executions",
                    crate::cron::MOST_CAUGHT_UP
                ),
            ));
        }
        schedule.validate().map_err(|e| match e {
            crate::cron::ScheduleError::Cron { .. } => invalid(key("cron"), e.to_string()),
            crate::cron::ScheduleError::UnknownZone { .. } => {
                invalid(key("timezone"), e.to_string())
            }
            crate::cron::ScheduleError::Invalid { field, .. } => invalid(key(field), e.to_string()),
        })?;
        Ok(schedule)
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Default: host name and process id.
    pub id: Option<String>,
    /// Election priority: the live node with the highest priority leads.
    pub priority: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BrokerKind {
    #[default]
    Memory,
    Kafka,
    Nats,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BrokerConfig {
    pub kind: BrokerKind,
    /// Kafka bootstrap servers.
    pub brokers: String,
    /// NATS server URL.
    pub url: String,
    /// NATS: JetStream (durable, at-least-once) or core NATS (at-most-once).
    pub jetstream: bool,
    /// Kafka: partitions and replication factor of topics weir creates.
    pub partitions: i32,
    pub replication: i32,
    /// Kafka: librdkafka properties passed through, e.g. `"session.timeout.ms" = "6000"`.
    pub options: BTreeMap<String, String>,
    /// JetStream: a delivered message unacknowledged this long (a crashed worker's) is
    /// delivered again. Graphs acknowledge their inputs through cache snapshots, so each
    /// graph's `snapshot_interval_ms` must be below it.
    pub ack_wait_ms: u64,
    /// How long topics and streams weir creates keep a message (Kafka `retention.ms`,
    /// JetStream `max_age`); 0 leaves it to the broker (Kafka: its default; JetStream:
    /// forever). Existing topics and streams keep their own setting.
    pub retention_ms: u64,
    /// NATS: user and password (also taken from the URL, `nats://user:pass@host`).
    pub user: Option<String>,
    pub password: Option<Secret>,
    /// NATS: an authentication token (also taken from the URL, `nats://token@host`).
    pub token: Option<Secret>,
    /// NATS: a file holding an NKey seed (`SU…`).
    pub nkey_seed_file: Option<PathBuf>,
    /// NATS: a `.creds` file (user JWT and NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// NATS: TLS. The CA that signed the server's certificate (default: the system's
    /// roots), a client certificate and key for servers that verify clients, and whether
    /// TLS is required even when the URL says `nats://`.
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub tls_required: bool,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        let kafka = crate::transport::kafka::KafkaSettings::default();
        let nats = crate::transport::nats::NatsSettings::default();
        Self {
            kind: BrokerKind::Memory,
            brokers: kafka.brokers,
            url: nats.url,
            jetstream: nats.jetstream,
            partitions: kafka.partitions,
            replication: kafka.replication,
            options: BTreeMap::new(),
            ack_wait_ms: ms(nats.ack_wait),
            retention_ms: defaults::RETENTION_MS,
            user: None,
            password: None,
            token: None,
            nkey_seed_file: None,
            credentials_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_required: false,
        }
    }
}

/// Every field, with the secret ones among the librdkafka options masked (the others
/// are [`Secret`]s already).
impl std::fmt::Debug for BrokerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerConfig")
            .field("kind", &self.kind)
            .field("brokers", &self.brokers)
            .field("url", &crate::secret::redact_urls(&self.url))
            .field("jetstream", &self.jetstream)
            .field("partitions", &self.partitions)
            .field("replication", &self.replication)
            .field(
                "options",
                &crate::transport::kafka::shown_options(&self.options),
            )
            .field("ack_wait_ms", &self.ack_wait_ms)
            .field("retention_ms", &self.retention_ms)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("token", &self.token)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("credentials_file", &self.credentials_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("tls_required", &self.tls_required)
            .finish()
    }
}

impl BrokerConfig {
    /// Retention of topics and streams weir creates; `None` leaves it to the broker.
    pub fn retention(&self) -> Option<Duration> {
        (self.retention_ms > 0).then(|| Duration::from_millis(self.retention_ms))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum StoreKind {
    #[default]
    Memory,
    Redis,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    pub kind: StoreKind,
    /// `redis://` or, for TLS, `rediss://`; may carry `user:password@`.
    pub url: String,
    /// First segment of every Redis key.
    pub prefix: String,
    /// An ACL user and its password (or only a password, for `requirepass`); they take
    /// precedence over those in the URL.
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// TLS (`rediss://`): the CA that signed the server's certificate (default: the
    /// system's roots), and a client certificate and key for servers that verify clients.
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreConfig")
            .field("kind", &self.kind)
            .field("url", &crate::secret::redact_url(&self.url))
            .field("prefix", &self.prefix)
            .field("username", &self.username)
            .field("password", &self.password)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .finish()
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            kind: StoreKind::Memory,
            url: defaults::REDIS_URL.into(),
            prefix: defaults::KEY_PREFIX.into(),
            username: None,
            password: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SupervisionConfig {
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub max_failures: u32,
    pub healthy_reset_ms: u64,
    pub shutdown_timeout_ms: u64,
    /// A graph runs on the node holding its lease; others take over within this TTL.
    pub graph_lease_ttl_ms: u64,
    /// How long a Failed graph stays down before it is tried again.
    pub failed_retry_ms: u64,
}

impl Default for SupervisionConfig {
    fn default() -> Self {
        let policy = SupervisionPolicy::default();
        Self {
            backoff_base_ms: ms(policy.backoff_base),
            backoff_max_ms: ms(policy.backoff_max),
            max_failures: policy.max_failures,
            healthy_reset_ms: ms(policy.healthy_reset),
            shutdown_timeout_ms: ms(policy.shutdown_timeout),
            graph_lease_ttl_ms: defaults::GRAPH_LEASE_TTL_MS,
            failed_retry_ms: ms(policy.failed_retry),
        }
    }
}

fn default_function() -> String {
    defaults::FUNCTION.into()
}
fn default_queue_capacity() -> usize {
    ReactorConfig::default().queue_capacity
}
fn default_max_in_flight() -> usize {
    ReactorConfig::default().max_in_flight
}
fn default_snapshot_interval_ms() -> u64 {
    ms(ReactorConfig::default().snapshot_interval)
}
fn default_checkpoint_interval_ms() -> u64 {
    ms(ReactorConfig::default().checkpoint_interval)
}
fn default_node_retries() -> u32 {
    ReactorConfig::default().node_retries
}
fn default_batch_size() -> usize {
    defaults::BATCH_SIZE
}
fn default_batch_interval_ms() -> u64 {
    defaults::BATCH_INTERVAL_MS
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphConfig {
    pub name: String,
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub criteria: Criteria,
    #[serde(default)]
    pub strategy: Strategy,
    #[serde(default = "default_function")]
    pub function: String,
    /// Topic or subject the function's output is published to.
    pub output: String,
    #[serde(default = "default_queue_capacity")]
    pub queue_capacity: usize,
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    #[serde(default = "default_snapshot_interval_ms")]
    pub snapshot_interval_ms: u64,
    /// Least time between the starts of an accumulator's checkpoint writes.
    #[serde(default = "default_checkpoint_interval_ms")]
    pub checkpoint_interval_ms: u64,
    /// Retries of a fire whose graph failed, before its inputs are dead-lettered.
    #[serde(default = "default_node_retries")]
    pub node_retries: u32,
    #[serde(rename = "accumulator", default)]
    pub accumulators: Vec<AccumulatorConfig>,
    /// Makes the graph keyed: a JSON pointer into each event (`/user`), or
    /// `message_key`.
    #[serde(default)]
    pub key: Option<String>,
    /// A keyed graph's partitions per source where weir makes them (NATS subjects,
    /// topics it creates).
    #[serde(default)]
    pub partitions: Option<u32>,
    /// Keys a keyed graph keeps in memory per owned partition; the least recently used leave first.
    #[serde(default)]
    pub max_keys_in_memory: Option<usize>,
    /// A keyed graph removes a key's state once its partition has applied a message this
    /// many ms newer than the key's last one; absent, every key is kept.
    #[serde(default)]
    pub key_idle_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    #[default]
    Json,
    Avro,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AccumulatorKind {
    #[default]
    Passthrough,
    Batch,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccumulatorConfig {
    pub name: String,
    /// Topic or subject to consume; without one the accumulator is push-only.
    #[serde(default)]
    pub topic: Option<String>,
    #[serde(default)]
    pub format: Format,
    /// Avro schema file (`.avsc`) of the events, for `format = "avro"`.
    #[serde(default)]
    pub schema: Option<PathBuf>,
    #[serde(default)]
    pub kind: AccumulatorKind,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    #[serde(default = "default_batch_interval_ms")]
    pub batch_interval_ms: u64,
    #[serde(default)]
    pub start: StartFrom,
    /// Dead-letter topic (default: the topic + `.dlq`).
    #[serde(default)]
    pub dead_letter: Option<String>,
}

impl Config {
    /// Reads a file and applies the process environment's overrides.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path, weir_variables(std::env::vars_os())?)
    }

    /// Parses TOML text with the given `WEIR__…` overrides.
    pub fn parse(
        text: &str,
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let value: toml::Value = toml::from_str::<toml::Table>(text)
            .map(toml::Value::Table)
            .map_err(|e| ConfigError::Syntax {
                path: path.to_path_buf(),
                message: syntax_error(text, &e),
            })?;
        let overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(var, _)| var.starts_with("WEIR__"))
            .collect();
        // An override is read as TOML (a number, a boolean, an array) unless the key it
        // sets takes text: then it is that text, as `WEIR__ADMIN__TOKEN=123456` means.
        let mut as_text = std::collections::HashSet::new();
        let config: Config = loop {
            let mut value = value.clone();
            for (i, (var, raw)) in overrides.iter().enumerate() {
                let path = &var["WEIR__".len()..];
                apply_override(&mut value, var, path, raw, as_text.contains(&i))?;
            }
            match serde_path_to_error::deserialize(value) {
                Ok(config) => break config,
                Err(e) => {
                    let key = e.path().to_string();
                    let meant_as_text = overrides.iter().enumerate().position(|(i, (var, _))| {
                        !as_text.contains(&i) && override_key(&var["WEIR__".len()..]) == key
                    });
                    if let Some(i) = meant_as_text {
                        if e.inner().to_string().contains("expected a string") {
                            as_text.insert(i);
                            continue;
                        }
                    }
                    // serde quotes the value it could not take: a secret's stays out.
                    let message = match key.strip_prefix("broker.options.") {
                        Some(option) if crate::transport::kafka::is_secret_option(option) => {
                            "must be text (the value is not shown: it is a secret)".into()
                        }
                        _ => e.into_inner().to_string(),
                    };
                    return Err(invalid(
                        if key == "." {
                            "(top level)".into()
                        } else {
                            key
                        },
                        message,
                    ));
                }
            }
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let mut errors = Vec::new();
        let registry = FunctionRegistry::default();
        let mut names = std::collections::HashSet::new();
        for (i, g) in self.graphs.iter().enumerate() {
            let key = |field: &str| format!("graph[{i}].{field}");
            if let Some(tenant) = &g.tenant {
                if let Err(e) = crate::tenant::check(tenant) {
                    errors.push(invalid(key("tenant"), e));
                }
            }
            if !names.insert((g.tenant.clone(), g.name.clone())) {
                errors.push(invalid(
                    key("name"),
                    format!("graph {} is declared twice", g.name),
                ));
            }
            if g.output.trim().is_empty() {
                errors.push(invalid(key("output"), "must name a topic or subject"));
            }
            if registry.get(&g.function).is_none() {
                let known: Vec<&str> = registry.names().collect();
                errors.push(invalid(
                    key("function"),
                    format!(
                        "unknown graph function {:?}; known: {}",
                        g.function,
                        known.join(", ")
                    ),
                ));
            }
            if g.accumulators.is_empty() {
                errors.push(invalid(
                    key("accumulator"),
                    "a graph needs at least one accumulator",
                ));
            }
            if !(1..=MOST_QUEUED).contains(&g.queue_capacity) {
                errors.push(invalid(
                    key("queue_capacity"),
                    format!("must be from 1 to {MOST_QUEUED}"),
                ));
            }
            if g.max_in_flight == 0 {
                errors.push(invalid(key("max_in_flight"), "must be at least 1"));
            }
            match &g.key {
                Some(k) if crate::graph::KeySource::parse(k).is_none() => errors.push(invalid(
                    key("key"),
                    format!(
                        "{k:?} is neither \"message_key\" nor a JSON pointer such as \"/user\""
                    ),
                )),
                Some(_) => {
                    if g.partitions == Some(0) {
                        errors.push(invalid(key("partitions"), "must be at least 1"));
                    }
                    if g.max_keys_in_memory == Some(0) {
                        errors.push(invalid(key("max_keys_in_memory"), "must be at least 1"));
                    }
                    match g.key_idle_ms {
                        Some(0) => errors.push(invalid(key("key_idle_ms"), "must be at least 1")),
                        Some(ms) if ms > MOST_MS => errors.push(invalid(
                            key("key_idle_ms"),
                            format!("must be at most {MOST_MS} (100 years)"),
                        )),
                        _ => {}
                    }
                    for (j, a) in g.accumulators.iter().enumerate() {
                        if a.topic.is_none() || a.kind != AccumulatorKind::Passthrough {
                            errors.push(invalid(
                                format!("graph[{i}].accumulator[{j}]"),
                                "a keyed graph's accumulators are passthrough ones reading a topic",
                            ));
                        }
                    }
                }
                None => {
                    for field in [
                        ("partitions", g.partitions.is_some()),
                        ("max_keys_in_memory", g.max_keys_in_memory.is_some()),
                        ("key_idle_ms", g.key_idle_ms.is_some()),
                    ] {
                        if field.1 {
                            errors.push(invalid(
                                key(field.0),
                                "applies to keyed graphs only: set key too",
                            ));
                        }
                    }
                }
            }
            for (j, a) in g.accumulators.iter().enumerate() {
                let key = |field: &str| format!("graph[{i}].accumulator[{j}].{field}");
                if a.format == Format::Avro && a.schema.is_none() {
                    errors.push(invalid(
                        key("schema"),
                        "format = \"avro\" needs the events' schema file",
                    ));
                }
                if a.kind == AccumulatorKind::Batch && a.batch_size == 0 {
                    errors.push(invalid(key("batch_size"), "must be at least 1"));
                }
                if a.topic.as_deref().is_some_and(|t| t.trim().is_empty()) {
                    errors.push(invalid(key("topic"), "must not be empty"));
                }
            }
        }
        for (i, sc) in self.schedules.iter().enumerate() {
            if let Err(e) = sc.schedule(i) {
                errors.push(e);
            }
        }
        for (i, r) in self.routes.iter().enumerate() {
            if let Err(e) = crate::dispatch::Route::new(&r.pattern, &r.executor) {
                errors.push(invalid(format!("route[{i}].pattern"), e.to_string()));
            }
        }
        for (i, w) in self.workflows.iter().enumerate() {
            if let Err(e) = w.workflow(i) {
                errors.push(e);
            }
        }
        let mut workflow_names = std::collections::HashSet::new();
        for (i, w) in self.workflows.iter().enumerate() {
            if let Some(tenant) = &w.tenant {
                if let Err(e) = crate::tenant::check(tenant) {
                    errors.push(invalid(format!("workflow[{i}].tenant"), e));
                }
            }
            if !workflow_names.insert((w.tenant.as_deref(), w.name.as_str())) {
                errors.push(invalid(
                    format!("workflow[{i}].name"),
                    format!("workflow {} is declared twice", w.name),
                ));
            }
        }
        if self.dispatch.results_topic.trim().is_empty() {
            errors.push(invalid(
                "dispatch.results_topic",
                "must name a topic or subject",
            ));
        }
        if let Err(e) = crate::dispatch::Router::new(Vec::new(), &self.dispatch.default_executor) {
            errors.push(invalid("dispatch.default_executor", e.to_string()));
        }
        let mut job_types = std::collections::HashSet::new();
        for (i, job) in self.jobs.iter().enumerate() {
            let key = |field: &str| format!("job[{i}].{field}");
            if !valid_job_type(&job.job_type) {
                errors.push(invalid(
                    key("type"),
                    format!(
                        "{:?} must be letters, digits, '_' or '-': it names the topic weir.jobs.<type>",
                        job.job_type
                    ),
                ));
            }
            if !job_types.insert(job.job_type.as_str()) {
                errors.push(invalid(
                    key("type"),
                    format!("job type {} is declared twice", job.job_type),
                ));
            }
            if job.partitions == 0 {
                errors.push(invalid(key("partitions"), "must be at least 1"));
            }
            if job.lease_ttl_ms < LEAST_LEASE_TTL_MS {
                errors.push(invalid(key("lease_ttl_ms"), LEASE_TOO_SHORT));
            }
            if job.max_jobs_in_memory == Some(0) {
                errors.push(invalid(key("max_jobs_in_memory"), "must be at least 1"));
            }
            if job.output.as_ref().is_some_and(|o| o.trim().is_empty()) {
                errors.push(invalid(key("output"), "must name a topic or subject"));
            }
        }
        if self.cron.shards == 0 {
            errors.push(invalid("cron.shards", "must be at least 1"));
        } else if self.cron.shards > MOST_SHARDS {
            errors.push(invalid(
                "cron.shards",
                format!(
                    "must be at most {MOST_SHARDS}: each shard is a lease every node \
                     keeps trying for and a due set it reads"
                ),
            ));
        }
        if self.broker.partitions < 1 {
            errors.push(invalid("broker.partitions", "must be at least 1"));
        }
        if let Some(token) = &self.admin.token {
            if let Some(problem) = token_problem(token.expose()) {
                errors.push(invalid("admin.token", problem));
            }
        }
        if self.admin.listen.is_some() && self.admin.listen == self.metrics.listen {
            errors.push(invalid(
                "metrics.listen",
                "the admin listener already serves /metrics; use another address or omit it",
            ));
        }
        if self.supervision.max_failures == 0 {
            errors.push(invalid("supervision.max_failures", "must be at least 1"));
        }
        // Durations that cannot work at zero: nothing would wait, renew or time out.
        let s = &self.supervision;
        for (key, ms) in [
            ("supervision.backoff_base_ms", s.backoff_base_ms),
            ("supervision.backoff_max_ms", s.backoff_max_ms),
            ("supervision.healthy_reset_ms", s.healthy_reset_ms),
            ("supervision.shutdown_timeout_ms", s.shutdown_timeout_ms),
            ("supervision.failed_retry_ms", s.failed_retry_ms),
            ("cron.orphan_after_ms", self.cron.orphan_after_ms),
            ("broker.ack_wait_ms", self.broker.ack_wait_ms),
        ] {
            if ms == 0 {
                errors.push(invalid(key, "must be more than 0"));
            }
        }
        // Durations beyond any use: added to the clock they would overflow it.
        let workflow_timeouts = self.workflows.iter().enumerate().flat_map(|(i, w)| {
            let tasks = w.tasks.iter().enumerate().flat_map(move |(j, t)| {
                [
                    (format!("workflow[{i}].task[{j}].timeout_ms"), t.timeout_ms),
                    (format!("workflow[{i}].task[{j}].backoff_ms"), t.backoff_ms),
                ]
            });
            let own = w
                .timeout_ms
                .map(|ms| (format!("workflow[{i}].timeout_ms"), ms));
            own.into_iter().chain(tasks)
        });
        let durations = [
            ("supervision.backoff_base_ms", s.backoff_base_ms),
            ("supervision.backoff_max_ms", s.backoff_max_ms),
            ("supervision.healthy_reset_ms", s.healthy_reset_ms),
            ("supervision.shutdown_timeout_ms", s.shutdown_timeout_ms),
            ("supervision.failed_retry_ms", s.failed_retry_ms),
            ("supervision.graph_lease_ttl_ms", s.graph_lease_ttl_ms),
            ("cron.lease_ttl_ms", self.cron.lease_ttl_ms),
            ("cron.orphan_after_ms", self.cron.orphan_after_ms),
            ("broker.ack_wait_ms", self.broker.ack_wait_ms),
            ("broker.retention_ms", self.broker.retention_ms),
        ]
        .map(|(key, ms)| (key.to_string(), ms));
        let graph_intervals = self.graphs.iter().enumerate().flat_map(|(i, g)| {
            let accumulators = g.accumulators.iter().enumerate().map(move |(j, a)| {
                let key = format!("graph[{i}].accumulator[{j}].batch_interval_ms");
                (key, a.batch_interval_ms)
            });
            [
                (
                    format!("graph[{i}].snapshot_interval_ms"),
                    g.snapshot_interval_ms,
                ),
                (
                    format!("graph[{i}].checkpoint_interval_ms"),
                    g.checkpoint_interval_ms,
                ),
            ]
            .into_iter()
            .chain(accumulators)
        });
        let job_leases = self
            .jobs
            .iter()
            .enumerate()
            .map(|(i, j)| (format!("job[{i}].lease_ttl_ms"), j.lease_ttl_ms));
        let every = durations
            .into_iter()
            .chain(workflow_timeouts)
            .chain(graph_intervals)
            .chain(job_leases);
        for (key, ms) in every {
            if ms > MOST_MS {
                errors.push(invalid(
                    key,
                    format!("must be at most {MOST_MS} (100 years)"),
                ));
            }
        }
        // A graph's inputs are acknowledged once a stored cache snapshot holds them and
        // the checkpoint after it is stored: were the two intervals together not well
        // within the ack wait, JetStream would deliver inputs a second time.
        if self.broker.kind == BrokerKind::Nats && self.broker.jetstream {
            for (i, g) in self.graphs.iter().enumerate() {
                let lag = g
                    .snapshot_interval_ms
                    .saturating_add(g.checkpoint_interval_ms);
                if lag.saturating_mul(2) > self.broker.ack_wait_ms {
                    errors.push(invalid(
                        format!("graph[{i}].snapshot_interval_ms"),
                        format!(
                            "with checkpoint_interval_ms must add up to at most half of \
                             broker.ack_wait_ms ({}): inputs are acknowledged only once a \
                             stored cache snapshot holds them",
                            self.broker.ack_wait_ms
                        ),
                    ));
                }
            }
        }
        if s.backoff_max_ms < s.backoff_base_ms {
            errors.push(invalid(
                "supervision.backoff_max_ms",
                "must be at least backoff_base_ms",
            ));
        }
        if (1..LEAST_LEASE_TTL_MS).contains(&s.graph_lease_ttl_ms) {
            errors.push(invalid(
                "supervision.graph_lease_ttl_ms",
                "must be 0 (no lease) or at least 1000: a shorter lease expires between renewals",
            ));
        }
        // Keyed graphs own their partitions through leases of this length: they have no
        // lease-free mode.
        if s.graph_lease_ttl_ms == 0 {
            if let Some(i) = self.graphs.iter().position(|g| g.key.is_some()) {
                errors.push(invalid(
                    "supervision.graph_lease_ttl_ms",
                    format!(
                        "must be at least 1000 while a graph is keyed (graph[{i}].key): \
                         keyed graphs own their partitions through leases of this length"
                    ),
                ));
            }
        }
        if self.cron.lease_ttl_ms < LEAST_LEASE_TTL_MS {
            errors.push(invalid("cron.lease_ttl_ms", LEASE_TOO_SHORT));
        }
        if self.cron.max_attempts == 0 {
            errors.push(invalid("cron.max_attempts", "must be at least 1"));
        }
        for (i, w) in self.workflows.iter().enumerate() {
            if w.timeout_ms == Some(0) {
                errors.push(invalid(
                    format!("workflow[{i}].timeout_ms"),
                    "must be more than 0 (omit it for no timeout)",
                ));
            }
            for (j, t) in w.tasks.iter().enumerate() {
                let key = |field: &str| format!("workflow[{i}].task[{j}].{field}");
                if t.timeout_ms == 0 {
                    errors.push(invalid(key("timeout_ms"), "must be more than 0"));
                }
                if t.max_attempts == 0 {
                    errors.push(invalid(key("max_attempts"), "must be at least 1"));
                }
            }
        }
        // Files that go in pairs: one without the other is a half-done TLS setup.
        for (section, cert, key) in [
            (
                "broker",
                &self.broker.tls_cert_file,
                &self.broker.tls_key_file,
            ),
            ("store", &self.store.tls_cert_file, &self.store.tls_key_file),
            ("admin", &self.admin.tls_cert_file, &self.admin.tls_key_file),
        ] {
            match (cert, key) {
                (Some(_), None) => errors.push(invalid(
                    format!("{section}.tls_key_file"),
                    "must be set with tls_cert_file",
                )),
                (None, Some(_)) => errors.push(invalid(
                    format!("{section}.tls_cert_file"),
                    "must be set with tls_key_file",
                )),
                _ => {}
            }
        }
        let mut admin_tokens: Vec<&str> = self.admin.token.iter().map(Secret::expose).collect();
        for (i, entry) in self.admin.tokens.iter().enumerate() {
            let key = |field: &str| format!("admin.tokens[{i}].{field}");
            if let Err(e) = crate::tenant::check(&entry.tenant) {
                errors.push(invalid(key("tenant"), e));
            }
            if let Some(problem) = token_problem(entry.token.expose()) {
                errors.push(invalid(key("token"), problem));
            } else if admin_tokens.contains(&entry.token.expose()) {
                errors.push(invalid(key("token"), "is already another token"));
            }
            admin_tokens.push(entry.token.expose());
        }
        if let Some(addr) = self.admin.listen {
            if !addr.ip().is_loopback()
                && admin_tokens.is_empty()
                && !self.admin.allow_unauthenticated
            {
                errors.push(invalid(
                    "admin.listen",
                    format!(
                        "{addr} is reachable from other hosts and admin.token is not set: \
                         set a token (WEIR__ADMIN__TOKEN), listen on 127.0.0.1, or set \
                         admin.allow_unauthenticated = true"
                    ),
                ));
            }
        }
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Many(errors)),
        }
    }

    /// Every task routed to `executor` has a handler in `registry`; the error names
    /// the key of each that has none.
    pub fn check_handlers(
        &self,
        executor: &str,
        tenant: Option<&str>,
        registry: &crate::worker::HandlerRegistry,
    ) -> Result<(), ConfigError> {
        let router = self.router()?;
        let mut errors = Vec::new();
        for (i, w) in self.workflows.iter().enumerate() {
            // A worker reads its own tenant's task topic only.
            if w.tenant.as_deref() != tenant {
                continue;
            }
            let workflow = w.workflow(i)?;
            for (j, t) in w.tasks.iter().enumerate() {
                if router.executor(&workflow.namespace(&t.id)) != executor
                    || registry.get(&t.handler).is_some()
                {
                    continue;
                }
                let known: Vec<&str> = registry.names().collect();
                errors.push(invalid(
                    format!("workflow[{i}].task[{j}].handler"),
                    format!(
                        "no handler registered as {:?}; known: {}",
                        t.handler,
                        known.join(", ")
                    ),
                ));
            }
        }
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Many(errors)),
        }
    }

    pub fn node_id(&self) -> String {
        self.node.id.clone().unwrap_or_else(default_node_id)
    }

    pub fn supervision_policy(&self) -> SupervisionPolicy {
        let s = &self.supervision;
        SupervisionPolicy {
            backoff_base: Duration::from_millis(s.backoff_base_ms),
            backoff_max: Duration::from_millis(s.backoff_max_ms),
            max_failures: s.max_failures,
            healthy_reset: Duration::from_millis(s.healthy_reset_ms),
            shutdown_timeout: Duration::from_millis(s.shutdown_timeout_ms),
            graph_lease_ttl: (s.graph_lease_ttl_ms > 0)
                .then(|| Duration::from_millis(s.graph_lease_ttl_ms)),
            failed_retry: Duration::from_millis(s.failed_retry_ms),
        }
    }

    /// The task router the `[[route]]` tables declare, in order.
    pub fn router(&self) -> Result<crate::dispatch::Router, ConfigError> {
        let routes = self
            .routes
            .iter()
            .enumerate()
            .map(|(i, r)| {
                crate::dispatch::Route::new(&r.pattern, &r.executor)
                    .map_err(|e| invalid(format!("route[{i}].pattern"), e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        crate::dispatch::Router::new(routes, &self.dispatch.default_executor)
            .map_err(|e| invalid("dispatch.default_executor", e.to_string()))
    }

    /// The declared workflows, validated.
    pub fn workflows(&self) -> Result<Vec<crate::dispatch::Workflow>, ConfigError> {
        self.workflows
            .iter()
            .enumerate()
            .map(|(i, w)| w.workflow(i))
            .collect()
    }

    /// The declared job types, with their handlers from `handlers`.
    pub fn job_types(
        &self,
        handlers: &crate::jobs::JobHandlers,
    ) -> Result<Vec<crate::jobs::JobType>, ConfigError> {
        let mut errors = Vec::new();
        let mut types = Vec::new();
        for (i, job) in self.jobs.iter().enumerate() {
            match job.job_type(i, handlers) {
                Ok(t) => types.push(t),
                Err(e) => errors.push(e),
            }
        }
        match errors.len() {
            0 => Ok(types),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Many(errors)),
        }
    }

    /// The declaration of one job type.
    pub fn job(&self, job_type: &str) -> Result<&JobConfig, ConfigError> {
        self.jobs
            .iter()
            .find(|j| j.job_type == job_type)
            .ok_or_else(|| {
                invalid(
                    "job",
                    format!("no [[job]] of type {job_type:?} is declared"),
                )
            })
    }

    /// Whether `weir run` runs the cron scheduler.
    pub fn cron_enabled(&self) -> bool {
        self.cron.enabled.unwrap_or(!self.schedules.is_empty())
    }

    pub fn scheduler_config(&self) -> crate::cron::scheduler::SchedulerConfig {
        crate::cron::scheduler::SchedulerConfig {
            priority: self.node.priority,
            shards: self.cron.shards,
            lease_ttl: Duration::from_millis(self.cron.lease_ttl_ms),
            orphan_after: Duration::from_millis(self.cron.orphan_after_ms),
            max_attempts: self.cron.max_attempts,
            ..crate::cron::scheduler::SchedulerConfig::new(self.node_id())
        }
    }

    /// The declared schedules, validated.
    pub fn declared_schedules(&self) -> Result<Vec<crate::cron::Schedule>, ConfigError> {
        self.schedules
            .iter()
            .enumerate()
            .map(|(i, s)| s.schedule(i))
            .collect()
    }

    /// Where the metrics and admin listeners run, if anywhere.
    pub fn listen(&self) -> crate::admin::Listen {
        crate::admin::Listen {
            metrics: self.metrics.listen,
            admin: self.admin.listen,
            admin_tls: match (&self.admin.tls_cert_file, &self.admin.tls_key_file) {
                (Some(cert), Some(key)) => Some(crate::admin::TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                }),
                _ => None,
            },
            allow_unauthenticated: self.admin.allow_unauthenticated,
        }
    }

    /// The declared graphs, compiled.
    pub fn graphs(
        &self,
        registry: &FunctionRegistry,
    ) -> Result<Vec<GraphDeclaration>, ConfigError> {
        let lease_ttl = Duration::from_millis(self.supervision.graph_lease_ttl_ms);
        self.graphs
            .iter()
            .enumerate()
            .map(|(i, g)| g.declaration(i, registry, lease_ttl))
            .collect()
    }
}

impl GraphConfig {
    fn declaration(
        &self,
        index: usize,
        registry: &FunctionRegistry,
        lease_ttl: Duration,
    ) -> Result<GraphDeclaration, ConfigError> {
        let mut builder = GraphBuilder::new(&self.name).reactor(ReactorConfig {
            criteria: self.criteria,
            strategy: self.strategy,
            queue_capacity: self.queue_capacity,
            max_in_flight: self.max_in_flight,
            snapshot_interval: Duration::from_millis(self.snapshot_interval_ms),
            checkpoint_interval: Duration::from_millis(self.checkpoint_interval_ms),
            node_retries: self.node_retries,
            ..ReactorConfig::default()
        });
        if let Some(t) = &self.tenant {
            builder = builder.tenant(t);
        }
        if let Some(key) = &self.key {
            let source = crate::graph::KeySource::parse(key).ok_or_else(|| {
                invalid(
                    format!("graph[{index}].key"),
                    format!(
                        "{key:?} is neither \"message_key\" nor a JSON pointer such as \"/user\""
                    ),
                )
            })?;
            let mut keying = crate::graph::Keying::new(source);
            keying.lease_ttl = lease_ttl;
            if let Some(partitions) = self.partitions {
                keying.partitions = partitions;
            }
            if let Some(max) = self.max_keys_in_memory {
                keying.max_keys_in_memory = max;
            }
            keying.key_idle = self.key_idle_ms.map(Duration::from_millis);
            builder = builder.keyed(keying);
        }
        for (j, a) in self.accumulators.iter().enumerate() {
            let mut spec = match a.kind {
                AccumulatorKind::Passthrough => AccumulatorSpec::passthrough(&a.name),
                AccumulatorKind::Batch => AccumulatorSpec::batch(
                    &a.name,
                    a.batch_size,
                    Duration::from_millis(a.batch_interval_ms),
                ),
            };
            if let Some(topic) = &a.topic {
                spec = spec.topic(topic).start(a.start);
            }
            if let Some(dlq) = &a.dead_letter {
                spec = spec.dead_letter(dlq);
            }
            if a.format == Format::Avro {
                let key = format!("graph[{index}].accumulator[{j}].schema");
                let path = a.schema.as_ref().ok_or_else(|| invalid(&key, "missing"))?;
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid(&key, format!("cannot read {}: {e}", path.display())))?;
                let codec =
                    AvroCodec::new("event", &text).map_err(|e| invalid(&key, e.to_string()))?;
                spec = spec.format(EventFormat::Avro(Arc::new(codec)));
            }
            builder = builder.accumulator(spec);
        }
        builder
            .function(&self.function, registry, &self.function)
            .output(&self.function, &self.output)
            .build()
            .map_err(|e| invalid(format!("graph[{index}]"), e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
[node]
id = "n1"
[broker]
kind = "kafka"
brokers = "127.0.0.1:9092"
[store]
kind = "redis"
url = "redis://127.0.0.1:6379"
[[graph]]
name = "prices"
criteria = "when_any"
strategy = "sequential"
function = "snapshot"
output = "prices.out"
[[graph.accumulator]]
name = "a"
topic = "prices.a"
format = "json"
"#;

    fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::parse(
            text,
            Path::new("weir.toml"),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn the_documented_example_parses() {
        let c = parse(SAMPLE, &[]).unwrap();
        assert_eq!(c.node.id.as_deref(), Some("n1"));
        assert_eq!(c.broker.kind, BrokerKind::Kafka);
        assert_eq!(c.store.kind, StoreKind::Redis);
        let g = &c.graphs[0];
        assert_eq!(g.strategy, Strategy::Sequential);
        assert_eq!(g.criteria, Criteria::WhenAny);
        assert_eq!(g.accumulators[0].topic.as_deref(), Some("prices.a"));
        assert_eq!(g.queue_capacity, ReactorConfig::default().queue_capacity);
        let decls = c.graphs(&FunctionRegistry::default()).unwrap();
        assert_eq!(decls[0].name, "prices");
    }

    #[test]
    fn an_override_of_a_text_key_stays_text() {
        let c = parse(
            SAMPLE,
            &[
                ("WEIR__ADMIN__TOKEN", "123456"),
                ("WEIR__NODE__ID", "7"),
                ("WEIR__GRAPH__0__OUTPUT", "true"),
                ("WEIR__SUPERVISION__MAX_FAILURES", "9"),
            ],
        )
        .unwrap();
        assert_eq!(c.admin.token.as_ref().map(Secret::expose), Some("123456"));
        assert_eq!(c.node.id.as_deref(), Some("7"));
        assert_eq!(c.graphs[0].output, "true");
        assert_eq!(c.supervision.max_failures, 9);
        let err = parse(SAMPLE, &[("WEIR__SUPERVISION__MAX_FAILURES", "many")]).unwrap_err();
        assert!(
            err.to_string().contains("supervision.max_failures"),
            "{err}"
        );
    }

    #[test]
    fn values_that_cannot_work_name_their_key() {
        let keys = [
            (
                "WEIR__SUPERVISION__BACKOFF_BASE_MS",
                "0",
                "supervision.backoff_base_ms",
            ),
            (
                "WEIR__SUPERVISION__SHUTDOWN_TIMEOUT_MS",
                "0",
                "supervision.shutdown_timeout_ms",
            ),
            (
                "WEIR__SUPERVISION__HEALTHY_RESET_MS",
                "0",
                "supervision.healthy_reset_ms",
            ),
            (
                "WEIR__SUPERVISION__FAILED_RETRY_MS",
                "0",
                "supervision.failed_retry_ms",
            ),
            (
                "WEIR__SUPERVISION__GRAPH_LEASE_TTL_MS",
                "999",
                "supervision.graph_lease_ttl_ms",
            ),
            ("WEIR__CRON__LEASE_TTL_MS", "0", "cron.lease_ttl_ms"),
            ("WEIR__CRON__LEASE_TTL_MS", "2", "cron.lease_ttl_ms"),
            ("WEIR__CRON__ORPHAN_AFTER_MS", "0", "cron.orphan_after_ms"),
            ("WEIR__CRON__MAX_ATTEMPTS", "0", "cron.max_attempts"),
            ("WEIR__BROKER__ACK_WAIT_MS", "0", "broker.ack_wait_ms"),
        ];
        for (var, value, key) in keys {
            let err = parse(SAMPLE, &[(var, value)]).unwrap_err();
            assert!(err.to_string().contains(key), "{var}={value}: {err}");
        }
        assert!(parse(SAMPLE, &[("WEIR__SUPERVISION__GRAPH_LEASE_TTL_MS", "0")]).is_ok());
        let workflow = format!(
            "{SAMPLE}[[workflow]]\nname = \"w\"\n[[workflow.task]]\nid = \"t\"\nhandler = \"builtin::echo\"\ntimeout_ms = 0\nmax_attempts = 0\n"
        );
        let err = parse(&workflow, &[]).unwrap_err().to_string();
        assert!(err.contains("workflow[0].task[0].timeout_ms"), "{err}");
        assert!(err.contains("workflow[0].task[0].max_attempts"), "{err}");
    }

    #[test]
    fn errors_never_show_a_secret() {
        let cases = [
            // A syntax error on a secret's line: toml would quote the line.
            "[store]\nkind = \"redis\"\npassword = \"hunter2\\q\"\n",
            "[admin]\ntoken = \"hunter2\"\ntoken = \"hunter2\"\n",
            // A secret that is not text: serde would quote the value.
            "[admin]\ntoken = 424242\n",
            "[broker]\nkind = \"kafka\"\n[broker.options]\n\"sasl.password\" = 424242\n",
        ];
        for text in cases {
            let err = parse(text, &[]).unwrap_err().to_string();
            assert!(
                !err.contains("hunter2") && !err.contains("424242"),
                "{text}: {err}"
            );
        }
        let err = parse(cases[0], &[]).unwrap_err().to_string();
        assert!(err.contains("line 3, column"), "says where: {err}");
        let err = parse(cases[2], &[]).unwrap_err().to_string();
        assert!(
            err.contains("admin.token") && err.contains("not text"),
            "{err}"
        );
        let err = parse(cases[3], &[]).unwrap_err().to_string();
        assert!(err.contains("sasl.password"), "{err}");
        let err = parse("[broker]\npartitions = \"six\"\n", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("six"), "other values are shown: {err}");
    }

    #[test]
    fn keyed_graphs_and_jobs_need_leases_long_enough_to_renew() {
        let keyed = SAMPLE.replacen("[[graph]]\n", "[[graph]]\nkey = \"/user\"\n", 1);
        assert_ne!(keyed, SAMPLE, "the sample declares a graph");
        let err = parse(&keyed, &[("WEIR__SUPERVISION__GRAPH_LEASE_TTL_MS", "0")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("supervision.graph_lease_ttl_ms"), "{err}");
        assert!(err.contains("graph[0].key"), "{err}");
        assert!(parse(&keyed, &[]).is_ok());
        let job = format!(
            "{SAMPLE}[[job]]\ntype = \"counter\"\nhandler = \"builtin::count\"\nlease_ttl_ms = 2\n"
        );
        let err = parse(&job, &[]).unwrap_err().to_string();
        assert!(err.contains("job[0].lease_ttl_ms"), "{err}");
        assert!(parse(&job.replace("lease_ttl_ms = 2", "lease_ttl_ms = 1000"), &[]).is_ok());
    }

    #[test]
    fn key_idle_ms_reaches_a_keyed_graph_and_no_other() {
        let keyed = |idle: &str| {
            SAMPLE.replacen(
                "[[graph]]\n",
                &format!("[[graph]]\nkey = \"/user\"\nkey_idle_ms = {idle}\n"),
                1,
            )
        };
        let config = parse(&keyed("60000"), &[]).unwrap();
        let graphs = config.graphs(&FunctionRegistry::default()).unwrap();
        let keying = graphs[0].keyed.as_ref().expect("keyed");
        assert_eq!(keying.key_idle, Some(Duration::from_secs(60)));
        for idle in ["0", "3153600000001"] {
            let err = parse(&keyed(idle), &[]).unwrap_err().to_string();
            assert!(err.contains("graph[0].key_idle_ms"), "{idle}: {err}");
        }
        let unkeyed = SAMPLE.replacen("[[graph]]\n", "[[graph]]\nkey_idle_ms = 1000\n", 1);
        let err = parse(&unkeyed, &[]).unwrap_err().to_string();
        assert!(
            err.contains("graph[0].key_idle_ms") && err.contains("keyed graphs only"),
            "{err}"
        );
        let config = parse(SAMPLE, &[]).unwrap();
        let graphs = config.graphs(&FunctionRegistry::default()).unwrap();
        assert!(graphs[0].keyed.is_none());
    }

    #[test]
    fn tasks_routed_to_a_worker_need_a_registered_handler() {
        let text = format!(
            "{SAMPLE}[[route]]\npattern = \"**::other\"\nexecutor = \"elsewhere\"\n[[workflow]]\nname = \"w\"\n[[workflow.task]]\nid = \"t\"\nhandler = \"builtin::nope\"\n[[workflow.task]]\nid = \"other\"\nhandler = \"custom\"\n"
        );
        let config = parse(&text, &[]).unwrap();
        let registry = crate::worker::HandlerRegistry::with_builtins(Arc::new(
            crate::transport::memory::MemoryBroker::default(),
        ));
        let err = config
            .check_handlers(crate::dispatch::DEFAULT_EXECUTOR, None, &registry)
            .unwrap_err()
            .to_string();
        assert!(err.contains("workflow[0].task[0].handler"), "{err}");
        assert!(err.contains("builtin::nope"), "{err}");
        assert!(!err.contains("task[1]"), "routed elsewhere: {err}");
        assert!(config.check_handlers("elsewhere", None, &registry).is_err());
    }

    #[test]
    fn a_tenants_worker_needs_the_handlers_of_its_tenants_tasks_only() {
        let text = format!(
            "{SAMPLE}[[workflow]]\nname = \"w\"\ntenant = \"acme\"\n[[workflow.task]]\nid = \"t\"\nhandler = \"acme_only\"\n[[workflow]]\nname = \"v\"\n[[workflow.task]]\nid = \"t\"\nhandler = \"builtin::echo\"\n"
        );
        let config = parse(&text, &[]).unwrap();
        let registry = crate::worker::HandlerRegistry::with_builtins(Arc::new(
            crate::transport::memory::MemoryBroker::default(),
        ));
        let executor = crate::dispatch::DEFAULT_EXECUTOR;
        assert!(config.check_handlers(executor, None, &registry).is_ok());
        let err = config
            .check_handlers(executor, Some("acme"), &registry)
            .unwrap_err()
            .to_string();
        assert!(err.contains("workflow[0].task[0].handler"), "{err}");
        assert!(config
            .check_handlers(executor, Some("globex"), &registry)
            .is_ok());
    }

    #[test]
    fn environment_overrides_any_key() {
        let c = parse(
            SAMPLE,
            &[
                ("WEIR__BROKER__KIND", "nats"),
                ("WEIR__BROKER__JETSTREAM", "false"),
                ("WEIR__STORE__URL", "redis://10.0.0.1:6380"),
                ("WEIR__GRAPH__0__OUTPUT", "elsewhere"),
                ("WEIR__GRAPH__0__ACCUMULATOR__0__TOPIC", "other.a"),
                ("WEIR__SUPERVISION__GRAPH_LEASE_TTL_MS", "3000"),
                ("UNRELATED", "x"),
            ],
        )
        .unwrap();
        assert_eq!(c.broker.kind, BrokerKind::Nats);
        assert!(!c.broker.jetstream);
        assert_eq!(c.store.url, "redis://10.0.0.1:6380");
        assert_eq!(c.graphs[0].output, "elsewhere");
        assert_eq!(
            c.graphs[0].accumulators[0].topic.as_deref(),
            Some("other.a")
        );
        assert_eq!(c.supervision.graph_lease_ttl_ms, 3000);
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let err = parse(
            &SAMPLE.replace("format = \"json\"", "formatt = \"json\""),
            &[],
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("graph[0].accumulator[0]") && text.contains("formatt"),
            "{text}"
        );

        let err = parse(SAMPLE, &[("WEIR__BROKER__NOPE", "1")]).unwrap_err();
        assert!(
            err.to_string().contains("broker") && err.to_string().contains("nope"),
            "{err}"
        );
    }

    #[test]
    fn retention_defaults_to_a_week_and_zero_leaves_it_to_the_broker() {
        let config = parse(SAMPLE, &[]).unwrap();
        assert_eq!(
            config.broker.retention(),
            Some(Duration::from_secs(7 * 24 * 3600))
        );
        let config = parse(SAMPLE, &[("WEIR__BROKER__RETENTION_MS", "60000")]).unwrap();
        assert_eq!(config.broker.retention(), Some(Duration::from_secs(60)));
        let config = parse(SAMPLE, &[("WEIR__BROKER__RETENTION_MS", "0")]).unwrap();
        assert_eq!(config.broker.retention(), None);
    }

    #[test]
    fn bad_values_are_errors_naming_the_key() {
        let err = parse(&SAMPLE.replace("\"sequential\"", "\"random\""), &[]).unwrap_err();
        assert!(err.to_string().contains("graph[0].strategy"), "{err}");
        let err = parse(SAMPLE, &[("WEIR__BROKER__PARTITIONS", "many")]).unwrap_err();
        assert!(err.to_string().contains("broker.partitions"), "{err}");
        let err = parse(&SAMPLE.replace("\"snapshot\"", "\"nope\""), &[]).unwrap_err();
        assert!(err.to_string().contains("graph[0].function"), "{err}");
    }

    #[test]
    fn numbers_past_what_can_work_are_errors_naming_the_key() {
        let text = SAMPLE.replace(
            "output = \"prices.out\"",
            "output = \"prices.out\"\nqueue_capacity = 4611686018427387904",
        );
        let text = format!(
            "{text}\n[[workflow]]\nname = \"w\"\ntimeout_ms = 9223372036854775807\n\
             [[workflow.task]]\nid = \"t\"\nhandler = \"builtin::echo\"\n"
        );
        let err = parse(
            &text,
            &[("WEIR__BROKER__ACK_WAIT_MS", "9223372036854775807")],
        )
        .unwrap_err()
        .to_string();
        for key in [
            "graph[0].queue_capacity",
            "workflow[0].timeout_ms",
            "broker.ack_wait_ms",
        ] {
            assert!(err.contains(key), "{key} missing from {err}");
        }
    }

    #[test]
    fn snapshots_spaced_past_the_jetstream_ack_wait_are_refused() {
        let text = SAMPLE
            .replace(
                "kind = \"kafka\"\nbrokers = \"127.0.0.1:9092\"",
                "kind = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\nack_wait_ms = 5000",
            )
            .replace(
                "output = \"prices.out\"",
                "output = \"prices.out\"\nsnapshot_interval_ms = 5000",
            );
        let err = parse(&text, &[]).unwrap_err().to_string();
        assert!(err.contains("graph[0].snapshot_interval_ms"), "{err}");
        assert!(err.contains("broker.ack_wait_ms (5000)"), "{err}");
        // With the checkpoint interval's default of 100 ms.
        let shorter = text.replace("snapshot_interval_ms = 5000", "snapshot_interval_ms = 2400");
        parse(&shorter, &[]).unwrap();
        let longer = text.replace("snapshot_interval_ms = 5000", "snapshot_interval_ms = 2401");
        assert!(parse(&longer, &[]).is_err());
        // Core NATS acknowledges nothing.
        let core = text.replace(
            "ack_wait_ms = 5000",
            "ack_wait_ms = 5000\njetstream = false",
        );
        parse(&core, &[]).unwrap();
    }

    #[test]
    fn several_problems_are_reported_together() {
        let text = SAMPLE
            .replace(
                "output = \"prices.out\"",
                "output = \"\"\nqueue_capacity = 0",
            )
            .replace("format = \"json\"", "format = \"avro\"");
        let err = parse(&text, &[]).unwrap_err();
        let text = err.to_string();
        for key in [
            "graph[0].output",
            "graph[0].queue_capacity",
            "graph[0].accumulator[0].schema",
        ] {
            assert!(text.contains(key), "{key} missing from {text}");
        }
    }

    #[test]
    fn routes_are_ordered_and_validated() {
        let text = format!(
            "{SAMPLE}\n[[route]]\npattern = \"acme::ml::**\"\nexecutor = \"gpu\"\n[[route]]\npattern = \"**\"\nexecutor = \"cpu\"\n"
        );
        let router = parse(&text, &[]).unwrap().router().unwrap();
        assert_eq!(router.topic("acme::ml::train::step"), "weir.tasks.gpu");
        assert_eq!(router.topic("acme::etl::x::y"), "weir.tasks.cpu");
        let bad = text.replace("acme::ml::**", "acme::ml*");
        let err = parse(&bad, &[]).unwrap_err();
        assert!(err.to_string().contains("route[0].pattern"), "{err}");
    }

    #[test]
    fn workflows_are_declared_and_validated() {
        let text = r#"
[[workflow]]
name = "etl"
[[workflow.task]]
id = "extract"
handler = "builtin::echo"
[[workflow.task]]
id = "load"
handler = "builtin::sleep"
depends_on = ["extract"]
max_attempts = 5
timeout_ms = 100
backoff_ms = 10
"#;
        let config = parse(text, &[]).unwrap();
        let w = config.workflows[0].workflow(0).unwrap();
        assert_eq!(w.task("load").unwrap().max_attempts, 5);
        assert_eq!(w.task("load").unwrap().timeout, Duration::from_millis(100));
        assert_eq!(w.namespace("load"), "public::default::etl::load");
        let err = parse(&text.replace("[\"extract\"]", "[\"nope\"]"), &[]).unwrap_err();
        assert!(
            err.to_string().contains("workflow[0]") && err.to_string().contains("nope"),
            "{err}"
        );
    }

    #[test]
    fn metrics_and_admin_listeners_are_optional_and_overridable() {
        assert_eq!(parse(SAMPLE, &[]).unwrap().listen(), Default::default());
        let c = parse(
            SAMPLE,
            &[
                ("WEIR__METRICS__LISTEN", "127.0.0.1:9898"),
                ("WEIR__ADMIN__LISTEN", "127.0.0.1:9899"),
                ("WEIR__ADMIN__TOKEN", "s3cret"),
            ],
        )
        .unwrap();
        assert_eq!(
            c.listen(),
            crate::admin::Listen {
                metrics: Some("127.0.0.1:9898".parse().unwrap()),
                admin: Some("127.0.0.1:9899".parse().unwrap()),
                ..Default::default()
            }
        );
        assert_eq!(c.admin.token.as_ref().map(Secret::expose), Some("s3cret"));
        let err = parse(SAMPLE, &[("WEIR__ADMIN__LISTEN", "localhost")]).unwrap_err();
        assert!(err.to_string().contains("admin.listen"), "{err}");
        let err = parse("[admin]\ntoken = \"\"", &[]).unwrap_err();
        assert!(err.to_string().contains("admin.token"), "{err}");
        // A token no request header can carry would lock every client out.
        for token in ["s3cret\\n", " s3cret", "s3cret ", "sécret"] {
            let toml = format!("[admin]\ntoken = \"{token}\"");
            let err = parse(&toml, &[]).unwrap_err().to_string();
            assert!(err.contains("admin.token"), "{token:?}: {err}");
            assert!(!err.contains("s3cret") && !err.contains("sécret"), "{err}");
            let toml = format!("[[admin.tokens]]\ntenant = \"acme\"\ntoken = \"{token}\"");
            let err = parse(&toml, &[]).unwrap_err().to_string();
            assert!(err.contains("admin.tokens[0].token"), "{token:?}: {err}");
        }
        assert!(parse("[admin]\ntoken = \"s3 cr~t\"", &[]).is_ok());
        let many =
            "[[schedule]]\nid = \"s\"\ncron = \"* * * * *\"\ncatchup = \"all\"\ncatchup_cap = 501";
        let err = parse(many, &[]).unwrap_err();
        assert!(err.to_string().contains("schedule[0].catchup_cap"), "{err}");
        let err = parse("[cron]\nshards = 5000", &[]).unwrap_err();
        assert!(err.to_string().contains("cron.shards"), "{err}");
        assert!(parse("[cron]\nshards = 1024", &[]).is_ok());
        let same = "[admin]\nlisten = \"127.0.0.1:9\"\n[metrics]\nlisten = \"127.0.0.1:9\"";
        let err = parse(same, &[]).unwrap_err();
        assert!(err.to_string().contains("metrics.listen"), "{err}");
    }

    #[test]
    fn syntax_errors_name_the_file() {
        let err = parse("[node\nid = 1", &[]).unwrap_err();
        assert!(err.to_string().contains("weir.toml"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn only_weir_variables_are_read_and_theirs_must_be_utf8() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let not_utf8 = || OsString::from_vec(vec![0x66, 0xff, 0x6f]);
        let env = vec![
            (not_utf8(), OsString::from("x")),
            (OsString::from("LANG"), not_utf8()),
            (OsString::from("WEIR__NODE__ID"), OsString::from("n1")),
        ];
        assert_eq!(
            weir_variables(env).unwrap(),
            vec![("WEIR__NODE__ID".to_string(), "n1".to_string())]
        );
        let env = vec![(OsString::from("WEIR__NODE__ID"), not_utf8())];
        let err = weir_variables(env).unwrap_err().to_string();
        assert!(
            err.contains("WEIR__NODE__ID") && err.contains("UTF-8"),
            "{err}"
        );
    }

    #[test]
    fn an_empty_file_means_all_defaults() {
        let c = parse("", &[]).unwrap();
        assert_eq!(c.broker.kind, BrokerKind::Memory);
        assert_eq!(c.store.kind, StoreKind::Memory);
        assert!(c.graphs.is_empty());
        assert_eq!(
            c.supervision_policy(),
            SupervisionPolicy {
                graph_lease_ttl: Some(Duration::from_millis(defaults::GRAPH_LEASE_TTL_MS)),
                ..SupervisionPolicy::default()
            }
        );
    }

    #[test]
    fn secrets_never_show_in_a_printed_config() {
        let text = r#"
[broker]
kind = "kafka"
url = "nats://alice:url-pw-1@127.0.0.1:4222"
password = "nats-pw-2"
token = "nats-token-3"
[broker.options]
"sasl.password" = "kafka-pw-4"
"sasl.username" = "alice"
[store]
kind = "redis"
url = "redis://weir:redis-url-pw-5@127.0.0.1:6379"
password = "redis-pw-6"
[admin]
token = "admin-token-7"
[[admin.tokens]]
token = "tenant-token-8"
tenant = "acme"
"#;
        let env = [(
            "WEIR__BROKER__OPTIONS__SSL.KEY.PASSWORD".to_string(),
            "123456789".to_string(),
        )];
        let config = Config::parse(text, Path::new("t.toml"), env).unwrap();
        assert_eq!(
            config.broker.options["ssl.key.password"], "123456789",
            "an option set from the environment stays text"
        );
        let shown = format!("{config:?}");
        for secret in [
            "url-pw-1",
            "nats-pw-2",
            "nats-token-3",
            "kafka-pw-4",
            "redis-url-pw-5",
            "redis-pw-6",
            "admin-token-7",
            "tenant-token-8",
            "123456789",
        ] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        assert!(shown.contains("alice"), "names stay: {shown}");
    }
}

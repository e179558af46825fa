//! Redis store. Values are JSON; leases are a key holding `holder|token` with a TTL,
//! the token coming from a per-lease counter that only grows (the fencing token).
//! Keys start with the configured prefix (`weir` by default).

mod batched;
mod cache;
mod checkpoint;
mod jobs;
mod keyed;
mod lease;
mod membership;
mod recovery;
mod schedule;
mod workflow;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, IntoConnectionInfo, Script};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{
    Backend, CacheStore, Checkpoint, CheckpointStore, Execution, Fence, FireNumbers, JobRecord,
    JobStore, KeyedChanges, KeyedStore, Lease, LeaseStore, MembershipStore, PartitionChanges,
    PartitionSnapshot, RecoveryEvent, RecoveryLog, ScheduleChanges, ScheduleStore, StoreError,
    WorkflowStore,
};
use crate::cron::{
    ExecutionList, HeldBack, Schedule, ScheduleList, UnreadableExecution, UnreadableSchedule,
};
use crate::dispatch::{RunStatus, WorkflowExecution};
use crate::reactor::CacheSnapshot;
use crate::secret::{redact_url, scrub, Secret};
use crate::store_error::BoxError;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct RedisStore {
    client: redis::Client,
    connection: ConnectionManager,
    prefix: String,
    url: String,
    /// Creations and compare-and-set updates of workflow executions, several to a
    /// script call.
    workflow_creates: std::sync::Arc<batched::BatchedScript>,
    workflow_updates: std::sync::Arc<batched::BatchedScript>,
}

// Lua scripts are built once: building one computes the SHA-1 it is invoked by.

/// Writes of a lease holder (a graph's checkpoints and snapshots, a shard master's
/// execution records, a job or keyed graph partition's batch), made only while no newer
/// holder has the lease. The token counters must never be evicted (no `allkeys-*`
/// eviction policy): a counter that started again would fence the new holder.
/// KEYS: the lease's token counter. ARGV: the writer's token, then operations, each
/// `SET key value`, `ZADD key score member`, `ZMAX key score member` (a member's score
/// only moving up), `ZREM key member`, `DEL key`,
/// `HSET key field value`, `HDEL key field` or `EXECUTION key record index member since` (a cron
/// execution's record and its place in the open index, `since` '' to leave it; written
/// only over a stored record whose status is neither `completed` nor `failed`).
static FENCED_WRITES: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local newest = tonumber(redis.call('GET', KEYS[1]) or '0')
if newest > tonumber(ARGV[1]) then
  return 0
end
local i = 2
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'SET' then
    redis.call('SET', ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'ZADD' then
    redis.call('ZADD', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
    i = i + 4
  elseif op == 'ZMAX' then
    local was = redis.call('ZSCORE', ARGV[i + 1], ARGV[i + 3])
    if not was or tonumber(was) < tonumber(ARGV[i + 2]) then
      redis.call('ZADD', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
    end
    i = i + 4
  elseif op == 'DEL' then
    redis.call('DEL', ARGV[i + 1])
    i = i + 2
  elseif op == 'HSET' then
    redis.call('HSET', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
    i = i + 4
  elseif op == 'HDEL' then
    redis.call('HDEL', ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'ZREM' then
    redis.call('ZREM', ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'EXECUTION' then
    local stored = redis.call('GET', ARGV[i + 1])
    local ok, record = pcall(cjson.decode, stored or 'null')
    local finished = ok and type(record) == 'table'
      and (record.status == 'completed' or record.status == 'failed')
    if stored and not finished then
      redis.call('SET', ARGV[i + 1], ARGV[i + 2])
      if ARGV[i + 5] == '' then
        redis.call('ZREM', ARGV[i + 3], ARGV[i + 4])
      else
        redis.call('ZADD', ARGV[i + 3], ARGV[i + 5], ARGV[i + 4])
      end
    end
    i = i + 6
  else
    return redis.error_reply('unknown write ' .. tostring(op))
  end
end
return 1
"#,
    )
});

/// One write of a batch: `SET key value`, `ZADD key score member`, a score that only
/// moves up, `ZREM key member`, `DEL key`, `HSET key field value`, `HDEL key field`, or a cron execution's record with its place in
/// the open index (`open_since`, or out of it). Under a fence (a shard master's write)
/// it only updates a stored record that has not finished: the state manager may have
/// recorded the tick's workflow's outcome first, and a record gone from its schedule's
/// history (trimmed as later ones were claimed) stays gone.
enum Write {
    Set(String, String),
    Zadd(String, i64, String),
    /// A member's score that only moves up.
    Zmax(String, i64, String),
    Zrem(String, String),
    Del(String),
    Hset(String, String, String),
    Hdel(String, String),
    Execution {
        key: String,
        record: String,
        index: String,
        member: String,
        open_since: Option<i64>,
    },
}

fn store_error(operation: &'static str, e: redis::RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped() {
        return StoreError::Unreachable {
            what: format!("redis {operation}"),
            source: e.into(),
        };
    }
    if holds_what_cannot_be_read(&e) {
        return StoreError::Corrupt {
            key: format!("a key {operation} reads or writes"),
            source: e.into(),
        };
    }
    // A Redis Cluster node refuses a call whose keys hash to several slots, and weir's
    // calls keep a record's keys together only on a single server: the same refusal
    // every time, until the store's URL names one.
    if e.kind() == redis::ErrorKind::CrossSlot {
        return StoreError::Operation {
            operation,
            source: Box::new(NeedsOneServer { refusal: e }),
            retryable: false,
        };
    }
    StoreError::Operation {
        operation,
        source: e.into(),
        retryable: true,
    }
}

/// A Redis Cluster node's refusal of keys over several slots, with what weir needs.
#[derive(Debug, thiserror::Error)]
#[error("weir's store needs a single Redis server or a primary with replicas, not a Redis Cluster")]
struct NeedsOneServer {
    #[source]
    refusal: redis::RedisError,
}

/// Whether Redis answered that what the keys of a call hold is not what this version
/// reads there: a key of another type (another program sharing the prefix), or a reply
/// that does not convert (bytes that are not text). The same every time, so callers
/// reading many records pass over it as over one that does not parse. Every other
/// refusal (a server loading its data, a failover under way, a script running, memory
/// full, a command an ACL denies, which an operator can put right while weir waits) is
/// tried again.
fn holds_what_cannot_be_read(e: &redis::RedisError) -> bool {
    match e.kind() {
        redis::ErrorKind::TypeError => true,
        redis::ErrorKind::ExtensionError => e.code() == Some("WRONGTYPE"),
        // Before Redis 7 an error inside a script comes back as the script's own ("ERR
        // Error running script …: WRONGTYPE …"), not under the command's code.
        redis::ErrorKind::ResponseError => e
            .detail()
            .is_some_and(|detail| detail.contains(WRONGTYPE_IN_SCRIPT)),
        _ => false,
    }
}

/// What Redis says of a key of another type, as a script's error quotes it.
const WRONGTYPE_IN_SCRIPT: &str = "WRONGTYPE Operation against a key holding the wrong kind";

/// Where Redis is and how to prove who we are to it.
#[derive(Clone, Default)]
pub struct RedisSettings {
    /// `redis://` or `rediss://` (TLS), possibly with `user:password@`.
    pub url: String,
    /// Take precedence over the URL's.
    pub username: Option<String>,
    pub password: Option<Secret>,
    /// PEM files: the CA to trust instead of the system's roots, and a client
    /// certificate with its key for servers that verify clients.
    pub tls_ca_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSettings")
            .field("url", &redact_url(&self.url))
            .field("username", &self.username)
            .field("password", &self.password)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .finish()
    }
}

impl RedisSettings {
    fn client(&self) -> Result<redis::Client, String> {
        let (_, in_url) = crate::secret::split_credentials(&self.url);
        let secrets: Vec<Secret> = self
            .password
            .iter()
            .cloned()
            .chain(in_url.password)
            .collect();
        let scrubbed =
            |e: &dyn std::fmt::Display| scrub(&e.to_string(), &secrets.iter().collect::<Vec<_>>());
        let mut info = self
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| format!("invalid URL: {}", scrubbed(&e)))?;
        if let Some(username) = &self.username {
            info.redis.username = Some(username.clone());
        }
        if let Some(password) = &self.password {
            info.redis.password = Some(password.expose().to_string());
        }
        let read = |key: &str, path: &PathBuf| {
            std::fs::read(path).map_err(|e| format!("cannot read {key} {}: {e}", path.display()))
        };
        let root_cert = match &self.tls_ca_file {
            Some(path) => Some(read("tls_ca_file", path)?),
            None => None,
        };
        let client_tls = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read("tls_cert_file", cert)?,
                client_key: read("tls_key_file", key)?,
            }),
            (None, None) => None,
            _ => return Err("tls_cert_file and tls_key_file go together".into()),
        };
        if root_cert.is_none() && client_tls.is_none() {
            return redis::Client::open(info).map_err(|e| scrubbed(&e));
        }
        if !matches!(info.addr, redis::ConnectionAddr::TcpTls { .. }) {
            return Err("TLS files are set but the URL is not rediss://".into());
        }
        redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls,
                root_cert,
            },
        )
        .map_err(|e| format!("TLS setup: {}", scrubbed(&e)))
    }
}

impl RedisStore {
    /// Connects to a URL with no more settings than it carries itself.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let settings = RedisSettings {
            url: url.to_string(),
            ..RedisSettings::default()
        };
        Self::connect_with(&settings, prefix).await
    }

    /// Connects (failing fast when Redis is down or refuses the credentials); reconnects
    /// by itself afterwards.
    pub async fn connect_with(settings: &RedisSettings, prefix: &str) -> Result<Self, StoreError> {
        let url = redact_url(&settings.url);
        let client = settings.client().map_err(|reason| StoreError::Settings {
            store: format!("redis {url}"),
            source: reason.into(),
        })?;
        let unreachable = |source: BoxError| StoreError::Unreachable {
            what: format!("redis {url}"),
            source,
        };
        // Fail fast on start; the manager below retries with backoff, which is right for
        // a blip later on but would make a wrong URL hang at start.
        tokio::time::timeout(CONNECT_TIMEOUT, client.get_multiplexed_async_connection())
            .await
            .map_err(|_| unreachable("connection timed out".into()))?
            .map_err(|e| unreachable(e.into()))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(CONNECT_TIMEOUT)
            .set_number_of_retries(3)
            .set_max_delay(500);
        let pubsub_client = client.clone();
        let connection = tokio::time::timeout(
            2 * CONNECT_TIMEOUT,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| unreachable("connection timed out".into()))?
        .map_err(|e| unreachable(e.into()))?;
        let (workflow_creates, workflow_updates) = workflow::batched_scripts();
        Ok(Self {
            client: pubsub_client,
            connection,
            prefix: prefix.to_string(),
            url,
            workflow_creates,
            workflow_updates,
        })
    }

    /// The server's URL, without its password.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Runs `writes` in one round trip: fenced, as one script refused whole once a
    /// newer token of the fence's lease exists; else as a pipeline.
    async fn apply_writes(
        &self,
        operation: &'static str,
        writes: Vec<Write>,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        let Some(fence) = fence else {
            let mut pipe = redis::pipe();
            for w in writes {
                match w {
                    Write::Set(key, value) => pipe.set(key, value).ignore(),
                    Write::Zadd(key, score, member) => pipe.zadd(key, member, score).ignore(),
                    // ZADD GT (Redis 6.2 or later); the fenced script needs no such
                    // version.
                    Write::Zmax(key, score, member) => pipe
                        .cmd("ZADD")
                        .arg(key)
                        .arg("GT")
                        .arg(score)
                        .arg(member)
                        .ignore(),
                    Write::Zrem(key, member) => pipe.zrem(key, member).ignore(),
                    Write::Del(key) => pipe.del(key).ignore(),
                    Write::Hset(key, field, value) => pipe.hset(key, field, value).ignore(),
                    Write::Hdel(key, field) => pipe.hdel(key, field).ignore(),
                    Write::Execution {
                        key,
                        record,
                        index,
                        member,
                        open_since,
                    } => {
                        pipe.set(key, record).ignore();
                        match open_since {
                            Some(since) => pipe.zadd(index, member, since).ignore(),
                            None => pipe.zrem(index, member).ignore(),
                        }
                    }
                };
            }
            return pipe
                .query_async::<()>(&mut c)
                .await
                .map_err(|e| store_error(operation, e));
        };
        let mut script = FENCED_WRITES.key(self.key(&["fence", &fence.lease]));
        script.arg(fence.token);
        for w in writes {
            match w {
                Write::Set(key, value) => script.arg("SET").arg(key).arg(value),
                Write::Zadd(key, score, member) => {
                    script.arg("ZADD").arg(key).arg(score).arg(member)
                }
                Write::Zmax(key, score, member) => {
                    script.arg("ZMAX").arg(key).arg(score).arg(member)
                }
                Write::Zrem(key, member) => script.arg("ZREM").arg(key).arg(member),
                Write::Del(key) => script.arg("DEL").arg(key),
                Write::Hset(key, field, value) => script.arg("HSET").arg(key).arg(field).arg(value),
                Write::Hdel(key, field) => script.arg("HDEL").arg(key).arg(field),
                Write::Execution {
                    key,
                    record,
                    index,
                    member,
                    open_since,
                } => script
                    .arg("EXECUTION")
                    .arg(key)
                    .arg(record)
                    .arg(index)
                    .arg(member)
                    .arg(
                        open_since
                            .map(|since| since.to_string())
                            .unwrap_or_default(),
                    ),
            };
        }
        let written: i64 = script
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error(operation, e))?;
        if written == 1 {
            Ok(())
        } else {
            Err(StoreError::Fenced {
                lease: fence.lease.clone(),
                token: fence.token,
            })
        }
    }

    fn key(&self, parts: &[&str]) -> String {
        let mut key = self.prefix.clone();
        for p in parts {
            key.push(':');
            key.push_str(p);
        }
        key
    }

    async fn get_json<T: DeserializeOwned>(&self, key: String) -> Result<Option<T>, StoreError> {
        let mut c = self.connection.clone();
        let raw: Option<String> = c.get(&key).await.map_err(|e| store_error("GET", e))?;
        raw.map(|text| {
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                key,
                source: e.into(),
            })
        })
        .transpose()
    }

    async fn set_json<T: Serialize>(&self, key: String, value: &T) -> Result<(), StoreError> {
        let text = serde_json::to_string(value).map_err(|e| StoreError::Operation {
            operation: "encode",
            source: e.into(),
            retryable: false,
        })?;
        let mut c = self.connection.clone();
        c.set::<_, _, ()>(key, text)
            .await
            .map_err(|e| store_error("SET", e))
    }

    /// [`Self::set_json`], refused once the fence's lease has a newer token.
    async fn set_fenced_json<T: Serialize>(
        &self,
        key: String,
        value: &T,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        match fence {
            None => self.set_json(key, value).await,
            Some(_) => {
                let write = Write::Set(key, Self::encode(value)?);
                self.apply_writes("fenced SET", vec![write], fence).await
            }
        }
    }

    fn encode<T: Serialize>(value: &T) -> Result<String, StoreError> {
        serde_json::to_string(value).map_err(|e| StoreError::Operation {
            operation: "encode",
            source: e.into(),
            retryable: false,
        })
    }
}

#[async_trait]
impl Backend for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .map(|_| ())
            .map_err(|e| match store_error("PING", e) {
                // Readiness shows this: it names the server (without credentials).
                StoreError::Unreachable { source, .. } => StoreError::Unreachable {
                    what: format!("redis {} PING", self.url),
                    source,
                },
                other => other,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_says(code: &str, detail: &str) -> redis::RedisError {
        redis::make_extension_error(code.into(), Some(detail.into()))
    }

    #[test]
    fn a_value_of_another_type_is_corrupt_and_not_retried() {
        let wrong_type = server_says(
            "WRONGTYPE",
            "Operation against a key holding the wrong kind of value",
        );
        let e = store_error("HMGET", wrong_type);
        assert_eq!(e.kind(), crate::store_error::StoreErrorKind::Corrupt, "{e}");
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("HMGET"), "{e}");
        let not_text = redis::RedisError::from((
            redis::ErrorKind::TypeError,
            "Response was of incompatible type",
        ));
        assert!(!store_error("GET", not_text).is_retryable());
    }

    #[test]
    fn a_value_of_another_type_met_by_a_script_on_redis_6_is_corrupt() {
        let in_script = redis::RedisError::from((
            redis::ErrorKind::ResponseError,
            "An error was signalled by the server",
            "Error running script (call to f_3f9a): @user_script:4: WRONGTYPE Operation \
             against a key holding the wrong kind of value"
                .to_string(),
        ));
        let e = store_error("EVALSHA", in_script);
        assert_eq!(e.kind(), crate::store_error::StoreErrorKind::Corrupt, "{e}");
        assert!(!e.is_retryable());
        // Another error of a script is not.
        let other = redis::RedisError::from((
            redis::ErrorKind::ResponseError,
            "An error was signalled by the server",
            "Error running script (call to f_3f9a): @user_script:4: some other failure".to_string(),
        ));
        assert!(store_error("EVALSHA", other).is_retryable());
    }

    #[test]
    fn keys_over_several_slots_of_a_redis_cluster_are_refused_for_good_naming_the_cause() {
        let cross_slot = redis::RedisError::from((
            redis::ErrorKind::CrossSlot,
            "An error was signalled by the server",
            "Keys in request don't hash to the same slot".to_string(),
        ));
        let e = store_error("EVALSHA", cross_slot);
        assert_eq!(e.kind(), crate::store_error::StoreErrorKind::Operation);
        assert!(!e.is_retryable());
        let cause = std::error::Error::source(&e).map(ToString::to_string);
        assert!(
            cause
                .as_deref()
                .is_some_and(|c| c.contains("Redis Cluster")),
            "{cause:?}"
        );
        // The server's own words stay in the chain.
        let refusal = std::error::Error::source(&e)
            .and_then(std::error::Error::source)
            .map(ToString::to_string);
        assert!(
            refusal.as_deref().is_some_and(|r| r.contains("same slot")),
            "{refusal:?}"
        );
    }

    #[test]
    fn a_refusal_that_may_pass_is_retried() {
        for e in [
            server_says("OOM", "command not allowed when used memory > 'maxmemory'"),
            server_says("BUSY", "Redis is busy running a script"),
            server_says(
                "NOPERM",
                "this user has no permissions to run the 'evalsha' command",
            ),
            redis::RedisError::from((redis::ErrorKind::BusyLoadingError, "loading")),
            redis::RedisError::from((redis::ErrorKind::ReadOnly, "replica")),
            redis::RedisError::from((redis::ErrorKind::ResponseError, "max clients reached")),
        ] {
            let e = store_error("SET", e);
            assert_eq!(e.kind(), crate::store_error::StoreErrorKind::Operation);
            assert!(e.is_retryable(), "{e}");
        }
    }
}

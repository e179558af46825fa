//! Redis store. Values are JSON; leases are a key holding `holder|token` with a TTL,
//! the token coming from a per-lease counter that only grows (the fencing token).
//! Keys start with the configured prefix (`weir` by default).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, IntoConnectionInfo, Script};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{
    Checkpoint, Execution, Fence, Lease, RecoveryEvent, ScheduleChanges, Store, StoreError,
};
use crate::cron::Schedule;
use crate::dispatch::{RunStatus, WorkflowExecution};
use crate::reactor::CacheSnapshot;
use crate::secret::{redact_url, scrub, Secret};

/// Execution records kept per schedule.
const EXECUTIONS_KEPT: isize = 1000;

/// An open-index member is `schedule@scheduled_ms`; the schedule id may itself hold
/// an `@`, the time never does.
fn open_member_prefix(schedule_id: &str) -> String {
    format!("{schedule_id}@")
}

/// Recovery events kept per graph and in the global list.
const RECOVERY_EVENTS_KEPT: isize = 10_000;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct RedisStore {
    client: redis::Client,
    connection: ConnectionManager,
    prefix: String,
    url: String,
}

// Lua scripts are built once: building one computes the SHA-1 it is invoked by.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local current = redis.call('GET', KEYS[1])
if current then
  local sep = string.find(current, '|', 1, true)
  local holder = string.sub(current, 1, sep - 1)
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(string.sub(current, sep + 1))
  end
  return false
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return token
"#,
    )
});

static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"#,
    )
});

static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"#,
    )
});

/// Writes of a lease holder (a graph's checkpoints and snapshots, a shard master's
/// execution records), made only while no newer holder has the lease.
/// KEYS: the lease's token counter. ARGV: the writer's token, then operations, each
/// `SET key value`, `ZADD key score member` or `ZREM key member`.
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
  else
    redis.call('ZREM', ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  end
end
return 1
"#,
    )
});

/// Prefix of the execution hash fields recording a task's ready event as published.
const PUBLISHED_FIELD: &str = "published:";

/// Finished workflow executions are kept this long, then expire.
const FINISHED_WORKFLOW_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// Claims an execution (SET NX), adds it to its schedule's history and, while
/// unfinished, to the open index; an execution that falls out of the history is deleted
/// with its index entry, so records do not outlive the history that lists them.
/// Refused (-1) when a fence token is given and a newer one exists.
/// KEYS: record, history, open index, lease token counter. ARGV: record JSON, scheduled
/// ms, executions kept, record key prefix, index member prefix, index score ('' when
/// finished), fence token ('' for none).
static CLAIM_EXECUTION: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if ARGV[7] ~= '' and tonumber(redis.call('GET', KEYS[4]) or '0') > tonumber(ARGV[7]) then
  return -1
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then
  return 0
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[5] .. ARGV[2])
end
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess > 0 then
  local dropped = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #dropped, 2 do
    redis.call('DEL', ARGV[4] .. dropped[i])
    redis.call('ZREM', KEYS[3], ARGV[5] .. dropped[i])
  end
end
return 1
"#,
    )
});

static UPDATE_WORKFLOW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'v') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'data', ARGV[3])
if tonumber(ARGV[4]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"#,
    )
});

/// One write of a batch: `SET key value`, `ZADD key score member`, `ZREM key member`.
enum Write {
    Set(String, String),
    Zadd(String, i64, String),
    Zrem(String, String),
}

fn store_error(operation: &'static str, e: redis::RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped() {
        StoreError::Unreachable(format!("redis {operation}: {e}"))
    } else {
        StoreError::Operation {
            operation,
            reason: e.to_string(),
        }
    }
}

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
        let client = settings.client().map_err(|reason| StoreError::Operation {
            operation: "open",
            reason: format!("redis {url}: {reason}"),
        })?;
        let unreachable =
            |reason: String| StoreError::Unreachable(format!("redis {url}: {reason}"));
        // Fail fast on start; the manager below retries with backoff, which is right for
        // a blip later on but would make a wrong URL hang at start.
        tokio::time::timeout(CONNECT_TIMEOUT, client.get_multiplexed_async_connection())
            .await
            .map_err(|_| unreachable("connection timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
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
        .map_err(|e| unreachable(e.to_string()))?;
        Ok(Self {
            client: pubsub_client,
            connection,
            prefix: prefix.to_string(),
            url,
        })
    }

    /// The server's URL, without its password.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn execution_key(&self, schedule_id: &str, scheduled_ms: i64) -> String {
        self.key(&["exec", schedule_id, &scheduled_ms.to_string()])
    }

    /// Sorted set of unfinished executions, scored by [`Execution::open_since`].
    fn open_index(&self) -> String {
        self.key(&["exec", "open"])
    }

    /// Writing an execution record, with the open index kept in step with its status.
    fn execution_writes(&self, execution: &Execution) -> Result<Vec<Write>, StoreError> {
        let member = format!(
            "{}{}",
            open_member_prefix(&execution.schedule_id),
            execution.scheduled_ms
        );
        let record = Write::Set(
            self.execution_key(&execution.schedule_id, execution.scheduled_ms),
            Self::encode(execution)?,
        );
        let index = match execution.open_since() {
            Some(since) => Write::Zadd(self.open_index(), since, member),
            None => Write::Zrem(self.open_index(), member),
        };
        Ok(vec![record, index])
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
                    Write::Zrem(key, member) => pipe.zrem(key, member).ignore(),
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
                Write::Zrem(key, member) => script.arg("ZREM").arg(key).arg(member),
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
                reason: e.to_string(),
            })
        })
        .transpose()
    }

    async fn set_json<T: Serialize>(&self, key: String, value: &T) -> Result<(), StoreError> {
        let text = serde_json::to_string(value).map_err(|e| StoreError::Operation {
            operation: "encode",
            reason: e.to_string(),
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

    fn changes_channel(&self) -> String {
        self.key(&["sched", "changed"])
    }

    fn encode<T: Serialize>(value: &T) -> Result<String, StoreError> {
        serde_json::to_string(value).map_err(|e| StoreError::Operation {
            operation: "encode",
            reason: e.to_string(),
        })
    }

    fn lease_value(lease: &Lease) -> String {
        format!("{}|{}", lease.holder, lease.token)
    }
}

#[async_trait]
impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    async fn load_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
    ) -> Result<Option<Checkpoint>, StoreError> {
        self.get_json(self.key(&["ckpt", graph, accumulator])).await
    }

    async fn save_checkpoint(
        &self,
        graph: &str,
        accumulator: &str,
        checkpoint: &Checkpoint,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        self.set_fenced_json(self.key(&["ckpt", graph, accumulator]), checkpoint, fence)
            .await
    }

    async fn load_cache(&self, graph: &str) -> Result<Option<CacheSnapshot>, StoreError> {
        self.get_json(self.key(&["cache", graph])).await
    }

    async fn save_cache(
        &self,
        graph: &str,
        snapshot: &CacheSnapshot,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        self.set_fenced_json(self.key(&["cache", graph]), snapshot, fence)
            .await
    }

    async fn record_recovery(&self, event: &RecoveryEvent) -> Result<(), StoreError> {
        let text = serde_json::to_string(event).map_err(|e| StoreError::Operation {
            operation: "encode",
            reason: e.to_string(),
        })?;
        let per_graph = self.key(&["recovery", &event.graph]);
        let all = self.key(&["recovery"]);
        let mut c = self.connection.clone();
        redis::pipe()
            .atomic()
            .lpush(&per_graph, &text)
            .ltrim(&per_graph, 0, RECOVERY_EVENTS_KEPT - 1)
            .lpush(&all, &text)
            .ltrim(&all, 0, RECOVERY_EVENTS_KEPT - 1)
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("LPUSH", e))
    }

    async fn recovery_events(
        &self,
        graph: Option<&str>,
        limit: usize,
    ) -> Result<Vec<RecoveryEvent>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let key = match graph {
            Some(g) => self.key(&["recovery", g]),
            None => self.key(&["recovery"]),
        };
        let mut c = self.connection.clone();
        let raw: Vec<String> = c
            .lrange(&key, 0, limit as isize - 1)
            .await
            .map_err(|e| store_error("LRANGE", e))?;
        raw.into_iter()
            .map(|text| {
                serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                    key: key.clone(),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let mut c = self.connection.clone();
        let token: Option<u64> = ACQUIRE
            .key(self.key(&["lease", name]))
            .key(self.key(&["fence", name]))
            .arg(holder)
            .arg(ttl.as_millis().max(1) as u64)
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("acquire lease", e))?;
        Ok(token.map(|token| Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            token,
        }))
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let renewed: i64 = RENEW
            .key(self.key(&["lease", &lease.name]))
            .arg(Self::lease_value(lease))
            .arg(ttl.as_millis().max(1) as u64)
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("renew lease", e))?;
        Ok(renewed == 1)
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let released: i64 = RELEASE
            .key(self.key(&["lease", &lease.name]))
            .arg(Self::lease_value(lease))
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("release lease", e))?;
        Ok(released == 1)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .map(|_| ())
            .map_err(|e| store_error("PING", e))
    }

    async fn put_schedule(&self, schedule: &Schedule) -> Result<(), StoreError> {
        let text = Self::encode(schedule)?;
        let mut c = self.connection.clone();
        redis::pipe()
            .atomic()
            .set(self.key(&["sched", &schedule.id]), text)
            .sadd(self.key(&["sched", "ids"]), &schedule.id)
            .publish(self.changes_channel(), &schedule.id)
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("put schedule", e))
    }

    async fn get_schedule(&self, id: &str) -> Result<Option<Schedule>, StoreError> {
        self.get_json(self.key(&["sched", id])).await
    }

    async fn list_schedules(&self) -> Result<Vec<Schedule>, StoreError> {
        let mut c = self.connection.clone();
        let ids: Vec<String> = c
            .smembers(self.key(&["sched", "ids"]))
            .await
            .map_err(|e| store_error("SMEMBERS", e))?;
        let mut schedules = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(500) {
            let keys: Vec<String> = chunk.iter().map(|id| self.key(&["sched", id])).collect();
            let raw: Vec<Option<String>> = redis::cmd("MGET")
                .arg(&keys)
                .query_async(&mut c)
                .await
                .map_err(|e| store_error("MGET", e))?;
            for (key, text) in keys.into_iter().zip(raw) {
                if let Some(text) = text {
                    schedules.push(serde_json::from_str(&text).map_err(|e| {
                        StoreError::Corrupt {
                            key,
                            reason: e.to_string(),
                        }
                    })?);
                }
            }
        }
        schedules.sort_by(|a: &Schedule, b| a.id.cmp(&b.id));
        Ok(schedules)
    }

    async fn delete_schedule(&self, id: &str, shard: u32) -> Result<bool, StoreError> {
        let mut c = self.connection.clone();
        let (deleted,): (i64,) = redis::pipe()
            .atomic()
            .del(self.key(&["sched", id]))
            .srem(self.key(&["sched", "ids"]), id)
            .ignore()
            .zrem(self.key(&["sched", "due", &shard.to_string()]), id)
            .ignore()
            .publish(self.changes_channel(), id)
            .ignore()
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("delete schedule", e))?;
        Ok(deleted > 0)
    }

    async fn set_next_fire(
        &self,
        shard: u32,
        id: &str,
        at_ms: Option<i64>,
    ) -> Result<(), StoreError> {
        let key = self.key(&["sched", "due", &shard.to_string()]);
        let mut c = self.connection.clone();
        match at_ms {
            Some(at) => c.zadd::<_, _, _, ()>(key, id, at).await,
            None => c.zrem::<_, _, ()>(key, id).await,
        }
        .map_err(|e| store_error("ZADD", e))
    }

    async fn due_schedules(
        &self,
        shard: u32,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let mut c = self.connection.clone();
        c.zrangebyscore_limit_withscores(
            self.key(&["sched", "due", &shard.to_string()]),
            "-inf",
            until_ms,
            0,
            limit as isize,
        )
        .await
        .map_err(|e| store_error("ZRANGEBYSCORE", e))
    }

    async fn earliest_fire(&self, shard: u32) -> Result<Option<i64>, StoreError> {
        let mut c = self.connection.clone();
        let first: Vec<(String, i64)> = c
            .zrange_withscores(self.key(&["sched", "due", &shard.to_string()]), 0, 0)
            .await
            .map_err(|e| store_error("ZRANGE", e))?;
        Ok(first.first().map(|(_, at)| *at))
    }

    async fn claim_execution(&self, execution: &Execution) -> Result<bool, StoreError> {
        let claims = self
            .claim_executions(std::slice::from_ref(execution), None)
            .await?;
        Ok(claims.first().copied().unwrap_or(false))
    }

    async fn claim_executions(
        &self,
        executions: &[Execution],
        fence: Option<&Fence>,
    ) -> Result<Vec<bool>, StoreError> {
        if executions.is_empty() {
            return Ok(Vec::new());
        }
        let fence_key = match fence {
            Some(f) => self.key(&["fence", &f.lease]),
            None => self.key(&["fence", "none"]),
        };
        let token = fence.map(|f| f.token.to_string()).unwrap_or_default();
        let open = self.open_index();
        let mut pipe = redis::pipe();
        // Loading the script first lets the pipeline invoke it by hash on any server.
        pipe.load_script(&CLAIM_EXECUTION).ignore();
        for e in executions {
            let ms = e.scheduled_ms.to_string();
            let mut claim = CLAIM_EXECUTION.key(self.execution_key(&e.schedule_id, e.scheduled_ms));
            claim
                .key(self.key(&["exec", "hist", &e.schedule_id]))
                .key(&open)
                .key(&fence_key)
                .arg(Self::encode(e)?)
                .arg(&ms)
                .arg(EXECUTIONS_KEPT)
                .arg(format!("{}:", self.key(&["exec", &e.schedule_id])))
                .arg(open_member_prefix(&e.schedule_id))
                .arg(e.open_since().map(|s| s.to_string()).unwrap_or_default())
                .arg(&token);
            pipe.invoke_script(&claim);
        }
        let mut c = self.connection.clone();
        let replies: Vec<i64> = pipe
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("claim executions", e))?;
        if let (Some(fence), true) = (fence, replies.contains(&-1)) {
            return Err(StoreError::Fenced {
                lease: fence.lease.clone(),
                token: fence.token,
            });
        }
        Ok(replies.into_iter().map(|r| r == 1).collect())
    }

    async fn record_fires(
        &self,
        shard: u32,
        executions: &[Execution],
        next_fires: &[(String, Option<i64>)],
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        if executions.is_empty() && next_fires.is_empty() {
            return Ok(());
        }
        let due = self.key(&["sched", "due", &shard.to_string()]);
        let mut writes = Vec::with_capacity(executions.len() * 2 + next_fires.len());
        for e in executions {
            writes.extend(self.execution_writes(e)?);
        }
        for (id, at) in next_fires {
            writes.push(match at {
                Some(at) => Write::Zadd(due.clone(), *at, id.clone()),
                None => Write::Zrem(due.clone(), id.clone()),
            });
        }
        self.apply_writes("record fires", writes, fence).await
    }

    async fn put_execution(
        &self,
        execution: &Execution,
        fence: Option<&Fence>,
    ) -> Result<(), StoreError> {
        let writes = self.execution_writes(execution)?;
        self.apply_writes("put execution", writes, fence).await
    }

    async fn open_executions(
        &self,
        changed_by_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        let mut c = self.connection.clone();
        let members: Vec<String> = c
            .zrangebyscore_limit(
                self.open_index(),
                "-inf",
                changed_by_ms,
                skip as isize,
                limit as isize,
            )
            .await
            .map_err(|e| store_error("ZRANGEBYSCORE", e))?;
        Ok(members
            .iter()
            .filter_map(|m| {
                let (schedule, ms) = m.rsplit_once('@')?;
                Some((schedule.to_string(), ms.parse().ok()?))
            })
            .collect())
    }

    async fn get_execution(
        &self,
        schedule_id: &str,
        scheduled_ms: i64,
    ) -> Result<Option<Execution>, StoreError> {
        self.get_json(self.execution_key(schedule_id, scheduled_ms))
            .await
    }

    async fn executions(
        &self,
        schedule_id: &str,
        limit: usize,
    ) -> Result<Vec<Execution>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let mut c = self.connection.clone();
        let times: Vec<i64> = c
            .zrevrange(
                self.key(&["exec", "hist", schedule_id]),
                0,
                limit as isize - 1,
            )
            .await
            .map_err(|e| store_error("ZREVRANGE", e))?;
        if times.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = times
            .iter()
            .map(|t| self.execution_key(schedule_id, *t))
            .collect();
        let raw: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("MGET", e))?;
        keys.into_iter()
            .zip(raw)
            .filter_map(|(key, text)| text.map(|t| (key, t)))
            .map(|(key, text)| {
                serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                    key,
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    async fn register_node(
        &self,
        node: &str,
        priority: i64,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        redis::pipe()
            .cmd("SET")
            .arg(self.key(&["node", node]))
            .arg(priority)
            .arg("PX")
            .arg(ttl.as_millis().max(1) as u64)
            .sadd(self.key(&["nodes"]), node)
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("register node", e))
    }

    async fn live_nodes(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let mut c = self.connection.clone();
        let nodes: Vec<String> = c
            .smembers(self.key(&["nodes"]))
            .await
            .map_err(|e| store_error("SMEMBERS", e))?;
        if nodes.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = nodes.iter().map(|n| self.key(&["node", n])).collect();
        let priorities: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("MGET", e))?;
        let mut live = Vec::new();
        for (node, priority) in nodes.into_iter().zip(priorities) {
            match priority {
                Some(p) => live.push((node, p)),
                None => {
                    let _: Result<(), _> = c.srem(self.key(&["nodes"]), &node).await;
                }
            }
        }
        Ok(live)
    }

    async fn watch_schedules(&self) -> Result<ScheduleChanges, StoreError> {
        let mut pubsub = self
            .client
            .get_async_pubsub()
            .await
            .map_err(|e| store_error("SUBSCRIBE", e))?;
        pubsub
            .subscribe(self.changes_channel())
            .await
            .map_err(|e| store_error("SUBSCRIBE", e))?;
        let (tx, receiver) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            use futures::StreamExt;
            let mut messages = pubsub.on_message();
            while messages.next().await.is_some() {
                if tx.is_closed() {
                    return;
                }
                let _ = tx.try_send(());
            }
        });
        Ok(ScheduleChanges { receiver })
    }

    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let key = self.key(&["wf", &execution.id]);
        let mut c = self.connection.clone();
        // Two set-if-absent in one transaction: both fields are written, or (the
        // execution exists) neither. Cheaper for Redis than a script doing the same.
        let (created, _): (i64, i64) = redis::pipe()
            .atomic()
            .hset_nx(&key, "data", Self::encode(execution)?)
            .hset_nx(&key, "v", execution.version)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("create workflow execution", e))?;
        Ok(created == 1)
    }

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError> {
        let key = self.key(&["wf", id]);
        let mut c = self.connection.clone();
        let raw: Option<String> = c
            .hget(&key, "data")
            .await
            .map_err(|e| store_error("HGET", e))?;
        raw.map(|text| {
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                key,
                reason: e.to_string(),
            })
        })
        .transpose()
    }

    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let expire = if execution.status == RunStatus::Running {
            0
        } else {
            FINISHED_WORKFLOW_TTL_MS
        };
        let mut c = self.connection.clone();
        let updated: i64 = UPDATE_WORKFLOW
            .key(self.key(&["wf", &execution.id]))
            .arg(execution.version.saturating_sub(1))
            .arg(execution.version)
            .arg(Self::encode(execution)?)
            .arg(expire)
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("update workflow execution", e))?;
        Ok(updated == 1)
    }

    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError> {
        if tasks.is_empty() {
            return Ok(());
        }
        // Fields of the execution's own hash: they expire with it, in one command.
        let fields: Vec<(String, u8)> = tasks
            .iter()
            .map(|task| (format!("{PUBLISHED_FIELD}{task}"), 1))
            .collect();
        let mut c = self.connection.clone();
        c.hset_multiple(self.key(&["wf", execution]), &fields)
            .await
            .map_err(|e| store_error("HSET", e))
    }

    async fn published_tasks(&self, execution: &str) -> Result<BTreeSet<String>, StoreError> {
        let mut c = self.connection.clone();
        let fields: Vec<String> = c
            .hkeys(self.key(&["wf", execution]))
            .await
            .map_err(|e| store_error("HKEYS", e))?;
        Ok(fields
            .iter()
            .filter_map(|f| f.strip_prefix(PUBLISHED_FIELD))
            .map(str::to_string)
            .collect())
    }

    async fn set_workflow_deadline(
        &self,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zadd::<_, _, _, ()>(self.key(&["wf-deadlines"]), execution, deadline_ms)
            .await
            .map_err(|e| store_error("ZADD", e))
    }

    async fn due_workflow_deadlines(
        &self,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut c = self.connection.clone();
        c.zrangebyscore_limit(
            self.key(&["wf-deadlines"]),
            "-inf",
            until_ms,
            0,
            limit as isize,
        )
        .await
        .map_err(|e| store_error("ZRANGEBYSCORE", e))
    }

    async fn clear_workflow_deadline(&self, execution: &str) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zrem::<_, _, ()>(self.key(&["wf-deadlines"]), execution)
            .await
            .map_err(|e| store_error("ZREM", e))
    }
}

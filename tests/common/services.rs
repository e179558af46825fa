//! Connections to the real services for `--features it` tests, named by the
//! `WEIR_TEST_*` variables that `scripts/services` exports (loopback defaults).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use weir::store::redis::RedisStore;
use weir::transport::kafka::{KafkaBroker, KafkaSettings};
use weir::transport::nats::{NatsBroker, NatsSettings};

pub fn kafka_brokers() -> String {
    std::env::var("WEIR_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub fn nats_url() -> String {
    std::env::var("WEIR_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

pub fn redis_url() -> String {
    std::env::var("WEIR_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Retention of the topics and streams tests create, so what they leave behind ages out.
pub const TEST_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

/// A prefix no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// The body of a config file's `[broker]` table for Kafka, with the tests' retention.
pub fn kafka_table() -> String {
    format!(
        "kind = \"kafka\"\nbrokers = \"{}\"\nretention_ms = {}",
        kafka_brokers(),
        TEST_RETENTION.as_millis()
    )
}

/// The body of a config file's `[broker]` table for NATS JetStream, with the tests'
/// retention.
pub fn nats_table() -> String {
    nats_table_at(&nats_url())
}

/// A `[broker]` table for the NATS server at `url`.
pub fn nats_table_at(url: &str) -> String {
    format!(
        "kind = \"nats\"\nurl = \"{url}\"\nretention_ms = {}",
        TEST_RETENTION.as_millis()
    )
}

/// [`fast_group_options`] as a `[broker]` line.
pub fn fast_group_options_line() -> String {
    let pairs: Vec<String> = fast_group_options()
        .iter()
        .map(|(k, v)| format!("{k:?} = {v:?}"))
        .collect();
    format!("options = {{ {} }}", pairs.join(", "))
}

/// Consumer settings that make a group join take seconds rather than tens of them.
pub fn fast_group_options() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("session.timeout.ms".to_string(), "6000".to_string()),
        ("max.poll.interval.ms".to_string(), "7000".to_string()),
        ("heartbeat.interval.ms".to_string(), "1000".to_string()),
    ])
}

pub fn kafka() -> Arc<KafkaBroker> {
    kafka_partitioned(1)
}

/// A client that creates topics with this many partitions.
pub fn kafka_partitioned(partitions: i32) -> Arc<KafkaBroker> {
    Arc::new(
        KafkaBroker::connect(KafkaSettings {
            brokers: kafka_brokers(),
            partitions,
            options: fast_group_options(),
            retention: Some(TEST_RETENTION),
            ..KafkaSettings::default()
        })
        .expect("kafka client"),
    )
}

pub async fn nats(jetstream: bool) -> Arc<NatsBroker> {
    nats_at(&nats_url(), jetstream).await
}

/// A client of the NATS server at `url`.
pub async fn nats_at(url: &str, jetstream: bool) -> Arc<NatsBroker> {
    Arc::new(
        NatsBroker::connect(NatsSettings {
            url: url.to_string(),
            jetstream,
            ack_wait: std::time::Duration::from_secs(5),
            retention: Some(TEST_RETENTION),
            ..Default::default()
        })
        .await
        .expect("nats reachable (run scripts/services)"),
    )
}

pub async fn redis(prefix: &str) -> Arc<RedisStore> {
    Arc::new(
        RedisStore::connect(&redis_url(), prefix)
            .await
            .expect("redis reachable (run scripts/services)"),
    )
}

/// Stores, as another version might, an execution record this one cannot read.
pub async fn write_unreadable_execution(prefix: &str, schedule_id: &str, scheduled_ms: i64) {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut connection = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("SET")
        .arg(format!("{prefix}:exec:{schedule_id}:{scheduled_ms}"))
        .arg(unreadable_execution(schedule_id))
        .query_async::<()>(&mut connection)
        .await
        .unwrap();
}

/// An execution record as another version might write it: one this version cannot read.
pub fn unreadable_execution(schedule_id: &str) -> String {
    format!(r#"{{"schedule_id": "{schedule_id}", "status": 7}}"#)
}

/// An execution of `schedule_id` due at `at_ms` that completed then.
pub fn completed_execution(schedule_id: &str, at_ms: i64) -> weir::store::Execution {
    weir::store::Execution {
        schedule_id: schedule_id.into(),
        scheduled_ms: at_ms,
        tick_id: format!("{schedule_id}@{at_ms}"),
        status: weir::store::ExecutionStatus::Completed,
        attempt: 1,
        max_attempts: 3,
        node_id: "n".into(),
        fencing_token: 1,
        updated_ms: at_ms,
        error: None,
    }
}

/// What a test made on the shared services, removed when this is dropped: the Redis
/// keys and JetStream streams whose names hold the test's prefix (as [`unique`] makes
/// it, no other test's names hold it), and, when the test process exits, its Kafka
/// topics. Declared before the processes and clients a test starts, it is dropped
/// after them.
///
/// Kafka topics wait for the exit because a topic deleted under a client still
/// fetching from it can crash the whole process: Tansu then answers fetches with a
/// leader update naming neither the topic nor its id, and librdkafka (2.12) compares
/// that missing name. A test's clients can outlive this guard (tasks of its runtime
/// end only when the runtime does); at exit every test and runtime has ended, and the
/// clients they dropped are let finish closing before any topic goes. A binary killed
/// before it exits leaves its topics to their retention.
pub struct Cleanup {
    prefix: String,
}

/// Removes what carries `prefix` on the shared services once the test is done.
pub fn cleanup(prefix: &str) -> Cleanup {
    // Short names could be parts of other tests' names.
    assert!(prefix.len() >= 12, "not a unique prefix: {prefix}");
    KAFKA_PREFIXES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(prefix.to_string());
    REMOVE_KAFKA_TOPICS_AT_EXIT.call_once(|| {
        extern "C" {
            fn atexit(callback: extern "C" fn()) -> std::ffi::c_int;
        }
        // SAFETY: `atexit` only stores the pointer of a function that lives as long as
        // the process; the function catches any panic, so none unwinds into libc.
        // Should the registration fail, the topics are left to their retention.
        unsafe {
            atexit(remove_kafka_topics_at_exit);
        }
    });
    Cleanup {
        prefix: prefix.to_string(),
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let prefix = self.prefix.clone();
        // Dropped inside a test's runtime, which cannot be blocked on.
        on_a_thread_of_its_own(async move {
            let _ = tokio::time::timeout(
                std::time::Duration::from_secs(30),
                remove_redis_keys_and_streams(&prefix),
            )
            .await;
        });
    }
}

/// Runs `work` to its end on a new thread and runtime, and waits for it.
fn on_a_thread_of_its_own(work: impl std::future::Future<Output = ()> + Send + 'static) {
    let thread = std::thread::Builder::new().spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            runtime.block_on(work);
        }
    });
    if let Ok(thread) = thread {
        let _ = thread.join();
    }
}

/// The prefixes of every [`Cleanup`] of this process, whose Kafka topics go at exit.
static KAFKA_PREFIXES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
static REMOVE_KAFKA_TOPICS_AT_EXIT: std::sync::Once = std::sync::Once::new();

extern "C" fn remove_kafka_topics_at_exit() {
    use std::time::Duration;
    // At exit the main thread's thread-locals may be gone already: whatever fails for
    // it, nothing may unwind out of this function.
    let _ = std::panic::catch_unwind(|| {
        let prefixes =
            std::mem::take(&mut *KAFKA_PREFIXES.lock().unwrap_or_else(|p| p.into_inner()));
        on_a_thread_of_its_own(async move {
            // Dropped clients close on threads of their own: a group they are leaving
            // may still fetch from its topics.
            weir::transport::kafka::let_clients_close(Duration::from_secs(10)).await;
            let _ =
                tokio::time::timeout(Duration::from_secs(30), remove_kafka_topics(&prefixes)).await;
        });
    });
}

/// Best effort: what cannot be removed (a service gone) is left for its retention.
async fn remove_redis_keys_and_streams(prefix: &str) {
    if let Ok(client) = redis::Client::open(redis_url()) {
        if let Ok(mut connection) = client.get_multiplexed_async_connection().await {
            let _ = delete_keys_matching(&mut connection, &format!("*{prefix}*")).await;
        }
    }
    // Stream names are subjects with their dots and wildcards replaced.
    let stream_part = weir::transport::nats::stream_name(prefix);
    if let Ok(client) = async_nats::connect(nats_url()).await {
        let js = async_nats::jetstream::new(client);
        let mut names = js.stream_names();
        let mut ours = Vec::new();
        while let Some(Ok(name)) = futures::StreamExt::next(&mut names).await {
            if name.contains(&stream_part) {
                ours.push(name);
            }
        }
        for name in ours {
            let _ = js.delete_stream(&name).await;
        }
    }
}

async fn remove_kafka_topics(prefixes: &[String]) {
    if prefixes.is_empty() {
        return;
    }
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", kafka_brokers());
    let Ok(consumer) = config.create::<BaseConsumer>() else {
        return;
    };
    let Ok(metadata) = consumer.fetch_metadata(None, std::time::Duration::from_secs(5)) else {
        return;
    };
    let ours: Vec<String> = metadata
        .topics()
        .iter()
        .map(|topic| topic.name().to_string())
        .filter(|name| prefixes.iter().any(|prefix| name.contains(prefix.as_str())))
        .collect();
    if ours.is_empty() {
        return;
    }
    let Ok(admin) = config.create::<AdminClient<DefaultClientContext>>() else {
        return;
    };
    let names: Vec<&str> = ours.iter().map(String::as_str).collect();
    let _ = admin.delete_topics(&names, &AdminOptions::new()).await;
}

/// Removes every Redis key under `prefix` (what a test's store created).
pub async fn remove_redis_keys(prefix: &str) {
    let client = redis::Client::open(redis_url()).expect("redis url");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis reachable");
    delete_keys_matching(&mut connection, &format!("{prefix}*"))
        .await
        .expect("SCAN and DEL");
}

/// Deletes the keys matching `pattern`. By SCAN, not KEYS: other tests' leases share
/// this Redis and must not stall.
async fn delete_keys_matching(
    connection: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Result<(), redis::RedisError> {
    let mut keys: Vec<String> = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await?;
        keys.extend(page);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    for chunk in keys.chunks(500) {
        let () = redis::cmd("DEL").arg(chunk).query_async(connection).await?;
    }
    Ok(())
}

/// Waits until every partition of an ownership `group` (`jobs.<type>`, `graph.<name>`)
/// is held, by exactly `nodes`: each holds at least one, no other holds any. Within 30 s;
/// a read refused meanwhile (Redis restarting) counts as a partition not held yet.
pub async fn await_owners(store: &RedisStore, group: &str, partitions: u32, nodes: &[&str]) {
    use weir::lease::LeaseStore;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let mut holders = std::collections::BTreeSet::new();
        let mut unowned = 0;
        for p in 0..partitions as i32 {
            let lease = match store
                .current_lease(&weir::ownership::partition_lease(group, p))
                .await
            {
                Ok(lease) => lease,
                // A connection broken by a Redis restart is made again at the next call.
                Err(e) if e.is_retryable() && std::time::Instant::now() < deadline => {
                    unowned += 1;
                    continue;
                }
                Err(e) => panic!("redis unreachable: {e}"),
            };
            match lease {
                Some(lease) => {
                    holders.insert(weir::lease::holder_node(&lease.holder).to_string());
                }
                None => unowned += 1,
            }
        }
        let wanted: std::collections::BTreeSet<String> =
            nodes.iter().map(|n| n.to_string()).collect();
        if holders == wanted && unowned == 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{group} owned by {holders:?} ({unowned} partitions by none), not {wanted:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Each partition's lease token in an ownership `group` (0 where none is held). A read
/// refused while Redis restarts is tried again, for up to 10 s.
pub async fn lease_tokens(store: &RedisStore, group: &str, partitions: u32) -> Vec<u64> {
    use weir::lease::LeaseStore;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut tokens = Vec::with_capacity(partitions as usize);
    for p in 0..partitions as i32 {
        let name = weir::ownership::partition_lease(group, p);
        loop {
            match store.current_lease(&name).await {
                Ok(lease) => {
                    tokens.push(lease.map_or(0, |l| l.token));
                    break;
                }
                Err(e) if e.is_retryable() && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => panic!("redis unreachable: {e}"),
            }
        }
    }
    tokens
}

/// Each partition's lease token rose between two readings of [`lease_tokens`].
pub fn assert_every_token_rose(before: &[u64], after: &[u64]) {
    assert_eq!(before.len(), after.len());
    for (p, (before, after)) in before.iter().zip(after).enumerate() {
        assert!(after > before, "partition {p}: token {before} then {after}");
    }
}

//! What the benches share: removing what a run left in Redis and the broker.

use std::sync::Arc;

use weir::transport::Broker;

/// Deletes every Redis key under `prefix`.
pub async fn remove_prefix(redis_url: &str, prefix: &str) {
    if let Ok(client) = redis::Client::open(redis_url) {
        if let Ok(mut c) = client.get_multiplexed_async_connection().await {
            let pattern = format!("{}:*", prefix);
            let mut cursor: u64 = 0;
            loop {
                let Ok((next, keys)): Result<(u64, Vec<String>), _> = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(10_000)
                    .query_async(&mut c)
                    .await
                else {
                    break;
                };
                if !keys.is_empty() {
                    let _: Result<i64, _> =
                        redis::cmd("UNLINK").arg(&keys).query_async(&mut c).await;
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
    }
}

/// Deletes the streams of NATS JetStream subjects.
pub async fn delete_topics(broker: &Arc<dyn Broker>, topics: &[String]) {
    // Kafka topics stay. Clients of this process may still hold a deleted topic in
    // their metadata cache, and the Kafka-compatible broker used here answers for
    // deleted topics in a way that crashed librdkafka's metadata update.
    if broker.kind() != "nats" {
        return;
    }
    let url = std::env::var("WEIR_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    if let Ok(client) = async_nats::connect(url.as_str()).await {
        let js = async_nats::jetstream::new(client);
        for t in topics {
            let _ = js
                .delete_stream(weir::transport::nats::stream_name(t))
                .await;
        }
    }
}

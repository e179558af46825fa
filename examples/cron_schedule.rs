//! A cron schedule declared in Rust: every second, at least once, with a payload; the
//! scheduler masters its shard and publishes one tick per second to `weir.cron.ticks`.
//! Runs on the embedded default for three seconds: `cargo run --example cron_schedule`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use weir::codec::avro::decode;
use weir::codec::CronTick;
use weir::cron::scheduler::{register, Scheduler, SchedulerConfig};
use weir::cron::{Delivery, Schedule};
use weir::store::memory::MemoryStore;
use weir::transport::memory::MemoryBroker;
use weir::transport::{Broker, Subscription};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let broker = MemoryBroker::default();
    let store = Arc::new(MemoryStore::new());
    let schedule = Schedule {
        payload: json!({ "job": "heartbeat" }),
        delivery: Delivery::AtLeastOnce,
        // Six fields: seconds first. Any IANA zone; DST follows Vixie cron's rules.
        ..Schedule::new("heartbeat", "* * * * * *", "Europe/London")
    };
    let config = SchedulerConfig::new("example-node");
    let first = register(store.as_ref(), &schedule, config.shards).await?;
    println!("first fire at {first:?}");

    let cancel = CancellationToken::new();
    let scheduler = Scheduler::new(store, broker.sink(), config);
    let running = tokio::spawn(scheduler.run(cancel.clone()));

    let mut ticks = broker
        .subscribe(&Subscription::new(weir::wire::TICK_TOPIC, "example"))
        .await?;
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(message) = tokio::time::timeout_at(until, ticks.next()).await {
        let tick: CronTick = decode(&message?.payload)?;
        println!(
            "{} at {} ms: {}",
            tick.tick_id, tick.scheduled_time_ms, tick.payload
        );
    }
    cancel.cancel();
    running.await?;
    Ok(())
}

//! The cron scheduler against the embedded backends (real time: schedules fire every
//! second), plus `weir run` failover on real Redis and NATS with `--features it`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use weir::codec::avro::decode;
use weir::codec::CronTick;
use weir::cron::scheduler::{
    register, set_enabled, Scheduler, SchedulerConfig, TickGuard, TickVerdict,
};
use weir::cron::{Delivery, Schedule, Target};
use weir::store::memory::MemoryStore;
use weir::store::prelude::*;
use weir::store::ExecutionStatus;
use weir::transport::memory::MemoryBroker;

/// The scheduled times of the ticks sent to `topic`, in order.
fn fired_times(broker: &MemoryBroker, topic: &str) -> Vec<i64> {
    let mut fired: Vec<i64> = ticks(broker, topic)
        .iter()
        .map(|t| t.scheduled_time_ms)
        .collect();
    fired.sort();
    fired
}

/// Runs one scheduler node over `store` for `long`, then stops it.
async fn run_for(
    store: &Arc<MemoryStore>,
    broker: &MemoryBroker,
    cfg: SchedulerConfig,
    long: Duration,
) {
    let cancel = CancellationToken::new();
    let node = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    tokio::time::sleep(long).await;
    cancel.cancel();
    let _ = node.await;
}

fn ticks(broker: &MemoryBroker, topic: &str) -> Vec<CronTick> {
    broker
        .messages(topic)
        .iter()
        .map(|m| decode::<CronTick>(&m.payload).expect("ticks are Avro CronTick records"))
        .collect()
}

fn every_second(id: &str, topic: &str) -> Schedule {
    let mut s = Schedule::new(id, "* * * * * *", "UTC");
    s.target = Target::Topic(topic.into());
    s.payload = serde_json::json!({"job": id});
    s
}

fn config(node: &str, priority: i64) -> SchedulerConfig {
    SchedulerConfig {
        priority,
        lease_ttl: Duration::from_millis(600),
        ..SchedulerConfig::new(node)
    }
}

#[tokio::test]
async fn fires_each_scheduled_time_once_with_a_stable_tick_id() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    register(store.as_ref(), &every_second("s1", "ticks"), 1)
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let a = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config("a", 0)).run(cancel.clone()),
    );
    let b = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config("b", 0)).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(3500)).await;
    cancel.cancel();
    let _ = tokio::join!(a, b);

    let ticks = ticks(&broker, "ticks");
    assert!(ticks.len() >= 2, "{} ticks", ticks.len());
    let mut times: Vec<i64> = ticks.iter().map(|t| t.scheduled_time_ms).collect();
    times.dedup();
    assert_eq!(
        times.len(),
        ticks.len(),
        "two schedulers, still one tick per scheduled time"
    );
    assert!(times.windows(2).all(|w| w[1] - w[0] == 1000));
    for t in &ticks {
        assert_eq!(t.tick_id, format!("s1@{}", t.scheduled_time_ms));
        assert_eq!(t.payload, r#"{"job":"s1"}"#);
        assert_eq!(t.delivery, "at_most_once");
        assert!(t.emitted_time_ms >= t.scheduled_time_ms);
        assert_eq!(t.scheduled_time_ms % 1000, 0);
    }
    let history = store.executions("s1", 100).await.unwrap().executions;
    assert_eq!(history.len(), ticks.len());
    assert!(history
        .iter()
        .all(|e| e.status == ExecutionStatus::Completed));
}

/// A stored schedule this version finds invalid (a zone its time zone data lacks, as
/// a newer version's may have) is not fired, and stays due for a later look.
#[tokio::test]
async fn a_stored_schedule_found_invalid_is_kept_for_later() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    register(store.as_ref(), &every_second("valid", "vticks"), 1)
        .await
        .unwrap();
    register(store.as_ref(), &every_second("later", "lticks"), 1)
        .await
        .unwrap();
    let mut newer = every_second("later", "lticks");
    newer.timezone = "Mars/Olympus_Mons".into();
    store.put_schedule(&newer).await.unwrap();
    let cancel = CancellationToken::new();
    let node = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config("a", 0)).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    cancel.cancel();
    let _ = node.await;
    assert!(!ticks(&broker, "vticks").is_empty());
    assert!(ticks(&broker, "lticks").is_empty());
    let due = store.next_fire(0, "later").await.unwrap();
    let now_ms = chrono::Utc::now().timestamp_millis();
    assert!(
        due.is_some_and(|due| due > now_ms + 30_000),
        "kept, due again later: {due:?}"
    );
}

/// Lowering `[cron] shards` leaves schedules in shards no master reads any more; they
/// are moved into the shard their id maps to now and fire from there.
#[tokio::test]
async fn schedules_of_shards_past_a_lowered_count_move_and_fire() {
    use weir::cron::scheduler::shard_of;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    // Filed among 8 shards, in one past the 2 the nodes now run.
    let id = (0..)
        .map(|i| format!("moved{i}"))
        .find(|id| shard_of(id, 8) >= 2)
        .unwrap();
    let old = shard_of(&id, 8);
    register(store.as_ref(), &every_second(&id, "mticks"), 8)
        .await
        .unwrap();
    let cfg = SchedulerConfig {
        shards: 2,
        orphan_after: Duration::from_millis(200),
        ..config("a", 0)
    };
    run_for(&store, &broker, cfg, Duration::from_millis(2500)).await;
    assert!(!ticks(&broker, "mticks").is_empty(), "it fires");
    assert_eq!(store.next_fire(old, &id).await.unwrap(), None);
    assert!(store
        .next_fire(shard_of(&id, 2), &id)
        .await
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn paused_schedules_do_not_fire_and_resume_later() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    register(store.as_ref(), &every_second("p", "pticks"), 1)
        .await
        .unwrap();
    assert!(set_enabled(store.as_ref(), "p", false, 1).await.unwrap());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config("a", 0)).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(ticks(&broker, "pticks").is_empty());
    // Resuming wakes the sleeping scheduler through the change feed.
    assert!(set_enabled(store.as_ref(), "p", true, 1).await.unwrap());
    tokio::time::sleep(Duration::from_millis(1600)).await;
    assert!(!ticks(&broker, "pticks").is_empty());
    cancel.cancel();
    let _ = task.await;
    assert!(!set_enabled(store.as_ref(), "missing", true, 1)
        .await
        .unwrap());
}

#[tokio::test]
async fn the_highest_priority_node_is_master_and_a_lower_one_yields() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    register(store.as_ref(), &every_second("y", "yticks"), 1)
        .await
        .unwrap();
    let low_cancel = CancellationToken::new();
    let low = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config("low", 1))
            .run(low_cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let high_cancel = CancellationToken::new();
    let high = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), config("high", 5))
            .run(high_cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    low_cancel.cancel();
    high_cancel.cancel();
    let _ = tokio::join!(low, high);
    let ticks = ticks(&broker, "yticks");
    let first = ticks.first().unwrap();
    let last = ticks.last().unwrap();
    assert_eq!(first.node_id, "low");
    assert_eq!(last.node_id, "high", "the higher priority took over");
    assert!(last.fencing_token > first.fencing_token);
    let mut times: Vec<i64> = ticks.iter().map(|t| t.scheduled_time_ms).collect();
    let n = times.len();
    times.dedup();
    assert_eq!(
        times.len(),
        n,
        "no scheduled time ticked twice across the hand-over"
    );
}

#[test]
fn ticks_from_a_deposed_master_are_rejected() {
    let tick = |token: i64, at: i64| CronTick {
        schedule_id: "s".into(),
        tick_id: format!("s@{at}"),
        scheduled_time_ms: at,
        emitted_time_ms: at,
        fencing_token: token,
        delivery: "at_least_once".into(),
        attempt: 1,
        payload: "{}".into(),
        node_id: "n".into(),
        tenant: None,
    };
    let mut guard = TickGuard::default();
    assert_eq!(guard.check(&tick(1, 1000)), TickVerdict::Accept);
    assert_eq!(guard.check(&tick(2, 2000)), TickVerdict::Accept);
    assert_eq!(
        guard.check(&tick(1, 3000)),
        TickVerdict::Stale,
        "the old master's late tick"
    );
    assert_eq!(guard.check(&tick(2, 2000)), TickVerdict::Duplicate);
    assert_eq!(guard.check(&tick(3, 3000)), TickVerdict::Accept);

    // Memory stays bounded however many ticks pass; duplicates in the window are still
    // caught, and a tick older than a full window counts as one.
    let mut guard = TickGuard::with_window(3);
    for at in 0..1000 {
        assert_eq!(guard.check(&tick(1, at * 1000)), TickVerdict::Accept);
    }
    assert_eq!(guard.remembered(), 3);
    assert_eq!(guard.check(&tick(1, 998_000)), TickVerdict::Duplicate);
    assert_eq!(guard.check(&tick(1, 5_000)), TickVerdict::Duplicate);
    assert_eq!(guard.check(&tick(1, 1_000_000)), TickVerdict::Accept);
}

#[tokio::test]
async fn invalid_schedules_are_rejected_at_registration() {
    let store = MemoryStore::new();
    let err = register(&store, &Schedule::new("bad", "* * *", "UTC"), 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("\"* * *\""), "{err}");
    let err = register(
        &store,
        &Schedule::new("bad", "* * * * *", "Atlantis/Nowhere"),
        1,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("Atlantis/Nowhere"), "{err}");
    assert!(store.list_schedules().await.unwrap().schedules.is_empty());
}

#[cfg(feature = "it")]
mod failover {
    use super::*;
    use common::services;
    use std::io::Write;
    use std::process::{Child, Command, Stdio};
    use weir::transport::{Assignment, Broker, Subscription};

    const TTL_MS: u64 = 2000;

    /// A `weir run` process, killed when dropped: a failing test leaves none running.
    struct Node(Child);

    impl std::ops::Deref for Node {
        type Target = Child;
        fn deref(&self) -> &Child {
            &self.0
        }
    }

    impl std::ops::DerefMut for Node {
        fn deref_mut(&mut self) -> &mut Child {
            &mut self.0
        }
    }

    impl Drop for Node {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn start(config: &std::path::Path, node: &str, prefix: &str) -> Node {
        let path = std::env::temp_dir().join(format!("{prefix}-{node}.log"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        Command::new(env!("CARGO_BIN_EXE_weir"))
            .args(["run", "--config"])
            .arg(config)
            .env("WEIR__NODE__ID", node)
            .env("WEIR_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map(Node)
            .unwrap()
    }

    async fn drain(broker: &Arc<dyn Broker>, topic: &str) -> Vec<CronTick> {
        let mut sub = Subscription::new(topic, services::unique("reader"));
        sub.assignment = Assignment::All;
        let mut source = broker.subscribe(&sub).await.unwrap();
        let mut out = Vec::new();
        // This reader never acknowledges: a message JetStream hands out again after its
        // ack wait has a position already read, and is not a second tick.
        let mut positions = std::collections::HashSet::new();
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(2), source.next()).await {
            if positions.insert(m.position.offset) {
                out.push(decode::<CronTick>(&m.payload).unwrap());
            }
        }
        out
    }

    /// Overwrites the stored schedule `id` with a record this version cannot read (as
    /// another version might write it); returns the connection it used.
    async fn make_unreadable(prefix: &str, id: &str) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("SET")
            .arg(format!("{prefix}:sched:{id}"))
            .arg(r#"{"id": "bad", "cron": 7}"#)
            .query_async::<()>(&mut connection)
            .await
            .unwrap();
        connection
    }

    /// Overwrites the stored schedule `id` with a value of another Redis type (a hash,
    /// as another program sharing the prefix might write), which reading it as a string
    /// fails on.
    async fn make_another_type(prefix: &str, id: &str) -> redis::aio::MultiplexedConnection {
        let mut connection = make_unreadable(prefix, id).await;
        let key = format!("{prefix}:sched:{id}");
        redis::pipe()
            .atomic()
            .del(&key)
            .hset(&key, "id", id)
            .query_async::<()>(&mut connection)
            .await
            .unwrap();
        connection
    }

    /// A stored schedule this version cannot read (another version wrote it, say) is
    /// left unfired; the other schedules of its shard fire on.
    #[tokio::test(flavor = "multi_thread")]
    async fn an_unreadable_stored_schedule_leaves_the_rest_of_its_shard_firing() {
        a_spoiled_schedule_leaves_the_rest_of_its_shard_firing(false).await;
    }

    /// As above for a key of another type under the schedule's name: Redis refuses to
    /// read it, every time, and the shard's other schedules fire on.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_schedule_key_of_another_type_leaves_the_rest_of_its_shard_firing() {
        a_spoiled_schedule_leaves_the_rest_of_its_shard_firing(true).await;
    }

    async fn a_spoiled_schedule_leaves_the_rest_of_its_shard_firing(another_type: bool) {
        let prefix = services::unique("cronbad");
        let _cleanup_prefix = services::cleanup(&prefix);
        let store = services::redis(&prefix).await;
        register(store.as_ref(), &every_second("good", "good.ticks"), 1)
            .await
            .unwrap();
        register(store.as_ref(), &every_second("bad", "bad.ticks"), 1)
            .await
            .unwrap();
        let mut connection = if another_type {
            make_another_type(&prefix, "bad").await
        } else {
            make_unreadable(&prefix, "bad").await
        };
        let broker = MemoryBroker::default();
        let cancel = CancellationToken::new();
        let scheduler = tokio::spawn(
            Scheduler::new(store.clone(), Arc::new(broker.clone()), config("a", 0))
                .run(cancel.clone()),
        );
        tokio::time::sleep(Duration::from_millis(3500)).await;
        cancel.cancel();
        let _ = scheduler.await;
        assert!(ticks(&broker, "good.ticks").len() >= 2);
        assert!(ticks(&broker, "bad.ticks").is_empty());
        let listed = store.list_schedules().await.unwrap();
        assert_eq!(
            listed
                .schedules
                .iter()
                .map(|s| s.id.as_str())
                .collect::<Vec<_>>(),
            ["good"]
        );
        assert_eq!(
            listed
                .unreadable
                .iter()
                .map(|u| u.id.as_str())
                .collect::<Vec<_>>(),
            ["bad"],
            "listed as unreadable"
        );
        // Still due, a while later: once readable again (every node upgraded) it fires.
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(format!("{prefix}:sched:due:0"))
            .arg("bad")
            .query_async(&mut connection)
            .await
            .unwrap();
        let now_ms = chrono::Utc::now().timestamp_millis() as f64;
        assert!(
            score.is_some_and(|due| due > now_ms + 30_000.0),
            "the unreadable schedule is kept, due again later: {score:?}"
        );
    }

    /// A Redis store under `prefix` with schedules `bad` and `orph`, never due in a test,
    /// each with a tick claimed at 1000 ms by a node that died before emitting it.
    async fn two_orphaned(prefix: &str) -> Arc<weir::store::redis::RedisStore> {
        let store = services::redis(prefix).await;
        // Ids in the order the sweep takes them: `bad` first.
        for id in ["bad", "orph"] {
            let mut schedule = every_second(id, "oticks");
            schedule.cron = "0 0 1 1 *".into();
            schedule.delivery = Delivery::AtLeastOnce;
            register(store.as_ref(), &schedule, 1).await.unwrap();
            store.claim_execution(&unemitted(id, 1_000)).await.unwrap();
        }
        store
    }

    /// The tick ids one node emits, sorted, sweeping `store` for orphans a while.
    async fn swept(store: Arc<weir::store::redis::RedisStore>) -> Vec<String> {
        let broker = MemoryBroker::default();
        let cancel = CancellationToken::new();
        let cfg = SchedulerConfig {
            orphan_after: Duration::from_millis(200),
            ..config("a", 0)
        };
        let scheduler =
            tokio::spawn(Scheduler::new(store, Arc::new(broker.clone()), cfg).run(cancel.clone()));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        cancel.cancel();
        let _ = scheduler.await;
        let mut emitted: Vec<String> = ticks(&broker, "oticks")
            .into_iter()
            .map(|t| t.tick_id)
            .collect();
        emitted.sort();
        emitted
    }

    /// An unreadable schedule with unfinished executions of its own leaves them waiting;
    /// the orphan sweep goes on to the other schedules' executions.
    #[tokio::test(flavor = "multi_thread")]
    async fn an_unreadable_schedule_leaves_the_rest_of_the_orphan_sweep_going() {
        let prefix = services::unique("cronorph");
        let _cleanup_prefix = services::cleanup(&prefix);
        let store = two_orphaned(&prefix).await;
        make_unreadable(&prefix, "bad").await;
        assert_eq!(swept(store.clone()).await, ["orph@1000"]);
        let waiting = store.get_execution("bad", 1_000).await.unwrap().unwrap();
        assert_eq!(waiting.status, ExecutionStatus::Scheduled, "left as it was");
    }

    /// An execution record this version cannot read leaves it waiting; the sweep goes
    /// on to the schedule's other executions and to the other schedules'.
    #[tokio::test(flavor = "multi_thread")]
    async fn an_unreadable_execution_record_leaves_the_rest_of_the_orphan_sweep_going() {
        let prefix = services::unique("cronexec");
        let _cleanup_prefix = services::cleanup(&prefix);
        let store = two_orphaned(&prefix).await;
        store
            .claim_execution(&unemitted("bad", 2_000))
            .await
            .unwrap();
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("SET")
            .arg(format!("{prefix}:exec:bad:1000"))
            .arg(r#"{"schedule_id": "bad", "status": 7}"#)
            .query_async::<()>(&mut connection)
            .await
            .unwrap();
        assert_eq!(swept(store).await, ["bad@2000", "orph@1000"]);
        let raw: String = redis::cmd("GET")
            .arg(format!("{prefix}:exec:bad:1000"))
            .query_async(&mut connection)
            .await
            .unwrap();
        assert!(raw.contains("\"status\": 7"), "left as it was: {raw}");
    }

    /// An execution record this version cannot read is listed apart, and the overlap
    /// check judges on the rest: a readable running execution still makes a schedule
    /// with `overlap = "skip"` skip its firings.
    #[tokio::test(flavor = "multi_thread")]
    async fn an_unreadable_execution_record_leaves_the_overlap_judged_on_the_rest() {
        let prefix = services::unique("cronover");
        let _cleanup_prefix = services::cleanup(&prefix);
        let (store, running, unreadable) = running_behind_unreadable(&prefix, 1).await;
        let listed = store.executions("wf", 10).await.unwrap();
        assert_eq!(listed.executions, [running]);
        assert_eq!(listed.unreadable.len(), 1);
        assert_eq!(listed.unreadable[0].scheduled_ms, unreadable[0]);
        assert_overlap_skips(store).await;
    }

    /// Behind as many unreadable records as a look reads at first, a running execution
    /// is still seen: the look reads further back.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_running_execution_behind_ten_unreadable_records_still_holds_firings_back() {
        let prefix = services::unique("cronover10");
        let _cleanup_prefix = services::cleanup(&prefix);
        let (store, _, _) = running_behind_unreadable(&prefix, 10).await;
        let listed = store.executions("wf", 10).await.unwrap();
        assert!(listed.executions.is_empty());
        assert_eq!(listed.unreadable.len(), 10);
        assert_overlap_skips(store).await;
    }

    /// A workflow schedule `wf` with `overlap = "skip"`, an execution of it running (and
    /// recently updated, so no orphan sweep looks at it), then `count` newer records
    /// another version wrote, at the returned times.
    async fn running_behind_unreadable(
        prefix: &str,
        count: usize,
    ) -> (
        Arc<weir::store::redis::RedisStore>,
        weir::store::Execution,
        Vec<i64>,
    ) {
        let store = services::redis(prefix).await;
        let mut schedule = every_second("wf", "unused");
        schedule.target = Target::Workflow("report".into());
        schedule.overlap = weir::cron::Overlap::Skip;
        register(store.as_ref(), &schedule, 1).await.unwrap();
        let now_ms = chrono::Utc::now().timestamp_millis() / 1000 * 1000;
        let mut running = unemitted("wf", now_ms - 20_000);
        running.status = ExecutionStatus::Running;
        running.updated_ms = now_ms;
        store.claim_execution(&running).await.unwrap();
        let mut unreadable = Vec::new();
        for i in 0..count as i64 {
            let at_ms = now_ms - 15_000 + i * 1_000;
            store
                .claim_execution(&unemitted("wf", at_ms))
                .await
                .unwrap();
            services::write_unreadable_execution(prefix, "wf", at_ms).await;
            unreadable.push(at_ms);
        }
        (store, running, unreadable)
    }

    /// Runs a scheduler over `store` a while: the running execution of `wf` makes it skip
    /// its firings rather than start its workflow.
    async fn assert_overlap_skips(store: Arc<weir::store::redis::RedisStore>) {
        let broker = MemoryBroker::default();
        let cancel = CancellationToken::new();
        let scheduler = tokio::spawn(
            Scheduler::new(store.clone(), Arc::new(broker.clone()), config("a", 0))
                .run(cancel.clone()),
        );
        tokio::time::sleep(Duration::from_millis(2500)).await;
        cancel.cancel();
        let _ = scheduler.await;
        assert!(ticks(&broker, "weir.workflows.report.start").is_empty());
        let skipped = store
            .executions("wf", 10)
            .await
            .unwrap()
            .executions
            .iter()
            .filter(|e| e.status == ExecutionStatus::Skipped)
            .count();
        assert!(skipped >= 2, "{skipped} firings skipped");
    }

    /// An at_least_once tick claimed already under a record this version cannot read
    /// (another version's master claimed it) is left to that version, not taken over;
    /// the shard goes on firing the rest, its at_most_once schedules with it.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_claimed_execution_that_does_not_read_back_leaves_its_shard_firing() {
        let prefix = services::unique("cronclaim");
        let _cleanup_prefix = services::cleanup(&prefix);
        let store = services::redis(&prefix).await;
        let mut alo = every_second("alo", "claim.alo");
        alo.delivery = weir::cron::Delivery::AtLeastOnce;
        // Catching up every time it misses, so a look that failed over the claimed one
        // would plan it again at every look after.
        alo.catchup = weir::cron::CatchUp::All { cap: 10 };
        register(store.as_ref(), &alo, 1).await.unwrap();
        register(store.as_ref(), &every_second("amo", "claim.amo"), 1)
            .await
            .unwrap();
        // Claimed by another version's master two seconds from now.
        let unreadable_ms = (chrono::Utc::now().timestamp_millis() / 1000 + 2) * 1000;
        services::write_unreadable_execution(&prefix, "alo", unreadable_ms).await;
        let broker = MemoryBroker::default();
        let cancel = CancellationToken::new();
        let scheduler = tokio::spawn(
            Scheduler::new(store.clone(), Arc::new(broker.clone()), config("a", 0))
                .run(cancel.clone()),
        );
        tokio::time::sleep(Duration::from_millis(5500)).await;
        cancel.cancel();
        let _ = scheduler.await;
        let after = |topic: &str| {
            let mut times: Vec<i64> = ticks(&broker, topic)
                .iter()
                .map(|t| t.scheduled_time_ms)
                .filter(|ms| *ms > unreadable_ms)
                .collect();
            times.sort();
            times.dedup();
            times
        };
        assert!(after("claim.amo").len() >= 2, "{:?}", after("claim.amo"));
        assert!(after("claim.alo").len() >= 2, "{:?}", after("claim.alo"));
        assert!(ticks(&broker, "claim.alo")
            .iter()
            .all(|t| t.scheduled_time_ms != unreadable_ms));
    }

    /// A config with two schedules ticking every second, `amo` at most once and `alo` at
    /// least once (catching up on every missed time), and the cron lease's TTL short.
    fn two_schedules(prefix: &str, amo: &str, alo: &str) -> tempfile::NamedTempFile {
        let text = format!(
            r#"
[broker]
{broker}
[store]
kind = "redis"
url = "{redis}"
prefix = "{prefix}"
[cron]
lease_ttl_ms = {TTL_MS}
[[schedule]]
id = "amo"
cron = "* * * * * *"
topic = "{amo}"
delivery = "at_most_once"
[[schedule]]
id = "alo"
cron = "* * * * * *"
topic = "{alo}"
delivery = "at_least_once"
catchup = "all"
"#,
            broker = services::nats_table(),
            redis = services::redis_url(),
        );
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        file
    }

    /// Which of the two nodes holds the cron shard's lease: (master, other).
    async fn master_of<'a>(
        prefix: &str,
        n1: &'a mut Node,
        n2: &'a mut Node,
    ) -> (&'a mut Node, &'a mut Node) {
        let client = redis::Client::open(services::redis_url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let holder: String =
            redis::AsyncCommands::get(&mut c, format!("{prefix}:lease:cron:shard:0"))
                .await
                .unwrap();
        if holder.starts_with("n1#") {
            (n1, n2)
        } else {
            (n2, n1)
        }
    }

    /// More schedules due at one instant than the NATS client lets publish
    /// acknowledgements be pending by default (5,000): the instant's ticks are handed
    /// over in turn and their acknowledgements awaited together, and every one goes out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn six_thousand_ticks_due_at_one_instant_all_go_out_on_nats() {
        const SCHEDULES: usize = 6_000;
        let prefix = services::unique("cronburst");
        let _cleanup_prefix = services::cleanup(&prefix);
        let topic = format!("{prefix}.ticks");
        let store = Arc::new(MemoryStore::new());
        for n in 0..SCHEDULES {
            let mut schedule = every_second(&format!("s{n}"), &topic);
            schedule.delivery = Delivery::AtLeastOnce;
            register(store.as_ref(), &schedule, 1).await.unwrap();
        }
        let broker: Arc<dyn Broker> = services::nats(true).await;
        let cancel = CancellationToken::new();
        let scheduler = tokio::spawn(
            Scheduler::new(store.clone(), broker.sink(), config("burst", 0)).run(cancel.clone()),
        );
        let mut subscription = Subscription::new(&topic, services::unique("reader"));
        subscription.assignment = Assignment::All;
        let mut source = broker.subscribe(&subscription).await.unwrap();
        // Schedules registered across a second boundary start an instant apart; from
        // then on every instant holds all of them.
        let mut per_instant: std::collections::BTreeMap<i64, std::collections::HashSet<String>> =
            Default::default();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while per_instant.values().all(|ids| ids.len() < SCHEDULES) {
            let read = per_instant.values().map(|ids| ids.len()).max().unwrap_or(0);
            assert!(
                std::time::Instant::now() < deadline,
                "at most {read} of {SCHEDULES} ticks of one instant after 60 s"
            );
            let Ok(message) = tokio::time::timeout(Duration::from_secs(5), source.next()).await
            else {
                continue;
            };
            let tick = decode::<CronTick>(&message.unwrap().payload).unwrap();
            per_instant
                .entry(tick.scheduled_time_ms)
                .or_default()
                .insert(tick.schedule_id);
        }
        cancel.cancel();
        let _ = scheduler.await;
    }

    /// Reads the at-most-once ticks of `topic`: at least `at_least` of them, no scheduled
    /// time twice, and ticked by both nodes in turn.
    async fn each_at_most_once_time_ticked_once_by_both(
        broker: &Arc<dyn Broker>,
        topic: &str,
        at_least: usize,
    ) {
        let ticks = drain(broker, topic).await;
        let mut times: Vec<i64> = ticks.iter().map(|t| t.scheduled_time_ms).collect();
        times.sort();
        let n = times.len();
        times.dedup();
        assert_eq!(
            times.len(),
            n,
            "at_most_once: no scheduled time ticked twice"
        );
        assert!(n >= at_least, "{n} ticks");
        let nodes: std::collections::BTreeSet<&str> =
            ticks.iter().map(|t| t.node_id.as_str()).collect();
        assert_eq!(nodes.len(), 2, "both nodes were master in turn: {nodes:?}");
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn killing_the_master_neither_duplicates_at_most_once_nor_misses_at_least_once() {
        let prefix = services::unique("cronit");
        let _cleanup_prefix = services::cleanup(&prefix);
        let (amo, alo) = (format!("{prefix}.amo"), format!("{prefix}.alo"));
        let file = two_schedules(&prefix, &amo, &alo);
        let mut n1 = start(file.path(), "n1", &prefix);
        let mut n2 = start(file.path(), "n2", &prefix);
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (master, survivor) = master_of(&prefix, &mut n1, &mut n2).await;
        master.kill().unwrap();
        master.wait().unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        survivor.kill().unwrap();
        survivor.wait().unwrap();

        let broker: Arc<dyn Broker> = services::nats(true).await;
        each_at_most_once_time_ticked_once_by_both(&broker, &amo, 6).await;

        let alo_ticks = drain(&broker, &alo).await;
        let mut times: Vec<i64> = alo_ticks.iter().map(|t| t.scheduled_time_ms).collect();
        times.sort();
        times.dedup();
        assert!(
            times.windows(2).all(|w| w[1] - w[0] == 1000),
            "at_least_once: no scheduled time missed: {times:?}"
        );
        let mut emitted: Vec<i64> = alo_ticks.iter().map(|t| t.emitted_time_ms).collect();
        emitted.sort();
        let gap = emitted.windows(2).map(|w| w[1] - w[0]).max().unwrap();
        assert!(
            gap <= TTL_MS as i64 + 1500,
            "ticks stopped for {gap} ms, more than the lease TTL"
        );
    }

    /// The master frozen (SIGSTOP) for three lease TTLs while the other node takes its
    /// shard over, then woken with everything it believed still in memory: it sends no
    /// at-most-once time a second time, and what it sends of at-least-once times under
    /// its old token is dropped by a consumer's `TickGuard`, which then sees every time
    /// once, with no gap.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_master_frozen_past_its_lease_sends_no_tick_twice_once_it_wakes() {
        let prefix = services::unique("cronit");
        let _cleanup_prefix = services::cleanup(&prefix);
        let (amo, alo) = (format!("{prefix}.amo"), format!("{prefix}.alo"));
        let file = two_schedules(&prefix, &amo, &alo);
        let mut n1 = start(file.path(), "n1", &prefix);
        let mut n2 = start(file.path(), "n2", &prefix);
        tokio::time::sleep(Duration::from_secs(4)).await;
        let (master, other) = master_of(&prefix, &mut n1, &mut n2).await;
        common::servers::signal(master, "STOP");
        tokio::time::sleep(Duration::from_millis(3 * TTL_MS)).await;
        common::servers::signal(master, "CONT");
        tokio::time::sleep(Duration::from_secs(4)).await;
        for node in [master, other] {
            node.kill().unwrap();
            node.wait().unwrap();
        }

        let broker: Arc<dyn Broker> = services::nats(true).await;
        each_at_most_once_time_ticked_once_by_both(&broker, &amo, 8).await;

        let mut guard = TickGuard::default();
        let mut accepted: Vec<i64> = drain(&broker, &alo)
            .await
            .iter()
            .filter(|tick| guard.check(tick) == TickVerdict::Accept)
            .map(|tick| tick.scheduled_time_ms)
            .collect();
        let n = accepted.len();
        accepted.sort();
        accepted.dedup();
        assert_eq!(accepted.len(), n, "the guard lets each time through once");
        assert!(
            accepted.windows(2).all(|w| w[1] - w[0] == 1000),
            "at_least_once: no scheduled time missed: {accepted:?}"
        );
    }
}

/// A tick claimed by a node that died before emitting it.
fn unemitted(schedule_id: &str, at: i64) -> weir::store::Execution {
    weir::store::Execution {
        schedule_id: schedule_id.into(),
        scheduled_ms: at,
        tick_id: format!("{schedule_id}@{at}"),
        status: ExecutionStatus::Scheduled,
        attempt: 1,
        max_attempts: 3,
        node_id: "dead".into(),
        fencing_token: 1,
        updated_ms: 0,
        error: None,
    }
}

/// Runs one scheduler node (orphans count after 200 ms) for long enough to sweep a few
/// times.
async fn sweep_a_while(store: &Arc<MemoryStore>, broker: &MemoryBroker, cfg: SchedulerConfig) {
    let cfg = SchedulerConfig {
        orphan_after: Duration::from_millis(200),
        ..cfg
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    cancel.cancel();
    let _ = task.await;
}

/// Executions that rightly stay open (here ticks buffered behind a running one) fill a
/// whole sweep batch; an orphan behind them is still found by a later sweep.
#[tokio::test]
async fn orphans_behind_a_full_sweep_batch_are_found() {
    use weir::store::Execution;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    for id in ["busy", "orph"] {
        let mut schedule = every_second(id, "bticks");
        schedule.cron = "0 0 1 1 *".into();
        schedule.delivery = Delivery::AtLeastOnce;
        register(store.as_ref(), &schedule, 1).await.unwrap();
    }
    let tomorrow = chrono::Utc::now().timestamp_millis() + 86_400_000;
    let running = Execution {
        status: ExecutionStatus::Running,
        updated_ms: tomorrow,
        ..unemitted("busy", 5_000)
    };
    store.claim_execution(&running).await.unwrap();
    for at in [6_000, 7_000, 8_000] {
        let buffered = Execution {
            status: ExecutionStatus::Buffered,
            ..unemitted("busy", at)
        };
        store.claim_execution(&buffered).await.unwrap();
    }
    // Changed after the buffered ones' place in the index (0), so it comes last.
    let orphan = Execution {
        updated_ms: 1,
        ..unemitted("orph", 1_000)
    };
    store.claim_execution(&orphan).await.unwrap();
    let cfg = SchedulerConfig {
        sweep_batch: 2,
        ..config("a", 0)
    };
    sweep_a_while(&store, &broker, cfg).await;
    let ticks = ticks(&broker, "bticks");
    assert_eq!(ticks.len(), 1, "{ticks:?}");
    assert_eq!(ticks[0].tick_id, "orph@1000");
    assert_eq!(ticks[0].attempt, 2);
    for at in [6_000, 7_000, 8_000] {
        let waiting = store.get_execution("busy", at).await.unwrap().unwrap();
        assert_eq!(waiting.status, ExecutionStatus::Buffered);
    }
}

#[tokio::test]
async fn orphaned_executions_are_re_emitted_or_failed_at_the_stored_cap() {
    use weir::store::Execution;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let mut schedule = every_second("orph", "oticks");
    // Far in the future: only the orphans fire during the test.
    schedule.cron = "0 0 1 1 *".into();
    schedule.delivery = Delivery::AtLeastOnce;
    register(store.as_ref(), &schedule, 1).await.unwrap();
    store
        .claim_execution(&unemitted("orph", 1_000))
        .await
        .unwrap();
    let last_attempt = Execution {
        attempt: 3,
        ..unemitted("orph", 2_000)
    };
    store.claim_execution(&last_attempt).await.unwrap();
    // One of a schedule removed since: never emitted, and failed.
    store
        .claim_execution(&unemitted("gone", 1_000))
        .await
        .unwrap();
    sweep_a_while(&store, &broker, config("a", 0)).await;
    let ticks = ticks(&broker, "oticks");
    assert_eq!(ticks.len(), 1);
    assert_eq!(ticks[0].tick_id, "orph@1000");
    assert_eq!(ticks[0].attempt, 2);
    let retried = store.get_execution("orph", 1_000).await.unwrap().unwrap();
    assert_eq!(retried.status, ExecutionStatus::Completed);
    let given_up = store.get_execution("orph", 2_000).await.unwrap().unwrap();
    assert_eq!(given_up.status, ExecutionStatus::Failed);
    let removed = store.get_execution("gone", 1_000).await.unwrap().unwrap();
    assert_eq!(removed.status, ExecutionStatus::Failed);
    // Nothing is left for the next sweep to look at.
    assert!(store
        .open_executions(i64::MAX, 0, 10)
        .await
        .unwrap()
        .is_empty());
}

/// An at_most_once tick claimed by a master that died before recording it may have
/// gone out: it is marked missed, never emitted again.
#[tokio::test]
async fn an_at_most_once_tick_of_a_dead_master_is_missed_not_re_emitted() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let mut schedule = every_second("once", "mticks");
    schedule.cron = "0 0 1 1 *".into();
    assert_eq!(schedule.delivery, Delivery::AtMostOnce);
    register(store.as_ref(), &schedule, 1).await.unwrap();
    store
        .claim_execution(&unemitted("once", 1_000))
        .await
        .unwrap();
    sweep_a_while(&store, &broker, config("a", 0)).await;
    assert!(ticks(&broker, "mticks").is_empty());
    let record = store.get_execution("once", 1_000).await.unwrap().unwrap();
    assert_eq!(record.status, ExecutionStatus::Missed);
    assert!(store
        .open_executions(i64::MAX, 0, 10)
        .await
        .unwrap()
        .is_empty());
}

/// An at_most_once workflow tick a dead master claimed and did emit has started its
/// workflow execution: the record takes the workflow's status rather than `missed`, so
/// the overlap policy sees it running, and it is not emitted again.
#[tokio::test(start_paused = true)]
async fn an_at_most_once_workflow_tick_of_a_dead_master_that_went_out_takes_its_workflows_status() {
    use weir::cron::scheduler::{register_at, TokioClock};
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new("wf", "0 0 1 1 *", "UTC");
    schedule.target = Target::Workflow("report".into());
    assert_eq!(schedule.delivery, Delivery::AtMostOnce);
    register_at(store.as_ref(), &schedule, 1, at("2026-01-01T00:00:30Z"))
        .await
        .unwrap();
    let minute = at("2026-01-01T00:01:00Z").timestamp_millis();
    store
        .claim_execution(&unemitted("wf", minute))
        .await
        .unwrap();
    workflows_running(&store, "wf", &[1]).await;
    let cfg = SchedulerConfig {
        clock,
        ..config("a", 0)
    };
    sweep_a_while(&store, &broker, cfg).await;
    assert!(ticks(&broker, "weir.workflows.report.start").is_empty());
    let record = store.get_execution("wf", minute).await.unwrap().unwrap();
    assert_eq!(record.status, ExecutionStatus::Running);
}

/// Takes nothing: every acknowledgement fails, as when the broker went away mid-send.
struct Unacknowledged;

#[async_trait::async_trait]
impl weir::transport::Sink for Unacknowledged {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        Err(weir::transport::TransportError::Publish {
            topic: message.topic.to_string(),
            source: "no acknowledgement".into(),
            retryable: true,
        })
    }
}

#[tokio::test]
async fn an_at_most_once_tick_whose_acknowledgement_failed_is_never_sent_again() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    register(store.as_ref(), &every_second("flaky", "fticks"), 1)
        .await
        .unwrap();
    let cfg = SchedulerConfig {
        orphan_after: Duration::from_millis(200),
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let failing = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(Unacknowledged), cfg.clone()).run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cancel.cancel();
    let _ = failing.await;
    let missed: Vec<i64> = store
        .executions("flaky", 10)
        .await
        .unwrap()
        .executions
        .iter()
        .filter(|e| e.status == ExecutionStatus::Missed)
        .map(|e| e.scheduled_ms)
        .collect();
    assert!(!missed.is_empty());
    // A healthy master sweeping for orphans sends none of them.
    sweep_a_while(&store, &broker, cfg).await;
    let sent: Vec<i64> = ticks(&broker, "fticks")
        .iter()
        .map(|t| t.scheduled_time_ms)
        .collect();
    assert!(
        missed.iter().all(|m| !sent.contains(m)),
        "missed {missed:?}, sent {sent:?}"
    );
}

fn at(s: &str) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::parse_from_rfc3339(s)
        .unwrap()
        .with_timezone(&chrono::Utc)
}

/// Runs a scheduler on a clock that follows tokio's paused time from `start`, for `run`.
async fn run_on_paused_clock(
    store: Arc<MemoryStore>,
    broker: &MemoryBroker,
    clock: Arc<weir::cron::scheduler::TokioClock>,
    run: Duration,
) {
    let cfg = SchedulerConfig {
        clock,
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let task =
        tokio::spawn(Scheduler::new(store, Arc::new(broker.clone()), cfg).run(cancel.clone()));
    tokio::time::sleep(run).await;
    cancel.cancel();
    let _ = task.await;
}

#[tokio::test(start_paused = true)]
async fn missed_times_after_downtime_follow_the_catch_up_policy() {
    use weir::cron::scheduler::{declare, register_at, Clock, TokioClock};
    use weir::cron::CatchUp;
    let cases = [
        (CatchUp::Skip, vec!["2026-01-01T06:00:00Z"]),
        (
            CatchUp::Latest,
            vec!["2026-01-01T05:00:00Z", "2026-01-01T06:00:00Z"],
        ),
        (
            CatchUp::All { cap: 3 },
            vec![
                "2026-01-01T03:00:00Z",
                "2026-01-01T04:00:00Z",
                "2026-01-01T05:00:00Z",
                "2026-01-01T06:00:00Z",
            ],
        ),
    ];
    // Each also with the schedule declared again at the restart, as a node's config
    // does at every start: its stored next fire time stays, so the same times fire.
    for ((policy, expected), again) in cases
        .into_iter()
        .flat_map(|case| [false, true].map(|again| (case.clone(), again)))
    {
        let store = Arc::new(MemoryStore::new());
        let broker = MemoryBroker::default();
        let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:30:00Z")));
        let mut schedule = Schedule::new("hourly", "0 * * * *", "UTC");
        schedule.target = Target::Topic("hourly.ticks".into());
        schedule.catchup = policy;
        let next = register_at(store.as_ref(), &schedule, 1, clock.now())
            .await
            .unwrap();
        assert_eq!(next, Some(at("2026-01-01T01:00:00Z")));
        // Nobody runs a scheduler until 05:10.
        tokio::time::sleep(Duration::from_secs(4 * 3600 + 40 * 60)).await;
        if again {
            let declared = declare(store.as_ref(), &schedule, 1).await.unwrap();
            assert_eq!(declared.next, Some(at("2026-01-01T01:00:00Z")));
            assert!(!declared.kept_paused);
        }
        // Then one runs past 06:00.
        run_on_paused_clock(
            store.clone(),
            &broker,
            clock.clone(),
            Duration::from_secs(55 * 60),
        )
        .await;
        let fired: Vec<String> = ticks(&broker, "hourly.ticks")
            .iter()
            .map(|t| {
                weir::cron::format_instant(
                    chrono::DateTime::from_timestamp_millis(t.scheduled_time_ms).unwrap(),
                )
            })
            .collect();
        assert_eq!(fired, expected, "{policy:?}, declared again: {again}");
    }
}

/// Declaring again: a changed definition starts from now, a pause made in the store
/// outlasts the restart, and the config can pause.
#[tokio::test]
async fn declaring_a_schedule_again_keeps_a_pause_and_takes_a_new_definition() {
    use weir::cron::scheduler::{declare, register, set_enabled};
    let store = MemoryStore::new();
    let schedule = Schedule::new("nightly", "0 2 * * *", "UTC");
    let far = chrono::DateTime::parse_from_rfc3339("2000-01-01T02:00:00Z").unwrap();
    register(&store, &schedule, 1).await.unwrap();
    store
        .set_next_fire(0, "nightly", Some(far.timestamp_millis()))
        .await
        .unwrap();
    // Unchanged: the stored position stays.
    let declared = declare(&store, &schedule, 1).await.unwrap();
    assert_eq!(
        declared.next.map(|t| t.timestamp_millis()),
        Some(far.timestamp_millis())
    );
    // Changed: from now.
    let mut changed = schedule.clone();
    changed.cron = "0 3 * * *".into();
    let declared = declare(&store, &changed, 1).await.unwrap();
    assert!(declared.next.unwrap() > chrono::Utc::now());
    assert_eq!(
        store.get_schedule("nightly").await.unwrap(),
        Some(changed.clone())
    );
    // Paused through the store: stays paused, changed or not.
    assert!(set_enabled(&store, "nightly", false, 1).await.unwrap());
    for declaring in [&changed, &schedule] {
        let declared = declare(&store, declaring, 1).await.unwrap();
        assert!(declared.kept_paused);
        assert_eq!(declared.next, None);
        let stored = store.get_schedule("nightly").await.unwrap().unwrap();
        assert!(!stored.enabled);
        assert_eq!(stored.cron, declaring.cron);
        assert_eq!(store.next_fire(0, "nightly").await.unwrap(), None);
    }
    // Resumed, then paused by the config.
    assert!(set_enabled(&store, "nightly", true, 1).await.unwrap());
    let mut off = schedule.clone();
    off.enabled = false;
    let declared = declare(&store, &off, 1).await.unwrap();
    assert!(!declared.kept_paused);
    assert_eq!(declared.next, None);
    assert_eq!(store.next_fire(0, "nightly").await.unwrap(), None);
}

/// A pause the config made is the config's to lift: declared enabled again, the schedule
/// fires from now. An operator's pause made meanwhile is not.
#[tokio::test]
async fn a_schedule_the_config_paused_resumes_when_the_config_enables_it() {
    use weir::cron::scheduler::{declare, set_enabled};
    let store = MemoryStore::new();
    let schedule = Schedule::new("weekly", "0 2 * * 1", "UTC");
    let mut off = schedule.clone();
    off.enabled = false;
    let declared = declare(&store, &off, 1).await.unwrap();
    assert_eq!(declared.next, None);
    let declared = declare(&store, &schedule, 1).await.unwrap();
    assert!(!declared.kept_paused);
    assert!(declared.next.unwrap() > chrono::Utc::now());
    assert!(store.get_schedule("weekly").await.unwrap().unwrap().enabled);
    // Paused by the config, then by an operator: the config no longer lifts it.
    declare(&store, &off, 1).await.unwrap();
    assert!(set_enabled(&store, "weekly", false, 1).await.unwrap());
    for declaring in [&off, &schedule] {
        declare(&store, declaring, 1).await.unwrap();
    }
    assert!(!store.get_schedule("weekly").await.unwrap().unwrap().enabled);
    assert_eq!(store.next_fire(0, "weekly").await.unwrap(), None);
}

/// Records the workflow executions of a schedule's ticks as running, as a state manager
/// would once it started them, so the scheduler sees them in progress.
async fn workflows_running(store: &MemoryStore, schedule: &str, minutes: &[i64]) {
    for m in minutes {
        let scheduled = at("2026-01-01T00:00:00Z").timestamp_millis() + m * 60_000;
        let execution = weir::dispatch::WorkflowExecution {
            id: format!("{schedule}@{scheduled}"),
            workflow: "report".into(),
            status: weir::dispatch::RunStatus::Running,
            context: serde_json::json!({}),
            tasks: Default::default(),
            origin: None,
            created_ms: scheduled,
            updated_ms: scheduled,
            version: 1,
        };
        assert!(store.create_workflow_execution(&execution).await.unwrap());
    }
}

#[tokio::test(start_paused = true)]
async fn overlap_skip_drops_firings_while_the_previous_one_runs() {
    use weir::cron::scheduler::{register_at, Clock, TokioClock};
    use weir::cron::Overlap;
    for (overlap, expected_ticks) in [(Overlap::Skip, 1), (Overlap::Allow, 3)] {
        let store = Arc::new(MemoryStore::new());
        let broker = MemoryBroker::default();
        let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
        let mut schedule = Schedule::new("wf", "* * * * *", "UTC");
        // Workflow executions stay running until their workflow completes.
        schedule.target = Target::Workflow("report".into());
        schedule.overlap = overlap;
        register_at(store.as_ref(), &schedule, 1, clock.now())
            .await
            .unwrap();
        workflows_running(&store, "wf", &[1, 2, 3]).await;
        run_on_paused_clock(store.clone(), &broker, clock, Duration::from_secs(3 * 60)).await;
        assert_eq!(
            ticks(&broker, "weir.workflows.report.start").len(),
            expected_ticks,
            "{overlap:?}"
        );
        let history = store.executions("wf", 10).await.unwrap().executions;
        let skipped = history
            .iter()
            .filter(|e| e.status == ExecutionStatus::Skipped)
            .count();
        assert_eq!(skipped, 3 - expected_ticks, "{overlap:?}");
    }
}

/// A run longer than ten firings: the firings it made skip fill the newest records, and
/// the running one is still found behind them.
#[tokio::test(start_paused = true)]
async fn overlap_skip_holds_through_more_skipped_firings_than_it_reads_at_first() {
    use weir::cron::scheduler::{register_at, Clock, TokioClock};
    use weir::cron::Overlap;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new("long", "* * * * *", "UTC");
    schedule.target = Target::Workflow("report".into());
    schedule.overlap = Overlap::Skip;
    register_at(store.as_ref(), &schedule, 1, clock.now())
        .await
        .unwrap();
    // Minute 1's workflow runs throughout.
    workflows_running(&store, "long", &[1]).await;
    run_on_paused_clock(store.clone(), &broker, clock, Duration::from_secs(14 * 60)).await;
    assert_eq!(ticks(&broker, "weir.workflows.report.start").len(), 1);
    let history = store.executions("long", 100).await.unwrap().executions;
    let skipped = history
        .iter()
        .filter(|e| e.status == ExecutionStatus::Skipped)
        .count();
    assert_eq!(skipped, 13);
}

#[tokio::test(start_paused = true)]
async fn overlap_buffer_one_holds_one_firing_until_the_running_one_ends() {
    use weir::cron::scheduler::{register_at, Clock, TokioClock};
    use weir::cron::Overlap;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new("buf", "* * * * *", "UTC");
    schedule.target = Target::Workflow("report".into());
    schedule.overlap = Overlap::BufferOne;
    register_at(store.as_ref(), &schedule, 1, clock.now())
        .await
        .unwrap();
    workflows_running(&store, "buf", &[1, 2]).await;
    let cfg = SchedulerConfig {
        clock: clock.clone(),
        orphan_after: Duration::from_secs(2),
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    // 00:01 fires, 00:02 is buffered, 00:03 is skipped.
    tokio::time::sleep(Duration::from_secs(3 * 60)).await;
    let status = |ms: i64| {
        let store = store.clone();
        async move {
            store
                .get_execution("buf", ms)
                .await
                .unwrap()
                .unwrap()
                .status
        }
    };
    let minute = |m: i64| at("2026-01-01T00:00:00Z").timestamp_millis() + m * 60_000;
    assert_eq!(status(minute(1)).await, ExecutionStatus::Running);
    assert_eq!(status(minute(2)).await, ExecutionStatus::Buffered);
    assert_eq!(status(minute(3)).await, ExecutionStatus::Skipped);
    assert_eq!(ticks(&broker, "weir.workflows.report.start").len(), 1);
    // The running workflow completes: the buffered firing goes out.
    let mut first = store
        .get_execution("buf", minute(1))
        .await
        .unwrap()
        .unwrap();
    first.status = ExecutionStatus::Completed;
    store.put_execution(&first, None).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    cancel.cancel();
    let _ = task.await;
    assert_eq!(status(minute(2)).await, ExecutionStatus::Running);
    let sent: Vec<i64> = ticks(&broker, "weir.workflows.report.start")
        .iter()
        .map(|t| t.scheduled_time_ms)
        .collect();
    assert_eq!(sent, vec![minute(1), minute(2)]);
}

/// Hands ticks to the broker, and takes shard 0's lease from its master as the tick
/// scheduled at `depose_at` goes out, so the master's record of the emission is refused.
struct DeposingOnSend {
    broker: MemoryBroker,
    store: Arc<MemoryStore>,
    depose_at: i64,
}

#[async_trait::async_trait]
impl weir::transport::Sink for DeposingOnSend {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        let tick: CronTick = decode(&message.payload).expect("ticks are Avro CronTick records");
        if tick.scheduled_time_ms == self.depose_at {
            let held = self.store.current_lease("cron:shard:0").await.unwrap();
            self.store.release_lease(&held.unwrap()).await.unwrap();
            let usurper = self
                .store
                .acquire_lease("cron:shard:0", "usurper", Duration::from_secs(1))
                .await
                .unwrap();
            assert!(usurper.is_some());
        }
        self.broker.publish(message).await
    }
}

/// A buffered `at_most_once` tick sent by a master deposed before it could record the
/// sending is not sent again by the next master.
#[tokio::test(start_paused = true)]
async fn a_buffered_at_most_once_tick_whose_record_failed_is_not_sent_again() {
    use weir::cron::scheduler::{register_at, Clock, TokioClock};
    use weir::cron::Overlap;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new("bufamo", "* * * * *", "UTC");
    schedule.target = Target::Workflow("report".into());
    schedule.overlap = Overlap::BufferOne;
    assert_eq!(schedule.delivery, Delivery::AtMostOnce);
    register_at(store.as_ref(), &schedule, 1, clock.now())
        .await
        .unwrap();
    workflows_running(&store, "bufamo", &[1, 2]).await;
    let minute = |m: i64| at("2026-01-01T00:00:00Z").timestamp_millis() + m * 60_000;
    let sink = DeposingOnSend {
        broker: broker.clone(),
        store: store.clone(),
        depose_at: minute(2),
    };
    let cfg = SchedulerConfig {
        clock: clock.clone(),
        orphan_after: Duration::from_secs(2),
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(Scheduler::new(store.clone(), Arc::new(sink), cfg).run(cancel.clone()));
    // 00:01 fires and 00:02 is buffered behind it.
    tokio::time::sleep(Duration::from_secs(100)).await;
    let mut first = store
        .get_execution("bufamo", minute(1))
        .await
        .unwrap()
        .unwrap();
    first.status = ExecutionStatus::Completed;
    store.put_execution(&first, None).await.unwrap();
    // The buffered tick goes out as its master is deposed; the master takes its shard
    // back once the usurper's lease lapses, and sweeps again.
    tokio::time::sleep(Duration::from_secs(20)).await;
    cancel.cancel();
    let _ = task.await;
    let sent: Vec<i64> = ticks(&broker, "weir.workflows.report.start")
        .iter()
        .map(|t| t.scheduled_time_ms)
        .filter(|&t| t <= minute(2))
        .collect();
    assert_eq!(sent, vec![minute(1), minute(2)]);
    // Its workflow execution (made running above) shows it went out.
    let buffered = store
        .get_execution("bufamo", minute(2))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(buffered.status, ExecutionStatus::Running);
}

#[tokio::test(start_paused = true)]
async fn a_workflow_tick_whose_execution_never_started_is_emitted_again() {
    use weir::cron::scheduler::{register_at, Clock, TokioClock};
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new("lost", "0 * * * *", "UTC");
    schedule.target = Target::Workflow("report".into());
    schedule.delivery = Delivery::AtLeastOnce;
    register_at(store.as_ref(), &schedule, 1, clock.now())
        .await
        .unwrap();
    let cfg = SchedulerConfig {
        clock: clock.clone(),
        orphan_after: Duration::from_secs(10),
        max_attempts: 2,
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    // 01:00 fires; nothing starts its workflow, so it is emitted again, then failed.
    tokio::time::sleep(Duration::from_secs(60 * 60 + 60)).await;
    cancel.cancel();
    let _ = task.await;
    let sent = ticks(&broker, "weir.workflows.report.start");
    assert_eq!(sent.len(), 2, "first emission and one re-emission");
    assert_eq!(sent[0].tick_id, sent[1].tick_id);
    assert_eq!(sent[1].attempt, 2);
    let scheduled = at("2026-01-01T01:00:00Z").timestamp_millis();
    let record = store
        .get_execution("lost", scheduled)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.status, ExecutionStatus::Failed);
}

/// A workflow started by a tick that ends failed sets the tick's cron execution
/// `failed`, its error naming the workflow execution (the tick id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cron_triggered_workflow_that_fails_fails_its_cron_execution() {
    use std::time::Instant;
    use weir::cron::Overlap;
    use weir::dispatch::{DispatchSettings, Router, RunStatus, StateManager, TaskSpec, Workflow};
    use weir::worker::{HandlerRegistry, Worker, WorkerSettings};
    const WAIT: Duration = Duration::from_secs(60);
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let cancel = CancellationToken::new();
    let results_topic = "weir.results.doomed".to_string();
    // Its only task always fails (`builtin::fail` without `fail_times`), with no retry.
    let only = TaskSpec {
        max_attempts: 1,
        backoff: Duration::from_millis(50),
        timeout: Duration::from_secs(10),
        ..TaskSpec::new("only", "builtin::fail")
    };
    let w = Workflow::new("doomed", vec![only]).expect("valid workflow");
    let workflows = vec![w.clone()];
    let manager = StateManager::new(
        store.clone(),
        Arc::new(broker.clone()),
        workflows.clone(),
        Router::new(Vec::new(), "cron").unwrap(),
        DispatchSettings {
            results_topic: results_topic.clone(),
        },
    );
    tokio::spawn(manager.run(Arc::new(broker.clone()), cancel.clone()));
    let worker = Worker::new(
        Arc::new(broker.clone()),
        store.clone(),
        HandlerRegistry::with_builtins(Arc::new(broker.clone())),
        workflows.clone(),
        WorkerSettings {
            executor: "cron".into(),
            concurrency: 4,
            worker_id: "cron-worker".into(),
            results_topic,
            tenant: None,
        },
    );
    tokio::spawn(worker.run(cancel.clone()));
    let mut schedule = Schedule::new("every-second", "* * * * * *", "UTC");
    schedule.target = Target::Workflow(w.name.clone());
    schedule.overlap = Overlap::Allow;
    schedule.payload = serde_json::json!({"from": "cron"});
    register(store.as_ref(), &schedule, 1).await.unwrap();
    let scheduler_stop = CancellationToken::new();
    let scheduler = tokio::spawn(
        Scheduler::new(
            store.clone(),
            Arc::new(broker.clone()),
            SchedulerConfig {
                lease_ttl: Duration::from_millis(900),
                ..SchedulerConfig::new("node")
            },
        )
        .run(scheduler_stop.clone()),
    );
    tokio::time::sleep(Duration::from_millis(2300)).await;
    scheduler_stop.cancel();
    scheduler.await.unwrap();
    let fired = store
        .executions(&schedule.id, 100)
        .await
        .unwrap()
        .executions;
    assert!(!fired.is_empty(), "a schedule every second never fired");
    // Each tick started its workflow execution, which failed.
    let deadline = Instant::now() + WAIT;
    for tick in &fired {
        loop {
            let run = store.get_workflow_execution(&tick.tick_id).await.unwrap();
            if let Some(run) = run.filter(|r| r.status != RunStatus::Running) {
                assert_eq!(run.status, RunStatus::Failed, "{run:?}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "execution {} did not finish",
                tick.tick_id
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // The cron executions take their workflow's outcome.
    let executions = loop {
        let executions = store
            .executions(&schedule.id, 100)
            .await
            .unwrap()
            .executions;
        if executions
            .iter()
            .all(|e| e.status != ExecutionStatus::Running)
        {
            break executions;
        }
        assert!(Instant::now() < deadline, "cron executions: {executions:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(executions.len(), fired.len());
    for execution in &executions {
        assert_eq!(execution.status, ExecutionStatus::Failed, "{executions:?}");
        assert_eq!(
            execution.error.as_deref(),
            Some(format!("workflow execution {} failed", execution.tick_id).as_str()),
            "{execution:?}"
        );
    }
    cancel.cancel();
}

/// Eight shards over three nodes of one priority: each masters two or three; when one
/// dies, its shards, and only those, move to the others.
#[tokio::test]
async fn equal_nodes_share_the_shards_and_a_dead_ones_move() {
    use std::collections::BTreeMap;
    use weir::cron::scheduler::shard_of;
    const SHARDS: u32 = 8;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    // One every-second schedule per shard.
    let mut ids: BTreeMap<u32, String> = BTreeMap::new();
    for k in 0.. {
        let id = format!("spread{k}");
        ids.entry(shard_of(&id, SHARDS)).or_insert(id);
        if ids.len() == SHARDS as usize {
            break;
        }
    }
    for (shard, id) in &ids {
        let mut schedule = every_second(id, "spread");
        schedule.delivery = Delivery::AtLeastOnce;
        register(store.as_ref(), &schedule, SHARDS).await.unwrap();
        assert_eq!(shard_of(id, SHARDS), *shard);
    }
    let start = |node: &str| {
        let cfg = SchedulerConfig {
            shards: SHARDS,
            ..config(node, 0)
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(
            Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
        );
        (cancel, task)
    };
    let nodes: Vec<_> = ["node-a", "node-b", "node-c"]
        .iter()
        .map(|n| (n.to_string(), start(n)))
        .collect();
    // Who emitted each shard's ticks scheduled in the last second seen.
    let masters = |broker: &MemoryBroker| -> BTreeMap<u32, String> {
        let ticks = ticks(broker, "spread");
        let newest = ticks.iter().map(|t| t.scheduled_time_ms).max().unwrap_or(0);
        ticks
            .iter()
            .filter(|t| t.scheduled_time_ms == newest)
            .map(|t| (shard_of(&t.schedule_id, SHARDS), t.node_id.clone()))
            .collect()
    };
    let settled = |broker: &MemoryBroker, expected: usize| {
        let broker = broker.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                tokio::time::sleep(Duration::from_millis(1200)).await;
                let m = masters(&broker);
                let per_node = m.values().collect::<std::collections::BTreeSet<_>>().len();
                if m.len() == SHARDS as usize && per_node == expected {
                    return m;
                }
                assert!(std::time::Instant::now() < deadline, "not settled: {m:?}");
            }
        }
    };
    let before = settled(&broker, 3).await;
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for node in before.values() {
        *count.entry(node.as_str()).or_default() += 1;
    }
    assert!(count.values().all(|c| (2..=3).contains(c)), "{before:?}");
    // node-c dies without releasing anything.
    let (_, (_, task)) = &nodes[2];
    task.abort();
    let after = settled(&broker, 2).await;
    for (shard, node) in &before {
        if node != "node-c" {
            assert_eq!(&after[shard], node, "shard {shard} moved needlessly");
        } else {
            assert_ne!(after[shard], "node-c");
        }
    }
    for (_, (cancel, _)) in &nodes {
        cancel.cancel();
    }
}

/// A change to one schedule leaves the others known: a store outage right after it
/// still has the master fire the `at_least_once` ones from what it knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_right_after_a_schedule_change_still_fires_the_others() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let mut least = every_second("least", "lticks");
    least.delivery = weir::cron::Delivery::AtLeastOnce;
    register(store.as_ref(), &least, 1).await.unwrap();
    let cfg = SchedulerConfig {
        lease_ttl: Duration::from_secs(3),
        ..SchedulerConfig::new("a")
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ticks(&broker, "lticks").is_empty() {
        assert!(std::time::Instant::now() < deadline, "never fired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    register(store.as_ref(), &every_second("other", "oticks"), 1)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.set_reachable(false);
    let cut_at = chrono::Utc::now().timestamp_millis();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    cancel.cancel();
    let _ = task.await;
    let first_second_out = (cut_at / 1000 + 1) * 1000;
    let during: Vec<i64> = ticks(&broker, "lticks")
        .iter()
        .map(|t| t.scheduled_time_ms)
        .filter(|at| *at >= first_second_out)
        .collect();
    assert!(
        !during.is_empty(),
        "no at_least_once tick during the outage (cut at {cut_at})"
    );
}

/// A master that dies holding its lease leaves the shard unserved until the lease runs
/// out; the at_least_once ticks due meanwhile are late, not missed, whatever the catch-up
/// policy says of downtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_ticks_due_during_a_failover_are_all_emitted() {
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let mut schedule = every_second("f", "fticks");
    schedule.delivery = weir::cron::Delivery::AtLeastOnce;
    schedule.catchup = weir::cron::CatchUp::Skip;
    register(store.as_ref(), &schedule, 1).await.unwrap();
    let ttl = Duration::from_secs(3);
    let node = |name: &str, priority: i64| SchedulerConfig {
        priority,
        lease_ttl: ttl,
        ..SchedulerConfig::new(name)
    };
    let cancel = CancellationToken::new();
    let master = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), node("master", 5))
            .run(cancel.clone()),
    );
    let standby = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), node("standby", 1))
            .run(cancel.clone()),
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Killed: no lease released, nothing more recorded.
    master.abort();
    let died = chrono::Utc::now().timestamp_millis();
    tokio::time::sleep(ttl * 2 + Duration::from_secs(1)).await;
    cancel.cancel();
    let _ = standby.await;
    let ticks = ticks(&broker, "fticks");
    assert!(
        ticks.iter().any(|t| t.node_id == "standby"),
        "the standby took over"
    );
    let times: std::collections::BTreeSet<i64> =
        ticks.iter().map(|t| t.scheduled_time_ms).collect();
    let (first, last) = (*times.first().unwrap(), *times.last().unwrap());
    assert!(last - died > 3000, "the run goes on past the failover");
    for second in (first..=last).step_by(1000) {
        assert!(
            times.contains(&second),
            "no tick for {second} (master died at {died})"
        );
    }
}

/// A minutely schedule catching up what it missed (10 ticks at most), registered at
/// 00:00:30 and then stored again with a time zone this version's data lacks (as a newer
/// version might write it), and a scheduler running over it on a clock starting then.
struct GoneInvalid {
    store: Arc<MemoryStore>,
    broker: MemoryBroker,
    clock: Arc<weir::cron::scheduler::TokioClock>,
    schedule: Schedule,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl GoneInvalid {
    async fn start(id: &str) -> Self {
        use weir::cron::scheduler::{Clock, TokioClock};
        let store = Arc::new(MemoryStore::new());
        let broker = MemoryBroker::default();
        let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
        let mut schedule = Schedule::new(id, "* * * * *", "UTC");
        schedule.target = Target::Topic(format!("{id}.ticks"));
        schedule.catchup = weir::cron::CatchUp::All { cap: 10 };
        weir::cron::scheduler::register_at(store.as_ref(), &schedule, 1, clock.now())
            .await
            .unwrap();
        let mut invalid = schedule.clone();
        invalid.timezone = "Nowhere/Atlantis".into();
        store.put_schedule(&invalid).await.unwrap();
        let cfg = SchedulerConfig {
            clock: clock.clone(),
            ..config("a", 0)
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(
            Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
        );
        Self {
            store,
            broker,
            clock,
            schedule,
            cancel,
            task,
        }
    }

    /// Registers the schedule (valid, as first registered) again now.
    async fn register_again(&self) {
        use weir::cron::scheduler::Clock;
        weir::cron::scheduler::register_at(
            self.store.as_ref(),
            &self.schedule,
            1,
            self.clock.now(),
        )
        .await
        .unwrap();
    }

    /// Kills the scheduler (no lease released, nothing more recorded) and starts
    /// another, `node`, which becomes master once the dead one's lease runs out.
    fn fail_over(&mut self, node: &str) {
        self.task.abort();
        let cfg = SchedulerConfig {
            clock: self.clock.clone(),
            ..config(node, 0)
        };
        self.task = tokio::spawn(
            Scheduler::new(self.store.clone(), Arc::new(self.broker.clone()), cfg)
                .run(self.cancel.clone()),
        );
    }

    /// Stops the scheduler; the times of the ticks it sent, in order.
    async fn stop(self) -> Vec<i64> {
        self.cancel.cancel();
        let _ = self.task.await;
        fired_times(&self.broker, &format!("{}.ticks", self.schedule.id))
    }
}

/// The given times of 2026-01-01, in milliseconds.
fn minutes(times: &[&str]) -> Vec<i64> {
    times
        .iter()
        .map(|t| at(&format!("2026-01-01T{t}Z")).timestamp_millis())
        .collect()
}

/// A stored schedule invalid here for a while (written with a time zone this version's
/// data lacks, say) is looked at again a minute later; once it reads back, the times it
/// missed meanwhile are caught up as its policy says, not dropped.
#[tokio::test(start_paused = true)]
async fn a_schedule_invalid_for_a_while_catches_up_the_times_it_missed() {
    let run = GoneInvalid::start("minutely").await;
    // Invalid until 00:03:40, looked at again each minute meanwhile.
    tokio::time::sleep(Duration::from_secs(190)).await;
    assert!(ticks(&run.broker, "minutely.ticks").is_empty());
    run.store.put_schedule(&run.schedule).await.unwrap();
    tokio::time::sleep(Duration::from_secs(180)).await;
    let every_minute = minutes(&[
        "00:01:00", "00:02:00", "00:03:00", "00:04:00", "00:05:00", "00:06:00",
    ]);
    assert_eq!(run.stop().await, every_minute);
}

/// When a held-back schedule was first due is kept with its shard: a master dying
/// meanwhile leaves it to the next, which catches up from then once it reads back.
#[tokio::test(start_paused = true)]
async fn a_schedule_invalid_across_a_failover_catches_up_the_times_it_missed() {
    let mut run = GoneInvalid::start("failover").await;
    // Invalid from 00:01:00, looked at again at 00:02:00; its master dies at 00:02:10,
    // and the next one finds it still invalid at 00:03:00.
    tokio::time::sleep(Duration::from_secs(100)).await;
    run.fail_over("b");
    tokio::time::sleep(Duration::from_secs(90)).await;
    assert!(ticks(&run.broker, "failover.ticks").is_empty());
    // Valid again at 00:03:40.
    run.store.put_schedule(&run.schedule).await.unwrap();
    tokio::time::sleep(Duration::from_secs(150)).await;
    let every_minute = minutes(&[
        "00:01:00", "00:02:00", "00:03:00", "00:04:00", "00:05:00", "00:06:00",
    ]);
    assert_eq!(run.stop().await, every_minute);
}

/// A schedule held back in a shard past a lowered `[cron] shards` (its master died
/// before the count was lowered) moves with when it was first due, and once it reads
/// back the shard it moved to catches it up from then.
#[tokio::test(start_paused = true)]
async fn a_held_back_schedule_moved_out_of_a_stranded_shard_still_catches_up() {
    use weir::cron::scheduler::{shard_of, TokioClock};
    use weir::cron::HeldBack;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let id = (0..)
        .map(|i| format!("stranded{i}"))
        .find(|id| shard_of(id, 8) >= 1)
        .unwrap();
    let mut schedule = Schedule::new(&id, "* * * * *", "UTC");
    schedule.target = Target::Topic("stranded.ticks".into());
    schedule.catchup = weir::cron::CatchUp::All { cap: 10 };
    store.put_schedule(&schedule).await.unwrap();
    // First due at 00:01:00 while unreadable, to be looked at again at 00:03:00.
    let old = shard_of(&id, 8);
    let retry_ms = minutes(&["00:03:00"])[0];
    store.set_next_fire(old, &id, Some(retry_ms)).await.unwrap();
    let held = HeldBack {
        first_due_ms: minutes(&["00:01:00"])[0],
        retry_ms,
    };
    store.hold_back(old, &id, held).await.unwrap();
    let cfg = SchedulerConfig {
        clock: Arc::new(TokioClock::starting_at(at("2026-01-01T00:02:30Z"))),
        orphan_after: Duration::from_millis(200),
        ..config("a", 0)
    };
    run_for(&store, &broker, cfg, Duration::from_secs(60)).await;
    assert_eq!(
        fired_times(&broker, "stranded.ticks"),
        minutes(&["00:01:00", "00:02:00", "00:03:00"])
    );
    assert_eq!(
        store
            .held_back(old, std::slice::from_ref(&id))
            .await
            .unwrap(),
        [None]
    );
    assert_eq!(store.held_back(0, &[id]).await.unwrap(), [None]);
}

/// A held-back schedule the master read ahead of its retry time (cached then at the
/// time its shard files it under) catches up from when it was first due in local state
/// too: the store going away in the pass that catches it up, the time that pass lost is
/// fired from local state through the outage, with every time after.
#[tokio::test(start_paused = true)]
async fn a_held_back_schedule_read_ahead_catches_up_from_local_state_in_an_outage() {
    use weir::cron::scheduler::TokioClock;
    use weir::cron::HeldBack;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let mut schedule = Schedule::new("behind", "* * * * *", "UTC");
    schedule.target = Target::Topic("behind.ticks".into());
    schedule.catchup = weir::cron::CatchUp::All { cap: 10 };
    schedule.delivery = Delivery::AtLeastOnce;
    store.put_schedule(&schedule).await.unwrap();
    // First due at 00:01:00 while unreadable, to be looked at again at 00:03:00.
    let retry_ms = minutes(&["00:03:00"])[0];
    store
        .set_next_fire(0, "behind", Some(retry_ms))
        .await
        .unwrap();
    let held = HeldBack {
        first_due_ms: minutes(&["00:01:00"])[0],
        retry_ms,
    };
    store.hold_back(0, "behind", held).await.unwrap();
    let sink = CuttingOffOnSend {
        broker: broker.clone(),
        store: store.clone(),
        losing_the_first: true,
        sent: Default::default(),
    };
    let cfg = SchedulerConfig {
        clock: Arc::new(TokioClock::starting_at(at("2026-01-01T00:02:30Z"))),
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let node = tokio::spawn(Scheduler::new(store.clone(), Arc::new(sink), cfg).run(cancel.clone()));
    // To 00:04:10: the pass at 00:03:00 loses 00:01:00, and 00:04:00 falls in the outage.
    tokio::time::sleep(Duration::from_secs(100)).await;
    cancel.cancel();
    let _ = node.await;
    let fired: std::collections::BTreeSet<i64> =
        fired_times(&broker, "behind.ticks").into_iter().collect();
    for time in minutes(&["00:01:00", "00:02:00", "00:03:00", "00:04:00"]) {
        assert!(fired.contains(&time), "{time} not fired: {fired:?}");
    }
}

/// What the shard holds back of a schedule is read even while the master has that
/// schedule cached (from before another master held it back, or from a pass that read
/// it back and then failed to record): the master catches it up from when it was first
/// due, and forgets the entry.
#[tokio::test(start_paused = true)]
async fn a_schedule_cached_while_its_shard_held_it_back_still_catches_up() {
    use weir::cron::scheduler::TokioClock;
    use weir::cron::HeldBack;
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new("cached", "* * * * *", "UTC");
    schedule.target = Target::Topic("cached.ticks".into());
    schedule.catchup = weir::cron::CatchUp::All { cap: 10 };
    weir::cron::scheduler::register_at(store.as_ref(), &schedule, 1, at("2026-01-01T00:00:30Z"))
        .await
        .unwrap();
    let cfg = SchedulerConfig {
        clock,
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let node = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    // Fired at 00:01:00 and cached; then held back from 00:02:00, to be looked at again
    // at 00:03:00, as another master of the shard would have left it.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let retry_ms = minutes(&["00:03:00"])[0];
    store
        .set_next_fire(0, "cached", Some(retry_ms))
        .await
        .unwrap();
    let held = HeldBack {
        first_due_ms: minutes(&["00:02:00"])[0],
        retry_ms,
    };
    store.hold_back(0, "cached", held).await.unwrap();
    tokio::time::sleep(Duration::from_secs(140)).await;
    cancel.cancel();
    let _ = node.await;
    assert_eq!(
        fired_times(&broker, "cached.ticks"),
        minutes(&["00:01:00", "00:02:00", "00:03:00"])
    );
    assert_eq!(
        store.held_back(0, &["cached".to_string()]).await.unwrap(),
        [None]
    );
}

/// A schedule held back while invalid that reads back paused forgets when it was first
/// due: resumed later, it fires from its resumption on, not the times of its pause.
#[tokio::test(start_paused = true)]
async fn a_schedule_invalid_then_paused_does_not_catch_up_its_pause_when_resumed() {
    let run = GoneInvalid::start("resumed").await;
    // Invalid from 00:01:00, read back paused at the next look (00:03:00).
    tokio::time::sleep(Duration::from_secs(100)).await;
    let mut paused = run.schedule.clone();
    paused.enabled = false;
    run.store.put_schedule(&paused).await.unwrap();
    // Resumed at 00:05:10.
    tokio::time::sleep(Duration::from_secs(180)).await;
    run.register_again().await;
    tokio::time::sleep(Duration::from_secs(150)).await;
    assert_eq!(run.stop().await, minutes(&["00:06:00", "00:07:00"]));
}

/// A schedule held back while invalid, then deleted and registered again, starts afresh
/// from its registration: it does not catch up the times of the one it replaced.
#[tokio::test(start_paused = true)]
async fn a_schedule_invalid_then_registered_again_fires_from_its_registration() {
    let run = GoneInvalid::start("replaced").await;
    // Invalid from 00:01:00; deleted and registered again at 00:03:10.
    tokio::time::sleep(Duration::from_secs(160)).await;
    assert!(run.store.delete_schedule("replaced", 0).await.unwrap());
    run.register_again().await;
    tokio::time::sleep(Duration::from_secs(140)).await;
    assert_eq!(run.stop().await, minutes(&["00:04:00", "00:05:00"]));
}

/// A scheduler on a clock that follows tokio's paused time from 00:00:30, over a memory
/// store that can be cut off: for what a master fires from local state in an outage.
struct OnPausedClock {
    store: Arc<MemoryStore>,
    broker: MemoryBroker,
    clock: Arc<weir::cron::scheduler::TokioClock>,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl OnPausedClock {
    /// Registers `schedules`; the scheduler starts with [`Self::run`].
    async fn new(schedules: &[Schedule]) -> Self {
        let run = Self {
            store: Arc::new(MemoryStore::new()),
            broker: MemoryBroker::default(),
            clock: Arc::new(weir::cron::scheduler::TokioClock::starting_at(at(
                "2026-01-01T00:00:30Z",
            ))),
            cancel: CancellationToken::new(),
            task: None,
        };
        for schedule in schedules {
            run.register(schedule).await;
        }
        run
    }

    fn run(mut self) -> Self {
        let cfg = SchedulerConfig {
            clock: self.clock.clone(),
            ..config("a", 0)
        };
        let scheduler = Scheduler::new(self.store.clone(), Arc::new(self.broker.clone()), cfg);
        self.task = Some(tokio::spawn(scheduler.run(self.cancel.clone())));
        self
    }

    /// Registers `schedule`, made at_least_once and sent to `<id>.ticks`, now.
    async fn register(&self, schedule: &Schedule) {
        use weir::cron::scheduler::Clock;
        let mut schedule = schedule.clone();
        schedule.target = Target::Topic(format!("{}.ticks", schedule.id));
        schedule.delivery = Delivery::AtLeastOnce;
        weir::cron::scheduler::register_at(self.store.as_ref(), &schedule, 1, self.clock.now())
            .await
            .unwrap();
    }

    /// Stops the scheduler; the times of the ticks of schedule `id`, in order, each
    /// checked to have gone out no sooner than its time.
    async fn stop(self, id: &str) -> Vec<i64> {
        self.cancel.cancel();
        if let Some(task) = self.task {
            let _ = task.await;
        }
        let topic = format!("{id}.ticks");
        for tick in ticks(&self.broker, &topic) {
            assert!(
                tick.emitted_time_ms >= tick.scheduled_time_ms,
                "sent early: {tick:?}"
            );
        }
        fired_times(&self.broker, &topic)
    }
}

/// A master knows its shard's at_least_once schedules before they are first due: one
/// whose first fire time since the master took the shard falls in a store outage still
/// fires, from local state.
#[tokio::test(start_paused = true)]
async fn an_at_least_once_schedule_first_due_in_a_store_outage_fires_from_local_state() {
    let run = OnPausedClock::new(&[Schedule::new("rare", "* * * * *", "UTC")])
        .await
        .run();
    tokio::time::sleep(Duration::from_secs(10)).await;
    run.store.set_reachable(false);
    // To 00:01:20: the 00:01:00 tick falls in the outage.
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(run.stop("rare").await, minutes(&["00:01:00"]));
}

/// Hands ticks to the broker, and cuts the store off as the first one goes out: the
/// master's record of that emission, and of the schedule's next fire time, fails. With
/// `losing_the_first`, that first tick is lost too (its publish fails, for a reason that
/// may pass), so the pass that catches a schedule up publishes only the rest of its times.
struct CuttingOffOnSend {
    broker: MemoryBroker,
    store: Arc<MemoryStore>,
    losing_the_first: bool,
    sent: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl weir::transport::Sink for CuttingOffOnSend {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        self.store.set_reachable(false);
        let first = !self.sent.swap(true, std::sync::atomic::Ordering::SeqCst);
        if first && self.losing_the_first {
            return Err(weir::transport::TransportError::Publish {
                topic: message.topic.to_string(),
                source: "connection closed".into(),
                retryable: true,
            });
        }
        self.broker.publish(message).await
    }
}

/// Registers `schedule` (sent to `<id>.ticks`) `before` 00:00:30, runs a scheduler from
/// 00:00:30 to 00:00:35 that is cut off from the store as its first tick goes out, and
/// gives the times it fired.
async fn fired_through_an_outage_from_the_first_tick(
    schedule: &Schedule,
    before: chrono::Duration,
) -> std::collections::BTreeSet<i64> {
    use weir::cron::scheduler::{register_at, Clock, TokioClock};
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    register_at(store.as_ref(), schedule, 1, clock.now() - before)
        .await
        .unwrap();
    let sink = CuttingOffOnSend {
        broker: broker.clone(),
        store: store.clone(),
        losing_the_first: false,
        sent: Default::default(),
    };
    let cfg = SchedulerConfig {
        clock: clock.clone(),
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let task = tokio::spawn(Scheduler::new(store.clone(), Arc::new(sink), cfg).run(cancel.clone()));
    tokio::time::sleep(Duration::from_millis(5100)).await;
    cancel.cancel();
    let _ = task.await;
    fired_times(&broker, &format!("{}.ticks", schedule.id))
        .into_iter()
        .collect()
}

/// Second `s` of 2026-01-01T00:00, in ms.
fn second(s: i64) -> i64 {
    at("2026-01-01T00:00:00Z").timestamp_millis() + s * 1000
}

/// A schedule the master first meets already due (read in the pass that fires it, not
/// ahead of it) is known locally from then on: a store outage starting as that pass
/// emits its tick, before the pass records the next fire time, still has every later
/// second fired from local state.
#[tokio::test(start_paused = true)]
async fn an_at_least_once_schedule_read_as_it_fell_due_fires_from_local_state_in_an_outage() {
    let mut schedule = every_second("cut", "cut.ticks");
    schedule.delivery = Delivery::AtLeastOnce;
    // Due at 00:00:30, as the scheduler starts.
    let fired =
        fired_through_an_outage_from_the_first_tick(&schedule, chrono::Duration::milliseconds(500))
            .await;
    assert!(fired.contains(&second(30)), "the first tick: {fired:?}");
    for s in 31..=34 {
        assert!(
            fired.contains(&second(s)),
            "no tick for 00:00:{s} in the outage: {fired:?}"
        );
    }
}

/// As above, after downtime: a schedule the store files under a time an hour past, with
/// `catchup = "skip"`, is fired from local state through the outage from where a pass
/// with the store would fire it, not from every second of the hour it missed.
#[tokio::test(start_paused = true)]
async fn an_at_least_once_schedule_read_after_downtime_fires_from_local_state_by_its_catch_up_policy(
) {
    let mut schedule = every_second("stale", "stale.ticks");
    schedule.delivery = Delivery::AtLeastOnce;
    schedule.catchup = weir::cron::CatchUp::Skip;
    let fired =
        fired_through_an_outage_from_the_first_tick(&schedule, chrono::Duration::hours(1)).await;
    // Late by the failover grace at most (the lease TTL and a third, and the look-ahead).
    let missed: Vec<i64> = fired.iter().copied().filter(|t| *t < second(29)).collect();
    assert!(
        missed.is_empty(),
        "missed times fired: {} of them",
        missed.len()
    );
    for s in 31..=34 {
        assert!(
            fired.contains(&second(s)),
            "no tick for 00:00:{s} in the outage: {fired:?}"
        );
    }
}

/// A schedule changed is read afresh at the master's next look, not only when next due:
/// changed just before a store outage, it fires through the outage as changed.
#[tokio::test(start_paused = true)]
async fn an_at_least_once_schedule_changed_before_a_store_outage_fires_as_changed() {
    let run = OnPausedClock::new(&[Schedule::new("moved", "* * * * *", "UTC")])
        .await
        .run();
    tokio::time::sleep(Duration::from_secs(10)).await;
    // At 00:00:40: at second 30 of each minute from now on.
    run.register(&Schedule::new("moved", "30 * * * * *", "UTC"))
        .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    run.store.set_reachable(false);
    // To 00:01:50.
    tokio::time::sleep(Duration::from_secs(65)).await;
    assert_eq!(run.stop("moved").await, minutes(&["00:01:30"]));
}

/// A schedule its shard holds back (unreadable when it was due) sits in the shard at the
/// time it is to be looked at again, which need not be a fire time of it: fired from
/// local state, it fires at its own times only.
#[tokio::test(start_paused = true)]
async fn a_schedule_held_back_fires_from_local_state_at_its_own_times_only() {
    // At minute 2 of each hour; held back since 00:02:00 of the day before, to be looked
    // at again at 00:01:00.
    let run = OnPausedClock::new(&[Schedule::new("hourly", "2 * * * *", "UTC")]).await;
    let retry_ms = minutes(&["00:01:00"])[0];
    let held = weir::cron::HeldBack {
        first_due_ms: at("2025-12-31T00:02:00Z").timestamp_millis(),
        retry_ms,
    };
    run.store.hold_back(0, "hourly", held).await.unwrap();
    run.store
        .set_next_fire(0, "hourly", Some(retry_ms))
        .await
        .unwrap();
    let run = run.run();
    tokio::time::sleep(Duration::from_secs(10)).await;
    run.store.set_reachable(false);
    // To 00:02:20.
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert_eq!(run.stop("hourly").await, minutes(&["00:02:00"]));
}

/// Raising `[cron] shards` files a schedule a config declares again in its new shard,
/// while its old shard still holds it: the old shard's master moves it out as it reads
/// its shard ahead, rather than plan its ticks beside the new shard's master.
#[tokio::test(start_paused = true)]
async fn a_schedule_left_in_its_old_shard_after_the_count_was_raised_moves_out() {
    use weir::cron::scheduler::{register_at, shard_of, Clock, TokioClock};
    let id = (0..)
        .map(|i| format!("raised-{i}"))
        .find(|id| shard_of(id, 2) == 1)
        .unwrap();
    let store = Arc::new(MemoryStore::new());
    let broker = MemoryBroker::default();
    let clock = Arc::new(TokioClock::starting_at(at("2026-01-01T00:00:30Z")));
    let mut schedule = Schedule::new(&id, "* * * * *", "UTC");
    schedule.target = Target::Topic("raised.ticks".into());
    // Filed in shard 0 under one shard, then in shard 1 under two.
    for shards in [1, 2] {
        register_at(store.as_ref(), &schedule, shards, clock.now())
            .await
            .unwrap();
    }
    let cfg = SchedulerConfig {
        clock,
        shards: 2,
        ..config("a", 0)
    };
    let cancel = CancellationToken::new();
    let node = tokio::spawn(
        Scheduler::new(store.clone(), Arc::new(broker.clone()), cfg).run(cancel.clone()),
    );
    // To 00:02:50.
    tokio::time::sleep(Duration::from_secs(140)).await;
    cancel.cancel();
    let _ = node.await;
    assert_eq!(store.next_fire(0, &id).await.unwrap(), None);
    assert_eq!(
        store.next_fire(1, &id).await.unwrap(),
        Some(minutes(&["00:03:00"])[0])
    );
    assert_eq!(
        fired_times(&broker, "raised.ticks"),
        minutes(&["00:01:00", "00:02:00"])
    );
}

//! Distributed jobs on the memory backends, with several nodes in one process: messages
//! applied exactly once across hand-overs, timeouts that fell due while a partition had
//! no owner fired once, a stopped job's output kept through its owner's death, and
//! malformed messages and outputs too large for the broker dead-lettered without stopping
//! anything, a message placed on another partition than its job's dead-lettered, and
//! each due time's timeout fired once while partitions move.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TaskNode;
use serde_json::{json, Value};
use weir::jobs::{
    HandlerError, JobClient, JobEvent, JobHandler, JobHandlers, JobType, JobsStore, Step, Timer,
};
use weir::store::memory::MemoryStore;
use weir::store::Store;
use weir::transport::memory::MemoryBroker;
use weir::transport::{Broker, Outbound, PartitionedTopic};

const TYPE: &str = "counter";
const PARTITIONS: u32 = 6;

/// The job type every node of a [`Cluster`] serves, with `handler`.
fn job_type(handler: Arc<dyn JobHandler>) -> JobType {
    let mut job_type = JobType::new(TYPE, handler);
    job_type.partitions = PARTITIONS;
    job_type.lease_ttl = Duration::from_millis(600);
    job_type.output = Some("counter.out".into());
    // Fewer than the jobs of a partition: some leave memory and come back.
    job_type.max_jobs_in_memory = 4;
    job_type
}

struct Cluster {
    broker: Arc<dyn Broker>,
    memory: MemoryBroker,
    store: Arc<dyn Store>,
    topic: PartitionedTopic,
}

impl Cluster {
    async fn new() -> Self {
        Self::on(MemoryBroker::new(1)).await
    }

    async fn on(memory: MemoryBroker) -> Self {
        let broker: Arc<dyn Broker> = Arc::new(memory.clone());
        let handler = JobHandlers::default().get("builtin::count").unwrap();
        let topic = weir::jobs::topics(&job_type(handler), broker.as_ref())
            .await
            .unwrap();
        Self {
            broker,
            memory,
            store: Arc::new(MemoryStore::new()),
            topic,
        }
    }

    fn node(&self, id: &str) -> TaskNode {
        self.node_handling(id, JobHandlers::default().get("builtin::count").unwrap())
    }

    fn node_handling(&self, id: &str, handler: Arc<dyn JobHandler>) -> TaskNode {
        self.node_on(id, handler, self.store.clone())
    }

    /// A node writing through `store` rather than straight to the cluster's.
    fn node_on(
        &self,
        id: &str,
        handler: Arc<dyn JobHandler>,
        store: Arc<dyn JobsStore>,
    ) -> TaskNode {
        let job_type = job_type(handler);
        TaskNode::spawn(|stop| {
            weir::jobs::serve(
                job_type,
                self.topic.clone(),
                self.broker.clone(),
                store,
                id.to_string(),
                stop,
            )
        })
    }

    async fn client(&self) -> JobClient {
        JobClient::new(self.broker.as_ref(), TYPE, PARTITIONS)
            .await
            .unwrap()
    }

    async fn state(&self, id: &str) -> Option<Value> {
        weir::jobs::view(self.store.as_ref(), TYPE, id)
            .await
            .unwrap()
            .map(|v| v.state)
    }

    /// Waits until every job's `count` is `expected`; panics with the stragglers.
    async fn await_counts(&self, ids: &[String], expected: u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let mut behind = Vec::new();
            for id in ids {
                let count = self.state(id).await.and_then(|s| s["count"].as_u64());
                if count != Some(expected) {
                    behind.push((id.clone(), count));
                }
            }
            if behind.is_empty() {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "jobs not at {expected}: {behind:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn send_round(client: &JobClient, ids: &[String], round: u64) {
    for id in ids {
        client.send(id, &json!({ "round": round })).await.unwrap();
    }
}

#[tokio::test]
async fn every_message_is_applied_once_while_nodes_join_leave_and_die() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let ids: Vec<String> = (0..40).map(|i| format!("job-{i}")).collect();
    for id in &ids {
        client.put(id, &json!({})).await.unwrap();
    }
    let a = cluster.node("a");
    for round in 0..10 {
        send_round(&client, &ids, round).await;
    }
    cluster.await_counts(&ids, 10).await;
    // b joins: a hands half of the partitions over while messages keep coming.
    let b = cluster.node("b");
    for round in 10..20 {
        send_round(&client, &ids, round).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    cluster.await_counts(&ids, 20).await;
    // c joins, then a dies without handing anything over.
    let c = cluster.node("c");
    for round in 20..25 {
        send_round(&client, &ids, round).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    a.kill();
    for round in 25..35 {
        send_round(&client, &ids, round).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    cluster.await_counts(&ids, 35).await;
    // A rolling stop: b leaves cleanly, c is left with everything.
    b.stop().await;
    for round in 35..40 {
        send_round(&client, &ids, round).await;
    }
    cluster.await_counts(&ids, 40).await;
    // Nothing more arrives later: each count stays exactly at 40.
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.await_counts(&ids, 40).await;
    c.stop().await;
}

/// A node counting, through a store whose partition writes and loads fail on demand,
/// with 12 jobs put and sent one message each, counted.
async fn serving_through_a_flaky_store(
    cluster: &Cluster,
) -> (TaskNode, Arc<common::FlakyStore>, JobClient, Vec<String>) {
    let client = cluster.client().await;
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let count = JobHandlers::default().get("builtin::count").unwrap();
    let node = cluster.node_on("n", count, flaky.clone());
    let ids: Vec<String> = (0..12).map(|i| format!("job-{i}")).collect();
    for id in &ids {
        client.put(id, &json!({})).await.unwrap();
    }
    send_round(&client, &ids, 0).await;
    cluster.await_counts(&ids, 1).await;
    (node, flaky, client, ids)
}

/// On a broker partitioning topics itself, a job type's output topic has as many
/// partitions as its job topic, and each job's outputs land in the partition its
/// messages came from; an output topic already there keeps its count.
#[tokio::test]
async fn a_jobs_outputs_land_in_the_partition_its_messages_came_from() {
    let cluster = Cluster::new().await;
    let node = cluster.node("n");
    let client = cluster.client().await;
    let ids: Vec<String> = (0..24).map(|i| format!("job-{i}")).collect();
    for id in &ids {
        client.put(id, &json!({})).await.unwrap();
        client.stop(id).await.unwrap();
    }
    common::eventually("every job stopped", || async {
        cluster.memory.messages("counter.out").len() >= ids.len()
    })
    .await;
    let outputs = cluster.memory.messages("counter.out");
    for output in &outputs {
        let key = output.key.as_deref().expect("an output keyed by its job");
        assert_eq!(
            output.position.partition,
            cluster.topic.partition_of(key),
            "{:?}",
            String::from_utf8_lossy(key)
        );
    }
    let partitions: std::collections::HashSet<i32> =
        outputs.iter().map(|o| o.position.partition).collect();
    assert_eq!(partitions.len(), PARTITIONS as usize);
    node.stop().await;

    let memory = MemoryBroker::new(1);
    memory.partitioned("counter.out", 2).await.unwrap();
    let handler = JobHandlers::default().get("builtin::count").unwrap();
    weir::jobs::topics(&job_type(handler), &memory)
        .await
        .unwrap();
    let output = memory.partitioned("counter.out", 7).await.unwrap();
    assert_eq!(output.partitions, 2, "an existing output keeps its count");
}

#[tokio::test]
async fn a_batch_write_failing_for_a_moment_is_tried_again_and_repeats_no_output() {
    // A stop's output is published before the batch holding the stop is written. Were
    // a failed write to serve the partition again from the store, the stop would be
    // applied again and its output published a second time.
    let cluster = Cluster::new().await;
    let (node, flaky, client, ids) = serving_through_a_flaky_store(&cluster).await;
    // Two tries fail: 150 ms of pauses, within the 300 ms (half the lease TTL) a
    // partition tries its store calls for.
    flaky.fail_writes(2);
    for id in &ids {
        client.stop(id).await.unwrap();
    }
    common::eventually("the failing writes tried", || async {
        flaky.failures_left() == 0
    })
    .await;
    common::eventually("every job stopped", || async {
        cluster.memory.messages("counter.out").len() >= ids.len()
    })
    .await;
    // Long enough for a partition served again to have applied its stops again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let outputs = cluster.memory.messages("counter.out");
    assert_eq!(outputs.len(), ids.len(), "stop outputs repeated");
    for id in &ids {
        assert_eq!(cluster.state(id).await, None, "{id} was stopped");
    }
    node.stop().await;
}

#[tokio::test]
async fn a_jobs_load_failing_for_a_moment_is_tried_again_and_repeats_no_dead_letter() {
    // A message is dead-lettered at once, before its batch is written. Were a failed
    // load of a job later in the batch to serve the partition again from the store, the
    // message would be read again and dead-lettered a second time.
    let cluster = Cluster::new().await;
    let (node, flaky, client, ids) = serving_through_a_flaky_store(&cluster).await;
    node.stop().await;
    // A backlog for the next node, which has none of the jobs in memory: the message
    // after the unreadable one loads its job.
    let id = &ids[0];
    let sink = cluster.broker.sink();
    sink.publish(cluster.topic.outbound(id, "not json"))
        .await
        .unwrap();
    client.send(id, &json!(1)).await.unwrap();
    flaky.fail_loads(0, 2);
    let count = JobHandlers::default().get("builtin::count").unwrap();
    let next = cluster.node_on("next", count, flaky.clone());
    cluster.await_counts(std::slice::from_ref(id), 2).await;
    assert_eq!(flaky.failures_left(), 0);
    // Long enough for a partition served again to have read its messages again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let topic = weir::wire::job_topic(TYPE);
    let dead = cluster
        .memory
        .messages(&weir::wire::dead_letter_topic(&topic));
    assert_eq!(dead.len(), 1, "{dead:?}");
    next.stop().await;
}

#[tokio::test]
async fn a_hand_over_whose_write_fails_for_a_moment_still_writes_it() {
    // The write handing a partition over carries the release mark and what its last
    // batch applied: failing once, it is tried again before the lease is let go.
    let cluster = Cluster::new().await;
    let (node, flaky, client, ids) = serving_through_a_flaky_store(&cluster).await;
    flaky.fail_releases(PARTITIONS as usize);
    node.stop().await;
    assert_eq!(flaky.failures_left(), 0);
    for partition in 0..PARTITIONS as i32 {
        let snapshot = cluster.store.load_partition(TYPE, partition).await.unwrap();
        assert!(
            snapshot.released.is_some(),
            "partition {partition} handed over without its write"
        );
    }
    let next = cluster.node("next");
    send_round(&client, &ids, 1).await;
    cluster.await_counts(&ids, 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.await_counts(&ids, 2).await;
    next.stop().await;
}

#[tokio::test]
async fn partitions_working_off_a_backlog_longer_than_their_lease_keep_it() {
    // One thread, and a backlog that takes longer than the lease TTL to work off: the
    // lease keepers share the thread with loops whose sources are always ready. Should
    // they miss their renewals, partitions are taken back and start again under newer
    // tokens.
    const MESSAGES: u64 = 150_000;
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    // One job: its partition's loop has the whole backlog.
    let ids = ["job-0".to_string()];
    client.put(&ids[0], &json!({})).await.unwrap();
    for round in 0..MESSAGES {
        send_round(&client, &ids, round).await;
    }
    let started = tokio::time::Instant::now();
    let node = cluster.node("n");
    cluster.await_counts(&ids, MESSAGES).await;
    let ttl = Duration::from_millis(600);
    assert!(
        started.elapsed() > ttl,
        "the backlog took {:?}, within the lease TTL of {ttl:?}: make it longer",
        started.elapsed()
    );
    let group = weir::jobs::ownership_group(TYPE);
    for partition in 0..PARTITIONS as i32 {
        let name = weir::ownership::partition_lease(&group, partition);
        let lease = cluster.store.current_lease(&name).await.unwrap();
        let token = lease.map(|l| l.token);
        assert_eq!(token, Some(1), "partition {partition} changed hands");
    }
    node.stop().await;
}

/// A job put again replaces the one of its id, timeout and all: the old one's due
/// times fire nothing.
#[tokio::test]
async fn a_job_put_again_keeps_none_of_the_old_ones_timeout() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let node = cluster.node("a");
    client.put("t", &json!({ "every_ms": 200 })).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster
        .state("t")
        .await
        .and_then(|s| s["timeouts"].as_u64())
        .unwrap_or(0)
        < 1
    {
        assert!(tokio::time::Instant::now() < deadline, "no timeout fired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    client
        .put("t", &json!({ "every_ms": 60_000 }))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.state("t").await.map(|s| s["every_ms"].clone()) != Some(json!(60_000)) {
        assert!(tokio::time::Instant::now() < deadline, "never put again");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Several of the old due times' worth.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let state = cluster.state("t").await.unwrap();
    assert_eq!(state["timeouts"].as_u64().unwrap_or(0), 0, "{state}");
    node.stop().await;
}

#[tokio::test]
async fn a_timeout_due_while_its_partition_had_no_owner_fires_once_on_the_next() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let a = cluster.node("a");
    client
        .put("ticker", &json!({ "every_ms": 1500 }))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.state("ticker").await.is_none() {
        assert!(tokio::time::Instant::now() < deadline, "job never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a.kill();
    // Several due times' worth without an owner (the lease expires after 600 ms).
    tokio::time::sleep(Duration::from_millis(4000)).await;
    assert_eq!(cluster.state("ticker").await.unwrap()["timeouts"], 0);
    let b = cluster.node("b");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let timeouts = cluster.state("ticker").await.unwrap()["timeouts"]
            .as_u64()
            .unwrap();
        if timeouts > 0 {
            assert_eq!(
                timeouts, 1,
                "the missed due time fires once, not once per period"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timeout never fired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // It re-arms from the firing: the next one comes a period later.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let timeouts = cluster.state("ticker").await.unwrap()["timeouts"]
        .as_u64()
        .unwrap();
    assert_eq!(timeouts, 2);
    b.stop().await;
}

/// Numbers its due times: each timeout publishes the number of the due time it fired
/// for and arms the next, a period from the firing.
struct NumberedTicks;

const TICK: Duration = Duration::from_millis(100);

impl JobHandler for NumberedTicks {
    fn handle(&self, mut state: Value, event: &JobEvent) -> Result<Step, HandlerError> {
        match event {
            JobEvent::Start => {
                state["due"] = json!(1);
                Ok(Step::new(state).timer(Timer::After(TICK)))
            }
            JobEvent::Timeout => {
                let due = state["due"].as_u64().unwrap_or(0);
                state["due"] = json!(due + 1);
                Ok(Step::new(state)
                    .timer(Timer::After(TICK))
                    .output(json!({ "due": due })))
            }
            JobEvent::Message(_) | JobEvent::Stop => Ok(Step::new(state)),
        }
    }
}

#[tokio::test]
async fn each_due_time_fires_once_while_nodes_join_and_leave() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let ticks: Arc<dyn JobHandler> = Arc::new(NumberedTicks);
    let ids: Vec<String> = (0..12).map(|i| format!("ticker-{i}")).collect();
    let a = cluster.node_handling("a", ticks.clone());
    for id in &ids {
        client.put(id, &json!({})).await.unwrap();
    }
    // Partitions move on every step while the tickers fire every 100 ms: b and c join,
    // then a and b leave, each handing its partitions over.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let b = cluster.node_handling("b", ticks.clone());
    tokio::time::sleep(Duration::from_millis(700)).await;
    let c = cluster.node_handling("c", ticks.clone());
    tokio::time::sleep(Duration::from_millis(700)).await;
    a.stop().await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    b.stop().await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    c.stop().await;

    let mut fired: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for message in cluster.memory.messages("counter.out") {
        let record: Value = serde_json::from_slice(&message.payload).unwrap();
        let id = record["id"].as_str().unwrap().to_string();
        fired
            .entry(id)
            .or_default()
            .push(record["output"]["due"].as_u64().unwrap());
    }
    for id in &ids {
        let next = cluster.state(id).await.unwrap()["due"].as_u64().unwrap();
        let mut dues = fired.remove(id).unwrap_or_default();
        dues.sort_unstable();
        // Every stop was clean: each due time before the stored next one fired once.
        assert_eq!(dues, (1..next).collect::<Vec<_>>(), "{id}: due times fired");
        assert!(next > 10, "{id} fired only {} times", next - 1);
    }
}

/// A malformed message just small enough for the broker makes a dead letter too large
/// for it: the letter goes without the payload, giving its size, and the partition goes
/// on.
#[tokio::test]
async fn a_malformed_message_at_the_size_limit_is_dead_lettered_without_its_payload() {
    const LIMIT: usize = 4096;
    let cluster = Cluster::on(MemoryBroker::with_max_message_bytes(1, LIMIT)).await;
    let client = cluster.client().await;
    let node = cluster.node("a");
    let topic = weir::wire::job_topic(TYPE);
    let malformed = cluster
        .topic
        .outbound("j", format!("not json {}", "x".repeat(LIMIT - 32)));
    let size = malformed.payload.len();
    cluster.broker.sink().publish(malformed).await.unwrap();
    client.send("j", &json!(1)).await.unwrap();
    cluster.await_counts(&["j".to_string()], 1).await;
    let dead = cluster
        .memory
        .messages(&weir::wire::dead_letter_topic(&topic));
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].payload.is_empty());
    let size = size.to_string();
    assert_eq!(
        dead[0].header(weir::wire::PAYLOAD_OMITTED_HEADER),
        Some(size.as_str())
    );
    assert!(dead[0]
        .header(weir::wire::ERROR_HEADER)
        .is_some_and(|e| e.contains("payload: invalid JSON")));
    assert_eq!(dead[0].header(weir::wire::OFFSET_HEADER), Some("0"));
    node.stop().await;
}

#[tokio::test]
async fn malformed_messages_are_dead_lettered_and_the_partition_goes_on() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let node = cluster.node("a");
    let topic = weir::wire::job_topic(TYPE);
    let sink = cluster.broker.sink();
    // No key, a payload that is not JSON, an unknown event.
    sink.publish(Outbound::new(topic.clone(), "{}"))
        .await
        .unwrap();
    sink.publish(cluster.topic.outbound("j", "not json"))
        .await
        .unwrap();
    sink.publish(
        cluster
            .topic
            .outbound("j", "{}")
            .header(weir::wire::JOB_EVENT_HEADER, "explode"),
    )
    .await
    .unwrap();
    client.send("j", &json!(1)).await.unwrap();
    client.send("j", &json!(2)).await.unwrap();
    cluster.await_counts(&["j".to_string()], 2).await;
    let dead = cluster
        .memory
        .messages(&weir::wire::dead_letter_topic(&topic));
    assert_eq!(dead.len(), 3, "{dead:?}");
    let reasons: Vec<&str> = dead
        .iter()
        .map(|m| m.header(weir::wire::ERROR_HEADER).unwrap())
        .collect();
    assert!(reasons.iter().any(|r| r.contains("job id")), "{reasons:?}");
    assert!(
        reasons.iter().any(|r| r.contains("payload: invalid JSON")),
        "{reasons:?}"
    );
    assert!(reasons.iter().any(|r| r.contains("explode")), "{reasons:?}");
    // A stop outputs the final state and removes the job.
    client.stop("j").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.state("j").await.is_some() {
        assert!(tokio::time::Instant::now() < deadline, "job never removed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outputs = cluster.memory.messages("counter.out");
    assert_eq!(outputs.len(), 1);
    let output: Value = serde_json::from_slice(&outputs[0].payload).unwrap();
    assert_eq!(
        output,
        json!({"type": TYPE, "id": "j", "output": {"count": 2}})
    );
    node.stop().await;
}

/// A producer placing job ids otherwise than the job's first messages were placed
/// (another client's partitioner) cannot give the job a second owner: its message, on
/// another partition, is dead-lettered naming both, and the job keeps what it had.
#[tokio::test]
async fn a_message_for_a_job_living_on_another_partition_is_dead_lettered() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let node = cluster.node("a");
    let ids = ["j".to_string()];
    client.send("j", &json!(1)).await.unwrap();
    cluster.await_counts(&ids, 1).await;
    let home = cluster.topic.partition_of(b"j");
    let elsewhere = (home + 1) % PARTITIONS as i32;
    let topic = weir::wire::job_topic(TYPE);
    cluster
        .memory
        .publish_to_partition(Outbound::new(topic.clone(), "2").key("j"), elsewhere)
        .unwrap();
    client.send("j", &json!(3)).await.unwrap();
    cluster.await_counts(&ids, 2).await;
    let dead_letters = weir::wire::dead_letter_topic(&topic);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.memory.messages(&dead_letters).is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = cluster.memory.messages(&dead_letters);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0].header(weir::wire::ERROR_HEADER).unwrap();
    assert!(
        reason.contains(&format!("lives on partition {home}"))
            && reason.contains(&format!("came on partition {elsewhere}")),
        "{reason}"
    );
    assert_eq!(&dead[0].payload[..], b"2");
    // Its owner still applies what comes where the job lives.
    client.send("j", &json!(4)).await.unwrap();
    cluster.await_counts(&ids, 3).await;
    node.stop().await;
}

/// A dead letter goes out at least once: a malformed message dead-lettered by a node
/// that dies before the position past it is stored is dead-lettered again by the node
/// owning the partition next; once that position is stored, never again.
#[tokio::test]
async fn a_message_dead_lettered_just_before_its_node_dies_is_dead_lettered_again() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let topic = weir::wire::job_topic(TYPE);
    cluster
        .broker
        .sink()
        .publish(cluster.topic.outbound("j", "not json"))
        .await
        .unwrap();
    client.send("j", &json!(1)).await.unwrap();
    // The node's partition writes fail, as with Redis away: the letter goes out and the
    // position past it is never stored before the node dies.
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    flaky.fail_writes(usize::MAX);
    let counting = JobHandlers::default().get("builtin::count").unwrap();
    let node = cluster.node_on("a", counting, flaky.clone());
    let dead = || {
        cluster
            .memory
            .messages(&weir::wire::dead_letter_topic(&topic))
    };
    common::eventually("the first dead letter", || async { !dead().is_empty() }).await;
    node.kill();
    assert_eq!(cluster.state("j").await, None, "nothing stored");
    let first = dead().len();
    let node = cluster.node("b");
    cluster.await_counts(&["j".to_string()], 1).await;
    common::eventually("the next owner's dead letter", || async {
        dead().len() > first
    })
    .await;
    for letter in dead() {
        assert_eq!(&letter.payload[..], b"not json");
    }
    node.stop().await;
    // Read again from the stored position: the letter does not go out again.
    let letters = dead().len();
    let node = cluster.node("c");
    client.send("j", &json!(2)).await.unwrap();
    cluster.await_counts(&["j".to_string()], 2).await;
    assert_eq!(dead().len(), letters);
    node.stop().await;
}

/// Counts messages, but panics on the message `"boom"`.
struct PanicsOnBoom;

impl JobHandler for PanicsOnBoom {
    fn handle(&self, state: Value, event: &JobEvent) -> Result<Step, HandlerError> {
        if let JobEvent::Message(message) = event {
            assert_ne!(message, "boom", "a message no handler should meet");
        }
        JobHandlers::default()
            .get("builtin::count")
            .unwrap()
            .handle(state, event)
    }
}

/// A handler that panics refuses the message, as one returning an error does: the
/// message is dead-lettered and the job goes on. Unwinding the partition instead, it
/// would be served again from the store and panic on the same message, forever.
#[tokio::test]
async fn a_handler_panicking_dead_letters_the_message_and_the_job_goes_on() {
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let node = cluster.node_handling("a", Arc::new(PanicsOnBoom));
    client.send("j", &json!(1)).await.unwrap();
    client.send("j", &json!("boom")).await.unwrap();
    client.send("j", &json!(2)).await.unwrap();
    cluster.await_counts(&["j".to_string()], 2).await;
    let topic = weir::wire::job_topic(TYPE);
    let dead = cluster
        .memory
        .messages(&weir::wire::dead_letter_topic(&topic));
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0].header(weir::wire::ERROR_HEADER).unwrap();
    assert!(
        reason.contains("panicked") && reason.contains("a message no handler should meet"),
        "{reason}"
    );
    assert_eq!(&dead[0].payload[..], b"\"boom\"");
    node.stop().await;
}

/// Wraps its state in one more object per message.
struct Nesting;

impl JobHandler for Nesting {
    fn handle(&self, state: Value, event: &JobEvent) -> Result<Step, HandlerError> {
        Ok(match event {
            JobEvent::Message(_) => Step::new(json!({ "inner": state })),
            _ => Step::new(state),
        })
    }
}

fn depth(mut state: &Value) -> usize {
    let mut depth = 1;
    while let Some(inner) = state.get("inner") {
        state = inner;
        depth += 1;
    }
    depth
}

/// A handler returning a state nested deeper than weir reads JSON: stored, it could never
/// be loaded again, so the message is dead-lettered as if the handler had refused it, the
/// job keeps its last state, and the partition goes on.
#[tokio::test]
async fn a_state_nested_too_deep_is_refused_and_the_job_keeps_its_last_one() {
    const LIMIT: usize = weir::codec::json::MAX_DEPTH;
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let node = cluster.node_handling("a", Arc::new(Nesting));
    client.put("deep", &json!({})).await.unwrap();
    for n in 0..LIMIT + 3 {
        client.send("deep", &json!(n)).await.unwrap();
    }
    let topic = weir::wire::job_topic(TYPE);
    let dead_letters = weir::wire::dead_letter_topic(&topic);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while cluster.memory.messages(&dead_letters).len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not dead-lettered: {:?}",
            cluster.memory.messages(&dead_letters)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = cluster.memory.messages(&dead_letters);
    assert_eq!(dead.len(), 4, "{dead:?}");
    for letter in &dead {
        let reason = letter.header(weir::wire::ERROR_HEADER).unwrap();
        assert!(reason.contains("nested deeper than 100"), "{reason}");
    }
    let state = cluster.state("deep").await.expect("the job is kept");
    assert_eq!(depth(&state), LIMIT);
    node.stop().await;
}

#[tokio::test]
async fn an_output_too_large_to_publish_is_dead_lettered_and_the_partition_goes_on() {
    // The padded state fits as a message; the stop's output, the state and more, does not.
    const LIMIT: usize = 400;
    let cluster = Cluster::on(MemoryBroker::with_max_message_bytes(1, LIMIT)).await;
    let client = cluster.client().await;
    let node = cluster.node("a");
    let pad = "x".repeat(LIMIT - 40);
    client.put("big", &json!({ "pad": pad })).await.unwrap();
    client.send("big", &json!(1)).await.unwrap();
    client.stop("big").await.unwrap();
    // Messages to another job of the same partition go on being applied.
    let neighbour = (0..)
        .map(|i| format!("n{i}"))
        .find(|id| cluster.topic.partition_of(id.as_bytes()) == cluster.topic.partition_of(b"big"))
        .unwrap();
    client.send(&neighbour, &json!(1)).await.unwrap();
    cluster
        .await_counts(std::slice::from_ref(&neighbour), 1)
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.memory.messages("counter.out.dlq").is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = cluster.memory.messages("counter.out.dlq");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].key.as_deref(), Some(&b"big"[..]));
    assert!(dead[0]
        .header(weir::wire::ERROR_HEADER)
        .is_some_and(|e| e.contains("larger than the broker takes")));
    assert!(cluster.memory.messages("counter.out").is_empty());
    node.stop().await;
}

#[tokio::test]
async fn a_stopped_jobs_output_survives_its_owner_dying_at_any_moment() {
    // Outputs go to the broker before the batch holding the stop is written: an owner
    // killed in between leaves the stop to be applied again by the next owner, so the
    // output comes out at least once, whenever the kill falls.
    let cluster = Cluster::new().await;
    let client = cluster.client().await;
    let mut node = cluster.node("n0");
    let mut ids = Vec::new();
    for (round, kill_after_ms) in [0u64, 1, 3, 10, 40].into_iter().enumerate() {
        let batch: Vec<String> = (0..8).map(|i| format!("r{round}-{i}")).collect();
        for id in &batch {
            client.put(id, &json!({})).await.unwrap();
            for n in 0..3 {
                client.send(id, &json!(n)).await.unwrap();
            }
            client.stop(id).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(kill_after_ms)).await;
        node.kill();
        node = cluster.node(&format!("n{}", round + 1));
        ids.extend(batch);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let outputs = cluster.memory.messages("counter.out");
        let missing: Vec<&String> = ids
            .iter()
            .filter(|id| {
                !outputs.iter().any(|m| {
                    m.key.as_deref() == Some(id.as_bytes())
                        && serde_json::from_slice::<Value>(&m.payload).unwrap()["output"]
                            == json!({"count": 3})
                })
            })
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no final output for {missing:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in &ids {
        assert_eq!(cluster.state(id).await, None, "{id} was stopped");
    }
    node.stop().await;
}

//! Keyed graphs on the memory backends, with several nodes in one process: one reactor
//! state per key, every input reaching an output in its key's order across joins and
//! kills, per-key `when_all`, keys leaving memory with events queued, an output too large
//! for the broker, a failed fire, events that cannot be read or keyed, the
//! co-partitioning check, idle keys expiring by event time, a key whose stored state
//! does not read back, and a lease running out between a fire's outputs.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::TaskNode;
use serde_json::{json, Value};
use weir::accumulator::AccumulatorSpec;
use weir::graph::{
    Criteria, FunctionRegistry, GraphBuilder, GraphDeclaration, KeySource, Keying, NodeContext,
    NodeError, Strategy,
};
use weir::keyed::{KeyedGraphStore, KeyedTopics};
use weir::store::memory::MemoryStore;
use weir::store::prelude::*;
use weir::transport::memory::MemoryBroker;
use weir::transport::{Broker, Outbound};

struct Cluster {
    broker: Arc<dyn Broker>,
    memory: MemoryBroker,
    store: Arc<dyn Store>,
    decl: GraphDeclaration,
    topics: KeyedTopics,
}

fn graph(name: &str, sources: &[&str], criteria: Criteria) -> GraphDeclaration {
    let mut keying = Keying::new(KeySource::Pointer("/user".into()));
    keying.partitions = 4;
    keying.lease_ttl = Duration::from_millis(600);
    keying.max_keys_in_memory = 10;
    let mut builder = GraphBuilder::new(name)
        .criteria(criteria)
        .strategy(Strategy::Sequential)
        .keyed(keying);
    for s in sources {
        builder =
            builder.accumulator(AccumulatorSpec::passthrough(*s).topic(format!("{name}.{s}")));
    }
    builder
        .function("snapshot", &FunctionRegistry::default(), "snapshot")
        .output("snapshot", format!("{name}.out"))
        .build()
        .unwrap()
}

impl Cluster {
    async fn new(decl: GraphDeclaration) -> Self {
        Self::on(decl, MemoryBroker::new(1)).await
    }

    async fn on(decl: GraphDeclaration, memory: MemoryBroker) -> Self {
        let broker: Arc<dyn Broker> = Arc::new(memory.clone());
        let topics = weir::keyed::topics(&decl, broker.as_ref()).await.unwrap();
        Self {
            broker,
            memory,
            store: Arc::new(MemoryStore::new()),
            decl,
            topics,
        }
    }

    fn node(&self, id: &str) -> TaskNode {
        self.node_on(id, self.store.clone())
    }

    /// A node writing through `store` rather than straight to the cluster's.
    fn node_on(&self, id: &str, store: Arc<dyn KeyedGraphStore>) -> TaskNode {
        TaskNode::spawn(|stop| {
            weir::keyed::serve(
                self.decl.clone(),
                self.topics.clone(),
                self.broker.clone(),
                store,
                id.to_string(),
                stop,
            )
        })
    }

    async fn send(&self, source: &str, user: &str, seq: u64) {
        let topic = format!("{}.{source}", self.decl.name);
        let event = json!({"user": user, "seq": seq});
        self.broker
            .sink()
            .publish(Outbound::new(topic, event.to_string()).key(user.to_string()))
            .await
            .unwrap();
    }

    /// Sends events `seqs` to source `a`, each to user `u<seq mod 20>`, and notes them
    /// in `sent`.
    async fn send_users(&self, seqs: std::ops::Range<u64>, sent: &mut HashSet<(String, u64)>) {
        for seq in seqs {
            let user = format!("u{}", seq % 20);
            self.send("a", &user, seq).await;
            sent.insert((user, seq));
        }
    }

    fn outputs(&self) -> Vec<Value> {
        self.memory
            .messages(&format!("{}.out", self.decl.name))
            .iter()
            .map(|m| {
                let value: Value = serde_json::from_slice(&m.payload).unwrap();
                assert_eq!(m.key.as_deref(), value["key"].as_str().map(str::as_bytes));
                value
            })
            .collect()
    }

    /// Waits until `key` is stored with `queued` events of `source` in its queue.
    async fn await_stored_queue(&self, key: &str, source: &str, queued: usize) {
        let partitions = self.topics.partitions;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let stored = weir::keyed::view(self.store.as_ref(), &self.decl.name, partitions, key)
                .await
                .unwrap()
                .and_then(|view| view.state)
                .map(|state| state.sources[source].queue.len());
            if stored == Some(queued) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{key} stored with {stored:?} events of {source} queued, not {queued}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the store holds no state for `key`.
    async fn await_forgotten(&self, key: &str) {
        let partitions = self.topics.partitions;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while weir::keyed::view(self.store.as_ref(), &self.decl.name, partitions, key)
            .await
            .unwrap()
            .is_some()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{key} still stored after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `topic` holds `count` messages at least.
    async fn await_count(&self, topic: &str, count: usize, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        while self.memory.messages(topic).len() < count {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{topic}: {} of {count} messages",
                self.memory.messages(topic).len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every (user, seq) in `sent` has an output; returns the outputs.
    async fn await_outputs(&self, sent: &HashSet<(String, u64)>) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let outputs = self.outputs();
            let seen: HashSet<(String, u64)> = outputs
                .iter()
                .map(|o| {
                    (
                        o["key"].as_str().unwrap().to_string(),
                        o["inputs"]["a"]["seq"].as_u64().unwrap(),
                    )
                })
                .collect();
            let missing = sent.difference(&seen).count();
            if missing == 0 {
                return outputs;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{missing} inputs without an output"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn every_input_reaches_an_output_in_its_keys_order_across_joins_and_kills() {
    let cluster = Cluster::new(graph("per_user", &["a"], Criteria::WhenAny)).await;
    let users: Vec<String> = (0..40).map(|i| format!("u{i}")).collect();
    let mut sent = HashSet::new();
    let mut seq = 0u64;
    // One event per user, each with the next sequence number.
    let mut round = |sent: &mut HashSet<(String, u64)>| {
        let batch: Vec<(String, u64)> = users
            .iter()
            .map(|u| {
                seq += 1;
                (u.clone(), seq)
            })
            .collect();
        sent.extend(batch.iter().cloned());
        batch
    };
    let a = cluster.node("a");
    for _ in 0..5 {
        for (user, seq) in round(&mut sent) {
            cluster.send("a", &user, seq).await;
        }
    }
    cluster.await_outputs(&sent).await;
    let b = cluster.node("b");
    for _ in 0..5 {
        for (user, seq) in round(&mut sent) {
            cluster.send("a", &user, seq).await;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    a.kill();
    for _ in 0..5 {
        for (user, seq) in round(&mut sent) {
            cluster.send("a", &user, seq).await;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    let outputs = cluster.await_outputs(&sent).await;
    // Per key, each input's first output comes in the order the inputs went in; a
    // replay after the kill may repeat inputs, never bring a new one early.
    let mut first_seen: BTreeMap<String, (u64, HashSet<u64>)> = BTreeMap::new();
    let mut repeats = 0;
    for o in &outputs {
        let key = o["key"].as_str().unwrap().to_string();
        let seq = o["inputs"]["a"]["seq"].as_u64().unwrap();
        let (highest, seen) = first_seen.entry(key.clone()).or_default();
        if !seen.insert(seq) {
            repeats += 1;
            continue;
        }
        assert!(
            seq > *highest,
            "{key}: input {seq} came out after {highest}"
        );
        *highest = seq;
    }
    assert!(repeats <= 40 * 5, "{repeats} repeated outputs");
    b.stop().await;
}

/// How many outputs carry a (user, seq) an earlier output carried.
fn repeats(outputs: &[Value]) -> usize {
    let mut seen = HashSet::new();
    outputs
        .iter()
        .filter(|o| {
            let key = o["key"].as_str().unwrap().to_string();
            !seen.insert((key, o["inputs"]["a"]["seq"].as_u64().unwrap()))
        })
        .count()
}

/// A cluster whose one node writes through a store failing on demand, with 40 events
/// over 20 users sent to source `a` and fired.
async fn serving_through_a_flaky_store(
    name: &str,
) -> (
    Cluster,
    Arc<common::FlakyStore>,
    TaskNode,
    HashSet<(String, u64)>,
) {
    let cluster = Cluster::new(graph(name, &["a"], Criteria::WhenAny)).await;
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let node = cluster.node_on("n", flaky.clone());
    let mut sent = HashSet::new();
    cluster.send_users(0..40, &mut sent).await;
    cluster.await_outputs(&sent).await;
    (cluster, flaky, node, sent)
}

#[tokio::test]
async fn a_batch_write_failing_for_a_moment_is_tried_again_and_repeats_no_output() {
    // A batch's outputs are published before its keys and positions are written. Were
    // a failed write to serve the partition again from the store, the batch's events
    // would be read again and their outputs published a second time.
    let (cluster, flaky, node, mut sent) = serving_through_a_flaky_store("blip").await;
    // Two tries fail: 150 ms of pauses, within the 300 ms (half the lease TTL) a
    // partition tries its store calls for.
    flaky.fail_writes(2);
    cluster.send_users(40..80, &mut sent).await;
    common::eventually("the failing writes tried", || async {
        flaky.failures_left() == 0
    })
    .await;
    let outputs = cluster.await_outputs(&sent).await;
    // Long enough for a partition served again to have read its events again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        repeats(&cluster.outputs()),
        0,
        "outputs repeated: {outputs:?}"
    );
    node.stop().await;
}

#[tokio::test]
async fn a_keys_load_failing_for_a_moment_is_tried_again_and_repeats_no_output() {
    // A key not in memory is loaded from the store when its event comes, mid-batch,
    // after the batch's earlier events fired. Were a failed load to serve the partition
    // again from the store, those events would be read again and fire a second time.
    let mut decl = graph("reload", &["a"], Criteria::WhenAny);
    decl.keyed.as_mut().unwrap().partitions = 1;
    let cluster = Cluster::new(decl).await;
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let mut sent = HashSet::new();
    let first = cluster.node_on("first", flaky.clone());
    cluster.send_users(0..40, &mut sent).await;
    cluster.await_outputs(&sent).await;
    first.stop().await;
    // A backlog for the next node, which has none of its keys in memory: each of the
    // first 20 events loads its key. The sixth load fails, twice.
    cluster.send_users(40..120, &mut sent).await;
    flaky.fail_loads(5, 2);
    let next = cluster.node_on("next", flaky.clone());
    common::eventually("the failing loads tried", || async {
        flaky.failures_left() == 0
    })
    .await;
    cluster.await_outputs(&sent).await;
    // Long enough for a partition served again to have read its events again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(repeats(&cluster.outputs()), 0);
    next.stop().await;
}

#[tokio::test]
async fn a_hand_over_whose_write_fails_for_a_moment_still_writes_it() {
    // The write handing a partition over carries what its last batch applied and the
    // release mark: failing once, it is tried again before the lease is let go, so the
    // next owner starts from it rather than from the batch before.
    let (cluster, flaky, node, mut sent) = serving_through_a_flaky_store("handover").await;
    let partitions = cluster.topics.partitions as i32;
    flaky.fail_releases(partitions as usize);
    node.stop().await;
    assert_eq!(flaky.failures_left(), 0);
    for partition in 0..partitions {
        let released = cluster
            .store
            .load_released("handover", partition)
            .await
            .unwrap();
        assert!(
            released.is_some(),
            "partition {partition} handed over without its write"
        );
    }
    let next = cluster.node("next");
    cluster.send_users(40..60, &mut sent).await;
    cluster.await_outputs(&sent).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(repeats(&cluster.outputs()), 0);
    next.stop().await;
}

#[tokio::test]
async fn a_partition_working_off_a_backlog_longer_than_its_lease_keeps_it() {
    // One thread, one partition, and a backlog that takes longer than the lease TTL to
    // work off: the lease keeper shares the thread with a loop whose source is always
    // ready. Should it miss its renewals, the partition is taken back and restarts from
    // the store, and part of the backlog fires twice under a newer fencing token.
    let mut decl = graph("backlog", &["a"], Criteria::WhenAny);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.max_keys_in_memory = 1000;
    let ttl = keying.lease_ttl;
    let cluster = Cluster::new(decl).await;
    let mut sent = HashSet::new();
    for seq in 0..60_000u64 {
        let user = format!("u{}", seq % 40);
        cluster.send("a", &user, seq).await;
        sent.insert((user, seq));
    }
    let started = tokio::time::Instant::now();
    let node = cluster.node("n");
    common::work_off_past_ttl(started, ttl, sent.len(), || {
        cluster.memory.messages("backlog.out").len()
    })
    .await;
    node.stop().await;
    cluster.await_outputs(&sent).await;
    let outputs = cluster.memory.messages("backlog.out");
    assert_eq!(outputs.len(), sent.len(), "some inputs fired twice");
    let tokens: HashSet<&str> = outputs
        .iter()
        .map(|m| m.header(weir::wire::FENCING_HEADER).unwrap())
        .collect();
    assert_eq!(tokens.len(), 1, "the partition changed hands: {tokens:?}");
}

#[tokio::test]
async fn when_all_waits_for_every_source_of_the_same_key() {
    let cluster = Cluster::new(graph("pairs", &["a", "b"], Criteria::WhenAll)).await;
    let node = cluster.node("n");
    cluster.send("a", "ann", 1).await;
    cluster.send("a", "bob", 2).await;
    cluster.send("b", "ann", 3).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.outputs().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "no fire");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let outputs = cluster.outputs();
    assert_eq!(outputs.len(), 1, "bob has one source only: {outputs:?}");
    assert_eq!(outputs[0]["key"], "ann");
    assert_eq!(outputs[0]["inputs"]["a"]["seq"], 1);
    assert_eq!(outputs[0]["inputs"]["b"]["seq"], 3);
    // The state of a key, as the admin API shows it.
    let view = weir::keyed::view(cluster.store.as_ref(), "pairs", 4, "bob")
        .await
        .unwrap()
        .expect("bob is stored");
    let state = view.state.unwrap();
    assert_eq!(state.fires, 0);
    assert_eq!(state.sources["a"].queue.len(), 1);
    assert!(view.owner.is_some());
    node.stop().await;
}

#[tokio::test]
async fn a_key_changed_several_times_in_one_batch_is_stored_as_it_ends() {
    let cluster = Cluster::new(graph("queued", &["a", "b"], Criteria::WhenAll)).await;
    let node = cluster.node("n");
    // Sent together, so they are applied in one batch: the stored state must hold all
    // three queued, not the key as the batch first saw it.
    for seq in 1..=3 {
        cluster.send("a", "ann", seq).await;
    }
    cluster.await_stored_queue("ann", "a", 3).await;
    node.stop().await;
}

#[tokio::test]
async fn sources_with_different_partition_counts_are_refused_by_name() {
    let decl = graph("mixed", &["a", "b"], Criteria::WhenAny);
    let memory = MemoryBroker::new(1);
    // `mixed.b` exists already with 2 partitions.
    memory.partitioned("mixed.b", 2).await.unwrap();
    let refused = weir::keyed::topics(&decl, &memory).await.unwrap_err();
    let text = refused.to_string();
    assert!(
        text.contains("mixed.a has 4") && text.contains("mixed.b has 2"),
        "{text}"
    );
}

/// The output topic weir creates has the graph's partitions, and each output lands in
/// the partition its input came from: a keyed graph reading it downstream is
/// co-partitioned with its other sources, and each partition has one writer. An output
/// topic that exists keeps its count.
#[tokio::test]
async fn outputs_land_in_the_partition_their_inputs_came_from() {
    let cluster = Cluster::new(graph("placed", &["a"], Criteria::WhenAny)).await;
    let node = cluster.node("n");
    let mut sent = HashSet::new();
    cluster.send_users(0..40, &mut sent).await;
    cluster.await_outputs(&sent).await;
    let input = &cluster.topics.sources[0];
    let outputs = cluster.memory.messages("placed.out");
    assert_eq!(outputs.len(), sent.len());
    for output in &outputs {
        let key = output.key.as_deref().expect("keyed output");
        assert_eq!(
            output.position.partition,
            input.partition_of(key),
            "{:?}",
            String::from_utf8_lossy(key)
        );
    }
    let partitions: HashSet<i32> = outputs.iter().map(|o| o.position.partition).collect();
    assert_eq!(partitions.len(), cluster.topics.partitions as usize);
    node.stop().await;

    let decl = graph("kept", &["a"], Criteria::WhenAny);
    let memory = MemoryBroker::new(1);
    memory.partitioned("kept.out", 2).await.unwrap();
    weir::keyed::topics(&decl, &memory).await.unwrap();
    let output = memory.partitioned("kept.out", 7).await.unwrap();
    assert_eq!(output.partitions, 2, "an existing output keeps its count");
}

#[tokio::test]
async fn an_output_too_large_to_publish_is_dead_lettered_and_the_key_goes_on() {
    // Inputs fit; the snapshot of the padded one, its input and more, does not.
    const LIMIT: usize = 400;
    let decl = graph("large", &["a"], Criteria::WhenAny);
    let cluster = Cluster::on(decl, MemoryBroker::with_max_message_bytes(1, LIMIT)).await;
    let node = cluster.node("n");
    let topic = "large.a";
    let sink = cluster.broker.sink();
    for (seq, pad) in [(1, 0), (2, 320), (3, 0)] {
        let event = json!({"user": "u1", "seq": seq, "pad": "x".repeat(pad)});
        assert!(event.to_string().len() < LIMIT);
        sink.publish(Outbound::new(topic, event.to_string()).key("u1"))
            .await
            .unwrap();
    }
    let sent = HashSet::from([("u1".to_string(), 1), ("u1".to_string(), 3)]);
    let outputs = cluster.await_outputs(&sent).await;
    assert_eq!(outputs.len(), 2, "{outputs:?}");
    // Dead-lettered when its batch is flushed, a moment after the others came out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while cluster.memory.messages("large.out.dlq").is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dead = cluster.memory.messages("large.out.dlq");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].key.as_deref(), Some(&b"u1"[..]));
    assert_eq!(dead[0].header(weir::wire::FIRE_HEADER), Some("2"));
    assert!(dead[0]
        .header(weir::wire::ERROR_HEADER)
        .is_some_and(|e| e.contains("larger than the broker takes")));
    let record: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(record["topic"], "large.out");
    node.stop().await;
}

#[tokio::test]
async fn events_that_cannot_be_read_or_keyed_are_dead_lettered_and_the_key_goes_on() {
    let cluster = Cluster::new(graph("unreadable", &["a"], Criteria::WhenAny)).await;
    let topic = "unreadable.a";
    let sink = cluster.broker.sink();
    // Sent before the node starts, so they are read and applied as one burst.
    let events = [
        json!({"user": "u1", "seq": 1}).to_string(),
        "{not json".to_string(),
        json!({"user": "u1", "seq": 2}).to_string(),
        json!({"seq": 99}).to_string(),
        json!({"user": "u1", "seq": 3}).to_string(),
    ];
    for event in events {
        sink.publish(Outbound::new(topic, event).key("u1"))
            .await
            .unwrap();
    }
    let node = cluster.node("n");
    let sent: HashSet<(String, u64)> = (1..=3).map(|seq| ("u1".to_string(), seq)).collect();
    let outputs = cluster.await_outputs(&sent).await;
    let seqs: Vec<u64> = outputs
        .iter()
        .map(|o| o["inputs"]["a"]["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [1, 2, 3]);
    let dead = cluster.memory.messages("unreadable.a.dlq");
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(&dead[0].payload[..], b"{not json");
    assert_eq!(dead[0].header(weir::wire::OFFSET_HEADER), Some("1"));
    assert!(dead[1]
        .header(weir::wire::ERROR_HEADER)
        .is_some_and(|e| e.contains("no key at /user")));
    assert_eq!(dead[1].header(weir::wire::OFFSET_HEADER), Some("3"));
    node.stop().await;
}

/// A dead letter goes out at least once: an unreadable event dead-lettered by a node
/// that dies before the position past it is stored is dead-lettered again by the node
/// reading the partition next; once that position is stored, never again.
#[tokio::test]
async fn an_event_dead_lettered_just_before_its_node_dies_is_dead_lettered_again() {
    let mut decl = graph("letter", &["a"], Criteria::WhenAny);
    decl.keyed.as_mut().unwrap().partitions = 1;
    let cluster = Cluster::new(decl).await;
    let sink = cluster.broker.sink();
    for event in [
        "{not json".to_string(),
        json!({"user": "u1", "seq": 1}).to_string(),
    ] {
        sink.publish(Outbound::new("letter.a", event).key("u1"))
            .await
            .unwrap();
    }
    // The node's batch writes fail, as with Redis away: the letter goes out and the
    // position past it is never stored before the node dies.
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    flaky.fail_writes(usize::MAX);
    let node = cluster.node_on("n1", flaky.clone());
    let dead = || cluster.memory.messages("letter.a.dlq");
    common::eventually("the first dead letter", || async { !dead().is_empty() }).await;
    node.kill();
    assert!(
        cluster
            .store
            .load_positions("letter", 0)
            .await
            .unwrap()
            .is_empty(),
        "no position stored"
    );
    let first = dead().len();
    let node = cluster.node("n2");
    let sent: HashSet<(String, u64)> = [("u1".to_string(), 1)].into();
    cluster.await_outputs(&sent).await;
    common::eventually("the next owner's dead letter", || async {
        dead().len() > first
    })
    .await;
    for letter in dead() {
        assert_eq!(&letter.payload[..], b"{not json");
        assert_eq!(letter.header(weir::wire::OFFSET_HEADER), Some("0"));
    }
    common::eventually("the positions stored", || async {
        let stored = cluster.store.load_positions("letter", 0).await.unwrap();
        stored.get("a").is_some_and(|&at| at >= 1)
    })
    .await;
    node.stop().await;
    // Read again from the stored position: the letter does not go out again.
    let letters = dead().len();
    let node = cluster.node("n3");
    cluster.send("a", "u1", 2).await;
    let sent: HashSet<(String, u64)> = [("u1".to_string(), 1), ("u1".to_string(), 2)].into();
    cluster.await_outputs(&sent).await;
    assert_eq!(dead().len(), letters);
    node.stop().await;
}

/// An event just small enough for the broker that cannot be read makes a dead letter
/// too large for it: the letter goes without the payload, giving its size, and the key
/// goes on.
#[tokio::test]
async fn an_unreadable_event_at_the_size_limit_is_dead_lettered_without_its_payload() {
    const LIMIT: usize = 4096;
    let decl = graph("limit", &["a"], Criteria::WhenAny);
    let cluster = Cluster::on(decl, MemoryBroker::with_max_message_bytes(1, LIMIT)).await;
    let sink = cluster.broker.sink();
    let unreadable = format!("{{{}", "x".repeat(LIMIT - 64));
    for event in [
        unreadable.clone(),
        json!({"user": "u1", "seq": 1}).to_string(),
    ] {
        sink.publish(Outbound::new("limit.a", event).key("u1"))
            .await
            .unwrap();
    }
    let node = cluster.node("n");
    let sent = HashSet::from([("u1".to_string(), 1)]);
    cluster.await_outputs(&sent).await;
    let dead = cluster.memory.messages("limit.a.dlq");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].payload.is_empty());
    let size = unreadable.len().to_string();
    assert_eq!(
        dead[0].header(weir::wire::PAYLOAD_OMITTED_HEADER),
        Some(size.as_str())
    );
    assert_eq!(dead[0].key.as_deref(), Some(&b"u1"[..]));
    assert_eq!(dead[0].header(weir::wire::OFFSET_HEADER), Some("0"));
    node.stop().await;
}

#[tokio::test]
async fn a_paused_keyed_graph_reads_nothing_on_any_node_until_resumed() {
    let cluster = Cluster::new(graph("pausing", &["a"], Criteria::WhenAny)).await;
    let graph = cluster.decl.key();
    let users: Vec<String> = (0..12).map(|i| format!("u{i}")).collect();
    let (a, b) = (cluster.node("a"), cluster.node("b"));
    let mut before = HashSet::new();
    for (seq, user) in users.iter().enumerate() {
        cluster.send("a", user, seq as u64).await;
        before.insert((user.clone(), seq as u64));
    }
    let answered = cluster.await_outputs(&before).await.len();
    cluster.store.save_paused(&graph, true).await.unwrap();
    // Both nodes look at the store every `PAUSE_POLL`.
    tokio::time::sleep(weir::keyed::PAUSE_POLL * 3).await;
    let mut sent = before.clone();
    for (seq, user) in users.iter().enumerate() {
        let seq = (users.len() + seq) as u64;
        cluster.send("a", user, seq).await;
        sent.insert((user.clone(), seq));
    }
    tokio::time::sleep(weir::keyed::PAUSE_POLL * 3).await;
    assert_eq!(cluster.outputs().len(), answered, "a paused graph fired");
    // A node dies while paused: whoever takes its partitions over starts paused too.
    a.kill();
    let c = cluster.node("c");
    let group = weir::keyed::ownership_group(&graph);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let mut owners = Vec::new();
        for partition in 0..4 {
            let lease = weir::ownership::partition_lease(&group, partition);
            let holder = cluster.store.current_lease(&lease).await.unwrap();
            owners.push(holder.map(|l| weir::lease::holder_node(&l.holder).to_string()));
        }
        if owners
            .iter()
            .all(|o| o.as_deref().is_some_and(|o| o != "a"))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dead node's partitions were not taken over: {owners:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(weir::keyed::PAUSE_POLL * 3).await;
    assert_eq!(
        cluster.outputs().len(),
        answered,
        "a partition taken over while paused fired"
    );
    cluster.store.save_paused(&graph, false).await.unwrap();
    let outputs = cluster.await_outputs(&sent).await;
    // Nothing was lost, repeated or reordered on the way: the node died idle, with
    // nothing in flight, so each input came out once, in its key's order.
    assert_eq!(outputs.len(), sent.len(), "an input came out twice");
    let mut highest: BTreeMap<String, u64> = BTreeMap::new();
    for o in &outputs {
        let key = o["key"].as_str().unwrap().to_string();
        let seq = o["inputs"]["a"]["seq"].as_u64().unwrap();
        if let Some(last) = highest.insert(key.clone(), seq) {
            assert!(seq > last, "{key}: input {seq} came out after {last}");
        }
    }
    b.stop().await;
    c.stop().await;
}

#[tokio::test]
async fn a_keys_full_queue_dead_letters_what_it_cannot_hold_and_the_partition_goes_on() {
    let mut decl = graph("bounded", &["a", "b"], Criteria::WhenAll);
    decl.reactor.queue_capacity = 2;
    let cluster = Cluster::new(decl).await;
    let node = cluster.node("n");
    // ann's other source has not come: two of her events wait, the others cannot.
    for seq in 1..=4 {
        cluster.send("a", "ann", seq).await;
    }
    cluster.send("a", "bob", 10).await;
    cluster.send("b", "bob", 11).await;
    let bob = HashSet::from([("bob".to_string(), 10)]);
    cluster.await_outputs(&bob).await;
    cluster.send("b", "ann", 20).await;
    cluster.send("b", "ann", 21).await;
    let ann = HashSet::from([("ann".to_string(), 1), ("ann".to_string(), 2)]);
    let outputs = cluster.await_outputs(&ann).await;
    let fired: Vec<(String, u64, u64)> = outputs
        .iter()
        .map(|o| {
            (
                o["key"].as_str().unwrap().to_string(),
                o["inputs"]["a"]["seq"].as_u64().unwrap(),
                o["inputs"]["b"]["seq"].as_u64().unwrap(),
            )
        })
        .filter(|(key, ..)| key == "ann")
        .collect();
    assert_eq!(
        fired,
        [("ann".to_string(), 1, 20), ("ann".to_string(), 2, 21)]
    );
    let dead = cluster.memory.messages("bounded.a.dlq");
    let seqs: Vec<u64> = dead
        .iter()
        .map(|m| {
            serde_json::from_slice::<Value>(&m.payload).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, [3, 4], "{dead:?}");
    for letter in &dead {
        let error = letter.header(weir::wire::ERROR_HEADER).unwrap_or_default();
        assert!(
            error.contains("queue of key ann") && error.contains("queue_capacity"),
            "{error}"
        );
    }
    node.stop().await;
}

/// How the node of [`faulty_graph`] fails on the event with `seq` 2: every time, or only
/// its first `n` runs.
#[derive(Clone, Copy)]
enum Failure {
    Error,
    Panic,
    ErrorTimes(u32),
}

/// A keyed graph over `faulty.a` passing each event through, but for the one with `seq` 2.
fn faulty_graph(failure: Failure) -> weir::GraphDeclaration {
    let mut keying = Keying::new(KeySource::Pointer("/user".into()));
    keying.partitions = 2;
    // Longer than a panic's backtrace takes to print (the first one symbolizes the
    // test binary's debug info on the thread the lease keeper shares): a lease lapsing
    // meanwhile would hand the partition over and fire its first event again.
    keying.lease_ttl = Duration::from_secs(3);
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    GraphBuilder::new("faulty")
        .criteria(Criteria::WhenAny)
        .strategy(Strategy::Sequential)
        .keyed(keying)
        .accumulator(AccumulatorSpec::passthrough("a").topic("faulty.a"))
        .node("n", ["a"], move |ctx: NodeContext| {
            let runs = runs.clone();
            async move {
                let event = ctx.source("a").cloned().unwrap_or_default();
                if event["seq"].as_u64() != Some(2) {
                    return Ok(Some(event));
                }
                let run = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                match failure {
                    Failure::Error => Err(NodeError::new("cannot take the second event")),
                    Failure::Panic => panic!("cannot take the second event"),
                    Failure::ErrorTimes(n) if run < n => {
                        Err(NodeError::new("cannot take the second event yet"))
                    }
                    Failure::ErrorTimes(_) => Ok(Some(event)),
                }
            }
        })
        .output("n", "faulty.out")
        .build()
        .unwrap()
}

/// The `seq` of each output of [`faulty_graph`], in order.
fn faulty_outputs(cluster: &Cluster) -> Vec<Value> {
    cluster
        .memory
        .messages("faulty.out")
        .iter()
        .map(|m| serde_json::from_slice::<Value>(&m.payload).unwrap()["seq"].clone())
        .collect()
}

#[tokio::test]
async fn a_failed_fire_is_dead_lettered_with_its_key_and_the_key_goes_on() {
    a_failing_fire_is_dead_lettered_and_the_key_goes_on(Failure::Error).await;
}

/// A node that panics fails its fire as one returning an error does. Unwinding the
/// partition instead, it would be served again from the store and panic again on the
/// same event, forever, publishing the outputs before it each time.
#[tokio::test]
async fn a_node_panicking_is_dead_lettered_with_its_key_and_the_key_goes_on() {
    a_failing_fire_is_dead_lettered_and_the_key_goes_on(Failure::Panic).await;
}

/// A fire failing fewer times than `node_retries` (3 by default) is run again and
/// publishes its output; nothing is dead-lettered.
#[tokio::test]
async fn a_keyed_fire_failing_less_than_its_retries_publishes_its_output() {
    let cluster = Cluster::new(faulty_graph(Failure::ErrorTimes(2))).await;
    let node = cluster.node("n");
    for seq in 1..=3 {
        cluster.send("a", "ann", seq).await;
    }
    cluster
        .await_count("faulty.out", 3, Duration::from_secs(10))
        .await;
    let seqs = faulty_outputs(&cluster);
    assert_eq!(seqs, [json!(1), json!(2), json!(3)]);
    assert!(cluster.memory.messages("faulty.out.dlq").is_empty());
    node.stop().await;
}

/// A partition let go (its node stopping) while a failed fire waits out its retry
/// backoff finishes the retries, dead-letters the fire and writes what it applied
/// before it lets go: the next owner repeats no output and no dead letter.
#[tokio::test]
async fn a_partition_let_go_during_a_retry_backoff_hands_over_what_it_applied() {
    let mut decl = faulty_graph(Failure::Error);
    decl.reactor.node_retry_backoff = Duration::from_millis(300);
    let cluster = Cluster::new(decl).await;
    // Both in the batch the failed fire holds up: event 1's output is out, its
    // position not yet written.
    cluster.send("a", "ann", 1).await;
    cluster.send("a", "ann", 2).await;
    let node = cluster.node("n");
    cluster
        .await_count("faulty.out", 1, Duration::from_secs(10))
        .await;
    // Within the first backoff of the fire of event 2.
    tokio::time::sleep(Duration::from_millis(100)).await;
    node.stop().await;
    let again = cluster.node("again");
    cluster.send("a", "ann", 3).await;
    cluster
        .await_count("faulty.out", 2, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seqs = faulty_outputs(&cluster);
    assert_eq!(seqs, [json!(1), json!(3)]);
    assert_eq!(cluster.memory.messages("faulty.out.dlq").len(), 1);
    again.stop().await;
}

async fn a_failing_fire_is_dead_lettered_and_the_key_goes_on(failure: Failure) {
    let cluster = Cluster::new(faulty_graph(failure)).await;
    let node = cluster.node("n");
    for seq in 1..=3 {
        cluster.send("a", "ann", seq).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let fired = loop {
        let fired: Vec<(Option<String>, Value)> = cluster
            .memory
            .messages("faulty.out")
            .iter()
            .map(|m| {
                let key = m.key.as_deref().map(|k| String::from_utf8_lossy(k).into());
                (
                    key,
                    serde_json::from_slice::<Value>(&m.payload).unwrap()["seq"].clone(),
                )
            })
            .collect();
        if fired.len() >= 2 && !cluster.memory.messages("faulty.out.dlq").is_empty() {
            break fired;
        }
        assert!(tokio::time::Instant::now() < deadline, "fired {fired:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let ann = Some("ann".to_string());
    assert_eq!(fired, [(ann.clone(), json!(1)), (ann.clone(), json!(3))]);
    let dead = cluster.memory.messages("faulty.out.dlq");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].key.as_deref(), Some(&b"ann"[..]));
    let error = dead[0].header(weir::wire::ERROR_HEADER).unwrap_or_default();
    assert!(error.contains("cannot take the second event"), "{error}");
    if let Failure::Panic = failure {
        assert!(error.contains("panicked"), "{error}");
    }
    let record: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(record["key"], "ann");
    assert_eq!(record["fire"], 2);
    assert_eq!(record["error"], error);
    assert_eq!(record["inputs"]["a"]["seq"], 2);
    // Where the input came from, to find it again: the second message of `faulty.a`.
    let sent = cluster.memory.messages("faulty.a");
    let second = sent
        .iter()
        .find(|m| serde_json::from_slice::<Value>(&m.payload).unwrap()["seq"] == 2)
        .unwrap();
    assert_eq!(
        record["positions"]["a"],
        json!([{"partition": second.position.partition, "offset": second.position.offset}]),
        "{record}"
    );
    // Restarted from what was stored, the node fires nothing again.
    node.stop().await;
    let again = cluster.node("again");
    cluster.send("a", "ann", 4).await;
    cluster
        .await_count("faulty.out", 3, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(cluster.memory.messages("faulty.out").len(), 3);
    assert_eq!(cluster.memory.messages("faulty.out.dlq").len(), 1);
    again.stop().await;
}

/// Ten keys whose `a` events wait for `b`, on one partition keeping two keys in memory:
/// the others leave memory with their queued events, which must come back from the
/// store when `b` arrives, whether the same node or a new one meets them again.
async fn keys_leaving_memory_keep_their_queued_events(kill_between: bool) {
    let mut decl = graph("cold", &["a", "b"], Criteria::WhenAll);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.max_keys_in_memory = 2;
    let cluster = Cluster::new(decl).await;
    let mut node = cluster.node("n");
    let users: Vec<String> = (0..10).map(|i| format!("u{i}")).collect();
    for (i, user) in users.iter().enumerate() {
        cluster.send("a", user, i as u64).await;
    }
    for user in &users {
        cluster.await_stored_queue(user, "a", 1).await;
    }
    if kill_between {
        node.kill();
        node = cluster.node("m");
    }
    for (i, user) in users.iter().enumerate() {
        cluster.send("b", user, 100 + i as u64).await;
    }
    let sent: HashSet<(String, u64)> = users
        .iter()
        .enumerate()
        .map(|(i, u)| (u.clone(), i as u64))
        .collect();
    let outputs = cluster.await_outputs(&sent).await;
    for o in &outputs {
        let a = o["inputs"]["a"]["seq"].as_u64().unwrap();
        assert_eq!(o["inputs"]["b"]["seq"].as_u64(), Some(100 + a), "{o}");
        assert_eq!(o["key"].as_str(), Some(format!("u{a}").as_str()), "{o}");
    }
    assert_eq!(outputs.len(), users.len(), "{outputs:?}");
    node.stop().await;
}

#[tokio::test]
async fn keys_leaving_memory_keep_their_queued_events_for_the_same_node() {
    keys_leaving_memory_keep_their_queued_events(false).await;
}

#[tokio::test]
async fn keys_leaving_memory_keep_their_queued_events_for_the_next_owner() {
    keys_leaving_memory_keep_their_queued_events(true).await;
}

/// Two keys wait in a join; once both sources reach events more than `key_idle` newer
/// than theirs, their state is removed, in memory and in the store, whether they are
/// still in memory or left it, and their queued inputs are dead-lettered. Their next
/// events start afresh, while keys with a recent event keep their own.
async fn idle_keys_lose_their_state(max_keys_in_memory: usize) {
    let mut decl = graph("idle", &["a", "b"], Criteria::WhenAll);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.max_keys_in_memory = max_keys_in_memory;
    keying.key_idle = Some(Duration::from_millis(500));
    let cluster = Cluster::new(decl).await;
    let node = cluster.node("n");
    cluster.send("a", "old1", 1).await;
    cluster.send("a", "old2", 2).await;
    cluster.send("b", "other", 4).await;
    cluster.await_stored_queue("old1", "a", 1).await;
    cluster.await_stored_queue("old2", "a", 1).await;
    cluster.await_stored_queue("other", "b", 1).await;
    // Events on both sources whose broker times are past both keys' idle time.
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "new", 3).await;
    cluster.send("b", "other", 5).await;
    cluster.await_forgotten("old1").await;
    cluster.await_forgotten("old2").await;
    cluster.await_stored_queue("new", "a", 1).await;
    // Applied in this order, one partition: had old1 kept its queued `a`, it would fire
    // before new does.
    cluster.send("b", "old1", 11).await;
    cluster.send("b", "new", 13).await;
    cluster
        .await_count("idle.out", 1, Duration::from_secs(10))
        .await;
    let outputs = cluster.outputs();
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    assert_eq!(outputs[0]["key"], "new", "{outputs:?}");
    assert_eq!(outputs[0]["inputs"]["a"]["seq"], 3, "{outputs:?}");
    assert_eq!(outputs[0]["inputs"]["b"]["seq"], 13, "{outputs:?}");
    cluster.await_stored_queue("old1", "b", 1).await;
    cluster.await_stored_queue("old1", "a", 0).await;
    // What the removed keys held unfired went to the dead-letter topic first, with the
    // key and the reason; the key that stayed lost nothing there.
    let dead = cluster.memory.messages("idle.a.dlq");
    let mut letters: Vec<(String, u64)> = dead
        .iter()
        .map(|letter| {
            let error = letter.header(weir::wire::ERROR_HEADER).unwrap_or_default();
            assert!(error.contains("key_idle_ms"), "{error}");
            let value: Value = serde_json::from_slice(&letter.payload).unwrap();
            let key = String::from_utf8(letter.key.clone().unwrap().to_vec()).unwrap();
            assert_eq!(value["user"], key.as_str());
            (key, value["seq"].as_u64().unwrap())
        })
        .collect();
    letters.sort();
    assert_eq!(
        letters,
        [("old1".to_string(), 1), ("old2".to_string(), 2)],
        "{dead:?}"
    );
    assert!(cluster.memory.messages("idle.b.dlq").is_empty());
    node.stop().await;
}

/// Idle keys by the hundred, most out of memory, have every unfired input
/// dead-lettered once, each key's in its queue's order, though the broker takes the
/// letters sent side by side in another order than they were sent in.
#[tokio::test]
async fn many_idle_keys_have_each_unfired_input_dead_lettered_once_in_order() {
    let mut decl = graph("many", &["a", "b"], Criteria::WhenAll);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_millis(500));
    let mut cluster = Cluster::new(decl).await;
    cluster.broker = Arc::new(common::WithSink {
        broker: cluster.broker.clone(),
        sink: Arc::new(TakesSlowly {
            inner: cluster.broker.sink(),
            taken: Default::default(),
        }),
    });
    let node = cluster.node("n");
    let keys = 150;
    for n in 0..keys {
        cluster.send("a", &format!("k{n}"), n).await;
    }
    for seq in [1000, 1001, 1002] {
        cluster.send("a", "deep", seq).await;
    }
    cluster.await_stored_queue("deep", "a", 3).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "fresh", 2000).await;
    cluster.send("b", "fresh", 2001).await;
    cluster.await_forgotten("deep").await;
    cluster.await_forgotten(&format!("k{}", keys - 1)).await;
    cluster
        .await_count("many.a.dlq", keys as usize + 3, Duration::from_secs(10))
        .await;
    let letters: Vec<(String, u64)> = cluster
        .memory
        .messages("many.a.dlq")
        .iter()
        .map(|letter| {
            let value: Value = serde_json::from_slice(&letter.payload).unwrap();
            let key = String::from_utf8(letter.key.clone().unwrap().to_vec()).unwrap();
            (key, value["seq"].as_u64().unwrap())
        })
        .collect();
    let deep: Vec<u64> = letters
        .iter()
        .filter(|(key, _)| key == "deep")
        .map(|(_, seq)| *seq)
        .collect();
    assert_eq!(deep, [1000, 1001, 1002], "in the queue's order");
    assert_eq!(letters.len(), keys as usize + 3, "{letters:?}");
    let mut each = letters.clone();
    each.sort();
    each.dedup();
    assert_eq!(each.len(), letters.len(), "each once");
    for n in 0..keys {
        assert!(each.contains(&(format!("k{n}"), n)), "k{n}");
    }
    node.stop().await;
}

#[tokio::test]
async fn idle_keys_in_memory_lose_their_state() {
    idle_keys_lose_their_state(10).await;
}

#[tokio::test]
async fn idle_keys_that_left_memory_lose_their_state() {
    idle_keys_lose_their_state(1).await;
}

/// A graph of sources `a` and `b` joined with `when_all` on their latest values, one
/// partition, whose keys expire after 500 ms without an event.
fn latest_expiring_idle_keys(name: &str) -> GraphDeclaration {
    latest_expiring_idle_keys_over(name, &["a", "b"])
}

/// As [`latest_expiring_idle_keys`], over `sources`.
fn latest_expiring_idle_keys_over(name: &str, sources: &[&str]) -> GraphDeclaration {
    let mut decl = graph(name, sources, Criteria::WhenAll);
    decl.reactor.strategy = Strategy::Latest;
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_millis(500));
    decl
}

/// `topic` holds one dead letter: key `lone`'s event `seq`.
fn assert_lone_letter(cluster: &Cluster, topic: &str, seq: u64) {
    let dead = cluster.memory.messages(topic);
    assert_eq!(dead.len(), 1, "only lone's input: {dead:?}");
    assert_eq!(dead[0].key.as_deref(), Some(&b"lone"[..]));
    let value: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(value["seq"], seq);
}

/// With the latest strategy, an idle key's latest value that no fire took (its other
/// source never came) is dead-lettered as the key is removed; one that fired is not.
#[tokio::test]
async fn an_idle_keys_unfired_latest_value_is_dead_lettered() {
    let decl = latest_expiring_idle_keys("latest");
    let cluster = Cluster::new(decl).await;
    let node = cluster.node("n");
    cluster.send("a", "lone", 1).await;
    cluster.send("a", "done", 2).await;
    cluster.send("b", "done", 3).await;
    cluster
        .await_count("latest.out", 1, Duration::from_secs(10))
        .await;
    // Events on both sources whose broker times are past both keys' idle time.
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "fresh", 4).await;
    cluster.send("b", "fresh", 5).await;
    cluster.await_forgotten("lone").await;
    cluster.await_forgotten("done").await;
    assert_lone_letter(&cluster, "latest.a.dlq", 1);
    assert!(cluster.memory.messages("latest.b.dlq").is_empty());
    node.stop().await;
}

/// The broker, but the sources of `topic` hand over nothing until `until`, as a source
/// behind the others on a long backlog; counts the sources it holds back.
struct ReadsHeldBack {
    broker: Arc<dyn Broker>,
    topic: String,
    until: tokio::time::Instant,
    held: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait::async_trait]
impl Broker for ReadsHeldBack {
    fn kind(&self) -> &'static str {
        self.broker.kind()
    }

    async fn subscribe(
        &self,
        subscription: &weir::transport::Subscription,
    ) -> Result<Box<dyn weir::transport::Source>, weir::transport::TransportError> {
        let source = self.broker.subscribe(subscription).await?;
        if subscription.topic != self.topic {
            return Ok(source);
        }
        self.held.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Box::new(HeldBack {
            source,
            until: self.until,
        }))
    }

    fn sink(&self) -> Arc<dyn weir::transport::Sink> {
        self.broker.sink()
    }

    async fn partitioned(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<weir::transport::PartitionedTopic, weir::transport::TransportError> {
        self.broker.partitioned(topic, partitions).await
    }

    async fn ping(&self) -> Result<(), weir::transport::TransportError> {
        self.broker.ping().await
    }
}

struct HeldBack {
    source: Box<dyn weir::transport::Source>,
    until: tokio::time::Instant,
}

#[async_trait::async_trait]
impl weir::transport::Source for HeldBack {
    async fn next(&mut self) -> Result<weir::transport::Message, weir::transport::TransportError> {
        tokio::time::sleep_until(self.until).await;
        self.source.next().await
    }

    fn ready(
        &mut self,
    ) -> Option<Result<weir::transport::Message, weir::transport::TransportError>> {
        if tokio::time::Instant::now() < self.until {
            return None;
        }
        self.source.ready()
    }

    async fn commit(
        &mut self,
        through: &[weir::transport::Position],
    ) -> Result<(), weir::transport::TransportError> {
        self.source.commit(through).await
    }
}

/// A node down for longer than `key_idle_ms`, then started again on a backlog whose
/// second source it reaches seconds after the first: the idle clock follows the
/// sources' event times, held back by the source behind, so neither the downtime nor
/// the other source's newer events make a key idle whose next event is still to be
/// read. The key fires with its queued input once that event comes; nothing is
/// dead-lettered.
#[tokio::test]
async fn neither_downtime_nor_a_source_ahead_on_its_backlog_makes_a_key_idle() {
    let mut decl = graph("held", &["a", "b"], Criteria::WhenAll);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_millis(500));
    let cluster = Cluster::new(decl).await;
    let node = cluster.node("n1");
    cluster.send("a", "waiting", 1).await;
    cluster.await_stored_queue("waiting", "a", 1).await;
    node.stop().await;
    // The key's next event, on the other source, 100 ms of event time later; then,
    // past the key's idle time, newer events on the first source.
    tokio::time::sleep(Duration::from_millis(100)).await;
    cluster.send("b", "waiting", 2).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "later", 3).await;
    cluster.send("a", "latest", 4).await;
    // Two looks for idle keys (one a second) while `b` is held back and `a` is read.
    let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let behind = Cluster {
        broker: Arc::new(ReadsHeldBack {
            broker: cluster.broker.clone(),
            topic: "held.b".into(),
            until: tokio::time::Instant::now() + Duration::from_millis(2500),
            held: held.clone(),
        }),
        memory: cluster.memory.clone(),
        store: cluster.store.clone(),
        decl: cluster.decl.clone(),
        topics: cluster.topics.clone(),
    };
    let node = behind.node("n2");
    cluster.await_stored_queue("later", "a", 1).await;
    cluster.await_stored_queue("latest", "a", 1).await;
    assert_eq!(
        held.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "source b held back"
    );
    cluster
        .await_count("held.out", 1, Duration::from_secs(10))
        .await;
    let outputs = cluster.outputs();
    assert_eq!(outputs.len(), 1, "{outputs:?}");
    assert_eq!(outputs[0]["key"], "waiting", "{outputs:?}");
    assert_eq!(outputs[0]["inputs"]["a"]["seq"], 1, "{outputs:?}");
    assert_eq!(outputs[0]["inputs"]["b"]["seq"], 2, "{outputs:?}");
    assert!(cluster.memory.messages("held.a.dlq").is_empty());
    assert!(cluster.memory.messages("held.b.dlq").is_empty());
    node.stop().await;
}

/// Takes each message after a pause of 0 to 3 ms, so that messages handed over side by
/// side are taken in another order than they were handed over in.
struct TakesSlowly {
    inner: Arc<dyn weir::transport::Sink>,
    taken: std::sync::atomic::AtomicU64,
}

#[async_trait::async_trait]
impl weir::transport::Sink for TakesSlowly {
    async fn publish(
        &self,
        message: Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        let n = self.taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(n * 7 % 4)).await;
        self.inner.publish(message).await
    }
}

/// Passes every message on; once a dead letter has gone, the store's partition
/// writes start failing, as Redis going away right after the letter was sent.
struct StoreGoesAfterALetter {
    inner: Arc<dyn weir::transport::Sink>,
    store: Arc<common::FlakyStore>,
}

#[async_trait::async_trait]
impl weir::transport::Sink for StoreGoesAfterALetter {
    async fn publish(
        &self,
        message: Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        let letter = message.topic.ends_with(".dlq");
        let sent = self.inner.publish(message).await;
        if letter {
            self.store.fail_writes(usize::MAX);
        }
        sent
    }
}

/// An idle key's dead letters go out before its removal is written: when the removal
/// is not (the store gone right after the letter, and the node with it), the next
/// owner finds the key still stored and sends its letters again, then removes it.
#[tokio::test]
async fn an_idle_keys_letters_go_out_again_when_its_removal_was_not_written() {
    let mut decl = graph("unremoved", &["a", "b"], Criteria::WhenAll);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_millis(500));
    let cluster = Cluster::new(decl).await;
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let going = Cluster {
        broker: Arc::new(common::WithSink {
            broker: cluster.broker.clone(),
            sink: Arc::new(StoreGoesAfterALetter {
                inner: cluster.broker.sink(),
                store: flaky.clone(),
            }),
        }),
        memory: cluster.memory.clone(),
        store: cluster.store.clone(),
        decl: cluster.decl.clone(),
        topics: cluster.topics.clone(),
    };
    let node = going.node_on("n1", flaky.clone());
    cluster.send("a", "lone", 1).await;
    cluster.await_stored_queue("lone", "a", 1).await;
    // Events on both sources past the key's idle time.
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "fresh", 2).await;
    cluster.send("b", "fresh", 3).await;
    let dead = || cluster.memory.messages("unremoved.a.dlq");
    common::eventually("the idle key's letter", || async { !dead().is_empty() }).await;
    node.kill();
    cluster.await_stored_queue("lone", "a", 1).await;
    assert_eq!(dead().len(), 1, "{:?}", dead());
    let node = cluster.node("n2");
    // The next owner's clock moves with the events it reads.
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "later", 4).await;
    cluster.send("b", "later", 5).await;
    cluster.await_forgotten("lone").await;
    let letters = dead();
    assert_eq!(letters.len(), 2, "{letters:?}");
    for letter in &letters {
        assert_eq!(letter.key.as_deref(), Some(&b"lone"[..]));
        let value: Value = serde_json::from_slice(&letter.payload).unwrap();
        assert_eq!(value["seq"], 1);
    }
    node.stop().await;
}

/// An idle key whose dead letter the broker refuses for good is kept, state and all,
/// while the other idle keys go; once the letter is taken, at a later look, the key
/// goes too, its input dead-lettered once.
#[tokio::test]
async fn an_idle_key_whose_dead_letter_is_refused_is_kept_until_it_is_taken() {
    let decl = latest_expiring_idle_keys("refused");
    let mut cluster = Cluster::new(decl).await;
    let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    cluster.broker = Arc::new(common::WithSink {
        broker: cluster.broker.clone(),
        sink: Arc::new(common::DeadLettersDown {
            inner: cluster.broker.sink(),
            down: refusing.clone(),
            refused: Arc::default(),
            for_good: true,
        }),
    });
    let node = cluster.node("n");
    cluster.send("a", "lone", 1).await;
    cluster.send("a", "done", 2).await;
    cluster.send("b", "done", 3).await;
    cluster
        .await_count("refused.out", 1, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "fresh", 4).await;
    cluster.send("b", "fresh", 5).await;
    cluster.await_forgotten("done").await;
    let view = |key: &'static str| {
        let (store, name) = (cluster.store.clone(), cluster.decl.name.clone());
        async move {
            weir::keyed::view(store.as_ref(), &name, 1, key)
                .await
                .unwrap()
        }
    };
    // Idle keys are looked for every second: "lone" stays through the next look too.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        view("lone").await.is_some(),
        "kept while its letter is refused"
    );
    assert!(cluster.memory.messages("refused.a.dlq").is_empty());
    refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    cluster.await_forgotten("lone").await;
    assert_lone_letter(&cluster, "refused.a.dlq", 1);
    node.stop().await;
}

/// More idle keys kept for a refused letter than a look reads at once hold up none of
/// the idle keys behind them, and each kept key's letter is tried once per look, not once
/// per page.
#[tokio::test]
async fn a_page_full_of_kept_idle_keys_holds_up_none_of_the_others() {
    let decl = latest_expiring_idle_keys("manykept");
    let mut cluster = Cluster::new(decl).await;
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    cluster.broker = Arc::new(common::WithSink {
        broker: cluster.broker.clone(),
        sink: Arc::new(common::DeadLettersDown {
            inner: cluster.broker.sink(),
            down: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            refused: refused.clone(),
            for_good: true,
        }),
    });
    // More than the thousand keys a page of the look holds, each with an unfired input.
    const KEPT: usize = 1001;
    let node = cluster.node("n");
    for i in 0..KEPT {
        cluster.send("a", &format!("kept-{i}"), i as u64).await;
    }
    // Later than every kept key, so behind all of them in the store's order.
    tokio::time::sleep(Duration::from_millis(20)).await;
    cluster.send("a", "done", 1).await;
    cluster.send("b", "done", 2).await;
    cluster
        .await_count("manykept.out", 1, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "fresh", 3).await;
    cluster.send("b", "fresh", 4).await;
    cluster.await_forgotten("done").await;
    let before = refused.load(std::sync::atomic::Ordering::SeqCst);
    // Idle keys are looked for every second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = refused.load(std::sync::atomic::Ordering::SeqCst) - before;
    assert!(
        (KEPT..=2 * KEPT).contains(&during),
        "{during} letters refused in 1.5 s: each kept key is tried once a look"
    );
    for key in ["kept-0", "kept-1000"] {
        let stored = weir::keyed::view(cluster.store.as_ref(), "manykept", 1, key)
            .await
            .unwrap();
        assert!(stored.is_some(), "{key} kept while its letter is refused");
    }
    node.stop().await;
}

/// Refuses, for good, what goes to one topic while `refusing` is set.
struct RefusingTopic {
    inner: Arc<dyn weir::transport::Sink>,
    topic: String,
    refusing: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl weir::transport::Sink for RefusingTopic {
    async fn publish(
        &self,
        message: weir::transport::Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        if message.topic == self.topic && self.refusing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(weir::transport::TransportError::Publish {
                topic: message.topic.to_string(),
                source: "topic authorization failed".into(),
                retryable: false,
            });
        }
        self.inner.publish(message).await
    }
}

/// An idle key whose first letter went and whose second was refused sends only the
/// second at the next looks: once it is taken, each of its inputs has one dead letter.
#[tokio::test]
async fn a_kept_idle_key_sends_again_only_the_letters_that_did_not_go() {
    let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (cluster, node) = lone_idle_with_its_letter_to_b_refused("partly", &refusing).await;
    assert!(
        weir::keyed::view(cluster.store.as_ref(), "partly", 1, "lone")
            .await
            .unwrap()
            .is_some(),
        "kept while its letter to b is refused"
    );
    let dead = cluster.memory.messages("partly.a.dlq");
    assert_eq!(
        dead.len(),
        1,
        "the letter that went is not sent again: {dead:?}"
    );
    refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(700)).await;
    for source in ["a", "b", "c"] {
        cluster.send(source, "fresh", 8).await;
    }
    cluster.await_forgotten("lone").await;
    for (topic, seq) in [("partly.a.dlq", 1), ("partly.b.dlq", 2)] {
        let dead = cluster.memory.messages(topic);
        assert_eq!(dead.len(), 1, "{topic}: {dead:?}");
        let value: Value = serde_json::from_slice(&dead[0].payload).unwrap();
        assert_eq!(value["seq"], seq);
    }
    node.stop().await;
}

/// A node running graph `name` (latest, when_all over a, b and c, keys idle after
/// 500 ms) whose key `lone` got inputs from a and b only, then went idle while the clock
/// moved over several looks (one a second): the letter of its input from b refused
/// while `refusing` holds.
async fn lone_idle_with_its_letter_to_b_refused(
    name: &str,
    refusing: &Arc<std::sync::atomic::AtomicBool>,
) -> (Cluster, TaskNode) {
    let decl = latest_expiring_idle_keys_over(name, &["a", "b", "c"]);
    let mut cluster = Cluster::new(decl).await;
    cluster.broker = Arc::new(common::WithSink {
        broker: cluster.broker.clone(),
        sink: Arc::new(RefusingTopic {
            inner: cluster.broker.sink(),
            topic: format!("{name}.b.dlq"),
            refusing: refusing.clone(),
        }),
    });
    let node = cluster.node("n");
    cluster.send("a", "lone", 1).await;
    cluster.send("b", "lone", 2).await;
    for seq in 3..8 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        for source in ["a", "b", "c"] {
            cluster.send(source, "fresh", seq).await;
        }
    }
    (cluster, node)
}

/// A key kept after idling, one of its inputs dead-lettered then, takes an event: the
/// dead-lettered input is not fired as well, and the one whose letter was refused stays
/// for the key's next fire.
#[tokio::test]
async fn a_kept_idle_key_fires_none_of_its_dead_lettered_inputs_once_it_has_an_event() {
    let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (cluster, node) = lone_idle_with_its_letter_to_b_refused("revived", &refusing).await;
    assert_lone_letter(&cluster, "revived.a.dlq", 1);
    cluster.send("c", "lone", 20).await;
    cluster.send("a", "lone", 21).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let fired = loop {
        let lone: Vec<Value> = cluster
            .outputs()
            .into_iter()
            .filter(|o| o["key"] == "lone")
            .collect();
        assert!(
            !lone.iter().any(|o| o["inputs"]["a"]["seq"] == 1),
            "lone fired the input it dead-lettered: {lone:?}"
        );
        if lone.iter().any(|o| o["inputs"]["a"]["seq"] == 21) {
            break lone;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no fire of lone: {lone:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        fired.len(),
        1,
        "lone fired once, with a's new input: {fired:?}"
    );
    let inputs = &fired[0]["inputs"];
    assert_eq!(
        inputs["b"]["seq"], 2,
        "b's input, its letter refused, stays: {inputs}"
    );
    assert_eq!(inputs["c"]["seq"], 20, "{inputs}");
    node.stop().await;
}

/// An idle key, out of memory, whose stored state does not read back is removed without
/// letters and holds up none of the others: the idle key beside it still has its unfired
/// input dead-lettered, and both go.
#[tokio::test]
async fn an_idle_key_whose_state_cannot_be_read_is_removed_without_holding_up_the_others() {
    let mut decl = latest_expiring_idle_keys("unreadable");
    decl.keyed.as_mut().unwrap().max_keys_in_memory = 1;
    let cluster = Cluster::new(decl).await;
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let node = cluster.node_on("n", flaky.clone());
    cluster.send("a", "bad", 1).await;
    cluster.send("a", "lone", 2).await;
    cluster.send("a", "done", 3).await;
    cluster.send("b", "done", 4).await;
    cluster
        .await_count("unreadable.out", 1, Duration::from_secs(10))
        .await;
    flaky.make_unreadable("bad");
    tokio::time::sleep(Duration::from_millis(800)).await;
    // A key of their own: the idle ones are out of memory, and read from the store.
    cluster.send("a", "fresh", 5).await;
    cluster.send("b", "fresh", 6).await;
    for key in ["bad", "lone", "done"] {
        cluster.await_forgotten(key).await;
    }
    assert_lone_letter(&cluster, "unreadable.a.dlq", 2);
    node.stop().await;
}

/// An event for a key out of memory whose stored state does not read back (written by
/// another version, say) is dead-lettered naming the cause, and holds up no other key:
/// the partition goes on past it.
#[tokio::test]
async fn an_event_for_a_key_whose_stored_state_cannot_be_read_is_dead_lettered() {
    let mut decl = graph("badstate", &["a"], Criteria::WhenAny);
    decl.keyed.as_mut().unwrap().partitions = 1;
    let cluster = Cluster::new(decl).await;
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let mut sent = HashSet::new();
    let first = cluster.node_on("first", flaky.clone());
    for (user, seq) in [("bad", 1), ("good", 2)] {
        cluster.send("a", user, seq).await;
        sent.insert((user.to_string(), seq));
    }
    cluster.await_outputs(&sent).await;
    first.stop().await;
    // The next node has neither key in memory, so it reads both from the store.
    flaky.make_unreadable("bad");
    let next = cluster.node_on("next", flaky.clone());
    for (user, seq) in [("bad", 3), ("good", 4), ("good", 5)] {
        cluster.send("a", user, seq).await;
    }
    sent.extend([("good".to_string(), 4), ("good".to_string(), 5)]);
    cluster.await_outputs(&sent).await;
    cluster
        .await_count("badstate.a.dlq", 1, Duration::from_secs(10))
        .await;
    let dead = cluster.memory.messages("badstate.a.dlq");
    assert_eq!(dead.len(), 1, "{dead:?}");
    let reason = dead[0].header(weir::wire::ERROR_HEADER).unwrap();
    assert!(
        reason.contains("stored state of key bad cannot be read"),
        "{reason}"
    );
    let letter: Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(letter["seq"], json!(3));
    assert!(
        !cluster
            .outputs()
            .iter()
            .any(|o| o["inputs"]["a"]["seq"] == json!(3)),
        "the unreadable key's event fired"
    );
    next.stop().await;
}

/// A sink whose first message to `topic` waits until `release` is set, as a hand-over
/// does that a client keeps waiting (its queue full, say); `holding` is set meanwhile.
struct FirstHeldBack {
    inner: Arc<dyn weir::transport::Sink>,
    topic: String,
    holding: Arc<std::sync::atomic::AtomicBool>,
    release: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl weir::transport::Sink for FirstHeldBack {
    async fn publish(
        &self,
        message: Outbound,
    ) -> Result<weir::transport::Position, weir::transport::TransportError> {
        use std::sync::atomic::Ordering::SeqCst;
        if *message.topic == *self.topic && !self.holding.swap(true, SeqCst) {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while !self.release.load(SeqCst) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        self.inner.publish(message).await
    }
}

/// A node whose lease runs out while it hands a fire's first output over (the lease
/// keeper paused, the client holding the hand-over back) publishes none of the fire's
/// later outputs under its old fencing token: the token on a key's outputs never goes
/// back.
#[tokio::test]
async fn a_node_whose_lease_ran_out_during_a_fires_first_output_publishes_no_later_one() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let mut keying = Keying::new(KeySource::Pointer("/user".into()));
    keying.partitions = 1;
    keying.lease_ttl = Duration::from_millis(600);
    let decl = GraphBuilder::new("lapsed")
        .criteria(Criteria::WhenAny)
        .strategy(Strategy::Sequential)
        .keyed(keying)
        .accumulator(AccumulatorSpec::passthrough("a").topic("lapsed.a"))
        .function("snapshot", &FunctionRegistry::default(), "snapshot")
        .output("snapshot", "lapsed.out")
        .output("snapshot", "lapsed.later")
        .build()
        .unwrap();
    let first = "lapsed.out".to_string();
    let mut cluster = Cluster::new(decl).await;
    let (holding, release) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    cluster.broker = Arc::new(common::WithSink {
        broker: cluster.broker.clone(),
        sink: Arc::new(FirstHeldBack {
            inner: cluster.broker.sink(),
            topic: first.clone(),
            holding: holding.clone(),
            release: release.clone(),
        }),
    });
    let flaky = Arc::new(common::FlakyStore::new(cluster.store.clone()));
    let node = cluster.node_on("n", flaky.clone());
    cluster.send("a", "k", 1).await;
    common::eventually("the first output held", || async { holding.load(SeqCst) }).await;
    // Paused past its lease's TTL (600 ms) while the hand-over waits.
    flaky.hold_renewals(true);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    release.store(true, SeqCst);
    cluster
        .await_count(&first, 1, Duration::from_secs(10))
        .await;
    let stale = cluster.memory.messages(&first)[0]
        .header(weir::wire::FENCING_HEADER)
        .map(str::to_string);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = cluster.memory.messages("lapsed.later");
    assert!(
        later
            .iter()
            .all(|m| m.header(weir::wire::FENCING_HEADER).map(str::to_string) != stale),
        "an output published under the token {stale:?} of a lease run out: {later:?}"
    );
    // Renewing again, the node takes the partition back and fires the event again,
    // under a newer token, both outputs.
    flaky.hold_renewals(false);
    cluster
        .await_count("lapsed.later", 1, Duration::from_secs(10))
        .await;
    let token = |m: &weir::transport::Message| {
        m.header(weir::wire::FENCING_HEADER)
            .and_then(|t| t.parse::<u64>().ok())
    };
    let stale_token = stale.as_deref().and_then(|t| t.parse::<u64>().ok());
    assert!(cluster
        .memory
        .messages("lapsed.later")
        .iter()
        .all(|m| token(m) > stale_token));
    node.stop().await;
}

/// A graph that stops expiring idle keys drops the times kept for it with the first
/// batch it writes, so that times gone stale meanwhile expire nothing should expiry
/// come back; every key keeps its state.
#[tokio::test]
async fn a_graph_no_longer_expiring_idle_keys_drops_their_times() {
    let mut decl = graph("untimed", &["a", "b"], Criteria::WhenAll);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_secs(3600));
    let mut cluster = Cluster::new(decl).await;
    let node = cluster.node("n");
    cluster.send("a", "k", 1).await;
    cluster.await_stored_queue("k", "a", 1).await;
    let timed = |store: Arc<dyn Store>| async move {
        store
            .idle_keys("untimed", 0, i64::MAX, 0, 10)
            .await
            .unwrap()
    };
    assert_eq!(timed(cluster.store.clone()).await, ["k"]);
    node.stop().await;
    cluster.decl.keyed.as_mut().unwrap().key_idle = None;
    let node = cluster.node("m");
    // Dropped with the first batch the partition writes.
    cluster.send("b", "z", 2).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !timed(cluster.store.clone()).await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "times still kept after 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.await_stored_queue("k", "a", 1).await;
    node.stop().await;
}

/// A key that expired and came back numbers its fires past the ones it had, on the node
/// that saw it go or on the next owner, so `weir-fire` stays an idempotency key.
#[tokio::test]
async fn a_key_back_after_expiring_fires_under_higher_numbers() {
    let mut decl = graph("again", &["a"], Criteria::WhenAny);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_millis(500));
    let cluster = Cluster::new(decl).await;
    let node = cluster.node("n");
    for seq in 0..3 {
        cluster.send("a", "k", seq).await;
    }
    cluster
        .await_count("again.out", 3, Duration::from_secs(10))
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.send("a", "other", 10).await;
    cluster.await_forgotten("k").await;
    node.stop().await;
    let node = cluster.node("m");
    cluster.send("a", "k", 20).await;
    cluster
        .await_count("again.out", 5, Duration::from_secs(10))
        .await;
    let fires: Vec<u64> = cluster
        .memory
        .messages("again.out")
        .iter()
        .filter(|m| m.key.as_deref() == Some(&b"k"[..]))
        .map(|m| m.header(weir::wire::FIRE_HEADER).unwrap().parse().unwrap())
        .collect();
    assert_eq!(fires.len(), 4, "{fires:?}");
    assert!(fires.windows(2).all(|w| w[0] < w[1]), "{fires:?}");
    node.stop().await;
}

/// Where idle keys expire, keys met afresh number their fires from a floor that only a
/// removal of idle keys raises, not each batch's write: a run carried on from the store
/// after a crash, cutting its batches elsewhere, numbers them as the run before did.
#[tokio::test]
async fn keys_met_afresh_number_their_fires_from_a_floor_that_batches_leave_alone() {
    let mut decl = graph("floor", &["a"], Criteria::WhenAny);
    let keying = decl.keyed.as_mut().unwrap();
    keying.partitions = 1;
    keying.key_idle = Some(Duration::from_secs(3600));
    let cluster = Cluster::new(decl).await;
    let node = cluster.node("n");
    cluster.send("a", "k1", 1).await;
    cluster.send("a", "k1", 2).await;
    cluster
        .await_count("floor.out", 2, Duration::from_secs(10))
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Written: k1's two fires, and the high with them.
    while cluster
        .store
        .load_fire_numbers("floor", 0)
        .await
        .unwrap()
        .high
        < 2
    {
        assert!(tokio::time::Instant::now() < deadline, "high not written");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.send("a", "k2", 3).await;
    cluster
        .await_count("floor.out", 3, Duration::from_secs(10))
        .await;
    let fires: Vec<(Vec<u8>, String)> = cluster
        .memory
        .messages("floor.out")
        .iter()
        .map(|m| {
            let key = m.key.as_deref().unwrap_or_default().to_vec();
            (key, m.header(weir::wire::FIRE_HEADER).unwrap().to_string())
        })
        .collect();
    assert_eq!(
        fires,
        [
            (b"k1".to_vec(), "1".to_string()),
            (b"k1".to_vec(), "2".to_string()),
            (b"k2".to_vec(), "1".to_string()),
        ]
    );
    node.stop().await;
}

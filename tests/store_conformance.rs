//! One conformance suite per store role, run against every backend: each case is its own
//! test, named `<backend>::<role>::<case>`, so a failure names both. The memory store
//! always runs; Redis runs with `--features it` (started by `scripts/services`), each
//! case under a key prefix of its own that is removed when the case passes.

mod common;

use std::sync::Arc;

use weir::store::Store;

/// A store opened for one case.
pub struct Opened {
    pub store: Arc<dyn Store>,
    /// Redis key prefix to remove afterwards.
    prefix: Option<String>,
}

impl Opened {
    async fn clean_up(self) {
        #[cfg(feature = "it")]
        if let Some(prefix) = self.prefix {
            common::services::remove_redis_keys(&prefix).await;
        }
        #[cfg(not(feature = "it"))]
        let _ = self.prefix;
    }
}

pub async fn memory() -> Opened {
    Opened {
        store: Arc::new(weir::store::memory::MemoryStore::new()),
        prefix: None,
    }
}

#[cfg(feature = "it")]
pub async fn redis() -> Opened {
    let prefix = common::services::unique("weirtest");
    Opened {
        store: common::services::redis(&prefix).await,
        prefix: Some(prefix),
    }
}

/// Every case of every role, as tests against the store `$open` returns.
macro_rules! store_conformance {
    ($backend:ident: $open:path) => {
        mod $backend {
            store_conformance!(@role $open; checkpoint:
                round_trip,
                a_deposed_holders_writes_are_refused);
            store_conformance!(@role $open; cache:
                round_trip,
                a_deposed_holders_writes_are_refused);
            store_conformance!(@role $open; recovery:
                newest_first_and_filtered_by_graph,
                a_tenants_events_are_not_crowded_out_by_anothers);
            store_conformance!(@role $open; lease:
                held_by_one_renewed_and_released_by_its_holder_only,
                expiry_hands_over_with_a_larger_token,
                the_current_holder_is_shown_until_expiry,
                its_holder_takes_a_lease_again_with_the_same_token);
            store_conformance!(@role $open; membership:
                members_are_sorted_and_expire,
                a_member_that_leaves_is_gone_at_once,
                a_groups_first_partition_count_stays);
            store_conformance!(@role $open; keyed:
                keys_and_positions_round_trip,
                a_deposed_owners_batch_is_refused_whole,
                a_graph_stays_paused_until_resumed,
                idle_keys_are_listed_oldest_first_and_expire_with_their_state,
                keys_written_through_their_slots_round_trip);
            store_conformance!(@role $open; jobs:
                a_partition_batch_round_trips,
                removed_jobs_lose_their_timeouts,
                timeouts_due_far_ahead_load_back,
                a_state_nested_as_deep_as_weir_reads_loads_back,
                a_deposed_owners_batch_is_refused_whole);
            store_conformance!(@role $open; schedule:
                schedules_and_fire_times_round_trip,
                executions_are_claimed_once_and_indexed_while_open,
                a_deposed_masters_execution_writes_are_refused,
                a_masters_write_leaves_a_finished_execution_as_it_ended,
                what_a_shard_held_back_is_kept_until_forgotten,
                what_a_shard_held_back_moves_with_a_schedule,
                a_shard_is_listed_through_a_page_at_a_time_while_it_changes,
                live_nodes_expire);
            store_conformance!(@role $open; workflow:
                executions_are_created_once_and_updated_by_version,
                concurrent_updates_each_get_their_own_outcome,
                deadlines_fall_due_earliest_first,
                deadlines_are_filed_per_workflow,
                published_tasks_accumulate_per_execution);
            store_conformance!(@role $open; backend:
                answers_a_ping);
        }
    };
    (@role $open:path; $role:ident: $($case:ident),+) => {
        mod $role {
            $(
                #[tokio::test]
                async fn $case() {
                    let opened = $open().await;
                    crate::cases::$role::$case(opened.store.clone()).await;
                    opened.clean_up().await;
                }
            )+
        }
    };
}

store_conformance!(memory_store: crate::memory);
#[cfg(feature = "it")]
store_conformance!(redis_store: crate::redis);

mod cases {
    use std::sync::Arc;
    use std::time::Duration;

    use weir::store::{Fence, Lease, Store, StoreError};

    /// Takes a lease, gives it up and lets another holder take it: the fences of the
    /// deposed holder and of its successor.
    pub async fn deposed_and_current(store: &dyn Store, name: &str) -> (Fence, Fence) {
        let ttl = Duration::from_secs(60);
        let old = store.acquire_lease(name, "n1", ttl).await.unwrap().unwrap();
        assert!(store.release_lease(&old).await.unwrap());
        let new = store.acquire_lease(name, "n2", ttl).await.unwrap().unwrap();
        (Fence::from(&old), Fence::from(&new))
    }

    fn is_fenced<T: std::fmt::Debug>(result: &Result<T, StoreError>) -> bool {
        matches!(result, Err(StoreError::Fenced { .. }))
    }

    pub mod checkpoint {
        use super::*;
        use weir::store::Checkpoint;
        use weir::transport::Position;

        pub fn sample(token: Option<u64>) -> Checkpoint {
            Checkpoint {
                positions: vec![
                    Position {
                        partition: 0,
                        offset: 41,
                    },
                    Position {
                        partition: 2,
                        offset: 7,
                    },
                ],
                state: Some(serde_json::json!({"sum": 3})),
                token,
            }
        }

        pub async fn round_trip(store: Arc<dyn Store>) {
            assert_eq!(store.load_checkpoint("g", "a").await.unwrap(), None);
            store
                .save_checkpoint("g", "a", &sample(None), None)
                .await
                .unwrap();
            assert_eq!(
                store.load_checkpoint("g", "a").await.unwrap(),
                Some(sample(None))
            );
            assert_eq!(store.load_checkpoint("g", "b").await.unwrap(), None);
            assert_eq!(store.load_checkpoint("h", "a").await.unwrap(), None);
        }

        pub async fn a_deposed_holders_writes_are_refused(store: Arc<dyn Store>) {
            let (stale, current) = deposed_and_current(store.as_ref(), "g-lease").await;
            let refused = store
                .save_checkpoint("g", "a", &sample(Some(stale.token)), Some(&stale))
                .await;
            assert!(is_fenced(&refused), "{refused:?}");
            assert!(!refused.unwrap_err().is_retryable());
            assert_eq!(store.load_checkpoint("g", "a").await.unwrap(), None);
            let kept = sample(Some(current.token));
            store
                .save_checkpoint("g", "a", &kept, Some(&current))
                .await
                .unwrap();
            assert_eq!(store.load_checkpoint("g", "a").await.unwrap(), Some(kept));
        }
    }

    pub mod cache {
        use super::*;
        use weir::reactor::{CacheSnapshot, Refire, SourceSnapshot};
        use weir::transport::Position;

        fn sample() -> CacheSnapshot {
            let mut snapshot = CacheSnapshot {
                fires: 9,
                // A fire to make again under its number after a restart.
                refires: [Refire {
                    fire: 8,
                    sources: vec!["a".into()],
                }]
                .into(),
                ..Default::default()
            };
            let position = Position {
                partition: 0,
                offset: 3,
            };
            snapshot.sources.insert(
                "a",
                SourceSnapshot {
                    seen: vec![position].into(),
                    dirty: true,
                    current: Some(Arc::new(weir::Boundary {
                        source: Arc::from("a"),
                        sequence: 0,
                        positions: vec![position].into(),
                        event_time_ms: 1,
                        emit_time_ms: 2,
                        value: serde_json::json!([1, 2]),
                    })),
                    queue: Vec::new(),
                },
            );
            snapshot
        }

        pub async fn round_trip(store: Arc<dyn Store>) {
            assert_eq!(store.load_cache("g").await.unwrap(), None);
            store.save_cache("g", &sample(), None).await.unwrap();
            assert_eq!(store.load_cache("g").await.unwrap(), Some(sample()));
            assert_eq!(store.load_cache("h").await.unwrap(), None);
        }

        pub async fn a_deposed_holders_writes_are_refused(store: Arc<dyn Store>) {
            let (stale, current) = deposed_and_current(store.as_ref(), "g-lease").await;
            let refused = store.save_cache("g", &sample(), Some(&stale)).await;
            assert!(is_fenced(&refused), "{refused:?}");
            assert_eq!(store.load_cache("g").await.unwrap(), None);
            store
                .save_cache("g", &sample(), Some(&current))
                .await
                .unwrap();
            assert_eq!(store.load_cache("g").await.unwrap(), Some(sample()));
        }
    }

    pub mod recovery {
        use super::*;
        use weir::store::{RecoveryAction, RecoveryEvent};

        /// A graph's respawn, its `attempt`-th.
        pub fn event(graph: &str, attempt: u32) -> RecoveryEvent {
            RecoveryEvent {
                graph: graph.to_string(),
                component: "reactor".into(),
                action: RecoveryAction::GraphRespawned,
                attempt,
                error: "boom".into(),
                at_ms: 10,
                node_id: "n1".into(),
            }
        }

        pub async fn newest_first_and_filtered_by_graph(store: Arc<dyn Store>) {
            for (graph, attempt) in [("g", 1), ("other", 1), ("g", 2)] {
                store.record_recovery(&event(graph, attempt)).await.unwrap();
            }
            let mine = store.recovery_events(Some("g"), 10).await.unwrap();
            assert_eq!(
                mine.iter().map(|e| e.attempt).collect::<Vec<_>>(),
                vec![2, 1]
            );
            assert!(mine.iter().all(|e| e.graph == "g"));
            assert_eq!(store.recovery_events(Some("g"), 1).await.unwrap().len(), 1);
            let all = store.recovery_events(None, 100).await.unwrap();
            assert_eq!(all.len(), 3);
            assert!(all.iter().any(|e| e.graph == "other"));
        }

        /// A tenant's events are kept apart: another tenant's 10,000 newer ones, more
        /// than every graph's list keeps, leave them listed, and no one else's is.
        pub async fn a_tenants_events_are_not_crowded_out_by_anothers(store: Arc<dyn Store>) {
            for (graph, attempt) in [("acme/a", 1), ("plain", 1), ("acme/b", 2)] {
                store.record_recovery(&event(graph, attempt)).await.unwrap();
            }
            for attempt in 0..10_000 {
                store
                    .record_recovery(&event("globex/a", attempt))
                    .await
                    .unwrap();
            }
            let acme = store.tenant_recovery_events("acme", 10).await.unwrap();
            assert_eq!(
                acme.iter()
                    .map(|e| (e.graph.as_str(), e.attempt))
                    .collect::<Vec<_>>(),
                [("acme/b", 2), ("acme/a", 1)]
            );
            assert_eq!(
                store.tenant_recovery_events("acme", 1).await.unwrap().len(),
                1
            );
            let globex = store.tenant_recovery_events("globex", 3).await.unwrap();
            assert!(globex.iter().all(|e| e.graph == "globex/a"), "{globex:?}");
            assert!(store
                .tenant_recovery_events("initech", 10)
                .await
                .unwrap()
                .is_empty());
            let all = store.recovery_events(None, 20_000).await.unwrap();
            assert!(
                all.iter().all(|e| e.graph == "globex/a"),
                "crowded out there"
            );
        }
    }

    pub mod lease {
        use super::*;

        pub async fn held_by_one_renewed_and_released_by_its_holder_only(store: Arc<dyn Store>) {
            let ttl = Duration::from_secs(60);
            let first = store
                .acquire_lease("l", "n1", ttl)
                .await
                .unwrap()
                .expect("free lease");
            assert!(store.acquire_lease("l", "n2", ttl).await.unwrap().is_none());
            assert!(store.renew_lease(&first, ttl).await.unwrap());
            let impostor = Lease {
                holder: "n2".into(),
                ..first.clone()
            };
            assert!(!store.renew_lease(&impostor, ttl).await.unwrap());
            assert!(!store.release_lease(&impostor).await.unwrap());
            assert!(store.release_lease(&first).await.unwrap());
            let second = store
                .acquire_lease("l", "n2", ttl)
                .await
                .unwrap()
                .expect("released");
            assert!(second.token > first.token, "fencing token grows");
            assert!(!store.renew_lease(&first, ttl).await.unwrap());
        }

        pub async fn expiry_hands_over_with_a_larger_token(store: Arc<dyn Store>) {
            let ttl = Duration::from_millis(300);
            let first = store.acquire_lease("l", "n1", ttl).await.unwrap().unwrap();
            tokio::time::sleep(ttl + Duration::from_millis(200)).await;
            let second = store
                .acquire_lease("l", "n2", ttl)
                .await
                .unwrap()
                .expect("expired");
            assert!(second.token > first.token);
            assert!(!store.renew_lease(&first, ttl).await.unwrap());
            assert!(!store.release_lease(&first).await.unwrap());
            assert!(store.renew_lease(&second, ttl).await.unwrap());
        }

        pub async fn the_current_holder_is_shown_until_expiry(store: Arc<dyn Store>) {
            let ttl = Duration::from_millis(300);
            assert_eq!(store.current_lease("l").await.unwrap(), None);
            let held = store
                .acquire_lease("l", "n1#7", ttl)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(store.current_lease("l").await.unwrap(), Some(held));
            tokio::time::sleep(ttl + Duration::from_millis(200)).await;
            assert_eq!(store.current_lease("l").await.unwrap(), None);
        }

        pub async fn its_holder_takes_a_lease_again_with_the_same_token(store: Arc<dyn Store>) {
            // Node ids are the operator's to choose: one may hold the character that
            // parts a stored holder from its token.
            let ttl = Duration::from_secs(60);
            for holder in ["n1#7", "rack|b/n1#7"] {
                let name = format!("l.{holder}");
                let held = store
                    .acquire_lease(&name, holder, ttl)
                    .await
                    .unwrap()
                    .unwrap();
                let again = store.acquire_lease(&name, holder, ttl).await.unwrap();
                assert_eq!(again, Some(held.clone()), "{holder}");
                assert!(store
                    .acquire_lease(&name, "n2#1", ttl)
                    .await
                    .unwrap()
                    .is_none());
                assert_eq!(store.current_lease(&name).await.unwrap(), Some(held));
            }
        }
    }

    pub mod membership {
        use super::*;

        pub async fn members_are_sorted_and_expire(store: Arc<dyn Store>) {
            let ttl = Duration::from_millis(300);
            store.join_group("g", "b#1", ttl).await.unwrap();
            store
                .join_group("g", "a#1", Duration::from_secs(60))
                .await
                .unwrap();
            store.join_group("other", "c#1", ttl).await.unwrap();
            assert_eq!(store.group_members("g").await.unwrap(), ["a#1", "b#1"]);
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert_eq!(store.group_members("g").await.unwrap(), ["a#1"]);
            assert!(store.group_members("other").await.unwrap().is_empty());
        }

        pub async fn a_member_that_leaves_is_gone_at_once(store: Arc<dyn Store>) {
            let ttl = Duration::from_secs(60);
            store.join_group("g", "a#1", ttl).await.unwrap();
            store.join_group("g", "b#1", ttl).await.unwrap();
            store.leave_group("g", "a#1").await.unwrap();
            assert_eq!(store.group_members("g").await.unwrap(), ["b#1"]);
        }

        pub async fn a_groups_first_partition_count_stays(store: Arc<dyn Store>) {
            assert_eq!(store.settle_partition_count("g", 6).await.unwrap(), 6);
            assert_eq!(store.settle_partition_count("g", 8).await.unwrap(), 6);
            assert_eq!(store.settle_partition_count("h", 8).await.unwrap(), 8);
        }
    }

    pub mod keyed {
        use super::*;
        use weir::reactor::CacheSnapshot;
        use weir::store::KeyedChanges;

        fn snapshot(fires: u64) -> CacheSnapshot {
            CacheSnapshot {
                fires,
                ..Default::default()
            }
        }

        pub async fn keys_and_positions_round_trip(store: Arc<dyn Store>) {
            let lease = store
                .acquire_lease("graph.g.1", "n1", Duration::from_secs(60))
                .await
                .unwrap()
                .unwrap();
            let fence = Fence::from(&lease);
            assert!(store.load_positions("g", 1).await.unwrap().is_empty());
            assert_eq!(store.load_released("g", 1).await.unwrap(), None);
            let mut changes = KeyedChanges {
                keys: vec![
                    ("ann".into(), None, snapshot(3)),
                    ("bob".into(), None, snapshot(1)),
                ],
                positions: [("a".to_string(), 17), ("b".to_string(), 4)].into(),
                ..Default::default()
            };
            store.save_keys("g", 1, &mut changes, &fence).await.unwrap();
            let mut later = KeyedChanges {
                keys: vec![("ann".into(), None, snapshot(4))],
                positions: [("a".to_string(), 18)].into(),
                released: Some((lease.token, 1_234)),
                ..Default::default()
            };
            store.save_keys("g", 1, &mut later, &fence).await.unwrap();
            assert_eq!(
                store
                    .load_keys("g", 1, &["ann".into(), "cid".into(), "bob".into()])
                    .await
                    .unwrap(),
                [Some(snapshot(4)), None, Some(snapshot(1))]
            );
            assert_eq!(
                store.load_positions("g", 1).await.unwrap(),
                [("a".to_string(), 18), ("b".to_string(), 4)].into()
            );
            assert_eq!(
                store.load_keys("g", 2, &["ann".into()]).await.unwrap(),
                [None]
            );
            assert_eq!(
                store.load_released("g", 1).await.unwrap(),
                Some((lease.token, 1_234))
            );
        }

        pub async fn idle_keys_are_listed_oldest_first_and_expire_with_their_state(
            store: Arc<dyn Store>,
        ) {
            let lease = store
                .acquire_lease("graph.g.1", "n1", Duration::from_secs(60))
                .await
                .unwrap()
                .unwrap();
            let fence = Fence::from(&lease);
            let mut changes = KeyedChanges {
                keys: ["ann", "bob", "cid", "dan"]
                    .iter()
                    .map(|k| ((*k).into(), None, snapshot(1)))
                    .collect(),
                touched: vec![
                    ("ann".into(), 300),
                    ("bob".into(), 100),
                    ("cid".into(), 200),
                    ("dan".into(), 900),
                ],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut changes, &fence).await.unwrap();
            // A later event moves a key's time on.
            let mut later = KeyedChanges {
                keys: vec![("bob".into(), None, snapshot(2))],
                touched: vec![("bob".into(), 800)],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut later, &fence).await.unwrap();
            // A key's time only moves forward (events of several sources, or producer
            // times, can come out of order).
            let mut earlier = KeyedChanges {
                touched: vec![("bob".into(), 50)],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut earlier, &fence).await.unwrap();
            // Before 300 is not at 300; another partition's keys are not listed.
            assert_eq!(store.idle_keys("g", 1, 300, 0, 10).await.unwrap(), ["cid"]);
            assert_eq!(
                store.idle_keys("g", 1, 850, 0, 10).await.unwrap(),
                ["cid", "ann", "bob"]
            );
            assert_eq!(
                store.idle_keys("g", 1, 850, 0, 2).await.unwrap(),
                ["cid", "ann"]
            );
            // Past the oldest kept ones: the next page.
            assert_eq!(store.idle_keys("g", 1, 850, 2, 2).await.unwrap(), ["bob"]);
            assert_eq!(store.idle_keys("g", 1, 850, 1, 1).await.unwrap(), ["ann"]);
            assert!(store
                .idle_keys("g", 1, 850, 3, 10)
                .await
                .unwrap()
                .is_empty());
            assert!(store
                .idle_keys("g", 2, 850, 0, 10)
                .await
                .unwrap()
                .is_empty());
            let mut expired = KeyedChanges {
                expired: vec!["cid".into(), "ann".into()],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut expired, &fence).await.unwrap();
            assert_eq!(store.idle_keys("g", 1, 850, 0, 10).await.unwrap(), ["bob"]);
            assert_eq!(
                store
                    .load_keys(
                        "g",
                        1,
                        &["ann".into(), "bob".into(), "cid".into(), "dan".into()]
                    )
                    .await
                    .unwrap(),
                [None, Some(snapshot(2)), None, Some(snapshot(1))]
            );
            // A key stored without a time is never listed.
            let mut untimed = KeyedChanges {
                keys: vec![("eve".into(), None, snapshot(1))],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut untimed, &fence).await.unwrap();
            assert_eq!(
                store.idle_keys("g", 1, i64::MAX, 0, 10).await.unwrap(),
                ["bob", "dan"]
            );
            // A deposed owner removes nothing.
            assert!(store.release_lease(&lease).await.unwrap());
            let (_, current) = deposed_and_current(store.as_ref(), "graph.g.1").await;
            let mut stale = KeyedChanges {
                expired: vec!["bob".into()],
                ..Default::default()
            };
            assert!(is_fenced(
                &store.save_keys("g", 1, &mut stale, &fence).await
            ));
            assert_eq!(
                store.load_keys("g", 1, &["bob".into()]).await.unwrap(),
                [Some(snapshot(2))]
            );
            // Fire numbers round-trip, per partition, each written on its own.
            use weir::keyed::FireNumbers;
            assert_eq!(
                store.load_fire_numbers("g", 1).await.unwrap(),
                FireNumbers::default()
            );
            let mut high = KeyedChanges {
                fire_high: Some(42),
                ..Default::default()
            };
            store.save_keys("g", 1, &mut high, &current).await.unwrap();
            let mut floor = KeyedChanges {
                fire_floor: Some(40),
                ..Default::default()
            };
            store.save_keys("g", 1, &mut floor, &current).await.unwrap();
            assert_eq!(
                store.load_fire_numbers("g", 1).await.unwrap(),
                FireNumbers {
                    floor: 40,
                    high: 42
                }
            );
            assert_eq!(
                store.load_fire_numbers("g", 2).await.unwrap(),
                FireNumbers::default()
            );
            // Times dropped: no key is listed, and every key keeps its state.
            let mut dropped = KeyedChanges {
                drop_times: true,
                ..Default::default()
            };
            store
                .save_keys("g", 1, &mut dropped, &current)
                .await
                .unwrap();
            assert!(store
                .idle_keys("g", 1, i64::MAX, 0, 10)
                .await
                .unwrap()
                .is_empty());
            assert_eq!(
                store
                    .load_keys("g", 1, &["bob".into(), "dan".into()])
                    .await
                    .unwrap(),
                [Some(snapshot(2)), Some(snapshot(1))]
            );
        }

        /// A store kept in this process hands out slots (the memory store); one
        /// elsewhere none (Redis), and the same writes go by name.
        pub async fn keys_written_through_their_slots_round_trip(store: Arc<dyn Store>) {
            let (old, fence) = deposed_and_current(store.as_ref(), "graph.g.1").await;
            let ann: weir::graph::Key = "ann".into();
            let ann_slot = store.key_slot("g", 1, &ann);
            // The same slot to every caller; a slot alone stores nothing.
            assert_eq!(store.key_slot("g", 1, &ann), ann_slot);
            assert_eq!(
                store.load_keys("g", 1, &["ann".into()]).await.unwrap(),
                [None]
            );
            let mut changes = KeyedChanges {
                keys: vec![
                    (ann.clone(), ann_slot, snapshot(3)),
                    ("bob".into(), None, snapshot(1)),
                ],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut changes, &fence).await.unwrap();
            assert_eq!(
                store
                    .load_keys("g", 1, &["ann".into(), "bob".into()])
                    .await
                    .unwrap(),
                [Some(snapshot(3)), Some(snapshot(1))]
            );
            // A deposed owner writes nothing through its slots.
            let mut stale = KeyedChanges {
                keys: vec![(ann.clone(), ann_slot, snapshot(9))],
                ..Default::default()
            };
            assert!(is_fenced(&store.save_keys("g", 1, &mut stale, &old).await));
            assert_eq!(
                store.load_keys("g", 1, &["ann".into()]).await.unwrap(),
                [Some(snapshot(3))]
            );
            // Once the key is removed its slot may hold another key: a write through the
            // old slot goes to its own key, and leaves the other as it was.
            let mut expired = KeyedChanges {
                expired: vec![ann.clone()],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut expired, &fence).await.unwrap();
            let cid: weir::graph::Key = "cid".into();
            let cid_slot = store.key_slot("g", 1, &cid);
            if ann_slot.is_some() {
                assert_eq!(cid_slot, ann_slot, "a removed key's slot is taken again");
            }
            let mut back = KeyedChanges {
                keys: vec![(ann.clone(), ann_slot, snapshot(4))],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut back, &fence).await.unwrap();
            assert_eq!(
                store
                    .load_keys("g", 1, &["ann".into(), "cid".into()])
                    .await
                    .unwrap(),
                [Some(snapshot(4)), None]
            );
            // The same key under another copy of its name (an owner started again), with
            // a slot handed out before: still the one key.
            let mut again = KeyedChanges {
                keys: vec![("cid".into(), cid_slot, snapshot(5))],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut again, &fence).await.unwrap();
            assert_eq!(
                store
                    .load_keys("g", 1, &["cid".into(), "ann".into()])
                    .await
                    .unwrap(),
                [Some(snapshot(5)), Some(snapshot(4))]
            );
            // So too for a name too long to be held inline: each copy of it is an
            // allocation of its own, a slot handed out for one serves the others.
            let long = "a user whose name is too long to be held inline";
            let first: weir::graph::Key = long.into();
            let long_slot = store.key_slot("g", 1, &first);
            let mut written = KeyedChanges {
                keys: vec![(first, long_slot, snapshot(6))],
                ..Default::default()
            };
            store.save_keys("g", 1, &mut written, &fence).await.unwrap();
            let second: weir::graph::Key = long.into();
            assert_eq!(store.key_slot("g", 1, &second), long_slot);
            for (copy, fires) in [(second, 7), (long.into(), 8)] {
                let mut rewritten = KeyedChanges {
                    keys: vec![(copy, long_slot, snapshot(fires))],
                    ..Default::default()
                };
                store
                    .save_keys("g", 1, &mut rewritten, &fence)
                    .await
                    .unwrap();
            }
            assert_eq!(
                store
                    .load_keys("g", 1, &[long.into(), "cid".into(), "ann".into()])
                    .await
                    .unwrap(),
                [Some(snapshot(8)), Some(snapshot(5)), Some(snapshot(4))]
            );
            // Slots are per partition.
            assert_eq!(
                store.load_keys("g", 2, &["cid".into()]).await.unwrap(),
                [None]
            );
        }

        pub async fn a_graph_stays_paused_until_resumed(store: Arc<dyn Store>) {
            assert!(!store.load_paused("g").await.unwrap());
            store.save_paused("g", true).await.unwrap();
            // Pausing twice changes nothing; another graph is not paused with it.
            store.save_paused("g", true).await.unwrap();
            assert!(store.load_paused("g").await.unwrap());
            assert!(!store.load_paused("h").await.unwrap());
            store.save_paused("g", false).await.unwrap();
            assert!(!store.load_paused("g").await.unwrap());
            store.save_paused("g", false).await.unwrap();
            assert!(!store.load_paused("g").await.unwrap());
        }

        pub async fn a_deposed_owners_batch_is_refused_whole(store: Arc<dyn Store>) {
            let (old, new) = deposed_and_current(store.as_ref(), "graph.g.1").await;
            let mut stale = KeyedChanges {
                keys: vec![("ann".into(), None, snapshot(9))],
                positions: [("a".to_string(), 99)].into(),
                touched: vec![("ann".into(), 5)],
                ..Default::default()
            };
            let sent = stale.clone();
            assert!(is_fenced(&store.save_keys("g", 1, &mut stale, &old).await));
            // A refused write leaves the batch whole, to be written again.
            assert_eq!(stale, sent);
            assert_eq!(
                store.load_keys("g", 1, &["ann".into()]).await.unwrap(),
                [None]
            );
            assert!(store.load_positions("g", 1).await.unwrap().is_empty());
            assert!(store.idle_keys("g", 1, 10, 0, 10).await.unwrap().is_empty());
            store.save_keys("g", 1, &mut stale, &new).await.unwrap();
            assert_eq!(
                store.load_keys("g", 1, &["ann".into()]).await.unwrap(),
                [Some(snapshot(9))]
            );
        }
    }

    pub mod jobs {
        use super::*;
        use serde_json::json;
        use weir::store::{JobRecord, PartitionChanges};

        fn record(id: &str, count: u64, timeout_at_ms: Option<i64>, position: i64) -> JobRecord {
            JobRecord {
                id: id.into(),
                state: json!({ "count": count }),
                timeout_at_ms,
                partition: 2,
                position,
            }
        }

        async fn fence(store: &dyn Store) -> Fence {
            let lease = store
                .acquire_lease("jobs.t.2", "n1", Duration::from_secs(60))
                .await
                .unwrap()
                .unwrap();
            Fence::from(&lease)
        }

        pub async fn a_partition_batch_round_trips(store: Arc<dyn Store>) {
            let fence = fence(store.as_ref()).await;
            let empty = store.load_partition("t", 2).await.unwrap();
            assert_eq!(empty.position, None);
            let changes = PartitionChanges {
                position: Some(41),
                put: vec![record("a", 1, Some(5_000), 40), record("b", 2, None, 41)],
                released: Some((fence.token, 1_234)),
                ..Default::default()
            };
            store
                .save_partition("t", 2, &changes, &fence)
                .await
                .unwrap();
            let loaded = store.load_partition("t", 2).await.unwrap();
            assert_eq!(loaded.position, Some(41));
            assert_eq!(loaded.timeouts, [("a".to_string(), 5_000)]);
            assert_eq!(loaded.released, Some((fence.token, 1_234)));
            assert_eq!(
                store
                    .load_jobs("t", &["b".into(), "none".into(), "a".into()])
                    .await
                    .unwrap(),
                [
                    Some(record("b", 2, None, 41)),
                    None,
                    Some(record("a", 1, Some(5_000), 40))
                ]
            );
            assert_eq!(store.list_jobs("t").await.unwrap(), ["a", "b"]);
            assert!(store.list_jobs("other").await.unwrap().is_empty());
            assert_eq!(store.load_partition("t", 3).await.unwrap().position, None);
        }

        pub async fn removed_jobs_lose_their_timeouts(store: Arc<dyn Store>) {
            let fence = fence(store.as_ref()).await;
            let put = PartitionChanges {
                position: Some(1),
                put: vec![
                    record("a", 1, Some(5_000), 0),
                    record("b", 1, Some(6_000), 1),
                ],
                ..Default::default()
            };
            store.save_partition("t", 2, &put, &fence).await.unwrap();
            let change = PartitionChanges {
                position: Some(3),
                put: vec![record("b", 2, None, 3)],
                removed: vec!["a".into()],
                ..Default::default()
            };
            store.save_partition("t", 2, &change, &fence).await.unwrap();
            let loaded = store.load_partition("t", 2).await.unwrap();
            assert_eq!(loaded.position, Some(3));
            assert!(loaded.timeouts.is_empty(), "{:?}", loaded.timeouts);
            assert_eq!(store.list_jobs("t").await.unwrap(), ["b"]);
            assert_eq!(store.load_jobs("t", &["a".into()]).await.unwrap(), [None]);
        }

        /// A timeout as late as weir arms one comes back exactly, and one later than
        /// that (Redis keeps due times as doubles, and writes large ones back in
        /// exponent form) leaves its partition loadable.
        pub async fn timeouts_due_far_ahead_load_back(store: Arc<dyn Store>) {
            let fence = fence(store.as_ref()).await;
            let latest = weir::jobs::LATEST_DUE_MS;
            let changes = PartitionChanges {
                position: Some(1),
                put: vec![
                    record("latest", 1, Some(latest), 0),
                    record("later", 1, Some(100_000_000_000_000_000), 1),
                ],
                ..Default::default()
            };
            store
                .save_partition("t", 2, &changes, &fence)
                .await
                .unwrap();
            let loaded = store.load_partition("t", 2).await.unwrap();
            assert_eq!(
                loaded.timeouts,
                [
                    ("latest".to_string(), latest),
                    ("later".to_string(), 100_000_000_000_000_000)
                ]
            );
        }

        /// Job handlers may return a state as deeply nested as weir reads JSON and no
        /// deeper (deeper ones are refused): the stored record around it must still read
        /// back, or the partition could never load it.
        pub async fn a_state_nested_as_deep_as_weir_reads_loads_back(store: Arc<dyn Store>) {
            let fence = fence(store.as_ref()).await;
            let mut state = json!({ "count": 1 });
            for _ in 1..weir::codec::json::MAX_DEPTH {
                state = json!({ "inner": state });
            }
            weir::codec::json::check_depth(&state).unwrap();
            let mut deep = record("deep", 1, Some(5_000), 0);
            deep.state = state;
            let changes = PartitionChanges {
                position: Some(0),
                put: vec![deep.clone()],
                ..Default::default()
            };
            store
                .save_partition("t", 2, &changes, &fence)
                .await
                .unwrap();
            let loaded = store.load_jobs("t", &["deep".to_string()]).await.unwrap();
            assert_eq!(loaded, vec![Some(deep)]);
        }

        pub async fn a_deposed_owners_batch_is_refused_whole(store: Arc<dyn Store>) {
            let (old, new) = deposed_and_current(store.as_ref(), "jobs.t.2").await;
            let stale = PartitionChanges {
                position: Some(9),
                put: vec![record("a", 9, Some(1), 9)],
                ..Default::default()
            };
            assert!(is_fenced(&store.save_partition("t", 2, &stale, &old).await));
            let loaded = store.load_partition("t", 2).await.unwrap();
            assert_eq!(loaded.position, None);
            assert!(loaded.timeouts.is_empty());
            assert!(store.list_jobs("t").await.unwrap().is_empty());
            let current = PartitionChanges {
                position: Some(9),
                ..Default::default()
            };
            store.save_partition("t", 2, &current, &new).await.unwrap();
            assert_eq!(
                store.load_partition("t", 2).await.unwrap().position,
                Some(9)
            );
        }
    }

    pub mod schedule {
        use super::*;
        use weir::cron::{HeldBack, Schedule};
        use weir::store::{Execution, ExecutionStatus};

        fn execution(scheduled_ms: i64, status: ExecutionStatus) -> Execution {
            Execution {
                schedule_id: "s".into(),
                scheduled_ms,
                tick_id: format!("s@{scheduled_ms}"),
                status,
                attempt: 1,
                max_attempts: 3,
                node_id: "n1".into(),
                fencing_token: 1,
                updated_ms: scheduled_ms + 100,
                error: None,
            }
        }

        pub async fn schedules_and_fire_times_round_trip(store: Arc<dyn Store>) {
            let schedule = Schedule::new("s", "* * * * * *", "UTC");
            assert_eq!(store.get_schedule("s").await.unwrap(), None);
            store.put_schedule(&schedule).await.unwrap();
            assert_eq!(
                store.get_schedule("s").await.unwrap(),
                Some(schedule.clone())
            );
            assert_eq!(
                store.list_schedules().await.unwrap().schedules,
                vec![schedule]
            );
            store.set_next_fire(0, "s", Some(5_000)).await.unwrap();
            assert!(store.due_schedules(0, 4_999, 10).await.unwrap().is_empty());
            assert!(store.due_schedules(1, 9_999, 10).await.unwrap().is_empty());
            assert_eq!(
                store.due_schedules(0, 5_000, 10).await.unwrap(),
                [("s".to_string(), 5_000)]
            );
            assert_eq!(store.earliest_fire(0).await.unwrap(), Some(5_000));
            assert_eq!(store.earliest_fire(1).await.unwrap(), None);
            let late = 1_767_229_200_123; // a time in milliseconds reads back exactly
            store.set_next_fire(0, "s", Some(late)).await.unwrap();
            assert_eq!(store.next_fire(0, "s").await.unwrap(), Some(late));
            assert_eq!(store.next_fire(1, "s").await.unwrap(), None);
            assert_eq!(store.next_fire(0, "other").await.unwrap(), None);
            store.set_next_fire(0, "s", Some(5_000)).await.unwrap();
            assert!(store.delete_schedule("s", 0).await.unwrap());
            assert_eq!(store.next_fire(0, "s").await.unwrap(), None);
            assert!(!store.delete_schedule("s", 0).await.unwrap());
            assert_eq!(store.get_schedule("s").await.unwrap(), None);
            assert_eq!(store.earliest_fire(0).await.unwrap(), None);
        }

        pub async fn a_shard_is_listed_through_a_page_at_a_time_while_it_changes(
            store: Arc<dyn Store>,
        ) {
            let id = |i: i64| format!("s{i:03}");
            for i in 0..300 {
                store
                    .set_next_fire(0, &id(i), Some(1_000 + i))
                    .await
                    .unwrap();
            }
            store
                .set_next_fire(1, "elsewhere", Some(1_000))
                .await
                .unwrap();
            let mut seen = std::collections::HashSet::new();
            let mut from: Option<String> = None;
            let mut pages = 0;
            loop {
                let (page, next) = store.filed_schedules(0, from.as_deref(), 50).await.unwrap();
                seen.extend(page);
                pages += 1;
                if pages == 2 {
                    // Meanwhile some fire (and move on), some go, and some are added.
                    for i in 0..100 {
                        store
                            .set_next_fire(0, &id(i), Some(90_000 + i))
                            .await
                            .unwrap();
                    }
                    for i in 100..110 {
                        store.set_next_fire(0, &id(i), None).await.unwrap();
                    }
                    for i in 300..320 {
                        store.set_next_fire(0, &id(i), Some(1_000)).await.unwrap();
                    }
                }
                match next {
                    Some(next) => from = Some(next),
                    None => break,
                }
                assert!(pages < 1_000, "the listing never ends");
            }
            for i in (0..100).chain(110..300) {
                assert!(seen.contains(&id(i)), "{} not listed", id(i));
            }
            assert!(!seen.contains("elsewhere"));
            let (_, next) = store.filed_schedules(7, None, 50).await.unwrap();
            assert_eq!(next, None, "an empty shard is listed through at once");
        }

        pub async fn executions_are_claimed_once_and_indexed_while_open(store: Arc<dyn Store>) {
            let claims = store
                .claim_executions(
                    &[
                        execution(1000, ExecutionStatus::Scheduled),
                        execution(2000, ExecutionStatus::Buffered),
                        execution(3000, ExecutionStatus::Skipped),
                    ],
                    None,
                )
                .await
                .unwrap();
            assert_eq!(claims, [true, true, true]);
            assert!(!store
                .claim_execution(&execution(1000, ExecutionStatus::Scheduled))
                .await
                .unwrap());
            let open = |by: i64| {
                let store = store.clone();
                async move { store.open_executions(by, 0, 100).await.unwrap() }
            };
            let s = || "s".to_string();
            // Buffered ones are always listed; the others once unchanged since `by`.
            assert_eq!(open(1100).await, [(s(), 2000), (s(), 1000)]);
            assert_eq!(open(1099).await, [(s(), 2000)]);
            assert_eq!(
                store.open_executions(i64::MAX, 0, 1).await.unwrap().len(),
                1
            );
            assert_eq!(
                store.open_executions(i64::MAX, 1, 5).await.unwrap(),
                [(s(), 1000)]
            );
            assert!(store
                .open_executions(i64::MAX, 2, 5)
                .await
                .unwrap()
                .is_empty());
            store
                .put_execution(&execution(1000, ExecutionStatus::Completed), None)
                .await
                .unwrap();
            let mut running = execution(2000, ExecutionStatus::Running);
            running.updated_ms = 5000;
            let (_, fence) = deposed_and_current(store.as_ref(), "shard-0").await;
            store
                .record_fires(0, &[running], &[], &[], &fence)
                .await
                .unwrap();
            assert!(open(4999).await.is_empty());
            assert_eq!(open(5000).await, [(s(), 2000)]);
            // History beyond its cap is dropped, oldest first, with its index entries.
            let later: Vec<Execution> = (0..1000)
                .map(|i| execution(10_000 + i, ExecutionStatus::Skipped))
                .collect();
            store.claim_executions(&later, None).await.unwrap();
            let history = store.executions("s", 2000).await.unwrap().executions;
            assert_eq!(history.len(), 1000);
            assert_eq!(history[0].scheduled_ms, 10_999, "newest first");
            assert_eq!(store.get_execution("s", 1000).await.unwrap(), None);
            assert_eq!(store.get_execution("s", 2000).await.unwrap(), None);
            assert!(open(i64::MAX).await.is_empty());
        }

        /// The state manager may record a tick's workflow's outcome before the tick's
        /// master records having emitted it (or before an orphan sweep's write): the
        /// master's writes leave the finished execution as it ended, out of the open
        /// index, and create no record, while the state manager's own write (no fence)
        /// always lands.
        pub async fn a_masters_write_leaves_a_finished_execution_as_it_ended(
            store: Arc<dyn Store>,
        ) {
            let (_, fence) = deposed_and_current(store.as_ref(), "shard-0").await;
            let open = || async { store.open_executions(i64::MAX, 0, 10).await.unwrap() };
            for (at, outcome) in [
                (1000, ExecutionStatus::Completed),
                (2000, ExecutionStatus::Failed),
            ] {
                assert_eq!(
                    store
                        .claim_executions(
                            &[execution(at, ExecutionStatus::Scheduled)],
                            Some(&fence)
                        )
                        .await
                        .unwrap(),
                    [true]
                );
                store
                    .put_execution(&execution(at, outcome), None)
                    .await
                    .unwrap();
            }
            store
                .record_fires(
                    0,
                    &[execution(1000, ExecutionStatus::Running)],
                    &[("s".to_string(), Some(9_000))],
                    &[],
                    &fence,
                )
                .await
                .unwrap();
            store
                .put_execution(&execution(2000, ExecutionStatus::Running), Some(&fence))
                .await
                .unwrap();
            let status = |at| {
                let store = store.clone();
                async move { store.get_execution("s", at).await.unwrap().unwrap().status }
            };
            assert_eq!(status(1000).await, ExecutionStatus::Completed);
            assert_eq!(status(2000).await, ExecutionStatus::Failed);
            assert!(open().await.is_empty(), "{:?}", open().await);
            // The rest of the batch is written.
            assert_eq!(store.earliest_fire(0).await.unwrap(), Some(9_000));
            // Nor does it make one that is not stored (dropped from history, say).
            store
                .put_execution(&execution(4000, ExecutionStatus::Running), Some(&fence))
                .await
                .unwrap();
            assert_eq!(store.get_execution("s", 4000).await.unwrap(), None);
            // An unfinished execution takes the master's write, and the state manager's
            // write lands over anything.
            store
                .claim_executions(&[execution(3000, ExecutionStatus::Scheduled)], Some(&fence))
                .await
                .unwrap();
            store
                .record_fires(
                    0,
                    &[execution(3000, ExecutionStatus::Running)],
                    &[],
                    &[],
                    &fence,
                )
                .await
                .unwrap();
            assert_eq!(status(3000).await, ExecutionStatus::Running);
            assert_eq!(open().await, [("s".to_string(), 3000)]);
            store
                .put_execution(&execution(1000, ExecutionStatus::Failed), None)
                .await
                .unwrap();
            assert_eq!(status(1000).await, ExecutionStatus::Failed);
        }

        pub async fn a_deposed_masters_execution_writes_are_refused(store: Arc<dyn Store>) {
            let (stale, current) = deposed_and_current(store.as_ref(), "shard-0").await;
            let claimed = store
                .claim_executions(
                    &[execution(50_000, ExecutionStatus::Scheduled)],
                    Some(&stale),
                )
                .await;
            assert!(is_fenced(&claimed), "{claimed:?}");
            assert_eq!(store.get_execution("s", 50_000).await.unwrap(), None);
            let refused = store
                .record_fires(
                    0,
                    &[execution(50_000, ExecutionStatus::Running)],
                    &[("s".to_string(), Some(60_000))],
                    &[],
                    &stale,
                )
                .await;
            assert!(is_fenced(&refused), "{refused:?}");
            assert_eq!(store.get_execution("s", 50_000).await.unwrap(), None);
            assert_eq!(store.earliest_fire(0).await.unwrap(), None, "refused whole");
            let put = store
                .put_execution(&execution(50_000, ExecutionStatus::Running), Some(&stale))
                .await;
            assert!(is_fenced(&put), "{put:?}");
            assert_eq!(
                store
                    .claim_executions(
                        &[execution(50_000, ExecutionStatus::Scheduled)],
                        Some(&current)
                    )
                    .await
                    .unwrap(),
                [true]
            );
            store
                .put_execution(
                    &execution(50_000, ExecutionStatus::Completed),
                    Some(&current),
                )
                .await
                .unwrap();
            assert_eq!(
                store
                    .get_execution("s", 50_000)
                    .await
                    .unwrap()
                    .map(|e| e.status),
                Some(ExecutionStatus::Completed)
            );
        }

        /// What a shard's master held back (a schedule it could not read) is kept with
        /// the shard under its lease, for the next master, until forgotten or the
        /// schedule is deleted.
        pub async fn what_a_shard_held_back_is_kept_until_forgotten(store: Arc<dyn Store>) {
            let (stale, current) = deposed_and_current(store.as_ref(), "shard-0").await;
            let ids = ["s".to_string(), "t".to_string(), "u".to_string()];
            let held = |first_due_ms, retry_ms| HeldBack {
                first_due_ms,
                retry_ms,
            };
            assert_eq!(store.held_back(0, &ids).await.unwrap(), [None, None, None]);
            store
                .record_fires(
                    0,
                    &[],
                    &[
                        ("s".to_string(), Some(61_000)),
                        ("t".to_string(), Some(62_000)),
                    ],
                    &[
                        ("s".to_string(), Some(held(1_000, 61_000))),
                        ("t".to_string(), Some(held(2_000, 62_000))),
                    ],
                    &current,
                )
                .await
                .unwrap();
            let both = [Some(held(1_000, 61_000)), Some(held(2_000, 62_000)), None];
            assert_eq!(store.held_back(0, &ids).await.unwrap(), both);
            assert_eq!(store.held_back(1, &ids[..1]).await.unwrap(), [None]);
            assert!(store.held_back(0, &[]).await.unwrap().is_empty());
            let refused = store
                .record_fires(0, &[], &[], &[("s".to_string(), None)], &stale)
                .await;
            assert!(is_fenced(&refused), "{refused:?}");
            assert_eq!(store.held_back(0, &ids).await.unwrap(), both);
            store
                .record_fires(0, &[], &[], &[("s".to_string(), None)], &current)
                .await
                .unwrap();
            assert_eq!(
                store.held_back(0, &ids).await.unwrap(),
                [None, Some(held(2_000, 62_000)), None]
            );
            store
                .put_schedule(&Schedule::new("t", "* * * * *", "UTC"))
                .await
                .unwrap();
            assert!(store.delete_schedule("t", 0).await.unwrap());
            assert_eq!(store.held_back(0, &ids).await.unwrap(), [None, None, None]);
            // No longer fired from the shard: what it held back goes with the fire time.
            store
                .record_fires(
                    0,
                    &[],
                    &[("u".to_string(), Some(63_000))],
                    &[("u".to_string(), Some(held(3_000, 63_000)))],
                    &current,
                )
                .await
                .unwrap();
            store
                .record_fires(0, &[], &[("u".to_string(), None)], &[], &current)
                .await
                .unwrap();
            assert_eq!(store.held_back(0, &ids).await.unwrap(), [None, None, None]);
        }

        /// A schedule moved out of a shard takes what that shard held back of it along;
        /// clearing its next fire time in the old one forgets it there.
        pub async fn what_a_shard_held_back_moves_with_a_schedule(store: Arc<dyn Store>) {
            let held = HeldBack {
                first_due_ms: 1_000,
                retry_ms: 61_000,
            };
            let id = ["s".to_string()];
            store.set_next_fire(5, "s", Some(61_000)).await.unwrap();
            store.hold_back(5, "s", held).await.unwrap();
            assert_eq!(store.held_back(5, &id).await.unwrap(), [Some(held)]);
            store.hold_back(0, "s", held).await.unwrap();
            store.set_next_fire(0, "s", Some(61_000)).await.unwrap();
            store.set_next_fire(5, "s", None).await.unwrap();
            assert_eq!(store.held_back(5, &id).await.unwrap(), [None]);
            assert_eq!(store.next_fire(5, "s").await.unwrap(), None);
            assert_eq!(store.held_back(0, &id).await.unwrap(), [Some(held)]);
            assert_eq!(store.next_fire(0, "s").await.unwrap(), Some(61_000));
        }

        pub async fn live_nodes_expire(store: Arc<dyn Store>) {
            store
                .register_node("brief", 1, Duration::from_millis(300))
                .await
                .unwrap();
            store
                .register_node("lasting", 7, Duration::from_secs(60))
                .await
                .unwrap();
            let mut live = store.live_nodes().await.unwrap();
            live.sort();
            assert_eq!(live, [("brief".to_string(), 1), ("lasting".to_string(), 7)]);
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert_eq!(
                store.live_nodes().await.unwrap(),
                [("lasting".to_string(), 7)]
            );
        }
    }

    pub mod workflow {
        use super::*;
        use weir::dispatch::{RunStatus, WorkflowExecution};

        pub async fn executions_are_created_once_and_updated_by_version(store: Arc<dyn Store>) {
            let mut execution = WorkflowExecution {
                id: "x".into(),
                workflow: "w".into(),
                status: RunStatus::Running,
                context: serde_json::json!({"n": 1}),
                tasks: Default::default(),
                origin: None,
                created_ms: 1,
                updated_ms: 1,
                version: 1,
            };
            assert_eq!(store.get_workflow_execution("x").await.unwrap(), None);
            assert!(store.create_workflow_execution(&execution).await.unwrap());
            assert!(!store.create_workflow_execution(&execution).await.unwrap());
            execution.status = RunStatus::Completed;
            execution.version = 2;
            assert!(store.update_workflow_execution(&execution).await.unwrap());
            // A second writer that read version 1 too loses.
            assert!(!store.update_workflow_execution(&execution).await.unwrap());
            assert_eq!(
                store.get_workflow_execution("x").await.unwrap(),
                Some(execution)
            );
        }

        /// Many writers at once, two per execution: creating it (as a start delivered
        /// twice), then updating it from the same version (as two state managers applying
        /// results of one execution). Exactly one of each pair wins, and the stored
        /// execution is the winner's.
        pub async fn concurrent_updates_each_get_their_own_outcome(store: Arc<dyn Store>) {
            let execution = |id: usize, writer: &str| WorkflowExecution {
                id: format!("x{id}"),
                workflow: "w".into(),
                status: RunStatus::Running,
                context: serde_json::json!({ "writer": writer }),
                tasks: Default::default(),
                origin: None,
                created_ms: 1,
                updated_ms: 1,
                version: 1,
            };
            let ids = 0..40;
            // Each created twice at once: one creation wins, the other finds it there.
            let creations: Vec<WorkflowExecution> = ids
                .clone()
                .flat_map(|id| [execution(id, "creator"), execution(id, "late")])
                .collect();
            let created = futures::future::join_all(
                creations
                    .iter()
                    .map(|creation| store.create_workflow_execution(creation)),
            )
            .await;
            for pair in created.chunks(2) {
                let pair: Vec<bool> = pair.iter().map(|c| *c.as_ref().unwrap()).collect();
                assert_eq!(pair, [true, false]);
            }
            let updates: Vec<WorkflowExecution> = ids
                .clone()
                .flat_map(|id| {
                    ["a", "b"].map(|writer| WorkflowExecution {
                        version: 2,
                        ..execution(id, writer)
                    })
                })
                .collect();
            let outcomes = futures::future::join_all(
                updates
                    .iter()
                    .map(|update| store.update_workflow_execution(update)),
            )
            .await;
            for (pair, won) in updates.chunks(2).zip(outcomes.chunks(2)) {
                let won: Vec<bool> = won.iter().map(|o| *o.as_ref().unwrap()).collect();
                assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
                let winner = if won[0] { &pair[0] } else { &pair[1] };
                let stored = store.get_workflow_execution(&winner.id).await.unwrap();
                assert_eq!(stored.as_ref(), Some(winner));
            }
        }

        pub async fn deadlines_fall_due_earliest_first(store: Arc<dyn Store>) {
            store
                .set_workflow_deadline("w", "late", 2_000)
                .await
                .unwrap();
            store
                .set_workflow_deadline("w", "early", 5_000)
                .await
                .unwrap();
            store
                .set_workflow_deadline("w", "early", 1_000)
                .await
                .unwrap();
            let due = |until| {
                let store = store.clone();
                async move {
                    store
                        .due_workflow_deadlines("w", until, 0, 10)
                        .await
                        .unwrap()
                }
            };
            assert_eq!(due(1_500).await, ["early"]);
            assert_eq!(due(3_000).await, ["early", "late"]);
            assert_eq!(
                store
                    .due_workflow_deadlines("w", 3_000, 1, 10)
                    .await
                    .unwrap(),
                ["late"],
                "after the first"
            );
            store.clear_workflow_deadline("w", "early").await.unwrap();
            assert_eq!(due(i64::MAX).await, ["late"]);
            store.clear_workflow_deadline("w", "late").await.unwrap();
            assert!(due(i64::MAX).await.is_empty());
        }

        /// A workflow's deadlines are its own: another workflow's, due or not, are
        /// neither listed nor cleared with them.
        pub async fn deadlines_are_filed_per_workflow(store: Arc<dyn Store>) {
            store.set_workflow_deadline("a", "x", 1_000).await.unwrap();
            store
                .set_workflow_deadline("tenant/a", "y", 1_000)
                .await
                .unwrap();
            store.set_workflow_deadline("b", "z", 500).await.unwrap();
            let due = |workflow: &'static str| {
                let store = store.clone();
                async move {
                    store
                        .due_workflow_deadlines(workflow, i64::MAX, 0, 10)
                        .await
                        .unwrap()
                }
            };
            assert_eq!(due("a").await, ["x"]);
            assert_eq!(due("tenant/a").await, ["y"]);
            assert_eq!(due("b").await, ["z"]);
            assert!(due("c").await.is_empty());
            store.clear_workflow_deadline("a", "z").await.unwrap();
            assert_eq!(due("b").await, ["z"], "cleared under another workflow");
            store.clear_workflow_deadline("b", "z").await.unwrap();
            assert!(due("b").await.is_empty());
            assert_eq!(due("a").await, ["x"]);
        }

        pub async fn published_tasks_accumulate_per_execution(store: Arc<dyn Store>) {
            assert!(store.published_tasks("x").await.unwrap().is_empty());
            let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            store
                .mark_tasks_published("x", &names(&["a", "b"]))
                .await
                .unwrap();
            store
                .mark_tasks_published("x", &names(&["b", "c"]))
                .await
                .unwrap();
            store.mark_tasks_published("x", &[]).await.unwrap();
            let published: Vec<String> = store
                .published_tasks("x")
                .await
                .unwrap()
                .into_iter()
                .collect();
            assert_eq!(published, ["a", "b", "c"]);
            assert!(store.published_tasks("y").await.unwrap().is_empty());
        }
    }

    pub mod backend {
        use super::*;

        pub async fn answers_a_ping(store: Arc<dyn Store>) {
            store.ping().await.unwrap();
            assert!(["memory", "redis"].contains(&store.kind()));
        }
    }
}

/// A Redis store written to before recovery events were kept per tenant holds a tenant's
/// earlier events only in the list of all: a tenant's view lists them after the ones
/// recorded since, newest first, and another tenant's none of them.
#[cfg(feature = "it")]
#[tokio::test]
async fn a_tenants_recovery_events_from_before_its_own_list_are_still_listed() {
    use weir::store::RecoveryEvent;
    let opened = redis().await;
    let prefix = opened.prefix.clone().expect("a prefix");
    let event = |graph: &str, at_ms| RecoveryEvent {
        at_ms,
        ..cases::recovery::event(graph, 1)
    };
    // Recorded as the store did before: onto the list of all and the graph's only.
    let client = redis::Client::open(common::services::redis_url()).expect("redis url");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("redis reachable");
    for (graph, at_ms) in [("acme/a", 1), ("globex/a", 2), ("acme/b", 3)] {
        let text = serde_json::to_string(&event(graph, at_ms)).unwrap();
        let _: () = redis::cmd("LPUSH")
            .arg(format!("{prefix}:recovery"))
            .arg(text)
            .query_async(&mut connection)
            .await
            .expect("LPUSH");
    }
    let store = opened.store.clone();
    store.record_recovery(&event("acme/a", 4)).await.unwrap();
    store.record_recovery(&event("globex/a", 5)).await.unwrap();
    let times = |events: Vec<RecoveryEvent>| events.iter().map(|e| e.at_ms).collect::<Vec<_>>();
    let acme = store.tenant_recovery_events("acme", 10).await.unwrap();
    assert_eq!(times(acme), [4, 3, 1]);
    let acme = store.tenant_recovery_events("acme", 2).await.unwrap();
    assert_eq!(times(acme), [4, 3]);
    let globex = store.tenant_recovery_events("globex", 10).await.unwrap();
    assert_eq!(times(globex), [5, 2]);
    let initech = store.tenant_recovery_events("initech", 10).await.unwrap();
    assert!(initech.is_empty());
    opened.clean_up().await;
}

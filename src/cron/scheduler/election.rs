//! Shard masters: the live nodes of the highest priority share the shards by
//! rendezvous hashing; each master takes or yields its shard's lease, and a
//! `lease::keep` task renews it meanwhile.

use super::*;

/// The node that masters a shard among equals: the one whose hash with the shard is
/// highest (rendezvous hashing), so shards spread evenly and only the departed node's
/// shards move when one leaves. Every node computes the same answer.
pub fn shard_master(nodes: &[String], shard: u32) -> Option<&str> {
    nodes
        .iter()
        .max_by_key(|node| {
            let weight = mix(fnv1a(node.as_bytes()) ^ u64::from(shard).rotate_left(32));
            (weight, node.as_str())
        })
        .map(String::as_str)
}

pub(super) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// SplitMix64's finaliser: spreads close inputs (one node, shard after shard) apart.
pub(super) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The shard a schedule belongs to (FNV-1a, stable across processes and versions).
pub fn shard_of(id: &str, shards: u32) -> u32 {
    (fnv1a(id.as_bytes()) % u64::from(shards.max(1))) as u32
}

/// The name of a shard's master lease.
pub(super) fn shard_lease(shard: u32) -> String {
    format!("cron:shard:{shard}")
}

impl Scheduler {
    /// Gives up shard `i` (its keeper stops), and forgets what is cached of it: another
    /// master fires it now, and a node that once led many shards would otherwise keep
    /// every schedule of them.
    pub(super) fn drop_shard(&mut self, i: usize) {
        self.shards[i] = Shard::default();
        let shards = self.config.shards;
        self.cache.retain(|id, _| shard_of(id, shards) != i as u32);
    }

    /// Registers this node, then per shard: yield to a higher priority, drop a lease
    /// taken over, or take the lease if this node is the best live one. Held leases are
    /// renewed by their keepers, not here.
    pub(super) async fn elect(&mut self) {
        let ttl = self.config.lease_ttl;
        if let Err(e) = self
            .bounded(
                self.store
                    .register_node(&self.config.node_id, self.config.priority, ttl),
            )
            .await
        {
            warn!(error = %e, "node registration failed");
        }
        // The live nodes of the highest priority share the shards; a lower one masters
        // none while a higher one lives.
        let candidates: Option<Vec<String>> = match self.bounded(self.store.live_nodes()).await {
            Ok(nodes) => {
                let top = nodes.iter().map(|(_, p)| *p).max();
                Some(
                    nodes
                        .into_iter()
                        .filter(|(_, p)| Some(*p) == top)
                        .map(|(node, _)| node)
                        .collect(),
                )
            }
            Err(e) => {
                warn!(error = %e, "cannot list live nodes");
                None
            }
        };
        for i in 0..self.shards.len() {
            let name = shard_lease(i as u32);
            let me_best = candidates.as_ref().is_none_or(|nodes| {
                shard_master(nodes, i as u32).is_none_or(|node| node == self.config.node_id)
            });
            if let Some(held) = self.shards[i].held.clone() {
                if !me_best {
                    info!(
                        shard = i,
                        "yielding the schedule master to a higher-priority node"
                    );
                    // Its keeper stops first, so no renewal follows the release.
                    self.drop_shard(i);
                    let _ = self.bounded(self.store.release_lease(&held.lease)).await;
                    crate::metrics::lease_dropped(LeaseRole::Cron);
                    continue;
                }
                // Its keeper renews it; a takeover ends it.
                if self.shards[i].lost.is_cancelled() {
                    warn!(shard = i, "schedule master lease lost");
                    crate::metrics::lease_dropped(LeaseRole::Cron);
                    self.drop_shard(i);
                }
            } else if me_best {
                let acquiring =
                    crate::lease::acquire(self.store.as_ref(), &name, &self.config.node_id, ttl);
                match self.bounded(acquiring).await {
                    Ok(Some(held)) => {
                        info!(
                            shard = i,
                            token = held.lease.token,
                            "schedule master for shard"
                        );
                        crate::metrics::lease_acquired(LeaseRole::Cron);
                        // What is cached of the shard from an earlier lease is stale
                        // (another master fired it meanwhile): the shard is read afresh.
                        let shards = self.config.shards;
                        self.cache.retain(|id, _| shard_of(id, shards) != i as u32);
                        self.shards[i] = Shard::kept(self.store.clone(), held, ttl);
                    }
                    Ok(None) => {}
                    Err(e) => warn!(shard = i, error = %e, "cannot take the shard lease"),
                }
            }
        }
    }
}

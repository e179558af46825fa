//! Schedules left in shards past `[cron] shards` once it was lowered: no master reads
//! those shards any more, so the master of shard 0 moves their schedules into the shard
//! their id maps to now, with their next fire time kept (times missed meanwhile are
//! then caught up by each schedule's policy).

use super::*;

/// Shards past the configured count read per sweep: every one up to [`MOST_SHARDS`]
/// within a few minutes, at one cheap read each.
const STRANDED_SHARDS_PER_SWEEP: u32 = 64;

impl Scheduler {
    pub(super) async fn move_stranded(&mut self) -> Result<(), StoreError> {
        let shards = self.config.shards.max(1);
        if !self.holds(0) || shards >= MOST_SHARDS {
            return Ok(());
        }
        let from = self.stranded_from.clamp(shards, MOST_SHARDS - 1);
        let to = (from + STRANDED_SHARDS_PER_SWEEP).min(MOST_SHARDS);
        self.stranded_from = if to >= MOST_SHARDS { shards } else { to };
        for old in from..to {
            let stranded = self
                .bounded(self.store.due_schedules(old, i64::MAX, DUE_BATCH))
                .await?;
            for (id, next_ms) in stranded {
                let shard = shard_of(&id, shards);
                // Declared again at a start, it may have a next fire time there already:
                // the earlier one is kept, so missed times are caught up.
                let there = self.bounded(self.store.next_fire(shard, &id)).await?;
                let next_ms = there.map_or(next_ms, |t| t.min(next_ms));
                // Added before it is removed: a failure between leaves it in both, and
                // its executions' claims keep a time from firing twice.
                self.bounded(self.store.set_next_fire(shard, &id, Some(next_ms)))
                    .await?;
                self.bounded(self.store.set_next_fire(old, &id, None))
                    .await?;
                info!(schedule = %id, from = old, to = shard, "schedule moved out of a shard past [cron] shards");
            }
        }
        Ok(())
    }
}

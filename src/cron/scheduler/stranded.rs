//! Schedules filed in a shard their id no longer maps to, once `[cron] shards` changed.
//! Lowered, the shards past the new count have no master any more, so the master of
//! shard 0 moves their schedules out; raised, a schedule a config declares again is
//! filed in its new shard as well as its old one, and the old shard's master moves it
//! out as it reads its shard ahead (see `ahead`). A move keeps the schedule's next fire
//! time and what its shard held back of it (times missed meanwhile are then caught up
//! by each schedule's policy), unless a config declared it in the new shard already.

use super::*;

/// Shards past the configured count read per sweep: every one up to [`MOST_SHARDS`]
/// within a few minutes, at one cheap read each.
const STRANDED_SHARDS_PER_SWEEP: u32 = 64;
/// Schedules moved per sweep, at three or four store calls each: the sweep runs between
/// firings, which must not wait long for it.
const STRANDED_MOVES_PER_SWEEP: usize = 200;

impl Scheduler {
    pub(super) async fn move_stranded(&mut self) -> Result<(), StoreError> {
        let shards = self.config.shards.max(1);
        if !self.holds(0) || shards >= MOST_SHARDS {
            return Ok(());
        }
        let from = self.stranded_from.clamp(shards, MOST_SHARDS - 1);
        let to = (from + STRANDED_SHARDS_PER_SWEEP).min(MOST_SHARDS);
        self.stranded_from = if to >= MOST_SHARDS { shards } else { to };
        let mut moves_left = STRANDED_MOVES_PER_SWEEP;
        for old in from..to {
            let stranded = self
                .bounded(self.store.due_schedules(old, i64::MAX, moves_left))
                .await?;
            let ids: Vec<String> = stranded.iter().map(|(id, _)| id.clone()).collect();
            let held_back = self.bounded(self.store.held_back(old, &ids)).await?;
            for ((id, next_ms), held) in stranded.into_iter().zip(held_back) {
                self.refile(old, &id, next_ms, held).await?;
                moves_left -= 1;
            }
            if moves_left == 0 {
                // This shard may hold more: the next sweep starts with it.
                self.stranded_from = old;
                break;
            }
        }
        Ok(())
    }
}

impl Scheduler {
    /// Moves schedule `id`, filed in shard `old` for `next_ms` with what `old` `held`
    /// back of it, into the shard its id maps to now.
    pub(super) async fn refile(
        &self,
        old: u32,
        id: &str,
        next_ms: i64,
        held: Option<HeldBack>,
    ) -> Result<(), StoreError> {
        let shard = shard_of(id, self.config.shards);
        // Declared again by a config at a start, it has a next fire time there
        // already, which wins: a changed definition starts from now.
        let there = self.bounded(self.store.next_fire(shard, id)).await?;
        if there.is_none() {
            // Held back (unreadable or invalid when last looked at), it goes with what
            // its shard kept of that, so it still catches up from when it was first due.
            // Added before it is removed: a failure between leaves it in both, and its
            // executions' claims keep a time from firing twice.
            if let Some(held) = held {
                self.bounded(self.store.hold_back(shard, id, held)).await?;
            }
            self.bounded(self.store.set_next_fire(shard, id, Some(next_ms)))
                .await?;
        }
        // Cleared with what the old shard held back of it.
        self.bounded(self.store.set_next_fire(old, id, None))
            .await?;
        info!(schedule = %id, from = old, to = shard, "schedule moved into the shard [cron] shards maps it to");
        Ok(())
    }
}

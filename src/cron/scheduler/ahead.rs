//! Knowing a shard's `at_least_once` schedules before they are due. A schedule enters
//! the cache when a pass finds it due, so after a master takes a shard, subscribes
//! again, or sees a schedule change, it would not know a schedule until its next fire
//! time: one first due while the store is away (a daily tick in a Redis outage) would
//! not fire from local state. So the master lists the shard once it holds it, and
//! between firings reads what it does not know yet, a batch at a time.

use super::*;

/// Schedules read per look: the look runs between firings, which must not wait long.
const READ_PER_LOOK: usize = 500;
/// The most schedules of one shard listed to be read ahead: a shard filing more is
/// known ahead only in part (the rest from their first firing, as before).
const LISTED_PER_SHARD: usize = 1_000_000;
/// A look is made only when the next firing is at least this far off.
pub(super) const ROOM_TO_LOOK: Duration = Duration::from_millis(100);

impl Scheduler {
    /// Reads into the cache a batch of the schedules of a shard this node leads that it
    /// does not know yet, listing the shard first if it was not since its lease was
    /// taken or the cache cleared. Returns whether any are left to read.
    pub(super) async fn read_ahead(&mut self) -> Result<bool, StoreError> {
        let Some(shard) = (0..self.shards.len()).find(|&i| {
            self.holds(i)
                && self.shards[i]
                    .unknown
                    .as_ref()
                    .is_none_or(|ids| !ids.is_empty())
        }) else {
            return Ok(false);
        };
        let unknown = match self.shards[shard].unknown.take() {
            Some(ids) => ids,
            None => {
                let filed = self
                    .bounded(
                        self.store
                            .due_schedules(shard as u32, i64::MAX, LISTED_PER_SHARD),
                    )
                    .await?;
                filed
                    .into_iter()
                    .map(|(id, _)| id)
                    .filter(|id| !self.cache.contains_key(id))
                    .collect()
            }
        };
        let mut unknown = unknown;
        let batch = unknown.split_off(unknown.len().saturating_sub(READ_PER_LOOK));
        let read = self.read_schedules(shard as u32, &batch).await;
        if read.is_err() {
            // Read again at the next look.
            unknown.extend(batch);
        }
        let left = !unknown.is_empty();
        self.shards[shard].unknown = Some(unknown);
        read.map(|()| left)
    }

    /// Caches those of `ids` that fire `at_least_once`, with their stored next fire time.
    async fn read_schedules(&mut self, shard: u32, ids: &[String]) -> Result<(), StoreError> {
        let ids: Vec<String> = ids
            .iter()
            .filter(|id| !self.cache.contains_key(*id))
            .cloned()
            .collect();
        let store = self.store.clone();
        let reading = futures::stream::iter(ids.iter().cloned())
            .map(|id| {
                let store = store.clone();
                async move {
                    let (schedule, next) =
                        futures::join!(store.get_schedule(&id), store.next_fire(shard, &id));
                    (id, schedule, next)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<_>>();
        let read = self.bounded(async { Ok(reading.await) }).await?;
        for (id, schedule, next) in read {
            let (schedule, next) = match (schedule, next) {
                (Ok(Some(schedule)), Ok(Some(next))) => (schedule, next),
                // Gone or moved meanwhile: nothing to fire here.
                (Ok(_), Ok(_)) => continue,
                // Unreadable (another version's, say): left to a pass with the store,
                // which says so.
                (Err(e), _) | (_, Err(e)) if !e.is_retryable() => continue,
                (Err(e), _) | (_, Err(e)) => return Err(e),
            };
            if schedule.delivery != Delivery::AtLeastOnce || !schedule.enabled {
                continue;
            }
            let Ok((expr, tz)) = schedule.validate() else {
                continue;
            };
            // The stored time if the definition fires then, else its first fire time
            // after: read the moment it changed, a definition may come with the time its
            // predecessor was next due, and a schedule its shard holds back (unreadable
            // when last due) is filed at the time to look at it again.
            let next = Utc
                .timestamp_millis_opt(next - 1)
                .single()
                .and_then(|t| schedule.next_after(&expr, tz, t));
            self.cache.insert(id, (Cached { schedule, expr, tz }, next));
        }
        Ok(())
    }

    /// A schedule changed: forgotten, and read afresh at the next look if its shard is
    /// led here.
    pub(super) fn changed(&mut self, id: String) {
        self.cache.remove(&id);
        let shard = shard_of(&id, self.config.shards) as usize;
        if let Some(unknown) = self.shards.get_mut(shard).and_then(|s| s.unknown.as_mut()) {
            unknown.push(id);
        }
    }
}

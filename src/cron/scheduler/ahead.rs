//! Knowing a shard's schedules before they are due. A schedule used to enter the cache
//! only when a pass found it due, so after a master took a shard, subscribed again, or
//! saw a schedule change, it did not know a schedule until its next fire time: an
//! `at_least_once` one first due while the store is away (a daily tick in a Redis
//! outage) did not fire from local state. So the master lists the shard once it holds
//! it, a page at a time between firings, and reads what it does not know yet; a
//! schedule changed is read again at the next look. The passes that fire them then find
//! them read already.

use super::*;

/// Schedules listed and read per look: the look runs between firings, which must not
/// wait for it.
const READ_PER_LOOK: usize = 100;
/// A look is made only when the next firing is at least this far off, beyond the
/// look-ahead with which firings are prepared.
pub(super) const ROOM_TO_LOOK: Duration = Duration::from_millis(100);

/// How far a master has read its shard ahead.
#[derive(Default)]
pub(super) struct ReadAhead {
    /// Where the listing goes on; `None` before its first page.
    from: Option<String>,
    /// The shard was listed through.
    listed: bool,
    /// Schedules changed since the listing began, to read again.
    changed: Vec<String>,
}

impl ReadAhead {
    fn done(&self) -> bool {
        self.listed && self.changed.is_empty()
    }
}

impl Scheduler {
    /// Reads into the cache a few schedules of a shard this node leads that it does not
    /// know yet. Returns whether any are left to read.
    pub(super) async fn read_ahead(&mut self) -> Result<bool, StoreError> {
        let Some(shard) =
            (0..self.shards.len()).find(|&i| self.holds(i) && !self.shards[i].ahead.done())
        else {
            return Ok(false);
        };
        let ahead = &mut self.shards[shard].ahead;
        if !ahead.changed.is_empty() {
            let at = ahead.changed.len().saturating_sub(READ_PER_LOOK);
            let changed = ahead.changed.split_off(at);
            if let Err(e) = self.read_schedules(shard as u32, &changed).await {
                // Read again at the next look.
                self.shards[shard].ahead.changed.extend(changed);
                return Err(e);
            }
        } else {
            let from = ahead.from.clone();
            let (page, next) = self
                .bounded(
                    self.store
                        .filed_schedules(shard as u32, from.as_deref(), READ_PER_LOOK),
                )
                .await?;
            // Listed again at the next look should the reading fail.
            self.read_schedules(shard as u32, &page).await?;
            let ahead = &mut self.shards[shard].ahead;
            ahead.listed = next.is_none();
            ahead.from = next;
        }
        Ok(!self.shards[shard].ahead.done())
    }

    /// Caches those of `ids` not known yet that read back valid, with their stored next
    /// fire time.
    async fn read_schedules(&mut self, shard: u32, ids: &[String]) -> Result<(), StoreError> {
        let unknown: Vec<String> = ids
            .iter()
            .filter(|id| !self.cache.contains_key(*id))
            .cloned()
            .collect();
        let store = self.store.clone();
        let reading = futures::stream::iter(unknown)
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

    /// A schedule changed: forgotten, and read afresh at a next look if its shard is led
    /// here.
    pub(super) fn changed(&mut self, id: String) {
        self.cache.remove(&id);
        let shard = shard_of(&id, self.config.shards) as usize;
        if let Some(shard) = self.shards.get_mut(shard).filter(|s| s.held.is_some()) {
            shard.ahead.changed.push(id);
        }
    }
}

//! Knowing a shard's schedules before they are due. A schedule used to enter the cache
//! only when a pass found it due, so after a master took a shard, subscribed again, or
//! saw a schedule change, it did not know a schedule until its next fire time: an
//! `at_least_once` one first due while the store is away (a daily tick in a Redis
//! outage) did not fire from local state. So the master lists the shard once it holds
//! it, a page at a time between firings, and reads what it does not know yet; a
//! schedule changed is read again at the next look. The passes that fire them then find
//! them read already.
//!
//! The listing also finds schedules filed in the shard under a smaller `[cron] shards`:
//! a config declaring one again under the raised count files it in its new shard too,
//! and two masters would plan its ticks. Each is moved into its new shard (see
//! `stranded`) when that shard has a master and its next fire time is a lease TTL off
//! or more, so that master picks it up in time; otherwise it stays, planned in both
//! shards, whose claims keep each time from firing twice.

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
        let ahead = &self.shards[shard].ahead;
        if !ahead.changed.is_empty() {
            // Taken off the list once read: a look cut short reads them again.
            let at = ahead.changed.len().saturating_sub(READ_PER_LOOK);
            let changed = ahead.changed[at..].to_vec();
            self.read_schedules(shard as u32, &changed).await?;
            self.shards[shard].ahead.changed.truncate(at);
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
    /// fire time; moves out those filed here that map to another shard now.
    async fn read_schedules(&mut self, shard: u32, ids: &[String]) -> Result<(), StoreError> {
        let shards = self.config.shards;
        let (ids, misfiled): (Vec<&String>, Vec<&String>) =
            ids.iter().partition(|id| shard_of(id, shards) == shard);
        let misfiled: Vec<String> = misfiled.into_iter().cloned().collect();
        self.move_misfiled(shard, &misfiled).await?;
        let unknown: Vec<String> = ids
            .into_iter()
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
        let horizon =
            self.config.clock.now() + chrono::Duration::from_std(LOOKAHEAD).unwrap_or_default();
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
            // when last due) is filed at the time to look at it again. A time long past
            // (filed before downtime) is caught up as the catch-up policy says.
            let next = plan::first_local_fire(
                &schedule,
                (&expr, tz),
                next,
                horizon,
                self.config.lease_ttl,
            );
            self.cache.insert(id, (Cached { schedule, expr, tz }, next));
        }
        Ok(())
    }

    /// Moves each of `ids`, filed in `shard` but mapped to another shard now, into that
    /// shard when it has a master and the schedule's next fire time is a lease TTL off
    /// or more.
    async fn move_misfiled(&self, shard: u32, ids: &[String]) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let ttl = chrono::Duration::from_std(self.config.lease_ttl).unwrap_or_default();
        let soonest_ms = (self.config.clock.now() + ttl).timestamp_millis();
        let held_back = self.bounded(self.store.held_back(shard, ids)).await?;
        // Whether each shard moved into has a master, asked once per shard.
        let mut led: HashMap<u32, bool> = HashMap::new();
        for (id, held) in ids.iter().zip(held_back) {
            let Some(next_ms) = self.bounded(self.store.next_fire(shard, id)).await? else {
                continue;
            };
            if next_ms < soonest_ms {
                continue;
            }
            let to = shard_of(id, self.config.shards);
            let to_led = match led.get(&to) {
                Some(known) => *known,
                None => {
                    let known = self
                        .shards
                        .get(to as usize)
                        .is_some_and(|s| s.held.is_some())
                        || self
                            .bounded(self.store.current_lease(&election::shard_lease(to)))
                            .await?
                            .is_some();
                    *led.entry(to).or_insert(known)
                }
            };
            if to_led {
                self.refile(shard, id, next_ms, held).await?;
            }
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

//! Firing what is due: claiming each tick's execution record in the store (fenced by
//! the shard's lease), or, with the store away, firing `at_least_once` schedules from
//! what this node knows.

use super::*;

impl Scheduler {
    /// Fires what is due in the shards this node leads. Returns the earliest next fire,
    /// and whether the store answered for every shard led.
    pub(super) async fn fire_due(&mut self) -> (Option<DateTime<Utc>>, bool) {
        let mut earliest: Option<DateTime<Utc>> = None;
        let mut answered = true;
        // Ticks of every shard fired from local state, fired together below in time
        // order, so that one shard's do not wait for another's.
        let mut local: Vec<(DateTime<Utc>, Schedule, Lease)> = Vec::new();
        for shard in 0..self.shards.len() {
            let Some(lease) = self.shards[shard].lease() else {
                continue;
            };
            let store_up = self.holds(shard);
            let next = if store_up {
                match self.fire_shard_from_store(shard as u32, &lease).await {
                    Ok(next) => next,
                    Err(StoreError::Fenced { .. }) => {
                        // A newer master holds the shard: this one is deposed.
                        warn!(shard, "schedule master deposed; its writes were refused");
                        crate::metrics::lease_dropped(LeaseRole::Cron);
                        self.drop_shard(shard);
                        continue;
                    }
                    Err(e) => {
                        warn!(shard, error = %e, "store unreachable; firing at_least_once schedules from local state");
                        answered = false;
                        self.due_locally(shard as u32, &lease, &mut local)
                    }
                }
            } else {
                answered = false;
                self.due_locally(shard as u32, &lease, &mut local)
            };
            if let Some(n) = next {
                earliest = Some(earliest.map_or(n, |e| e.min(n)));
            }
        }
        local.sort_by_key(|(t, _, _)| *t);
        for (t, schedule, lease) in local {
            let wait = (t - self.config.clock.now()).to_std().unwrap_or_default();
            if !wait.is_zero() {
                tokio::time::sleep(wait).await;
            }
            self.fire_without_store(&schedule, t, &lease).await;
        }
        (earliest, answered)
    }

    pub(super) async fn fire_shard_from_store(
        &mut self,
        shard: u32,
        lease: &Lease,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        // Plan and claim a little ahead, so at the due instant only the publish remains.
        let now = self.config.clock.now();
        let retry_ms = (now + chrono::Duration::from_std(UNREADABLE_RETRY).unwrap_or_default())
            .timestamp_millis();
        // Warnings given under an earlier lease are given again (another master may
        // have seen the schedule read back meanwhile); those of a schedule not due again
        // a retry after it was to be looked at (deleted) are forgotten.
        if !self.warned.is_empty() {
            let (shards, now_ms) = (self.config.shards, now.timestamp_millis());
            let gone_after = UNREADABLE_RETRY.as_millis() as i64;
            self.warned.retain(|id, warned| {
                shard_of(id, shards) != shard
                    || (warned.token == lease.token && now_ms <= warned.retry_ms + gone_after)
            });
        }
        let horizon = now + chrono::Duration::from_std(LOOKAHEAD).unwrap_or_default();
        let due = self
            .bounded(
                self.store
                    .due_schedules(shard, horizon.timestamp_millis(), DUE_BATCH),
            )
            .await?;
        // Load what is not cached yet, many at a time.
        let missing: Vec<String> = due
            .iter()
            .filter(|(id, _)| !self.cache.contains_key(id))
            .map(|(id, _)| id.clone())
            .collect();
        let store = self.store.clone();
        // What the shard held back is kept with it, so whichever master looks at a
        // schedule again catches up from when it was first due. Read for every due
        // schedule, cached or not: a pass that read one back and then failed to record
        // leaves it cached with its entry still held, and a master that led the shard
        // before may have it cached from then.
        let due_ids: Vec<String> = due.iter().map(|(id, _)| id.clone()).collect();
        let held_back = self.store.held_back(shard, &due_ids);
        let loading = futures::stream::iter(missing)
            .map(|id| {
                let store = store.clone();
                async move {
                    let found = store.get_schedule(&id).await;
                    (id, found)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<(String, Result<Option<Schedule>, StoreError>)>>();
        let (loaded, held_back) = self
            .bounded(async {
                let (loaded, held_back) = futures::join!(loading, held_back);
                Ok((loaded, held_back?))
            })
            .await?;
        let held_back: HashMap<String, HeldBack> = due_ids
            .into_iter()
            .zip(held_back)
            .filter_map(|(id, held)| Some((id, held?)))
            .collect();
        // Held back and found due at its retry (or, the pass that was to move it having
        // failed to record, still at its first due time): it catches up from when it was
        // first due. Found due at another time, it was registered again or resumed
        // meanwhile, and starts afresh.
        let first_due = |id: &str, due_ms: i64| match held_back.get(id) {
            Some(held) if due_ms == held.retry_ms || due_ms == held.first_due_ms => {
                held.first_due_ms.min(due_ms)
            }
            _ => due_ms,
        };
        // What this pass holds back, or forgets having held back, recorded with it.
        let mut held_now: Vec<(String, Option<HeldBack>)> = Vec::new();
        // Unreadable or invalid (written by another version, say): one such schedule
        // must not stop the rest of its shard, nor be dropped from it. It stays out of the cache, so it
        // is not fired, and is looked at again a while later.
        let mut unreadable = std::collections::HashSet::new();
        let due_at: HashMap<&str, i64> = due.iter().map(|(id, ms)| (id.as_str(), *ms)).collect();
        for (id, found) in loaded {
            let (what, error) = match found {
                Err(e) if !e.is_retryable() => (
                    "stored schedule cannot be read; not firing it",
                    e.to_string(),
                ),
                found => match found? {
                    // Deleted since it was found due: what was held back of it goes too.
                    None => {
                        if held_back.contains_key(&id) {
                            held_now.push((id, None));
                        }
                        continue;
                    }
                    Some(schedule) => match schedule.validate() {
                        Ok((expr, tz)) => {
                            // Known from the time it was found due (or first due,
                            // held back) until this pass records the next one: should
                            // the store go away before that, it fires from local state
                            // from there on (a time this pass emits goes out again,
                            // under the same tick id).
                            let next = due_at.get(id.as_str()).and_then(|&due_ms| {
                                plan::first_local_fire(
                                    &schedule,
                                    (&expr, tz),
                                    first_due(&id, due_ms),
                                    horizon,
                                    self.config.lease_ttl,
                                )
                            });
                            self.cache.insert(id, (Cached { schedule, expr, tz }, next));
                            continue;
                        }
                        // Invalid here (a zone this version's time zone data lacks, say),
                        // perhaps valid for the version that stored it: kept, and read
                        // again a while later, like an unreadable one.
                        Err(e) => ("stored schedule is invalid; not firing it", e.to_string()),
                    },
                },
            };
            self.warn_held_back(&id, retry_ms, lease.token, what, error);
            let due_ms = due_at.get(id.as_str()).copied().unwrap_or(i64::MAX);
            let first_due_ms = first_due(&id, due_ms);
            held_now.push((
                id.clone(),
                Some(HeldBack {
                    first_due_ms,
                    retry_ms,
                }),
            ));
            unreadable.insert(id);
        }
        // Held back, it is known locally from when it was first due, whether loaded in
        // this pass (done above, and the same again here) or cached before it (read
        // ahead, at the time its shard files it under: the retry): should the store go
        // away before this pass records, it catches up from local state from there.
        for (id, due_ms) in &due {
            if !held_back.contains_key(id) {
                continue;
            }
            if let Some((cached, next)) = self.cache.get_mut(id) {
                *next = plan::first_local_fire(
                    &cached.schedule,
                    (&cached.expr, cached.tz),
                    first_due(id, *due_ms),
                    horizon,
                    self.config.lease_ttl,
                );
            }
        }
        // Plan every firing, claim them all in one round trip, publish the claimed ones
        // concurrently, then record statuses and next fire times in one more.
        let mut next_fires = Vec::with_capacity(due.len());
        let mut planned: Vec<(String, Execution)> = Vec::new();
        // Warned of before and read now: forgotten once this pass is recorded.
        let mut read_back = Vec::new();
        for (id, next_ms) in due {
            let Some((cached, _)) = self.cache.get(&id) else {
                let retry = unreadable.contains(&id).then_some(retry_ms);
                next_fires.push((id, retry));
                continue;
            };
            let schedule = &cached.schedule;
            // Read back: what was held back of it is forgotten with this pass's record
            // (a pass that fails to record is planned again from the same first due
            // time), and so is the time a pause found it first due at.
            if held_back.contains_key(&id) {
                held_now.push((id.clone(), None));
            }
            if self.warned.contains_key(&id) {
                read_back.push(id.clone());
            }
            if !schedule.enabled {
                next_fires.push((id, None));
                continue;
            }
            let first_due_ms = first_due(&id, next_ms);
            let last = Utc
                .timestamp_millis_opt(first_due_ms - 1)
                .single()
                .unwrap_or(now);
            let running = if plan::overlap_matters(schedule) {
                match self.recent_executions(&id).await {
                    // Records that do not read back (another version wrote them, say)
                    // are passed over: what runs is judged on the rest.
                    Ok(recent) => {
                        if let Some(first) = recent.unreadable.first() {
                            warn!(schedule = %id, unreadable = recent.unreadable.len(), error = %first.error, "execution records cannot be read; overlap judged on the rest");
                        }
                        plan::Running::from_recent(&recent.executions)
                    }
                    // Its history unreadable (another version's records): fired as if
                    // nothing ran, rather than never again.
                    Err(e) if !e.is_retryable() => {
                        warn!(schedule = %id, error = %e, "recent executions cannot be read; overlap not checked");
                        plan::Running::Nothing
                    }
                    Err(e) => return Err(e),
                }
            } else {
                plan::Running::Nothing
            };
            let scheduled = plan::plan(
                schedule,
                (&cached.expr, cached.tz),
                last,
                horizon,
                self.config.lease_ttl,
                running,
            );
            for firing in scheduled.firings {
                let mut execution = self.execution(schedule, firing.at, lease);
                execution.status = firing.status;
                execution.error = firing.error;
                planned.push((id.clone(), execution));
            }
            let next = scheduled.next;
            next_fires.push((id, next.map(|t| t.timestamp_millis())));
        }
        let executions: Vec<Execution> = planned.iter().map(|(_, e)| e.clone()).collect();
        let fence = Fence::from(lease);
        let claims = self
            .bounded(self.store.claim_executions(&executions, Some(&fence)))
            .await?;
        let mut claimed = Vec::with_capacity(planned.len());
        for ((id, execution), won) in planned.into_iter().zip(claims) {
            if won {
                if execution.status == ExecutionStatus::Scheduled {
                    claimed.push((id, execution));
                }
                continue;
            }
            // Claimed already. If a deposed master claimed it and died before emitting,
            // an at_least_once tick must not wait for orphan recovery: take it over now.
            let at_least_once = self
                .cache
                .get(&id)
                .is_some_and(|(c, _)| c.schedule.delivery == Delivery::AtLeastOnce);
            if !at_least_once {
                continue;
            }
            let existing = match self
                .bounded(self.store.get_execution(&id, execution.scheduled_ms))
                .await
            {
                Ok(existing) => existing,
                // Written by another version, say: left to that one's master rather
                // than stopping the rest of the shard.
                Err(e) if !e.is_retryable() => {
                    warn!(schedule = %id, scheduled_ms = execution.scheduled_ms, error = %e, "claimed execution cannot be read; not taking it over");
                    continue;
                }
                Err(e) => return Err(e),
            };
            if let Some(mut existing) = existing {
                if existing.status == ExecutionStatus::Scheduled
                    && existing.fencing_token < lease.token
                {
                    existing.attempt += 1;
                    existing.fencing_token = lease.token;
                    existing.node_id = self.config.node_id.clone();
                    claimed.push((id, existing));
                }
            }
        }
        claimed.sort_by_key(|(_, e)| e.scheduled_ms);
        let mut fired = Vec::with_capacity(claimed.len());
        let mut batch = Vec::new();
        let mut pending = claimed.into_iter().peekable();
        while let Some((id, execution)) = pending.next() {
            let at = execution.scheduled_ms;
            batch.push((id, execution));
            if pending.peek().is_some_and(|(_, e)| e.scheduled_ms == at) {
                continue;
            }
            // Build every message now, so at the instant only the emission time is
            // written before each is handed to the broker client.
            let mut ready = Vec::with_capacity(batch.len());
            for (id, mut execution) in batch.drain(..) {
                let Some((cached, _)) = self.cache.get(&id) else {
                    continue;
                };
                match self.ready_tick(&cached.schedule, &execution) {
                    Ok(tick) => ready.push((execution, tick)),
                    Err(e) => {
                        warn!(schedule = %id, error = %e, "tick cannot be encoded");
                        execution.error = Some(e.to_string());
                        fired.push(execution);
                    }
                }
            }
            let wait = at - self.config.clock.now().timestamp_millis();
            if wait > 0 {
                tokio::time::sleep(Duration::from_millis(wait as u64)).await;
            }
            fired.extend(self.emit(ready, shard).await);
        }
        self.bounded(
            self.store
                .record_fires(shard, &fired, &next_fires, &held_now, &fence),
        )
        .await?;
        for id in read_back {
            self.warned.remove(&id);
        }
        for (id, next) in next_fires {
            if let Some(entry) = self.cache.get_mut(&id) {
                entry.1 = next.and_then(|ms| Utc.timestamp_millis_opt(ms).single());
            }
        }
        let earliest = self.bounded(self.store.earliest_fire(shard)).await?;
        Ok(earliest.and_then(|ms| Utc.timestamp_millis_opt(ms).single()))
    }

    /// Warns of a stored schedule left unfired until a later look when it is first left
    /// so, or when the reason changes: a schedule invalid for good would otherwise warn
    /// at every look.
    fn warn_held_back(&mut self, id: &str, retry_ms: i64, token: u64, what: &str, error: String) {
        match self.warned.get_mut(id) {
            Some(warned) if warned.token == token && warned.error == error => {
                debug!(schedule = %id, %error, retry_in = ?UNREADABLE_RETRY, "{what}");
                warned.retry_ms = retry_ms;
            }
            _ => {
                warn!(schedule = %id, %error, retry_in = ?UNREADABLE_RETRY, "{what}");
                let warned = Warned {
                    error,
                    retry_ms,
                    token,
                };
                self.warned.insert(id.to_string(), warned);
            }
        }
    }

    /// The store is unreachable: the ticks of the `at_least_once` schedules this node
    /// knows that are due, added to `due`; returns the shard's next fire time after. What
    /// falls due within the look-ahead is taken too, to be fired at its instant: the
    /// loop wakes that much ahead of the next fire time, and would otherwise find
    /// nothing due and wake again at once until the instant came.
    fn due_locally(
        &mut self,
        shard: u32,
        lease: &Lease,
        due: &mut Vec<(DateTime<Utc>, Schedule, Lease)>,
    ) -> Option<DateTime<Utc>> {
        let horizon =
            self.config.clock.now() + chrono::Duration::from_std(LOOKAHEAD).unwrap_or_default();
        let shards = self.config.shards;
        let mut earliest = None;
        for (id, (cached, next)) in self.cache.iter_mut() {
            if shard_of(id, shards) != shard
                || cached.schedule.delivery != Delivery::AtLeastOnce
                || !cached.schedule.enabled
            {
                continue;
            }
            while let Some(t) = next.filter(|t| *t <= horizon) {
                due.push((t, cached.schedule.clone(), lease.clone()));
                *next = cached.schedule.next_after(&cached.expr, cached.tz, t);
            }
            if let Some(n) = *next {
                earliest = Some(earliest.map_or(n, |e: DateTime<Utc>| e.min(n)));
            }
        }
        earliest
    }

    pub(super) fn execution(
        &self,
        schedule: &Schedule,
        scheduled: DateTime<Utc>,
        lease: &Lease,
    ) -> Execution {
        Execution {
            schedule_id: schedule.id.clone(),
            scheduled_ms: scheduled.timestamp_millis(),
            tick_id: tick_id(&schedule.id, scheduled),
            status: ExecutionStatus::Scheduled,
            attempt: 1,
            max_attempts: self.config.max_attempts,
            node_id: self.config.node_id.clone(),
            fencing_token: lease.token,
            updated_ms: self.config.clock.now().timestamp_millis(),
            error: None,
        }
    }

    /// The tick of an execution as a message, all but its emission time.
    pub(super) fn ready_tick(
        &self,
        schedule: &Schedule,
        execution: &Execution,
    ) -> Result<ReadyTick, CodecError> {
        let tick = CronTick {
            schedule_id: schedule.id.clone(),
            tick_id: execution.tick_id.clone(),
            scheduled_time_ms: execution.scheduled_ms,
            emitted_time_ms: 0,
            fencing_token: execution.fencing_token as i64,
            delivery: schedule.delivery.as_str().to_string(),
            attempt: execution.attempt as i32,
            payload: schedule.payload.to_string(),
            node_id: self.config.node_id.clone(),
            tenant: schedule.tenant.clone(),
        };
        let topic = match &schedule.target {
            Target::Topic(t) => t.clone(),
            Target::Workflow(w) => crate::dispatch::manager::workflow_start_topic(w),
        };
        let topic = match &schedule.tenant {
            Some(tenant) => format!("{tenant}.{topic}"),
            None => topic,
        };
        Ok(ReadyTick {
            encoded: PreparedTick::new(&tick)?,
            message: Outbound::new(topic, Bytes::new())
                .key(schedule.id.clone().into_bytes())
                .header(crate::wire::TICK_ID_HEADER, execution.tick_id.clone()),
            delivery: schedule.delivery,
            emitted: emitted_status(schedule),
        })
    }
}

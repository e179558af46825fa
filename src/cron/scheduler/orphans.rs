//! Ticks claimed and never emitted, and workflow ticks whose workflow never started:
//! emitted again, or settled.

use super::*;

impl Scheduler {
    /// Executions claimed but never emitted (their master died between the claim and
    /// the publish), and workflow ticks still `running` whose workflow execution never
    /// started, are emitted again once they are older than `orphan_after`, until their
    /// stored attempt cap; then they are marked failed. A `running` one whose workflow
    /// ended takes its outcome. A `buffer_one` execution goes out once nothing of its
    /// schedule is running.
    pub(super) async fn recover_orphans(&mut self) -> Result<(), StoreError> {
        let led: Vec<usize> = (0..self.shards.len()).filter(|&i| self.holds(i)).collect();
        if led.is_empty() {
            return Ok(());
        }
        let threshold = self.config.clock.now().timestamp_millis()
            - self.config.orphan_after.as_millis() as i64;
        // Only unfinished executions are looked at, found through the store's index, so
        // a sweep costs nothing per schedule that is firing normally.
        let batch = self.config.sweep_batch.max(1);
        let found = self
            .bounded(
                self.store
                    .open_executions(threshold, self.sweep_from, batch),
            )
            .await?;
        // Executions that rightly stay open (running workflows, buffered ticks, other
        // shards') would otherwise fill every batch and hide the rest: the next sweep
        // starts after this one, and from the front once the end is reached. What
        // leaves the index meanwhile only shifts the rest forward, to be met next pass.
        self.sweep_from = if found.len() < batch {
            0
        } else {
            self.sweep_from + found.len()
        };
        let mut open: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (id, scheduled_ms) in found {
            open.entry(id).or_default().push(scheduled_ms);
        }
        for (id, times) in open {
            let shard = shard_of(&id, self.config.shards) as usize;
            if !led.contains(&shard) {
                continue;
            }
            let Some(lease) = self.shards[shard].lease() else {
                continue;
            };
            // A master deposed meanwhile has its writes refused.
            let fence = Fence::from(&lease);
            // Unreadable (written by another version, say): its executions wait, and the
            // rest of the sweep goes on, as the shard's firing does.
            let schedule = match self.bounded(self.store.get_schedule(&id)).await {
                Err(e) if !e.is_retryable() => {
                    warn!(schedule = %id, error = %e, "stored schedule cannot be read; its unfinished executions are left for a later sweep");
                    continue;
                }
                found => found?,
            };
            // Whether one of the schedule's executions runs, for its buffered one; not
            // known while one of its records cannot be read and none of the rest runs,
            // and the buffered one waits.
            let mut running = match self.recent_executions(&id).await {
                Ok(recent) => {
                    let runs = recent
                        .executions
                        .iter()
                        .any(|e| e.status == ExecutionStatus::Running);
                    if !runs && !recent.unreadable.is_empty() {
                        warn!(schedule = %id, unreadable = recent.unreadable.len(), "the schedule's executions cannot all be read; a buffered tick of it waits for a later sweep");
                        None
                    } else {
                        Some(runs)
                    }
                }
                Err(e) if !e.is_retryable() => {
                    warn!(schedule = %id, error = %e, "the schedule's executions cannot all be read; a buffered tick of it waits for a later sweep");
                    None
                }
                Err(e) => return Err(e),
            };
            for scheduled_ms in times {
                // Unreadable (written by another version, say): it waits, and the rest
                // of the sweep goes on.
                let mut execution = match self
                    .bounded(self.store.get_execution(&id, scheduled_ms))
                    .await
                {
                    Ok(Some(execution)) => execution,
                    Ok(None) => continue,
                    Err(e) if !e.is_retryable() => {
                        warn!(schedule = %id, scheduled_ms, error = %e, "stored execution cannot be read; left for a later sweep");
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let Some(schedule) = &schedule else {
                    execution.status = ExecutionStatus::Failed;
                    execution.error = Some("schedule removed before the tick was emitted".into());
                    execution.updated_ms = self.config.clock.now().timestamp_millis();
                    self.bounded(self.store.put_execution(&execution, Some(&fence)))
                        .await?;
                    continue;
                };
                if execution.status == ExecutionStatus::Buffered {
                    if running != Some(false) {
                        continue;
                    }
                    // The running execution ended: the buffered one goes now.
                    execution.fencing_token = lease.token;
                    let at_most_once = schedule.delivery == Delivery::AtMostOnce;
                    if at_most_once {
                        // Recorded as claimed before it goes out: should the record of
                        // its emission fail, a later sweep finds it `scheduled` and gives
                        // it up, where a `buffered` one would be sent a second time.
                        execution.status = ExecutionStatus::Scheduled;
                        execution.updated_ms = self.config.clock.now().timestamp_millis();
                        self.bounded(self.store.put_execution(&execution, Some(&fence)))
                            .await?;
                    }
                    match self.publish(schedule, &execution).await {
                        Ok(()) => {
                            execution.status = ExecutionStatus::Running;
                            running = Some(true);
                        }
                        // It may have reached the broker all the same.
                        Err(reason) if at_most_once => {
                            warn!(schedule = %id, tick = %execution.tick_id, %reason, "buffered tick not published");
                            execution.error = Some(reason);
                            missed(&mut execution);
                        }
                        Err(reason) => {
                            warn!(schedule = %id, tick = %execution.tick_id, %reason, "buffered tick not published; sent again by a later sweep");
                        }
                    }
                    execution.updated_ms = self.config.clock.now().timestamp_millis();
                    self.bounded(self.store.put_execution(&execution, Some(&fence)))
                        .await?;
                    continue;
                }
                if execution.updated_ms > threshold {
                    continue;
                }
                if execution.status == ExecutionStatus::Running {
                    match self
                        .bounded(self.settle_running(schedule, &mut execution))
                        .await
                    {
                        Ok(true) => {}
                        Ok(false) => continue,
                        Err(e) if !e.is_retryable() => {
                            warn!(schedule = %id, tick = %execution.tick_id, error = %e, "the tick's workflow execution cannot be read; left for a later sweep");
                            continue;
                        }
                        Err(e) => return Err(e),
                    }
                    if execution.status != ExecutionStatus::Scheduled {
                        self.bounded(self.store.put_execution(&execution, Some(&fence)))
                            .await?;
                        continue;
                    }
                }
                if execution.status != ExecutionStatus::Scheduled {
                    continue;
                }
                if schedule.delivery == Delivery::AtMostOnce {
                    // Claimed and perhaps emitted by a master that died before recording
                    // it: emitting it now could deliver it twice. A workflow tick that
                    // did go out has started its workflow execution, which says so.
                    match self
                        .bounded(self.started_workflow(schedule, &execution))
                        .await
                    {
                        Ok(Some(status)) => {
                            info!(schedule = %id, tick = %execution.tick_id, ?status, "at_most_once tick of a dead master went out; its workflow tells how it went");
                            execution.status = status;
                        }
                        Ok(None) => {
                            warn!(schedule = %id, tick = %execution.tick_id, "at_most_once tick of a dead master marked missed");
                            missed(&mut execution);
                        }
                        Err(e) if !e.is_retryable() => {
                            warn!(schedule = %id, tick = %execution.tick_id, error = %e, "at_most_once tick of a dead master marked missed; its workflow execution cannot be read");
                            missed(&mut execution);
                        }
                        Err(e) => return Err(e),
                    }
                } else if execution.attempt >= execution.max_attempts {
                    warn!(schedule = %id, tick = %execution.tick_id, attempts = execution.attempt, "execution failed: never emitted");
                    execution.status = ExecutionStatus::Failed;
                    execution.error =
                        Some(format!("not emitted after {} attempts", execution.attempt));
                } else {
                    execution.attempt += 1;
                    execution.fencing_token = lease.token;
                    execution.node_id = self.config.node_id.clone();
                    info!(schedule = %id, tick = %execution.tick_id, attempt = execution.attempt, "re-emitting orphaned execution");
                    match self.publish(schedule, &execution).await {
                        Ok(()) => {
                            execution.status = emitted_status(schedule);
                            execution.error = None;
                        }
                        Err(reason) => execution.error = Some(reason),
                    }
                }
                execution.updated_ms = self.config.clock.now().timestamp_millis();
                self.bounded(self.store.put_execution(&execution, Some(&fence)))
                    .await?;
            }
        }
        Ok(())
    }

    /// A workflow tick `running` past the orphan threshold: its workflow execution
    /// (whose id is the tick id) tells what happened. Ended: the record takes its
    /// outcome. Never started (the tick was lost): the record goes back to `scheduled`
    /// for re-emission. Still running: nothing to do. Returns whether it changed.
    pub(super) async fn settle_running(
        &self,
        schedule: &Schedule,
        execution: &mut Execution,
    ) -> Result<bool, StoreError> {
        if !matches!(schedule.target, Target::Workflow(_)) {
            return Ok(false);
        }
        execution.status = match self.started_workflow(schedule, execution).await? {
            Some(ExecutionStatus::Running) => return Ok(false),
            Some(ended) => ended,
            None => {
                info!(schedule = %schedule.id, tick = %execution.tick_id, "workflow tick never started its execution");
                ExecutionStatus::Scheduled
            }
        };
        execution.updated_ms = self.config.clock.now().timestamp_millis();
        Ok(true)
    }

    /// What the workflow execution a workflow tick started (its id is the tick id) says
    /// of the tick: `running`, `completed` or `failed`. None when the schedule targets
    /// no workflow, or the tick started none.
    async fn started_workflow(
        &self,
        schedule: &Schedule,
        execution: &Execution,
    ) -> Result<Option<ExecutionStatus>, StoreError> {
        if !matches!(schedule.target, Target::Workflow(_)) {
            return Ok(None);
        }
        let run = self
            .store
            .get_workflow_execution(&execution.tick_id)
            .await?;
        Ok(run.map(|r| match r.status {
            crate::dispatch::RunStatus::Running => ExecutionStatus::Running,
            crate::dispatch::RunStatus::Completed => ExecutionStatus::Completed,
            crate::dispatch::RunStatus::Failed => ExecutionStatus::Failed,
        }))
    }
}

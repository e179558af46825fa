//! Handing claimed ticks to the broker and recording how that went.

use super::*;

impl Scheduler {
    /// Emits the ticks of one scheduled instant: each is stamped and handed to the
    /// broker client in turn, then all acknowledgements are awaited together. Returns
    /// their records with the new status. An `at_most_once` tick whose lease lapsed
    /// meanwhile stays `scheduled` for the next master's orphan recovery; so does a tick
    /// the broker did not take.
    pub(super) async fn emit(
        &self,
        ticks: Vec<(Execution, ReadyTick)>,
        shard: u32,
    ) -> Vec<Execution> {
        let holds = self.holds(shard as usize);
        let span = info_span!("cron_fire", shard, ticks = ticks.len());
        async move {
            let mut done = Vec::with_capacity(ticks.len());
            // Handed to the broker client, and their acknowledgements, in step.
            let mut handed = Vec::with_capacity(ticks.len());
            let mut acks = Vec::with_capacity(ticks.len());
            for (mut execution, tick) in ticks {
                if tick.delivery == Delivery::AtMostOnce && !holds {
                    execution.error = Some("lease lapsed before the tick was due".into());
                    done.push(execution);
                    continue;
                }
                let (delivery, emitted) = (tick.delivery, tick.emitted);
                let emitted_ms = self.config.clock.now().timestamp_millis();
                // Exempt from tokio's cooperative budget: otherwise the task yields every
                // so many sends, and the rest of the burst waits its turn for a core.
                let handing = self.sink.enqueue(tick.stamped(emitted_ms));
                match tokio::task::unconstrained(handing).await {
                    Ok(ack) => {
                        handed.push((execution, delivery, emitted, emitted_ms));
                        acks.push(ack);
                    }
                    Err(e) => {
                        warn!(schedule = %execution.schedule_id, error = %e, "tick not published");
                        execution.error = Some(e.to_string());
                        if delivery == Delivery::AtMostOnce {
                            missed(&mut execution);
                        }
                        done.push(execution);
                    }
                }
            }
            let acks = futures::future::join_all(acks).await;
            let now = self.config.clock.now().timestamp_millis();
            for ((mut execution, delivery, emitted, emitted_ms), acked) in
                handed.into_iter().zip(acks)
            {
                match acked {
                    Ok(_) => {
                        record_emission(delivery, emitted_ms - execution.scheduled_ms);
                        execution.status = emitted;
                    }
                    Err(e) => {
                        warn!(schedule = %execution.schedule_id, error = %e, "tick not published");
                        execution.error = Some(e.to_string());
                        // It may have reached the broker all the same: sending it again
                        // could deliver it twice.
                        if delivery == Delivery::AtMostOnce {
                            missed(&mut execution);
                        }
                    }
                }
                execution.updated_ms = now;
                done.push(execution);
            }
            done
        }
        .instrument(span)
        .await
    }

    /// A firing while the store is unreachable: no claim is possible, so only
    /// `at_least_once` schedules fire, with the tick id a claim would have used.
    pub(super) async fn fire_without_store(
        &self,
        schedule: &Schedule,
        scheduled: DateTime<Utc>,
        lease: &Lease,
    ) {
        let execution = self.execution(schedule, scheduled, lease);
        if let Err(reason) = self.publish(schedule, &execution).await {
            warn!(schedule = %schedule.id, %reason, "tick not published");
        }
    }

    /// Publishes one tick now and waits for the broker's acknowledgement.
    pub(super) async fn publish(
        &self,
        schedule: &Schedule,
        execution: &Execution,
    ) -> Result<(), String> {
        let tick = self
            .ready_tick(schedule, execution)
            .map_err(|e| e.to_string())?;
        let delivery = tick.delivery;
        let emitted_ms = self.config.clock.now().timestamp_millis();
        let span = info_span!("cron_fire", schedule = %schedule.id);
        self.sink
            .publish(tick.stamped(emitted_ms))
            .instrument(span)
            .await
            .map_err(|e| e.to_string())?;
        record_emission(delivery, emitted_ms - execution.scheduled_ms);
        Ok(())
    }
}

/// A claimed tick made ready ahead of its instant.
pub(super) struct ReadyTick {
    pub(super) encoded: PreparedTick,
    /// Topic, key and headers; the payload is written at emission.
    pub(super) message: Outbound,
    pub(super) delivery: Delivery,
    /// The execution's status once the broker has the tick.
    pub(super) emitted: ExecutionStatus,
}

impl ReadyTick {
    pub(super) fn stamped(self, emitted_ms: i64) -> Outbound {
        let mut message = self.message;
        message.payload = self.encoded.finish(emitted_ms).into();
        message
    }
}

/// Gives an `at_most_once` tick up for good.
pub(super) fn missed(execution: &mut Execution) {
    execution.status = ExecutionStatus::Missed;
    metrics::counter!(crate::metrics::CRON_TICKS_MISSED_TOTAL).increment(1);
}

pub(super) fn record_emission(delivery: Delivery, lateness_ms: i64) {
    let lateness = lateness_ms.max(0) as f64 / 1000.0;
    metrics::histogram!(crate::metrics::TICK_LATENESS_SECONDS).record(lateness);
    metrics::counter!(crate::metrics::CRON_TICKS_TOTAL, "delivery" => delivery.as_str())
        .increment(1);
}

//! Planning, as a pure function: which scheduled times of one schedule fire and with
//! what status, from the schedule, the times it is due at, and what of it still runs.
//! No store, no clock: the claim step reads those and hands them in.

use super::*;

/// What of a schedule still runs when its times fall due. Only workflow executions
/// stay running; a topic tick is done once published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Running {
    Nothing,
    /// An execution runs; none waits behind it.
    One,
    /// An execution runs and another waits (`buffer_one`).
    OneAndBuffered,
}

impl Running {
    /// From the statuses of a schedule's recent executions.
    pub(super) fn from_recent(recent: &[Execution]) -> Self {
        let has = |status| recent.iter().any(|e| e.status == status);
        match (
            has(ExecutionStatus::Running),
            has(ExecutionStatus::Buffered),
        ) {
            (false, _) => Self::Nothing,
            (true, false) => Self::One,
            (true, true) => Self::OneAndBuffered,
        }
    }
}

/// One scheduled time and what becomes of it: `Scheduled` (fire it), `Buffered` (wait
/// for the running one) or `Skipped` (dropped by the overlap policy).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Firing {
    pub at: DateTime<Utc>,
    pub status: ExecutionStatus,
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Plan {
    pub firings: Vec<Firing>,
    /// The first fire time after the horizon.
    pub next: Option<DateTime<Utc>>,
}

/// Whether planning needs to know what of `schedule` still runs.
pub(super) fn overlap_matters(schedule: &Schedule) -> bool {
    schedule.overlap != Overlap::Allow && matches!(schedule.target, Target::Workflow(_))
}

/// How late an `at_least_once` tick may be and still go out whatever the catch-up
/// policy says of downtime: one due within a failover (the previous master's lease
/// running out, then an election) is late, not missed.
pub(super) fn failover_grace(schedule: &Schedule, lease_ttl: Duration) -> Duration {
    match schedule.delivery {
        Delivery::AtLeastOnce => lease_ttl * 4 / 3 + LOOKAHEAD,
        _ => Duration::ZERO,
    }
}

/// The first time a master that knows `schedule` only from memory fires it, given the
/// time the store files it under (`due_ms`) and the planning horizon: that time when it
/// is recent, or, after downtime, the first of the times since that the catch-up policy
/// keeps, as a pass with the store plans them. Fired from there, one time after the
/// other, up to the horizon, it fires what such a pass would: every policy keeps the
/// newest missed times, one after the other, then every recent one.
pub(super) fn first_local_fire(
    schedule: &Schedule,
    (expr, tz): (&CronExpr, Tz),
    due_ms: i64,
    horizon: DateTime<Utc>,
    lease_ttl: Duration,
) -> Option<DateTime<Utc>> {
    let last = Utc.timestamp_millis_opt(due_ms - 1).single()?;
    let grace = failover_grace(schedule, lease_ttl);
    let (times, next) = schedule.due_and_next(expr, tz, last, horizon, grace);
    times.first().copied().or(next)
}

/// The firings of `schedule` after `last` up to `horizon`.
pub(super) fn plan(
    schedule: &Schedule,
    (expr, tz): (&CronExpr, Tz),
    last: DateTime<Utc>,
    horizon: DateTime<Utc>,
    lease_ttl: Duration,
    mut running: Running,
) -> Plan {
    let grace = failover_grace(schedule, lease_ttl);
    let (times, next) = schedule.due_and_next(expr, tz, last, horizon, grace);
    if !overlap_matters(schedule) {
        running = Running::Nothing;
    }
    let firings = times
        .into_iter()
        .map(|at| {
            let (status, error) = match (schedule.overlap, running) {
                (_, Running::Nothing) => (ExecutionStatus::Scheduled, None),
                (Overlap::BufferOne, Running::One) => {
                    running = Running::OneAndBuffered;
                    (ExecutionStatus::Buffered, None)
                }
                _ => (
                    ExecutionStatus::Skipped,
                    Some("previous execution still running".to_string()),
                ),
            };
            Firing { at, status, error }
        })
        .collect();
    Plan { firings, next }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minute: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 1, 1, 0, minute, 0).unwrap()
    }

    fn every_minute(overlap: Overlap) -> (Schedule, CronExpr, Tz) {
        let mut schedule = Schedule::new("s", "0 * * * * *", "UTC");
        schedule.target = Target::Workflow("w".into());
        schedule.overlap = overlap;
        schedule.catchup = crate::cron::CatchUp::All { cap: 10 };
        let (expr, tz) = schedule.validate().unwrap();
        (schedule, expr, tz)
    }

    fn statuses(plan: &Plan) -> Vec<ExecutionStatus> {
        plan.firings.iter().map(|f| f.status).collect()
    }

    const TTL: Duration = Duration::from_secs(15);

    #[test]
    fn with_nothing_running_every_due_time_fires() {
        let (s, expr, tz) = every_minute(Overlap::Skip);
        let plan = plan(&s, (&expr, tz), at(0), at(2), TTL, Running::Nothing);
        assert_eq!(
            plan.firings.iter().map(|f| f.at).collect::<Vec<_>>(),
            [at(1), at(2)]
        );
        assert_eq!(statuses(&plan), [ExecutionStatus::Scheduled; 2]);
        assert_eq!(plan.next, Some(at(3)));
    }

    #[test]
    fn skip_drops_what_falls_due_while_one_runs() {
        let (s, expr, tz) = every_minute(Overlap::Skip);
        let plan = plan(&s, (&expr, tz), at(0), at(2), TTL, Running::One);
        assert_eq!(statuses(&plan), [ExecutionStatus::Skipped; 2]);
        assert!(plan.firings.iter().all(|f| f.error.is_some()));
    }

    #[test]
    fn buffer_one_keeps_one_waiting_and_drops_the_rest() {
        let (s, expr, tz) = every_minute(Overlap::BufferOne);
        let plan = plan(&s, (&expr, tz), at(0), at(3), TTL, Running::One);
        assert_eq!(
            statuses(&plan),
            [
                ExecutionStatus::Buffered,
                ExecutionStatus::Skipped,
                ExecutionStatus::Skipped
            ]
        );
        let full = plan_of(&s, &expr, tz, Running::OneAndBuffered);
        assert_eq!(statuses(&full), [ExecutionStatus::Skipped]);
    }

    fn plan_of(s: &Schedule, expr: &CronExpr, tz: Tz, running: Running) -> Plan {
        plan(s, (expr, tz), at(0), at(1), TTL, running)
    }

    #[test]
    fn allow_and_topic_targets_ignore_what_runs() {
        let (s, expr, tz) = every_minute(Overlap::Allow);
        assert_eq!(
            statuses(&plan_of(&s, &expr, tz, Running::One)),
            [ExecutionStatus::Scheduled]
        );
        let (mut topic, expr, tz) = every_minute(Overlap::Skip);
        topic.target = Target::Topic("t".into());
        assert_eq!(
            statuses(&plan_of(&topic, &expr, tz, Running::One)),
            [ExecutionStatus::Scheduled]
        );
    }

    #[test]
    fn running_is_read_from_recent_statuses() {
        let execution = |status| Execution {
            schedule_id: "s".into(),
            scheduled_ms: 0,
            tick_id: "t".into(),
            status,
            attempt: 1,
            max_attempts: 1,
            node_id: "n".into(),
            fencing_token: 1,
            updated_ms: 0,
            error: None,
        };
        assert_eq!(Running::from_recent(&[]), Running::Nothing);
        assert_eq!(
            Running::from_recent(&[execution(ExecutionStatus::Buffered)]),
            Running::Nothing
        );
        assert_eq!(
            Running::from_recent(&[execution(ExecutionStatus::Running)]),
            Running::One
        );
        assert_eq!(
            Running::from_recent(&[
                execution(ExecutionStatus::Completed),
                execution(ExecutionStatus::Buffered),
                execution(ExecutionStatus::Running)
            ]),
            Running::OneAndBuffered
        );
    }
}

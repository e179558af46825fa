//! The schedule model. Everything a user supplies is validated at registration, with
//! errors that name the offending field and value.

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use super::expr::CronExpr;
use super::next::next_fire;

/// The most missed times `CatchUp::All` fires in one go. A schedule keeps its newest
/// 1000 execution records, and the times caught up are claimed together with the late
/// ones beside them: more would push the first of them out before they are sent.
pub const MOST_CAUGHT_UP: u32 = 500;

/// Missed fire times after downtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "policy")]
pub enum CatchUp {
    /// Drop them; fire at the next time after now.
    Skip,
    /// Fire once for the most recent missed time.
    Latest,
    /// Fire each missed time, oldest first, at most `cap` of them (the newest).
    All { cap: u32 },
}

/// A firing due while the previous one is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    Allow,
    Skip,
    /// Keep one waiting firing; drop further ones.
    BufferOne,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// Fire only while holding a valid lease: never twice, possibly not at all.
    AtMostOnce,
    /// Keep firing from local state when the store is unreachable: never missed,
    /// possibly twice (same tick id).
    AtLeastOnce,
}

impl Delivery {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AtMostOnce => "at_most_once",
            Self::AtLeastOnce => "at_least_once",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// Publish the tick to this topic or subject.
    Topic(String),
    /// Start one execution of this workflow per tick.
    Workflow(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub id: String,
    pub cron: String,
    pub timezone: String,
    pub enabled: bool,
    /// Paused because a node's config declared it `enabled = false`, not by an operator:
    /// a config that enables it again resumes it. Absent from records older versions
    /// wrote, whose pauses are kept as an operator's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused_by_config: bool,
    pub start: Option<DateTime<Utc>>,
    pub end: Option<DateTime<Utc>>,
    pub target: Target,
    pub payload: serde_json::Value,
    pub catchup: CatchUp,
    pub overlap: Overlap,
    pub delivery: Delivery,
    pub tenant: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("schedule {id}: {source}")]
    Cron {
        id: String,
        #[source]
        source: super::expr::CronError,
    },
    #[error("schedule {id}: unknown time zone {zone:?} (use an IANA name such as Europe/London)")]
    UnknownZone { id: String, zone: String },
    #[error("schedule {id}: {field} {value:?} is invalid: {reason}")]
    Invalid {
        id: String,
        field: &'static str,
        value: String,
        reason: String,
    },
}

impl ScheduleError {
    /// A schedule that fails validation stays invalid.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

impl Schedule {
    /// A schedule with the defaults: enabled, tick to `weir.cron.ticks`, skip missed
    /// times, skip overlapping firings, at-most-once.
    pub fn new(
        id: impl Into<String>,
        cron: impl Into<String>,
        timezone: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            cron: cron.into(),
            timezone: timezone.into(),
            enabled: true,
            paused_by_config: false,
            start: None,
            end: None,
            target: Target::Topic(crate::wire::TICK_TOPIC.into()),
            payload: serde_json::Value::Object(Default::default()),
            catchup: CatchUp::Skip,
            overlap: Overlap::Skip,
            delivery: Delivery::AtMostOnce,
            tenant: None,
        }
    }

    /// Checks every field; returns the parsed expression and zone.
    pub fn validate(&self) -> Result<(CronExpr, Tz), ScheduleError> {
        let invalid = |field, value: &str, reason: &str| ScheduleError::Invalid {
            id: self.id.clone(),
            field,
            value: value.to_string(),
            reason: reason.to_string(),
        };
        if self.id.is_empty() || self.id.chars().any(|c| c.is_whitespace() || c == ':') {
            return Err(invalid(
                "id",
                &self.id,
                "must be non-empty, without spaces or ':'",
            ));
        }
        // `/` separates a tenant from its schedule's name, and only there.
        let name = match (&self.tenant, self.id.split_once('/')) {
            (Some(tenant), Some((prefix, name))) if prefix == tenant => name,
            (_, Some(_)) => {
                return Err(invalid(
                    "id",
                    &self.id,
                    "holds no '/' but the one after its tenant (tenant/name)",
                ))
            }
            (_, None) => &self.id,
        };
        if name.is_empty() || name.contains('/') {
            return Err(invalid(
                "id",
                &self.id,
                "names no schedule after its tenant",
            ));
        }
        let expr = CronExpr::parse(&self.cron).map_err(|source| ScheduleError::Cron {
            id: self.id.clone(),
            source,
        })?;
        let tz: Tz = self
            .timezone
            .parse()
            .map_err(|_| ScheduleError::UnknownZone {
                id: self.id.clone(),
                zone: self.timezone.clone(),
            })?;
        if let (Some(start), Some(end)) = (self.start, self.end) {
            if end <= start {
                return Err(invalid("end", &end.to_rfc3339(), "must be after start"));
            }
        }
        if let CatchUp::All { cap: 0 } = self.catchup {
            return Err(invalid("catchup", "all", "the cap must be at least 1"));
        }
        match &self.target {
            Target::Topic(t) | Target::Workflow(t) if t.trim().is_empty() => {
                return Err(invalid("target", t, "must name a topic or a workflow"))
            }
            _ => {}
        }
        Ok((expr, tz))
    }

    /// The first fire instant strictly after `after`, within the start/end window.
    pub fn next_after(
        &self,
        expr: &CronExpr,
        tz: Tz,
        after: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let from = match self.start {
            // Start is inclusive: look from just before it.
            Some(start) if start > after => start - chrono::Duration::milliseconds(1),
            _ => after,
        };
        let next = next_fire(expr, tz, from)?;
        match self.end {
            Some(end) if next > end => None,
            _ => Some(next),
        }
    }

    /// Fire times to emit for the interval (`last`, `now`], following the catch-up
    /// policy: all of them (up to the cap), the latest, or none.
    pub fn due(
        &self,
        expr: &CronExpr,
        tz: Tz,
        last: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Vec<DateTime<Utc>> {
        self.due_and_next(expr, tz, last, now, JUST_DUE).0
    }

    /// [`Schedule::due`] and the first fire time after `now`, computed in one pass.
    /// Times within `recent` of `now` are not missed but late (a scheduler taking over
    /// from one that stopped): they are all kept, whatever the policy, which applies to
    /// the older ones only.
    pub fn due_and_next(
        &self,
        expr: &CronExpr,
        tz: Tz,
        last: DateTime<Utc>,
        now: DateTime<Utc>,
        recent: std::time::Duration,
    ) -> (Vec<DateTime<Utc>>, Option<DateTime<Utc>>) {
        let recent =
            chrono::Duration::from_std(recent.max(JUST_DUE)).unwrap_or(chrono::Duration::MAX);
        let cap = match self.catchup {
            CatchUp::Skip => 0,
            CatchUp::Latest => 1,
            // A stored schedule from before the limit may ask for more.
            CatchUp::All { cap } => cap.min(MOST_CAUGHT_UP) as usize,
        };
        // Times at or before `boundary` are older, missed; after it, late.
        let boundary = now.checked_sub_signed(recent).unwrap_or(last).max(last);
        let older = self.newest_before(expr, tz, last, boundary, cap);
        // Every recent one, and the next after `now`.
        let mut late = Vec::new();
        let mut at = boundary;
        let next = loop {
            match self.next_after(expr, tz, at) {
                Some(t) if t <= now => {
                    late.push(t);
                    at = t;
                }
                other => break other,
            }
        };
        let mut times: Vec<_> = match self.catchup {
            // The latest missed time stands for the missed ones only when no recent
            // one does.
            CatchUp::Latest if !late.is_empty() => Vec::new(),
            _ => older.into(),
        };
        times.extend(late);
        (times, next)
    }
}

impl Schedule {
    /// The newest `cap` fire times after `last` and at or before `boundary`, oldest
    /// first. Rather than walking every time from `last` (a per-second schedule down for
    /// a year missed 31 million; a stored position near the epoch, 1.7 billion), it
    /// looks back from `boundary` over a window that doubles until the window holds
    /// `cap` times or reaches `last`.
    fn newest_before(
        &self,
        expr: &CronExpr,
        tz: Tz,
        last: DateTime<Utc>,
        boundary: DateTime<Utc>,
        cap: usize,
    ) -> std::collections::VecDeque<DateTime<Utc>> {
        let mut kept = std::collections::VecDeque::new();
        if cap == 0 {
            return kept;
        }
        let mut window = chrono::Duration::seconds(1);
        loop {
            let from = boundary
                .checked_sub_signed(window)
                .unwrap_or(last)
                .max(last);
            kept.clear();
            let mut found = 0;
            let mut at = from;
            while let Some(t) = self.next_after(expr, tz, at).filter(|&t| t <= boundary) {
                if kept.len() == cap {
                    kept.pop_front();
                }
                kept.push_back(t);
                found += 1;
                at = t;
            }
            if found >= cap || from == last {
                return kept;
            }
            window = window.checked_mul(2).unwrap_or(chrono::Duration::MAX);
        }
    }
}

/// A time due less than this long ago is on time, not missed.
const JUST_DUE: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slash_in_an_id_only_follows_its_tenant() {
        let mut schedule = Schedule::new("acme/nightly", "0 2 * * *", "UTC");
        assert!(
            schedule.validate().is_err(),
            "no tenant, yet a tenant's name"
        );
        schedule.tenant = Some("acme".into());
        assert!(schedule.validate().is_ok());
        schedule.tenant = Some("globex".into());
        assert!(schedule.validate().is_err(), "another tenant's name");
        schedule.id = "globex/a/b".into();
        assert!(schedule.validate().is_err());
        schedule.id = "globex/".into();
        assert!(schedule.validate().is_err());
    }

    #[test]
    fn recent_times_are_late_not_missed_whatever_the_policy() {
        let mut schedule = Schedule::new("s", "* * * * * *", "UTC");
        let (expr, tz) = schedule.validate().unwrap();
        let now = DateTime::from_timestamp(1_000_000, 0).unwrap();
        let last = now - chrono::Duration::seconds(10);
        let four = std::time::Duration::from_secs(4);
        schedule.catchup = CatchUp::Skip;
        let (times, _) = schedule.due_and_next(&expr, tz, last, now, four);
        assert_eq!(
            times.len(),
            4,
            "the last four seconds, none older: {times:?}"
        );
        assert_eq!(*times.last().unwrap(), now);
        let (times, _) = schedule.due_and_next(&expr, tz, last, now, std::time::Duration::ZERO);
        assert_eq!(times, vec![now], "without grace, only what is due now");
        schedule.catchup = CatchUp::All { cap: 2 };
        let (times, _) = schedule.due_and_next(&expr, tz, last, now, four);
        assert_eq!(times.len(), 6, "two older, four recent: {times:?}");
    }

    /// Every fire time after `last` up to `now`, one at a time: what catching up keeps
    /// is taken from these.
    fn walked(
        s: &Schedule,
        expr: &CronExpr,
        tz: Tz,
        last: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Vec<DateTime<Utc>> {
        let mut times = Vec::new();
        let mut at = last;
        while let Some(t) = s.next_after(expr, tz, at).filter(|&t| t <= now) {
            times.push(t);
            at = t;
        }
        times
    }

    #[test]
    fn catching_up_keeps_the_newest_missed_times_however_many_were_missed() {
        let four = std::time::Duration::from_secs(4);
        for (cron, zone, missed) in [
            ("* * * * * *", "UTC", chrono::Duration::hours(3)),
            ("*/7 * * * *", "America/New_York", chrono::Duration::days(9)),
            ("30 2 * * *", "Europe/London", chrono::Duration::days(400)),
            ("0 0 1 1 *", "UTC", chrono::Duration::days(365 * 7)),
        ] {
            let mut schedule = Schedule::new("s", cron, zone);
            let (expr, tz) = schedule.validate().unwrap();
            let now = utc("2026-03-29T01:30:00Z");
            let last = now - missed;
            let every = walked(&schedule, &expr, tz, last, now);
            let boundary = now - chrono::Duration::seconds(4);
            let late: Vec<_> = every.iter().copied().filter(|&t| t > boundary).collect();
            let older: Vec<_> = every.iter().copied().filter(|&t| t <= boundary).collect();
            for (policy, kept) in [
                (CatchUp::Skip, 0),
                (CatchUp::Latest, 1),
                (CatchUp::All { cap: 3 }, 3),
                (CatchUp::All { cap: 100 }, 100),
            ] {
                schedule.catchup = policy;
                let (times, next) = schedule.due_and_next(&expr, tz, last, now, four);
                let mut expected: Vec<_> = older[older.len().saturating_sub(kept)..].to_vec();
                if policy == CatchUp::Latest && !late.is_empty() {
                    expected.clear();
                }
                expected.extend(&late);
                assert_eq!(times, expected, "{cron} in {zone}, {policy:?}");
                assert_eq!(next, schedule.next_after(&expr, tz, now), "{cron}");
            }
        }
    }

    #[test]
    fn catching_up_from_a_position_near_the_epoch_keeps_only_the_newest() {
        let mut schedule = Schedule::new("s", "* * * * * *", "UTC");
        schedule.catchup = CatchUp::All { cap: 2 };
        let (expr, tz) = schedule.validate().unwrap();
        let now = utc("2026-03-29T01:30:00Z");
        let last = DateTime::from_timestamp(0, 0).unwrap();
        let (times, _) = schedule.due_and_next(&expr, tz, last, now, JUST_DUE);
        let second = chrono::Duration::seconds(1);
        assert_eq!(times, vec![now - second * 2, now - second, now]);
    }

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn invalid_fields_are_named() {
        let err = Schedule::new("s", "not cron", "UTC")
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("\"not cron\""), "{err}");
        let err = Schedule::new("s", "* * * * *", "Mars/Olympus")
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("Mars/Olympus"), "{err}");
        let mut s = Schedule::new("s", "* * * * *", "UTC");
        s.catchup = CatchUp::All { cap: 0 };
        assert!(s.validate().unwrap_err().to_string().contains("catchup"));
        let s = Schedule::new("has space", "* * * * *", "UTC");
        assert!(s.validate().unwrap_err().to_string().contains("id"));
    }

    #[test]
    fn catch_up_policies() {
        let mut s = Schedule::new("s", "0 * * * *", "UTC");
        let (expr, tz) = s.validate().unwrap();
        let last = utc("2026-01-01T00:00:00Z");
        let now = utc("2026-01-01T05:30:00Z");
        assert!(
            s.due(&expr, tz, last, now).is_empty(),
            "skip drops missed times"
        );
        s.catchup = CatchUp::Latest;
        assert_eq!(
            s.due(&expr, tz, last, now),
            vec![utc("2026-01-01T05:00:00Z")]
        );
        s.catchup = CatchUp::All { cap: 3 };
        assert_eq!(
            s.due(&expr, tz, last, now),
            vec![
                utc("2026-01-01T03:00:00Z"),
                utc("2026-01-01T04:00:00Z"),
                utc("2026-01-01T05:00:00Z")
            ]
        );
        // A cap over the limit (stored before it) catches up as many as the limit.
        s.catchup = CatchUp::All { cap: 5000 };
        let a_month_later = utc("2026-02-01T00:30:00Z");
        let due = s.due(&expr, tz, last, a_month_later);
        assert_eq!(due.len(), MOST_CAUGHT_UP as usize);
        assert_eq!(due.last(), Some(&utc("2026-02-01T00:00:00Z")));
        s.catchup = CatchUp::Skip;
        let on_time = utc("2026-01-01T05:00:00.200Z");
        assert_eq!(
            s.due(&expr, tz, utc("2026-01-01T04:59:00Z"), on_time),
            vec![utc("2026-01-01T05:00:00Z")]
        );
    }

    #[test]
    fn start_and_end_bound_the_fires() {
        let mut s = Schedule::new("s", "0 * * * *", "UTC");
        s.start = Some(utc("2026-01-01T03:00:00Z"));
        s.end = Some(utc("2026-01-01T04:00:00Z"));
        let (expr, tz) = s.validate().unwrap();
        let first = s.next_after(&expr, tz, utc("2026-01-01T00:00:00Z"));
        assert_eq!(first, Some(utc("2026-01-01T03:00:00Z")));
        assert_eq!(
            s.next_after(&expr, tz, utc("2026-01-01T03:00:00Z")),
            Some(utc("2026-01-01T04:00:00Z"))
        );
        assert_eq!(s.next_after(&expr, tz, utc("2026-01-01T04:00:00Z")), None);
    }
}

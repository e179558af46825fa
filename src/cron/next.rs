//! Fire instants of a cron expression in an IANA time zone, with Vixie cron's rules for
//! daylight-saving transitions:
//! - a fixed-time job whose local time falls in a spring-forward gap fires once, at the
//!   first valid instant after the gap;
//! - a fixed-time job whose local time repeats in a fall-back hour fires once, at the
//!   first occurrence;
//! - a job whose minute or hour field starts with `*` fires at every real matching
//!   instant (none inside a gap, both occurrences in a repeated hour).
//!
//! The expression is matched against local wall-clock times; each match is then mapped
//! to instants by these rules. The `cron` crate's own zone handling is not used.

use chrono::{DateTime, Duration, LocalResult, NaiveDateTime, TimeZone, Timelike, Utc};
use chrono_tz::Tz;

use super::expr::CronExpr;

/// Larger than any daylight-saving shift, so a match this far before `after` in local
/// time cannot map to an instant after it.
const SHIFT_MARGIN: Duration = Duration::hours(3);

/// The first fire instant strictly after `after`.
pub fn next_fire(expr: &CronExpr, tz: Tz, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
    let local_after = after.with_timezone(&tz).naive_local();
    let offset = |t: DateTime<Utc>| t.with_timezone(&tz).naive_local() - t.naive_utc();
    let steady = offset(after - SHIFT_MARGIN) == offset(after)
        && offset(after) == offset(after + SHIFT_MARGIN);
    if steady {
        // No transition near: local order is instant order, the first match wins. A
        // match further out may still meet a transition, so map it with the rules too.
        let mut cursor = local_after;
        loop {
            let n = expr.next_local(cursor)?;
            if let Some(t) = instants(expr, tz, n).into_iter().find(|t| *t > after) {
                return Some(t);
            }
            cursor = n;
        }
    }
    // Near a transition, local order and instant order can differ: look at every match
    // from a margin before `after` and keep the earliest instant after it.
    let mut cursor = local_after - SHIFT_MARGIN;
    let mut best: Option<DateTime<Utc>> = None;
    loop {
        let Some(n) = expr.next_local(cursor) else {
            return best;
        };
        if let Some(b) = best {
            if n > b.with_timezone(&tz).naive_local() + SHIFT_MARGIN {
                return best;
            }
        }
        for t in instants(expr, tz, n) {
            if t > after && best.is_none_or(|b| t < b) {
                best = Some(t);
            }
        }
        cursor = n;
    }
}

/// The next `count` fire instants after `from`.
pub fn preview(expr: &CronExpr, tz: Tz, from: DateTime<Utc>, count: usize) -> Vec<DateTime<Utc>> {
    let mut out = Vec::with_capacity(count);
    let mut at = from;
    while out.len() < count {
        match next_fire(expr, tz, at) {
            Some(t) => {
                out.push(t);
                at = t;
            }
            None => break,
        }
    }
    out
}

/// The instants one local match stands for.
fn instants(expr: &CronExpr, tz: Tz, local: NaiveDateTime) -> Vec<DateTime<Utc>> {
    match tz.from_local_datetime(&local) {
        LocalResult::Single(t) => vec![t.with_timezone(&Utc)],
        LocalResult::Ambiguous(a, b) => {
            let (first, second) = if a <= b { (a, b) } else { (b, a) };
            if expr.is_wildcard() {
                vec![first.with_timezone(&Utc), second.with_timezone(&Utc)]
            } else {
                vec![first.with_timezone(&Utc)]
            }
        }
        LocalResult::None if expr.is_wildcard() => Vec::new(),
        LocalResult::None => gap_end(tz, local).into_iter().collect(),
    }
}

/// The first valid instant after a local time that falls in a gap. Transitions happen
/// on whole minutes, so the first existing whole minute is the gap's end.
fn gap_end(tz: Tz, local: NaiveDateTime) -> Option<DateTime<Utc>> {
    let mut minute = local.with_second(0)?.with_nanosecond(0)?;
    for _ in 0..(48 * 60) {
        minute += Duration::minutes(1);
        if let Some(t) = tz.from_local_datetime(&minute).earliest() {
            return Some(t.with_timezone(&Utc));
        }
    }
    None
}

/// Formats an instant the way every weir command prints one: RFC 3339, UTC, `Z`.
pub fn format_instant(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn fires(expr: &str, tz: &str, from: &str, count: usize) -> Vec<String> {
        let expr = CronExpr::parse(expr).unwrap();
        let tz: Tz = tz.parse().unwrap();
        preview(&expr, tz, utc(from), count)
            .iter()
            .map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string())
            .collect()
    }

    /// (expression, zone, from, expected fire instants in UTC)
    const TABLE: &[(&str, &str, &str, &[&str])] = &[
        // America/New_York: spring forward 2026-03-08 02:00 EST -> 03:00 EDT.
        (
            "30 2 * * *",
            "America/New_York",
            "2026-03-07T12:00:00Z",
            &["2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"],
        ),
        (
            "0,30 2 * * *",
            "America/New_York",
            "2026-03-08T00:00:00Z",
            &["2026-03-08T07:00:00Z", "2026-03-09T06:00:00Z"],
        ),
        (
            "*/30 * * * *",
            "America/New_York",
            "2026-03-08T06:15:00Z",
            &[
                "2026-03-08T06:30:00Z",
                "2026-03-08T07:00:00Z",
                "2026-03-08T07:30:00Z",
            ],
        ),
        // Fall back 2026-11-01 02:00 EDT -> 01:00 EST: 01:30 happens twice.
        (
            "30 1 * * *",
            "America/New_York",
            "2026-11-01T00:00:00Z",
            &["2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"],
        ),
        (
            "30 * * * *",
            "America/New_York",
            "2026-11-01T04:00:00Z",
            &[
                "2026-11-01T04:30:00Z",
                "2026-11-01T05:30:00Z",
                "2026-11-01T06:30:00Z",
                "2026-11-01T07:30:00Z",
            ],
        ),
        (
            "0 9 * * *",
            "America/New_York",
            "2026-03-07T00:00:00Z",
            &["2026-03-07T14:00:00Z", "2026-03-08T13:00:00Z"],
        ),
        // Europe/London: 2026-03-29 01:00 GMT -> 02:00 BST; 2026-10-25 02:00 BST -> 01:00 GMT.
        (
            "30 1 * * *",
            "Europe/London",
            "2026-03-28T12:00:00Z",
            &["2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z"],
        ),
        (
            "30 1 * * *",
            "Europe/London",
            "2026-10-24T12:00:00Z",
            &["2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z"],
        ),
        (
            "*/30 1 * * *",
            "Europe/London",
            "2026-10-24T23:50:00Z",
            &[
                "2026-10-25T00:00:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T01:00:00Z",
                "2026-10-25T01:30:00Z",
                "2026-10-26T01:00:00Z",
            ],
        ),
        // Australia/Lord_Howe: 30-minute shift. 2026-10-04 02:00 -> 02:30 (+10:30 -> +11);
        // 2026-04-05 02:00 -> 01:30 (+11 -> +10:30).
        (
            "15 2 * * *",
            "Australia/Lord_Howe",
            "2026-10-03T12:00:00Z",
            &["2026-10-03T15:30:00Z", "2026-10-04T15:15:00Z"],
        ),
        (
            "*/15 2 * * *",
            "Australia/Lord_Howe",
            "2026-10-03T15:00:00Z",
            &[
                "2026-10-03T15:30:00Z",
                "2026-10-03T15:45:00Z",
                "2026-10-04T15:00:00Z",
            ],
        ),
        (
            "45 1 * * *",
            "Australia/Lord_Howe",
            "2026-04-04T12:00:00Z",
            &["2026-04-04T14:45:00Z", "2026-04-05T15:15:00Z"],
        ),
        (
            "*/30 1 * * *",
            "Australia/Lord_Howe",
            "2026-04-04T14:00:00Z",
            &[
                "2026-04-04T14:30:00Z",
                "2026-04-04T15:00:00Z",
                "2026-04-05T14:30:00Z",
            ],
        ),
        // Asia/Kathmandu: +05:45, no DST.
        (
            "0 9 * * *",
            "Asia/Kathmandu",
            "2026-06-01T00:00:00Z",
            &["2026-06-01T03:15:00Z", "2026-06-02T03:15:00Z"],
        ),
        // Pacific/Chatham: +12:45 / +13:45. Spring forward 2026-09-27 02:45 -> 03:45;
        // fall back 2026-04-05 03:45 -> 02:45.
        (
            "0 3 * * *",
            "Pacific/Chatham",
            "2026-09-26T00:00:00Z",
            &[
                "2026-09-26T14:00:00Z",
                "2026-09-27T13:15:00Z",
                "2026-09-28T13:15:00Z",
            ],
        ),
        (
            "0 3 * * *",
            "Pacific/Chatham",
            "2026-04-04T00:00:00Z",
            &["2026-04-04T13:15:00Z", "2026-04-05T14:15:00Z"],
        ),
        (
            "15 3 * * *",
            "Pacific/Chatham",
            "2026-04-04T12:00:00Z",
            &["2026-04-04T13:30:00Z", "2026-04-05T14:30:00Z"],
        ),
    ];

    #[test]
    fn dst_table() {
        for (expr, tz, from, expected) in TABLE {
            let got = fires(expr, tz, from, expected.len());
            assert_eq!(&got, expected, "{expr} in {tz} from {from}");
        }
    }

    #[test]
    fn seconds_field_every_second() {
        let got = fires("* * * * * *", "UTC", "2026-01-01T00:00:00Z", 3);
        assert_eq!(
            got,
            vec![
                "2026-01-01T00:00:01Z",
                "2026-01-01T00:00:02Z",
                "2026-01-01T00:00:03Z"
            ]
        );
    }
}

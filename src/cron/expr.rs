//! Cron expressions with the usual Unix meaning, on top of the `cron` crate's parser:
//! 5 fields (minute hour day-of-month month day-of-week) or 6 with seconds first.
//! Differences from the crate that this layer irons out: day-of-week numbers follow
//! Unix (0 or 7 = Sunday, 1 = Monday), names and numbers mix in one field (`MON,3` is
//! Monday and Wednesday, `JAN,3` January and March), and when both day fields are
//! restricted a day matching either one matches (Vixie), not both.

use std::str::FromStr;

use chrono::{DateTime, NaiveDateTime, Utc};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cron expression {expr:?}: {reason}")]
pub struct CronError {
    pub expr: String,
    pub reason: String,
}

/// A parsed expression. Matching happens on local wall-clock time (naive date-times).
#[derive(Debug, Clone)]
pub struct CronExpr {
    text: String,
    /// More than one when both day fields are restricted: a time matches if any does.
    schedules: Vec<cron::Schedule>,
    /// Minute or hour field starts with `*`: such a job fires at every real matching
    /// instant, even twice in a repeated hour; others fire once per local time.
    wildcard: bool,
}

impl CronExpr {
    pub fn parse(text: &str) -> Result<Self, CronError> {
        let err = |reason: String| CronError {
            expr: text.to_string(),
            reason,
        };
        let fields: Vec<&str> = text.split_whitespace().collect();
        let mut fields: Vec<String> = match fields.len() {
            5 => std::iter::once("0")
                .chain(fields)
                .map(str::to_string)
                .collect(),
            6 => fields.into_iter().map(str::to_string).collect(),
            n => {
                return Err(err(format!(
                    "expected 5 fields (or 6 with seconds), found {n}"
                )))
            }
        };
        let wildcard = fields[1].starts_with('*') || fields[2].starts_with('*');
        // As in Vixie cron, a day field starting with `*` (`*/2` too) is not a
        // restriction that widens the other: the two are then both required.
        let unrestricted = |f: &str| f.starts_with('*') || f == "?";
        let either_day = !unrestricted(&fields[3]) && !unrestricted(&fields[5]);
        fields[4] = months(&fields[4]).map_err(err)?;
        fields[5] = unix_days_of_week(&fields[5]).map_err(err)?;
        let variants: Vec<Vec<String>> = if either_day {
            let mut by_month_day = fields.clone();
            by_month_day[5] = "*".into();
            let mut by_week_day = fields.clone();
            by_week_day[3] = "*".into();
            vec![by_month_day, by_week_day]
        } else {
            vec![fields]
        };
        let schedules = variants
            .iter()
            .map(|f| cron::Schedule::from_str(&f.join(" ")).map_err(|e| err(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        // A valid expression that never matches (31 February) is useless and surely a
        // mistake: reject it here rather than never firing.
        let probe = NaiveDateTime::default();
        let expr = Self {
            text: text.to_string(),
            schedules,
            wildcard,
        };
        if expr.next_local(probe).is_none() {
            return Err(err("never matches".into()));
        }
        Ok(expr)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn is_wildcard(&self) -> bool {
        self.wildcard
    }

    /// The first local wall-clock time strictly after `after` that matches.
    pub fn next_local(&self, after: NaiveDateTime) -> Option<NaiveDateTime> {
        let after: DateTime<Utc> = DateTime::from_naive_utc_and_offset(after, Utc);
        self.schedules
            .iter()
            .filter_map(|s| s.after(&after).next())
            .min()
            .map(|t| t.naive_utc())
    }
}

const DAY_NAMES: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];
const MONTH_NAMES: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];

/// Rewrites a month field with names (`JAN`) into numbers, so names and numbers mix in
/// lists and ranges (`JAN,3`, `FEB-4`) and mean what they say.
fn months(field: &str) -> Result<String, String> {
    if !field.chars().any(|c| c.is_ascii_alphabetic()) {
        return Ok(field.to_string());
    }
    let mut out = String::with_capacity(field.len());
    let mut word = String::new();
    for c in field.chars().chain(std::iter::once(',')) {
        if c.is_ascii_alphabetic() {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            let lower = word.to_ascii_lowercase();
            let month = MONTH_NAMES
                .iter()
                .position(|m| *m == lower)
                .ok_or_else(|| format!("month {word:?} is not a month name"))?;
            out.push_str(&(month + 1).to_string());
            word.clear();
        }
        out.push(c);
    }
    out.pop();
    Ok(out)
}

/// Rewrites a Unix day-of-week field (0-7, 0 and 7 = Sunday, or names `SUN`-`SAT`, mixed
/// freely) into the crate's numbering (1-7, 1 = Sunday).
fn unix_days_of_week(field: &str) -> Result<String, String> {
    if field == "*" || field == "?" {
        return Ok(field.to_string());
    }
    let mut days = std::collections::BTreeSet::new();
    for part in field.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (
                r,
                s.parse::<u32>()
                    .map_err(|_| format!("bad step in {part:?}"))?,
            ),
            None => (part, 1),
        };
        if step == 0 {
            return Err(format!("step 0 in {part:?}"));
        }
        let (from, to) = match range {
            "*" => (0, 6),
            r => match r.split_once('-') {
                // `FRI-SUN` ends the week: Sunday as the end of a range is day 7.
                Some((a, b)) if b.eq_ignore_ascii_case("sun") => (parse_day(a)?, 7),
                Some((a, b)) => (parse_day(a)?, parse_day(b)?),
                None if part.contains('/') => (parse_day(r)?, 6),
                None => (parse_day(r)?, parse_day(r)?),
            },
        };
        if from > to {
            return Err(format!("day-of-week range {range:?} runs backwards"));
        }
        for d in (from..=to).step_by(step as usize) {
            days.insert(d % 7 + 1);
        }
    }
    Ok(days
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(","))
}

fn parse_day(s: &str) -> Result<u32, String> {
    let lower = s.to_ascii_lowercase();
    if let Some(d) = DAY_NAMES.iter().position(|n| *n == lower) {
        return Ok(d as u32);
    }
    match s.parse::<u32>() {
        Ok(d) if d <= 7 => Ok(d),
        _ => Err(format!("day of week {s:?} is not 0-7 or SUN-SAT")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDate;

    fn at(y: i32, m: u32, d: u32, h: u32, min: u32) -> NaiveDateTime {
        NaiveDate::from_ymd_opt(y, m, d)
            .unwrap()
            .and_hms_opt(h, min, 0)
            .unwrap()
    }

    #[test]
    fn five_and_six_fields() {
        let e = CronExpr::parse("30 2 * * *").unwrap();
        assert_eq!(
            e.next_local(at(2026, 1, 1, 0, 0)),
            Some(at(2026, 1, 1, 2, 30))
        );
        let e = CronExpr::parse("15 30 2 * * *").unwrap();
        let next = e.next_local(at(2026, 1, 1, 0, 0)).unwrap();
        assert_eq!(next, at(2026, 1, 1, 2, 30) + chrono::Duration::seconds(15));
    }

    #[test]
    fn unix_day_numbers() {
        // 2026-01-05 is a Monday.
        let monday = CronExpr::parse("0 9 * * 1").unwrap();
        assert_eq!(
            monday.next_local(at(2026, 1, 3, 0, 0)),
            Some(at(2026, 1, 5, 9, 0))
        );
        let sunday = CronExpr::parse("0 9 * * 0").unwrap();
        assert_eq!(
            sunday.next_local(at(2026, 1, 5, 0, 0)),
            Some(at(2026, 1, 11, 9, 0))
        );
        let seven = CronExpr::parse("0 9 * * 7").unwrap();
        assert_eq!(
            seven.next_local(at(2026, 1, 5, 0, 0)),
            Some(at(2026, 1, 11, 9, 0))
        );
        let weekdays = CronExpr::parse("0 9 * * 1-5").unwrap();
        assert_eq!(
            weekdays.next_local(at(2026, 1, 9, 10, 0)),
            Some(at(2026, 1, 12, 9, 0))
        );
        let names = CronExpr::parse("0 9 * * MON-FRI").unwrap();
        assert_eq!(
            names.next_local(at(2026, 1, 9, 10, 0)),
            Some(at(2026, 1, 12, 9, 0))
        );
    }

    #[test]
    fn both_day_fields_match_either() {
        // The 1st of the month, or any Friday (2026-01-02 is a Friday).
        let e = CronExpr::parse("0 0 1 * 5").unwrap();
        assert_eq!(
            e.next_local(at(2026, 1, 1, 0, 0)),
            Some(at(2026, 1, 2, 0, 0))
        );
        assert_eq!(
            e.next_local(at(2026, 1, 30, 0, 0)),
            Some(at(2026, 2, 1, 0, 0))
        );
    }

    #[test]
    fn a_day_field_starting_with_a_star_is_required_with_the_other() {
        // Odd days of the month that are Fridays (Vixie): 2026-01-09 is one; the 2nd
        // is a Friday on an even day, the 3rd an odd day that is a Saturday.
        let e = CronExpr::parse("0 0 */2 * 5").unwrap();
        assert_eq!(
            e.next_local(at(2026, 1, 1, 0, 0)),
            Some(at(2026, 1, 9, 0, 0))
        );
        let e = CronExpr::parse("0 0 13 * */3").unwrap();
        // The 13th on a Sunday, Wednesday or Saturday: 2026-05-13 is a Wednesday.
        assert_eq!(
            e.next_local(at(2026, 1, 1, 0, 0)),
            Some(at(2026, 5, 13, 0, 0))
        );
    }

    #[test]
    fn names_ranges_steps_and_lists() {
        let e = CronExpr::parse("*/20 8-9 * JAN,MAR *").unwrap();
        assert!(e.is_wildcard());
        assert_eq!(
            e.next_local(at(2026, 1, 1, 9, 40)),
            Some(at(2026, 1, 2, 8, 0))
        );
        assert_eq!(
            e.next_local(at(2026, 1, 31, 10, 0)),
            Some(at(2026, 3, 1, 8, 0))
        );
        assert!(!CronExpr::parse("0 2 * * *").unwrap().is_wildcard());
        assert!(CronExpr::parse("0 * * * *").unwrap().is_wildcard());
    }

    /// Names and numbers mixed in one field mean what they say, in lists and ranges,
    /// in any case. 2026-01-05 is a Monday.
    #[test]
    fn names_and_numbers_mix() {
        let days = |expr: &str| {
            let e = CronExpr::parse(expr).unwrap();
            let mut at_ = at(2026, 1, 4, 23, 0); // Sunday night
            let mut out = Vec::new();
            for _ in 0..4 {
                at_ = e.next_local(at_).unwrap();
                out.push(at_.format("%a").to_string());
            }
            out
        };
        assert_eq!(days("0 9 * * MON,3"), ["Mon", "Wed", "Mon", "Wed"]);
        assert_eq!(days("0 9 * * 1,wed"), ["Mon", "Wed", "Mon", "Wed"]);
        assert_eq!(days("0 9 * * Mon-3"), ["Mon", "Tue", "Wed", "Mon"]);
        assert_eq!(days("0 9 * * 5-SUN"), ["Fri", "Sat", "Sun", "Fri"]);
        assert_eq!(days("0 9 * * sun,SAT"), ["Sat", "Sun", "Sat", "Sun"]);
        assert_eq!(days("0 9 * * MON-FRI/2"), ["Mon", "Wed", "Fri", "Mon"]);
        let months = |expr: &str| {
            let e = CronExpr::parse(expr).unwrap();
            let mut at_ = at(2026, 1, 1, 0, 0);
            let mut out = Vec::new();
            for _ in 0..4 {
                at_ = e.next_local(at_).unwrap();
                out.push(at_.format("%b").to_string());
            }
            out
        };
        assert_eq!(months("0 0 1 JAN,3 *"), ["Mar", "Jan", "Mar", "Jan"]);
        assert_eq!(months("0 0 1 feb-4 *"), ["Feb", "Mar", "Apr", "Feb"]);
        assert_eq!(months("0 0 1 10-DEC *"), ["Oct", "Nov", "Dec", "Oct"]);
        assert_eq!(months("0 0 1 Jan-Dec/6 *"), ["Jul", "Jan", "Jul", "Jan"]);
        assert!(CronExpr::parse("0 0 1 JANUARY *").is_err());
        assert!(CronExpr::parse("0 0 * * FUNDAY").is_err());
    }

    #[test]
    fn invalid_expressions_name_themselves() {
        for bad in [
            "",
            "* * *",
            "61 * * * *",
            "* 25 * * *",
            "0 0 * * 8",
            "0 0 31 2 *",
            "nonsense here x y z",
            "0 0 * * 5-1",
        ] {
            let err = CronExpr::parse(bad).unwrap_err();
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }
}

//! Cron expressions: parsing, and next fire times across time zones with DST.
#![no_main]

use chrono::{TimeZone, Utc};
use libfuzzer_sys::fuzz_target;
use weir::cron::expr::CronExpr;
use weir::cron::next::next_fire;

const ZONES: [chrono_tz::Tz; 4] = [
    chrono_tz::UTC,
    chrono_tz::Europe::London,
    chrono_tz::America::New_York,
    chrono_tz::Australia::Lord_Howe,
];

fuzz_target!(|data: &[u8]| {
    let Some((&seed, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let Ok(expr) = CronExpr::parse(text) else {
        return;
    };
    let zone = ZONES[usize::from(seed) % ZONES.len()];
    // A start somewhere between 1970 and 2100, from the seed.
    let start = Utc
        .timestamp_opt(i64::from(seed) * 16_000_000, 0)
        .single()
        .expect("in range");
    let mut after = start;
    for _ in 0..4 {
        match next_fire(&expr, zone, after) {
            Some(next) => {
                assert!(
                    next > after,
                    "{text:?} in {zone}: {next} is not after {after}"
                );
                after = next;
            }
            None => break,
        }
    }
});

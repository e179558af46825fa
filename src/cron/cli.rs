//! `weir cron …` commands.

use std::io::Write;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;

use super::expr::CronExpr;
use super::next::preview;
use crate::cli::CronCommand;
use crate::error::Error;

/// Formats an instant the way every weir command prints one: RFC 3339, UTC, `Z`.
pub fn format_instant(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

pub fn run(command: CronCommand, out: &mut impl Write) -> Result<(), Error> {
    match command {
        CronCommand::Preview {
            expr,
            tz,
            from,
            count,
        } => {
            let parsed = CronExpr::parse(&expr)?;
            let zone: Tz = tz.parse().map_err(|_| {
                Error::Usage(format!(
                    "unknown time zone {tz:?} (use an IANA name such as Europe/London)"
                ))
            })?;
            let from = match from {
                Some(text) => DateTime::parse_from_rfc3339(&text)
                    .map_err(|e| Error::Usage(format!("--from {text:?} is not RFC 3339: {e}")))?
                    .with_timezone(&Utc),
                None => Utc::now(),
            };
            for t in preview(&parsed, zone, from, count) {
                writeln!(out, "{}", format_instant(t))?;
            }
            Ok(())
        }
    }
}

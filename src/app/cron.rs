//! `weir cron …` commands.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;

use crate::app::cli::{CronAddArgs, CronCommand};
use crate::app::error::Error;
use weir::config::{CatchUpKind, Config, ScheduleConfig};
use weir::cron::expr::CronExpr;
use weir::cron::format_instant;
use weir::cron::next::preview;
use weir::cron::scheduler::{register, set_enabled, shard_of};
use weir::store::prelude::*;

async fn open(config: &Path) -> Result<(Config, Arc<dyn Store>), Error> {
    let config = Config::load(config)?;
    let store = config.store().await?;
    Ok((config, store))
}

fn parse_enum<T: serde::de::DeserializeOwned>(flag: &str, value: &str) -> Result<T, Error> {
    serde_json::from_value(serde_json::Value::String(value.to_string())).map_err(|_| {
        Error::Usage(format!(
            "--{flag} {value:?} is not one of the accepted values"
        ))
    })
}

fn store_error(e: weir::store::StoreError) -> Error {
    Error::Store(e)
}

pub async fn run(command: CronCommand, out: &mut impl Write) -> Result<(), Error> {
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
        }
        CronCommand::Add(args) => {
            let (config, store) = open(&args.config).await?;
            let schedule = schedule_from_args(&args)?;
            let next = register(store.as_ref(), &schedule, config.cron.shards)
                .await
                .map_err(register_error)?;
            let next = next.map(format_instant).unwrap_or_else(|| "-".into());
            writeln!(out, "{} next={next}", schedule.id)?;
        }
        CronCommand::List { config } => {
            let (config, store) = open(&config).await?;
            let list = store.list_schedules().await.map_err(store_error)?;
            for s in list.schedules {
                let next = next_fire(store.as_ref(), &s.id, config.cron.shards).await?;
                writeln!(
                    out,
                    "{}\t{}\t{}\t{}\tnext={}",
                    s.id,
                    s.cron,
                    s.timezone,
                    if s.enabled { "enabled" } else { "paused" },
                    next.map(format_instant).unwrap_or_else(|| "-".into())
                )?;
            }
            // The rest is listed first: one bad record hides none of the others.
            for u in &list.unreadable {
                eprintln!("weir: schedule {:?} not listed: {}", u.id, u.error);
            }
            if !list.unreadable.is_empty() {
                return Err(Error::Unreadable {
                    what: "stored schedules",
                    count: list.unreadable.len(),
                });
            }
        }
        CronCommand::Show { config, id } => {
            let (config, store) = open(&config).await?;
            let schedule = store
                .get_schedule(&id)
                .await
                .map_err(store_error)?
                .ok_or_else(|| Error::NotFound {
                    what: "schedule",
                    id: id.clone(),
                })?;
            let next = next_fire(store.as_ref(), &id, config.cron.shards).await?;
            let mut value = serde_json::to_value(&schedule).map_err(|source| Error::Json {
                what: "the stored schedule",
                source,
            })?;
            value["next_fire"] = next.map(format_instant).into();
            writeln!(
                out,
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            )?;
        }
        CronCommand::Rm { config, id } => {
            let (config, store) = open(&config).await?;
            if !store
                .delete_schedule(&id, shard_of(&id, config.cron.shards))
                .await
                .map_err(store_error)?
            {
                return Err(Error::NotFound {
                    what: "schedule",
                    id,
                });
            }
            writeln!(out, "{id} removed")?;
        }
        CronCommand::Pause { config, id } => toggle(&config, &id, false, out).await?,
        CronCommand::Resume { config, id } => toggle(&config, &id, true, out).await?,
        CronCommand::History { config, id, limit } => {
            let (_, store) = open(&config).await?;
            let list = store.executions(&id, limit).await.map_err(store_error)?;
            for e in &list.executions {
                writeln!(out, "{}", serde_json::to_string(e).unwrap_or_default())?;
            }
            // The rest is listed first: one bad record hides none of the others.
            for u in &list.unreadable {
                eprintln!(
                    "weir: execution of {id:?} at {} ms not listed: {}",
                    u.scheduled_ms, u.error
                );
            }
            if !list.unreadable.is_empty() {
                return Err(Error::Unreadable {
                    what: "stored executions",
                    count: list.unreadable.len(),
                });
            }
        }
    }
    Ok(())
}

fn register_error(e: weir::cron::scheduler::RegisterError) -> Error {
    match e {
        weir::cron::scheduler::RegisterError::Invalid(e) => Error::Schedule(e),
        weir::cron::scheduler::RegisterError::Store(e) => Error::Store(e),
    }
}

async fn toggle(config: &Path, id: &str, enabled: bool, out: &mut impl Write) -> Result<(), Error> {
    let (config, store) = open(config).await?;
    let found = set_enabled(store.as_ref(), id, enabled, config.cron.shards)
        .await
        .map_err(register_error)?;
    if !found {
        return Err(Error::NotFound {
            what: "schedule",
            id: id.to_string(),
        });
    }
    writeln!(out, "{id} {}", if enabled { "resumed" } else { "paused" })?;
    Ok(())
}

async fn next_fire(
    store: &dyn Store,
    id: &str,
    shards: u32,
) -> Result<Option<DateTime<Utc>>, Error> {
    let next = store
        .next_fire(shard_of(id, shards), id)
        .await
        .map_err(store_error)?;
    Ok(next.and_then(|ms| Utc.timestamp_millis_opt(ms).single()))
}

fn schedule_from_args(args: &CronAddArgs) -> Result<weir::cron::Schedule, Error> {
    let entry = ScheduleConfig {
        id: args.id.clone(),
        cron: args.cron.clone(),
        timezone: args.tz.clone(),
        topic: args.topic.clone(),
        workflow: args.workflow.clone(),
        payload: None,
        catchup: parse_enum::<CatchUpKind>("catchup", &args.catchup)?,
        catchup_cap: args.catchup_cap,
        overlap: parse_enum("overlap", &args.overlap)?,
        delivery: parse_enum("delivery", &args.delivery)?,
        start: args.start.clone(),
        end: args.end.clone(),
        enabled: !args.paused,
        tenant: None,
    };
    let mut schedule = entry
        .schedule(0)
        .map_err(|e| Error::Usage(e.to_string().replace("schedule[0].", "")))?;
    if let Some(payload) = &args.payload {
        schedule.payload = serde_json::from_str(payload).map_err(|source| Error::Json {
            what: "--payload is not JSON",
            source,
        })?;
    }
    Ok(schedule)
}

//! Storing a schedule with its next fire time, and pausing or resuming it.

use super::*;

#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error(transparent)]
    Invalid(#[from] ScheduleError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Validates and stores a schedule, with its next fire time after now.
pub async fn register(
    store: &dyn ScheduleStore,
    schedule: &Schedule,
    shards: u32,
) -> Result<Option<DateTime<Utc>>, RegisterError> {
    register_at(store, schedule, shards, Utc::now()).await
}

/// [`register`] with the next fire time computed after `now`.
pub async fn register_at(
    store: &dyn ScheduleStore,
    schedule: &Schedule,
    shards: u32,
    now: DateTime<Utc>,
) -> Result<Option<DateTime<Utc>>, RegisterError> {
    let (expr, tz) = schedule.validate()?;
    store.put_schedule(schedule).await?;
    let next = if schedule.enabled {
        schedule.next_after(&expr, tz, now)
    } else {
        None
    };
    store
        .set_next_fire(
            shard_of(&schedule.id, shards),
            &schedule.id,
            next.map(|t| t.timestamp_millis()),
        )
        .await?;
    Ok(next)
}

/// Registers a schedule a node's config declares, as each node declaring it does at
/// every start. A schedule stored as declared keeps its next fire time, so the times
/// missed while no node ran are caught up by its policy rather than dropped at the
/// restart; one whose definition changed starts again from now. The config may pause a
/// schedule (`enabled = false`) and, enabling it again, resume what it paused; a pause
/// made through `weir cron pause` or the admin API outlasts restarts until resumed
/// there, whatever the config says.
pub async fn declare(
    store: &dyn ScheduleStore,
    schedule: &Schedule,
    shards: u32,
) -> Result<Declared, RegisterError> {
    schedule.validate()?;
    let stored = match store.get_schedule(&schedule.id).await {
        Ok(stored) => stored,
        // A record that does not read back (another version wrote it) is replaced.
        Err(e) if e.kind() == StoreErrorKind::Corrupt => None,
        Err(e) => return Err(e.into()),
    };
    let shard = shard_of(&schedule.id, shards);
    let mut declared = schedule.clone();
    declared.paused_by_config = !declared.enabled;
    let mut kept_paused = false;
    if let Some(stored) = &stored {
        let paused_by_operator = !stored.enabled && !stored.paused_by_config;
        if paused_by_operator {
            kept_paused = declared.enabled;
            declared.enabled = false;
            declared.paused_by_config = false;
        }
        if *stored == declared {
            let next = store.next_fire(shard, &declared.id).await?;
            if next.is_some() || !declared.enabled {
                return Ok(Declared {
                    next: next.and_then(DateTime::from_timestamp_millis),
                    kept_paused,
                });
            }
        }
    }
    let next = register(store, &declared, shards).await?;
    Ok(Declared { next, kept_paused })
}

/// What [`declare`] left in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    /// The schedule's next fire time (none while paused).
    pub next: Option<DateTime<Utc>>,
    /// Whether the store holds the schedule paused though its config enables it.
    pub kept_paused: bool,
}

/// Pauses or resumes a stored schedule. Returns false if there is no such schedule.
pub async fn set_enabled(
    store: &dyn ScheduleStore,
    id: &str,
    enabled: bool,
    shards: u32,
) -> Result<bool, RegisterError> {
    let Some(mut schedule) = store.get_schedule(id).await? else {
        return Ok(false);
    };
    schedule.enabled = enabled;
    // The operator's pause or resume, whatever the config had said.
    schedule.paused_by_config = false;
    register(store, &schedule, shards).await?;
    Ok(true)
}

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
    register(store, &schedule, shards).await?;
    Ok(true)
}

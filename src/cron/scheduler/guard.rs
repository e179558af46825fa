//! The tick guard, for consumers: duplicates and deposed masters' ticks dropped.

use super::*;

/// For tick consumers: drops duplicates (same tick id) and ticks from a deposed master
/// (a fencing token lower than one already seen for the schedule). Its memory is
/// bounded: per schedule it keeps the newest [`TickGuard::DEFAULT_WINDOW`] scheduled
/// times (or the window given), and a tick older than all of a full window counts as a
/// duplicate, since ticks of a schedule arrive in time order but for redeliveries.
#[derive(Debug)]
pub struct TickGuard {
    schedules: HashMap<String, SeenTicks>,
    window: usize,
}

#[derive(Debug, Default)]
struct SeenTicks {
    highest_token: i64,
    times: std::collections::BTreeSet<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickVerdict {
    Accept,
    Duplicate,
    /// From a master that has since lost its lease.
    Stale,
}

impl Default for TickGuard {
    fn default() -> Self {
        Self::with_window(Self::DEFAULT_WINDOW)
    }
}

impl TickGuard {
    pub const DEFAULT_WINDOW: usize = 1024;

    /// Remembers the newest `window` scheduled times per schedule.
    pub fn with_window(window: usize) -> Self {
        Self {
            schedules: HashMap::new(),
            window: window.max(1),
        }
    }

    pub fn check(&mut self, tick: &CronTick) -> TickVerdict {
        let seen = self
            .schedules
            .entry(tick.schedule_id.clone())
            .or_insert_with(|| SeenTicks {
                highest_token: i64::MIN,
                times: Default::default(),
            });
        if tick.fencing_token < seen.highest_token {
            return TickVerdict::Stale;
        }
        seen.highest_token = tick.fencing_token;
        let at = tick.scheduled_time_ms;
        let full = seen.times.len() >= self.window;
        if seen.times.contains(&at) || (full && seen.times.first().is_some_and(|&o| at < o)) {
            return TickVerdict::Duplicate;
        }
        seen.times.insert(at);
        if seen.times.len() > self.window {
            seen.times.pop_first();
        }
        TickVerdict::Accept
    }

    /// Scheduled times remembered, over all schedules.
    pub fn remembered(&self) -> usize {
        self.schedules.values().map(|s| s.times.len()).sum()
    }
}

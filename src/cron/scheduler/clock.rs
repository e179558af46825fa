//! Where the scheduler reads the time: the system clock, or tokio's (paused in tests).

use super::*;

/// Where the scheduler reads the time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> DateTime<Utc>;
}

/// The system's wall clock.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// Wall-clock time that advances with tokio's clock from a fixed start, so schedules can
/// be driven through hours of (paused) test time.
#[derive(Debug)]
pub struct TokioClock {
    start: DateTime<Utc>,
    origin: Instant,
}

impl TokioClock {
    pub fn starting_at(start: DateTime<Utc>) -> Self {
        Self {
            start,
            origin: Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> DateTime<Utc> {
        self.start + chrono::Duration::from_std(self.origin.elapsed()).unwrap_or_default()
    }
}

//! Cron: schedules as data, next fire times with Vixie-cron DST rules.
//!
//! [`expr`] parses expressions, [`next`] maps matches to instants in a time zone,
//! [`schedule`] is the schedule model and its validation, [`scheduler`] the elected
//! per-shard master that fires them as CronTick messages.

pub mod expr;
pub mod next;
pub mod schedule;
pub mod scheduler;
pub mod store;

pub use expr::{CronError, CronExpr};
pub use next::{format_instant, next_fire, preview};
pub use schedule::{CatchUp, Delivery, Overlap, Schedule, ScheduleError, Target, MOST_CAUGHT_UP};
pub use store::{
    CronStore, Execution, ExecutionList, ExecutionStatus, HeldBack, ScheduleList, ScheduleStore,
    UnreadableExecution, UnreadableSchedule,
};

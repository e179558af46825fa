//! Metric names (Prometheus, `weir_*`, base units) and the per-graph counters that feed
//! them. Labels stay low-cardinality: graph, source, reason; never keys or ids.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{counter, histogram, Counter, Histogram};

pub const EVENTS_TOTAL: &str = "weir_events_total";
pub const BOUNDARIES_TOTAL: &str = "weir_boundaries_total";
pub const DUPLICATES_DROPPED_TOTAL: &str = "weir_duplicate_boundaries_total";
pub const FIRES_TOTAL: &str = "weir_fires_total";
pub const FIRE_FAILURES_TOTAL: &str = "weir_fire_failures_total";
pub const FIRE_DURATION_SECONDS: &str = "weir_fire_duration_seconds";
pub const OUTPUTS_TOTAL: &str = "weir_outputs_total";
pub const DEAD_LETTERS_TOTAL: &str = "weir_dead_letters_total";
pub const CHECKPOINTS_TOTAL: &str = "weir_checkpoints_total";
pub const CACHE_SNAPSHOTS_TOTAL: &str = "weir_cache_snapshots_total";
pub const RECOVERY_EVENTS_TOTAL: &str = "weir_recovery_events_total";
pub const CRON_TICKS_TOTAL: &str = "weir_cron_ticks_total";
pub const TICK_LATENESS_SECONDS: &str = "weir_cron_tick_lateness_seconds";

/// Counters of one graph, shared by its accumulators, reactor and supervisor across
/// restarts. Each count is kept both as a plain atomic (for `GraphHandle::stats` and
/// the demo summary) and as a metric.
pub struct GraphStats {
    events: AtomicU64,
    boundaries: AtomicU64,
    fires: AtomicU64,
    outputs: AtomicU64,
    dead_letters: AtomicU64,
    duplicates: AtomicU64,
    fire_failures: AtomicU64,
    events_metric: Counter,
    boundaries_metric: Counter,
    fires_metric: Counter,
    outputs_metric: Counter,
    dead_letters_metric: Counter,
    duplicates_metric: Counter,
    fire_failures_metric: Counter,
    checkpoints_metric: Counter,
    snapshots_metric: Counter,
    fire_duration: Histogram,
}

/// A point-in-time copy of [`GraphStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct StatsSnapshot {
    pub events: u64,
    pub boundaries: u64,
    pub fires: u64,
    pub outputs: u64,
    pub dead_letters: u64,
    pub duplicates: u64,
    pub fire_failures: u64,
}

impl GraphStats {
    pub fn new(graph: &str) -> Self {
        let g = graph.to_string();
        Self {
            events: AtomicU64::new(0),
            boundaries: AtomicU64::new(0),
            fires: AtomicU64::new(0),
            outputs: AtomicU64::new(0),
            dead_letters: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            fire_failures: AtomicU64::new(0),
            events_metric: counter!(EVENTS_TOTAL, "graph" => g.clone()),
            boundaries_metric: counter!(BOUNDARIES_TOTAL, "graph" => g.clone()),
            fires_metric: counter!(FIRES_TOTAL, "graph" => g.clone()),
            outputs_metric: counter!(OUTPUTS_TOTAL, "graph" => g.clone()),
            dead_letters_metric: counter!(DEAD_LETTERS_TOTAL, "graph" => g.clone()),
            duplicates_metric: counter!(DUPLICATES_DROPPED_TOTAL, "graph" => g.clone()),
            fire_failures_metric: counter!(FIRE_FAILURES_TOTAL, "graph" => g.clone()),
            checkpoints_metric: counter!(CHECKPOINTS_TOTAL, "graph" => g.clone()),
            snapshots_metric: counter!(CACHE_SNAPSHOTS_TOTAL, "graph" => g.clone()),
            fire_duration: histogram!(FIRE_DURATION_SECONDS, "graph" => g),
        }
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            events: get(&self.events),
            boundaries: get(&self.boundaries),
            fires: get(&self.fires),
            outputs: get(&self.outputs),
            dead_letters: get(&self.dead_letters),
            duplicates: get(&self.duplicates),
            fire_failures: get(&self.fire_failures),
        }
    }

    pub(crate) fn event_received(&self) {
        self.events.fetch_add(1, Ordering::Relaxed);
        self.events_metric.increment(1);
    }

    pub(crate) fn boundary_cached(&self) {
        self.boundaries.fetch_add(1, Ordering::Relaxed);
        self.boundaries_metric.increment(1);
    }

    pub(crate) fn duplicate_dropped(&self) {
        self.duplicates.fetch_add(1, Ordering::Relaxed);
        self.duplicates_metric.increment(1);
    }

    pub(crate) fn fired(&self, took: Duration) {
        self.fires.fetch_add(1, Ordering::Relaxed);
        self.fires_metric.increment(1);
        self.fire_duration.record(took.as_secs_f64());
    }

    pub(crate) fn fire_failed(&self) {
        self.fire_failures.fetch_add(1, Ordering::Relaxed);
        self.fire_failures_metric.increment(1);
    }

    pub(crate) fn published(&self, outputs: usize) {
        self.outputs.fetch_add(outputs as u64, Ordering::Relaxed);
        self.outputs_metric.increment(outputs as u64);
    }

    pub(crate) fn dead_lettered(&self) {
        self.dead_letters.fetch_add(1, Ordering::Relaxed);
        self.dead_letters_metric.increment(1);
    }

    pub(crate) fn checkpoint_written(&self) {
        self.checkpoints_metric.increment(1);
    }

    pub(crate) fn snapshot_written(&self) {
        self.snapshots_metric.increment(1);
    }
}

pub(crate) fn recovery_recorded(graph: &str, action: &'static str) {
    counter!(RECOVERY_EVENTS_TOTAL, "graph" => graph.to_string(), "action" => action).increment(1);
}

//! What a running graph reports: its reactor's state, each accumulator's health, why
//! it fired, and the counters behind its metrics. Kept apart from the accumulator and
//! the reactor because both report into the same [`GraphStats`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use serde::{Deserialize, Serialize};

use crate::metrics::{
    ACCUMULATOR_HEALTH, BOUNDARIES_TOTAL, CACHE_SNAPSHOTS_TOTAL, CHECKPOINTS_TOTAL,
    DEAD_LETTERS_TOTAL, DUPLICATES_DROPPED_TOTAL, EVENTS_TOTAL, FIRES_TOTAL, FIRE_DURATION_SECONDS,
    FIRE_FAILURES_TOTAL, OUTPUTS_TOTAL, PENDING_BOUNDARIES, QUEUE_DEPTH, REACTOR_STATE,
};

/// Health of one accumulator, as the reactor and the supervisor see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Loading its checkpoint.
    Starting,
    /// Checkpoint loaded, opening the source.
    Connecting,
    /// Source open, processing events.
    Live,
    /// The source failed; the supervisor restarts the accumulator.
    Disconnected,
    /// No source path: push-only, healthy by definition.
    SocketOnly,
}

impl Health {
    pub const ALL: [Self; 5] = [
        Self::Starting,
        Self::Connecting,
        Self::Live,
        Self::Disconnected,
        Self::SocketOnly,
    ];

    /// The name used in JSON and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Connecting => "connecting",
            Self::Live => "live",
            Self::Disconnected => "disconnected",
            Self::SocketOnly => "socket_only",
        }
    }

    pub fn is_healthy(self) -> bool {
        matches!(self, Self::Live | Self::SocketOnly)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReactorState {
    /// Restoring the cache.
    Starting,
    /// Some sources not yet healthy: receiving, not firing.
    Warming,
    Live,
    /// A source disconnected after Live: firing, outputs flagged degraded. Also the
    /// state while the graph waits out an unreachable store or broker.
    Degraded,
    /// The supervisor gave up after repeated failures; the graph is down until it is
    /// retried (after `failed_retry`, or on a restart command).
    Failed,
}

impl ReactorState {
    pub const ALL: [Self; 5] = [
        Self::Starting,
        Self::Warming,
        Self::Live,
        Self::Degraded,
        Self::Failed,
    ];

    /// The name used in JSON and as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Warming => "warming",
            Self::Live => "live",
            Self::Degraded => "degraded",
            Self::Failed => "failed",
        }
    }
}

/// Why a reactor fired, as the `reason` label of `weir_fires_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FireReason {
    /// The criteria were met.
    Criteria = 0,
    /// A ForceFire command.
    Force = 1,
    /// A FireWith command.
    FireWith = 2,
}

impl FireReason {
    pub const ALL: [Self; 3] = [Self::Criteria, Self::Force, Self::FireWith];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Criteria => "criteria",
            Self::Force => "force",
            Self::FireWith => "fire_with",
        }
    }
}

/// Times fires for their duration histogram. A fire takes about a microsecond, and
/// two readings of the system clock cost a few percent of that; the processor's
/// time-stamp counter, read where it runs at a steady rate (quanta checks, and falls
/// back to the monotonic clock where it does not), costs a fraction. quanta calibrates
/// the counter once per process, spinning for up to 200 ms: that runs on a thread of
/// its own, and fires are timed by the standard clock until it is done.
#[derive(Debug)]
pub(crate) struct FireClock;

/// A reading of the [`FireClock`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum FireStart {
    Counter(&'static quanta::Clock, u64),
    Standard(std::time::Instant),
}

static COUNTER: std::sync::OnceLock<quanta::Clock> = std::sync::OnceLock::new();
static CALIBRATION: std::sync::Once = std::sync::Once::new();

impl FireClock {
    pub(crate) fn new() -> Self {
        CALIBRATION.call_once(|| {
            std::thread::spawn(|| COUNTER.get_or_init(quanta::Clock::new));
        });
        Self
    }

    pub(crate) fn start(&self) -> FireStart {
        match COUNTER.get() {
            Some(counter) => FireStart::Counter(counter, counter.raw()),
            None => FireStart::Standard(std::time::Instant::now()),
        }
    }

    pub(crate) fn since(&self, start: FireStart) -> Duration {
        match start {
            FireStart::Counter(counter, raw) => counter.delta(raw, counter.raw()),
            FireStart::Standard(at) => at.elapsed(),
        }
    }
}

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
    /// Indexed by [`FireReason`], in the order of [`FireReason::ALL`].
    fires_metric: [Counter; 3],
    outputs_metric: Counter,
    dead_letters_metric: Counter,
    duplicates_metric: Counter,
    fire_failures_metric: Counter,
    checkpoints_metric: Counter,
    snapshots_metric: Counter,
    fire_duration: Histogram,
    /// Indexed like [`ReactorState::ALL`].
    state_metric: [Gauge; 5],
    /// Per accumulator, in declaration order.
    sources: Vec<SourceMetrics>,
}

struct SourceMetrics {
    /// Indexed like [`Health::ALL`].
    health: [Gauge; 5],
    queue_depth: Gauge,
    pending: AtomicU64,
    pending_metric: Gauge,
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
    /// Boundaries emitted and not yet held in a stored snapshot, over all sources, as
    /// last reported.
    pub pending_boundaries: u64,
}

impl GraphStats {
    /// Counters of a graph whose accumulators are `sources`, in declaration order.
    pub fn new(graph: &str, sources: &[&str]) -> Self {
        let g = graph.to_string();
        let sources = sources
            .iter()
            .map(|source| {
                let s = source.to_string();
                SourceMetrics {
                    health: Health::ALL.map(|h| {
                        gauge!(ACCUMULATOR_HEALTH, "graph" => g.clone(), "source" => s.clone(), "health" => h.as_str())
                    }),
                    queue_depth: gauge!(QUEUE_DEPTH, "graph" => g.clone(), "source" => s.clone()),
                    pending: AtomicU64::new(0),
                    pending_metric: gauge!(PENDING_BOUNDARIES, "graph" => g.clone(), "source" => s),
                }
            })
            .collect();
        let stats = Self {
            events: AtomicU64::new(0),
            boundaries: AtomicU64::new(0),
            fires: AtomicU64::new(0),
            outputs: AtomicU64::new(0),
            dead_letters: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            fire_failures: AtomicU64::new(0),
            events_metric: counter!(EVENTS_TOTAL, "graph" => g.clone()),
            boundaries_metric: counter!(BOUNDARIES_TOTAL, "graph" => g.clone()),
            fires_metric: FireReason::ALL
                .map(|r| counter!(FIRES_TOTAL, "graph" => g.clone(), "reason" => r.as_str())),
            outputs_metric: counter!(OUTPUTS_TOTAL, "graph" => g.clone()),
            dead_letters_metric: counter!(DEAD_LETTERS_TOTAL, "graph" => g.clone()),
            duplicates_metric: counter!(DUPLICATES_DROPPED_TOTAL, "graph" => g.clone()),
            fire_failures_metric: counter!(FIRE_FAILURES_TOTAL, "graph" => g.clone()),
            checkpoints_metric: counter!(CHECKPOINTS_TOTAL, "graph" => g.clone()),
            snapshots_metric: counter!(CACHE_SNAPSHOTS_TOTAL, "graph" => g.clone()),
            fire_duration: histogram!(FIRE_DURATION_SECONDS, "graph" => g.clone()),
            state_metric: ReactorState::ALL
                .map(|st| gauge!(REACTOR_STATE, "graph" => g.clone(), "state" => st.as_str())),
            sources,
        };
        stats.state_changed(ReactorState::Starting);
        for source in 0..stats.sources.len() {
            stats.health_changed(source, Health::Starting);
        }
        stats
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
            pending_boundaries: self.sources.iter().map(|s| get(&s.pending)).sum(),
        }
    }

    /// Counted per burst of events rather than per event: each count is an atomic add.
    pub(crate) fn events_received(&self, events: u64) {
        self.events.fetch_add(events, Ordering::Relaxed);
        self.events_metric.increment(events);
    }

    pub(crate) fn boundaries_cached(&self, boundaries: u64) {
        self.boundaries.fetch_add(boundaries, Ordering::Relaxed);
        self.boundaries_metric.increment(boundaries);
    }

    pub(crate) fn duplicate_dropped(&self) {
        self.duplicates.fetch_add(1, Ordering::Relaxed);
        self.duplicates_metric.increment(1);
    }

    pub(crate) fn fired(&self, took: Duration, reason: FireReason) {
        self.fires.fetch_add(1, Ordering::Relaxed);
        self.fires_metric[reason as usize].increment(1);
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

    pub(crate) fn state_changed(&self, state: ReactorState) {
        for (gauge, s) in self.state_metric.iter().zip(ReactorState::ALL) {
            gauge.set(if s == state { 1.0 } else { 0.0 });
        }
    }

    pub(crate) fn health_changed(&self, source: usize, health: Health) {
        if let Some(metrics) = self.sources.get(source) {
            for (gauge, h) in metrics.health.iter().zip(Health::ALL) {
                gauge.set(if h == health { 1.0 } else { 0.0 });
            }
        }
    }

    pub(crate) fn pending_boundaries(&self, source: usize, pending: usize) {
        if let Some(metrics) = self.sources.get(source) {
            metrics.pending.store(pending as u64, Ordering::Relaxed);
            metrics.pending_metric.set(pending as f64);
        }
    }

    pub(crate) fn queue_depth(&self, source: usize, depth: usize) {
        if let Some(metrics) = self.sources.get(source) {
            metrics.queue_depth.set(depth as f64);
        }
    }
}

//! Metric names (Prometheus, `weir_*`, base units), the per-graph counters and gauges
//! that feed them, and the process's Prometheus recorder. Labels stay low-cardinality:
//! graph, source, reason, state, health, role; never keys or ids.
//!
//! Metric handles bind to the recorder installed when they are created, so
//! [`prometheus`] must run before graphs are spawned. Handles are created once per graph
//! and source: the hot path only touches atomics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::accumulator::Health;
use crate::reactor::{FireReason, ReactorState};

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
/// `at_most_once` ticks given up rather than risk a second emission: their
/// acknowledgement failed, or their master died before recording them.
pub const CRON_TICKS_MISSED_TOTAL: &str = "weir_cron_ticks_missed_total";
/// Gauges: a graph's reactor state and each accumulator's health, as one series per
/// possible value set to 1 for the current one (`state` / `health` label).
pub const REACTOR_STATE: &str = "weir_reactor_state";
pub const ACCUMULATOR_HEALTH: &str = "weir_accumulator_health";
/// Boundaries waiting in a reactor's input cache, per graph and source.
pub const QUEUE_DEPTH: &str = "weir_queue_depth";
/// 1 while this node holds a lease of the role (`graph`, `cron`), else 0.
pub const LEASE_HELD: &str = "weir_lease_held";
/// Times this node gained a lease, per role: a fast-growing count means flapping.
pub const LEASE_ACQUISITIONS_TOTAL: &str = "weir_lease_acquisitions_total";
pub const WORKFLOWS_STARTED_TOTAL: &str = "weir_workflows_started_total";
/// Finished workflow executions, by `status` (completed, failed).
pub const WORKFLOWS_FINISHED_TOTAL: &str = "weir_workflows_finished_total";
/// Task counters, per `executor`.
pub const TASKS_DISPATCHED_TOTAL: &str = "weir_tasks_dispatched_total";
pub const TASKS_STARTED_TOTAL: &str = "weir_tasks_started_total";
pub const TASKS_COMPLETED_TOTAL: &str = "weir_tasks_completed_total";
pub const TASKS_FAILED_TOTAL: &str = "weir_tasks_failed_total";
pub const TASKS_RETRIED_TOTAL: &str = "weir_tasks_retried_total";
pub const TASK_DURATION_SECONDS: &str = "weir_task_duration_seconds";
/// Time from a task becoming ready to a worker starting it.
pub const TASK_WAIT_SECONDS: &str = "weir_task_wait_seconds";
/// Tasks a worker runs now, and how many it may run at once.
pub const WORKER_CAPACITY_IN_USE: &str = "weir_worker_capacity_in_use";
pub const WORKER_CAPACITY: &str = "weir_worker_capacity";

/// Every metric weir exports, for checks that dashboards and alerts query real names.
pub const ALL: &[&str] = &[
    EVENTS_TOTAL,
    BOUNDARIES_TOTAL,
    DUPLICATES_DROPPED_TOTAL,
    FIRES_TOTAL,
    FIRE_FAILURES_TOTAL,
    FIRE_DURATION_SECONDS,
    OUTPUTS_TOTAL,
    DEAD_LETTERS_TOTAL,
    CHECKPOINTS_TOTAL,
    CACHE_SNAPSHOTS_TOTAL,
    RECOVERY_EVENTS_TOTAL,
    CRON_TICKS_TOTAL,
    TICK_LATENESS_SECONDS,
    CRON_TICKS_MISSED_TOTAL,
    REACTOR_STATE,
    ACCUMULATOR_HEALTH,
    QUEUE_DEPTH,
    LEASE_HELD,
    LEASE_ACQUISITIONS_TOTAL,
    WORKFLOWS_STARTED_TOTAL,
    WORKFLOWS_FINISHED_TOTAL,
    TASKS_DISPATCHED_TOTAL,
    TASKS_STARTED_TOTAL,
    TASKS_COMPLETED_TOTAL,
    TASKS_FAILED_TOTAL,
    TASKS_RETRIED_TOTAL,
    TASK_DURATION_SECONDS,
    TASK_WAIT_SECONDS,
    WORKER_CAPACITY_IN_USE,
    WORKER_CAPACITY,
];

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
                    queue_depth: gauge!(QUEUE_DEPTH, "graph" => g.clone(), "source" => s),
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

    pub(crate) fn queue_depth(&self, source: usize, depth: usize) {
        if let Some(metrics) = self.sources.get(source) {
            metrics.queue_depth.set(depth as f64);
        }
    }
}

/// What a lease is for, as the `role` label of the lease metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRole {
    /// One graph's single-active-instance lease.
    Graph,
    /// A cron shard's master lease.
    Cron,
}

impl LeaseRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Graph => "graph",
            Self::Cron => "cron",
        }
    }
}

pub(crate) fn lease_acquired(role: LeaseRole) {
    gauge!(LEASE_HELD, "role" => role.as_str()).increment(1.0);
    counter!(LEASE_ACQUISITIONS_TOTAL, "role" => role.as_str()).increment(1);
}

/// The lease was released, lost, or let lapse.
pub(crate) fn lease_dropped(role: LeaseRole) {
    gauge!(LEASE_HELD, "role" => role.as_str()).decrement(1.0);
}

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("another metrics recorder is already installed in this process")]
    RecorderTaken,
}

impl MetricsError {
    /// The process's recorder is set once; retrying cannot change it.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// Installs the Prometheus recorder for the whole process on the first call, and returns
/// its handle (for rendering `/metrics`) on every call.
pub fn prometheus() -> Result<PrometheusHandle, MetricsError> {
    static HANDLE: Mutex<Option<PrometheusHandle>> = Mutex::new(None);
    let mut installed = HANDLE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|_| MetricsError::RecorderTaken)?;
    *installed = Some(handle.clone());
    Ok(handle)
}

pub(crate) fn recovery_recorded(graph: &str, action: &'static str) {
    counter!(RECOVERY_EVENTS_TOTAL, "graph" => graph.to_string(), "action" => action).increment(1);
}

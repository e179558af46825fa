//! Metric names (Prometheus, `weir_*`, base units) and the process's Prometheus
//! recorder; the per-graph counters and gauges that feed them are in [`crate::stats`].
//! Labels stay low-cardinality: graph, source, reason, state, health, role; never keys
//! or ids.
//!
//! Metric handles bind to the recorder installed when they are created, so
//! [`prometheus`] must run before graphs are spawned. Handles are created once per graph
//! and source: the hot path only touches atomics.

use std::sync::Mutex;

use metrics::{counter, gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

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
/// Boundaries an accumulator emitted that no stored snapshot holds yet, per graph and
/// source: each holds its source position back from the checkpoint. Grows through a
/// store outage, up to the bound at which the source is held.
pub const PENDING_BOUNDARIES: &str = "weir_pending_boundaries";
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
/// Partitions of a `group` (`jobs.<type>`, `graph.<name>`) this node owns now.
pub const PARTITIONS_OWNED: &str = "weir_partitions_owned";
/// Partitions this node took over, per `group`: each one a migration to it.
pub const PARTITION_MIGRATIONS_TOTAL: &str = "weir_partition_migrations_total";
/// From a partition's release by its previous owner to this node processing it.
pub const PARTITION_HANDOVER_SECONDS: &str = "weir_partition_handover_seconds";
/// Times a partition this node serves failed and was served again from the store, per
/// `group`: a count that keeps growing means a partition stuck on something no retry
/// mends (a dead letter the broker refuses for good, a store that keeps refusing).
pub const PARTITION_FAILURES_TOTAL: &str = "weir_partition_failures_total";
/// Keys of a keyed `graph` whose state was removed, idle past its `key_idle_ms`.
pub const KEYED_KEYS_EXPIRED_TOTAL: &str = "weir_keyed_keys_expired_total";
/// Jobs of a `job_type` in this node's memory, in the partitions it owns.
pub const JOBS_OWNED: &str = "weir_jobs_owned";
/// Messages, starts and stops applied to jobs, per `job_type`.
pub const JOB_MESSAGES_APPLIED_TOTAL: &str = "weir_job_messages_applied_total";
pub const JOB_TIMEOUTS_FIRED_TOTAL: &str = "weir_job_timeouts_fired_total";
/// Writes of job state to the store: one per batch of applied messages.
pub const JOB_STORE_WRITES_TOTAL: &str = "weir_job_store_writes_total";

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
    PENDING_BOUNDARIES,
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
    PARTITIONS_OWNED,
    PARTITION_MIGRATIONS_TOTAL,
    PARTITION_HANDOVER_SECONDS,
    PARTITION_FAILURES_TOTAL,
    KEYED_KEYS_EXPIRED_TOTAL,
    JOBS_OWNED,
    JOB_MESSAGES_APPLIED_TOTAL,
    JOB_TIMEOUTS_FIRED_TOTAL,
    JOB_STORE_WRITES_TOTAL,
];

/// A partition of `group` was taken.
pub(crate) fn partition_taken(group: &str) {
    gauge!(PARTITIONS_OWNED, "group" => group.to_string()).increment(1.0);
    counter!(PARTITION_MIGRATIONS_TOTAL, "group" => group.to_string()).increment(1);
}

/// `count` keys of `graph` expired, idle.
pub(crate) fn keys_expired(graph: &str, count: u64) {
    counter!(KEYED_KEYS_EXPIRED_TOTAL, "graph" => graph.to_string()).increment(count);
}

/// A taken partition is processed again, `handover` after its previous owner released it.
pub(crate) fn partition_resumed(group: &str, handover: std::time::Duration) {
    metrics::histogram!(PARTITION_HANDOVER_SECONDS, "group" => group.to_string())
        .record(handover.as_secs_f64());
}

/// A partition of `group` failed and is to be served again from the store.
pub(crate) fn partition_failed(group: &str) {
    counter!(PARTITION_FAILURES_TOTAL, "group" => group.to_string()).increment(1);
}

pub(crate) fn partition_dropped(group: &str) {
    gauge!(PARTITIONS_OWNED, "group" => group.to_string()).decrement(1.0);
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

//! The store: every role a store plays, bundled, and the backends that play them.
//!
//! Each role trait belongs to the module that uses it: [`CheckpointStore`]
//! (accumulators), [`CacheStore`] (reactors), [`RecoveryLog`] (the supervisor and the
//! admin API), [`LeaseStore`] (the lease keeper), [`ScheduleStore`] (the cron scheduler),
//! [`WorkflowStore`] (the workflow state manager and workers), [`JobStore`] (job
//! partitions), [`KeyedStore`] (keyed graphs) and [`MembershipStore`] (partition
//! owners). [`Store`] is their
//! bundle, implemented for every type that plays them all, so a backend implements the
//! roles and nothing else. Backends: [`memory`] (the embedded default) and [`redis`],
//! each one file per role.

pub mod memory;
pub mod redis;

use async_trait::async_trait;

pub use crate::accumulator::checkpoint::{Checkpoint, CheckpointStore};
pub use crate::cron::store::{
    CronStore, Execution, ExecutionList, ExecutionStatus, ScheduleChanges, ScheduleStore,
};
pub use crate::dispatch::store::{DispatchStore, TickOutcomes, WorkflowStore};
pub use crate::jobs::store::{JobRecord, JobStore, PartitionChanges, PartitionSnapshot};
pub use crate::keyed::store::{FireNumbers, KeyedChanges, KeyedStore};
pub use crate::lease::{Fence, Lease, LeaseStore};
pub use crate::ownership::MembershipStore;
pub use crate::reactor::cache::CacheStore;
pub use crate::recovery::{RecoveryAction, RecoveryEvent, RecoveryLog};
pub use crate::store_error::StoreError;

/// What a store is, apart from its roles: its kind, for logs, and whether it answers.
#[async_trait]
pub trait Backend: Send + Sync {
    fn kind(&self) -> &'static str;

    async fn ping(&self) -> Result<(), StoreError>;
}

/// Every role, in one trait object: what a node wires once and hands to each part, each
/// part seeing only its own roles (`Arc<dyn Store>` coerces to `Arc<dyn CheckpointStore>`
/// and the others). Keys are already tenant-qualified by the caller.
pub trait Store:
    Backend
    + CheckpointStore
    + CacheStore
    + RecoveryLog
    + LeaseStore
    + ScheduleStore
    + WorkflowStore
    + CronStore
    + DispatchStore
    + crate::jobs::JobsStore
    + crate::keyed::KeyedGraphStore
{
}

impl<T> Store for T where
    T: Backend
        + CheckpointStore
        + CacheStore
        + RecoveryLog
        + LeaseStore
        + ScheduleStore
        + WorkflowStore
        + CronStore
        + DispatchStore
        + crate::jobs::JobsStore
        + crate::keyed::KeyedGraphStore
{
}

/// Every store trait, for callers that use a concrete backend (a `MemoryStore`, a
/// `RedisStore`) directly: `use weir::store::prelude::*;`.
pub mod prelude {
    pub use super::{
        Backend, CacheStore, CheckpointStore, CronStore, DispatchStore, JobStore, KeyedStore,
        LeaseStore, MembershipStore, RecoveryLog, ScheduleStore, Store, TickOutcomes,
        WorkflowStore,
    };
}

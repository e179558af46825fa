//! The store roles the workflow state manager and workers use.

use std::collections::BTreeSet;

use async_trait::async_trait;

use super::{CronOrigin, RunStatus, WorkflowExecution};
use crate::store_error::StoreError;

/// Where workflow executions, their published tasks and their deadlines are kept.
#[async_trait]
pub trait WorkflowStore: Send + Sync {
    /// Stores a new workflow execution unless one with its id exists: true if created.
    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError>;

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError>;

    /// Replaces the stored execution if its version is still `execution.version - 1`
    /// (compare and set); false if another writer changed it first.
    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError>;

    /// Records that the TaskReadyEvents of `tasks` were published for `execution`, so a
    /// repeated start or result does not dispatch them a second time while they run.
    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError>;

    /// The tasks of `execution` recorded by [`WorkflowStore::mark_tasks_published`].
    async fn published_tasks(&self, execution: &str) -> Result<BTreeSet<String>, StoreError>;

    /// Files an execution of `workflow` (its key, `tenant/name` or `name`) under the time
    /// it must have ended by. Each workflow's deadlines are filed apart, so a node reads
    /// only those of the workflows it declares.
    async fn set_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError>;

    /// `workflow`'s executions whose deadline is at or before `until_ms`, earliest
    /// first, after the first `skip` of them.
    async fn due_workflow_deadlines(
        &self,
        workflow: &str,
        until_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError>;

    async fn clear_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
    ) -> Result<(), StoreError>;
}

/// Told when a workflow execution that a cron tick started has ended, so the tick's own
/// record can take the outcome. Every store of schedules implements it (`cron::store`),
/// which keeps this module free of cron's types.
#[async_trait]
pub trait TickOutcomes: Send + Sync {
    async fn workflow_finished(
        &self,
        origin: &CronOrigin,
        execution_id: &str,
        status: RunStatus,
        at_ms: i64,
    ) -> Result<(), StoreError>;
}

/// What the state manager needs of a store.
pub trait DispatchStore: WorkflowStore + TickOutcomes {}

impl<T: WorkflowStore + TickOutcomes> DispatchStore for T {}

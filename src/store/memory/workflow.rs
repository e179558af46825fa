//! Workflow executions, published tasks and deadlines on the memory store.

use super::*;

#[async_trait]
impl WorkflowStore for MemoryStore {
    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let mut state = self.state()?;
        if state.workflows.contains_key(&execution.id) {
            return Ok(false);
        }
        state
            .workflows
            .insert(execution.id.clone(), execution.clone());
        Ok(true)
    }

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError> {
        Ok(self.state()?.workflows.get(id).cloned())
    }

    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let mut state = self.state()?;
        match state.workflows.get_mut(&execution.id) {
            Some(stored) if stored.version + 1 == execution.version => {
                *stored = execution.clone();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError> {
        self.state()?
            .published
            .entry(execution.to_string())
            .or_default()
            .extend(tasks.iter().cloned());
        Ok(())
    }

    async fn published_tasks(
        &self,
        execution: &str,
    ) -> Result<std::collections::BTreeSet<String>, StoreError> {
        Ok(self
            .state()?
            .published
            .get(execution)
            .cloned()
            .unwrap_or_default())
    }

    async fn set_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        let filed = state.deadlines.entry(workflow.to_string()).or_default();
        if let Some(old) = filed.at.insert(execution.to_string(), deadline_ms) {
            filed.by_time.remove(&(old, execution.to_string()));
        }
        filed.by_time.insert((deadline_ms, execution.to_string()));
        Ok(())
    }

    async fn due_workflow_deadlines(
        &self,
        workflow: &str,
        until_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        let state = self.state()?;
        let Some(filed) = state.deadlines.get(workflow) else {
            return Ok(Vec::new());
        };
        Ok(filed
            .by_time
            .iter()
            .take_while(|(at, _)| *at <= until_ms)
            .skip(skip)
            .take(limit)
            .map(|(_, id)| id.clone())
            .collect())
    }

    async fn clear_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        if let Some(filed) = state.deadlines.get_mut(workflow) {
            if let Some(at) = filed.at.remove(execution) {
                filed.by_time.remove(&(at, execution.to_string()));
            }
            if filed.at.is_empty() {
                state.deadlines.remove(workflow);
            }
        }
        Ok(())
    }
}

/// One workflow's execution deadlines on the memory store.
#[derive(Default)]
pub(super) struct WorkflowDeadlines {
    /// (deadline ms, execution id), earliest first.
    by_time: std::collections::BTreeSet<(i64, String)>,
    /// Each execution's deadline.
    at: HashMap<String, i64>,
}

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
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut state = self.state()?;
        if let Some(old) = state.deadline_of.insert(execution.to_string(), deadline_ms) {
            state.deadlines.remove(&(old, execution.to_string()));
        }
        state.deadlines.insert((deadline_ms, execution.to_string()));
        Ok(())
    }

    async fn due_workflow_deadlines(
        &self,
        until_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        Ok(self
            .state()?
            .deadlines
            .iter()
            .take_while(|(at, _)| *at <= until_ms)
            .skip(skip)
            .take(limit)
            .map(|(_, id)| id.clone())
            .collect())
    }

    async fn clear_workflow_deadline(&self, execution: &str) -> Result<(), StoreError> {
        let mut state = self.state()?;
        if let Some(at) = state.deadline_of.remove(execution) {
            state.deadlines.remove(&(at, execution.to_string()));
        }
        Ok(())
    }
}

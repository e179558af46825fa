//! Workflow executions, published tasks and deadlines on the Redis store.

use super::*;

/// Prefix of the execution hash fields recording a task's ready event as published.
const PUBLISHED_FIELD: &str = "published:";

/// Finished workflow executions are kept this long, then expire.
const FINISHED_WORKFLOW_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

static UPDATE_WORKFLOW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('HGET', KEYS[1], 'v') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'data', ARGV[3])
if tonumber(ARGV[4]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"#,
    )
});

#[async_trait]
impl WorkflowStore for RedisStore {
    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let key = self.key(&["wf", &execution.id]);
        let mut c = self.connection.clone();
        // Two set-if-absent in one transaction: both fields are written, or (the
        // execution exists) neither. Cheaper for Redis than a script doing the same.
        let (created, _): (i64, i64) = redis::pipe()
            .atomic()
            .hset_nx(&key, "data", Self::encode(execution)?)
            .hset_nx(&key, "v", execution.version)
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("create workflow execution", e))?;
        Ok(created == 1)
    }

    async fn get_workflow_execution(
        &self,
        id: &str,
    ) -> Result<Option<WorkflowExecution>, StoreError> {
        let key = self.key(&["wf", id]);
        let mut c = self.connection.clone();
        let raw: Option<String> = c
            .hget(&key, "data")
            .await
            .map_err(|e| store_error("HGET", e))?;
        raw.map(|text| {
            serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                key,
                source: e.into(),
            })
        })
        .transpose()
    }

    async fn update_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let expire = if execution.status == RunStatus::Running {
            0
        } else {
            FINISHED_WORKFLOW_TTL_MS
        };
        let mut c = self.connection.clone();
        let updated: i64 = UPDATE_WORKFLOW
            .key(self.key(&["wf", &execution.id]))
            .arg(execution.version.saturating_sub(1))
            .arg(execution.version)
            .arg(Self::encode(execution)?)
            .arg(expire)
            .invoke_async(&mut c)
            .await
            .map_err(|e| store_error("update workflow execution", e))?;
        Ok(updated == 1)
    }

    async fn mark_tasks_published(
        &self,
        execution: &str,
        tasks: &[String],
    ) -> Result<(), StoreError> {
        if tasks.is_empty() {
            return Ok(());
        }
        // Fields of the execution's own hash: they expire with it, in one command.
        let fields: Vec<(String, u8)> = tasks
            .iter()
            .map(|task| (format!("{PUBLISHED_FIELD}{task}"), 1))
            .collect();
        let mut c = self.connection.clone();
        c.hset_multiple(self.key(&["wf", execution]), &fields)
            .await
            .map_err(|e| store_error("HSET", e))
    }

    async fn published_tasks(&self, execution: &str) -> Result<BTreeSet<String>, StoreError> {
        let mut c = self.connection.clone();
        let fields: Vec<String> = c
            .hkeys(self.key(&["wf", execution]))
            .await
            .map_err(|e| store_error("HKEYS", e))?;
        Ok(fields
            .iter()
            .filter_map(|f| f.strip_prefix(PUBLISHED_FIELD))
            .map(str::to_string)
            .collect())
    }

    async fn set_workflow_deadline(
        &self,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zadd::<_, _, _, ()>(self.key(&["wf-deadlines"]), execution, deadline_ms)
            .await
            .map_err(|e| store_error("ZADD", e))
    }

    async fn due_workflow_deadlines(
        &self,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        let mut c = self.connection.clone();
        c.zrangebyscore_limit(
            self.key(&["wf-deadlines"]),
            "-inf",
            until_ms,
            0,
            limit as isize,
        )
        .await
        .map_err(|e| store_error("ZRANGEBYSCORE", e))
    }

    async fn clear_workflow_deadline(&self, execution: &str) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zrem::<_, _, ()>(self.key(&["wf-deadlines"]), execution)
            .await
            .map_err(|e| store_error("ZREM", e))
    }
}

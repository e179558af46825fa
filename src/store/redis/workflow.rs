//! Workflow executions, published tasks and deadlines on the Redis store.

use std::sync::Arc;

use super::batched::BatchedScript;
use super::*;

/// Prefix of the execution hash fields recording a task's ready event as published.
const PUBLISHED_FIELD: &str = "published:";

/// Finished workflow executions are kept this long, then expire.
const FINISHED_WORKFLOW_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// Compare-and-set updates of workflow executions. KEYS: the executions' hashes; ARGV:
/// per key, the version it must still have, the new version, the new data and the
/// expiry in milliseconds (0 for none). Returns per key 1 if updated, 0 if another writer
/// changed it first. Keys are taken in order, so two updates of one execution in a call
/// meet as they would one after the other.
static UPDATE_WORKFLOWS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local updated = {}
for i = 1, #KEYS do
  local a = (i - 1) * 4
  if redis.call('HGET', KEYS[i], 'v') ~= ARGV[a + 1] then
    updated[i] = 0
  else
    redis.call('HSET', KEYS[i], 'v', ARGV[a + 2], 'data', ARGV[a + 3])
    if tonumber(ARGV[a + 4]) > 0 then
      redis.call('PEXPIRE', KEYS[i], ARGV[a + 4])
    end
    updated[i] = 1
  end
end
return updated
"#,
    )
});

/// Creations of workflow executions. KEYS: the executions' hashes; ARGV: per key, the
/// data and the version. Returns per key 1 if created, 0 if the execution exists (then
/// nothing is written).
static CREATE_WORKFLOWS: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local created = {}
for i = 1, #KEYS do
  if redis.call('HSETNX', KEYS[i], 'data', ARGV[2 * i - 1]) == 1 then
    redis.call('HSET', KEYS[i], 'v', ARGV[2 * i])
    created[i] = 1
  else
    created[i] = 0
  end
end
return created
"#,
    )
});

/// The script calls a store shares between its clones: creations and updates of
/// workflow executions, each several to a call.
pub(super) fn batched_scripts() -> (Arc<BatchedScript>, Arc<BatchedScript>) {
    (
        Arc::new(BatchedScript::new(
            &CREATE_WORKFLOWS,
            "create workflow execution",
        )),
        Arc::new(BatchedScript::new(
            &UPDATE_WORKFLOWS,
            "update workflow execution",
        )),
    )
}

#[async_trait]
impl WorkflowStore for RedisStore {
    async fn create_workflow_execution(
        &self,
        execution: &WorkflowExecution,
    ) -> Result<bool, StoreError> {
        let key = self.key(&["wf", &execution.id]);
        // A lone creation costs Redis a little more as a script than as a transaction of
        // two set-if-absent, but creations made together share one call, which spares
        // both Redis and this client a request each.
        let args = vec![Self::encode(execution)?, execution.version.to_string()];
        self.workflow_creates
            .call(&self.connection, key, args)
            .await
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
        let key = self.key(&["wf", &execution.id]);
        let args = vec![
            execution.version.saturating_sub(1).to_string(),
            execution.version.to_string(),
            Self::encode(execution)?,
            expire.to_string(),
        ];
        self.workflow_updates
            .call(&self.connection, key, args)
            .await
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
        workflow: &str,
        execution: &str,
        deadline_ms: i64,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zadd::<_, _, _, ()>(self.deadlines_key(workflow), execution, deadline_ms)
            .await
            .map_err(|e| store_error("ZADD", e))
    }

    async fn due_workflow_deadlines(
        &self,
        workflow: &str,
        until_ms: i64,
        skip: usize,
        limit: usize,
    ) -> Result<Vec<String>, StoreError> {
        let key = self.deadlines_key(workflow);
        let due = |c: &mut redis::Pipeline| {
            c.cmd("ZRANGEBYSCORE")
                .arg(&key)
                .arg("-inf")
                .arg(until_ms)
                .arg("LIMIT")
                .arg(skip)
                .arg(limit);
        };
        let mut c = self.connection.clone();
        // The shared set of earlier versions is looked at in the same round trip, for
        // due entries only: an earlier version files a deadline before it creates the
        // execution, which a look at one not due yet could find missing. What is due
        // there is filed under each execution's workflow before reading this one's.
        let mut both = redis::pipe();
        both.cmd("ZRANGEBYSCORE")
            .arg(self.key(&[UNFILED_DEADLINES]))
            .arg("-inf")
            .arg(until_ms)
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(UNFILED_PER_CALL);
        due(&mut both);
        let (unfiled, ids): (Vec<(String, f64)>, Vec<String>) = both
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("ZRANGEBYSCORE", e))?;
        if unfiled.is_empty() {
            return Ok(ids);
        }
        if let Err(e) = self.file_unfiled_deadlines(unfiled).await {
            // This workflow's own deadlines are swept all the same; the move is tried
            // again at the next look.
            tracing::warn!(error = %e, "cannot file an earlier version's workflow deadlines; trying again at the next sweep");
            return Ok(ids);
        }
        let mut again = redis::pipe();
        due(&mut again);
        let (ids,): (Vec<String>,) = again
            .query_async(&mut c)
            .await
            .map_err(|e| store_error("ZRANGEBYSCORE", e))?;
        Ok(ids)
    }

    async fn clear_workflow_deadline(
        &self,
        workflow: &str,
        execution: &str,
    ) -> Result<(), StoreError> {
        let mut c = self.connection.clone();
        c.zrem::<_, _, ()>(self.deadlines_key(workflow), execution)
            .await
            .map_err(|e| store_error("ZREM", e))
    }
}

/// The one sorted set of every workflow's deadlines that versions before per-workflow
/// deadlines wrote, read by every node for every workflow.
const UNFILED_DEADLINES: &str = "wf-deadlines";

/// Entries of [`UNFILED_DEADLINES`] filed under their workflow per deadline look.
const UNFILED_PER_CALL: usize = 100;

impl RedisStore {
    /// The sorted set of `workflow`'s deadlines: execution id, scored by deadline ms.
    fn deadlines_key(&self, workflow: &str) -> String {
        self.key(&[UNFILED_DEADLINES, workflow])
    }

    /// Moves due deadlines an earlier version filed in the shared set into their
    /// workflow's: each execution is read for its workflow. One whose execution is gone
    /// is dropped, as a sweep would have; one whose execution cannot be read is dropped
    /// with an error logged, as a sweep does, rather than be read again on every look.
    /// A read that fails for now leaves that one and the rest for the next look.
    async fn file_unfiled_deadlines(&self, unfiled: Vec<(String, f64)>) -> Result<(), StoreError> {
        let shared = self.key(&[UNFILED_DEADLINES]);
        let mut moves = redis::pipe();
        moves.atomic();
        for (id, deadline_ms) in unfiled {
            match self.get_workflow_execution(&id).await {
                Ok(Some(execution)) => {
                    moves
                        .zadd(
                            self.deadlines_key(&execution.workflow),
                            &id,
                            deadline_ms as i64,
                        )
                        .ignore();
                }
                Ok(None) => {}
                Err(e) if e.is_retryable() => {
                    // This one and the rest are left in the shared set, to be filed at a
                    // next look; those read so far are filed now.
                    tracing::warn!(execution = %id, error = %e, "cannot read a workflow execution to file its deadline; trying again at the next sweep");
                    break;
                }
                Err(e) => {
                    tracing::error!(execution = %id, error = %e, "cannot read a workflow execution to file its deadline; the deadline is dropped");
                }
            }
            moves.zrem(&shared, &id).ignore();
        }
        if moves.is_empty() {
            return Ok(());
        }
        let mut c = self.connection.clone();
        moves
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| store_error("MULTI", e))
    }
}

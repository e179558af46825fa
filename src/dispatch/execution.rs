//! One run of a workflow: its context and each task's progress, as kept in the store.
//! Applying a worker's result is a pure step here; the state manager stores the new
//! version with compare-and-set and publishes what became ready.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::router::Router;
use super::workflow::Workflow;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Running,
    Completed,
    Failed,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    /// Waiting for dependencies.
    Pending,
    /// Its TaskReadyEvent is published; no attempt has reported yet.
    Ready,
    /// An attempt failed; the worker retries after the backoff.
    Retrying,
    Completed,
    Failed,
    Skipped,
}

impl TaskStatus {
    fn is_done(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Skipped)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub status: TaskStatus,
    /// Attempts reported so far.
    pub attempts: u32,
    pub executor: String,
    pub error: Option<String>,
    pub duration_ms: Option<i64>,
}

/// The cron firing that started an execution, told when the execution ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CronOrigin {
    pub schedule_id: String,
    pub scheduled_ms: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkflowExecution {
    pub id: String,
    pub workflow: String,
    pub status: RunStatus,
    pub context: Value,
    pub tasks: BTreeMap<String, TaskRecord>,
    pub origin: Option<CronOrigin>,
    pub created_ms: i64,
    pub updated_ms: i64,
    /// Grows by one with every stored change; updates are compare-and-set on it.
    pub version: u64,
}

/// How a task attempt ended, as reported in an `ExecutionResult`.
#[derive(Debug, Clone, PartialEq)]
pub enum Reported {
    Completed(Option<Value>),
    /// Failed, with attempts left: the worker retries.
    Retry(String),
    Failed(String),
    Skipped,
}

impl Reported {
    /// The `status` field of `ExecutionResult`.
    pub fn status(&self) -> &'static str {
        match self {
            Self::Completed(_) => "completed",
            Self::Retry(_) => "retry",
            Self::Failed(_) => "failed",
            Self::Skipped => "skipped",
        }
    }
}

/// What applying a result changed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Applied {
    /// False for a duplicate or stale result: nothing to store.
    pub changed: bool,
    /// Tasks to publish a TaskReadyEvent for.
    pub ready: Vec<String>,
    /// The execution ended with this result.
    pub finished: bool,
}

impl WorkflowExecution {
    /// A new execution with its root tasks ready.
    /// Ends a running execution that outlived its workflow's timeout: every task not
    /// yet done fails with the reason. False if it had ended already.
    pub fn time_out(&mut self, timeout_ms: u128, now_ms: i64) -> bool {
        let reason = format!("the workflow execution timed out after {timeout_ms} ms");
        self.fail_unfinished(&reason, now_ms)
    }

    /// Fails a running execution and every task of it not done yet, each with `reason`.
    /// False if it was no longer running.
    pub fn fail_unfinished(&mut self, reason: &str, now_ms: i64) -> bool {
        if self.status != RunStatus::Running {
            return false;
        }
        for record in self.tasks.values_mut() {
            if !record.status.is_done() {
                record.status = TaskStatus::Failed;
                record.error = Some(reason.to_string());
            }
        }
        self.status = RunStatus::Failed;
        self.updated_ms = now_ms;
        self.version += 1;
        true
    }

    pub fn start(
        id: &str,
        workflow: &Workflow,
        context: Value,
        origin: Option<CronOrigin>,
        router: &Router,
        now_ms: i64,
    ) -> (Self, Vec<String>) {
        let tasks = workflow
            .tasks()
            .iter()
            .map(|t| {
                let record = TaskRecord {
                    status: TaskStatus::Pending,
                    attempts: 0,
                    executor: router.executor(&workflow.namespace(&t.id)).to_string(),
                    error: None,
                    duration_ms: None,
                };
                (t.id.clone(), record)
            })
            .collect();
        let mut execution = Self {
            id: id.to_string(),
            workflow: workflow.key(),
            status: RunStatus::Running,
            context,
            tasks,
            origin,
            created_ms: now_ms,
            updated_ms: now_ms,
            version: 1,
        };
        let ready = execution.advance(workflow);
        (execution, ready)
    }

    fn ids_with(&self, pred: impl Fn(TaskStatus) -> bool) -> BTreeSet<String> {
        self.tasks
            .iter()
            .filter(|(_, t)| pred(t.status))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Marks tasks whose dependencies are all done as ready, and ends the execution when
    /// every task is done. Returns the newly ready tasks.
    fn advance(&mut self, workflow: &Workflow) -> Vec<String> {
        if self.status != RunStatus::Running {
            return Vec::new();
        }
        let done = self.ids_with(|s| matches!(s, TaskStatus::Completed | TaskStatus::Skipped));
        let started = self.ids_with(|s| s != TaskStatus::Pending);
        let ready: Vec<String> = workflow
            .ready(&done, &started)
            .into_iter()
            .map(|t| t.id.clone())
            .collect();
        for id in &ready {
            if let Some(t) = self.tasks.get_mut(id) {
                t.status = TaskStatus::Ready;
            }
        }
        if self.tasks.values().all(|t| t.status.is_done()) {
            self.status = RunStatus::Completed;
        }
        ready
    }

    /// Applies one attempt's result. Duplicates (the task already done) and results of
    /// attempts older than one already reported change nothing.
    pub fn apply(
        &mut self,
        workflow: &Workflow,
        task: &str,
        attempt: u32,
        reported: Reported,
        duration_ms: i64,
        now_ms: i64,
    ) -> Applied {
        let running = self.status == RunStatus::Running;
        let Some(record) = self.tasks.get_mut(task) else {
            return Applied::default();
        };
        if !running || record.status.is_done() || attempt < record.attempts {
            return Applied::default();
        }
        record.attempts = attempt;
        record.duration_ms = Some(duration_ms);
        let mut failed = false;
        match reported {
            Reported::Completed(output) => {
                record.status = TaskStatus::Completed;
                record.error = None;
                merge(&mut self.context, task, output);
            }
            Reported::Skipped => record.status = TaskStatus::Skipped,
            Reported::Retry(error) => {
                record.status = TaskStatus::Retrying;
                record.error = Some(error);
            }
            Reported::Failed(error) => {
                record.status = TaskStatus::Failed;
                record.error = Some(error);
                failed = true;
            }
        }
        self.updated_ms = now_ms;
        self.version += 1;
        if failed {
            self.status = RunStatus::Failed;
            return Applied {
                changed: true,
                ready: Vec::new(),
                finished: true,
            };
        }
        let ready = self.advance(workflow);
        Applied {
            changed: true,
            finished: self.status != RunStatus::Running,
            ready,
        }
    }

    /// Ready tasks no attempt has reported on, optionally only those depending on
    /// `after`: what a crash between storing and publishing may have left unpublished.
    pub fn unreported_ready(&self, workflow: &Workflow, after: Option<&str>) -> Vec<String> {
        if self.status != RunStatus::Running {
            return Vec::new();
        }
        self.tasks
            .iter()
            .filter(|(_, t)| t.status == TaskStatus::Ready && t.attempts == 0)
            .filter(|(id, _)| {
                after.is_none_or(|a| {
                    workflow
                        .task(id)
                        .is_some_and(|spec| spec.depends_on.iter().any(|d| d == a))
                })
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// `{"execution", "status", "tasks": {id: {"status", "attempts", "executor"}}}`.
    pub fn summary(&self) -> Value {
        let tasks: serde_json::Map<String, Value> = self
            .tasks
            .iter()
            .map(|(id, t)| {
                let mut entry = serde_json::json!({
                    "status": t.status,
                    "attempts": t.attempts,
                    "executor": t.executor,
                });
                if let Some(e) = &t.error {
                    entry["error"] = Value::String(e.clone());
                }
                (id.clone(), entry)
            })
            .collect();
        serde_json::json!({
            "execution": self.id,
            "workflow": self.workflow,
            "status": self.status.as_str(),
            "tasks": tasks,
        })
    }
}

/// A completed task's output joins the context: an object's keys are merged in, any
/// other value is stored under the task's id.
fn merge(context: &mut Value, task: &str, output: Option<Value>) {
    let Some(output) = output else { return };
    if !context.is_object() {
        *context = Value::Object(Default::default());
    }
    let Some(target) = context.as_object_mut() else {
        return;
    };
    match output {
        Value::Null => {}
        Value::Object(fields) => target.extend(fields),
        other => {
            target.insert(task.to_string(), other);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::{Route, TaskSpec};
    use serde_json::json;

    fn diamond() -> Workflow {
        Workflow::new(
            "diamond",
            vec![
                TaskSpec::new("start", "builtin::echo"),
                TaskSpec::new("left", "builtin::echo").after(["start"]),
                TaskSpec::new("right", "builtin::echo").after(["start"]),
                TaskSpec::new("join", "builtin::echo").after(["left", "right"]),
            ],
        )
        .unwrap()
    }

    fn router() -> Router {
        Router::new(vec![Route::new("**::left", "lefty").unwrap()], "default").unwrap()
    }

    #[test]
    fn a_diamond_fans_out_and_in() {
        let w = diamond();
        let (mut e, ready) = WorkflowExecution::start("x", &w, json!({"n": 1}), None, &router(), 0);
        assert_eq!(ready, vec!["start"]);
        assert_eq!(e.tasks["left"].executor, "lefty");
        assert_eq!(e.tasks["join"].executor, "default");
        let a = e.apply(
            &w,
            "start",
            1,
            Reported::Completed(Some(json!({"s": 2}))),
            5,
            1,
        );
        assert_eq!(a.ready, vec!["left", "right"]);
        assert_eq!(e.context, json!({"n": 1, "s": 2}));
        let a = e.apply(&w, "left", 1, Reported::Completed(Some(json!(7))), 5, 2);
        assert!(a.ready.is_empty(), "join waits for right");
        assert_eq!(e.context["left"], json!(7));
        let a = e.apply(&w, "right", 1, Reported::Skipped, 5, 3);
        assert_eq!(a.ready, vec!["join"]);
        let a = e.apply(&w, "join", 1, Reported::Completed(None), 5, 4);
        assert!(a.finished);
        assert_eq!(e.status, RunStatus::Completed);
        assert_eq!(e.summary()["status"], "completed");
        assert_eq!(e.summary()["tasks"]["join"]["attempts"], 1);
    }

    #[test]
    fn retries_then_failure_fail_the_execution() {
        let w = diamond();
        let (mut e, _) = WorkflowExecution::start("x", &w, json!({}), None, &router(), 0);
        let a = e.apply(&w, "start", 1, Reported::Retry("boom".into()), 5, 1);
        assert!(a.changed && !a.finished);
        assert_eq!(e.tasks["start"].status, TaskStatus::Retrying);
        let a = e.apply(&w, "start", 2, Reported::Failed("boom".into()), 5, 2);
        assert!(a.finished);
        assert_eq!(e.status, RunStatus::Failed);
        assert_eq!(e.summary()["tasks"]["start"]["attempts"], 2);
        assert_eq!(e.summary()["tasks"]["left"]["status"], "pending");
    }

    #[test]
    fn duplicates_and_stale_attempts_change_nothing() {
        let w = diamond();
        let (mut e, _) = WorkflowExecution::start("x", &w, json!({}), None, &router(), 0);
        e.apply(&w, "start", 2, Reported::Retry("x".into()), 5, 1);
        let before = e.clone();
        assert!(
            !e.apply(&w, "start", 1, Reported::Retry("old".into()), 5, 2)
                .changed
        );
        assert!(!e.apply(&w, "nope", 1, Reported::Skipped, 5, 2).changed);
        assert_eq!(e, before);
        e.apply(&w, "start", 3, Reported::Completed(None), 5, 3);
        let v = e.version;
        assert!(
            !e.apply(&w, "start", 3, Reported::Completed(None), 5, 4)
                .changed
        );
        assert_eq!(e.version, v);
        assert_eq!(e.unreported_ready(&w, Some("start")), vec!["left", "right"]);
        assert!(e.unreported_ready(&w, Some("left")).is_empty());
    }
}

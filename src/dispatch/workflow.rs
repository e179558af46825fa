//! Workflow declarations: a DAG of tasks, each with a handler, dependencies, an attempt
//! cap, a timeout and a retry backoff. Validated once when declared.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One task of a workflow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub id: String,
    /// Registered handler name, e.g. `builtin::echo`.
    pub handler: String,
    pub depends_on: Vec<String>,
    pub max_attempts: u32,
    pub timeout: Duration,
    /// Delay before the first retry; doubles with each further attempt.
    pub backoff: Duration,
}

impl TaskSpec {
    pub fn new(id: impl Into<String>, handler: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            handler: handler.into(),
            depends_on: Vec::new(),
            max_attempts: 3,
            timeout: Duration::from_secs(30),
            backoff: Duration::from_secs(1),
        }
    }

    pub fn after<I, S>(mut self, dependencies: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.depends_on
            .extend(dependencies.into_iter().map(Into::into));
        self
    }

    /// Delay before attempt `attempt` (2 = the first retry): backoff × 2^(attempt − 2).
    pub fn retry_delay(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(2).min(16);
        self.backoff.saturating_mul(1 << exponent)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkflowError {
    #[error("workflow name {0:?} must be letters, digits, '-' or '_'")]
    BadName(String),
    #[error("workflow {workflow} has no tasks")]
    Empty { workflow: String },
    #[error("workflow {workflow}: task id {task:?} is declared twice or is not letters, digits, '-' or '_'")]
    BadTask { workflow: String, task: String },
    #[error("workflow {workflow}: task {task} depends on unknown task {dependency}")]
    UnknownDependency {
        workflow: String,
        task: String,
        dependency: String,
    },
    #[error("workflow {workflow}: dependency cycle through {}", tasks.join(", "))]
    Cycle {
        workflow: String,
        tasks: Vec<String>,
    },
    #[error("workflow {workflow}: task {task} needs max_attempts of at least 1")]
    NoAttempts { workflow: String, task: String },
}

impl WorkflowError {
    /// A bad declaration stays bad.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// A validated workflow: tasks in a dependency order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workflow {
    pub name: String,
    pub tenant: Option<String>,
    pub package: String,
    tasks: Vec<TaskSpec>,
    /// An execution still running this long after its start fails.
    #[serde(default, with = "optional_millis")]
    pub timeout: Option<std::time::Duration>,
}

/// An optional duration as whole milliseconds.
mod optional_millis {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&(d.as_millis() as u64)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

impl Workflow {
    pub fn new(name: &str, tasks: Vec<TaskSpec>) -> Result<Self, WorkflowError> {
        let workflow = name.to_string();
        if !valid_id(name) {
            return Err(WorkflowError::BadName(workflow));
        }
        if tasks.is_empty() {
            return Err(WorkflowError::Empty { workflow });
        }
        let mut ids = BTreeSet::new();
        for t in &tasks {
            if !valid_id(&t.id) || !ids.insert(t.id.clone()) {
                return Err(WorkflowError::BadTask {
                    workflow,
                    task: t.id.clone(),
                });
            }
            if t.max_attempts == 0 {
                return Err(WorkflowError::NoAttempts {
                    workflow,
                    task: t.id.clone(),
                });
            }
        }
        for t in &tasks {
            if let Some(d) = t.depends_on.iter().find(|d| !ids.contains(*d)) {
                return Err(WorkflowError::UnknownDependency {
                    workflow,
                    task: t.id.clone(),
                    dependency: d.clone(),
                });
            }
        }
        // Kahn's algorithm: what is left over sits on or behind a cycle.
        let mut remaining: BTreeMap<&str, BTreeSet<&str>> = tasks
            .iter()
            .map(|t| {
                (
                    t.id.as_str(),
                    t.depends_on.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        let mut order: Vec<String> = Vec::with_capacity(tasks.len());
        loop {
            let ready: Vec<&str> = remaining
                .iter()
                .filter(|(_, deps)| deps.is_empty())
                .map(|(id, _)| *id)
                .collect();
            if ready.is_empty() {
                break;
            }
            for id in ready {
                remaining.remove(id);
                for deps in remaining.values_mut() {
                    deps.remove(id);
                }
                order.push(id.to_string());
            }
        }
        if !remaining.is_empty() {
            return Err(WorkflowError::Cycle {
                workflow,
                tasks: remaining.keys().map(|k| k.to_string()).collect(),
            });
        }
        let mut by_id: BTreeMap<String, TaskSpec> =
            tasks.into_iter().map(|t| (t.id.clone(), t)).collect();
        let tasks = order.iter().filter_map(|id| by_id.remove(id)).collect();
        Ok(Self {
            name: workflow,
            tenant: None,
            package: "default".into(),
            tasks,
            timeout: None,
        })
    }

    /// Fails an execution that is still running `timeout` after its start.
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Tasks in a dependency order (every task after all it depends on).
    pub fn tasks(&self) -> &[TaskSpec] {
        &self.tasks
    }

    pub fn task(&self, id: &str) -> Option<&TaskSpec> {
        self.tasks.iter().find(|t| t.id == id)
    }

    /// The workflow's identity in the store, in metrics and in the admin API:
    /// `tenant/name`, or `name`.
    pub fn key(&self) -> String {
        crate::tenant::key(self.tenant.as_deref(), &self.name)
    }

    /// A topic as this workflow's tenant sees it (its executor, results and start
    /// topics).
    pub fn topic(&self, topic: &str) -> String {
        crate::tenant::topic(self.tenant.as_deref(), topic)
    }

    /// `tenant::package::workflow::task`, the key routing rules match on.
    pub fn namespace(&self, task: &str) -> String {
        format!(
            "{}::{}::{}::{task}",
            self.tenant.as_deref().unwrap_or(crate::tenant::PUBLIC),
            self.package,
            self.name
        )
    }

    /// Tasks whose dependencies are all in `completed` and that are not themselves
    /// completed or in `started`: what becomes ready next.
    pub fn ready<'a>(
        &'a self,
        completed: &BTreeSet<String>,
        started: &BTreeSet<String>,
    ) -> Vec<&'a TaskSpec> {
        self.tasks
            .iter()
            .filter(|t| !completed.contains(&t.id) && !started.contains(&t.id))
            .filter(|t| t.depends_on.iter().all(|d| completed.contains(d)))
            .collect()
    }
}

/// A task namespace as [`Workflow::namespace`] writes it,
/// `tenant::package::workflow::task`, back to (tenant, workflow, task).
pub fn split_namespace(namespace: &str) -> Option<(Option<&str>, &str, &str)> {
    let parts: Vec<&str> = namespace.split("::").collect();
    match parts.as_slice() {
        [tenant, _, workflow, task] if !workflow.is_empty() && !task.is_empty() => {
            Some((crate::tenant::of_namespace_segment(tenant), workflow, task))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diamond() -> Workflow {
        Workflow::new(
            "diamond",
            vec![
                TaskSpec::new("join", "builtin::echo").after(["left", "right"]),
                TaskSpec::new("left", "builtin::echo").after(["start"]),
                TaskSpec::new("right", "builtin::echo").after(["start"]),
                TaskSpec::new("start", "builtin::echo"),
            ],
        )
        .unwrap()
    }

    #[test]
    fn tasks_come_in_dependency_order() {
        let w = diamond();
        let order: Vec<&str> = w.tasks().iter().map(|t| t.id.as_str()).collect();
        assert_eq!(order.first(), Some(&"start"));
        assert_eq!(order.last(), Some(&"join"));
    }

    #[test]
    fn fan_out_then_fan_in() {
        let w = diamond();
        let none = BTreeSet::new();
        let ids = |v: Vec<&TaskSpec>| v.iter().map(|t| t.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(w.ready(&none, &none)), vec!["start"]);
        let done: BTreeSet<String> = ["start".to_string()].into();
        assert_eq!(ids(w.ready(&done, &none)), vec!["left", "right"]);
        let started: BTreeSet<String> = ["left".to_string()].into();
        assert_eq!(ids(w.ready(&done, &started)), vec!["right"]);
        let done: BTreeSet<String> = ["start", "left"].map(String::from).into();
        assert_eq!(
            ids(w.ready(&done, &["right".to_string()].into())),
            Vec::<String>::new()
        );
        let done: BTreeSet<String> = ["start", "left", "right"].map(String::from).into();
        assert_eq!(ids(w.ready(&done, &none)), vec!["join"]);
    }

    #[test]
    fn namespaces_and_backoff() {
        let w = diamond().with_tenant("acme");
        assert_eq!(w.namespace("left"), "acme::default::diamond::left");
        assert_eq!(diamond().namespace("x"), "public::default::diamond::x");
        let t = TaskSpec {
            backoff: Duration::from_millis(100),
            ..TaskSpec::new("t", "h")
        };
        assert_eq!(t.retry_delay(2), Duration::from_millis(100));
        assert_eq!(t.retry_delay(3), Duration::from_millis(200));
        assert_eq!(t.retry_delay(4), Duration::from_millis(400));
    }

    #[test]
    fn bad_declarations_are_errors() {
        let err = Workflow::new(
            "w",
            vec![
                TaskSpec::new("a", "h").after(["b"]),
                TaskSpec::new("b", "h").after(["a"]),
            ],
        )
        .unwrap_err();
        assert!(matches!(err, WorkflowError::Cycle { .. }), "{err}");
        let err = Workflow::new("w", vec![TaskSpec::new("a", "h").after(["nope"])]).unwrap_err();
        assert!(err.to_string().contains("unknown task nope"), "{err}");
        let err =
            Workflow::new("w", vec![TaskSpec::new("a", "h"), TaskSpec::new("a", "h")]).unwrap_err();
        assert!(matches!(err, WorkflowError::BadTask { .. }));
        assert!(matches!(
            Workflow::new("w", vec![]),
            Err(WorkflowError::Empty { .. })
        ));
        assert!(matches!(
            Workflow::new("bad name", vec![TaskSpec::new("a", "h")]),
            Err(WorkflowError::BadName(_))
        ));
        let zero = TaskSpec {
            max_attempts: 0,
            ..TaskSpec::new("a", "h")
        };
        assert!(matches!(
            Workflow::new("w", vec![zero]),
            Err(WorkflowError::NoAttempts { .. })
        ));
    }

    #[test]
    fn namespaces_name_workflow_and_task() {
        assert_eq!(
            split_namespace("public::default::etl::load"),
            Some((None, "etl", "load"))
        );
        assert_eq!(
            split_namespace("acme::default::etl::load"),
            Some((Some("acme"), "etl", "load"))
        );
        assert_eq!(split_namespace("etl::load"), None);
        assert_eq!(split_namespace("a::b::::t"), None);
    }
}

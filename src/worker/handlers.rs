//! Task handlers and the built-ins: `builtin::echo` (returns the context),
//! `builtin::sleep` (waits `sleep_ms` from the context), `builtin::fail` (fails the first
//! `fail_times` attempts, then succeeds) and `builtin::publish` (publishes the context
//! to the context's `topic`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;

use crate::transport::{Outbound, Sink};

/// What a handler gets: the execution's context (loaded from the store), the task's
/// namespace and the attempt number (1-based).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskContext {
    pub execution_id: String,
    pub namespace: String,
    pub attempt: u32,
    pub context: Value,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskOutcome {
    /// Done; the value is merged into the execution's context.
    Completed(Value),
    /// Failed; retried while attempts remain.
    Failed(String),
    /// Nothing to do for this execution.
    Skipped,
}

/// A task's code. A worker polls its running handlers together on one task, so a
/// handler must not block the thread: CPU-heavy or blocking work belongs in
/// `tokio::task::spawn_blocking`.
#[async_trait]
pub trait TaskHandler: Send + Sync {
    async fn run(&self, task: TaskContext) -> TaskOutcome;
}

/// Handlers by name. Starts with the built-ins.
#[derive(Clone)]
pub struct HandlerRegistry {
    handlers: BTreeMap<String, Arc<dyn TaskHandler>>,
}

impl HandlerRegistry {
    /// The built-ins; `builtin::publish` publishes through `sink`.
    pub fn with_builtins(sink: Arc<dyn Sink>) -> Self {
        let mut registry = Self {
            handlers: BTreeMap::new(),
        };
        registry.register("builtin::echo", Arc::new(Echo));
        registry.register("builtin::sleep", Arc::new(Sleep));
        registry.register("builtin::fail", Arc::new(Fail));
        registry.register("builtin::publish", Arc::new(Publish { sink }));
        registry
    }

    pub fn register(&mut self, name: impl Into<String>, handler: Arc<dyn TaskHandler>) {
        self.handlers.insert(name.into(), handler);
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn TaskHandler>> {
        self.handlers.get(name).cloned()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.handlers.keys().map(String::as_str)
    }
}

struct Echo;

#[async_trait]
impl TaskHandler for Echo {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        TaskOutcome::Completed(task.context)
    }
}

struct Sleep;

#[async_trait]
impl TaskHandler for Sleep {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        match task.context.get("sleep_ms").map(Value::as_u64) {
            None => TaskOutcome::Completed(Value::Null),
            Some(Some(ms)) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                TaskOutcome::Completed(Value::Null)
            }
            Some(None) => TaskOutcome::Failed("sleep_ms must be a non-negative integer".into()),
        }
    }
}

struct Fail;

#[async_trait]
impl TaskHandler for Fail {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        let times = task
            .context
            .get("fail_times")
            .and_then(Value::as_u64)
            .unwrap_or(u64::MAX);
        if u64::from(task.attempt) <= times {
            TaskOutcome::Failed(format!(
                "failing attempt {} of the first {times}",
                task.attempt
            ))
        } else {
            TaskOutcome::Completed(Value::Null)
        }
    }
}

struct Publish {
    sink: Arc<dyn Sink>,
}

#[async_trait]
impl TaskHandler for Publish {
    async fn run(&self, task: TaskContext) -> TaskOutcome {
        let Some(topic) = task.context.get("topic").and_then(Value::as_str) else {
            return TaskOutcome::Failed("the context names no topic".into());
        };
        let message = Outbound::new(topic, crate::codec::json::encode(&task.context))
            .key(task.execution_id.clone().into_bytes())
            .header(crate::wire::NAMESPACE_HEADER, task.namespace.clone());
        match self.sink.publish(message).await {
            Ok(_) => TaskOutcome::Completed(Value::Null),
            Err(e) => TaskOutcome::Failed(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::memory::MemoryBroker;
    use serde_json::json;

    fn task(attempt: u32, context: Value) -> TaskContext {
        TaskContext {
            execution_id: "e1".into(),
            namespace: "public::default::w::t".into(),
            attempt,
            context,
        }
    }

    fn registry(broker: &MemoryBroker) -> HandlerRegistry {
        HandlerRegistry::with_builtins(Arc::new(broker.clone()))
    }

    #[tokio::test]
    async fn echo_returns_the_context() {
        let r = registry(&MemoryBroker::default());
        let out = r
            .get("builtin::echo")
            .unwrap()
            .run(task(1, json!({"a": 1})))
            .await;
        assert_eq!(out, TaskOutcome::Completed(json!({"a": 1})));
    }

    #[tokio::test(start_paused = true)]
    async fn sleep_waits_the_given_time() {
        let r = registry(&MemoryBroker::default());
        let started = tokio::time::Instant::now();
        let out = r
            .get("builtin::sleep")
            .unwrap()
            .run(task(1, json!({"sleep_ms": 250})))
            .await;
        assert_eq!(out, TaskOutcome::Completed(Value::Null));
        assert_eq!(started.elapsed(), Duration::from_millis(250));
        let bad = r
            .get("builtin::sleep")
            .unwrap()
            .run(task(1, json!({"sleep_ms": "soon"})))
            .await;
        assert!(matches!(bad, TaskOutcome::Failed(_)));
    }

    #[tokio::test]
    async fn fail_fails_the_first_attempts() {
        let r = registry(&MemoryBroker::default());
        let h = r.get("builtin::fail").unwrap();
        let ctx = json!({"fail_times": 2});
        assert!(matches!(
            h.run(task(1, ctx.clone())).await,
            TaskOutcome::Failed(_)
        ));
        assert!(matches!(
            h.run(task(2, ctx.clone())).await,
            TaskOutcome::Failed(_)
        ));
        assert_eq!(
            h.run(task(3, ctx)).await,
            TaskOutcome::Completed(Value::Null)
        );
    }

    #[tokio::test]
    async fn publish_sends_the_context() {
        let broker = MemoryBroker::default();
        let r = registry(&broker);
        let out = r
            .get("builtin::publish")
            .unwrap()
            .run(task(1, json!({"topic": "out", "x": 1})))
            .await;
        assert_eq!(out, TaskOutcome::Completed(Value::Null));
        let messages = broker.messages("out");
        assert_eq!(messages.len(), 1);
        assert_eq!(
            messages[0].header("weir-namespace"),
            Some("public::default::w::t")
        );
        let missing = r
            .get("builtin::publish")
            .unwrap()
            .run(task(1, json!({})))
            .await;
        assert!(matches!(missing, TaskOutcome::Failed(_)));
        assert!(r.get("nope").is_none());
        assert_eq!(r.names().count(), 4);
    }
}

//! Built-in accumulator kinds.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use serde_json::Value;

use super::{Accumulator, AccumulatorError, Event};
use crate::transport::{now_ms, Message, Position, Source, SourceFactory, TransportError};

/// Emits every event unchanged.
pub struct Passthrough;

impl Accumulator for Passthrough {
    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        Ok(Some(event.value))
    }
}

/// Emits events that differ from the previous one (used for polling). The previous one
/// is its checkpointed state, so a restart does not emit an unchanged value again.
#[derive(Default)]
pub struct Deduplicating {
    last: Option<Value>,
}

impl Accumulator for Deduplicating {
    /// The state is `null` before any event, else `[last]`: a last value of `null` is
    /// told apart from none.
    fn init(&mut self, state: Option<Value>) -> Result<(), AccumulatorError> {
        self.last = match state {
            None | Some(Value::Null) => None,
            Some(Value::Array(mut last)) if last.len() == 1 => last.pop(),
            Some(other) => {
                return Err(AccumulatorError::BadCheckpoint(format!(
                    "deduplicating state must be null or a one-element array, found {other}"
                )))
            }
        };
        Ok(())
    }

    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        if self.last.as_ref() == Some(&event.value) {
            return Ok(None);
        }
        self.last = Some(event.value.clone());
        Ok(Some(event.value))
    }

    fn checkpoint(&self) -> Option<Value> {
        Some(match &self.last {
            None => Value::Null,
            Some(last) => Value::Array(vec![last.clone()]),
        })
    }
}

/// Emits held events as one JSON array on size or on interval. The partial batch is
/// its checkpointed state, so no held event is lost in a restart.
pub struct Batch {
    size: usize,
    interval: Duration,
    held: Vec<Value>,
}

impl Batch {
    pub fn new(size: usize, interval: Duration) -> Self {
        Self {
            size: size.max(1),
            interval,
            held: Vec::new(),
        }
    }
}

impl Accumulator for Batch {
    fn init(&mut self, state: Option<Value>) -> Result<(), AccumulatorError> {
        self.held = match state {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(held)) => held,
            Some(other) => {
                return Err(AccumulatorError::BadCheckpoint(format!(
                    "batch state must be an array, found {other}"
                )))
            }
        };
        Ok(())
    }

    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        self.held.push(event.value);
        if self.held.len() >= self.size {
            return Ok(self.flush());
        }
        Ok(None)
    }

    fn flush_interval(&self) -> Option<Duration> {
        (!self.interval.is_zero()).then_some(self.interval)
    }

    fn flush(&mut self) -> Option<Value> {
        if self.held.is_empty() {
            return None;
        }
        Some(Value::Array(std::mem::take(&mut self.held)))
    }

    fn checkpoint(&self) -> Option<Value> {
        Some(Value::Array(self.held.clone()))
    }
}

type Fold = Arc<dyn Fn(&mut Value, &Value) -> Option<Value> + Send + Sync>;

/// Folds events into a user state that survives restarts.
pub struct Stateful {
    initial: Value,
    state: Value,
    fold: Fold,
}

impl Stateful {
    pub fn new(initial: Value, fold: Fold) -> Self {
        Self {
            state: initial.clone(),
            initial,
            fold,
        }
    }
}

impl Accumulator for Stateful {
    fn init(&mut self, state: Option<Value>) -> Result<(), AccumulatorError> {
        self.state = state.unwrap_or_else(|| self.initial.clone());
        Ok(())
    }

    fn process(&mut self, event: Event) -> Result<Option<Value>, AccumulatorError> {
        Ok((self.fold)(&mut self.state, &event.value))
    }

    fn checkpoint(&self) -> Option<Value> {
        Some(self.state.clone())
    }
}

type PollFn = Arc<dyn Fn() -> BoxFuture<'static, Option<Value>> + Send + Sync>;

/// A source that calls a function on an interval; each value becomes an event.
pub struct PollSource {
    name: String,
    interval: Duration,
    poll: PollFn,
}

impl PollSource {
    pub fn new<F, Fut>(name: impl Into<String>, interval: Duration, poll: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Option<Value>> + Send + 'static,
    {
        Self {
            name: name.into(),
            interval,
            poll: Arc::new(move || Box::pin(poll())),
        }
    }
}

#[async_trait]
impl SourceFactory for PollSource {
    fn describe(&self) -> String {
        format!("poll:{}", self.name)
    }

    async fn open(&self, resume_after: &[Position]) -> Result<Box<dyn Source>, TransportError> {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Values are numbered on from the checkpoint: a number at or below it would be
        // taken for one already processed and skipped.
        let count = resume_after
            .iter()
            .filter(|p| p.partition == 0)
            .map(|p| p.offset)
            .max()
            .unwrap_or(0)
            .max(0);
        Ok(Box::new(Polling {
            topic: Arc::from(self.describe()),
            ticker,
            poll: self.poll.clone(),
            count,
        }))
    }
}

struct Polling {
    topic: Arc<str>,
    ticker: tokio::time::Interval,
    poll: PollFn,
    count: i64,
}

#[async_trait]
impl Source for Polling {
    async fn next(&mut self) -> Result<Message, TransportError> {
        loop {
            self.ticker.tick().await;
            if let Some(value) = (self.poll)().await {
                self.count += 1;
                return Ok(Message {
                    topic: self.topic.clone(),
                    position: Position {
                        partition: 0,
                        offset: self.count,
                    },
                    key: None,
                    payload: Bytes::from(crate::codec::json::encode(&value)),
                    headers: Vec::new(),
                    timestamp_ms: now_ms(),
                });
            }
        }
    }

    async fn commit(&mut self, _through: &[Position]) -> Result<(), TransportError> {
        // A poll has nothing to replay: each tick reads the current value afresh.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(value: Value) -> Event {
        Event {
            value,
            position: None,
            time_ms: 0,
        }
    }

    #[test]
    fn batch_emits_on_size_and_keeps_partial_state() {
        let mut batch = Batch::new(3, Duration::from_secs(1));
        assert_eq!(batch.process(ev(json!(1))).unwrap(), None);
        assert_eq!(batch.process(ev(json!(2))).unwrap(), None);
        assert_eq!(batch.checkpoint(), Some(json!([1, 2])));
        assert_eq!(batch.process(ev(json!(3))).unwrap(), Some(json!([1, 2, 3])));
        assert_eq!(batch.checkpoint(), Some(json!([])));
        batch.process(ev(json!(4))).unwrap();
        assert_eq!(batch.flush(), Some(json!([4])));
        assert_eq!(batch.flush(), None);
    }

    #[test]
    fn batch_restores_held_events() {
        let mut batch = Batch::new(2, Duration::ZERO);
        batch.init(Some(json!(["a"]))).unwrap();
        assert_eq!(
            batch.process(ev(json!("b"))).unwrap(),
            Some(json!(["a", "b"]))
        );
        assert!(batch.init(Some(json!({"x": 1}))).is_err());
        assert_eq!(batch.flush_interval(), None);
    }

    #[test]
    fn stateful_folds_and_restores() {
        let fold: Fold = Arc::new(|state, event| {
            let total = state.as_i64().unwrap_or(0) + event.as_i64().unwrap_or(0);
            *state = json!(total);
            Some(json!(total))
        });
        let mut acc = Stateful::new(json!(0), fold.clone());
        acc.init(None).unwrap();
        assert_eq!(acc.process(ev(json!(2))).unwrap(), Some(json!(2)));
        assert_eq!(acc.checkpoint(), Some(json!(2)));
        let mut restored = Stateful::new(json!(0), fold);
        restored.init(acc.checkpoint()).unwrap();
        assert_eq!(restored.process(ev(json!(5))).unwrap(), Some(json!(7)));
    }

    #[test]
    fn deduplicating_skips_repeats() {
        let mut acc = Deduplicating::default();
        assert!(acc.process(ev(json!(1))).unwrap().is_some());
        assert!(acc.process(ev(json!(1))).unwrap().is_none());
        assert!(acc.process(ev(json!(2))).unwrap().is_some());
    }

    #[test]
    fn deduplicating_skips_a_repeat_across_a_restore() {
        let mut acc = Deduplicating::default();
        assert_eq!(acc.checkpoint(), Some(Value::Null));
        for value in [json!(2), Value::Null] {
            assert!(acc.process(ev(value.clone())).unwrap().is_some());
            let mut restored = Deduplicating::default();
            restored.init(acc.checkpoint()).unwrap();
            assert!(restored.process(ev(value)).unwrap().is_none());
            assert!(restored.process(ev(json!(3))).unwrap().is_some());
        }
        let mut fresh = Deduplicating::default();
        fresh.init(Some(Value::Null)).unwrap();
        assert!(fresh.process(ev(Value::Null)).unwrap().is_some());
        assert!(fresh.init(Some(json!({"x": 1}))).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn poll_source_emits_on_interval() {
        let factory = PollSource::new("fx", Duration::from_millis(100), || async {
            Some(json!({"rate": 1.1}))
        });
        let mut source = factory.open(&[]).await.unwrap();
        let first = source.next().await.unwrap();
        let second = source.next().await.unwrap();
        assert_eq!(first.position.offset, 1);
        assert_eq!(second.position.offset, 2);
        assert_eq!(&second.payload[..], br#"{"rate":1.1}"#);
    }

    #[tokio::test(start_paused = true)]
    async fn poll_source_numbers_on_from_its_checkpoint() {
        let factory = PollSource::new("fx", Duration::from_millis(100), || async {
            Some(json!(1))
        });
        let resume = [Position {
            partition: 0,
            offset: 41,
        }];
        let mut source = factory.open(&resume).await.unwrap();
        assert_eq!(source.next().await.unwrap().position.offset, 42);
    }
}

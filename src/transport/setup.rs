//! Keeps a sink's messages to a topic in the order they were handed over while the
//! topic is being set up (created, or its stream looked up) on first use.
//!
//! Publishes run concurrently (a reactor's fires in flight, say), and the first publish
//! to a topic waits for the setup. Without this, a publish that came later but found the
//! topic already set up could overtake ones still waiting, reordering the topic.

use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
struct TopicState {
    ready: bool,
    /// Publishes that found the topic not ready (or others waiting) and queued for their
    /// turn.
    waiting: usize,
}

#[derive(Default)]
pub(crate) struct SetupGate {
    topics: Mutex<HashMap<String, TopicState>>,
    /// Taken in arrival order (tokio's mutex is fair) by queued publishes.
    turn: tokio::sync::Mutex<()>,
}

/// A publish's place in line: holding it, set the topic up if [`Turn::needs_setup`],
/// then hand the message to the client, then drop it.
pub(crate) struct Turn<'a> {
    gate: &'a SetupGate,
    /// Queued for the turn: the topic, and the turn once held. `None` on the fast path,
    /// which allocates nothing. Made before waiting for the turn, so a publish dropped
    /// while it waits still leaves the line (see `Drop`).
    queued: Option<(String, Option<tokio::sync::MutexGuard<'a, ()>>)>,
}

impl SetupGate {
    /// Waits for this publish's turn: at once for a ready topic nobody waits on.
    pub(crate) async fn enter(&self, topic: &str) -> Turn<'_> {
        let queued = {
            let mut topics = self.topics.lock().unwrap_or_else(|p| p.into_inner());
            match topics.get_mut(topic) {
                Some(state) if state.ready && state.waiting == 0 => false,
                Some(state) => {
                    state.waiting += 1;
                    true
                }
                None => {
                    let state = TopicState {
                        ready: false,
                        waiting: 1,
                    };
                    topics.insert(topic.to_string(), state);
                    true
                }
            }
        };
        let mut turn = Turn {
            gate: self,
            queued: queued.then(|| (topic.to_string(), None)),
        };
        if let Some((_, held)) = &mut turn.queued {
            *held = Some(self.turn.lock().await);
        }
        turn
    }

    fn with_state<T>(&self, topic: &str, f: impl FnOnce(&mut TopicState) -> T) -> T {
        let mut topics = self.topics.lock().unwrap_or_else(|p| p.into_inner());
        f(topics.entry(topic.to_string()).or_default())
    }
}

impl Turn<'_> {
    pub(crate) fn needs_setup(&self) -> bool {
        match &self.queued {
            Some((topic, _)) => self.gate.with_state(topic, |s| !s.ready),
            None => false,
        }
    }

    /// The topic is set up: later publishes need not wait for it.
    pub(crate) fn set_up(&self) {
        if let Some((topic, _)) = &self.queued {
            self.gate.with_state(topic, |s| s.ready = true);
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if let Some((topic, _)) = &self.queued {
            self.gate.with_state(topic, |s| s.waiting -= 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn later_publishes_never_overtake_those_waiting_for_setup() {
        let gate = Arc::new(SetupGate::default());
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for n in 0..5u32 {
            let (gate, order) = (gate.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                // Arrive in order, the first while nothing is set up.
                tokio::time::sleep(Duration::from_millis(u64::from(n))).await;
                let turn = gate.enter("t").await;
                if turn.needs_setup() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    turn.set_up();
                }
                order.lock().unwrap().push(n);
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
        // A publish dropped while waiting for its turn leaves the line.
        let held = gate.turn.lock().await;
        {
            let gate = gate.clone();
            let waiting = tokio::spawn(async move {
                let _turn = gate.enter("t2").await;
            });
            tokio::task::yield_now().await;
            waiting.abort();
            let _ = waiting.await;
        }
        drop(held);
        assert_eq!(gate.topics.lock().unwrap()["t2"].waiting, 0);
        // Once nobody waits, a ready topic is passed straight through.
        let turn = gate.enter("t").await;
        assert!(!turn.needs_setup());
        assert!(turn.queued.is_none());
    }
}

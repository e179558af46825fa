//! A running graph as its callers hold it: pushes, reactor commands, state and status.

use super::*;

/// A running graph: push events, send reactor commands, watch its state.
#[derive(Clone)]
pub struct GraphHandle {
    pub(super) name: String,
    pub(super) reactor: ReactorHandle,
    pub(super) sockets: Arc<BTreeMap<String, mpsc::Sender<Value>>>,
    pub(super) status: watch::Receiver<GraphStatus>,
    pub(super) state: watch::Receiver<ReactorState>,
    pub(super) health: Arc<BTreeMap<String, watch::Receiver<Health>>>,
    pub(super) stats: Arc<GraphStats>,
    pub(super) restart: Arc<Notify>,
}

impl GraphHandle {
    /// Starts the graph afresh now: a Failed graph is tried again at once, a graph waiting
    /// out a backoff stops waiting, a running one is torn down and respawned with its
    /// cache restored. None of it counts as a failure. A command that comes while the
    /// graph is between those states (restoring its cache, say) is kept until the graph
    /// can act on it: one stored permit, however many commands came meanwhile. A node
    /// standing by while another holds the graph's lease ignores it.
    pub fn restart(&self) {
        self.restart.notify_one();
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn reactor(&self) -> &ReactorHandle {
        &self.reactor
    }

    /// Pushes an event into an accumulator's socket path, waiting if its queue is full.
    pub async fn push(&self, accumulator: &str, value: Value) -> Result<(), PushError> {
        let socket = self.socket(accumulator)?;
        socket.send(value).await.map_err(|_| PushError::Stopped {
            graph: self.name.clone(),
        })
    }

    /// The sender behind an accumulator's socket path, for pushing without lookups.
    pub fn socket(&self, accumulator: &str) -> Result<mpsc::Sender<Value>, PushError> {
        self.sockets
            .get(accumulator)
            .cloned()
            .ok_or_else(|| PushError::UnknownAccumulator {
                graph: self.name.clone(),
                accumulator: accumulator.to_string(),
            })
    }

    pub fn status(&self) -> GraphStatus {
        self.status.borrow().clone()
    }

    pub fn state(&self) -> ReactorState {
        *self.state.borrow()
    }

    pub fn health(&self, accumulator: &str) -> Option<Health> {
        self.health.get(accumulator).map(|h| *h.borrow())
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Waits until the reactor reaches `state`.
    pub async fn wait_for_state(&self, state: ReactorState) {
        let mut rx = self.state.clone();
        let _ = rx.wait_for(|s| *s == state).await;
    }

    /// Waits until the graph's status satisfies `f`.
    pub async fn wait_for_status(&self, f: impl Fn(&GraphStatus) -> bool) -> GraphStatus {
        let mut rx = self.status.clone();
        let reached = rx.wait_for(|s| f(s)).await.map(|s| s.clone());
        reached.unwrap_or_else(|_| self.status())
    }
}

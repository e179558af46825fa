//! The services graphs run on, and this node's name among them.

use super::*;

/// The services graphs run on.
#[derive(Clone)]
pub struct Runtime {
    pub broker: Arc<dyn Broker>,
    pub store: Arc<dyn Store>,
    pub node_id: String,
}

impl Runtime {
    /// The embedded default: in-process broker and store, no services needed.
    pub fn embedded() -> Self {
        Self {
            broker: Arc::new(crate::transport::memory::MemoryBroker::default()),
            store: Arc::new(crate::store::memory::MemoryStore::new()),
            node_id: default_node_id(),
        }
    }
}

/// Host name and process id.
pub fn default_node_id() -> String {
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "weir".to_string());
    format!("{host}-{}", std::process::id())
}

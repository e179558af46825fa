//! How a graph's reactor fires it: the criteria, the input cache strategy, and the
//! reactor's settings. Declared with the graph; the reactor reads them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// When a reactor fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Criteria {
    /// Any source has new data.
    #[default]
    WhenAny,
    /// Every declared source has new data since the last fire. Flags start unset for all
    /// declared sources, so nothing fires before each has emitted once.
    WhenAll,
}

/// How the input cache holds boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Keep the newest boundary per source; intermediates may be skipped.
    #[default]
    Latest,
    /// Queue every boundary per source (bounded); each fire takes the head of each queue
    /// it consumes. A full queue holds back that source's accumulator; nothing is dropped.
    Sequential,
}

/// Reactor settings of one graph. Defaults in [`ReactorConfig::default`].
#[derive(Debug, Clone, PartialEq)]
pub struct ReactorConfig {
    pub criteria: Criteria,
    pub strategy: Strategy,
    /// Per-source queue bound for [`Strategy::Sequential`].
    pub queue_capacity: usize,
    /// Fires whose outputs may await acknowledgement at once.
    pub max_in_flight: usize,
    /// Least time between cache snapshots to the store; zero snapshots after every batch.
    /// Inputs are committed only through stored snapshots, so this also bounds how far
    /// commits lag; a snapshot is due sooner once many inputs (50,000) wait for one.
    pub snapshot_interval: Duration,
    /// Least time between the starts of the checkpoint writes of an accumulator reading
    /// a topic (its positions are committed to the broker after each); zero writes each
    /// one as soon as the last is stored. Sources that cannot replay are checkpointed
    /// at once.
    pub checkpoint_interval: Duration,
    /// Times a fire whose graph failed is run again before its inputs are dead-lettered.
    pub node_retries: u32,
    /// Wait before the first retry of a failed fire; doubles with each retry.
    pub node_retry_backoff: Duration,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        Self {
            criteria: Criteria::WhenAny,
            strategy: Strategy::Latest,
            queue_capacity: 1024,
            max_in_flight: 64,
            snapshot_interval: Duration::from_millis(200),
            checkpoint_interval: Duration::from_millis(100),
            node_retries: 3,
            node_retry_backoff: Duration::from_millis(100),
        }
    }
}

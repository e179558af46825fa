//! Restart policy: exponential backoff, a failure budget, and a healthy-time reset.

use std::time::Duration;

/// Defaults: base 1 s doubling to 60 s, Failed after 5 consecutive failures, the count
/// reset by 60 s without a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisionPolicy {
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub max_failures: u32,
    pub healthy_reset: Duration,
    /// How long shutdown waits for a graph's tasks to finish.
    pub shutdown_timeout: Duration,
    /// When set, a graph runs only on the node holding its lease in the store, renewed
    /// every third of this TTL; another node takes over within the TTL.
    pub graph_lease_ttl: Option<Duration>,
    /// How long a Failed graph stays down before it is tried again (a restart command
    /// tries it at once).
    pub failed_retry: Duration,
}

impl Default for SupervisionPolicy {
    fn default() -> Self {
        Self {
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            max_failures: 5,
            healthy_reset: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(5),
            graph_lease_ttl: None,
            failed_retry: Duration::from_secs(300),
        }
    }
}

impl SupervisionPolicy {
    /// Delay before the restart that follows the `failures`-th consecutive failure.
    pub fn backoff(&self, failures: u32) -> Duration {
        let exponent = failures.saturating_sub(1).min(31);
        self.backoff_base
            .saturating_mul(1u32 << exponent)
            .min(self.backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_one_second_to_a_sixty_second_cap() {
        let p = SupervisionPolicy::default();
        let delays: Vec<u64> = (1..=8).map(|n| p.backoff(n).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(p.backoff(1000), Duration::from_secs(60));
    }
}

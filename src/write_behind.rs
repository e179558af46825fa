//! Store writes taken off a hot path: the owner hands over each new value and goes on;
//! a task writes the newest one, waiting out an unreachable store with backoff, and
//! reports which version is stored. Only the newest value matters (a cache snapshot, a
//! checkpoint), so values handed over while a write is under way replace each other.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::Stream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::warn;

use crate::store_error::StoreError;

const FIRST_PAUSE: Duration = Duration::from_millis(50);
const LONGEST_PAUSE: Duration = Duration::from_secs(5);

type Write<T> = Arc<dyn Fn(Arc<T>) -> BoxFuture<'static, Result<(), StoreError>> + Send + Sync>;

/// The owner's end. Dropping it stops the writer, even mid-backoff: a value its owner
/// no longer stands behind must not land after a successor's.
pub(crate) struct WriteBehind<T> {
    latest: watch::Sender<(u64, Option<Arc<T>>)>,
    written: watch::Receiver<u64>,
    version: u64,
    task: JoinHandle<()>,
}

impl<T: Send + Sync + 'static> WriteBehind<T> {
    /// Starts the writer; `what` names the values in logs.
    pub(crate) fn spawn<F, Fut>(what: &'static str, write: F) -> Self
    where
        F: Fn(Arc<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        let write: Write<T> = Arc::new(move |value| Box::pin(write(value)));
        let (latest, values) = watch::channel((0, None));
        let (done, written) = watch::channel(0);
        let task = tokio::spawn(run(what, write, values, done));
        Self {
            latest,
            written,
            version: 0,
            task,
        }
    }

    /// Hands a value over; returns its version.
    pub(crate) fn submit(&mut self, value: T) -> u64 {
        self.version += 1;
        self.latest
            .send_replace((self.version, Some(Arc::new(value))));
        self.version
    }

    /// The newest version stored.
    pub(crate) fn written(&self) -> u64 {
        *self.written.borrow()
    }

    /// The newest version stored, each time it changes from now on; ends once the
    /// writer has stopped. For a `select!` loop: see [`changes`].
    pub(crate) fn stored_versions(&self) -> impl Stream<Item = u64> + Send + 'static {
        changes(self.written.clone())
    }

    /// Waits at most `limit` for everything handed over to be stored; true if it was.
    pub(crate) async fn flush(&mut self, limit: Duration) -> bool {
        let wanted = self.version;
        let stored = tokio::time::timeout(limit, self.written.wait_for(|&v| v >= wanted)).await;
        matches!(stored, Ok(Ok(_)))
    }
}

impl<T> Drop for WriteBehind<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run<T>(
    what: &'static str,
    write: Write<T>,
    mut values: watch::Receiver<(u64, Option<Arc<T>>)>,
    done: watch::Sender<u64>,
) {
    while values.changed().await.is_ok() {
        let mut pause = FIRST_PAUSE;
        loop {
            let (version, value) = values.borrow_and_update().clone();
            let Some(value) = value else { break };
            match write(value).await {
                Ok(()) => {
                    done.send_replace(version);
                    break;
                }
                Err(e) if !e.is_retryable() => {
                    // Refused for good (its writer's lease has a newer holder): a retry
                    // would be refused too, and a newer value will be tried in its turn.
                    warn!(%what, error = %e, "store refused the write; given up");
                    break;
                }
                Err(e) => {
                    warn!(%what, error = %e, retry_in = ?pause, "store write failed; retrying");
                    // A newer value does not cut the pause short: the store is away
                    // whichever value is tried.
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(LONGEST_PAUSE);
                }
            }
        }
    }
}

/// A watched value each time it changes after `receiver` last saw it; ends when the
/// sender is gone. A `select!` loop polling `changed()` afresh each turn registers and
/// removes a waiter under the channel's lock every turn, whether or not anything
/// changed; the stream keeps one wait across turns, so a turn that finds nothing new
/// costs no lock.
pub(crate) fn changes<T: Clone + Send + Sync + 'static>(
    receiver: watch::Receiver<T>,
) -> impl Stream<Item = T> + Send + 'static {
    let values = futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.changed().await.ok()?;
        let value = receiver.borrow_and_update().clone();
        Some((value, receiver))
    });
    // Ended, it answers `None` to every later poll: a loop may go on polling it.
    futures::StreamExt::fuse(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    #[tokio::test(start_paused = true)]
    async fn the_newest_value_is_written_once_the_store_is_back() {
        let failures_left = Arc::new(AtomicUsize::new(3));
        let stored = Arc::new(Mutex::new(Vec::new()));
        let (left, into) = (failures_left.clone(), stored.clone());
        let mut behind = WriteBehind::spawn("test", move |v: Arc<u32>| {
            let (left, into) = (left.clone(), into.clone());
            async move {
                if left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return Err(StoreError::Unreachable {
                        what: "test store".into(),
                        source: "down".into(),
                    });
                }
                into.lock().unwrap().push(*v);
                Ok(())
            }
        });
        behind.submit(1);
        behind.submit(2);
        tokio::task::yield_now().await;
        behind.submit(3);
        assert!(behind.flush(Duration::from_secs(10)).await);
        assert_eq!(behind.written(), 3);
        assert_eq!(*stored.lock().unwrap(), vec![3]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_write_is_given_up() {
        let mut behind = WriteBehind::spawn("test", |_: Arc<u32>| async {
            Err(StoreError::Fenced {
                lease: "graph:g".into(),
                token: 1,
            })
        });
        behind.submit(1);
        assert!(!behind.flush(Duration::from_secs(1)).await);
        assert_eq!(behind.written(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_is_bounded_while_the_store_is_away() {
        let mut behind = WriteBehind::spawn("test", |_: Arc<u32>| async {
            Err(StoreError::Unreachable {
                what: "test store".into(),
                source: "down".into(),
            })
        });
        behind.submit(1);
        assert!(!behind.flush(Duration::from_secs(1)).await);
        assert_eq!(behind.written(), 0);
    }

    #[tokio::test]
    async fn changes_yield_each_new_value_and_end_with_the_sender() {
        use futures::StreamExt;
        let (sender, receiver) = watch::channel(0u64);
        sender.send_replace(1);
        let mut values = Box::pin(changes(receiver));
        // What the receiver had not seen yet comes first.
        assert_eq!(values.next().await, Some(1));
        // A turn of a `select!` that finds nothing new leaves the wait in place.
        assert!(futures::poll!(values.next()).is_pending());
        sender.send_replace(2);
        sender.send_replace(3);
        assert_eq!(values.next().await, Some(3));
        drop(sender);
        assert_eq!(values.next().await, None);
        assert_eq!(values.next().await, None, "polled again once ended");
    }
}

//! Store writes taken off a hot path: the owner hands over each new value and goes on;
//! a task writes the newest one, waiting out an unreachable store with backoff, and
//! reports which version is stored. Only the newest value matters (a cache snapshot, a
//! checkpoint), so values handed over while a write is under way replace each other.
//! A writer may also keep a least time between the starts of its writes: at a steady
//! trickle of values, one write per value would cost the store (and the machine) a round
//! trip per event where one per interval does.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// A value handed over, with its version.
struct Handed<T> {
    version: u64,
    value: Option<Arc<T>>,
    /// Written as soon as the write under way is done, whatever the spacing.
    at_once: bool,
}

impl<T> Clone for Handed<T> {
    fn clone(&self) -> Self {
        Self {
            version: self.version,
            value: self.value.clone(),
            at_once: self.at_once,
        }
    }
}

/// The owner's end. Dropping it stops the writer, even mid-backoff: a value its owner
/// no longer stands behind must not land after a successor's.
pub(crate) struct WriteBehind<T> {
    latest: watch::Sender<Handed<T>>,
    /// The newest version the writer has taken up to write.
    taken: Arc<AtomicU64>,
    written: watch::Receiver<u64>,
    /// The newest version whose write has ended, stored or refused for good: a flush
    /// waits for this, not for a refused value to be stored.
    settled: watch::Receiver<u64>,
    version: u64,
    task: JoinHandle<()>,
}

impl<T: Send + Sync + 'static> WriteBehind<T> {
    /// Starts the writer; `what` names the values in logs. Successful writes start at
    /// least `spacing` apart (zero: each as soon as the last is done), except that a
    /// value handed over with [`WriteBehind::submit_at_once`] does not wait.
    pub(crate) fn spawn<F, Fut>(what: &'static str, spacing: Duration, write: F) -> Self
    where
        F: Fn(Arc<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        let write: Write<T> = Arc::new(move |value| Box::pin(write(value)));
        let (latest, values) = watch::channel(Handed {
            version: 0,
            value: None,
            at_once: false,
        });
        let (done, written) = watch::channel(0);
        let (ended, settled) = watch::channel(0);
        let taken = Arc::new(AtomicU64::new(0));
        let outcomes = Outcomes { done, ended };
        let task = tokio::spawn(run(what, spacing, write, values, taken.clone(), outcomes));
        Self {
            latest,
            taken,
            written,
            settled,
            version: 0,
            task,
        }
    }

    /// Hands a value over; returns its version. It is written once the spacing since
    /// the last write has passed, unless a newer value replaces it first.
    pub(crate) fn submit(&mut self, value: T) -> u64 {
        self.hand_over(value, false)
    }

    /// Hands a value over to be written as soon as the write under way is done, without
    /// waiting out the spacing: for a value nothing could rebuild if it were lost.
    pub(crate) fn submit_at_once(&mut self, value: T) -> u64 {
        self.hand_over(value, true)
    }

    fn hand_over(&mut self, value: T, at_once: bool) -> u64 {
        self.version += 1;
        // A value replacing one due at once that the writer has not taken up yet is due
        // at once too: it holds what the other held. (Once taken, the other is being
        // written already.)
        let inherited = {
            let replaced = self.latest.borrow();
            replaced.at_once && replaced.version > self.taken.load(Ordering::Acquire)
        };
        self.latest.send_replace(Handed {
            version: self.version,
            value: Some(Arc::new(value)),
            at_once: at_once || inherited,
        });
        self.version
    }

    /// Whether `version` will never be written on its own: a newer value replaced it
    /// before the writer took it up, so it is stored, if ever, with that one. An owner
    /// keeping something per version folds it into the newer one's, or through a store
    /// outage it would keep one per value handed over. (A value the writer is taking up
    /// at that instant may read as replaced: what was kept for it then waits for the
    /// newer one's write, later than it might, never earlier.)
    pub(crate) fn replaced(&self, version: u64) -> bool {
        version < self.version && version > self.taken.load(Ordering::Acquire)
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
    /// The newest value is written without waiting out the spacing: an owner flushing is
    /// about to stop, and would otherwise give up on it. A value the store refuses for
    /// good ends the wait at once: no retry would store it.
    pub(crate) async fn flush(&mut self, limit: Duration) -> bool {
        let wanted = self.version;
        if wanted > self.taken.load(Ordering::Acquire) {
            self.latest.send_modify(|handed| handed.at_once = true);
        }
        let settled = self.settled.wait_for(|&v| v >= wanted);
        let _ = tokio::time::timeout(limit, settled).await;
        *self.written.borrow() >= wanted
    }
}

impl<T> Drop for WriteBehind<T> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the writer reports: the newest version stored, and the newest whose write
/// ended either way.
struct Outcomes {
    done: watch::Sender<u64>,
    ended: watch::Sender<u64>,
}

async fn run<T>(
    what: &'static str,
    spacing: Duration,
    write: Write<T>,
    mut values: watch::Receiver<Handed<T>>,
    taken: Arc<AtomicU64>,
    outcomes: Outcomes,
) {
    // A value seen while waiting out the spacing, not yet written.
    let mut pending = false;
    loop {
        if !pending && values.changed().await.is_err() {
            return;
        }
        pending = false;
        let began = tokio::time::Instant::now();
        let mut pause = FIRST_PAUSE;
        let stored = loop {
            let handed = values.borrow_and_update().clone();
            let Some(value) = handed.value else {
                break false;
            };
            taken.store(handed.version, Ordering::Release);
            match write(value).await {
                Ok(()) => {
                    outcomes.done.send_replace(handed.version);
                    outcomes.ended.send_replace(handed.version);
                    break true;
                }
                Err(e) if !e.is_retryable() => {
                    // Refused for good (its writer's lease has a newer holder, or a key
                    // holds another type than the write expects): a retry would be
                    // refused too, and a newer value will be tried in its turn.
                    warn!(%what, error = %e, "store refused the write; given up");
                    outcomes.ended.send_replace(handed.version);
                    break false;
                }
                Err(e) => {
                    warn!(%what, error = %e, retry_in = ?pause, "store write failed; retrying");
                    // A newer value does not cut the pause short: the store is away
                    // whichever value is tried.
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(LONGEST_PAUSE);
                }
            }
        };
        if stored && !spacing.is_zero() {
            // Values handed over meanwhile replace each other until the spacing has
            // passed, unless one must be written at once.
            let spaced = tokio::time::sleep_until(began + spacing);
            tokio::pin!(spaced);
            loop {
                tokio::select! {
                    _ = &mut spaced => break,
                    changed = values.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        pending = true;
                        if values.borrow().at_once {
                            break;
                        }
                    }
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
        let mut behind = WriteBehind::spawn("test", Duration::ZERO, move |v: Arc<u32>| {
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
    async fn a_value_replaced_before_the_writer_took_it_up_is_told_apart() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = gate.clone();
        let mut behind = WriteBehind::spawn("test", Duration::ZERO, move |_: Arc<u32>| {
            let held = held.clone();
            async move {
                let _ = held.acquire().await;
                Ok(())
            }
        });
        let first = behind.submit(1);
        for _ in 0..100 {
            if behind.taken.load(Ordering::Acquire) == first {
                break;
            }
            tokio::task::yield_now().await;
        }
        let second = behind.submit(2);
        let third = behind.submit(3);
        assert!(!behind.replaced(first), "being written");
        assert!(behind.replaced(second), "replaced before it was taken up");
        assert!(!behind.replaced(third), "the newest");
        gate.add_permits(10);
        assert!(behind.flush(Duration::from_secs(1)).await);
        assert_eq!(behind.written(), third);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_write_is_given_up() {
        let mut behind = WriteBehind::spawn("test", Duration::ZERO, |_: Arc<u32>| async {
            Err(StoreError::Fenced {
                lease: "graph:g".into(),
                token: 1,
            })
        });
        behind.submit(1);
        let asked = tokio::time::Instant::now();
        assert!(!behind.flush(Duration::from_secs(60)).await);
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "a flush waits out no refused write"
        );
        assert_eq!(behind.written(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_is_bounded_while_the_store_is_away() {
        let mut behind = WriteBehind::spawn("test", Duration::ZERO, |_: Arc<u32>| async {
            Err(StoreError::Unreachable {
                what: "test store".into(),
                source: "down".into(),
            })
        });
        behind.submit(1);
        assert!(!behind.flush(Duration::from_secs(1)).await);
        assert_eq!(behind.written(), 0);
    }

    type Stored = Arc<Mutex<Vec<(u32, tokio::time::Instant)>>>;

    /// A writer with `spacing` that records each value it stores, and when.
    fn recording(spacing: Duration) -> (WriteBehind<u32>, Stored) {
        recording_slowly(spacing, Duration::ZERO)
    }

    /// The same, each write taking `takes`.
    fn recording_slowly(spacing: Duration, takes: Duration) -> (WriteBehind<u32>, Stored) {
        let stored = Arc::new(Mutex::new(Vec::new()));
        let into = stored.clone();
        let behind = WriteBehind::spawn("test", spacing, move |v: Arc<u32>| {
            let into = into.clone();
            async move {
                tokio::time::sleep(takes).await;
                into.lock().unwrap().push((*v, tokio::time::Instant::now()));
                Ok(())
            }
        });
        (behind, stored)
    }

    #[tokio::test(start_paused = true)]
    async fn values_within_the_spacing_wait_for_it_and_replace_each_other() {
        let spacing = Duration::from_millis(50);
        let (mut behind, stored) = recording(spacing);
        let start = tokio::time::Instant::now();
        behind.submit(1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        behind.submit(2);
        behind.submit(3);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            behind.written(),
            1,
            "the second write waits out the spacing"
        );
        tokio::time::sleep(spacing * 2).await;
        let stored = stored.lock().unwrap().clone();
        assert_eq!(
            stored.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
            vec![1, 3]
        );
        assert!(stored[1].1 - start >= spacing, "{:?}", stored[1].1 - start);
        assert_eq!(behind.written(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_flush_does_not_wait_out_the_spacing() {
        let (mut behind, stored) = recording(Duration::from_secs(3600));
        behind.submit(1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        behind.submit(2);
        assert!(behind.flush(Duration::from_secs(1)).await);
        let values: Vec<u32> = stored.lock().unwrap().iter().map(|(v, _)| *v).collect();
        assert_eq!(values, vec![1, 2]);
        // Nothing left to hurry: a flush with everything stored writes nothing again.
        assert!(behind.flush(Duration::from_secs(1)).await);
        tokio::time::sleep(Duration::from_secs(7200)).await;
        assert_eq!(stored.lock().unwrap().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_value_for_at_once_does_not_wait_out_the_spacing() {
        let (mut behind, stored) = recording(Duration::from_secs(60));
        behind.submit(1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        behind.submit(2);
        behind.submit_at_once(3);
        assert!(behind.flush(Duration::from_secs(1)).await);
        let values: Vec<u32> = stored.lock().unwrap().iter().map(|(v, _)| *v).collect();
        assert_eq!(values, vec![1, 3]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_value_replacing_one_for_at_once_is_written_at_once_too() {
        let (mut behind, stored) = recording(Duration::from_secs(60));
        behind.submit(1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        behind.submit_at_once(2);
        behind.submit(3);
        assert!(behind.flush(Duration::from_secs(1)).await);
        let values: Vec<u32> = stored.lock().unwrap().iter().map(|(v, _)| *v).collect();
        assert_eq!(values, vec![1, 3]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_value_handed_over_while_one_for_at_once_is_written_waits_out_the_spacing() {
        let write = Duration::from_millis(5);
        let (mut behind, stored) = recording_slowly(Duration::from_secs(60), write);
        behind.submit(1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        behind.submit_at_once(2);
        // 2 is being written: 3 holds nothing that must not wait.
        tokio::time::sleep(Duration::from_millis(1)).await;
        behind.submit(3);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(behind.written(), 2);
        assert!(behind.flush(Duration::from_secs(61)).await);
        let values: Vec<u32> = stored.lock().unwrap().iter().map(|(v, _)| *v).collect();
        assert_eq!(values, vec![1, 2, 3]);
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

//! Futures and streams polled only once they woke their task.
//!
//! A loop's `select!` polls every branch on every turn. Most turns are for its busy
//! branch (inputs, pushes), and its rare ones (shutdown, a watch of stored positions)
//! are waits on a tokio `Notify`, which takes the notifier's lock on each poll while it
//! waits, to check whether the task's waker changed. [`Woken`] gives its inner future or
//! stream a waker of its own: the inner one is polled the first time and then only after
//! that waker was woken, and every other poll costs a comparison of wakers and a load.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use futures::Stream;

/// `inner`, polled only once it woke its task (and on its first poll).
pub(crate) fn woken<T>(inner: T) -> Woken<T> {
    let signal = Arc::new(Signal {
        woken: AtomicBool::new(true),
        task: Mutex::new(None),
    });
    Woken {
        inner: Box::pin(inner),
        waker: Waker::from(signal.clone()),
        signal,
        registered: None,
    }
}

/// See [`woken`].
pub(crate) struct Woken<T> {
    inner: Pin<Box<T>>,
    signal: Arc<Signal>,
    /// The waker the inner future or stream is polled with: it sets the signal.
    waker: Waker,
    /// The task's waker the signal holds, kept here too so that a poll by the same
    /// task compares wakers instead of taking the signal's lock.
    registered: Option<Waker>,
}

/// Set by the inner future or stream waking, and the task to wake then.
struct Signal {
    woken: AtomicBool,
    task: Mutex<Option<Waker>>,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(task) = task {
            task.wake();
        }
    }
}

impl<T> Woken<T> {
    /// Whether the inner future or stream may be ready: it woke since it was last
    /// polled, or was never polled, or (a stream) its last poll gave an item. Not for a
    /// future that completed already. A load, no lock: for a loop that looks between two
    /// polls whether to stop, and asks the exact question only when this says so.
    pub(crate) fn may_be_ready(&self) -> bool {
        self.signal.woken.load(Ordering::SeqCst)
    }

    /// Whether the inner future or stream is to be polled: registers the task's waker
    /// first, so a wake coming after the flag is read reaches this task.
    fn due(&mut self, cx: &Context<'_>) -> bool {
        if !self
            .registered
            .as_ref()
            .is_some_and(|registered| registered.will_wake(cx.waker()))
        {
            let task = cx.waker().clone();
            *self
                .signal
                .task
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(task.clone());
            self.registered = Some(task);
        }
        self.signal.woken.load(Ordering::SeqCst) && self.signal.woken.swap(false, Ordering::SeqCst)
    }
}

impl<T: Future> Future for Woken<T> {
    type Output = T::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T::Output> {
        let this = self.get_mut();
        if !this.due(cx) {
            return Poll::Pending;
        }
        this.inner
            .as_mut()
            .poll(&mut Context::from_waker(&this.waker))
    }
}

impl<T: Stream> Stream for Woken<T> {
    type Item = T::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T::Item>> {
        let this = self.get_mut();
        if !this.due(cx) {
            return Poll::Pending;
        }
        let polled = this
            .inner
            .as_mut()
            .poll_next(&mut Context::from_waker(&this.waker));
        if polled.is_ready() {
            // An item may not be the last ready: the next poll looks again.
            this.signal.woken.store(true, Ordering::SeqCst);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    #[tokio::test]
    async fn may_be_ready_says_so_until_polled_and_again_once_woken() {
        let cancel = CancellationToken::new();
        let mut stopping = woken(cancel.clone().cancelled_owned());
        assert!(stopping.may_be_ready(), "never polled");
        assert!(futures::poll!(&mut stopping).is_pending());
        assert!(!stopping.may_be_ready());
        cancel.cancel();
        assert!(stopping.may_be_ready());
        assert!(futures::poll!(&mut stopping).is_ready());
    }

    #[tokio::test]
    async fn a_future_completes_once_its_inner_one_wakes_it() {
        let cancel = CancellationToken::new();
        let stopping = woken(cancel.clone().cancelled_owned());
        tokio::pin!(stopping);
        assert!(futures::poll!(&mut stopping).is_pending());
        assert!(futures::poll!(&mut stopping).is_pending());
        let canceller = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            canceller.cancel();
        });
        tokio::time::timeout(Duration::from_secs(5), stopping)
            .await
            .expect("woken by the cancellation");
    }

    #[tokio::test]
    async fn an_inner_future_is_polled_again_only_once_it_woke_its_waker() {
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // Wakes its waker on its first poll only, as if what it waits for came then.
        let inner = {
            let polls = polls.clone();
            futures::future::poll_fn(move |cx| {
                if polls.fetch_add(1, Ordering::SeqCst) == 0 {
                    cx.waker().wake_by_ref();
                }
                Poll::<()>::Pending
            })
        };
        let gated = woken(inner);
        tokio::pin!(gated);
        for _ in 0..5 {
            assert!(futures::poll!(&mut gated).is_pending());
        }
        assert_eq!(
            polls.load(Ordering::SeqCst),
            2,
            "polled first, then once for its one wake"
        );
    }

    #[tokio::test]
    async fn a_stream_gives_every_change_it_is_woken_for() {
        let (tx, rx) = tokio::sync::watch::channel(0u64);
        let changes = futures::stream::unfold(rx, |mut rx| async move {
            rx.changed().await.ok()?;
            let seen = *rx.borrow_and_update();
            Some((seen, rx))
        });
        let mut changes = woken(changes);
        assert!(futures::poll!(changes.next()).is_pending());
        for version in 1..=3 {
            tx.send(version).expect("receiver open");
            let seen = tokio::time::timeout(Duration::from_secs(5), changes.next())
                .await
                .expect("woken by the change");
            assert_eq!(seen, Some(version));
            assert!(futures::poll!(changes.next()).is_pending());
        }
        drop(tx);
        let end = tokio::time::timeout(Duration::from_secs(5), changes.next())
            .await
            .expect("woken by the sender going");
        assert_eq!(end, None);
    }

    #[tokio::test]
    async fn a_ready_stream_is_read_to_its_end_without_a_wake_between_items() {
        let mut items = woken(futures::stream::iter([1, 2, 3]));
        let mut seen = Vec::new();
        while let Some(item) = tokio::time::timeout(Duration::from_secs(5), items.next())
            .await
            .expect("ready items need no wake")
        {
            seen.push(item);
        }
        assert_eq!(seen, vec![1, 2, 3]);
    }
}

//! Consuming with many messages in flight: each message is handled by its own future,
//! at most `limit` at once. At the limit the loop stops reading (the broker keeps the
//! rest), so a slow consumer never buffers without bound. A message is committed when
//! its handler finishes it; one left unfinished (cancelled, given up) stays for
//! redelivery. At the limit the source is held rather than left alone, so a client that
//! must keep polling to stay in its group does (see [`Source::hold`]).
//!
//! The handlers are polled by the consuming task itself rather than spawned: they wait
//! on brokers, stores and timers far more than they compute, and polling them in place
//! spares a task spawn, a cross-thread wake-up and a move of a large future for every
//! message (about a fifth of the whole cost of a no-op workflow task). The price is that
//! a handler must not block: CPU-heavy work belongs in `spawn_blocking`.

use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::{Message, Position, Source, TransportError};

/// How often messages still being worked on are reported alive to the broker.
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(2);
/// After cancellation, how long running handlers get to finish and be committed.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after a retryable read error (broker restarting, leader moving).
const READ_RETRY: Duration = Duration::from_millis(500);

/// Runs until `cancel` fires or the source fails for good. `handle` returns whether the
/// message is finished (to be committed).
pub async fn consume_concurrently<H, F>(
    mut source: Box<dyn Source>,
    limit: usize,
    cancel: CancellationToken,
    handle: H,
) -> Result<(), TransportError>
where
    H: Fn(Message) -> F,
    F: Future<Output = bool> + Send + 'static,
{
    let limit = limit.max(1);
    let mut running: FuturesUnordered<BoxFuture<'static, (Position, bool)>> =
        FuturesUnordered::new();
    let mut in_flight: HashSet<Position> = HashSet::new();
    let mut keep_alive = tokio::time::interval(KEEP_ALIVE_EVERY);
    keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // After a failed read, reading waits a while; the handlers in flight go on meanwhile.
    let read_pause = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(read_pause);
    let mut read_paused = false;
    let result = loop {
        let full = running.len() >= limit;
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break Ok(()),
            Some(done) = running.next(), if !running.is_empty() => {
                finish(&mut *source, &mut in_flight, done).await;
            }
            _ = keep_alive.tick(), if !in_flight.is_empty() => {
                let positions: Vec<Position> = in_flight.iter().copied().collect();
                if let Err(e) = source.keep_alive(&positions).await {
                    warn!(error = %e, "cannot report messages in progress");
                }
            }
            _ = &mut read_pause, if read_paused => read_paused = false,
            read = next_unless_full(&mut *source, full), if !read_paused => match read {
                Ok(message) => {
                    let position = message.position;
                    in_flight.insert(position);
                    let work = AssertUnwindSafe(handle(message)).catch_unwind();
                    running.push(Box::pin(async move {
                        match work.await {
                            Ok(finished) => (position, finished),
                            Err(_) => {
                                warn!(?position, "message handler panicked; left for redelivery");
                                (position, false)
                            }
                        }
                    }));
                }
                Err(e) if e.is_retryable() => {
                    warn!(error = %e, "read failed; retrying");
                    read_pause
                        .as_mut()
                        .reset(tokio::time::Instant::now() + READ_RETRY);
                    read_paused = true;
                }
                Err(e) => break Err(e),
            },
        }
    };
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Some(done) = running.next().await {
            finish(&mut *source, &mut in_flight, done).await;
        }
    })
    .await;
    if drained.is_err() {
        warn!(
            left = running.len(),
            "handlers still running at shutdown; their messages will be redelivered"
        );
        // Dropped unfinished: their messages stay uncommitted.
        running.clear();
    }
    result
}

/// The next message, or, at the limit, none: the source is held (see [`Source::hold`])
/// until a handler finishes and this read is dropped.
async fn next_unless_full(source: &mut dyn Source, full: bool) -> Result<Message, TransportError> {
    if !full {
        return source.next().await;
    }
    loop {
        source.hold().await?;
    }
}

async fn finish(
    source: &mut dyn Source,
    in_flight: &mut HashSet<Position>,
    (position, finished): (Position, bool),
) {
    in_flight.remove(&position);
    if finished {
        if let Err(e) = source.commit(&[position]).await {
            warn!(error = %e, ?position, "commit failed; the message may come again");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use async_trait::async_trait;

    use super::*;

    /// Delivers one message, then fails a read (retryably), then has nothing more.
    struct FailingAfterOne {
        reads: usize,
        commits: Arc<Mutex<Vec<(Position, tokio::time::Instant)>>>,
    }

    #[async_trait]
    impl Source for FailingAfterOne {
        async fn next(&mut self) -> Result<Message, TransportError> {
            self.reads += 1;
            match self.reads {
                1 => Ok(Message {
                    topic: Arc::from("t"),
                    position: Position {
                        partition: 0,
                        offset: 1,
                    },
                    key: None,
                    payload: bytes::Bytes::new(),
                    headers: Vec::new(),
                    timestamp_ms: 0,
                }),
                2 => Err(TransportError::Consume {
                    topic: "t".into(),
                    source: "broker away".into(),
                    retryable: true,
                }),
                _ => std::future::pending().await,
            }
        }

        async fn commit(&mut self, through: &[Position]) -> Result<(), TransportError> {
            let now = tokio::time::Instant::now();
            let mut commits = self.commits.lock().unwrap();
            commits.extend(through.iter().map(|p| (*p, now)));
            Ok(())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn handlers_in_flight_go_on_while_reading_pauses_after_an_error() {
        let commits = Arc::new(Mutex::new(Vec::new()));
        let source = Box::new(FailingAfterOne {
            reads: 0,
            commits: commits.clone(),
        });
        let cancel = CancellationToken::new();
        let began = tokio::time::Instant::now();
        let consumer = tokio::spawn(consume_concurrently(source, 4, cancel.clone(), |_| async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            true
        }));
        tokio::time::sleep(READ_RETRY * 2).await;
        cancel.cancel();
        consumer.await.unwrap().unwrap();
        let commits = commits.lock().unwrap();
        assert_eq!(commits.len(), 1, "the message is committed once");
        assert!(
            commits[0].1 - began < READ_RETRY,
            "committed after {:?}, not held up by the read pause",
            commits[0].1 - began
        );
    }
}

//! Consuming with many messages in flight: each message is handled by its own task, at
//! most `limit` at once. At the limit the loop stops reading (the broker keeps the rest),
//! so a slow consumer never buffers without bound. A message is committed when its task
//! finishes it; one left unfinished (cancelled, given up) stays for redelivery.

use std::collections::HashSet;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::task::JoinHandle;
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
    let mut running: FuturesUnordered<JoinHandle<(Position, bool)>> = FuturesUnordered::new();
    let mut in_flight: HashSet<Position> = HashSet::new();
    let mut keep_alive = tokio::time::interval(KEEP_ALIVE_EVERY);
    keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break Ok(()),
            Some(joined) = running.next(), if !running.is_empty() => {
                finish(&mut *source, &mut in_flight, joined).await;
            }
            _ = keep_alive.tick(), if !in_flight.is_empty() => {
                let positions: Vec<Position> = in_flight.iter().copied().collect();
                if let Err(e) = source.keep_alive(&positions).await {
                    warn!(error = %e, "cannot report messages in progress");
                }
            }
            read = source.next(), if running.len() < limit => match read {
                Ok(message) => {
                    let position = message.position;
                    in_flight.insert(position);
                    let work = AssertUnwindSafe(handle(message)).catch_unwind();
                    running.push(tokio::spawn(async move {
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
                    tokio::select! {
                        _ = cancel.cancelled() => break Ok(()),
                        _ = tokio::time::sleep(READ_RETRY) => {}
                    }
                }
                Err(e) => break Err(e),
            },
        }
    };
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Some(joined) = running.next().await {
            finish(&mut *source, &mut in_flight, joined).await;
        }
    })
    .await;
    if drained.is_err() {
        warn!(
            left = running.len(),
            "handlers still running at shutdown; their messages will be redelivered"
        );
        for task in running.iter() {
            task.abort();
        }
    }
    result
}

async fn finish(
    source: &mut dyn Source,
    in_flight: &mut HashSet<Position>,
    joined: Result<(Position, bool), tokio::task::JoinError>,
) {
    let Ok((position, finished)) = joined else {
        return;
    };
    in_flight.remove(&position);
    if finished {
        if let Err(e) = source.commit(&[position]).await {
            warn!(error = %e, ?position, "commit failed; the message may come again");
        }
    }
}

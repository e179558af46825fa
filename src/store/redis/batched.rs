//! Script calls shared by the writes that come in together. Redis spends about as much
//! on a script call as on the work inside it, so a script that takes any number of
//! keys, one write each, costs far less per write when the writes made at the same time
//! go in one call. A write that comes in while no call is out goes at once, alone.

use std::sync::{LazyLock, Mutex};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use redis::aio::ConnectionManager;
use redis::Script;
use tokio::sync::{mpsc, oneshot};

use super::store_error;
use crate::store_error::StoreError;

/// Writes in one call at most.
const WRITES_PER_CALL: usize = 64;
/// Calls awaiting their reply at once. While this many are out, writes queue and go
/// together in the next call: calls grow with the load.
const CALLS_IN_FLIGHT: usize = 4;
/// Writes queued for the task making the calls, at most; a writer beyond it waits.
const QUEUE: usize = 4096;

/// A script taking per key the same number of arguments, and answering per key 1 (the
/// write was made) or 0. The task making its calls starts with the first write and ends
/// when the last store sharing it is dropped.
pub(super) struct BatchedScript {
    script: &'static LazyLock<Script>,
    operation: &'static str,
    queue: Mutex<Option<mpsc::Sender<Write>>>,
}

/// One key's write and who waits for its outcome.
struct Write {
    key: String,
    args: Vec<String>,
    made: oneshot::Sender<Result<bool, StoreError>>,
}

impl BatchedScript {
    pub(super) fn new(script: &'static LazyLock<Script>, operation: &'static str) -> Self {
        Self {
            script,
            operation,
            queue: Mutex::new(None),
        }
    }

    /// Makes one key's write, in a call shared with the writes queued with it; whether
    /// the script made it.
    pub(super) async fn call(
        &self,
        connection: &ConnectionManager,
        key: String,
        args: Vec<String>,
    ) -> Result<bool, StoreError> {
        let queue = {
            let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            match queue.as_ref().filter(|q| !q.is_closed()) {
                Some(running) => running.clone(),
                // None yet, or its task panicked: the next write starts one.
                None => {
                    let (sender, writes) = mpsc::channel(QUEUE);
                    tokio::spawn(make_calls(
                        self.script,
                        self.operation,
                        connection.clone(),
                        writes,
                    ));
                    queue.insert(sender).clone()
                }
            }
        };
        let stopped = || StoreError::Operation {
            operation: self.operation,
            source: "the task making the calls has stopped".into(),
            retryable: true,
        };
        let (made, outcome) = oneshot::channel();
        let write = Write { key, args, made };
        queue.send(write).await.map_err(|_| stopped())?;
        outcome.await.unwrap_or_else(|_| Err(stopped()))
    }
}

/// The task making the calls, up to [`CALLS_IN_FLIGHT`] at once.
async fn make_calls(
    script: &'static LazyLock<Script>,
    operation: &'static str,
    connection: ConnectionManager,
    mut queue: mpsc::Receiver<Write>,
) {
    let mut calls = FuturesUnordered::new();
    let mut open = true;
    while open || !calls.is_empty() {
        tokio::select! {
            Some(()) = calls.next(), if !calls.is_empty() => {}
            first = queue.recv(), if open && calls.len() < CALLS_IN_FLIGHT => match first {
                None => open = false,
                Some(first) => {
                    let mut writes = vec![first];
                    while writes.len() < WRITES_PER_CALL {
                        match queue.try_recv() {
                            Ok(write) => writes.push(write),
                            Err(_) => break,
                        }
                    }
                    calls.push(call(script, operation, connection.clone(), writes));
                }
            }
        }
    }
}

/// One call for `writes`; each writer gets its own outcome.
async fn call(
    script: &'static LazyLock<Script>,
    operation: &'static str,
    mut connection: ConnectionManager,
    writes: Vec<Write>,
) {
    let mut invocation = script.prepare_invoke();
    for write in &writes {
        invocation.key(&write.key);
        for arg in &write.args {
            invocation.arg(arg);
        }
    }
    let outcome: Result<Vec<i64>, _> = invocation.invoke_async(&mut connection).await;
    match outcome {
        Ok(made) if made.len() == writes.len() => {
            for (write, made) in writes.into_iter().zip(made) {
                // A writer that stopped waiting no longer needs the answer.
                let _ = write.made.send(Ok(made == 1));
            }
        }
        Ok(made) => {
            let why = format!("{} answers to {} writes", made.len(), writes.len());
            for write in writes {
                let _ = write.made.send(Err(StoreError::Operation {
                    operation,
                    source: why.clone().into(),
                    retryable: true,
                }));
            }
        }
        Err(e) if writes.len() > 1 && !e.is_io_error() && !e.is_timeout() => {
            // The script failed on one write (a key of another type, say); the writes
            // before it in the call may be made. Each is made again in a call of its own,
            // so only the failing one fails: one already made answers 0, and its writer
            // reads the store again, as after losing a race.
            tracing::warn!(operation, writes = writes.len(), error = %e, "a shared script call failed; making its writes one by one");
            futures::future::join_all(
                writes
                    .into_iter()
                    .map(|write| call(script, operation, connection.clone(), vec![write])),
            )
            .await;
        }
        Err(e) => {
            let failed = store_error(operation, e);
            for write in writes {
                let _ = write.made.send(Err(same_class(&failed)));
            }
        }
    }
}

/// `error` once more, for another writer of a shared call: the same class (so the same
/// answer to whether a retry can help), its cause as text.
fn same_class(error: &StoreError) -> StoreError {
    match error {
        StoreError::Unreachable { what, source } => StoreError::Unreachable {
            what: what.clone(),
            source: source.to_string().into(),
        },
        StoreError::Operation {
            operation,
            source,
            retryable,
        } => StoreError::Operation {
            operation,
            source: source.to_string().into(),
            retryable: *retryable,
        },
        StoreError::Corrupt { key, source } => StoreError::Corrupt {
            key: key.clone(),
            source: source.to_string().into(),
        },
        // `store_error` makes only the three above.
        other => StoreError::Operation {
            operation: "shared script call",
            source: other.to_string().into(),
            retryable: other.is_retryable(),
        },
    }
}

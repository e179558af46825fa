//! One cancellation token for the whole process, cancelled by Ctrl-C or SIGTERM.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;

/// Set once a signal arrived, so the process can exit with the status that says so.
static SIGNALLED: AtomicBool = AtomicBool::new(false);

/// A token cancelled on the first Ctrl-C or SIGTERM.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        SIGNALLED.store(true, Ordering::SeqCst);
        cancel.cancel();
    });
    token
}

/// Whether Ctrl-C or SIGTERM arrived.
pub fn signalled() -> bool {
    SIGNALLED.load(Ordering::SeqCst)
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

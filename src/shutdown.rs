//! Turns SIGTERM and SIGINT into a cancellation every part of the process listens to.

use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGTERM or SIGINT.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "Cannot listen for SIGTERM.");
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received; shutting down."),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down."),
        }
        cancel.cancel();
    });
    token
}

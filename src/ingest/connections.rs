//! The ingress's own connection loop on hyper: at most `--max-connections` open, each under
//! the header-read timeout, so a half-sent request or an idle connection is closed, and a stop
//! that drains within a bound. (axum's own `serve` gives hyper no timer, so it cannot time out
//! a connection that sends nothing.)

use axum::Router;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What bounds the ingress's connections.
#[derive(Debug, Clone, Copy)]
pub(super) struct ConnectionLimits {
    /// Open at once; past it, new connections wait in the kernel's backlog.
    pub(super) max_connections: usize,
    /// hyper's header-read timeout: a request's headers must arrive this soon after the
    /// connection opened or answered, so a half-sent request or an idle connection is closed.
    pub(super) header_timeout: Duration,
    /// How long a stop waits for the connections still open.
    pub(super) drain_limit: Duration,
}

/// Serves `app` on `listener` until `shutdown`, with at most `max_connections` open, each
/// under the header-read timeout. On shutdown: no more accepts, idle connections closed at
/// once, requests in flight answered, and whatever is still open after the drain limit closed.
/// (axum's own `serve` gives hyper no timer, so it cannot time out a connection that sends
/// nothing.)
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: CancellationToken,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let places = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let service = hyper_util::service::TowerToHyperService::new(app);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let place = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            place = places.clone().acquire_owned() => place.expect("the semaphore is never closed"),
        };
        let stream = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: wait a little rather than spin.
                    tracing::warn!(error = %e, "Could not accept a connection.");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let connection =
            graceful.watch(http.serve_connection(TokioIo::new(stream), service.clone()));
        connections.spawn(async move {
            let _ = connection.await;
            drop(place);
        });
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    if tokio::time::timeout(limits.drain_limit, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            open = connections.len(),
            limit_secs = limits.drain_limit.as_secs(),
            "Connections were still open at the drain limit; closing them."
        );
    }
    connections.abort_all();
}

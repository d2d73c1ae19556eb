//! Whether the ingress is ready, one answer per process: the broker's reachability, watched,
//! and the drain after SIGTERM, both reported into one [`crate::telemetry::Health`] that the
//! webhook port's `/readyz` and the metrics port's read alike.

use super::AppState;
use axum::extract::State;
use axum::http::StatusCode;
use rdkafka::producer::Producer as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// On `shutdown`: not ready at once, still accepting for the shutdown delay, then the
/// listener closes.
pub(super) async fn drain_after(state: Arc<AppState>, shutdown: CancellationToken) {
    shutdown.cancelled().await;
    state.draining.store(true, Ordering::Relaxed);
    state
        .health
        .report(DRAIN_CHECK, Some("shutting down".into()));
    let delay = state.settings.shutdown_delay;
    if !delay.is_zero() {
        tracing::info!(
            delay_ms = delay.as_millis() as u64,
            "Stopping: /readyz answers 503; webhooks are still accepted for the shutdown delay."
        );
        tokio::time::sleep(delay).await;
    }
    tracing::info!("Closing the listener; finishing the requests in flight.");
    state.closing.cancel();
}

/// Reports the broker unreachable unless the producer can fetch the topic's metadata from the broker.
pub(super) async fn watch_broker(state: Arc<AppState>, shutdown: CancellationToken) {
    let mut reachable = false;
    while !shutdown.is_cancelled() {
        let probe = state.clone();
        let ok = tokio::task::spawn_blocking(move || {
            let md = probe
                .producer
                .client()
                .fetch_metadata(Some(&probe.settings.topic), Duration::from_secs(2));
            md.is_ok_and(|m| {
                m.topics()
                    .iter()
                    .any(|t| t.error().is_none() && !t.partitions().is_empty())
            })
        })
        .await
        .unwrap_or(false);
        let problem = (!ok).then(|| "the broker is not reachable".to_owned());
        state.health.report(BROKER_CHECK, problem);
        if std::mem::replace(&mut reachable, ok) != ok {
            tracing::info!(ready = ok, "The broker's reachability changed.");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

/// The check `/readyz` names while the broker does not answer.
pub(super) const BROKER_CHECK: &str = "broker";
/// The check `/readyz` names after SIGTERM.
const DRAIN_CHECK: &str = "ingest";

/// The same answer as the metrics port's `/readyz`: one [`crate::telemetry::Health`].
pub(super) async fn readyz(State(state): State<Arc<AppState>>) -> (StatusCode, String) {
    state.health.ready_answer()
}

//! Turns SIGTERM and SIGINT into a cancellation every part of the process listens to, and
//! the handle of a started role that runs until that cancellation.

use anyhow::Context as _;
use std::future::Future;
use std::net::SocketAddr;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A started role (the ingress, a consumer, a dispatcher): built and checked by its `start`,
/// it runs until its shutdown token is cancelled, then finishes what is in flight.
pub struct Running {
    task: JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Runs `work` on the runtime.
    pub fn spawn(work: impl Future<Output = anyhow::Result<()>> + Send + 'static) -> Self {
        Self {
            task: tokio::spawn(work),
        }
    }

    /// Waits until it has stopped, and says how it ended.
    pub async fn stopped(self) -> anyhow::Result<()> {
        self.task.await.context("the task panicked")?
    }
}

/// What every long-running role's process starts with, written once: the shutdown signal, a
/// registry holding the process metrics, and the `/metrics` and `/healthz` server.
pub struct Process {
    /// Cancelled on the first SIGTERM or SIGINT.
    pub shutdown: CancellationToken,
    /// Where the role registers its metrics; served at `/metrics`.
    pub registry: prometheus::Registry,
    /// What `/healthz` reports.
    pub health: crate::telemetry::Health,
}

impl Process {
    /// Listens for signals, registers the process metrics for `role`, and serves `/metrics` and
    /// `/healthz` at `metrics_addr` (None: the role serves its own, as ingest does).
    pub async fn start(
        role: &'static str,
        metrics_addr: Option<SocketAddr>,
    ) -> anyhow::Result<Self> {
        let shutdown = on_signal();
        let registry = prometheus::Registry::new();
        crate::telemetry::register_process_metrics(&registry, role)?;
        let health = match metrics_addr {
            Some(at) => crate::telemetry::serve(at, registry.clone(), &shutdown).await?,
            None => crate::telemetry::Health::default(),
        };
        Ok(Self {
            shutdown,
            registry,
            health,
        })
    }
}

/// A token cancelled on the first SIGTERM or SIGINT. A second one ends the process at once
/// with status 130, for an operator who will not wait for the graceful stop: what was in flight
/// is rolled back and replayed harmlessly by the next owner.
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
            _ = term.recv() => tracing::info!("SIGTERM received; shutting down (a second signal stops at once)."),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down (a second signal stops at once)."),
        }
        cancel.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::warn!(
            "A second signal: stopping at once; work in flight will be replayed harmlessly."
        );
        std::process::exit(SECOND_SIGNAL_EXIT);
    });
    token
}

/// The exit status after a second SIGTERM or SIGINT.
pub const SECOND_SIGNAL_EXIT: i32 = 130;

//! The dispatcher's metrics.

use crate::outbox::{self, OutboxState};
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use sqlx::PgPool;

/// The dispatcher's metrics; labels are outcomes and states from fixed lists.
#[derive(Clone)]
pub struct DispatchMetrics {
    pub attempts: IntCounterVec,
    pub latency: Histogram,
    pub operations: IntGaugeVec,
    pub oldest_due_seconds: IntGauge,
    pub expired_leases: IntGauge,
}

impl DispatchMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            attempts: IntCounterVec::new(
                Opts::new(
                    "replayproof_dispatch_attempts_total",
                    "Delivery attempts, by outcome.",
                ),
                &["outcome"],
            )?,
            latency: Histogram::with_opts(
                HistogramOpts::new(
                    "replayproof_dispatch_duration_seconds",
                    "Time of one attempt.",
                )
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 16)?),
            )?,
            operations: IntGaugeVec::new(
                Opts::new(
                    "replayproof_outbox_operations",
                    "Outbox operations, by state.",
                ),
                &["state"],
            )?,
            oldest_due_seconds: IntGauge::new(
                "replayproof_outbox_oldest_due_seconds",
                "How long the oldest due operation has been waiting.",
            )?,
            expired_leases: IntGauge::new(
                "replayproof_outbox_expired_leases",
                "In-progress operations whose lease expired: their worker is gone.",
            )?,
        };
        // Every outcome's series from the start, at 0: one born at its first increment hides
        // that increment from `increase()`.
        for outcome in outbox::Outcome::ALL {
            m.attempts.with_label_values(&[outcome.as_str()]);
        }
        registry.register(Box::new(m.attempts.clone()))?;
        registry.register(Box::new(m.latency.clone()))?;
        registry.register(Box::new(m.operations.clone()))?;
        registry.register(Box::new(m.oldest_due_seconds.clone()))?;
        registry.register(Box::new(m.expired_leases.clone()))?;
        Ok(m)
    }

    /// Reads the gauges from the outbox.
    pub async fn refresh(&self, pool: &PgPool) -> sqlx::Result<()> {
        let g = outbox::gauges(pool).await?;
        for state in OutboxState::ALL {
            let n = g
                .by_state
                .iter()
                .find(|(s, _)| *s == state)
                .map_or(0, |(_, n)| *n);
            self.operations.with_label_values(&[state.as_str()]).set(n);
        }
        self.oldest_due_seconds.set(g.oldest_due_seconds as i64);
        self.expired_leases.set(g.expired_leases);
        Ok(())
    }
}

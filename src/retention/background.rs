//! The background pruner of `consume --prune-interval`: a round every interval, its rows and
//! each source's oldest claim in the metrics. A refused round (a retention below a floor, say)
//! is logged and counted, and tried again next interval; it never stops the consumer.

use super::metrics::PruneMetrics;
use super::round::{Pruner, RoundError};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The outcomes of a background prune round, as `replayproof_prune_rounds_total` labels them.
pub const ROUND_OUTCOMES: [&str; 3] = ["done", "refused", "error"];

pub struct Background {
    pub pruner: Pruner,
    pub every: Duration,
    pub metrics: PruneMetrics,
}

impl Background {
    /// Runs a round every interval until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(self.every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.round() => {}
            }
        }
    }

    async fn round(&self) {
        let outcome = match self.pruner.round(false).await {
            Ok(round) => {
                for (_, table, n) in &round.pruned.rows {
                    self.metrics
                        .rows
                        .with_label_values(&[table])
                        .inc_by(*n as u64);
                }
                for d in &round.decided {
                    self.metrics
                        .retention
                        .with_label_values(&[&d.source])
                        .set(d.retention.as_secs_f64());
                }
                tracing::debug!(rows = round.pruned.rows.len(), "Pruned past retention.");
                "done"
            }
            Err(RoundError::Refused(refusal)) => {
                tracing::error!(error = %refusal, "Prune refused; nothing was deleted.");
                "refused"
            }
            Err(e) => {
                tracing::warn!(error = %e, "A prune round failed; trying again next interval.");
                "error"
            }
        };
        self.metrics.rounds.with_label_values(&[outcome]).inc();
        self.oldest_claims().await;
    }

    async fn oldest_claims(&self) {
        match super::prune::oldest_claims(&self.pruner.pool).await {
            Ok(ages) => {
                for (source, age) in ages {
                    self.metrics
                        .oldest_claim_age
                        .with_label_values(&[&source])
                        .set(age);
                }
            }
            Err(e) => tracing::warn!(error = %e, "Reading the oldest claims failed."),
        }
    }
}

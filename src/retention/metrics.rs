//! The background pruner's metrics (`consume --prune-interval`), registered in the consumer's
//! registry.

use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};

/// The background pruner's metrics (`consume --prune-interval`).
#[derive(Clone)]
pub struct PruneMetrics {
    /// Rows deleted (or payloads erased) by prune, by table.
    pub rows: IntCounterVec,
    /// Prune rounds, by outcome: done, refused, error.
    pub rounds: IntCounterVec,
    /// The age of each source's oldest claim.
    pub oldest_claim_age: GaugeVec,
    /// Each source's retention, for the alert that compares the two.
    pub retention: GaugeVec,
}

impl PruneMetrics {
    /// The metrics, registered in `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let per_source = |name: &str, help: &str| {
            keep(registry, GaugeVec::new(Opts::new(name, help), &["source"]))
        };
        let by = |name: &str, help: &str, label: &str| {
            keep(
                registry,
                IntCounterVec::new(Opts::new(name, help), &[label]),
            )
        };
        Ok(Self {
            rows: by(
                "replayproof_pruned_rows_total",
                "Rows pruned (or payloads erased) past their retention, by table.",
                "table",
            )?,
            rounds: by(
                "replayproof_prune_rounds_total",
                "Background prune rounds, by outcome (done, refused, error).",
                "outcome",
            )?,
            oldest_claim_age: per_source(
                "replayproof_oldest_claim_age_seconds",
                "Age of the oldest claim of each source.",
            )?,
            retention: per_source(
                "replayproof_retention_seconds",
                "How long each source's claims are kept.",
            )?,
        })
        .inspect(|made: &Self| {
            for outcome in super::background::ROUND_OUTCOMES {
                made.rounds.with_label_values(&[outcome]);
            }
        })
    }
}

/// Registers `made` in `registry`, and gives it back.
fn keep<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    made: prometheus::Result<M>,
) -> prometheus::Result<M> {
    let metric = made?;
    registry.register(Box::new(metric.clone()))?;
    Ok(metric)
}

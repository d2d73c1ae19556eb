//! The dispatcher's metrics.

use super::Destinations;
use crate::db::Db;
use crate::destinations::{self, Breaker};
use crate::outbox::{self, OutboxState};
use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use std::collections::BTreeMap;

/// The dispatcher's metrics; labels are outcomes and states from fixed lists.
#[derive(Clone)]
pub struct DispatchMetrics {
    pub attempts: IntCounterVec,
    pub latency: Histogram,
    pub operations: IntGaugeVec,
    pub oldest_due_seconds: IntGauge,
    pub expired_leases: IntGauge,
    /// Operations held past their idempotency window, waiting for an operator.
    pub held: IntGauge,
    /// Destinations by breaker position; `destination` is an origin with its own
    /// `[dispatch.destinations]` section, or `default` for the rest.
    pub breakers: IntGaugeVec,
    /// Requests in flight per destination, from every dispatcher.
    pub in_flight: IntGaugeVec,
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
            held: IntGauge::new(
                "replayproof_outbox_held",
                "Operations held past their idempotency window, waiting for an operator.",
            )?,
            breakers: IntGaugeVec::new(
                Opts::new(
                    "replayproof_dispatch_breakers",
                    "Destinations whose circuit breaker is in each state (closed, open, half_open).",
                ),
                &["destination", "state"],
            )?,
            in_flight: IntGaugeVec::new(
                Opts::new(
                    "replayproof_dispatch_in_flight",
                    "Requests in flight to each destination, from every dispatcher.",
                ),
                &["destination"],
            )?,
        };
        // Every outcome's series from the start, at 0: one born at its first increment hides
        // that increment from `increase()`.
        for outcome in outbox::Outcome::ALL {
            m.attempts.with_label_values(&[outcome.as_str()]);
        }
        m.register(registry)?;
        Ok(m)
    }

    /// Registers every metric in `registry`.
    fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.attempts.clone()))?;
        registry.register(Box::new(self.latency.clone()))?;
        registry.register(Box::new(self.operations.clone()))?;
        registry.register(Box::new(self.oldest_due_seconds.clone()))?;
        registry.register(Box::new(self.expired_leases.clone()))?;
        registry.register(Box::new(self.held.clone()))?;
        registry.register(Box::new(self.breakers.clone()))?;
        registry.register(Box::new(self.in_flight.clone()))
    }

    /// Every configured destination's series from the start, at 0.
    pub fn destinations(&self, destinations: &Destinations) {
        let labels =
            std::iter::once("default").chain(destinations.by_origin.keys().map(String::as_str));
        for label in labels {
            self.in_flight.with_label_values(&[label]);
            for breaker in Breaker::ALL {
                self.breakers.with_label_values(&[label, breaker.as_str()]);
            }
        }
    }

    /// Reads the gauges from the outbox, the destinations labelled as `destinations` names
    /// them.
    pub async fn refresh(&self, pools: &[Db], destinations: &Destinations) -> sqlx::Result<()> {
        let mut breakers: BTreeMap<(&str, Breaker), i64> = BTreeMap::new();
        let mut in_flight: BTreeMap<&str, i64> = BTreeMap::new();
        let gauges = match pools {
            [] => Vec::new(),
            _ => {
                destinations::destination_gauges(&destinations::LimitsHome::over(pools, 0)).await?
            }
        };
        for g in &gauges {
            let label = destinations.label(&g.origin);
            *breakers.entry((label, g.breaker)).or_default() += 1;
            *in_flight.entry(label).or_default() += g.in_flight;
        }
        let labels =
            std::iter::once("default").chain(destinations.by_origin.keys().map(String::as_str));
        for label in labels {
            for breaker in Breaker::ALL {
                let n = breakers.get(&(label, breaker)).copied().unwrap_or(0);
                self.breakers
                    .with_label_values(&[label, breaker.as_str()])
                    .set(n);
            }
            let n = in_flight.get(label).copied().unwrap_or(0);
            self.in_flight.with_label_values(&[label]).set(n);
        }
        let (mut by_state, mut oldest_due, mut expired, mut held) = (BTreeMap::new(), 0f64, 0, 0);
        for pool in pools {
            let g = outbox::gauges(pool).await?;
            for (state, n) in g.by_state {
                *by_state.entry(state.as_str()).or_insert(0) += n;
            }
            oldest_due = oldest_due.max(g.oldest_due_seconds);
            expired += g.expired_leases;
            held += g.held;
        }
        for state in OutboxState::ALL {
            let n = by_state.get(state.as_str()).copied().unwrap_or(0);
            self.operations.with_label_values(&[state.as_str()]).set(n);
        }
        self.oldest_due_seconds.set(oldest_due as i64);
        self.expired_leases.set(expired);
        self.held.set(held);
        Ok(())
    }
}

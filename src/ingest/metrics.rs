//! The ingress's metrics.

use prometheus::{Histogram, HistogramOpts, IntCounterVec, Opts, Registry};

/// The ingress's metrics; labels are a configured source name (or `unknown`) and an outcome.
#[derive(Clone)]
pub struct IngestMetrics {
    pub requests: IntCounterVec,
    pub produce_seconds: Histogram,
    /// Events of a kind whose deliveries carry the event's time that came without one: a late
    /// redelivery of such an event after its key was pruned is not caught as an expired replay.
    pub untimed: IntCounterVec,
}

impl IngestMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new(
                    "replayproof_ingest_requests_total",
                    "Webhook requests, by source and outcome.",
                ),
                &["source", "outcome"],
            )?,
            produce_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "replayproof_ingest_produce_duration_seconds",
                    "Time from producing a record to the broker's acknowledgement.",
                )
                .buckets(prometheus::exponential_buckets(0.0005, 2.0, 16)?),
            )?,
            untimed: IntCounterVec::new(
                Opts::new(
                    "replayproof_ingest_events_without_time_total",
                    "Events of a kind whose deliveries carry the event's time (stripe, shopify, \
                     slack) that came without one, by source.",
                ),
                &["source"],
            )?,
        };
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.untimed.clone()))?;
        registry.register(Box::new(m.produce_seconds.clone()))?;
        Ok(m)
    }
}

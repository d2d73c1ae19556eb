//! The consumer's metrics.

use super::batch::{Outcome, UNKNOWN_SOURCE};
use super::deferred::Applied;
use super::BatchReport;
use crate::retention::metrics::PruneMetrics;
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// The consumer's metrics. Labels are bounded: an outcome from a fixed list, a configured
/// source, the topic and a partition.
#[derive(Clone)]
pub struct ConsumeMetrics {
    /// The same counts by partition and minute, and each partition's lag, for the console's
    /// charts ([`crate::activity`]).
    pub activity: crate::activity::Activity,
    /// Events by source and outcome (applied, duplicate, conflict, dead_letter, failed,
    /// deferred, expired_replay); dead letters count under the source `unknown`.
    pub events: IntCounterVec,
    /// Effect attempts that returned an error, retried or not.
    pub effect_failures: IntCounter,
    /// Operations of applied events whose source names an obligation, by source and how they
    /// were keyed: obligation (held by this event), fulfilled (by an earlier event; nothing
    /// enqueued), fallback (the field was missing: keyed by the event).
    pub operation_keys: IntCounterVec,
    /// Batches that failed on a database error and were retried.
    pub batch_retries: IntCounter,
    /// Messages per batch.
    pub batch_size: Histogram,
    /// Time from the start of a batch to its commit.
    pub batch_seconds: Histogram,
    /// The last offset committed to Kafka, per topic and partition.
    pub committed_offset: IntGaugeVec,
    /// Partitions this member owns now.
    pub assigned_partitions: IntGauge,
    /// Messages after the last applied batch, per topic and partition.
    pub consumer_lag: IntGaugeVec,
    /// Lanes that panicked; each stops the process so its partitions move on.
    pub lane_panics: IntCounter,
    /// Errors Kafka reported while consuming, by librdkafka's error code.
    pub kafka_errors: IntCounterVec,
    /// The deferred applier's metrics.
    pub deferred: DeferredMetrics,
    /// The background pruner's metrics.
    pub prune: PruneMetrics,
}

/// The deferred applier's metrics.
#[derive(Clone)]
pub struct DeferredMetrics {
    /// Due deferred claims taken up, by outcome: applied, deferred (again), failed, postponed,
    /// skipped (another worker held it).
    pub attempts: IntCounterVec,
    /// Effects that panicked while the deferred applier applied their event; each event is
    /// settled `failed` with the panic's message.
    pub panics: IntCounter,
    /// Times the deferred applier's task panicked outside an effect and was started again.
    pub restarts: IntCounter,
    /// The topic's deferred claims, read from the database (every member reports the same).
    pub events: IntGauge,
    /// Seconds since the oldest deferred claim of the topic was first deferred.
    pub oldest_age: Gauge,
}

/// Creates metrics and registers each in the registry as it is made.
struct Maker<'r>(&'r Registry);

impl Maker<'_> {
    fn keep<M: prometheus::core::Collector + Clone + 'static>(
        &self,
        made: prometheus::Result<M>,
    ) -> prometheus::Result<M> {
        let metric = made?;
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    fn counter(&self, name: &str, help: &str) -> prometheus::Result<IntCounter> {
        self.keep(IntCounter::new(name, help))
    }

    fn by(&self, name: &str, help: &str, label: &str) -> prometheus::Result<IntCounterVec> {
        self.keep(IntCounterVec::new(Opts::new(name, help), &[label]))
    }

    fn per_partition(&self, name: &str, help: &str) -> prometheus::Result<IntGaugeVec> {
        self.keep(IntGaugeVec::new(
            Opts::new(name, help),
            &["topic", "partition"],
        ))
    }

    fn histogram(
        &self,
        name: &str,
        help: &str,
        start: f64,
        n: usize,
    ) -> prometheus::Result<Histogram> {
        let buckets = prometheus::exponential_buckets(start, 2.0, n)?;
        self.keep(Histogram::with_opts(
            HistogramOpts::new(name, help).buckets(buckets),
        ))
    }
}

impl DeferredMetrics {
    fn new(m: &Maker<'_>) -> prometheus::Result<Self> {
        Ok(Self {
            attempts: m.by(
                "replayproof_deferred_attempts_total",
                "Due deferred events taken up, by outcome.",
                "outcome",
            )?,
            panics: m.counter(
                "replayproof_deferred_panics_total",
                "Effects that panicked applying a deferred event (the event is failed).",
            )?,
            restarts: m.counter(
                "replayproof_deferred_restarts_total",
                "Times the deferred applier panicked and was started again.",
            )?,
            events: m.keep(IntGauge::new(
                "replayproof_deferred_events",
                "Events of the topic whose effect deferred, waiting to be applied.",
            ))?,
            oldest_age: m.keep(Gauge::new(
                "replayproof_deferred_oldest_age_seconds",
                "Age of the oldest deferred event of the topic, from its first deferral.",
            ))?,
        })
        .inspect(|made: &Self| {
            // Every outcome's series from the start, at 0 (see `known_sources`).
            for outcome in Applied::ALL {
                made.attempts.with_label_values(&[outcome.as_str()]);
            }
        })
    }
}

impl ConsumeMetrics {
    /// The metrics, registered in `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Maker(registry);
        Ok(Self {
            activity: Default::default(),
            events: m.keep(IntCounterVec::new(
                Opts::new(
                    "replayproof_consume_events_total",
                    "Events consumed, by source and outcome.",
                ),
                &["source", "outcome"],
            ))?,
            effect_failures: m.counter(
                "replayproof_effect_failures_total",
                "Effect attempts that failed.",
            )?,
            operation_keys: m.keep(IntCounterVec::new(
                Opts::new(
                    "replayproof_consume_operation_keys_total",
                    "Operations of applied events whose source names an obligation, by source \
                     and key: obligation, fulfilled (by an earlier event), fallback (by event).",
                ),
                &["source", "key"],
            ))?,
            batch_retries: m.counter(
                "replayproof_batch_retries_total",
                "Batches retried after a database error.",
            )?,
            batch_size: m.histogram("replayproof_batch_size", "Messages per batch.", 1.0, 12)?,
            batch_seconds: m.histogram(
                "replayproof_batch_duration_seconds",
                "Time from the start of a batch to its commit.",
                0.0005,
                16,
            )?,
            committed_offset: m.per_partition(
                "replayproof_committed_offset",
                "The next offset to read, as last committed to Kafka.",
            )?,
            assigned_partitions: m.keep(IntGauge::new(
                "replayproof_assigned_partitions",
                "Partitions assigned to this consumer.",
            ))?,
            consumer_lag: m.per_partition(
                "replayproof_consumer_lag",
                "Messages in the partition after the last applied batch.",
            )?,
            lane_panics: m.counter(
                "replayproof_lane_panics_total",
                "Partition lanes that panicked.",
            )?,
            kafka_errors: m.by(
                "replayproof_kafka_consume_errors_total",
                "Errors Kafka reported while consuming, by error code.",
                "code",
            )?,
            deferred: DeferredMetrics::new(&m)?,
            prune: PruneMetrics::new(registry)?,
        })
    }

    /// Creates every series the consumer may count at 0, for each of `sources` (and
    /// `unknown`): a counter whose series is born at its first increment hides that increment
    /// from `increase()`, and an alert on it misses the first dead letter after a restart.
    pub fn known_sources<'s>(&self, sources: impl IntoIterator<Item = &'s str>) {
        let sources = sources.into_iter().chain([UNKNOWN_SOURCE]);
        for source in sources {
            for outcome in Outcome::ALL {
                self.events.with_label_values(&[source, outcome.label()]);
            }
            for keyed in crate::envelope::OperationKeyed::ALL {
                self.operation_keys
                    .with_label_values(&[source, keyed.label()]);
            }
        }
    }

    /// Creates an assigned partition's series, at 0 where they count.
    pub fn known_partition(&self, topic: &str, partition: i32) {
        let labels = [topic, &partition.to_string()];
        self.committed_offset.with_label_values(&labels);
        self.consumer_lag.with_label_values(&labels);
    }

    /// Removes a revoked partition's series.
    pub fn forget_partition(&self, topic: &str, partition: i32) {
        let labels = [topic, &partition.to_string()];
        let _ = self.consumer_lag.remove_label_values(&labels);
        let _ = self.committed_offset.remove_label_values(&labels);
    }

    /// Counts what one committed batch did.
    pub fn record(&self, report: &BatchReport) {
        for (source, counts) in &report.by_source {
            for (outcome, n) in Outcome::ALL.into_iter().zip(counts) {
                if *n > 0 {
                    let labels = [source.as_str(), outcome.label()];
                    self.events.with_label_values(&labels).inc_by(*n as u64);
                }
            }
        }
        self.effect_failures.inc_by(report.effect_errors as u64);
        for ((source, keyed), n) in &report.keyed {
            self.operation_keys
                .with_label_values(&[source.as_str(), keyed.label()])
                .inc_by(*n as u64);
        }
    }
}

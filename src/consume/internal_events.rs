//! What the consumer tells its operator: each happening is one value whose `emit` logs it and
//! counts it in one place, with bounded labels (an outcome, an error code; never a key).

use super::deferred::Applied;
use super::{BatchError, BatchReport, ConsumeMetrics};
use std::time::Duration;

/// Something that happened, logged and counted together.
pub(super) trait Emit {
    fn emit(self, metrics: &ConsumeMetrics);
}

/// A batch (or part of one) committed.
pub(super) struct BatchCommitted<'a> {
    pub partition: i32,
    pub messages: usize,
    pub last_offset: Option<i64>,
    /// The next offset to store, when it moved.
    pub next_offset: Option<i64>,
    pub report: &'a BatchReport,
    pub took: Duration,
}

impl Emit for BatchCommitted<'_> {
    fn emit(self, metrics: &ConsumeMetrics) {
        let (partition, report) = (self.partition, self.report);
        metrics.record(report);
        let dead = report.dead_letters.len();
        let activity = &metrics.activity;
        activity.batch(partition, report.applied, report.duplicates, dead);
        metrics.batch_size.observe(self.messages as f64);
        metrics.batch_seconds.observe(self.took.as_secs_f64());
        for letter in &report.dead_letters {
            let (offset, reason) = (letter.offset, &letter.reason);
            tracing::warn!(
                partition,
                offset,
                reason,
                "Dead-lettered a malformed message."
            );
        }
        if report.conflicts > 0 {
            tracing::warn!(
                partition,
                conflicts = report.conflicts,
                "Events reused a claimed key with a different payload; recorded in key_conflicts."
            );
        }
        tracing::debug!(
            partition,
            last_offset = self.last_offset,
            next_offset = self.next_offset,
            applied = report.applied,
            duplicates = report.duplicates,
            failed = report.failed,
            "Committed a batch."
        );
    }
}

/// A batch did not commit and is run again: whole after a backoff, or in halves after its
/// transaction ran past the batch timeout.
pub(super) enum BatchRetried<'a> {
    Later {
        partition: i32,
        error: &'a BatchError,
        retry_in: Duration,
    },
    InHalves {
        partition: i32,
        messages: usize,
        limit: Duration,
    },
}

impl Emit for BatchRetried<'_> {
    fn emit(self, metrics: &ConsumeMetrics) {
        metrics.batch_retries.inc();
        match self {
            Self::Later {
                partition,
                error,
                retry_in,
            } => tracing::warn!(
                partition,
                error = format!("{error:#}"),
                retry_in_ms = retry_in.as_millis() as u64,
                "A batch did not commit; retrying it."
            ),
            Self::InHalves {
                partition,
                messages,
                limit,
            } => tracing::warn!(
                partition,
                messages,
                limit_secs = limit.as_secs(),
                "A batch's transaction ran past the batch timeout and was rolled back; \
                 applying it in halves."
            ),
        }
    }
}

/// A lane panicked; the process stops (logged by the vitals as it stops).
pub(super) struct LanePanicked;

impl Emit for LanePanicked {
    fn emit(self, metrics: &ConsumeMetrics) {
        metrics.lane_panics.inc();
    }
}

/// Kafka reported an error: of the consumer as a whole, or of one partition's fetches.
pub(super) struct KafkaErrorReported<'a> {
    pub partition: Option<i32>,
    pub error: &'a rdkafka::error::KafkaError,
}

impl Emit for KafkaErrorReported<'_> {
    fn emit(self, metrics: &ConsumeMetrics) {
        let code = self
            .error
            .rdkafka_error_code()
            .map_or_else(|| "other".to_owned(), |c| format!("{c:?}"));
        metrics.kafka_errors.with_label_values(&[&code]).inc();
        let error = self.error;
        match self.partition {
            Some(partition) => tracing::warn!(
                partition,
                error = %error,
                "Kafka reported an error fetching a partition."
            ),
            None => tracing::warn!(error = %error, "Kafka reported an error."),
        }
    }
}

/// The deferred applier took up a due claim.
pub(super) struct DeferredTaken(pub Applied);

impl Emit for DeferredTaken {
    fn emit(self, metrics: &ConsumeMetrics) {
        let outcome = self.0.as_str();
        if self.0 == Applied::Done {
            let applier = crate::activity::DEFERRED_APPLIER;
            metrics.activity.batch(applier, 1, 0, 0);
        }
        metrics
            .deferred
            .attempts
            .with_label_values(&[outcome])
            .inc();
    }
}

/// A deferred event's effect panicked; the event is failed.
pub(super) struct DeferredEffectPanicked<'a> {
    pub key: &'a str,
    pub error: &'a str,
}

impl Emit for DeferredEffectPanicked<'_> {
    fn emit(self, metrics: &ConsumeMetrics) {
        metrics.deferred.panics.inc();
        let (key, error) = (self.key, self.error);
        tracing::error!(
            key,
            error,
            "A deferred event's effect panicked; the event is failed."
        );
    }
}

/// The deferred applier's task panicked outside an effect and is started again.
pub(super) struct DeferredApplierRestarted<'a> {
    pub panic: &'a str,
}

impl Emit for DeferredApplierRestarted<'_> {
    fn emit(self, metrics: &ConsumeMetrics) {
        metrics.deferred.restarts.inc();
        let panic = self.panic;
        tracing::error!(panic, "The deferred applier panicked; starting it again.");
    }
}

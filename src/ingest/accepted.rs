//! The log line of each accepted delivery (its source, key, request id, partition and offset),
//! at info, rate-limited: at most [`PER_SECOND`] lines a second (as many at once), by governor's
//! token bucket. A delivery past the limit is logged at debug only, and counted: the next line
//! logged at info says how many were not (`not_logged`), so the lines and that count add up to
//! every accepted delivery.

use crate::envelope::Envelope;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

/// Accepted deliveries logged at info per second, at most.
pub const PER_SECOND: u32 = 20;

/// Logs accepted deliveries; see the module's documentation.
pub(super) struct AcceptedLog {
    limiter: DefaultDirectRateLimiter,
    /// Accepted deliveries not logged at info since the last line that was.
    not_logged: AtomicU64,
}

impl Default for AcceptedLog {
    fn default() -> Self {
        let per_second = NonZeroU32::new(PER_SECOND).expect("a positive rate");
        Self {
            limiter: RateLimiter::direct(Quota::per_second(per_second)),
            not_logged: AtomicU64::new(0),
        }
    }
}

impl AcceptedLog {
    /// Logs the acceptance of `envelope`, written at `partition` and `offset`.
    pub(super) fn accepted(&self, envelope: &Envelope, partition: i32, offset: i64) {
        let (source, key) = (&envelope.source, envelope.key.as_str());
        let request_id = envelope.request_id.as_deref().unwrap_or_default();
        if self.limiter.check().is_err() {
            self.not_logged.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%source, %key, %request_id, partition, offset, "Accepted a webhook.");
            return;
        }
        let not_logged = self.not_logged.swap(0, Ordering::Relaxed);
        tracing::info!(%source, %key, %request_id, partition, offset, not_logged, "Accepted a webhook.");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_burst_deliveries_are_counted_not_logged() {
        let log = AcceptedLog::default();
        let envelope: Envelope =
            serde_json::from_str(r#"{"key": "stripe:evt_1", "source": "stripe", "payload": {}}"#)
                .unwrap();
        for offset in 0..(PER_SECOND as i64 + 5) {
            log.accepted(&envelope, 0, offset);
        }
        assert_eq!(log.not_logged.load(Ordering::Relaxed), 5);
    }
}

//! The downstream's idempotency window: how long it honours an idempotency key (Stripe keeps
//! keys 24 hours). An operation whose request may already have been applied is protected by its
//! key only within the window counted from its first attempt whose outcome is unknown; past it,
//! sending it again could apply it twice, so it is reconciled first or held for an operator.
//! This is the one place the rule is written; the dispatcher and `events retry` follow it.

use chrono::{DateTime, Utc};
use std::time::Duration;

/// How long a destination honours an idempotency key; `None`: forever (nothing is known of it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdempotencyWindow(pub Option<Duration>);

impl IdempotencyWindow {
    /// Until when the key protects an operation first maybe-applied at `since`; None: as long
    /// as the operation lives (no window, or nothing was ever maybe-applied).
    pub fn until(self, since: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
        Some(later(since?, self.0?))
    }

    /// Whether a request started at `now` and lasting up to `request` could reach the downstream
    /// after `until`: then the key may no longer protect it.
    pub fn passed(until: Option<DateTime<Utc>>, now: DateTime<Utc>, request: Duration) -> bool {
        until.is_some_and(|until| later(now, request) >= until)
    }

    /// The next attempt of a maybe-applied operation, due at `next` by its backoff, moved
    /// earlier so that it ends within the window (two request timeouts before `until`) when
    /// there is still time for that; otherwise left as it is, and that attempt reconciles or
    /// holds the operation. Never before `now`.
    pub fn schedule(
        until: Option<DateTime<Utc>>,
        next: DateTime<Utc>,
        now: DateTime<Utc>,
        request: Duration,
    ) -> DateTime<Utc> {
        let Some(until) = until else { return next };
        let margin = chrono::Duration::from_std(request * 2).unwrap_or(chrono::Duration::MAX);
        let latest = until.checked_sub_signed(margin).unwrap_or(now);
        match latest > now && next > latest {
            true => latest,
            false => next,
        }
    }
}

/// `at + wait`, saturating at the latest time there is.
fn later(at: DateTime<Utc>, wait: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(wait)
        .ok()
        .and_then(|w| at.checked_add_signed(w))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// Why a held operation is not sent: the window of `origin` passed since its first attempt
/// whose outcome is unknown.
pub fn past_window_reason(origin: &str, window: Duration, since: DateTime<Utc>) -> String {
    format!(
        "past the idempotency window: {origin} honours an idempotency key for {}, and the \
         first attempt whose outcome is unknown started at {}; sent again, it could be applied \
         twice, so it waits for an operator (events retry --accept-duplicate-risk)",
        humantime::format_duration(window),
        since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn no_window_or_nothing_maybe_applied_protects_forever() {
        let day = IdempotencyWindow(Some(Duration::from_secs(86_400)));
        assert_eq!(IdempotencyWindow(None).until(Some(at(0))), None);
        assert_eq!(day.until(None), None);
        assert_eq!(day.until(Some(at(0))), Some(at(86_400)));
        assert!(!IdempotencyWindow::passed(
            None,
            at(1 << 30),
            Duration::ZERO
        ));
    }

    #[test]
    fn a_request_that_could_arrive_after_the_window_is_past_it() {
        let until = Some(at(100));
        let timeout = Duration::from_secs(10);
        assert!(!IdempotencyWindow::passed(until, at(89), timeout));
        assert!(IdempotencyWindow::passed(until, at(90), timeout));
        assert!(IdempotencyWindow::passed(until, at(500), timeout));
    }

    #[test]
    fn backoff_is_moved_into_the_window_while_there_is_time() {
        let timeout = Duration::from_secs(10);
        let schedule = |next, now| IdempotencyWindow::schedule(Some(at(100)), next, now, timeout);
        // Well within: unchanged.
        assert_eq!(schedule(at(50), at(0)), at(50));
        // Past the window: brought back to two timeouts before it.
        assert_eq!(schedule(at(300), at(0)), at(80));
        // Too late to bring back: left for the attempt that reconciles or holds it.
        assert_eq!(schedule(at(300), at(85)), at(300));
        assert_eq!(
            IdempotencyWindow::schedule(None, at(300), at(0), timeout),
            at(300)
        );
    }
}

//! The dispatcher's side of the idempotency window ([`crate::outbox::IdempotencyWindow`]):
//! every settlement carries when the operation was first maybe-applied and until when its key
//! protects it, the next attempt is scheduled within the window, and an operation past it is
//! reconciled or held; and answers that refuse the key itself.

use super::answer::settled;
use super::Dispatcher;
use crate::outbox::{
    self, AttemptKind, IdempotencyWindow, Leased, OutboxState, Outcome, Settlement,
};
use std::time::{Duration, Instant};

/// How a downstream refused the idempotency key rather than the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyRefusal {
    /// An earlier request with this key is still being processed (Stripe's 409
    /// `idempotency_key_in_use`; a 409 of the IETF draft that names the key).
    InUse,
    /// The key was first used with other parameters (Stripe's 400 `idempotency_error`; a 422
    /// of the IETF draft).
    OtherParameters,
}

/// Whether an answer refuses the key rather than the request: only a 400, 409 or 422 that
/// speaks of idempotency, so an ordinary refusal stays what it is. A key still in use (an
/// earlier request being processed) may be applied; a key first used with other parameters
/// (Stripe's `idempotency_error`, the IETF draft's 422, a 409 "reused with a different
/// intent") is never sent again.
pub(super) fn key_refusal(status: u16, body: &str) -> Option<KeyRefusal> {
    let body = body.to_ascii_lowercase();
    if !body.contains("idempot") {
        return None;
    }
    let any = |words: &[&str]| words.iter().any(|word| body.contains(word));
    let in_use = any(&[
        "idempotency_key_in_use",
        "in progress",
        "in-progress",
        "concurrent",
    ]);
    let other_parameters = any(&["idempotency_error", "parameter", "different", "mismatch"]);
    match status {
        400 | 409 | 422 if in_use => Some(KeyRefusal::InUse),
        400 | 409 | 422 if other_parameters => Some(KeyRefusal::OtherParameters),
        409 => Some(KeyRefusal::InUse),
        _ => None,
    }
}

impl Dispatcher {
    /// Until when the key of `row` protects it, with its destination's window; None while
    /// nothing was maybe-applied or the window is unknown.
    pub(super) fn protected_until(&self, row: &Leased) -> Option<chrono::DateTime<chrono::Utc>> {
        self.settings
            .destinations
            .window(&row.origin)
            .until(row.maybe_applied_at)
    }

    /// Whether a delivery started now could reach the downstream after the window of `row`.
    pub(super) fn past_window(&self, row: &Leased) -> bool {
        let until = self.protected_until(row);
        IdempotencyWindow::passed(until, chrono::Utc::now(), self.settings.request_timeout)
    }

    /// The settlement with the window's facts: when the operation was first maybe-applied
    /// (this attempt, if its outcome is unknown and it is the first), until when its key
    /// protects it, and its next attempt moved within that window when there is time.
    pub(super) fn windowed(
        &self,
        row: &Leased,
        settlement: &Settlement,
        outcome: Outcome,
        started: chrono::DateTime<chrono::Utc>,
    ) -> Settlement {
        let since = outcome.maybe_applied().then_some(started);
        let first = row.maybe_applied_at.or(since);
        let until = self.settings.destinations.window(&row.origin).until(first);
        let next = settlement.next_attempt_at.map(|next| {
            IdempotencyWindow::schedule(
                until,
                next,
                chrono::Utc::now(),
                self.settings.request_timeout,
            )
        });
        Settlement {
            next_attempt_at: next,
            maybe_applied_since: since,
            idempotent_until: until,
            ..settlement.clone()
        }
    }

    /// Holds an operation past its window without a reconcile URL: `uncertain`, with the
    /// reason, never sent again by a dispatcher; an operator decides.
    pub(super) async fn hold(&self, row: &Leased, lease_deadline: Instant) -> sqlx::Result<()> {
        let window = self.settings.destinations.window(&row.origin).0;
        let since = row.maybe_applied_at.unwrap_or_else(chrono::Utc::now);
        let reason = outbox::past_window_reason(&row.origin, window.unwrap_or_default(), since);
        tracing::warn!(operation = %row.operation_key, destination = %row.origin, "Holding an operation past its idempotency window for an operator: sent again, it could be applied twice.");
        let settlement = Settlement {
            held: true,
            ..settled(OutboxState::Uncertain, None, Some(reason))
        };
        let attempt = self.attempt_record(
            AttemptKind::Deliver,
            chrono::Utc::now(),
            Duration::ZERO,
            Outcome::PastWindow,
        );
        self.settle(row, &settlement, &attempt, lease_deadline)
            .await
    }

    /// The settlement of an answer that refused the key itself.
    pub(super) fn refused_key(
        &self,
        row: &Leased,
        refusal: KeyRefusal,
        status: Option<i32>,
        body: String,
    ) -> (Outcome, Settlement) {
        match refusal {
            KeyRefusal::InUse => (
                Outcome::KeyInUse,
                Settlement {
                    next_attempt_at: Some(self.next_attempt(row, None)),
                    response: Some(body),
                    ..settled(
                        row.unless_out_of_attempts(OutboxState::Uncertain),
                        status,
                        Some("the downstream is still processing an earlier request with this idempotency key: it may be applied; asked again later".into()),
                    )
                },
            ),
            KeyRefusal::OtherParameters => (
                Outcome::KeyMismatch,
                Settlement {
                    response: Some(body),
                    ..settled(
                        OutboxState::Failed,
                        status,
                        Some("the downstream refused the idempotency key as first used with other parameters; replayproof sends an operation's stored bytes on every attempt, so another request used this key: another client, the body changed outside replayproof, or an obligation sent again by a later event after prune removed the event that held it; not sent again".into()),
                    )
                },
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_about_the_key_is_a_key_refusal() {
        let stripe_in_use = r#"{"error":{"code":"idempotency_key_in_use","message":"There is currently another in-progress request using this Idempotent Key"}}"#;
        let stripe_params = r#"{"error":{"type":"idempotency_error","message":"Keys for idempotent requests can only be used with the same parameters they were first used with."}}"#;
        assert_eq!(key_refusal(409, stripe_in_use), Some(KeyRefusal::InUse));
        assert_eq!(key_refusal(400, stripe_in_use), Some(KeyRefusal::InUse));
        assert_eq!(
            key_refusal(400, stripe_params),
            Some(KeyRefusal::OtherParameters)
        );
        let draft = "Idempotency-Key is already used with a different request payload";
        assert_eq!(key_refusal(422, draft), Some(KeyRefusal::OtherParameters));
        let reused = "the Idempotency-Key is being reused with a different intent";
        assert_eq!(key_refusal(409, reused), Some(KeyRefusal::OtherParameters));
        let draft_409 = "a request with this Idempotency-Key is outstanding";
        assert_eq!(key_refusal(409, draft_409), Some(KeyRefusal::InUse));
        // Ordinary refusals stay ordinary.
        assert_eq!(key_refusal(400, r#"{"error":"amount is missing"}"#), None);
        assert_eq!(key_refusal(409, "order already shipped"), None);
        assert_eq!(key_refusal(422, "invalid parameter: amount"), None);
        assert_eq!(key_refusal(404, "idempotency_error"), None);
    }
}

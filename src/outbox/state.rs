//! The outbox's states and the outcomes of an attempt, each spelled out in this one place.

use serde::Serialize;

/// Where an operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum OutboxState {
    /// Enqueued, never attempted.
    Pending,
    /// Leased to a worker that is sending it.
    InProgress,
    /// Not delivered (refused connection, 5xx, 429): sent again after a backoff.
    Retryable,
    /// May have been applied (a timeout, a cut connection): reconciled, or sent again with
    /// the same idempotency key.
    Uncertain,
    /// Acknowledged downstream.
    Done,
    /// Refused downstream (4xx, a redirect): kept for an operator.
    Failed,
    /// Out of attempts, or given up by an operator.
    Dead,
}

impl OutboxState {
    /// Every state, in the order of an operation's life.
    pub const ALL: [Self; 7] = [
        Self::Pending,
        Self::InProgress,
        Self::Retryable,
        Self::Uncertain,
        Self::Done,
        Self::Failed,
        Self::Dead,
    ];

    /// The state as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::InProgress => "in_progress",
            Self::Retryable => "retryable",
            Self::Uncertain => "uncertain",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Dead => "dead",
        }
    }

    /// Whether an operator may send it again: it failed, its outcome is unknown, or it is dead.
    pub fn is_retryable_by_hand(self) -> bool {
        matches!(self, Self::Failed | Self::Uncertain | Self::Dead)
    }
}

impl std::fmt::Display for OutboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OutboxState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| format!("{s:?} is not an outbox state"))
    }
}

/// What an attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum AttemptKind {
    /// Sent the operation.
    Deliver,
    /// Asked the downstream whether it already has the operation.
    Reconcile,
}

impl AttemptKind {
    /// The kind as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Deliver => "deliver",
            Self::Reconcile => "reconcile",
        }
    }
}

/// How an attempt ended, as recorded and as the metric's bounded label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// 2xx.
    Done,
    /// 3xx: recorded with its Location, never followed.
    Redirected,
    /// A 4xx that will not change.
    Failed,
    /// 5xx, 429 and other answers worth another try.
    Retryable,
    /// The connection was refused: nothing was sent.
    Refused,
    /// The request left and no answer came back.
    Uncertain,
    /// The downstream confirmed it has the operation.
    ReconciledDone,
    /// The downstream could not say.
    ReconcileUnknown,
    /// Too little of the lease was left to send; given back.
    LeaseShort,
    /// The request could not be built (a header or URL that HTTP cannot carry): nothing was
    /// sent, and sending again would fail the same way.
    Unsendable,
    /// Not sent: past the destination's idempotency window after an attempt whose outcome is
    /// unknown; held for an operator.
    PastWindow,
    /// The downstream is still processing an earlier request with the same key (Stripe's
    /// `idempotency_key_in_use`, a 409): it may be applied; asked again later.
    KeyInUse,
    /// The downstream refused the key as first used with other parameters (Stripe's
    /// `idempotency_error`, a 422 of the IETF draft): never a plain 4xx of the request.
    KeyMismatch,
}

impl Outcome {
    /// Whether the request may have been applied without the answer saying so: its idempotency
    /// window runs from this attempt when it is the first.
    pub fn maybe_applied(self) -> bool {
        matches!(self, Self::Uncertain | Self::KeyInUse)
    }

    /// Every outcome.
    pub const ALL: [Self; 13] = [
        Self::Done,
        Self::Redirected,
        Self::Failed,
        Self::Retryable,
        Self::Refused,
        Self::Uncertain,
        Self::ReconciledDone,
        Self::ReconcileUnknown,
        Self::LeaseShort,
        Self::Unsendable,
        Self::PastWindow,
        Self::KeyInUse,
        Self::KeyMismatch,
    ];

    /// The outcome as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Redirected => "redirected",
            Self::Failed => "failed",
            Self::Retryable => "retryable",
            Self::Refused => "refused",
            Self::Uncertain => "uncertain",
            Self::ReconciledDone => "reconciled_done",
            Self::ReconcileUnknown => "reconcile_unknown",
            Self::LeaseShort => "lease_short",
            Self::Unsendable => "unsendable",
            Self::PastWindow => "past_window",
            Self::KeyInUse => "key_in_use",
            Self::KeyMismatch => "key_mismatch",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stored text (sqlx and serde derive it) and the metric label (`as_str`) are one spelling.
    #[test]
    fn every_spelling_agrees() {
        let spelled = |value: serde_json::Value, label: &str| assert_eq!(value, label);
        for state in OutboxState::ALL {
            spelled(serde_json::to_value(state).unwrap(), state.as_str());
        }
        for kind in [AttemptKind::Deliver, AttemptKind::Reconcile] {
            spelled(serde_json::to_value(kind).unwrap(), kind.as_str());
        }
        for outcome in Outcome::ALL {
            spelled(serde_json::to_value(outcome).unwrap(), outcome.as_str());
        }
    }
}

//! The read model's story of one event: everything known about it as typed moments, in the
//! order they happened. The console renders each moment; nothing here knows of HTML.

use super::events::{self, EventDetail};
use super::OperatorError;
use crate::audit::ActionRow;
use crate::claims::conflicts::ConflictRow;
use crate::claims::dead_letters::DeadLetterRow;
use crate::claims::ClaimStatus;
use crate::db::Db;
use crate::effect::ledger::LedgerRow;
use crate::outbox::{AttemptRow, FulfilledRow, OperationRow, OutboxState};
use chrono::{DateTime, Utc};
use serde::Serialize;

/// One moment of an event's story.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "moment", rename_all = "snake_case")]
pub enum Moment {
    /// Ingest accepted the delivery.
    Received {
        at: DateTime<Utc>,
        source: String,
        event_type: Option<String>,
        request_id: Option<String>,
    },
    /// The Kafka message the claim was made from, as `topic/partition@offset`.
    Message {
        at: DateTime<Utc>,
        key: String,
        position: String,
    },
    /// The claim, as it stands.
    Claimed {
        at: DateTime<Utc>,
        status: ClaimStatus,
        attempts: i32,
        settled_at: Option<DateTime<Utc>>,
        last_error: Option<String>,
    },
    /// The key was delivered again: every delivery after the claimed one was suppressed.
    Redelivered {
        /// When it was last delivered.
        at: DateTime<Utc>,
        /// When the claimed delivery was.
        first: DateTime<Utc>,
        deliveries: i32,
    },
    /// The effect said "not yet".
    Deferred {
        at: DateTime<Utc>,
        reason: Option<String>,
        due: Option<DateTime<Utc>>,
        deadline: Option<DateTime<Utc>>,
    },
    /// A row the ledger effect wrote.
    Ledger(LedgerRow),
    /// An outbox operation of the event, as it stands (dated by the claim that enqueued it).
    Operation {
        at: DateTime<Utc>,
        operation: OperationRow,
    },
    /// An operation another event's operation fulfils: both named one obligation.
    Fulfilled(FulfilledRow),
    /// One attempt (or reconciliation) of an operation.
    Attempt(AttemptRow),
    /// Another payload under the same key, with the payload kept when it is stored.
    Conflict {
        conflict: ConflictRow,
        kept: Option<String>,
    },
    DeadLetter(DeadLetterRow),
    /// A change an operator made.
    Operator(ActionRow),
}

impl Moment {
    /// When it happened.
    pub fn at(&self) -> DateTime<Utc> {
        match self {
            Self::Received { at, .. }
            | Self::Message { at, .. }
            | Self::Claimed { at, .. }
            | Self::Deferred { at, .. }
            | Self::Redelivered { at, .. }
            | Self::Operation { at, .. } => *at,
            Self::Ledger(row) => row.applied_at,
            Self::Fulfilled(row) => row.recorded_at,
            Self::Attempt(row) => row.started_at,
            Self::Conflict { conflict, .. } => conflict.first_seen_at,
            Self::DeadLetter(row) => row.created_at,
            Self::Operator(row) => row.at,
        }
    }

    /// Keeps moments of one instant in the order they happen.
    fn order(&self) -> u8 {
        match self {
            Self::Received { .. } => 0,
            Self::Message { .. } => 1,
            Self::Claimed { .. } => 2,
            Self::Deferred { .. } => 3,
            Self::Ledger(_) => 4,
            Self::Operation { .. } | Self::Fulfilled(_) => 5,
            Self::Attempt(_) => 6,
            Self::Conflict { .. } | Self::Redelivered { .. } => 7,
            Self::DeadLetter(_) => 8,
            Self::Operator(_) => 9,
        }
    }

    /// Whether it is something an operator should look at.
    pub fn bad(&self) -> bool {
        match self {
            Self::Claimed { status, .. } => {
                matches!(status, ClaimStatus::Failed | ClaimStatus::Dead)
            }
            Self::Operation { operation, .. } => matches!(
                operation.state,
                OutboxState::Failed | OutboxState::Dead | OutboxState::Uncertain
            ),
            Self::Attempt(row) => row.outcome.as_str() != "done",
            Self::Conflict { .. } | Self::DeadLetter(_) => true,
            _ => false,
        }
    }

    /// Its headline.
    pub fn what(&self) -> String {
        match self {
            Self::Received { .. } => "received".into(),
            Self::Message { .. } => "Kafka message".into(),
            Self::Claimed { status, .. } => format!("claimed: {status}"),
            Self::Deferred { .. } => "deferred".into(),
            Self::Redelivered { deliveries, .. } => format!(
                "delivered {deliveries} times, {} suppressed as duplicates",
                deliveries - 1
            ),
            Self::Ledger(_) => "effect: ledger row".into(),
            Self::Operation { operation, .. } => format!(
                "operation {}: {}",
                short(&operation.operation_key),
                operation.state
            ),
            Self::Fulfilled(row) => {
                format!("operation {}: fulfilled by another event", row.operation)
            }
            Self::Attempt(row) => format!(
                "{} of {}: {}",
                if row.kind.as_str() == "reconcile" {
                    "reconciliation"
                } else {
                    "attempt"
                },
                row.operation,
                row.outcome.as_str()
            ),
            Self::Conflict { conflict, .. } => format!(
                "key conflict: another payload, seen {} time(s)",
                conflict.times_seen
            ),
            Self::DeadLetter(_) => "dead letter".into(),
            Self::Operator(row) => format!("operator {}: {}", row.action, row.actor),
        }
    }
}

/// The operation's name, from its key (`key#name`).
pub fn short(operation_key: &str) -> &str {
    operation_key
        .rsplit_once('#')
        .map(|(_, n)| n)
        .unwrap_or(operation_key)
}

/// One event's story: what is known of it, and its moments in order.
#[derive(Debug, Clone, Serialize)]
pub struct Story {
    pub detail: EventDetail,
    pub moments: Vec<Moment>,
}

/// The story of `key`, with the operators' changes to it and to its dead letters.
pub async fn of_event(pool: &Db, key: &str) -> Result<Story, OperatorError> {
    let detail = events::show(pool, key).await?;
    let letters: Vec<String> = detail
        .dead_letters
        .iter()
        .map(|l| format!("dead_letter:{}", l.id))
        .collect();
    let actions = crate::audit::of_event(pool, key, &letters).await?;
    let moments = moments(&detail, actions);
    Ok(Story { detail, moments })
}

/// Every moment of `detail` and the operators' `actions`, oldest first.
pub fn moments(detail: &EventDetail, actions: Vec<ActionRow>) -> Vec<Moment> {
    let mut out = claim_moments(detail);
    out.extend(detail.ledger.iter().cloned().map(Moment::Ledger));
    out.extend(detail.operations.iter().map(|o| Moment::Operation {
        at: detail.claim.claimed_at,
        operation: o.clone(),
    }));
    out.extend(detail.fulfilled_by.iter().cloned().map(Moment::Fulfilled));
    out.extend(detail.attempts.iter().cloned().map(Moment::Attempt));
    let kept = detail
        .claim
        .payload
        .as_ref()
        .map(|p| p.get().to_owned())
        .or_else(|| detail.ledger.first().map(|l| l.payload.get().to_owned()));
    out.extend(detail.key_conflicts.iter().map(|c| Moment::Conflict {
        conflict: c.clone(),
        kept: kept.clone(),
    }));
    out.extend(detail.dead_letters.iter().cloned().map(Moment::DeadLetter));
    out.extend(actions.into_iter().map(Moment::Operator));
    in_order(&mut out);
    out
}

/// Sorts moments by time, those of one instant in the order they happen.
pub fn in_order(moments: &mut [Moment]) {
    moments.sort_by_key(|m| (m.at(), m.order()));
}

/// The claim's own moments: received, its message, the claim, and its deferral.
fn claim_moments(detail: &EventDetail) -> Vec<Moment> {
    let claim = &detail.claim;
    let mut out = vec![
        Moment::Received {
            at: claim.received_at.unwrap_or(claim.claimed_at),
            source: claim.source.clone(),
            event_type: claim.event_type.clone(),
            request_id: claim.request_id.clone(),
        },
        Moment::Message {
            at: claim.claimed_at,
            key: claim.event_key.clone(),
            position: claim.first_seen_at.clone(),
        },
        Moment::Claimed {
            at: claim.claimed_at,
            status: claim.status,
            attempts: claim.attempts,
            settled_at: claim.completed_at,
            last_error: claim.last_error.clone(),
        },
    ];
    if claim.deliveries > 1 {
        out.push(Moment::Redelivered {
            at: claim.last_seen_at,
            first: claim.claimed_at,
            deliveries: claim.deliveries,
        });
    }
    if claim.due_at.is_some() || claim.deferred_reason.is_some() {
        out.push(Moment::Deferred {
            at: claim.claimed_at,
            reason: claim.deferred_reason.clone(),
            due: claim.due_at,
            deadline: claim.deadline_at,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn moments_go_by_time_and_those_of_one_instant_in_the_order_they_happen() {
        let claimed = Moment::Claimed {
            at: at(5),
            status: ClaimStatus::Failed,
            attempts: 3,
            settled_at: None,
            last_error: Some("boom".into()),
        };
        let message = Moment::Message {
            at: at(5),
            key: "s:1".into(),
            position: "t/0@7".into(),
        };
        let received = Moment::Received {
            at: at(1),
            source: "s".into(),
            event_type: None,
            request_id: None,
        };
        let deferred = Moment::Deferred {
            at: at(5),
            reason: None,
            due: None,
            deadline: None,
        };
        let redelivered = Moment::Redelivered {
            at: at(9),
            first: at(5),
            deliveries: 3,
        };
        let mut moments = vec![redelivered, deferred, claimed, message, received];
        in_order(&mut moments);
        let what: Vec<String> = moments.iter().map(Moment::what).collect();
        assert_eq!(
            what,
            [
                "received",
                "Kafka message",
                "claimed: failed",
                "deferred",
                "delivered 3 times, 2 suppressed as duplicates"
            ]
        );
        assert!(moments[2].bad(), "a failed claim is to be looked at");
        assert!(!moments[0].bad() && !moments[3].bad());
    }

    #[test]
    fn an_operation_is_named_by_the_end_of_its_key() {
        assert_eq!(short("stripe:evt_1#notify"), "notify");
        assert_eq!(short("no-operation"), "no-operation");
    }
}

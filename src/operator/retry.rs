//! `events retry` of an event's operations: sent again with the same key and payload, unless
//! done, on their way, erased, or past their idempotency window without the operator accepting
//! the risk; an event without operations has its local effect run again
//! ([`super::events::retry_local`]).

use super::events::retry_local;
use super::{Act, Change, OperatorError};
use crate::db::Db;
use crate::effect::{Effect, Registry};
use crate::outbox::{self, OutboxState};
use std::sync::Arc;

/// What a retry runs.
#[derive(Clone, Default)]
pub struct Retry {
    /// Only this operation of the event.
    pub operation: Option<String>,
    /// The effect to run again for a failed local effect, instead of the one recorded on its
    /// claim (needed only for an effect the registry cannot build by name).
    pub effect: Option<Arc<dyn Effect>>,
    /// Sends operations past their idempotency window too, which the downstream could apply a
    /// second time; the audit row says so.
    pub accept_duplicate_risk: bool,
}

/// Sends an event's `failed`, `uncertain` or `dead` operations again, with the same idempotency
/// key and payload; an event without operations whose local effect failed or deferred has the
/// effect run again, now, from its stored payload. `done` is refused, and so is an operation
/// already on its way or whose body was erased.
pub async fn retry(
    pool: &Db,
    registry: &Registry,
    key: &str,
    retry: &Retry,
    act: &Act,
) -> Result<Vec<Change>, OperatorError> {
    let mut tx = pool.begin().await?;
    let ops = outbox::lock_of_event(&mut tx, key, retry.operation.as_deref()).await?;
    if ops.is_empty() {
        drop(tx);
        return retry_local(pool, registry, key, retry.effect.clone(), act).await;
    }
    let mut changes = Vec::new();
    for op in ops {
        match op.state {
            state if state.is_retryable_by_hand() && op.erased => {
                return Err(OperatorError::BodyErased(op.operation_key))
            }
            state if state.is_retryable_by_hand() => {
                if op.past_window && !retry.accept_duplicate_risk {
                    return Err(OperatorError::PastWindow(op.operation_key));
                }
                outbox::requeue(&mut tx, op.id, op.past_window).await?;
                let change = Change::new(&op.operation_key, state, OutboxState::Pending);
                let act = match op.past_window {
                    true => accepting_risk(act),
                    false => act.clone(),
                };
                crate::audit::record(&mut tx, act.audit("retry", &change)).await?;
                changes.push(change);
            }
            OutboxState::Done => return Err(OperatorError::AlreadyDone(op.operation_key)),
            state => {
                return Err(OperatorError::OnItsWay {
                    target: op.operation_key,
                    state: state.to_string(),
                })
            }
        }
    }
    tx.commit().await?;
    Ok(changes)
}

/// The act of sending an operation past its idempotency window: the audit row says the
/// operator accepted the risk of a second application.
fn accepting_risk(act: &Act) -> Act {
    Act {
        reason: format!(
            "{} (accepted the duplicate risk: past the idempotency window)",
            act.reason
        ),
        ..act.clone()
    }
}

//! `events show`, `retry` and `resolve`: everything known about one event, and its claim and
//! operations moved by hand.

pub use super::bulk_retry::{to_retry, RetryFilter};
pub use super::retry::{retry, Retry};
use super::{Act, Change, OperatorError};
use crate::claims::{self, conflicts, dead_letters, ClaimStatus};
use crate::consume::settle::{self, Next, Policy, Standing};
use crate::consume::EffectRetry;
use crate::db::Db;
use crate::effect::{ledger, Effect, EffectError, Registry};
use crate::outbox::{self, OutboxState};
use chrono::Utc;
use serde::Serialize;
use sqlx::PgConnection;
use std::sync::Arc;

/// Everything known about one event.
#[derive(Debug, Clone, Serialize)]
pub struct EventDetail {
    pub claim: claims::ClaimRow,
    pub ledger: Vec<ledger::LedgerRow>,
    pub operations: Vec<outbox::OperationRow>,
    /// Its operations fulfilled by another event's: both named one obligation.
    pub fulfilled_by: Vec<outbox::FulfilledRow>,
    pub attempts: Vec<outbox::AttemptRow>,
    /// Its records for Kafka output topics: where each is (topic, partition, offset) and
    /// whether it is known to be there.
    pub output_records: Vec<crate::output::store::EventRecord>,
    pub dead_letters: Vec<dead_letters::DeadLetterRow>,
    pub key_conflicts: Vec<conflicts::ConflictRow>,
}

/// An event's claim, effect rows, operations, every attempt, dead letters and key conflicts.
pub async fn show(pool: &Db, key: &str) -> Result<EventDetail, OperatorError> {
    let claim = claims::find(pool, key)
        .await?
        .ok_or_else(|| OperatorError::NoSuchEvent(key.into()))?;
    Ok(EventDetail {
        claim,
        ledger: ledger::of_event(pool, key).await?,
        operations: outbox::of_event(pool, key).await?,
        fulfilled_by: outbox::fulfilled_of_event(pool, key).await?,
        attempts: outbox::attempts_of_event(pool, key).await?,
        output_records: crate::output::store::of_event(pool, key).await?,
        dead_letters: dead_letters::of_key(pool, key).await?,
        key_conflicts: conflicts::of_event(pool, key).await?,
    })
}

/// Runs a failed or deferred local effect again, now, once, in one transaction with its claim's
/// change and audit row. What becomes of the claim is the consumer's rule
/// ([`settle::next`]), with the deferral policy stored on the claim: an effect that defers again
/// leaves it `deferred` (from `failed`, with a fresh deadline from that policy); a transient
/// failure changes nothing.
pub(super) async fn retry_local(
    pool: &Db,
    registry: &Registry,
    key: &str,
    given: Option<Arc<dyn Effect>>,
    act: &Act,
) -> Result<Vec<Change>, OperatorError> {
    let mut tx = pool.begin().await?;
    let claim = claims::lock(&mut tx, key)
        .await?
        .ok_or_else(|| OperatorError::NoSuchEvent(key.into()))?;
    if !matches!(claim.status, ClaimStatus::Failed | ClaimStatus::Deferred) {
        return Err(OperatorError::NotRetryable {
            key: key.into(),
            status: claim.status.to_string(),
        });
    }
    let ran = run_again(&mut tx, registry, key, &claim, given, act, "retry").await?;
    tx.commit().await?;
    ran.answer(key)
}

/// What running a stored claim's effect again did, in a transaction not yet committed.
pub(super) struct RanAgain {
    change: Change,
    next: Next,
    outcome: Result<(), EffectError>,
}

impl RanAgain {
    /// The operator's answer once the transaction committed.
    pub(super) fn answer(self, key: &str) -> Result<Vec<Change>, OperatorError> {
        match self.next {
            Next::Applied => Ok(vec![self.change]),
            Next::Defer { reason, due, .. } => Err(OperatorError::StillDeferred {
                key: key.into(),
                reason,
                due,
            }),
            _ => Err(failed(key, self.outcome)),
        }
    }
}

/// Runs the effect of the locked `claim` once, in `tx`, moves the claim as the consumer's rule
/// says and audits it as `action`. A transient failure changes nothing and is an error: the
/// caller rolls back.
pub(super) async fn run_again(
    tx: &mut PgConnection,
    registry: &Registry,
    key: &str,
    claim: &claims::StoredClaim,
    given: Option<Arc<dyn Effect>>,
    act: &Act,
    action: &str,
) -> Result<RanAgain, OperatorError> {
    let effect = effect_to_run(registry, key, given, claim.effect_spec.as_ref())?;
    let event = claim.event(key)?;
    let outcome = crate::effect::apply_in_savepoint(tx, effect.as_ref(), &event).await?;
    let policy = Policy {
        defer: settle::policy_in_force(claim, || effect.defer_policy().unwrap_or_default()),
        retry: ONE_TRY,
    };
    let standing = Standing::stored(claim, 1);
    let next = settle::next(outcome.as_ref().copied(), standing, &policy, Utc::now());
    let after = match carry_out(tx, key, &next, &policy).await? {
        Some(after) => after,
        None => return Err(failed(key, outcome)),
    };
    let change = Change::new(key, claim.status, after);
    crate::audit::record(tx, act.audit(action, &change)).await?;
    Ok(RanAgain {
        change,
        next,
        outcome,
    })
}

/// An operator's retry is one try: a failure settles the claim at once.
const ONE_TRY: EffectRetry = EffectRetry {
    attempts: 1,
    backoff: std::time::Duration::ZERO,
};

/// Moves the claim as the rule said; None when nothing changes (a transient failure).
async fn carry_out(
    tx: &mut PgConnection,
    key: &str,
    next: &Next,
    policy: &Policy,
) -> Result<Option<ClaimStatus>, OperatorError> {
    Ok(Some(match next {
        Next::Applied => {
            claims::record_attempt(tx, key, None).await?;
            ClaimStatus::Done
        }
        Next::Defer {
            reason,
            due,
            deadline,
        } => {
            claims::redefer(tx, key, reason, *due, *deadline, &policy.defer).await?;
            ClaimStatus::Deferred
        }
        Next::Failed { error } | Next::Retry { error, .. } => {
            claims::record_attempt(tx, key, Some(error)).await?;
            ClaimStatus::Failed
        }
        Next::Postpone { .. } => return Ok(None),
    }))
}

fn failed(key: &str, outcome: Result<(), EffectError>) -> OperatorError {
    let error = match outcome {
        Ok(()) => anyhow::anyhow!("the effect applied"),
        Err(e) => e.into(),
    };
    OperatorError::EffectFailed {
        key: key.into(),
        error,
    }
}

/// The effect a retry runs: the one given, which must match what the claim recorded, or the
/// recorded one rebuilt by the registry.
fn effect_to_run(
    registry: &Registry,
    key: &str,
    given: Option<Arc<dyn Effect>>,
    recorded: Option<&serde_json::Value>,
) -> Result<Arc<dyn Effect>, OperatorError> {
    match (given, recorded) {
        (Some(given), Some(recorded)) => match given.spec() {
            Some(spec) if &spec != recorded => Err(OperatorError::OtherEffects {
                key: key.into(),
                recorded: Box::new(recorded.clone()),
                given: Box::new(spec),
            }),
            _ => Ok(given),
        },
        (Some(given), None) => Ok(given),
        (None, Some(recorded)) => Ok(registry
            .from_spec(recorded)
            .map_err(|e| e.context(format!("rebuilding the effects recorded on {key}")))?),
        (None, None) => Err(OperatorError::EffectNotRecorded(key.into())),
    }
}

/// How an operator settles an event by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Resolution {
    /// The outcome was confirmed elsewhere.
    Done,
    /// It will not happen.
    Dead,
}

impl Resolution {
    fn operation_state(self) -> OutboxState {
        match self {
            Self::Done => OutboxState::Done,
            Self::Dead => OutboxState::Dead,
        }
    }

    fn claim_status(self) -> ClaimStatus {
        match self {
            Self::Done => ClaimStatus::Done,
            Self::Dead => ClaimStatus::Dead,
        }
    }
}

/// Settles an event by hand: its operations that are not done and not under a live lease, and
/// its failed or deferred claim.
pub async fn resolve(
    pool: &Db,
    key: &str,
    operation: Option<&str>,
    to: Resolution,
    act: &Act,
) -> Result<Vec<Change>, OperatorError> {
    let mut tx = pool.begin().await?;
    let mut changes = resolve_operations(&mut tx, key, operation, to, act).await?;
    let claim = claims::lock(&mut tx, key)
        .await?
        .ok_or_else(|| OperatorError::NoSuchEvent(key.into()))?;
    if matches!(claim.status, ClaimStatus::Failed | ClaimStatus::Deferred) {
        claims::resolve(&mut tx, key, to.claim_status()).await?;
        let change = Change::new(key, claim.status, to.claim_status());
        crate::audit::record(&mut tx, act.audit("resolve", &change)).await?;
        changes.push(change);
    }
    if changes.is_empty() {
        return Err(OperatorError::NothingToResolve(key.into()));
    }
    tx.commit().await?;
    Ok(changes)
}

async fn resolve_operations(
    tx: &mut PgConnection,
    key: &str,
    operation: Option<&str>,
    to: Resolution,
    act: &Act,
) -> Result<Vec<Change>, OperatorError> {
    let mut changes = Vec::new();
    for op in outbox::lock_of_event(tx, key, operation).await? {
        if op.state == OutboxState::Done {
            continue;
        }
        if op.state == OutboxState::InProgress && op.leased {
            return Err(OperatorError::LeaseLive(op.operation_key));
        }
        outbox::resolve(tx, op.id, to.operation_state()).await?;
        let change = Change::new(&op.operation_key, op.state, to.operation_state());
        crate::audit::record(tx, act.audit("resolve", &change)).await?;
        changes.push(change);
    }
    Ok(changes)
}

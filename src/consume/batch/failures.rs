//! The events of a batch whose effect did not apply, settled by the one rule
//! ([`crate::consume::settle::next`]) in the batch's transaction.

use super::guarded::EffectFailure;
use super::{Attempts, BatchProcessor, BatchReport, Outcome, RunError};
use crate::claims::{self, Deferral, Failure};
use crate::consume::settle::{self, Next, Policy, Standing};
use crate::effect::EffectError;
use crate::envelope::Event;
use sqlx::{Postgres, Transaction};
use std::time::Duration;

/// An event to try again in a later transaction, after `after`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Again {
    pub(super) offset: i64,
    pub(super) after: Duration,
}

/// A batch's failed events, by what becomes of them.
#[derive(Default)]
struct Sorted<'e> {
    failed: Vec<Failure<'e>>,
    deferred: Vec<Deferral<'e>>,
    /// With each, its event key and route key.
    again: Vec<((&'e str, &'e str), Again)>,
}

impl BatchProcessor {
    /// The rules in force for an event of this batch.
    pub(super) fn policy_for(&self, event: &Event) -> Policy {
        Policy {
            defer: self.defer.policy(&event.source, &*self.effect),
            retry: self.retry,
        }
    }

    /// Settles each failed event: deferred, its claim becomes `deferred` with the payload, its
    /// due time and the policy in force; failed for good or out of attempts, `failed` with the
    /// error and the payload; otherwise its claim is taken back and it is returned, to be tried
    /// again in a later transaction.
    pub(super) async fn settle_failures(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        failures: &[EffectFailure<'_>],
        attempts: &Attempts,
        report: &mut BatchReport,
    ) -> Result<Vec<Again>, RunError> {
        let sorted = self.sort_failures(failures, attempts)?;
        report.effect_errors += failures.len() - sorted.deferred.len();
        for f in &sorted.failed {
            report.tally(&f.event.source, Outcome::Failed);
        }
        for d in &sorted.deferred {
            report.tally(&d.event.source, Outcome::Deferred);
        }
        let spec = self.effect.spec();
        if !sorted.failed.is_empty() {
            claims::fail(tx, &sorted.failed, spec.as_ref()).await?;
        }
        if !sorted.deferred.is_empty() {
            claims::defer(tx, &sorted.deferred, spec.as_ref()).await?;
        }
        if !sorted.again.is_empty() {
            let keys: Vec<(&str, &str)> = sorted.again.iter().map(|(key, _)| *key).collect();
            claims::release(tx, &keys).await?;
        }
        Ok(sorted.again.into_iter().map(|(_, a)| a).collect())
    }

    /// What the rule says for each failed event.
    fn sort_failures<'e>(
        &self,
        failures: &[EffectFailure<'e>],
        attempts: &Attempts,
    ) -> Result<Sorted<'e>, RunError> {
        let now = chrono::Utc::now();
        let mut sorted = Sorted::default();
        for f in failures {
            let attempt = attempts.get(&f.offset).copied().unwrap_or(0) + 1;
            let policy = self.policy_for(f.event);
            let key = f.event.key.as_str();
            match settle::next(Err(&f.error), Standing::fresh(attempt), &policy, now) {
                Next::Defer {
                    reason,
                    due,
                    deadline,
                } => {
                    tracing::debug!(key, reason, %due, "An effect deferred its event.");
                    let (event, policy) = (f.event, policy.defer);
                    sorted.deferred.push(Deferral {
                        event,
                        reason,
                        due,
                        deadline,
                        policy,
                    });
                }
                Next::Failed { error } => {
                    self.log_failure(key, attempt, &error);
                    let (event, attempts, policy) = (f.event, attempt as i32, policy.defer);
                    sorted.failed.push(Failure {
                        event,
                        attempts,
                        error,
                        policy,
                    });
                }
                Next::Retry { after, error } => {
                    self.log_failure(key, attempt, &error);
                    let offset = f.offset;
                    let keys = (key, f.event.route_key());
                    sorted.again.push((keys, Again { offset, after }));
                }
                // Transient failures end the run before anything is settled.
                Next::Postpone { error, .. } => {
                    let error = EffectError::transient(anyhow::anyhow!(error));
                    return Err(RunError::Transient(error));
                }
                Next::Applied => {}
            }
        }
        Ok(sorted)
    }

    fn log_failure(&self, key: &str, attempt: u32, error: &str) {
        let effect = self.effect.name();
        tracing::warn!(key, attempt, effect, error, "An effect failed.");
    }
}

//! The one rule from an effect's answer to its claim's next state. The batch, the deferred
//! applier and an operator's `events retry` all ask [`next`]; each only carries its answer out
//! (a batch holds a retried event in its lane, the applier sleeps and tries again, an operator
//! gets one attempt).
//!
//! The deferral policy in force for an event is the one chosen when its claim was first settled
//! `deferred` or `failed`, stored on the claim ([`policy_in_force`]): a per-source policy
//! (`--defer-source stripe=72h`) then holds for the applier and for an operator's retry alike.

use super::EffectRetry;
use crate::claims::{ClaimStatus, StoredClaim};
use crate::effect::{later, DeferPolicy, Effect, EffectError};
use chrono::{DateTime, Utc};
use std::collections::BTreeMap;
use std::time::Duration;

/// How often the applier looks for due claims (`DeferSettings::poll_interval`).
pub const DEFAULT_DEFER_POLL: Duration = Duration::from_secs(1);

/// How long deferred events wait, by source and by effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeferSettings {
    /// For events whose source has no policy of its own and whose effect names none
    /// (`--defer-backoff`, `--defer-max-backoff`, `--defer-deadline`).
    pub default: DeferPolicy,
    /// Per source (`--defer-source`); wins over the effect's own policy.
    pub sources: BTreeMap<String, DeferPolicy>,
    /// How often the applier looks for due claims.
    pub poll_interval: Duration,
}

impl Default for DeferSettings {
    fn default() -> Self {
        Self {
            default: DeferPolicy::default(),
            sources: BTreeMap::new(),
            poll_interval: DEFAULT_DEFER_POLL,
        }
    }
}

impl DeferSettings {
    /// The policy for an event from `source` deferred by `effect`: the source's, else the
    /// effect's ([`Effect::defer_policy`]), else the default.
    pub fn policy(&self, source: &str, effect: &dyn Effect) -> DeferPolicy {
        self.sources
            .get(source)
            .copied()
            .or_else(|| effect.defer_policy())
            .unwrap_or(self.default)
    }
}

/// The policy in force for a stored claim: the one stored on it, else `otherwise` (a claim
/// settled before policies were stored).
pub fn policy_in_force(
    claim: &StoredClaim,
    otherwise: impl FnOnce() -> DeferPolicy,
) -> DeferPolicy {
    claim.defer_policy().unwrap_or_else(otherwise)
}

/// What is known of a claim when its effect answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// This try's number in the current series of tries (from 1), for a failure's retries.
    pub attempt: u32,
    /// Deferrals and postponements recorded on the claim so far; 0 for a fresh claim.
    pub deferrals: u32,
    /// The deadline of a claim that is deferred; None when this is its first deferral (from a
    /// fresh claim, or from `failed`), which sets a fresh one.
    pub deadline: Option<DateTime<Utc>>,
}

impl Standing {
    /// A claim made in this batch, at its `attempt`-th try.
    pub fn fresh(attempt: u32) -> Self {
        Self {
            attempt,
            deferrals: 0,
            deadline: None,
        }
    }

    /// A stored claim (deferred or failed), at the `attempt`-th try of this series. A claim
    /// held while its source was paused stands as a fresh one: the pause spends none of its
    /// effect's deferrals or deadline.
    pub fn stored(claim: &StoredClaim, attempt: u32) -> Self {
        if claim.held() {
            return Self::fresh(attempt);
        }
        let deferred = claim.status == ClaimStatus::Deferred;
        Self {
            attempt,
            deferrals: claim.attempts.max(0) as u32,
            deadline: claim.deadline_at.filter(|_| deferred),
        }
    }
}

/// The rules in force for one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// How long the event may be deferred, and the waits between.
    pub defer: DeferPolicy,
    /// How often a failing effect is tried before its event is settled `failed`.
    pub retry: EffectRetry,
}

/// A claim's next state after its effect answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// The effect applied: the claim is `done`.
    Applied,
    /// A failure with tries left: the event is tried again after `after`, in a later
    /// transaction; nothing of this try is kept.
    Retry {
        /// The wait before the next try.
        after: Duration,
        /// The failure, for the log.
        error: String,
    },
    /// Not yet: the claim is `deferred`, applied again at `due`, settled `failed` if it still
    /// defers at `deadline`.
    Defer {
        /// The effect's reason.
        reason: String,
        /// When the event is tried again; never past the deadline.
        due: DateTime<Utc>,
        /// The claim's deadline: kept from before, or fresh on a first deferral.
        deadline: DateTime<Utc>,
    },
    /// Trouble that says nothing about the event: nothing settles. A batch rolls back and runs
    /// again; a deferred claim stays deferred, due again at `due`; an operator's retry changes
    /// nothing.
    Postpone {
        /// When a deferred claim is tried again.
        due: DateTime<Utc>,
        /// The failure, kept on a deferred claim for `events show`.
        error: String,
    },
    /// Settled `failed`, with the reason kept for an operator.
    Failed {
        /// The failure, or why a deferral ended.
        error: String,
    },
}

/// The rule: what becomes of a claim whose effect answered `outcome` at `now`.
pub fn next(
    outcome: Result<(), &EffectError>,
    standing: Standing,
    policy: &Policy,
    now: DateTime<Utc>,
) -> Next {
    let error = match outcome {
        Ok(()) => return Next::Applied,
        Err(EffectError::NotYet(not_yet)) => return defer(not_yet, standing, policy, now),
        Err(e) => format!("{e:#}"),
    };
    match outcome {
        Err(EffectError::Transient(_)) => Next::Postpone {
            due: later(now, policy.defer.delay(standing.deferrals + 1)),
            error,
        },
        Err(EffectError::Failed(_)) if standing.attempt < policy.retry.attempts() => Next::Retry {
            after: policy.retry.delay(standing.attempt),
            error,
        },
        _ => Next::Failed { error },
    }
}

/// "Not yet": deferred until the effect's time or the policy's backoff, within the deadline;
/// `failed` with the reason once a deadline set before has passed.
fn defer(
    not_yet: &crate::effect::Deferred,
    standing: Standing,
    policy: &Policy,
    now: DateTime<Utc>,
) -> Next {
    match standing.deadline {
        Some(deadline) if now >= deadline => Next::Failed {
            error: format!(
                "still deferred at its deadline ({}): {}",
                deadline.to_rfc3339(),
                not_yet.reason
            ),
        },
        kept => {
            let deadline = kept.unwrap_or_else(|| policy.defer.deadline_from(now));
            Next::Defer {
                reason: not_yet.reason.clone(),
                due: policy
                    .defer
                    .due(not_yet, standing.deferrals + 1, now, deadline),
                deadline,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effect::Deferred;

    fn policy() -> Policy {
        Policy {
            defer: DeferPolicy {
                backoff: Duration::from_secs(10),
                max_backoff: Duration::from_secs(60),
                deadline: Duration::from_secs(3600),
            },
            retry: EffectRetry {
                attempts: 3,
                backoff: Duration::from_millis(50),
            },
        }
    }

    fn answer(outcome: &Result<(), EffectError>) -> Result<(), &EffectError> {
        outcome.as_ref().copied()
    }

    fn secs(n: i64) -> chrono::Duration {
        chrono::Duration::seconds(n)
    }

    #[test]
    fn a_first_deferral_is_due_after_the_backoff_or_the_effects_time_within_a_fresh_deadline() {
        let now = Utc::now();
        let not_yet = || Err(Deferred::new("x").into());
        let first = next(answer(&not_yet()), Standing::fresh(1), &policy(), now);
        assert_eq!(
            first,
            Next::Defer {
                reason: "x".into(),
                due: now + secs(10),
                deadline: now + secs(3600)
            }
        );
        let far = Err(Deferred::new("x").until(now + secs(7200)).into());
        let Next::Defer { due, deadline, .. } =
            next(answer(&far), Standing::fresh(1), &policy(), now)
        else {
            panic!()
        };
        assert_eq!(due, deadline, "never later than the deadline");
        let past = Err(Deferred::new("x").until(now - secs(5)).into());
        let Next::Defer { due, .. } = next(answer(&past), Standing::fresh(1), &policy(), now)
        else {
            panic!()
        };
        assert_eq!(due, now, "never in the past");
    }

    #[test]
    fn a_deferred_claim_keeps_its_deadline_backs_off_and_fails_once_the_deadline_passed() {
        let now = Utc::now();
        let deferred = |deferrals, deadline| Standing {
            attempt: 1,
            deferrals,
            deadline: Some(deadline),
        };
        let not_yet = Err(Deferred::new("gate closed").into());
        let again = next(
            answer(&not_yet),
            deferred(2, now + secs(100)),
            &policy(),
            now,
        );
        assert_eq!(
            again,
            Next::Defer {
                reason: "gate closed".into(),
                due: now + secs(40),
                deadline: now + secs(100)
            }
        );
        let Next::Failed { error } = next(answer(&not_yet), deferred(2, now), &policy(), now)
        else {
            panic!()
        };
        assert!(
            error.starts_with("still deferred at its deadline"),
            "{error}"
        );
        assert!(error.ends_with(": gate closed"), "{error}");
    }

    #[test]
    fn a_claim_held_by_a_source_pause_stands_fresh_and_a_deferred_one_keeps_its_deadline() {
        let deadline = Utc::now();
        let claim = |reason: &str| StoredClaim {
            source: "stripe".into(),
            event_type: None,
            received_at: None,
            payload: None,
            payload_sha256: vec![0; 32],
            status: ClaimStatus::Deferred,
            effect_spec: None,
            attempts: 1,
            deadline_at: Some(deadline),
            defer_policy: None,
            route_key: "k".into(),
            deferred_reason: Some(reason.into()),
            attributes: None,
        };
        let held = format!("{} (by ops: incident)", crate::sources::HELD_REASON);
        assert_eq!(Standing::stored(&claim(&held), 1), Standing::fresh(1));
        let deferred = Standing::stored(&claim("gate closed"), 1);
        assert_eq!((deferred.deferrals, deferred.deadline), (1, Some(deadline)));
    }

    #[test]
    fn failures_retry_until_out_of_tries_permanent_ones_fail_at_once_transient_ones_settle_nothing()
    {
        let now = Utc::now();
        let failed = || Err(EffectError::Failed(anyhow::anyhow!("constraint")));
        let retry = next(answer(&failed()), Standing::fresh(2), &policy(), now);
        assert_eq!(
            retry,
            Next::Retry {
                after: Duration::from_millis(100),
                error: "constraint".into()
            }
        );
        let out = next(answer(&failed()), Standing::fresh(3), &policy(), now);
        assert_eq!(
            out,
            Next::Failed {
                error: "constraint".into()
            }
        );
        let permanent = Err(EffectError::permanent(anyhow::anyhow!("no order")));
        let at_once = next(answer(&permanent), Standing::fresh(1), &policy(), now);
        assert_eq!(
            at_once,
            Next::Failed {
                error: "no order".into()
            }
        );
        let transient = Err(EffectError::transient(anyhow::anyhow!("timeout")));
        let standing = Standing {
            deferrals: 1,
            ..Standing::fresh(1)
        };
        let postponed = next(answer(&transient), standing, &policy(), now);
        assert_eq!(
            postponed,
            Next::Postpone {
                due: now + secs(20),
                error: "timeout".into()
            }
        );
        assert_eq!(
            next(answer(&Ok(())), Standing::fresh(9), &policy(), now),
            Next::Applied
        );
    }

    #[test]
    fn the_backoff_doubles_up_to_its_cap() {
        let waits: Vec<u64> = (1..=6).map(|n| policy().defer.delay(n).as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 60, 60, 60]);
        assert_eq!(policy().defer.delay(100).as_secs(), 60);
    }

    #[test]
    fn a_sources_policy_wins_over_the_effects_which_wins_over_the_default() {
        use std::collections::BTreeMap;
        struct Patient;
        #[async_trait::async_trait]
        impl Effect for Patient {
            fn name(&self) -> &'static str {
                "patient"
            }
            async fn apply(
                &self,
                _: &mut crate::effect::Tx<'_>,
                _: &crate::envelope::Event,
            ) -> Result<(), EffectError> {
                Ok(())
            }
            fn defer_policy(&self) -> Option<DeferPolicy> {
                Some(DeferPolicy {
                    deadline: Duration::from_secs(7),
                    ..DeferPolicy::default()
                })
            }
        }
        let stripe = DeferPolicy {
            deadline: Duration::from_secs(3 * 86400),
            ..DeferPolicy::default()
        };
        let settings = DeferSettings {
            sources: BTreeMap::from([("stripe".to_owned(), stripe)]),
            ..DeferSettings::default()
        };
        assert_eq!(settings.policy("stripe", &Patient), stripe);
        assert_eq!(settings.policy("github", &Patient).deadline.as_secs(), 7);
        assert_eq!(
            settings.policy("github", &crate::effect::Ledger),
            DeferPolicy::default()
        );
    }
}

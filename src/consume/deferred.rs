//! Deferred events: an effect said "not yet" ([`Deferred`]), so the event's claim was committed
//! as `deferred` with its payload, a due time, a deadline and the deferral policy in force, and
//! the partition moved on.
//!
//! Every consumer runs a [`DeferredApplier`] beside its lanes. It applies its topic's due
//! claims one at a time, each in its own transaction: the claim is locked with
//! `FOR UPDATE SKIP LOCKED`, the effect runs, and the claim moves to `done` (or is deferred
//! again, or settled `failed`) in the same transaction. A claim another worker holds is
//! skipped; a worker killed mid-way leaves no trace (its transaction aborts and releases the
//! lock), so each deferred event is applied once, whichever member of the group gets to it.

use super::internal_events::{
    DeferredApplierRestarted, DeferredEffectPanicked, DeferredTaken, Emit,
};
use super::settle::{self, Next, Policy, Standing};
use super::{BatchError, BatchProcessor, ConsumeMetrics};
use crate::claims::{self, StoredClaim};
use crate::db::Db;
use crate::effect::{self, EffectError};
use crate::sources::Paused;
use crate::telemetry::{Health, Probe};
use chrono::{DateTime, Utc};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Due claims taken in one round; the next round starts at once while claims are due.
const ROUND_LIMIT: i64 = 100;
/// How often the deferred gauges are read from the database.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// What the applier did with one due claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The effect applied; the claim is `done`.
    Done,
    /// The effect said "not yet" again; the claim waits for its next due time.
    Deferred,
    /// The effect failed for good (or panicked), or still deferred at the deadline; the claim
    /// is `failed`.
    Failed,
    /// The effect failed transiently (a lock or statement timeout, a lost connection): the
    /// claim stays deferred, due again after a backoff, and the round goes on.
    Postponed,
    /// Another worker holds the claim, or it is no longer deferred and due.
    Skipped,
}

impl Applied {
    /// Every outcome.
    pub const ALL: [Applied; 5] = [
        Self::Done,
        Self::Deferred,
        Self::Failed,
        Self::Postponed,
        Self::Skipped,
    ];

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::Done => "applied",
            Self::Deferred => "deferred",
            Self::Failed => "failed",
            Self::Postponed => "postponed",
            Self::Skipped => "skipped",
        }
    }
}

/// What one round did, claim by claim.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Round {
    /// Due claims found at the start of the round.
    pub due: usize,
    /// Claims applied and settled `done`.
    pub applied: usize,
    /// Claims deferred again.
    pub deferred: usize,
    /// Claims settled `failed`.
    pub failed: usize,
    /// Claims whose effect failed transiently, due again after a backoff.
    pub postponed: usize,
    /// Claims another worker held (or had settled).
    pub skipped: usize,
}

impl Round {
    fn count(&mut self, applied: Applied) {
        match applied {
            Applied::Done => self.applied += 1,
            Applied::Deferred => self.deferred += 1,
            Applied::Failed => self.failed += 1,
            Applied::Postponed => self.postponed += 1,
            Applied::Skipped => self.skipped += 1,
        }
    }
}

/// The applier's heartbeat, as `/healthz` names it.
const HEARTBEAT: &str = "deferred applier";
/// Restarts of the applier within [`RESTART_WINDOW`] past which `/healthz` says it cannot run.
const MAX_RESTARTS: usize = 5;
const RESTART_WINDOW: Duration = Duration::from_secs(60);

/// Applies a topic's due deferred claims; see the module's documentation.
#[derive(Clone)]
pub struct DeferredApplier {
    processor: BatchProcessor,
    topic: String,
    metrics: ConsumeMetrics,
    health: Health,
    /// How long a round may go without a heartbeat before `/healthz` fails.
    unhealthy_after: Duration,
}

/// Aborts the task it holds when dropped: the applier's rounds end with its supervisor.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What one try at a due claim came to.
enum Try {
    Settled(Applied),
    /// A deterministic failure with attempts left: tried again after `after`.
    Again {
        after: Duration,
    },
}

/// A due claim's effect's answer, and the rules it was judged by.
struct Answer<'a> {
    key: &'a str,
    attempt: u32,
    error: Option<EffectError>,
    policy: Policy,
}

impl DeferredApplier {
    /// An applier for the deferred claims of `topic`, with the processor's effect, retries and
    /// deferral settings.
    pub fn new(processor: BatchProcessor, topic: &str, metrics: ConsumeMetrics) -> Self {
        Self {
            processor,
            topic: topic.into(),
            metrics,
            health: Health::default(),
            unhealthy_after: super::DEFAULT_UNHEALTHY_AFTER,
        }
    }

    /// Reports to `health`: a heartbeat that goes stale when a round hangs for
    /// `unhealthy_after`, and a problem when the applier keeps failing.
    pub fn with_health(mut self, health: Health, unhealthy_after: Duration) -> Self {
        self.health = health;
        self.unhealthy_after = unhealthy_after;
        self
    }

    /// Applies due claims in rounds until `stop` is cancelled, waiting
    /// [`super::DeferSettings::poll_interval`] when nothing is due and backing off on database errors.
    /// A claim being applied when `stop` comes is finished first. The rounds run in a task of
    /// their own, started again (and counted) if it ever panics; an effect's panic only fails
    /// its event.
    pub async fn run(self, stop: CancellationToken) {
        let mut restarts: Vec<Instant> = Vec::new();
        while !stop.is_cancelled() {
            let mut rounds = AbortOnDrop(tokio::spawn(self.clone().rounds(stop.clone())));
            let ended = (&mut rounds.0).await;
            let panic = match ended {
                Ok(()) => break,
                Err(e) if e.is_panic() => super::panic_message(&*e.into_panic()),
                Err(_) => break,
            };
            DeferredApplierRestarted { panic: &panic }.emit(&self.metrics);
            let now = Instant::now();
            restarts.retain(|at| now.duration_since(*at) < RESTART_WINDOW);
            restarts.push(now);
            if restarts.len() > MAX_RESTARTS {
                let problem = format!(
                    "it panicked {} times in {} s, last: {panic}",
                    restarts.len(),
                    RESTART_WINDOW.as_secs()
                );
                self.health.report_as(HEARTBEAT, Probe::Live, Some(problem));
            }
            // Doubled for each restart within the window, so a panic that repeats is not
            // logged at the poll interval forever.
            let shift = (restarts.len() - 1).min(10) as u32;
            let wait =
                (self.processor.defer.poll_interval * 2u32.pow(shift)).min(Duration::from_secs(30));
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
        self.health.forget(HEARTBEAT);
    }

    /// The rounds themselves, until `stop`.
    async fn rounds(self, stop: CancellationToken) {
        let poll = self.processor.defer.poll_interval;
        let mut backoff = poll;
        let mut gauges_read: Option<Instant> = None;
        while !stop.is_cancelled() {
            self.beat();
            crate::failpoint!("consume::deferred_round");
            let wait = match self.apply_due(&stop).await {
                Ok(round) => {
                    backoff = poll;
                    if round.applied + round.deferred + round.failed > 0 {
                        // It runs again: a problem of earlier restarts is over.
                        self.health.report(HEARTBEAT, None);
                    }
                    match round.due as i64 >= ROUND_LIMIT && round.skipped < round.due {
                        true => Duration::ZERO,
                        false => poll,
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "Applying deferred events failed; trying again.");
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    backoff
                }
            };
            if gauges_read.is_none_or(|at| at.elapsed() >= GAUGE_INTERVAL) {
                self.read_gauges().await;
                gauges_read = Some(Instant::now());
            }
            self.beat();
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// A heartbeat allowed to go as long as the longest wait between rounds, plus the limit.
    fn beat(&self) {
        let max_age =
            Duration::from_secs(30).max(self.processor.defer.poll_interval) + self.unhealthy_after;
        self.health.beat(HEARTBEAT, max_age);
    }

    /// Sets the gauges of deferred claims from the database.
    async fn read_gauges(&self) {
        match self.overview().await {
            Ok((count, oldest)) => {
                self.metrics.deferred.events.set(count);
                self.metrics.deferred.oldest_age.set(oldest);
            }
            Err(e) => tracing::debug!(error = %e, "Could not read the deferred gauges."),
        }
    }

    /// The deferred claims of the topic over every shard: how many, and the age in seconds of
    /// the oldest.
    async fn overview(&self) -> sqlx::Result<(i64, f64)> {
        let (mut count, mut oldest) = (0, 0f64);
        for (_, pool) in self.processor.shards.databases() {
            let (n, age, _) = claims::deferred_overview(pool, Some(&self.topic)).await?;
            count += n;
            oldest = oldest.max(age);
        }
        Ok((count, oldest))
    }

    /// One round: on each shard, every claim due now (at most 100), each in its own
    /// transaction. Stops early when `stop` is cancelled, between claims. A claim whose effect
    /// fails transiently is postponed on its own; only a database error of the round itself
    /// ends it.
    pub async fn apply_due(&self, stop: &CancellationToken) -> Result<Round, BatchError> {
        let mut round = Round::default();
        // A paused source's events wait, whatever made them deferred.
        let paused = Paused::read(self.processor.shards.first()).await?.names();
        for (_, pool) in self.processor.shards.databases() {
            let keys = claims::due(pool, &self.topic, ROUND_LIMIT, &paused).await?;
            round.due += keys.len();
            for key in keys {
                if stop.is_cancelled() {
                    break;
                }
                self.beat();
                let applied = self.apply_one(pool, &key).await?;
                DeferredTaken(applied).emit(&self.metrics);
                round.count(applied);
            }
        }
        Ok(round)
    }

    /// Applies one due claim in its own transaction, retrying a deterministic error like the
    /// batch does.
    async fn apply_one(&self, pool: &Db, key: &str) -> Result<Applied, BatchError> {
        let mut attempt = 1;
        loop {
            match self.try_once(pool, key, attempt).await? {
                Try::Settled(applied) => return Ok(applied),
                Try::Again { after } => {
                    tokio::time::sleep(after).await;
                    attempt += 1;
                }
            }
        }
    }

    /// One transaction at a due claim: lock it, run the effect (a panic caught), settle it by
    /// the one rule.
    async fn try_once(&self, pool: &Db, key: &str, attempt: u32) -> Result<Try, BatchError> {
        use futures_util::FutureExt as _;
        let p = &self.processor;
        let mut tx = pool.begin().await?;
        let Some(claim) = claims::lock_due(&mut tx, key).await? else {
            return Ok(Try::Settled(Applied::Skipped));
        };
        let event = match claim.event(key) {
            Ok(event) => event,
            Err(e) => {
                claims::record_attempt(&mut tx, key, Some(&format!("{e:#}"))).await?;
                tx.commit().await?;
                return Ok(Try::Settled(Applied::Failed));
            }
        };
        let applying = effect::apply_in_savepoint(&mut tx, &*p.effect, &event);
        let outcome = match std::panic::AssertUnwindSafe(applying).catch_unwind().await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(db)) => return Err(db.into()),
            Err(panic) => {
                // Rolled back before the failure is recorded in a fresh transaction: a dropped
                // one only queues its rollback, and its row lock would make the fresh one skip
                // the claim, to be applied (and panic) again next round.
                let _ = tx.rollback().await;
                let panic = super::panic_message(&*panic);
                return self.settle_panic(pool, key, &panic).await.map(Try::Settled);
            }
        };
        let policy = self.policy_for(&claim, &event.source);
        let next = settle::next(
            outcome.as_ref().copied(),
            Standing::stored(&claim, attempt),
            &policy,
            Utc::now(),
        );
        let answer = Answer {
            key,
            attempt,
            error: outcome.err(),
            policy,
        };
        self.carry_out(pool, tx, answer, next).await
    }

    /// The rules in force for a stored claim: the deferral policy stored on it (else the one
    /// configured now), and the processor's retries.
    fn policy_for(&self, claim: &StoredClaim, source: &str) -> Policy {
        let p = &self.processor;
        Policy {
            defer: settle::policy_in_force(claim, || p.defer.policy(source, &*p.effect)),
            retry: p.retry,
        }
    }

    /// Does what the rule said, in the claim's transaction (or, for a postponement, in a fresh
    /// one after this one rolled back).
    async fn carry_out(
        &self,
        pool: &Db,
        mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
        answer: Answer<'_>,
        next: Next,
    ) -> Result<Try, BatchError> {
        let Answer {
            key,
            attempt,
            error,
            policy,
        } = answer;
        let applied = match next {
            Next::Applied => {
                claims::record_attempt(&mut tx, key, None).await?;
                crate::failpoint!("consume::deferred_applied_before_commit");
                crate::stallpoint!("consume::deferred_applied_stall_before_commit");
                tracing::debug!(key, "Applied a deferred event.");
                Applied::Done
            }
            Next::Defer {
                reason,
                due,
                deadline,
            } => {
                claims::redefer(&mut tx, key, &reason, due, deadline, &policy.defer).await?;
                Applied::Deferred
            }
            Next::Postpone { due, error } => {
                let _ = tx.rollback().await;
                tracing::warn!(key, error, %due, "A deferred event's effect failed transiently; it is due again later.");
                let settle = Settle::Postpone { due, error: &error };
                return self.settle_alone(pool, key, settle).await.map(Try::Settled);
            }
            Next::Retry { after, error } => {
                self.log_failure(key, attempt, &error);
                let _ = tx.rollback().await;
                return Ok(Try::Again { after });
            }
            Next::Failed { error: reason } => {
                match &error {
                    Some(EffectError::NotYet(_)) => {
                        tracing::warn!(key, error = reason, "A deferred event passed its deadline.")
                    }
                    _ => self.log_failure(key, attempt, &reason),
                }
                claims::record_attempt(&mut tx, key, Some(&reason)).await?;
                Applied::Failed
            }
        };
        tx.commit().await?;
        Ok(Try::Settled(applied))
    }

    fn log_failure(&self, key: &str, attempt: u32, error: &str) {
        let effect = self.processor.effect.name();
        tracing::warn!(
            key,
            attempt,
            effect,
            error,
            "A deferred event's effect failed."
        );
    }

    /// The effect panicked: the event is settled `failed` with the panic's message, as a lane
    /// settles nothing and stops; the applier goes on with the next claim.
    async fn settle_panic(&self, pool: &Db, key: &str, panic: &str) -> Result<Applied, BatchError> {
        let error = format!("the effect panicked: {panic}");
        DeferredEffectPanicked { key, error: &error }.emit(&self.metrics);
        self.settle_alone(pool, key, Settle::Fail { error: &error })
            .await
    }

    /// Settles a claim whose effect's transaction was rolled back, in a transaction of its own
    /// that locks the claim again: Skipped when another worker took it meanwhile.
    async fn settle_alone(
        &self,
        pool: &Db,
        key: &str,
        settle: Settle<'_>,
    ) -> Result<Applied, BatchError> {
        let mut tx = pool.begin().await?;
        if claims::lock_due(&mut tx, key).await?.is_none() {
            return Ok(Applied::Skipped);
        }
        let applied = match settle {
            Settle::Postpone { due, error } => {
                claims::postpone(&mut tx, key, due, error).await?;
                Applied::Postponed
            }
            Settle::Fail { error } => {
                claims::record_attempt(&mut tx, key, Some(error)).await?;
                Applied::Failed
            }
        };
        tx.commit().await?;
        Ok(applied)
    }
}

/// How [`DeferredApplier::settle_alone`] settles a claim.
enum Settle<'a> {
    /// Still deferred, due again at `due`, with the error kept.
    Postpone { due: DateTime<Utc>, error: &'a str },
    /// `failed` with the error.
    Fail { error: &'a str },
}

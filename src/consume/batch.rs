//! One batch of one partition, in one transaction: dead letters, claims, conflicts, effects.
//!
//! The fast path applies every claimed event's effect directly in the batch transaction. When
//! an effect fails, that transaction is rolled back and the batch runs again with a savepoint
//! around each effect, so the failing event is retried and, at worst, recorded as `failed`
//! while the rest of the batch commits once. An effect failing for a reason that says nothing
//! about the event (a timeout, a lost connection, a missing table) settles nothing: the batch
//! rolls back and is retried whole.
//!
//! When PostgreSQL refuses the batch's own rows (a data error, SQLSTATE classes 22 and 23), the
//! batch is split in halves until the refused messages are found; each becomes a dead letter
//! with PostgreSQL's message and the rest commits, so one bad message never stalls a partition.

use crate::claims::dead_letters::{self, DeadLetter};
use crate::claims::{self, conflicts, ClaimStatus, Origin, Settlement};
use crate::effect::{self, Effect, FailureKind};
use crate::envelope::Event;
use sqlx::{Acquire, PgPool, Postgres, Transaction};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// A Kafka message as the consumer hands it over: its offset and raw bytes.
#[derive(Debug, Clone)]
pub struct RawMessage {
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
}

/// The log target of the line logged for each applied event, after its batch committed. Off
/// unless asked for (`RUST_LOG=replayproof::applied=debug`); `dev` turns it on.
pub const APPLIED_LOG: &str = "replayproof::applied";

/// What a committed batch did, event by event.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed here whose effect committed.
    pub applied: usize,
    /// Their keys and types, in offset order; gathered only while the [`APPLIED_LOG`] log
    /// target is enabled (as `dev` enables it), so a production batch allocates nothing for it.
    pub applied_events: Vec<(String, Option<String>)>,
    /// Replays: the key was claimed before with the same payload, or repeated in this batch.
    pub duplicates: usize,
    /// The key was claimed before with a different payload; recorded in `key_conflicts`.
    pub conflicts: usize,
    /// Messages that are not envelopes, by offset with the reason; recorded in `dead_letters`.
    pub dead_letters: Vec<(i64, String)>,
    /// Claimed events whose effect failed every attempt; recorded as `failed` claims.
    pub failed: usize,
    /// Effect attempts that failed, including those retried successfully.
    pub effect_errors: usize,
}

impl BatchReport {
    /// Adds the report of a later part of the same batch.
    fn merge(&mut self, other: BatchReport) {
        self.applied += other.applied;
        self.applied_events.extend(other.applied_events);
        self.duplicates += other.duplicates;
        self.conflicts += other.conflicts;
        self.dead_letters.extend(other.dead_letters);
        self.failed += other.failed;
        self.effect_errors += other.effect_errors;
    }
}

/// Why a batch did not commit. Nothing of it committed, or (for an error from COMMIT itself) the
/// outcome is unknown; either way the offset must not move, and a retry is harmless.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// An effect failed for a reason that says nothing about its event.
    #[error("an effect failed transiently: {0:#}")]
    Transient(anyhow::Error),
}

/// How effects are retried when they fail.
#[derive(Debug, Clone, Copy)]
pub struct EffectRetry {
    /// Attempts per event before it is recorded as failed; at least 1.
    pub attempts: u32,
    /// The pause before the second attempt; doubled for each further one.
    pub backoff: Duration,
}

impl Default for EffectRetry {
    fn default() -> Self {
        Self {
            attempts: 3,
            backoff: Duration::from_millis(50),
        }
    }
}

/// Applies batches for one consumer; cheap to clone into each partition lane.
#[derive(Clone)]
pub struct BatchProcessor {
    pub pool: PgPool,
    pub effect: Arc<dyn Effect>,
    pub retry: EffectRetry,
}

/// The batch, sorted out before any database work.
struct Plan<'m> {
    /// Where the messages were read.
    origin: Origin<'m>,
    /// The first copy of each key, in offset order.
    firsts: Vec<(i64, Event)>,
    /// Later copies of a key within this batch.
    copies: Vec<(i64, Event)>,
    dead: Vec<DeadLetter<'m>>,
}

impl<'m> Plan<'m> {
    fn new(origin: Origin<'m>, messages: &'m [RawMessage]) -> Self {
        let mut plan = Plan {
            origin,
            firsts: Vec::new(),
            copies: Vec::new(),
            dead: Vec::new(),
        };
        let mut seen = HashSet::new();
        for m in messages {
            match Event::parse(m.key.as_deref(), m.value.as_deref()) {
                Ok(event) if seen.insert(event.key.clone()) => plan.firsts.push((m.offset, event)),
                Ok(event) => plan.copies.push((m.offset, event)),
                Err(reason) => plan.dead.push(DeadLetter {
                    offset: m.offset,
                    key: m.key.as_deref(),
                    value: m.value.as_deref(),
                    reason: reason.to_string(),
                }),
            }
        }
        plan
    }
}

/// Why one run of a batch did not commit.
enum RunError {
    /// An effect failed on the fast path: run again with savepoints.
    EffectFailed,
    /// An effect failed transiently: roll back and retry the batch later.
    Transient(anyhow::Error),
    Database(sqlx::Error),
}

impl From<RunError> for BatchError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Database(e) => Self::Database(e),
            RunError::Transient(e) => Self::Transient(e),
            RunError::EffectFailed => unreachable!("isolated runs settle failures"),
        }
    }
}

impl From<sqlx::Error> for RunError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Fast,
    Isolated,
}

impl BatchProcessor {
    /// Applies a batch in one transaction and commits it. An error means nothing of the batch
    /// committed, or (for an error from COMMIT itself) that the outcome is unknown; either way
    /// the caller must not move the offset and should retry, which the claims make harmless.
    /// Messages PostgreSQL refuses are dead-lettered, not returned as an error.
    #[tracing::instrument(name = "batch", skip_all, fields(topic, partition, messages = messages.len()))]
    pub async fn process(
        &self,
        topic: &str,
        partition: i32,
        messages: &[RawMessage],
    ) -> Result<BatchReport, BatchError> {
        let origin = Origin { topic, partition };
        match self.process_part(origin, messages).await {
            Err(BatchError::Database(e)) if crate::db::is_data_error(&e) => {
                tracing::warn!(partition, error = %e, "PostgreSQL refused part of a batch; splitting it to find the messages.");
                self.split_out_refused(origin, messages, e).await
            }
            other => other,
        }
    }

    /// Runs part of a batch in one transaction: fast, then isolated if an effect failed.
    async fn process_part(
        &self,
        origin: Origin<'_>,
        messages: &[RawMessage],
    ) -> Result<BatchReport, BatchError> {
        let plan = Plan::new(origin, messages);
        match self.run_and_commit(&plan, Mode::Fast).await {
            Err(RunError::EffectFailed) => {
                tracing::debug!(
                    partition = origin.partition,
                    "An effect failed; isolating the batch's events."
                );
                Ok(self.run_and_commit(&plan, Mode::Isolated).await?)
            }
            other => Ok(other?),
        }
    }

    /// Commits a refused batch part by part, in offset order: a part PostgreSQL refuses is
    /// halved, and a single refused message becomes a dead letter with PostgreSQL's message.
    /// Any other error stops the split; the parts that committed replay harmlessly.
    async fn split_out_refused(
        &self,
        origin: Origin<'_>,
        messages: &[RawMessage],
        refusal: sqlx::Error,
    ) -> Result<BatchReport, BatchError> {
        let mut report = BatchReport::default();
        let mut parts = VecDeque::from([(messages, Some(refusal))]);
        while let Some((part, refusal)) = parts.pop_front() {
            let refusal = match refusal {
                Some(e) => e,
                None => match self.process_part(origin, part).await {
                    Ok(r) => {
                        report.merge(r);
                        continue;
                    }
                    Err(BatchError::Database(e)) if crate::db::is_data_error(&e) => e,
                    Err(e) => return Err(e),
                },
            };
            match part {
                [message] => {
                    let letter = self.dead_letter_refused(origin, message, &refusal).await?;
                    report.merge(letter);
                }
                _ => {
                    let (left, right) = part.split_at(part.len() / 2);
                    parts.push_front((right, None));
                    parts.push_front((left, None));
                }
            }
        }
        Ok(report)
    }

    /// Dead-letters one message whose rows PostgreSQL refused, with PostgreSQL's own message.
    async fn dead_letter_refused(
        &self,
        origin: Origin<'_>,
        message: &RawMessage,
        refusal: &sqlx::Error,
    ) -> Result<BatchReport, BatchError> {
        let reason = match refusal {
            sqlx::Error::Database(db) => format!(
                "PostgreSQL refused the event: {} (SQLSTATE {})",
                db.message(),
                db.code().as_deref().unwrap_or("?")
            ),
            e => format!("PostgreSQL refused the event: {e}"),
        };
        let letter = DeadLetter {
            offset: message.offset,
            key: message.key.as_deref(),
            value: message.value.as_deref(),
            reason: reason.replace('\0', ""),
        };
        let mut tx = self.pool.begin().await?;
        dead_letters::insert(&mut tx, origin, std::slice::from_ref(&letter)).await?;
        tx.commit().await?;
        Ok(BatchReport {
            dead_letters: vec![(letter.offset, letter.reason)],
            ..BatchReport::default()
        })
    }

    async fn run_and_commit(&self, plan: &Plan<'_>, mode: Mode) -> Result<BatchReport, RunError> {
        let mut tx = self.pool.begin().await?;
        match self.run(&mut tx, plan, mode).await {
            Ok(report) => {
                crate::failpoint!("consume::before_commit");
                crate::stallpoint!("consume::stall_before_commit");
                tx.commit().await?;
                Ok(report)
            }
            Err(e) => {
                // The rollback's own failure changes nothing: the transaction did not commit.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn run(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        plan: &Plan<'_>,
        mode: Mode,
    ) -> Result<BatchReport, RunError> {
        let origin = plan.origin;
        let mut report = BatchReport {
            dead_letters: plan
                .dead
                .iter()
                .map(|d| (d.offset, d.reason.clone()))
                .collect(),
            ..BatchReport::default()
        };
        if !plan.dead.is_empty() {
            dead_letters::insert(tx, origin, &plan.dead).await?;
        }
        if plan.firsts.is_empty() {
            return Ok(report);
        }
        let mut firsts: Vec<(i64, &Event)> = plan.firsts.iter().map(|(o, e)| (*o, e)).collect();
        let replays = self.sort_out_captures(tx, &mut firsts).await?;
        if !replays.is_empty() {
            report.conflicts += replays.len();
            conflicts::record(tx, origin, &replays).await?;
        }
        if firsts.is_empty() {
            return Ok(report);
        }
        let claimed: HashSet<String> = claims::claim(tx, origin, &firsts)
            .await?
            .into_iter()
            .collect();
        self.sort_out_replays(tx, plan, &claimed, &mut report)
            .await?;
        let mut settlements = Vec::with_capacity(claimed.len());
        for (_, event) in firsts
            .iter()
            .filter(|(_, e)| claimed.contains(e.key.as_str()))
        {
            let settlement = self.apply(tx, event, mode, &mut report).await?;
            match settlement.status {
                ClaimStatus::Done => {
                    report.applied += 1;
                    if tracing::enabled!(target: APPLIED_LOG, tracing::Level::DEBUG) {
                        report
                            .applied_events
                            .push((event.key.to_string(), event.event_type.clone()));
                    }
                }
                _ => report.failed += 1,
            }
            settlements.push(settlement);
        }
        claims::settle(tx, &settlements, self.effect.spec().as_ref()).await?;
        Ok(report)
    }

    /// Takes out of `firsts` the replayed captures: guarded events whose signed body was first
    /// delivered under another key within the window. They are returned with the reason.
    async fn sort_out_captures<'e>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        firsts: &mut Vec<(i64, &'e Event)>,
    ) -> Result<Vec<conflicts::Conflict<'e>>, RunError> {
        let guarded: Vec<(i64, &Event)> = firsts
            .iter()
            .filter(|(_, e)| e.replay_window_secs.is_some())
            .copied()
            .collect();
        if guarded.is_empty() {
            return Ok(Vec::new());
        }
        let seen = conflicts::fingerprints(tx, &guarded).await?;
        let mut replays = Vec::new();
        firsts.retain(|(offset, e)| {
            let Some(window) = e.replay_window_secs else {
                return true;
            };
            let fingerprint = (e.source.clone(), e.payload_sha256.to_vec());
            match seen.get(&fingerprint) {
                Some((first_key, age)) if first_key != e.key.as_str() && *age <= window as f64 => {
                    replays.push((
                        *offset,
                        *e,
                        Some(format!(
                            "replayed capture: the same signed body was delivered as {first_key} \
                             {age:.0} s earlier (replay window {window} s)"
                        )),
                    ));
                    false
                }
                _ => true,
            }
        });
        Ok(replays)
    }

    /// Counts replays and records key conflicts: every event that was not claimed here is
    /// compared with the payload that won its key.
    async fn sort_out_replays(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        plan: &Plan<'_>,
        claimed: &HashSet<String>,
        report: &mut BatchReport,
    ) -> Result<(), RunError> {
        let unclaimed: Vec<&str> = plan
            .firsts
            .iter()
            .map(|(_, e)| e.key.as_str())
            .filter(|k| !claimed.contains(*k))
            .collect();
        let mut winners: HashMap<&str, Vec<u8>> = plan
            .firsts
            .iter()
            .filter(|(_, e)| claimed.contains(e.key.as_str()))
            .map(|(_, e)| (e.key.as_str(), e.payload_sha256.to_vec()))
            .collect();
        if !unclaimed.is_empty() {
            let stored = claims::stored_hashes(tx, &unclaimed).await?;
            for key in &unclaimed {
                if let Some(hash) = stored.get(*key) {
                    winners.insert(key, hash.clone());
                }
            }
        }
        let losers = plan
            .firsts
            .iter()
            .filter(|(_, e)| !claimed.contains(e.key.as_str()))
            .chain(plan.copies.iter());
        let mut conflicts = Vec::new();
        for (offset, event) in losers {
            match winners.get(event.key.as_str()) {
                Some(hash) if hash[..] != event.payload_sha256[..] => {
                    conflicts.push((*offset, event, None))
                }
                _ => report.duplicates += 1,
            }
        }
        report.conflicts += conflicts.len();
        if !conflicts.is_empty() {
            conflicts::record(tx, plan.origin, &conflicts).await?;
        }
        Ok(())
    }

    /// Runs one claimed event's effect. On the fast path a failure abandons the run; isolated,
    /// each attempt has its own savepoint and the last error is kept on the claim.
    async fn apply<'e>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &'e Event,
        mode: Mode,
        report: &mut BatchReport,
    ) -> Result<Settlement<'e>, RunError> {
        let key = event.key.as_str();
        if mode == Mode::Fast {
            return match self.effect.apply(tx, event).await {
                Ok(()) => Ok(done(key, 1)),
                Err(e) if effect::classify(&e) == FailureKind::Transient => {
                    Err(RunError::Transient(e))
                }
                Err(_) => Err(RunError::EffectFailed),
            };
        }
        let attempts = self.retry.attempts.max(1);
        let mut last_error = String::new();
        for attempt in 1..=attempts {
            let mut savepoint = tx.begin().await?;
            match self.effect.apply(&mut savepoint, event).await {
                Ok(()) => {
                    savepoint.commit().await?;
                    return Ok(done(key, attempt as i32));
                }
                Err(e) => {
                    savepoint.rollback().await?;
                    report.effect_errors += 1;
                    let kind = effect::classify(&e);
                    if kind == FailureKind::Transient {
                        return Err(RunError::Transient(e));
                    }
                    last_error = format!("{e:#}");
                    tracing::warn!(key, attempt, effect = self.effect.name(), error = %last_error, "An effect failed.");
                    if kind == FailureKind::Permanent {
                        return Ok(failed(key, attempt as i32, last_error));
                    }
                }
            }
            if attempt < attempts {
                tokio::time::sleep(self.retry.backoff * 2u32.pow(attempt - 1)).await;
            }
        }
        Ok(failed(key, attempts as i32, last_error))
    }
}

fn failed(key: &str, attempts: i32, error: String) -> Settlement<'_> {
    Settlement {
        key,
        status: ClaimStatus::Failed,
        attempts,
        last_error: Some(error),
    }
}

fn done(key: &str, attempts: i32) -> Settlement<'_> {
    Settlement {
        key,
        status: ClaimStatus::Done,
        attempts,
        last_error: None,
    }
}

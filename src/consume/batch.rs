//! One batch of one partition, in one transaction: dead letters, claims, conflicts, effects.
//!
//! Every claim is written once, with its final status, and the effect runs once for the whole
//! batch ([`Effect::apply_batch`]). When it fails, the batch runs again guarded: in parts of at
//! most 128 events, each after a savepoint, a failing part rolled back to it and halved until
//! the events that fail alone are found; the rest commits. A failing event's claim is taken back and the event
//! is tried again in a later transaction after a capped backoff, so no transaction sits open
//! while waiting; after its last attempt it is recorded as `failed` with the error and its
//! payload. An effect failing for a reason that says nothing about the event (a timeout, a lost
//! connection, a missing table) settles nothing: the batch rolls back and is retried whole.
//!
//! When PostgreSQL refuses the batch's own rows (a data error, SQLSTATE classes 22 and 23), the
//! batch is split in halves until the refused messages are found; each becomes a dead letter
//! with PostgreSQL's message and the rest commits, so one bad message never stalls a partition.

use super::deferred::DeferSettings;
use crate::claims::dead_letters::{self, DeadLetter};
use crate::claims::{self, conflicts, Deferral, Failure, Origin};
use crate::effect::{self, Deferred, Effect, FailureKind};
use crate::envelope::Event;
use sqlx::{PgPool, Postgres, Transaction};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// A Kafka message as the consumer hands it over: its offset and raw bytes.
#[derive(Debug, Clone)]
pub struct RawMessage {
    /// The message's offset in its partition.
    pub offset: i64,
    /// The message key's bytes, if it has a key.
    pub key: Option<Vec<u8>>,
    /// The message value's bytes (the envelope), if it has a value.
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
    /// Claimed events whose effect said "not yet"; recorded as `deferred` claims, applied again
    /// when due.
    pub deferred: usize,
    /// Effect attempts that failed, including those retried successfully (deferrals are not
    /// failures).
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
        self.deferred += other.deferred;
        self.effect_errors += other.effect_errors;
    }
}

/// Why a batch did not commit. Nothing of it committed, or (for an error from COMMIT itself) the
/// outcome is unknown; either way the offset must not move, and a retry is harmless.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// A database error: nothing committed, or the outcome of COMMIT is unknown.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// An effect failed for a reason that says nothing about its event.
    #[error("an effect failed transiently: {0:#}")]
    Transient(anyhow::Error),
    /// One of the batch's transactions ran past its time limit and was abandoned (rolled
    /// back). Applied in smaller parts, each transaction has less to do.
    #[error("a transaction of the batch took longer than {} s; abandoned, it rolled back", .0.as_secs())]
    TimedOut(Duration),
}

/// The most attempts `--effect-attempts` allows: with the capped backoff, an event's retries
/// end within seconds, well inside a batch's timeout.
pub const MAX_EFFECT_ATTEMPTS: u32 = 10;
/// The longest wait between two attempts at a failing event's effect.
pub const MAX_EFFECT_BACKOFF: Duration = Duration::from_secs(2);

/// How effects are retried when they fail.
#[derive(Debug, Clone, Copy)]
pub struct EffectRetry {
    /// Attempts per event before it is recorded as failed; taken between 1 and
    /// [`MAX_EFFECT_ATTEMPTS`].
    pub attempts: u32,
    /// The wait before the second attempt; doubled for each further one, up to
    /// [`MAX_EFFECT_BACKOFF`]. No transaction is open while waiting.
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

impl EffectRetry {
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts.clamp(1, MAX_EFFECT_ATTEMPTS)
    }

    /// The wait after the failed attempt number `attempt` (from 1).
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let doubled = self.backoff.saturating_mul(
            1u32.checked_shl(attempt.saturating_sub(1))
                .unwrap_or(u32::MAX),
        );
        doubled.min(MAX_EFFECT_BACKOFF)
    }
}

/// Events whose effect failed and that wait, outside any transaction, for another attempt; a
/// lane keeps one and hands it to every [`BatchProcessor::process_pass`], so that later batches
/// go on meanwhile. Its first offset is where the partition's committed offset must stop.
#[derive(Debug, Default)]
pub struct Retrying {
    /// In offset order.
    held: Vec<Held>,
    /// Passes still to run with the effect in a savepoint, after one where an effect failed.
    guarded: u32,
}

/// After an effect fails, this many passes run with the effect in a savepoint, so that a run of
/// failures costs no reruns; otherwise the effect runs without one, saving two round trips per
/// batch, and a failure reruns its batch once with savepoints.
const GUARDED_PASSES: u32 = 8;

/// A guarded pass applies its events in parts of at most this many, each after its savepoint:
/// a part that fails undoes only its own work before it is halved, where a whole batch of 500
/// would write and undo 500 effects (with 2 KiB payloads, that undone work costs more than the
/// round trips the extra parts take).
const GUARDED_PART: usize = 128;

#[derive(Debug)]
struct Held {
    message: RawMessage,
    /// Attempts made so far.
    attempts: u32,
    due: tokio::time::Instant,
}

impl Retrying {
    /// Whether no event waits for another attempt.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// When the next attempt is due.
    pub fn next_due(&self) -> Option<tokio::time::Instant> {
        self.held.iter().map(|h| h.due).min()
    }

    /// The offset of the first event still unsettled.
    pub fn first_offset(&self) -> Option<i64> {
        self.held.first().map(|h| h.message.offset)
    }

    /// What the waiting events take in memory, as the lane's budget counts messages.
    pub fn bytes(&self) -> usize {
        self.held.iter().map(|h| h.message.queued_bytes()).sum()
    }
}

/// The savepoint a guarded pass applies parts of its batch after, one at a time. It is taken
/// once; a failed attempt rolls back to it, which keeps it; the work of a successful attempt is
/// released into the transaction, and the savepoint taken again, in the same round trip as the
/// next attempt needs anyway. An attempt costs two round trips, not three.
struct Savepoint {
    /// The work since the savepoint applied and is to be kept.
    holds_work: bool,
}

impl Savepoint {
    const TAKE: &'static str = "SAVEPOINT replayproof_part";
    const KEEP_AND_TAKE: &'static str =
        "RELEASE SAVEPOINT replayproof_part; SAVEPOINT replayproof_part";
    const UNDO: &'static str = "ROLLBACK TO SAVEPOINT replayproof_part";

    async fn establish(tx: &mut Transaction<'static, Postgres>) -> Result<Self, RunError> {
        sqlx::Executor::execute(&mut **tx, Self::TAKE).await?;
        Ok(Self { holds_work: false })
    }

    /// Applies `part`: None when it applied, or the error it failed with (its work undone). A
    /// transient failure ends the run. Work kept is never undone by a later attempt; it commits
    /// with the transaction (the savepoint needs no release for that).
    async fn attempt(
        &mut self,
        tx: &mut Transaction<'static, Postgres>,
        effect: &dyn Effect,
        part: &[(i64, &Event)],
    ) -> Result<Option<anyhow::Error>, RunError> {
        if std::mem::take(&mut self.holds_work) {
            // Text without parameters goes as one simple query: both statements, one round trip.
            sqlx::Executor::execute(&mut **tx, Self::KEEP_AND_TAKE).await?;
        }
        let batch: Vec<&Event> = part.iter().map(|(_, e)| *e).collect();
        match effect.apply_batch(tx, &batch).await {
            Ok(()) => {
                self.holds_work = true;
                Ok(None)
            }
            Err(error) => {
                sqlx::Executor::execute(&mut **tx, Self::UNDO).await?;
                match effect::classify(&error) {
                    FailureKind::Transient => Err(RunError::Transient(error)),
                    _ => Ok(Some(error)),
                }
            }
        }
    }
}

/// Attempts made so far at each event of a pass, by offset; absent means none.
type Attempts = HashMap<i64, u32>;

/// How the transactions of one pass run.
struct Run<'a> {
    attempts: &'a Attempts,
    /// Whether the effect runs in savepoints from the start.
    guarded: bool,
    /// The longest one transaction may take; None for no limit.
    limit: Option<Duration>,
}

/// Applies batches for one consumer; cheap to clone into each partition lane.
#[derive(Clone)]
pub struct BatchProcessor {
    /// Where the claims and effects are written.
    pub pool: PgPool,
    /// The effect applied to each claimed event.
    pub effect: Arc<dyn Effect>,
    /// How a failing effect is retried before its event is settled `failed`.
    pub retry: EffectRetry,
    /// How long deferred events wait, and when they are given up.
    pub defer: DeferSettings,
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
    fn new(origin: Origin<'m>, messages: &[&'m RawMessage]) -> Self {
        let mut plan = Plan {
            origin,
            firsts: Vec::with_capacity(messages.len()),
            copies: Vec::new(),
            dead: Vec::new(),
        };
        let mut events = Vec::with_capacity(messages.len());
        for m in messages {
            match Event::parse(m.key.as_deref(), m.value.as_deref()) {
                Ok(event) => events.push((m.offset, event)),
                Err(reason) => plan.dead.push(DeadLetter {
                    offset: m.offset,
                    key: m.key.as_deref(),
                    value: m.value.as_deref(),
                    reason: reason.to_string(),
                }),
            }
        }
        let first: Vec<bool> = {
            let mut seen = HashSet::with_capacity(events.len());
            events
                .iter()
                .map(|(_, e)| seen.insert(e.key.as_str()))
                .collect()
        };
        for ((offset, event), first) in events.into_iter().zip(first) {
            match first {
                true => plan.firsts.push((offset, event)),
                false => plan.copies.push((offset, event)),
            }
        }
        plan
    }
}

/// What one pass over (part of) a batch committed, and the offsets of the events whose effect
/// failed and is to be tried again in a later transaction.
#[derive(Default)]
struct Pass {
    report: BatchReport,
    held: Vec<i64>,
}

impl Pass {
    fn merge(&mut self, other: Pass) {
        self.report.merge(other.report);
        self.held.extend(other.held);
    }
}

/// Why one run of a batch did not commit.
enum RunError {
    /// An effect failed transiently: roll back and retry the batch later.
    Transient(anyhow::Error),
    /// An effect failed outside a savepoint: roll back and run the batch again with savepoints.
    Unguarded,
    Database(sqlx::Error),
    /// The transaction ran past its limit: abandoned, it rolls back.
    TimedOut(Duration),
}

impl From<RunError> for BatchError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Database(e) => Self::Database(e),
            RunError::Transient(e) => Self::Transient(e),
            RunError::TimedOut(limit) => Self::TimedOut(limit),
            // `run_and_commit` always reruns these guarded; never seen here.
            RunError::Unguarded => {
                Self::Transient(anyhow::anyhow!("an effect failed outside a savepoint"))
            }
        }
    }
}

impl From<sqlx::Error> for RunError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

impl BatchProcessor {
    /// Applies a batch and commits it. An error means nothing of the batch committed, or (for an
    /// error from COMMIT itself) that the outcome is unknown; either way the caller must not move
    /// the offset and should retry, which the claims make harmless. Messages PostgreSQL refuses
    /// are dead-lettered, not returned as an error.
    ///
    /// Events whose effect fails are tried again, each attempt in a new transaction after a
    /// capped backoff with no transaction open, until they succeed or run out of attempts; the
    /// call returns once every event of the batch is settled. (A lane does not wait: it uses
    /// [`BatchProcessor::process_pass`] and goes on with later batches.)
    pub async fn process(
        &self,
        topic: &str,
        partition: i32,
        messages: &[RawMessage],
    ) -> Result<BatchReport, BatchError> {
        let mut retrying = Retrying::default();
        let mut report = self
            .process_pass(topic, partition, messages, &mut retrying)
            .await?;
        while let Some(due) = retrying.next_due() {
            tokio::time::sleep_until(due).await;
            let later = self
                .process_pass(topic, partition, &[], &mut retrying)
                .await?;
            report.merge(later);
        }
        Ok(report)
    }

    /// Applies `messages`, with the events of `retrying` whose next attempt is due in front of
    /// them, in one transaction (more when PostgreSQL refuses some rows), and commits. Events
    /// whose effect fails and that have attempts left go into `retrying`, due after a capped
    /// backoff; events out of attempts are recorded as `failed`. On an error, nothing committed
    /// (or the outcome of COMMIT is unknown) and `retrying` is unchanged: call again.
    pub async fn process_pass(
        &self,
        topic: &str,
        partition: i32,
        messages: &[RawMessage],
        retrying: &mut Retrying,
    ) -> Result<BatchReport, BatchError> {
        self.process_pass_within(topic, partition, messages, retrying, None)
            .await
    }

    /// [`BatchProcessor::process_pass`] with each of its transactions bounded by `limit`: one
    /// that runs past it is abandoned (it rolls back) and the pass ends with
    /// [`BatchError::TimedOut`], nothing of it committed unless PostgreSQL refused some rows
    /// (then the parts before committed, and replay harmlessly). A lane applies such a batch
    /// again in halves.
    #[tracing::instrument(name = "batch", skip_all, fields(topic, partition, messages = messages.len()))]
    pub async fn process_pass_within(
        &self,
        topic: &str,
        partition: i32,
        messages: &[RawMessage],
        retrying: &mut Retrying,
        limit: Option<Duration>,
    ) -> Result<BatchReport, BatchError> {
        let origin = Origin { topic, partition };
        let now = tokio::time::Instant::now();
        let due: Vec<&Held> = retrying.held.iter().filter(|h| h.due <= now).collect();
        let attempts: Attempts = due.iter().map(|h| (h.message.offset, h.attempts)).collect();
        let part: Vec<&RawMessage> = due
            .iter()
            .map(|h| &h.message)
            .chain(messages.iter())
            .collect();
        let guarded = retrying.guarded > 0;
        let run = Run {
            attempts: &attempts,
            guarded,
            limit,
        };
        let pass = self.run_pass(origin, &part, &run).await?;
        retrying.guarded = match pass.report.effect_errors + pass.report.deferred {
            0 => retrying.guarded.saturating_sub(1),
            _ => GUARDED_PASSES,
        };
        if !pass.held.is_empty() {
            tracing::debug!(
                partition,
                events = pass.held.len(),
                "Effects failed; their events are tried again in a later transaction."
            );
        }
        let held: Vec<Held> = part
            .iter()
            .filter(|m| pass.held.contains(&m.offset))
            .map(|m| {
                let made = attempts.get(&m.offset).copied().unwrap_or(0) + 1;
                Held {
                    message: (*m).clone(),
                    attempts: made,
                    due: now + self.retry.delay(made),
                }
            })
            .collect();
        retrying
            .held
            .retain(|h| !attempts.contains_key(&h.message.offset));
        retrying.held.extend(held);
        retrying.held.sort_by_key(|h| h.message.offset);
        Ok(pass.report)
    }

    /// One pass over part of a batch, splitting out the messages PostgreSQL refuses.
    async fn run_pass(
        &self,
        origin: Origin<'_>,
        messages: &[&RawMessage],
        run: &Run<'_>,
    ) -> Result<Pass, BatchError> {
        match self.run_and_commit(origin, messages, run).await {
            Err(RunError::Database(e)) if crate::db::is_data_error(&e) => {
                tracing::warn!(partition = origin.partition, error = %e, "PostgreSQL refused part of a batch; splitting it to find the messages.");
                self.split_out_refused(origin, messages, e, run).await
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
        messages: &[&RawMessage],
        refusal: sqlx::Error,
        run: &Run<'_>,
    ) -> Result<Pass, BatchError> {
        let mut done = Pass::default();
        let mut parts = VecDeque::from([(messages, Some(refusal))]);
        while let Some((part, refusal)) = parts.pop_front() {
            let refusal = match refusal {
                Some(e) => e,
                None => match self.run_and_commit(origin, part, run).await {
                    Ok(pass) => {
                        done.merge(pass);
                        continue;
                    }
                    Err(RunError::Database(e)) if crate::db::is_data_error(&e) => e,
                    Err(e) => return Err(e.into()),
                },
            };
            match part {
                [message] => {
                    let letter = self.dead_letter_refused(origin, message, &refusal).await?;
                    done.report.merge(letter);
                }
                _ => {
                    let (left, right) = part.split_at(part.len() / 2);
                    parts.push_front((right, None));
                    parts.push_front((left, None));
                }
            }
        }
        Ok(done)
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

    /// Runs and commits part of a batch. Unguarded, the effect runs without a savepoint; if it
    /// fails, the transaction is rolled back and the part runs again guarded.
    async fn run_and_commit(
        &self,
        origin: Origin<'_>,
        messages: &[&RawMessage],
        run: &Run<'_>,
    ) -> Result<Pass, RunError> {
        let plan = Plan::new(origin, messages);
        match self.run_once(&plan, run, run.guarded).await {
            Err(RunError::Unguarded) => {
                tracing::debug!(
                    partition = origin.partition,
                    "An effect failed; running the batch again with savepoints."
                );
                self.run_once(&plan, run, true).await
            }
            other => other,
        }
    }

    /// One transaction, within the run's time limit: past it, the transaction is abandoned
    /// (dropped, so it rolls back) and the run ends with [`RunError::TimedOut`].
    async fn run_once(
        &self,
        plan: &Plan<'_>,
        run: &Run<'_>,
        guarded: bool,
    ) -> Result<Pass, RunError> {
        let transaction = self.transaction(plan, run.attempts, guarded);
        match run.limit {
            None => transaction.await,
            Some(limit) => tokio::time::timeout(limit, transaction)
                .await
                .unwrap_or(Err(RunError::TimedOut(limit))),
        }
    }

    async fn transaction(
        &self,
        plan: &Plan<'_>,
        attempts: &Attempts,
        guarded: bool,
    ) -> Result<Pass, RunError> {
        let mut tx = self.pool.begin().await?;
        match self.run(&mut tx, plan, attempts, guarded).await {
            Ok(pass) => {
                crate::failpoint!("consume::before_commit");
                crate::stallpoint!("consume::stall_before_commit");
                tx.commit().await?;
                Ok(pass)
            }
            Err(e) => {
                // The rollback's own failure changes nothing: the transaction did not commit.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// The batch's steps, in its transaction: dead letters, replayed captures, claims, replays
    /// and conflicts, effects, failures.
    async fn run(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        plan: &Plan<'_>,
        attempts: &Attempts,
        guarded: bool,
    ) -> Result<Pass, RunError> {
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
            return Ok(Pass {
                report,
                held: Vec::new(),
            });
        }
        let mut firsts: Vec<(i64, &Event)> = plan.firsts.iter().map(|(o, e)| (*o, e)).collect();
        let replays = self.sort_out_captures(tx, &mut firsts).await?;
        if !replays.is_empty() {
            report.conflicts += replays.len();
            conflicts::record(tx, origin, &replays).await?;
        }
        if firsts.is_empty() {
            return Ok(Pass {
                report,
                held: Vec::new(),
            });
        }
        let claimed: HashSet<String> = claims::claim(tx, origin, &firsts)
            .await?
            .into_iter()
            .collect();
        self.sort_out_replays(tx, plan, &claimed, &mut report)
            .await?;
        firsts.retain(|(_, e)| claimed.contains(e.key.as_str()));
        // An event tried again runs alone in its savepoint: failing again, it costs no search
        // through the fresh events it shares the transaction with.
        let (retried, fresh): (Vec<_>, Vec<_>) = firsts
            .iter()
            .partition(|(offset, _)| attempts.contains_key(offset));
        let mut failures = self.apply_splitting(tx, &fresh, guarded).await?;
        for one in retried.chunks(1) {
            failures.extend(self.apply_splitting(tx, one, true).await?);
        }
        failures.sort_by_key(|(offset, _, _)| *offset);
        let held = self
            .settle_failures(tx, &failures, attempts, &mut report)
            .await?;
        report.applied += firsts.len() - failures.len();
        if tracing::enabled!(target: APPLIED_LOG, tracing::Level::DEBUG) {
            let failed: HashSet<i64> = failures.iter().map(|(o, _, _)| *o).collect();
            report.applied_events = firsts
                .iter()
                .filter(|(o, _)| !failed.contains(o))
                .map(|(_, e)| (e.key.to_string(), e.event_type.clone()))
                .collect();
        }
        Ok(Pass { report, held })
    }

    /// Applies the effect to the claimed events with one call per batch. Guarded, it runs in a
    /// savepoint, and when it fails the part is split in halves, each applied after a savepoint,
    /// until the events that fail alone are found; they are returned with their
    /// errors and everything else stays applied. Unguarded, a failure ends the
    /// run ([`RunError::Unguarded`]). A transient failure ends the run either way.
    async fn apply_splitting<'e>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        events: &[(i64, &'e Event)],
        guarded: bool,
    ) -> Result<Vec<(i64, &'e Event, anyhow::Error)>, RunError> {
        if !guarded && !events.is_empty() {
            let batch: Vec<&Event> = events.iter().map(|(_, e)| *e).collect();
            return match self.effect.apply_batch(tx, &batch).await {
                Ok(()) => Ok(Vec::new()),
                Err(e) if effect::classify(&e) == FailureKind::Transient => {
                    Err(RunError::Transient(e))
                }
                Err(_) => Err(RunError::Unguarded),
            };
        }
        let mut failures = Vec::new();
        let mut savepoint = Savepoint::establish(tx).await?;
        // Each part with whether it is known to fail: a failing part whose left half applies
        // holds its failure in the right half, which is then split without being tried whole.
        // Parts start at most GUARDED_PART events long, so a failure undoes little work. Popped
        // from the end: pushed last to first.
        let mut parts: Vec<_> = events
            .chunks(GUARDED_PART)
            .rev()
            .map(|p| (p, false))
            .collect();
        while let Some((part, known_to_fail)) = parts.pop() {
            let (tried, rest) = match part {
                [] => continue,
                [_, _, ..] if known_to_fail => part.split_at(part.len() / 2),
                _ => (part, &part[part.len()..]),
            };
            match savepoint.attempt(tx, &*self.effect, tried).await? {
                None => parts.push((rest, true)),
                Some(error) => {
                    parts.push((rest, false));
                    match tried {
                        [(offset, event)] => failures.push((*offset, *event, error)),
                        _ => parts.push((tried, true)),
                    }
                }
            }
        }
        Ok(failures)
    }

    /// Records each failed event: deferred, its claim becomes `deferred` with the payload and
    /// its due time; out of attempts (or failed for good), its claim becomes `failed` with the
    /// error and the payload; otherwise its claim is taken back and its offset returned, to be
    /// tried again in a later transaction.
    async fn settle_failures(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        failures: &[(i64, &Event, anyhow::Error)],
        attempts: &Attempts,
        report: &mut BatchReport,
    ) -> Result<Vec<i64>, RunError> {
        let mut failed = Vec::new();
        let mut deferred = Vec::new();
        let mut held = Vec::new();
        for (offset, event, error) in failures {
            if let Some(not_yet) = error.downcast_ref::<Deferred>() {
                let policy = self.defer.policy(&event.source, &*self.effect);
                let (due, deadline) = super::deferred::first_due(not_yet, &policy);
                tracing::debug!(key = event.key.as_str(), reason = not_yet.reason, %due, "An effect deferred its event.");
                deferred.push(Deferral {
                    event,
                    reason: not_yet.reason.clone(),
                    due,
                    deadline,
                });
                continue;
            }
            let attempt = attempts.get(offset).copied().unwrap_or(0) + 1;
            let permanent = effect::classify(error) == FailureKind::Permanent;
            let error = format!("{error:#}");
            let key = event.key.as_str();
            tracing::warn!(
                key,
                attempt,
                effect = self.effect.name(),
                error,
                "An effect failed."
            );
            if permanent || attempt >= self.retry.attempts() {
                failed.push(Failure {
                    event,
                    attempts: attempt as i32,
                    error,
                });
            } else {
                held.push(*offset);
            }
        }
        report.effect_errors += failures.len() - deferred.len();
        report.failed += failed.len();
        report.deferred += deferred.len();
        if !failed.is_empty() {
            claims::fail(tx, &failed, self.effect.spec().as_ref()).await?;
        }
        if !deferred.is_empty() {
            claims::defer(tx, &deferred, self.effect.spec().as_ref()).await?;
        }
        if !held.is_empty() {
            let keys: Vec<&str> = failures
                .iter()
                .filter(|(o, _, _)| held.contains(o))
                .map(|(_, e, _)| e.key.as_str())
                .collect();
            claims::release(tx, &keys).await?;
        }
        Ok(held)
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
        let stored = match unclaimed.is_empty() {
            true => HashMap::new(),
            false => claims::stored_hashes(tx, &unclaimed).await?,
        };
        // The payload each loser is compared with: a claim made in this batch for a later copy
        // of its key, or the one stored before for a key not claimed here.
        let copied: HashSet<&str> = plan.copies.iter().map(|(_, e)| e.key.as_str()).collect();
        let mut winners: HashMap<&str, &[u8]> = plan
            .firsts
            .iter()
            .map(|(_, e)| (e.key.as_str(), &e.payload_sha256[..]))
            .filter(|(k, _)| copied.contains(k) && claimed.contains(*k))
            .collect();
        winners.extend(stored.iter().map(|(k, h)| (k.as_str(), h.as_slice())));
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
}

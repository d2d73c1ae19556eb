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

mod error;
mod expired;
mod failures;
mod guarded;
mod outcome;
mod plan;
mod refused;
mod replays;
mod report;
mod retrying;

pub use error::BatchError;
pub use outcome::Outcome;
pub use report::{BatchReport, DeadLettered, APPLIED_LOG, UNKNOWN_SOURCE};
pub use retrying::{EffectRetry, Retrying, MAX_EFFECT_ATTEMPTS, MAX_EFFECT_BACKOFF};

use super::settle::DeferSettings;
use crate::claims::{self, conflicts, dead_letters, Origin};
use crate::db::Db;
use crate::effect::Effect;
use crate::envelope::Event;
use crate::shard::Shards;
use crate::sources::Paused;
use error::RunError;
use guarded::EffectFailure;
use plan::Plan;
use report::{Applied, Pass};
use retrying::{Held, GUARDED_PASSES};
use sqlx::{Postgres, Transaction};
use std::collections::{HashMap, HashSet};
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
    /// Its `traceparent` header: the trace of the ingress request that wrote it.
    pub traceparent: Option<String>,
    /// Its headers, all of them, in order: a CloudEvent's attributes in binary mode, an outbox
    /// message's event id; kept with a dead letter so a replay writes them again.
    pub headers: crate::inputs::Headers,
}

/// Attempts made so far at each event of a pass, by offset; absent means none.
type Attempts = HashMap<i64, u32>;

/// How the transactions of one pass (or of its part on one shard) run.
#[derive(Clone, Copy)]
struct Run<'a> {
    /// The shard's database.
    pool: &'a Db,
    attempts: &'a Attempts,
    /// Whether the effect runs in savepoints from the start.
    guarded: bool,
    /// The longest one transaction may take; None for no limit.
    limit: Option<Duration>,
    /// Where its transactions find the paused sources, whose events they hold.
    pauses: Pauses<'a>,
}

/// Where a pass's transactions find the paused sources (`source_pauses`, on the first database).
#[derive(Clone, Copy)]
enum Pauses<'a> {
    /// Each transaction reads them itself, just before its claims: one database holds the
    /// claims and the pauses, and the read costs no connection of its own.
    InTransaction,
    /// Read on the first database when the pass began: its transactions run on other shards.
    Read(&'a Paused),
}

impl Pauses<'_> {
    /// The paused sources for the transaction `tx`: read in it, or those read before it.
    async fn read(self, tx: &mut sqlx::PgConnection) -> sqlx::Result<Paused> {
        match self {
            Pauses::InTransaction => Paused::read(tx).await,
            Pauses::Read(paused) => Ok(paused.clone()),
        }
    }
}

/// Applies batches for one consumer; cheap to clone into each partition lane.
#[derive(Clone)]
pub struct BatchProcessor {
    /// Where the claims and effects are written: one database, or several shards each holding
    /// the claims of its route keys ([`crate::shard`]).
    pub shards: Shards,
    /// The effect applied to each claimed event.
    pub effect: Arc<dyn Effect>,
    /// How a failing effect is retried before its event is settled `failed`.
    pub retry: EffectRetry,
    /// How long deferred events wait, and when they are given up.
    pub defer: DeferSettings,
    /// The format of the topic's messages.
    pub input: crate::inputs::Input,
}

impl BatchProcessor {
    /// A processor applying `effect` through `shards` (a `Db` for a single database), with
    /// the default retries ([`EffectRetry::default`]) and deferral settings
    /// ([`DeferSettings::default`]).
    pub fn new(shards: impl Into<Shards>, effect: Arc<dyn Effect>) -> Self {
        Self {
            shards: shards.into(),
            effect,
            retry: EffectRetry::default(),
            defer: DeferSettings::default(),
            input: crate::inputs::Input::default(),
        }
    }

    /// Reading the topic's messages as `input` says.
    pub fn with_input(mut self, input: crate::inputs::Input) -> Self {
        self.input = input;
        self
    }

    /// With these retries of a failing effect.
    pub fn with_retry(mut self, retry: EffectRetry) -> Self {
        self.retry = retry;
        self
    }

    /// With these deferral settings.
    pub fn with_defer(mut self, defer: DeferSettings) -> Self {
        self.defer = defer;
        self
    }

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
        crate::trace::link_current(messages.iter().map(|m| m.traceparent.as_deref()));
        let now = tokio::time::Instant::now();
        let due: Vec<&Held> = retrying.held.iter().filter(|h| h.due <= now).collect();
        let attempts: Attempts = due.iter().map(|h| (h.message.offset, h.attempts)).collect();
        let part: Vec<&RawMessage> = due
            .iter()
            .map(|h| &h.message)
            .chain(messages.iter())
            .collect();
        let guarded = retrying.guarded > 0;
        let paused = match (self.shards.len(), part.is_empty()) {
            (1, _) => None,
            (_, true) => Some(Paused::none()),
            (_, false) => Some(Paused::read(self.shards.first()).await?),
        };
        let reads = plan::Read::all(&self.input, topic, &part);
        let reads: Vec<&plan::Read<'_>> = reads.iter().collect();
        let run = Run {
            pool: self.shards.first(),
            attempts: &attempts,
            guarded,
            limit,
            pauses: paused.as_ref().map_or(Pauses::InTransaction, Pauses::Read),
        };
        let pass = match self.shards.len() {
            1 => self.run_pass(origin, &reads, &run).await?,
            _ => self.run_shards(origin, &reads, &run).await?,
        };
        retrying.guarded = match pass.report.effect_errors + pass.report.deferred {
            0 => retrying.guarded.saturating_sub(1),
            _ => GUARDED_PASSES,
        };
        let again = Held::again(&part, &attempts, &pass.again, now);
        retrying.replace_tried(&attempts, again);
        Ok(pass.report)
    }

    /// A pass over several shards: the messages split by the shard of their route key, each
    /// shard's part in its own transaction (all at once), claims sorted within each as always.
    /// The pass succeeds only when every part committed, so the caller moves the offset only
    /// then; a part that committed before another failed is harmless on replay, its keys found
    /// claimed. Parts commit independently and none waits on another shard while holding its
    /// locks, so lanes racing on overlapping keys cannot deadlock across shards.
    async fn run_shards(
        &self,
        origin: Origin<'_>,
        reads: &[&plan::Read<'_>],
        run: &Run<'_>,
    ) -> Result<Pass, BatchError> {
        let parts = plan::by_shard(&self.shards, reads);
        let runs: Vec<Run<'_>> = parts
            .iter()
            .map(|(shard, _)| Run {
                pool: self.shards.pool(*shard),
                ..*run
            })
            .collect();
        let passes = futures_util::future::join_all(
            parts
                .iter()
                .zip(&runs)
                .map(|((_, part), run)| self.run_pass(origin, part, run)),
        )
        .await;
        let mut merged = Pass::default();
        for pass in passes {
            merged.merge(pass?);
        }
        self.dead_letter_on_first(origin, reads, &merged.dead_later)
            .await?;
        Ok(merged)
    }

    /// Writes the dead letters of a batch's parts to the first shard, in a transaction of its
    /// own after every part committed and before the offset may move: a crash in between reads
    /// the batch again, and a dead letter written twice is kept once.
    async fn dead_letter_on_first(
        &self,
        origin: Origin<'_>,
        reads: &[&plan::Read<'_>],
        dead: &[DeadLettered],
    ) -> Result<(), BatchError> {
        if dead.is_empty() {
            return Ok(());
        }
        let letters: Vec<dead_letters::DeadLetter<'_>> = dead
            .iter()
            .filter_map(|d| {
                let m = reads
                    .iter()
                    .map(|r| r.message)
                    .find(|m| m.offset == d.offset)?;
                Some(dead_letters::DeadLetter {
                    offset: m.offset,
                    key: m.key.as_deref(),
                    value: m.value.as_deref(),
                    headers: &m.headers,
                    reason: d.reason.clone(),
                })
            })
            .collect();
        let mut tx = self.shards.first().begin().await?;
        dead_letters::insert(&mut tx, origin, &letters).await?;
        tx.commit().await?;
        Ok(())
    }

    /// One pass over part of a batch, splitting out the messages PostgreSQL refuses.
    async fn run_pass(
        &self,
        origin: Origin<'_>,
        reads: &[&plan::Read<'_>],
        run: &Run<'_>,
    ) -> Result<Pass, BatchError> {
        match self.run_and_commit(origin, reads, run).await {
            Err(RunError::Database(e)) if crate::db::is_data_error(&e) => {
                tracing::warn!(partition = origin.partition, error = %e, "PostgreSQL refused part of a batch; splitting it to find the messages.");
                self.split_out_refused(origin, reads, e, run).await
            }
            other => Ok(other?),
        }
    }

    /// Runs and commits part of a batch. Unguarded, the effect runs without a savepoint; if it
    /// fails, the transaction is rolled back and the part runs again guarded.
    async fn run_and_commit(
        &self,
        origin: Origin<'_>,
        reads: &[&plan::Read<'_>],
        run: &Run<'_>,
    ) -> Result<Pass, RunError> {
        let plan = Plan::new(origin, reads);
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
        let transaction = self.transaction(plan, run, guarded);
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
        run: &Run<'_>,
        guarded: bool,
    ) -> Result<Pass, RunError> {
        let mut tx = run.pool.begin().await?;
        match self.run(&mut tx, plan, run, guarded).await {
            Ok(pass) => {
                crate::failpoint!("consume::before_commit");
                crate::stallpoint!("consume::stall_before_commit");
                tx.commit().await?;
                pass.log_applied(plan.origin.partition);
                Ok(pass)
            }
            Err(e) => {
                // The rollback's own failure changes nothing: the transaction did not commit.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// The batch's steps, in its transaction: dead letters, replayed captures, expired replays,
    /// the paused sources, claims, replays and conflicts, effects, failures.
    async fn run(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        plan: &Plan<'_>,
        run: &Run<'_>,
        guarded: bool,
    ) -> Result<Pass, RunError> {
        let origin = plan.origin;
        let mut report = BatchReport::default();
        let mut dead_later = Vec::new();
        if !plan.dead.is_empty() {
            // With several shards they go to the first, once every part committed.
            match self.shards.len() {
                1 => dead_letters::insert(tx, origin, &plan.dead).await?,
                _ => dead_later = plan.dead.iter().map(DeadLettered::from).collect(),
            }
            report.dead_letters = plan.dead.iter().map(DeadLettered::from).collect();
            for _ in &plan.dead {
                report.tally(UNKNOWN_SOURCE, Outcome::DeadLetter);
            }
        }
        for source in &plan.skipped {
            report.tally(source, Outcome::Skipped);
        }
        let mut firsts: Vec<(i64, &Event)> = plan.firsts.clone();
        if !firsts.is_empty() {
            let replays = self.sort_out_captures(tx, &mut firsts).await?;
            if !replays.is_empty() {
                for (_, event, _) in &replays {
                    report.tally(&event.source, Outcome::Conflict);
                }
                conflicts::record(tx, origin, &replays).await?;
            }
            self.sort_out_expired(tx, origin, &mut firsts, &mut report)
                .await?;
        }
        if firsts.is_empty() {
            return Ok(Pass {
                dead_later,
                ..Pass::reporting(report)
            });
        }
        let paused = run.pauses.read(tx).await?;
        let claims::Claimed {
            keys: claimed,
            found,
        } = claims::claim(tx, origin, &firsts).await?;
        self.sort_out_replays(tx, (plan, &firsts), &claimed, found, &mut report)
            .await?;
        firsts.retain(|(_, e)| claimed.contains(e.key.as_str()));
        let held = plan::hold(&paused, &mut firsts);
        let pass = self
            .apply_claimed(tx, (&firsts, held), run.attempts, guarded, report)
            .await?;
        Ok(Pass { dead_later, ..pass })
    }

    /// Applies the effect to the events claimed here and settles those whose effect did not
    /// apply, and those held (their source paused), which are deferred without their effect.
    /// An event tried again runs alone in its savepoint: failing again, it costs no search
    /// through the fresh events it shares the transaction with.
    async fn apply_claimed(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        (claimed, held): (&[(i64, &Event)], Vec<EffectFailure<'_>>),
        attempts: &Attempts,
        guarded: bool,
        mut report: BatchReport,
    ) -> Result<Pass, RunError> {
        let (retried, fresh): (Vec<_>, Vec<_>) = claimed
            .iter()
            .partition(|(offset, _)| attempts.contains_key(offset));
        let mut failures = held;
        failures.extend(self.apply_splitting(tx, &fresh, guarded).await?);
        for one in retried.chunks(1) {
            failures.extend(self.apply_splitting(tx, one, true).await?);
        }
        failures.sort_by_key(|f| f.offset);
        let again = self
            .settle_failures(tx, &failures, attempts, &mut report)
            .await?;
        let failed: HashSet<i64> = failures.iter().map(|f| f.offset).collect();
        let succeeded = claimed.iter().filter(|(o, _)| !failed.contains(o));
        for (_, event) in succeeded.clone() {
            report.tally(&event.source, Outcome::Applied);
            for keyed in event.keyed_notes() {
                *report
                    .keyed
                    .entry((event.source.clone(), keyed))
                    .or_default() += 1;
            }
        }
        let mut applied = Vec::new();
        if tracing::enabled!(target: APPLIED_LOG, tracing::Level::DEBUG) {
            applied = succeeded
                .map(|(_, e)| Applied {
                    key: e.key.to_string(),
                    event_type: e.event_type.clone(),
                })
                .collect();
        }
        Ok(Pass {
            report,
            again,
            applied,
            dead_later: Vec::new(),
        })
    }
}

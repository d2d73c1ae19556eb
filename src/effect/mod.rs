//! Effects: what an event does, written in the same transaction as its claim. The built-in
//! ones are [`ledger`] and [`http`]; [`Registry`] finds any effect by the name given to
//! `--effect`, including an application's own.
//!
//! An [`Effect`] receives the open transaction and the parsed event. Whatever it writes commits
//! together with the claim or not at all, so a crash can never leave a claimed event without its
//! effect, nor an effect without its claim.

pub mod http;
pub mod ledger;
mod registry;

pub use http::HttpOutbox;
pub use ledger::Ledger;
pub use registry::Registry;

use crate::envelope::Event;
use async_trait::async_trait;
use sqlx::{Postgres, Transaction};
use std::sync::Arc;

/// The transaction an effect writes in: the batch's own. When the effect fails, only its own
/// work is undone: rolled back to a savepoint taken before it, or with the whole transaction
/// when the batch then runs again.
pub type Tx<'a> = Transaction<'a, Postgres>;

/// Something an event does to the database.
///
/// Implementations must do all their work through `tx`; work done elsewhere (an HTTP call, a
/// second connection) does not roll back with the claim and belongs in the outbox instead.
///
/// What an error does depends on its [`FailureKind`] (see [`classify`]):
/// - transient or infrastructure trouble (a deadlock, a timeout, a lost connection, a full disk,
///   a read-only database, a missing table or privilege, or an error wrapped in [`Transient`])
///   rolls the whole batch back; nothing is settled and the batch is retried with backoff;
/// - an error wrapped in [`Permanent`] settles the event as `failed` at once;
/// - any other error is taken as deterministic: the event alone is retried and, after the
///   configured number of attempts, recorded as `failed` with the error for an operator.
#[async_trait]
pub trait Effect: Send + Sync + 'static {
    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// Applies the event. Called at most once per committed claim.
    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> anyhow::Result<()>;

    /// Applies every event of a batch, in offset order; the consumer calls this once per batch.
    /// The default calls [`Effect::apply`] for each event, so a simple effect stays simple; an
    /// effect that writes rows does better with one statement over the whole batch (`unnest`
    /// or a multi-row insert), as [`Ledger`] and [`HttpOutbox`] do.
    ///
    /// An error rolls back everything this call wrote. The consumer then calls this again on
    /// parts of the batch, halving a part that fails, until it has found the events that fail
    /// alone; only those are retried (in a later transaction) or recorded as failed.
    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> anyhow::Result<()> {
        for event in events {
            self.apply(tx, event).await?;
        }
        Ok(())
    }

    /// How to build this effect again ([`Registry::from_spec`]), recorded on failed claims so
    /// that an operator's retry runs the same effects. None (the default) for an effect the
    /// [`Registry`] names for it, or that cannot be rebuilt: its retries need the effect given.
    fn spec(&self) -> Option<serde_json::Value> {
        None
    }
}

/// How an effect's error is handled; see [`Effect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Says nothing about the event: roll the batch back and retry it later, settling nothing.
    Transient,
    /// Probably fails the same way again: retry the event a few times, then settle it `failed`.
    Deterministic,
    /// Will fail the same way every time: settle the event `failed` at once.
    Permanent,
}

/// Marks an effect's error as permanent: the event is recorded as `failed` without retries.
#[derive(Debug, thiserror::Error)]
#[error("{0:#}")]
pub struct Permanent(pub anyhow::Error);

/// Marks an effect's error as transient: the batch is rolled back and retried, nothing settles.
#[derive(Debug, thiserror::Error)]
#[error("{0:#}")]
pub struct Transient(pub anyhow::Error);

/// Sorts an effect's error: an explicit [`Permanent`] or [`Transient`] wins; otherwise a
/// database error anywhere in the chain decides by its SQLSTATE ([`crate::db::is_transient`]);
/// anything else is [`FailureKind::Deterministic`].
pub fn classify(error: &anyhow::Error) -> FailureKind {
    if error.downcast_ref::<Permanent>().is_some() {
        return FailureKind::Permanent;
    }
    if error.downcast_ref::<Transient>().is_some() {
        return FailureKind::Transient;
    }
    let db_error = error.chain().find_map(|e| e.downcast_ref::<sqlx::Error>());
    match db_error {
        Some(e) if crate::db::is_transient(e) => FailureKind::Transient,
        _ => FailureKind::Deterministic,
    }
}

/// Several effects applied in order in the same transaction, such as a ledger row and an
/// outbox operation.
pub struct Chain(pub Vec<Arc<dyn Effect>>);

#[async_trait]
impl Effect for Chain {
    fn name(&self) -> &'static str {
        "chain"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> anyhow::Result<()> {
        for effect in &self.0 {
            effect.apply(tx, event).await?;
        }
        Ok(())
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> anyhow::Result<()> {
        for effect in &self.0 {
            effect.apply_batch(tx, events).await?;
        }
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        let parts: Option<Vec<_>> = self.0.iter().map(|e| e.spec()).collect();
        Some(serde_json::json!({ "effect": "chain", "of": parts? }))
    }
}

//! Effects: what an event does, written in the same transaction as its claim. The built-in
//! ones are [`ledger`], [`http`] and [`kafka`]; [`Registry`] finds any effect by the name given to
//! `--effect`, including an application's own.
//!
//! An [`Effect`] receives the open transaction and the parsed event. Whatever it writes commits
//! together with the claim or not at all, so a crash can never leave a claimed event without its
//! effect, nor an effect without its claim.
//!
//! An effect answers `Ok(())` (applied) or an [`EffectError`]: permanent, transient, a plain
//! failure, or [`EffectError::NotYet`] with a [`Deferred`]: "not yet", for an event that arrives before what it refers to. A deferred event
//! does not hold its partition: its claim is committed as `deferred` with its payload and a due
//! time, and the consumer applies it again when due ([`crate::consume::DeferredApplier`]).
//! [`newest`] keeps the latest state of an object when events arrive out of order. The guide for
//! effect authors is `docs/effects.md`.
//!
//! # Example
//!
//! An effect that marks an invoice paid, deferring a payment whose invoice has not arrived:
//!
//! ```
//! use anyhow::Context as _;
//! use replayproof::async_trait;
//! use replayproof::effect::{Deferred, Effect, EffectError, Tx};
//! use replayproof::envelope::Event;
//!
//! struct MarkInvoicePaid;
//!
//! #[async_trait]
//! impl Effect for MarkInvoicePaid {
//!     fn name(&self) -> &'static str {
//!         "invoices"
//!     }
//!
//!     async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
//!         let invoice = event.payload()?["invoice"]
//!             .as_str()
//!             .context("the payment names no invoice")
//!             .map_err(EffectError::Permanent)?;
//!         let paid = sqlx::query("UPDATE invoices SET paid = true WHERE id = $1 AND NOT paid")
//!             .bind(invoice)
//!             .execute(&mut **tx)
//!             .await?
//!             .rows_affected();
//!         if paid == 0 {
//!             let exists: bool =
//!                 sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM invoices WHERE id = $1)")
//!                     .bind(invoice)
//!                     .fetch_one(&mut **tx)
//!                     .await?;
//!             if !exists {
//!                 // Not an error, and not done: applied again when due.
//!                 return Err(Deferred::new(format!("invoice {invoice} has not arrived")).into());
//!             }
//!             let paid_twice = anyhow::anyhow!("invoice {invoice} was already paid");
//!             return Err(EffectError::Permanent(paid_twice));
//!         }
//!         Ok(())
//!     }
//! }
//!
//! // Registered by name, it runs with `consume --effect invoices`.
//! let cli = replayproof::Cli::new().with_effect("invoices", MarkInvoicePaid);
//! # drop(cli);
//! ```

#![warn(missing_docs)]

mod error;
pub mod http;
pub mod kafka;
pub mod ledger;
pub mod newest;
pub mod obligation;
mod registry;
#[cfg(feature = "failpoints")]
pub mod testing;

pub use error::{EffectError, FailureKind};
pub use http::HttpOutbox;
pub use kafka::KafkaOutput;
pub use ledger::Ledger;
pub use registry::{built_in_needs, BuiltIns, Registry};

use crate::envelope::Event;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{Postgres, Transaction};
use std::sync::Arc;
use std::time::Duration;

/// The transaction an effect writes in: the batch's own. When the effect fails, only its own
/// work is undone: rolled back to a savepoint taken before it, or with the whole transaction
/// when the batch then runs again.
pub type Tx<'a> = Transaction<'a, Postgres>;

/// Something an event does to the database.
///
/// Implementations must do all their work through `tx`; work done elsewhere (an HTTP call, a
/// second connection) does not roll back with the claim and belongs in the outbox instead.
///
/// What an error does depends on its [`EffectError`] variant ([`EffectError::kind`]):
/// - [`EffectError::NotYet`] ("not yet") commits the claim as `deferred` with the payload; the event is
///   applied again when due, until it applies or passes its deadline ([`DeferPolicy`]);
/// - transient or infrastructure trouble (a deadlock, a timeout, a lost connection, a full disk,
///   a read-only database, a missing table or privilege: [`EffectError::Transient`]) rolls the
///   whole batch back; nothing is settled and the batch is retried with backoff;
/// - [`EffectError::Permanent`] settles the event as `failed` at once;
/// - [`EffectError::Failed`] (any other error `?` converts) is taken as deterministic: the event
///   alone is retried and, after the configured number of attempts, recorded as `failed` with
///   the error for an operator.
#[async_trait]
pub trait Effect: Send + Sync + 'static {
    /// A short name for logs.
    fn name(&self) -> &'static str;

    /// Applies the event. Called at most once per committed claim.
    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError>;

    /// Applies every event of a batch, in offset order; the consumer calls this once per batch.
    /// The default calls [`Effect::apply`] for each event, inside the event's span
    /// ([`Event::span`]), so a simple effect stays simple and its spans join the event's trace;
    /// an effect that writes rows does better with one statement over the whole batch (`unnest`
    /// or a multi-row insert), as [`Ledger`] and [`HttpOutbox`] do, carrying each event's
    /// context as [`Event::traceparent`].
    ///
    /// An error rolls back everything this call wrote. The consumer then calls this again on
    /// parts of the batch, halving a part that fails, until it has found the events that fail
    /// alone; only those are retried (in a later transaction) or recorded as failed.
    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        for event in events {
            // In the event's trace, when traces are exported.
            tracing::Instrument::instrument(self.apply(tx, event), event.span()).await?;
        }
        Ok(())
    }

    /// How to build this effect again ([`Registry::from_spec`]), recorded on failed claims so
    /// that an operator's retry runs the same effects. None (the default) for an effect the
    /// [`Registry`] names for it, or that cannot be rebuilt: its retries need the effect given.
    fn spec(&self) -> Option<serde_json::Value> {
        None
    }

    /// How long this effect's deferred events wait: the first wait, its cap, and the deadline
    /// after which a deferred event is settled `failed`. None (the default) takes the
    /// consumer's `--defer-*` settings; a `--defer-source` setting for the event's source wins
    /// over both.
    fn defer_policy(&self) -> Option<DeferPolicy> {
        None
    }
}

/// An effect's answer "not yet": the event refers to something that has not arrived (Stripe's
/// `invoice.paid` before `invoice.created`, a payment before the order it pays). Return it as
/// the error of [`Effect::apply`] (`Err(Deferred::new(..).into())`, an [`EffectError::NotYet`]): the effect's work for this event is undone, its claim is
/// committed as `deferred` with the payload and `reason`, and the event is applied again when
/// due, each time in its own transaction that moves the claim to `done` with the effect.
///
/// ```
/// # use replayproof::effect::{Deferred, EffectError};
/// # fn check() -> Result<(), EffectError> {
/// return Err(Deferred::new("order 42 does not exist yet")
///     .after(std::time::Duration::from_secs(30))
///     .into());
/// # }
/// # assert!(check().is_err());
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error("deferred: {reason}")]
pub struct Deferred {
    /// Why not yet; shown by `events show` and kept as the failure's reason past the deadline.
    pub reason: String,
    /// When to try again; None for the backoff of the [`DeferPolicy`]. Never later than the
    /// deadline.
    pub until: Option<DateTime<Utc>>,
}

impl Deferred {
    /// Not yet, for `reason`; tried again after the policy's backoff.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            until: None,
        }
    }

    /// Tried again at `at` rather than after the backoff.
    pub fn until(mut self, at: DateTime<Utc>) -> Self {
        self.until = Some(at);
        self
    }

    /// Tried again after `wait` rather than after the backoff.
    pub fn after(self, wait: Duration) -> Self {
        self.until(later(Utc::now(), wait))
    }
}

/// `now + wait`, saturating at the latest time there is.
pub(crate) fn later(now: DateTime<Utc>, wait: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(wait)
        .ok()
        .and_then(|w| now.checked_add_signed(w))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// How long deferred events wait: the wait after the first "not yet", doubled after each
/// further one up to `max_backoff`, and the `deadline`, counted from the first deferral, after
/// which the event is settled `failed` with its last reason.
///
/// The policy in force for an event is stored on its claim when the claim is first settled
/// `deferred` or `failed`, so every later attempt (the deferred applier's, an operator's retry)
/// follows the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeferPolicy {
    /// The wait after the first deferral.
    #[serde(with = "humantime_text")]
    pub backoff: Duration,
    /// The longest wait between two attempts.
    #[serde(with = "humantime_text")]
    pub max_backoff: Duration,
    /// How long after its first deferral an event may still be deferred.
    #[serde(with = "humantime_text")]
    pub deadline: Duration,
}

/// A duration stored as humantime's text (`"10s"`, `"3days"`), readable in `events show`.
mod humantime_text {
    use serde::{Deserialize as _, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

impl Default for DeferPolicy {
    /// 10 s, doubled up to 10 min, for at most 24 h.
    fn default() -> Self {
        Self {
            backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(600),
            deadline: Duration::from_secs(24 * 3600),
        }
    }
}

impl DeferPolicy {
    /// The wait after deferral number `deferrals` (from 1).
    pub fn delay(&self, deferrals: u32) -> Duration {
        let factor = 1u32
            .checked_shl(deferrals.saturating_sub(1))
            .unwrap_or(u32::MAX);
        self.backoff.saturating_mul(factor).min(self.max_backoff)
    }

    /// The deadline of an event first deferred at `now`.
    pub fn deadline_from(&self, now: DateTime<Utc>) -> DateTime<Utc> {
        later(now, self.deadline)
    }

    /// When an event deferred (`not_yet`) for the `deferrals`-th time at `now` is due again:
    /// the time the effect asked for, else after [`DeferPolicy::delay`]; never before `now`,
    /// never after `deadline`.
    pub fn due(
        &self,
        not_yet: &Deferred,
        deferrals: u32,
        now: DateTime<Utc>,
        deadline: DateTime<Utc>,
    ) -> DateTime<Utc> {
        not_yet
            .until
            .unwrap_or_else(|| later(now, self.delay(deferrals)))
            .clamp(now, deadline.max(now))
    }
}

/// Applies `effect` to one event in a savepoint of `tx`: its work is kept when it succeeds and
/// undone when it fails (or defers). The outer result is the database's; the inner, the
/// effect's.
pub async fn apply_in_savepoint(
    tx: &mut sqlx::PgConnection,
    effect: &dyn Effect,
    event: &Event,
) -> sqlx::Result<Result<(), EffectError>> {
    let mut savepoint = sqlx::Acquire::begin(tx).await?;
    match effect.apply(&mut savepoint, event).await {
        Ok(()) => savepoint.commit().await.map(|()| Ok(())),
        Err(e) => savepoint.rollback().await.map(|()| Err(e)),
    }
}

/// Several effects applied in order in the same transaction, such as a ledger row and an
/// outbox operation. When one defers or fails, the work of all of them for that event is undone.
pub struct Chain(pub Vec<Arc<dyn Effect>>);

#[async_trait]
impl Effect for Chain {
    fn name(&self) -> &'static str {
        "chain"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        for effect in &self.0 {
            effect.apply(tx, event).await?;
        }
        Ok(())
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        for effect in &self.0 {
            effect.apply_batch(tx, events).await?;
        }
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        let parts: Option<Vec<_>> = self.0.iter().map(|e| e.spec()).collect();
        Some(serde_json::json!({ "effect": "chain", "of": parts? }))
    }

    /// The first policy one of the chained effects has.
    fn defer_policy(&self) -> Option<DeferPolicy> {
        self.0.iter().find_map(|e| e.defer_policy())
    }
}

//! Effects: what an event does, written in the same transaction as its claim.
//!
//! An [`Effect`] receives the open transaction and the parsed event. Whatever it writes commits
//! together with the claim or not at all, so a crash can never leave a claimed event without its
//! effect, nor an effect without its claim.

use crate::envelope::Event;
use anyhow::Context as _;
use async_trait::async_trait;
use sqlx::{Postgres, Transaction};
use std::sync::Arc;

/// The transaction an effect writes in. It is a savepoint inside the batch transaction: when the
/// effect fails, only this event's work is rolled back.
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

    /// How to build this effect again ([`from_spec`]), recorded on failed claims so that an
    /// operator's retry runs the same effects. None (the default) for an effect that cannot be
    /// rebuilt by name; its retries need the effect handed to [`crate::ops::retry`].
    fn spec(&self) -> Option<serde_json::Value> {
        None
    }
}

/// Builds an effect from its [`Effect::spec`].
pub fn from_spec(spec: &serde_json::Value) -> anyhow::Result<Arc<dyn Effect>> {
    let field = |name: &str| spec.get(name).and_then(serde_json::Value::as_str);
    match field("effect") {
        Some("ledger") => Ok(Arc::new(Ledger)),
        Some("http") => Ok(Arc::new(HttpOutbox {
            target_url: field("target_url")
                .context("an http effect spec names its target_url")?
                .to_owned(),
            reconcile_url: field("reconcile_url").map(str::to_owned),
            max_attempts: spec
                .get("max_attempts")
                .and_then(serde_json::Value::as_i64)
                .and_then(|n| i32::try_from(n).ok())
                .context("an http effect spec names its max_attempts")?,
        })),
        Some("chain") => {
            let parts = spec
                .get("of")
                .and_then(serde_json::Value::as_array)
                .context("a chain spec lists its effects under `of`")?;
            Ok(Arc::new(Chain(
                parts.iter().map(from_spec).collect::<anyhow::Result<_>>()?,
            )))
        }
        _ => anyhow::bail!("not an effect spec: {spec}"),
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

/// The built-in demo effect: one `ledger` row per applied event.
///
/// `ledger` has no unique constraint on `event_key` on purpose, so the number of rows per key
/// counts exactly how many times the effect ran.
#[derive(Debug, Default, Clone, Copy)]
pub struct Ledger;

#[async_trait]
impl Effect for Ledger {
    fn name(&self) -> &'static str {
        "ledger"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> anyhow::Result<()> {
        sqlx::query(
            "INSERT INTO ledger (event_key, source, event_type, payload) VALUES ($1, $2, $3, $4)",
        )
        .bind(event.key.as_str())
        .bind(&event.source)
        .bind(&event.event_type)
        .bind(&event.payload)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({ "effect": "ledger" }))
    }
}

/// The built-in outbox effect: one `deliver` operation per event, a POST of the event's
/// envelope to a fixed URL, enqueued with the claim and sent later by `replayproof dispatch`.
#[derive(Debug, Clone)]
pub struct HttpOutbox {
    pub target_url: String,
    /// A URL template with `{key}` where the operation key goes; a GET answering 2xx means the
    /// downstream already has the operation, 404 that it does not.
    pub reconcile_url: Option<String>,
    pub max_attempts: i32,
}

#[async_trait]
impl Effect for HttpOutbox {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> anyhow::Result<()> {
        let envelope = crate::envelope::Envelope {
            key: event.key.to_string(),
            source: event.source.clone(),
            event_type: event.event_type.clone(),
            received_at: event.received_at,
            payload: event.payload.clone(),
            unhashed: Vec::new(),
            replay_window_secs: None,
        };
        let op = crate::outbox::NewOperation {
            event_key: event.key.as_str(),
            operation: "deliver",
            destination: &self.target_url,
            payload: envelope.to_bytes(),
            reconcile_url: self.reconcile_url.clone(),
            max_attempts: self.max_attempts,
        };
        crate::outbox::enqueue(tx, &op).await?;
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "effect": "http",
            "target_url": self.target_url,
            "reconcile_url": self.reconcile_url,
            "max_attempts": self.max_attempts,
        }))
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

    fn spec(&self) -> Option<serde_json::Value> {
        let parts: Option<Vec<_>> = self.0.iter().map(|e| e.spec()).collect();
        Some(serde_json::json!({ "effect": "chain", "of": parts? }))
    }
}

/// The built-in effects, by the name given to `--effect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BuiltinEffect {
    /// One row in the `ledger` table per event.
    Ledger,
    /// One outbox operation per event: a POST of the event to --target-url, sent by
    /// `replayproof dispatch`.
    Http,
}

impl BuiltinEffect {
    /// Builds the effects given, chained in order when there are several.
    pub fn build_all(
        effects: &[Self],
        http: Option<HttpOutbox>,
    ) -> anyhow::Result<std::sync::Arc<dyn Effect>> {
        let mut built = effects
            .iter()
            .map(|e| e.build(http.clone()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(!built.is_empty(), "no effect given");
        Ok(if built.len() == 1 {
            built.remove(0)
        } else {
            std::sync::Arc::new(Chain(built))
        })
    }

    /// Builds the effect; `http` needs its target.
    pub fn build(self, http: Option<HttpOutbox>) -> anyhow::Result<std::sync::Arc<dyn Effect>> {
        Ok(match self {
            Self::Ledger => std::sync::Arc::new(Ledger),
            Self::Http => std::sync::Arc::new(
                http.ok_or_else(|| anyhow::anyhow!("--effect http needs --target-url"))?,
            ),
        })
    }
}

//! All SQL for `source_pauses`, on the first database: a pause and a resume, each one
//! transaction with its audit row; the list an operator reads; and the set of held sources a
//! batch or the deferred applier reads before it takes events.
//!
//! A pause holds from the first batch that reads it: a batch reads the set in its transaction,
//! just before its claims (with several shards, on the first database before its transactions
//! begin), so the batches in flight when the pause commits finish as they began, and every
//! event a consumer takes after `sources pause` returned is held. A resume is read the same way;
//! an event held by a batch that read the pause just before the resume is applied by the
//! deferred applier's next round.

use crate::audit::{self, Act, Change};
use crate::db::Db;
use chrono::{DateTime, Utc};
use std::sync::Arc;

/// The reason a held event's claim carries, followed by who paused its source and why.
pub const HELD_REASON: &str = "its source is paused";

/// One paused source, as `sources list` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SourcePause {
    pub source: String,
    pub by: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// The sources held when it was read, each with the reason its held events' claims carry.
#[derive(Debug, Clone, Default)]
pub struct Paused(Arc<Vec<SourcePause>>);

impl Paused {
    /// The paused sources on the first database now, read through `first`: its pool, or a
    /// transaction's connection (the transaction's own view, no other connection).
    pub async fn read<'c>(
        first: impl sqlx::Executor<'c, Database = sqlx::Postgres>,
    ) -> sqlx::Result<Self> {
        Ok(Self(Arc::new(list(first).await?)))
    }

    /// Nothing held.
    pub fn none() -> Self {
        Self::default()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The reason an event of `source` is held for, when it is.
    pub fn reason(&self, source: &str) -> Option<String> {
        let pause = self.0.iter().find(|p| p.source == source)?;
        Some(format!("{HELD_REASON} (by {}: {})", pause.by, pause.reason))
    }

    /// The held sources' names.
    pub fn names(&self) -> Vec<String> {
        self.0.iter().map(|p| p.source.clone()).collect()
    }

    /// Whether `source` is held.
    pub fn holds(&self, source: &str) -> bool {
        self.0.iter().any(|p| p.source == source)
    }
}

/// The audit row's target for `source`.
fn target(source: &str) -> String {
    format!("source:{source}")
}

/// Pauses `source`: one transaction with its audit row. Pausing a paused source replaces who
/// and why.
pub async fn pause(first: &Db, source: &str, act: &Act) -> sqlx::Result<Change> {
    let mut tx = first.begin().await?;
    let before = sqlx::query_scalar!(
        "SELECT paused_by FROM source_pauses WHERE source = $1 FOR UPDATE",
        source
    )
    .fetch_optional(&mut *tx)
    .await?;
    sqlx::query!(
        "INSERT INTO source_pauses (source, paused_by, reason) VALUES ($1, $2, $3) \
         ON CONFLICT (source) DO UPDATE SET paused_by = $2, reason = $3, paused_at = now()",
        source,
        act.actor,
        act.reason,
    )
    .execute(&mut *tx)
    .await?;
    let was = if before.is_some() {
        "paused"
    } else {
        "running"
    };
    let change = Change::new(&target(source), was, "paused");
    audit::record(&mut tx, act.audit("pause", &change)).await?;
    tx.commit().await?;
    Ok(change)
}

/// Resumes `source`: one transaction with its audit row. None when it is not paused, and then
/// nothing is written.
pub async fn resume(first: &Db, source: &str, act: &Act) -> sqlx::Result<Option<Change>> {
    let mut tx = first.begin().await?;
    let gone = sqlx::query!("DELETE FROM source_pauses WHERE source = $1", source)
        .execute(&mut *tx)
        .await?;
    if gone.rows_affected() == 0 {
        return Ok(None);
    }
    let change = Change::new(&target(source), "paused", "running");
    audit::record(&mut tx, act.audit("resume", &change)).await?;
    tx.commit().await?;
    Ok(Some(change))
}

/// Every paused source, by name, read through `first` (the first database, or a connection to
/// it).
pub async fn list<'c>(
    first: impl sqlx::Executor<'c, Database = sqlx::Postgres>,
) -> sqlx::Result<Vec<SourcePause>> {
    let rows = sqlx::query!(
        "SELECT source, paused_by, reason, paused_at FROM source_pauses ORDER BY source"
    )
    .fetch_all(first)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| SourcePause {
            source: r.source,
            by: r.paused_by,
            reason: r.reason,
            at: r.paused_at,
        })
        .collect())
}

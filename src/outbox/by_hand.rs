//! The outbox as an operator reads and moves it: an event's operations and every attempt, locked
//! for a change by hand, requeued or resolved, and the counts `status` shows.

use super::{AttemptKind, OutboxState, Outcome};
use crate::db::Db;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

/// An operation as the operator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct OperationRow {
    /// The idempotency key sent downstream.
    pub operation_key: String,
    /// Where the operation stands.
    pub state: OutboxState,
    /// Attempts so far, of the most allowed (`3/10`).
    pub attempts: String,
    /// The HTTP method and the body's content type.
    pub request: String,
    /// Where it is sent.
    pub destination: String,
    /// The credential it is sent with, by name.
    pub credential: Option<String>,
    /// When it is due (again).
    pub next_attempt_at: DateTime<Utc>,
    /// When the current lease ends, while one is held.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The last HTTP status the downstream answered.
    pub last_status: Option<i32>,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was settled.
    pub completed_at: Option<DateTime<Utc>>,
    /// Until when the downstream's idempotency key protects it, once an attempt's outcome was
    /// unknown and the destination's window is known.
    pub idempotent_until: Option<DateTime<Utc>>,
    /// Since when it is held for an operator, past its idempotency window.
    pub held_at: Option<DateTime<Utc>>,
}

/// An event's operations, their destinations redacted ([`crate::secrets::redact_url`]): a
/// target URL may carry its credential.
pub async fn of_event(pool: &Db, key: &str) -> sqlx::Result<Vec<OperationRow>> {
    let mut rows = sqlx::query_as!(
        OperationRow,
        r#"SELECT operation_key, state AS "state: OutboxState",
                  attempts || '/' || max_attempts AS "attempts!",
                  method || ' ' || content_type AS "request!", destination, credential,
                  next_attempt_at, lease_expires_at, last_status, last_error, completed_at,
                  idempotent_until, held_at
           FROM outbox WHERE event_key = $1 ORDER BY operation"#,
        key
    )
    .fetch_all(pool)
    .await?;
    for row in &mut rows {
        row.destination = crate::secrets::redact_url(&row.destination);
    }
    Ok(rows)
}

/// An operation of an event that another event's operation fulfils: both named one obligation.
#[derive(Debug, Clone, Serialize)]
pub struct FulfilledRow {
    /// The operation's name within the event.
    pub operation: String,
    /// The obligation's operation key.
    pub operation_key: String,
    /// The event whose operation it is.
    pub fulfilled_by: String,
    /// When the event named the obligation again.
    pub recorded_at: DateTime<Utc>,
}

/// The operations of an event that other events' operations fulfil.
pub async fn fulfilled_of_event(pool: &Db, key: &str) -> sqlx::Result<Vec<FulfilledRow>> {
    sqlx::query_as!(
        FulfilledRow,
        "SELECT operation, operation_key, fulfilled_by, recorded_at FROM fulfilled_operations \
         WHERE event_key = $1 ORDER BY operation",
        key
    )
    .fetch_all(pool)
    .await
}

/// One recorded attempt, as the operator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct AttemptRow {
    /// The operation's name within its event.
    pub operation: String,
    /// A delivery or a reconcile.
    pub kind: AttemptKind,
    /// How it ended.
    pub outcome: Outcome,
    /// The downstream's answer; none when no answer came.
    pub status_code: Option<i32>,
    /// False when the attempt's lease had been taken over: it changed nothing.
    pub applied: bool,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// How long it took, in milliseconds.
    pub duration_ms: i32,
    /// The worker that made it.
    pub worker: String,
    /// The fencing token of the lease it was made under.
    pub fencing_token: i64,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// The start of the downstream's answer, sanitised and capped as the operation's last one.
    pub response_excerpt: Option<String>,
}

/// Every attempt at an event's operations, in order.
pub async fn attempts_of_event(pool: &Db, key: &str) -> sqlx::Result<Vec<AttemptRow>> {
    sqlx::query_as!(
        AttemptRow,
        r#"SELECT o.operation, a.kind AS "kind: AttemptKind", a.outcome AS "outcome: Outcome",
                  a.status_code, a.applied, a.started_at, a.duration_ms, a.worker,
                  a.fencing_token, a.error, a.response_excerpt
           FROM outbox_attempts a JOIN outbox o ON o.id = a.outbox_id
           WHERE o.event_key = $1 ORDER BY a.id"#,
        key
    )
    .fetch_all(pool)
    .await
}

/// An operation locked for an operator's change.
#[derive(Debug, Clone)]
pub struct Locked {
    /// The row's id.
    pub id: i64,
    /// The idempotency key sent downstream.
    pub operation_key: String,
    /// Where the operation stands.
    pub state: OutboxState,
    /// Whether a worker holds a lease on it that has not expired.
    pub leased: bool,
    /// Whether its body was erased (`events erase`): it can never be sent again.
    pub erased: bool,
    /// Past its idempotency window after an attempt whose outcome is unknown (held, or its
    /// window ended): sent again, it could be applied twice.
    pub past_window: bool,
}

/// An event's operations (or only `operation`), locked until the caller's transaction ends.
pub async fn lock_of_event(
    conn: &mut PgConnection,
    key: &str,
    operation: Option<&str>,
) -> sqlx::Result<Vec<Locked>> {
    sqlx::query_as!(
        Locked,
        r#"SELECT id, operation_key, state AS "state: OutboxState",
                  coalesce(lease_expires_at > now(), false) AS "leased!",
                  payload_erased_at IS NOT NULL AS "erased!",
                  (held_at IS NOT NULL OR coalesce(idempotent_until <= now(), false))
                      AS "past_window!"
           FROM outbox WHERE event_key = $1 AND ($2::text IS NULL OR operation = $2)
           ORDER BY operation FOR UPDATE"#,
        key,
        operation
    )
    .fetch_all(conn)
    .await
}

/// Makes an operation due again with fresh attempts; its key and payload stay as they were,
/// and so does its idempotency window, unless `fresh_window`: an operator who sends it past the
/// window accepted the risk of a second application, and its window starts again.
pub async fn requeue(conn: &mut PgConnection, id: i64, fresh_window: bool) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE outbox SET state = 'pending', attempts = 0, next_attempt_at = now(), \
         updated_at = now(), held_at = NULL, \
         maybe_applied_at = CASE WHEN $2 THEN NULL ELSE maybe_applied_at END, \
         idempotent_until = CASE WHEN $2 THEN NULL ELSE idempotent_until END \
         WHERE id = $1",
        id,
        fresh_window
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Settles an operation by hand.
pub async fn resolve(conn: &mut PgConnection, id: i64, to: OutboxState) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE outbox SET state = $2, lease_expires_at = NULL, updated_at = now(), \
         completed_at = CASE WHEN $2 = 'done' THEN now() END, held_at = NULL WHERE id = $1",
        id,
        to.as_str()
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Operations not yet done.
pub async fn open_count(pool: &Db) -> sqlx::Result<i64> {
    sqlx::query_scalar!(r#"SELECT count(*) AS "n!" FROM outbox WHERE state <> 'done'"#)
        .fetch_one(pool)
        .await
}

/// Attempts recorded, and how many of them settled an operation by reconciliation.
pub async fn attempt_counts(pool: &Db) -> sqlx::Result<(i64, i64)> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "all!",
                  count(*) FILTER (WHERE outcome = 'reconciled_done') AS "reconciled!"
           FROM outbox_attempts"#
    )
    .fetch_one(pool)
    .await?;
    Ok((row.all, row.reconciled))
}

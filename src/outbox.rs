//! All SQL for the outbox tables: `outbox` and `outbox_attempts`.
//!
//! An operation is enqueued inside the consume transaction, so it exists exactly when its
//! event's claim does. Dispatchers lease due rows with `FOR UPDATE SKIP LOCKED`, each lease
//! stamping a fresh fencing token; a completion only changes a row whose token it presents, so a
//! worker whose lease expired and was taken over changes nothing.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

/// An operation to enqueue.
#[derive(Debug, Clone)]
pub struct NewOperation<'a> {
    pub event_key: &'a str,
    /// The operation's name within its event, such as `deliver`; one event can drive several.
    pub operation: &'a str,
    pub destination: &'a str,
    pub payload: Vec<u8>,
    pub reconcile_url: Option<String>,
    pub max_attempts: i32,
}

impl NewOperation<'_> {
    /// The key sent downstream as `Idempotency-Key` on every attempt.
    pub fn operation_key(&self) -> String {
        operation_key(self.event_key, self.operation)
    }
}

pub fn operation_key(event_key: &str, operation: &str) -> String {
    format!("{event_key}#{operation}")
}

/// Enqueues an operation in the caller's transaction. Enqueuing one twice keeps the first.
pub async fn enqueue(conn: &mut PgConnection, op: &NewOperation<'_>) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO outbox (operation_key, event_key, operation, destination, payload, \
         reconcile_url, max_attempts) VALUES ($1, $2, $3, $4, $5, $6, $7) \
         ON CONFLICT (operation_key) DO NOTHING",
    )
    .bind(op.operation_key())
    .bind(op.event_key)
    .bind(op.operation)
    .bind(op.destination)
    .bind(&op.payload)
    .bind(&op.reconcile_url)
    .bind(op.max_attempts)
    .execute(conn)
    .await?;
    Ok(())
}

/// A row leased to this worker.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Leased {
    pub id: i64,
    pub operation_key: String,
    pub destination: String,
    pub payload: Vec<u8>,
    pub reconcile_url: Option<String>,
    /// Attempts so far, this one included.
    pub attempts: i32,
    pub max_attempts: i32,
    pub fencing_token: i64,
    /// `uncertain`, or `in_progress` for a lease taken over from a worker that vanished: the
    /// operation may already have been applied.
    pub previous_state: String,
}

impl Leased {
    /// Whether an earlier attempt may already have reached the downstream: the row was
    /// `uncertain`, or its lease was taken over from a worker that vanished mid-request.
    pub fn may_have_been_applied(&self) -> bool {
        self.previous_state == "uncertain" || self.previous_state == "in_progress"
    }
}

/// Leases up to `limit` due rows: pending, retryable or uncertain ones whose time has come, and
/// in-progress ones whose lease expired. Rows another worker is leasing are skipped, not
/// waited for. Every lease counts as an attempt, so a row whose worker dies or hangs on it each
/// time goes `dead` once its attempts are spent, instead of taking down worker after worker.
pub async fn lease(
    pool: &PgPool,
    worker: &str,
    limit: i64,
    lease: Duration,
) -> sqlx::Result<Vec<Leased>> {
    let buried = sqlx::query(
        "UPDATE outbox SET state = 'dead', lease_expires_at = NULL, updated_at = now(),          last_error = format('the lease expired on attempt %s of %s: its worker died or hung',                              attempts, max_attempts)          WHERE state = 'in_progress' AND lease_expires_at <= now() AND attempts >= max_attempts",
    )
    .execute(pool)
    .await?
    .rows_affected();
    if buried > 0 {
        tracing::warn!(
            operations = buried,
            "Operations whose lease expired on their last attempt are now dead."
        );
    }
    sqlx::query_as(
        r#"WITH due AS (
               SELECT id, state AS previous_state FROM outbox
               WHERE (state IN ('pending', 'retryable', 'uncertain') AND next_attempt_at <= now())
                  OR (state = 'in_progress' AND lease_expires_at <= now())
               ORDER BY next_attempt_at
               LIMIT $1
               FOR UPDATE SKIP LOCKED)
           UPDATE outbox o
           SET state = 'in_progress', attempts = o.attempts + 1, leased_by = $2,
               lease_expires_at = now() + make_interval(secs => $3),
               fencing_token = nextval('outbox_fencing_token'), updated_at = now()
           FROM due WHERE o.id = due.id
           RETURNING o.id, o.operation_key, o.destination, o.payload, o.reconcile_url, o.attempts,
                     o.max_attempts, o.fencing_token, due.previous_state"#,
    )
    .bind(limit)
    .bind(worker)
    .bind(lease.as_secs_f64())
    .fetch_all(pool)
    .await
}

/// Where an attempt leaves its row.
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    /// One of `done`, `retryable`, `uncertain`, `failed`, `dead`.
    pub state: &'static str,
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub status: Option<i32>,
    pub error: Option<String>,
    pub response: Option<String>,
}

/// One attempt, as recorded whatever its lease became.
#[derive(Debug, Clone)]
pub struct Attempt<'a> {
    pub worker: &'a str,
    pub kind: &'static str,
    pub started_at: DateTime<Utc>,
    pub duration: Duration,
    pub outcome: &'a str,
}

/// Records an attempt and, if the lease is still this worker's, settles the row. Returns false
/// when the lease had been taken over: the row is left as its new owner has it.
pub async fn complete(
    pool: &PgPool,
    leased: &Leased,
    settlement: &Settlement,
    attempt: &Attempt<'_>,
) -> sqlx::Result<bool> {
    let mut tx = pool.begin().await?;
    let updated = sqlx::query(
        "UPDATE outbox SET state = $3, next_attempt_at = coalesce($4, next_attempt_at), \
         last_status = $5, last_error = $6, last_response = $7, lease_expires_at = NULL, \
         updated_at = now(), completed_at = CASE WHEN $3 = 'done' THEN now() END \
         WHERE id = $1 AND fencing_token = $2 AND state = 'in_progress'",
    )
    .bind(leased.id)
    .bind(leased.fencing_token)
    .bind(settlement.state)
    .bind(settlement.next_attempt_at)
    .bind(settlement.status)
    .bind(&settlement.error)
    .bind(&settlement.response)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let sha: [u8; 32] = <sha2::Sha256 as sha2::Digest>::digest(&leased.payload).into();
    sqlx::query(
        "INSERT INTO outbox_attempts (outbox_id, fencing_token, worker, kind, idempotency_key, \
         payload_sha256, started_at, duration_ms, status_code, error, outcome, applied) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    )
    .bind(leased.id)
    .bind(leased.fencing_token)
    .bind(attempt.worker)
    .bind(attempt.kind)
    .bind(&leased.operation_key)
    .bind(&sha[..])
    .bind(attempt.started_at)
    .bind(attempt.duration.as_millis().min(i32::MAX as u128) as i32)
    .bind(settlement.status)
    .bind(&settlement.error)
    .bind(attempt.outcome)
    .bind(updated > 0)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(updated > 0)
}

/// What the metrics show of the outbox.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    pub by_state: Vec<(String, i64)>,
    /// Seconds since the oldest due operation became due.
    pub oldest_due_seconds: f64,
    /// In-progress rows whose lease expired: their worker is gone.
    pub expired_leases: i64,
}

pub async fn gauges(pool: &PgPool) -> sqlx::Result<Gauges> {
    let by_state =
        sqlx::query_as("SELECT state, count(*) FROM outbox GROUP BY state ORDER BY state")
            .fetch_all(pool)
            .await?;
    let (oldest, expired): (Option<f64>, i64) = sqlx::query_as(
        "SELECT (SELECT extract(epoch FROM now() - min(next_attempt_at))::float8 FROM outbox \
                 WHERE state IN ('pending', 'retryable', 'uncertain') AND next_attempt_at <= now()), \
                (SELECT count(*) FROM outbox WHERE state = 'in_progress' AND lease_expires_at <= now())",
    )
    .fetch_one(pool)
    .await?;
    Ok(Gauges {
        by_state,
        oldest_due_seconds: oldest.unwrap_or(0.0),
        expired_leases: expired,
    })
}

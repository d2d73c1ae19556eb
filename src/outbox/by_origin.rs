//! `outbox` by origin, as the destinations' limits take it
//! ([`crate::destinations::lease_within_limits`]): the origins with due operations, each
//! origin's requests in flight, its backlog, and the leases of one origin's due operations.

use super::{bury_expired_last_attempts, lease_rows, Leased, OutboxState};
use crate::db::Db;
use sqlx::PgConnection;
use std::time::Duration;

/// The origins with due operations, or with leases that expired: one index probe each.
pub async fn due_origins(pool: &Db) -> sqlx::Result<Vec<String>> {
    bury_expired_last_attempts(pool).await?;
    sqlx::query_scalar!(
        r#"WITH RECURSIVE origins AS (
               SELECT min(origin) AS origin FROM outbox
               WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL
               UNION ALL
               SELECT (SELECT min(origin) FROM outbox
                       WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL
                         AND origin > o.origin)
               FROM origins o WHERE o.origin IS NOT NULL)
           SELECT origin AS "origin!" FROM origins o
           WHERE origin IS NOT NULL
             AND EXISTS (SELECT 1 FROM outbox d WHERE d.origin = o.origin
                         AND d.state IN ('pending', 'retryable', 'uncertain')
                         AND d.next_attempt_at <= now() AND d.held_at IS NULL)
           UNION
           SELECT DISTINCT coalesce(origin, destination) FROM outbox
           WHERE state = 'in_progress' AND lease_expires_at <= now()"#
    )
    .fetch_all(pool)
    .await
}

/// `origin`'s requests in flight on this database: its unexpired leases.
pub async fn count_in_flight(conn: &mut PgConnection, origin: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM outbox
           WHERE origin = $1 AND state = 'in_progress' AND lease_expires_at > now()"#,
        origin
    )
    .fetch_one(conn)
    .await
}

/// Leases up to `count` of `origin`'s due operations of this database.
pub async fn lease_due(
    conn: &mut PgConnection,
    origin: &str,
    count: usize,
    worker: &str,
    lease: Duration,
) -> sqlx::Result<Vec<Leased>> {
    let due = sqlx::query!(
        r#"SELECT id, state AS "state: OutboxState" FROM outbox
           WHERE origin = $1
             AND ((state IN ('pending', 'retryable', 'uncertain') AND next_attempt_at <= now())
                  OR (state = 'in_progress' AND lease_expires_at <= now()))
             AND held_at IS NULL
           ORDER BY next_attempt_at
           LIMIT $2
           FOR UPDATE SKIP LOCKED"#,
        origin,
        count as i64,
    )
    .fetch_all(&mut *conn)
    .await?;
    let due: Vec<(i64, OutboxState)> = due.into_iter().map(|r| (r.id, r.state)).collect();
    lease_rows(conn, &due, worker, lease).await
}

/// The requests in flight on this database, by origin: the unexpired leases.
pub async fn in_flight_by_origin(pool: &Db) -> sqlx::Result<Vec<(String, i64)>> {
    let counts = sqlx::query!(
        r#"SELECT origin AS "origin!", count(*) AS "n!" FROM outbox
           WHERE state = 'in_progress' AND lease_expires_at > now() AND origin IS NOT NULL
           GROUP BY origin"#
    )
    .fetch_all(pool)
    .await?;
    Ok(counts.into_iter().map(|c| (c.origin, c.n)).collect())
}

/// The operations waiting to be sent on this database, by origin: pending, retryable or
/// uncertain, not held for an operator, due now or later.
pub async fn backlog_by_origin(pool: &Db) -> sqlx::Result<Vec<(String, i64)>> {
    let counts = sqlx::query!(
        r#"SELECT origin AS "origin!", count(*) AS "n!" FROM outbox
           WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL
             AND origin IS NOT NULL
           GROUP BY origin"#
    )
    .fetch_all(pool)
    .await?;
    Ok(counts.into_iter().map(|c| (c.origin, c.n)).collect())
}

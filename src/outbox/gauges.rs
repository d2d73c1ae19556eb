//! What the metrics show of the outbox: operations by state, the oldest due one, expired
//! leases.

use super::OutboxState;
use crate::db::Db;

/// What the metrics show of the outbox.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// Operations by state.
    pub by_state: Vec<(OutboxState, i64)>,
    /// Seconds since the oldest due operation became due.
    pub oldest_due_seconds: f64,
    /// In-progress rows whose lease expired: their worker is gone.
    pub expired_leases: i64,
    /// Operations held past their idempotency window, waiting for an operator.
    pub held: i64,
}

/// The outbox's gauges: operations by state, the oldest due one, expired leases.
pub async fn gauges(pool: &Db) -> sqlx::Result<Gauges> {
    // Done operations, nearly all, are estimated from the table's statistics; the others are
    // counted through their partial index.
    let by_state = sqlx::query!(
        r#"WITH unsettled AS (SELECT state, count(*) AS n FROM outbox
                              WHERE state <> 'done' GROUP BY state)
           SELECT state AS "state!: OutboxState", n AS "n!" FROM unsettled
           UNION ALL
           SELECT 'done', greatest(0, (SELECT reltuples FROM pg_class
                                       WHERE oid = to_regclass('outbox'))::int8
                                      - (SELECT coalesce(sum(n), 0) FROM unsettled)::int8)
           ORDER BY 1"#
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|r| (r.state, r.n))
    .filter(|(state, n)| *state != OutboxState::Done || *n > 0)
    .collect();
    let row = sqlx::query!(
        r#"SELECT (SELECT extract(epoch FROM now() - min(next_attempt_at))::float8 FROM outbox
                   WHERE state IN ('pending', 'retryable', 'uncertain')
                     AND next_attempt_at <= now() AND held_at IS NULL) AS oldest,
                  (SELECT count(*) FROM outbox
                   WHERE state = 'in_progress' AND lease_expires_at <= now()) AS "expired!",
                  (SELECT count(*) FROM outbox WHERE held_at IS NOT NULL) AS "held!""#
    )
    .fetch_one(pool)
    .await?;
    Ok(Gauges {
        by_state,
        oldest_due_seconds: row.oldest.unwrap_or(0.0),
        expired_leases: row.expired,
        held: row.held,
    })
}

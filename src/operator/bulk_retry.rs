//! Which events a bulk `events retry --state` takes: its filter and the query.

use super::search::StateName;
use super::OperatorError;
use crate::db::Db;
use chrono::{DateTime, Utc};

/// Which events a bulk retry takes.
#[derive(Debug, Clone)]
pub struct RetryFilter {
    /// `failed`, `uncertain` or `dead` ([`StateName::retryable`]).
    pub state: StateName,
    pub source: Option<String>,
    /// Only events claimed at or after this time.
    pub since: Option<DateTime<Utc>>,
    pub limit: i64,
}

/// The events a bulk retry takes, oldest claim first; never one whose operations' bodies were
/// erased, which can never be sent again.
pub async fn to_retry(pool: &Db, f: &RetryFilter) -> Result<Vec<String>, OperatorError> {
    let keys = sqlx::query_scalar!(
        r#"SELECT event_key AS "event_key!" FROM event_summaries
           WHERE (claim = $1 OR $1 = ANY(operation_states))
             AND ($2::text IS NULL OR source = $2)
             AND ($3::timestamptz IS NULL OR claimed_at >= $3)
             AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = event_summaries.event_key
                             AND o.state IN ('failed', 'uncertain', 'dead')
                             AND o.payload_erased_at IS NOT NULL)
           ORDER BY claimed_at, event_key
           LIMIT $4"#,
        f.state.as_str(),
        f.source.as_deref(),
        f.since,
        f.limit,
    )
    .fetch_all(pool)
    .await?;
    Ok(keys)
}

//! The built-in `ledger` effect and all SQL on its table.

use super::{Effect, EffectError, Tx};
use crate::db::Db;
use crate::db::JsonText;
use crate::envelope::Event;
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;

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

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    /// One statement for the whole batch; each payload goes in as the text it arrived as.
    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        let keys: Vec<&str> = events.iter().map(|e| e.key.as_str()).collect();
        let routes: Vec<&str> = events.iter().map(|e| e.route_key()).collect();
        let sources: Vec<&str> = events.iter().map(|e| e.source.as_str()).collect();
        let types: Vec<Option<&str>> = events.iter().map(|e| e.event_type.as_deref()).collect();
        let payloads: Vec<&str> = events.iter().map(|e| e.payload_json.get()).collect();
        sqlx::query!(
            "INSERT INTO ledger (event_key, source, event_type, payload, route_key)
             SELECT k, s, t, p::jsonb, rk
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
                 AS u(k, s, t, p, rk)",
            &keys as _,
            &sources as _,
            &types as _,
            &payloads as _,
            &routes as _,
        )
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(json!({ "effect": "ledger" }))
    }
}

/// A ledger row as the operator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct LedgerRow {
    /// The row's id, in the order rows were written.
    pub id: i64,
    /// The event's type, if the envelope had one.
    #[serde(rename = "type")]
    pub event_type: Option<String>,
    /// When the transaction that wrote it started.
    pub applied_at: DateTime<Utc>,
    /// The event's payload.
    pub payload: JsonText,
}

/// The ledger rows an event wrote.
pub async fn of_event(pool: &Db, key: &str) -> sqlx::Result<Vec<LedgerRow>> {
    sqlx::query_as!(
        LedgerRow,
        r#"SELECT id, event_type, applied_at, payload AS "payload: JsonText"
           FROM ledger WHERE event_key = $1 ORDER BY id"#,
        key
    )
    .fetch_all(pool)
    .await
}

/// Ledger rows per event key.
pub async fn rows_per_key(pool: &Db) -> sqlx::Result<std::collections::HashMap<String, i64>> {
    let rows = sqlx::query!(r#"SELECT event_key, count(*) AS "n!" FROM ledger GROUP BY event_key"#)
        .fetch_all(pool)
        .await?;
    Ok(rows.into_iter().map(|r| (r.event_key, r.n)).collect())
}

/// How many distinct events have a ledger row.
pub async fn events_applied(pool: &Db) -> sqlx::Result<i64> {
    sqlx::query_scalar!(r#"SELECT count(DISTINCT event_key) AS "n!" FROM ledger"#)
        .fetch_one(pool)
        .await
}

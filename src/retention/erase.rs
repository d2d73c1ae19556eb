//! Erasure: the payloads of settled events removed everywhere replayproof keeps them (the claim,
//! the ledger, the operations' bodies, key conflicts, expired replays), while the key, the
//! payload's hash and the status stay, so a redelivery is still a replay. For one key, or for a
//! data subject: every event of a source whose stored payload has a field equal to a value.
//! Audited; refused for an event that is not settled (failed, deferred, an operation still on
//! its way, an expired replay not yet resolved), whose payload is still needed.

use crate::operator::Act;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};

/// What an erasure did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Erased {
    /// Keys whose payloads were erased.
    pub erased: Vec<String>,
    /// Keys refused, with why.
    pub refused: Vec<(String, String)>,
}

/// The keys of `source` whose stored payload has `value` at `path` (`customer` or
/// `data.object.customer`), wherever a payload is kept.
pub async fn matching(
    pool: &PgPool,
    source: &str,
    path: &str,
    value: &str,
) -> sqlx::Result<Vec<String>> {
    let path: Vec<&str> = path.split('.').collect();
    sqlx::query_scalar!(
        r#"SELECT event_key AS "k!" FROM processed_events
               WHERE source = $1 AND payload #>> $2 = $3
           UNION SELECT event_key FROM ledger WHERE source = $1 AND payload #>> $2 = $3
           UNION SELECT event_key FROM key_conflicts WHERE source = $1 AND payload #>> $2 = $3
           UNION SELECT event_key FROM expired_replays
               WHERE source = $1 AND payload #>> $2 = $3
           ORDER BY 1"#,
        source,
        &path as _,
        value
    )
    .fetch_all(pool)
    .await
}

/// Erases the payloads of `keys`, each settled one in its own transaction with its audit row.
pub async fn erase(pool: &PgPool, keys: &[String], act: &Act) -> sqlx::Result<Erased> {
    let mut erased = Erased::default();
    for key in keys {
        let mut tx = pool.begin().await?;
        match unsettled(&mut tx, key).await? {
            Some(why) => erased.refused.push((key.clone(), why)),
            None => {
                let status = erase_one(&mut tx, key).await?;
                let action = crate::audit::Action {
                    actor: &act.actor,
                    action: "erase",
                    target: key,
                    reason: &act.reason,
                    before: &status,
                    after: &status,
                };
                crate::audit::record(&mut tx, action).await?;
                tx.commit().await?;
                erased.erased.push(key.clone());
            }
        }
    }
    Ok(erased)
}

/// Why `key`'s payload may not be erased yet, its claim locked; None when it may.
async fn unsettled(conn: &mut PgConnection, key: &str) -> sqlx::Result<Option<String>> {
    let row = sqlx::query!(
        r#"SELECT (SELECT status FROM processed_events WHERE event_key = $1 FOR UPDATE) AS status,
                  (SELECT string_agg(operation || '=' || state, ', ') FROM outbox
                   WHERE event_key = $1 AND state NOT IN ('done', 'dead')) AS ops,
                  (SELECT count(*) FROM expired_replays
                   WHERE event_key = $1 AND resolution IS NULL) AS "open!""#,
        key
    )
    .fetch_one(conn)
    .await?;
    Ok(match (row.status.as_deref(), row.ops, row.open) {
        (_, _, open) if open > 0 => Some("an expired replay of it is not resolved".into()),
        (None, _, _) => Some("no such event".into()),
        (Some(status @ ("failed" | "deferred" | "in_progress")), _, _) => {
            Some(format!("its claim is {status}; resolve it first"))
        }
        (_, Some(ops), _) => Some(format!("operations are not settled: {ops}")),
        _ => None,
    })
}

/// Erases every payload kept for `key`, and returns its claim's status.
async fn erase_one(conn: &mut PgConnection, key: &str) -> sqlx::Result<String> {
    let row = sqlx::query!(
        r#"WITH claim AS (UPDATE processed_events SET payload = NULL, payload_erased_at = now()
                          WHERE event_key = $1 RETURNING status),
                ledger AS (UPDATE ledger SET payload = 'null'::jsonb, payload_erased_at = now()
                           WHERE event_key = $1 RETURNING 1),
                ops AS (UPDATE outbox SET payload = ''::bytea, payload_erased_at = now()
                        WHERE event_key = $1 RETURNING 1),
                conflicts AS (UPDATE key_conflicts
                              SET payload = 'null'::jsonb, payload_erased_at = now()
                              WHERE event_key = $1 RETURNING 1),
                expired AS (UPDATE expired_replays SET payload = NULL
                            WHERE event_key = $1 RETURNING 1)
           SELECT (SELECT status FROM claim) AS "status!",
                  (SELECT count(*) FROM ledger) + (SELECT count(*) FROM ops)
                  + (SELECT count(*) FROM conflicts) + (SELECT count(*) FROM expired) AS rows"#,
        key
    )
    .fetch_one(conn)
    .await?;
    Ok(row.status)
}

//! Erasure: the payloads of settled events removed everywhere replayproof keeps them (the claim,
//! the ledger, the operations' bodies and the downstream's answers and excerpts, key
//! conflicts, expired replays, dead letters' bytes), while the key, the payload's hash and the
//! status stay, so a redelivery is still a replay. For one key, or for a data subject: every
//! event of a source whose stored payload (or JSON operation body) has a field equal to a
//! value. Audited; refused for an event that is not settled (failed, deferred, an operation
//! still on its way, an expired replay not yet resolved), whose payload is still needed. The
//! topic keeps the event's bytes until its own retention: erasure cannot reach them.

use crate::audit::Act;
use crate::db::Db;
use serde::Serialize;
use sqlx::PgConnection;

/// What an erasure did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Erased {
    /// Keys whose payloads were erased.
    pub erased: Vec<String>,
    /// Keys refused, with why.
    pub refused: Vec<(String, String)>,
    /// Dead letters whose bytes were erased, by id.
    pub dead_letters: Vec<i64>,
    /// What could not be searched, and so may still concern the data subject: one sentence
    /// each. An erasure that leaves any is not a success.
    pub unsearched: Vec<String>,
}

/// The keys of `source` whose stored payload has `value` at `path` (`customer` or
/// `data.object.customer`), wherever a payload is kept: claims, the ledger, key conflicts,
/// expired replays and the JSON bodies of operations.
pub async fn matching(
    pool: &Db,
    source: &str,
    path: &str,
    value: &str,
) -> sqlx::Result<Vec<String>> {
    let path: Vec<&str> = path.split('.').collect();
    let mut keys = matching_payloads(pool, source, &path, value).await?;
    keys.extend(super::erase_search::matching_bodies(pool, source, &path, value).await?);
    keys.sort();
    keys.dedup();
    Ok(keys)
}

async fn matching_payloads(
    pool: &Db,
    source: &str,
    path: &[&str],
    value: &str,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!(
        r#"SELECT event_key AS "k!" FROM processed_events
               WHERE source = $1 AND payload #>> $2 = $3
           UNION SELECT event_key FROM ledger WHERE source = $1 AND payload #>> $2 = $3
           UNION SELECT event_key FROM key_conflicts WHERE source = $1 AND payload #>> $2 = $3
           UNION SELECT event_key FROM expired_replays
               WHERE source = $1 AND payload #>> $2 = $3
           ORDER BY 1"#,
        source,
        path as _,
        value
    )
    .fetch_all(pool)
    .await
}

/// `events erase --key`: `key`'s payloads in `pool`, its database (None when no database
/// holds it), and its dead letters' bytes in `first`, where dead letters are kept.
pub async fn erase_key(
    pool: Option<&Db>,
    first: &Db,
    key: &str,
    act: &Act,
) -> sqlx::Result<Erased> {
    let mut erased = match pool {
        Some(pool) => erase(pool, &[key.to_owned()], act).await?,
        None => Erased {
            refused: vec![(key.to_owned(), NO_SUCH_EVENT.to_owned())],
            ..Erased::default()
        },
    };
    let letters = super::erase_search::dead_letters_of(first, key).await?;
    erase_letters(first, &letters, act, &mut erased).await?;
    // Only dead letters of it: erased, and no claim needed.
    if erased.refused == [(key.to_owned(), NO_SUCH_EVENT.to_owned())] && !letters.is_empty() {
        erased.refused.clear();
    }
    Ok(erased)
}

/// `events erase --source --match FIELD=VALUE`: the matching events of `databases`, the
/// matching dead letters of `first` (where every dead letter is kept), and what could not be
/// searched.
pub async fn erase_matching(
    first: &Db,
    databases: &[Db],
    source: &str,
    field: &str,
    value: &str,
    act: &Act,
) -> sqlx::Result<Erased> {
    let mut erased = Erased::default();
    let path: Vec<&str> = field.split('.').collect();
    for pool in databases {
        let keys = matching(pool, source, field, value).await?;
        let done = erase(pool, &keys, act).await?;
        erased.erased.extend(done.erased);
        erased.refused.extend(done.refused);
        let blind = super::erase_search::unsearchable(pool, source).await?;
        if blind > 0 {
            erased.unsearched.push(format!(
                "{blind} settled event(s) of {source} keep no payload to search (a done claim \
                 keeps only its hash; the application's own tables and the topic are not \
                 searched): erase them by --key, or in the application, if they concern the \
                 data subject"
            ));
        }
    }
    let (letters, unsearched) =
        super::erase_search::matching_dead_letters(first, source, &path, value).await?;
    erase_letters(first, &letters, act, &mut erased).await?;
    if unsearched > 0 {
        erased.unsearched.push(format!(
            "{unsearched} dead letter(s) that are no envelope: a value shorter than {} \
             characters is not looked for in raw bytes; erase them by --key",
            super::erase_search::MIN_RAW_MATCH
        ));
    }
    Ok(erased)
}

/// Erases the bytes of the dead letters `ids` of `first`, each audited.
async fn erase_letters(
    first: &Db,
    ids: &[i64],
    act: &Act,
    erased: &mut Erased,
) -> sqlx::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    super::erase_search::erase_dead_letters(first, ids).await?;
    let mut conn = first.begin().await?;
    for id in ids {
        let target = format!("dead_letter:{id}");
        let action = crate::audit::Action {
            actor: &act.actor,
            action: "erase",
            target: &target,
            reason: &act.reason,
            before: "dead",
            after: "dead",
        };
        crate::audit::record(&mut conn, action).await?;
    }
    conn.commit().await?;
    erased.dead_letters.extend_from_slice(ids);
    Ok(())
}

/// Why an erasure of a key without a claim is refused.
const NO_SUCH_EVENT: &str = "no such event";

/// Erases the payloads of `keys`, each settled one in its own transaction with its audit row.
pub async fn erase(pool: &Db, keys: &[String], act: &Act) -> sqlx::Result<Erased> {
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
        (None, _, _) => Some(NO_SUCH_EVENT.into()),
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
        r#"WITH claim AS (UPDATE processed_events SET payload = NULL, attributes = NULL,
                                                 payload_erased_at = now()
                          WHERE event_key = $1 RETURNING status),
                ledger AS (UPDATE ledger SET payload = 'null'::jsonb, payload_erased_at = now()
                           WHERE event_key = $1 RETURNING 1),
                ops AS (UPDATE outbox SET payload = ''::bytea, last_response = NULL,
                               payload_erased_at = now()
                        WHERE event_key = $1 RETURNING id),
                excerpts AS (UPDATE outbox_attempts SET response_excerpt = NULL
                             WHERE outbox_id IN (SELECT id FROM ops)
                               AND response_excerpt IS NOT NULL RETURNING 1),
                conflicts AS (UPDATE key_conflicts
                              SET payload = 'null'::jsonb, payload_erased_at = now()
                              WHERE event_key = $1 RETURNING 1),
                expired AS (UPDATE expired_replays SET payload = NULL, attributes = NULL
                            WHERE event_key = $1 RETURNING 1)
           SELECT (SELECT status FROM claim) AS "status!",
                  (SELECT count(*) FROM ledger) + (SELECT count(*) FROM ops)
                  + (SELECT count(*) FROM conflicts) + (SELECT count(*) FROM expired)
                  + (SELECT count(*) FROM excerpts) AS rows"#,
        key
    )
    .fetch_one(conn)
    .await?;
    Ok(row.status)
}

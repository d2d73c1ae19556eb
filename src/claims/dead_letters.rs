//! All SQL for `dead_letters`: messages that are not valid envelopes, kept byte for byte.

use super::Origin;
use crate::db::Db;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;

/// A message that is not a valid envelope, kept byte for byte.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a> {
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub headers: &'a crate::inputs::Headers,
    pub reason: String,
}

/// Stores dead letters; a redelivered message that is already dead-lettered is not stored twice,
/// while a different message at a reused offset (a truncated or recreated topic) is stored too.
#[tracing::instrument(skip_all, fields(dead_letters = letters.len(), partition = origin.partition))]
pub async fn insert(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    letters: &[DeadLetter<'_>],
) -> sqlx::Result<()> {
    let offsets: Vec<i64> = letters.iter().map(|d| d.offset).collect();
    let keys: Vec<Option<&[u8]>> = letters.iter().map(|d| d.key).collect();
    let values: Vec<Option<&[u8]>> = letters.iter().map(|d| d.value).collect();
    let reasons: Vec<&str> = letters.iter().map(|d| d.reason.as_str()).collect();
    // PostgreSQL's arrays cannot be ragged: every letter's headers in one array, each letter
    // naming its slice of it (from, to; none when from > to).
    let (mut all, mut from, mut to) = (Vec::new(), Vec::new(), Vec::new());
    for letter in letters {
        from.push(all.len() as i32 + 1);
        all.extend(letter.headers.to_stored());
        to.push(all.len() as i32);
    }
    sqlx::query!(
        r#"INSERT INTO dead_letters (kafka_topic, kafka_partition, kafka_offset, raw_key,
                raw_value, reason, raw_headers)
           SELECT $5, $6, o, k, v, r, CASE WHEN hf <= ht THEN ($7::bytea[])[hf:ht] END
           FROM unnest($1::int8[], $2::bytea[], $3::bytea[], $4::text[], $8::int4[], $9::int4[])
                AS u(o, k, v, r, hf, ht)
           ON CONFLICT (kafka_topic, kafka_partition, kafka_offset, message_sha256, route_key)
           DO NOTHING"#,
        &offsets,
        &keys as _,
        &values as _,
        &reasons as _,
        origin.topic,
        origin.partition,
        &all as _,
        &from,
        &to,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// A dead letter as the operator sees it; the raw bytes shown as text where they are text.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetterRow {
    pub id: i64,
    pub created_at: DateTime<Utc>,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub reason: String,
    pub replayed_at: Option<DateTime<Utc>>,
    pub key: Option<String>,
    /// Only in [`find`]'s answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

/// The newest dead letters first.
pub async fn list(pool: &Db, limit: i64) -> sqlx::Result<Vec<DeadLetterRow>> {
    sqlx::query_as!(
        DeadLetterRow,
        r#"SELECT id, created_at, kafka_topic AS topic, kafka_partition AS partition,
                  kafka_offset AS offset, reason, replayed_at, encode(raw_key, 'escape') AS key,
                  NULL::text AS value
           FROM dead_letters ORDER BY id DESC LIMIT $1"#,
        limit
    )
    .fetch_all(pool)
    .await
}

/// Which dead letters a list or a bulk replay takes.
#[derive(Debug, Clone, Default)]
pub struct LetterSearch {
    /// Only those stored at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only those whose reason is `LIKE` this pattern (`%not JSON%`).
    pub reason_like: Option<String>,
    /// Only those never replayed.
    pub not_replayed: bool,
    /// The page after this id (ids are listed newest first).
    pub before_id: Option<i64>,
    pub limit: i64,
}

/// The newest dead letters matching `search`, by keyset on the id.
pub async fn search(pool: &Db, search: &LetterSearch) -> sqlx::Result<Vec<DeadLetterRow>> {
    let mut q = sqlx::QueryBuilder::new(
        "SELECT id, created_at, kafka_topic AS topic, kafka_partition AS partition, \
         kafka_offset AS offset, reason, replayed_at, encode(raw_key, 'escape') AS key, \
         NULL::text AS value FROM dead_letters WHERE true",
    );
    if let Some(since) = search.since {
        q.push(" AND created_at >= ").push_bind(since);
    }
    if let Some(pattern) = &search.reason_like {
        q.push(" AND reason LIKE ").push_bind(pattern.clone());
    }
    if search.not_replayed {
        q.push(" AND replayed_at IS NULL AND payload_erased_at IS NULL");
    }
    if let Some(id) = search.before_id {
        q.push(" AND id < ").push_bind(id);
    }
    q.push(" ORDER BY id DESC LIMIT ")
        .push_bind(search.limit.max(1));
    q.build_query_as().fetch_all(pool).await
}

/// One dead letter with its value.
pub async fn find(pool: &Db, id: i64) -> sqlx::Result<Option<DeadLetterRow>> {
    sqlx::query_as!(
        DeadLetterRow,
        r#"SELECT id, created_at, kafka_topic AS topic, kafka_partition AS partition,
                  kafka_offset AS offset, reason, replayed_at, encode(raw_key, 'escape') AS key,
                  encode(raw_value, 'escape') AS value
           FROM dead_letters WHERE id = $1"#,
        id
    )
    .fetch_optional(pool)
    .await
}

/// The dead letters stored under an event key, oldest first.
pub async fn of_key(pool: &Db, key: &str) -> sqlx::Result<Vec<DeadLetterRow>> {
    sqlx::query_as!(
        DeadLetterRow,
        r#"SELECT id, created_at, kafka_topic AS topic, kafka_partition AS partition,
                  kafka_offset AS offset, reason, replayed_at, encode(raw_key, 'escape') AS key,
                  NULL::text AS value
           FROM dead_letters WHERE raw_key = convert_to($1, 'UTF8') ORDER BY id"#,
        key
    )
    .fetch_all(pool)
    .await
}

/// A dead letter's raw bytes and origin, for producing it again.
#[derive(Debug, Clone)]
pub struct RawLetter {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    /// Its headers as stored: names and values in turn ([`crate::inputs::Headers::from_stored`]).
    pub headers: Option<Vec<Option<Vec<u8>>>>,
    pub replayed: bool,
    /// Its bytes were erased (`events erase`): it can never be replayed.
    pub erased: bool,
}

/// Reads a dead letter's bytes without locking it: a replay must not hold a row lock while it
/// waits on Kafka.
pub async fn take(pool: &Db, id: i64) -> sqlx::Result<Option<RawLetter>> {
    sqlx::query_as!(
        RawLetter,
        r#"SELECT kafka_topic AS topic, raw_key AS key, raw_value AS value,
                  raw_headers AS "headers: Vec<Option<Vec<u8>>>",
                  replayed_at IS NOT NULL AS "replayed!",
                  payload_erased_at IS NOT NULL AS "erased!"
           FROM dead_letters WHERE id = $1"#,
        id
    )
    .fetch_optional(pool)
    .await
}

/// Marks a dead letter replayed, in the caller's transaction.
pub async fn mark_replayed(conn: &mut PgConnection, id: i64) -> sqlx::Result<bool> {
    let updated = sqlx::query!(
        "UPDATE dead_letters SET replayed_at = now() WHERE id = $1 AND payload_erased_at IS NULL",
        id
    )
    .execute(conn)
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// How many dead letters are stored (estimated from the table's statistics, so the table is
/// never counted whole), and how many were never replayed (counted, through their index).
pub async fn counts(pool: &Db) -> sqlx::Result<(i64, i64)> {
    let row = sqlx::query!(
        r#"SELECT (SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL) AS "not_replayed!",
                  (SELECT greatest(reltuples, 0)::int8 FROM pg_class
                   WHERE oid = to_regclass('dead_letters')) AS "all""#
    )
    .fetch_one(pool)
    .await?;
    Ok((row.all.unwrap_or(0).max(row.not_replayed), row.not_replayed))
}

//! All SQL for the claim tables: `processed_events`, `key_conflicts`, `dead_letters` and the
//! replay guard's `delivery_fingerprints`.
//!
//! Every statement here runs inside the batch transaction, so claims, conflicts and dead letters
//! commit together with the effects or not at all.

use crate::envelope::Event;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use std::collections::HashMap;

/// Where a message came from, stored with whatever it produced.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    pub topic: &'a str,
    pub partition: i32,
}

/// A claimed event's outcome, written back to its claim before COMMIT.
#[derive(Debug, Clone)]
pub struct Settlement<'a> {
    pub key: &'a str,
    pub status: ClaimStatus,
    pub attempts: i32,
    pub last_error: Option<String>,
}

/// The states of a claim that the consumer writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimStatus {
    Done,
    Failed,
}

impl ClaimStatus {
    fn as_str(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Failed => "failed",
        }
    }
}

/// Claims the keys of `events` in one statement and returns the keys this transaction claimed.
///
/// The rows are inserted in key order (`COLLATE "C"`), so two transactions racing on
/// overlapping keys take their locks in the same order and can wait on each other but never
/// deadlock. A key another transaction is inserting makes this one wait for it: if it commits
/// the key is not claimed here, if it aborts the key is claimed here.
#[tracing::instrument(skip_all, fields(events = events.len()))]
pub async fn claim(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    events: &[(i64, &Event)],
) -> sqlx::Result<Vec<String>> {
    let mut keys = Vec::with_capacity(events.len());
    let mut sources = Vec::with_capacity(events.len());
    let mut types = Vec::with_capacity(events.len());
    let mut hashes = Vec::with_capacity(events.len());
    let mut payloads = Vec::with_capacity(events.len());
    let mut received: Vec<Option<DateTime<Utc>>> = Vec::with_capacity(events.len());
    let mut offsets = Vec::with_capacity(events.len());
    for (offset, e) in events {
        keys.push(e.key.as_str());
        sources.push(e.source.as_str());
        types.push(e.event_type.as_deref());
        hashes.push(&e.payload_sha256[..]);
        payloads.push(&e.payload);
        received.push(e.received_at);
        offsets.push(*offset);
    }
    sqlx::query_scalar(
        r#"INSERT INTO processed_events (event_key, source, event_type, status, payload_sha256,
                payload, received_at, kafka_topic, kafka_partition, kafka_offset)
           SELECT k, s, t, 'in_progress', h, p, r, $8, $9, o
           FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::jsonb[],
                       $6::timestamptz[], $7::int8[]) AS u(k, s, t, h, p, r, o)
           ORDER BY k COLLATE "C"
           ON CONFLICT (event_key) DO NOTHING
           RETURNING event_key"#,
    )
    .bind(&keys)
    .bind(&sources)
    .bind(&types)
    .bind(&hashes)
    .bind(&payloads)
    .bind(&received)
    .bind(&offsets)
    .bind(origin.topic)
    .bind(origin.partition)
    .fetch_all(conn)
    .await
}

/// The payload hashes already stored for `keys`.
pub async fn stored_hashes(
    conn: &mut PgConnection,
    keys: &[&str],
) -> sqlx::Result<HashMap<String, Vec<u8>>> {
    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT event_key, payload_sha256 FROM processed_events WHERE event_key = ANY($1)",
    )
    .bind(keys)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// An event recorded in `key_conflicts` instead of applied, with why when it is not a plain
/// reuse of a claimed key (a replayed capture).
pub type Conflict<'a> = (i64, &'a Event, Option<String>);

/// Records events whose key was already claimed with a different payload, or that the replay
/// guard caught. Each distinct (key, payload) pair is one row; seeing it again bumps its count.
#[tracing::instrument(skip_all, fields(conflicts = conflicts.len()))]
pub async fn record_conflicts(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    conflicts: &[Conflict<'_>],
) -> sqlx::Result<()> {
    let mut seen = std::collections::HashSet::new();
    let unique: Vec<_> = conflicts
        .iter()
        .filter(|(_, e, _)| seen.insert((e.key.as_str(), e.payload_sha256)))
        .collect();
    let keys: Vec<&str> = unique.iter().map(|(_, e, _)| e.key.as_str()).collect();
    let hashes: Vec<&[u8]> = unique
        .iter()
        .map(|(_, e, _)| &e.payload_sha256[..])
        .collect();
    let payloads: Vec<&serde_json::Value> = unique.iter().map(|(_, e, _)| &e.payload).collect();
    let sources: Vec<&str> = unique.iter().map(|(_, e, _)| e.source.as_str()).collect();
    let offsets: Vec<i64> = unique.iter().map(|(o, _, _)| *o).collect();
    let reasons: Vec<Option<&str>> = unique.iter().map(|(_, _, r)| r.as_deref()).collect();
    sqlx::query(
        r#"INSERT INTO key_conflicts (event_key, payload_sha256, payload, source, kafka_topic,
                kafka_partition, kafka_offset, reason)
           SELECT k, h, p, s, $6, $7, o, r
           FROM unnest($1::text[], $2::bytea[], $3::jsonb[], $4::text[], $5::int8[], $8::text[])
                AS u(k, h, p, s, o, r)
           ORDER BY k COLLATE "C", h
           ON CONFLICT (event_key, payload_sha256) DO UPDATE
           SET last_seen_at = now(), times_seen = key_conflicts.times_seen + 1"#,
    )
    .bind(&keys)
    .bind(&hashes)
    .bind(&payloads)
    .bind(&sources)
    .bind(&offsets)
    .bind(origin.topic)
    .bind(origin.partition)
    .bind(&reasons)
    .execute(conn)
    .await?;
    Ok(())
}

/// A signed body as the replay guard knows it: its source and payload hash.
pub type Fingerprint = (String, Vec<u8>);

/// The key a signed body was first delivered under, and how many seconds ago.
pub type FirstDelivery = (String, f64);

/// For each guarded event, the key its signed body was first delivered under and how many
/// seconds ago. Records the fingerprints of bodies seen for the first time (the earliest offset
/// wins within a batch), and moves to the new key a fingerprint older than that event's window.
///
/// Lock order: fingerprints are inserted sorted by (source, hash) and always before the claims,
/// so two batches can wait on each other's fingerprints but never deadlock.
#[tracing::instrument(skip_all, fields(events = events.len()))]
pub async fn fingerprints(
    conn: &mut PgConnection,
    events: &[(i64, &Event)],
) -> sqlx::Result<HashMap<Fingerprint, FirstDelivery>> {
    let sources: Vec<&str> = events.iter().map(|(_, e)| e.source.as_str()).collect();
    let hashes: Vec<&[u8]> = events.iter().map(|(_, e)| &e.payload_sha256[..]).collect();
    let keys: Vec<&str> = events.iter().map(|(_, e)| e.key.as_str()).collect();
    let offsets: Vec<i64> = events.iter().map(|(o, _)| *o).collect();
    let windows: Vec<f64> = events
        .iter()
        .map(|(_, e)| e.replay_window_secs.unwrap_or(0) as f64)
        .collect();
    sqlx::query(
        r#"INSERT INTO delivery_fingerprints AS f (source, payload_sha256, event_key)
           SELECT s, h, k FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int8[])
                AS u(s, h, k, o)
           ORDER BY s COLLATE "C", h, o
           ON CONFLICT (source, payload_sha256) DO NOTHING"#,
    )
    .bind(&sources)
    .bind(&hashes)
    .bind(&keys)
    .bind(&offsets)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        r#"UPDATE delivery_fingerprints AS f SET event_key = u.k, first_seen_at = now()
           FROM unnest($1::text[], $2::bytea[], $3::text[], $4::float8[]) AS u(s, h, k, w)
           WHERE f.source = u.s AND f.payload_sha256 = u.h AND f.event_key <> u.k
             AND f.first_seen_at < now() - make_interval(secs => u.w)"#,
    )
    .bind(&sources)
    .bind(&hashes)
    .bind(&keys)
    .bind(&windows)
    .execute(&mut *conn)
    .await?;
    let rows: Vec<(String, Vec<u8>, String, f64)> = sqlx::query_as(
        r#"SELECT f.source, f.payload_sha256, f.event_key,
                  extract(epoch FROM now() - f.first_seen_at)::float8
           FROM delivery_fingerprints f
           JOIN unnest($1::text[], $2::bytea[]) AS u(s, h)
             ON f.source = u.s AND f.payload_sha256 = u.h"#,
    )
    .bind(&sources)
    .bind(&hashes)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(s, h, k, age)| ((s, h), (k, age)))
        .collect())
}

/// A message that is not a valid envelope, kept byte for byte.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a> {
    pub offset: i64,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub reason: String,
}

/// Stores dead letters; a redelivered message that is already dead-lettered is not stored twice,
/// while a different message at a reused offset (a truncated or recreated topic) is stored too.
#[tracing::instrument(skip_all, fields(dead_letters = letters.len()))]
pub async fn insert_dead_letters(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    letters: &[DeadLetter<'_>],
) -> sqlx::Result<()> {
    let offsets: Vec<i64> = letters.iter().map(|d| d.offset).collect();
    let keys: Vec<Option<&[u8]>> = letters.iter().map(|d| d.key).collect();
    let values: Vec<Option<&[u8]>> = letters.iter().map(|d| d.value).collect();
    let reasons: Vec<&str> = letters.iter().map(|d| d.reason.as_str()).collect();
    sqlx::query(
        r#"INSERT INTO dead_letters (kafka_topic, kafka_partition, kafka_offset, raw_key,
                raw_value, reason)
           SELECT $5, $6, o, k, v, r
           FROM unnest($1::int8[], $2::bytea[], $3::bytea[], $4::text[]) AS u(o, k, v, r)
           ON CONFLICT (kafka_topic, kafka_partition, kafka_offset, message_sha256) DO NOTHING"#,
    )
    .bind(&offsets)
    .bind(&keys)
    .bind(&values)
    .bind(&reasons)
    .bind(origin.topic)
    .bind(origin.partition)
    .execute(conn)
    .await?;
    Ok(())
}

/// Writes each claimed event's outcome to its claim; a failed one also records `effect_spec`,
/// the effects to run again on an operator's retry.
#[tracing::instrument(skip_all, fields(claims = settlements.len()))]
pub async fn settle(
    conn: &mut PgConnection,
    settlements: &[Settlement<'_>],
    effect_spec: Option<&serde_json::Value>,
) -> sqlx::Result<()> {
    let keys: Vec<&str> = settlements.iter().map(|s| s.key).collect();
    let statuses: Vec<&str> = settlements.iter().map(|s| s.status.as_str()).collect();
    let attempts: Vec<i32> = settlements.iter().map(|s| s.attempts).collect();
    let errors: Vec<Option<&str>> = settlements
        .iter()
        .map(|s| s.last_error.as_deref())
        .collect();
    sqlx::query(
        r#"UPDATE processed_events AS p
           SET status = u.status, attempts = u.attempts, last_error = u.err,
               completed_at = CASE WHEN u.status = 'done' THEN clock_timestamp() END,
               effect_spec = CASE WHEN u.status = 'failed' THEN $5::jsonb END
           FROM unnest($1::text[], $2::text[], $3::int4[], $4::text[]) AS u(k, status, attempts, err)
           WHERE p.event_key = u.k"#,
    )
    .bind(&keys)
    .bind(&statuses)
    .bind(&attempts)
    .bind(&errors)
    .bind(effect_spec)
    .execute(conn)
    .await?;
    Ok(())
}

//! All SQL for `key_conflicts` (a key reused with a different payload, or a replayed capture)
//! and the replay guard's `delivery_fingerprints`.

use super::Origin;
use crate::db::Db;
use crate::db::JsonText;
use crate::envelope::Event;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use std::collections::HashMap;

/// An event recorded in `key_conflicts` instead of applied, with why when it is not a plain
/// reuse of a claimed key (a replayed capture).
pub type Conflict<'a> = (i64, &'a Event, Option<String>);

/// Records events whose key was already claimed with a different payload, or that the replay
/// guard caught. Each distinct (key, payload) pair is one row; seeing it again bumps its count.
#[tracing::instrument(skip_all, fields(conflicts = conflicts.len()))]
pub async fn record(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    conflicts: &[Conflict<'_>],
) -> sqlx::Result<()> {
    let mut seen = std::collections::HashSet::new();
    let unique: Vec<_> = conflicts
        .iter()
        .filter(|(_, e, _)| seen.insert((e.key.as_str(), e.route_key(), e.payload_sha256)))
        .collect();
    let keys: Vec<&str> = unique.iter().map(|(_, e, _)| e.key.as_str()).collect();
    let routes: Vec<&str> = unique.iter().map(|(_, e, _)| e.route_key()).collect();
    let hashes: Vec<&[u8]> = unique
        .iter()
        .map(|(_, e, _)| &e.payload_sha256[..])
        .collect();
    let payloads: Vec<&str> = unique
        .iter()
        .map(|(_, e, _)| e.payload_json.get())
        .collect();
    let sources: Vec<&str> = unique.iter().map(|(_, e, _)| e.source.as_str()).collect();
    let offsets: Vec<i64> = unique.iter().map(|(o, _, _)| *o).collect();
    let reasons: Vec<Option<&str>> = unique.iter().map(|(_, _, r)| r.as_deref()).collect();
    sqlx::query!(
        r#"INSERT INTO key_conflicts (event_key, route_key, payload_sha256, payload, source,
                kafka_topic, kafka_partition, kafka_offset, reason)
           SELECT k, rk, h, p::jsonb, s, $6, $7, o, r
           FROM unnest($1::text[], $2::bytea[], $3::text[], $4::text[], $5::int8[], $8::text[],
                       $9::text[])
                AS u(k, h, p, s, o, r, rk)
           ORDER BY k COLLATE "C", h, rk COLLATE "C"
           ON CONFLICT (event_key, payload_sha256, route_key) DO UPDATE
           SET last_seen_at = now(), times_seen = key_conflicts.times_seen + 1"#,
        &keys as _,
        &hashes as _,
        &payloads as _,
        &sources as _,
        &offsets,
        origin.topic,
        origin.partition,
        &reasons as _,
        &routes as _,
    )
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
    let routes: Vec<&str> = events.iter().map(|(_, e)| fingerprint_route(e)).collect();
    let offsets: Vec<i64> = events.iter().map(|(o, _)| *o).collect();
    let windows: Vec<f64> = events
        .iter()
        .map(|(_, e)| e.replay_window_secs.unwrap_or(0) as f64)
        .collect();
    remember_first_deliveries(conn, &sources, &hashes, &keys, &offsets, &routes).await?;
    sqlx::query!(
        r#"UPDATE delivery_fingerprints AS f SET event_key = u.k, first_seen_at = now()
           FROM unnest($1::text[], $2::bytea[], $3::text[], $4::float8[], $5::text[])
                AS u(s, h, k, w, rk)
           WHERE f.source = u.s AND f.payload_sha256 = u.h AND f.route_key = u.rk
             AND f.event_key <> u.k
             AND f.first_seen_at < now() - make_interval(secs => u.w)"#,
        &sources as _,
        &hashes as _,
        &keys as _,
        &windows,
        &routes as _,
    )
    .execute(&mut *conn)
    .await?;
    let rows = sqlx::query!(
        r#"SELECT f.source, f.payload_sha256, f.event_key,
                  extract(epoch FROM now() - f.first_seen_at)::float8 AS "age!"
           FROM delivery_fingerprints f
           JOIN unnest($1::text[], $2::bytea[], $3::text[]) AS u(s, h, rk)
             ON f.source = u.s AND f.payload_sha256 = u.h AND f.route_key = u.rk"#,
        &sources as _,
        &hashes as _,
        &routes as _,
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| ((r.source, r.payload_sha256), (r.event_key, r.age)))
        .collect())
}

/// The route a fingerprint is kept under: the tenant's route key for sources that route by
/// tenant (a capture replayed under another id is caught on the tenant's shard), '' for sources
/// routed by the event key, whose fingerprints each shard keeps for the bodies it saw.
fn fingerprint_route(event: &Event) -> &str {
    event.tenant_route().unwrap_or("")
}

/// Stores the fingerprints of bodies seen for the first time; the earliest offset wins.
async fn remember_first_deliveries(
    conn: &mut PgConnection,
    sources: &[&str],
    hashes: &[&[u8]],
    keys: &[&str],
    offsets: &[i64],
    routes: &[&str],
) -> sqlx::Result<()> {
    sqlx::query!(
        r#"INSERT INTO delivery_fingerprints AS f (source, payload_sha256, event_key, route_key)
           SELECT s, h, k, rk FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int8[],
                                          $5::text[])
                AS u(s, h, k, o, rk)
           ORDER BY s COLLATE "C", h, rk COLLATE "C", o
           ON CONFLICT (source, payload_sha256, route_key) DO NOTHING"#,
        sources as _,
        hashes as _,
        keys as _,
        offsets,
        routes as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// A key conflict as the operator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct ConflictRow {
    pub payload_sha256: String,
    pub times_seen: i64,
    pub reason: Option<String>,
    pub first_seen_at: DateTime<Utc>,
    pub last_seen_at: DateTime<Utc>,
    pub payload: JsonText,
    /// The Kafka message that first carried it: topic/partition@offset.
    pub message: String,
}

/// The conflicting payloads seen for `key`, oldest first.
pub async fn of_event(pool: &Db, key: &str) -> sqlx::Result<Vec<ConflictRow>> {
    sqlx::query_as!(
        ConflictRow,
        r#"SELECT encode(payload_sha256, 'hex') AS "payload_sha256!", times_seen, reason,
                  first_seen_at, last_seen_at, payload AS "payload: JsonText",
                  kafka_topic || '/' || kafka_partition || '@' || kafka_offset AS "message!"
           FROM key_conflicts WHERE event_key = $1 ORDER BY first_seen_at"#,
        key
    )
    .fetch_all(pool)
    .await
}

//! All SQL for `expired_replays` and the consumer's reading of `prune_horizons`: events whose
//! key is unknown and that are older than their source's prune horizon, so their claim may have
//! been pruned. They are not applied; an operator applies them (once) or drops them.
//!
//! Why nothing slips between the check and the claim: the horizons are read through
//! `claim_horizons`, which holds each source's prune lock shared until the batch's transaction
//! ends, so prune cannot move a horizon the batch decided by. An event older than the horizon has
//! its key looked up with `FOR KEY SHARE`, which a pruning `DELETE` waits for (or which waits for
//! it): either the claim is there and stays until the batch commits, or it is gone and the event
//! is an expired replay. An event newer than the horizon was claimed, if ever, after it, and prune
//! deletes nothing claimed after the horizon it committed.

use crate::claims::Origin;
use crate::db::Db;
use crate::db::JsonText;
use crate::envelope::Event;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use std::collections::{HashMap, HashSet};

/// For each source of `sources` that was pruned: events that happened before this time are
/// candidates for an expired replay (the horizon, plus the clock margin prune recorded).
#[tracing::instrument(skip_all, fields(sources = sources.len()))]
pub async fn horizons(
    conn: &mut PgConnection,
    sources: &[&str],
) -> sqlx::Result<HashMap<String, DateTime<Utc>>> {
    let rows = sqlx::query!(
        r#"SELECT source AS "source!", expired_before AS "expired_before!"
           FROM claim_horizons($1::text[])"#,
        sources as _
    )
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.source, r.expired_before))
        .collect())
}

/// Of `keys`, those claimed, each locked against prune until the caller's transaction ends.
pub async fn lock_known(
    conn: &mut PgConnection,
    keys: &[(&str, &str)],
) -> sqlx::Result<HashSet<String>> {
    let (keys, routes): (Vec<&str>, Vec<&str>) = keys.iter().copied().unzip();
    let rows = sqlx::query_scalar!(
        r#"SELECT p.event_key FROM processed_events p
           JOIN unnest($1::text[], $2::text[]) AS u(k, rk)
             ON p.event_key = u.k AND p.route_key = u.rk
           ORDER BY p.event_key COLLATE "C", p.route_key COLLATE "C"
           FOR KEY SHARE OF p"#,
        &keys as _,
        &routes as _,
    )
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// An expired replay caught by a batch.
pub struct Caught<'a> {
    pub offset: i64,
    pub event: &'a Event,
    /// The horizon (with its margin) the event was older than.
    pub expired_before: DateTime<Utc>,
}

/// Records `caught` in the batch's transaction; a copy already recorded counts once more.
pub async fn record(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    caught: &[Caught<'_>],
    effect_spec: Option<&serde_json::Value>,
) -> sqlx::Result<()> {
    let keys: Vec<&str> = caught.iter().map(|c| c.event.key.as_str()).collect();
    let routes: Vec<&str> = caught.iter().map(|c| c.event.route_key()).collect();
    let sources: Vec<&str> = caught.iter().map(|c| c.event.source.as_str()).collect();
    let types: Vec<Option<&str>> = caught
        .iter()
        .map(|c| c.event.event_type.as_deref())
        .collect();
    let occurred: Vec<Option<DateTime<Utc>>> = caught.iter().map(|c| c.event.occurred_at).collect();
    let received: Vec<Option<DateTime<Utc>>> = caught.iter().map(|c| c.event.received_at).collect();
    let horizons: Vec<DateTime<Utc>> = caught.iter().map(|c| c.expired_before).collect();
    let hashes: Vec<&[u8]> = caught.iter().map(|c| &c.event.payload_sha256[..]).collect();
    let payloads: Vec<&str> = caught.iter().map(|c| c.event.payload_json.get()).collect();
    let offsets: Vec<i64> = caught.iter().map(|c| c.offset).collect();
    let attributes = crate::claims::attributes(caught.iter().map(|c| c.event));
    sqlx::query!(
        r#"INSERT INTO expired_replays AS x (event_key, source, event_type, occurred_at,
                received_at, pruned_before, payload_sha256, payload, effect_spec, kafka_topic,
                kafka_partition, kafka_offset, route_key, attributes)
           SELECT k, s, t, o, r, h, sha, p::jsonb, $10::jsonb, $11, $12, off, rk, a
           FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::timestamptz[],
                       $6::timestamptz[], $7::bytea[], $8::text[], $9::int8[], $13::text[],
                       $14::jsonb[])
               AS u(k, s, t, o, r, h, sha, p, off, rk, a)
           ORDER BY k COLLATE "C", rk COLLATE "C"
           ON CONFLICT (event_key, payload_sha256, route_key) DO UPDATE
           SET times_seen = x.times_seen + 1, last_seen_at = now()"#,
        &keys as _,
        &sources as _,
        &types as _,
        &occurred as _,
        &received as _,
        &horizons,
        &hashes as _,
        &payloads as _,
        &offsets,
        effect_spec,
        origin.topic,
        origin.partition,
        &routes as _,
        &attributes as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// An expired replay as an operator sees it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ExpiredReplay {
    pub id: i64,
    pub event_key: String,
    pub source: String,
    pub event_type: Option<String>,
    pub occurred_at: DateTime<Utc>,
    pub pruned_before: DateTime<Utc>,
    pub times_seen: i64,
    pub first_seen_at: DateTime<Utc>,
    pub resolution: Option<String>,
}

/// Expired replays, newest first; only the unresolved ones unless `all`.
pub async fn list(pool: &Db, all: bool, limit: i64) -> sqlx::Result<Vec<ExpiredReplay>> {
    sqlx::query_as!(
        ExpiredReplay,
        r#"SELECT id, event_key, source, event_type, occurred_at, pruned_before, times_seen,
                  first_seen_at, resolution
           FROM expired_replays
           WHERE $1 OR resolution IS NULL
           ORDER BY id DESC LIMIT $2"#,
        all,
        limit
    )
    .fetch_all(pool)
    .await
}

/// Unresolved expired replays, and the age in seconds of the oldest (0 when none).
pub async fn open_overview(pool: &Db) -> sqlx::Result<(i64, f64)> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "n!",
                  coalesce(extract(epoch FROM now() - min(first_seen_at))::float8, 0) AS "oldest!"
           FROM expired_replays WHERE resolution IS NULL"#
    )
    .fetch_one(pool)
    .await?;
    Ok((row.n, row.oldest))
}

/// [`list`] over several databases (the shards), newest first by when each was caught.
pub async fn list_over(pools: &[Db], all: bool, limit: i64) -> sqlx::Result<Vec<ExpiredReplay>> {
    let mut rows = Vec::new();
    for pool in pools {
        rows.extend(list(pool, all, limit).await?);
    }
    if pools.len() > 1 {
        rows.sort_by_key(|r| std::cmp::Reverse((r.first_seen_at, r.id)));
        rows.truncate(limit.max(0) as usize);
    }
    Ok(rows)
}

/// An unresolved expired replay, locked for the caller's transaction, with what applying it
/// needs.
pub struct Locked {
    pub id: i64,
    pub event_key: String,
    pub source: String,
    pub event_type: Option<String>,
    pub occurred_at: DateTime<Utc>,
    pub received_at: Option<DateTime<Utc>>,
    pub payload_sha256: Vec<u8>,
    pub payload: Option<JsonText>,
    pub effect_spec: Option<serde_json::Value>,
    pub kafka_topic: String,
    pub kafka_partition: i32,
    pub kafka_offset: i64,
    /// The route key it would have been claimed by.
    pub route_key: String,
    /// What the message said of the event beyond the envelope.
    pub attributes: Option<serde_json::Value>,
}

/// The unresolved expired replays of `key`, locked; an operator acts on them together.
pub async fn lock_open(conn: &mut PgConnection, key: &str) -> sqlx::Result<Vec<Locked>> {
    sqlx::query_as!(
        Locked,
        r#"SELECT id, event_key, source, event_type, occurred_at, received_at, payload_sha256,
                  payload AS "payload: JsonText", effect_spec, kafka_topic, kafka_partition,
                  kafka_offset, route_key, attributes
           FROM expired_replays WHERE event_key = $1 AND resolution IS NULL
           ORDER BY id FOR UPDATE"#,
        key
    )
    .fetch_all(conn)
    .await
}

/// Settles the expired replays of `ids` as `applied` or `dropped`.
pub async fn resolve(conn: &mut PgConnection, ids: &[i64], resolution: &str) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE expired_replays SET resolution = $2, resolved_at = now() WHERE id = ANY($1)",
        ids,
        resolution
    )
    .execute(conn)
    .await?;
    Ok(())
}

//! All SQL for the claim tables: `processed_events` here, `key_conflicts` and the replay
//! guard's `delivery_fingerprints` in [`conflicts`], `dead_letters` in [`dead_letters`].
//!
//! The consumer's statements run inside the batch transaction, so claims, conflicts and dead
//! letters commit together with the effects or not at all. The operator's statements take the
//! connection or transaction their flow runs in.

pub mod conflicts;
pub mod dead_letters;
pub mod deliveries;
mod stored;

pub use stored::{lock, lock_due, StoredClaim};

use crate::db::Db;
use crate::db::JsonText;
use crate::effect::DeferPolicy;
use crate::envelope::Event;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgConnection;
use std::collections::{HashMap, HashSet};

/// Where a message came from, stored with whatever it produced.
#[derive(Debug, Clone, Copy)]
pub struct Origin<'a> {
    pub topic: &'a str,
    pub partition: i32,
}

/// A claim's status: `done`, `deferred` (the effect said "not yet"; applied again when due),
/// `failed` (kept for an operator's retry or resolve), or `dead` when an operator gave up on
/// it. `in_progress` is what claims were inserted with before they were written once with their
/// final status; old rows may still hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum ClaimStatus {
    InProgress,
    Done,
    Deferred,
    Failed,
    Dead,
}

impl ClaimStatus {
    pub const ALL: [Self; 5] = [
        Self::InProgress,
        Self::Done,
        Self::Deferred,
        Self::Failed,
        Self::Dead,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Done => "done",
            Self::Deferred => "deferred",
            Self::Failed => "failed",
            Self::Dead => "dead",
        }
    }
}

impl std::fmt::Display for ClaimStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A claimed event whose effect failed for good: written to its claim with the payload, so an
/// operator can retry it.
#[derive(Debug)]
pub struct Failure<'a> {
    pub event: &'a Event,
    pub attempts: i32,
    pub error: String,
    /// The deferral policy in force for the event, kept for an operator's retry.
    pub policy: DeferPolicy,
}

/// What [`claim`] found: the keys this transaction claimed, and the claims found already for
/// the others, each with its route and payload hash.
#[derive(Debug, Default)]
pub struct Claimed {
    pub keys: HashSet<String>,
    pub found: HashMap<String, (String, Vec<u8>)>,
}

/// Claims the keys of `events` in one statement, each row written once with its final status
/// (`done`: its effect runs in the same transaction), and returns the keys this transaction
/// claimed with the claims it found. A settled claim keeps its payload's hash, not the payload.
///
/// The statement probes the claims for every key first and inserts only the keys it did not
/// find, as bulk loaders do: a batch of redeliveries writes no claim. The deliveries of the keys
/// it found are recorded by the same statement, as one `redeliveries` row ([`deliveries`]); the
/// caller records the rest (copies within the batch, keys a racing transaction claimed). A key
/// found under another route (its source's `route_from` changed, a proxy added a routing header
/// to one delivery) is not claimed again either: it is one event, and the caller tells which
/// route won it from what was found. A key another transaction is claiming under another route
/// at the same moment is not found, and both claim it (docs/failure-modes.md).
///
/// The rows are inserted in key order (`COLLATE "C"`), so two transactions racing on
/// overlapping keys take their locks in the same order and can wait on each other but never
/// deadlock. A key another transaction is inserting makes this one wait for it: if it commits
/// the key is not claimed here (nor found: look it up with [`stored_hashes`]), if it aborts the
/// key is claimed here.
#[tracing::instrument(skip_all, fields(events = events.len()))]
pub async fn claim(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    events: &[(i64, &Event)],
) -> sqlx::Result<Claimed> {
    let keys = column(events, |e| e.key.as_str());
    let routes = column(events, Event::route_key);
    let sources = column(events, |e| e.source.as_str());
    let types = column(events, |e| e.event_type.as_deref());
    let hashes = column(events, |e| &e.payload_sha256[..]);
    let received = column(events, |e| e.received_at);
    let offsets: Vec<i64> = events.iter().map(|(o, _)| *o).collect();
    let requests = column(events, |e| e.request_id.as_deref());
    let traces = column(events, |e| e.traceparent.as_deref());
    let rows = sqlx::query!(
        r#"WITH u AS MATERIALIZED (
               SELECT u.*, f.route_key AS found_route, f.payload_sha256 AS found_hash
               FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::timestamptz[],
                           $6::int8[], $9::text[], $10::text[], $11::text[])
                    AS u(k, s, t, h, r, o, q, tp, rk)
               LEFT JOIN LATERAL (SELECT x.route_key, x.payload_sha256 FROM processed_events x
                                  WHERE x.event_key = u.k OFFSET 0) AS f ON true),
           claimed AS (
               INSERT INTO processed_events (event_key, route_key, source, event_type, status,
                   payload_sha256, received_at, kafka_topic, kafka_partition, kafka_offset,
                   attempts, completed_at, request_id, traceparent)
               SELECT k, rk, s, t, 'done', h, r, $7, $8, o, 1, now(), q, tp
               FROM u WHERE found_route IS NULL
               ORDER BY k COLLATE "C", rk COLLATE "C"
               ON CONFLICT (event_key, route_key) DO NOTHING
               RETURNING event_key),
           seen AS (
               INSERT INTO redeliveries (kafka_topic, kafka_partition, event_keys, kafka_offsets)
               SELECT $7, $8, array_agg(k ORDER BY o), array_agg(o ORDER BY o)
               FROM u WHERE found_route IS NOT NULL
               HAVING count(*) > 0)
           SELECT event_key AS "event_key!", NULL::text AS route_key, NULL::bytea AS hash
           FROM claimed
           UNION ALL
           SELECT k, found_route, found_hash FROM u WHERE found_route IS NOT NULL"#,
        &keys as _,
        &sources as _,
        &types as _,
        &hashes as _,
        &received as _,
        &offsets,
        origin.topic,
        origin.partition,
        &requests as _,
        &traces as _,
        &routes as _,
    )
    .fetch_all(conn)
    .await?;
    Ok(Claimed::sorted(
        rows.into_iter()
            .map(|r| (r.event_key, r.route_key.zip(r.hash))),
    ))
}

/// One column of `events`, for an array parameter.
fn column<'e, T>(events: &[(i64, &'e Event)], value: impl Fn(&'e Event) -> T) -> Vec<T> {
    events.iter().map(|&(_, e)| value(e)).collect()
}

impl Claimed {
    /// The statement's rows sorted out: a key with no stored claim beside it was claimed here.
    fn sorted(rows: impl Iterator<Item = (String, Option<(String, Vec<u8>)>)>) -> Self {
        let mut claimed = Self::default();
        for (key, stored) in rows {
            match stored {
                Some(stored) => {
                    claimed.found.insert(key, stored);
                }
                None => {
                    claimed.keys.insert(key);
                }
            }
        }
        claimed
    }
}

/// The route and payload hash each of `keys` is already claimed under in this database, by
/// event key alone: a key claimed under another route is found too.
pub async fn stored_hashes(
    conn: &mut PgConnection,
    keys: &[&str],
) -> sqlx::Result<HashMap<String, (String, Vec<u8>)>> {
    let rows = sqlx::query!(
        r#"SELECT p.event_key, p.route_key, p.payload_sha256 FROM processed_events p
           WHERE p.event_key = ANY($1::text[])"#,
        keys as _,
    )
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.event_key, (r.route_key, r.payload_sha256)))
        .collect())
}

/// Marks claims of this transaction whose effect failed for good as `failed`, with the error,
/// the payload and `effect_spec` (the effects to run again on an operator's retry).
#[tracing::instrument(skip_all, fields(claims = failures.len()))]
pub async fn fail(
    conn: &mut PgConnection,
    failures: &[Failure<'_>],
    effect_spec: Option<&serde_json::Value>,
) -> sqlx::Result<()> {
    let keys: Vec<&str> = failures.iter().map(|f| f.event.key.as_str()).collect();
    let routes: Vec<&str> = failures.iter().map(|f| f.event.route_key()).collect();
    let attempts: Vec<i32> = failures.iter().map(|f| f.attempts).collect();
    let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
    let payloads: Vec<&str> = failures
        .iter()
        .map(|f| f.event.payload_json.get())
        .collect();
    let policies = policies(failures.iter().map(|f| &f.policy));
    let attributes = attributes(failures.iter().map(|f| f.event));
    sqlx::query!(
        r#"UPDATE processed_events AS p
           SET status = 'failed', attempts = u.attempts, last_error = u.err,
               payload = u.payload::jsonb, completed_at = NULL, effect_spec = $5::jsonb,
               defer_policy = u.policy::jsonb, attributes = u.attrs
           FROM unnest($1::text[], $2::int4[], $3::text[], $4::text[], $6::text[], $7::text[],
                       $8::jsonb[])
               AS u(k, attempts, err, payload, policy, rk, attrs)
           WHERE p.event_key = u.k AND p.route_key = u.rk"#,
        &keys as _,
        &attempts,
        &errors as _,
        &payloads as _,
        effect_spec,
        &policies,
        &routes as _,
        &attributes as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Each event's attributes as stored, when it has any ([`Event::attributes`]).
pub(crate) fn attributes<'e>(
    events: impl Iterator<Item = &'e Event>,
) -> Vec<Option<serde_json::Value>> {
    events
        .map(|e| {
            e.attributes()
                .and_then(crate::envelope::Attributes::to_json)
        })
        .collect()
}

/// A claimed event whose effect said "not yet": its claim becomes `deferred` until `due`.
#[derive(Debug)]
pub struct Deferral<'a> {
    pub event: &'a Event,
    pub reason: String,
    pub due: DateTime<Utc>,
    /// After this the event is settled `failed` rather than deferred again.
    pub deadline: DateTime<Utc>,
    /// The deferral policy in force for the event, kept for every later attempt.
    pub policy: DeferPolicy,
}

/// Deferral policies as the JSON text stored in `defer_policy`.
fn policies<'p>(policies: impl Iterator<Item = &'p DeferPolicy>) -> Vec<String> {
    policies
        .map(|p| serde_json::to_string(p).expect("a policy serialises"))
        .collect()
}

/// Marks claims of this transaction whose effect deferred as `deferred`, with the payload, the
/// due time, the deadline, the reason and `effect_spec`.
#[tracing::instrument(skip_all, fields(claims = deferrals.len()))]
pub async fn defer(
    conn: &mut PgConnection,
    deferrals: &[Deferral<'_>],
    effect_spec: Option<&serde_json::Value>,
) -> sqlx::Result<()> {
    let keys: Vec<&str> = deferrals.iter().map(|d| d.event.key.as_str()).collect();
    let routes: Vec<&str> = deferrals.iter().map(|d| d.event.route_key()).collect();
    let reasons: Vec<&str> = deferrals.iter().map(|d| d.reason.as_str()).collect();
    let payloads: Vec<&str> = deferrals
        .iter()
        .map(|d| d.event.payload_json.get())
        .collect();
    let due: Vec<DateTime<Utc>> = deferrals.iter().map(|d| d.due).collect();
    let deadlines: Vec<DateTime<Utc>> = deferrals.iter().map(|d| d.deadline).collect();
    let policies = policies(deferrals.iter().map(|d| &d.policy));
    let attributes = attributes(deferrals.iter().map(|d| d.event));
    sqlx::query!(
        r#"UPDATE processed_events AS p
           SET status = 'deferred', deferred_reason = u.reason, payload = u.payload::jsonb,
               due_at = u.due, deadline_at = u.deadline, completed_at = NULL,
               effect_spec = $6::jsonb, defer_policy = u.policy::jsonb, attributes = u.attrs
           FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::timestamptz[],
                       $7::text[], $8::text[], $9::jsonb[])
               AS u(k, reason, payload, due, deadline, policy, rk, attrs)
           WHERE p.event_key = u.k AND p.route_key = u.rk"#,
        &keys as _,
        &reasons as _,
        &payloads as _,
        &due,
        &deadlines,
        effect_spec,
        &policies,
        &routes as _,
        &attributes as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// The keys of `topic`'s deferred claims that are due, soonest first, but for those of the
/// `paused` sources.
pub async fn due(
    pool: &Db,
    topic: &str,
    limit: i64,
    paused: &[String],
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar!(
        r#"SELECT event_key FROM processed_events
           WHERE status = 'deferred' AND kafka_topic = $1 AND due_at <= now()
             AND NOT (source = ANY($3))
           ORDER BY due_at LIMIT $2"#,
        topic,
        limit,
        paused
    )
    .fetch_all(pool)
    .await
}

/// Whether any claim of `source` is on `pool` (through `processed_events_age_idx`).
pub async fn source_seen(pool: &Db, source: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM processed_events WHERE source = $1) AS "seen!""#,
        source
    )
    .fetch_one(pool)
    .await
}

/// Deferred claims of `topic` (None: of every topic): how many, the age in seconds of the
/// oldest (0 when none is), and the seconds until the next is due (negative when overdue; None
/// when none is deferred).
pub async fn deferred_overview(
    pool: &Db,
    topic: Option<&str>,
) -> sqlx::Result<(i64, f64, Option<f64>)> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "n!",
                  coalesce(extract(epoch FROM now() - min(claimed_at))::float8, 0) AS "oldest!",
                  extract(epoch FROM min(due_at) - now())::float8 AS next_due
           FROM processed_events
           WHERE status = 'deferred' AND ($1::text IS NULL OR kafka_topic = $1)"#,
        topic
    )
    .fetch_one(pool)
    .await?;
    Ok((row.n, row.oldest, row.next_due))
}

/// Defers a claim again (or, from `failed`, for the first time): one more attempt, the new due
/// time, deadline and reason. The policy is stored when the claim has none yet.
pub async fn redefer(
    conn: &mut PgConnection,
    key: &str,
    reason: &str,
    due: DateTime<Utc>,
    deadline: DateTime<Utc>,
    policy: &DeferPolicy,
) -> sqlx::Result<()> {
    let policy = serde_json::to_string(policy).expect("a policy serialises");
    sqlx::query!(
        r#"UPDATE processed_events
           SET status = 'deferred', attempts = attempts + 1, deferred_reason = $2, due_at = $3,
               deadline_at = $4, completed_at = NULL,
               defer_policy = coalesce(defer_policy, $5::text::jsonb)
           WHERE event_key = $1"#,
        key,
        reason,
        due,
        deadline,
        policy,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Puts a deferred claim off after its effect failed transiently: one more attempt, due again
/// at `due`, the error kept; it stays deferred with its reason and deadline.
pub async fn postpone(
    conn: &mut PgConnection,
    key: &str,
    due: DateTime<Utc>,
    error: &str,
) -> sqlx::Result<()> {
    sqlx::query!(
        r#"UPDATE processed_events
           SET attempts = attempts + 1, due_at = $2, last_error = $3
           WHERE event_key = $1 AND status = 'deferred'"#,
        key,
        due,
        error,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Takes back claims of this transaction whose effect failed and will be tried again in a later
/// transaction: at commit the keys are unclaimed, as if never seen.
pub async fn release(conn: &mut PgConnection, keys: &[(&str, &str)]) -> sqlx::Result<()> {
    let (keys, routes): (Vec<&str>, Vec<&str>) = keys.iter().copied().unzip();
    sqlx::query!(
        r#"DELETE FROM processed_events p USING unnest($1::text[], $2::text[]) AS u(k, rk)
           WHERE p.event_key = u.k AND p.route_key = u.rk"#,
        &keys as _,
        &routes as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether this database holds `key`: its claim, or its expired replay.
pub async fn holds(pool: &Db, key: &str) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM processed_events WHERE event_key = $1)
               OR EXISTS (SELECT 1 FROM expired_replays WHERE event_key = $1) AS "held!""#,
        key
    )
    .fetch_one(pool)
    .await
}

/// A claim as the operator sees it.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimRow {
    pub event_key: String,
    pub source: String,
    #[serde(rename = "type")]
    pub event_type: Option<String>,
    pub status: ClaimStatus,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub payload_sha256: String,
    pub first_seen_at: String,
    /// When the ingress received the delivery that was claimed, if the envelope says.
    pub received_at: Option<DateTime<Utc>>,
    pub claimed_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    /// When a deferred claim's effect is tried again.
    pub due_at: Option<DateTime<Utc>>,
    /// When a deferred claim is settled `failed` if its effect still defers.
    pub deadline_at: Option<DateTime<Utc>>,
    /// Why the effect deferred, the last time it did.
    pub deferred_reason: Option<String>,
    /// Kept only on claims that are not settled `done` (see [`claim`]).
    pub payload: Option<JsonText>,
    /// The ingress request that carried the delivery that was claimed (the provider's
    /// delivery id where it has one).
    pub request_id: Option<String>,
    /// The W3C traceparent of the claim: its trace id finds the whole trace.
    pub traceparent: Option<String>,
    /// How many times the key was delivered to the consumer group: the claimed delivery and
    /// every duplicate since ([`deliveries::record`]).
    pub deliveries: i32,
    /// When the key was last delivered (the claim's own time until a duplicate came).
    pub last_seen_at: DateTime<Utc>,
}

impl ClaimRow {
    /// The deliveries not applied: duplicates (and key conflicts) of the claimed one.
    pub fn suppressed(&self) -> i32 {
        (self.deliveries - 1).max(0)
    }
}

/// One claim, if the key was ever claimed.
pub async fn find(pool: &Db, key: &str) -> sqlx::Result<Option<ClaimRow>> {
    sqlx::query_as!(
        ClaimRow,
        r#"SELECT event_key, source, event_type, status AS "status: ClaimStatus", attempts,
                  last_error, encode(payload_sha256, 'hex') AS "payload_sha256!",
                  kafka_topic || '/' || kafka_partition || '@' || kafka_offset AS "first_seen_at!",
                  received_at, claimed_at, completed_at, due_at, deadline_at, deferred_reason,
                  payload AS "payload: JsonText", request_id, traceparent,
                  d.deliveries AS "deliveries!", d.last_seen_at AS "last_seen_at!"
           FROM processed_events JOIN claim_deliveries d USING (event_key, route_key)
           WHERE event_key = $1"#,
        key
    )
    .fetch_optional(pool)
    .await
}

/// Records one more attempt at a claim's effect: `error` None settles it `done` (keeping only
/// the payload's hash, as every `done` claim), otherwise it becomes `failed` with the error.
pub async fn record_attempt(
    conn: &mut PgConnection,
    key: &str,
    error: Option<&str>,
) -> sqlx::Result<()> {
    sqlx::query!(
        r#"UPDATE processed_events
           SET attempts = attempts + 1, last_error = $2,
               status = CASE WHEN $2::text IS NULL THEN 'done' ELSE 'failed' END,
               completed_at = CASE WHEN $2::text IS NULL THEN now() END,
               payload = CASE WHEN $2::text IS NULL THEN NULL ELSE payload END,
               attributes = CASE WHEN $2::text IS NULL THEN NULL ELSE attributes END,
               due_at = NULL
           WHERE event_key = $1"#,
        key,
        error
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Settles a claim by hand as `done` or `dead`.
pub async fn resolve(conn: &mut PgConnection, key: &str, to: ClaimStatus) -> sqlx::Result<()> {
    sqlx::query!(
        r#"UPDATE processed_events
           SET status = $2, completed_at = CASE WHEN $2 = 'done' THEN now() END, due_at = NULL
           WHERE event_key = $1"#,
        key,
        to.as_str()
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// Claims by status: those not done counted through their partial index, the done ones (nearly
/// all) estimated from the table's statistics, so the table is never counted whole.
pub async fn counts(pool: &Db) -> sqlx::Result<Vec<(String, i64)>> {
    let rows = sqlx::query!(
        r#"WITH unsettled AS (SELECT status, count(*) AS n FROM processed_events
                              WHERE status <> 'done' GROUP BY status)
           SELECT status AS "status!", n AS "n!" FROM unsettled
           UNION ALL
           SELECT 'done', greatest(0, (SELECT reltuples FROM pg_class
                                       WHERE oid = to_regclass('processed_events'))::int8
                                      - (SELECT coalesce(sum(n), 0) FROM unsettled)::int8)
           ORDER BY 1"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.status, r.n))
        .filter(|(status, n)| status != "done" || *n > 0)
        .collect())
}

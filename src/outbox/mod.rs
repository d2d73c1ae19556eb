//! All SQL for the outbox tables: `outbox` and `outbox_attempts`; their states in [`state`].
//!
//! An operation is enqueued inside the consume transaction, so it exists exactly when its
//! event's claim does. Dispatchers lease due rows with `FOR UPDATE SKIP LOCKED`, each lease
//! stamping a fresh fencing token; a completion only changes a row whose token it presents, so a
//! worker whose lease expired and was taken over changes nothing.

#![warn(missing_docs)]

mod by_hand;
mod by_origin;
mod enqueue;
mod gauges;
pub mod state;
mod window;

pub use by_hand::*;
pub use by_origin::{
    backlog_by_origin, count_in_flight, due_origins, in_flight_by_origin, lease_due,
};
pub use enqueue::{enqueue, enqueue_all, Enqueued, Fulfilled};
pub use gauges::{gauges, Gauges};
pub use state::{AttemptKind, OutboxState, Outcome};
pub use window::{past_window_reason, IdempotencyWindow};

use crate::db::Db;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use std::time::Duration;

/// An operation to enqueue: one request, sent the same way on every attempt.
///
/// [`NewOperation::new`] makes a JSON POST; [`NewOperation::method`],
/// [`NewOperation::form`], [`NewOperation::bytes`], [`NewOperation::header`] and
/// [`NewOperation::credential`] describe any other request.
#[derive(Debug, Clone)]
pub struct NewOperation<'a> {
    /// The event that enqueued it, in the same transaction as its claim.
    pub event_key: &'a str,
    /// The route key of that event's claim ([`crate::envelope::Event::route_key`]): the
    /// operation is stored on its claim's shard.
    pub route_key: &'a str,
    /// The operation's name within its event, such as `deliver`; one event can drive several.
    pub operation: &'a str,
    /// Where it is sent.
    pub destination: &'a str,
    /// The HTTP method (`POST`, `PUT`, `PATCH`, `DELETE`, …).
    pub method: String,
    /// The body's `Content-Type`: `application/json`, `application/x-www-form-urlencoded`, or
    /// any other for raw bytes.
    pub content_type: String,
    /// The exact request body, sent byte for byte on every attempt.
    pub payload: Vec<u8>,
    /// Headers sent with it on every attempt. They are stored with the operation, so they must
    /// never carry a secret: name a [`NewOperation::credential`] instead.
    pub headers: Vec<(String, String)>,
    /// The name of a credential in the dispatcher's configuration
    /// (`[dispatch.credentials.NAME]`), whose headers are added when the request is sent.
    pub credential: Option<String>,
    /// A URL template (`{key}`) that tells whether the downstream already has the operation.
    pub reconcile_url: Option<String>,
    /// Attempts before the operation is `dead`.
    pub max_attempts: i32,
    /// The W3C `traceparent` of the event's trace, which the dispatcher's request continues.
    pub traceparent: Option<String>,
    /// The business obligation it fulfils, as `{source}:{obligation}`
    /// ([`NewOperation::obligation`]); None keys it by its event.
    pub obligation: Option<String>,
}

/// The `Content-Type` of a JSON body, the default.
pub const JSON: &str = "application/json";
/// The `Content-Type` of a form-encoded body (Stripe's API, OAuth token endpoints).
pub const FORM: &str = "application/x-www-form-urlencoded";
/// Headers that carry credentials: an operation names a credential instead of storing them.
pub const SECRET_HEADERS: &[&str] = &["authorization", "proxy-authorization", "cookie"];
/// Headers the dispatcher sets itself on every request: no configured or stored header may.
pub const RESERVED_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "host",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
];
/// Attempts before an operation is `dead`, unless it says otherwise.
pub const DEFAULT_MAX_ATTEMPTS: i32 = 10;

impl<'a> NewOperation<'a> {
    /// A JSON POST of `payload` to `destination`, made by `operation` of the event `event_key`,
    /// tried up to [`DEFAULT_MAX_ATTEMPTS`] times.
    pub fn new(
        event_key: &'a str,
        operation: &'a str,
        destination: &'a str,
        payload: Vec<u8>,
    ) -> Self {
        Self {
            event_key,
            route_key: event_key,
            operation,
            destination,
            method: "POST".into(),
            content_type: JSON.into(),
            payload,
            headers: Vec::new(),
            credential: None,
            reconcile_url: None,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            traceparent: None,
            obligation: None,
        }
    }

    /// An operation of `event`, in the event's trace: [`NewOperation::new`] with the event's
    /// key and traceparent.
    pub fn of_event(
        event: &'a crate::envelope::Event,
        operation: &'a str,
        destination: &'a str,
        payload: Vec<u8>,
    ) -> Self {
        Self {
            traceparent: event.traceparent.clone(),
            route_key: event.route_key(),
            ..Self::new(event.key.as_str(), operation, destination, payload)
        }
    }

    /// Sent with `method` instead of POST.
    pub fn method(mut self, method: &str) -> Self {
        self.method = method.to_ascii_uppercase();
        self
    }

    /// The body is `fields`, form-encoded (`a=1&b=x%20y`), as Stripe's API takes it.
    pub fn form<T: serde::Serialize + ?Sized>(mut self, fields: &T) -> anyhow::Result<Self> {
        self.payload = serde_urlencoded::to_string(fields)?.into_bytes();
        self.content_type = FORM.into();
        Ok(self)
    }

    /// The body is `payload` as is, sent with `content_type`.
    pub fn bytes(mut self, content_type: &str, payload: Vec<u8>) -> Self {
        self.payload = payload;
        self.content_type = content_type.into();
        self
    }

    /// One more header, sent on every attempt; stored with the operation, so never a secret.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The headers of `[dispatch.credentials.NAME]` are added when it is sent.
    pub fn credential(mut self, name: &str) -> Self {
        self.credential = Some(name.into());
        self
    }

    /// Asks `url` (with `{key}`) whether the downstream has the operation before resending one
    /// whose outcome is unknown.
    pub fn reconcile_url(mut self, url: &str) -> Self {
        self.reconcile_url = Some(url.into());
        self
    }

    /// Attempts before it is `dead`.
    pub fn max_attempts(mut self, attempts: i32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Keys the operation by the business obligation it fulfils, `obligation` of `source` (an
    /// order id, a subscription id), instead of by its event: its key is
    /// `{source}:{obligation}#{operation}`, claimed in the event's transaction. The first event
    /// naming the obligation enqueues it; a later one enqueues nothing and is recorded as
    /// fulfilled by the first ([`Enqueued::fulfilled`]). Operations of other names stay
    /// independent. With several databases, `source` must be routed by the same field
    /// (`route_from`), so that every event naming the obligation is claimed where it is held.
    pub fn obligation(mut self, source: &str, obligation: &str) -> Self {
        self.obligation = Some(format!("{source}:{obligation}"));
        self
    }

    /// Why this operation cannot be stored as a request, if it cannot: a method or header
    /// HTTP cannot carry, a header replayproof sets itself, or a secret in a stored header.
    /// The same operation is refused every time, so the effect fails rather than retries.
    pub fn refusal(&self) -> Option<String> {
        let key = self.operation_key();
        if reqwest::Method::from_bytes(self.method.as_bytes()).is_err() {
            return Some(format!("{key}: {:?} is not an HTTP method", self.method));
        }
        if reqwest::header::HeaderValue::from_str(&self.content_type).is_err() {
            return Some(format!("{key}: the content type is not a header value"));
        }
        self.headers.iter().find_map(|(name, value)| {
            let lower = name.to_ascii_lowercase();
            if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err()
                || reqwest::header::HeaderValue::from_str(value).is_err()
            {
                Some(format!(
                    "{key}: the header {name:?} cannot be carried by HTTP"
                ))
            } else if SECRET_HEADERS.contains(&lower.as_str()) {
                Some(format!(
                    "{key}: the {name} header would store a secret in the outbox; name a \
                     credential of [dispatch.credentials] instead"
                ))
            } else if RESERVED_HEADERS.contains(&lower.as_str()) {
                Some(format!("{key}: the {name} header is set by replayproof"))
            } else {
                None
            }
        })
    }

    /// The key sent downstream as the idempotency key on every attempt: the obligation's when
    /// it names one, else its event's.
    pub fn operation_key(&self) -> String {
        operation_key(
            self.obligation.as_deref().unwrap_or(self.event_key),
            self.operation,
        )
    }
}

/// The origin of a destination URL: scheme, host and port, the default port left out
/// (`https://api.stripe.com`). Limits and the circuit breaker count per origin. A destination
/// that is not a URL is its own origin: its operations fail as unsendable.
pub fn origin(destination: &str) -> String {
    match reqwest::Url::parse(destination).map(|url| url.origin()) {
        Ok(origin @ url::Origin::Tuple(..)) => origin.ascii_serialization(),
        _ => destination.to_owned(),
    }
}

/// The operation key of `operation` of the event `event_key` (or of the obligation
/// `{source}:{obligation}`): sent downstream as the idempotency key (and `webhook-id`) on every
/// attempt.
pub fn operation_key(event_key: &str, operation: &str) -> String {
    format!("{event_key}#{operation}")
}

/// A row leased to this worker.
#[derive(Debug, Clone)]
pub struct Leased {
    /// The row's id.
    pub id: i64,
    /// The route key of its event's claim; its attempts are stored with it.
    pub route_key: String,
    /// The idempotency key sent downstream.
    pub operation_key: String,
    /// Where it is sent.
    pub destination: String,
    /// The destination's origin, which its limits count by ([`origin`]).
    pub origin: String,
    /// The HTTP method.
    pub method: String,
    /// The body's `Content-Type`.
    pub content_type: String,
    /// The exact request body.
    pub payload: Vec<u8>,
    /// The operation's own headers, none of them secret.
    pub headers: sqlx::types::Json<Vec<(String, String)>>,
    /// The credential whose headers are added, by name.
    pub credential: Option<String>,
    /// The reconcile URL template, if any.
    pub reconcile_url: Option<String>,
    /// The W3C `traceparent` of the event's trace.
    pub traceparent: Option<String>,
    /// Attempts so far, this one included.
    pub attempts: i32,
    /// Attempts before the operation is `dead`.
    pub max_attempts: i32,
    /// The fencing token of this lease; a completion must present it.
    pub fencing_token: i64,
    /// `uncertain`, or `in_progress` for a lease taken over from a worker that vanished: the
    /// operation may already have been applied.
    pub previous_state: OutboxState,
    /// When its first attempt whose outcome is unknown started (a lease taken over counts from
    /// the lost lease's start): its idempotency window runs from then.
    pub maybe_applied_at: Option<DateTime<Utc>>,
}

impl Leased {
    /// `state`, or `dead` when this was the row's last attempt.
    pub fn unless_out_of_attempts(&self, state: OutboxState) -> OutboxState {
        if self.attempts >= self.max_attempts {
            OutboxState::Dead
        } else {
            state
        }
    }

    /// Whether an earlier attempt may already have reached the downstream: the row was
    /// `uncertain`, or its lease was taken over from a worker that vanished mid-request.
    pub fn may_have_been_applied(&self) -> bool {
        matches!(
            self.previous_state,
            OutboxState::Uncertain | OutboxState::InProgress
        ) || self.maybe_applied_at.is_some()
    }
}

/// Leases up to `limit` due rows of any destination, with no limit per destination: pending,
/// retryable or uncertain ones whose time has come, and in-progress ones whose lease expired.
/// Rows another worker is leasing are skipped, not waited for. Every lease counts as an
/// attempt, so a row whose worker dies or hangs on it each time goes `dead` once its attempts
/// are spent, instead of taking down worker after worker. The dispatcher leases per
/// destination instead ([`crate::destinations::lease_within_limits`]).
pub async fn lease(
    pool: &Db,
    worker: &str,
    limit: i64,
    lease: Duration,
) -> sqlx::Result<Vec<Leased>> {
    bury_expired_last_attempts(pool).await?;
    let mut tx = pool.begin().await?;
    let due = sqlx::query!(
        r#"SELECT id, state AS "state: OutboxState" FROM outbox
           WHERE ((state IN ('pending', 'retryable', 'uncertain') AND next_attempt_at <= now())
                  OR (state = 'in_progress' AND lease_expires_at <= now()))
             AND held_at IS NULL
           ORDER BY next_attempt_at
           LIMIT $1
           FOR UPDATE SKIP LOCKED"#,
        limit,
    )
    .fetch_all(&mut *tx)
    .await?;
    let due: Vec<(i64, OutboxState)> = due.into_iter().map(|r| (r.id, r.state)).collect();
    let leased = lease_rows(&mut tx, &due, worker, lease).await?;
    tx.commit().await?;
    Ok(leased)
}

/// Leases the rows `due` (locked by the caller's transaction, with the state each had): each
/// gets a fresh fencing token and one more attempt.
async fn lease_rows(
    conn: &mut PgConnection,
    due: &[(i64, OutboxState)],
    worker: &str,
    lease: Duration,
) -> sqlx::Result<Vec<Leased>> {
    let ids: Vec<i64> = due.iter().map(|(id, _)| *id).collect();
    let states: Vec<&str> = due.iter().map(|(_, s)| s.as_str()).collect();
    sqlx::query_as!(
        Leased,
        r#"WITH due AS (SELECT * FROM unnest($1::int8[], $2::text[]) AS u(id, previous_state))
           UPDATE outbox o
           SET state = 'in_progress', attempts = o.attempts + 1, leased_by = $3,
               lease_expires_at = now() + make_interval(secs => $4),
               fencing_token = nextval('outbox_fencing_token'), updated_at = now(),
               maybe_applied_at = CASE WHEN o.state = 'in_progress'
                                       THEN coalesce(o.maybe_applied_at, o.updated_at)
                                       ELSE o.maybe_applied_at END
           FROM due WHERE o.id = due.id
           RETURNING o.id, o.route_key, o.operation_key, o.destination,
                     coalesce(o.origin, o.destination) AS "origin!", o.method, o.content_type,
                     o.payload, o.headers AS "headers: sqlx::types::Json<Vec<(String, String)>>",
                     o.credential, o.reconcile_url, o.traceparent, o.attempts, o.max_attempts,
                     o.fencing_token AS "fencing_token!",
                     due.previous_state AS "previous_state!: OutboxState",
                     o.maybe_applied_at"#,
        &ids,
        &states as _,
        worker,
        lease.as_secs_f64(),
    )
    .fetch_all(conn)
    .await
}

/// Rows whose lease expired on their last attempt go `dead` instead of being leased again.
async fn bury_expired_last_attempts(pool: &Db) -> sqlx::Result<()> {
    let buried = sqlx::query!(
        "UPDATE outbox SET state = 'dead', lease_expires_at = NULL, updated_at = now(), \
         maybe_applied_at = coalesce(maybe_applied_at, updated_at), \
         last_error = format('the lease expired on attempt %s of %s: its worker died or hung', \
                             attempts, max_attempts) \
         WHERE state = 'in_progress' AND lease_expires_at <= now() AND attempts >= max_attempts",
    )
    .execute(pool)
    .await?
    .rows_affected();
    if buried > 0 {
        tracing::warn!(
            operations = buried,
            "Operations whose lease expired on their last attempt are now dead."
        );
    }
    Ok(())
}

/// Where an attempt leaves its row.
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    /// `done`, `retryable`, `uncertain`, `failed` or `dead`.
    pub state: OutboxState,
    /// When a `retryable` or `uncertain` row is due again.
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// The downstream's HTTP status, if it answered.
    pub status: Option<i32>,
    /// What went wrong, if anything.
    pub error: Option<String>,
    /// The start of the downstream's answer, for an operator.
    pub response: Option<String>,
    /// When this attempt, whose outcome is unknown, started: the request may have been
    /// applied. The row keeps the first such time.
    pub maybe_applied_since: Option<DateTime<Utc>>,
    /// Until when the downstream's idempotency key protects the operation, when its window is
    /// known ([`IdempotencyWindow::until`]).
    pub idempotent_until: Option<DateTime<Utc>>,
    /// Held for an operator: past the idempotency window, it is not sent again by itself.
    pub held: bool,
}

/// One attempt, as recorded whatever its lease became.
#[derive(Debug, Clone)]
pub struct Attempt<'a> {
    /// The worker that made the attempt.
    pub worker: &'a str,
    /// A delivery or a reconcile.
    pub kind: AttemptKind,
    /// When the attempt started.
    pub started_at: DateTime<Utc>,
    /// How long it took.
    pub duration: Duration,
    /// How it ended.
    pub outcome: Outcome,
}

/// The most characters of a downstream's answer kept with an operation.
pub const RESPONSE_EXCERPT_CHARS: usize = 2_000;
/// The most characters of an error kept with an operation or an attempt.
pub const ERROR_CHARS: usize = 4_000;

/// Text as PostgreSQL's `text` can hold it, at most `max_chars` long: a NUL (which `text`
/// refuses) becomes U+FFFD, so that a downstream's odd answer can never make its own record
/// fail.
pub fn storable_text(text: &str, max_chars: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max_chars)
        .map(|c| {
            if c == '\0' {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect();
    if text.chars().nth(max_chars).is_some() {
        out.push('…');
    }
    out
}

impl Settlement {
    /// The settlement with its texts made storable ([`storable_text`]).
    fn storable(&self) -> Self {
        Self {
            error: self.error.as_deref().map(|e| storable_text(e, ERROR_CHARS)),
            response: self
                .response
                .as_deref()
                .map(|r| storable_text(r, RESPONSE_EXCERPT_CHARS)),
            ..self.clone()
        }
    }
}

/// Records an attempt and, if the lease is still this worker's, settles the row. Returns false
/// when the lease had been taken over: the row is left as its new owner has it. The texts are
/// stored as [`storable_text`] makes them.
pub async fn complete(
    pool: &Db,
    leased: &Leased,
    settlement: &Settlement,
    attempt: &Attempt<'_>,
) -> sqlx::Result<bool> {
    let settlement = &settlement.storable();
    let mut tx = pool.begin().await?;
    crate::failpoint!("outbox::complete");
    let updated = settle_row(&mut tx, leased, settlement).await?;
    record_attempt(&mut tx, leased, settlement, attempt, updated).await?;
    tx.commit().await?;
    Ok(updated)
}

/// Settles the row without recording the attempt: the last resort of a worker whose attempt
/// record PostgreSQL refuses, so that an answered request is never sent again for want of its
/// record. The error says what was lost.
pub async fn complete_unrecorded(
    pool: &Db,
    leased: &Leased,
    settlement: &Settlement,
) -> sqlx::Result<bool> {
    let settlement = settlement.storable();
    let mut tx = pool.begin().await?;
    let updated = settle_row(&mut tx, leased, &settlement).await?;
    tx.commit().await?;
    Ok(updated)
}

async fn settle_row(
    conn: &mut PgConnection,
    leased: &Leased,
    settlement: &Settlement,
) -> sqlx::Result<bool> {
    let updated = sqlx::query!(
        "UPDATE outbox SET state = $3, next_attempt_at = coalesce($4, next_attempt_at), \
         last_status = $5, last_error = $6, last_response = $7, lease_expires_at = NULL, \
         updated_at = now(), completed_at = CASE WHEN $3 = 'done' THEN now() END, \
         maybe_applied_at = coalesce(maybe_applied_at, $8), idempotent_until = $9, \
         held_at = CASE WHEN $10 THEN now() END \
         WHERE id = $1 AND fencing_token = $2 AND state = 'in_progress'",
        leased.id,
        leased.fencing_token,
        settlement.state.as_str(),
        settlement.next_attempt_at,
        settlement.status,
        settlement.error.as_deref(),
        settlement.response.as_deref(),
        settlement.maybe_applied_since,
        settlement.idempotent_until,
        settlement.held,
    )
    .execute(conn)
    .await?
    .rows_affected();
    Ok(updated > 0)
}

async fn record_attempt(
    conn: &mut PgConnection,
    leased: &Leased,
    settlement: &Settlement,
    attempt: &Attempt<'_>,
    applied: bool,
) -> sqlx::Result<()> {
    let sha: [u8; 32] = <sha2::Sha256 as sha2::Digest>::digest(&leased.payload).into();
    sqlx::query!(
        "INSERT INTO outbox_attempts (outbox_id, fencing_token, worker, kind, idempotency_key, \
         payload_sha256, started_at, duration_ms, status_code, error, outcome, applied, \
         response_excerpt, route_key) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        leased.id,
        leased.fencing_token,
        attempt.worker,
        attempt.kind.as_str(),
        &leased.operation_key,
        &sha[..],
        attempt.started_at,
        attempt.duration.as_millis().min(i32::MAX as u128) as i32,
        settlement.status,
        settlement.error.as_deref(),
        attempt.outcome.as_str(),
        applied,
        settlement.response.as_deref(),
        &leased.route_key,
    )
    .execute(conn)
    .await?;
    Ok(())
}

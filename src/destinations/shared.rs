//! Limits per destination, held in PostgreSQL so that every dispatcher process keeps one set:
//! the `outbox_destinations` table, one row per origin, on the first database only
//! ([`LimitsHome`]), whatever the number of shards.
//!
//! A dispatcher leases an origin's due operations while it holds the origin's row lock: it
//! counts the origin's requests in flight (its unexpired leases, whichever process holds them,
//! on every database), and takes no more than the limits admit ([`admit`]): the concurrency
//! left, the rate's next start times, nothing while a 429 asked to wait, nothing while the
//! circuit breaker is open and one probe once it half-opens. Two dispatchers leasing for one
//! origin queue on that row lock, and the first commits its leases before it lets go, so the
//! second counts them. Every answer's verdict goes to the same row, so a breaker opens after
//! the configured failures in a row, counted once across every database.

pub use super::admission::*;
use super::{bury_expired_last_attempts, lease_rows, Leased, OutboxState};
use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use std::time::Duration;

/// Where destinations' limits live and what they count: the one row per origin on the first
/// database, and the requests in flight on every database.
#[derive(Debug, Clone)]
pub struct LimitsHome {
    /// The database holding `outbox_destinations` (the first shard).
    pub first: PgPool,
    /// Every database whose outbox sends to the destinations, the first included.
    pub every: Vec<PgPool>,
    /// The loop using it leases from the first database itself: its leases are taken in the
    /// transaction that holds the destination's row, on one connection.
    pub own_is_first: bool,
}

impl LimitsHome {
    /// One database: its limits and its operations in one place.
    pub fn single(pool: &PgPool) -> Self {
        Self {
            first: pool.clone(),
            every: vec![pool.clone()],
            own_is_first: true,
        }
    }

    /// Over `databases` in the order of the list, for the loop of the database `own`: the
    /// limits on the first.
    pub fn over(databases: &[PgPool], own: usize) -> Self {
        Self {
            first: databases[0].clone(),
            every: databases.to_vec(),
            own_is_first: own == 0,
        }
    }
}

/// An operation leased within its destination's limits, with when it may start.
#[derive(Debug, Clone)]
pub struct Admitted {
    /// The leased operation.
    pub row: Leased,
    /// How long to wait before sending it: the rate's schedule.
    pub wait: Duration,
    /// It is the half-open breaker's probe.
    pub probe: bool,
}

/// The origins with due operations, or with leases that expired: one index probe each.
pub async fn due_origins(pool: &PgPool) -> sqlx::Result<Vec<String>> {
    bury_expired_last_attempts(pool).await?;
    sqlx::query_scalar!(
        r#"WITH RECURSIVE origins AS (
               SELECT min(origin) AS origin FROM outbox
               WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL
               UNION ALL
               SELECT (SELECT min(origin) FROM outbox
                       WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL
                         AND origin > o.origin)
               FROM origins o WHERE o.origin IS NOT NULL)
           SELECT origin AS "origin!" FROM origins o
           WHERE origin IS NOT NULL
             AND EXISTS (SELECT 1 FROM outbox d WHERE d.origin = o.origin
                         AND d.state IN ('pending', 'retryable', 'uncertain')
                         AND d.next_attempt_at <= now() AND d.held_at IS NULL)
           UNION
           SELECT DISTINCT coalesce(origin, destination) FROM outbox
           WHERE state = 'in_progress' AND lease_expires_at <= now()"#
    )
    .fetch_all(pool)
    .await
}

/// Leases up to `room` of `origin`'s due operations in `pool`, as many as its `limits` admit
/// across every dispatcher and every database of `home` ([`admit`]), each with when it may
/// start.
pub async fn lease_within_limits(
    pool: &PgPool,
    home: &LimitsHome,
    origin: &str,
    limits: &Limits,
    worker: &str,
    room: usize,
    lease: Duration,
) -> sqlx::Result<Vec<Admitted>> {
    let mut held = home.first.begin().await?;
    let (state, now) = lock_destination(&mut held, origin).await?;
    let in_flight = in_flight(&mut held, home, origin).await?;
    let admission = admit(&state, limits, now, in_flight, room);
    if admission.count == 0 {
        held.commit().await?;
        return Ok(Vec::new());
    }
    let leased = if home.own_is_first {
        lease_due(&mut held, origin, admission.count, worker, lease).await?
    } else {
        // Committed before the row's lock is let go, so that the next holder counts them.
        let mut tx = pool.begin().await?;
        let leased = lease_due(&mut tx, origin, admission.count, worker, lease).await?;
        tx.commit().await?;
        leased
    };
    let probing = admission.probe && !leased.is_empty();
    let recorded = async {
        if limits.rate_per_sec.is_some() || probing {
            let next_start = admission.start(leased.len());
            let probe_until =
                probing.then(|| now + chrono::Duration::from_std(lease).unwrap_or_default());
            record_lease(&mut held, origin, next_start, probing, probe_until).await?;
        }
        held.commit().await
    };
    match (recorded.await, home.own_is_first) {
        (Ok(()), _) => {}
        (Err(e), true) => return Err(e),
        // The leases are committed on their own database: they are sent, not left to expire.
        (Err(e), false) => {
            tracing::warn!(destination = %origin, error = %e, "Leased, but the destination's schedule could not be recorded; sending anyway.");
        }
    }
    Ok(leased
        .into_iter()
        .enumerate()
        .map(|(i, row_leased)| Admitted {
            row: row_leased,
            wait: (admission.start(i) - now).to_std().unwrap_or_default(),
            probe: admission.probe,
        })
        .collect())
}

/// Locks `origin`'s row until `held` ends, making it first when there is none; its state and
/// the database's now.
async fn lock_destination(
    held: &mut PgConnection,
    origin: &str,
) -> sqlx::Result<(DestinationState, DateTime<Utc>)> {
    // The row may be gone between the two statements (`prune` drops an idle destination's row
    // when it saw nothing to send): made again, it is a closed destination with nothing due.
    loop {
        sqlx::query!(
            "INSERT INTO outbox_destinations (origin) VALUES ($1) ON CONFLICT (origin) DO NOTHING",
            origin
        )
        .execute(&mut *held)
        .await?;
        crate::stallpoint!("outbox::destination_before_lock");
        let row = sqlx::query!(
            r#"SELECT breaker AS "breaker: Breaker", open_until, probe_until, paused_until,
                      next_start_at, now() AS "now!"
               FROM outbox_destinations WHERE origin = $1 FOR UPDATE"#,
            origin
        )
        .fetch_optional(&mut *held)
        .await?;
        if let Some(row) = row {
            let state = DestinationState {
                breaker: row.breaker,
                open_until: row.open_until,
                probe_until: row.probe_until,
                paused_until: row.paused_until,
                next_start_at: row.next_start_at,
            };
            return Ok((state, row.now));
        }
    }
}

/// `origin`'s requests in flight on every database of `home`, counted while `held` holds its
/// row: each count a statement of its own, whose snapshot sees the leases a dispatcher
/// committed before it let go of the row.
async fn in_flight(held: &mut PgConnection, home: &LimitsHome, origin: &str) -> sqlx::Result<i64> {
    let mut n = count_in_flight(held, origin).await?;
    for other in home.every.iter().skip(1) {
        n += count_in_flight(&mut *other.acquire().await?, origin).await?;
    }
    Ok(n)
}

async fn count_in_flight(conn: &mut PgConnection, origin: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM outbox
           WHERE origin = $1 AND state = 'in_progress' AND lease_expires_at > now()"#,
        origin
    )
    .fetch_one(conn)
    .await
}

/// Leases up to `count` of `origin`'s due operations of this database.
async fn lease_due(
    conn: &mut PgConnection,
    origin: &str,
    count: usize,
    worker: &str,
    lease: Duration,
) -> sqlx::Result<Vec<Leased>> {
    let due = sqlx::query!(
        r#"SELECT id, state AS "state: OutboxState" FROM outbox
           WHERE origin = $1
             AND ((state IN ('pending', 'retryable', 'uncertain') AND next_attempt_at <= now())
                  OR (state = 'in_progress' AND lease_expires_at <= now()))
             AND held_at IS NULL
           ORDER BY next_attempt_at
           LIMIT $2
           FOR UPDATE SKIP LOCKED"#,
        origin,
        count as i64,
    )
    .fetch_all(&mut *conn)
    .await?;
    let due: Vec<(i64, OutboxState)> = due.into_iter().map(|r| (r.id, r.state)).collect();
    lease_rows(conn, &due, worker, lease).await
}

/// Moves the rate's schedule on past the starts just given, and half-opens the breaker when
/// one of them is its probe.
async fn record_lease(
    conn: &mut sqlx::PgConnection,
    origin: &str,
    next_start: DateTime<Utc>,
    probing: bool,
    probe_until: Option<DateTime<Utc>>,
) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE outbox_destinations SET next_start_at = $2, updated_at = now(), \
         breaker = CASE WHEN $3 THEN 'half_open' ELSE breaker END, \
         probe_until = CASE WHEN $3 THEN $4 ELSE probe_until END \
         WHERE origin = $1",
        origin,
        next_start,
        probing,
        probe_until,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// What an answer says of its destination's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// It answered (2xx, 4xx, a redirect): the breaker closes.
    Answering,
    /// A retryable failure: 5xx, a refused connection, no answer.
    Failing,
    /// A 429: nothing starts to it before this long has passed.
    SlowDown(Duration),
    /// Says nothing of the destination (the request could not be built).
    Unknown,
}

/// What happened to the breaker when an answer was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerChange {
    /// As it was.
    Unchanged,
    /// It opened: the destination gets nothing until its probe.
    Opened,
    /// It closed: the destination answers again.
    Closed,
}

/// Records what an answer says of `origin`'s health: its breaker and its pause.
pub async fn record_health(
    pool: &PgPool,
    origin: &str,
    limits: &Limits,
    verdict: Verdict,
) -> sqlx::Result<BreakerChange> {
    let before_after = match verdict {
        Verdict::Unknown => return Ok(BreakerChange::Unchanged),
        Verdict::Answering => sqlx::query!(
            r#"UPDATE outbox_destinations d
               SET breaker = 'closed', consecutive_failures = 0, open_until = NULL,
                   probe_until = NULL, updated_at = now()
               FROM (SELECT breaker FROM outbox_destinations WHERE origin = $1 FOR UPDATE) old
               WHERE d.origin = $1 AND (d.breaker <> 'closed' OR d.consecutive_failures <> 0)
               RETURNING old.breaker AS "before: Breaker", d.breaker AS "after: Breaker""#,
            origin
        )
        .fetch_optional(pool)
        .await?
        .map(|r| (r.before, r.after)),
        Verdict::Failing => {
            let threshold = limits.breaker_failures.map(|n| n as i32);
            sqlx::query!(
                r#"UPDATE outbox_destinations d
                   SET consecutive_failures = d.consecutive_failures + 1, updated_at = now(),
                       breaker = CASE WHEN d.breaker = 'open' THEN 'open'
                                      WHEN $2::int4 IS NOT NULL
                                           AND (d.breaker = 'half_open'
                                                OR d.consecutive_failures + 1 >= $2)
                                      THEN 'open' ELSE d.breaker END,
                       open_until = CASE WHEN d.breaker = 'open' THEN d.open_until
                                         WHEN $2::int4 IS NOT NULL
                                              AND (d.breaker = 'half_open'
                                                   OR d.consecutive_failures + 1 >= $2)
                                         THEN now() + make_interval(secs => $3)
                                         ELSE d.open_until END,
                       opened_at = CASE WHEN d.breaker <> 'open' AND $2::int4 IS NOT NULL
                                             AND (d.breaker = 'half_open'
                                                  OR d.consecutive_failures + 1 >= $2)
                                        THEN now() ELSE d.opened_at END,
                       probe_until = NULL
                   FROM (SELECT breaker FROM outbox_destinations WHERE origin = $1 FOR UPDATE) old
                   WHERE d.origin = $1
                   RETURNING old.breaker AS "before: Breaker", d.breaker AS "after: Breaker""#,
                origin,
                threshold,
                limits.breaker_open.as_secs_f64(),
            )
            .fetch_optional(pool)
            .await?
            .map(|r| (r.before, r.after))
        }
        Verdict::SlowDown(wait) => sqlx::query!(
            r#"UPDATE outbox_destinations d
               SET paused_until = greatest(d.paused_until, now() + make_interval(secs => $2)),
                   probe_until = NULL, updated_at = now()
               FROM (SELECT breaker FROM outbox_destinations WHERE origin = $1 FOR UPDATE) old
               WHERE d.origin = $1
               RETURNING old.breaker AS "before: Breaker", d.breaker AS "after: Breaker""#,
            origin,
            wait.as_secs_f64(),
        )
        .fetch_optional(pool)
        .await?
        .map(|r| (r.before, r.after)),
    };
    Ok(match before_after {
        Some((before, Breaker::Open)) if before != Breaker::Open => BreakerChange::Opened,
        Some((before, Breaker::Closed)) if before != Breaker::Closed => BreakerChange::Closed,
        _ => BreakerChange::Unchanged,
    })
}

/// One origin as the gauges show it.
#[derive(Debug, Clone)]
pub struct DestinationGauge {
    /// The destination's origin.
    pub origin: String,
    /// Its breaker's position.
    pub breaker: Breaker,
    /// Its requests in flight, from every dispatcher.
    pub in_flight: i64,
}

/// Every known origin's breaker, from the first database of `home`, and its requests in
/// flight on every database (an origin with no row on the first database is not shown).
pub async fn destination_gauges(home: &LimitsHome) -> sqlx::Result<Vec<DestinationGauge>> {
    let mut gauges = sqlx::query_as!(
        DestinationGauge,
        r#"SELECT d.origin, d.breaker AS "breaker: Breaker",
                  (SELECT count(*) FROM outbox o WHERE o.origin = d.origin
                   AND o.state = 'in_progress' AND o.lease_expires_at > now()) AS "in_flight!"
           FROM outbox_destinations d ORDER BY d.origin"#
    )
    .fetch_all(&home.first)
    .await?;
    for other in home.every.iter().skip(1) {
        let counts = sqlx::query!(
            r#"SELECT origin AS "origin!", count(*) AS "n!" FROM outbox
               WHERE state = 'in_progress' AND lease_expires_at > now() AND origin IS NOT NULL
               GROUP BY origin"#
        )
        .fetch_all(other)
        .await?;
        for c in counts {
            if let Some(g) = gauges.iter_mut().find(|g| g.origin == c.origin) {
                g.in_flight += c.n;
            }
        }
    }
    Ok(gauges)
}

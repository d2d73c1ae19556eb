//! All SQL for `outbox_destinations`: limits per destination, held in PostgreSQL so that every
//! dispatcher process keeps one set, one row per origin, on the first database only
//! ([`LimitsHome`]), whatever the number of shards. The operations themselves are the outbox's
//! ([`crate::outbox::lease_due`], [`crate::outbox::count_in_flight`]).
//!
//! A dispatcher leases an origin's due operations while it holds the origin's row lock: it
//! counts the origin's requests in flight (its unexpired leases, whichever process holds them,
//! on every database), and takes no more than the limits admit ([`admit`]): the concurrency
//! left, the rate's next start times, nothing while an operator paused it, nothing while a 429
//! asked to wait, nothing while the
//! circuit breaker is open and one probe once it half-opens. Two dispatchers leasing for one
//! origin queue on that row lock, and the first commits its leases before it lets go, so the
//! second counts them. Every answer's verdict goes to the same row, so a breaker opens after
//! the configured failures in a row, counted once across every database.

use super::admission::{
    admit, transition, Breaker, BreakerChange, DestinationState, Health, Pause,
};
use super::{Limits, Verdict};
use crate::db::Db;
use crate::outbox::{self, lease_due, Leased};
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use std::time::Duration;

/// Where destinations' limits live and what they count: the one row per origin on the first
/// database, and the requests in flight on every database.
#[derive(Debug, Clone)]
pub struct LimitsHome {
    /// The database holding `outbox_destinations` (the first shard).
    pub first: Db,
    /// Every database whose outbox sends to the destinations, the first included.
    pub every: Vec<Db>,
    /// The loop using it leases from the first database itself: its leases are taken in the
    /// transaction that holds the destination's row, on one connection.
    pub own_is_first: bool,
}

impl LimitsHome {
    /// One database: its limits and its operations in one place.
    pub fn single(pool: &Db) -> Self {
        Self {
            first: pool.clone(),
            every: vec![pool.clone()],
            own_is_first: true,
        }
    }

    /// Over `databases` in the order of the list, for the loop of the database `own`: the
    /// limits on the first.
    pub fn over(databases: &[Db], own: usize) -> Self {
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

/// Leases up to `room` of `origin`'s due operations in `pool`, as many as its `limits` admit
/// across every dispatcher and every database of `home` ([`admit`]), each with when it may
/// start.
pub async fn lease_within_limits(
    pool: &Db,
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
                      next_start_at, operator_paused_at, operator_paused_by,
                      operator_pause_reason, operator_pause_until, now() AS "now!"
               FROM outbox_destinations WHERE origin = $1 FOR UPDATE"#,
            origin
        )
        .fetch_optional(&mut *held)
        .await?;
        if let Some(row) = row {
            let state = DestinationState {
                pause: row.operator_paused_at.map(|at| Pause {
                    by: row.operator_paused_by.unwrap_or_default(),
                    reason: row.operator_pause_reason.unwrap_or_default(),
                    at,
                    until: row.operator_pause_until,
                }),
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
    let mut n = outbox::count_in_flight(held, origin).await?;
    for other in home.every.iter().skip(1) {
        let mut tx = other.begin().await?;
        n += outbox::count_in_flight(&mut tx, origin).await?;
        tx.commit().await?;
    }
    Ok(n)
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

/// Records what an answer says of `origin`'s health: its breaker and its pause, as
/// [`transition`] decides from the row.
///
/// Several dispatchers may record answers for one origin at once, and a dispatcher leasing for
/// it holds its row meanwhile ([`lease_within_limits`]). The row is read `FOR UPDATE` in the
/// transaction that writes it back, so each answer's read, transition and write are one step:
/// the next recorder waits for the lock and starts from what the first wrote, as it did when
/// the rule was one `UPDATE` computing each column from the old row. No failure is lost from the
/// count, and of concurrent failures that reach the threshold only one opens the breaker.
pub async fn record_health(
    pool: &Db,
    origin: &str,
    limits: &Limits,
    verdict: Verdict,
) -> sqlx::Result<BreakerChange> {
    if verdict == Verdict::Unknown {
        return Ok(BreakerChange::Unchanged);
    }
    let mut tx = pool.begin().await?;
    let Some((before, now)) = lock_health(&mut tx, origin).await? else {
        return Ok(BreakerChange::Unchanged);
    };
    let Some(after) = transition(&before, limits, verdict, now) else {
        tx.commit().await?;
        return Ok(BreakerChange::Unchanged);
    };
    write_health(&mut tx, origin, &after).await?;
    tx.commit().await?;
    Ok(BreakerChange::between(before.breaker, after.breaker))
}

/// `origin`'s health, locked until `tx` ends, and the database's now; None without a row.
async fn lock_health(
    tx: &mut PgConnection,
    origin: &str,
) -> sqlx::Result<Option<(Health, DateTime<Utc>)>> {
    let row = sqlx::query!(
        r#"SELECT breaker AS "breaker: Breaker", consecutive_failures, opened_at, open_until,
                  probe_until, paused_until, now() AS "now!"
           FROM outbox_destinations WHERE origin = $1 FOR UPDATE"#,
        origin
    )
    .fetch_optional(tx)
    .await?;
    Ok(row.map(|r| {
        let health = Health {
            breaker: r.breaker,
            consecutive_failures: r.consecutive_failures,
            opened_at: r.opened_at,
            open_until: r.open_until,
            probe_until: r.probe_until,
            paused_until: r.paused_until,
        };
        (health, r.now)
    }))
}

/// Writes `health` to `origin`'s row, locked by `tx`.
async fn write_health(tx: &mut PgConnection, origin: &str, health: &Health) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE outbox_destinations SET breaker = $2, consecutive_failures = $3, opened_at = $4, \
         open_until = $5, probe_until = $6, paused_until = $7, updated_at = now() \
         WHERE origin = $1",
        origin,
        health.breaker.as_str(),
        health.consecutive_failures,
        health.opened_at,
        health.open_until,
        health.probe_until,
        health.paused_until,
    )
    .execute(tx)
    .await?;
    Ok(())
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
        r#"SELECT origin, breaker AS "breaker: Breaker", 0::int8 AS "in_flight!"
           FROM outbox_destinations ORDER BY origin"#
    )
    .fetch_all(&home.first)
    .await?;
    for pool in &home.every {
        for (origin, n) in outbox::in_flight_by_origin(pool).await? {
            if let Some(g) = gauges.iter_mut().find(|g| g.origin == origin) {
                g.in_flight += n;
            }
        }
    }
    Ok(gauges)
}

//! Limits per destination, held in PostgreSQL so that every dispatcher process keeps one set:
//! the `outbox_destinations` table, one row per origin.
//!
//! A dispatcher leases an origin's due operations in one short transaction that locks the
//! origin's row, counts the origin's requests in flight (its unexpired leases, whichever
//! process holds them), and takes no more than the limits admit: the concurrency left, the
//! rate's next start times, nothing while a 429 asked to wait, nothing while the circuit
//! breaker is open and one probe once it half-opens. Two dispatchers leasing for one origin
//! queue on that row lock, so the second counts the first's leases.

use super::{bury_expired_last_attempts, lease_rows, Leased, OutboxState};
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use std::time::Duration;

/// The limits of one destination, as `[dispatch.destinations]` configures them.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Requests in flight to the origin at once, across every dispatcher; None for no limit.
    pub max_concurrency: Option<u32>,
    /// Requests started per second, across every dispatcher; None for no limit.
    pub rate_per_sec: Option<f64>,
    /// Retryable failures in a row that open the circuit breaker; None for no breaker.
    pub breaker_failures: Option<u32>,
    /// How long the breaker stays open before one probe request is let through.
    pub breaker_open: Duration,
}

/// How long an open breaker waits before its probe, unless configured.
pub const DEFAULT_BREAKER_OPEN: Duration = Duration::from_secs(30);

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_concurrency: None,
            rate_per_sec: None,
            breaker_failures: None,
            breaker_open: DEFAULT_BREAKER_OPEN,
        }
    }
}

/// A circuit breaker's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, sqlx::Type, serde::Serialize)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Breaker {
    /// Requests go out.
    Closed,
    /// None go out until it half-opens.
    Open,
    /// One probe is out; its answer closes or reopens the breaker.
    HalfOpen,
}

impl Breaker {
    /// Every position.
    pub const ALL: [Self; 3] = [Self::Closed, Self::Open, Self::HalfOpen];

    /// The position as stored and as the metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// An origin's shared state, as read under its row lock.
#[derive(Debug, Clone)]
pub struct DestinationState {
    /// The breaker's position.
    pub breaker: Breaker,
    /// When an open breaker lets its probe through.
    pub open_until: Option<DateTime<Utc>>,
    /// When a half-open breaker's probe is taken for lost, and another may go.
    pub probe_until: Option<DateTime<Utc>>,
    /// A 429's wait: nothing starts before then.
    pub paused_until: Option<DateTime<Utc>>,
    /// The rate's schedule: the earliest start of the next request.
    pub next_start_at: DateTime<Utc>,
}

/// The rate limit schedules starts at most this far ahead of now: a worker waits for its
/// start, and a worker that dies wastes no more than this much of the rate.
pub const RATE_HORIZON: Duration = Duration::from_secs(1);

/// What the limits admit now.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    /// How many operations may be leased.
    pub count: usize,
    /// When the first may start (the rate's schedule); each further one `spacing` later.
    pub first_start: DateTime<Utc>,
    /// The rate's spacing between starts; zero without a rate.
    pub spacing: chrono::Duration,
    /// The breaker half-opens: the one admitted operation is its probe.
    pub probe: bool,
}

impl Admission {
    fn none(now: DateTime<Utc>) -> Self {
        Self {
            count: 0,
            first_start: now,
            spacing: chrono::Duration::zero(),
            probe: false,
        }
    }

    /// When the `i`th admitted operation may start.
    pub fn start(&self, i: usize) -> DateTime<Utc> {
        self.first_start + self.spacing * i32::try_from(i).unwrap_or(i32::MAX)
    }
}

/// What `limits` admit for an origin in `state` at `now` with `in_flight` requests out, when
/// the worker has room for `room`: the one rule every dispatcher follows.
pub fn admit(
    state: &DestinationState,
    limits: &Limits,
    now: DateTime<Utc>,
    in_flight: i64,
    room: usize,
) -> Admission {
    if state.paused_until.is_some_and(|t| t > now) {
        return Admission::none(now);
    }
    let probe = match state.breaker {
        Breaker::Closed => false,
        Breaker::Open if state.open_until.is_some_and(|t| t > now) => return Admission::none(now),
        Breaker::HalfOpen if state.probe_until.is_some_and(|t| t > now) => {
            return Admission::none(now)
        }
        Breaker::Open | Breaker::HalfOpen => true,
    };
    let mut count = if probe { room.min(1) } else { room };
    if let Some(max) = limits.max_concurrency {
        let left = i64::from(max).saturating_sub(in_flight).max(0);
        count = count.min(usize::try_from(left).unwrap_or(0));
    }
    let mut admission = Admission {
        count,
        probe,
        ..Admission::none(now)
    };
    if let Some(rate) = limits.rate_per_sec.filter(|r| *r > 0.0) {
        let spacing = chrono::Duration::from_std(Duration::from_secs_f64(1.0 / rate))
            .unwrap_or(chrono::Duration::MAX);
        let first = state.next_start_at.max(now);
        let horizon = now + chrono::Duration::from_std(RATE_HORIZON).unwrap_or_default();
        let slots = if first > horizon {
            0
        } else {
            let ahead = (horizon - first).num_microseconds().unwrap_or(i64::MAX);
            let step = spacing.num_microseconds().unwrap_or(i64::MAX).max(1);
            usize::try_from(ahead / step + 1).unwrap_or(usize::MAX)
        };
        admission.count = admission.count.min(slots);
        admission.first_start = first;
        admission.spacing = spacing;
    }
    admission
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
               WHERE state IN ('pending', 'retryable', 'uncertain')
               UNION ALL
               SELECT (SELECT min(origin) FROM outbox
                       WHERE state IN ('pending', 'retryable', 'uncertain') AND origin > o.origin)
               FROM origins o WHERE o.origin IS NOT NULL)
           SELECT origin AS "origin!" FROM origins o
           WHERE origin IS NOT NULL
             AND EXISTS (SELECT 1 FROM outbox d WHERE d.origin = o.origin
                         AND d.state IN ('pending', 'retryable', 'uncertain')
                         AND d.next_attempt_at <= now())
           UNION
           SELECT DISTINCT coalesce(origin, destination) FROM outbox
           WHERE state = 'in_progress' AND lease_expires_at <= now()"#
    )
    .fetch_all(pool)
    .await
}

/// Leases up to `room` of `origin`'s due operations, as many as its `limits` admit across
/// every dispatcher ([`admit`]), each with when it may start.
pub async fn lease_within_limits(
    pool: &PgPool,
    origin: &str,
    limits: &Limits,
    worker: &str,
    room: usize,
    lease: Duration,
) -> sqlx::Result<Vec<Admitted>> {
    let mut tx = pool.begin().await?;
    // The row may be gone between the two statements (`prune` drops an idle destination's row
    // when it saw nothing to send): made again, it is a closed destination with nothing due.
    let row = loop {
        sqlx::query!(
            "INSERT INTO outbox_destinations (origin) VALUES ($1) ON CONFLICT (origin) DO NOTHING",
            origin
        )
        .execute(&mut *tx)
        .await?;
        crate::stallpoint!("outbox::destination_before_lock");
        let row = sqlx::query!(
            r#"SELECT breaker AS "breaker: Breaker", open_until, probe_until, paused_until,
                      next_start_at, now() AS "now!"
               FROM outbox_destinations WHERE origin = $1 FOR UPDATE"#,
            origin
        )
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            break row;
        }
    };
    let state = DestinationState {
        breaker: row.breaker,
        open_until: row.open_until,
        probe_until: row.probe_until,
        paused_until: row.paused_until,
        next_start_at: row.next_start_at,
    };
    // Counted after the lock, in a statement of its own: its snapshot then sees the leases of
    // a dispatcher that held the lock before.
    let in_flight = sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM outbox
           WHERE origin = $1 AND state = 'in_progress' AND lease_expires_at > now()"#,
        origin
    )
    .fetch_one(&mut *tx)
    .await?;
    let admission = admit(&state, limits, row.now, in_flight, room);
    if admission.count == 0 {
        tx.commit().await?;
        return Ok(Vec::new());
    }
    let due = sqlx::query!(
        r#"SELECT id, state AS "state: OutboxState" FROM outbox
           WHERE origin = $1
             AND ((state IN ('pending', 'retryable', 'uncertain') AND next_attempt_at <= now())
                  OR (state = 'in_progress' AND lease_expires_at <= now()))
           ORDER BY next_attempt_at
           LIMIT $2
           FOR UPDATE SKIP LOCKED"#,
        origin,
        admission.count as i64,
    )
    .fetch_all(&mut *tx)
    .await?;
    let due: Vec<(i64, OutboxState)> = due.into_iter().map(|r| (r.id, r.state)).collect();
    let leased = lease_rows(&mut tx, &due, worker, lease).await?;
    let probing = admission.probe && !leased.is_empty();
    if limits.rate_per_sec.is_some() || probing {
        let next_start = admission.start(leased.len());
        let probe_until =
            probing.then(|| row.now + chrono::Duration::from_std(lease).unwrap_or_default());
        record_lease(&mut tx, origin, next_start, probing, probe_until).await?;
    }
    tx.commit().await?;
    Ok(leased
        .into_iter()
        .enumerate()
        .map(|(i, row_leased)| Admitted {
            row: row_leased,
            wait: (admission.start(i) - row.now).to_std().unwrap_or_default(),
            probe: admission.probe,
        })
        .collect())
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

/// Every known origin's breaker and requests in flight.
pub async fn destination_gauges(pool: &PgPool) -> sqlx::Result<Vec<DestinationGauge>> {
    sqlx::query_as!(
        DestinationGauge,
        r#"SELECT d.origin, d.breaker AS "breaker: Breaker",
                  (SELECT count(*) FROM outbox o WHERE o.origin = d.origin
                   AND o.state = 'in_progress' AND o.lease_expires_at > now()) AS "in_flight!"
           FROM outbox_destinations d ORDER BY d.origin"#
    )
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap()
    }

    fn closed() -> DestinationState {
        DestinationState {
            breaker: Breaker::Closed,
            open_until: None,
            probe_until: None,
            paused_until: None,
            next_start_at: at(-1_000_000),
        }
    }

    #[test]
    fn concurrency_admits_only_what_is_left_across_every_dispatcher() {
        let limits = Limits {
            max_concurrency: Some(4),
            ..Limits::default()
        };
        assert_eq!(admit(&closed(), &limits, at(0), 0, 32).count, 4);
        assert_eq!(admit(&closed(), &limits, at(0), 3, 32).count, 1);
        assert_eq!(admit(&closed(), &limits, at(0), 4, 32).count, 0);
        assert_eq!(admit(&closed(), &limits, at(0), 9, 32).count, 0);
        assert_eq!(
            admit(&closed(), &Limits::default(), at(0), 99, 32).count,
            32
        );
    }

    #[test]
    fn the_rate_schedules_starts_evenly_and_never_more_than_a_second_ahead() {
        let limits = Limits {
            rate_per_sec: Some(10.0),
            ..Limits::default()
        };
        let a = admit(&closed(), &limits, at(0), 0, 100);
        assert_eq!(a.count, 11, "now, then every 100 ms up to a second ahead");
        assert_eq!(a.start(0), at(0));
        assert_eq!(a.start(10), at(1_000));
        // The next turn continues the schedule where the last ended.
        let later = DestinationState {
            next_start_at: a.start(11),
            ..closed()
        };
        let b = admit(&later, &limits, at(50), 0, 100);
        assert_eq!((b.count, b.start(0)), (0, at(1_100)));
        let b = admit(&later, &limits, at(100), 0, 100);
        assert_eq!((b.count, b.start(0)), (1, at(1_100)));
    }

    #[test]
    fn an_open_breaker_admits_nothing_then_one_probe_and_a_429_pauses() {
        let open = DestinationState {
            breaker: Breaker::Open,
            open_until: Some(at(30_000)),
            ..closed()
        };
        let limits = Limits::default();
        assert_eq!(admit(&open, &limits, at(29_999), 0, 32).count, 0);
        let probe = admit(&open, &limits, at(30_000), 0, 32);
        assert_eq!((probe.count, probe.probe), (1, true));
        let probing = DestinationState {
            breaker: Breaker::HalfOpen,
            probe_until: Some(at(60_000)),
            ..closed()
        };
        assert_eq!(admit(&probing, &limits, at(40_000), 0, 32).count, 0);
        assert_eq!(
            admit(&probing, &limits, at(60_000), 0, 32).count,
            1,
            "a lost probe"
        );
        let paused = DestinationState {
            paused_until: Some(at(5_000)),
            ..closed()
        };
        assert_eq!(admit(&paused, &limits, at(4_999), 0, 32).count, 0);
        assert_eq!(admit(&paused, &limits, at(5_000), 0, 32).count, 32);
    }
}

//! An operator's pause of a destination, in its `outbox_destinations` row on the first database
//! ([`super::LimitsHome`]): `destinations pause`, `destinations resume`, and the list an
//! operator reads them in. A pause and a resume are each one transaction with their audit row,
//! taking the origin's row lock, so a dispatcher leasing for it finishes first and the next one
//! reads the pause ([`super::admit`] admits nothing while it holds).

use super::admission::{Breaker, Pause};
use super::LimitsHome;
use crate::audit::{self, Act, Change};
use crate::db::Db;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use std::collections::BTreeMap;
use std::time::Duration;

/// One destination as an operator lists it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DestinationRow {
    /// Its origin, credentials redacted.
    pub origin: String,
    /// The operator's pause, while it holds.
    pub pause: Option<Pause>,
    /// Its breaker's position.
    pub breaker: Breaker,
    /// Requests in flight to it, from every dispatcher and database.
    pub in_flight: i64,
    /// Operations waiting to be sent to it on every database (pending, retryable, uncertain).
    pub backlog: i64,
}

/// The audit row's target for `origin`.
fn target(origin: &str) -> String {
    format!("destination:{origin}")
}

/// How a pause reads in an audit row.
fn described(pause: Option<&Pause>, now: DateTime<Utc>) -> String {
    match pause {
        Some(p) if p.holds(now) => match p.until {
            Some(until) => format!("paused until {}", until.to_rfc3339()),
            None => "paused".into(),
        },
        _ => "running".into(),
    }
}

/// Pauses `origin` (made known if it was not) until it is resumed, or for `until`: one
/// transaction with its audit row. Pausing a paused destination replaces its pause.
pub async fn pause(
    first: &Db,
    origin: &str,
    until: Option<Duration>,
    act: &Act,
) -> sqlx::Result<Change> {
    let mut tx = first.begin().await?;
    let (before, now) = lock_pause(&mut tx, origin).await?;
    let until = until.map(|d| now + chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX));
    sqlx::query!(
        "UPDATE outbox_destinations SET operator_paused_at = $2, operator_paused_by = $3, \
         operator_pause_reason = $4, operator_pause_until = $5, updated_at = now() \
         WHERE origin = $1",
        origin,
        now,
        act.actor,
        act.reason,
        until,
    )
    .execute(&mut *tx)
    .await?;
    let after = Pause {
        by: act.actor.clone(),
        reason: act.reason.clone(),
        at: now,
        until,
    };
    let change = Change::new(
        &target(origin),
        described(before.as_ref(), now),
        described(Some(&after), now),
    );
    audit::record(&mut tx, act.audit("pause", &change)).await?;
    tx.commit().await?;
    Ok(change)
}

/// Resumes `origin`: one transaction with its audit row. None when it is not paused (or its
/// pause already ended by itself), and then nothing is written.
pub async fn resume(first: &Db, origin: &str, act: &Act) -> sqlx::Result<Option<Change>> {
    let mut tx = first.begin().await?;
    let (before, now) = lock_pause(&mut tx, origin).await?;
    if !before.as_ref().is_some_and(|p| p.holds(now)) {
        return Ok(None);
    }
    sqlx::query!(
        "UPDATE outbox_destinations SET operator_paused_at = NULL, operator_paused_by = NULL, \
         operator_pause_reason = NULL, operator_pause_until = NULL, updated_at = now() \
         WHERE origin = $1",
        origin,
    )
    .execute(&mut *tx)
    .await?;
    let change = Change::new(&target(origin), described(before.as_ref(), now), "running");
    audit::record(&mut tx, act.audit("resume", &change)).await?;
    tx.commit().await?;
    Ok(Some(change))
}

/// Locks `origin`'s row until `tx` ends, making it when there is none; its pause and the
/// database's now.
async fn lock_pause(
    tx: &mut PgConnection,
    origin: &str,
) -> sqlx::Result<(Option<Pause>, DateTime<Utc>)> {
    // As the dispatcher's lock does: prune may drop an idle row between the two statements.
    loop {
        sqlx::query!(
            "INSERT INTO outbox_destinations (origin) VALUES ($1) ON CONFLICT (origin) DO NOTHING",
            origin
        )
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query!(
            r#"SELECT operator_paused_at, operator_paused_by, operator_pause_reason,
                      operator_pause_until, now() AS "now!"
               FROM outbox_destinations WHERE origin = $1 FOR UPDATE"#,
            origin
        )
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            let pause = row.operator_paused_at.map(|at| Pause {
                by: row.operator_paused_by.unwrap_or_default(),
                reason: row.operator_pause_reason.unwrap_or_default(),
                at,
                until: row.operator_pause_until,
            });
            return Ok((pause, row.now));
        }
    }
}

/// Every known destination (a row on the first database, or operations waiting on any), with
/// its pause while it holds, breaker, requests in flight and backlog.
pub async fn list(home: &LimitsHome) -> sqlx::Result<Vec<DestinationRow>> {
    let mut rows: BTreeMap<String, DestinationRow> = BTreeMap::new();
    let known = sqlx::query!(
        r#"SELECT origin, breaker AS "breaker: Breaker", operator_paused_at, operator_paused_by,
                  operator_pause_reason, operator_pause_until, now() AS "now!"
           FROM outbox_destinations"#
    )
    .fetch_all(&home.first)
    .await?;
    for r in known {
        let pause = r.operator_paused_at.map(|at| Pause {
            by: r.operator_paused_by.unwrap_or_default(),
            reason: r.operator_pause_reason.unwrap_or_default(),
            at,
            until: r.operator_pause_until,
        });
        let row = unknown_row(&r.origin);
        rows.insert(
            r.origin,
            DestinationRow {
                pause: pause.filter(|p| p.holds(r.now)),
                breaker: r.breaker,
                ..row
            },
        );
    }
    for pool in &home.every {
        for (origin, n) in crate::outbox::in_flight_by_origin(pool).await? {
            let row = rows.entry(origin).or_insert_with_key(|o| unknown_row(o));
            row.in_flight += n;
        }
        for (origin, n) in crate::outbox::backlog_by_origin(pool).await? {
            let row = rows.entry(origin).or_insert_with_key(|o| unknown_row(o));
            row.backlog += n;
        }
    }
    Ok(rows.into_values().collect())
}

/// A destination with no row yet: running, its breaker closed.
fn unknown_row(origin: &str) -> DestinationRow {
    // An origin has no path: the URL's own `/` is not shown.
    let shown = crate::secrets::redact_url(origin);
    DestinationRow {
        origin: shown.strip_suffix('/').unwrap_or(&shown).to_owned(),
        pause: None,
        breaker: Breaker::Closed,
        in_flight: 0,
        backlog: 0,
    }
}

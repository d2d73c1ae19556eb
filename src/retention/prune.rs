//! All SQL of pruning: each source's horizon in `prune_horizons`, and the deletes, in small
//! batches, of what is past its lifetime in every table.
//!
//! A source is pruned in two steps. First its horizon moves forward (never back) to now minus
//! its retention, in a transaction of its own that takes the source's prune lock exclusively:
//! it waits for the batches that read the old horizon ([`super::expired`]) and commits before
//! anything is deleted. Then its settled claims claimed before that horizon are deleted, a batch
//! at a time (`FOR UPDATE SKIP LOCKED`: a claim another transaction holds is left for the next
//! round), each with its ledger rows, its operations and their attempts. Never deleted: a claim
//! that is failed or deferred, or one with an operation that is not done or dead.

use super::{Decided, Lifetimes};
use crate::db::Db;
use serde::Serialize;
use std::time::Duration;

/// Rows one statement deletes at most: each batch holds its locks for milliseconds.
pub const DEFAULT_BATCH: i64 = 1000;

/// What one round pruned (or, for a dry run, would prune), by source and table.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Pruned {
    /// `(source, table, rows)`, the claims' tables by source; the others under source `*`.
    pub rows: Vec<(String, &'static str, i64)>,
}

impl Pruned {
    fn add(&mut self, source: &str, table: &'static str, rows: i64) {
        if rows == 0 {
            return;
        }
        match self
            .rows
            .iter_mut()
            .find(|(s, t, _)| s == source && *t == table)
        {
            Some((_, _, n)) => *n += rows,
            None => self.rows.push((source.into(), table, rows)),
        }
    }

    /// Rows of `table`, over every source.
    pub fn of(&self, table: &str) -> i64 {
        self.rows
            .iter()
            .filter(|(_, t, _)| *t == table)
            .map(|(_, _, n)| n)
            .sum()
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The clock margin an expired replay is judged with: five minutes, or a quarter of a shorter
/// retention.
fn clock_margin(retention: Duration) -> Duration {
    (retention / 4).min(Duration::from_secs(300))
}

/// Every source that has claims, by a skip scan of the claims' age index.
pub async fn sources(pool: &Db) -> sqlx::Result<Vec<String>> {
    let rows = sqlx::query_scalar!(
        r#"WITH RECURSIVE s(source) AS (
               (SELECT source FROM processed_events ORDER BY source LIMIT 1)
               UNION ALL
               SELECT (SELECT p.source FROM processed_events p WHERE p.source > s.source
                       ORDER BY p.source LIMIT 1)
               FROM s WHERE s.source IS NOT NULL)
           SELECT source AS "source!" FROM s WHERE source IS NOT NULL"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Moves the horizon of `source` to now minus `retention` (never back) once the batches that
/// read the old one have ended, and returns it.
pub async fn advance_horizon(
    pool: &Db,
    source: &str,
    retention: Duration,
) -> sqlx::Result<chrono::DateTime<chrono::Utc>> {
    let mut tx = pool.begin().await?;
    sqlx::query!(
        "SELECT pg_advisory_xact_lock(hashtext('replayproof.prune'), hashtext($1))",
        source
    )
    .fetch_one(&mut *tx)
    .await?;
    let horizon = sqlx::query_scalar!(
        r#"INSERT INTO prune_horizons AS h (source, pruned_before, clock_margin)
           VALUES ($1, now() - make_interval(secs => $2), make_interval(secs => $3))
           ON CONFLICT (source) DO UPDATE
           SET pruned_before = greatest(h.pruned_before, EXCLUDED.pruned_before),
               clock_margin = EXCLUDED.clock_margin, updated_at = now()
           RETURNING pruned_before"#,
        source,
        secs(retention),
        secs(clock_margin(retention)),
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(horizon)
}

/// What one delete statement removed, and the newest claim time it reached.
struct Deleted {
    claims: i64,
    ledger: i64,
    ops: i64,
    attempts: i64,
    /// Where the next statement starts: the claims before it are gone or kept on purpose, and
    /// their dead index entries are not read again.
    reached: Option<chrono::DateTime<chrono::Utc>>,
}

/// Deletes up to `batch` settled claims of `source` claimed in `[from, horizon)`, oldest first,
/// with their ledger rows, operations and attempts.
async fn delete_claims(
    pool: &Db,
    source: &str,
    from: Option<chrono::DateTime<chrono::Utc>>,
    horizon: chrono::DateTime<chrono::Utc>,
    batch: i64,
) -> sqlx::Result<Deleted> {
    let row = sqlx::query!(
        r#"WITH doomed AS (
               SELECT p.event_key, p.claimed_at FROM processed_events p
               WHERE p.source = $1 AND p.claimed_at < $2 AND p.status IN ('done', 'dead')
                 AND p.claimed_at >= coalesce($4::timestamptz, '-infinity')
                 AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key
                                 AND o.state NOT IN ('done', 'dead'))
               ORDER BY p.claimed_at LIMIT $3
               FOR UPDATE OF p SKIP LOCKED),
           ops AS (DELETE FROM outbox o USING doomed d WHERE o.event_key = d.event_key
                   RETURNING o.id),
           attempts AS (DELETE FROM outbox_attempts a USING ops WHERE a.outbox_id = ops.id
                        RETURNING 1),
           ledger AS (DELETE FROM ledger l USING doomed d WHERE l.event_key = d.event_key
                      RETURNING 1),
           obligations AS (DELETE FROM operation_obligations ob USING doomed d
                           WHERE ob.event_key = d.event_key RETURNING 1),
           claims AS (DELETE FROM processed_events p USING doomed d
                      WHERE p.event_key = d.event_key RETURNING 1)
           SELECT (SELECT count(*) FROM claims) AS "claims!",
                  (SELECT count(*) FROM ledger) AS "ledger!",
                  (SELECT count(*) FROM ops) AS "ops!",
                  (SELECT count(*) FROM attempts) AS "attempts!",
                  (SELECT max(claimed_at) FROM doomed) AS reached"#,
        source,
        horizon,
        batch,
        from,
    )
    .fetch_one(pool)
    .await?;
    Ok(Deleted {
        claims: row.claims,
        ledger: row.ledger,
        ops: row.ops,
        attempts: row.attempts,
        reached: row.reached,
    })
}

/// Prunes the claims of one source past its retention, batch after batch.
pub async fn prune_source(
    pool: &Db,
    decided: &Decided,
    batch: i64,
    pruned: &mut Pruned,
) -> sqlx::Result<()> {
    let horizon = advance_horizon(pool, &decided.source, decided.retention).await?;
    let mut from = None;
    loop {
        let deleted = delete_claims(pool, &decided.source, from, horizon, batch).await?;
        pruned.add(&decided.source, "processed_events", deleted.claims);
        pruned.add(&decided.source, "ledger", deleted.ledger);
        pruned.add(&decided.source, "outbox", deleted.ops);
        pruned.add(&decided.source, "outbox_attempts", deleted.attempts);
        if deleted.claims < batch {
            return Ok(());
        }
        from = deleted.reached;
    }
}

/// Rows kept by age: what happens to them (`change`), and the query that selects them by `key`,
/// `$1` being their lifetime in seconds. A round changes them `$2` at a time
/// ([`Rule::change_sql`]); a dry run counts them ([`Rule::count_sql`]).
struct Rule {
    /// The table, or `table.payload` for an erasure.
    name: &'static str,
    change: &'static str,
    key: &'static str,
    select: &'static str,
    /// `FOR UPDATE OF …` when the selection joins another table.
    lock_of: &'static str,
}

impl Rule {
    fn change_sql(&self) -> String {
        format!(
            "{} WHERE {} = ANY(ARRAY({} LIMIT $2 FOR UPDATE{} SKIP LOCKED))",
            self.change, self.key, self.select, self.lock_of
        )
    }

    fn count_sql(&self) -> String {
        format!("SELECT count(*) FROM ({}) AS rows", self.select)
    }
}

/// Every rule: the tables pruned by age alone, then the settled payloads erased past the
/// payload retention (the rows, keys and hashes stay).
const RULES: &[Rule] = &[
    Rule {
        name: "key_conflicts",
        change: "DELETE FROM key_conflicts",
        key: "ctid",
        select: "SELECT ctid FROM key_conflicts \
                 WHERE last_seen_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    // Redeliveries recorded by batch, once no claim they count on can still be kept for its
    // age: each is younger than its claim, so it outlives every settled claim it counts on.
    Rule {
        name: "redeliveries",
        change: "DELETE FROM redeliveries",
        key: "id",
        select: "SELECT id FROM redeliveries \
                 WHERE seen_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "delivery_fingerprints",
        change: "DELETE FROM delivery_fingerprints",
        key: "ctid",
        select: "SELECT ctid FROM delivery_fingerprints \
                 WHERE first_seen_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "dead_letters",
        change: "DELETE FROM dead_letters",
        key: "ctid",
        select: "SELECT ctid FROM dead_letters WHERE replayed_at IS NOT NULL \
                 AND created_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "operator_actions",
        change: "DELETE FROM operator_actions",
        key: "ctid",
        select: "SELECT ctid FROM operator_actions \
                 WHERE at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "outbox_attempts",
        change: "DELETE FROM outbox_attempts",
        key: "ctid",
        select: "SELECT a.ctid FROM outbox_attempts a JOIN outbox o ON o.id = a.outbox_id \
                 WHERE o.state IN ('done', 'dead') \
                 AND a.started_at < now() - make_interval(secs => $1)",
        lock_of: " OF a",
    },
    // Kafka output records known to be in their topic; a pending one is never pruned.
    Rule {
        name: "output_records",
        change: "DELETE FROM output_records",
        key: "id",
        select: "SELECT id FROM output_records WHERE state = 'sent' \
                 AND sent_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    // A destination's shared limits (one row per origin ever called): dropped once it is closed,
    // unpaused (by a 429 or by an operator), has nothing left to send and has not been leased for as long as attempts are
    // kept. A later operation for the origin starts a fresh row.
    Rule {
        name: "outbox_destinations",
        change: "DELETE FROM outbox_destinations",
        key: "origin",
        select: "SELECT origin FROM outbox_destinations d \
                 WHERE d.breaker = 'closed' AND d.consecutive_failures = 0 \
                 AND (d.paused_until IS NULL OR d.paused_until < now()) \
                 AND (d.operator_paused_at IS NULL OR d.operator_pause_until < now()) \
                 AND d.updated_at < now() - make_interval(secs => $1) \
                 AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.origin = d.origin \
                     AND o.state IN ('pending', 'retryable', 'uncertain', 'in_progress'))",
        lock_of: "",
    },
    Rule {
        name: "expired_replays",
        change: "DELETE FROM expired_replays",
        key: "ctid",
        select: "SELECT ctid FROM expired_replays WHERE resolution IS NOT NULL \
                 AND resolved_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "ledger.payload",
        change: "UPDATE ledger SET payload = 'null'::jsonb, payload_erased_at = now()",
        key: "ctid",
        select: "SELECT ctid FROM ledger WHERE payload_erased_at IS NULL \
                 AND applied_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "outbox.payload",
        change: "UPDATE outbox SET payload = ''::bytea, last_response = NULL, \
                 payload_erased_at = now()",
        key: "id",
        select: "SELECT id FROM outbox WHERE state IN ('done', 'dead') \
                 AND payload_erased_at IS NULL \
                 AND coalesce(completed_at, updated_at) < now() - make_interval(secs => $1)",
        lock_of: "",
    },
    Rule {
        name: "expired_replays.payload",
        change: "UPDATE expired_replays SET payload = NULL, attributes = NULL",
        key: "id",
        select: "SELECT id FROM expired_replays WHERE resolution IS NOT NULL \
                 AND payload IS NOT NULL AND resolved_at < now() - make_interval(secs => $1)",
        lock_of: "",
    },
];

impl Lifetimes {
    /// The longest any settled claim is kept: the default retention, or the retention decided
    /// for a source (its own, or its kind's floor when that is longer than the default).
    fn longest_claim(&self, decided: &[Decided]) -> Duration {
        let each = decided.iter().map(|d| d.retention);
        each.fold(self.default, Duration::max)
    }

    fn lifetime_of(&self, rule: &str, decided: &[Decided]) -> Duration {
        match rule {
            "key_conflicts" => self.conflict,
            "delivery_fingerprints" => self.fingerprint,
            "dead_letters" => self.dead_letter,
            "operator_actions" => self.audit,
            "outbox_attempts" | "outbox_destinations" | "output_records" => self.attempt,
            "expired_replays" => self.expired_replay,
            "redeliveries" => self.longest_claim(decided),
            _ => self.payload,
        }
    }
}

/// Prunes the tables kept by age, and erases settled payloads past the payload retention.
pub async fn prune_by_age(
    pool: &Db,
    decided: &[Decided],
    lifetimes: &Lifetimes,
    batch: i64,
    pruned: &mut Pruned,
) -> sqlx::Result<()> {
    for rule in RULES {
        let (sql, age) = (
            rule.change_sql(),
            secs(lifetimes.lifetime_of(rule.name, decided)),
        );
        loop {
            let done = sqlx::query(&sql)
                .bind(age)
                .bind(batch)
                .execute(pool)
                .await?
                .rows_affected() as i64;
            pruned.add("*", rule.name, done);
            if done < batch {
                break;
            }
        }
    }
    Ok(())
}

/// What a round would prune, counted and changed nothing: claims by source (under the horizon
/// the round would set), the other tables by age.
pub async fn dry_run(
    pool: &Db,
    decided: &[Decided],
    lifetimes: &Lifetimes,
) -> sqlx::Result<Pruned> {
    let mut pruned = Pruned::default();
    for d in decided {
        let n = sqlx::query_scalar!(
            r#"SELECT count(*) AS "n!" FROM processed_events p
               WHERE p.source = $1 AND p.claimed_at < now() - make_interval(secs => $2)
                 AND p.status IN ('done', 'dead')
                 AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key
                                 AND o.state NOT IN ('done', 'dead'))"#,
            d.source,
            secs(d.retention),
        )
        .fetch_one(pool)
        .await?;
        pruned.add(&d.source, "processed_events", n);
    }
    for rule in RULES {
        let n: i64 = sqlx::query_scalar(&rule.count_sql())
            .bind(secs(lifetimes.lifetime_of(rule.name, decided)))
            .fetch_one(pool)
            .await?;
        pruned.add("*", rule.name, n);
    }
    Ok(pruned)
}

/// The age in seconds of each source's oldest claim.
pub async fn oldest_claims(pool: &Db) -> sqlx::Result<Vec<(String, f64)>> {
    let mut ages = Vec::new();
    for source in sources(pool).await? {
        let age = sqlx::query_scalar!(
            r#"SELECT extract(epoch FROM now() - min(claimed_at))::float8 AS "age!"
               FROM processed_events WHERE source = $1"#,
            source
        )
        .fetch_one(pool)
        .await?;
        ages.push((source, age));
    }
    Ok(ages)
}

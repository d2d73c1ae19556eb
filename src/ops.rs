//! The operator path: inspect events, operations and dead letters, and move them between the
//! states that allow it. Every change is one transaction with its audit row in
//! `operator_actions` (actor, action, reason, state before and after).

use crate::effect::Effect;
use crate::envelope::{Event, EventKey};
use anyhow::{bail, Context as _};
use sqlx::postgres::PgArguments;
use sqlx::{Column, PgConnection, PgPool, Row};

/// Rows as text, for a table on a terminal or JSON for machines.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    pub columns: Vec<String>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl Table {
    async fn fetch(
        pool: &PgPool,
        query: sqlx::query::Query<'_, sqlx::Postgres, PgArguments>,
    ) -> sqlx::Result<Self> {
        let rows = query.fetch_all(pool).await?;
        let columns = rows
            .first()
            .map(|r| r.columns().iter().map(|c| c.name().to_owned()).collect())
            .unwrap_or_default();
        let rows = rows
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| r.try_get::<Option<String>, _>(i))
                    .collect()
            })
            .collect::<sqlx::Result<_>>()?;
        Ok(Self { columns, rows })
    }

    /// The rows as JSON objects.
    pub fn to_json(&self) -> serde_json::Value {
        let rows = self.rows.iter().map(|row| {
            let fields = self
                .columns
                .iter()
                .cloned()
                .zip(row.iter().map(|v| json_of(v.as_deref())));
            serde_json::Value::Object(fields.collect())
        });
        serde_json::Value::Array(rows.collect())
    }

    /// A plain-text table, long cells cut.
    pub fn render(&self) -> String {
        if self.rows.is_empty() {
            return "(none)\n".into();
        }
        let cell = |v: &Option<String>| {
            let s = v.as_deref().unwrap_or("-").replace('\n', " ");
            if s.chars().count() > 60 {
                format!("{}…", s.chars().take(59).collect::<String>())
            } else {
                s
            }
        };
        let cells: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| r.iter().map(cell).collect())
            .collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.columns[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |values: Vec<&str>| {
            let padded: Vec<String> = values
                .iter()
                .zip(&widths)
                .map(|(v, w)| format!("{v:<w$}"))
                .collect();
            padded.join("  ").trim_end().to_owned() + "\n"
        };
        let mut out = line(self.columns.iter().map(String::as_str).collect());
        for row in &cells {
            out += &line(row.iter().map(String::as_str).collect());
        }
        out
    }
}

/// Text that holds JSON (payloads) stays JSON; everything else is a string.
fn json_of(v: Option<&str>) -> serde_json::Value {
    match v {
        None => serde_json::Value::Null,
        Some(s) if s.starts_with('{') || s.starts_with('[') => {
            serde_json::from_str(s).unwrap_or_else(|_| serde_json::Value::String(s.into()))
        }
        Some(s) => serde_json::Value::String(s.into()),
    }
}

/// Filters for `events list`.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    /// A claim status or an operation state.
    pub state: Option<String>,
    pub source: Option<String>,
    /// Only events claimed at least this long ago.
    pub older_than: Option<std::time::Duration>,
    pub limit: i64,
}

pub async fn list_events(pool: &PgPool, f: &EventFilter) -> sqlx::Result<Table> {
    let query = sqlx::query(
        r#"SELECT p.event_key, p.source, p.event_type AS type, p.status AS claim,
                  (SELECT string_agg(o.operation || '=' || o.state, ', ' ORDER BY o.operation)
                     FROM outbox o WHERE o.event_key = p.event_key) AS operations,
                  p.attempts::text, p.claimed_at::text
           FROM processed_events p
           WHERE ($1::text IS NULL OR p.status = $1
                  OR EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key AND o.state = $1))
             AND ($2::text IS NULL OR p.source = $2)
             AND ($3::float8 IS NULL OR p.claimed_at <= now() - make_interval(secs => $3))
           ORDER BY p.claimed_at DESC, p.event_key
           LIMIT $4"#,
    )
    .bind(&f.state)
    .bind(&f.source)
    .bind(f.older_than.map(|d| d.as_secs_f64()))
    .bind(f.limit);
    Table::fetch(pool, query).await
}

/// Everything known about one event, section by section.
pub async fn show_event(pool: &PgPool, key: &str) -> anyhow::Result<Vec<(&'static str, Table)>> {
    let claim = Table::fetch(pool, sqlx::query(
        "SELECT event_key, source, event_type AS type, status, attempts::text, last_error, \
         encode(payload_sha256, 'hex') AS payload_sha256, kafka_topic || '/' || kafka_partition || '@' || kafka_offset AS first_seen_at, \
         claimed_at::text, completed_at::text, payload::text FROM processed_events WHERE event_key = $1",
    ).bind(key)).await?;
    if claim.rows.is_empty() {
        bail!("no event has the key {key:?}");
    }
    let ledger = Table::fetch(pool, sqlx::query(
        "SELECT id::text, event_type AS type, applied_at::text, payload::text FROM ledger WHERE event_key = $1 ORDER BY id",
    ).bind(key)).await?;
    let operations = Table::fetch(pool, sqlx::query(
        "SELECT operation_key, state, attempts::text || '/' || max_attempts AS attempts, destination, \
         next_attempt_at::text, lease_expires_at::text, last_status::text, last_error, completed_at::text \
         FROM outbox WHERE event_key = $1 ORDER BY operation",
    ).bind(key)).await?;
    let attempts = Table::fetch(pool, sqlx::query(
        "SELECT o.operation, a.kind, a.started_at::text, a.duration_ms::text, a.status_code::text, a.outcome, \
         a.applied::text, a.worker, a.error FROM outbox_attempts a JOIN outbox o ON o.id = a.outbox_id \
         WHERE o.event_key = $1 ORDER BY a.id",
    ).bind(key)).await?;
    let dead = Table::fetch(pool, sqlx::query(
        "SELECT id::text, kafka_topic || '/' || kafka_partition || '@' || kafka_offset AS at, reason, created_at::text \
         FROM dead_letters WHERE raw_key = convert_to($1, 'UTF8') ORDER BY id",
    ).bind(key)).await?;
    let conflicts = Table::fetch(pool, sqlx::query(
        "SELECT encode(payload_sha256, 'hex') AS payload_sha256, times_seen::text, first_seen_at::text, \
         last_seen_at::text, payload::text FROM key_conflicts WHERE event_key = $1 ORDER BY first_seen_at",
    ).bind(key)).await?;
    Ok(vec![
        ("claim", claim),
        ("effect rows (ledger)", ledger),
        ("outbox operations", operations),
        ("attempts", attempts),
        ("dead letters", dead),
        ("key conflicts", conflicts),
    ])
}

async fn audit(
    conn: &mut PgConnection,
    actor: &str,
    action: &str,
    target: &str,
    reason: &str,
    before: &str,
    after: &str,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO operator_actions (actor, action, target, reason, state_before, state_after) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(actor)
    .bind(action)
    .bind(target)
    .bind(reason)
    .bind(before)
    .bind(after)
    .execute(conn)
    .await?;
    Ok(())
}

/// Which events a bulk retry takes.
#[derive(Debug, Clone)]
pub struct RetryFilter {
    /// `failed`, `uncertain` or `dead`: of the claim or of one of its operations.
    pub state: String,
    pub source: Option<String>,
    /// Only events claimed at or after this time.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    pub limit: i64,
}

/// The events a bulk retry takes, oldest claim first.
pub async fn events_to_retry(pool: &PgPool, f: &RetryFilter) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        r#"SELECT p.event_key FROM processed_events p
           WHERE (p.status = $1
                  OR EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key AND o.state = $1))
             AND ($2::text IS NULL OR p.source = $2)
             AND ($3::timestamptz IS NULL OR p.claimed_at >= $3)
           ORDER BY p.claimed_at, p.event_key
           LIMIT $4"#,
    )
    .bind(&f.state)
    .bind(&f.source)
    .bind(f.since)
    .bind(f.limit)
    .fetch_all(pool)
    .await
}

/// What an operator change did: (target, state before, state after) for each row it moved.
pub type Changes = Vec<(String, String, String)>;

/// Sends an event's `failed`, `uncertain` or `dead` operations again, with the same idempotency
/// key and payload; an event without operations whose local effect failed has the effect run
/// again, from its stored payload, with `effect`. `done` is refused, and so is an operation
/// already on its way.
pub async fn retry(
    pool: &PgPool,
    effect: Option<&dyn Effect>,
    key: &str,
    operation: Option<&str>,
    actor: &str,
    reason: &str,
) -> anyhow::Result<Changes> {
    let mut tx = pool.begin().await?;
    let ops: Vec<(i64, String, String)> = sqlx::query_as(
        "SELECT id, operation_key, state FROM outbox WHERE event_key = $1 AND ($2::text IS NULL OR operation = $2) \
         ORDER BY operation FOR UPDATE",
    )
    .bind(key)
    .bind(operation)
    .fetch_all(&mut *tx)
    .await?;
    if ops.is_empty() {
        drop(tx);
        return retry_local(pool, effect, key, actor, reason).await;
    }
    let mut changes = Changes::new();
    for (id, op_key, state) in ops {
        match state.as_str() {
            "failed" | "uncertain" | "dead" => {
                sqlx::query("UPDATE outbox SET state = 'pending', attempts = 0, next_attempt_at = now(), updated_at = now() WHERE id = $1")
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                audit(&mut tx, actor, "retry", &op_key, reason, &state, "pending").await?;
                changes.push((op_key, state, "pending".into()));
            }
            "done" => bail!("{op_key} is done; a done operation is not sent again"),
            other => bail!("{op_key} is {other}: it is already on its way"),
        }
    }
    tx.commit().await?;
    Ok(changes)
}

/// A claim as stored, for running its effect again.
#[derive(sqlx::FromRow)]
struct StoredClaim {
    source: String,
    event_type: Option<String>,
    received_at: Option<chrono::DateTime<chrono::Utc>>,
    payload: serde_json::Value,
    payload_sha256: Vec<u8>,
    status: String,
    effect_spec: Option<serde_json::Value>,
}

/// Runs a failed local effect again in one transaction with its claim's change and audit row.
async fn retry_local(
    pool: &PgPool,
    effect: Option<&dyn Effect>,
    key: &str,
    actor: &str,
    reason: &str,
) -> anyhow::Result<Changes> {
    let mut tx = pool.begin().await?;
    let claim: Option<StoredClaim> = sqlx::query_as(
        "SELECT source, event_type, received_at, payload, payload_sha256, status, effect_spec FROM processed_events WHERE event_key = $1 FOR UPDATE",
    )
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(claim) = claim else {
        bail!("no event has the key {key:?}");
    };
    if claim.status != "failed" {
        bail!(
            "{key} is {}: only a failed effect or a failed, uncertain or dead operation is retried",
            claim.status
        );
    }
    if let (Some(given), Some(spec)) = (effect.and_then(|e| e.spec()), &claim.effect_spec) {
        if &given != spec {
            bail!(
                "{key} failed with the effects {spec}; --effect would run {given} instead and \
                 skip some: retry without --effect"
            );
        }
    }
    let recorded = match (&effect, &claim.effect_spec) {
        (None, Some(spec)) => Some(
            crate::effect::from_spec(spec)
                .with_context(|| format!("rebuilding the effects recorded on {key}"))?,
        ),
        _ => None,
    };
    let effect = effect.or(recorded.as_deref()).with_context(|| {
        format!("the effects {key} failed with are not recorded (a library effect): pass --effect")
    })?;
    let event = Event {
        key: EventKey::try_from(key.to_owned())?,
        source: claim.source,
        event_type: claim.event_type,
        received_at: claim.received_at,
        payload: claim.payload,
        payload_sha256: claim
            .payload_sha256
            .try_into()
            .map_err(|_| anyhow::anyhow!("a stored payload hash is not 32 bytes"))?,
        replay_window_secs: None,
    };
    let mut savepoint = sqlx::Acquire::begin(&mut *tx).await?;
    if let Err(e) = effect.apply(&mut savepoint, &event).await {
        savepoint.rollback().await?;
        sqlx::query("UPDATE processed_events SET attempts = attempts + 1, last_error = $2 WHERE event_key = $1")
            .bind(key)
            .bind(format!("{e:#}"))
            .execute(&mut *tx)
            .await?;
        audit(&mut tx, actor, "retry", key, reason, "failed", "failed").await?;
        tx.commit().await?;
        return Err(e.context(format!("the effect failed again for {key}")));
    }
    savepoint.commit().await?;
    sqlx::query("UPDATE processed_events SET status = 'done', attempts = attempts + 1, last_error = NULL, completed_at = now() WHERE event_key = $1")
        .bind(key)
        .execute(&mut *tx)
        .await?;
    audit(&mut tx, actor, "retry", key, reason, "failed", "done").await?;
    tx.commit().await?;
    Ok(vec![(key.to_owned(), "failed".into(), "done".into())])
}

/// Settles an event by hand as `done` (the outcome was confirmed elsewhere) or `dead` (it will
/// not happen): its operations that are not done and not under a live lease, or its failed
/// claim.
pub async fn resolve(
    pool: &PgPool,
    key: &str,
    operation: Option<&str>,
    to: &str,
    actor: &str,
    reason: &str,
) -> anyhow::Result<Changes> {
    anyhow::ensure!(
        to == "done" || to == "dead",
        "an event is resolved as done or dead"
    );
    let mut tx = pool.begin().await?;
    let ops: Vec<(i64, String, String, bool)> = sqlx::query_as(
        "SELECT id, operation_key, state, coalesce(lease_expires_at > now(), false) FROM outbox \
         WHERE event_key = $1 AND ($2::text IS NULL OR operation = $2) ORDER BY operation FOR UPDATE",
    )
    .bind(key)
    .bind(operation)
    .fetch_all(&mut *tx)
    .await?;
    let mut changes = Changes::new();
    for (id, op_key, state, leased) in ops {
        if state == "done" {
            continue;
        }
        if state == "in_progress" && leased {
            bail!("{op_key} is being sent right now; resolve it when its lease has ended");
        }
        sqlx::query(
            "UPDATE outbox SET state = $2, lease_expires_at = NULL, updated_at = now(), \
                     completed_at = CASE WHEN $2 = 'done' THEN now() END WHERE id = $1",
        )
        .bind(id)
        .bind(to)
        .execute(&mut *tx)
        .await?;
        audit(&mut tx, actor, "resolve", &op_key, reason, &state, to).await?;
        changes.push((op_key, state, to.into()));
    }
    let claim: Option<String> =
        sqlx::query_scalar("SELECT status FROM processed_events WHERE event_key = $1 FOR UPDATE")
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
    match claim.as_deref() {
        None => bail!("no event has the key {key:?}"),
        Some("failed") => {
            sqlx::query("UPDATE processed_events SET status = $2, completed_at = CASE WHEN $2 = 'done' THEN now() END WHERE event_key = $1")
                .bind(key)
                .bind(to)
                .execute(&mut *tx)
                .await?;
            audit(&mut tx, actor, "resolve", key, reason, "failed", to).await?;
            changes.push((key.to_owned(), "failed".into(), to.into()));
        }
        Some(_) => {}
    }
    if changes.is_empty() {
        bail!("{key} has nothing to resolve: its claim and operations are settled");
    }
    tx.commit().await?;
    Ok(changes)
}

pub async fn list_dead_letters(pool: &PgPool, limit: i64) -> sqlx::Result<Table> {
    Table::fetch(pool, sqlx::query(
        "SELECT id::text, kafka_topic AS topic, kafka_partition::text AS partition, kafka_offset::text AS offset, \
         reason, created_at::text, replayed_at::text, encode(raw_key, 'escape') AS key \
         FROM dead_letters ORDER BY id DESC LIMIT $1",
    ).bind(limit)).await
}

pub async fn show_dead_letter(pool: &PgPool, id: i64) -> anyhow::Result<Table> {
    let t = Table::fetch(pool, sqlx::query(
        "SELECT id::text, kafka_topic AS topic, kafka_partition::text AS partition, kafka_offset::text AS offset, \
         reason, created_at::text, replayed_at::text, encode(raw_key, 'escape') AS key, encode(raw_value, 'escape') AS value \
         FROM dead_letters WHERE id = $1",
    ).bind(id)).await?;
    anyhow::ensure!(!t.rows.is_empty(), "no dead letter has the id {id}");
    Ok(t)
}

/// A dead letter's raw bytes and origin, for replaying it.
pub struct DeadLetter {
    pub topic: String,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
}

#[derive(sqlx::FromRow)]
struct StoredDeadLetter {
    topic: String,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    replayed: bool,
}

/// Marks a dead letter replayed, with its audit row, once `produce` has put it back on a
/// topic. If producing fails, nothing is marked.
pub async fn replay_dead_letter<F, Fut>(
    pool: &PgPool,
    id: i64,
    actor: &str,
    reason: &str,
    produce: F,
) -> anyhow::Result<Changes>
where
    F: FnOnce(DeadLetter) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    let mut tx = pool.begin().await?;
    let row: Option<StoredDeadLetter> = sqlx::query_as(
        "SELECT kafka_topic AS topic, raw_key AS key, raw_value AS value, replayed_at IS NOT NULL AS replayed \
         FROM dead_letters WHERE id = $1 FOR UPDATE",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(StoredDeadLetter {
        topic,
        key,
        value,
        replayed,
    }) = row
    else {
        bail!("no dead letter has the id {id}");
    };
    let before = if replayed { "replayed" } else { "dead" };
    let to = produce(DeadLetter { topic, key, value }).await?;
    sqlx::query("UPDATE dead_letters SET replayed_at = now() WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    audit(
        &mut tx,
        actor,
        "replay",
        &format!("dead_letter:{id}"),
        reason,
        before,
        &format!("replayed to {to}"),
    )
    .await?;
    tx.commit().await?;
    Ok(vec![(
        format!("dead_letter:{id}"),
        before.into(),
        "replayed".into(),
    )])
}

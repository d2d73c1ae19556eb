//! `shards move`: a range of buckets moved from one database to another, with the consumers and
//! dispatchers of both stopped. Four steps, each safe to run again:
//!
//! 1. **Fence**: the move refuses to start while any other replayproof session is connected to
//!    either database, and locks the source's tables against writes (`EXCLUSIVE`) for its
//!    duration, so a process started by mistake waits instead of writing to the range.
//! 2. **Copy**: every row of the range, of every table distributed by `route_key` (and of the
//!    application's effect tables named with `--table`), in one transaction on the target.
//!    Tables whose ids are looked up alone (the outbox, its attempts, the ledger, expired
//!    replays) get fresh ids there, and the attempts follow their operation's new id.
//! 3. **Verify**: each table holds as many rows of the range on the target as on the source,
//!    or nothing commits.
//! 4. **Switch**: the target commits, then the range is deleted from the source. A move cut
//!    off between the two finds its rows on the target when run again, verifies them and
//!    finishes the delete.
//!
//! The consumers then start with the new list of databases, in which the target holds the
//! range ([`super::Layout`]): splitting every shard in two, the new database goes right after
//! the one whose upper half it took.

use anyhow::{bail, ensure, Context as _};
use sqlx::{Connection as _, PgConnection};
use std::ops::RangeInclusive;

/// The tables that move with their route keys, parents before children; dead letters (no
/// route key) stay where they are.
const MOVED: &[&str] = &[
    "processed_events",
    "key_conflicts",
    "delivery_fingerprints",
    "expired_replays",
    "object_versions",
    "ledger",
    "outbox",
    "outbox_attempts",
];

/// Tables given fresh ids on the target: their ids are unique per database and looked up alone.
const RENUMBERED: &[&str] = &["expired_replays", "ledger", "outbox", "outbox_attempts"];

/// What a move did, table by table.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Moved {
    /// Rows of the range per table, as verified on both sides.
    pub rows: Vec<(String, i64)>,
    /// Whether the rows were found copied already (a move cut off after its copy).
    pub resumed: bool,
}

/// A move's parameters.
#[derive(Debug, Clone)]
pub struct Move<'a> {
    /// The number of buckets route keys hash into.
    pub buckets: u32,
    /// The buckets moved.
    pub range: RangeInclusive<u32>,
    /// The application's effect tables (`schema.table`), distributed by `route_key` too.
    pub extra: &'a [String],
    /// Count and verify only.
    pub dry_run: bool,
}

impl Move<'_> {
    /// The predicate of a row in the range, as PostgreSQL computes the bucket.
    /// Rows routed '' (dead letters, and the replay guard's and newest-wins' state of events
    /// routed by their own key) belong to their database, not to a bucket: they stay.
    fn in_range(&self) -> String {
        format!(
            "(route_key <> '' AND \
             (((hashtext(route_key)::int8 + 2147483648) * {}) >> 32) BETWEEN {} AND {})",
            self.buckets,
            self.range.start(),
            self.range.end()
        )
    }

    fn tables(&self) -> Vec<String> {
        MOVED
            .iter()
            .map(|t| t.to_string())
            .chain(self.extra.iter().cloned())
            .collect()
    }
}

/// Moves the range from `from` to `to` (connections of their own, in replayproof's schema).
pub async fn run(
    from: &mut PgConnection,
    to: &mut PgConnection,
    m: &Move<'_>,
) -> anyhow::Result<Moved> {
    ensure!(
        m.range.start() <= m.range.end() && *m.range.end() < m.buckets,
        "the buckets {}-{} are not within 0-{}",
        m.range.start(),
        m.range.end(),
        m.buckets - 1
    );
    for (side, conn) in [("source", &mut *from), ("target", &mut *to)] {
        fence_check(conn)
            .await
            .with_context(|| format!("the {side} database"))?;
    }
    let mut source = from.begin().await?;
    let tables = m.tables();
    for table in &tables {
        sqlx::query(&format!("LOCK TABLE {table} IN EXCLUSIVE MODE"))
            .execute(&mut *source)
            .await
            .with_context(|| format!("fencing {table}"))?;
    }
    let mut target = to.begin().await?;
    let resumed = count(&mut target, "processed_events", m).await? > 0;
    if !resumed && !m.dry_run {
        copy(&mut source, &mut target, m).await?;
    }
    let mut moved = Moved {
        resumed,
        ..Moved::default()
    };
    for table in &tables {
        let (here, there) = (
            count(&mut source, table, m).await?,
            count(&mut target, table, m).await?,
        );
        if !m.dry_run && here != there {
            bail!("{table}: {here} rows of the range on the source, {there} on the target; nothing was switched");
        }
        moved.rows.push((table.clone(), here));
    }
    if m.dry_run {
        return Ok(moved);
    }
    target.commit().await.context("committing the copy")?;
    crate::failpoint!("shards::move_after_copy");
    for table in tables.iter().rev() {
        sqlx::query(&format!("DELETE FROM {table} WHERE {}", m.in_range()))
            .execute(&mut *source)
            .await
            .with_context(|| format!("deleting the range from the source's {table}"))?;
    }
    source.commit().await.context("committing the delete")?;
    Ok(moved)
}

/// Refuses when another replayproof process is connected: its consumers and dispatchers must be
/// stopped for the move.
async fn fence_check(conn: &mut PgConnection) -> anyhow::Result<()> {
    let others: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'replayproof' AND pid <> pg_backend_pid()",
    )
    .fetch_one(&mut *conn)
    .await?;
    ensure!(
        others == 0,
        "{others} replayproof session(s) are connected: stop the consumers and dispatchers of \
         both databases before moving buckets"
    );
    Ok(())
}

async fn count(conn: &mut PgConnection, table: &str, m: &Move<'_>) -> anyhow::Result<i64> {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE {}",
        m.in_range()
    ))
    .fetch_one(conn)
    .await
    .with_context(|| format!("counting the range in {table}"))
}

/// The columns a copy writes: all but generated ones, and but `id` where ids are renewed.
async fn columns(conn: &mut PgConnection, table: &str, renumbered: bool) -> anyhow::Result<String> {
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT quote_ident(attname) FROM pg_attribute WHERE attrelid = to_regclass($1) \
         AND attnum > 0 AND NOT attisdropped AND attgenerated = '' \
         AND NOT ($2 AND attname = 'id') ORDER BY attnum",
    )
    .bind(table)
    .bind(renumbered)
    .fetch_all(conn)
    .await?;
    ensure!(!columns.is_empty(), "{table}: no such table");
    Ok(columns.join(", "))
}

/// Copies every table's rows of the range, as JSON read from the source and written by
/// PostgreSQL's own record input on the target. The outbox's attempts point at their
/// operation's new id.
async fn copy(
    source: &mut PgConnection,
    target: &mut PgConnection,
    m: &Move<'_>,
) -> anyhow::Result<()> {
    let mut outbox_ids: Vec<(i64, i64)> = Vec::new();
    for table in m.tables() {
        let renumbered = RENUMBERED.contains(&table.as_str());
        let mut rows: Vec<serde_json::Value> = sqlx::query_scalar(&format!(
            "SELECT to_jsonb(t) FROM {table} t WHERE {} ORDER BY route_key",
            m.in_range()
        ))
        .fetch_all(&mut *source)
        .await
        .with_context(|| format!("reading the range from {table}"))?;
        if rows.is_empty() {
            continue;
        }
        if table == "outbox_attempts" {
            for row in &mut rows {
                let old = row["outbox_id"]
                    .as_i64()
                    .context("an attempt without its operation")?;
                let new = outbox_ids
                    .iter()
                    .find(|(o, _)| *o == old)
                    .map(|(_, n)| *n)
                    .context("an attempt whose operation was not copied")?;
                row["outbox_id"] = new.into();
            }
        }
        let cols = columns(&mut *target, &table, renumbered).await?;
        let insert = format!(
            "INSERT INTO {table} ({cols}) SELECT {cols} \
             FROM jsonb_populate_recordset(NULL::{table}, $1)"
        );
        if table != "outbox" {
            sqlx::query(&insert)
                .bind(serde_json::Value::Array(rows))
                .execute(&mut *target)
                .await
                .with_context(|| format!("writing the range to {table}"))?;
            continue;
        }
        // An operation is known on both sides by its key and route: its old id maps to the new.
        let identity =
            |v: &serde_json::Value| (v["operation_key"].to_string(), v["route_key"].to_string());
        let old: std::collections::HashMap<(String, String), i64> = rows
            .iter()
            .filter_map(|r| Some((identity(r), r["id"].as_i64()?)))
            .collect();
        let new: Vec<(i64, serde_json::Value)> = sqlx::query_as(&format!(
            "{insert} RETURNING id, jsonb_build_object('operation_key', operation_key, \
             'route_key', route_key)"
        ))
        .bind(serde_json::Value::Array(rows))
        .fetch_all(&mut *target)
        .await
        .with_context(|| format!("writing the range to {table}"))?;
        for (id, written) in &new {
            let was = old
                .get(&identity(written))
                .context("an operation changed on the way")?;
            outbox_ids.push((*was, *id));
        }
    }
    Ok(())
}

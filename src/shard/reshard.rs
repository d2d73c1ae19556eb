//! `shards move`: a range of buckets moved from one database to another, with the consumers and
//! dispatchers of both stopped. Each step is its own commit, recorded in both databases'
//! layouts ([`super::holdings`]), so a move cut off anywhere is finished by running it again,
//! and no process can use either database meanwhile:
//!
//! 1. **Fence**: refused while any other replayproof session is connected to either database.
//! 2. **Mark**: the range is `leaving` on the source (its tables locked against writes while the
//!    mark commits). From here on every process refuses the source. The fence is checked again.
//! 3. **Copy**: every row of the range, of every table distributed by `route_key` (and of the
//!    application's effect tables named with `--table`), streamed with `COPY` so every value
//!    arrives as it was (a JSON `null` stays JSON `null`), with the prune horizons (the later
//!    one kept), in one transaction on the target that also marks the range `arriving`. Tables
//!    whose ids are looked up alone (the outbox, its attempts, the ledger, expired replays) get
//!    fresh ids there, and the attempts follow their operation's new id. Each table must hold
//!    as many rows of the range on both sides, or nothing commits.
//! 4. **Delete**: the range's rows go from the source, with its mark.
//! 5. **Activate**: the range is `held` on the target.
//!
//! The consumers then start with the new list of databases, in which the target holds the
//! range ([`super::Layout`]): splitting every shard in two, the new database goes right after
//! the one whose upper half it took.

use super::holdings::{self, Holdings, RangeState, Span};
use anyhow::{bail, ensure, Context as _};
use futures_util::TryStreamExt as _;
use sqlx::{Connection as _, PgConnection, Postgres, Transaction};
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
    "operation_obligations",
    "fulfilled_operations",
];

/// Tables given fresh ids on the target: their ids are unique per database and looked up alone.
const RENUMBERED: &[&str] = &["expired_replays", "ledger", "outbox", "outbox_attempts"];

/// How far a move had come, as both databases record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The source holds the range; nothing was done.
    Start,
    /// Cut off after the mark: the range is leaving the source, nothing is on the target.
    Marked,
    /// Cut off after the copy: leaving the source, arriving on the target.
    Copied,
    /// Cut off after the source's delete: only arriving on the target.
    Deleted,
    /// The target holds the range.
    Done,
}

/// What a move did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Counted only.
    DryRun,
    /// Moved from the start.
    Moved,
    /// An earlier run had been cut off; this one finished it.
    Finished,
    /// The target held the range already.
    AlreadyMoved,
}

impl Outcome {
    /// How the command says it.
    pub fn said(self) -> &'static str {
        match self {
            Self::DryRun => "would move (dry run: nothing changed)",
            Self::Moved => "moved and verified",
            Self::Finished => {
                "were part-moved by an earlier run that was cut off; verified and finished"
            }
            Self::AlreadyMoved => "are held by the target already: nothing to do",
        }
    }
}

/// What a move did, table by table.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Moved {
    /// Rows of the range per table, as verified on both sides (before the delete).
    pub rows: Vec<(String, i64)>,
    pub outcome: Outcome,
}

/// A move's parameters.
#[derive(Debug, Clone)]
pub struct Move<'a> {
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
    fn in_range(&self, buckets: u32) -> String {
        format!(
            "(route_key <> '' AND \
             (((hashtext(route_key)::int8 + 2147483648) * {buckets}) >> 32) BETWEEN {} AND {})",
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

/// Moves the range from `from` to `to` (connections of their own, in replayproof's schema),
/// from wherever an earlier run was cut off.
pub async fn run(
    from: &mut PgConnection,
    to: &mut PgConnection,
    m: &Move<'_>,
) -> anyhow::Result<Moved> {
    fence(from, to).await?;
    let (buckets, mut stage) = stage(from, to, m).await?;
    let start = stage;
    if m.dry_run || stage == Stage::Done {
        let outcome = match stage {
            Stage::Done => Outcome::AlreadyMoved,
            _ => Outcome::DryRun,
        };
        let rows = counts(from, m, buckets).await?;
        return Ok(Moved { rows, outcome });
    }
    if stage == Stage::Start {
        mark_leaving(from, m, buckets).await?;
        crate::failpoint!("shards::move_after_mark");
        fence(from, to)
            .await
            .context("a session connected while the range was being marked; the move stopped")?;
        stage = Stage::Marked;
    }
    let mut rows = Vec::new();
    if stage != Stage::Deleted {
        rows = copy_and_delete(from, to, m, buckets, stage).await?;
    }
    let mut to_tx = to.begin().await?;
    holdings::set_span(
        &mut to_tx,
        *m.range.start(),
        *m.range.end(),
        RangeState::Held,
    )
    .await?;
    to_tx
        .commit()
        .await
        .context("activating the range on the target")?;
    let outcome = match start {
        Stage::Start => Outcome::Moved,
        _ => Outcome::Finished,
    };
    Ok(Moved { rows, outcome })
}

/// Copies (unless an earlier run did), verifies, then deletes the range from the source.
async fn copy_and_delete(
    from: &mut PgConnection,
    to: &mut PgConnection,
    m: &Move<'_>,
    buckets: u32,
    stage: Stage,
) -> anyhow::Result<Vec<(String, i64)>> {
    let mut source = from.begin().await?;
    for table in m.tables() {
        sqlx::query(&format!("LOCK TABLE {table} IN EXCLUSIVE MODE"))
            .execute(&mut *source)
            .await
            .with_context(|| format!("fencing {table}"))?;
    }
    let mut target = to.begin().await?;
    if stage == Stage::Marked {
        copy(&mut source, &mut target, m, buckets).await?;
        copy_horizons(&mut source, &mut target).await?;
        let (first, last) = (*m.range.start(), *m.range.end());
        holdings::set_span(&mut target, first, last, RangeState::Arriving).await?;
    }
    let rows = verify(&mut source, &mut target, m, buckets).await?;
    target.commit().await.context("committing the copy")?;
    crate::failpoint!("shards::move_after_copy");
    // The copied claims carry these deliveries in their count: a range moved back must not
    // find them here to count again.
    crate::claims::deliveries::forget_where(&mut source, &m.in_range(buckets))
        .await
        .context("taking the range's keys out of the source's redeliveries")?;
    for table in m.tables().iter().rev() {
        sqlx::query(&format!(
            "DELETE FROM {table} WHERE {}",
            m.in_range(buckets)
        ))
        .execute(&mut *source)
        .await
        .with_context(|| format!("deleting the range from the source's {table}"))?;
    }
    holdings::clear_spans(&mut source, *m.range.start(), *m.range.end()).await?;
    source.commit().await.context("committing the delete")?;
    crate::failpoint!("shards::move_after_delete");
    Ok(rows)
}

/// Each table's rows of the range on both sides, which must be equal.
async fn verify(
    source: &mut PgConnection,
    target: &mut PgConnection,
    m: &Move<'_>,
    buckets: u32,
) -> anyhow::Result<Vec<(String, i64)>> {
    let mut rows = Vec::new();
    for table in m.tables() {
        let here = count(source, &table, m, buckets).await?;
        let there = count(target, &table, m, buckets).await?;
        ensure!(
            here == there,
            "{table}: {here} rows of the range on the source, {there} on the target; nothing was switched"
        );
        rows.push((table, here));
    }
    Ok(rows)
}

async fn counts(
    conn: &mut PgConnection,
    m: &Move<'_>,
    buckets: u32,
) -> anyhow::Result<Vec<(String, i64)>> {
    let mut rows = Vec::new();
    for table in m.tables() {
        rows.push((table.clone(), count(conn, &table, m, buckets).await?));
    }
    Ok(rows)
}

/// Where the move stands, from both layouts; refused when they say something no move leaves.
async fn stage(
    from: &mut PgConnection,
    to: &mut PgConnection,
    m: &Move<'_>,
) -> anyhow::Result<(u32, Stage)> {
    let source = holdings::read(from).await?.context(
        "the source records no layout: run `replayproof migrate` with its list of databases first",
    )?;
    let target = holdings::read(to).await?.context(
        "the target records no layout: migrate it with `replayproof migrate --new-shards \
         --database-url TARGET`",
    )?;
    ensure!(
        source.buckets == target.buckets,
        "the source records {} buckets and the target {}",
        source.buckets,
        target.buckets
    );
    let (first, last) = (*m.range.start(), *m.range.end());
    ensure!(
        first <= last && last < source.buckets,
        "the buckets {first}-{last} are not within 0-{}",
        source.buckets - 1
    );
    let stage = match (state_of(&source, m), state_of(&target, m)) {
        (Some(RangeState::Held), None) => Stage::Start,
        (Some(RangeState::Leaving), None) => Stage::Marked,
        (Some(RangeState::Leaving), Some(RangeState::Arriving)) => Stage::Copied,
        (None, Some(RangeState::Arriving)) => Stage::Deleted,
        (None, Some(RangeState::Held)) => Stage::Done,
        (here, there) => bail!(
            "the buckets {first}-{last} are {} on the source and {} on the target: no move \
             between these two databases leaves them so",
            said(here),
            said(there)
        ),
    };
    Ok((source.buckets, stage))
}

fn said(state: Option<RangeState>) -> &'static str {
    state.map_or("not held", RangeState::as_str)
}

/// The state of the whole range in a database: held when a held span covers it, in transit
/// when a span of exactly that range is, None when it overlaps no span at all.
fn state_of(h: &Holdings, m: &Move<'_>) -> Option<RangeState> {
    let (first, last) = (*m.range.start(), *m.range.end());
    let covering = h
        .spans
        .iter()
        .find(|s| s.first <= first && last <= s.last)?;
    match covering.state {
        RangeState::Held => Some(RangeState::Held),
        state if covering.first == first && covering.last == last => Some(state),
        _ => None,
    }
}

/// The source's spans with the range cut out of the held span covering it and marked leaving.
fn leaving(h: &Holdings, first: u32, last: u32) -> Vec<Span> {
    let mut spans = Vec::new();
    for s in &h.spans {
        if s.state != RangeState::Held || last < s.first || s.last < first {
            spans.push(*s);
            continue;
        }
        if s.first < first {
            spans.push(Span {
                last: first - 1,
                ..*s
            });
        }
        if last < s.last {
            spans.push(Span {
                first: last + 1,
                ..*s
            });
        }
    }
    spans.push(Span {
        first,
        last,
        state: RangeState::Leaving,
    });
    spans.sort_by_key(|s| s.first);
    spans
}

/// Marks the range leaving on the source, its tables locked against writes meanwhile.
async fn mark_leaving(from: &mut PgConnection, m: &Move<'_>, buckets: u32) -> anyhow::Result<()> {
    let mut tx = from.begin().await?;
    for table in m.tables() {
        sqlx::query(&format!("LOCK TABLE {table} IN EXCLUSIVE MODE"))
            .execute(&mut *tx)
            .await
            .with_context(|| format!("fencing {table}"))?;
    }
    let now = holdings::read(&mut tx)
        .await?
        .context("the source's layout is gone")?;
    ensure!(
        now.buckets == buckets,
        "the source's layout changed meanwhile"
    );
    let spans = leaving(&now, *m.range.start(), *m.range.end());
    sqlx::query("DELETE FROM shard_ranges")
        .execute(&mut *tx)
        .await?;
    for s in spans {
        holdings::set_span(&mut tx, s.first, s.last, s.state).await?;
    }
    tx.commit()
        .await
        .context("marking the range as leaving the source")
}

/// Refuses when another replayproof process is connected to either side: its consumers and
/// dispatchers must be stopped for the move.
async fn fence(from: &mut PgConnection, to: &mut PgConnection) -> anyhow::Result<()> {
    for (side, conn) in [("source", from), ("target", to)] {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'replayproof' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut *conn)
        .await?;
        ensure!(
            others == 0,
            "the {side} database: {others} replayproof session(s) are connected: stop the \
             consumers and dispatchers of both databases before moving buckets"
        );
    }
    Ok(())
}

async fn count(
    conn: &mut PgConnection,
    table: &str,
    m: &Move<'_>,
    buckets: u32,
) -> anyhow::Result<i64> {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} WHERE {}",
        m.in_range(buckets)
    ))
    .fetch_one(conn)
    .await
    .with_context(|| format!("counting the range in {table}"))
}

/// The columns a copy carries: all but generated ones.
async fn columns(conn: &mut PgConnection, table: &str) -> anyhow::Result<Vec<String>> {
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT quote_ident(attname) FROM pg_attribute WHERE attrelid = to_regclass($1) \
         AND attnum > 0 AND NOT attisdropped AND attgenerated = '' ORDER BY attnum",
    )
    .bind(table)
    .fetch_all(conn)
    .await?;
    ensure!(!columns.is_empty(), "{table}: no such table");
    Ok(columns)
}

/// Copies every table's rows of the range: streamed by `COPY` from the source into a
/// temporary table of the target shaped like it, then inserted from there, fresh ids given
/// where ids are renewed and the attempts pointed at their operation's new id.
async fn copy(
    source: &mut Transaction<'_, Postgres>,
    target: &mut Transaction<'_, Postgres>,
    m: &Move<'_>,
    buckets: u32,
) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TEMP TABLE rp_move_outbox_ids (old_id BIGINT, new_id BIGINT) ON COMMIT DROP",
    )
    .execute(&mut **target)
    .await?;
    for table in m.tables() {
        let cols = columns(target, &table).await?;
        let stage = format!("rp_move_{}", table.replace('.', "_"));
        stream(source, target, &table, &stage, &cols.join(", "), m, buckets).await?;
        let renumbered = RENUMBERED.contains(&table.as_str());
        let kept: Vec<&str> = cols
            .iter()
            .map(String::as_str)
            .filter(|c| !(renumbered && *c == "id"))
            .collect();
        let kept = kept.join(", ");
        let insert = format!("INSERT INTO {table} ({kept}) SELECT {kept} FROM {stage} ORDER BY 1");
        let sql = match table.as_str() {
            "outbox" => format!(
                "WITH ins AS ({insert} RETURNING id, operation_key, route_key) \
                 INSERT INTO rp_move_outbox_ids SELECT s.id, ins.id FROM ins \
                 JOIN {stage} s USING (operation_key, route_key)"
            ),
            "outbox_attempts" => format!(
                "UPDATE {stage} s SET outbox_id = i.new_id FROM rp_move_outbox_ids i \
                 WHERE s.outbox_id = i.old_id; {insert}"
            ),
            _ => insert,
        };
        sqlx::raw_sql(&sql)
            .execute(&mut **target)
            .await
            .with_context(|| format!("writing the range to {table}"))?;
    }
    Ok(())
}

/// Streams the range's rows of `table` into a new temporary table `stage` of the target.
async fn stream(
    source: &mut Transaction<'_, Postgres>,
    target: &mut Transaction<'_, Postgres>,
    table: &str,
    stage: &str,
    cols: &str,
    m: &Move<'_>,
    buckets: u32,
) -> anyhow::Result<()> {
    sqlx::query(&format!(
        "CREATE TEMP TABLE {stage} (LIKE {table}) ON COMMIT DROP"
    ))
    .execute(&mut **target)
    .await
    .with_context(|| format!("staging {table}"))?;
    let mut sink = target
        .copy_in_raw(&format!("COPY {stage} ({cols}) FROM STDIN"))
        .await?;
    let (select, from) = crate::claims::deliveries::counted_read(table, cols);
    let out = format!(
        "COPY (SELECT {select} FROM {from} WHERE {}) TO STDOUT",
        m.in_range(buckets)
    );
    let mut rows = source.copy_out_raw(&out).await?;
    while let Some(chunk) = rows.try_next().await? {
        sink.send(chunk).await?;
    }
    sink.finish()
        .await
        .with_context(|| format!("copying the range of {table}"))?;
    Ok(())
}

/// The source's prune horizons onto the target, keeping the later of the two per source: a
/// late redelivery of a key pruned on the source is an expired replay on the target too.
async fn copy_horizons(source: &mut PgConnection, target: &mut PgConnection) -> anyhow::Result<()> {
    type Horizon = (
        String,
        chrono::DateTime<chrono::Utc>,
        sqlx::postgres::types::PgInterval,
    );
    let horizons: Vec<Horizon> =
        sqlx::query_as("SELECT source, pruned_before, clock_margin FROM prune_horizons")
            .fetch_all(&mut *source)
            .await
            .context("reading the source's prune horizons")?;
    for (name, before, margin) in horizons {
        sqlx::query(
            "INSERT INTO prune_horizons AS h (source, pruned_before, clock_margin) \
             VALUES ($1, $2, $3) ON CONFLICT (source) DO UPDATE SET \
             pruned_before = GREATEST(h.pruned_before, excluded.pruned_before), \
             clock_margin = GREATEST(h.clock_margin, excluded.clock_margin), updated_at = now()",
        )
        .bind(name)
        .bind(before)
        .bind(margin)
        .execute(&mut *target)
        .await
        .context("writing the prune horizons to the target")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(list: &[(u32, u32, RangeState)]) -> Holdings {
        Holdings {
            buckets: 1024,
            spans: list
                .iter()
                .map(|&(first, last, state)| Span { first, last, state })
                .collect(),
            epoch: 1,
        }
    }

    #[test]
    fn the_moved_range_is_cut_out_of_the_held_span() {
        use RangeState::*;
        let a = spans(&[(0, 511, Held)]);
        assert_eq!(
            leaving(&a, 256, 511),
            spans(&[(0, 255, Held), (256, 511, Leaving)]).spans
        );
        assert_eq!(
            leaving(&a, 100, 199),
            spans(&[(0, 99, Held), (100, 199, Leaving), (200, 511, Held)]).spans
        );
    }

    #[test]
    fn the_stage_of_a_range_is_read_from_its_spans() {
        use RangeState::*;
        let m = Move {
            range: 256..=511,
            extra: &[],
            dry_run: false,
        };
        assert_eq!(state_of(&spans(&[(0, 511, Held)]), &m), Some(Held));
        assert_eq!(
            state_of(&spans(&[(0, 255, Held), (256, 511, Leaving)]), &m),
            Some(Leaving)
        );
        assert_eq!(state_of(&spans(&[(0, 255, Held)]), &m), None);
        assert_eq!(state_of(&spans(&[(256, 600, Arriving)]), &m), None);
    }
}

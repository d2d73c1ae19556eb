//! Which buckets each database holds, recorded in the database itself (`shard_layout`,
//! `shard_ranges`): `migrate` writes it (or the first process that finds none), every process
//! and command that touches claims checks it against its own list of databases before it uses
//! one, and again on every new connection, and only `shards move` changes it. A list given in
//! another order, shortened, or with another bucket count is refused with the database and the
//! range it holds, instead of claiming keys in the wrong database.

use sqlx::{Connection as _, PgConnection};
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// What a database does with a range of buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeState {
    /// Its keys are claimed, leased and applied here.
    Held,
    /// A `shards move` is taking it away: from before the copy until the source's delete.
    Leaving,
    /// A `shards move` is bringing it here: from the copy until the source's delete is done.
    Arriving,
}

impl RangeState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Leaving => "leaving",
            Self::Arriving => "arriving",
        }
    }

    fn parse(text: &str) -> anyhow::Result<Self> {
        match text {
            "held" => Ok(Self::Held),
            "leaving" => Ok(Self::Leaving),
            "arriving" => Ok(Self::Arriving),
            other => anyhow::bail!("shard_ranges holds an unknown state {other:?}"),
        }
    }
}

/// A range of buckets, both ends included, in one state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub first: u32,
    pub last: u32,
    pub state: RangeState,
}

/// Buckets `first..=last`, or "none".
pub struct Buckets<'a>(pub &'a [Range<u32>]);

impl fmt::Display for Buckets<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ranges: Vec<String> = self
            .0
            .iter()
            .filter(|r| !r.is_empty())
            .map(|r| format!("{}-{}", r.start, r.end - 1))
            .collect();
        match ranges.is_empty() {
            true => f.write_str("none"),
            false => f.write_str(&ranges.join(", ")),
        }
    }
}

/// What one database records of the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings {
    /// How many buckets route keys hash into.
    pub buckets: u32,
    /// Its ranges, by first bucket.
    pub spans: Vec<Span>,
    /// Grows at every change.
    pub epoch: i64,
}

impl Holdings {
    /// The buckets held, adjacent ranges joined.
    pub fn held(&self) -> Vec<Range<u32>> {
        let mut held: Vec<Range<u32>> = Vec::new();
        for span in self.spans.iter().filter(|s| s.state == RangeState::Held) {
            match held.last_mut() {
                Some(last) if last.end == span.first => last.end = span.last + 1,
                _ => held.push(span.first..span.last + 1),
            }
        }
        held
    }

    /// Why this database cannot serve as `expected`, if it cannot.
    pub fn refusal(&self, expected: &Expected) -> Option<String> {
        if self.buckets != expected.buckets {
            return Some(format!(
                "records {} buckets, and this process is configured with {}: every process must \
                 use the bucket count the data was split with ([database] buckets, --buckets)",
                self.buckets, expected.buckets
            ));
        }
        if let Some(span) = self.spans.iter().find(|s| s.state != RangeState::Held) {
            return Some(format!(
                "has buckets {}-{} {} in a `shards move` that did not finish: run the same \
                 `shards move` again to finish it before starting anything on this database",
                span.first,
                span.last,
                span.state.as_str()
            ));
        }
        let held = self.held();
        let wanted: Vec<Range<u32>> = vec![expected.range.clone()];
        let same = held == wanted || (held.is_empty() && expected.range.is_empty());
        (!same).then(|| {
            format!(
                "holds buckets {}, but the list of {} database(s) gives it buckets {}: the \
                 shards are listed in another order, or the list lacks some of them; list every \
                 database in the order they were split (docs/scaling.md)",
                Buckets(&held),
                expected.shards,
                Buckets(&wanted)
            )
        })
    }
}

/// What a process expects of one database of its list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// The configured bucket count.
    pub buckets: u32,
    /// The buckets the list gives it.
    pub range: Range<u32>,
    /// Its place in the list.
    pub shard: usize,
    /// How many databases the list has.
    pub shards: usize,
    /// Where it is, for messages: host, port and database name, never a password.
    pub database: String,
}

/// A database that does not hold what the process's list says it holds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("refused: the database {database} (shard {shard} of the list) {why}")]
pub struct Refused {
    pub database: String,
    pub shard: usize,
    pub why: String,
}

/// Like [`crate::db::pool_in`], for a database of a list of shards: every new connection first
/// checks that the database holds the buckets `expected` says, so a process whose database
/// was swapped, or whose range was moved away, under it stops using it (the connection is
/// refused, with the reason logged) instead of claiming keys there.
pub fn pool(
    url: &crate::db::DatabaseUrl,
    max_connections: u32,
    session: &crate::db::Session,
    expected: Expected,
) -> anyhow::Result<crate::db::Db> {
    let (options, pool) = crate::db::pool_options(url, max_connections, session)?;
    let (on_connect, guard) = (session.clone(), Arc::new(StillHolds(expected.clone())));
    let pool = pool.after_connect(move |conn, _| {
        let (expected, session) = (expected.clone(), on_connect.clone());
        Box::pin(async move { check_on(conn, &session, &expected).await.map_err(refused) })
    });
    let db = session.wrap(pool.connect_lazy_with(options));
    Ok(match session.pooler {
        crate::db::Pooler::None => db,
        crate::db::Pooler::Transaction => db.guarded(guard),
    })
}

/// [`check`] in a transaction of its own, as `session` begins them (behind a pooler, a
/// statement outside a transaction may reach another server connection halfway).
pub async fn check_on(
    conn: &mut PgConnection,
    session: &crate::db::Session,
    expected: &Expected,
) -> anyhow::Result<()> {
    let mut tx = session.begin_on(conn).await?;
    check(&mut tx, expected).await?;
    tx.commit().await?;
    Ok(())
}

/// What the database records; None when nothing was recorded yet, or when it has not been
/// migrated to a version that records it.
pub async fn read(conn: &mut PgConnection) -> anyhow::Result<Option<Holdings>> {
    let migrated: bool = sqlx::query_scalar("SELECT to_regclass('shard_ranges') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if !migrated {
        return Ok(None);
    }
    recorded(conn).await
}

/// What a migrated database records, in one statement; None when nothing was recorded yet.
async fn recorded(conn: &mut PgConnection) -> anyhow::Result<Option<Holdings>> {
    type Row = (i32, i64, Vec<i32>, Vec<i32>, Vec<String>);
    let layout: Option<Row> = sqlx::query_as(
        "SELECT l.buckets, l.epoch,
                coalesce(array_agg(r.first_bucket ORDER BY r.first_bucket)
                         FILTER (WHERE r.first_bucket IS NOT NULL), '{}'),
                coalesce(array_agg(r.last_bucket ORDER BY r.first_bucket)
                         FILTER (WHERE r.first_bucket IS NOT NULL), '{}'),
                coalesce(array_agg(r.state ORDER BY r.first_bucket)
                         FILTER (WHERE r.first_bucket IS NOT NULL), '{}')
           FROM shard_layout l LEFT JOIN shard_ranges r ON true
          GROUP BY l.buckets, l.epoch",
    )
    .fetch_optional(&mut *conn)
    .await?;
    let Some((buckets, epoch, firsts, lasts, states)) = layout else {
        return Ok(None);
    };
    let spans = firsts
        .into_iter()
        .zip(lasts)
        .zip(states)
        .map(|((first, last), state)| {
            Ok(Span {
                first: first as u32,
                last: last as u32,
                state: RangeState::parse(&state)?,
            })
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Some(Holdings {
        buckets: buckets as u32,
        spans,
        epoch,
    }))
}

/// Behind a pooler, every transaction checks the holdings again ([`crate::db::Guard`]): the
/// pooler may have moved the connection to another database since it opened.
struct StillHolds(Expected);

impl crate::db::Guard for StillHolds {
    fn check<'c>(
        &'c self,
        conn: &'c mut PgConnection,
    ) -> futures_util::future::BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let holdings = recorded(conn).await.map_err(refused)?;
            match holdings.and_then(|h| h.refusal(&self.0)) {
                None => Ok(()),
                Some(why) => Err(refused(
                    Refused {
                        database: self.0.database.clone(),
                        shard: self.0.shard,
                        why,
                    }
                    .into(),
                )),
            }
        })
    }
}

/// A refusal as the pool reports it, logged once here.
fn refused(e: anyhow::Error) -> sqlx::Error {
    if let Some(db) = e.downcast_ref::<sqlx::Error>() {
        if crate::db::is_transient(db) {
            return sqlx::Error::Protocol(format!("{e:#}"));
        }
    }
    tracing::error!(error = %format!("{e:#}"), "A database connection was refused: it does not hold the buckets this process's list gives it.");
    sqlx::Error::Configuration(e.into())
}

/// Records `range` of `buckets` as held, unless the database records a layout already (then it
/// is left as it is); in one transaction, so of two processes recording at once one wins and
/// the other reads what it wrote. Returns whether this call recorded it.
pub async fn adopt(
    conn: &mut PgConnection,
    buckets: u32,
    range: Range<u32>,
) -> anyhow::Result<bool> {
    let mut tx = conn.begin().await?;
    let recorded = sqlx::query(
        "INSERT INTO shard_layout (buckets) VALUES ($1) ON CONFLICT (singleton) DO NOTHING",
    )
    .bind(buckets as i32)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    if recorded && !range.is_empty() {
        set_span(&mut tx, range.start, range.end - 1, RangeState::Held).await?;
    }
    tx.commit().await?;
    Ok(recorded)
}

/// Writes one span (replacing any that starts at the same bucket) and moves the epoch on.
pub async fn set_span(
    conn: &mut PgConnection,
    first: u32,
    last: u32,
    state: RangeState,
) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO shard_ranges (first_bucket, last_bucket, state) VALUES ($1, $2, $3) \
         ON CONFLICT (first_bucket) DO UPDATE SET last_bucket = excluded.last_bucket, \
         state = excluded.state",
    )
    .bind(first as i32)
    .bind(last as i32)
    .bind(state.as_str())
    .execute(&mut *conn)
    .await?;
    bump(conn).await
}

/// Removes every span inside `first..=last` and moves the epoch on.
pub async fn clear_spans(conn: &mut PgConnection, first: u32, last: u32) -> anyhow::Result<()> {
    sqlx::query("DELETE FROM shard_ranges WHERE first_bucket >= $1 AND last_bucket <= $2")
        .bind(first as i32)
        .bind(last as i32)
        .execute(&mut *conn)
        .await?;
    bump(conn).await
}

async fn bump(conn: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::query("UPDATE shard_layout SET epoch = epoch + 1, updated_at = now()")
        .execute(conn)
        .await?;
    Ok(())
}

/// Checks the database against `expected`, first recording `expected` where nothing is
/// recorded yet (a database migrated before layouts were recorded, or by the library alone).
/// A database not yet migrated passes: nothing can be claimed in it.
pub async fn check(conn: &mut PgConnection, expected: &Expected) -> anyhow::Result<()> {
    let holdings = match read(conn).await? {
        Some(holdings) => holdings,
        None => {
            let migrated: bool =
                sqlx::query_scalar("SELECT to_regclass('shard_layout') IS NOT NULL")
                    .fetch_one(&mut *conn)
                    .await?;
            if !migrated {
                return Ok(());
            }
            adopt(conn, expected.buckets, expected.range.clone()).await?;
            read(conn)
                .await?
                .ok_or_else(|| anyhow::anyhow!("the layout just recorded is gone"))?
        }
    };
    match holdings.refusal(expected) {
        None => Ok(()),
        Some(why) => Err(Refused {
            database: expected.database.clone(),
            shard: expected.shard,
            why,
        }
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(buckets: u32, spans: &[(u32, u32, RangeState)]) -> Holdings {
        Holdings {
            buckets,
            spans: spans
                .iter()
                .map(|&(first, last, state)| Span { first, last, state })
                .collect(),
            epoch: 1,
        }
    }

    fn expected(range: Range<u32>) -> Expected {
        Expected {
            buckets: 1024,
            range,
            shard: 1,
            shards: 2,
            database: "db".into(),
        }
    }

    #[test]
    fn the_range_the_list_gives_must_be_the_range_held() {
        let b = holding(1024, &[(512, 1023, RangeState::Held)]);
        assert_eq!(b.refusal(&expected(512..1024)), None);
        let why = b.refusal(&expected(0..512)).unwrap();
        assert!(why.contains("holds buckets 512-1023"), "{why}");
        assert!(why.contains("gives it buckets 0-511"), "{why}");
        // A list of one database gives it everything.
        assert!(b.refusal(&expected(0..1024)).is_some());
        // Adjacent held ranges count as one.
        let joined = holding(
            1024,
            &[(0, 255, RangeState::Held), (256, 511, RangeState::Held)],
        );
        assert_eq!(joined.refusal(&expected(0..512)), None);
    }

    #[test]
    fn another_bucket_count_or_a_range_in_transit_is_refused() {
        let b = holding(2048, &[(0, 2047, RangeState::Held)]);
        assert!(b
            .refusal(&expected(0..1024))
            .unwrap()
            .contains("records 2048 buckets"));
        let moving = holding(
            1024,
            &[(0, 255, RangeState::Held), (256, 511, RangeState::Leaving)],
        );
        let why = moving.refusal(&expected(0..256)).unwrap();
        assert!(why.contains("256-511 leaving"), "{why}");
        assert!(moving.refusal(&expected(0..512)).is_some());
        let empty = holding(1024, &[]);
        assert_eq!(empty.refusal(&expected(0..0)), None);
        assert!(empty
            .refusal(&expected(0..512))
            .unwrap()
            .contains("holds buckets none"));
    }
}

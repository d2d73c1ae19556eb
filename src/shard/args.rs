//! The flags of `migrate` and `shards`, and how each runs.

use crate::args::DatabaseArgs;
use clap::{Args, Subcommand};

/// Citus's own default `citus.shard_count`, used by `migrate --citus` unless
/// `--citus-shards` says otherwise.
pub const CITUS_DEFAULT_SHARD_COUNT: usize = 32;

#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// The database is a Citus coordinator: after the migrations, distribute the tables by
    /// route_key, co-located with the claims, over `--citus-shards` shards (32 unless given),
    /// and make the tables with no route key reference tables.
    #[arg(long)]
    pub citus: bool,

    /// The databases are new shards that `shards move` will fill: record that they hold no
    /// bucket yet (without it, each database is recorded as holding its range of the list).
    #[arg(long, conflicts_with = "citus")]
    pub new_shards: bool,

    /// Behind a transaction-mode pooler (`--pooler transaction`), the database's own address,
    /// which the migrations need (they hold a session-level lock); repeated, one per
    /// `--database-url`, in the same order.
    #[arg(long, env = "REPLAYPROOF_DIRECT_DATABASE_URL", hide_env_values = true, value_name = "URL", action = clap::ArgAction::Append)]
    pub direct_database_url: Vec<crate::db::DatabaseUrl>,

    /// Succeed when the database holds migrations this binary does not know (a newer release
    /// applied them: a rollback, or a pod of the old release restarting mid-update), with a
    /// warning; without it migrate refuses, naming the version. The Kubernetes init containers
    /// run with it.
    #[arg(long)]
    pub allow_newer: bool,
}

impl MigrateArgs {
    /// Applies the migrations (and `extra`) on every database, in the order given, and records
    /// or checks which buckets each holds; with `--citus`, distributes the tables on the
    /// coordinator.
    pub async fn run(&self, extra: &[&str]) -> anyhow::Result<()> {
        let database = &self.database;
        let shards = database.shards(1)?;
        let (urls, session) = self.migrated()?;
        for (shard, url) in urls.iter().enumerate() {
            let pool = crate::db::pool_in(url, 1, &session)?;
            let newer = match self.allow_newer {
                true => crate::db::Newer::Allowed,
                false => crate::db::Newer::Refused,
            };
            crate::db::migrate_with_newer(&pool, extra, newer).await?;
            tracing::info!(schema = %database.session.schema, shard, "Migrations applied.");
            let mut expected = database.expected(shard)?;
            if self.new_shards {
                expected.range = 0..0;
            }
            let mut tx = pool.begin().await?;
            super::holdings::check(&mut tx, &expected).await?;
            tx.commit().await?;
        }
        if self.citus {
            let count = self
                .database
                .citus_shards
                .unwrap_or(CITUS_DEFAULT_SHARD_COUNT);
            crate::shard::Layout::new(self.database.buckets, count)?;
            super::citus::distribute(shards.first(), count).await?;
            tracing::info!(shard_count = count, "Tables distributed by route_key.");
        }
        Ok(())
    }
}

impl MigrateArgs {
    /// The databases the migrations run on and how: the direct addresses when given (each
    /// database's own, so the session's settings hold), else the pooled ones.
    pub fn migrated(&self) -> anyhow::Result<(&[crate::db::DatabaseUrl], crate::db::Session)> {
        let database = &self.database;
        let session = database.session.session();
        if self.direct_database_url.is_empty() {
            anyhow::ensure!(
                session.pooler == crate::db::Pooler::None,
                crate::db::DIRECT_NEEDED
            );
            return Ok((&database.database_url, session));
        }
        anyhow::ensure!(
            self.direct_database_url.len() == database.database_url.len(),
            "{} direct URLs for {} databases: give one --direct-database-url (or `[database] \
             direct_url`) per database, in the same order",
            self.direct_database_url.len(),
            database.database_url.len()
        );
        let direct = crate::db::Session {
            pooler: crate::db::Pooler::None,
            ..session
        };
        Ok((&self.direct_database_url, direct))
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum ShardsCommand {
    /// Check the schema of every shard against the sharding rules: every primary key, unique
    /// index and foreign key of a distributed table includes route_key, and key columns are
    /// COLLATE "C". `--table` adds an application's own effect tables.
    Check {
        #[command(flatten)]
        database: DatabaseArgs,
        /// An effect table of the application (`schema.table`), checked by the same rules;
        /// repeatable.
        #[arg(long = "table", value_name = "TABLE")]
        tables: Vec<String>,
    },
    /// Move a range of buckets from one database to another (fence, copy, verify, switch),
    /// with the consumers and dispatchers of both stopped; safe to run again if cut off. Then
    /// start them with the new list of databases (docs/scaling.md).
    Move {
        /// The database the buckets leave.
        #[arg(long, value_name = "URL")]
        from_url: crate::db::DatabaseUrl,
        /// The database the buckets go to, migrated.
        #[arg(long, value_name = "URL")]
        to_url: crate::db::DatabaseUrl,
        /// The buckets moved, `FIRST-LAST` (both included), such as 512-1023. The bucket count
        /// is the one the source records.
        #[arg(long = "range", value_name = "FIRST-LAST", value_parser = bucket_range)]
        range: (u32, u32),
        /// An effect table of the application distributed by route_key (`schema.table`), moved
        /// with the claims; repeatable.
        #[arg(long = "table", value_name = "TABLE")]
        tables: Vec<String>,
        /// Count the rows of the range on both sides; move nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        session: crate::args::SessionArgs,
    },
    /// Print where a route key lives: its bucket and its shard.
    Locate {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The route key (the event key, unless its source routes by a tenant field).
        route_key: String,
    },
}

/// `shards move`: it holds a session on each database across its steps, so it needs direct
/// connections.
async fn move_buckets(
    session: &crate::args::SessionArgs,
    (from_url, to_url): (&crate::db::DatabaseUrl, &crate::db::DatabaseUrl),
    m: &super::reshard::Move<'_>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        session.pooler == crate::db::Pooler::None,
        "shards move needs direct connections to both databases (it holds a session on each \
         across its steps): give the databases' own addresses and --pooler none"
    );
    let (from, to) = (session.pool(from_url, 1)?, session.pool(to_url, 1)?);
    let (mut from, mut to) = (from.pool().acquire().await?, to.pool().acquire().await?);
    let moved = super::reshard::run(&mut from, &mut to, m).await?;
    for (table, n) in &moved.rows {
        println!("{table}: {n} rows");
    }
    let (first, last) = (m.range.start(), m.range.end());
    println!("Buckets {first}-{last} {}.", moved.outcome.said());
    Ok(())
}

/// `FIRST-LAST`, or one bucket.
fn bucket_range(s: &str) -> Result<(u32, u32), String> {
    let (first, last) = s.split_once('-').unwrap_or((s, s));
    let parse = |n: &str| {
        n.trim()
            .parse::<u32>()
            .map_err(|_| format!("{n:?} is not a bucket number"))
    };
    let (first, last) = (parse(first)?, parse(last)?);
    match first <= last {
        true => Ok((first, last)),
        false => Err(format!("{first}-{last} is an empty range")),
    }
}

impl ShardsCommand {
    pub async fn run(&self) -> anyhow::Result<()> {
        match self {
            Self::Move {
                from_url,
                to_url,
                range,
                tables,
                dry_run,
                session,
            } => {
                let m = super::reshard::Move {
                    range: range.0..=range.1,
                    extra: tables,
                    dry_run: *dry_run,
                };
                move_buckets(session, (from_url, to_url), &m).await
            }
            Self::Check { database, tables } => {
                let shards = database.shards(1)?;
                let mut problems = 0;
                for (shard, pool) in shards.databases() {
                    let findings = super::lint::check(pool, tables).await?;
                    for finding in &findings {
                        println!("shard {shard}: {finding}");
                    }
                    problems += findings.len();
                }
                anyhow::ensure!(
                    problems == 0,
                    "{problems} table(s) break the sharding rules"
                );
                println!("Every table follows the sharding rules.");
                Ok(())
            }
            Self::Locate {
                database,
                route_key,
            } => {
                let layout = database.shards(1)?.layout();
                let bucket = layout.bucket(route_key);
                println!(
                    "bucket {bucket} of {}, shard {} of {}",
                    layout.buckets(),
                    layout.shard_of_bucket(bucket),
                    layout.shards()
                );
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::bucket_range;

    #[test]
    fn bucket_ranges_are_first_to_last_or_one_bucket() {
        assert_eq!(bucket_range("512-1023"), Ok((512, 1023)));
        assert_eq!(bucket_range("7"), Ok((7, 7)));
        assert!(bucket_range("9-3").unwrap_err().contains("empty range"));
        assert!(bucket_range("a-3")
            .unwrap_err()
            .contains("not a bucket number"));
    }
}

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
}

impl MigrateArgs {
    /// Applies the migrations (and `extra`) on every database, in the order given; with
    /// `--citus`, distributes the tables on the coordinator.
    pub async fn run(&self, extra: &[&str]) -> anyhow::Result<()> {
        let shards = self.database.shards(1)?;
        for (shard, pool) in shards.databases() {
            crate::db::migrate_with(pool, extra).await?;
            tracing::info!(schema = %self.database.session.schema, shard, "Migrations applied.");
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
    /// Print where a route key lives: its bucket and its shard.
    Locate {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The route key (the event key, unless its source routes by a tenant field).
        route_key: String,
    },
}

impl ShardsCommand {
    pub async fn run(&self) -> anyhow::Result<()> {
        match self {
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

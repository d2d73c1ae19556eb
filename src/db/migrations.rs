//! The migrations: applying them, and what a binary older than its database does.

use super::{with_cause, Db, Pooler, Schema};
use anyhow::Context as _;

/// The embedded migrations from `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Why the migrations are refused through a transaction-mode pooler, and what to do.
pub const DIRECT_NEEDED: &str = "the migrations need a direct connection to PostgreSQL, not \
     the transaction-mode pooler `[database] pooler` names: run `replayproof migrate` with \
     `[database] direct_url` (or --direct-database-url, REPLAYPROOF_DIRECT_DATABASE_URL) set to \
     the database's own address (docs/production.md, \"Connection poolers\")";

/// Creates the pool's schema when missing and applies every pending migration there.
///
/// Refused behind a transaction-mode pooler: the migrations hold a session-level lock (so that
/// two runs at once apply each migration once) that such a pooler cannot keep.
pub async fn migrate(pool: &Db) -> anyhow::Result<()> {
    migrate_as(pool, Newer::Refused).await
}

/// What `migrate` does when the database holds migrations this binary does not know: a newer
/// release applied them, and this one runs after a rollback (or on a pod that restarted in the
/// middle of a rolling update).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Newer {
    /// Refused, naming the version: the usual answer to a binary older than its database.
    Refused,
    /// Nothing of them is undone, nothing is applied twice, and the rest goes on; said in a
    /// warning (`migrate --allow-newer`, as the Kubernetes init containers run it).
    Allowed,
}

async fn migrate_as(pool: &Db, newer: Newer) -> anyhow::Result<()> {
    if pool.pooler() == Pooler::Transaction {
        anyhow::bail!(DIRECT_NEEDED);
    }
    let search_path: String = match sqlx::query_scalar("SELECT current_setting('search_path')")
        .fetch_one(pool)
        .await
    {
        Ok(path) => path,
        Err(e) => return Err(with_cause(pool, e).await.context("reading the search_path")),
    };
    let schema: Schema = search_path
        .split(',')
        .next()
        .unwrap_or_default()
        .trim()
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .execute(pool)
        .await
        .with_context(|| format!("creating the schema {schema}"))?;
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.set_ignore_missing(newer == Newer::Allowed);
    warn_of_newer(pool, newer).await;
    migrator
        .run(pool.pool())
        .await
        .context("applying migrations")
}

/// [`migrate`], then an application's own `extra` SQL (each safe to run again), in order.
pub async fn migrate_with(pool: &Db, extra: &[&str]) -> anyhow::Result<()> {
    migrate_with_newer(pool, extra, Newer::Refused).await
}

/// [`migrate_with`], doing with newer migrations what `newer` says.
pub async fn migrate_with_newer(pool: &Db, extra: &[&str], newer: Newer) -> anyhow::Result<()> {
    migrate_as(pool, newer).await?;
    for sql in extra {
        sqlx::raw_sql(sql)
            .execute(pool)
            .await
            .context("applying the application's migration")?;
    }
    Ok(())
}

/// Warns, when newer migrations are allowed, of those the database holds and this binary does
/// not know.
async fn warn_of_newer(pool: &Db, newer: Newer) {
    if newer == Newer::Refused {
        return;
    }
    let known: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    let unknown: Result<Vec<i64>, sqlx::Error> = sqlx::query_scalar(
        "SELECT version FROM _sqlx_migrations WHERE NOT (version = ANY($1)) ORDER BY version",
    )
    .bind(&known)
    .fetch_all(pool)
    .await;
    if let Ok(unknown) = unknown {
        if !unknown.is_empty() {
            tracing::warn!(versions = ?unknown, "The database holds migrations this binary does not know (a newer release applied them); they stay, and this binary's own are checked and applied.");
        }
    }
}

//! The PostgreSQL pool and the schema migrations.

use anyhow::Context as _;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The embedded migrations from `migrations/`.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// A PostgreSQL URL. It may carry a password, so it never prints.
#[derive(Clone)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl FromStr for DatabaseUrl {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        PgConnectOptions::from_str(s).context("DATABASE_URL is not a PostgreSQL URL")?;
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DatabaseUrl(<redacted>)")
    }
}

/// A pool that connects lazily, so a process starts while PostgreSQL is down and carries on by
/// itself once it is back. Acquiring a connection gives up after a few seconds, so a batch
/// fails and is retried rather than hanging.
pub fn pool(url: &DatabaseUrl, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = PgConnectOptions::from_str(url.expose())?.application_name("replayproof");
    Ok(PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(options))
}

/// Applies every pending migration.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    MIGRATOR.run(pool).await.context("applying migrations")
}

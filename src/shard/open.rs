//! How the database flags ([`DatabaseArgs`]) open their databases as shards: one pool per
//! database, each connection checking that its database holds the buckets the list gives it
//! ([`holdings`]), and the pool a command reading one database, or one key, reads.

use super::{holdings, Layout, Shards};
use crate::args::{DatabaseArgs, SessionArgs};
use crate::db::{self, DatabaseUrl};

impl SessionArgs {
    /// [`SessionArgs::pool`] for a database of a list of shards: each new connection checks
    /// that it holds the buckets `expected` says.
    pub fn pool_holding(
        &self,
        url: &DatabaseUrl,
        max_connections: u32,
        expected: holdings::Expected,
    ) -> anyhow::Result<crate::db::Db> {
        holdings::pool(url, max_connections, &self.session(), expected)
    }
}

impl DatabaseArgs {
    /// A pool of the database, for commands that run on one: with several databases, the one
    /// `--shard` names (a command that reads a single database must be told which).
    pub fn pool(&self, max_connections: u32) -> anyhow::Result<crate::db::Db> {
        let n = self.database_url.len();
        let i = match (n, self.shard) {
            (1, None | Some(0)) => 0,
            (_, Some(i)) if i < n => i,
            (_, Some(i)) => anyhow::bail!(
                "--shard {i} names none of the {n} databases (0 to {})",
                n - 1
            ),
            (_, None) => anyhow::bail!(
                "this command reads one database at a time, and {n} shards are given: add \
                 --shard N (0 to {}) to say which",
                n - 1
            ),
        };
        let url = &self.database_url[i];
        self.session
            .pool_holding(url, max_connections, self.expected(i)?)
    }

    /// [`DatabaseArgs::pool`], once the database was checked to hold the buckets the list
    /// gives it ([`DatabaseArgs::check_holdings`]).
    pub async fn open_pool(&self, max_connections: u32) -> anyhow::Result<crate::db::Db> {
        let pool = self.pool(max_connections)?;
        self.check_holdings().await?;
        Ok(pool)
    }

    /// [`DatabaseArgs::shards`], once every database was checked to hold the buckets the list
    /// gives it ([`DatabaseArgs::check_holdings`]).
    pub async fn open_shards(&self, max_connections: u32) -> anyhow::Result<Shards> {
        let shards = self.shards(max_connections)?;
        self.check_holdings().await?;
        Ok(shards)
    }

    /// What database `i` of the list must hold: its equal range of the buckets, in the order
    /// listed; with Citus, the coordinator holds them all.
    pub fn expected(&self, i: usize) -> anyhow::Result<holdings::Expected> {
        let n = self.database_url.len();
        let (range, shards) = match self.citus_shards {
            Some(_) => (0..self.buckets, 1),
            None => (Layout::new(self.buckets, n)?.buckets_of(i), n),
        };
        Ok(holdings::Expected {
            buckets: self.buckets,
            range,
            shard: i,
            shards,
            database: db::describe(&self.database_url[i]),
        })
    }

    /// Refuses, with the database and the range it holds, a list whose databases do not hold
    /// the buckets it gives them (reordered, shortened, another bucket count, a move not
    /// finished); a database that records nothing yet is recorded as the list says. A database
    /// that cannot be reached now is checked when it is: every new connection checks it.
    pub async fn check_holdings(&self) -> anyhow::Result<()> {
        use sqlx::Connection as _;
        for (i, url) in self.database_url.iter().enumerate() {
            let expected = self.expected(i)?;
            let pool = self.session.pool(url, 1)?;
            let mut conn = match sqlx::PgConnection::connect_with(&pool.connect_options()).await {
                Ok(conn) => conn,
                Err(e) => {
                    tracing::warn!(database = %expected.database, error = %e, "Could not check which buckets the database holds yet; every connection checks it.");
                    continue;
                }
            };
            holdings::check_on(&mut conn, &self.session.session(), &expected).await?;
            let _ = conn.close().await;
        }
        Ok(())
    }

    /// The pool of the database holding `key`'s claim (or its expired replay): with several
    /// databases each is asked, since a key routed by a tenant field lives on its tenant's
    /// shard. Refused when none holds it, or more than one (its source's route was changed).
    pub async fn pool_for_key(
        &self,
        key: &str,
        max_connections: u32,
    ) -> anyhow::Result<crate::db::Db> {
        self.pool_holding_key(key, max_connections)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no shard holds the event {key}"))
    }

    /// [`DatabaseArgs::pool_for_key`], None when no shard holds the key.
    pub async fn pool_holding_key(
        &self,
        key: &str,
        max_connections: u32,
    ) -> anyhow::Result<Option<crate::db::Db>> {
        if self.database_url.len() == 1 || self.shard.is_some() {
            return Ok(Some(self.open_pool(max_connections).await?));
        }
        self.open_shards(max_connections).await?.holding(key).await
    }

    /// The shards: one pool per `--database-url`, in the order given, or the Citus
    /// coordinator's pool once per Citus shard; `max_connections` per database.
    pub fn shards(&self, max_connections: u32) -> anyhow::Result<Shards> {
        if let Some(count) = self.citus_shards {
            anyhow::ensure!(
                self.database_url.len() == 1,
                "--citus-shards takes one --database-url, the coordinator's"
            );
            let pool = self
                .session
                .pool_holding(self.url(), max_connections, self.expected(0)?)?;
            return Ok(Shards::citus(pool, self.buckets, count)?);
        }
        let layout = Layout::new(self.buckets, self.database_url.len())?;
        let pools = self
            .database_url
            .iter()
            .enumerate()
            .map(|(i, url)| {
                self.session
                    .pool_holding(url, max_connections, self.expected(i)?)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Shards::new(layout, pools)?)
    }
}

//! The handle every command reaches PostgreSQL through, directly or behind a transaction-mode
//! pooler (PgBouncer, Supabase's Supavisor, Neon's pooler, RDS Proxy).
//!
//! A transaction-mode pooler lends a server connection for one transaction and takes it back at
//! the next `ReadyForQuery` outside one. Three habits of a direct connection break there:
//!
//! - **Session settings** (the startup `options` carrying `search_path` and the timeouts): the
//!   pooler refuses or drops them. Behind a pooler every transaction sets them again with `SET
//!   LOCAL`, which ends with the transaction.
//! - **A statement outside a transaction**: sqlx parses a statement, waits for the server's
//!   answer, then binds and executes it, two round trips the pooler may serve from two different
//!   server connections. Behind a pooler every statement runs inside a transaction, so both halves
//!   reach the same server.
//! - **Named prepared statements kept across transactions**: the next transaction may run on a
//!   server that lacks the statement, or that holds another client's statement of the same name.
//!   Behind a pooler sqlx's statement cache is off, so a statement is never used outside the
//!   transaction that prepared it, and each transaction starts with `DEALLOCATE ALL`, so the names
//!   a transaction prepares never meet those another client left on that server connection.

use super::{Limits, Schema};
use futures_util::future::BoxFuture;
use futures_util::stream::{BoxStream, StreamExt as _, TryStreamExt as _};
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Either, Execute, Executor, PgPool, Postgres, Transaction};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// What stands between replayproof and PostgreSQL (`[database] pooler`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Pooler {
    /// A direct connection, or a pooler in session mode: session settings hold.
    #[default]
    None,
    /// A pooler in transaction mode: nothing may outlive a transaction.
    Transaction,
}

impl FromStr for Pooler {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" | "session" => Ok(Self::None),
            "transaction" => Ok(Self::Transaction),
            other => Err(format!(
                "{other:?} is not a pooler mode: none (a direct connection or a session-mode \
                 pooler) or transaction"
            )),
        }
    }
}

impl fmt::Display for Pooler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Transaction => "transaction",
        })
    }
}

/// A PostgreSQL pool that keeps every guarantee behind a transaction-mode pooler too: each
/// statement given to it runs in a transaction of its own, and each transaction it begins first
/// sets the session's schema and time limits for itself (see the module's header). With no pooler
/// it is the pool itself.
#[derive(Clone)]
pub struct Db {
    pool: PgPool,
    /// The statement that opens a transaction behind a pooler; None for a direct connection.
    begin: Option<Arc<str>>,
    /// What each transaction behind a pooler checks first (see [`Guard`]).
    guard: Option<Arc<dyn Guard>>,
}

/// A check of the database a connection reaches, made when the connection opens, and behind a
/// pooler at the start of every transaction: the pooler may move a connection that stays open
/// to another server (a reload pointing a name elsewhere, a failover), which a check made once
/// at connect would never see.
pub trait Guard: Send + Sync + 'static {
    /// An error when this connection's database must not be used.
    fn check<'c>(
        &'c self,
        conn: &'c mut sqlx::PgConnection,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;
}

impl fmt::Debug for Db {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Db")
            .field("pooler", &self.pooler())
            .finish_non_exhaustive()
    }
}

impl From<PgPool> for Db {
    /// A pool whose sessions carry their settings (a direct connection).
    fn from(pool: PgPool) -> Self {
        Self {
            pool,
            begin: None,
            guard: None,
        }
    }
}

impl Db {
    /// `pool` reached as `pooler` says; behind a transaction pooler each transaction first sets
    /// `limits` and `schema`.
    pub(crate) fn new(pool: PgPool, pooler: Pooler, limits: Limits, schema: &Schema) -> Self {
        let begin = match pooler {
            Pooler::None => None,
            Pooler::Transaction => Some(begin_statement(limits, schema).into()),
        };
        Self {
            pool,
            begin,
            guard: None,
        }
    }

    /// This handle, whose transactions behind a pooler first pass `guard`.
    pub(crate) fn guarded(self, guard: Arc<dyn Guard>) -> Self {
        Self {
            guard: Some(guard),
            ..self
        }
    }

    /// Another pool of the same database, reached the way this one is.
    pub(crate) fn sibling(&self, pool: PgPool) -> Self {
        Self {
            pool,
            begin: self.begin.clone(),
            guard: self.guard.clone(),
        }
    }

    /// The pool underneath, for what must hold a session of its own (the migrations' lock).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The pooler mode this handle was built for.
    pub fn pooler(&self) -> Pooler {
        match self.begin {
            None => Pooler::None,
            Some(_) => Pooler::Transaction,
        }
    }

    /// Begins a transaction; behind a pooler, one that carries the session's settings and has
    /// passed the handle's [`Guard`].
    pub async fn begin(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        let Some(statement) = &self.begin else {
            return self.pool.begin().await;
        };
        let mut tx = self.pool.begin_with(statement.to_string()).await?;
        if let Some(guard) = &self.guard {
            guard.check(&mut tx).await?;
        }
        Ok(tx)
    }

    /// The options the pool connects with.
    pub fn connect_options(&self) -> Arc<sqlx::postgres::PgConnectOptions> {
        self.pool.connect_options()
    }

    /// Closes the pool: see [`sqlx::Pool::close`].
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Whether [`Db::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.pool.is_closed()
    }

    /// The connections open now, idle or in use.
    pub fn size(&self) -> u32 {
        self.pool.size()
    }

    /// The connections open and idle now.
    pub fn num_idle(&self) -> usize {
        self.pool.num_idle()
    }
}

/// `BEGIN`, then what a session would otherwise carry from its startup: one simple-protocol
/// round trip. The values are numbers and a checked schema name, never quoted text.
pub(super) fn begin_statement(limits: Limits, schema: &Schema) -> String {
    let ms = |d: std::time::Duration| d.as_millis();
    format!(
        "BEGIN; DEALLOCATE ALL; SET LOCAL search_path TO {}; SET LOCAL statement_timeout = {}; \
         SET LOCAL lock_timeout = {}; SET LOCAL idle_in_transaction_session_timeout = {}; \
         SET LOCAL jit = off",
        schema.search_path(),
        ms(limits.statement_timeout),
        ms(limits.lock_timeout),
        ms(limits.idle_in_transaction_timeout),
    )
}

/// A statement given to the handle itself: behind a pooler it runs in a transaction of its
/// own, committed before its rows are handed over, as an autocommitted statement would be.
impl<'c> Executor<'c> for &'c Db {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if self.begin.is_none() {
            return self.pool.fetch_many(query);
        }
        let all = async move {
            let mut tx = self.begin().await?;
            let items: Vec<_> = tx.fetch_many(query).try_collect().await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(items)
        };
        futures_util::stream::once(all)
            .map(|all| match all {
                Ok(items) => futures_util::stream::iter(items.into_iter().map(Ok)).left_stream(),
                Err(e) => futures_util::stream::iter([Err(e)]).right_stream(),
            })
            .flatten()
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        if self.begin.is_none() {
            return self.pool.fetch_optional(query);
        }
        Box::pin(async move {
            let mut tx = self.begin().await?;
            let row = tx.fetch_optional(query).await?;
            tx.commit().await?;
            Ok(row)
        })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.pool.prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<sqlx::Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.pool.describe(sql)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn behind_a_pooler_each_transaction_sets_what_a_session_would_carry() {
        let limits = Limits {
            statement_timeout: std::time::Duration::from_secs(30),
            lock_timeout: std::time::Duration::from_millis(2500),
            ..Limits::default()
        };
        let sql = begin_statement(limits, &"billing".parse().unwrap());
        assert!(sql.starts_with("BEGIN; DEALLOCATE ALL; "), "{sql}");
        for part in [
            "SET LOCAL search_path TO billing,public",
            "SET LOCAL statement_timeout = 30000",
            "SET LOCAL lock_timeout = 2500",
            "SET LOCAL idle_in_transaction_session_timeout = 30000",
            "SET LOCAL jit = off",
        ] {
            assert!(sql.contains(part), "{part} missing from {sql}");
        }
    }

    #[test]
    fn pooler_modes_read_as_written_and_others_are_refused() {
        assert_eq!("transaction".parse(), Ok(Pooler::Transaction));
        assert_eq!("none".parse(), Ok(Pooler::None));
        assert_eq!("session".parse(), Ok(Pooler::None));
        let refused = "statement".parse::<Pooler>().unwrap_err();
        assert!(refused.contains("transaction"), "{refused}");
    }
}

//! The PostgreSQL pool and the schema its sessions run in, the migrations, and what a database
//! error means.

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

mod migrations;
mod pooled;
pub use migrations::{migrate, migrate_with, migrate_with_newer, Newer, DIRECT_NEEDED, MIGRATOR};
pub use pooled::{Db, Guard, Pooler};

/// The buckets a deployment is split into unless it says otherwise (`[database] buckets`):
/// fixed for the life of the data, and a power of two so that any power-of-two number of
/// shards up to it splits them evenly ([`crate::shard::Layout`]).
pub const DEFAULT_BUCKETS: u32 = 1024;

/// A JSON column (a payload) read as the text PostgreSQL holds rather than as a value, so its
/// numbers stay exact whatever `serde_json` features the application is built with; it
/// serialises as that same JSON. Queries name it with `payload AS "payload: JsonText"`.
pub type JsonText = sqlx::types::Json<Box<serde_json::value::RawValue>>;

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

    /// Registers the URL's password as a secret ([`crate::secrets`]) first, so that nothing
    /// prints it, and says why a URL is refused without repeating it.
    fn from_str(s: &str) -> anyhow::Result<Self> {
        crate::secrets::register_url(s);
        match PgConnectOptions::from_str(s) {
            Ok(_) => Ok(Self(s.to_owned())),
            Err(e) => {
                let why = crate::secrets::scrub(&e.to_string()).replace(s, "the URL");
                anyhow::bail!("not a PostgreSQL URL: {why}")
            }
        }
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DatabaseUrl(<redacted>)")
    }
}

/// The time limits every replayproof session runs under, so that no stuck statement, lock wait
/// or paused process holds claims for long: PostgreSQL itself ends what overstays, its locks
/// are released, and the partition's next owner goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `statement_timeout`: the longest one statement may run.
    pub statement_timeout: Duration,
    /// `lock_timeout`: the longest one statement may wait for a lock, such as a claim another
    /// transaction holds.
    pub lock_timeout: Duration,
    /// `idle_in_transaction_session_timeout`: how long a session may sit inside a transaction
    /// without sending anything (a paused or cut-off process) before PostgreSQL ends it.
    pub idle_in_transaction_timeout: Duration,
    /// `tcp_keepalives_idle`: how soon PostgreSQL probes a silent client's connection. Three
    /// failed probes ten seconds apart end the session.
    pub keepalive_idle: Duration,
}

/// Limits::statement_timeout unless `--statement-timeout-ms` says otherwise.
pub const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(30);
/// A claim held elsewhere is waited for this long at most (`--lock-timeout-ms`).
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// A silent session inside a transaction ends after this
/// (`--idle-in-transaction-timeout-ms`).
pub const DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for Limits {
    fn default() -> Self {
        Self {
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            idle_in_transaction_timeout: DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT,
            keepalive_idle: Duration::from_secs(30),
        }
    }
}

impl Limits {
    /// The session settings, as sent in the connection's startup packet. `jit` is off: every
    /// statement replayproof runs is short, and compiling one whose plan looks large (a batch's
    /// arrays of 500 rows) takes longer than running it.
    fn settings(&self) -> [(&'static str, String); 7] {
        let ms = |d: Duration| d.as_millis().to_string();
        [
            ("jit", "off".into()),
            ("statement_timeout", ms(self.statement_timeout)),
            ("lock_timeout", ms(self.lock_timeout)),
            (
                "idle_in_transaction_session_timeout",
                ms(self.idle_in_transaction_timeout),
            ),
            (
                "tcp_keepalives_idle",
                self.keepalive_idle.as_secs().max(1).to_string(),
            ),
            ("tcp_keepalives_interval", "10".into()),
            ("tcp_keepalives_count", "3".into()),
        ]
    }
}

/// A pool that connects lazily, so a process starts while PostgreSQL is down and carries on by
/// itself once it is back. Acquiring a connection gives up after a few seconds, so a batch
/// fails and is retried rather than hanging. Sessions run under the default [`Limits`].
pub fn pool(url: &DatabaseUrl, max_connections: u32) -> anyhow::Result<Db> {
    pool_with(url, max_connections, Limits::default())
}

/// Like [`pool`], with the given time limits.
pub fn pool_with(url: &DatabaseUrl, max_connections: u32, limits: Limits) -> anyhow::Result<Db> {
    let session = Session {
        limits,
        ..Session::default()
    };
    pool_in(url, max_connections, &session)
}

/// Like [`pool_with`], with every setting of the session.
pub fn pool_in(url: &DatabaseUrl, max_connections: u32, session: &Session) -> anyhow::Result<Db> {
    let (options, pool) = pool_options(url, max_connections, session)?;
    Ok(session.wrap(pool.connect_lazy_with(options)))
}

/// What every session of a process runs under: its time limits, the schema of replayproof's
/// tables, and whether a transaction-mode pooler stands in front of PostgreSQL.
#[derive(Debug, Clone, Default)]
pub struct Session {
    pub limits: Limits,
    pub schema: Schema,
    pub pooler: Pooler,
}

impl Session {
    /// `pool`, built from [`pool_options`] with this session, as the handle commands use.
    pub(crate) fn wrap(&self, pool: PgPool) -> Db {
        Db::new(pool, self.pooler, self.limits, &self.schema)
    }

    /// A transaction on a connection of its own (not from a [`Db`]), carrying the session's
    /// settings behind a pooler as [`Db::begin`] does.
    pub(crate) async fn begin_on<'c>(
        &self,
        conn: &'c mut sqlx::PgConnection,
    ) -> sqlx::Result<sqlx::Transaction<'c, sqlx::Postgres>> {
        use sqlx::Connection as _;
        match self.pooler {
            Pooler::None => conn.begin().await,
            Pooler::Transaction => {
                conn.begin_with(pooled::begin_statement(self.limits, &self.schema))
                    .await
            }
        }
    }
}

/// Where a URL points, for messages: host, port and database, never a password.
pub fn describe(url: &DatabaseUrl) -> String {
    match PgConnectOptions::from_str(url.expose()) {
        Ok(o) => format!(
            "{}:{}/{}",
            o.get_host(),
            o.get_port(),
            o.get_database().unwrap_or("postgres")
        ),
        Err(_) => "(an unreadable URL)".into(),
    }
}

/// The connection and pool options [`pool_in`] uses, for pools that add their own hooks.
///
/// Behind a transaction-mode pooler no session setting is sent (the pooler refuses the
/// `options` startup parameter; each transaction sets them instead, see [`Db`]) and sqlx's
/// statement cache is off, since a statement prepared in one transaction may be missing, or be
/// another client's, in the next.
pub(crate) fn pool_options(
    url: &DatabaseUrl,
    max_connections: u32,
    session: &Session,
) -> anyhow::Result<(PgConnectOptions, PgPoolOptions)> {
    let options = PgConnectOptions::from_str(url.expose())?;
    if let Some(warning) = unverified_tls(&options) {
        tracing::warn!(warning, "The database connection is not verified.");
    }
    let options = options.application_name("replayproof");
    let options = match session.pooler {
        Pooler::None => options
            .options(session.limits.settings())
            .options([("search_path", session.schema.search_path())]),
        Pooler::Transaction => options
            .statement_cache_capacity(0)
            .extra_float_digits(None::<i8>),
    };
    // No ping before each acquire (a round trip per transaction): a connection that died while
    // idle fails its first statement instead, and the batch is retried on a fresh one.
    let pool = PgPoolOptions::new()
        .max_connections(max_connections)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(5));
    Ok((options, pool))
}

/// Why the connection to a database on another host can be read or taken over on the way,
/// if it can: without `sslmode=verify-full` (or `verify-ca`) no certificate is checked, and
/// PostgreSQL's default `prefer` silently falls back to plaintext. None for a local database
/// (a Unix socket, localhost, a loopback address) and for a verified one.
pub fn unverified_tls(options: &PgConnectOptions) -> Option<String> {
    use sqlx::postgres::PgSslMode;
    let host = options.get_host();
    let local = options.get_socket().is_some()
        || host.starts_with('/')
        || host.eq_ignore_ascii_case("localhost")
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    let mode = match options.get_ssl_mode() {
        PgSslMode::VerifyFull | PgSslMode::VerifyCa => return None,
        _ if local => return None,
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
    };
    let fallback = match mode {
        "allow" | "prefer" => ", and falls back to plaintext when TLS is not offered",
        "disable" => ", and sends everything in plaintext",
        _ => "",
    };
    Some(format!(
        "the database at {host} is reached with sslmode={mode}, which checks no certificate{fallback}; \
         add sslmode=verify-full (and sslrootcert=… for a private CA) to the URL"
    ))
}

/// [`unverified_tls`] of a URL; None when it does not parse.
pub fn unverified_tls_of(url: &str) -> Option<String> {
    unverified_tls(&PgConnectOptions::from_str(url).ok()?)
}

/// The schema that holds replayproof's tables and migrations' bookkeeping (`--schema`).
pub const DEFAULT_SCHEMA: &str = "replayproof";

/// The PostgreSQL schema that holds replayproof's tables and its migrations' bookkeeping, so
/// they never collide with a host application's own `outbox` or `_sqlx_migrations`.
///
/// Sessions run with `search_path` set to the schema, then `public`: replayproof's tables
/// (all created by the migrations) are found first, and an effect's own tables in `public`
/// stay reachable by their plain names inside the claim's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema(String);

impl Default for Schema {
    fn default() -> Self {
        Self(DEFAULT_SCHEMA.into())
    }
}

impl FromStr for Schema {
    type Err = String;

    /// A plain lower-case identifier, so it never needs quoting.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut chars = s.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if first_ok && rest_ok && s.len() <= 63 {
            Ok(Self(s.into()))
        } else {
            Err(format!(
                "{s:?} is not a schema name: lower-case letters, digits and _, at most 63"
            ))
        }
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Schema {
    pub(crate) fn search_path(&self) -> String {
        if self.0 == "public" {
            "public".into()
        } else {
            format!("{},public", self.0)
        }
    }
}

/// An error from a pool, with the reason when it is only "timed out": the pool keeps no
/// connection's error, so one direct connection asks PostgreSQL why (refused, no such host, a
/// password it did not take). For a command's first statement, so its error names the cause.
pub async fn with_cause(pool: &Db, error: sqlx::Error) -> anyhow::Error {
    use sqlx::Connection as _;
    if matches!(error, sqlx::Error::PoolTimedOut) {
        let options = pool.connect_options();
        if let Err(direct) = sqlx::PgConnection::connect_with(&options).await {
            return anyhow::Error::new(direct).context("PostgreSQL did not answer");
        }
    }
    error.into()
}

/// Whether a database error says nothing about the data: the connection, the server or the
/// schema is at fault, and the same statement may well succeed later.
///
/// SQLSTATE classes 08 (connection), 40 (deadlock, serialization), 53 (disk full, out of
/// memory, too many connections), 57 (statement timeout, shutdown), 58 (I/O), and the codes
/// 55P03 (lock timeout), 25006 (read-only transaction), 42P01, 42703, 42883 (a missing table,
/// column or function after a bad deploy) and 42501 (a missing privilege).
pub fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            matches!(code.get(..2), Some("08" | "40" | "53" | "57" | "58"))
                || matches!(
                    code.as_ref(),
                    "55P03" | "25006" | "42P01" | "42703" | "42883" | "42501"
                )
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// The database error anywhere in `error`'s chain of causes, if there is one.
pub fn database_error(error: &anyhow::Error) -> Option<&sqlx::Error> {
    error.chain().find_map(|e| e.downcast_ref::<sqlx::Error>())
}

/// Whether a database error is about the data itself (SQLSTATE classes 22 and 23): the same
/// rows will be refused every time.
pub fn is_data_error(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|code| matches!(code.get(..2), Some("22" | "23"))),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unverified_connection_to_another_host_is_warned_about() {
        let warned = |url: &str| unverified_tls_of(url);
        for url in [
            "postgres://u@db.example.com/x",
            "postgres://u@db.example.com/x?sslmode=prefer",
            "postgres://u@10.0.0.5:5432/x?sslmode=require",
            "postgres://u@db.example.com/x?sslmode=disable",
        ] {
            let warning = warned(url).unwrap_or_default();
            assert!(warning.contains("verify-full"), "{url}: {warning}");
        }
        assert!(warned("postgres://u@db.example.com/x")
            .unwrap()
            .contains("falls back to plaintext"));
        for url in [
            "postgres://u@db.example.com/x?sslmode=verify-full",
            "postgres://u@db.example.com/x?sslmode=verify-ca",
            "postgres://u@localhost/x",
            "postgres://u@127.0.0.1:5433/x",
            "postgres://u@[::1]/x",
            "postgres://u@%2Fvar%2Frun%2Fpostgresql/x",
        ] {
            assert_eq!(warned(url), None, "{url}");
        }
    }

    #[test]
    fn a_refused_url_says_why_without_its_password() {
        let error = "postgres://app:pa55-w0rd-secret@db/x?sslmode=verfy-full"
            .parse::<DatabaseUrl>()
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.contains("sslmode") || error.contains("verfy"),
            "{error}"
        );
        assert!(!error.contains("pa55-w0rd-secret"), "{error}");
    }
}

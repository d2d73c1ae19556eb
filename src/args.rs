//! Flag groups several commands share, defined once and flattened into each command's `Args`.

use crate::db::{self, DatabaseUrl, Schema};
use clap::Args;
use std::time::Duration;

/// A default duration as a `--…-ms` flag's number.
pub const fn millis(duration: Duration) -> u64 {
    duration.as_millis() as u64
}

/// The longest wait, timeout or interval any duration flag accepts: a week. Nothing replayproof
/// waits for is longer, and a bound keeps a typo (or `u64::MAX`) from overflowing the clock
/// arithmetic it feeds: such a value is refused with the range, at start.
pub const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

/// A `--…-ms` flag: milliseconds from `min` up to [`MAX_WAIT`].
pub fn ms(min: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(min..=millis(MAX_WAIT))
}

/// A `--…-secs` flag: seconds from `min` up to [`MAX_WAIT`].
pub fn secs(min: u64) -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(min..=MAX_WAIT.as_secs())
}

/// One of PostgreSQL's session timeouts in milliseconds: 0 (off) up to the largest it holds.
pub fn pg_ms() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(0..=i32::MAX as u64)
}

/// An age to filter by, in seconds: up to a hundred years.
pub fn age_secs() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(0..=100 * 365 * 24 * 3600)
}

/// Where PostgreSQL is, which schema holds replayproof's tables, and the time limits every
/// session runs under.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, for example postgres://user:password@localhost:5432/replayproof.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: DatabaseUrl,

    #[command(flatten)]
    pub session: SessionArgs,
}

/// The session settings of [`DatabaseArgs`], for commands whose database is optional.
#[derive(Debug, Clone, Args)]
pub struct SessionArgs {
    /// The PostgreSQL schema of replayproof's tables and migrations; `public` for an
    /// installation made before schemas were configurable.
    #[arg(long, env = "REPLAYPROOF_SCHEMA", default_value = db::DEFAULT_SCHEMA)]
    pub schema: Schema,

    /// PostgreSQL's statement_timeout for every session, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_STATEMENT_TIMEOUT_MS", value_parser = pg_ms(), default_value_t = millis(db::DEFAULT_STATEMENT_TIMEOUT))]
    pub statement_timeout_ms: u64,

    /// PostgreSQL's lock_timeout for every session, in milliseconds: how long a claim waits for
    /// another transaction holding the same key.
    #[arg(long, env = "REPLAYPROOF_LOCK_TIMEOUT_MS", value_parser = pg_ms(), default_value_t = millis(db::DEFAULT_LOCK_TIMEOUT))]
    pub lock_timeout_ms: u64,

    /// PostgreSQL's idle_in_transaction_session_timeout, in milliseconds: a paused or cut-off
    /// process's open transaction (and the claims it holds) ends after this.
    #[arg(long, env = "REPLAYPROOF_IDLE_IN_TRANSACTION_TIMEOUT_MS", value_parser = pg_ms(), default_value_t = millis(db::DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT))]
    pub idle_in_transaction_timeout_ms: u64,
}

impl Default for SessionArgs {
    fn default() -> Self {
        Self {
            schema: Schema::default(),
            statement_timeout_ms: millis(db::DEFAULT_STATEMENT_TIMEOUT),
            lock_timeout_ms: millis(db::DEFAULT_LOCK_TIMEOUT),
            idle_in_transaction_timeout_ms: millis(db::DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT),
        }
    }
}

impl SessionArgs {
    /// A pool of `url` whose sessions run in the schema under the configured time limits.
    pub fn pool(&self, url: &DatabaseUrl, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
        let limits = db::Limits {
            statement_timeout: Duration::from_millis(self.statement_timeout_ms),
            lock_timeout: Duration::from_millis(self.lock_timeout_ms),
            idle_in_transaction_timeout: Duration::from_millis(self.idle_in_transaction_timeout_ms),
            ..db::Limits::default()
        };
        db::pool_in(url, max_connections, limits, &self.schema)
    }
}

impl DatabaseArgs {
    /// A pool whose sessions run in the schema under the configured time limits.
    pub fn pool(&self, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
        self.session.pool(&self.database_url, max_connections)
    }
}

/// The Kafka brokers and the librdkafka properties passed through to every client.
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: String,

    #[command(flatten)]
    pub options: KafkaOptions,
}

/// `--kafka-option`, for commands whose brokers come from elsewhere or are optional.
#[derive(Debug, Clone, Default, Args)]
pub struct KafkaOptions {
    /// A librdkafka property, KEY=VALUE; repeatable. Applied last, so it overrides the defaults
    /// (for example session.timeout.ms=6000 or security.protocol=ssl).
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub kafka_options: Vec<(String, String)>,
}

/// Parses one `KEY=VALUE`.
/// A property whose key names a secret (`sasl.password`) has its value registered, so no log
/// or error prints it; text without `=` is refused without being echoed, as it may be one.
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => {
            if crate::secrets::is_secret_property(k) {
                crate::secrets::register(v);
            }
            Ok((k.to_owned(), v.to_owned()))
        }
        _ => Err("expected KEY=VALUE".to_owned()),
    }
}

/// Renders flags back to arguments, for starting a replayproof process from typed settings.
pub trait ToArgs {
    /// The arguments that parse back to `self`.
    fn to_args(&self) -> Vec<String>;
}

impl ToArgs for DatabaseArgs {
    fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--database-url".into(), self.database_url.expose().into()];
        args.extend(self.session.to_args());
        args
    }
}

impl ToArgs for SessionArgs {
    fn to_args(&self) -> Vec<String> {
        vec![
            "--schema".into(),
            self.schema.to_string(),
            "--statement-timeout-ms".into(),
            self.statement_timeout_ms.to_string(),
            "--lock-timeout-ms".into(),
            self.lock_timeout_ms.to_string(),
            "--idle-in-transaction-timeout-ms".into(),
            self.idle_in_transaction_timeout_ms.to_string(),
        ]
    }
}

impl ToArgs for KafkaArgs {
    fn to_args(&self) -> Vec<String> {
        let mut args = vec!["--brokers".into(), self.brokers.clone()];
        args.extend(self.options.to_args());
        args
    }
}

impl ToArgs for KafkaOptions {
    fn to_args(&self) -> Vec<String> {
        self.kafka_options
            .iter()
            .flat_map(|(k, v)| ["--kafka-option".into(), format!("{k}={v}")])
            .collect()
    }
}

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

/// A duration flag: humantime text (`250ms`, `30s`, `5m`, `1h 30m`) from `min` up to
/// [`MAX_WAIT`]. Each also has its old spelling, a number of milliseconds or seconds
/// (`--lease-secs 300`), accepted as a hidden alias ([`or_old_ms`], [`or_old_secs`]).
pub fn wait(
    min: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |text: &str| within(text, min, MAX_WAIT)
}

/// One of PostgreSQL's session timeouts: 0 (off) up to the largest it holds (`i32::MAX` ms).
pub fn pg_wait() -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    |text: &str| within(text, Duration::ZERO, Duration::from_millis(i32::MAX as u64))
}

fn within(text: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let d = humantime::parse_duration(text)
        .map_err(|e| format!("{e} (a duration such as 250ms, 30s or 5m)"))?;
    let show = |d: Duration| humantime::format_duration(d).to_string();
    if d < min || d > max {
        return Err(format!(
            "{} is not between {} and {}",
            show(d),
            show(min),
            show(max)
        ));
    }
    Ok(d)
}

/// An age to filter by: up to a hundred years.
pub fn age() -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    |text: &str| {
        within(
            text,
            Duration::ZERO,
            Duration::from_secs(100 * 365 * 24 * 3600),
        )
    }
}

/// How long rows are kept: from a second up to a hundred years.
pub fn lifetime() -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    |text: &str| {
        within(
            text,
            Duration::from_secs(1),
            Duration::from_secs(100 * 365 * 24 * 3600),
        )
    }
}

/// A default duration as a flag's text, such as `30s`; computed once per value.
pub fn text(d: Duration) -> &'static str {
    static TEXTS: std::sync::Mutex<Vec<(Duration, &'static str)>> =
        std::sync::Mutex::new(Vec::new());
    let mut texts = TEXTS.lock().expect("texts lock");
    if let Some((_, t)) = texts.iter().find(|(at, _)| *at == d) {
        return t;
    }
    let t: &'static str = Box::leak(humantime::format_duration(d).to_string().into_boxed_str());
    texts.push((d, t));
    t
}

/// A duration as a flag's argument, such as `30s`.
pub fn duration_text(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// A duration given in its humantime spelling, or in its old one in milliseconds, which wins
/// when given (the two cannot both be given).
pub fn or_old_ms(new: Duration, old: Option<u64>) -> Duration {
    old.map_or(new, Duration::from_millis)
}

/// [`or_old_ms`] for an old spelling in seconds.
pub fn or_old_secs(new: Duration, old: Option<u64>) -> Duration {
    old.map_or(new, Duration::from_secs)
}

/// Where PostgreSQL is, which schema holds replayproof's tables, and the time limits every
/// session runs under.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Database")]
pub struct DatabaseArgs {
    /// PostgreSQL URL, for example postgres://user:password@localhost:5432/replayproof.
    /// Repeated (or `[database] shards = [...]`), one per shard: the claims are spread over
    /// them by route key, the buckets split into equal ranges in the order given
    /// (docs/scaling.md).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, required = true, action = clap::ArgAction::Append)]
    pub database_url: Vec<DatabaseUrl>,

    /// How many buckets route keys hash into: a power of two, fixed for the life of the data.
    #[arg(long, env = "REPLAYPROOF_BUCKETS", default_value_t = db::DEFAULT_BUCKETS)]
    pub buckets: u32,

    /// The database URL is a Citus coordinator whose distributed tables have this many shards
    /// (`migrate --citus` creates them): each batch is split into one transaction per Citus
    /// shard, which Citus routes to one worker without two-phase commit.
    #[arg(long, env = "REPLAYPROOF_CITUS_SHARDS", value_name = "SHARD_COUNT")]
    pub citus_shards: Option<usize>,

    /// With several databases, the one (0 for the first `--database-url`) that a command
    /// reading a single database reads: lists of dead letters and expired replays, bulk
    /// retries, erasure, the console. The commands that span every shard ignore it.
    #[arg(long, value_name = "N")]
    pub shard: Option<usize>,

    #[command(flatten)]
    pub session: SessionArgs,
}

/// The session settings of [`DatabaseArgs`], for commands whose database is optional.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Database")]
pub struct SessionArgs {
    /// The PostgreSQL schema of replayproof's tables and migrations; `public` for an
    /// installation made before schemas were configurable.
    #[arg(long, env = "REPLAYPROOF_SCHEMA", default_value = db::DEFAULT_SCHEMA)]
    pub schema: Schema,

    /// PostgreSQL's statement_timeout for every session.
    /// A duration such as 250ms, 30s or 5m; `--statement-timeout-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_STATEMENT_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(db::DEFAULT_STATEMENT_TIMEOUT), value_parser = crate::args::pg_wait(), conflicts_with = "statement_timeout_ms")]
    pub statement_timeout: Duration,

    /// The old spelling of `--statement-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_STATEMENT_TIMEOUT_MS", value_parser = pg_ms(), hide = true)]
    pub statement_timeout_ms: Option<u64>,

    /// PostgreSQL's lock_timeout for every session: how long a claim waits for
    /// another transaction holding the same key.
    /// A duration such as 250ms, 30s or 5m; `--lock-timeout-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_LOCK_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(db::DEFAULT_LOCK_TIMEOUT), value_parser = crate::args::pg_wait(), conflicts_with = "lock_timeout_ms")]
    pub lock_timeout: Duration,

    /// The old spelling of `--lock-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_LOCK_TIMEOUT_MS", value_parser = pg_ms(), hide = true)]
    pub lock_timeout_ms: Option<u64>,

    /// PostgreSQL's idle_in_transaction_session_timeout: a paused or cut-off
    /// process's open transaction (and the claims it holds) ends after this.
    /// A duration such as 250ms, 30s or 5m; `--idle-in-transaction-timeout-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_IDLE_IN_TRANSACTION_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(db::DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT), value_parser = crate::args::pg_wait(), conflicts_with = "idle_in_transaction_timeout_ms")]
    pub idle_in_transaction_timeout: Duration,

    /// The old spelling of `--idle-in-transaction-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_IDLE_IN_TRANSACTION_TIMEOUT_MS", value_parser = pg_ms(), hide = true)]
    pub idle_in_transaction_timeout_ms: Option<u64>,

    /// What stands between replayproof and PostgreSQL: `none` (a direct connection or a
    /// session-mode pooler) or `transaction` (PgBouncer, Supavisor, Neon's or RDS Proxy's
    /// transaction pooling): then no session setting is relied on and every statement runs in
    /// a transaction that sets the schema and the timeouts itself (docs/production.md).
    #[arg(
        long,
        env = "REPLAYPROOF_POOLER",
        value_name = "MODE",
        default_value = "none"
    )]
    pub pooler: db::Pooler,
}

impl Default for SessionArgs {
    fn default() -> Self {
        Self {
            schema: Schema::default(),
            statement_timeout: db::DEFAULT_STATEMENT_TIMEOUT,
            statement_timeout_ms: None,
            lock_timeout: db::DEFAULT_LOCK_TIMEOUT,
            lock_timeout_ms: None,
            idle_in_transaction_timeout: db::DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT,
            idle_in_transaction_timeout_ms: None,
            pooler: db::Pooler::None,
        }
    }
}

impl SessionArgs {
    /// A pool of `url` whose sessions run in the schema under the configured time limits.
    pub fn pool(&self, url: &DatabaseUrl, max_connections: u32) -> anyhow::Result<crate::db::Db> {
        db::pool_in(url, max_connections, &self.session())
    }

    /// Every setting of the sessions the flags give.
    pub fn session(&self) -> db::Session {
        db::Session {
            limits: self.limits(),
            schema: self.schema.clone(),
            pooler: self.pooler,
        }
    }

    /// The session limits the flags give.
    pub fn limits(&self) -> db::Limits {
        db::Limits {
            statement_timeout: crate::args::or_old_ms(
                self.statement_timeout,
                self.statement_timeout_ms,
            ),
            lock_timeout: crate::args::or_old_ms(self.lock_timeout, self.lock_timeout_ms),
            idle_in_transaction_timeout: crate::args::or_old_ms(
                self.idle_in_transaction_timeout,
                self.idle_in_transaction_timeout_ms,
            ),
            ..db::Limits::default()
        }
    }
}

impl DatabaseArgs {
    /// A single database with `url`, at the default session settings.
    pub fn single(url: DatabaseUrl) -> Self {
        Self {
            database_url: vec![url],
            buckets: db::DEFAULT_BUCKETS,
            citus_shards: None,
            shard: None,
            session: SessionArgs::default(),
        }
    }

    /// The first database's URL: the only one, the Citus coordinator, or the first shard.
    pub fn url(&self) -> &DatabaseUrl {
        &self.database_url[0]
    }

    /// Whether the claims are spread over several databases or Citus shards.
    pub fn is_sharded(&self) -> bool {
        self.database_url.len() > 1 || self.citus_shards.is_some_and(|n| n > 1)
    }
}

/// The Kafka brokers and the librdkafka properties passed through to every client.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Kafka")]
pub struct KafkaArgs {
    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: String,

    #[command(flatten)]
    pub options: KafkaOptions,
}

/// `--kafka-option`, for commands whose brokers come from elsewhere or are optional.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Kafka")]
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
        let mut args: Vec<String> = Vec::new();
        for url in &self.database_url {
            args.extend(["--database-url".into(), url.expose().into()]);
        }
        args.extend(["--buckets".into(), self.buckets.to_string()]);
        if let Some(count) = self.citus_shards {
            args.extend(["--citus-shards".into(), count.to_string()]);
        }
        if let Some(shard) = self.shard {
            args.extend(["--shard".into(), shard.to_string()]);
        }
        args.extend(self.session.to_args());
        args
    }
}

impl ToArgs for SessionArgs {
    fn to_args(&self) -> Vec<String> {
        vec![
            "--schema".into(),
            self.schema.to_string(),
            "--statement-timeout".into(),
            duration_text(or_old_ms(self.statement_timeout, self.statement_timeout_ms)),
            "--lock-timeout".into(),
            duration_text(or_old_ms(self.lock_timeout, self.lock_timeout_ms)),
            "--idle-in-transaction-timeout".into(),
            duration_text(or_old_ms(
                self.idle_in_transaction_timeout,
                self.idle_in_transaction_timeout_ms,
            )),
            "--pooler".into(),
            self.pooler.to_string(),
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

/// A moment: an RFC 3339 time (`2026-12-02T10:00:00Z`), or a duration meaning that long ago
/// (`40m`, `2h`, `3days`).
pub fn parse_moment(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    moment_at(text, chrono::Utc::now())
}

/// [`parse_moment`] with `now` given.
pub fn moment_at(
    text: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<chrono::DateTime<chrono::Utc>, String> {
    if let Ok(at) = chrono::DateTime::parse_from_rfc3339(text.trim()) {
        return Ok(at.with_timezone(&chrono::Utc));
    }
    let ago = humantime::parse_duration(text.trim()).map_err(|_| {
        format!("{text:?} is neither an RFC 3339 time (2026-12-02T10:00:00Z) nor a duration ago (40m, 2h)")
    })?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|ago| now.checked_sub_signed(ago))
        .ok_or_else(|| format!("{text:?} is too long ago"))
}

#[cfg(test)]
mod moment_tests {
    use super::*;

    #[test]
    fn a_moment_is_a_time_or_a_duration_ago() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-12-02T10:00:00Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let at = |t| moment_at(t, now).map(|m| m.to_rfc3339());
        assert_eq!(
            at("2026-12-02T09:20:00Z").unwrap(),
            "2026-12-02T09:20:00+00:00"
        );
        assert_eq!(
            at("2026-12-02T10:20:00+01:00").unwrap(),
            "2026-12-02T09:20:00+00:00"
        );
        assert_eq!(at("40m").unwrap(), "2026-12-02T09:20:00+00:00");
        assert_eq!(at("1day").unwrap(), "2026-12-01T10:00:00+00:00");
        assert!(at("yesterday").unwrap_err().contains("RFC 3339"));
        assert!(at("100000000years").is_err());
    }
}

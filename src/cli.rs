//! The command line: one `clap` definition for every flag and its environment variable.

use crate::consume::{self, BatchProcessor, ConsumerSettings, EffectRetry};
use crate::db::{self, DatabaseUrl};
use crate::effect::BuiltinEffect;
use crate::telemetry::{self, ConsumeMetrics, Health};
use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::time::Duration;

/// Makes webhook redeliveries harmless: one visible effect per event, whatever is redelivered.
#[derive(Debug, Parser)]
#[command(name = "replayproof", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations and exit.
    Migrate(DatabaseArgs),
    /// Join the consumer group and apply each event of the topic exactly once.
    Consume(ConsumeArgs),
    /// Receive signed webhooks over HTTP and write them to the topic.
    Ingest(IngestArgs),
    /// Deliver the outbox's operations under a lease, with idempotency keys.
    Dispatch(DispatchArgs),
    /// Inspect events and their operations, and retry or resolve them.
    #[command(subcommand)]
    Events(EventsCommand),
    /// The whole promise end to end with no services: a storm of signed webhooks, a consumer
    /// killed mid-stream, a flaky downstream, and a report that every event had one effect.
    Demo(DemoArgs),
    /// Ingest, consume and dispatch in one process for local development, on an embedded
    /// broker and database unless real ones are configured.
    Dev(DevArgs),
    /// One screen for an operator: lag, claims, the outbox and dead letters.
    Status(StatusArgs),
    /// Exit 0 when the URL answers 2xx: a health check for images without curl.
    Probe {
        /// For example http://127.0.0.1:9464/healthz.
        url: String,
    },
    /// Inspect and replay messages that were not valid envelopes.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLettersCommand),
}

#[derive(Debug, Args)]
pub struct DispatchArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Names this worker in leases and attempts. [default: host name and process id]
    #[arg(long, env = "REPLAYPROOF_WORKER")]
    pub worker: Option<String>,

    /// Operations leased, and sent concurrently, at once.
    #[arg(long, env = "REPLAYPROOF_DISPATCH_BATCH", default_value_t = 32, value_parser = clap::value_parser!(i64).range(1..=1000))]
    pub batch_size: i64,

    /// How long a lease lasts, in seconds: longer than the slowest realistic request, shorter
    /// than anyone's patience with an operation whose worker died.
    #[arg(long, env = "REPLAYPROOF_LEASE_SECS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_secs: u64,

    /// The timeout of one request, in milliseconds; must be well under the lease.
    #[arg(long, env = "REPLAYPROOF_REQUEST_TIMEOUT_MS", default_value_t = 10_000)]
    pub request_timeout_ms: u64,

    /// The first retry's delay in milliseconds; doubled for each further attempt, with jitter.
    #[arg(long, env = "REPLAYPROOF_BACKOFF_MS", default_value_t = 1_000)]
    pub backoff_ms: u64,

    /// The longest delay between attempts, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_MAX_BACKOFF_MS", default_value_t = 300_000)]
    pub max_backoff_ms: u64,

    /// How often to look for due operations when none were due, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_POLL_MS", default_value_t = 500)]
    pub poll_ms: u64,

    /// Where to serve Prometheus /metrics and /healthz.
    #[arg(
        long,
        env = "REPLAYPROOF_METRICS_ADDR",
        default_value = "127.0.0.1:9465"
    )]
    pub metrics_addr: SocketAddr,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Distinct events in the storm.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub events: u64,

    /// The share of events delivered more than once.
    #[arg(long, default_value_t = 0.3)]
    pub redeliver: f64,

    /// The storm's random seed.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Consumer processes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub consumers: u64,

    /// Concurrent senders.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub senders: u64,

    /// Kafka bootstrap servers; without them, an in-process mock cluster.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    /// PostgreSQL URL; without it, a throwaway cluster.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<DatabaseUrl>,
}

#[derive(Debug, Args)]
pub struct DevArgs {
    /// Kafka bootstrap servers; without them, an in-process mock cluster.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    /// PostgreSQL URL; without it, a throwaway cluster from the local PostgreSQL binaries.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<DatabaseUrl>,

    /// A sources file, as for `ingest`; without it, development sources for stripe, github,
    /// svix (standard-webhooks), shopify and slack.
    #[arg(long, env = "REPLAYPROOF_CONFIG")]
    pub config: Option<std::path::PathBuf>,

    #[arg(long, env = "REPLAYPROOF_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = "webhooks")]
    pub topic: String,

    /// Partitions of the embedded broker's topic.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,

    /// Also POST each event here through the outbox, and run a dispatcher.
    #[arg(long, env = "REPLAYPROOF_TARGET_URL")]
    pub target_url: Option<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Kafka bootstrap servers; without them the lag is not shown.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = "webhooks")]
    pub topic: String,

    #[arg(long, env = "REPLAYPROOF_GROUP", default_value = "replayproof")]
    pub group: String,

    /// A librdkafka property, KEY=VALUE; repeatable.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub kafka_options: Vec<(String, String)>,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct OperatorArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Who is acting, for the audit table. [default: $USER]
    #[arg(long, env = "REPLAYPROOF_ACTOR")]
    pub actor: Option<String>,

    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

impl OperatorArgs {
    pub fn actor(&self) -> String {
        self.actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "operator".into())
    }
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// List events, newest first.
    List {
        #[command(flatten)]
        op: OperatorArgs,
        /// A claim status (done, failed) or an operation state (pending, in_progress,
        /// retryable, uncertain, done, failed, dead).
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        source: Option<String>,
        /// Only events claimed at least this many seconds ago.
        #[arg(long)]
        older_than_secs: Option<u64>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Everything about one event: its claim, effect rows, operations, every attempt, dead
    /// letters and key conflicts.
    Show {
        #[command(flatten)]
        op: OperatorArgs,
        key: String,
    },
    /// Send a failed, uncertain or dead operation again with the same idempotency key, or run a
    /// failed local effect again from its stored payload.
    Retry {
        #[command(flatten)]
        op: OperatorArgs,
        /// The event to retry; without it, every event matching --state (and --source, --since).
        #[arg(required_unless_present = "state")]
        key: Option<String>,
        /// Only this operation of the event.
        #[arg(long)]
        operation: Option<String>,
        /// The effect to run again for a failed local effect, instead of the effects recorded on
        /// its claim (needed only for an event whose consumer ran a library effect).
        #[arg(long, value_enum)]
        effect: Option<BuiltinEffect>,
        /// Bulk: retry every event whose claim or an operation is in this state.
        #[arg(long, value_parser = ["failed", "uncertain", "dead"], conflicts_with = "key")]
        state: Option<String>,
        /// Bulk: only events of this source.
        #[arg(long, requires = "state")]
        source: Option<String>,
        /// Bulk: only events claimed at or after this time (RFC 3339).
        #[arg(long, requires = "state")]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Bulk: at most this many events.
        #[arg(long, default_value_t = 1000, requires = "state")]
        limit: i64,
        /// Bulk: list the events that would be retried, and change nothing.
        #[arg(long, requires = "state")]
        dry_run: bool,
        #[arg(long)]
        reason: String,
    },
    /// Settle an event's operations (or failed claim) by hand.
    Resolve {
        #[command(flatten)]
        op: OperatorArgs,
        key: String,
        #[arg(long = "as", value_parser = ["done", "dead"])]
        to: String,
        #[arg(long)]
        operation: Option<String>,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    List {
        #[command(flatten)]
        op: OperatorArgs,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// One dead letter with its raw key and value.
    Show {
        #[command(flatten)]
        op: OperatorArgs,
        id: i64,
    },
    /// Produce a dead letter's raw bytes again, to its topic or another.
    Replay {
        #[command(flatten)]
        op: OperatorArgs,
        id: i64,
        /// Kafka bootstrap servers.
        #[arg(long, env = "REPLAYPROOF_BROKERS")]
        brokers: String,
        /// Produce to this topic instead of the one it came from.
        #[arg(long)]
        topic: Option<String>,
        /// A librdkafka property for the producer, KEY=VALUE; repeatable.
        #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = parse_key_value)]
        kafka_options: Vec<(String, String)>,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// The TOML file naming the sources (see replayproof.example.toml). Flags and environment
    /// variables override its settings.
    #[arg(long, env = "REPLAYPROOF_CONFIG")]
    pub config: std::path::PathBuf,

    /// Where to listen for webhooks (and /healthz, /readyz). [default: 0.0.0.0:8080]
    #[arg(long, env = "REPLAYPROOF_LISTEN")]
    pub listen: Option<SocketAddr>,

    /// Where to serve Prometheus /metrics: a listener of its own, never the public webhook port.
    #[arg(
        long,
        env = "REPLAYPROOF_METRICS_ADDR",
        default_value = "127.0.0.1:9463"
    )]
    pub metrics_addr: SocketAddr,

    /// Webhook requests handled at once; more get 503 with Retry-After.
    #[arg(long, env = "REPLAYPROOF_MAX_IN_FLIGHT", default_value_t = crate::ingest::DEFAULT_MAX_IN_FLIGHT, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_in_flight: usize,

    /// Open connections at once; more wait in the kernel's backlog.
    #[arg(long, env = "REPLAYPROOF_MAX_CONNECTIONS", default_value_t = crate::ingest::DEFAULT_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_connections: usize,

    /// How long a sender has to deliver its whole body before the answer is 408, in
    /// milliseconds.
    #[arg(long, env = "REPLAYPROOF_BODY_TIMEOUT_MS", default_value_t = crate::ingest::DEFAULT_BODY_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout_ms: u64,

    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    /// The topic the envelopes are written to. [default: webhooks]
    #[arg(long, env = "REPLAYPROOF_TOPIC")]
    pub topic: Option<String>,

    /// The largest body accepted, in bytes; larger ones get 413. [default: 1048576]
    #[arg(long, env = "REPLAYPROOF_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,

    /// How long the broker has to acknowledge a record before the answer is 503, in
    /// milliseconds. Keep it well under the senders' own timeouts (GitHub waits 10 s).
    /// [default: 5000]
    #[arg(long, env = "REPLAYPROOF_PRODUCE_TIMEOUT_MS")]
    pub produce_timeout_ms: Option<u64>,

    /// A librdkafka property for the producer, KEY=VALUE; repeatable.
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub kafka_options: Vec<(String, String)>,
}

impl IngestArgs {
    /// The file's settings with the flags and environment over them.
    pub fn settings(
        &self,
        file: &crate::ingest::config::FileConfig,
    ) -> anyhow::Result<crate::ingest::IngestSettings> {
        let listen = self
            .listen
            .or(file.listen)
            .unwrap_or_else(|| ([0, 0, 0, 0], 8080).into());
        let brokers = self.brokers.clone().or_else(|| file.brokers.clone());
        let brokers = brokers
            .context("no brokers: set --brokers, REPLAYPROOF_BROKERS or `brokers` in the file")?;
        let topic = self
            .topic
            .clone()
            .or_else(|| file.topic.clone())
            .unwrap_or_else(|| "webhooks".into());
        let mut settings = crate::ingest::IngestSettings::new(listen, &brokers, &topic);
        settings.kafka_options = self.kafka_options.clone();
        settings.metrics_listen = Some(self.metrics_addr);
        settings.max_in_flight = self.max_in_flight;
        settings.max_connections = self.max_connections;
        settings.body_timeout = Duration::from_millis(self.body_timeout_ms);
        if let Some(n) = self.max_body_bytes.or(file.max_body_bytes) {
            anyhow::ensure!(
                n > 0 && n <= 16 * 1024 * 1024,
                "max_body_bytes must be between 1 byte and 16 MiB"
            );
            settings.max_body_bytes = n;
        }
        if let Some(ms) = self.produce_timeout_ms.or(file.produce_timeout_ms) {
            anyhow::ensure!(ms > 0, "produce_timeout_ms must be positive");
            settings.produce_timeout = Duration::from_millis(ms);
        }
        Ok(settings)
    }
}

#[derive(Debug, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, for example postgres://user:password@localhost:5432/replayproof.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: DatabaseUrl,

    /// PostgreSQL's statement_timeout for every session, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_STATEMENT_TIMEOUT_MS", default_value_t = db::DEFAULT_STATEMENT_TIMEOUT_MS)]
    pub statement_timeout_ms: u64,

    /// PostgreSQL's lock_timeout for every session, in milliseconds: how long a claim waits for
    /// another transaction holding the same key.
    #[arg(long, env = "REPLAYPROOF_LOCK_TIMEOUT_MS", default_value_t = db::DEFAULT_LOCK_TIMEOUT_MS)]
    pub lock_timeout_ms: u64,

    /// PostgreSQL's idle_in_transaction_session_timeout, in milliseconds: a paused or cut-off
    /// process's open transaction (and the claims it holds) ends after this.
    #[arg(long, env = "REPLAYPROOF_IDLE_IN_TRANSACTION_TIMEOUT_MS", default_value_t = db::DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS)]
    pub idle_in_transaction_timeout_ms: u64,
}

impl DatabaseArgs {
    /// A pool whose sessions run under the configured time limits.
    pub fn pool(&self, max_connections: u32) -> anyhow::Result<sqlx::PgPool> {
        let limits = db::Limits {
            statement_timeout: Duration::from_millis(self.statement_timeout_ms),
            lock_timeout: Duration::from_millis(self.lock_timeout_ms),
            idle_in_transaction_timeout: Duration::from_millis(self.idle_in_transaction_timeout_ms),
            ..db::Limits::default()
        };
        db::pool_with(&self.database_url, max_connections, limits)
    }
}

#[derive(Debug, Args)]
pub struct ConsumeArgs {
    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: String,

    /// The topic the envelopes are written to.
    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = "webhooks")]
    pub topic: String,

    /// The consumer group; start more consumers with the same group to share the partitions.
    #[arg(long, env = "REPLAYPROOF_GROUP", default_value = "replayproof")]
    pub group: String,

    #[command(flatten)]
    pub database: DatabaseArgs,

    /// The effect applied to each event, in the same transaction as its claim. Repeat it (or
    /// separate with commas) to apply several in order, for example ledger,http.
    #[arg(long = "effect", env = "REPLAYPROOF_EFFECT", value_enum, value_delimiter = ',', default_values_t = [BuiltinEffect::Ledger])]
    pub effects: Vec<BuiltinEffect>,

    /// With --effect http: where each event is POSTed (by `replayproof dispatch`).
    #[arg(long, env = "REPLAYPROOF_TARGET_URL")]
    pub target_url: Option<String>,

    /// With --effect http: a URL template, `{key}` replaced by the operation key, that answers
    /// 2xx when the downstream already has the operation and 404 when it does not. Used to
    /// settle uncertain outcomes without resending.
    #[arg(long, env = "REPLAYPROOF_RECONCILE_URL")]
    pub reconcile_url: Option<String>,

    /// With --effect http: attempts before an operation is dead.
    #[arg(long, env = "REPLAYPROOF_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,

    /// A librdkafka property, KEY=VALUE; repeatable. Applied last, so it overrides the defaults
    /// (for example session.timeout.ms=6000 or security.protocol=ssl).
    #[arg(long = "kafka-option", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub kafka_options: Vec<(String, String)>,

    /// The most messages of one partition applied in one transaction.
    #[arg(long, env = "REPLAYPROOF_BATCH_SIZE", default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,

    /// How long to wait for more messages once a batch has its first one, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_LINGER_MS", default_value_t = 5)]
    pub linger_ms: u64,

    /// Messages queued for one partition before it is paused until the database catches up.
    #[arg(long, env = "REPLAYPROOF_MAX_BACKLOG", default_value_t = 5_000)]
    pub max_backlog: usize,

    /// How often committed batches' offsets are committed to Kafka, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_COMMIT_INTERVAL_MS", default_value_t = 200)]
    pub commit_interval_ms: u64,

    /// Attempts of a failing effect before its event is recorded as failed.
    #[arg(long, env = "REPLAYPROOF_EFFECT_ATTEMPTS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub effect_attempts: u32,

    /// The longest pause between retries of a batch that failed on a database error, in
    /// milliseconds.
    #[arg(
        long,
        env = "REPLAYPROOF_MAX_RETRY_BACKOFF_MS",
        default_value_t = 5_000
    )]
    pub max_retry_backoff_ms: u64,

    /// On SIGTERM, SIGINT or a revoke: how long batches in flight may take to finish, in seconds.
    #[arg(long, env = "REPLAYPROOF_SHUTDOWN_GRACE_SECS", default_value_t = 20)]
    pub shutdown_grace_secs: u64,

    /// The longest one attempt at a batch may take before it is abandoned (rolled back) and
    /// retried, in seconds.
    #[arg(long, env = "REPLAYPROOF_BATCH_TIMEOUT_SECS", default_value_t = consume::DEFAULT_BATCH_TIMEOUT_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_timeout_secs: u64,

    /// /healthz fails once a partition has not committed its batch for this long, or Kafka has
    /// reported errors this long without a message, in seconds.
    #[arg(long, env = "REPLAYPROOF_UNHEALTHY_AFTER_SECS", default_value_t = consume::DEFAULT_UNHEALTHY_AFTER_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    pub unhealthy_after_secs: u64,

    /// The process exits non-zero once a partition has not committed its batch for this long,
    /// so the group hands its partitions to another member, in seconds.
    #[arg(long, env = "REPLAYPROOF_STALL_EXIT_SECS", default_value_t = consume::DEFAULT_STALL_EXIT_SECS, value_parser = clap::value_parser!(u64).range(1..))]
    pub stall_exit_secs: u64,

    /// Connections in the PostgreSQL pool; each partition's batch uses one.
    #[arg(long, env = "REPLAYPROOF_DB_POOL_SIZE", default_value_t = 16)]
    pub db_pool_size: u32,

    /// Where to serve Prometheus /metrics and /healthz.
    #[arg(
        long,
        env = "REPLAYPROOF_METRICS_ADDR",
        default_value = "127.0.0.1:9464"
    )]
    pub metrics_addr: SocketAddr,

    /// Apply the database migrations before consuming.
    #[arg(long, env = "REPLAYPROOF_MIGRATE")]
    pub migrate: bool,
}

fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

impl ConsumeArgs {
    /// The outbox effect's settings, when a target is given.
    pub fn http_outbox(&self) -> Option<crate::effect::HttpOutbox> {
        self.target_url
            .clone()
            .map(|target_url| crate::effect::HttpOutbox {
                target_url,
                reconcile_url: self.reconcile_url.clone(),
                max_attempts: self.max_attempts,
            })
    }

    pub fn settings(&self) -> ConsumerSettings {
        ConsumerSettings {
            kafka_options: self.kafka_options.clone(),
            batch_size: self.batch_size as usize,
            linger: Duration::from_millis(self.linger_ms),
            max_backlog: self.max_backlog,
            commit_interval: Duration::from_millis(self.commit_interval_ms),
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
            max_retry_backoff: Duration::from_millis(self.max_retry_backoff_ms),
            batch_timeout: Duration::from_secs(self.batch_timeout_secs),
            unhealthy_after: Duration::from_secs(self.unhealthy_after_secs),
            stall_exit_after: Duration::from_secs(self.stall_exit_secs),
            ..ConsumerSettings::new(&self.brokers, &self.topic, &self.group)
        }
    }
}

/// Runs a parsed command line to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate(args) => {
            let pool = db::pool(&args.database_url, 1)?;
            db::migrate(&pool).await?;
            tracing::info!("Migrations applied.");
            Ok(())
        }
        Command::Consume(args) => run_consume(args).await,
        Command::Ingest(args) => run_ingest(args).await,
        Command::Dispatch(args) => run_dispatch(args).await,
        Command::Demo(args) => {
            anyhow::ensure!(
                (0.0..=5.0).contains(&args.redeliver),
                "--redeliver is a share between 0 and 5"
            );
            let passed = crate::demo::run(crate::demo::DemoOptions {
                events: args.events as usize,
                redeliver: args.redeliver,
                seed: args.seed,
                consumers: args.consumers as usize,
                senders: args.senders as usize,
                brokers: args.brokers,
                database_url: args.database_url,
            })
            .await?;
            anyhow::ensure!(passed, "some event did not have exactly one effect");
            Ok(())
        }
        Command::Dev(args) => {
            crate::dev::run(crate::dev::DevOptions {
                brokers: args.brokers,
                database_url: args.database_url,
                config: args.config,
                listen: args.listen,
                topic: args.topic,
                partitions: args.partitions,
                target_url: args.target_url,
            })
            .await
        }
        Command::Probe { url } => {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?;
            let status = client.get(&url).send().await.context("probing")?.status();
            anyhow::ensure!(status.is_success(), "{url} answered {status}");
            Ok(())
        }
        Command::Status(args) => {
            let pool = args.database.pool(2)?;
            let kafka = args
                .brokers
                .clone()
                .map(|brokers| crate::status::KafkaTarget {
                    brokers,
                    topic: args.topic.clone(),
                    group: args.group.clone(),
                    options: args.kafka_options.clone(),
                });
            let status = crate::status::gather(&pool, kafka).await?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print!("{}", crate::status::render(&status));
            }
            Ok(())
        }
        Command::Events(command) => crate::cli_ops::events(command).await,
        Command::DeadLetters(command) => crate::cli_ops::dead_letters(command).await,
    }
}

/// Serves `/metrics` and `/healthz` until `shutdown`; returns what `/healthz` reads.
async fn serve_metrics(
    addr: SocketAddr,
    registry: prometheus::Registry,
    shutdown: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Health> {
    let health = Health::default();
    let addr = telemetry::serve_metrics(
        addr,
        registry,
        health.clone(),
        shutdown.clone().cancelled_owned(),
    )
    .await
    .context("starting the metrics server")?;
    tracing::info!(%addr, "Serving /metrics and /healthz.");
    Ok(health)
}

async fn run_consume(args: ConsumeArgs) -> anyhow::Result<()> {
    let shutdown = crate::shutdown::on_signal();
    let registry = prometheus::Registry::new();
    let metrics = ConsumeMetrics::new(&registry)?;
    let health = serve_metrics(args.metrics_addr, registry, &shutdown).await?;
    let pool = args.database.pool(args.db_pool_size)?;
    if args.migrate {
        db::migrate(&pool).await?;
    }
    let processor = BatchProcessor {
        pool,
        effect: BuiltinEffect::build_all(&args.effects, args.http_outbox())?,
        retry: EffectRetry {
            attempts: args.effect_attempts,
            ..EffectRetry::default()
        },
    };
    consume::run_with_health(args.settings(), processor, metrics, health, shutdown).await
}

async fn run_ingest(args: IngestArgs) -> anyhow::Result<()> {
    let file = crate::ingest::config::FileConfig::load(&args.config)?;
    let sources = file.sources()?;
    anyhow::ensure!(
        !sources.is_empty(),
        "{} names no sources",
        args.config.display()
    );
    let settings = args.settings(&file)?;
    let shutdown = crate::shutdown::on_signal();
    let running =
        crate::ingest::start(settings, sources, prometheus::Registry::new(), shutdown).await?;
    running.stopped().await
}

async fn run_dispatch(args: DispatchArgs) -> anyhow::Result<()> {
    let shutdown = crate::shutdown::on_signal();
    let registry = prometheus::Registry::new();
    let metrics = crate::dispatch::DispatchMetrics::new(&registry)?;
    let health = serve_metrics(args.metrics_addr, registry, &shutdown).await?;
    let pool = args.database.pool((args.batch_size as u32).clamp(2, 64))?;
    let worker = args.worker.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "host".into());
        format!("{}-{}", host.trim(), std::process::id())
    });
    let settings = crate::dispatch::DispatchSettings {
        batch_size: args.batch_size,
        lease: Duration::from_secs(args.lease_secs),
        request_timeout: Duration::from_millis(args.request_timeout_ms),
        poll_interval: Duration::from_millis(args.poll_ms),
        backoff_base: Duration::from_millis(args.backoff_ms),
        backoff_max: Duration::from_millis(args.max_backoff_ms),
        ..crate::dispatch::DispatchSettings::new(&worker)
    };
    let mut dispatcher = crate::dispatch::Dispatcher::new(settings, pool, metrics)?;
    dispatcher.health = health;
    dispatcher.run(shutdown).await
}

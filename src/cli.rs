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
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// The TOML file naming the sources (see replayproof.example.toml). Flags and environment
    /// variables override its settings.
    #[arg(long, env = "REPLAYPROOF_CONFIG")]
    pub config: std::path::PathBuf,

    /// Where to listen for webhooks (and /healthz, /readyz, /metrics). [default: 0.0.0.0:8080]
    #[arg(long, env = "REPLAYPROOF_LISTEN")]
    pub listen: Option<SocketAddr>,

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

    /// The effect applied to each event, in the same transaction as its claim.
    #[arg(long, env = "REPLAYPROOF_EFFECT", value_enum, default_value_t = BuiltinEffect::Ledger)]
    pub effect: BuiltinEffect,

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
    pub fn settings(&self) -> ConsumerSettings {
        ConsumerSettings {
            kafka_options: self.kafka_options.clone(),
            batch_size: self.batch_size as usize,
            linger: Duration::from_millis(self.linger_ms),
            max_backlog: self.max_backlog,
            commit_interval: Duration::from_millis(self.commit_interval_ms),
            shutdown_grace: Duration::from_secs(self.shutdown_grace_secs),
            max_retry_backoff: Duration::from_millis(self.max_retry_backoff_ms),
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
    }
}

async fn run_consume(args: ConsumeArgs) -> anyhow::Result<()> {
    let shutdown = crate::shutdown::on_signal();
    let registry = prometheus::Registry::new();
    let metrics = ConsumeMetrics::new(&registry)?;
    let health = Health::default();
    health.set(true);
    let addr = telemetry::serve_metrics(
        args.metrics_addr,
        registry,
        health,
        shutdown.clone().cancelled_owned(),
    )
    .await
    .context("starting the metrics server")?;
    tracing::info!(%addr, "Serving /metrics and /healthz.");
    let pool = db::pool(&args.database.database_url, args.db_pool_size)?;
    if args.migrate {
        db::migrate(&pool).await?;
    }
    let processor = BatchProcessor {
        pool,
        effect: args.effect.build(),
        retry: EffectRetry {
            attempts: args.effect_attempts,
            ..EffectRetry::default()
        },
    };
    consume::run(args.settings(), processor, metrics, shutdown).await
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

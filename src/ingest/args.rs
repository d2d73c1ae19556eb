//! `replayproof ingest`'s flags. Like every command's, they are layered over the environment and
//! the configuration file's `[ingest]` and `[kafka]` settings ([`crate::config`]); the file's
//! sources are read by [`super::config::FileConfig`].

use super::config::FileConfig;
use super::{
    IngestSettings, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_SHUTDOWN_DELAY,
};
use crate::args::KafkaOptions;
use crate::kafka::DEFAULT_TOPIC;
use anyhow::Context as _;
use clap::Args;
use std::net::SocketAddr;
use std::time::Duration;

/// Where webhooks arrive (`--listen`).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";
/// Where ingest serves `/metrics` (`--metrics-addr`); off the public listener.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9463";

/// Its sources come from the configuration file's `[[ingest.sources]]` (`--config`).
#[derive(Debug, Clone, Args)]
pub struct IngestArgs {
    /// Where to listen for webhooks (and /livez, /readyz, /healthz). [default: 0.0.0.0:8080]
    #[arg(long, env = "REPLAYPROOF_LISTEN")]
    pub listen: Option<SocketAddr>,

    /// Where to serve Prometheus /metrics: a listener of its own, never the public webhook port.
    #[arg(long, env = "REPLAYPROOF_METRICS_ADDR", default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: SocketAddr,

    /// Verified webhooks being written to Kafka at once; more get 503 with Retry-After. A
    /// request takes a place only once its body has arrived and its signature checked out.
    #[arg(long, env = "REPLAYPROOF_MAX_IN_FLIGHT", default_value_t = DEFAULT_MAX_IN_FLIGHT, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_in_flight: usize,

    /// Open connections at once; more wait in the kernel's backlog.
    #[arg(long, env = "REPLAYPROOF_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_connections: usize,

    /// How long a sender has to deliver its whole body before the answer is 408, in
    /// milliseconds.
    /// A duration such as 250ms, 30s or 5m; `--body-timeout-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_BODY_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(DEFAULT_BODY_TIMEOUT), value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "body_timeout_ms")]
    pub body_timeout: Duration,

    /// The old spelling of `--body-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_BODY_TIMEOUT_MS", value_parser = crate::args::ms(1), hide = true)]
    pub body_timeout_ms: Option<u64>,

    /// How long a connection has to send a request's headers, from when it opens or from its
    /// previous answer: half-sent requests and idle keep-alive connections
    /// are closed after it, so they cannot hold --max-connections places.
    /// A duration such as 250ms, 30s or 5m; `--header-timeout-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_HEADER_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(DEFAULT_HEADER_TIMEOUT), value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "header_timeout_ms")]
    pub header_timeout: Duration,

    /// The old spelling of `--header-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_HEADER_TIMEOUT_MS", value_parser = crate::args::ms(1), hide = true)]
    pub header_timeout_ms: Option<u64>,

    /// After SIGTERM, how long /readyz answers 503 while webhooks are still accepted and
    /// acknowledged, before the listener closes: long enough for the load balancer to stop
    /// routing here (a Kubernetes Service takes a few seconds). 0s closes it at once.
    #[arg(long, env = "REPLAYPROOF_SHUTDOWN_DELAY", value_name = "DURATION", default_value = crate::args::text(DEFAULT_SHUTDOWN_DELAY), value_parser = crate::args::wait(Duration::ZERO))]
    pub shutdown_delay: Duration,

    /// Kafka bootstrap servers, comma-separated host:port.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    /// The topic the envelopes are written to. [default: webhooks]
    #[arg(long, env = "REPLAYPROOF_TOPIC")]
    pub topic: Option<String>,

    /// The largest body accepted, in bytes; larger ones get 413. [default: 1048576]
    #[arg(long, env = "REPLAYPROOF_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,

    /// How long the broker has to acknowledge a record before the answer is 503; keep it well
    /// under the senders' own timeouts (GitHub waits 10 s). A duration such as 250ms, 30s or
    /// 5m; `--produce-timeout-ms` (milliseconds) is its old spelling. [default: 5s]
    #[arg(long, env = "REPLAYPROOF_PRODUCE_TIMEOUT", value_name = "DURATION", value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "produce_timeout_ms")]
    pub produce_timeout: Option<Duration>,

    /// The old spelling of `--produce-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_PRODUCE_TIMEOUT_MS", value_parser = crate::args::ms(1), hide = true)]
    pub produce_timeout_ms: Option<u64>,

    #[command(flatten)]
    pub kafka: KafkaOptions,
}

impl IngestArgs {
    /// The settings, from the flags (layered over the environment and the file).
    pub fn settings(&self) -> anyhow::Result<IngestSettings> {
        let listen = match self.listen {
            Some(listen) => listen,
            None => DEFAULT_LISTEN.parse()?,
        };
        let brokers = self
            .brokers
            .clone()
            .context("no brokers: set --brokers, REPLAYPROOF_BROKERS or `brokers` in the file")?;
        let topic = self.topic.clone().unwrap_or_else(|| DEFAULT_TOPIC.into());
        let mut settings = IngestSettings::new(listen, &brokers, &topic);
        settings.kafka_options = self.kafka.kafka_options.clone();
        settings.metrics_listen = Some(self.metrics_addr);
        settings.max_in_flight = self.max_in_flight;
        settings.max_connections = self.max_connections;
        settings.body_timeout = crate::args::or_old_ms(self.body_timeout, self.body_timeout_ms);
        settings.header_timeout =
            crate::args::or_old_ms(self.header_timeout, self.header_timeout_ms);
        settings.shutdown_delay = self.shutdown_delay;
        if let Some(n) = self.max_body_bytes {
            anyhow::ensure!(
                n > 0 && n <= 16 * 1024 * 1024,
                "max_body_bytes must be between 1 byte and 16 MiB"
            );
            settings.max_body_bytes = n;
        }
        let old = self.produce_timeout_ms.map(Duration::from_millis);
        if let Some(timeout) = self.produce_timeout.or(old) {
            settings.produce_timeout = timeout;
        }
        Ok(settings)
    }

    /// Loads the configuration file's sources and runs the ingress until a signal stops it.
    pub async fn run(self, config: Option<&crate::config::ConfigFile>) -> anyhow::Result<()> {
        let config = config.context(
            "ingest reads its sources from the configuration file: set --config or REPLAYPROOF_CONFIG",
        )?;
        let sources = FileConfig::from_config(config)?.sources()?;
        anyhow::ensure!(
            !sources.is_empty(),
            "{} names no [[ingest.sources]]",
            config.path.display()
        );
        let settings = self.settings()?;
        // Ingest serves `/metrics` on its own listener (`metrics_listen`), never the webhook port.
        let process = crate::shutdown::Process::start("ingest", None).await?;
        super::Ingress::build(settings, sources, process.registry)
            .await?
            .run_until_stopped(process.shutdown)
            .stopped()
            .await
    }
}

//! `replayproof dispatch`'s flags, and the dispatcher process they start.

use super::*;
use crate::args::{millis, DatabaseArgs};
use clap::Args;
use std::net::SocketAddr;

/// Where a dispatcher serves `/metrics` and `/healthz` (`--metrics-addr`).
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9465";

#[derive(Debug, Clone, Args)]
pub struct DispatchArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Names this worker in leases and attempts. [default: host name and process id]
    #[arg(long, env = "REPLAYPROOF_WORKER")]
    pub worker: Option<String>,

    /// Operations leased, and sent concurrently, at once.
    #[arg(long, env = "REPLAYPROOF_DISPATCH_BATCH", default_value_t = DEFAULT_BATCH_SIZE, value_parser = clap::value_parser!(i64).range(1..=1000))]
    pub batch_size: i64,

    /// How long a lease lasts, in seconds: longer than the slowest realistic request, shorter
    /// than anyone's patience with an operation whose worker died.
    #[arg(long, env = "REPLAYPROOF_LEASE_SECS", default_value_t = DEFAULT_LEASE.as_secs(), value_parser = crate::args::secs(1))]
    pub lease_secs: u64,

    /// The timeout of one request, in milliseconds; must be well under the lease.
    #[arg(long, env = "REPLAYPROOF_REQUEST_TIMEOUT_MS", default_value_t = millis(DEFAULT_REQUEST_TIMEOUT), value_parser = crate::args::ms(1))]
    pub request_timeout_ms: u64,

    /// The first retry's delay in milliseconds; doubled for each further attempt, with jitter.
    #[arg(long, env = "REPLAYPROOF_BACKOFF_MS", default_value_t = millis(DEFAULT_BACKOFF), value_parser = crate::args::ms(0))]
    pub backoff_ms: u64,

    /// The longest delay between attempts, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_MAX_BACKOFF_MS", default_value_t = millis(DEFAULT_MAX_BACKOFF), value_parser = crate::args::ms(1))]
    pub max_backoff_ms: u64,

    /// How often to look for due operations when none were due, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_POLL_MS", default_value_t = millis(DEFAULT_POLL), value_parser = crate::args::ms(1))]
    pub poll_ms: u64,

    /// Where to serve Prometheus /metrics and /healthz.
    #[arg(long, env = "REPLAYPROOF_METRICS_ADDR", default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: SocketAddr,

    /// A PEM file of CA certificates trusted besides the system's roots, for a downstream
    /// behind a private CA.
    #[arg(long, env = "REPLAYPROOF_CA_FILE", value_name = "PEM")]
    pub ca_file: Option<std::path::PathBuf>,

    /// A header sent with every request, NAME=VALUE; repeatable. `${VAR}` in the value is read
    /// from the environment: --header 'Authorization=Bearer ${DOWNSTREAM_TOKEN}'.
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<outbound::Header>,

    /// Sign every delivery with the Standard Webhooks scheme (webhook-id = the operation key,
    /// webhook-timestamp, webhook-signature) with this whsec_ secret. Give it through the
    /// variable or the file, not on the command line.
    #[arg(
        long,
        env = "REPLAYPROOF_SIGNING_SECRET",
        hide_env_values = true,
        value_name = "WHSEC"
    )]
    pub signing_secret: Option<outbound::SigningSecret>,
}

impl DispatchArgs {
    /// The worker's name: the flag, or the host name and process id.
    fn worker(&self) -> String {
        self.worker.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "host".into());
            format!("{}-{}", host.trim(), std::process::id())
        })
    }

    pub fn settings(&self) -> anyhow::Result<DispatchSettings> {
        let mut outbound = Outbound {
            headers: self.headers.clone(),
            signing: self.signing_secret.clone(),
            ..Outbound::default()
        };
        if let Some(path) = &self.ca_file {
            outbound.trust_pem_file(path)?;
        }
        Ok(DispatchSettings {
            batch_size: self.batch_size,
            lease: Duration::from_secs(self.lease_secs),
            request_timeout: Duration::from_millis(self.request_timeout_ms),
            poll_interval: Duration::from_millis(self.poll_ms),
            backoff_base: Duration::from_millis(self.backoff_ms),
            backoff_max: Duration::from_millis(self.max_backoff_ms),
            outbound,
            ..DispatchSettings::new(&self.worker())
        })
    }

    /// Runs the dispatcher process until a signal stops it.
    pub async fn run(self) -> anyhow::Result<()> {
        let process = crate::shutdown::Process::start("dispatch", Some(self.metrics_addr)).await?;
        let metrics = DispatchMetrics::new(&process.registry)?;
        let pool = self.database.pool((self.batch_size as u32).clamp(2, 64))?;
        Dispatcher::build(self.settings()?, pool, metrics, process.health)?
            .run_until_stopped(process.shutdown)
            .stopped()
            .await
    }
}

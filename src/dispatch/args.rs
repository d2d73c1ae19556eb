//! `replayproof dispatch`'s flags, and the dispatcher process they start.

use super::*;
use crate::args::DatabaseArgs;
use clap::Args;
use std::net::SocketAddr;

/// Where a dispatcher serves `/metrics` and `/healthz` (`--metrics-addr`).
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9465";

/// The keys of the file read by the dispatcher rather than by a flag, as (section, key):
/// `[dispatch.destinations]` and `[dispatch.credentials]`.
pub const FILE_TABLES: &[(&str, &str)] =
    &[("dispatch", "destinations"), ("dispatch", "credentials")];

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

    /// How long a lease lasts: longer than the slowest realistic request, shorter
    /// than anyone's patience with an operation whose worker died.
    /// A duration such as 250ms, 30s or 5m; `--lease-secs` (seconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_LEASE", value_name = "DURATION", default_value = crate::args::text(DEFAULT_LEASE), value_parser = crate::args::wait(Duration::from_secs(1)), conflicts_with = "lease_secs")]
    pub lease: Duration,

    /// The old spelling of `--lease`, in seconds.
    #[arg(long, env = "REPLAYPROOF_LEASE_SECS", value_parser = crate::args::secs(1), hide = true)]
    pub lease_secs: Option<u64>,

    /// The timeout of one request,; must be well under the lease.
    /// A duration such as 250ms, 30s or 5m; `--request-timeout-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_REQUEST_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(DEFAULT_REQUEST_TIMEOUT), value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "request_timeout_ms")]
    pub request_timeout: Duration,

    /// The old spelling of `--request-timeout`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_REQUEST_TIMEOUT_MS", value_parser = crate::args::ms(1), hide = true)]
    pub request_timeout_ms: Option<u64>,

    /// The first retry's delay; doubled for each further attempt, with jitter.
    /// A duration such as 250ms, 30s or 5m; `--backoff-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_BACKOFF", value_name = "DURATION", default_value = crate::args::text(DEFAULT_BACKOFF), value_parser = crate::args::wait(Duration::ZERO), conflicts_with = "backoff_ms")]
    pub backoff: Duration,

    /// The old spelling of `--backoff`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_BACKOFF_MS", value_parser = crate::args::ms(0), hide = true)]
    pub backoff_ms: Option<u64>,

    /// The longest delay between attempts.
    /// A duration such as 250ms, 30s or 5m; `--max-backoff-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_MAX_BACKOFF", value_name = "DURATION", default_value = crate::args::text(DEFAULT_MAX_BACKOFF), value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "max_backoff_ms")]
    pub max_backoff: Duration,

    /// The old spelling of `--max-backoff`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_MAX_BACKOFF_MS", value_parser = crate::args::ms(1), hide = true)]
    pub max_backoff_ms: Option<u64>,

    /// How often to look for due operations when none were due.
    /// A duration such as 250ms, 30s or 5m; `--poll-ms` (milliseconds) is its old spelling.
    #[arg(long, env = "REPLAYPROOF_POLL", value_name = "DURATION", default_value = crate::args::text(DEFAULT_POLL), value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "poll_ms")]
    pub poll: Duration,

    /// The old spelling of `--poll`, in milliseconds.
    #[arg(long, env = "REPLAYPROOF_POLL_MS", value_parser = crate::args::ms(1), hide = true)]
    pub poll_ms: Option<u64>,

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

    /// The relay of the Kafka output records.
    #[command(flatten)]
    pub relay: crate::output::args::RelayArgs,
}

/// `$HOSTNAME` when set, else the kernel's host name, with the process id.
fn default_worker(hostname: Option<String>, pid: u32) -> String {
    let host = hostname
        .filter(|h| !h.trim().is_empty())
        .unwrap_or_else(|| gethostname::gethostname().to_string_lossy().into_owned());
    format!("{}-{pid}", host.trim())
}

impl DispatchArgs {
    /// The worker's name: the flag, or the host name and process id. The host name is
    /// `$HOSTNAME` (a Kubernetes pod's name), else the kernel's (`gethostname`): a container's
    /// `/etc/hostname` may be the image's, the same in every replica.
    fn worker(&self) -> String {
        let hostname = std::env::var("HOSTNAME").ok();
        self.worker
            .clone()
            .unwrap_or_else(|| default_worker(hostname, std::process::id()))
    }

    /// The settings of the flags, with the destinations and credentials of the configuration
    /// file's `[dispatch]`, if there is a file.
    pub fn settings(
        &self,
        file: Option<&crate::config::ConfigFile>,
    ) -> anyhow::Result<DispatchSettings> {
        let section = file.map(|f| f.section("dispatch")).unwrap_or_default();
        let mut outbound = Outbound {
            headers: self.headers.clone(),
            signing: self.signing_secret.clone(),
            credentials: Credentials::from_table(section.get("credentials"))?,
            ..Outbound::default()
        };
        if let Some(path) = &self.ca_file {
            outbound.trust_pem_file(path)?;
        }
        Ok(DispatchSettings {
            batch_size: self.batch_size,
            lease: crate::args::or_old_secs(self.lease, self.lease_secs),
            request_timeout: crate::args::or_old_ms(self.request_timeout, self.request_timeout_ms),
            poll_interval: crate::args::or_old_ms(self.poll, self.poll_ms),
            backoff_base: crate::args::or_old_ms(self.backoff, self.backoff_ms),
            backoff_max: crate::args::or_old_ms(self.max_backoff, self.max_backoff_ms),
            outbound,
            destinations: Destinations::from_table(section.get("destinations"))?,
            ..DispatchSettings::new(&self.worker())
        })
    }

    /// Runs the dispatcher process until a signal stops it.
    pub async fn run(self, file: Option<&crate::config::ConfigFile>) -> anyhow::Result<()> {
        let settings = self.settings(file)?;
        let relay = self
            .relay
            .settings(&settings.worker, settings.poll_interval)?;
        let process = crate::shutdown::Process::start("dispatch", Some(self.metrics_addr)).await?;
        let metrics = DispatchMetrics::new(&process.registry)?;
        let shards = self
            .database
            .open_shards((self.batch_size as u32).clamp(2, 64))
            .await?;
        let databases: Vec<crate::db::Db> = shards.databases().map(|(_, p)| p.clone()).collect();
        // One loop per database, each leasing that database's operations, all admitted by the
        // destinations' one set of rows on the first database.
        let mut loops = Vec::new();
        for (shard, pool) in databases.iter().enumerate() {
            let dispatcher = Dispatcher::build(
                settings.clone(),
                pool.clone(),
                metrics.clone(),
                process.health.clone(),
            )?
            .on_shard(shard, &databases);
            loops.push(dispatcher.run_until_stopped(process.shutdown.clone()));
        }
        match relay {
            Some(relay) => loops.extend(relays(relay, &databases, &process)?),
            None => crate::output::store::warn_unrelayed(&databases).await,
        }
        for running in loops {
            running.stopped().await?;
        }
        Ok(())
    }
}

/// One relay per database, each producing that database's output records; the first reports
/// every database's backlog.
fn relays(
    settings: crate::output::RelaySettings,
    databases: &[crate::db::Db],
    process: &crate::shutdown::Process,
) -> anyhow::Result<Vec<Running>> {
    let metrics = crate::output::OutputMetrics::new(&process.registry)?;
    let mut relays = Vec::new();
    for (shard, pool) in databases.iter().enumerate() {
        let relay = crate::output::Relay::build(
            settings.clone(),
            pool.clone(),
            metrics.clone(),
            process.health.clone(),
        )?
        .reporting(match shard {
            0 => databases.to_vec(),
            _ => Vec::new(),
        });
        let stop = process.shutdown.clone();
        relays.push(Running::spawn(async move {
            // A relay that ends with an error (a setting the broker refuses) ends the process,
            // so that it exits saying why instead of running on without its relay.
            let ended = relay.run(stop.clone()).await;
            if ended.is_err() {
                stop.cancel();
            }
            ended
        }));
    }
    Ok(relays)
}

#[cfg(test)]
mod tests {
    use super::default_worker;

    #[test]
    fn the_worker_is_named_after_the_pod_else_the_kernels_host_name() {
        assert_eq!(
            default_worker(Some("dispatch-7d9f".into()), 42),
            "dispatch-7d9f-42"
        );
        let kernel = gethostname::gethostname().to_string_lossy().into_owned();
        assert_eq!(default_worker(None, 7), format!("{kernel}-7"));
        assert_eq!(default_worker(Some(" ".into()), 7), format!("{kernel}-7"));
    }
}

//! `replayproof dev`: ingest, consume and dispatch in one process for local development, on the
//! embedded broker and database unless real ones are configured.

use super::stack::Stack;
use crate::consume::{self, BatchProcessor, ConsumeMetrics, ConsumerSettings};
use crate::db::DatabaseUrl;
use crate::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use crate::effect::{HttpOutbox, Registry};
use crate::ingest::config::FileConfig;
use crate::ingest::{self, IngestSettings};
use crate::shutdown::Running;
use crate::telemetry::Health;
use clap::Args;
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Where `dev` takes webhooks (`--listen`): this machine only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// The embedded topic's partitions (`--partitions`).
pub const DEFAULT_PARTITIONS: i32 = 4;
/// The log filter of `dev`: the usual one, and a line for each applied event.
pub const LOG_FILTER: &str = "info,sqlx=warn,rdkafka=warn,replayproof::applied=debug";

#[derive(Debug, Clone, Args)]
pub struct DevArgs {
    /// Kafka bootstrap servers; without them, an in-process mock cluster.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    /// PostgreSQL URL; without it, a throwaway cluster from the local PostgreSQL binaries.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<DatabaseUrl>,

    /// Where webhooks are taken, as for `ingest --listen`; this machine only by default.
    #[arg(long, env = "REPLAYPROOF_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,

    /// The topic the envelopes are written to and consumed from.
    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = consume::DEFAULT_TOPIC)]
    pub topic: String,

    /// Partitions of the embedded broker's topic.
    #[arg(long, default_value_t = DEFAULT_PARTITIONS)]
    pub partitions: i32,

    /// Also POST each event here through the outbox, and run a dispatcher.
    #[arg(long, env = "REPLAYPROOF_TARGET_URL")]
    pub target_url: Option<String>,

    /// Where the console is served; this machine only by default. Its users are the
    /// configuration file's `[console]` section, or else one operator, `dev`, with a password
    /// made at start and printed.
    #[arg(long, env = "REPLAYPROOF_CONSOLE_LISTEN", default_value = crate::console::DEFAULT_LISTEN)]
    pub console_listen: SocketAddr,
}

/// The console's settings in `dev`, and how to log in.
fn console_settings(
    opts: &DevArgs,
    config: Option<&crate::config::ConfigFile>,
    stack: &Stack,
) -> anyhow::Result<(crate::console::ConsoleSettings, String)> {
    use crate::console::{ConsoleFile, ConsoleSettings, Role, UserConfig};
    let section = config.map(ConsoleFile::from_config).transpose()?;
    let (mut settings, login) = match section {
        Some(section) if !section.users.is_empty() => (
            ConsoleSettings::new(opts.console_listen, section)?,
            "as a user of [console]".to_owned(),
        ),
        _ => {
            let password = crate::console::random_hex::<12>();
            crate::secrets::register(&password);
            let file = ConsoleFile {
                session_key: Some(crate::console::random_hex::<32>()),
                users: vec![UserConfig {
                    name: "dev".into(),
                    role: Role::Operator,
                    password_hash: Some(crate::console::hash_password(&password)?),
                }],
                ..ConsoleFile::default()
            };
            let login = format!("user dev, password {password} (made for this run)");
            (ConsoleSettings::new(opts.console_listen, file)?, login)
        }
    };
    settings.kafka = Some(crate::operator::status::KafkaTarget {
        brokers: stack.brokers.clone(),
        topic: stack.topic.clone(),
        group: DEV_GROUP.into(),
        options: Vec::new(),
    });
    settings.effects = effects(opts);
    settings.http = http_outbox(opts);
    Ok((settings, login))
}

/// The consumer group of `dev`.
const DEV_GROUP: &str = "replayproof-dev";

fn effects(opts: &DevArgs) -> Vec<String> {
    let mut effects = vec!["ledger".to_owned()];
    effects.extend(opts.target_url.as_ref().map(|_| "http".to_owned()));
    effects
}

fn http_outbox(opts: &DevArgs) -> Option<HttpOutbox> {
    opts.target_url.clone().map(|target_url| HttpOutbox {
        target_url,
        reconcile_url: None,
        max_attempts: crate::consume::args::DEFAULT_MAX_ATTEMPTS,
        operation_keys: Default::default(),
    })
}

/// Runs ingest, a consumer and (with a target) a dispatcher until a signal stops them.
///
/// The sources are the configuration file's (`--config`, as for `ingest`); without one,
/// development sources for stripe, github, svix (standard-webhooks), shopify and slack.
pub async fn run(
    opts: DevArgs,
    config: Option<&crate::config::ConfigFile>,
    registry: &Registry,
) -> anyhow::Result<()> {
    let shutdown = crate::shutdown::on_signal();
    let (brokers, url) = (opts.brokers.clone(), opts.database_url.clone());
    let stack = Stack::start(brokers, url, &opts.topic, opts.partitions).await?;
    let (sources, secrets) = match config {
        Some(file) => (
            FileConfig::from_config(file)?.sources()?,
            vec![format!("from {}", file.path.display())],
        ),
        None => super::sources::dev_sources()?,
    };
    let mut names: Vec<String> = sources.keys().cloned().collect();
    names.sort();
    let settings = IngestSettings::new(opts.listen, &stack.brokers, &stack.topic);
    let metrics = prometheus::Registry::new();
    let ingress = ingest::Ingress::build(settings, sources, metrics).await?;
    let base = format!("http://{}", ingress.addr());
    let ingress = ingress.run_until_stopped(shutdown.clone());
    let consumer = start_consumer(&stack, &opts, registry, shutdown.clone())?;
    let dispatcher = match &opts.target_url {
        Some(_) => Some(start_dispatcher(&stack, shutdown.clone())?),
        None => None,
    };
    let (settings, login) = console_settings(&opts, config, &stack)?;
    let console =
        crate::console::Console::bind(settings, stack.pool.clone(), registry.clone()).await?;
    let console_line = format!("http://{}/ ({login})", console.addr());
    let console = console.run_until_stopped(shutdown.clone());
    eprintln!(
        "{}",
        banner(
            &stack,
            &base,
            &names,
            &secrets,
            opts.target_url.as_deref(),
            &console_line
        )
    );
    ingress.stopped().await?;
    consumer.stopped().await?;
    console.stopped().await?;
    if let Some(d) = dispatcher {
        d.stopped().await?;
    }
    tracing::info!("Stopped.");
    Ok(())
}

fn start_consumer(
    stack: &Stack,
    opts: &DevArgs,
    registry: &Registry,
    stop: CancellationToken,
) -> anyhow::Result<Running> {
    let http = http_outbox(opts);
    let processor = BatchProcessor::new(
        stack.pool.clone(),
        registry.build(&effects(opts), http.as_ref())?,
    );
    let settings = ConsumerSettings {
        kafka_options: vec![("session.timeout.ms".into(), "6000".into())],
        ..ConsumerSettings::new(&stack.brokers, &stack.topic, DEV_GROUP)
    };
    let metrics = ConsumeMetrics::new(&prometheus::Registry::new())?;
    Ok(
        consume::Consumer::build(settings, processor, metrics, Health::default())?
            .run_until_stopped(stop),
    )
}

fn start_dispatcher(stack: &Stack, stop: CancellationToken) -> anyhow::Result<Running> {
    let metrics = DispatchMetrics::new(&prometheus::Registry::new())?;
    let settings = DispatchSettings {
        poll_interval: Duration::from_millis(200),
        ..DispatchSettings::new("dev")
    };
    Ok(Dispatcher::build(
        settings,
        stack.pool.clone(),
        metrics,
        crate::telemetry::Health::default(),
    )?
    .run_until_stopped(stop))
}

/// What is running where, and how to send it a webhook.
fn banner(
    stack: &Stack,
    base: &str,
    names: &[String],
    secrets: &[String],
    target_url: Option<&str>,
    console: &str,
) -> String {
    let kafka = if stack.embedded_kafka {
        "in-process mock cluster"
    } else {
        "configured"
    };
    let (postgres, how) = if stack.embedded_postgres {
        (
            stack.database_url.as_str(),
            "throwaway cluster, removed on exit",
        )
    } else {
        ("DATABASE_URL", "configured")
    };
    let mut banner = String::from("\nreplayproof dev is running.\n");
    banner += &format!(
        "  Kafka:       {} ({kafka}; topic {})\n",
        stack.brokers, stack.topic
    );
    banner += &format!("  PostgreSQL:  {postgres} ({how})\n");
    for name in names {
        banner += &format!("  Webhooks:    POST {base}/webhooks/{name}\n");
    }
    banner += &format!("  Stripe CLI:  stripe listen --forward-to {base}/webhooks/stripe\n");
    banner +=
        "               (then set STRIPE_WEBHOOK_SECRET to the secret it prints and restart)\n";
    for s in secrets {
        banner += &format!("  Secret:      {s}\n");
    }
    if let Some(url) = target_url {
        banner += &format!("  Outbox:      each event is also POSTed to {url}\n");
    }
    banner += &format!("  Console:     {console}\n");
    banner + "  Ctrl-C stops everything.\n"
}

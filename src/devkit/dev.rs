//! `replayproof dev`: ingest, consume and dispatch in one process for local development, on the
//! embedded broker and database unless real ones are configured. Any binary built on
//! [`crate::Cli`] has it, with its own effects (`--effect`) and migrations.

use super::stack::Stack;
use crate::config::ConfigFile;
use crate::consume::{self, BatchProcessor, ConsumeMetrics, ConsumerSettings};
use crate::db::DatabaseUrl;
use crate::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use crate::effect::{Effect, HttpOutbox, Registry};
use crate::ingest::config::FileConfig;
use crate::ingest::{self, IngestSettings};
use crate::shutdown::Running;
use crate::telemetry::Health;
use anyhow::Context as _;
use clap::Args;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Where `dev` takes webhooks (`--listen`): this machine only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Where `dev` serves `/metrics`, `/livez` and `/readyz` (`--metrics-addr`): consume's port.
pub const DEFAULT_METRICS_ADDR: &str = crate::consume::args::DEFAULT_METRICS_ADDR;
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

    /// The effects applied to each event, in order, as `consume --effect`: `ledger` or one this
    /// binary registers (an application built on `replayproof::Cli` has its own). Default: the
    /// configuration file's `[consume] effect`, else `ledger`.
    #[arg(long = "effect", env = "REPLAYPROOF_EFFECT", value_delimiter = ',')]
    pub effects: Vec<String>,

    /// Also POST each event here through the outbox, and run a dispatcher.
    #[arg(long, env = "REPLAYPROOF_TARGET_URL")]
    pub target_url: Option<String>,

    /// Where the console is served; this machine only by default. Its users are the
    /// configuration file's `[console]` section, or else one operator, `dev`, with a password
    /// made at start and printed.
    #[arg(long, env = "REPLAYPROOF_CONSOLE_LISTEN", default_value = crate::console::DEFAULT_LISTEN)]
    pub console_listen: SocketAddr,

    /// Where Prometheus `/metrics` (the ingress's, the consumer's and the dispatcher's) and the
    /// `/livez` and `/readyz` probes are served; this machine only by default.
    #[arg(long, env = "REPLAYPROOF_METRICS_ADDR", default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: SocketAddr,
}

/// The effects `dev` applies, by name, and where the names came from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Effects {
    names: Vec<String>,
    from: &'static str,
}

impl Effects {
    /// `--effect` (or `REPLAYPROOF_EFFECT`), else the file's `[consume] effect`, else `ledger`;
    /// then `http` when `--target-url` is given and no name says it already.
    fn resolve(opts: &DevArgs, config: Option<&ConfigFile>) -> Self {
        let from_file = config.and_then(|file| file.section("consume").get("effect").map(names));
        let (mut names, from) = match from_file {
            _ if !opts.effects.is_empty() => (opts.effects.clone(), "--effect"),
            Some(names) if !names.is_empty() => (names, "[consume] effect"),
            _ => (
                vec![crate::consume::args::DEFAULT_EFFECT.to_owned()],
                "the default",
            ),
        };
        names.retain(|name| !name.trim().is_empty());
        if opts.target_url.is_some() && !names.iter().any(|n| n == "http") {
            names.push("http".to_owned());
        }
        Self { names, from }
    }

    /// Builds the chain from `registry`, or says which names it knows.
    fn build(
        &self,
        registry: &Registry,
        http: Option<&HttpOutbox>,
    ) -> anyhow::Result<Arc<dyn Effect>> {
        if self.names.iter().any(|name| name == "kafka") {
            anyhow::bail!(
                "dev does not run the kafka effect, which needs an output topic and a relay of \
                 its own: run `consume --effect kafka --output-topic T` and `dispatch` instead"
            );
        }
        registry
            .build(&self.names, http)
            .with_context(|| format!("dev --effect {} (from {})", self.names.join(","), self.from))
    }
}

/// A file's `effect`, as an array or as names separated by commas.
fn names(value: &toml::Value) -> Vec<String> {
    let plain = |v: &toml::Value| match v {
        toml::Value::String(s) => s.trim().to_owned(),
        other => other.to_string(),
    };
    match value {
        toml::Value::Array(list) => list.iter().map(plain).collect(),
        other => plain(other)
            .split(',')
            .map(|n| n.trim().to_owned())
            .collect(),
    }
}

/// The console's settings in `dev`, and how to log in.
fn console_settings(
    opts: &DevArgs,
    config: Option<&ConfigFile>,
    stack: &Stack,
    effects: &Effects,
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
    settings.effects = effects.names.clone();
    settings.http = http_outbox(opts);
    Ok((settings, login))
}

/// The consumer group of `dev`.
const DEV_GROUP: &str = "replayproof-dev";

fn http_outbox(opts: &DevArgs) -> Option<HttpOutbox> {
    opts.target_url.clone().map(|target_url| HttpOutbox {
        target_url,
        reconcile_url: None,
        max_attempts: crate::consume::args::DEFAULT_MAX_ATTEMPTS,
        operation_keys: Default::default(),
    })
}

/// The one `/metrics`, `/livez` and `/readyz` of the process: every role registers its
/// metrics in `registry` and reports to `health`.
struct Telemetry {
    registry: prometheus::Registry,
    health: Health,
    addr: SocketAddr,
}

/// What `/readyz` says until every role has started.
const STARTING: &str = "dev";

impl Telemetry {
    /// Binds `at` first of all, so a second `dev` on the same ports stops before it starts
    /// anything; not ready until [`Telemetry::started`].
    async fn serve(at: SocketAddr, stop: &CancellationToken) -> anyhow::Result<Self> {
        let registry = prometheus::Registry::new();
        crate::telemetry::register_process_metrics(&registry, "dev")?;
        let health = Health::default();
        health.report(STARTING, Some("starting".into()));
        let stopped = stop.clone().cancelled_owned();
        let addr = crate::telemetry::serve_metrics(at, registry.clone(), health.clone(), stopped)
            .await
            .with_context(|| {
                format!(
                    "serving /metrics on {at} (is another dev running? --metrics-addr moves it)"
                )
            })?;
        Ok(Self {
            registry,
            health,
            addr,
        })
    }

    fn started(&self) {
        self.health.report(STARTING, None);
    }
}

/// Runs ingest, a consumer and (with a target) a dispatcher until a signal stops them, applying
/// `dev` applies the migrations and keeps session settings: a file that puts its database
/// behind a transaction-mode pooler is refused with what to do, rather than failing on the
/// pooler's refusal of the startup parameters.
fn refuse_a_pooler(config: Option<&ConfigFile>) -> anyhow::Result<()> {
    let pooler = config.and_then(|f| f.section("database").get("pooler").cloned());
    anyhow::ensure!(
        pooler.as_ref().and_then(|p| p.as_str()) != Some("transaction"),
        "dev needs a direct connection to PostgreSQL, and the file's [database] pooler is \
         \"transaction\": give dev the database's own address (--database-url or DATABASE_URL) \
         and a file without the pooler, or no DATABASE_URL for its own throwaway database"
    );
    Ok(())
}

/// `registry`'s effects after running `migrations` (an application's own tables).
///
/// The sources are the configuration file's (`--config`, as for `ingest`); without one,
/// development sources for stripe, github, svix (standard-webhooks), shopify and slack.
pub async fn run(
    opts: DevArgs,
    config: Option<&ConfigFile>,
    registry: &Registry,
    migrations: &[&str],
) -> anyhow::Result<()> {
    let effects = Effects::resolve(&opts, config);
    let effect = effects.build(registry, http_outbox(&opts).as_ref())?;
    refuse_a_pooler(config)?;
    let shutdown = crate::shutdown::on_signal();
    let telemetry = Telemetry::serve(opts.metrics_addr, &shutdown).await?;
    let (brokers, url) = (opts.brokers.clone(), opts.database_url.clone());
    let stack = Stack::start(brokers, url, &opts.topic, opts.partitions).await?;
    if !migrations.is_empty() {
        crate::db::migrate_with(&stack.pool, migrations).await?;
    }
    let ingress = start_ingress(&opts, config, &stack, &telemetry, shutdown.clone()).await?;
    let consumer = start_consumer(&stack, effect, &telemetry, shutdown.clone())?;
    let dispatcher = match &opts.target_url {
        Some(_) => Some(start_dispatcher(&stack, &telemetry, shutdown.clone())?),
        None => None,
    };
    let (settings, login) = console_settings(&opts, config, &stack, &effects)?;
    let console =
        crate::console::Console::bind(settings, stack.pool.clone(), registry.clone()).await?;
    let console_line = format!("http://{}/ ({login})", console.addr());
    let console = console.run_until_stopped(shutdown.clone());
    telemetry.started();
    let banner = Banner {
        stack: &stack,
        ingress: &ingress,
        effects: &effects,
        target_url: opts.target_url.as_deref(),
        console: &console_line,
        metrics: telemetry.addr,
    };
    eprintln!("{}", banner.text());
    ingress.running.stopped().await?;
    consumer.stopped().await?;
    console.stopped().await?;
    if let Some(d) = dispatcher {
        d.stopped().await?;
    }
    tracing::info!("Stopped.");
    Ok(())
}

/// The running ingress, where it listens and its sources' names and secrets.
struct StartedIngress {
    running: Running,
    base: String,
    names: Vec<String>,
    secrets: Vec<String>,
}

async fn start_ingress(
    opts: &DevArgs,
    config: Option<&ConfigFile>,
    stack: &Stack,
    telemetry: &Telemetry,
    stop: CancellationToken,
) -> anyhow::Result<StartedIngress> {
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
    let ingress = ingest::Ingress::build(settings, sources, telemetry.registry.clone()).await?;
    let base = format!("http://{}", ingress.addr());
    Ok(StartedIngress {
        running: ingress.run_until_stopped(stop),
        base,
        names,
        secrets,
    })
}

fn start_consumer(
    stack: &Stack,
    effect: Arc<dyn Effect>,
    telemetry: &Telemetry,
    stop: CancellationToken,
) -> anyhow::Result<Running> {
    let processor = BatchProcessor::new(stack.pool.clone(), effect);
    let settings = ConsumerSettings {
        kafka_options: vec![("session.timeout.ms".into(), "6000".into())],
        ..ConsumerSettings::new(&stack.brokers, &stack.topic, DEV_GROUP)
    };
    let metrics = ConsumeMetrics::new(&telemetry.registry)?;
    let health = telemetry.health.clone();
    Ok(consume::Consumer::build(settings, processor, metrics, health)?.run_until_stopped(stop))
}

fn start_dispatcher(
    stack: &Stack,
    telemetry: &Telemetry,
    stop: CancellationToken,
) -> anyhow::Result<Running> {
    let metrics = DispatchMetrics::new(&telemetry.registry)?;
    let settings = DispatchSettings {
        poll_interval: Duration::from_millis(200),
        ..DispatchSettings::new("dev")
    };
    let health = telemetry.health.clone();
    Ok(Dispatcher::build(settings, stack.pool.clone(), metrics, health)?.run_until_stopped(stop))
}

/// What is running where, and how to send it a webhook.
struct Banner<'a> {
    stack: &'a Stack,
    ingress: &'a StartedIngress,
    effects: &'a Effects,
    target_url: Option<&'a str>,
    console: &'a str,
    metrics: SocketAddr,
}

impl Banner<'_> {
    fn text(&self) -> String {
        let stack = self.stack;
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
        banner + &self.webhooks() + &self.served()
    }

    /// Where webhooks go, with which secrets, and what is applied to them.
    fn webhooks(&self) -> String {
        let base = &self.ingress.base;
        let mut text = String::new();
        for name in &self.ingress.names {
            text += &format!("  Webhooks:    POST {base}/webhooks/{name}\n");
        }
        text += &format!("  Stripe CLI:  stripe listen --forward-to {base}/webhooks/stripe\n");
        text +=
            "               (then set STRIPE_WEBHOOK_SECRET to the secret it prints and restart)\n";
        for s in &self.ingress.secrets {
            text += &format!("  Secret:      {s}\n");
        }
        let (names, from) = (self.effects.names.join(","), self.effects.from);
        text += &format!("  Effects:     {names} (from {from})\n");
        if let Some(url) = self.target_url {
            text += &format!("  Outbox:      each event is also POSTed to {url}\n");
        }
        text
    }

    /// The console, the metrics and the probes.
    fn served(&self) -> String {
        let metrics = self.metrics;
        let mut text = format!("  Console:     {}\n", self.console);
        text += &format!("  Metrics:     http://{metrics}/metrics\n");
        text += &format!("  Probes:      http://{metrics}/livez and http://{metrics}/readyz\n");
        text + "  Ctrl-C stops everything.\n"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        dev: DevArgs,
    }

    fn dev(flags: &[&str]) -> DevArgs {
        let argv = std::iter::once("dev").chain(flags.iter().copied());
        Cmd::try_parse_from(argv).expect("dev's flags").dev
    }

    fn file(text: &str) -> ConfigFile {
        let env = crate::config::ProcessEnv;
        ConfigFile::parse(std::path::Path::new("dev.toml"), text, &env).unwrap()
    }

    fn resolved(flags: &[&str], config: Option<&ConfigFile>) -> (Vec<String>, &'static str) {
        let effects = Effects::resolve(&dev(flags), config);
        (effects.names, effects.from)
    }

    #[test]
    fn the_effect_flag_wins_over_the_file_which_wins_over_ledger() {
        let orders = file("[consume]\neffect = [\"orders\"]\n");
        let listed = file("[consume]\neffect = \"ledger, orders\"\n");
        let none = file("[consume]\nbatch_size = 10\n");
        let strings = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(resolved(&[], None), (strings(&["ledger"]), "the default"));
        assert_eq!(
            resolved(&[], Some(&none)),
            (strings(&["ledger"]), "the default")
        );
        assert_eq!(
            resolved(&[], Some(&orders)),
            (strings(&["orders"]), "[consume] effect")
        );
        assert_eq!(
            resolved(&[], Some(&listed)),
            (strings(&["ledger", "orders"]), "[consume] effect")
        );
        assert_eq!(
            resolved(&["--effect", "ledger"], Some(&orders)),
            (strings(&["ledger"]), "--effect")
        );
        // A target adds the outbox, once.
        let target = ["--target-url", "http://127.0.0.1:1/", "--effect", "orders"];
        assert_eq!(resolved(&target, None).0, strings(&["orders", "http"]));
        let both = [
            "--target-url",
            "http://127.0.0.1:1/",
            "--effect",
            "http,ledger",
        ];
        assert_eq!(resolved(&both, None).0, strings(&["http", "ledger"]));
    }

    #[test]
    fn an_unknown_effect_is_refused_with_the_names_it_could_be() {
        let registry = Registry::default();
        let effects = Effects::resolve(&dev(&["--effect", "nope"]), None);
        let error = format!("{:#}", effects.build(&registry, None).err().unwrap());
        assert!(
            error.contains("dev --effect nope (from --effect)"),
            "{error}"
        );
        assert!(error.contains("no effect is called \"nope\""), "{error}");
        assert!(error.contains("ledger"), "{error}");
        let kafka = Effects::resolve(&dev(&["--effect", "kafka"]), None);
        let error = format!("{:#}", kafka.build(&registry, None).err().unwrap());
        assert!(
            error.contains("dev does not run the kafka effect"),
            "{error}"
        );
        assert!(Effects::resolve(&dev(&[]), None)
            .build(&registry, None)
            .is_ok());
    }
}

//! `replayproof demo`: the whole promise, end to end, with no services.
//!
//! It starts the embedded broker and database, `ingest`, three `consume` processes and a
//! dispatcher, sends a storm of signed webhook deliveries through the real HTTP ingress (several
//! sources, redeliveries, some concurrent, a few malformed or badly signed), puts a few poison
//! records straight on the topic, kills one consumer with SIGKILL mid-stream and restarts it,
//! and lets a fake downstream drop some responses. Then it counts: every event must have
//! exactly one ledger row and exactly one side effect downstream.

mod consumers;
mod report;
mod storm;

use super::downstream::Downstream;
use super::sources::{self, DevSource};
use super::stack::Stack;
use crate::args::{DatabaseArgs, KafkaArgs, KafkaOptions};
use crate::consume::args::ConsumeArgs;
use crate::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use crate::ingest::config::Kind;
use crate::ingest::{self, IngestSettings};
use crate::shutdown::Running;
use consumers::Consumers;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The storm's size and shape.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Distinct events.
    pub events: usize,
    /// The share of events delivered again.
    pub redeliver: f64,
    pub seed: u64,
    pub consumers: usize,
    /// Concurrent senders.
    pub senders: usize,
    pub brokers: Option<String>,
    pub database_url: Option<crate::db::DatabaseUrl>,
}

/// `replayproof demo`'s flags.
#[derive(Debug, Clone, clap::Args)]
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
    pub database_url: Option<crate::db::DatabaseUrl>,
}

impl DemoArgs {
    /// Runs the demo; an error unless every event had exactly one effect.
    pub async fn run(self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (0.0..=5.0).contains(&self.redeliver),
            "--redeliver is a share between 0 and 5"
        );
        let passed = run(DemoOptions {
            events: self.events as usize,
            redeliver: self.redeliver,
            seed: self.seed,
            consumers: self.consumers as usize,
            senders: self.senders as usize,
            brokers: self.brokers,
            database_url: self.database_url,
        })
        .await?;
        anyhow::ensure!(passed, "some event did not have exactly one effect");
        Ok(())
    }
}

/// The demo's sources, with the secrets the storm signs with.
const DEMO_SOURCES: &[DevSource] = &[
    DevSource {
        name: "github",
        kind: Kind::Github,
        secret_env: "GITHUB",
        fallback: storm::GITHUB_SECRET,
    },
    DevSource {
        name: "stripe",
        kind: Kind::Stripe,
        secret_env: "STRIPE",
        fallback: storm::STRIPE_SECRET,
    },
    DevSource {
        name: "svix",
        kind: Kind::StandardWebhooks,
        secret_env: "SVIX",
        fallback: storm::SVIX_SECRET,
    },
];

/// Records that are not envelopes, written straight to the topic.
const POISON: [&[u8]; 3] = [
    b"not an envelope",
    br#"{"source":"demo","payload":{}}"#,
    b"\x00\x01\x02",
];

/// How long the demo waits for every event to settle.
const PATIENCE: Duration = Duration::from_secs(180);

/// Runs the demo and prints its report; returns whether every event had exactly one effect.
pub async fn run(o: DemoOptions) -> anyhow::Result<bool> {
    let started = Instant::now();
    let topic = format!("demo_{}", std::process::id());
    let stack = Stack::start(o.brokers.clone(), o.database_url.clone(), &topic, 4).await?;
    let downstream = Arc::new(Downstream::default());
    let downstream_url = downstream.start().await?;
    let shutdown = CancellationToken::new();
    let (sources, _) = sources::build(DEMO_SOURCES, |_| None)?;
    let listen = ([127, 0, 0, 1], 0).into();
    let settings = IngestSettings::new(listen, &stack.brokers, &stack.topic);
    let registry = prometheus::Registry::new();
    let ingress = ingest::Ingress::build(settings, sources, registry).await?;
    let base = format!("http://{}", ingress.addr());
    let ingress = ingress.run_until_stopped(shutdown.clone());
    let consumers = Consumers::start(consumer_args(&stack, &downstream_url)?, o.consumers)?;
    let dispatching = start_dispatcher(&stack, shutdown.clone())?;
    let plan = storm::plan(&o);
    let answers = Arc::new(storm::Answers::default());
    let mut watch = Watch::new(&o, &plan);
    let sending = storm::send(
        base,
        plan.clone(),
        o.senders.max(1),
        answers.clone(),
        watch.sent.clone(),
    );
    let storm = tokio::spawn(sending);
    for (i, value) in POISON.iter().enumerate() {
        stack
            .produce_raw(format!("poison-{i}").as_bytes(), value)
            .await?;
    }
    let consumers = watch
        .until_settled(&stack, &downstream, &storm, consumers)
        .await?;
    storm.abort();
    let run = report::Run {
        options: &o,
        plan: &plan,
        answers: &answers,
        downstream: &downstream,
        elapsed: started.elapsed(),
        killed: watch.killed,
    };
    let report = report::Report::gather(&stack.pool, run).await?;
    println!("{}", report.render());
    shutdown.cancel();
    consumers.stop().await;
    ingress.stopped().await?;
    dispatching.stopped().await?;
    stack.pool.close().await;
    Ok(report.passed())
}

/// The consumers' settings: both effects, small batches, quick rebalances.
fn consumer_args(stack: &Stack, downstream_url: &str) -> anyhow::Result<ConsumeArgs> {
    let kafka_options = [
        "session.timeout.ms=6000",
        "heartbeat.interval.ms=500",
        "broker.address.family=v4",
    ];
    let kafka = KafkaArgs {
        brokers: stack.brokers.clone(),
        options: KafkaOptions {
            kafka_options: kafka_options
                .iter()
                .map(|o| crate::args::parse_key_value(o).map_err(anyhow::Error::msg))
                .collect::<anyhow::Result<_>>()?,
        },
    };
    let database = DatabaseArgs::single(stack.database_url.parse()?);
    let mut args = ConsumeArgs::new(kafka, database);
    args.topic = stack.topic.clone();
    args.group = "demo".into();
    args.effects = vec!["ledger".into(), "http".into()];
    args.http.target_url = Some(format!("{downstream_url}/ops"));
    args.http.reconcile_url = Some(format!("{downstream_url}/ops/{{key}}"));
    args.metrics_addr = ([127, 0, 0, 1], 0).into();
    args.batch_size = 50;
    args.commit_interval = std::time::Duration::from_millis(50);
    Ok(args)
}

/// A dispatcher with short timeouts, so the downstream's slow answers come back uncertain.
fn start_dispatcher(stack: &Stack, stop: CancellationToken) -> anyhow::Result<Running> {
    let settings = DispatchSettings {
        request_timeout: Duration::from_secs(1),
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(100),
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
        ..DispatchSettings::new("demo")
    };
    let metrics = DispatchMetrics::new(&prometheus::Registry::new())?;
    Ok(Dispatcher::build(
        settings,
        stack.pool.clone(),
        metrics,
        crate::telemetry::Health::default(),
    )?
    .run_until_stopped(stop))
}

/// The progress bars, and the consumer kill once a third of the events are applied.
struct Watch {
    events: usize,
    progress: MultiProgress,
    sent: ProgressBar,
    applied: ProgressBar,
    killed: bool,
}

impl Watch {
    fn new(o: &DemoOptions, plan: &[storm::Delivery]) -> Self {
        let progress = MultiProgress::new();
        let style = ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len}")
            .expect("a valid template")
            .progress_chars("=> ");
        let bar = |len: usize, prefix: &'static str| {
            let bar = ProgressBar::new(len as u64).with_style(style.clone());
            progress.add(bar.with_prefix(prefix))
        };
        let (sent, applied) = (bar(plan.len(), "deliveries"), bar(o.events, "applied"));
        Self {
            events: o.events,
            progress,
            sent,
            applied,
            killed: false,
        }
    }

    /// Waits until every event is applied and delivered, every poison record dead-lettered and
    /// the storm over, or [`PATIENCE`] ran out; kills one consumer on the way.
    async fn until_settled(
        &mut self,
        stack: &Stack,
        downstream: &Downstream,
        storm: &tokio::task::JoinHandle<()>,
        mut consumers: Consumers,
    ) -> anyhow::Result<Consumers> {
        let deadline = Instant::now() + PATIENCE;
        while !self.settled(stack, downstream, storm).await? {
            let applied = crate::effect::ledger::events_applied(&stack.pool).await?;
            if !self.killed && applied as f64 >= self.events as f64 * 0.35 {
                consumers.kill_and_restart(0).await?;
                let said = "Killed one consumer with SIGKILL mid-stream and started it again.";
                self.progress.println(said)?;
                self.killed = true;
            }
            if Instant::now() > deadline {
                self.progress
                    .println("Gave up waiting after 180 s; reporting what happened.")?;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.sent.finish();
        self.applied.finish();
        Ok(consumers)
    }

    async fn settled(
        &self,
        stack: &Stack,
        downstream: &Downstream,
        storm: &tokio::task::JoinHandle<()>,
    ) -> anyhow::Result<bool> {
        let applied = crate::effect::ledger::events_applied(&stack.pool).await?;
        self.applied.set_position(applied.max(0) as u64);
        let open = crate::outbox::open_count(&stack.pool).await?;
        let (dead, _) = crate::claims::dead_letters::counts(&stack.pool).await?;
        Ok(storm.is_finished()
            && dead >= POISON.len() as i64
            && applied as usize >= self.events
            && open == 0
            && downstream.applied() >= self.events)
    }
}

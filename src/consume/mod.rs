//! `replayproof consume`: a member of a Kafka consumer group that applies each event once.
//!
//! One thread owns the Kafka consumer: it polls, moves each partition's messages from the
//! partition's own librdkafka queue to its lane while the lane has room (memory bounded by bytes,
//! never by pausing), stores and commits offsets, and serves rebalances. Each assigned partition
//! has a lane, a task that takes the partition's messages in offset order, in batches, and
//! applies each batch in one PostgreSQL transaction ([`BatchProcessor`]). A lane reports a batch
//! only after its transaction committed, and an event whose effect is waiting for a retry holds
//! the partition's offset; only then is the offset stored and committed. A lane whose partition
//! is revoked is stopped and drained first, and anything it reports afterwards is ignored, so no
//! offset is ever stored for a partition this member no longer owns.

#![warn(missing_docs)]

#[cfg(feature = "cli")]
pub mod args;
mod batch;
#[cfg(feature = "cli")]
pub mod defer_args;
mod deferred;
mod ffi;
mod health;
#[cfg(feature = "cli")]
pub mod http_args;
#[cfg(feature = "cli")]
pub mod input_args;
mod internal_events;
#[cfg(feature = "cli")]
pub mod kafka_args;
mod lane;
mod metrics;
mod offsets;
mod poll;
mod settings;
pub mod settle;

pub use batch::{
    BatchError, BatchProcessor, BatchReport, DeadLettered, EffectRetry, Outcome, RawMessage,
    Retrying, APPLIED_LOG, MAX_EFFECT_ATTEMPTS, MAX_EFFECT_BACKOFF, UNKNOWN_SOURCE,
};
pub use deferred::{Applied, DeferredApplier, Round};
pub(crate) use lane::panic_message;
pub use metrics::{ConsumeMetrics, DeferredMetrics};
pub use settings::*;
pub use settle::{DeferSettings, DEFAULT_DEFER_POLL};

pub use crate::shutdown::Running;
use crate::telemetry::Health;
use anyhow::Context as _;
use health::Vitals;
use poll::{LaneContext, GROUP, POLL_LOOP};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use std::sync::Arc;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// Runs a consumer group member until `shutdown` is cancelled, then finishes the batches in
/// flight, commits their offsets, leaves the group and returns. See [`Consumer`].
pub async fn run(
    settings: ConsumerSettings,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    Consumer::build(settings, processor, metrics, Health::default())?
        .run_until_stopped(shutdown)
        .stopped()
        .await
}

/// A member of the consumer group, built and checked: its client created with the guarded
/// configuration and subscribed to the topic. It joins the group once it runs.
pub struct Consumer {
    settings: ConsumerSettings,
    consumer: BaseConsumer<LaneContext>,
    deferred: DeferredApplier,
    vitals: Arc<Vitals>,
    health: Health,
    /// Every database the claims live in, each probed for readiness.
    databases: Vec<crate::db::Db>,
    /// The consumer's activity by minute, written to the first database.
    activity: crate::activity::Activity,
}

impl Consumer {
    /// Creates the consumer and subscribes it; a refused option or a consumer that cannot be
    /// created is an error here, before anything runs. It will report to `health` what
    /// `/livez` and `/readyz` should say.
    pub fn build(
        settings: ConsumerSettings,
        processor: BatchProcessor,
        metrics: ConsumeMetrics,
        health: Health,
    ) -> anyhow::Result<Self> {
        let config = settings.client_config()?;
        let vitals = Arc::new(Vitals::new(CancellationToken::new()));
        let databases = processor
            .shards
            .databases()
            .map(|(_, pool)| pool.clone())
            .collect();
        let activity = metrics.activity.clone();
        let deferred = DeferredApplier::new(processor.clone(), &settings.topic, metrics.clone())
            .with_health(health.clone(), settings.unhealthy_after);
        let context = LaneContext::new(
            settings.clone(),
            processor,
            metrics,
            Handle::current(),
            vitals.clone(),
            health.clone(),
        );
        let consumer: BaseConsumer<LaneContext> = config
            .create_with_context(context)
            .context("creating the Kafka consumer")?;
        consumer
            .subscribe(&[&settings.topic])
            .context("subscribing to the topic")?;
        Ok(Self {
            settings,
            consumer,
            deferred,
            vitals,
            health,
            databases,
            activity,
        })
    }

    /// Joins the group and polls until `shutdown` is cancelled. It ends with an error, after
    /// leaving the group cleanly, when a lane panicked or stalled past
    /// [`ConsumerSettings::stall_exit_after`]: the process should exit non-zero so the group
    /// reassigns its partitions.
    pub fn run_until_stopped(self, shutdown: CancellationToken) -> Running {
        let Self {
            settings,
            consumer,
            deferred,
            vitals,
            health,
            databases,
            activity,
        } = self;
        let s = &settings;
        let (first, topic) = (databases_first(&databases), s.topic.clone());
        tracing::info!(topic = %s.topic, group = %s.group, brokers = %s.brokers, "Joining the consumer group.");
        let joining = Some("has not joined the group yet".to_owned());
        health.report(GROUP, joining);
        let stop = vitals.stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => stop.cancel(),
                _ = stop.cancelled() => {}
            }
        });
        let unhealthy_after = settings.unhealthy_after;
        let probe =
            health::probe_database(databases, health.clone(), vitals.clone(), unhealthy_after);
        let probe = tokio::spawn(probe);
        let grace = settings.shutdown_grace;
        let watchdog = tokio::spawn(health::watch(vitals.clone(), health.clone(), settings));
        let deferred = tokio::spawn(deferred.run(vitals.stop.clone()));
        let activity = tokio::spawn(activity.run(first, topic, vitals.stop.clone()));
        let polled = poll::spawn_thread(consumer, vitals.stop.clone());
        Running::spawn(async move {
            let polled = polled?.await;
            vitals.stop.cancel();
            let _ = watchdog.await;
            let _ = probe.await;
            finish_deferred(deferred, grace).await;
            let _ = tokio::time::timeout(grace, activity).await;
            health.forget(POLL_LOOP);
            polled.context("the Kafka poll thread panicked")?;
            match vitals.fatal() {
                Some(reason) => Err(anyhow::anyhow!(reason)),
                None => Ok(()),
            }
        })
    }
}

/// The first database, where the consumer's activity is written.
fn databases_first(databases: &[crate::db::Db]) -> crate::db::Db {
    databases
        .first()
        .expect("a consumer has a database")
        .clone()
}

/// The deferred event being applied is finished within the grace period; past it, its
/// transaction is abandoned (rolled back), and it is applied again when due.
async fn finish_deferred(mut deferred: tokio::task::JoinHandle<()>, grace: std::time::Duration) {
    if tokio::time::timeout(grace, &mut deferred).await.is_err() {
        deferred.abort();
    }
}

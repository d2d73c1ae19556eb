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
mod deferred;
mod metrics;

pub use batch::{
    BatchError, BatchProcessor, BatchReport, EffectRetry, RawMessage, Retrying, APPLIED_LOG,
    MAX_EFFECT_ATTEMPTS, MAX_EFFECT_BACKOFF,
};
pub use deferred::{Applied, DeferSettings, DeferredApplier, Round, DEFAULT_DEFER_POLL};
pub use metrics::ConsumeMetrics;

pub use crate::shutdown::Running;
use crate::telemetry::Health;
use anyhow::Context as _;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use crate::kafka::DEFAULT_TOPIC;
/// The consumer group (`--group`).
pub const DEFAULT_GROUP: &str = "replayproof";
/// Messages claimed in one transaction at most (`--batch-size`): enough to amortise a
/// commit, few enough that a failing batch reruns quickly.
pub const DEFAULT_BATCH_SIZE: u32 = 500;
/// How long a partial batch waits for more messages (`--linger-ms`).
pub const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// How often settled offsets go to Kafka (`--commit-interval-ms`); a crash in between only
/// replays claims that are already done.
pub const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_millis(200);
/// How long a stop waits for the batch in flight (`--shutdown-grace-secs`).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// Bytes of messages queued for one partition's lane, beyond the batch in flight, before the
/// poll loop stops taking that partition's messages out of librdkafka (`--max-lane-bytes`).
pub const DEFAULT_MAX_LANE_BYTES: usize = 2 << 20;
/// What librdkafka pre-fetches per partition, in KiB (`queued.max.messages.kbytes`; each
/// partition has its own queue here). With the lane's budget and the batch in flight, this
/// bounds the consumer's memory per partition whatever the backlog on the topic.
pub const QUEUED_MAX_KBYTES: u32 = 1024;
/// The most one fetch response may carry (`fetch.max.bytes`). librdkafka hands messages out
/// without copying them, so one message still queued keeps its whole response in memory: with
/// 16 partitions and 4 MiB responses, responses held for a message or two came to 140 MiB
/// (heaptrack, `cargo bench --bench consume` memory run). 1 MiB keeps that small and costs no
/// speed on a local network.
pub const FETCH_MAX_BYTES: u32 = 1 << 20;
/// The most one fetch response carries for one partition (`max.partition.fetch.bytes`): a
/// quarter of [`FETCH_MAX_BYTES`], so one response serves several partitions and a partition
/// whose lane is full holds a small piece of it.
pub const PARTITION_FETCH_MAX_BYTES: u32 = FETCH_MAX_BYTES / 4;
/// What a queued message costs beyond its key and value: the allocation and its bookkeeping.
const MESSAGE_OVERHEAD_BYTES: usize = 64;
/// The ceiling of the wait between reruns of a batch that hit a transient error
/// (`--max-retry-backoff-ms`).
pub const DEFAULT_MAX_RETRY_BACKOFF: Duration = Duration::from_millis(5_000);
/// A batch transaction longer than this is abandoned and rerun (`--batch-timeout-secs`).
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(60);
/// `/healthz` fails after this long without progress (`--unhealthy-after-secs`).
pub const DEFAULT_UNHEALTHY_AFTER: Duration = Duration::from_secs(60);
/// The process exits after this long without progress, so a supervisor restarts it
/// (`--stall-exit-secs`).
pub const DEFAULT_STALL_EXIT: Duration = Duration::from_secs(300);
/// Tries of the synchronous commit on a revoke or a stop.
const FINAL_COMMIT_ATTEMPTS: u32 = 3;
/// Kafka errors closer together than this make one streak.
const ERROR_STREAK_GAP: Duration = Duration::from_secs(10);

/// How the group spreads partitions over its members (`--assignor`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Assignor {
    /// Eager: every rebalance takes all partitions from every member and hands them out again.
    #[default]
    Roundrobin,
    /// Incremental: a rebalance moves only the partitions that change owner; the others keep
    /// being applied while it runs.
    CooperativeSticky,
}

impl Assignor {
    /// librdkafka's `partition.assignment.strategy`.
    pub fn strategy(self) -> &'static str {
        match self {
            Self::Roundrobin => "roundrobin",
            Self::CooperativeSticky => "cooperative-sticky",
        }
    }
}

/// How the consumer reads, batches and commits.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// The bootstrap servers, `host:port` separated by commas.
    pub brokers: String,
    /// The topic the envelopes are read from.
    pub topic: String,
    /// The consumer group; members of one group share the topic's partitions.
    pub group: String,
    /// Passed to librdkafka last, so they override everything set here.
    pub kafka_options: Vec<(String, String)>,
    /// Every member of a group must use the same.
    pub assignor: Assignor,
    /// Static membership (`group.instance.id`): a member that restarts under the same id within
    /// the session timeout gets its partitions back without a rebalance. Unique per member.
    pub instance_id: Option<String>,
    /// The most messages in one transaction.
    pub batch_size: usize,
    /// How long a lane waits to fill a batch once it has a first message.
    pub linger: Duration,
    /// Bytes of messages queued for one lane before the poll loop leaves its partition's
    /// messages in librdkafka's queue (never a pause: librdkafka drops a paused partition's
    /// pre-fetched messages and fetches them again).
    pub max_lane_bytes: usize,
    /// How often stored offsets are committed; revokes and shutdown commit at once.
    pub commit_interval: Duration,
    /// How long in-flight batches may take to finish on revoke or shutdown.
    pub shutdown_grace: Duration,
    /// The longest pause between retries of a batch that failed on a database error.
    pub max_retry_backoff: Duration,
    /// The longest one attempt at a batch may take; past it the attempt is abandoned (its
    /// transaction rolls back) and retried, so a hung connection cannot hold a lane forever.
    pub batch_timeout: Duration,
    /// A lane that has not committed its batch for this long (the database unreachable, a batch
    /// stuck), or Kafka reporting errors this long without a message, makes `/healthz` fail.
    pub unhealthy_after: Duration,
    /// A lane that has not committed its batch for this long stops the process with an error,
    /// so that the group hands its partitions to a member that can make progress.
    pub stall_exit_after: Duration,
}

impl ConsumerSettings {
    /// Settings with the defaults of the command line.
    pub fn new(brokers: &str, topic: &str, group: &str) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            group: group.into(),
            kafka_options: Vec::new(),
            assignor: Assignor::default(),
            instance_id: None,
            batch_size: DEFAULT_BATCH_SIZE as usize,
            linger: DEFAULT_LINGER,
            max_lane_bytes: DEFAULT_MAX_LANE_BYTES,
            commit_interval: DEFAULT_COMMIT_INTERVAL,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            max_retry_backoff: DEFAULT_MAX_RETRY_BACKOFF,
            batch_timeout: DEFAULT_BATCH_TIMEOUT,
            unhealthy_after: DEFAULT_UNHEALTHY_AFTER,
            stall_exit_after: DEFAULT_STALL_EXIT,
        }
    }

    /// The consumer's librdkafka configuration: replayproof's tuning, the user's options over
    /// it, and the guarded properties (no auto-commit, no automatic offset store, a new group
    /// from the earliest offset, committed records only) set last ([`crate::kafka`]).
    fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let mut tuning = vec![
            (
                "partition.assignment.strategy",
                self.assignor.strategy().into(),
            ),
            ("client.id", "replayproof-consume".into()),
            ("queued.max.messages.kbytes", QUEUED_MAX_KBYTES.to_string()),
            ("fetch.max.bytes", FETCH_MAX_BYTES.to_string()),
            (
                "max.partition.fetch.bytes",
                PARTITION_FETCH_MAX_BYTES.to_string(),
            ),
            // A partition whose queue is full is fetched again this soon after it drains,
            // rather than after librdkafka's default second.
            ("fetch.queue.backoff.ms", "20".into()),
            // librdkafka has one fetch in flight per broker: a fetch the broker holds open for
            // partitions with nothing new delays partitions whose queue just drained. 50 ms
            // instead of 500 doubles the rate of 2 KiB messages (`cargo bench --bench consume`).
            ("fetch.wait.max.ms", "50".into()),
            // Each partition's lag is read from librdkafka's statistics this often, so it keeps
            // moving while a partition's batches are stuck.
            ("statistics.interval.ms", STATISTICS_INTERVAL_MS.to_string()),
        ];
        if let Some(id) = &self.instance_id {
            tuning.push(("group.instance.id", id.clone()));
        }
        crate::kafka::client_config(
            crate::kafka::Role::Consumer,
            &self.brokers,
            Some(&self.group),
            &tuning,
            &self.kafka_options,
        )
    }
}

/// Runs a consumer group member until `shutdown` is cancelled, then finishes the batches in
/// flight, commits their offsets, leaves the group and returns. See [`start`].
pub async fn run(
    settings: ConsumerSettings,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    start(settings, processor, metrics, Health::default(), shutdown)?
        .stopped()
        .await
}

/// Creates the consumer, joins the group and starts polling; a refused option or a consumer
/// that cannot be created is an error here. The member runs until `shutdown` is cancelled,
/// reporting to `health` what `/healthz` should say. It ends with an error, after leaving the
/// group cleanly, when a lane panicked or stalled past [`ConsumerSettings::stall_exit_after`]:
/// the process should exit non-zero so the group reassigns its partitions.
pub fn start(
    settings: ConsumerSettings,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    health: Health,
    shutdown: CancellationToken,
) -> anyhow::Result<Running> {
    let config = settings.client_config()?;
    let vitals = Arc::new(Vitals::new(shutdown.child_token()));
    let pool = processor.pool.clone();
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
    tracing::info!(topic = %settings.topic, group = %settings.group, brokers = %settings.brokers, "Joined the consumer group.");
    let probe = tokio::spawn(probe_database(
        pool,
        health.clone(),
        vitals.stop.clone(),
        settings.unhealthy_after,
    ));
    let grace = settings.shutdown_grace;
    let watchdog = tokio::spawn(watch(vitals.clone(), health.clone(), settings));
    let mut deferred = tokio::spawn(deferred.run(vitals.stop.clone()));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let stop = vitals.stop.clone();
    std::thread::Builder::new()
        .name("kafka-poll".into())
        .spawn(move || {
            poll_until(&consumer, &stop);
            leave(consumer);
            let _ = done_tx.send(());
        })
        .context("starting the Kafka poll thread")?;
    Ok(Running::spawn(async move {
        let polled = done_rx.await;
        vitals.stop.cancel();
        let _ = watchdog.await;
        let _ = probe.await;
        // The deferred event being applied is finished within the grace period; past it, its
        // transaction is abandoned (rolled back), and it is applied again when due.
        if tokio::time::timeout(grace, &mut deferred).await.is_err() {
            deferred.abort();
        }
        health.forget(POLL_LOOP);
        polled.context("the Kafka poll thread panicked")?;
        match vitals.fatal() {
            Some(reason) => Err(anyhow::anyhow!(reason)),
            None => Ok(()),
        }
    }))
}

/// The poll loop's heartbeat, as `/healthz` names it.
const POLL_LOOP: &str = "kafka poll loop";

/// What the lanes and the poll loop tell the watchdog, and how the process is stopped when
/// something cannot go on.
struct Vitals {
    /// Stops the poll loop: cancelled on shutdown or on a fatal problem.
    stop: CancellationToken,
    epoch: Instant,
    fatal: Mutex<Option<String>>,
    /// Per running lane (by id): its partition, and when its unfinished batch started (ms
    /// since `epoch`, 0 when it has none).
    busy: Mutex<HashMap<u64, (i32, Arc<AtomicU64>)>>,
    /// Kafka errors of the consumer as a whole: when the current streak started and when the
    /// last one came.
    errors: Mutex<Option<ErrorStreak>>,
    /// Each assigned partition's own errors and progress: a message of one partition says
    /// nothing of another.
    partitions: Mutex<HashMap<i32, PartitionVitals>>,
}

/// How one assigned partition is doing, as its fetches and the statistics tell.
#[derive(Debug, Clone)]
struct PartitionVitals {
    /// The partition's own fetch errors, cleared by its next message.
    errors: Option<ErrorStreak>,
    /// When a message of the partition last reached its lane (or, before any, when it was
    /// assigned).
    advanced: Instant,
    /// Messages on the broker after the last one handed over, from the statistics.
    behind: i64,
    /// Whether its lane holds its whole byte budget: then the partition waits for the lane, and
    /// a lane that does not commit is reported as such.
    lane_full: bool,
}

impl PartitionVitals {
    fn new(now: Instant) -> Self {
        Self {
            errors: None,
            advanced: now,
            behind: 0,
            lane_full: false,
        }
    }
}

#[derive(Debug, Clone)]
struct ErrorStreak {
    since: Instant,
    last: Instant,
    error: String,
}

impl ErrorStreak {
    /// Adds an error to the streak in `slot`, or starts one when the last error is old.
    fn extend(slot: &mut Option<ErrorStreak>, error: String) {
        let now = Instant::now();
        match slot.as_mut() {
            Some(streak) if now - streak.last < ERROR_STREAK_GAP => {
                streak.last = now;
                streak.error = error;
            }
            _ => {
                *slot = Some(ErrorStreak {
                    since: now,
                    last: now,
                    error,
                })
            }
        }
    }

    /// The streak's sentence, when it still repeats and has lasted `limit`.
    fn lasting(&self, now: Instant, limit: Duration) -> Option<String> {
        let repeating = now.saturating_duration_since(self.last) < ERROR_STREAK_GAP;
        let lasting = now.saturating_duration_since(self.since);
        (repeating && lasting >= limit).then(|| {
            format!(
                "Kafka has reported errors for {} s without a message: {}",
                lasting.as_secs(),
                self.error
            )
        })
    }
}

impl Vitals {
    fn new(stop: CancellationToken) -> Self {
        Self {
            stop,
            epoch: Instant::now(),
            fatal: Mutex::new(None),
            busy: Mutex::new(HashMap::new()),
            errors: Mutex::new(None),
            partitions: Mutex::new(HashMap::new()),
        }
    }

    /// Milliseconds since the epoch, never 0 (which means idle).
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Stops the process's consumer on a problem it cannot get past by itself.
    fn fail(&self, reason: String) {
        tracing::error!(reason, "Stopping the consumer: it cannot go on by itself.");
        self.fatal.lock().expect("fatal lock").get_or_insert(reason);
        self.stop.cancel();
    }

    fn fatal(&self) -> Option<String> {
        self.fatal.lock().expect("fatal lock").clone()
    }

    fn kafka_error(&self, error: String) {
        ErrorStreak::extend(&mut self.errors.lock().expect("errors lock"), error);
    }

    fn kafka_message(&self) {
        *self.errors.lock().expect("errors lock") = None;
    }

    /// An error from one partition's fetches: its own streak, which only its own messages end.
    fn partition_error(&self, partition: i32, error: String) {
        let mut partitions = self.partitions.lock().expect("partitions lock");
        let vitals = partitions
            .entry(partition)
            .or_insert_with(|| PartitionVitals::new(Instant::now()));
        ErrorStreak::extend(&mut vitals.errors, error);
    }

    /// A message of `partition` reached its lane.
    fn partition_advanced(&self, partition: i32) {
        let mut partitions = self.partitions.lock().expect("partitions lock");
        let now = Instant::now();
        let vitals = partitions
            .entry(partition)
            .or_insert_with(|| PartitionVitals::new(now));
        vitals.errors = None;
        vitals.advanced = now;
    }

    fn assigned(&self, partition: i32) {
        self.partitions
            .lock()
            .expect("partitions lock")
            .insert(partition, PartitionVitals::new(Instant::now()));
    }

    fn revoked(&self, partition: i32) {
        self.partitions
            .lock()
            .expect("partitions lock")
            .remove(&partition);
    }

    /// The partition whose unfinished batch is oldest, and how long it has been going.
    fn oldest_batch(&self) -> Option<(i32, Duration)> {
        let now = self.now_ms();
        let busy = self.busy.lock().expect("busy lock");
        busy.values()
            .filter_map(|(partition, since)| match since.load(Ordering::Relaxed) {
                0 => None,
                at => Some((*partition, Duration::from_millis(now.saturating_sub(at)))),
            })
            .max_by_key(|(_, age)| *age)
    }
}

/// What the watchdog concluded.
#[derive(Debug, Default, PartialEq, Eq)]
struct Assessment {
    lanes: Option<String>,
    kafka: Option<String>,
    /// Partitions stuck on their own: fetch errors, or messages waiting that never arrive.
    partitions: Option<String>,
    fatal: Option<String>,
}

/// Judges the vitals against the limits; a pure function, so the thresholds can be tested.
fn assess(
    oldest_batch: Option<(i32, Duration)>,
    errors: Option<&ErrorStreak>,
    now: Instant,
    settings: &ConsumerSettings,
) -> Assessment {
    let mut verdict = Assessment::default();
    if let Some((partition, age)) = oldest_batch {
        let said = format!(
            "partition {partition} has not committed its batch for {} s (is the database \
             reachable? is a batch stuck?)",
            age.as_secs()
        );
        if age >= settings.stall_exit_after {
            verdict.fatal = Some(said.clone());
        }
        if age >= settings.unhealthy_after {
            verdict.lanes = Some(said);
        }
    }
    verdict.kafka = errors.and_then(|streak| streak.lasting(now, settings.unhealthy_after));
    verdict
}

/// Judges each partition on its own: one whose fetches keep failing, or that is behind and has
/// handed over nothing for the limit while its lane had room. A message of another partition
/// clears neither.
fn assess_partitions(
    partitions: &HashMap<i32, PartitionVitals>,
    now: Instant,
    limit: Duration,
) -> Option<String> {
    let mut stuck: Vec<(i32, String)> = partitions
        .iter()
        .filter_map(|(&partition, v)| {
            if let Some(said) = v.errors.as_ref().and_then(|e| e.lasting(now, limit)) {
                return Some((partition, format!("partition {partition}: {said}")));
            }
            let quiet = now.saturating_duration_since(v.advanced);
            (v.behind > 0 && !v.lane_full && quiet >= limit).then(|| {
                let said = format!(
                    "partition {partition} is {} messages behind and has received none for {} s",
                    v.behind,
                    quiet.as_secs()
                );
                (partition, said)
            })
        })
        .collect();
    stuck.sort();
    (!stuck.is_empty()).then(|| {
        stuck
            .into_iter()
            .map(|(_, said)| said)
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// Every second: reports stalled lanes and repeating Kafka errors to `/healthz`, and stops the
/// process when a lane has stalled past the exit limit.
async fn watch(vitals: Arc<Vitals>, health: Health, settings: ConsumerSettings) {
    while !vitals.stop.is_cancelled() {
        let streak = vitals.errors.lock().expect("errors lock").clone();
        let verdict = assess(
            vitals.oldest_batch(),
            streak.as_ref(),
            Instant::now(),
            &settings,
        );
        health.report("lanes", verdict.lanes);
        health.report("kafka", verdict.kafka);
        let partitions = vitals.partitions.lock().expect("partitions lock").clone();
        health.report(
            "partitions",
            assess_partitions(&partitions, Instant::now(), settings.unhealthy_after),
        );
        if let Some(reason) = verdict.fatal {
            vitals.fail(reason);
        }
        tokio::select! {
            _ = vitals.stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Asks PostgreSQL whether it answers, every few seconds, so that an idle consumer whose
/// database is gone fails `/healthz` too, not only one whose batches fail.
async fn probe_database(
    pool: sqlx::PgPool,
    health: Health,
    stop: CancellationToken,
    unhealthy_after: Duration,
) {
    let every = (unhealthy_after / 2).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut failing_since: Option<Instant> = None;
    while !stop.is_cancelled() {
        let asked = sqlx::query("SELECT 1").execute(&pool);
        match tokio::time::timeout(every.max(Duration::from_secs(1)), asked).await {
            Ok(Ok(_)) => {
                failing_since = None;
                health.report("database", None);
            }
            _ => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= unhealthy_after {
                    let problem = format!(
                        "PostgreSQL has not answered for {} s",
                        since.elapsed().as_secs()
                    );
                    health.report("database", Some(problem));
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Serves the consumer: events and rebalances from its own queue, then messages from each
/// partition's queue while the partition's lane has room, then offsets.
fn poll_until(consumer: &BaseConsumer<LaneContext>, shutdown: &CancellationToken) {
    let ctx = consumer.context();
    let mut idle = false;
    while !shutdown.is_cancelled() {
        ctx.health.beat(POLL_LOOP, ctx.settings.unhealthy_after);
        // Waits a little only when the last round moved nothing, so a busy consumer never sleeps.
        let wait = if idle { IDLE_POLL } else { Duration::ZERO };
        match consumer.poll(wait) {
            // A message fetched before its partition's queue was split off.
            Some(Ok(message)) => {
                ctx.vitals.kafka_message();
                ctx.vitals.partition_advanced(message.partition());
                ctx.route(message.partition(), RawMessage::from(&message))
            }
            Some(Err(e)) => ctx.kafka_error(&e),
            None => {}
        }
        idle = !ctx.pump();
        ctx.store_completed(consumer);
        ctx.commit_if_due(consumer);
    }
}

/// How long the poll loop waits for an event when no partition had messages for its lane.
const IDLE_POLL: Duration = Duration::from_millis(5);

impl From<&BorrowedMessage<'_>> for RawMessage {
    fn from(message: &BorrowedMessage<'_>) -> Self {
        RawMessage {
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            value: message.payload().map(<[u8]>::to_vec),
        }
    }
}

impl RawMessage {
    /// What the message costs while queued for its lane: the budget `--max-lane-bytes` counts.
    pub fn queued_bytes(&self) -> usize {
        MESSAGE_OVERHEAD_BYTES
            + self.key.as_ref().map_or(0, Vec::len)
            + self.value.as_ref().map_or(0, Vec::len)
    }
}

/// One assigned partition's own queue in librdkafka, split off the consumer's queue when the
/// partition is assigned. The poll loop takes its messages only while the partition's lane has
/// room; otherwise they stay here, where librdkafka stops fetching past
/// `queued.max.messages.kbytes`. (Pausing the partition instead would make librdkafka drop what
/// it pre-fetched and fetch it again on resume.) The split is what rdkafka's
/// `split_partition_queue` does, but that needs the consumer in an `Arc`, and the split must
/// happen in the rebalance callback, before the partition's first fetch, where there is none.
struct PartitionFeed(*mut rdkafka::bindings::rd_kafka_queue_t);

// SAFETY: librdkafka's queues are thread-safe; the handle is used only under the context's lock
// and released before the consumer is destroyed (`leave` stops every lane first).
unsafe impl Send for PartitionFeed {}

impl PartitionFeed {
    /// Splits `partition`'s queue off the consumer's: librdkafka keeps it split across later
    /// fetch restarts, because the application set it.
    fn split(consumer: &BaseConsumer<LaneContext>, topic: &CStr, partition: i32) -> Option<Self> {
        use rdkafka::bindings as rd;
        let rk = consumer.client().native_ptr();
        // SAFETY: `rk` is the live consumer; the queue returned is a new reference we own.
        unsafe {
            let queue = rd::rd_kafka_queue_get_partition(rk, topic.as_ptr(), partition);
            if queue.is_null() {
                return None;
            }
            rd::rd_kafka_queue_forward(queue, std::ptr::null_mut());
            Some(Self(queue))
        }
    }

    /// The next message waiting, its bytes copied out, or the error it carries; never waits.
    fn next(&self) -> Option<KafkaResult<RawMessage>> {
        use rdkafka::bindings as rd;
        // SAFETY: the queue is ours until drop; a message returned is read, then destroyed once.
        unsafe {
            let message = rd::rd_kafka_consume_queue(self.0, 0);
            if message.is_null() {
                return None;
            }
            let m = &*message;
            let copy = |ptr: *mut std::ffi::c_void, len: usize| {
                (!ptr.is_null()).then(|| std::slice::from_raw_parts(ptr as *const u8, len).to_vec())
            };
            let result = if m.err == rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                Ok(RawMessage {
                    offset: m.offset,
                    key: copy(m.key, m.key_len),
                    value: copy(m.payload, m.len),
                })
            } else {
                Err(KafkaError::MessageConsumption(m.err.into()))
            };
            rd::rd_kafka_message_destroy(message);
            Some(result)
        }
    }
}

impl Drop for PartitionFeed {
    fn drop(&mut self) {
        // SAFETY: releases the reference taken in `split`, once.
        unsafe { rdkafka::bindings::rd_kafka_queue_destroy(self.0) }
    }
}

/// Stops fetching, drains every lane, commits, and leaves the group.
fn leave(consumer: BaseConsumer<LaneContext>) {
    tracing::info!("Stopping: finishing the batches in flight.");
    consumer.context().stop_lanes(&consumer, None);
    consumer.unsubscribe();
    drop(consumer);
    tracing::info!("Left the consumer group.");
}

/// A batch that committed, reported by its lane.
struct Completion {
    partition: i32,
    lane: u64,
    /// The offset after the batch's last message: the next one to read.
    next_offset: i64,
}

/// One partition's ordered lane, as seen from the poll thread.
struct Lane {
    id: u64,
    messages: mpsc::UnboundedSender<RawMessage>,
    stop: CancellationToken,
    /// Taken when the lane is stopped, to wait for it.
    task: Option<tokio::task::JoinHandle<()>>,
    /// Bytes of the messages sent to the lane and not yet taken into a batch.
    queued_bytes: Arc<AtomicUsize>,
    /// Bytes of the events whose effect failed and that wait in the lane for another attempt:
    /// they count in the lane's budget too.
    held_bytes: Arc<AtomicUsize>,
    /// The next offset expected; a message below it means the partition's offsets went back.
    next_offset: i64,
}

impl Lane {
    /// What the lane holds beyond its batch in flight: queued messages and held retries.
    fn holds(&self) -> usize {
        self.queued_bytes
            .load(Ordering::Relaxed)
            .saturating_add(self.held_bytes.load(Ordering::Relaxed))
    }

    /// Queues a message for the lane. True when its offset is below the next one expected: a
    /// truncated or recreated topic, or an offset reset. Those may be new messages at reused
    /// offsets, and the claims make any replay among them harmless, so they are queued too.
    fn push(&mut self, message: RawMessage) -> bool {
        let rewound = message.offset < self.next_offset;
        self.next_offset = message.offset + 1;
        self.queued_bytes
            .fetch_add(message.queued_bytes(), Ordering::Relaxed);
        let _ = self.messages.send(message);
        rewound
    }
}

/// The consumer's context: owns the lanes and serves rebalances on the poll thread.
struct LaneContext {
    settings: ConsumerSettings,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    runtime: Handle,
    lanes: Mutex<HashMap<i32, Lane>>,
    /// Each assigned partition, with its own queue (None if it could not be split off).
    feeds: Mutex<HashMap<i32, Option<PartitionFeed>>>,
    next_lane_id: AtomicU64,
    completions_tx: std_mpsc::Sender<Completion>,
    completions: Mutex<std_mpsc::Receiver<Completion>>,
    /// When offsets were last committed, and whether some were stored since.
    commit_state: Mutex<(Instant, bool)>,
    vitals: Arc<Vitals>,
    health: Health,
}

/// How often librdkafka reports its statistics, the source of `replayproof_consumer_lag`.
pub const STATISTICS_INTERVAL_MS: u64 = 5_000;

impl ClientContext for LaneContext {
    /// Sets each assigned partition's lag from librdkafka's statistics: the last stable offset
    /// the broker reported minus the offset stored after the last applied batch (or the
    /// committed one before any). It moves on a timer, whatever the lanes are doing; up to the
    /// partition's fetch queue (1 MiB) past a stuck batch, after which librdkafka stops
    /// fetching the partition and its reported end stops moving too.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let Some(topic) = statistics.topics.get(&self.settings.topic) else {
            return;
        };
        let feeds = self.feeds.lock().expect("feeds lock");
        let lanes = self.lanes.lock().expect("lanes lock");
        let mut vitals = self.vitals.partitions.lock().expect("partitions lock");
        let budget = self.settings.max_lane_bytes.max(1);
        for (partition, stats) in &topic.partitions {
            if !feeds.contains_key(partition) {
                continue;
            }
            if let Some(v) = vitals.get_mut(partition) {
                v.behind = not_handed_over(stats);
                v.lane_full = lanes.get(partition).is_some_and(|l| l.holds() >= budget);
            }
            // Before this group stored or committed anything, everything from the log's start
            // is still to apply (a new group reads from the earliest offset).
            let end = if stats.ls_offset >= 0 {
                stats.ls_offset
            } else {
                stats.hi_offset
            };
            let lag = if stats.consumer_lag_stored >= 0 {
                stats.consumer_lag_stored
            } else if stats.consumer_lag >= 0 {
                stats.consumer_lag
            } else if end >= 0 && stats.lo_offset >= 0 {
                end - stats.lo_offset
            } else {
                -1
            };
            if lag >= 0 {
                self.metrics
                    .consumer_lag
                    .with_label_values(&[&partition.to_string()])
                    .set(lag);
            }
        }
    }
}

/// Messages the broker reported for a partition after the last one librdkafka handed to the
/// poll loop (or, before any, after the committed offset or the log's start).
fn not_handed_over(stats: &rdkafka::statistics::Partition) -> i64 {
    let end = if stats.ls_offset >= 0 {
        stats.ls_offset
    } else {
        stats.hi_offset
    };
    let next = [stats.app_offset, stats.committed_offset, stats.lo_offset]
        .into_iter()
        .find(|o| *o >= 0);
    match next {
        Some(next) if end >= 0 => (end - next).max(0),
        _ => 0,
    }
}

impl ConsumerContext for LaneContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => {
                let partitions: Vec<i32> = tpl
                    .elements_for_topic(&self.settings.topic)
                    .iter()
                    .map(|e| e.partition())
                    .collect();
                tracing::info!(?partitions, "Partitions revoked; draining their lanes.");
                self.stop_lanes(consumer, Some(&partitions));
            }
            Rebalance::Assign(tpl) => {
                let partitions: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
                tracing::info!(?partitions, "Partitions assigned.");
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "A rebalance failed."),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            // A partition this member no longer owns has no lag or offset here: its series go,
            // so a dashboard does not show a stale number next to the new owner's.
            for e in tpl.elements_for_topic(&self.settings.topic) {
                self.metrics.forget_partition(e.partition());
                self.vitals.revoked(e.partition());
            }
            return;
        }
        // Right after the assignment, before its first fetch: each new partition gets its own
        // queue. The assignment is counted from the rebalances themselves: asking the client with
        // `assignment()` blocks forever when the rebalance is served while the consumer closes.
        let Rebalance::Assign(tpl) = rebalance else {
            return;
        };
        let Ok(topic) = CString::new(self.settings.topic.as_str()) else {
            return;
        };
        let mut feeds = self.feeds.lock().expect("feeds lock");
        for e in tpl.elements_for_topic(&self.settings.topic) {
            let feed = PartitionFeed::split(consumer, &topic, e.partition());
            if feed.is_none() {
                tracing::warn!(
                    partition = e.partition(),
                    "Could not give an assigned partition its own queue; its messages come through the consumer's."
                );
            }
            feeds.insert(e.partition(), feed);
            self.vitals.assigned(e.partition());
        }
        self.metrics.assigned_partitions.set(feeds.len() as i64);
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        // A commit can succeed as a request and still fail for some partitions.
        let failed = match result {
            Ok(()) => offsets
                .elements_for_topic(&self.settings.topic)
                .iter()
                .find_map(|e| e.error().err()),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => return,
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            // Retried at the next interval even if the partition stays idle.
            self.commit_state.lock().expect("commit lock").1 = true;
            tracing::warn!(error = %e, "An offset commit failed; retrying it. Until it succeeds, its messages would be replayed harmlessly.");
            return;
        }
        let feeds = self.feeds.lock().expect("feeds lock");
        for e in offsets.elements_for_topic(&self.settings.topic) {
            // The final commit of a revoked partition is not this member's to show any more.
            if !feeds.contains_key(&e.partition()) {
                continue;
            }
            if let Offset::Offset(o) = e.offset() {
                self.metrics
                    .committed_offset
                    .with_label_values(&[&e.partition().to_string()])
                    .set(o);
            }
        }
    }
}

impl LaneContext {
    fn new(
        settings: ConsumerSettings,
        processor: BatchProcessor,
        metrics: ConsumeMetrics,
        runtime: Handle,
        vitals: Arc<Vitals>,
        health: Health,
    ) -> Self {
        let (completions_tx, completions) = std_mpsc::channel();
        Self {
            settings,
            processor,
            metrics,
            runtime,
            lanes: Mutex::new(HashMap::new()),
            feeds: Mutex::new(HashMap::new()),
            next_lane_id: AtomicU64::new(0),
            completions_tx,
            completions: Mutex::new(completions),
            commit_state: Mutex::new((Instant::now(), false)),
            vitals,
            health,
        }
    }

    /// Counts and logs an error Kafka reported; a streak of them shows in `/healthz`.
    fn kafka_error(&self, error: &KafkaError) {
        self.count_error(error);
        tracing::warn!(error = %error, "Kafka reported an error.");
        self.vitals.kafka_error(error.to_string());
    }

    /// Like [`LaneContext::kafka_error`], for an error of one partition's fetches: its streak is
    /// the partition's own.
    fn partition_error(&self, partition: i32, error: &KafkaError) {
        self.count_error(error);
        tracing::warn!(partition, error = %error, "Kafka reported an error fetching a partition.");
        self.vitals.partition_error(partition, error.to_string());
    }

    fn count_error(&self, error: &KafkaError) {
        let code = error
            .rdkafka_error_code()
            .map_or_else(|| "other".to_owned(), |c| format!("{c:?}"));
        self.metrics.kafka_errors.with_label_values(&[&code]).inc();
    }

    /// Moves messages from each partition's queue to its lane while the lane holds less than
    /// its byte budget; true when any moved.
    fn pump(&self) -> bool {
        let feeds = self.feeds.lock().expect("feeds lock");
        let mut lanes = self.lanes.lock().expect("lanes lock");
        let budget = self.settings.max_lane_bytes.max(1);
        let mut moved = false;
        for (&partition, feed) in feeds.iter() {
            let Some(feed) = feed else { continue };
            loop {
                let full = lanes.get(&partition).is_some_and(|l| l.holds() >= budget);
                if full {
                    break;
                }
                match feed.next() {
                    None => break,
                    Some(Ok(message)) => {
                        self.vitals.kafka_message();
                        self.vitals.partition_advanced(partition);
                        self.route_to(&mut lanes, partition, message);
                        moved = true;
                    }
                    Some(Err(e)) => {
                        self.partition_error(partition, &e);
                        break;
                    }
                }
            }
        }
        moved
    }

    /// Hands a message to its partition's lane, starting the lane on its first message.
    fn route(&self, partition: i32, message: RawMessage) {
        let mut lanes = self.lanes.lock().expect("lanes lock");
        self.route_to(&mut lanes, partition, message);
    }

    fn route_to(&self, lanes: &mut HashMap<i32, Lane>, partition: i32, message: RawMessage) {
        let lane = lanes
            .entry(partition)
            .or_insert_with(|| self.start_lane(partition, message.offset));
        let (offset, expected) = (message.offset, lane.next_offset);
        if lane.push(message) {
            tracing::warn!(
                partition,
                offset,
                expected,
                "Offsets went backwards; processing the messages again."
            );
        }
    }

    fn start_lane(&self, partition: i32, first_offset: i64) -> Lane {
        let id = self.next_lane_id.fetch_add(1, Ordering::Relaxed);
        let (messages, rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let held_bytes = Arc::new(AtomicUsize::new(0));
        let busy_since = Arc::new(AtomicU64::new(0));
        self.vitals
            .busy
            .lock()
            .expect("busy lock")
            .insert(id, (partition, busy_since.clone()));
        let worker = LaneWorker {
            id,
            partition,
            first_offset,
            topic: self.settings.topic.clone(),
            batch_size: self.settings.batch_size.max(1),
            linger: self.settings.linger,
            max_retry_backoff: self.settings.max_retry_backoff,
            batch_timeout: self.settings.batch_timeout,
            processor: self.processor.clone(),
            metrics: self.metrics.clone(),
            stop: stop.clone(),
            queued_bytes: queued_bytes.clone(),
            held_bytes: held_bytes.clone(),
            completions: self.completions_tx.clone(),
            busy_since,
            vitals: self.vitals.clone(),
        };
        tracing::debug!(partition, lane = id, first_offset, "Started a lane.");
        Lane {
            id,
            messages,
            stop,
            task: Some(self.runtime.spawn(worker.run(rx))),
            queued_bytes,
            held_bytes,
            next_offset: first_offset,
        }
    }

    /// Stores the offsets of committed batches whose lane still owns its partition.
    fn store_completed(&self, consumer: &BaseConsumer<Self>) {
        let completions = self.completions.lock().expect("completions lock");

        let lanes = self.lanes.lock().expect("lanes lock");
        let mut stored = false;
        for c in completions.try_iter() {
            if !stored {
                // Tests stall the poll thread here, with committed batches in hand.
                crate::failpoint!("consume::before_store");
            }
            if lanes.get(&c.partition).map(|l| l.id) != Some(c.lane) {
                continue;
            }
            match consumer.store_offset(&self.settings.topic, c.partition, c.next_offset - 1) {
                Ok(()) => {
                    stored = true;
                    self.record_lag(consumer, c.partition, c.next_offset);
                }
                Err(e) => {
                    tracing::warn!(partition = c.partition, error = %e, "Could not store an offset; the batch will be replayed harmlessly.")
                }
            }
        }
        if stored {
            self.commit_state.lock().expect("commit lock").1 = true;
        }
    }

    /// The messages of `partition` after `next_offset`, from the client's cached high watermark.
    fn record_lag(&self, consumer: &BaseConsumer<Self>, partition: i32, next_offset: i64) {
        let Ok(topic) = std::ffi::CString::new(self.settings.topic.as_str()) else {
            return;
        };
        let (mut low, mut high) = (0i64, 0i64);
        // SAFETY: reads the client's cached watermarks into two locals; no call to the broker.
        let err = unsafe {
            rdkafka::bindings::rd_kafka_get_watermark_offsets(
                consumer.client().native_ptr(),
                topic.as_ptr(),
                partition,
                &mut low,
                &mut high,
            )
        };
        if err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0 {
            self.metrics
                .consumer_lag
                .with_label_values(&[&partition.to_string()])
                .set((high - next_offset).max(0));
        }
    }

    /// Commits asynchronously when offsets were stored (or a commit failed) since the last one
    /// and the interval has passed. A failure reported later marks the commit due again.
    fn commit_if_due(&self, consumer: &BaseConsumer<Self>) {
        {
            let mut state = self.commit_state.lock().expect("commit lock");
            if !(state.1 && state.0.elapsed() >= self.settings.commit_interval) {
                return;
            }
            *state = (Instant::now(), false);
        }
        if !commit_async(consumer) {
            self.commit_state.lock().expect("commit lock").1 = true;
        }
    }

    /// Commits the stored offsets; false when the commit failed (logged).
    fn commit(&self, consumer: &BaseConsumer<Self>, mode: CommitMode) -> bool {
        match consumer.commit_consumer_state(mode) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => true,
            Err(e) => {
                tracing::warn!(error = %e, "An offset commit failed; its messages will be replayed harmlessly.");
                false
            }
        }
    }

    /// Commits synchronously, trying a few times: the last commit before a revoke or a stop.
    fn commit_now(&self, consumer: &BaseConsumer<Self>) -> bool {
        for attempt in 1..=FINAL_COMMIT_ATTEMPTS {
            if self.commit(consumer, CommitMode::Sync) {
                return true;
            }
            if attempt < FINAL_COMMIT_ATTEMPTS {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        false
    }

    /// Stops the given lanes (all when `None`), waits for their batches in flight to commit or
    /// roll back, stores and commits what committed, and forgets the lanes. Runs on the poll
    /// thread, inside a revoke or at shutdown, while the partitions are still ours.
    fn stop_lanes(&self, consumer: &BaseConsumer<Self>, partitions: Option<&[i32]>) {
        let tasks: Vec<_> = {
            let mut lanes = self.lanes.lock().expect("lanes lock");
            lanes
                .iter_mut()
                .filter(|(p, _)| partitions.is_none_or(|ps| ps.contains(p)))
                .filter_map(|(_, lane)| {
                    lane.stop.cancel();
                    lane.task.take()
                })
                .collect()
        };
        let grace = self.settings.shutdown_grace;
        let drained = self.runtime.block_on(async {
            tokio::time::timeout(grace, async {
                for task in tasks {
                    let _ = task.await;
                }
            })
            .await
        });
        if drained.is_err() {
            tracing::warn!(
                grace_ms = grace.as_millis() as u64,
                "Lanes did not finish in time; their batches will be replayed harmlessly."
            );
        }
        self.store_completed(consumer);
        let committed = self.commit_now(consumer);
        *self.commit_state.lock().expect("commit lock") = (Instant::now(), !committed);
        if !committed && partitions.is_none() {
            self.vitals.fail(
                "the final offset commit failed; the last batches will be replayed harmlessly \
                 by the next owner"
                    .into(),
            );
        }
        let kept = |p: &i32| partitions.is_some_and(|ps| !ps.contains(p));
        // Their queues go too: what is left in them was never handed to a lane.
        let assigned = {
            let mut feeds = self.feeds.lock().expect("feeds lock");
            feeds.retain(|p, _| kept(p));
            feeds.len()
        };
        self.metrics.assigned_partitions.set(assigned as i64);
        let mut lanes = self.lanes.lock().expect("lanes lock");
        let mut busy = self.vitals.busy.lock().expect("busy lock");
        lanes.retain(|p, lane| {
            let keep = kept(p);
            if !keep {
                busy.remove(&lane.id);
            }
            keep
        });
    }
}

/// Commits the stored offsets without waiting, the outcome reported to
/// [`ConsumerContext::commit_callback`] by a later poll. (`commit_consumer_state(Async)` posts
/// its outcome nowhere when the consumer uses librdkafka's event API: a failure would be only
/// logged, and never retried.) False when the commit could not even be started.
fn commit_async(consumer: &BaseConsumer<LaneContext>) -> bool {
    use rdkafka::bindings as rd;
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is this live consumer's handle. The consumer queue is a new reference that is
    // released right after the call; a null offsets list means the stored offsets, and without a
    // callback the outcome is posted as an event on that queue, which `poll` serves.
    let err = unsafe {
        let queue = rd::rd_kafka_queue_get_consumer(rk);
        if queue.is_null() {
            return false;
        }
        let err =
            rd::rd_kafka_commit_queue(rk, std::ptr::null(), queue, None, std::ptr::null_mut());
        rd::rd_kafka_queue_destroy(queue);
        err
    };
    match err {
        rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR
        | rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR__NO_OFFSET => true,
        e => {
            let e = KafkaError::ConsumerCommit(e.into());
            tracing::warn!(error = %e, "An offset commit could not be started; retrying it.");
            false
        }
    }
}

/// What a panic said, for a log line or a failed event's error.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The task behind a lane: batches in offset order, each applied in one transaction.
struct LaneWorker {
    id: u64,
    partition: i32,
    /// The offset of the first message handed to the lane.
    first_offset: i64,
    topic: String,
    batch_size: usize,
    linger: Duration,
    max_retry_backoff: Duration,
    batch_timeout: Duration,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    stop: CancellationToken,
    queued_bytes: Arc<AtomicUsize>,
    /// What the lane's held retries take ([`Retrying::bytes`]), for the poll loop's budget.
    held_bytes: Arc<AtomicUsize>,
    completions: std_mpsc::Sender<Completion>,
    /// When the batch in hand started (ms since the vitals' epoch), 0 when there is none.
    busy_since: Arc<AtomicU64>,
    vitals: Arc<Vitals>,
}

/// Where a lane is in its partition.
#[derive(Default)]
struct Progress {
    /// Events whose effect failed, waiting for another attempt while later batches go on.
    retrying: Retrying,
    /// The offset after the last message taken from the partition.
    read_to: Option<i64>,
    /// The last offset reported as the next to read (at first, the lane's first offset: nothing
    /// to store yet), which only moves forward.
    reported: Option<i64>,
}

impl Progress {
    /// The next offset to read after a committed batch: after the batch, or at the first event
    /// still waiting for another attempt. None when it has not moved forward.
    fn advance(&mut self, batch: &[RawMessage]) -> Option<i64> {
        if let Some(last) = batch.last() {
            self.read_to = Some(last.offset + 1);
        }
        let next = match (self.retrying.first_offset(), self.read_to) {
            (Some(held), Some(read)) => held.min(read),
            (held, read) => held.or(read)?,
        };
        if self.reported.is_some_and(|r| r >= next) {
            return None;
        }
        self.reported = Some(next);
        Some(next)
    }
}

impl LaneWorker {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<RawMessage>) {
        use futures_util::FutureExt as _;
        let mut progress = Progress {
            reported: Some(self.first_offset),
            ..Progress::default()
        };
        while let Some(batch) = self.next_batch(&mut rx, progress.retrying.next_due()).await {
            let bytes = batch.iter().map(RawMessage::queued_bytes).sum();
            self.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
            if self.stop.is_cancelled() {
                return;
            }
            match std::panic::AssertUnwindSafe(self.apply(&batch, &mut progress))
                .catch_unwind()
                .await
            {
                Ok(true) => {}
                Ok(false) => return,
                Err(panic) => return self.panicked(panic.as_ref()),
            }
        }
    }

    /// A lane that panicked cannot go on: its batch did not commit and its offset must not move.
    /// The process stops, so the partition moves to a member that replays the batch.
    fn panicked(&self, panic: &(dyn std::any::Any + Send)) {
        let message = panic_message(panic);
        self.metrics.lane_panics.inc();
        self.vitals.fail(format!(
            "the lane of partition {} panicked: {message}",
            self.partition
        ));
    }

    /// Waits for a first message, then takes more until the batch is full or the linger ends.
    /// When an event's retry falls due first, the batch is empty: the pass applies the retry.
    async fn next_batch(
        &self,
        rx: &mut mpsc::UnboundedReceiver<RawMessage>,
        retry_due: Option<tokio::time::Instant>,
    ) -> Option<Vec<RawMessage>> {
        let retry = async {
            match retry_due {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending().await,
            }
        };
        let first = tokio::select! {
            biased;
            _ = self.stop.cancelled() => return None,
            m = rx.recv() => m?,
            _ = retry => return Some(Vec::new()),
        };
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + self.linger;
        while batch.len() < self.batch_size {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => match tokio::time::timeout_at(deadline, rx.recv()).await {
                    Ok(Some(m)) => batch.push(m),
                    _ => break,
                },
            }
        }
        Some(batch)
    }

    /// Applies a batch, retrying database errors with backoff until it commits (true) or the
    /// lane is stopped (false; what committed is reported, the rest replays). Each transaction is
    /// bounded by the batch timeout on its own; a part whose transaction ran past it is split in
    /// halves, applied in offset order, so a slow batch commits part by part instead of timing
    /// out whole forever.
    async fn apply(&self, batch: &[RawMessage], progress: &mut Progress) -> bool {
        let started = Instant::now();
        self.busy_since
            .store(self.vitals.now_ms(), Ordering::Relaxed);
        // Parts still to commit, the next one last.
        let mut parts = vec![batch];
        let mut backoff = Duration::from_millis(100);
        while let Some(part) = parts.pop() {
            let attempt = self.processor.process_pass_within(
                &self.topic,
                self.partition,
                part,
                &mut progress.retrying,
                Some(self.batch_timeout),
            );
            let result = attempt.await;
            self.held_bytes
                .store(progress.retrying.bytes(), Ordering::Relaxed);
            match result {
                Ok(report) => {
                    crate::failpoint!("consume::after_commit");
                    let now = if parts.is_empty() {
                        0
                    } else {
                        self.vitals.now_ms()
                    };
                    self.busy_since.store(now, Ordering::Relaxed);
                    self.report(part, progress.advance(part), &report, started);
                    backoff = Duration::from_millis(100);
                    continue;
                }
                Err(BatchError::TimedOut(limit)) if part.len() > 1 => {
                    self.metrics.batch_retries.inc();
                    tracing::warn!(
                        partition = self.partition,
                        messages = part.len(),
                        limit_secs = limit.as_secs(),
                        "A batch's transaction ran past the batch timeout and was rolled back; \
                         applying it in halves."
                    );
                    let (left, right) = part.split_at(part.len() / 2);
                    parts.extend([right, left]);
                    continue;
                }
                Err(e) => {
                    self.metrics.batch_retries.inc();
                    tracing::warn!(
                        partition = self.partition,
                        error = format!("{e:#}"),
                        retry_in_ms = backoff.as_millis() as u64,
                        "A batch did not commit; retrying it."
                    );
                    parts.push(part);
                }
            }
            let jitter = Duration::from_millis(fastrand::u64(0..=backoff.as_millis() as u64 / 4));
            tokio::select! {
                _ = self.stop.cancelled() => return false,
                _ = tokio::time::sleep(backoff + jitter) => {}
            }
            backoff = (backoff * 2).min(self.max_retry_backoff);
        }
        true
    }

    fn report(
        &self,
        batch: &[RawMessage],
        next_offset: Option<i64>,
        report: &BatchReport,
        started: Instant,
    ) {
        if let Some(next_offset) = next_offset {
            let _ = self.completions.send(Completion {
                partition: self.partition,
                lane: self.id,
                next_offset,
            });
        }
        self.metrics.record(report);
        self.metrics.batch_size.observe(batch.len() as f64);
        self.metrics
            .batch_seconds
            .observe(started.elapsed().as_secs_f64());
        for (key, event_type) in &report.applied_events {
            let event_type = event_type.as_deref().unwrap_or("-");
            tracing::debug!(target: batch::APPLIED_LOG, partition = self.partition, "Applied {key} ({event_type}).");
        }
        for (offset, reason) in &report.dead_letters {
            tracing::warn!(
                partition = self.partition,
                offset,
                reason,
                "Dead-lettered a malformed message."
            );
        }
        if report.conflicts > 0 {
            tracing::warn!(
                partition = self.partition,
                conflicts = report.conflicts,
                "Events reused a claimed key with a different payload; recorded in key_conflicts."
            );
        }
        tracing::debug!(
            partition = self.partition,
            last_offset = batch.last().map(|m| m.offset),
            next_offset,
            applied = report.applied,
            duplicates = report.duplicates,
            failed = report.failed,
            "Committed a batch."
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConsumerSettings {
        ConsumerSettings {
            unhealthy_after: Duration::from_secs(60),
            stall_exit_after: Duration::from_secs(300),
            ..ConsumerSettings::new("b", "t", "g")
        }
    }

    #[test]
    fn messages_whose_offsets_went_backwards_are_queued_not_dropped() {
        let (messages, mut rx) = mpsc::unbounded_channel();
        let mut lane = Lane {
            id: 0,
            messages,
            stop: CancellationToken::new(),
            task: None,
            queued_bytes: Arc::new(AtomicUsize::new(0)),
            held_bytes: Arc::new(AtomicUsize::new(0)),
            next_offset: 0,
        };
        let message = |offset| RawMessage {
            offset,
            key: None,
            value: Some(format!("m{offset}").into_bytes()),
        };
        let rewound: Vec<bool> = [0, 1, 2, 0, 1, 2, 3]
            .into_iter()
            .map(|o| lane.push(message(o)))
            .collect();
        assert_eq!(rewound, [false, false, false, true, false, false, false]);
        let mut queued = Vec::new();
        while let Ok(m) = rx.try_recv() {
            queued.push(m.offset);
        }
        assert_eq!(queued, [0, 1, 2, 0, 1, 2, 3]);
        // Seven values of two bytes, each with its bookkeeping.
        assert_eq!(
            lane.queued_bytes.load(Ordering::Relaxed),
            7 * (2 + MESSAGE_OVERHEAD_BYTES)
        );
    }

    #[test]
    fn a_lane_without_a_commit_is_unhealthy_then_fatal() {
        let now = Instant::now();
        let quiet = assess(Some((3, Duration::from_secs(59))), None, now, &limits());
        assert_eq!(quiet, Assessment::default());
        let stuck = assess(Some((3, Duration::from_secs(61))), None, now, &limits());
        assert!(stuck
            .lanes
            .unwrap()
            .starts_with("partition 3 has not committed"));
        assert_eq!(stuck.fatal, None);
        let stalled = assess(Some((3, Duration::from_secs(300))), None, now, &limits());
        assert!(stalled.fatal.is_some() && stalled.lanes.is_some());
    }

    #[test]
    fn each_partition_is_judged_on_its_own() {
        let now = Instant::now();
        let limit = Duration::from_secs(60);
        let ago = |secs| now - Duration::from_secs(secs);
        let flowing = PartitionVitals {
            advanced: now,
            behind: 10,
            ..PartitionVitals::new(now)
        };
        let failing = PartitionVitals {
            errors: Some(ErrorStreak {
                since: ago(90),
                last: ago(1),
                error: "Broker: Corrupt message".into(),
            }),
            advanced: ago(90),
            ..PartitionVitals::new(now)
        };
        let starved = PartitionVitals {
            advanced: ago(61),
            behind: 7,
            ..PartitionVitals::new(now)
        };
        let waiting_for_its_lane = PartitionVitals {
            lane_full: true,
            ..starved.clone()
        };
        let caught_up = PartitionVitals {
            advanced: ago(3600),
            ..PartitionVitals::new(now)
        };
        let all = HashMap::from([
            (0, flowing),
            (1, failing),
            (2, starved),
            (3, waiting_for_its_lane),
            (4, caught_up),
        ]);
        let said = assess_partitions(&all, now, limit).unwrap();
        assert!(
            said.contains("partition 1: Kafka has reported errors for 90 s"),
            "{said}"
        );
        assert!(said.contains("partition 2 is 7 messages behind"), "{said}");
        for quiet in ["partition 0", "partition 3", "partition 4"] {
            assert!(!said.contains(quiet), "{said}");
        }
        let healthy = HashMap::from([(0, all[&0].clone()), (4, all[&4].clone())]);
        assert_eq!(assess_partitions(&healthy, now, limit), None);
    }

    #[test]
    fn only_a_lasting_streak_of_kafka_errors_is_unhealthy() {
        let now = Instant::now();
        let streak = |since: u64, last: u64| ErrorStreak {
            since: now - Duration::from_secs(since),
            last: now - Duration::from_secs(last),
            error: "Decompression failed".into(),
        };
        let young = streak(30, 0);
        assert_eq!(assess(None, Some(&young), now, &limits()).kafka, None);
        let lasting = streak(90, 1);
        let said = assess(None, Some(&lasting), now, &limits()).kafka.unwrap();
        assert!(
            said.contains("90 s") && said.contains("Decompression"),
            "{said}"
        );
        // An old streak that stopped repeating (the broker came back, the topic is idle).
        let over = streak(90, 30);
        assert_eq!(
            assess(None, Some(&over), now, &limits()),
            Assessment::default()
        );
    }
}

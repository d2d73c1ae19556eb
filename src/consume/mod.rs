//! `replayproof consume`: a member of a Kafka consumer group that applies each event once.
//!
//! One thread owns the Kafka consumer: it polls, routes each message to its partition's lane,
//! stores and commits offsets, and serves rebalances. Each assigned partition has a lane, a task
//! that takes the partition's messages in offset order, in batches, and applies each batch in one
//! PostgreSQL transaction ([`BatchProcessor`]). A lane reports a batch only after its transaction
//! committed; only then is the batch's offset stored and committed. A lane whose partition is
//! revoked is stopped and drained first, and anything it reports afterwards is ignored, so no
//! offset is ever stored for a partition this member no longer owns.

mod batch;

pub use batch::{BatchError, BatchProcessor, BatchReport, EffectRetry, RawMessage};

use crate::telemetry::ConsumeMetrics;
use anyhow::Context as _;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How the consumer reads, batches and commits.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    pub brokers: String,
    pub topic: String,
    pub group: String,
    /// Passed to librdkafka last, so they override everything set here.
    pub kafka_options: Vec<(String, String)>,
    /// The most messages in one transaction.
    pub batch_size: usize,
    /// How long a lane waits to fill a batch once it has a first message.
    pub linger: Duration,
    /// Messages queued for one lane before its partition is paused.
    pub max_backlog: usize,
    /// How often stored offsets are committed; revokes and shutdown commit at once.
    pub commit_interval: Duration,
    /// How long in-flight batches may take to finish on revoke or shutdown.
    pub shutdown_grace: Duration,
    /// The longest pause between retries of a batch that failed on a database error.
    pub max_retry_backoff: Duration,
    /// Log one line for each applied event (for `replayproof dev`).
    pub log_events: bool,
}

impl ConsumerSettings {
    /// Settings with the defaults of the command line.
    pub fn new(brokers: &str, topic: &str, group: &str) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            group: group.into(),
            kafka_options: Vec::new(),
            batch_size: 500,
            linger: Duration::from_millis(5),
            max_backlog: 5_000,
            commit_interval: Duration::from_millis(200),
            shutdown_grace: Duration::from_secs(20),
            max_retry_backoff: Duration::from_secs(5),
            log_events: false,
        }
    }

    fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", "roundrobin")
            .set("client.id", "replayproof-consume");
        for (k, v) in &self.kafka_options {
            config.set(k, v);
        }
        config
    }
}

/// Runs a consumer group member until `shutdown` is cancelled, then finishes the batches in
/// flight, commits their offsets, leaves the group and returns.
pub async fn run(
    settings: ConsumerSettings,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    crate::kafka::check_options(crate::kafka::Role::Consumer, &settings.kafka_options)?;
    let context = LaneContext::new(settings.clone(), processor, metrics, Handle::current());
    let consumer: BaseConsumer<LaneContext> = settings
        .client_config()
        .create_with_context(context)
        .context("creating the Kafka consumer")?;
    consumer
        .subscribe(&[&settings.topic])
        .context("subscribing to the topic")?;
    tracing::info!(topic = %settings.topic, group = %settings.group, brokers = %settings.brokers, "Joined the consumer group.");
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kafka-poll".into())
        .spawn(move || {
            poll_until(&consumer, &shutdown);
            leave(consumer);
            let _ = done_tx.send(());
        })
        .context("starting the Kafka poll thread")?;
    done_rx.await.context("the Kafka poll thread panicked")?;
    Ok(())
}

fn poll_until(consumer: &BaseConsumer<LaneContext>, shutdown: &CancellationToken) {
    let ctx = consumer.context();
    while !shutdown.is_cancelled() {
        match consumer.poll(Duration::from_millis(20)) {
            Some(Ok(message)) => ctx.route(&message),
            Some(Err(e)) => tracing::warn!(error = %e, "Kafka reported an error."),
            None => {}
        }
        ctx.store_completed(consumer);
        ctx.commit_if_due(consumer);
        ctx.apply_backpressure(consumer);
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
    /// Messages sent to the lane and not yet taken into a batch.
    backlog: Arc<AtomicUsize>,
    /// The next offset expected; a message below it means the partition's offsets went back.
    next_offset: i64,
    paused: bool,
}

/// The consumer's context: owns the lanes and serves rebalances on the poll thread.
struct LaneContext {
    settings: ConsumerSettings,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    runtime: Handle,
    lanes: Mutex<HashMap<i32, Lane>>,
    next_lane_id: AtomicU64,
    completions_tx: std_mpsc::Sender<Completion>,
    completions: Mutex<std_mpsc::Receiver<Completion>>,
    /// When offsets were last committed, and whether some were stored since.
    commit_state: Mutex<(Instant, bool)>,
}

impl ClientContext for LaneContext {}

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
        // A partition paused for backpressure by an earlier owner's lane may come back paused;
        // its new lane starts empty, so it starts fetching.
        if let Rebalance::Assign(tpl) = rebalance {
            if let Err(e) = consumer.resume(tpl) {
                tracing::warn!(error = %e, "Could not resume newly assigned partitions.");
            }
        }
        let assigned = consumer.assignment().map(|a| a.count()).unwrap_or(0);
        self.metrics.assigned_partitions.set(assigned as i64);
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => {
                for e in offsets.elements_for_topic(&self.settings.topic) {
                    if let Offset::Offset(o) = e.offset() {
                        self.metrics
                            .committed_offset
                            .with_label_values(&[&e.partition().to_string()])
                            .set(o);
                    }
                }
            }
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "An offset commit failed; its messages will be replayed harmlessly.")
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
    ) -> Self {
        let (completions_tx, completions) = std_mpsc::channel();
        Self {
            settings,
            processor,
            metrics,
            runtime,
            lanes: Mutex::new(HashMap::new()),
            next_lane_id: AtomicU64::new(0),
            completions_tx,
            completions: Mutex::new(completions),
            commit_state: Mutex::new((Instant::now(), false)),
        }
    }

    /// Hands a message to its partition's lane, starting the lane on its first message.
    fn route(&self, message: &BorrowedMessage<'_>) {
        let partition = message.partition();
        let mut lanes = self.lanes.lock().expect("lanes lock");
        let lane = lanes
            .entry(partition)
            .or_insert_with(|| self.start_lane(partition, message.offset()));
        if message.offset() < lane.next_offset {
            // A truncated or recreated topic, or an offset reset: these may be new messages at
            // reused offsets. The claims make any replay among them harmless, so all are applied.
            tracing::warn!(
                partition,
                offset = message.offset(),
                expected = lane.next_offset,
                "Offsets went backwards; processing the messages again."
            );
        }
        lane.next_offset = message.offset() + 1;
        lane.backlog.fetch_add(1, Ordering::Relaxed);
        let _ = lane.messages.send(RawMessage {
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            value: message.payload().map(<[u8]>::to_vec),
        });
    }

    fn start_lane(&self, partition: i32, first_offset: i64) -> Lane {
        let id = self.next_lane_id.fetch_add(1, Ordering::Relaxed);
        let (messages, rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let backlog = Arc::new(AtomicUsize::new(0));
        let worker = LaneWorker {
            id,
            partition,
            topic: self.settings.topic.clone(),
            batch_size: self.settings.batch_size.max(1),
            linger: self.settings.linger,
            max_retry_backoff: self.settings.max_retry_backoff,
            log_events: self.settings.log_events,
            processor: self.processor.clone(),
            metrics: self.metrics.clone(),
            stop: stop.clone(),
            backlog: backlog.clone(),
            completions: self.completions_tx.clone(),
        };
        tracing::debug!(partition, lane = id, first_offset, "Started a lane.");
        Lane {
            id,
            messages,
            stop,
            task: Some(self.runtime.spawn(worker.run(rx))),
            backlog,
            next_offset: first_offset,
            paused: false,
        }
    }

    /// Stores the offsets of committed batches whose lane still owns its partition.
    fn store_completed(&self, consumer: &BaseConsumer<Self>) {
        let completions = self.completions.lock().expect("completions lock");
        let lanes = self.lanes.lock().expect("lanes lock");
        let mut stored = false;
        for c in completions.try_iter() {
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

    fn commit_if_due(&self, consumer: &BaseConsumer<Self>) {
        let mut state = self.commit_state.lock().expect("commit lock");
        if state.1 && state.0.elapsed() >= self.settings.commit_interval {
            self.commit(consumer, CommitMode::Async);
            *state = (Instant::now(), false);
        }
    }

    fn commit(&self, consumer: &BaseConsumer<Self>, mode: CommitMode) {
        match consumer.commit_consumer_state(mode) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                tracing::warn!(error = %e, "An offset commit failed; its messages will be replayed harmlessly.")
            }
        }
    }

    /// Pauses a partition whose lane has fallen behind and resumes it once the lane catches up,
    /// so a slow database holds messages in Kafka rather than in memory.
    fn apply_backpressure(&self, consumer: &BaseConsumer<Self>) {
        let max = self.settings.max_backlog.max(self.settings.batch_size);
        let mut lanes = self.lanes.lock().expect("lanes lock");
        for (partition, lane) in lanes.iter_mut() {
            let backlog = lane.backlog.load(Ordering::Relaxed);
            let pause = !lane.paused && backlog > max;
            let resume = lane.paused && backlog <= max / 2;
            if !(pause || resume) {
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&self.settings.topic, *partition);
            let result = if pause {
                consumer.pause(&tpl)
            } else {
                consumer.resume(&tpl)
            };
            match result {
                Ok(()) => lane.paused = pause,
                Err(e) => {
                    tracing::warn!(partition, error = %e, "Could not pause or resume a partition.")
                }
            }
        }
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
        self.commit(consumer, CommitMode::Sync);
        *self.commit_state.lock().expect("commit lock") = (Instant::now(), false);
        let mut lanes = self.lanes.lock().expect("lanes lock");
        lanes.retain(|p, _| partitions.is_some_and(|ps| !ps.contains(p)));
    }
}

/// The task behind a lane: batches in offset order, each applied in one transaction.
struct LaneWorker {
    id: u64,
    partition: i32,
    topic: String,
    batch_size: usize,
    linger: Duration,
    max_retry_backoff: Duration,
    log_events: bool,
    processor: BatchProcessor,
    metrics: ConsumeMetrics,
    stop: CancellationToken,
    backlog: Arc<AtomicUsize>,
    completions: std_mpsc::Sender<Completion>,
}

impl LaneWorker {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<RawMessage>) {
        while let Some(batch) = self.next_batch(&mut rx).await {
            self.backlog.fetch_sub(batch.len(), Ordering::Relaxed);
            if self.stop.is_cancelled() || !self.apply(&batch).await {
                return;
            }
        }
    }

    /// Waits for a first message, then takes more until the batch is full or the linger ends.
    async fn next_batch(
        &self,
        rx: &mut mpsc::UnboundedReceiver<RawMessage>,
    ) -> Option<Vec<RawMessage>> {
        let first = tokio::select! {
            biased;
            _ = self.stop.cancelled() => return None,
            m = rx.recv() => m?,
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
    /// lane is stopped (false, nothing committed).
    async fn apply(&self, batch: &[RawMessage]) -> bool {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(100);
        loop {
            match self
                .processor
                .process(&self.topic, self.partition, batch)
                .await
            {
                Ok(report) => {
                    crate::failpoint!("consume::after_commit");
                    self.report(batch, &report, started);
                    return true;
                }
                Err(e) => {
                    self.metrics.batch_retries.inc();
                    tracing::warn!(partition = self.partition, error = %e, retry_in_ms = backoff.as_millis() as u64, "A batch did not commit; retrying it.");
                    let jitter =
                        Duration::from_millis(fastrand::u64(0..=backoff.as_millis() as u64 / 4));
                    tokio::select! {
                        _ = self.stop.cancelled() => return false,
                        _ = tokio::time::sleep(backoff + jitter) => {}
                    }
                    backoff = (backoff * 2).min(self.max_retry_backoff);
                }
            }
        }
    }

    fn report(&self, batch: &[RawMessage], report: &BatchReport, started: Instant) {
        let last = batch.last().expect("a batch is never empty").offset;
        let _ = self.completions.send(Completion {
            partition: self.partition,
            lane: self.id,
            next_offset: last + 1,
        });
        self.metrics.record(report);
        self.metrics.batch_size.observe(batch.len() as f64);
        self.metrics
            .batch_seconds
            .observe(started.elapsed().as_secs_f64());
        if self.log_events {
            for (key, event_type) in &report.applied_events {
                let event_type = event_type.as_deref().unwrap_or("-");
                tracing::info!(partition = self.partition, "Applied {key} ({event_type}).");
            }
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
            last_offset = last,
            applied = report.applied,
            duplicates = report.duplicates,
            failed = report.failed,
            "Committed a batch."
        );
    }
}

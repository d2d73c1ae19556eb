//! The poll thread: it owns the Kafka consumer, serves rebalances (a revoked partition's lane is
//! drained and its offsets committed before the partition goes), and moves each partition's
//! messages from its own librdkafka queue to its lane while the lane has room. The offsets it
//! stores and commits are in [`super::offsets`].

use super::ffi::PartitionFeed;
use super::health::Vitals;
use super::internal_events::{Emit, KafkaErrorReported};
use super::lane::{Completion, Lane, LaneWorker};
use super::offsets::FinalCommit;
use super::{BatchProcessor, ConsumeMetrics, ConsumerSettings, RawMessage};
use crate::telemetry::Health;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::TopicPartitionList;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The poll loop's heartbeat, as the probes name it.
pub(super) const POLL_LOOP: &str = "kafka poll loop";
/// The check that keeps the member not ready until it first joined its group.
pub(super) const GROUP: &str = "consumer group";

/// Serves the consumer: events and rebalances from its own queue, then messages from each
/// partition's queue while the partition's lane has room, then offsets.
pub(super) fn poll_until(consumer: &BaseConsumer<LaneContext>, shutdown: &CancellationToken) {
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
    /// The message's bytes and headers, read through librdkafka as a lane reads them: a header
    /// name that is not UTF-8 is read lossily (rdkafka's own iterator panics on one).
    fn from(message: &BorrowedMessage<'_>) -> Self {
        use rdkafka::Message as _;
        // SAFETY: the message is alive while it is borrowed here.
        let (headers, traceparent) = unsafe { super::ffi::headers_and_trace(message.ptr()) };
        RawMessage {
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            value: message.payload().map(<[u8]>::to_vec),
            traceparent,
            headers,
        }
    }
}

/// The messages waiting in `feed`, taken while they add up to less than `room` bytes (the
/// last one taken may pass it, as a single message may) and to at most [`MAX_CHUNK`], then
/// the error the feed gave, if it gave one.
fn take_chunk(feed: &PartitionFeed, room: usize) -> (Vec<RawMessage>, Option<KafkaError>) {
    let mut chunk = Vec::new();
    let mut bytes = 0;
    while bytes < room && chunk.len() < MAX_CHUNK {
        match feed.next() {
            None => break,
            Some(Ok(message)) => {
                bytes += message.queued_bytes();
                chunk.push(message);
            }
            Some(Err(e)) => return (chunk, Some(e)),
        }
    }
    (chunk, None)
}

/// The most messages handed to a lane at once.
const MAX_CHUNK: usize = 1024;

/// Starts the poll thread: it polls until `stop`, then leaves the group. The receiver hears
/// when it is done.
pub(super) fn spawn_thread(
    consumer: BaseConsumer<LaneContext>,
    stop: CancellationToken,
) -> anyhow::Result<tokio::sync::oneshot::Receiver<()>> {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kafka-poll".into())
        .spawn(move || {
            poll_until(&consumer, &stop);
            leave(consumer);
            let _ = done_tx.send(());
        })
        .map_err(|e| anyhow::anyhow!(e).context("starting the Kafka poll thread"))?;
    Ok(done_rx)
}

/// Stops fetching, drains every lane, commits, and leaves the group.
pub(super) fn leave(consumer: BaseConsumer<LaneContext>) {
    tracing::info!("Stopping: finishing the batches in flight.");
    let leaving = Some("leaving the group".to_owned());
    consumer.context().health.report(GROUP, leaving);
    consumer.context().stop_lanes(&consumer, None);
    consumer.unsubscribe();
    drop(consumer);
    tracing::info!("Left the consumer group.");
}

/// The consumer's context: owns the lanes and serves rebalances on the poll thread.
pub(super) struct LaneContext {
    pub(super) settings: ConsumerSettings,
    pub(super) processor: BatchProcessor,
    pub(super) metrics: ConsumeMetrics,
    pub(super) runtime: Handle,
    pub(super) lanes: Mutex<HashMap<i32, Lane>>,
    /// Each assigned partition, with its own queue (None if it could not be split off).
    pub(super) feeds: Mutex<HashMap<i32, Option<PartitionFeed>>>,
    pub(super) next_lane_id: AtomicU64,
    pub(super) completions_tx: std_mpsc::Sender<Completion>,
    pub(super) completions: Mutex<std_mpsc::Receiver<Completion>>,
    /// When offsets were last committed, and whether some were stored since.
    pub(super) commit_state: Mutex<(Instant, bool)>,
    pub(super) vitals: Arc<Vitals>,
    pub(super) health: Health,
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
                self.metrics
                    .forget_partition(&self.settings.topic, e.partition());
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
        // In the group: ready, whether or not this assignment holds any partition.
        self.health.report(GROUP, None);
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
            self.metrics
                .known_partition(&self.settings.topic, e.partition());
        }
        self.metrics.assigned_partitions.set(feeds.len() as i64);
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        self.committed(result, offsets);
    }
}

impl LaneContext {
    pub(super) fn new(
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

    /// Counts and logs an error Kafka reported; a streak of them shows in `/readyz`.
    fn kafka_error(&self, error: &KafkaError) {
        let partition = None;
        KafkaErrorReported { partition, error }.emit(&self.metrics);
        self.vitals.kafka_error(error.to_string());
    }

    /// Like [`LaneContext::kafka_error`], for an error of one partition's fetches: its streak is
    /// the partition's own.
    fn partition_error(&self, partition: i32, error: &KafkaError) {
        let reported = KafkaErrorReported {
            partition: Some(partition),
            error,
        };
        reported.emit(&self.metrics);
        self.vitals.partition_error(partition, error.to_string());
    }

    /// Moves messages from each partition's queue to its lane while the lane holds less than
    /// its byte budget, in chunks: one hand-off per partition and round, not one per message;
    /// true when any moved.
    fn pump(&self) -> bool {
        let feeds = self.feeds.lock().expect("feeds lock");
        let mut lanes = self.lanes.lock().expect("lanes lock");
        let budget = self.settings.max_lane_bytes.max(1);
        let mut moved = false;
        for (&partition, feed) in feeds.iter() {
            let Some(feed) = feed else { continue };
            let holds = lanes.get(&partition).map_or(0, Lane::holds);
            let (chunk, error) = take_chunk(feed, budget.saturating_sub(holds));
            if !chunk.is_empty() {
                self.vitals.kafka_message();
                self.vitals.partition_advanced(partition);
                self.route_to(&mut lanes, partition, chunk);
                moved = true;
            }
            if let Some(e) = error {
                self.partition_error(partition, &e);
            }
        }
        moved
    }

    /// Hands a message to its partition's lane, starting the lane on its first message.
    fn route(&self, partition: i32, message: RawMessage) {
        let mut lanes = self.lanes.lock().expect("lanes lock");
        self.route_to(&mut lanes, partition, vec![message]);
    }

    /// Hands `chunk` (not empty, in offset order) to its partition's lane, starting the lane on
    /// its first message.
    fn route_to(&self, lanes: &mut HashMap<i32, Lane>, partition: i32, chunk: Vec<RawMessage>) {
        let lane = lanes
            .entry(partition)
            .or_insert_with(|| self.start_lane(partition, chunk[0].offset));
        for (offset, expected) in lane.push(chunk) {
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

    /// Stops the given lanes (all when `None`), waits for their batches in flight to commit or
    /// roll back, stores and commits what committed, and forgets the lanes. Runs on the poll
    /// thread, inside a revoke or at shutdown, while the partitions are still ours.
    pub(super) fn stop_lanes(&self, consumer: &BaseConsumer<Self>, partitions: Option<&[i32]>) {
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
        let outcome = self.commit_now(consumer);
        let due = outcome != FinalCommit::Committed;
        *self.commit_state.lock().expect("commit lock") = (Instant::now(), due);
        if outcome == FinalCommit::Failed && partitions.is_none() {
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

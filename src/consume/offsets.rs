//! The offset bookkeeping of the poll thread: a committed batch's offset is stored only while its
//! lane still owns the partition, stored offsets are committed on an interval (and at once on a
//! revoke or a stop), and each partition's lag is set from librdkafka's statistics: the
//! `replayproof_consumer_lag` gauge has this one writer.

use super::ffi;
use super::poll::LaneContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::time::{Duration, Instant};

/// Tries of the synchronous commit on a revoke or a stop.
const FINAL_COMMIT_ATTEMPTS: u32 = 3;

/// How the last commit before a revoke or a stop went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FinalCommit {
    /// The stored offsets are committed (or there was nothing to commit).
    Committed,
    /// The group is in the middle of a rebalance (members stopping or joining together): it
    /// refuses commits from this member until it polls again, and the next owner replays the
    /// uncommitted batches harmlessly. Part of a group's life, not a fault of this member.
    Rebalancing,
    /// The commit failed for another reason: the coordinator unreachable or failing, or this
    /// member evicted from the group (an unknown member, an old generation: it stalled past
    /// the group's limits).
    Failed,
}

/// Whether a commit refused with `code` means the group is rebalancing. A member the group
/// evicted hears `UnknownMemberId` or `IllegalGeneration`: that is its own stall, a failure.
fn rebalancing(code: RDKafkaErrorCode) -> bool {
    code == RDKafkaErrorCode::RebalanceInProgress
}

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
                self.metrics.activity.lag(*partition, lag);
                self.metrics
                    .consumer_lag
                    .with_label_values(&[&self.settings.topic, &partition.to_string()])
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

impl LaneContext {
    /// Stores the offsets of committed batches whose lane still owns its partition.
    pub(super) fn store_completed(&self, consumer: &BaseConsumer<Self>) {
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
                Ok(()) => stored = true,
                Err(e) => {
                    tracing::warn!(partition = c.partition, error = %e, "Could not store an offset; the batch will be replayed harmlessly.")
                }
            }
        }
        if stored {
            self.commit_state.lock().expect("commit lock").1 = true;
        }
    }

    /// Commits asynchronously when offsets were stored (or a commit failed) since the last one
    /// and the interval has passed. A failure reported later marks the commit due again.
    pub(super) fn commit_if_due(&self, consumer: &BaseConsumer<Self>) {
        {
            let mut state = self.commit_state.lock().expect("commit lock");
            if !(state.1 && state.0.elapsed() >= self.settings.commit_interval) {
                return;
            }
            *state = (Instant::now(), false);
        }
        if !ffi::commit_async(consumer) {
            self.commit_state.lock().expect("commit lock").1 = true;
        }
    }

    /// Commits the stored offsets and says how it went (a failure is logged).
    fn commit(&self, consumer: &BaseConsumer<Self>, mode: CommitMode) -> FinalCommit {
        match consumer.commit_consumer_state(mode) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {
                FinalCommit::Committed
            }
            Err(KafkaError::ConsumerCommit(code)) if rebalancing(code) => {
                tracing::warn!(error = %code, "The group is rebalancing, so the offsets could not be committed; the next owner replays the last batches harmlessly.");
                FinalCommit::Rebalancing
            }
            Err(e) => {
                tracing::warn!(error = %e, "An offset commit failed; its messages will be replayed harmlessly.");
                FinalCommit::Failed
            }
        }
    }

    /// Commits synchronously, trying a few times: the last commit before a revoke or a stop.
    /// A rebalancing group refuses every try until this member polls again, so its refusal
    /// ends the tries at once.
    pub(super) fn commit_now(&self, consumer: &BaseConsumer<Self>) -> FinalCommit {
        let mut outcome = FinalCommit::Failed;
        for attempt in 1..=FINAL_COMMIT_ATTEMPTS {
            outcome = self.commit(consumer, CommitMode::Sync);
            if outcome != FinalCommit::Failed {
                break;
            }
            if attempt < FINAL_COMMIT_ATTEMPTS {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        outcome
    }

    /// Serves a commit's outcome: a failure marks the commit due again; a success shows each
    /// owned partition's committed offset.
    pub(super) fn committed(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
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
                    .with_label_values(&[&self.settings.topic, &e.partition().to_string()])
                    .set(o);
            }
        }
    }
}

//! A partition's lane: the task that takes the partition's messages in offset order, in
//! batches, applies each batch in one transaction ([`BatchProcessor`]), holds the events whose
//! effect is waiting for another attempt, and reports the next offset to store only after its
//! batch committed.

use super::batch::{BatchError, BatchReport, RawMessage};
use super::health::Vitals;
use super::internal_events::{BatchCommitted, BatchRetried, Emit, LanePanicked};
use super::{BatchProcessor, ConsumeMetrics, Retrying};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What a queued message costs beyond its key and value: the allocation and its bookkeeping.
const MESSAGE_OVERHEAD_BYTES: usize = 64;

impl RawMessage {
    /// What the message costs while queued for its lane: the budget `--max-lane-bytes` counts.
    pub fn queued_bytes(&self) -> usize {
        MESSAGE_OVERHEAD_BYTES
            + self.key.as_ref().map_or(0, Vec::len)
            + self.value.as_ref().map_or(0, Vec::len)
            + self.traceparent.as_ref().map_or(0, String::len)
            + self.headers.byte_len()
    }
}

/// A batch that committed, reported by its lane.
pub(super) struct Completion {
    pub(super) partition: i32,
    pub(super) lane: u64,
    /// The offset after the batch's last message: the next one to read.
    pub(super) next_offset: i64,
}

/// One partition's ordered lane, as seen from the poll thread.
pub(super) struct Lane {
    pub(super) id: u64,
    /// Chunks of the partition's messages, in offset order.
    pub(super) messages: mpsc::UnboundedSender<Vec<RawMessage>>,
    pub(super) stop: CancellationToken,
    /// Taken when the lane is stopped, to wait for it.
    pub(super) task: Option<tokio::task::JoinHandle<()>>,
    /// Bytes of the messages sent to the lane and not yet taken into a batch.
    pub(super) queued_bytes: Arc<AtomicUsize>,
    /// Bytes of the events whose effect failed and that wait in the lane for another attempt:
    /// they count in the lane's budget too.
    pub(super) held_bytes: Arc<AtomicUsize>,
    /// The next offset expected; a message below it means the partition's offsets went back.
    pub(super) next_offset: i64,
}

impl Lane {
    /// What the lane holds beyond its batch in flight: queued messages and held retries.
    pub(super) fn holds(&self) -> usize {
        self.queued_bytes
            .load(Ordering::Relaxed)
            .saturating_add(self.held_bytes.load(Ordering::Relaxed))
    }

    /// Queues a chunk of messages for the lane, and says which of them have an offset below
    /// the one expected (with the one expected): a truncated or recreated topic, or an offset
    /// reset. Those may be new messages at reused offsets, and the claims make any replay among
    /// them harmless, so they are queued too.
    pub(super) fn push(&mut self, chunk: Vec<RawMessage>) -> Vec<(i64, i64)> {
        let mut rewound = Vec::new();
        let mut bytes = 0;
        for message in &chunk {
            if message.offset < self.next_offset {
                rewound.push((message.offset, self.next_offset));
            }
            self.next_offset = message.offset + 1;
            bytes += message.queued_bytes();
        }
        self.queued_bytes.fetch_add(bytes, Ordering::Relaxed);
        let _ = self.messages.send(chunk);
        rewound
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
pub(super) struct LaneWorker {
    pub(super) id: u64,
    pub(super) partition: i32,
    /// The offset of the first message handed to the lane.
    pub(super) first_offset: i64,
    pub(super) topic: String,
    pub(super) batch_size: usize,
    pub(super) linger: Duration,
    pub(super) max_retry_backoff: Duration,
    pub(super) batch_timeout: Duration,
    pub(super) processor: BatchProcessor,
    pub(super) metrics: ConsumeMetrics,
    pub(super) stop: CancellationToken,
    pub(super) queued_bytes: Arc<AtomicUsize>,
    /// What the lane's held retries take ([`Retrying::bytes`]), for the poll loop's budget.
    pub(super) held_bytes: Arc<AtomicUsize>,
    pub(super) completions: std_mpsc::Sender<Completion>,
    /// When the batch in hand started (ms since the vitals' epoch), 0 when there is none.
    pub(super) busy_since: Arc<AtomicU64>,
    pub(super) vitals: Arc<Vitals>,
}

/// The lane's side of its messages: the chunks the poll thread sent, and the part of the last
/// one not yet taken into a batch.
struct Queue {
    rx: mpsc::UnboundedReceiver<Vec<RawMessage>>,
    pending: VecDeque<RawMessage>,
}

impl Queue {
    /// Moves pending messages, oldest first, into `batch` until it holds `size`; true when it
    /// does. What does not fit stays pending for the next batch.
    fn top_up(&mut self, batch: &mut Vec<RawMessage>, size: usize) -> bool {
        let room = size.saturating_sub(batch.len()).min(self.pending.len());
        batch.extend(self.pending.drain(..room));
        batch.len() >= size
    }
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
    pub(super) async fn run(self, rx: mpsc::UnboundedReceiver<Vec<RawMessage>>) {
        use futures_util::FutureExt as _;
        let mut progress = Progress {
            reported: Some(self.first_offset),
            ..Progress::default()
        };
        let mut queue = Queue {
            rx,
            pending: VecDeque::new(),
        };
        while let Some(batch) = self
            .next_batch(&mut queue, progress.retrying.next_due())
            .await
        {
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
        LanePanicked.emit(&self.metrics);
        self.vitals.fail(format!(
            "the lane of partition {} panicked: {message}",
            self.partition
        ));
    }

    /// Waits for a first message, then takes more until the batch is full or the linger ends.
    /// When an event's retry falls due first, the batch is empty: the pass applies the retry.
    async fn next_batch(
        &self,
        queue: &mut Queue,
        retry_due: Option<tokio::time::Instant>,
    ) -> Option<Vec<RawMessage>> {
        let retry = async {
            match retry_due {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending().await,
            }
        };
        if queue.pending.is_empty() {
            let chunk = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return None,
                chunk = queue.rx.recv() => chunk?,
                _ = retry => return Some(Vec::new()),
            };
            queue.pending.extend(chunk);
        }
        let mut batch = Vec::with_capacity(self.batch_size.min(queue.pending.len()));
        let deadline = tokio::time::Instant::now() + self.linger;
        while !queue.top_up(&mut batch, self.batch_size) {
            match queue.rx.try_recv() {
                Ok(chunk) => queue.pending.extend(chunk),
                Err(_) => match tokio::time::timeout_at(deadline, queue.rx.recv()).await {
                    Ok(Some(chunk)) => queue.pending.extend(chunk),
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
                    // Busy again at once while parts of the batch are left.
                    let busy = if parts.is_empty() {
                        0
                    } else {
                        self.vitals.now_ms()
                    };
                    self.busy_since.store(busy, Ordering::Relaxed);
                    self.report(part, progress.advance(part), &report, started);
                    backoff = Duration::from_millis(100);
                    continue;
                }
                Err(BatchError::TimedOut(limit)) if part.len() > 1 => {
                    BatchRetried::InHalves {
                        partition: self.partition,
                        messages: part.len(),
                        limit,
                    }
                    .emit(&self.metrics);
                    let (left, right) = part.split_at(part.len() / 2);
                    parts.extend([right, left]);
                    continue;
                }
                Err(error) => {
                    BatchRetried::Later {
                        partition: self.partition,
                        error: &error,
                        retry_in: backoff,
                    }
                    .emit(&self.metrics);
                    parts.push(part);
                }
            }
            if !self.back_off(&mut backoff).await {
                return false;
            }
        }
        true
    }

    /// Waits `backoff` with some jitter, then doubles it up to the cap; false when the lane was
    /// stopped meanwhile.
    async fn back_off(&self, backoff: &mut Duration) -> bool {
        let jitter = Duration::from_millis(fastrand::u64(0..=backoff.as_millis() as u64 / 4));
        tokio::select! {
            _ = self.stop.cancelled() => return false,
            _ = tokio::time::sleep(*backoff + jitter) => {}
        }
        *backoff = (*backoff * 2).min(self.max_retry_backoff);
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
        BatchCommitted {
            partition: self.partition,
            messages: batch.len(),
            last_offset: batch.last().map(|m| m.offset),
            next_offset,
            report,
            took: started.elapsed(),
        }
        .emit(&self.metrics);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(offset: i64) -> RawMessage {
        RawMessage {
            offset,
            key: None,
            value: Some(format!("m{offset}").into_bytes()),
            traceparent: None,
            headers: Default::default(),
        }
    }

    #[test]
    fn chunks_are_cut_into_batches_in_offset_order_and_the_rest_waits_for_the_next() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut queue = Queue {
            rx,
            pending: VecDeque::new(),
        };
        tx.send((0..1200).map(message).collect()).unwrap();
        tx.send((1200..1400).map(message).collect()).unwrap();
        queue.pending.extend(queue.rx.try_recv().unwrap());
        let offsets = |batch: &[RawMessage]| batch.iter().map(|m| m.offset).collect::<Vec<_>>();
        let mut batches = Vec::new();
        for _ in 0..2 {
            let mut batch = Vec::new();
            assert!(queue.top_up(&mut batch, 500));
            batches.push(offsets(&batch));
        }
        // The chunk's last 200 do not fill a batch: the next chunk tops it up, and what does not
        // fit waits.
        let mut batch = Vec::new();
        assert!(!queue.top_up(&mut batch, 500));
        queue.pending.extend(queue.rx.try_recv().unwrap());
        assert!(!queue.top_up(&mut batch, 500));
        batches.push(offsets(&batch));
        assert_eq!(batches[0], (0..500).collect::<Vec<_>>());
        assert_eq!(batches[1], (500..1000).collect::<Vec<_>>());
        assert_eq!(batches[2], (1000..1400).collect::<Vec<_>>());
        let mut batch = vec![message(0); 450];
        tx.send((1400..1600).map(message).collect()).unwrap();
        queue.pending.extend(queue.rx.try_recv().unwrap());
        assert!(queue.top_up(&mut batch, 500));
        assert_eq!(offsets(&batch[450..]), (1400..1450).collect::<Vec<_>>());
        assert_eq!(queue.pending.front().map(|m| m.offset), Some(1450));
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
        let rewound: Vec<_> = [vec![0, 1], vec![2, 0, 1], vec![2, 3]]
            .into_iter()
            .map(|chunk| lane.push(chunk.into_iter().map(message).collect()))
            .collect();
        assert_eq!(rewound, [vec![], vec![(0, 3)], vec![]]);
        let mut queued = Vec::new();
        while let Ok(chunk) = rx.try_recv() {
            queued.extend(chunk.iter().map(|m| m.offset));
        }
        assert_eq!(queued, [0, 1, 2, 0, 1, 2, 3]);
        // Seven values of two bytes, each with its bookkeeping.
        assert_eq!(
            lane.queued_bytes.load(Ordering::Relaxed),
            7 * (2 + MESSAGE_OVERHEAD_BYTES)
        );
    }
}

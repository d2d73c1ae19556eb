//! `replayproof replay`: recovery by time. Reads the topic again from the offsets of a moment
//! (librdkafka's `offsets_for_times`) and runs every message through the normal claim path: a
//! key already claimed is a duplicate and changes nothing, and only events with no claim are
//! applied. A bad deploy that skipped work, or a restore that lost claims, is mended by
//! replaying its window.
//!
//! The reader is outside the live group: it assigns partitions itself under a group id of its
//! own and never commits, so the live group's committed offsets are untouched.
//!
//! A window is refused when it may reach data the topic no longer holds (it starts before the
//! first retained message of a partition whose start was deleted), or past the claims'
//! retention (a key pruned since would look new: the consumer would catch it as an expired
//! replay, not apply it, but the window would not do what was asked) unless `force` says so.

use super::{Act, Change, OperatorError};
use crate::consume::{BatchProcessor, BatchReport, RawMessage};
use crate::db::Db;
use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The messages of one partition applied in one transaction.
pub const REPLAY_BATCH: usize = 500;
/// How long the broker may stay silent before the replay gives up.
pub const SILENCE_LIMIT: Duration = Duration::from_secs(30);

/// What to read again.
#[derive(Debug, Clone)]
pub struct Window {
    pub brokers: String,
    pub topic: String,
    /// librdkafka properties (TLS, SASL), as every client of the topic has them.
    pub options: Vec<(String, String)>,
    pub since: DateTime<Utc>,
    /// Up to this moment (exclusive); the partitions' ends at the start when not given.
    pub until: Option<DateTime<Utc>>,
    /// Only this partition.
    pub partition: Option<i32>,
    /// Read and count; apply nothing, record nothing.
    pub dry_run: bool,
    /// Replay even a window the checks refuse.
    pub force: bool,
}

impl Window {
    fn describe(&self) -> String {
        let until = self
            .until
            .map(|u| u.to_rfc3339())
            .unwrap_or_else(|| "the end".into());
        let partition = self
            .partition
            .map(|p| format!(" partition {p}"))
            .unwrap_or_default();
        format!(
            "{}{partition} from {} to {until}",
            self.topic,
            self.since.to_rfc3339()
        )
    }
}

/// The offsets one partition is read between.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PartitionRange {
    pub partition: i32,
    /// The first offset read.
    pub from: i64,
    /// The offset read up to, not included.
    pub to: i64,
}

/// What a replay read and did.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ReplayReport {
    pub dry_run: bool,
    pub partitions: Vec<PartitionRange>,
    pub read: usize,
    /// Their key was claimed: nothing changed.
    pub already_applied: usize,
    /// Their key had no claim: applied now (would be, on a dry run).
    pub newly_applied: usize,
    /// Not envelopes: dead letters (would be, on a dry run).
    pub dead_lettered: usize,
    /// Their key was claimed with another payload: recorded as key conflicts.
    pub conflicts: usize,
    /// Applied now but their effect failed, or deferred; or caught as expired replays.
    pub failed: usize,
    pub deferred: usize,
    pub expired: usize,
    /// Messages that carry no event (Debezium's tombstones): passed over.
    pub skipped: usize,
}

impl ReplayReport {
    fn add(&mut self, r: &BatchReport) {
        self.newly_applied += r.applied;
        self.already_applied += r.duplicates;
        self.conflicts += r.conflicts;
        self.dead_lettered += r.dead_letters.len();
        self.failed += r.failed;
        self.deferred += r.deferred;
        self.expired += r.expired;
        self.skipped += r.skipped;
    }

    fn summary(&self) -> String {
        format!(
            "read {}, already applied {}, newly applied {}, dead-lettered {}, conflicts {}, failed {}, deferred {}, expired {}, skipped {}",
            self.read,
            self.already_applied,
            self.newly_applied,
            self.dead_lettered,
            self.conflicts,
            self.failed,
            self.deferred,
            self.expired,
            self.skipped
        )
    }
}

/// Why a window was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("the window ends before it starts")]
    Empty,
    #[error("partition {partition} no longer holds the start of the window: its first retained message (offset {low}) is from {first}, after {since}; messages before it were deleted (--force replays what is left)")]
    BeforeRetained {
        partition: i32,
        low: i64,
        first: DateTime<Utc>,
        since: DateTime<Utc>,
    },
    #[error("the claims of {sources} were pruned up to {pruned_before}, after the window's start: their events would not be applied again but caught as expired replays (--force replays anyway)")]
    PastRetention {
        sources: String,
        pruned_before: DateTime<Utc>,
    },
    #[error("the topic {0} has no partition {1}")]
    NoPartition(String, i32),
}

/// Whether a partition's window starts before its retained data: its start was deleted
/// (`low > 0`), the window begins at the first retained message, and that message is later
/// than the window's start.
pub fn starts_before_retained(
    low: i64,
    start: i64,
    first: Option<DateTime<Utc>>,
    since: DateTime<Utc>,
) -> bool {
    low > 0 && start <= low && first.is_some_and(|first| first > since)
}

/// Reads `window` again and runs it through `processor`, as the consumer would; audited as
/// `act` unless it is a dry run.
pub async fn replay(
    pool: &Db,
    processor: &BatchProcessor,
    window: &Window,
    act: &Act,
) -> Result<ReplayReport, OperatorError> {
    if window.until.is_some_and(|u| u <= window.since) {
        return Err(anyhow::Error::from(Refusal::Empty).into());
    }
    if !window.force {
        // Each database prunes its own claims: the window must be within every one's horizons.
        for (_, shard) in processor.shards.databases() {
            check_retention(shard, window.since).await?;
        }
    }
    let plan = {
        let window = window.clone();
        tokio::task::spawn_blocking(move || plan(&window))
            .await
            .map_err(anyhow::Error::from)??
    };
    let mut report = ReplayReport {
        dry_run: window.dry_run,
        partitions: plan.clone(),
        ..ReplayReport::default()
    };
    let ranges: Vec<_> = plan.into_iter().filter(|r| r.from < r.to).collect();
    if !ranges.is_empty() {
        read(pool, processor, window, &ranges, &mut report).await?;
    }
    if !window.dry_run {
        let change = Change::new(
            &format!("topic:{}", window.topic),
            window.describe(),
            report.summary(),
        );
        let mut tx = pool.begin().await?;
        crate::audit::record(&mut tx, act.audit("replay", &change)).await?;
        tx.commit().await?;
    }
    tracing::info!(window = %window.describe(), report = %report.summary(), dry_run = window.dry_run, "Replayed a window of the topic.");
    Ok(report)
}

/// Refuses a window that starts before a source's prune horizon.
async fn check_retention(pool: &Db, since: DateTime<Utc>) -> Result<(), OperatorError> {
    let pruned = sqlx::query!(
        r#"SELECT string_agg(source, ', ' ORDER BY source) AS sources, max(pruned_before) AS pruned_before
           FROM prune_horizons WHERE pruned_before > $1"#,
        since
    )
    .fetch_one(pool)
    .await?;
    if let (Some(sources), Some(pruned_before)) = (pruned.sources, pruned.pruned_before) {
        return Err(anyhow::Error::from(Refusal::PastRetention {
            sources,
            pruned_before,
        })
        .into());
    }
    Ok(())
}

/// A consumer outside every group that matters: a group id of its own, never committed.
fn reader<
    C: rdkafka::consumer::ConsumerContext + 'static,
    T: rdkafka::config::FromClientConfigAndContext<C>,
>(
    window: &Window,
    context: C,
) -> anyhow::Result<T> {
    let group = format!(
        "replayproof-replay-{}",
        hex::encode(fastrand::u64(..).to_be_bytes())
    );
    let tuning = [("client.id", "replayproof-replay".to_owned())];
    let config = crate::kafka::client_config(
        crate::kafka::Role::Consumer,
        &window.brokers,
        Some(&group),
        &tuning,
        &window.options,
    )?;
    Ok(config.create_with_context(context)?)
}

/// Each partition's offsets for the window, checked against what the topic still holds.
fn plan(window: &Window) -> anyhow::Result<Vec<PartitionRange>> {
    let consumer: BaseConsumer = reader(window, rdkafka::consumer::DefaultConsumerContext)?;
    let timeout = Duration::from_secs(10);
    let partitions = partitions_of(&consumer, window, timeout)?;
    let at = |moment: DateTime<Utc>| -> anyhow::Result<BTreeMap<i32, Offset>> {
        let mut tpl = TopicPartitionList::new();
        for &p in &partitions {
            tpl.add_partition_offset(&window.topic, p, Offset::Offset(moment.timestamp_millis()))?;
        }
        let found = consumer.offsets_for_times(tpl, timeout)?;
        Ok(found
            .elements()
            .iter()
            .map(|e| (e.partition(), e.offset()))
            .collect())
    };
    let starts = at(window.since)?;
    let ends = window.until.map(at).transpose()?;
    let mut ranges = Vec::new();
    for &p in &partitions {
        let (low, high) = consumer.fetch_watermarks(&window.topic, p, timeout)?;
        let resolve = |o: Option<&Offset>| match o {
            Some(Offset::Offset(o)) => *o,
            // No message at or after the moment: the partition's end.
            _ => high,
        };
        let from = resolve(starts.get(&p)).max(low);
        let to = match &ends {
            Some(ends) => resolve(ends.get(&p)).min(high),
            None => high,
        };
        if !window.force && low > 0 && from <= low && from < high {
            check_retained(window, p, low, from)?;
        }
        ranges.push(PartitionRange {
            partition: p,
            from,
            to: to.max(from),
        });
    }
    Ok(ranges)
}

/// The window's partitions, in order: every partition of the topic, or the one it names.
fn partitions_of(
    consumer: &BaseConsumer,
    window: &Window,
    timeout: Duration,
) -> anyhow::Result<Vec<i32>> {
    let metadata = consumer.fetch_metadata(Some(&window.topic), timeout)?;
    let topic = metadata
        .topics()
        .first()
        .filter(|t| t.error().is_none() && !t.partitions().is_empty())
        .ok_or_else(|| anyhow::anyhow!("the topic {} does not exist", window.topic))?;
    let mut partitions: Vec<i32> = topic.partitions().iter().map(|p| p.id()).collect();
    partitions.sort_unstable();
    if let Some(p) = window.partition {
        anyhow::ensure!(
            partitions.contains(&p),
            Refusal::NoPartition(window.topic.clone(), p)
        );
        partitions = vec![p];
    }
    Ok(partitions)
}

/// Refuses a window of partition `p` that starts before the data the topic still holds.
fn check_retained(window: &Window, p: i32, low: i64, from: i64) -> anyhow::Result<()> {
    let first = first_timestamp(window, p, low)?;
    if starts_before_retained(low, from, first, window.since) {
        anyhow::bail!(Refusal::BeforeRetained {
            partition: p,
            low,
            first: first.expect("checked"),
            since: window.since,
        });
    }
    Ok(())
}

/// The timestamp of the message at `offset`.
fn first_timestamp(
    window: &Window,
    partition: i32,
    offset: i64,
) -> anyhow::Result<Option<DateTime<Utc>>> {
    let consumer: BaseConsumer = reader(window, rdkafka::consumer::DefaultConsumerContext)?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&window.topic, partition, Offset::Offset(offset))?;
    consumer.assign(&tpl)?;
    let deadline = std::time::Instant::now() + SILENCE_LIMIT;
    while std::time::Instant::now() < deadline {
        if let Some(message) = consumer.poll(Duration::from_millis(200)) {
            let message = message?;
            return Ok(message
                .timestamp()
                .to_millis()
                .and_then(DateTime::from_timestamp_millis));
        }
    }
    anyhow::bail!("partition {partition}: no message at offset {offset} within {SILENCE_LIMIT:?}")
}

/// Reads each range and applies it in batches, as the consumer's lanes would.
async fn read(
    pool: &Db,
    processor: &BatchProcessor,
    window: &Window,
    ranges: &[PartitionRange],
    report: &mut ReplayReport,
) -> Result<(), OperatorError> {
    let consumer: StreamConsumer = reader(window, rdkafka::consumer::DefaultConsumerContext)?;
    let mut tpl = TopicPartitionList::new();
    for r in ranges {
        tpl.add_partition_offset(&window.topic, r.partition, Offset::Offset(r.from))
            .map_err(anyhow::Error::from)?;
    }
    consumer.assign(&tpl).map_err(anyhow::Error::from)?;
    let ends: BTreeMap<i32, i64> = ranges.iter().map(|r| (r.partition, r.to)).collect();
    let mut pending: BTreeMap<i32, Vec<RawMessage>> = BTreeMap::new();
    let mut open: std::collections::BTreeSet<i32> = ends.keys().copied().collect();
    while !open.is_empty() {
        let message = tokio::time::timeout(SILENCE_LIMIT, consumer.recv())
            .await
            .map_err(|_| anyhow::anyhow!("the broker sent nothing for {SILENCE_LIMIT:?}; partitions {open:?} were not read to their ends"))?
            .map_err(anyhow::Error::from)?;
        let (p, offset) = (message.partition(), message.offset());
        let Some(&end) = ends.get(&p) else { continue };
        if offset >= end {
            continue;
        }
        report.read += 1;
        // The consumer's own reading of a message: key, value and traceparent.
        let raw = RawMessage::from(&message);
        let batch = pending.entry(p).or_default();
        batch.push(raw);
        let done = offset + 1 >= end;
        if done || batch.len() >= REPLAY_BATCH {
            let batch = std::mem::take(batch);
            apply(pool, processor, window, p, &batch, report).await?;
        }
        if done {
            open.remove(&p);
        }
    }
    Ok(())
}

async fn apply(
    pool: &Db,
    processor: &BatchProcessor,
    window: &Window,
    partition: i32,
    batch: &[RawMessage],
    report: &mut ReplayReport,
) -> Result<(), OperatorError> {
    if !window.dry_run {
        let done = processor
            .process(&window.topic, partition, batch)
            .await
            .map_err(|e| anyhow::anyhow!("applying partition {partition}: {e}"))?;
        report.add(&done);
        return Ok(());
    }
    let mut keys = Vec::new();
    for m in batch {
        match processor.input.read(&m.as_input(&window.topic)) {
            Ok(crate::inputs::Reading::Event(event)) => keys.push(event.key.as_str().to_owned()),
            Ok(crate::inputs::Reading::Skipped { .. }) => report.skipped += 1,
            Err(_) => report.dead_lettered += 1,
        }
    }
    let claimed = sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM processed_events WHERE event_key = ANY($1)"#,
        &keys
    )
    .fetch_one(pool)
    .await? as usize;
    let mut unique = keys.clone();
    unique.sort_unstable();
    unique.dedup();
    report.already_applied += keys.len() - (unique.len() - claimed);
    report.newly_applied += unique.len() - claimed;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[test]
    fn a_window_starts_before_retained_data_only_when_the_start_was_deleted_and_is_later() {
        let since = at("2026-12-02T10:00:00Z");
        let later = Some(at("2026-12-02T10:05:00Z"));
        let earlier = Some(at("2026-12-02T09:55:00Z"));
        // Nothing deleted: the topic holds everything from its start.
        assert!(!starts_before_retained(0, 0, later, since));
        // Deleted, and the first retained message is after the window's start.
        assert!(starts_before_retained(100, 100, later, since));
        // Deleted, but only messages older than the window: the window is whole.
        assert!(!starts_before_retained(100, 100, earlier, since));
        // The window starts past the first retained message.
        assert!(!starts_before_retained(100, 150, later, since));
    }
}

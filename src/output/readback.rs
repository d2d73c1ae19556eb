//! Reading an output partition back after a send whose outcome is unknown: every record from
//! the offset the partition is known to be settled at to the end of the log, collected by its
//! record id header. Blocking: run it on a blocking thread.

use super::RECORD_ID_HEADER;
use anyhow::Context as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::time::{Duration, Instant};

/// What a read-back found: each record id with its offset, and the end of the log it read to
/// (where the next read-back starts once this one is recorded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadBack {
    pub found: Vec<(String, i64)>,
    pub end: i64,
    /// False when its time ran out first: `end` is then where it stopped, and the rest of the
    /// log is read by the next read-back, from there.
    pub complete: bool,
}

/// Why a read-back could not be trusted.
#[derive(Debug, thiserror::Error)]
pub enum Unreadable {
    /// The records it would read were deleted (retention, a recreated topic): a record may be
    /// in the topic without the relay seeing it, so the partition stops.
    #[error(
        "the partition's log starts at offset {low}, after offset {from} where the read-back \
         must start: records the relay may have written are gone (deleted by retention, or the \
         topic was recreated)"
    )]
    Truncated { from: i64, low: i64 },
    /// The log ends before the offset the relay knows was settled: the topic is not the one it
    /// wrote to (deleted and created again), so a record sent to the old one cannot be found.
    #[error(
        "the partition's log ends at offset {high}, before offset {from} where the relay knows \
         its records settled: the topic was deleted and created again"
    )]
    Rewound { from: i64, high: i64 },
    /// The broker could not be read; tried again later.
    #[error(transparent)]
    Kafka(#[from] anyhow::Error),
}

/// Reads `topic`'s `partition` from `from` to its end with a consumer of `config` (no group,
/// no commits), within `limit`.
pub fn read_back(
    config: &ClientConfig,
    (topic, partition): (&str, i32),
    from: i64,
    limit: Duration,
) -> Result<ReadBack, Unreadable> {
    let consumer: BaseConsumer = config.create().context("creating the read-back consumer")?;
    let (low, high) = consumer
        .fetch_watermarks(topic, partition, Duration::from_secs(10))
        .with_context(|| format!("reading the offsets of {topic}/{partition}"))?;
    if from < low {
        return Err(Unreadable::Truncated { from, low });
    }
    if from > high {
        return Err(Unreadable::Rewound { from, high });
    }
    let back = ReadBack {
        found: Vec::new(),
        end: high.max(from),
        complete: true,
    };
    if from >= high {
        return Ok(back);
    }
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(topic, partition, Offset::Offset(from))
        .context("assigning the partition")?;
    consumer
        .assign(&assignment)
        .context("assigning the partition")?;
    read_to(&consumer, (topic, partition), (from, high), limit, back)
}

/// Reads the assigned partition from `from` towards `high` into `back`, within `limit`: to
/// the end, or as far as it got when the time ran out.
fn read_to(
    consumer: &BaseConsumer,
    (topic, partition): (&str, i32),
    (from, high): (i64, i64),
    limit: Duration,
    mut back: ReadBack,
) -> Result<ReadBack, Unreadable> {
    let started = Instant::now();
    let mut next = from;
    while started.elapsed() < limit {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            // Past the end already: the last offsets were not records (a transaction's marker).
            if position(consumer, topic, partition).is_some_and(|p| p >= high) {
                return Ok(back);
            }
            continue;
        };
        let message = message.with_context(|| format!("reading {topic}/{partition} back"))?;
        if let Some(id) = record_id(&message) {
            back.found.push((id, message.offset()));
        }
        crate::crashpoint!("relay::during_readback");
        next = message.offset() + 1;
        if next >= high {
            return Ok(back);
        }
    }
    if next == from {
        return Err(anyhow::anyhow!(
            "reading {topic}/{partition} back from offset {from} to {high}: nothing read in {limit:?}"
        )
        .into());
    }
    // What was read is kept; the next read-back goes on from here.
    back.end = next;
    back.complete = false;
    Ok(back)
}

/// Where the consumer reads `topic`'s `partition` next, if it knows.
fn position(consumer: &BaseConsumer, topic: &str, partition: i32) -> Option<i64> {
    let list = consumer.position().ok()?;
    match list.find_partition(topic, partition)?.offset() {
        Offset::Offset(at) => Some(at),
        _ => None,
    }
}

/// The record id header of `message`, if it has one.
fn record_id(message: &rdkafka::message::BorrowedMessage<'_>) -> Option<String> {
    let headers = message.headers()?;
    headers
        .iter()
        .find(|h| h.key == RECORD_ID_HEADER)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(str::to_owned)
}

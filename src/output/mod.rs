//! Kafka output: records enqueued in the consume transaction, with the claim, and produced
//! afterwards by the relay ([`relay`]) exactly once in their topic, with no Kafka transactions
//! required. The guarantee, how it is kept and what breaks it: `docs/kafka-output.md`.
//!
//! The built-in `kafka` effect ([`crate::effect::KafkaOutput`]) enqueues one record per event;
//! an application's effect enqueues its own with [`enqueue`], in the transaction it is given:
//!
//! ```no_run
//! use replayproof::effect::{EffectError, Tx};
//! use replayproof::envelope::Event;
//! use replayproof::output::{enqueue, OutputRecord};
//!
//! async fn publish(tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
//!     let record = OutputRecord::new("order-paid", "orders")
//!         .key(b"order-42".to_vec())
//!         .value(br#"{"order":42,"paid":true}"#.to_vec())
//!         .header("content-type", "application/json");
//!     enqueue(tx, event, &[record]).await?;
//!     Ok(())
//! }
//! ```

#[cfg(feature = "cli")]
pub mod args;
pub mod metrics;
pub mod partitioner;
mod produce;
mod readback;
pub mod relay;
pub mod settings;
pub mod store;
mod transactions;

pub use metrics::OutputMetrics;
pub use relay::Relay;
pub use settings::RelaySettings;

use crate::envelope::Event;
use sqlx::PgConnection;

/// The header every produced record carries its record id in: what the read-back finds it by.
pub const RECORD_ID_HEADER: &str = "replayproof-record-id";
/// The header naming the event's source.
pub const SOURCE_HEADER: &str = "replayproof-source";
/// The header naming the event's type, when it has one.
pub const TYPE_HEADER: &str = "replayproof-type";
/// The W3C trace context header, when the event is in a trace.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// What is known of a record: [`RecordState::Pending`] until it is known to be in its topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Not known to be in the topic: not sent yet, or sent with an unknown outcome.
    Pending,
    /// In the topic, at its recorded offset.
    Sent,
}

impl RecordState {
    /// The `state` column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Sent => "sent",
        }
    }
}

/// How a record is known to be in its topic: the `confirmed_by` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmation {
    /// The broker acknowledged the send.
    Ack,
    /// Found in the partition by its record id, after a send whose outcome was unknown.
    ReadBack,
    /// Acknowledged in a Kafka transaction that committed (`--kafka-transactions`).
    Transaction,
}

impl Confirmation {
    /// The `confirmed_by` column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::ReadBack => "read-back",
            Self::Transaction => "transaction",
        }
    }
}

/// A record for an output topic, enqueued by an effect with [`enqueue`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputRecord {
    /// The record's name among its event's records: its record id is `{event key}#{name}`,
    /// and enqueuing a name twice for one event keeps the first.
    pub name: String,
    /// The topic it is produced to.
    pub topic: String,
    /// The Kafka key; it fixes the partition (the Java client's murmur2). None partitions by
    /// the record id.
    pub key: Option<Vec<u8>>,
    /// The value, produced byte for byte.
    pub value: Option<Vec<u8>>,
    /// Headers, in order; [`RECORD_ID_HEADER`] is added when sent.
    pub headers: Vec<(String, String)>,
}

impl OutputRecord {
    /// A record named `name` for `topic`, with no key, value or headers yet.
    pub fn new(name: impl Into<String>, topic: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            topic: topic.into(),
            key: None,
            value: None,
            headers: Vec::new(),
        }
    }

    /// With this Kafka key.
    pub fn key(mut self, key: Vec<u8>) -> Self {
        self.key = Some(key);
        self
    }

    /// With this value.
    pub fn value(mut self, value: Vec<u8>) -> Self {
        self.value = Some(value);
        self
    }

    /// With one more header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The record the built-in `kafka` effect makes of `event` for `topic`: the event key as
    /// its key, the payload byte for byte as its value, and the source, type and trace
    /// context as headers.
    pub fn of_event(event: &Event, topic: &str) -> Self {
        let mut record = Self::new(BUILT_IN, topic)
            .key(event.key.as_str().as_bytes().to_vec())
            .value(event.payload_json.get().as_bytes().to_vec())
            .header(SOURCE_HEADER, event.source.clone());
        if let Some(kind) = &event.event_type {
            record = record.header(TYPE_HEADER, kind.clone());
        }
        if let Some(trace) = &event.traceparent {
            record = record.header(TRACEPARENT_HEADER, trace.clone());
        }
        record
    }

    /// Why it cannot be enqueued, if it cannot.
    fn refusal(&self) -> Option<String> {
        if self.name.is_empty() || self.name.contains('#') {
            return Some(format!(
                "an output record's name must be non-empty and without '#': {:?}",
                self.name
            ));
        }
        if !is_topic_name(&self.topic) {
            return Some(format!("not a Kafka topic name: {:?}", self.topic));
        }
        self.headers
            .iter()
            .any(|(name, _)| name == RECORD_ID_HEADER)
            .then(|| format!("the {RECORD_ID_HEADER} header is the relay's to set"))
    }
}

/// Whether Kafka accepts `name` as a topic's: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub fn is_topic_name(name: &str) -> bool {
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    (1..=249).contains(&name.len()) && name.chars().all(legal) && name != "." && name != ".."
}

/// The name of the built-in effect's one record per event.
pub const BUILT_IN: &str = "kafka";

/// The record id of `event_key`'s record `name`.
pub fn record_id(event_key: &str, name: &str) -> String {
    format!("{event_key}#{name}")
}

/// Enqueues `records` of `event` in the caller's transaction, in one statement: they commit
/// with the claim or not at all, and the relay produces each once. Enqueuing a record twice
/// (the same event and name) keeps the first.
pub async fn enqueue(
    conn: &mut PgConnection,
    event: &Event,
    records: &[OutputRecord],
) -> sqlx::Result<()> {
    let all: Vec<(&Event, &OutputRecord)> = records.iter().map(|r| (event, r)).collect();
    enqueue_all(conn, &all).await
}

/// Enqueues the records of several events in one statement, in the order given.
pub async fn enqueue_all(
    conn: &mut PgConnection,
    records: &[(&Event, &OutputRecord)],
) -> sqlx::Result<()> {
    if let Some(refusal) = records.iter().find_map(|(_, r)| r.refusal()) {
        return Err(sqlx::Error::InvalidArgument(refusal));
    }
    store::insert(conn, records).await
}

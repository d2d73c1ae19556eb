//! Handing a partition's records to a producer, in order, and telling a record refused for
//! what it is (it can never be sent) from one whose outcome is merely unknown.

use super::store::Pending;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

/// A record given to the producer, or why not.
pub(super) enum Handed {
    /// On its way: its delivery tells the outcome.
    Queued(DeliveryFuture),
    /// Refused by the producer itself: never sent.
    Refused(KafkaError),
    /// Not handed over (the queue was full, or a record before it was refused).
    NotSent,
}

/// Hands `records` to `producer` for `topic`'s `partition`, in order, until it takes one no
/// more; each with its headers and the record id header last.
pub(super) fn hand(
    producer: &FutureProducer,
    (topic, partition): (&str, i32),
    records: &[Pending],
) -> Vec<Handed> {
    let mut stopped = false;
    records
        .iter()
        .map(|r| {
            if stopped {
                return Handed::NotSent;
            }
            let handed = hand_one(producer, (topic, partition), r);
            stopped = !matches!(handed, Handed::Queued(_));
            handed
        })
        .collect()
}

fn hand_one(producer: &FutureProducer, (topic, partition): (&str, i32), r: &Pending) -> Handed {
    let mut headers = OwnedHeaders::new_with_capacity(r.headers.0.len() + 1);
    for (name, value) in &r.headers.0 {
        headers = headers.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    headers = headers.insert(Header {
        key: super::RECORD_ID_HEADER,
        value: Some(r.record_id.as_bytes()),
    });
    let mut record = FutureRecord::<[u8], [u8]>::to(topic)
        .partition(partition)
        .headers(headers);
    if let Some(key) = &r.record_key {
        record = record.key(key.as_slice());
    }
    if let Some(value) = &r.value {
        record = record.payload(value.as_slice());
    }
    match producer.send_result(record) {
        Ok(delivery) => Handed::Queued(delivery),
        Err((e, _)) if refused_for_good(&e) => Handed::Refused(e),
        // Its queue is full: the rest waits for the next turn.
        Err(_) => Handed::NotSent,
    }
}

/// Whether the producer or the broker refused a record for what it is, so that sending it
/// again can never succeed.
pub(super) fn refused_for_good(e: &KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode as Code;
    matches!(
        e.rdkafka_error_code(),
        Some(
            Code::MessageSizeTooLarge
                | Code::InvalidMessageSize
                | Code::InvalidMessage
                | Code::InvalidRecord
        )
    )
}

/// Why the partition stops for `record`.
pub(super) fn refused(record: &Pending, e: &KafkaError) -> String {
    let size =
        record.value.as_ref().map_or(0, Vec::len) + record.record_key.as_ref().map_or(0, Vec::len);
    format!(
        "the record {} ({size} bytes of key and value) was refused: {e}; the records after it \
         wait (docs/kafka-output.md, \"When the relay stops\")",
        record.record_id
    )
}

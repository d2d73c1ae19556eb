//! `--kafka-transactions`: each output partition's batches in Kafka transactions of a producer
//! of its own, with a transactional id per output partition (and per database).
//!
//! What it adds to the default relay is fencing. A new owner of a partition first initialises
//! the partition's producer: the broker then refuses every earlier producer of that id (a relay
//! frozen past its lease included), and aborts the transaction it left open. Only then does it
//! read the partition back, committed records only, so the read-back can no longer race a send
//! still on its way. Blocking calls run on blocking threads.

use anyhow::Context as _;
use rdkafka::producer::{FutureProducer, Producer as _};
use rdkafka::ClientConfig;
use std::time::Duration;

/// The transactional id of an output partition's producer: `token` is the partition row's
/// own, so two databases relaying to one topic never fence each other.
pub(super) fn transactional_id(topic: &str, partition: i32, token: &str) -> String {
    format!("replayproof-relay.{token}.{topic}.{partition}")
}

/// The broker refused to initialise an output partition's transactions for good: the relay
/// stops, since waiting changes nothing.
#[derive(Debug, thiserror::Error)]
#[error(
    "--kafka-transactions: the broker refused to initialise the transactions of {id}: {reason}. \
     A broker without Kafka transactions (nisshi, for one) answers so, as does one whose ACLs \
     deny the transactional id: run the relay without --kafka-transactions, or allow the id \
     (docs/kafka-output.md, \"With Kafka transactions\")"
)]
pub struct Refused {
    id: String,
    reason: String,
}

/// Creates the partition's producer (`config` with `id`) and fences every earlier producer of
/// `id`: once this returns, nothing an earlier one sent can still land, and the transaction it
/// left open is aborted. A refusal that waiting cannot change is [`Refused`].
pub(super) async fn fence(
    config: &ClientConfig,
    id: &str,
    timeout: Duration,
) -> anyhow::Result<FutureProducer> {
    let mut config = config.clone();
    config.set("transactional.id", id);
    let id = id.to_owned();
    tokio::task::spawn_blocking(move || {
        let producer: FutureProducer = config
            .create()
            .context("creating an output partition's transactional producer")?;
        match producer.init_transactions(timeout) {
            Ok(()) => Ok(producer),
            Err(rdkafka::error::KafkaError::Transaction(e)) if !e.is_retriable() => {
                let reason = e.to_string();
                Err(Refused { id, reason }.into())
            }
            Err(e) => Err(e).with_context(|| format!("initialising the transactions of {id}")),
        }
    })
    .await?
}

/// Commits the open transaction: true when the broker committed it, false when it is known
/// not to have (aborted instead), an error when its outcome is unknown.
pub(super) async fn commit(producer: &FutureProducer, timeout: Duration) -> anyhow::Result<bool> {
    let p = producer.clone();
    let committed = tokio::task::spawn_blocking(move || p.commit_transaction(timeout)).await?;
    match committed {
        Ok(()) => Ok(true),
        Err(e) if abortable(&e) => {
            abort(producer, timeout).await?;
            Ok(false)
        }
        Err(e) => Err(e).context("committing an output transaction"),
    }
}

/// Aborts the open transaction: afterwards none of its records is in the topic for a
/// `read_committed` reader.
pub(super) async fn abort(producer: &FutureProducer, timeout: Duration) -> anyhow::Result<()> {
    let p = producer.clone();
    tokio::task::spawn_blocking(move || p.abort_transaction(timeout))
        .await?
        .context("aborting an output transaction")
}

/// Whether a failed commit left its transaction to be aborted (librdkafka's
/// `txn_requires_abort`), rather than with an unknown or a fatal outcome.
fn abortable(e: &rdkafka::error::KafkaError) -> bool {
    match e {
        rdkafka::error::KafkaError::Transaction(e) => e.txn_requires_abort() && !e.is_fatal(),
        _ => false,
    }
}

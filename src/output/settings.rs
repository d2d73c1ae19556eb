//! How a relay leases and sends: its settings, and the librdkafka properties of its producer
//! and of its read-back consumer.

use std::time::Duration;

/// How long a relay's lease on an output partition lasts (`--relay-lease`).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// How long a send may wait for its acknowledgement (`--relay-send-timeout`,
/// librdkafka's `message.timeout.ms`).
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// Records of one partition sent at once (`--relay-batch-size`).
pub const DEFAULT_BATCH: i64 = 2_000;

/// How a relay leases and sends.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Names this relay in the partitions' leases.
    pub worker: String,
    pub brokers: String,
    /// librdkafka properties, as `--kafka-option` gives them.
    pub kafka_options: Vec<(String, String)>,
    /// How long a lease keeps other relays off a partition: more than two send timeouts, so
    /// every send of an owner ends, acknowledged or expired, before its lease does.
    pub lease: Duration,
    pub send_timeout: Duration,
    pub batch_size: i64,
    /// The pause when nothing was sent.
    pub poll_interval: Duration,
    /// Each batch in a Kafka transaction of a producer per output partition
    /// (`--kafka-transactions`): a new owner fences every earlier producer of the partition
    /// before it reads back, so nothing an earlier owner sent can land afterwards.
    pub transactions: bool,
}

impl RelaySettings {
    /// The defaults, for `worker` on `brokers`.
    pub fn new(worker: &str, brokers: &str) -> Self {
        Self {
            worker: worker.into(),
            brokers: brokers.into(),
            kafka_options: Vec::new(),
            lease: DEFAULT_LEASE,
            send_timeout: DEFAULT_SEND_TIMEOUT,
            batch_size: DEFAULT_BATCH,
            poll_interval: Duration::from_millis(200),
            transactions: false,
        }
    }

    /// Why a relay cannot run with these settings, if it cannot.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.lease > self.send_timeout * 2,
            "the relay lease ({:?}) must be longer than two send timeouts ({:?} each): every \
             send of a relay must end before another may take its partition over",
            self.lease,
            self.send_timeout
        );
        refuse_owned(&self.kafka_options)
    }

    /// The relay producer's defaults besides the guarded `acks=all` and idempotence.
    pub(super) fn tuning(&self) -> Vec<(&'static str, String)> {
        let mut tuning = crate::kafka::producer_tuning("replayproof-relay");
        tuning.push((
            "message.timeout.ms",
            self.send_timeout.as_millis().to_string(),
        ));
        if self.transactions {
            // A transaction left open (its relay frozen or gone) is aborted by the broker
            // once the lease that covered it ended.
            tuning.push(("transaction.timeout.ms", self.lease.as_millis().to_string()));
        }
        tuning.push(("allow.auto.create.topics", "false".into()));
        tuning.push(("linger.ms", "5".into()));
        // librdkafka's own limit (1,000,000 bytes) is below a broker's default (1,048,588)
        // and below what ingest passes on: the broker's (or the topic's) limit decides
        // instead, and a record it refuses stops its partition with the reason.
        tuning.push(("message.max.bytes", MAX_MESSAGE_BYTES.to_string()));
        tuning
    }
}

/// The relay producer's `message.max.bytes`: more than any broker's default.
const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The read-back consumer's settings: a group librdkafka needs to assign partitions, never
/// joined and never committed to. With `transactions`, committed records only (an aborted
/// batch of ours is not in the topic for the readers it is written for); without, every
/// record, so that another producer's open (or hanging) transaction never holds it up.
pub(super) fn reader_tuning(transactions: bool) -> Vec<(&'static str, String)> {
    let isolation = match transactions {
        true => "read_committed",
        false => "read_uncommitted",
    };
    vec![
        ("client.id", "replayproof-relay-readback".into()),
        ("group.id", "replayproof-relay-readback".into()),
        ("enable.auto.commit", "false".into()),
        ("enable.auto.offset.store", "false".into()),
        ("isolation.level", isolation.into()),
    ]
}

/// Refuses options that set what the relay owns: the send timeout, which the lease is
/// checked against, and the transactional id, which it gives each output partition.
fn refuse_owned(options: &[(String, String)]) -> anyhow::Result<()> {
    for (key, _) in options {
        let key = key.trim().trim_start_matches("topic.");
        let instead = match key {
            "message.timeout.ms" | "delivery.timeout.ms" => {
                "its lease is checked against the send timeout; give --relay-send-timeout instead"
            }
            "transactional.id" | "transaction.timeout.ms" => {
                "with --kafka-transactions it gives each output partition a transactional id of \
                 its own, whose transactions the broker aborts once the relay's lease is over"
            }
            _ => continue,
        };
        anyhow::bail!("--kafka-option {key} is refused for the relay: {instead}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(key: &str) -> Vec<(String, String)> {
        vec![(key.to_owned(), "1".to_owned())]
    }

    #[test]
    fn a_timeout_or_a_transactional_id_in_the_options_is_refused() {
        for key in [
            "message.timeout.ms",
            "topic.message.timeout.ms",
            "delivery.timeout.ms",
            "transactional.id",
            "transaction.timeout.ms",
        ] {
            let settings = RelaySettings {
                kafka_options: options(key),
                ..RelaySettings::new("w", "b")
            };
            let refused = settings.check().unwrap_err().to_string();
            assert!(
                refused.contains("refused for the relay"),
                "{key}: {refused}"
            );
        }
        let fine = RelaySettings {
            kafka_options: options("linger.ms"),
            ..RelaySettings::new("w", "b")
        };
        fine.check().unwrap();
    }

    #[test]
    fn a_lease_shorter_than_two_send_timeouts_is_refused() {
        let settings = RelaySettings {
            lease: Duration::from_secs(20),
            ..RelaySettings::new("w", "b")
        };
        assert!(settings.check().is_err());
    }
}

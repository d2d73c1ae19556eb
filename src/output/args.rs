//! `replayproof dispatch`'s relay flags: with `--brokers`, the dispatcher also relays the
//! output records to Kafka.

use super::settings::{RelaySettings, DEFAULT_BATCH, DEFAULT_LEASE, DEFAULT_SEND_TIMEOUT};
use crate::args::KafkaOptions;
use clap::Args;
use std::time::Duration;

/// The relay's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Kafka output")]
pub struct RelayArgs {
    /// Kafka bootstrap servers, comma-separated host:port: relay the output records of
    /// `consume --effect kafka` there (docs/kafka-output.md). Without it, none are relayed.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    #[command(flatten)]
    pub options: KafkaOptions,

    /// How long the relay's lease on an output partition lasts: longer than two send timeouts.
    /// A relay that dies holds its partitions this long.
    #[arg(long, env = "REPLAYPROOF_RELAY_LEASE", value_name = "DURATION", default_value = crate::args::text(DEFAULT_LEASE), value_parser = crate::args::wait(Duration::from_secs(1)))]
    pub relay_lease: Duration,

    /// How long a record's send waits for the broker's acknowledgement before its outcome is
    /// unknown (librdkafka's message.timeout.ms).
    #[arg(long, env = "REPLAYPROOF_RELAY_SEND_TIMEOUT", value_name = "DURATION", default_value = crate::args::text(DEFAULT_SEND_TIMEOUT), value_parser = crate::args::wait(Duration::from_millis(100)))]
    pub relay_send_timeout: Duration,

    /// Records of one output partition sent at once.
    #[arg(long, env = "REPLAYPROOF_RELAY_BATCH_SIZE", default_value_t = DEFAULT_BATCH, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub relay_batch_size: i64,

    /// Sends each batch in a Kafka transaction of a producer per output partition, which every
    /// new owner of the partition fences before reading it back: nothing a relay frozen past
    /// its lease sent can land afterwards. Needs a broker with transactions; the records'
    /// consumers must read `read_committed` (docs/kafka-output.md).
    #[arg(long, env = "REPLAYPROOF_KAFKA_TRANSACTIONS")]
    pub kafka_transactions: bool,
}

impl RelayArgs {
    /// The relay's settings for `worker`, when brokers are given, checked.
    pub fn settings(&self, worker: &str, poll: Duration) -> anyhow::Result<Option<RelaySettings>> {
        let Some(brokers) = self.brokers.as_deref() else {
            return Ok(None);
        };
        let settings = RelaySettings {
            kafka_options: self.options.kafka_options.clone(),
            lease: self.relay_lease,
            send_timeout: self.relay_send_timeout,
            batch_size: self.relay_batch_size,
            poll_interval: poll.min(Duration::from_millis(200)),
            transactions: self.kafka_transactions,
            ..RelaySettings::new(worker, brokers)
        };
        settings.check()?;
        Ok(Some(settings))
    }
}

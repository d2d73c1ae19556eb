//! The built-in `kafka` effect's flag: its output topic.

use crate::effect::KafkaOutput;
use clap::Args;

/// The `kafka` effect's flags.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Effects")]
pub struct KafkaEffectArgs {
    /// With --effect kafka: the topic each event's record goes to, once (its key the event
    /// key, its value the payload byte for byte), produced by `replayproof dispatch --brokers`.
    /// See docs/kafka-output.md.
    #[arg(long, env = "REPLAYPROOF_OUTPUT_TOPIC", value_name = "TOPIC", value_parser = check_topic)]
    pub output_topic: Option<String>,
}

impl KafkaEffectArgs {
    /// The effect's settings, when a topic is given.
    pub fn output(&self) -> Option<KafkaOutput> {
        self.output_topic
            .as_deref()
            .map(|topic| KafkaOutput::new(topic).expect("checked when parsed"))
    }
}

/// Refuses a name Kafka would refuse as a topic's.
fn check_topic(name: &str) -> Result<String, String> {
    match crate::output::is_topic_name(name) {
        true => Ok(name.to_owned()),
        false => Err("not a Kafka topic name: 1 to 249 of a-z A-Z 0-9 . _ -".to_owned()),
    }
}

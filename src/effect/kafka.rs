//! The built-in `kafka` effect: one output record per event, enqueued with the claim and
//! produced exactly once in the output topic by the relay (`replayproof dispatch --brokers`).

use super::{Effect, EffectError, Tx};
use crate::envelope::Event;
use crate::output::OutputRecord;
use anyhow::Context as _;
use async_trait::async_trait;

/// One record per event in `topic`: the event key as its key, the payload byte for byte as its
/// value, and the source, type, trace context and record id as headers
/// ([`OutputRecord::of_event`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaOutput {
    /// The output topic.
    pub topic: String,
}

impl KafkaOutput {
    /// The effect for `topic`, refused when Kafka would refuse the name.
    pub fn new(topic: &str) -> anyhow::Result<Self> {
        anyhow::ensure!(
            crate::output::is_topic_name(topic),
            "--output-topic {topic:?} is not a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -)"
        );
        Ok(Self {
            topic: topic.to_owned(),
        })
    }

    /// Builds the effect again from its [`Effect::spec`].
    pub fn from_spec(spec: &serde_json::Value) -> anyhow::Result<Self> {
        let topic = spec
            .get("output_topic")
            .and_then(serde_json::Value::as_str)
            .context("a kafka effect spec names its output_topic")?;
        Self::new(topic)
    }
}

#[async_trait]
impl Effect for KafkaOutput {
    fn name(&self) -> &'static str {
        "kafka"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    /// One statement for the whole batch.
    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        let records: Vec<OutputRecord> = events
            .iter()
            .map(|e| OutputRecord::of_event(e, &self.topic))
            .collect();
        let pairs: Vec<(&Event, &OutputRecord)> =
            events.iter().copied().zip(records.iter()).collect();
        crate::output::enqueue_all(tx, &pairs).await?;
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({ "effect": "kafka", "output_topic": self.topic }))
    }
}

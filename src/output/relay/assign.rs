//! Partitioning: each topic's partition count from the broker, and the new records given
//! their partition over it, or the topic stopped when the count is not the one its records
//! were partitioned over.

use super::Relay;
use crate::output::store;
use rdkafka::producer::Producer as _;
use std::collections::HashMap;
use std::time::Duration;

impl Relay {
    /// Each topic's partition count from the broker's metadata, or why there is none.
    pub(super) async fn partition_counts(
        &self,
        topics: &[String],
    ) -> HashMap<String, Result<i32, String>> {
        let mut counts = HashMap::new();
        for topic in topics {
            let producer = self.producer.clone();
            let name = topic.clone();
            let count = tokio::task::spawn_blocking(move || {
                let md = producer
                    .client()
                    .fetch_metadata(Some(&name), Duration::from_secs(10))
                    .map_err(|e| format!("reading the metadata of {name}: {e}"))?;
                use rdkafka::types::RDKafkaRespErr as Code;
                match md.topics().first() {
                    Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                        Ok(i32::try_from(t.partitions().len()).unwrap_or(i32::MAX))
                    }
                    // Only this answer says the topic is not there; any other (no access, a
                    // broker busy) says nothing of it, and nothing is stopped for it.
                    None => Err(format!("the output topic {name} does not exist")),
                    Some(t) => match t.error() {
                        None | Some(Code::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => {
                            Err(format!("the output topic {name} does not exist"))
                        }
                        Some(e) => Err(format!("reading the metadata of {name}: {e:?}")),
                    },
                }
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            counts.insert(topic.clone(), count);
        }
        counts
    }

    /// Gives the new records of each topic their partition, as many as one turn of each of
    /// its partitions sends; returns how many it partitioned.
    pub(super) async fn assign(
        &self,
        topics: &[String],
        counts: &HashMap<String, Result<i32, String>>,
    ) -> anyhow::Result<u64> {
        let mut assigned = 0;
        for topic in topics {
            let count = match counts.get(topic) {
                Some(Ok(count)) => *count,
                Some(Err(why)) => {
                    self.say_once(topic, &format!("{why}: its records wait, unpartitioned."));
                    continue;
                }
                None => continue,
            };
            if let Some(known) = store::known_count(&self.pool, topic).await? {
                if known != count {
                    let why = changed(known, count);
                    self.say_once(topic, &why);
                    store::stop(&self.pool, topic, None, &why).await?;
                    continue;
                }
            }
            self.said_lock().remove(topic);
            let limit = self.settings.batch_size.saturating_mul(i64::from(count));
            let n = store::assign(&self.pool, topic, count, limit).await?;
            self.metrics
                .enqueued
                .with_label_values(&[topic.as_str()])
                .inc_by(n);
            assigned += n;
        }
        Ok(assigned)
    }

    /// Logs why `topic`'s records wait, unless that was the last thing said of it.
    fn say_once(&self, topic: &str, why: &str) {
        let mut said = self.said_lock();
        if said.get(topic).is_none_or(|last| last != why) {
            tracing::error!(topic = %topic, "{why}");
            said.insert(topic.to_owned(), why.to_owned());
        }
    }

    fn said_lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.said.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Why a topic's partition count is not the one its records were partitioned over.
pub(super) fn changed(known: i32, now: i32) -> String {
    format!(
        "the output topic's partition count changed from {known} to {now}: records keyed to a \
         partition of {known} would land elsewhere, so the relay stops rather than guess \
         (docs/kafka-output.md, \"When the relay stops\")"
    )
}

//! A Kafka-protocol broker per test: the mock cluster or the broker process, producers and
//! committed offsets.

use super::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replayproof::consume::ConsumerSettings;
use replayproof::devkit::embedded::EmbeddedKafka;
use std::time::Duration;

/// A Kafka-protocol broker for one test.
pub enum TestKafka {
    /// librdkafka's mock cluster in this process.
    Mock(EmbeddedKafka),
    /// A separate broker process (`KAFKA_BROKERS`), such as nisshi started by the test script.
    External(String),
}

impl TestKafka {
    pub fn mock() -> Self {
        Self::Mock(EmbeddedKafka::start().expect("mock cluster"))
    }

    /// The broker for tests that run consumers as separate processes: `KAFKA_BROKERS` when set,
    /// otherwise the mock cluster, which listens on localhost for other processes too.
    pub fn for_processes() -> Self {
        match std::env::var("KAFKA_BROKERS") {
            Ok(b) if !b.is_empty() => Self::External(b),
            _ => Self::mock(),
        }
    }

    pub fn brokers(&self) -> String {
        match self {
            Self::Mock(k) => k.bootstrap_servers(),
            Self::External(b) => b.clone(),
        }
    }

    /// Creates a fresh topic and returns its name.
    pub async fn topic(&self, partitions: i32) -> String {
        let topic = unique("webhooks");
        match self {
            Self::Mock(k) => k.create_topic(&topic, partitions).expect("create topic"),
            Self::External(b) => create_external_topic(b, &topic, partitions).await,
        }
        topic
    }
}

async fn create_external_topic(brokers: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<_> = client_config(brokers).create().expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topics");
    for r in results {
        r.expect("topic created");
    }
    // Wait until the broker serves metadata for every partition.
    let consumer: BaseConsumer = client_config(brokers).create().unwrap();
    wait_for("topic metadata", Duration::from_secs(20), || {
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(2));
        let ok = md.is_ok_and(|m| {
            m.topics()
                .first()
                .is_some_and(|t| t.partitions().len() == partitions as usize)
        });
        async move { ok }
    })
    .await;
}

pub fn client_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("broker.address.family", "v4")
        .set("log_level", "3");
    c
}

/// The librdkafka options every test consumer uses: quick group membership, IPv4.
pub fn test_kafka_options() -> Vec<(String, String)> {
    [
        ("session.timeout.ms", "6000"),
        ("heartbeat.interval.ms", "500"),
        ("broker.address.family", "v4"),
        ("topic.metadata.refresh.interval.ms", "2000"),
        ("log_level", "3"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

pub fn settings(brokers: &str, topic: &str, group: &str) -> ConsumerSettings {
    ConsumerSettings {
        kafka_options: test_kafka_options(),
        batch_size: 200,
        commit_interval: Duration::from_millis(50),
        shutdown_grace: Duration::from_secs(10),
        max_retry_backoff: Duration::from_millis(500),
        ..ConsumerSettings::new(brokers, topic, group)
    }
}

/// One record to produce: key, value, and a partition when the test chooses it.
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub partition: Option<i32>,
}

impl Record {
    pub fn event(key: &str, payload: serde_json::Value) -> Self {
        Self {
            key: Some(key.as_bytes().to_vec()),
            value: envelope(key, payload),
            partition: None,
        }
    }

    pub fn on(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }
}

pub fn producer(brokers: &str) -> FutureProducer {
    client_config(brokers)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

/// Produces records in order and waits for every acknowledgement.
pub async fn produce(producer: &FutureProducer, topic: &str, records: &[Record]) {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};
    let mut pending = Vec::with_capacity(records.len());
    for r in records {
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(&r.value);
        if let Some(k) = &r.key {
            record = record.key(k);
        }
        if let Some(p) = r.partition {
            record = record.partition(p);
        }
        // `send_result` enqueues now; awaiting `send` one by one would produce one at a time.
        loop {
            match producer.send_result(record) {
                Ok(delivery) => break pending.push(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => panic!("produce failed: {e}"),
            }
        }
    }
    for p in pending {
        p.await
            .expect("delivery reported")
            .map_err(|(e, _)| e)
            .expect("record acknowledged");
    }
}

/// The group's committed offsets for partitions `0..partitions`; -1 where none is committed.
pub fn committed_offsets(brokers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let consumer: BaseConsumer = client_config(brokers)
        .set("group.id", group)
        .create()
        .expect("offset reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .map(
            |p| match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            },
        )
        .collect()
}

/// [`committed_offsets`] off the async runtime's threads.
pub async fn committed(kafka: &TestKafka, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let (b, g, t) = (kafka.brokers(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || committed_offsets(&b, &g, &t, partitions))
        .await
        .unwrap()
}

/// Waits until the group's committed offsets add up to `total`.
pub async fn wait_committed_total(
    kafka: &TestKafka,
    group: &str,
    topic: &str,
    partitions: i32,
    total: i64,
) {
    wait_for("offsets committed", Duration::from_secs(120), || async {
        committed(kafka, group, topic, partitions)
            .await
            .iter()
            .sum::<i64>()
            == total
    })
    .await;
}

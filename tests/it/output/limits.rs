//! What the relay does at the limits: a record larger than the producer or the topic takes,
//! and a read-back longer than one turn.

use super::*;

/// A library effect: one record per event, the event `huge`'s value `size` bytes.
struct OneHuge {
    topic: String,
    huge: &'static str,
    size: usize,
}

#[async_trait::async_trait]
impl Effect for OneHuge {
    fn name(&self) -> &'static str {
        "one-huge"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let value = match event.key.as_str() == self.huge {
            true => vec![b'x'; self.size],
            false => event.payload_json.get().as_bytes().to_vec(),
        };
        let record = OutputRecord::new("kafka", &self.topic)
            .key(event.key.as_str().as_bytes().to_vec())
            .value(value);
        replayproof::output::enqueue(tx, event, &[record]).await?;
        Ok(())
    }
}

/// Claims events 0..30 whose record `huge` is `size` bytes, relays them until the partition
/// stops, and returns the relay and what `status` says.
async fn stopped_by(
    db: &TestDb,
    brokers: &str,
    topic: &str,
    huge: &'static str,
    size: usize,
) -> (ConsumerProcess, String) {
    let topic = topic.to_owned();
    claim(db, Arc::new(OneHuge { topic, huge, size }), 0..30).await;
    let relay = relay(db, brokers, "only", None);
    wait_stopped(db, 1).await;
    (relay, replayproof(db, &["status"]))
}

/// A record refused for what it is (larger than the producer takes) stops its partition with
/// the reason: the records before it are sent, the refused one and those after it wait, and
/// nothing is sent out of order or tried for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_refused_for_its_size_stops_its_partition_with_the_reason() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let brokers = kafka.brokers();
    let (relay, status) = stopped_by(&db, &brokers, &topic, "evt-25", 17 << 20).await;
    assert!(
        status.contains("the record evt-25#kafka (17825798 bytes of key and value) was refused"),
        "{status}"
    );
    let pending: Vec<String> = sqlx::query_scalar(
        "SELECT event_key FROM output_records WHERE state = 'pending' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(pending, ["evt-25", "evt-26", "evt-27", "evt-28", "evt-29"]);
    let out = read_topic(&brokers, &topic, 1);
    let keys: Vec<String> = out
        .iter()
        .map(|o| String::from_utf8(o.key.clone()).unwrap())
        .collect();
    let expected: Vec<String> = (0..25).map(|i| format!("evt-{i}")).collect();
    assert_eq!(keys, expected, "the records before it, once each, in order");
    relay.terminate(WAIT).await;
}

/// Creates `topic` with one partition on `brokers`, taking records of at most `max_bytes`.
async fn topic_taking(brokers: &str, topic: &str, max_bytes: usize) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<_> = client_config(brokers).create().unwrap();
    let size = max_bytes.to_string();
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1)).set("max.message.bytes", &size);
    for r in admin
        .create_topics(&[new], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.expect("topic created");
    }
    wait_for("the topic's metadata", WAIT, || async {
        let consumer: BaseConsumer = client_config(brokers).create().unwrap();
        consumer
            .fetch_watermarks(topic, 0, Duration::from_secs(2))
            .is_ok()
    })
    .await;
}

/// The broker refuses a whole request when one record of it is larger than the topic takes: the
/// records are then sent one a turn, the others get through in order, and the partition stops
/// naming the one record the broker refuses alone (not the request's first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_refuses_is_the_one_named_and_the_records_before_it_are_sent() {
    let _heavy = heavy().await;
    let TestKafka::External(brokers) = TestKafka::for_processes() else {
        panic!("needs a broker process that applies a topic's max.message.bytes (KAFKA_BROKERS)")
    };
    let db = TestDb::new().await;
    let topic = unique("output_small");
    topic_taking(&brokers, &topic, 50_000).await;
    let (relay, status) = stopped_by(&db, &brokers, &topic, "evt-15", 200_000).await;
    assert!(
        status.contains("the record evt-15#kafka (200006 bytes of key and value) was refused"),
        "{status}"
    );
    let keys: Vec<String> = read_topic(&brokers, &topic, 1)
        .iter()
        .map(|o| String::from_utf8(o.key.clone()).unwrap())
        .collect();
    let expected: Vec<String> = (0..15).map(|i| format!("evt-{i}")).collect();
    assert_eq!(keys, expected, "the records before it, once each, in order");
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE state = 'pending'")
            .await,
        15
    );
    relay.terminate(WAIT).await;
}

/// A read-back longer than its turn (here each record read takes 10 ms, the turn 1.5 s) keeps
/// what it read and goes on from there the next turn, instead of starting over for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_back_longer_than_a_turn_goes_on_from_where_it_stopped() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let brokers = kafka.brokers();
    claim(&db, kafka_effect(&topic), 0..400).await;
    let batch = ["--relay-batch-size", "400"];
    let first = relay_with(
        &db,
        &brokers,
        "first",
        Some("relay::after_ack=1*return"),
        &batch,
    );
    assert!(!first.exited(WAIT).await.success());
    let slow = Some("relay::during_readback=sleep(10)");
    let second = relay_with(&db, &brokers, "second", slow, &batch);
    wait_all_sent(&db, 400).await;
    assert_eq!(
        read_backs(&db).await,
        400,
        "every record found by the read-back"
    );
    assert_each_once(&read_topic(&brokers, &topic, 1), 400, 1);
    second.terminate(WAIT).await;
}

/// With several databases, each database's relay shares the process's output gauges and only
/// the first reports them: the others' refresh (of no database) must leave them as they are,
/// or a scrape between the two finds the backlog gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_reporting_no_database_leaves_the_output_gauges_alone() {
    let db = TestDb::new().await;
    claim(&db, kafka_effect(&unique("never_created")), 0..3).await;
    let registry = prometheus::Registry::new();
    let metrics = replayproof::output::OutputMetrics::new(&registry).unwrap();
    let backlog = |registry: &prometheus::Registry| {
        metric_value(registry, "replayproof_output_backlog") as i64
    };
    metrics
        .refresh(std::slice::from_ref(&db.pool))
        .await
        .unwrap();
    assert_eq!(backlog(&registry), 3);
    metrics.refresh(&[]).await.unwrap();
    assert_eq!(backlog(&registry), 3, "still shown");
    sqlx::query("DELETE FROM output_records")
        .execute(&db.pool)
        .await
        .unwrap();
    metrics
        .refresh(std::slice::from_ref(&db.pool))
        .await
        .unwrap();
    assert_eq!(
        backlog(&registry),
        0,
        "a partition with nothing left drops out"
    );
}

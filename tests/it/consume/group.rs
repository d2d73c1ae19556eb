//! The consumer group against a Kafka-protocol broker (librdkafka's in-process mock cluster) and
//! a real PostgreSQL. Each test counts ledger rows per key.

use crate::harness::*;
use replayproof::consume::ConsumerSettings;
use replayproof::effect::EffectError;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

async fn wait_committed(kafka: &TestKafka, group: &str, topic: &str, expected: &[i64]) {
    let n = expected.len() as i32;
    wait_for("offsets committed", WAIT, || async {
        committed(kafka, group, topic, n).await == expected
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_delivery_twice_in_sequence_has_one_effect() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    let producer = producer(&kafka.brokers());

    produce(
        &producer,
        &topic,
        &[Record::event("evt-1", json!({"amount": 10}))],
    )
    .await;
    wait_committed(&kafka, &group, &topic, &[1]).await;
    produce(
        &producer,
        &topic,
        &[Record::event("evt-1", json!({"amount": 10}))],
    )
    .await;
    wait_committed(&kafka, &group, &topic, &[2]).await;

    assert_eq!(db.ledger_counts().await["evt-1"], 1);
    assert_eq!(consumer.metric("replayproof_consume_events_total"), 2.0);
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 1);
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_on_two_partitions_with_two_consumers_racing_has_one_effect() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let a = InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    let b = InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    wait_for("one partition each", WAIT, || async {
        a.metric("replayproof_assigned_partitions") == 1.0
            && b.metric("replayproof_assigned_partitions") == 1.0
    })
    .await;

    // Every key goes to both partitions, in opposite orders, so the two consumers' batches claim
    // overlapping keys at the same time.
    let keys: Vec<String> = (0..2_000).map(|i| format!("evt-{i:05}")).collect();
    let mut records: Vec<Record> = keys
        .iter()
        .map(|k| Record::event(k, json!({"k": k})).on(0))
        .collect();
    records.extend(
        keys.iter()
            .rev()
            .map(|k| Record::event(k, json!({"k": k})).on(1)),
    );
    produce(&producer(&kafka.brokers()), &topic, &records).await;

    let expected: HashSet<String> = keys.into_iter().collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    wait_committed(&kafka, &group, &topic, &[2_000, 2_000]).await;
    let deadlocks = db
        .count("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .await;
    assert_eq!(deadlocks, 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_mid_stream_applies_every_event_once() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(4).await, unique("group"));
    let brokers = kafka.brokers();
    let first = InProcessConsumer::start(settings(&brokers, &topic, &group), db.pool.clone());

    let producing = {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        tokio::spawn(async move {
            let producer = producer(&brokers);
            for chunk in 0..40 {
                let records: Vec<Record> = (0..100)
                    .map(|i| Record::event(&format!("evt-{chunk}-{i}"), json!({"chunk": chunk})))
                    .collect();
                produce(&producer, &topic, &records).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let applied_at_least = |n: i64| {
        let db = &db;
        move || async move { db.count("SELECT count(*) FROM ledger").await >= n }
    };
    wait_for("some events applied", WAIT, applied_at_least(300)).await;
    let second = InProcessConsumer::start(settings(&brokers, &topic, &group), db.pool.clone());
    wait_for("the second consumer's share", WAIT, || async {
        second.metric("replayproof_assigned_partitions") > 0.0
    })
    .await;
    let third = InProcessConsumer::start(settings(&brokers, &topic, &group), db.pool.clone());
    // The group settled: every member holds its share. (A member stopped while the group is
    // still rebalancing cannot make its final commit; its batches are replayed.)
    wait_for("the third consumer's share", WAIT, || async {
        let shares = [&first, &second, &third].map(|c| c.metric("replayproof_assigned_partitions"));
        shares.iter().all(|n| *n > 0.0) && shares.iter().sum::<f64>() == 4.0
    })
    .await;
    first.stop().await;
    producing.await.unwrap();

    let expected: HashSet<String> = (0..40)
        .flat_map(|c| (0..100).map(move |i| format!("evt-{c}-{i}")))
        .collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    // Offsets whose commit failed during a rebalance are replayed by the next owner, harmlessly,
    // and then committed: the group ends with every offset committed and no second effect.
    wait_committed_total(&kafka, &group, &topic, 4, 4_000).await;
    let ends = committed(&kafka, &group, &topic, 4).await;
    second.stop().await;
    third.stop().await;
    assert_eq!(committed(&kafka, &group, &topic, 4).await, ends);
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 4_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_over_their_byte_budget_leave_messages_in_kafka_and_lose_none() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let producer = producer(&kafka.brokers());
    let records: Vec<Record> = (0..600)
        .map(|i| Record::event(&format!("evt-{i}"), json!({"i": i, "pad": "x".repeat(500)})))
        .collect();
    produce(&producer, &topic, &records).await;

    // A budget below one message: each lane takes one message at a time from its partition's
    // queue, and the rest of the backlog waits in librdkafka.
    let tight = ConsumerSettings {
        max_lane_bytes: 1,
        ..settings(&kafka.brokers(), &topic, &group)
    };
    let consumer = InProcessConsumer::start(tight, db.pool.clone());

    let expected: HashSet<String> = (0..600).map(|i| format!("evt-{i}")).collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    wait_committed_total(&kafka, &group, &topic, 2, 600).await;
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_event_waits_for_its_retries_while_later_events_go_on_and_holds_the_offset() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let processor = replayproof::consume::BatchProcessor::new(
        db.pool.clone(),
        std::sync::Arc::new(super::batch::FailsFor("evt-bad")),
    )
    .with_retry(replayproof::consume::EffectRetry {
        attempts: 3,
        backoff: Duration::from_secs(1),
    });
    let consumer =
        InProcessConsumer::with_processor(settings(&kafka.brokers(), &topic, &group), processor);
    let mut records = vec![Record::event("evt-bad", json!(0))];
    records.extend((1..=100).map(|i| Record::event(&format!("evt-{i}"), json!(i))));
    produce(&producer(&kafka.brokers()), &topic, &records).await;

    // The events after the failing one are applied while it waits between its attempts, and
    // the partition's offset stays at the failing event meanwhile.
    wait_for("the later events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await == 100
    })
    .await;
    let bad = db
        .count("SELECT count(*) FROM processed_events WHERE event_key = 'evt-bad'")
        .await;
    assert_eq!(
        bad, 0,
        "the failing event was settled before the later ones"
    );
    assert!(committed(&kafka, &group, &topic, 1).await[0] <= 0);

    // After its last attempt it is recorded as failed, and the offset moves past everything.
    wait_committed(&kafka, &group, &topic, &[101]).await;
    let (status, attempts): (String, i32) =
        sqlx::query_as("SELECT status, attempts FROM processed_events WHERE event_key = 'evt-bad'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), attempts), ("failed", 3));
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 100);
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_message_is_dead_lettered_and_the_good_ones_applied() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    let poison = |value: &[u8]| Record {
        key: Some(b"poison".to_vec()),
        value: value.to_vec(),
        partition: None,
    };
    let records = [
        Record::event("good-1", json!(1)),
        poison(b"this is not json"),
        Record::event("good-2", json!(2)),
        poison(br#"{"source":"s","payload":{}}"#),
        Record::event("good-3", json!(3)),
        // Valid JSON that PostgreSQL cannot store: dead-lettered, the partition goes on.
        Record::event("nul", json!({"note": "a\u{0}b"})),
        Record::event("good-4", json!(4)),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    wait_committed(&kafka, &group, &topic, &[7]).await;

    let expected: HashSet<String> = ["good-1", "good-2", "good-3", "good-4"]
        .map(String::from)
        .into();
    assert_exactly_once(&db, &expected, WAIT).await;
    let letters: Vec<(i64, Vec<u8>, String)> = sqlx::query_as(
        "SELECT kafka_offset, raw_value, reason FROM dead_letters ORDER BY kafka_offset",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(letters.len(), 3);
    assert!(letters[2].2.contains("NUL"), "{}", letters[2].2);
    assert_eq!(
        (letters[0].0, letters[0].1.as_slice()),
        (1, &b"this is not json"[..])
    );
    assert!(
        letters[1].2.contains("missing field `key`"),
        "{}",
        letters[1].2
    );
    assert_eq!(consumer.metric("replayproof_consume_events_total"), 7.0);
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_loses_nothing_and_commits_no_offset_ahead() {
    let (kafka, db) = (TestKafka::mock(), TestDb::on_own_cluster().await);
    let postgres = db.cluster.as_ref().unwrap();
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    let keys: Vec<String> = (0..3_000).map(|i| format!("evt-{i}")).collect();
    let records: Vec<Record> = keys
        .iter()
        .map(|k| Record::event(k, json!({"k": k})))
        .collect();
    let producer = producer(&kafka.brokers());

    // Stop PostgreSQL for real while the events flow.
    produce(&producer, &topic, &records[..1_500]).await;
    wait_for("some events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await >= 200
    })
    .await;
    postgres.stop().unwrap();
    produce(&producer, &topic, &records[1_500..]).await;
    let retries_before = consumer.metric("replayproof_batch_retries_total");
    wait_for("batches retried while PostgreSQL is down", WAIT, || async {
        consumer.metric("replayproof_batch_retries_total") >= retries_before + 2.0
    })
    .await;
    let mut offsets_while_down = Vec::new();
    for _ in 0..3 {
        offsets_while_down.push(committed(&kafka, &group, &topic, 2).await);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let restarted_at = chrono::Utc::now();
    postgres.resume().unwrap();

    let expected: HashSet<String> = keys.iter().cloned().collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    // Every offset committed while the database was down is covered by a claim that committed
    // before it went down.
    for partition in 0..2 {
        let covered: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(kafka_offset) + 1, 0) FROM processed_events \
             WHERE kafka_partition = $1 AND claimed_at < $2",
        )
        .bind(partition)
        .bind(restarted_at)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        for sample in &offsets_while_down {
            assert!(
                sample[partition as usize] <= covered,
                "partition {partition}: offset {} committed past work committed before the outage ({covered})",
                sample[partition as usize]
            );
        }
    }
    let total: i64 = 3_000;
    wait_committed_total(&kafka, &group, &topic, 2, total).await;
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, total);
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_loses_nothing() {
    let TestKafka::Mock(mock) = TestKafka::mock() else {
        unreachable!()
    };
    let db = TestDb::new().await;
    let brokers = mock.bootstrap_servers();
    let (topic, group) = (unique("webhooks"), unique("group"));
    mock.create_topic(&topic, 2).unwrap();
    let consumer = InProcessConsumer::start(settings(&brokers, &topic, &group), db.pool.clone());
    let producer = producer(&brokers);
    let records: Vec<Record> = (0..2_000)
        .map(|i| Record::event(&format!("evt-{i}"), json!(i)))
        .collect();
    produce(&producer, &topic, &records[..1_000]).await;
    wait_for("some events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await >= 200
    })
    .await;
    // The broker goes away for a while, as in a restart, and comes back.
    mock.set_broker_up(false).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    mock.set_broker_up(true).unwrap();
    produce(&producer, &topic, &records[1_000..]).await;

    let expected: HashSet<String> = (0..2_000).map(|i| format!("evt-{i}")).collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    let kafka = TestKafka::Mock(mock);
    wait_committed_total(&kafka, &group, &topic, 2, 2_000).await;
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_that_would_break_offset_safety_are_refused_at_start() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    for (key, value) in [
        ("enable.auto.commit", "true"),
        ("enable.auto.offset.store", "true"),
        ("isolation.level", "read_uncommitted"),
    ] {
        let mut s = settings(&kafka.brokers(), &topic, &unique("group"));
        s.kafka_options.push((key.into(), value.into()));
        let processor = replayproof::consume::BatchProcessor::new(
            db.pool.clone(),
            std::sync::Arc::new(replayproof::effect::Ledger),
        )
        .with_retry(replayproof::consume::EffectRetry::default());
        let metrics =
            replayproof::consume::ConsumeMetrics::new(&prometheus::Registry::new()).unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let run = replayproof::consume::run(s, processor, metrics, stop);
        let result = tokio::time::timeout(Duration::from_secs(10), run).await;
        let error = result.expect("refused at once").expect_err(key).to_string();
        assert!(error.contains(key) && error.contains("refused"), "{error}");
    }
}

/// Panics on one key; the ledger effect for every other.
struct PanicsOn(&'static str);

#[async_trait::async_trait]
impl replayproof::effect::Effect for PanicsOn {
    fn name(&self) -> &'static str {
        "panics-on"
    }

    async fn apply(
        &self,
        tx: &mut replayproof::effect::Tx<'_>,
        event: &replayproof::envelope::Event,
    ) -> Result<(), EffectError> {
        assert_ne!(event.key.as_str(), self.0, "a bug in an effect");
        replayproof::effect::Ledger.apply(tx, event).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_effect_stops_the_consumer_with_an_error_and_moves_no_offset() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let producer = producer(&kafka.brokers());
    produce(&producer, &topic, &[Record::event("before", json!(1))]).await;
    let consumer = InProcessConsumer::with_effect(
        settings(&kafka.brokers(), &topic, &group),
        db.pool.clone(),
        std::sync::Arc::new(PanicsOn("boom")),
    );
    wait_committed(&kafka, &group, &topic, &[1]).await;
    produce(
        &producer,
        &topic,
        &[
            Record::event("boom", json!(2)),
            Record::event("after", json!(3)),
        ],
    )
    .await;
    let registry = consumer.registry.clone();
    let ended = consumer.ended(WAIT).await;
    let error = format!("{:#}", ended.expect_err("the consumer stops with an error"));
    assert!(error.contains("panicked"), "{error}");
    assert_eq!(
        metric_value(&registry, "replayproof_lane_panics_total"),
        1.0
    );
    assert_eq!(
        committed(&kafka, &group, &topic, 1).await,
        [1],
        "the panicked batch's offset did not move"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_topics_are_read_with_every_codec() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let mut expected = HashSet::new();
    for codec in ["zstd", "lz4", "snappy", "gzip"] {
        let producer: rdkafka::producer::FutureProducer = client_config(&kafka.brokers())
            .set("compression.type", codec)
            .set("linger.ms", "5")
            .create()
            .expect("a producer with every codec");
        let records: Vec<Record> = (0..20)
            .map(|i| Record::event(&format!("{codec}-{i}"), json!({"codec": codec, "i": i})))
            .collect();
        expected.extend(
            records
                .iter()
                .map(|r| String::from_utf8(r.key.clone().unwrap()).unwrap()),
        );
        produce(&producer, &topic, &records).await;
    }
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    assert_exactly_once(&db, &expected, WAIT).await;
    wait_committed(&kafka, &group, &topic, &[80]).await;
    assert_eq!(
        consumer.metric("replayproof_kafka_consume_errors_total"),
        0.0
    );
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_offset_commit_is_retried_while_the_partition_is_idle() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let TestKafka::Mock(mock) = &kafka else {
        unreachable!()
    };
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    let producer = producer(&kafka.brokers());
    produce(&producer, &topic, &[Record::event("warm-up", json!(0))]).await;
    wait_committed(&kafka, &group, &topic, &[1]).await;

    // The broker refuses the next offset commits; then the partition goes quiet.
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    mock.fail_requests(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_LOAD_IN_PROGRESS; 3],
    );
    let records: Vec<Record> = (0..10)
        .map(|i| Record::event(&format!("evt-{i}"), json!(i)))
        .collect();
    produce(&producer, &topic, &records).await;
    wait_committed(&kafka, &group, &topic, &[11]).await;
    wait_for("the commit's outcome reported", WAIT, || async {
        consumer.metric("replayproof_committed_offset") == 11.0
    })
    .await;
    let mut expected: HashSet<String> = (0..10).map(|i| format!("evt-{i}")).collect();
    expected.insert("warm-up".into());
    assert_exactly_once(&db, &expected, WAIT).await;
    consumer.stop().await;
}

/// A consumer that applied one event stopped while the broker answers every offset commit with
/// `error`: how its stop ended. Nothing was committed either way.
async fn stop_with_commits_refused(error: rdkafka::types::RDKafkaRespErr) -> anyhow::Result<()> {
    use rdkafka::types::RDKafkaApiKey;
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let TestKafka::Mock(mock) = &kafka else {
        unreachable!()
    };
    let s = ConsumerSettings {
        // Only the final commit commits: the interval is longer than the test.
        commit_interval: Duration::from_secs(600),
        ..settings(&kafka.brokers(), &topic, &group)
    };
    let consumer = InProcessConsumer::start(s, db.pool.clone());
    produce(
        &producer(&kafka.brokers()),
        &topic,
        &[Record::event("evt-1", json!(1))],
    )
    .await;
    assert_exactly_once(&db, &HashSet::from(["evt-1".to_owned()]), WAIT).await;
    mock.fail_requests(RDKafkaApiKey::OffsetCommit, &[error; 50]);
    let stopped = consumer.stop_result().await;
    mock.clear_request_errors(RDKafkaApiKey::OffsetCommit);
    assert_eq!(committed(&kafka, &group, &topic, 1).await, [-1]);
    stopped
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_offset_commit_that_fails_makes_the_stop_an_error() {
    use rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_LOAD_IN_PROGRESS as LOADING;
    let stopped = stop_with_commits_refused(LOADING).await;
    let error = format!("{:#}", stopped.expect_err("the final commit failed"));
    assert!(error.contains("final offset commit failed"), "{error}");
}

/// A member the group evicted (it stalled past the group's limits) hears that it is unknown:
/// its stop is an error, not a rebalance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_commit_refused_to_an_evicted_member_makes_the_stop_an_error() {
    use rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_MEMBER_ID as EVICTED;
    let stopped = stop_with_commits_refused(EVICTED).await;
    let error = format!("{:#}", stopped.expect_err("the final commit failed"));
    assert!(error.contains("final offset commit failed"), "{error}");
}

/// Members stopping together: the group is rebalancing and refuses the last ones' commits.
/// Their batches are replayed harmlessly by the next owner; the stop is not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_commit_refused_because_the_group_is_rebalancing_is_a_clean_stop() {
    use rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_REBALANCE_IN_PROGRESS as REBALANCING;
    stop_with_commits_refused(REBALANCING)
        .await
        .expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_consumer_whose_database_is_gone_fails_health() {
    let kafka = TestKafka::mock();
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let (_reserved, refusing) = crate::harness::refusing_address();
    let nowhere = format!("postgres://postgres@{refusing}/none");
    let pool = replayproof::db::pool(&nowhere.parse().unwrap(), 2).unwrap();
    let s = ConsumerSettings {
        unhealthy_after: Duration::from_secs(1),
        ..settings(&kafka.brokers(), &topic, &group)
    };
    let processor = replayproof::consume::BatchProcessor::new(
        pool,
        std::sync::Arc::new(replayproof::effect::Ledger),
    )
    .with_retry(replayproof::consume::EffectRetry::default());
    let metrics = replayproof::consume::ConsumeMetrics::new(&prometheus::Registry::new()).unwrap();
    let health = replayproof::telemetry::Health::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = replayproof::consume::Consumer::build(s, processor, metrics, health.clone())
        .unwrap()
        .run_until_stopped(stop.clone());
    wait_for("/healthz to name the database", WAIT, || async {
        health
            .problems()
            .iter()
            .any(|p| p.starts_with("database: PostgreSQL has not answered"))
    })
    .await;
    assert!(health.is_live(), "{:?}", health.liveness_problems());
    stop.cancel();
    running.stopped().await.unwrap();
}

/// Holds the batch with `key` inside its effect until released; the ledger effect for the rest.
struct HoldsOn {
    key: &'static str,
    entered: std::sync::atomic::AtomicBool,
    release: tokio::sync::Semaphore,
}

#[async_trait::async_trait]
impl replayproof::effect::Effect for HoldsOn {
    fn name(&self) -> &'static str {
        "holds-on"
    }

    async fn apply(
        &self,
        tx: &mut replayproof::effect::Tx<'_>,
        event: &replayproof::envelope::Event,
    ) -> Result<(), EffectError> {
        if event.key.as_str() == self.key {
            self.entered
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let _permit = self.release.acquire().await.map_err(anyhow::Error::from)?;
        }
        replayproof::effect::Ledger.apply(tx, event).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_keeps_growing_from_the_statistics_while_a_partition_is_stuck() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let effect = std::sync::Arc::new(HoldsOn {
        key: "stuck",
        entered: std::sync::atomic::AtomicBool::new(false),
        release: tokio::sync::Semaphore::new(0),
    });
    let mut s = settings(&kafka.brokers(), &topic, &group);
    s.kafka_options
        .push(("statistics.interval.ms".into(), "100".into()));
    s.batch_timeout = Duration::from_secs(300);
    let consumer = InProcessConsumer::with_effect(s, db.pool.clone(), effect.clone());
    let producer = producer(&kafka.brokers());
    produce(&producer, &topic, &[Record::event("stuck", json!(0))]).await;
    wait_for("the batch to be stuck in its effect", WAIT, || async {
        effect.entered.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;

    // Nothing is applied while the batch is held, and the lag still follows the new messages.
    let more: Vec<Record> = (1..=40)
        .map(|i| Record::event(&format!("evt-{i}"), json!(i)))
        .collect();
    produce(&producer, &topic, &more).await;
    wait_for("the lag to show the 41 waiting messages", WAIT, || async {
        consumer.metric("replayproof_consumer_lag") == 41.0
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 0);

    effect.release.add_permits(1_000);
    wait_for("the lag to drain", WAIT, || async {
        consumer.metric("replayproof_consumer_lag") == 0.0
            && db.count("SELECT count(*) FROM ledger").await == 41
    })
    .await;
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_that_skips_the_backlog_is_refused_and_earliest_applies_it() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let records: Vec<Record> = (0..20)
        .map(|i| Record::event(&format!("evt-{i}"), json!(i)))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    for (key, value) in [
        ("topic.auto.offset.reset", "latest"),
        ("auto.offset.reset", "largest"),
        ("topic.auto.offset.reset", "end"),
        ("enable.auto.commit", "true"),
        ("enable.auto.offset.store", "true"),
        ("isolation.level", "read_uncommitted"),
        ("topic.offset.store.method", "file"),
    ] {
        let mut s = settings(&kafka.brokers(), &topic, &unique("group"));
        s.kafka_options.push((key.into(), value.into()));
        let ended = InProcessConsumer::start(s, db.pool.clone())
            .ended(WAIT)
            .await;
        let error = format!("{:#}", ended.expect_err("refused at start"));
        assert!(error.contains("refused"), "{key}={value}: {error}");
    }
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 0);
    // A fresh group given the value replayproof keeps reads the whole backlog.
    let group = unique("group");
    let mut s = settings(&kafka.brokers(), &topic, &group);
    s.kafka_options
        .push(("topic.auto.offset.reset".into(), "earliest".into()));
    let consumer = InProcessConsumer::start(s, db.pool.clone());
    let expected: HashSet<String> = (0..20).map(|i| format!("evt-{i}")).collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    wait_committed(&kafka, &group, &topic, &[20]).await;
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_nested_200000_levels_deep_is_dead_lettered_and_the_partition_goes_on() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    // Written straight to the topic, as any producer could.
    let deep = format!(
        r#"{{"key":"evt-deep","source":"test","payload":{}1{}}}"#,
        "[".repeat(200_000),
        "]".repeat(200_000)
    );
    let records = [
        Record::event("evt-before", json!(1)),
        Record {
            key: Some(b"evt-deep".to_vec()),
            value: deep.into_bytes(),
            partition: None,
        },
        Record::event("evt-after", json!(2)),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    wait_committed(&kafka, &group, &topic, &[3]).await;
    let counts = db.ledger_counts().await;
    assert_eq!((counts["evt-before"], counts["evt-after"]), (1, 1));
    let reason: String = sqlx::query_scalar("SELECT reason FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(reason.contains("levels deep"), "{reason}");
    consumer.stop().await;
}

/// The ledger effect, 10 ms an event, refusing one event for good.
struct Slow {
    refused: &'static str,
}

#[async_trait::async_trait]
impl replayproof::effect::Effect for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }

    async fn apply(
        &self,
        tx: &mut replayproof::effect::Tx<'_>,
        event: &replayproof::envelope::Event,
    ) -> Result<(), EffectError> {
        tokio::time::sleep(Duration::from_millis(10)).await;
        if event.key.as_str() == self.refused {
            return Err(anyhow::anyhow!("the downstream refuses {}", self.refused).into());
        }
        replayproof::effect::Ledger.apply(tx, event).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_batch_with_one_failing_event_commits_within_its_timeout() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let records: Vec<Record> = (0..200)
        .map(|i| Record::event(&format!("evt-{i:03}"), json!(i)))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    // 200 events of 10 ms: 2 s unguarded until the last one fails, about 2.7 s more guarded
    // with the search for it. Each transaction fits in 3 s; the two together do not.
    let s = ConsumerSettings {
        batch_size: 200,
        linger: Duration::from_millis(500),
        batch_timeout: Duration::from_secs(3),
        ..settings(&kafka.brokers(), &topic, &group)
    };
    let slow = std::sync::Arc::new(Slow { refused: "evt-199" });
    let consumer = InProcessConsumer::with_effect(s, db.pool.clone(), slow);
    wait_committed(&kafka, &group, &topic, &[200]).await;
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 199);
    let failed = db
        .count("SELECT count(*) FROM processed_events WHERE status = 'failed' AND event_key = 'evt-199'")
        .await;
    assert_eq!(failed, 1);
    consumer.stop().await;
}

/// Fails every event (deterministically), remembering every key it was asked to apply.
#[derive(Default)]
struct FailsAll {
    seen: std::sync::Mutex<HashSet<String>>,
}

#[async_trait::async_trait]
impl replayproof::effect::Effect for FailsAll {
    fn name(&self) -> &'static str {
        "fails-all"
    }

    async fn apply(
        &self,
        _: &mut replayproof::effect::Tx<'_>,
        event: &replayproof::envelope::Event,
    ) -> Result<(), EffectError> {
        self.seen.lock().unwrap().insert(event.key.to_string());
        Err(anyhow::anyhow!("always refused").into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_waiting_for_an_effect_retry_count_in_the_lane_budget() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let padding = "x".repeat(1_000);
    let records: Vec<Record> = (0..2_000)
        .map(|i| Record::event(&format!("evt-{i:04}"), json!({ "pad": padding })))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    // Room for about fifteen messages; the first retry is due only after 2 s.
    let s = ConsumerSettings {
        max_lane_bytes: 16 * 1024,
        ..settings(&kafka.brokers(), &topic, &group)
    };
    let effect = std::sync::Arc::new(FailsAll::default());
    let processor = replayproof::consume::BatchProcessor::new(db.pool.clone(), effect.clone())
        .with_retry(replayproof::consume::EffectRetry {
            attempts: 10,
            backoff: Duration::from_secs(2),
        });
    let consumer = InProcessConsumer::with_processor(s, processor);
    wait_for("the first events tried", WAIT, || async {
        !effect.seen.lock().unwrap().is_empty()
    })
    .await;
    // Held retries fill the budget: the lane takes no more messages until they settle (18 s
    // from now), where it used to take every message it could read meanwhile.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let seen = effect.seen.lock().unwrap().len();
    assert!(
        seen <= 64,
        "{seen} events were taken in while the first ones waited"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 0);
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_failing_its_fetches_is_unhealthy_while_another_flows() {
    let kafka = replayproof::devkit::embedded::EmbeddedKafka::start_with_brokers(2).unwrap();
    let db = TestDb::new().await;
    let (topic, group) = (unique("webhooks"), unique("group"));
    kafka.create_topic(&topic, 2).unwrap();
    kafka.set_partition_leader(&topic, 0, 1).unwrap();
    kafka.set_partition_leader(&topic, 1, 2).unwrap();
    let brokers = kafka.bootstrap_servers();
    let s = ConsumerSettings {
        unhealthy_after: Duration::from_secs(2),
        ..settings(&brokers, &topic, &group)
    };
    let processor = replayproof::consume::BatchProcessor::new(
        db.pool.clone(),
        std::sync::Arc::new(replayproof::effect::Ledger),
    )
    .with_retry(replayproof::consume::EffectRetry::default());
    let metrics = replayproof::consume::ConsumeMetrics::new(&prometheus::Registry::new()).unwrap();
    let health = replayproof::telemetry::Health::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = replayproof::consume::Consumer::build(s, processor, metrics, health.clone())
        .unwrap()
        .run_until_stopped(stop.clone());
    let producer = producer(&brokers);
    produce(
        &producer,
        &topic,
        &[Record::event("evt-p1", json!(1)).on(1)],
    )
    .await;
    wait_for("the first events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await == 1
    })
    .await;
    // Broker 2's fetches fail from now on: partition 1 is stuck, while partition 0 keeps
    // delivering messages, each of which used to clear the consumer's one error streak.
    kafka.fail_fetches_from(
        2,
        2_000,
        rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_MSG,
    );
    let mut n = 0;
    wait_for("/healthz to name partition 1", WAIT, || {
        n += 1;
        let (producer, topic, health) = (&producer, &topic, &health);
        async move {
            let record = Record::event(&format!("evt-p0-{n}"), json!(n)).on(0);
            produce(producer, topic, &[record]).await;
            health
                .problems()
                .iter()
                .any(|p| p.starts_with("partitions: partition 1: Kafka has reported errors"))
        }
    })
    .await;
    assert!(
        !health.problems().iter().any(|p| p.contains("partition 0")),
        "{:?}",
        health.problems()
    );
    stop.cancel();
    running.stopped().await.unwrap();
}

//! The Kafka output: each claimed event's record exactly once in the output topic, read from
//! the beginning and counted per key, whatever kills, races and outages the relay meets; on the
//! broker process (nisshi, no transactions) and on the mock cluster.

use crate::harness::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::effect::{Effect, EffectError, KafkaOutput, Tx};
use replayproof::envelope::{Envelope, Event};
use replayproof::output::{OutputRecord, RECORD_ID_HEADER};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

mod limits;
mod transactions;

const WAIT: Duration = Duration::from_secs(90);

/// A payload whose bytes no serialiser would write back: spaces, a key order, an exact number.
fn payload_text(i: usize) -> String {
    format!("{{ \"n\" : {i},\"amount\":1.10000000000000000001 , \"name\":\"caf\u{e9} {i}\" }}")
}

fn raw_envelope(key: &str, text: &str) -> Vec<u8> {
    Envelope {
        route: None,
        key: key.try_into().expect("a valid event key"),
        source: "test".into(),
        event_type: Some("test.event".into()),
        received_at: None,
        occurred_at: None,
        payload: serde_json::value::RawValue::from_string(text.to_owned()).unwrap(),
        unhashed: Vec::new(),
        replay_window_secs: None,
        request_id: None,
    }
    .to_bytes()
}

/// Claims events `range` in `db` with the `kafka` effect for `topic`, in one batch each of 100.
async fn claim(db: &TestDb, effect: Arc<dyn Effect>, range: std::ops::Range<usize>) {
    let processor = BatchProcessor::new(db.pool.clone(), effect).with_retry(Default::default());
    let all: Vec<usize> = range.collect();
    for chunk in all.chunks(100) {
        let messages: Vec<RawMessage> = chunk
            .iter()
            .map(|i| RawMessage {
                offset: *i as i64,
                key: Some(format!("evt-{i}").into_bytes()),
                value: Some(raw_envelope(&format!("evt-{i}"), &payload_text(*i))),
                traceparent: None,
                headers: Default::default(),
            })
            .collect();
        processor.process("in", 0, &messages).await.unwrap();
    }
}

fn kafka_effect(topic: &str) -> Arc<dyn Effect> {
    Arc::new(KafkaOutput::new(topic).unwrap())
}

/// A library effect: two records per event on a shared key (`account-{n % 5}`), in order.
struct TwoPerEvent(String);

#[async_trait::async_trait]
impl Effect for TwoPerEvent {
    fn name(&self) -> &'static str {
        "two-per-event"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let n: usize = event.key.as_str()[4..].parse().unwrap();
        let records: Vec<OutputRecord> = ["first", "second"]
            .iter()
            .enumerate()
            .map(|(j, name)| {
                OutputRecord::new(*name, &self.0)
                    .key(format!("account-{}", n % 5).into_bytes())
                    .value(format!("{}", n * 2 + j).into_bytes())
                    .header("kind", *name)
            })
            .collect();
        replayproof::output::enqueue(tx, event, &records).await?;
        Ok(())
    }
}

/// A `replayproof dispatch` process relaying `db`'s output records to `brokers`.
fn relay(db: &TestDb, brokers: &str, worker: &str, failpoints: Option<&str>) -> ConsumerProcess {
    relay_with(db, brokers, worker, failpoints, &[])
}

fn relay_with(
    db: &TestDb,
    brokers: &str,
    worker: &str,
    failpoints: Option<&str>,
    extra: &[&str],
) -> ConsumerProcess {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args(["dispatch", "--database-url", &db.url, "--brokers", brokers])
        .args(["--worker", worker, "--poll", "50ms"])
        .args(["--relay-lease", "3s", "--relay-send-timeout", "1s"])
        .args(extra)
        .env("RUST_LOG", "warn,replayproof=info")
        .env_remove("FAILPOINTS")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if !extra.contains(&"--relay-batch-size") {
        cmd.args(["--relay-batch-size", "40"]);
    }
    if !extra.contains(&"--metrics-addr") {
        cmd.args(["--metrics-addr", "127.0.0.1:0"]);
    }
    for (k, v) in test_kafka_options() {
        cmd.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    if let Some(f) = failpoints {
        cmd.env("FAILPOINTS", f);
    }
    ConsumerProcess {
        child: cmd.spawn().expect("spawn replayproof dispatch"),
    }
}

/// Waits until `n` output partitions are stopped.
async fn wait_stopped(db: &TestDb, n: i64) {
    wait_for("output partitions stopped", WAIT, || async {
        db.count("SELECT count(*) FROM output_partitions WHERE stopped IS NOT NULL")
            .await
            == n
    })
    .await;
}

async fn wait_all_sent(db: &TestDb, expected: i64) {
    wait_for("every output record sent", WAIT, || async {
        db.count("SELECT count(*) FROM output_records WHERE state = 'sent'")
            .await
            == expected
    })
    .await;
}

/// One record read back from the output topic.
#[derive(Debug, Clone)]
struct Out {
    partition: i32,
    key: Vec<u8>,
    value: Vec<u8>,
    headers: BTreeMap<String, String>,
}

/// Every record of `topic`'s `partitions`, from the beginning to each partition's end.
fn read_topic(brokers: &str, topic: &str, partitions: i32) -> Vec<Out> {
    let consumer: BaseConsumer = client_config(brokers)
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut ends = HashMap::new();
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        let (_, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .unwrap();
        ends.insert(p, high);
        list.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&list).unwrap();
    let total: i64 = ends.values().sum();
    let mut out = Vec::new();
    let started = std::time::Instant::now();
    while (out.len() as i64) < total {
        assert!(
            started.elapsed() < WAIT,
            "reading {topic} back took too long"
        );
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| {
                        let value = String::from_utf8(h.value.unwrap_or_default().to_vec());
                        (h.key.to_owned(), value.unwrap())
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Out {
            partition: m.partition(),
            key: m.key().unwrap_or_default().to_vec(),
            value: m.payload().unwrap_or_default().to_vec(),
            headers,
        });
    }
    out
}

/// Each of events `0..n`'s record exactly once, none other, payload bytes exact, its partition
/// the Java client's, its headers right.
fn assert_each_once(out: &[Out], n: usize, partitions: i32) {
    let mut per_key: HashMap<Vec<u8>, Vec<&Out>> = HashMap::new();
    for o in out {
        per_key.entry(o.key.clone()).or_default().push(o);
    }
    let doubled: Vec<String> = per_key
        .iter()
        .filter(|(_, v)| v.len() != 1)
        .map(|(k, v)| format!("{} x{}", String::from_utf8_lossy(k), v.len()))
        .collect();
    assert!(doubled.is_empty(), "keys not exactly once: {doubled:?}");
    assert_eq!(per_key.len(), n, "records missing or foreign");
    for i in 0..n {
        let key = format!("evt-{i}");
        let record = per_key[key.as_bytes()][0];
        assert_eq!(
            record.value,
            payload_text(i).into_bytes(),
            "{key}'s payload"
        );
        let partition = replayproof::output::partitioner::partition_of(key.as_bytes(), partitions);
        assert_eq!(record.partition, partition, "{key}'s partition");
        assert_eq!(record.headers[RECORD_ID_HEADER], format!("{key}#kafka"));
        assert_eq!(record.headers["replayproof-source"], "test");
        assert_eq!(record.headers["replayproof-type"], "test.event");
    }
}

async fn read_backs(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM output_records WHERE confirmed_by = 'read-back'")
        .await
}

/// Killed between the broker's ack and the database update: the next owner reads the
/// partition back first, marks what it finds sent, and sends only the rest.
async fn killed_between_ack_and_update(kafka: TestKafka) {
    let db = TestDb::new().await;
    let topic = kafka.topic(3).await;
    claim(&db, kafka_effect(&topic), 0..300).await;
    let first = relay(
        &db,
        &kafka.brokers(),
        "first",
        Some("relay::after_ack=1*return"),
    );
    let status = first.exited(WAIT).await;
    assert!(
        !status.success(),
        "the failpoint ended the relay: {status:?}"
    );
    assert!(
        db.count("SELECT count(*) FROM output_partitions WHERE in_doubt")
            .await
            >= 1,
        "the relay died with a partition in doubt"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE state = 'sent'")
            .await,
        0,
        "nothing recorded sent before the crash"
    );
    let second = relay(&db, &kafka.brokers(), "second", None);
    wait_all_sent(&db, 300).await;
    assert!(
        read_backs(&db).await >= 1,
        "the acked batch was found by the read-back"
    );
    assert_each_once(&read_topic(&kafka.brokers(), &topic, 3), 300, 3);
    second.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_ack_and_update_leaves_each_record_once_on_the_broker_process() {
    let _heavy = heavy().await;
    killed_between_ack_and_update(TestKafka::for_processes()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_ack_and_update_leaves_each_record_once_on_the_mock_cluster() {
    let _heavy = heavy().await;
    killed_between_ack_and_update(TestKafka::mock()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_the_update_and_the_next_send_sends_the_rest_once() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    // One partition: with two, the other partition's batch may be in flight when this one's
    // update stops the process, and that one is rightly read back.
    let topic = kafka.topic(1).await;
    claim(&db, kafka_effect(&topic), 0..200).await;
    let first = relay(
        &db,
        &kafka.brokers(),
        "first",
        Some("relay::after_update=1*return"),
    );
    assert!(!first.exited(WAIT).await.success());
    let sent = db
        .count("SELECT count(*) FROM output_records WHERE state = 'sent'")
        .await;
    assert!(
        (1..200).contains(&sent),
        "one batch recorded before the crash: {sent}"
    );
    let second = relay(&db, &kafka.brokers(), "second", None);
    wait_all_sent(&db, 200).await;
    assert_eq!(read_backs(&db).await, 0, "nothing was in doubt");
    assert_each_once(&read_topic(&kafka.brokers(), &topic, 1), 200, 1);
    second.terminate(WAIT).await;
}

/// The database loses the commit that recorded a batch sent (as a crash before the WAL flush
/// loses it; the relay does not wait for that flush), while the relay runs on: its next batch
/// finds the partition not as it holds it, so it takes the partition again from what is
/// recorded (in doubt), reads it back and sends nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_commit_of_a_sent_batch_is_read_back_not_sent_again() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    claim(&db, kafka_effect(&topic), 0..120).await;
    let port = free_port();
    let metrics = ["--metrics-addr", &format!("127.0.0.1:{port}")];
    let lose = Some("relay::lose_record=1*return");
    let relay = relay_with(&db, &kafka.brokers(), "only", lose, &metrics);
    wait_all_sent(&db, 120).await;
    assert_eq!(
        read_backs(&db).await,
        40,
        "the lost batch found by the read-back"
    );
    assert_each_once(&read_topic(&kafka.brokers(), &topic, 1), 120, 1);
    let page = http_get(port, "/metrics").await.unwrap().1;
    for (name, value) in [
        ("replayproof_output_records_enqueued_total", 120.0),
        ("replayproof_output_records_produced_total", 120.0),
        (
            "replayproof_output_records_confirmed_by_readback_total",
            40.0,
        ),
    ] {
        assert_eq!(scraped(&page, name), value, "{name}");
    }
    relay.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_during_the_read_back_leaves_it_to_the_next_owner() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    claim(&db, kafka_effect(&topic), 0..150).await;
    let brokers = kafka.brokers();
    let first = relay(&db, &brokers, "first", Some("relay::after_ack=1*return"));
    assert!(!first.exited(WAIT).await.success());
    let second = relay(
        &db,
        &brokers,
        "second",
        Some("relay::during_readback=1*return"),
    );
    assert!(
        !second.exited(WAIT).await.success(),
        "killed inside its read-back"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM output_partitions WHERE in_doubt")
            .await,
        1,
        "still in doubt after a read-back that did not finish"
    );
    let third = relay(&db, &brokers, "third", None);
    wait_all_sent(&db, 150).await;
    assert!(read_backs(&db).await >= 1);
    assert_each_once(&read_topic(&brokers, &topic, 1), 150, 1);
    third.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_racing_for_the_partitions_send_each_record_once_in_per_key_order() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(3).await;
    let brokers = kafka.brokers();
    let a = relay(&db, &brokers, "a", None);
    let b = relay(&db, &brokers, "b", None);
    // Enqueued while both run, in batches of a hundred, as a consumer would.
    claim(&db, Arc::new(TwoPerEvent(topic.clone())), 0..600).await;
    // One of them is killed mid-run; the other takes its partitions over.
    a.kill9().await;
    wait_all_sent(&db, 1_200).await;
    let out = read_topic(&brokers, &topic, 3);
    assert_eq!(out.len(), 1_200, "each record once");
    let ids: std::collections::HashSet<&String> =
        out.iter().map(|o| &o.headers[RECORD_ID_HEADER]).collect();
    assert_eq!(ids.len(), 1_200, "no record id twice");
    let mut per_key: BTreeMap<Vec<u8>, Vec<usize>> = BTreeMap::new();
    for o in &out {
        let value: usize = String::from_utf8_lossy(&o.value).parse().unwrap();
        per_key.entry(o.key.clone()).or_default().push(value);
    }
    assert_eq!(per_key.len(), 5);
    for (key, values) in per_key {
        let mut sorted = values.clone();
        sorted.sort_unstable();
        assert_eq!(
            values,
            sorted,
            "{} out of order",
            String::from_utf8_lossy(&key)
        );
    }
    b.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_mid_run_leaves_each_record_once() {
    let _heavy = heavy().await;
    let TestKafka::Mock(mock) = TestKafka::mock() else {
        unreachable!()
    };
    let db = TestDb::new().await;
    let topic = unique("output");
    mock.create_topic(&topic, 2).unwrap();
    let brokers = mock.bootstrap_servers();
    claim(&db, kafka_effect(&topic), 0..200).await;
    let relay = relay(&db, &brokers, "only", None);
    wait_for("some records sent", WAIT, || async {
        db.count("SELECT count(*) FROM output_records WHERE state = 'sent'")
            .await
            >= 40
    })
    .await;
    mock.set_broker_up(false).unwrap();
    claim(&db, kafka_effect(&topic), 200..400).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    mock.set_broker_up(true).unwrap();
    wait_all_sent(&db, 400).await;
    assert_each_once(&read_topic(&brokers, &topic, 2), 400, 2);
    relay.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_batch_enqueue_each_record_once() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (input, output, group) = (kafka.topic(2).await, kafka.topic(2).await, unique("group"));
    let brokers = kafka.brokers();
    let records: Vec<Record> = (0..400)
        .map(|i| Record {
            key: Some(format!("evt-{i}").into_bytes()),
            value: raw_envelope(&format!("evt-{i}"), &payload_text(i)),
            partition: None,
        })
        .collect();
    produce(&producer(&brokers), &input, &records).await;
    let effect = ["--effect", "kafka", "--output-topic", &output];
    let first = ConsumerProcess::spawn_with(
        &brokers,
        &input,
        &group,
        &db.url,
        Some("consume::before_commit=pause"),
        &effect,
    );
    kill_inside_transaction(first, &db).await;
    let relay = relay(&db, &brokers, "relay", None);
    let second = ConsumerProcess::spawn_with(&brokers, &input, &group, &db.url, None, &effect);
    wait_all_sent(&db, 400).await;
    assert_each_once(&read_topic(&brokers, &output, 2), 400, 2);
    second.terminate(WAIT).await;
    relay.terminate(WAIT).await;
}

/// `replayproof ARGS --database-url URL`'s standard output.
fn replayproof(db: &TestDb, args: &[&str]) -> String {
    let out = stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(args)
            .args(["--database-url", &db.url]),
    );
    String::from_utf8(out).unwrap()
}

/// Deletes `topic` and creates it again with `partitions` partitions, as an operator might.
async fn recreate_topic(brokers: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<_> = client_config(brokers).create().unwrap();
    let options = AdminOptions::new();
    for r in admin.delete_topics(&[topic], &options).await.unwrap() {
        r.expect("topic deleted");
    }
    wait_for("the topic created again", WAIT, || async {
        let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
        let created = admin.create_topics(&[new], &options).await;
        created.is_ok_and(|r| r.iter().all(Result::is_ok))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_recreated_with_another_partition_count_stops_the_relay_with_the_reason() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(2).await;
    let brokers = kafka.brokers();
    claim(&db, kafka_effect(&topic), 0..50).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let relay = relay_with(&db, &brokers, "only", None, &["--metrics-addr", &addr]);
    wait_all_sent(&db, 50).await;
    // `events show` says where each record is.
    let shown = replayproof(&db, &["events", "show", "evt-7"]);
    let section = shown.split("== output records").nth(1).unwrap();
    let partition = replayproof::output::partitioner::partition_of(b"evt-7", 2);
    assert!(
        section.contains(&topic) && section.contains("sent"),
        "{shown}"
    );
    assert!(section.contains(&format!(" {partition} ")), "{shown}");

    assert_each_once(&read_topic(&brokers, &topic, 2), 50, 2);

    recreate_topic(&brokers, &topic, 3).await;
    claim(&db, kafka_effect(&topic), 50..80).await;
    wait_stopped(&db, 2).await;
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE state = 'pending'")
            .await,
        30,
        "nothing sent to a partition a different count would choose"
    );
    let status = replayproof(&db, &["status"]);
    assert!(
        status.contains("stopped: the output topic's partition count changed from 2 to 3"),
        "{status}"
    );
    wait_for("the stop in the metrics", WAIT, || async {
        let page = http_get(port, "/metrics")
            .await
            .map(|(_, p)| p)
            .unwrap_or_default();
        scraped(&page, "replayproof_output_partition_stopped") == 2.0
    })
    .await;
    assert!(
        read_topic(&brokers, &topic, 3).is_empty(),
        "nothing sent to the new topic"
    );
    relay.terminate(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_for_a_missing_topic_wait_unpartitioned_and_status_shows_them() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let missing = unique("never_created");
    claim(&db, kafka_effect(&missing), 0..10).await;
    claim(&db, kafka_effect(&topic), 10..20).await;
    let relay = relay(&db, &kafka.brokers(), "only", None);
    // The relay partitions every topic's records in each round: once the other topic's are
    // sent, it has met the missing one's.
    wait_all_sent(&db, 10).await;
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE kafka_partition IS NULL")
            .await,
        10,
        "no partition guessed for a topic the broker does not have"
    );
    let status = replayproof(&db, &["status"]);
    let line = status
        .lines()
        .find(|l| l.contains(&missing))
        .unwrap_or_else(|| panic!("{status}"));
    assert!(line.contains("unassigned") && line.contains("10"), "{line}");
    relay.terminate(WAIT).await;
}

/// A topic deleted and created again (same partition count) while a send's outcome is unknown:
/// the old topic's records cannot be read back, so the partition stops instead of sending them
/// again into the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_recreated_while_a_send_is_in_doubt_stops_the_partition() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let brokers = kafka.brokers();
    claim(&db, kafka_effect(&topic), 0..50).await;
    // Batches of 40: the first is recorded, the relay dies after the second's ack.
    let first = relay(
        &db,
        &brokers,
        "first",
        Some("relay::after_ack=1*off->return"),
    );
    assert!(
        !first.exited(WAIT).await.success(),
        "the failpoint ended the relay"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE state = 'sent'")
            .await,
        40
    );
    recreate_topic(&brokers, &topic, 1).await;
    let second = relay(&db, &brokers, "second", None);
    stopped_with_nothing_written(&db, &brokers, &topic, "deleted and created again", 10).await;
    second.terminate(WAIT).await;
}

/// Waits until `topic`'s one partition stops, then checks that `status` says `why`, that
/// `pending` records wait, and that nothing was written to the topic as it is now.
async fn stopped_with_nothing_written(
    db: &TestDb,
    brokers: &str,
    topic: &str,
    why: &str,
    pending: i64,
) {
    wait_stopped(db, 1).await;
    let status = replayproof(db, &["status"]);
    assert!(status.contains(why), "{status}");
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE state = 'pending'")
            .await,
        pending
    );
    assert!(
        read_topic(brokers, topic, 1).is_empty(),
        "nothing written to the topic"
    );
}

/// A topic deleted and created again with the same partition count while nothing is in doubt:
/// its log ends before the offset the relay knows settled, so the partition stops before its
/// next batch instead of writing into a topic that lost the records before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_recreated_with_the_same_partition_count_stops_the_partition_before_its_next_batch()
{
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let brokers = kafka.brokers();
    claim(&db, kafka_effect(&topic), 0..50).await;
    let relay = relay(&db, &brokers, "only", None);
    wait_all_sent(&db, 50).await;
    assert_eq!(
        db.count("SELECT count(*) FROM output_partitions WHERE in_doubt")
            .await,
        0,
        "nothing in doubt before the topic is recreated"
    );
    recreate_topic(&brokers, &topic, 1).await;
    claim(&db, kafka_effect(&topic), 50..60).await;
    stopped_with_nothing_written(&db, &brokers, &topic, "deleted and created again", 10).await;
    relay.terminate(WAIT).await;
}

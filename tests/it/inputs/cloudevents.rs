//! CloudEvents through the binary: events written by the CloudEvents SDK's own Kafka binding
//! (docs/producers/cloudevents_producer.py, the Python `cloudevents` package over
//! confluent-kafka), in binary and structured mode, each redelivered on another partition in the
//! other mode, read by `replayproof consume` configured as docs/inputs.md shows.

use crate::harness::*;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use replayproof::inputs::cloudevent_key;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::time::Duration;

/// The producer docs/inputs.md shows, run as it shows it.
const PRODUCER: &str = "docs/producers/cloudevents_producer.py";

/// Writes `events` with the SDK in `mode`, every one to `partition`.
fn sdk_produce(brokers: &str, topic: &str, mode: &str, partition: i32, events: &[Value]) {
    let mut cmd = std::process::Command::new("python3");
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg(PRODUCER)
        .args(["--brokers", brokers, "--topic", topic, "--mode", mode])
        .args(["--partition", &partition.to_string()])
        .args(["--config", "broker.address.family=v4"])
        .stdin(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("python3 runs the producer");
    let mut stdin = child.stdin.take().unwrap();
    for event in events {
        writeln!(stdin, "{event}").unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the SDK producer failed (pip install cloudevents==2.2.0 confluent-kafka): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const WAIT: Duration = Duration::from_secs(120);

/// A message's headers, written by hand.
type Headers<'a> = &'a [(&'a str, &'a str)];

/// A message written by hand, with headers.
async fn produce_with_headers(
    brokers: &str,
    topic: &str,
    partition: i32,
    messages: &[(Headers<'_>, Option<&str>)],
) {
    let producer = producer(brokers);
    for (headers, value) in messages {
        let mut owned = OwnedHeaders::new();
        for (name, v) in *headers {
            owned = owned.insert(Header {
                key: name,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(partition)
            .headers(owned);
        if let Some(v) = value {
            record = record.payload(v.as_bytes());
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("acknowledged");
    }
}

/// 24 events: ids 1 to 12 under two sources, so each id is two events. Most carry JSON data,
/// id 5 text, id 7 none.
fn events() -> Vec<Value> {
    let mut events = Vec::new();
    for source in ["/shop/eu", "/shop/us"] {
        for id in 1..=12 {
            let mut e = json!({
                "source": source, "id": id.to_string(), "type": "order.created",
                "time": "2026-12-07T10:00:00Z", "extensions": {"tenant": format!("t-{}", id % 3)},
            });
            match id {
                5 => {
                    e["datacontenttype"] = json!("text/plain");
                    e["data"] = json!(format!("note {id}"));
                }
                7 => {}
                _ => e["data"] = json!({"order": id, "total": "10.50", "source": source}),
            }
            events.push(e);
        }
    }
    events
}

/// Messages that are not valid CloudEvents, each with the words its dead letter must say.
const MALFORMED: [(Headers<'static>, Option<&str>, &str); 6] = [
    (
        &[
            ("ce_specversion", "1.0"),
            ("ce_source", "/s"),
            ("ce_type", "t"),
        ],
        Some("{}"),
        "id is missing",
    ),
    (
        &[
            ("ce_specversion", "0.3"),
            ("ce_id", "1"),
            ("ce_source", "/s"),
            ("ce_type", "t"),
        ],
        None,
        "specversion \"0.3\"",
    ),
    (
        &[("content-type", "application/cloudevents+json")],
        Some("not json"),
        "not a JSON object",
    ),
    (
        &[("content-type", "application/cloudevents+json")],
        Some(
            r#"{"specversion":"1.0","id":"9","source":"/s","type":"t","data":1,"data_base64":"AA=="}"#,
        ),
        "both data and data_base64",
    ),
    (
        &[
            ("ce_specversion", "1.0"),
            ("ce_id", "2"),
            ("ce_source", "/s"),
            ("ce_type", "t"),
            ("ce_time", "yesterday"),
        ],
        None,
        "RFC 3339",
    ),
    (
        &[],
        Some(r#"{"key":"k","source":"s","payload":{}}"#),
        "neither a ce_specversion",
    ),
];

fn config_file(dir: &tempfile::TempDir) -> String {
    // As docs/inputs.md shows it.
    let path = dir.path().join("replayproof.toml");
    std::fs::write(&path, "[consume]\ninput = \"cloudevents\"\n").unwrap();
    path.to_str().unwrap().to_owned()
}

async fn ledger_types(db: &TestDb) -> HashMap<String, Option<String>> {
    sqlx::query_as("SELECT event_key, event_type FROM ledger")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_from_the_sdk_in_both_modes_on_other_partitions_apply_once_per_source_and_id() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group, brokers) = (kafka.topic(3).await, unique("group"), kafka.brokers());
    let events = events();
    sdk_produce(&brokers, &topic, "binary", 0, &events);
    sdk_produce(&brokers, &topic, "structured", 1, &events);
    // A third copy of some, in binary mode again, behind the malformed ones.
    let messages: Vec<_> = MALFORMED.iter().map(|(h, v, _)| (*h, *v)).collect();
    produce_with_headers(&brokers, &topic, 2, &messages).await;
    sdk_produce(&brokers, &topic, "binary", 2, &events[..6]);

    let dir = tempfile::tempdir().unwrap();
    let config = config_file(&dir);
    let consumer = ConsumerProcess::spawn_with(
        &brokers,
        &topic,
        &group,
        &db.url,
        None,
        &["--config", &config],
    );
    wait_committed_total(&kafka, &group, &topic, 3, 24 + 24 + 6 + 6).await;

    let expected: HashSet<String> = events
        .iter()
        .map(|e| cloudevent_key(e["source"].as_str().unwrap(), e["id"].as_str().unwrap()))
        .collect();
    assert_eq!(
        expected.len(),
        24,
        "the same id under two sources is two events"
    );
    assert_exactly_once(&db, &expected, WAIT).await;
    assert_eq!(
        db.count("SELECT count(*) FROM key_conflicts").await,
        0,
        "both modes read alike"
    );
    assert!(ledger_types(&db)
        .await
        .values()
        .all(|t| t.as_deref() == Some("order.created")));
    let sources: Vec<String> = sqlx::query_scalar("SELECT DISTINCT source FROM processed_events")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(sources, vec![topic.clone()], "the topic names the source");
    let text: Value = sqlx::query_scalar("SELECT payload FROM ledger WHERE event_key = $1")
        .bind(cloudevent_key("/shop/eu", "5"))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        text,
        json!({"datacontenttype": "text/plain", "data_base64": "bm90ZSA1"})
    );

    let reasons: Vec<String> =
        sqlx::query_scalar("SELECT reason FROM dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(reasons.len(), MALFORMED.len(), "{reasons:?}");
    for ((_, _, says), reason) in MALFORMED.iter().zip(&reasons) {
        assert!(reason.contains(says), "{reason} should say {says}");
        assert!(reason.starts_with("not a valid CloudEvent"), "{reason}");
    }
    assert!(consumer.terminate(WAIT).await.success());
    replay_applies_only_what_is_missing(&kafka, &db, &topic, &config, &expected).await;
}

/// Replay by time over the CloudEvents topic, after claims and effects were lost.
async fn replay_applies_only_what_is_missing(
    kafka: &TestKafka,
    db: &TestDb,
    topic: &str,
    config: &str,
    expected: &HashSet<String>,
) {
    if !matches!(kafka, TestKafka::External(_)) {
        eprintln!(
            "NOT RUN: replay by time needs a broker that looks offsets up by time (KAFKA_BROKERS)"
        );
        return;
    }
    let lost = [
        cloudevent_key("/shop/eu", "3"),
        cloudevent_key("/shop/us", "5"),
        cloudevent_key("/shop/us", "12"),
    ];
    for key in &lost {
        for table in ["ledger", "processed_events"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE event_key = $1"))
                .bind(key)
                .execute(&db.pool)
                .await
                .unwrap();
        }
    }
    let brokers = kafka.brokers();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args([
        "replay", "--config", config, "--since", "1h", "--json", "--actor", "ann",
    ])
    .args([
        "--brokers",
        &brokers,
        "--topic",
        topic,
        "--database-url",
        &db.url,
    ]);
    for (k, v) in test_kafka_options() {
        cmd.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    let report: Value = serde_json::from_slice(&stdout_of(&mut cmd)).unwrap();
    assert_eq!(report["newly_applied"], 3, "{report}");
    assert_eq!(report["dead_lettered"], 6, "{report}");
    assert_exactly_once(db, expected, WAIT).await;
    assert_eq!(
        db.count("SELECT count(*) FROM dead_letters").await,
        6,
        "stored once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_dead_lettered_under_the_wrong_input_apply_once_replayed_with_their_headers() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group, brokers) = (kafka.topic(1).await, unique("group"), kafka.brokers());
    let events = &events()[..4];
    sdk_produce(&brokers, &topic, "binary", 0, events);
    // Started without --input, the consumer reads envelopes: every CloudEvent is a dead letter.
    let wrong = ConsumerProcess::spawn(&brokers, &topic, &group, &db.url, None);
    wait_committed_total(&kafka, &group, &topic, 1, 4).await;
    assert!(wrong.terminate(WAIT).await.success());
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 4);
    let first: i64 = db.count("SELECT min(id) FROM dead_letters").await;
    let mut show = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    show.args(["dead-letters", "show", &first.to_string(), "--json"])
        .args(["--database-url", &db.url]);
    let shown: Value = serde_json::from_slice(&stdout_of(&mut show)).unwrap();
    let headers = shown["headers"].as_array().expect("headers listed");
    assert!(
        headers.contains(&json!(["ce_id", events[0]["id"]])),
        "each letter keeps its ce_* headers: {shown}"
    );

    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args([
        "dead-letters",
        "replay",
        "--all",
        "--reason",
        "input fixed",
        "--actor",
        "ann",
    ])
    .args(["--database-url", &db.url, "--brokers", &brokers]);
    for (k, v) in test_kafka_options() {
        cmd.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    stdout_of(&mut cmd);
    let right = ConsumerProcess::spawn_with(
        &brokers,
        &topic,
        &group,
        &db.url,
        None,
        &["--input", "cloudevents"],
    );
    wait_committed_total(&kafka, &group, &topic, 1, 8).await;
    let expected: HashSet<String> = events
        .iter()
        .map(|e| cloudevent_key(e["source"].as_str().unwrap(), e["id"].as_str().unwrap()))
        .collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    assert!(right.terminate(WAIT).await.success());
}

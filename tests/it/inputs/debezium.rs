//! Debezium's outbox event router through the binary: messages shaped as the router writes
//! them with its defaults (the event id in the `id` header, the aggregate id as the key), in
//! each of the three value shapes, each redelivered on another partition in another shape;
//! tombstones skipped and counted.

use crate::harness::*;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::Value;
use std::collections::HashSet;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

/// One outbox message as the router writes it.
struct Outbox {
    id: Option<String>,
    key: Option<String>,
    value: Option<String>,
    event_type: &'static str,
}

/// The payload of event `i`, in value shape `shape`: 0 an object (`expand.json.payload`), 1 a
/// JSON string holding JSON (a text column), 2 the JsonConverter's schema wrapper around it.
fn value(i: usize, shape: usize) -> String {
    let document =
        format!(r#"{{"orderId":{i},"lines":[{{"sku":"A-{i}","qty":2}}],"total":"19.90"}}"#);
    let quoted = serde_json::to_string(&document).unwrap();
    match shape {
        0 => document,
        1 => quoted,
        _ => format!(r#"{{"schema":{{"type":"string","optional":false}},"payload":{quoted}}}"#),
    }
}

/// The aggregate id, plain or as the JSON converter quotes it.
fn key(i: usize, quoted: bool) -> String {
    let aggregate = format!("order-{}", i % 4);
    match quoted {
        true => format!("\"{aggregate}\""),
        false => aggregate,
    }
}

fn id(i: usize) -> String {
    format!("9f1c2a3b-0000-4000-8000-{i:012}")
}

async fn write(brokers: &str, topic: &str, partition: i32, messages: &[Outbox]) {
    let producer = producer(brokers);
    for m in messages {
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "eventType",
            value: Some(m.event_type),
        });
        if let Some(id) = &m.id {
            headers = headers.insert(Header {
                key: "id",
                value: Some(id.as_str()),
            });
        }
        let mut record = FutureRecord::<str, str>::to(topic)
            .partition(partition)
            .headers(headers);
        if let Some(k) = &m.key {
            record = record.key(k.as_str());
        }
        if let Some(v) = &m.value {
            record = record.payload(v.as_str());
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("acknowledged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_messages_in_every_value_shape_redelivered_apply_once_per_id_and_tombstones_are_skipped(
) {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group, brokers) = (kafka.topic(2).await, unique("group"), kafka.brokers());
    const N: usize = 12;
    // First deliveries on partition 0, each in shape i % 3, the key plain.
    let first: Vec<Outbox> = (0..N)
        .map(|i| Outbox {
            id: Some(id(i)),
            key: Some(key(i, false)),
            value: Some(value(i, i % 3)),
            event_type: "OrderCreated",
        })
        .collect();
    // Redeliveries on partition 1 in the next shape, the id and key JSON-quoted as the JSON
    // converter writes them; tombstones of three aggregates; one message without an id.
    let mut again: Vec<Outbox> = (0..N)
        .map(|i| Outbox {
            id: Some(format!("\"{}\"", id(i))),
            key: Some(key(i, true)),
            value: Some(value(i, (i + 1) % 3)),
            event_type: "OrderCreated",
        })
        .collect();
    for i in 0..3 {
        again.push(Outbox {
            id: None,
            key: Some(key(i, false)),
            value: None,
            event_type: "OrderCreated",
        });
    }
    again.push(Outbox {
        id: None,
        key: Some(key(0, false)),
        value: Some(value(0, 0)),
        event_type: "OrderCreated",
    });
    write(&brokers, &topic, 0, &first).await;
    write(&brokers, &topic, 1, &again).await;

    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let consumer = ConsumerProcess::spawn_with(
        &brokers,
        &topic,
        &group,
        &db.url,
        None,
        &[
            "--input",
            "debezium-outbox",
            "--source-name",
            "orders",
            "--metrics-addr",
            &addr,
        ],
    );
    wait_committed_total(&kafka, &group, &topic, 2, (N + N + 4) as i64).await;

    let expected: HashSet<String> = (0..N).map(|i| format!("outbox:{}", id(i))).collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    assert_eq!(
        db.count("SELECT count(*) FROM key_conflicts").await,
        0,
        "the shapes read alike"
    );
    let payload: Value = sqlx::query_scalar("SELECT payload FROM ledger WHERE event_key = $1")
        .bind(format!("outbox:{}", id(1)))
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        payload["orderId"], 1,
        "the document, not its quoted text: {payload}"
    );
    let routes: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT event_key, route_key, source FROM processed_events ORDER BY event_key",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for (key, route, source) in &routes {
        let i: usize = key.rsplit('-').next().unwrap().parse().unwrap();
        assert_eq!(
            route,
            &format!("order-{}", i % 4),
            "the aggregate id routes {key}"
        );
        assert_eq!(source, "orders");
    }
    assert!(
        db.count("SELECT count(*) FROM ledger WHERE event_type = 'OrderCreated'")
            .await
            == N as i64
    );
    let reasons: Vec<String> = sqlx::query_scalar("SELECT reason FROM dead_letters")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        reasons.len(),
        1,
        "only the message without an id: {reasons:?}"
    );
    assert!(reasons[0].contains("no id header"), "{}", reasons[0]);
    let (_, page) = http_get(port, "/metrics").await.unwrap();
    let skipped = r#"replayproof_consume_events_total{outcome="skipped",source="orders"} 3"#;
    assert!(page.lines().any(|l| l == skipped), "{skipped} in {page}");
    assert!(consumer.terminate(WAIT).await.success());
}

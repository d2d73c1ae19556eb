//! `replayproof status` on a seeded database and topic.

use crate::harness::*;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::effect::Ledger;
use serde_json::json;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_prints_the_right_counts() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let topic = kafka.topic(2).await;
    let group = unique("group");
    let records: Vec<Record> = (0..5)
        .map(|i| Record::event(&format!("a{i}"), json!(i)).on(0))
        .chain((0..3).map(|i| Record::event(&format!("b{i}"), json!(i)).on(1)))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let (brokers, t, g) = (kafka.brokers(), topic.clone(), group.clone());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = client_config(&brokers)
            .set("group.id", &g)
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&t, 0, Offset::Offset(2)).unwrap();
        c.commit(&tpl, CommitMode::Sync).unwrap();
    })
    .await
    .unwrap();

    let p = BatchProcessor::new(db.pool.clone(), Arc::new(Ledger));
    let raw = |offset, key: &str, value: &[u8]| RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(value.to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    let batch = [
        raw(0, "k1", &envelope("k1", json!(1))),
        raw(1, "k2", &envelope("k2", json!(2))),
        raw(2, "k3", b"not json"),
        raw(3, "k1", &envelope("k1", json!("other"))),
        raw(4, "k4", &envelope("k4", json!(4))),
    ];
    p.process("t", 0, &batch).await.unwrap();
    sqlx::query("UPDATE processed_events SET status = 'failed' WHERE event_key = 'k2'")
        .execute(&db.pool)
        .await
        .unwrap();
    // An event an effect deferred 100 s ago, due again in an hour.
    sqlx::query(
        "UPDATE processed_events SET status = 'deferred', payload = '4', \
         claimed_at = now() - interval '100 s', due_at = now() + interval '1 hour', \
         deadline_at = now() + interval '1 day', deferred_reason = 'waiting' \
         WHERE event_key = 'k4'",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    // No statistics were gathered: a small install is counted exactly all the same.
    let stdout = stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args([
                "status",
                "--database-url",
                &db.url,
                "--brokers",
                &kafka.brokers(),
            ])
            .args(["--topic", &topic, "--group", &group, "--json"]),
    );
    let s: serde_json::Value = serde_json::from_slice(&stdout).unwrap();
    assert_eq!(
        s["claims"],
        json!([["deferred", 1], ["done", 1], ["failed", 1]])
    );
    assert_eq!(s["deferred"], 1);
    let oldest = s["oldest_deferred_seconds"].as_f64().unwrap();
    assert!((100.0..160.0).contains(&oldest), "{oldest}");
    let next = s["next_deferred_due_seconds"].as_f64().unwrap();
    assert!((3500.0..=3600.0).contains(&next), "{next}");
    assert_eq!(s["dead_letters"], 1);
    assert_eq!(s["key_conflicts"], 1);
    assert_eq!(s["expired_replays"], 0);
    assert_eq!(s["outbox"], json!([]));
    assert_eq!(
        s["lag"],
        json!([
            {"partition": 0, "committed": 2, "high_watermark": 5, "lag": 3},
            {"partition": 1, "committed": null, "high_watermark": 3, "lag": 3}
        ])
    );
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args(["status", "--database-url", &db.url])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("Claims: deferred 1, done 1, failed 1"),
        "{text}"
    );
    assert!(text.contains("Deferred: 1; oldest 1"), "{text}");
    assert!(text.contains("; next due in 3"), "{text}");
    assert!(
        text.contains("Dead letters: 1 (1 not replayed); key conflicts: 1"),
        "{text}"
    );
}

/// `status` as text, over `db`.
fn status_text(db: &TestDb) -> String {
    String::from_utf8(stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof")).args([
            "status",
            "--database-url",
            &db.url,
        ]),
    ))
    .unwrap()
}

#[tokio::test]
async fn a_big_table_is_estimated_once_analysed_and_said_not_analysed_before() {
    let db = TestDb::new().await;
    let over = replayproof::operator::status::EXACT_BELOW + 1;
    // Autovacuum would analyse the table by itself sooner or later.
    sqlx::query("ALTER TABLE dead_letters SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO dead_letters (kafka_topic, kafka_partition, kafka_offset, reason) \
         SELECT 't', 0, n, 'bad' FROM generate_series(1, $1) AS n",
    )
    .bind(over)
    .execute(&db.pool)
    .await
    .unwrap();
    let text = status_text(&db);
    assert!(
        text.contains(&format!(
            "Dead letters: over {} (not analysed yet) ({over} not replayed)",
            over - 1
        )),
        "{text}"
    );
    assert!(text.contains("key conflicts: 0"), "{text}");
    sqlx::query("ANALYZE dead_letters")
        .execute(&db.pool)
        .await
        .unwrap();
    let text = status_text(&db);
    assert!(
        text.contains(&format!("Dead letters: ~{over} ({over} not replayed)")),
        "{text}"
    );
}

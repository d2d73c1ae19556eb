//! Recovery by time: a window of the topic read again through the claim path applies exactly
//! the events whose claims were lost, once, and leaves the live group's offsets alone.
//!
//! It needs a broker that finds offsets by time (ListOffsets with a timestamp): the broker
//! process the test script starts. librdkafka's mock cluster answers such a lookup with the
//! partition's end, so with no `KAFKA_BROKERS` the test says so and stops.

use crate::harness::*;
use replayproof::consume::BatchProcessor;
use replayproof::effect::Ledger;
use replayproof::operator::replay::{self, Window};
use replayproof::operator::{Act, OperatorError};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

fn external_broker() -> Option<TestKafka> {
    match std::env::var("KAFKA_BROKERS") {
        Ok(b) if !b.is_empty() => Some(TestKafka::External(b)),
        _ => {
            eprintln!(
                "NOT RUN: replay by time needs a broker that looks offsets up by time \
                 (KAFKA_BROKERS, as scripts/test.sh starts one); the mock cluster cannot"
            );
            None
        }
    }
}

async fn audits(db: &TestDb) -> Vec<(String, String, String)> {
    sqlx::query_as("SELECT actor, action, target FROM operator_actions ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_window_applies_exactly_the_lost_events_once_and_leaves_the_group_alone() {
    let Some(kafka) = external_broker() else {
        return;
    };
    let db = TestDb::new().await;
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let producer = producer(&kafka.brokers());

    // Before the window: events that stay out of it.
    let early: Vec<Record> = (0..6)
        .map(|i| Record::event(&format!("early-{i}"), json!({"i": i})).on(i % 2))
        .collect();
    produce(&producer, &topic, &early).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let since = chrono::Utc::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let window: Vec<Record> = (0..40)
        .map(|i| Record::event(&format!("evt-{i:02}"), json!({"i": i})).on(i % 2))
        .collect();
    produce(&producer, &topic, &window).await;

    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    wait_committed_total(&kafka, &group, &topic, 2, 46).await;
    consumer.stop().await;
    let offsets_before = committed(&kafka, &group, &topic, 2).await;

    // A bad deploy lost some claims and their effects; the early ones too, outside the window.
    let lost = ["evt-03", "evt-17", "evt-22", "evt-39", "early-1"];
    for key in lost {
        sqlx::query("DELETE FROM ledger WHERE event_key = $1")
            .bind(key)
            .execute(&db.pool)
            .await
            .unwrap();
        sqlx::query("DELETE FROM processed_events WHERE event_key = $1")
            .bind(key)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let processor = BatchProcessor::new(db.pool.clone(), Arc::new(Ledger));
    let act = Act::new("ann", "the 10:00 deploy skipped work");
    let mut w = Window {
        brokers: kafka.brokers(),
        topic: topic.clone(),
        options: test_kafka_options(),
        since,
        until: None,
        partition: None,
        dry_run: true,
        force: false,
    };

    // A dry run counts and changes nothing.
    let dry = replay::replay(&db.pool, &processor, &w, &act)
        .await
        .unwrap();
    assert_eq!(
        (dry.read, dry.newly_applied, dry.already_applied),
        (40, 4, 36),
        "{dry:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 41);
    assert!(audits(&db).await.is_empty(), "a dry run records nothing");

    w.dry_run = false;
    let done = replay::replay(&db.pool, &processor, &w, &act)
        .await
        .unwrap();
    assert_eq!(done.read, 40, "{done:?}");
    assert_eq!(
        done.newly_applied, 4,
        "exactly the lost events in the window: {done:?}"
    );
    assert_eq!(done.already_applied, 36);
    assert_eq!((done.dead_lettered, done.conflicts, done.failed), (0, 0, 0));
    let counts = db.ledger_counts().await;
    for i in 0..40 {
        assert_eq!(
            counts.get(&format!("evt-{i:02}")),
            Some(&1),
            "evt-{i:02} once"
        );
    }
    assert_eq!(
        counts.get("early-1"),
        None,
        "outside the window: not applied"
    );
    assert_eq!(counts.len(), 45);
    assert_eq!(
        committed(&kafka, &group, &topic, 2).await,
        offsets_before,
        "the live group's offsets are untouched"
    );
    assert_eq!(
        audits(&db).await,
        [(
            "ann".to_owned(),
            "replay".to_owned(),
            format!("topic:{topic}")
        )]
    );

    // Again: nothing is missing now, so nothing is applied.
    let again = replay::replay(&db.pool, &processor, &w, &act)
        .await
        .unwrap();
    assert_eq!((again.newly_applied, again.already_applied), (0, 40));
    assert_eq!(
        db.count("SELECT count(*) FROM claim_deliveries WHERE deliveries <> 1")
            .await,
        0,
        "a message read again is not a second delivery"
    );

    // One partition only.
    w.partition = Some(1);
    w.dry_run = true;
    let one = replay::replay(&db.pool, &processor, &w, &act)
        .await
        .unwrap();
    assert_eq!(one.read, 20);
    assert_eq!(one.partitions.len(), 1);

    // A window before the claims' retention is refused, unless forced.
    sqlx::query("INSERT INTO prune_horizons (source, pruned_before) VALUES ('test', now())")
        .execute(&db.pool)
        .await
        .unwrap();
    let refused = replay::replay(&db.pool, &processor, &w, &act)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, OperatorError::Unexpected(e) if e.to_string().contains("pruned")),
        "{refused}"
    );
    w.force = true;
    assert!(replay::replay(&db.pool, &processor, &w, &act).await.is_ok());
    sqlx::query("DELETE FROM prune_horizons")
        .execute(&db.pool)
        .await
        .unwrap();

    // The console's form runs the same replay, as the logged-in operator.
    sqlx::query("DELETE FROM ledger WHERE event_key = 'evt-05'")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM processed_events WHERE event_key = 'evt-05'")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut s = crate::harness::console::settings();
    s.kafka = Some(replayproof::operator::status::KafkaTarget {
        brokers: kafka.brokers(),
        topic: topic.clone(),
        group: group.clone(),
        options: test_kafka_options(),
    });
    let console = crate::harness::console::TestConsole::start(&db, s).await;
    let ann = console.login("ann").await;
    let token = ann.csrf("/replay").await;
    let since_text = since.to_rfc3339();
    let form = |dry: bool| {
        let mut f = vec![
            ("csrf_token", token.clone()),
            ("since", since_text.clone()),
            ("reason", "evt-05 went missing".to_owned()),
        ];
        if dry {
            f.push(("dry_run", "1".to_owned()));
        }
        f
    };
    let dry = form(true);
    let dry: Vec<(&str, &str)> = dry.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let page = ann.post("/replay", &dry).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        page.body
            .contains("<td>newly applied</td><td class=\"n\">1</td>"),
        "{}",
        page.body
    );
    assert_eq!(
        db.ledger_counts().await.get("evt-05"),
        None,
        "a dry run applies nothing"
    );
    let run = form(false);
    let run: Vec<(&str, &str)> = run.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let page = ann.post("/replay", &run).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        page.body.contains("<td>read</td><td class=\"n\">40</td>"),
        "{}",
        page.body
    );
    assert_eq!(db.ledger_counts().await.get("evt-05"), Some(&1));
    let by_ann: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE actor = 'ann' AND action = 'replay' AND reason = 'evt-05 went missing'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(by_ann, 1);
}

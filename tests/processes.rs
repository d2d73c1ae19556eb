//! `replayproof consume` as real processes: killed with SIGKILL at chosen steps, stopped with
//! SIGTERM, and run three at a time. The broker is `KAFKA_BROKERS` (the test script starts a
//! nisshi broker process) or, without it, the mock cluster hosted by this test process.

mod common;

use common::*;
use serde_json::json;
use std::collections::HashSet;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

async fn committed(kafka: &TestKafka, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let (b, g, t) = (kafka.brokers(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || committed_offsets(&b, &g, &t, partitions))
        .await
        .unwrap()
}

async fn wait_committed_total(
    kafka: &TestKafka,
    group: &str,
    topic: &str,
    partitions: i32,
    total: i64,
) {
    wait_for("offsets committed", WAIT, || async {
        committed(kafka, group, topic, partitions)
            .await
            .iter()
            .sum::<i64>()
            == total
    })
    .await;
}

fn spawn(
    kafka: &TestKafka,
    topic: &str,
    group: &str,
    db: &TestDb,
    failpoints: Option<&str>,
) -> ConsumerProcess {
    ConsumerProcess::spawn(&kafka.brokers(), topic, group, &db.url, failpoints)
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_between_claim_and_commit_applies_the_event_once_after_restart() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let first = spawn(
        &kafka,
        &topic,
        &group,
        &db,
        Some("consume::before_commit=pause"),
    );
    produce(
        &producer(&kafka.brokers()),
        &topic,
        &[Record::event("evt-kill", json!({"n": 1}))],
    )
    .await;

    wait_for_open_transaction(&db).await;
    first.kill9().await;
    wait_for("the killed consumer's transaction to end", WAIT, || async {
        db.count("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'").await == 0
    })
    .await;
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events").await,
        0,
        "the claim rolled back"
    );
    assert_eq!(
        committed(&kafka, &group, &topic, 1).await,
        [-1],
        "no offset was committed"
    );

    let second = spawn(&kafka, &topic, &group, &db, None);
    wait_committed_total(&kafka, &group, &topic, 1, 1).await;
    assert_exactly_once(&db, &HashSet::from(["evt-kill".to_owned()]), WAIT).await;
    assert!(second.terminate(Duration::from_secs(30)).await.success());
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_after_commit_before_offset_commit_replays_harmlessly() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let first = spawn(
        &kafka,
        &topic,
        &group,
        &db,
        Some("consume::after_commit=pause"),
    );
    produce(
        &producer(&kafka.brokers()),
        &topic,
        &[Record::event("evt-kill", json!({"n": 1}))],
    )
    .await;

    wait_for("the transaction to commit", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await == 1
    })
    .await;
    first.kill9().await;
    assert_eq!(
        committed(&kafka, &group, &topic, 1).await,
        [-1],
        "the offset was not committed"
    );

    let second = spawn(&kafka, &topic, &group, &db, None);
    wait_committed_total(&kafka, &group, &topic, 1, 1).await;
    assert_exactly_once(&db, &HashSet::from(["evt-kill".to_owned()]), WAIT).await;
    assert!(second.terminate(Duration::from_secs(30)).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_commits_what_committed_and_exits_zero() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let consumer = spawn(&kafka, &topic, &group, &db, None);
    let records: Vec<Record> = (0..3_000)
        .map(|i| Record::event(&format!("evt-{i}"), json!(i)))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    wait_for("some events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await >= 500
    })
    .await;

    let status = consumer.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status:?}");
    // After a clean stop the committed offsets cover exactly what was applied: nothing will be
    // replayed, and nothing is skipped.
    let offsets = committed(&kafka, &group, &topic, 2).await;
    for partition in 0..2 {
        let applied: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(kafka_offset) + 1, 0) FROM processed_events WHERE kafka_partition = $1",
        )
        .bind(partition)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let offset = offsets[partition as usize];
        if applied == 0 {
            assert!(
                offset <= 0,
                "partition {partition}: offset {offset} with nothing applied"
            );
        } else {
            assert_eq!(offset, applied, "partition {partition}");
        }
    }
}

/// Test 7 of the consumer's promise: 20,000 events, 30% redelivered, 4 partitions, 3 consumer
/// processes, one of them killed with SIGKILL twice. Prints the sustained rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_events_three_processes_one_killed_twice() {
    const EVENTS: usize = 20_000;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(4).await, unique("group"));
    let mut rng = fastrand::Rng::with_seed(7);
    let keys: Vec<String> = (0..EVENTS).map(|i| format!("evt-{i:05}")).collect();
    let mut records: Vec<Record> = keys
        .iter()
        .map(|k| Record::event(k, json!({"k": k})))
        .collect();
    for _ in 0..EVENTS * 3 / 10 {
        let k = &keys[rng.usize(..EVENTS)];
        let at = rng.usize(..records.len());
        records.insert(at, Record::event(k, json!({"k": k})));
    }
    let messages = records.len() as i64;

    let started = Instant::now();
    let mut victim = spawn(&kafka, &topic, &group, &db, None);
    let steady = [
        spawn(&kafka, &topic, &group, &db, None),
        spawn(&kafka, &topic, &group, &db, None),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    for at in [5_000, 12_000] {
        wait_for("progress before the kill", WAIT, || async {
            db.count("SELECT count(*) FROM ledger").await >= at
        })
        .await;
        victim.kill9().await;
        victim = spawn(&kafka, &topic, &group, &db, None);
    }
    let expected: HashSet<String> = keys.into_iter().collect();
    assert_exactly_once(&db, &expected, Duration::from_secs(300)).await;
    let elapsed = started.elapsed();
    let (first, last): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT min(applied_at), max(applied_at) FROM ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let applying = (last - first).to_std().unwrap_or_default().as_secs_f64();
    eprintln!(
        "test 7: {EVENTS} events ({messages} messages) applied by 3 consumers in {:.1} s from start \
         ({:.0} events/s); first to last effect {applying:.1} s ({:.0} events/s, {:.0} messages/s)",
        elapsed.as_secs_f64(),
        EVENTS as f64 / elapsed.as_secs_f64(),
        EVENTS as f64 / applying,
        messages as f64 / applying,
    );
    wait_committed_total(&kafka, &group, &topic, 4, messages).await;
    for consumer in steady.into_iter().chain([victim]) {
        assert!(consumer.terminate(Duration::from_secs(30)).await.success());
    }
}

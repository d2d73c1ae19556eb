//! `examples/orders.rs`, a binary built on `replayproof::Cli` with an effect of its own, run as
//! real processes: its `migrate`, `consume --effect orders` (deferring a payment whose order
//! does not exist yet) and `events` commands. The effect's paths one by one are the example's
//! own tests (`cargo test --example orders`).

use crate::harness::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

/// The example's binary, built next to this test binary by `cargo test`.
fn orders_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let target = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    target.join("examples").join("orders")
}

fn orders(args: &[&str], db: &TestDb) -> std::process::Output {
    std::process::Command::new(orders_binary())
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running the orders example (scripts/test.sh builds it; alone: `cargo build --all-features --example orders`)")
}

/// `consume --effect orders` as a process, deferring with short waits, its metrics on `port`.
fn consumer(
    kafka: &TestKafka,
    db: &TestDb,
    topic: &str,
    group: &str,
    port: u16,
) -> ConsumerProcess {
    let mut cmd = consumer_command(kafka, db, topic, group, port);
    ConsumerProcess {
        child: cmd.spawn().expect("the orders example's consumer"),
    }
}

fn consumer_command(
    kafka: &TestKafka,
    db: &TestDb,
    topic: &str,
    group: &str,
    port: u16,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(orders_binary());
    cmd.args([
        "consume",
        "--effect",
        "orders",
        "--brokers",
        &kafka.brokers(),
    ])
    .args(["--topic", topic, "--group", group])
    .args(["--defer-backoff", "200ms", "--defer-max-backoff", "400ms"])
    .args(["--defer-poll-ms", "50", "--commit-interval-ms", "50"])
    .arg("--metrics-addr")
    .arg(format!("127.0.0.1:{port}"))
    .args(
        test_kafka_options()
            .iter()
            .flat_map(|(k, v)| ["--kafka-option".into(), format!("{k}={v}")]),
    )
    .env("DATABASE_URL", &db.url)
    .env("RUST_LOG", "warn")
    .env_remove("FAILPOINTS")
    .kill_on_drop(true);
    cmd
}

fn payment(key: &str, order_id: i64, amount: i64) -> Record {
    Record::event(key, json!({"order_id": order_id, "amount": amount}))
}

async fn statuses(db: &TestDb) -> HashMap<String, String> {
    sqlx::query_as("SELECT event_key, status FROM processed_events")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

async fn migrated() -> TestDb {
    let db = TestDb::new().await;
    let migrated = orders(&["migrate"], &db);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    db
}

async fn metric(port: u16, name: &str) -> f64 {
    let (_, page) = http_get(port, "/metrics").await.expect("the metrics page");
    scraped(&page, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_pay_once_wait_for_a_late_order_and_refusals_keep_their_reasons() {
    let _heavy = heavy().await;
    let db = migrated().await;
    sqlx::query("INSERT INTO orders (id, amount) VALUES (1, 1999)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("orders"));
    let records = [
        payment("stripe:evt_1", 1, 1999),
        payment("stripe:evt_1", 1, 1999),
        payment("stripe:evt_2", 1, 1999),
        payment("stripe:evt_3", 2, 500),
        Record::event("stripe:evt_4", json!({"amount": 1})),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let port = free_port();
    let consumer = consumer(&kafka, &db, &topic, &group, port);
    wait_for("every event settled", WAIT, || async {
        statuses(&db).await.len() == 4
    })
    .await;
    let expected: HashMap<String, String> = [
        ("stripe:evt_1", "done"),
        ("stripe:evt_2", "failed"),
        ("stripe:evt_3", "deferred"),
        ("stripe:evt_4", "failed"),
    ]
    .into_iter()
    .map(|(k, s)| (k.to_owned(), s.to_owned()))
    .collect();
    assert_eq!(statuses(&db).await, expected);
    // The operator sees the deferred payment with its reason and due time.
    let listed = orders(&["events", "list", "--state", "deferred", "--json"], &db);
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["event_key"], "stripe:evt_3");
    let shown = orders(&["events", "show", "stripe:evt_3", "--json"], &db);
    let shown: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(
        shown["claim"]["deferred_reason"],
        "order 2 does not exist yet"
    );
    assert!(shown["claim"]["due_at"].is_string(), "{shown}");
    assert!(shown["claim"]["deadline_at"].is_string(), "{shown}");
    // The deferral did not hold the partition: the offset moved past every message.
    wait_committed_total(&kafka, &group, &topic, 1, 5).await;
    assert_eq!(
        metric(
            port,
            "replayproof_consume_events_total{outcome=\"deferred\""
        )
        .await,
        1.0
    );
    // The order arrives: the payment is applied, by itself, once.
    sqlx::query("INSERT INTO orders (id, amount) VALUES (2, 500)")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("the deferred payment applied", WAIT, || async {
        statuses(&db).await["stripe:evt_3"] == "done"
    })
    .await;
    assert_eq!(
        metric(
            port,
            "replayproof_deferred_attempts_total{outcome=\"applied\"}"
        )
        .await,
        1.0
    );
    assert!(consumer.terminate(WAIT).await.success());
    let paid: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, status, provider_event_id FROM orders ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        paid,
        [
            (1, "paid".to_owned(), Some("stripe:evt_1".to_owned())),
            (2, "paid".to_owned(), Some("stripe:evt_3".to_owned())),
        ]
    );
    let error: String = sqlx::query_scalar(
        "SELECT last_error FROM processed_events WHERE event_key = 'stripe:evt_2'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(error.contains("already paid by stripe:evt_1"), "{error}");
    // The event without an order failed; the claim recorded the effect by its name, so a
    // retry needs no --effect.
    let spec: serde_json::Value = sqlx::query_scalar(
        "SELECT effect_spec FROM processed_events WHERE event_key = 'stripe:evt_4'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(spec, json!({"effect": "orders"}));
    let retried = orders(
        &[
            "events",
            "retry",
            "stripe:evt_4",
            "--reason",
            "check",
            "--json",
        ],
        &db,
    );
    assert!(
        !retried.status.success(),
        "the payload still names no order"
    );
    let audited = db
        .count("SELECT count(*) FROM operator_actions WHERE action = 'retry'")
        .await;
    assert_eq!(audited, 1, "the failed retry is recorded");
}

/// Payments arrive before their orders on four partitions shared by two consumers; the orders
/// then appear at once, and both consumers' background tasks race for the due payments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_before_their_orders_with_two_consumers_are_each_applied_once() {
    let _heavy = heavy().await;
    let db = migrated().await;
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(4).await, unique("orders"));
    const N: i64 = 40;
    let records: Vec<Record> = (1..=N)
        .map(|i| payment(&format!("stripe:evt_{i}"), i, 100 + i))
        .collect();
    let ports = [free_port(), free_port()];
    let consumers = [
        consumer(&kafka, &db, &topic, &group, ports[0]),
        consumer(&kafka, &db, &topic, &group, ports[1]),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    wait_for("every payment deferred", WAIT, || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'deferred'")
            .await
            == N
    })
    .await;
    sqlx::query("INSERT INTO orders (id, amount) SELECT i, 100 + i FROM generate_series(1, $1) i")
        .bind(N)
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("every payment applied", WAIT, || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'done'")
            .await
            == N
    })
    .await;
    let mut applied = 0.0;
    for port in ports {
        applied += metric(
            port,
            "replayproof_deferred_attempts_total{outcome=\"applied\"}",
        )
        .await;
    }
    assert_eq!(
        applied, N as f64,
        "each deferred payment applied once, by one consumer"
    );
    for consumer in consumers {
        assert!(consumer.terminate(WAIT).await.success());
    }
    let wrong = db
        .count(
            "SELECT count(*) FROM orders \
             WHERE status <> 'paid' OR provider_event_id <> 'stripe:evt_' || id",
        )
        .await;
    assert_eq!(wrong, 0, "every order paid by its own payment");
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events WHERE status <> 'done'")
            .await,
        0
    );
}

#[test]
fn an_application_binary_completes_its_own_name() {
    let out = std::process::Command::new(orders_binary())
        .args(["completions", "bash"])
        .env_remove("REPLAYPROOF_CONFIG")
        .output()
        .expect("running the orders example");
    assert!(out.status.success());
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(script.contains("complete -F _orders"), "{script}");
    assert!(!script.contains("_replayproof"), "{script}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effects_own_spans_join_the_trace_of_the_event_it_applies() {
    use crate::harness::otlp::{traced, Collector};
    let _heavy = heavy().await;
    let (collector, endpoint) = Collector::start().await;
    let db = migrated().await;
    sqlx::query("INSERT INTO orders (id, amount) VALUES (7, 700)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("orders"));
    produce(
        &producer(&kafka.brokers()),
        &topic,
        &[payment("stripe:evt_traced", 7, 700)],
    )
    .await;
    let mut cmd = consumer_command(&kafka, &db, &topic, &group, free_port());
    traced(&mut cmd, &endpoint);
    let _consumer = ConsumerProcess {
        child: cmd.spawn().expect("the orders example's consumer"),
    };

    // The example's effect records its work in a span of its own, "pay order".
    let named = |name: &str| collector.spans().into_iter().find(|s| s.name == name);
    wait_for("the event's and the effect's spans", WAIT, || async {
        named("claim and apply test").is_some() && named("pay order").is_some()
    })
    .await;
    let (event, effect) = (
        named("claim and apply test").unwrap(),
        named("pay order").unwrap(),
    );
    assert_eq!(effect.trace_id, event.trace_id, "one trace");
    assert_eq!(
        effect.parent_span_id, event.span_id,
        "the effect's span is a child of its event's"
    );
    assert_eq!(
        statuses(&db)
            .await
            .get("stripe:evt_traced")
            .map(String::as_str),
        Some("done")
    );
}

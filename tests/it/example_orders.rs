//! `examples/orders.rs`, a binary built on `replayproof::Cli` with an effect of its own: its
//! `migrate`, `consume --effect orders` and `events retry --effect orders` apply that effect.

use crate::harness::*;
use serde_json::json;
use std::time::Duration;

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
        .expect("running the orders example (`cargo test` builds it; alone: `cargo build --example orders`)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_event_pays_its_order_once_and_a_failed_one_is_retried_by_name() {
    let db = TestDb::new().await;
    let migrated = orders(&["migrate"], &db);
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    sqlx::query("INSERT INTO orders (id, amount) VALUES (1, 1999), (2, 500)")
        .execute(&db.pool)
        .await
        .unwrap();
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("orders"));
    let records = [
        Record::event("stripe:evt_1", json!({"order_id": 1})),
        Record::event("stripe:evt_1", json!({"order_id": 1})),
        Record::event("stripe:evt_2", json!({"order_id": 1})),
        Record::event("stripe:evt_3", json!({"no_order": true})),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let port = free_port().to_string();
    let mut consumer = std::process::Command::new(orders_binary())
        .args([
            "consume",
            "--effect",
            "orders",
            "--brokers",
            &kafka.brokers(),
        ])
        .args(["--topic", &topic, "--group", &group, "--metrics-addr"])
        .arg(format!("127.0.0.1:{port}"))
        .args(
            test_kafka_options()
                .iter()
                .flat_map(|(k, v)| ["--kafka-option".into(), format!("{k}={v}")]),
        )
        .env("DATABASE_URL", &db.url)
        .spawn()
        .unwrap();
    wait_for("every event settled", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM processed_events WHERE status <> 'in_progress'")
            .await
            == 3
    })
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(consumer.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    consumer.wait().unwrap();
    let paid: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, status, provider_event_id FROM orders ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        paid,
        [
            (1, "paid".to_owned(), Some("stripe:evt_1".to_owned())),
            (2, "pending".to_owned(), None)
        ]
    );
    // The event without an order failed; the claim recorded the effect by its name.
    let spec: serde_json::Value = sqlx::query_scalar(
        "SELECT effect_spec FROM processed_events WHERE event_key = 'stripe:evt_3'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(spec, json!({"effect": "orders"}));
    let retried = orders(
        &[
            "events",
            "retry",
            "stripe:evt_3",
            "--effect",
            "orders",
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

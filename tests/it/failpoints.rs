//! Scenarios that stop this process's own code at a chosen step with `fail` failpoints,
//! configured in-process. Failpoints are global to the process, so each of these tests runs
//! alone in a child process of the test binary (`harness::isolation`).

use crate::harness::dispatcher::Downstream;
use crate::harness::*;
use replayproof::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use replayproof::outbox;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_at_commit_moves_no_offset_and_the_retry_applies_once() {
    let _heavy = heavy().await;
    if !crate::harness::isolation::in_child_process(
        "failpoints::a_connection_cut_at_commit_moves_no_offset_and_the_retry_applies_once",
    ) {
        return;
    }
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    // The batch's transaction waits at COMMIT long enough for its connection to be cut.
    fail::cfg("consume::stall_before_commit", "1*return(3000)").unwrap();
    let consumer =
        InProcessConsumer::start(settings(&kafka.brokers(), &topic, &group), db.pool.clone());
    produce(
        &producer(&kafka.brokers()),
        &topic,
        &[Record::event("evt-cut", json!(1))],
    )
    .await;
    wait_for("the batch holding its transaction open", WAIT, || async {
        idle_in_transaction(&db).await == 1
    })
    .await;
    let cut: bool = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND state = 'idle in transaction'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(cut);
    fail::remove("consume::stall_before_commit");
    assert_eq!(
        committed(&kafka, &group, &topic, 1).await,
        [-1],
        "no offset moved for the cut batch"
    );
    // At the end of the stall the COMMIT meets a closed connection: its outcome is an error,
    // the offset stays, and the retried batch applies the event once.
    let once = HashSet::from(["evt-cut".to_owned()]);
    assert_exactly_once(&db, &once, WAIT).await;
    wait_committed_total(&kafka, &group, &topic, 1, 1).await;
    assert!(consumer.metric("replayproof_batch_retries_total") >= 1.0);
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_is_not_started_with_less_than_a_request_timeout_left_on_the_lease() {
    let _heavy = heavy().await;
    if !crate::harness::isolation::in_child_process(
        "failpoints::a_delivery_is_not_started_with_less_than_a_request_timeout_left_on_the_lease",
    ) {
        return;
    }
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let op = outbox::operation_key("evt-slow", "deliver");
    enqueue_http(&db, &downstream, &["evt-slow".to_owned()], true).await;
    // The operation may have been applied: the attempt reconciles (404), then would deliver.
    sqlx::query("UPDATE outbox SET state = 'uncertain'")
        .execute(&db.pool)
        .await
        .unwrap();
    let tight = DispatchSettings {
        lease: Duration::from_millis(2500),
        request_timeout: Duration::from_millis(1000),
        poll_interval: Duration::from_millis(20),
        ..DispatchSettings::new("tight")
    };
    let d = Dispatcher::build(
        tight,
        db.pool.clone(),
        DispatchMetrics::new(&prometheus::Registry::new()).unwrap(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    // Something slow between the reconcile and the delivery eats most of the lease.
    fail::cfg("dispatch::before_delivery", "1*return(1800)").unwrap();
    assert_eq!(d.dispatch_once().await.unwrap(), 1);
    fail::remove("dispatch::before_delivery");
    assert_eq!(downstream.bodies().get(&op), None, "nothing was sent");
    let (state, error): (String, String) = sqlx::query_as("SELECT state, last_error FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(state, "uncertain");
    assert!(error.contains("lease"), "{error}");
    let outcome: String =
        sqlx::query_scalar("SELECT outcome FROM outbox_attempts ORDER BY id DESC LIMIT 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(outcome, "lease_short");
    // With a fresh lease the next attempt reconciles and delivers, once.
    assert_eq!(d.dispatch_once().await.unwrap(), 1);
    assert_eq!(downstream.applied().get(&op), Some(&1));
    assert_eq!(downstream.max_in_flight(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_row_pruned_while_a_dispatcher_leases_for_it_is_made_again() {
    let _heavy = heavy().await;
    if !crate::harness::isolation::in_child_process(
        "failpoints::a_destination_row_pruned_while_a_dispatcher_leases_for_it_is_made_again",
    ) {
        return;
    }
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let op = outbox::operation_key("evt-pruned", "deliver");
    enqueue_http(&db, &downstream, &["evt-pruned".to_owned()], false).await;
    // The destination's row exists, idle, as `prune` finds one.
    sqlx::query(
        "INSERT INTO outbox_destinations (origin, updated_at) \
         SELECT origin, now() - interval '40 days' FROM outbox",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let d = Dispatcher::build(
        DispatchSettings::new("w"),
        db.pool.clone(),
        DispatchMetrics::new(&prometheus::Registry::new()).unwrap(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    // The dispatcher stops after it made sure the row exists and before it locks it; prune's
    // snapshot missed the new operation, so it deletes the row in that gap.
    fail::cfg("outbox::destination_before_lock", "1*return(1500)").unwrap();
    let dispatching = tokio::spawn(async move { d.dispatch_once().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deleted = sqlx::query("DELETE FROM outbox_destinations")
        .execute(&db.pool)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(
        deleted, 1,
        "the row was deleted while the dispatcher waited"
    );
    let leased = dispatching.await.unwrap();
    fail::remove("outbox::destination_before_lock");
    assert_eq!(leased.unwrap(), 1, "the lease went on with a fresh row");
    assert_eq!(downstream.applied().get(&op), Some(&1));
    assert_eq!(
        db.count("SELECT count(*) FROM outbox_destinations").await,
        1
    );
}

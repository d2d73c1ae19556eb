//! `dispatch --kafka-transactions`: each batch in a Kafka transaction of the partition's own
//! producer, fenced by every new owner before it reads back.
//!
//! librdkafka's mock cluster is the only broker here with transactions (nisshi has none), and
//! it keeps only part of Kafka's protocol: it writes no abort markers, and it gives every new
//! producer of a transactional id a new producer id instead of bumping the epoch of the one
//! before, so it fences nothing across processes. On it, the tests show what it can: batches
//! committed in transactions, and a commit whose database update was lost, read back. The
//! fencing of a frozen relay runs against a broker with transactions named by
//! `REPLAYPROOF_TRANSACTIONAL_BROKERS` (Apache Kafka, Redpanda), with `--ignored`.

use super::*;

/// A relay process with transactions.
fn transactional(
    db: &TestDb,
    brokers: &str,
    worker: &str,
    failpoints: Option<&str>,
) -> ConsumerProcess {
    relay_with(db, brokers, worker, failpoints, &["--kafka-transactions"])
}

async fn confirmed_by(db: &TestDb, how: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM output_records WHERE confirmed_by = '{how}'");
    db.count(&sql).await
}

/// A relay frozen past its lease between marking a batch in doubt and handing it to the
/// producer, then woken after another relay took the partition over and sent everything: its
/// producer was fenced by the new owner, so nothing of its batch lands. (Without transactions
/// this batch would land a second time: docs/kafka-output.md, "What breaks it".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a broker that fences transactional producers: REPLAYPROOF_TRANSACTIONAL_BROKERS"]
async fn with_transactions_a_relay_frozen_past_its_lease_is_fenced_and_each_record_lands_once() {
    let _heavy = heavy().await;
    let brokers = std::env::var("REPLAYPROOF_TRANSACTIONAL_BROKERS")
        .expect("REPLAYPROOF_TRANSACTIONAL_BROKERS names a broker with transactions");
    let (kafka, db) = (TestKafka::External(brokers.clone()), TestDb::new().await);
    let topic = kafka.topic(1).await;
    claim(&db, kafka_effect(&topic), 0..100).await;
    // Frozen 6 s (the lease is 3 s) before its first batch; it ends when that batch's
    // outcome is known.
    let frozen = transactional(
        &db,
        &brokers,
        "frozen",
        Some("relay::before_produce=1*return(6000);relay::after_ack=return"),
    );
    wait_for("the frozen relay's batch in doubt", WAIT, || async {
        db.count("SELECT count(*) FROM output_partitions WHERE in_doubt AND owner = 'frozen'")
            .await
            == 1
    })
    .await;
    let next = transactional(&db, &brokers, "next", None);
    wait_all_sent(&db, 100).await;
    assert!(
        !frozen.exited(WAIT).await.success(),
        "the frozen relay woke, tried its batch and ended at the failpoint"
    );
    assert_each_once(&read_topic(&brokers, &topic, 1), 100, 1);
    assert_eq!(
        confirmed_by(&db, "transaction").await,
        100,
        "every record sent by the new owner's committed transactions"
    );
    next.terminate(WAIT).await;
}

/// Killed after the broker committed a batch's transaction, before the database update: the
/// next owner fences the partition's producer, reads it back (committed records only), marks
/// what it finds sent and sends only the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_transactions_a_relay_killed_after_the_commit_is_read_back_and_sends_the_rest_once() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let topic = kafka.topic(2).await;
    let brokers = kafka.brokers();
    claim(&db, kafka_effect(&topic), 0..200).await;
    let first = transactional(&db, &brokers, "first", Some("relay::after_commit=1*return"));
    assert!(!first.exited(WAIT).await.success());
    assert!(
        db.count("SELECT count(*) FROM output_partitions WHERE in_doubt")
            .await
            >= 1,
        "the relay died with a committed batch in doubt"
    );
    let second = transactional(&db, &brokers, "second", None);
    wait_all_sent(&db, 200).await;
    assert!(
        confirmed_by(&db, "read-back").await >= 1,
        "the committed batch was found by the read-back"
    );
    assert_eq!(
        confirmed_by(&db, "read-back").await + confirmed_by(&db, "transaction").await,
        200
    );
    assert_each_once(&read_topic(&brokers, &topic, 2), 200, 2);
    second.terminate(WAIT).await;
}

/// The relay refuses a `transactional.id` of the user's at start, since with transactions it
/// gives each output partition its own.
#[test]
fn a_transactional_id_option_is_refused_for_the_relay() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args([
            "dispatch",
            "--brokers",
            "127.0.0.1:9",
            "--kafka-transactions",
        ])
        .args(["--database-url", "postgres://nobody@127.0.0.1:9/none"])
        .args(["--kafka-option", "transactional.id=mine"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("--kafka-option transactional.id is refused for the relay"),
        "{text}"
    );
}

/// `--kafka-transactions` against a broker without transactions (nisshi): the relay ends the
/// process at once, saying why and what to do, instead of retrying for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_transactions_a_broker_without_them_ends_dispatch_with_the_reason() {
    let _heavy = heavy().await;
    let TestKafka::External(brokers) = TestKafka::for_processes() else {
        panic!("needs a broker process without transactions (KAFKA_BROKERS, nisshi)")
    };
    let (kafka, db) = (TestKafka::External(brokers.clone()), TestDb::new().await);
    let topic = kafka.topic(1).await;
    claim(&db, kafka_effect(&topic), 0..5).await;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args(["dispatch", "--database-url", &db.url, "--brokers", &brokers])
        .args(["--kafka-transactions", "--metrics-addr", "127.0.0.1:0"])
        .args(["--relay-lease", "3s", "--relay-send-timeout", "1s"])
        .env_remove("FAILPOINTS")
        .kill_on_drop(true);
    for (k, v) in test_kafka_options() {
        cmd.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    let out = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("dispatch ends by itself")
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("--kafka-transactions: the broker refused to initialise the transactions"),
        "{text}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM output_records WHERE state = 'pending'")
            .await,
        5,
        "nothing sent"
    );
}

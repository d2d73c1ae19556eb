//! `events erase` through the binary: every place a data subject's value is kept is searched
//! and erased, and an erasure that could not search everything does not say it succeeded.

use crate::harness::dispatcher::Downstream;
use crate::harness::operator::{message, process};
use crate::harness::TestDb;
use replayproof::effect::{HttpOutbox, Ledger};
use serde_json::json;
use std::sync::Arc;

/// `replayproof events erase ARGS --database-url DB`: (success, everything it printed).
fn erase(db: &TestDb, args: &[&str]) -> (bool, String) {
    let out = crate::harness::replayproof()
        .args(["events", "erase", "--reason", "erasure request 7"])
        .args(args)
        .args(["--database-url", &db.url])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

async fn dead_letter(db: &TestDb, offset: i64, key: &str, value: &[u8]) {
    sqlx::query(
        "INSERT INTO dead_letters (kafka_topic, kafka_partition, kafka_offset, raw_key, \
         raw_value, reason) VALUES ('webhooks', 0, $1, $2, $3, 'not an envelope')",
    )
    .bind(offset)
    .bind(key.as_bytes())
    .bind(value)
    .execute(&db.pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_by_field_reaches_operation_bodies_answers_excerpts_and_dead_letters() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    let http = HttpOutbox {
        target_url: downstream.url(),
        reconcile_url: None,
        max_attempts: 3,
        operation_keys: Default::default(),
    };
    let subject = json!({"data": {"object": {"customer": "cus_subject_9"}}});
    let other = json!({"data": {"object": {"customer": "cus_other_1"}}});
    let messages = [
        message(0, "evt-a", subject.clone()),
        message(1, "evt-b", other),
    ];
    process(&db, Arc::new(http), &messages).await;
    // Settled, with what the downstream answered kept.
    sqlx::query(
        "UPDATE outbox SET state = 'done', completed_at = now(), \
         last_response = 'ok for cus_subject_9'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox_attempts (outbox_id, fencing_token, worker, kind, idempotency_key, \
         payload_sha256, started_at, duration_ms, outcome, applied, response_excerpt, route_key) \
         SELECT id, 1, 'w', 'deliver', operation_key, sha256(payload), now(), 1, 'done', true, \
         'customer cus_subject_9', route_key FROM outbox",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Two dead letters carry the value: an envelope of the source, and bytes that are none.
    let envelope = crate::harness::envelope("evt-dl", subject);
    dead_letter(&db, 10, "evt-dl", &envelope).await;
    dead_letter(&db, 11, "junk", b"\xff garbage cus_subject_9 \xfe").await;
    dead_letter(&db, 12, "other", b"\xff unrelated \xfe").await;

    let (ok, said) = erase(
        &db,
        &[
            "--source",
            "test",
            "--match",
            "data.object.customer=cus_subject_9",
        ],
    );
    assert!(ok, "{said}");
    assert!(said.contains("evt-a: payloads erased"), "{said}");
    assert!(!said.contains("evt-b"), "{said}");
    let kept: (Vec<u8>, Option<String>) =
        sqlx::query_as("SELECT payload, last_response FROM outbox WHERE event_key = 'evt-a'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(kept, (Vec::new(), None));
    let excerpts: Vec<Option<String>> = sqlx::query_scalar(
        "SELECT a.response_excerpt FROM outbox_attempts a JOIN outbox o ON o.id = a.outbox_id \
         ORDER BY o.event_key",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(excerpts, [None, Some("customer cus_subject_9".into())]);
    let letters: Vec<(i64, Option<Vec<u8>>)> =
        sqlx::query_as("SELECT kafka_offset, raw_value FROM dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(letters[0], (10, None));
    assert_eq!(letters[1], (11, None));
    assert!(
        letters[2].1.is_some(),
        "a dead letter without the value stays"
    );
    // An erased dead letter is never replayed.
    let id: i64 = sqlx::query_scalar("SELECT id FROM dead_letters WHERE kafka_offset = 10")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let out = crate::harness::replayproof()
        .args([
            "dead-letters",
            "replay",
            &id.to_string(),
            "--reason",
            "again",
        ])
        .args(["--brokers", "127.0.0.1:1", "--database-url", &db.url])
        .output()
        .unwrap();
    let replay_said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        replay_said.contains("its bytes were erased"),
        "{replay_said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_that_could_not_search_every_settled_event_does_not_say_it_succeeded() {
    let db = TestDb::new().await;
    let messages = [message(0, "evt-old", json!({"customer": "cus_x"}))];
    process(&db, Arc::new(Ledger), &messages).await;
    // Its payload went with the payload retention: nothing is left to search.
    sqlx::query("UPDATE ledger SET payload = 'null'::jsonb, payload_erased_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    let (ok, said) = erase(&db, &["--source", "test", "--match", "customer=cus_x"]);
    assert!(!ok, "{said}");
    assert!(
        said.contains("not searched: 1 settled event(s) of test"),
        "{said}"
    );
    // By key it is erased, and then nothing is left unsearched.
    let (ok, said) = erase(&db, &["--key", "evt-old"]);
    assert!(ok, "{said}");
    let (ok, said) = erase(&db, &["--source", "test", "--match", "customer=cus_x"]);
    assert!(ok, "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasure_by_key_takes_its_dead_letters_too() {
    let db = TestDb::new().await;
    dead_letter(&db, 3, "evt-bad", b"{not json cus_1").await;
    let (ok, said) = erase(&db, &["--key", "evt-bad"]);
    assert!(ok, "{said}");
    assert!(said.contains("bytes erased"), "{said}");
    let value: Option<Vec<u8>> = sqlx::query_scalar("SELECT raw_value FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(value, None);
    assert_eq!(
        db.count("SELECT count(*) FROM operator_actions WHERE target LIKE 'dead_letter:%'")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erased_dead_letter_stays_erased_when_its_message_is_delivered_again() {
    let db = TestDb::new().await;
    let poison = replayproof::consume::RawMessage {
        offset: 5,
        key: Some(b"junk-key".to_vec()),
        value: Some(b"not an envelope, cus_subject_9".to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    process(&db, Arc::new(Ledger), std::slice::from_ref(&poison)).await;
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 1);
    let (ok, said) = erase(&db, &["--key", "junk-key"]);
    assert!(ok, "{said}");
    // The same message again (a restart before the offset commit, a replay by time).
    process(&db, Arc::new(Ledger), &[poison]).await;
    let kept: Vec<Option<Vec<u8>>> = sqlx::query_scalar("SELECT raw_value FROM dead_letters")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(kept, [None], "still the one erased letter");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_erased_on_the_first_database_whatever_shard_is_named() {
    let (first, second) = (TestDb::new().await, TestDb::new().await);
    dead_letter(&first, 4, "evt-gone", b"raw cus_subject_9 bytes").await;
    let out = crate::harness::replayproof()
        .args([
            "events",
            "erase",
            "--key",
            "evt-gone",
            "--reason",
            "request 9",
        ])
        .args(["--database-url", &first.url, "--database-url", &second.url])
        .args(["--shard", "1"])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    let value: Option<Vec<u8>> = sqlx::query_scalar("SELECT raw_value FROM dead_letters")
        .fetch_one(&first.pool)
        .await
        .unwrap();
    assert_eq!(value, None, "{said}");
}

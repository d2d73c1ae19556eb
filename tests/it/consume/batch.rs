//! The batch transaction against a real PostgreSQL, without Kafka: claims, replays, conflicts,
//! dead letters and failing effects.

use crate::harness::{envelope, TestDb};
use async_trait::async_trait;
use replayproof::consume::{BatchError, BatchProcessor, EffectRetry, RawMessage};
use replayproof::effect::{Effect, EffectError, Ledger, Tx};
use replayproof::envelope::Event;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

fn message(offset: i64, key: &str, payload: serde_json::Value) -> RawMessage {
    RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(envelope(key, payload)),
        traceparent: None,
        headers: Default::default(),
    }
}

fn processor(db: &TestDb, effect: Arc<dyn Effect>) -> BatchProcessor {
    processor_on(db.pool.clone(), effect)
}

/// A processor writing through `pool`, with quick retries.
fn processor_on(pool: replayproof::db::Db, effect: Arc<dyn Effect>) -> BatchProcessor {
    BatchProcessor::new(pool, effect).with_retry(EffectRetry {
        attempts: 3,
        backoff: Duration::from_millis(5),
    })
}

#[tokio::test]
async fn two_copies_of_one_key_in_a_batch_have_one_effect() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let batch = [
        message(0, "k1", json!({"n": 1})),
        message(1, "k1", json!({"n": 1})),
    ];
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((report.applied, report.duplicates), (1, 1));
    assert_eq!(db.ledger_counts().await["k1"], 1);
}

#[tokio::test]
async fn replayed_batch_has_no_second_effect() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let batch = [message(0, "a", json!(1)), message(1, "b", json!(2))];
    p.process("t", 0, &batch).await.unwrap();
    let replay = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((replay.applied, replay.duplicates), (0, 2));
    let counts = db.ledger_counts().await;
    assert_eq!((counts["a"], counts["b"]), (1, 1));
    let done = db.count("SELECT count(*) FROM processed_events WHERE status = 'done' AND completed_at IS NOT NULL").await;
    assert_eq!(done, 2);
}

#[tokio::test]
async fn same_key_with_another_payload_is_recorded_as_a_conflict() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    p.process("t", 0, &[message(0, "k", json!({"v": 1}))])
        .await
        .unwrap();
    let report = p
        .process(
            "t",
            0,
            &[
                message(1, "k", json!({"v": 2})),
                message(2, "k", json!({"v": 2})),
            ],
        )
        .await
        .unwrap();
    assert_eq!(report.conflicts, 2);
    // The first payload is kept; the second is findable, once, with how often it was seen.
    let kept: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM ledger WHERE event_key = 'k'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(kept, json!({"v": 1}));
    let (payload, seen): (serde_json::Value, i64) =
        sqlx::query_as("SELECT payload, times_seen FROM key_conflicts WHERE event_key = 'k'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((payload, seen), (json!({"v": 2}), 1));
    // A re-serialised copy of the first payload is a replay, not a conflict.
    let same = RawMessage {
        offset: 3,
        key: Some(b"k".to_vec()),
        value: Some(br#"{"payload": {"v" : 1}, "source": "test", "key": "k"}"#.to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    let report = p.process("t", 0, &[same]).await.unwrap();
    assert_eq!((report.duplicates, report.conflicts), (1, 0));
}

#[tokio::test]
async fn malformed_messages_become_dead_letters_with_their_bytes() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let too_long = "x".repeat(513);
    let batch = [
        message(0, "good-1", json!(1)),
        RawMessage {
            offset: 1,
            key: Some(b"junk".to_vec()),
            value: Some(b"\xffnot json".to_vec()),
            traceparent: None,
            headers: Default::default(),
        },
        RawMessage {
            offset: 2,
            key: None,
            value: Some(br#"{"source":"s","payload":1}"#.to_vec()),
            traceparent: None,
            headers: Default::default(),
        },
        RawMessage {
            offset: 3,
            key: None,
            value: Some(format!(r#"{{"key":"{too_long}","source":"s","payload":1}}"#).into_bytes()),
            traceparent: None,
            headers: Default::default(),
        },
        RawMessage {
            offset: 4,
            key: None,
            value: Some(br#"{"key":"k","source":"s"}"#.to_vec()),
            traceparent: None,
            headers: Default::default(),
        },
        RawMessage {
            offset: 5,
            key: None,
            value: None,
            traceparent: None,
            headers: Default::default(),
        },
        message(6, "good-2", json!(2)),
    ];
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((report.applied, report.dead_letters.len()), (2, 5));
    let raw: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT raw_value FROM dead_letters WHERE kafka_offset = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(raw.as_deref(), Some(&b"\xffnot json"[..]));
    let reason: String =
        sqlx::query_scalar("SELECT reason FROM dead_letters WHERE kafka_offset = 3")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(reason.contains("513 bytes"), "{reason}");
    // Replaying the batch stores no second dead letter.
    p.process("t", 0, &batch).await.unwrap();
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 5);
}

/// Fails for one key, always; applies the ledger effect for every other key.
pub struct FailsFor(pub &'static str);

#[async_trait]
impl Effect for FailsFor {
    fn name(&self) -> &'static str {
        "fails-for"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        Ledger.apply(tx, event).await?;
        if event.key.as_str() == self.0 {
            // A constraint violation after a write: the write must roll back with the claim.
            sqlx::query("INSERT INTO ledger (event_key, source, payload) VALUES (NULL, 's', '1')")
                .execute(&mut **tx)
                .await?;
        }
        Ok(())
    }
}

#[tokio::test]
async fn failing_effect_rolls_back_only_its_own_event() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(FailsFor("bad")));
    let batch = [
        message(0, "a", json!(1)),
        message(1, "bad", json!(2)),
        message(2, "c", json!(3)),
    ];
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!(
        (report.applied, report.failed, report.effect_errors),
        (2, 1, 3)
    );
    let counts = db.ledger_counts().await;
    assert_eq!(
        (counts.get("a"), counts.get("bad"), counts.get("c")),
        (Some(&1), None, Some(&1))
    );
    let (status, attempts, error): (String, i32, String) = sqlx::query_as(
        "SELECT status, attempts, last_error FROM processed_events WHERE event_key = 'bad'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("failed", 3));
    assert!(error.contains("null value"), "{error}");
    // The payload stays with the failed claim, for a retry.
    let payload: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM processed_events WHERE event_key = 'bad'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(payload, json!(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_batches_with_overlapping_keys_have_one_effect_and_no_deadlock() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let keys: Vec<String> = (0..3000).map(|i| format!("key-{i:04}")).collect();
    for round in 0..3 {
        let forward: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| message(i as i64, &format!("{round}-{k}"), json!(1)))
            .collect();
        let backward: Vec<_> = forward.iter().rev().cloned().collect();
        let (pa, pb) = (p.clone(), p.clone());
        let a = tokio::spawn(async move { pa.process("t", 0, &forward).await });
        let b = tokio::spawn(async move { pb.process("t", 1, &backward).await });
        let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
        assert_eq!(a.applied + b.applied, keys.len());
        assert_eq!(a.duplicates + b.duplicates, keys.len());
    }
    assert!(db.ledger_counts().await.values().all(|n| *n == 1));
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 9000);
    let deadlocks: i64 = db
        .count("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .await;
    assert_eq!(deadlocks, 0, "the claims deadlocked");
}

/// Every key's `deliveries`, by key.
async fn deliveries(db: &TestDb) -> std::collections::BTreeMap<String, i32> {
    sqlx::query_as("SELECT event_key, deliveries FROM claim_deliveries")
        .fetch_all(&db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// A batch of redeliveries probes the claims and writes none of them: one row of
/// `redeliveries` is all it writes, and each key counts its second delivery.
#[tokio::test]
async fn a_batch_of_redeliveries_writes_no_claim_and_records_one_row() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let keys: Vec<String> = (0..300).map(|i| format!("key-{i:03}")).collect();
    let at = |from: i64| -> Vec<RawMessage> {
        let each = keys.iter().enumerate();
        each.map(|(i, k)| message(from + i as i64, k, json!(1)))
            .collect()
    };
    p.process("t", 0, &at(0)).await.unwrap();
    let versions = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT string_agg(xmin::text || ctid::text, ',' ORDER BY event_key)
             FROM processed_events",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let before = versions().await;
    let report = p.process("t", 0, &at(1000)).await.unwrap();
    assert_eq!((report.duplicates, report.applied), (300, 0));
    assert_eq!(versions().await, before, "a redelivery wrote its claim");
    assert_eq!(db.count("SELECT count(*) FROM redeliveries").await, 1);
    assert!(deliveries(&db).await.values().all(|n| *n == 2));
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_delivery_of_a_claimed_key_is_counted_once_and_racing_counts_never_deadlock() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let keys: Vec<String> = (0..2000).map(|i| format!("key-{i:04}")).collect();
    let batch = |offset: i64, keys: &[String]| -> Vec<RawMessage> {
        let at = |i: usize| offset + i as i64;
        let each = keys.iter().enumerate();
        each.map(|(i, k)| message(at(i), k, json!(1))).collect()
    };
    let first = batch(0, &keys);
    p.process("t", 0, &first).await.unwrap();
    // The group restarted before committing: the same messages again are no new delivery.
    p.process("t", 0, &first).await.unwrap();
    assert!(deliveries(&db).await.values().all(|n| *n == 1));

    // Redelivered by the sender: later messages on the partition, one key twice in its batch.
    let mut again = batch(2000, &keys[..10]);
    again.push(message(2010, &keys[0], json!(1)));
    p.process("t", 0, &again).await.unwrap();
    p.process("t", 0, &again).await.unwrap();
    let counted = deliveries(&db).await;
    assert_eq!(counted[&keys[0]], 3);
    assert!(keys[1..10].iter().all(|k| counted[k] == 2), "{counted:?}");
    assert!(keys[10..].iter().all(|k| counted[k] == 1));

    // Two batches of the same duplicates, in opposite orders, at once.
    let forward = batch(0, &keys);
    let backward: Vec<_> = batch(0, &keys).into_iter().rev().collect();
    let (pa, pb) = (p.clone(), p.clone());
    let a = tokio::spawn(async move { pa.process("t", 1, &forward).await });
    let b = tokio::spawn(async move { pb.process("t", 2, &backward).await });
    let (a, b) = (a.await.unwrap().unwrap(), b.await.unwrap().unwrap());
    assert_eq!((a.duplicates, b.duplicates), (keys.len(), keys.len()));
    let counted = deliveries(&db).await;
    assert_eq!(counted[&keys[0]], 5);
    assert!(keys[10..].iter().all(|k| counted[k] == 3), "{counted:?}");
    let deadlocks: i64 = db
        .count("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        .await;
    assert_eq!(deadlocks, 0, "counting deliveries deadlocked");
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 2000);
}

/// The ledger effect, once a permit is given: holds its transaction open (its claims written,
/// not committed) until then.
struct Gate {
    entered: tokio::sync::Notify,
    permits: tokio::sync::Semaphore,
}

#[async_trait]
impl Effect for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        self.entered.notify_one();
        self.permits.acquire().await.unwrap().forget();
        Ledger.apply_batch(tx, events).await
    }
}

/// Each delivery of a claimed key is recorded once, wherever it is told apart: the claim
/// statement records those of the keys it found claimed (one `redeliveries` row), the batch
/// those of copies of a key within it and of keys a racing transaction claimed while this one
/// waited on them (one more row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_delivery_is_recorded_once_whether_found_copied_in_its_batch_or_raced() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    p.process("t", 0, &[message(0, "old", json!(1))])
        .await
        .unwrap();
    let batch: Vec<RawMessage> = [(1, "old"), (2, "old"), (3, "new"), (4, "new")]
        .into_iter()
        .map(|(offset, key)| message(offset, key, json!(1)))
        .collect();
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((report.applied, report.duplicates), (1, 3));
    let counted = deliveries(&db).await;
    assert_eq!((counted["old"], counted["new"]), (3, 2), "{counted:?}");
    let recorded = "SELECT coalesce(sum(cardinality(event_keys)), 0)::int8 FROM redeliveries";
    assert_eq!(db.count("SELECT count(*) FROM redeliveries").await, 2);
    assert_eq!(db.count(recorded).await, 3, "each delivery recorded once");

    let gate = Arc::new(Gate {
        entered: tokio::sync::Notify::new(),
        permits: tokio::sync::Semaphore::new(0),
    });
    let holder = processor(&db, gate.clone());
    let raced: Vec<RawMessage> = (0..10)
        .map(|i| message(i, &format!("race-{i}"), json!(1)))
        .collect();
    let (mine, theirs) = (raced.clone(), raced);
    let first = tokio::spawn(async move { holder.process("t", 1, &mine).await });
    gate.entered.notified().await;
    let second = tokio::spawn({
        let p = p.clone();
        async move { p.process("t", 2, &theirs).await }
    });
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    while db.count(waiting).await == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gate.permits.add_permits(1);
    let (a, b) = (
        first.await.unwrap().unwrap(),
        second.await.unwrap().unwrap(),
    );
    assert_eq!((a.applied, b.applied, b.duplicates), (10, 0, 10));
    let counted = deliveries(&db).await;
    assert!(
        (0..10).all(|i| counted[&format!("race-{i}")] == 2),
        "{counted:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM redeliveries").await, 3);
    assert_eq!(db.count(recorded).await, 13, "each delivery recorded once");
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 12);
}

#[tokio::test]
async fn database_error_is_an_error_not_a_duplicate() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    sqlx::query("ALTER TABLE ledger RENAME TO ledger_away")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("REVOKE ALL ON processed_events FROM PUBLIC")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("DROP TABLE processed_events CASCADE")
        .execute(&db.pool)
        .await
        .unwrap();
    let result = p.process("t", 0, &[message(0, "k", json!(1))]).await;
    assert!(
        result.is_err(),
        "a missing claims table must fail the batch, got {result:?}"
    );
}

#[tokio::test]
async fn messages_postgresql_refuses_become_dead_letters_and_the_rest_commits() {
    let db = TestDb::new().await;
    // A refusal the envelope's own checks cannot know about: PostgreSQL's word is final.
    sqlx::query(
        "ALTER TABLE processed_events ADD CONSTRAINT refuse_poison \
         CHECK (event_key NOT LIKE 'poison%')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let p = processor(&db, Arc::new(Ledger));
    let batch: Vec<RawMessage> = (0..40)
        .map(|i| match i {
            7 => message(i, "poison-7", json!(i)),
            19 => message(i, "nul-19", json!({"note": "a\u{0}b"})),
            31 => message(i, "poison-31", json!(i)),
            _ => message(i, &format!("good-{i}"), json!(i)),
        })
        .collect();
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((report.applied, report.dead_letters.len()), (37, 3));
    let counts = db.ledger_counts().await;
    assert_eq!(counts.len(), 37);
    assert!(counts.values().all(|n| *n == 1));
    let reasons: Vec<(i64, String)> =
        sqlx::query_as("SELECT kafka_offset, reason FROM dead_letters ORDER BY kafka_offset")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        reasons.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
        [7, 19, 31]
    );
    assert!(reasons[0].1.contains("refuse_poison"), "{reasons:?}");
    assert!(reasons[0].1.contains("SQLSTATE 23514"), "{reasons:?}");
    assert!(reasons[1].1.contains("NUL"), "{reasons:?}");
    // The raw bytes are kept, and a replay of the batch changes nothing.
    let raw: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT raw_value FROM dead_letters WHERE kafka_offset = 31")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(raw, batch[31].value);
    let replay = p.process("t", 0, &batch).await.unwrap();
    assert_eq!(replay.applied, 0);
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 3);
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 37);
}

/// Writes each event to a table of its own, which a test may drop, lock or leave missing.
struct WritesTo(&'static str);

#[async_trait]
impl Effect for WritesTo {
    fn name(&self) -> &'static str {
        "writes-to"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        sqlx::query("SET LOCAL lock_timeout = '200ms'")
            .execute(&mut **tx)
            .await?;
        sqlx::query(&format!("INSERT INTO {} (event_key) VALUES ($1)", self.0))
            .bind(event.key.as_str())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

async fn claims_by_status(db: &TestDb) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT status, count(*) FROM processed_events GROUP BY status ORDER BY 1")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn missing_table_or_lock_timeout_in_an_effect_settles_nothing_and_retries() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(WritesTo("effect_rows")));
    let batch = [message(0, "a", json!(1)), message(1, "b", json!(2))];

    // A bad deploy: the effect's table is missing. Nothing may settle as failed.
    let result = p.process("t", 0, &batch).await;
    assert!(
        matches!(result, Err(BatchError::Transient(_))),
        "{result:?}"
    );
    assert_eq!(claims_by_status(&db).await, []);

    // A lock held elsewhere: the effect's lock timeout is transient too.
    sqlx::query("CREATE TABLE effect_rows (event_key text NOT NULL)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE effect_rows IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let result = p.process("t", 0, &batch).await;
    assert!(
        matches!(result, Err(BatchError::Transient(_))),
        "{result:?}"
    );
    assert_eq!(claims_by_status(&db).await, []);
    holder.rollback().await.unwrap();

    // Repaired: the same batch applies, once each.
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((report.applied, report.failed), (2, 0));
    assert_eq!(claims_by_status(&db).await, [("done".to_owned(), 2)]);
    assert_eq!(db.count("SELECT count(*) FROM effect_rows").await, 2);
}

#[tokio::test]
async fn read_only_database_fails_the_batch_and_settles_nothing() {
    let db = TestDb::new().await;
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    // A connection opened before the switch stays writable, to switch back.
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    sqlx::query(&format!(
        "ALTER DATABASE {name} SET default_transaction_read_only = on"
    ))
    .execute(&mut admin)
    .await
    .unwrap();
    let read_only = replayproof::db::Db::from(sqlx::PgPool::connect(&db.url).await.unwrap());
    let p = processor_on(read_only, Arc::new(Ledger));
    let batch = [message(0, "a", json!(1))];
    let result = p.process("t", 0, &batch).await;
    assert!(matches!(result, Err(BatchError::Database(_))), "{result:?}");
    let settled: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM processed_events) + (SELECT count(*) FROM dead_letters)",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(settled, 0, "nothing settles and nothing is dead-lettered");

    sqlx::query(&format!(
        "ALTER DATABASE {name} RESET default_transaction_read_only"
    ))
    .execute(&mut admin)
    .await
    .unwrap();
    let writable = processor_on(
        replayproof::db::Db::from(sqlx::PgPool::connect(&db.url).await.unwrap()),
        Arc::new(Ledger),
    );
    assert_eq!(writable.process("t", 0, &batch).await.unwrap().applied, 1);
}

/// Refuses one key for good, declaring it permanent.
struct RefusesFor(&'static str);

#[async_trait]
impl Effect for RefusesFor {
    fn name(&self) -> &'static str {
        "refuses-for"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        if event.key.as_str() == self.0 {
            return Err(EffectError::permanent(anyhow::anyhow!(
                "the amount does not match the order"
            )));
        }
        Ledger.apply(tx, event).await
    }
}

#[tokio::test]
async fn permanent_effect_error_settles_failed_without_retries() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(RefusesFor("bad")));
    let batch = [message(0, "a", json!(1)), message(1, "bad", json!(2))];
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!(
        (report.applied, report.failed, report.effect_errors),
        (1, 1, 1)
    );
    let (attempts, error): (i32, String) = sqlx::query_as(
        "SELECT attempts, last_error FROM processed_events WHERE event_key = 'bad' AND status = 'failed'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 1);
    assert!(error.contains("does not match"), "{error}");
}

#[tokio::test]
async fn a_new_bad_message_at_a_reused_offset_is_a_second_dead_letter() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let bad = |value: &[u8]| RawMessage {
        offset: 5,
        key: Some(b"k".to_vec()),
        value: Some(value.to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    p.process("t", 0, &[bad(b"first")]).await.unwrap();
    p.process("t", 0, &[bad(b"first")]).await.unwrap();
    // The topic was recreated: offset 5 now holds another message.
    p.process("t", 0, &[bad(b"second")]).await.unwrap();
    let values: Vec<Vec<u8>> = sqlx::query_scalar("SELECT raw_value FROM dead_letters ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(values, [b"first".to_vec(), b"second".to_vec()]);
}

#[tokio::test]
async fn numbers_reach_the_effect_and_the_database_byte_for_byte() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let raw = br#"{"key":"big","source":"stripe","payload":{"amount":123456789012345678901234567890,"rate":0.1000000000000000055511151231257827}}"#;
    let m = RawMessage {
        offset: 0,
        key: Some(b"big".to_vec()),
        value: Some(raw.to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    assert_eq!(p.process("t", 0, &[m]).await.unwrap().applied, 1);
    let (amount, rate): (String, String) = sqlx::query_as(
        "SELECT payload->>'amount', payload->>'rate' FROM ledger WHERE event_key = 'big'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(amount, "123456789012345678901234567890");
    assert_eq!(rate, "0.1000000000000000055511151231257827");
}

/// Takes five seconds per event.
struct Slow;

#[async_trait]
impl Effect for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        sqlx::query("SELECT pg_sleep(5)").execute(&mut **tx).await?;
        Ledger.apply(tx, event).await
    }
}

#[tokio::test]
async fn a_slow_effect_is_ended_by_the_statement_timeout_and_settles_nothing() {
    let db = TestDb::new().await;
    let limits = replayproof::db::Limits {
        statement_timeout: Duration::from_millis(300),
        ..replayproof::db::Limits::default()
    };
    let pool = replayproof::db::pool_with(&db.url.parse().unwrap(), 2, limits).unwrap();
    let p = processor_on(pool, Arc::new(Slow));
    let started = std::time::Instant::now();
    let result = p.process("t", 0, &[message(0, "slow", json!(1))]).await;
    assert!(
        matches!(result, Err(BatchError::Transient(_))),
        "{result:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "ended by the timeout, not by the sleep: {:?}",
        started.elapsed()
    );
    assert_eq!(claims_by_status(&db).await, []);
}

/// The ledger effect over whole batches, failing any batch that holds the poisoned key (as one
/// statement over the batch would), and counting its calls.
struct PoisonedBatch {
    poisoned: String,
    calls: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Effect for PoisonedBatch {
    fn name(&self) -> &'static str {
        "poisoned-batch"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ledger.apply_batch(tx, events).await?;
        if events.iter().any(|e| e.key.as_str() == self.poisoned) {
            let refused = anyhow::anyhow!("the downstream table refuses {}", self.poisoned);
            return Err(refused.into());
        }
        Ok(())
    }
}

#[tokio::test]
async fn one_poisoned_effect_among_500_fails_alone_and_nothing_waits_inside_a_transaction() {
    let db = TestDb::new().await;
    // A session idle inside a transaction for 300 ms is ended by PostgreSQL, while the effect's
    // retries wait a second between attempts: a wait inside a transaction fails the batch.
    let limits = replayproof::db::Limits {
        idle_in_transaction_timeout: Duration::from_millis(300),
        ..replayproof::db::Limits::default()
    };
    let pool = replayproof::db::pool_with(&db.url.parse().unwrap(), 2, limits).unwrap();
    let effect = Arc::new(PoisonedBatch {
        poisoned: "k-0321".into(),
        calls: Default::default(),
    });
    let p = BatchProcessor::new(pool, effect.clone()).with_retry(EffectRetry {
        attempts: 3,
        backoff: Duration::from_secs(1),
    });
    let batch: Vec<RawMessage> = (0..500)
        .map(|i| message(i, &format!("k-{i:04}"), json!({ "n": i })))
        .collect();

    let report = p.process("t", 0, &batch).await.unwrap();

    assert_eq!(
        (report.applied, report.failed, report.effect_errors),
        (499, 1, 3)
    );
    let counts = db.ledger_counts().await;
    assert_eq!(counts.len(), 499);
    assert!(counts.values().all(|n| *n == 1), "an event applied twice");
    assert!(!counts.contains_key("k-0321"));
    let (status, attempts, payload): (String, i32, serde_json::Value) = sqlx::query_as(
        "SELECT status, attempts, payload FROM processed_events WHERE event_key = 'k-0321'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((status.as_str(), attempts), ("failed", 3));
    assert_eq!(payload, json!({ "n": 321 }));
    // Found by halving: one call for the batch without a savepoint, then one for each of its
    // four parts of at most 128 with one, at most two per level of the search through the part
    // that failed (128 → 1 in 7 levels) and one for the last event, one for each later attempt;
    // never one call per event.
    let calls = effect.calls.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        calls <= 1 + 4 + 2 * 7 + 1 + 2,
        "{calls} calls to apply_batch"
    );
    // Settled claims were written once, with their final status and without their payload.
    let done_without_payload = db
        .count("SELECT count(*) FROM processed_events WHERE status = 'done' AND payload IS NULL AND attempts = 1")
        .await;
    assert_eq!(done_without_payload, 499);
}

#[tokio::test]
async fn a_key_no_header_can_carry_is_dead_lettered_and_the_batch_goes_on() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let crlf = "evt-1\r\nX-Injected: 1";
    // Written by another producer: an `Envelope` cannot hold such a key.
    let foreign = RawMessage {
        offset: 1,
        key: Some(crlf.as_bytes().to_vec()),
        value: Some(
            json!({"key": crlf, "source": "test", "payload": 2})
                .to_string()
                .into_bytes(),
        ),
        traceparent: None,
        headers: Default::default(),
    };
    let batch = [
        message(0, "before", json!(1)),
        foreign,
        message(2, "after", json!(3)),
    ];
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!(report.applied, 2);
    assert_eq!(report.dead_letters.len(), 1);
    assert!(
        report.dead_letters[0].reason.contains("control character"),
        "{report:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 2);
}

#[tokio::test]
async fn a_payload_nested_deeper_than_any_document_is_dead_lettered_without_a_crash() {
    let db = TestDb::new().await;
    let p = processor(&db, Arc::new(Ledger));
    let deep = format!(
        r#"{{"key":"deep","source":"s","payload":{}1{}}}"#,
        "{\"a\":".repeat(200_000),
        "}".repeat(200_000)
    );
    let batch = [
        message(0, "before", json!(1)),
        RawMessage {
            offset: 1,
            key: Some(b"deep".to_vec()),
            value: Some(deep.into_bytes()),
            traceparent: None,
            headers: Default::default(),
        },
        message(2, "after", json!(3)),
    ];
    let report = p.process("t", 0, &batch).await.unwrap();
    assert_eq!((report.applied, report.dead_letters.len()), (2, 1));
    assert!(
        report.dead_letters[0].reason.contains("levels deep"),
        "{report:?}"
    );
}

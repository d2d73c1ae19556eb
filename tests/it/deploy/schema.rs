//! replayproof's tables live in their own PostgreSQL schema: a host application's `outbox` and
//! `_sqlx_migrations` in `public` are never touched, an installation made in `public` keeps
//! working with `--schema public`, and the documented move to the schema (docs/operations.md) keeps every claim.

use crate::harness::*;
use serde_json::json;
use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

/// `replayproof migrate` on `url`, with more arguments such as `--schema public`.
fn migrate(url: &str, extra: &[&str]) {
    stdout_of(
        Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(["migrate", "--database-url", url])
            .args(extra),
    );
}

/// The names of `table`'s columns, in order.
async fn columns(db: &TestDb, schema: &str, table: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns
         WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

async fn schema_exists(db: &TestDb, schema: &str) -> bool {
    let sql = "SELECT count(*) FROM pg_namespace WHERE nspname = $1";
    let n: i64 = sqlx::query_scalar(sql)
        .bind(schema)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    n == 1
}

/// Ledger rows per event key in `schema`.
async fn ledger_in(db: &TestDb, schema: &str) -> Vec<(String, i64)> {
    let sql = format!(
        "SELECT event_key, count(*) FROM {schema}.ledger GROUP BY event_key ORDER BY event_key"
    );
    sqlx::query_as(&sql).fetch_all(&db.pool).await.unwrap()
}

/// A consumer process on `topic` (one partition) until `total` offsets are committed.
async fn consume_until(
    kafka: &TestKafka,
    (topic, group): (&str, &str),
    db: &TestDb,
    extra: &[&str],
    total: i64,
) {
    let consumer =
        ConsumerProcess::spawn_with(&kafka.brokers(), topic, group, &db.url, None, extra);
    wait_committed_total(kafka, group, topic, 1, total).await;
    let status = consumer.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
}

async fn produce_keys(kafka: &TestKafka, topic: &str, keys: &[&str]) {
    let records: Vec<Record> = keys
        .iter()
        .map(|k| Record::event(k, json!({"k": k})))
        .collect();
    produce(&producer(&kafka.brokers()), topic, &records).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_outbox_and_migrations_in_public_are_left_alone() {
    let db = TestDb::unmigrated().await;
    sqlx::raw_sql(
        "CREATE TABLE public.outbox (id bigserial PRIMARY KEY, body text NOT NULL);
         INSERT INTO public.outbox (body) VALUES ('the host''s own message');
         CREATE TABLE public._sqlx_migrations (
             version BIGINT PRIMARY KEY, description TEXT NOT NULL,
             installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL,
             checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL);
         INSERT INTO public._sqlx_migrations (version, description, success, checksum,
             execution_time) VALUES (1, 'the host''s first migration', true, '\\x00', 1);",
    )
    .execute(&db.pool)
    .await
    .unwrap();

    migrate(&db.url, &[]);
    assert_eq!(columns(&db, "public", "outbox").await, ["id", "body"]);
    assert!(columns(&db, "replayproof", "outbox")
        .await
        .contains(&"operation_key".to_owned()));
    let host_versions: Vec<i64> = sqlx::query_scalar("SELECT version FROM public._sqlx_migrations")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(host_versions, [1], "the host's bookkeeping is untouched");
    let ours = db
        .count("SELECT count(*) FROM replayproof._sqlx_migrations WHERE success")
        .await;
    assert_eq!(ours as usize, replayproof::db::MIGRATOR.iter().count());

    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    produce_keys(&kafka, &topic, &["evt-h"]).await;
    let http = ["--effect", "http", "--target-url", "http://127.0.0.1:9/ops"];
    consume_until(&kafka, (&topic, &group), &db, &http, 1).await;
    let ours = "SELECT count(*) FROM replayproof.outbox WHERE operation_key = 'evt-h#deliver'";
    assert_eq!(
        db.count(ours).await,
        1,
        "the operation is in replayproof's outbox"
    );
    let host: Vec<String> = sqlx::query_scalar("SELECT body FROM public.outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        host,
        ["the host's own message"],
        "the host's outbox is untouched"
    );
}

/// The SQL in docs/operations.md that moves an installation from `public` into the schema.
fn documented_move_sql() -> String {
    let operations = include_str!("../../../docs/operations.md");
    let start = operations
        .find("```sql\nBEGIN;\nCREATE SCHEMA replayproof;")
        .expect("docs/operations.md shows the move to the schema");
    let block = &operations[start + "```sql\n".len()..];
    block[..block.find("```").expect("the block ends")].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_move_to_a_schema_keeps_every_claim() {
    let db = TestDb::unmigrated().await;
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("group"));

    // An installation made before schemas were configurable: everything in public.
    migrate(&db.url, &["--schema", "public"]);
    assert!(!schema_exists(&db, "replayproof").await);
    assert!(!columns(&db, "public", "processed_events").await.is_empty());
    produce_keys(&kafka, &topic, &["evt-1"]).await;
    let public = ["--schema", "public"];
    consume_until(&kafka, (&topic, &group), &db, &public, 1).await;
    assert_eq!(ledger_in(&db, "public").await, [("evt-1".to_owned(), 1)]);

    sqlx::raw_sql(&documented_move_sql())
        .execute(&db.pool)
        .await
        .expect("the documented move runs");
    assert!(columns(&db, "public", "processed_events").await.is_empty());
    migrate(&db.url, &[]); // nothing left to apply: the bookkeeping moved too

    // A redelivery of evt-1 after the move is a replay; evt-2 is new.
    produce_keys(&kafka, &topic, &["evt-1", "evt-2"]).await;
    let restart = unique("group");
    consume_until(&kafka, (&topic, &restart), &db, &[], 3).await;
    assert_eq!(
        ledger_in(&db, "replayproof").await,
        [("evt-1".to_owned(), 1), ("evt-2".to_owned(), 1)]
    );
    let claims: HashSet<String> =
        sqlx::query_scalar("SELECT event_key FROM replayproof.processed_events")
            .fetch_all(&db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(claims, HashSet::from(["evt-1".into(), "evt-2".into()]));
}

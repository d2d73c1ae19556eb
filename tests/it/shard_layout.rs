//! Which buckets each database holds, recorded in the database: a list of databases given in
//! another order, shortened or with another bucket count is refused by every command before it
//! claims anything, and a `shards move` cut off at any of its commits leaves no range usable on
//! both sides, carries every value and prune horizon as it was, and finishes when run again.
//! And one event key is one claim whatever route a delivery names.

use crate::harness::*;
use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::effect::{Effect, EffectError, Ledger, Tx};
use replayproof::envelope::{Envelope, Event};
use replayproof::shard::{Layout, Shards};
use std::sync::Arc;
use std::time::Duration;

/// Runs the binary with `args`, then `--database-url` for each of `dbs`, with no
/// `DATABASE_URL`; returns whether it succeeded and what it printed.
fn run(args: &[&str], dbs: &[&TestDb], failpoints: Option<&str>) -> (bool, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("FAILPOINTS")
        .env("RUST_LOG", "warn");
    for db in dbs {
        cmd.args(["--database-url", &db.url]);
    }
    if let Some(f) = failpoints {
        cmd.env("FAILPOINTS", f);
    }
    let out = cmd.output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

/// The spans a database records, as `first-last state`.
async fn spans(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT first_bucket || '-' || last_bucket || ' ' || state FROM shard_ranges \
         ORDER BY first_bucket",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The commands that touch claims, each as a user would start it against a list of databases.
fn commands(metrics: &str) -> Vec<Vec<String>> {
    let brokers = "127.0.0.1:1".to_string();
    [
        vec!["consume", "--brokers", &brokers, "--metrics-addr", metrics],
        vec!["dispatch", "--metrics-addr", metrics],
        vec!["status"],
        vec!["events", "list"],
        vec!["events", "show", "evt-1"],
        vec!["prune", "--dry-run", "--brokers", &brokers],
        vec!["dead-letters", "list"],
    ]
    .into_iter()
    .map(|c| c.into_iter().map(String::from).collect())
    .collect()
}

fn refused_by_every_command(dbs: &[&TestDb], extra: &[&str], expect: &[&str]) {
    let metrics = format!("127.0.0.1:{}", free_port());
    for command in commands(&metrics) {
        let mut args: Vec<&str> = command.iter().map(String::as_str).collect();
        args.extend(extra);
        let (ok, said) = run(&args, dbs, None);
        assert!(!ok, "{command:?} must be refused: {said}");
        for part in expect {
            assert!(said.contains(part), "{command:?} says {part:?}: {said}");
        }
    }
}

#[tokio::test]
async fn a_shard_list_reordered_shortened_or_recounted_is_refused_before_anything_is_claimed() {
    let (a, b) = (TestDb::new().await, TestDb::new().await);
    let (ok, said) = run(&["migrate"], &[&a, &b], None);
    assert!(ok, "{said}");
    assert_eq!(spans(&a).await, ["0-511 held"]);
    assert_eq!(spans(&b).await, ["512-1023 held"]);
    // Running `migrate` again with the same list changes nothing.
    assert!(run(&["migrate"], &[&a, &b], None).0);

    // One event applied by the list as it was split.
    let layout = Layout::new(1024, 2).unwrap();
    let key = (0..)
        .map(|n| format!("evt-{n}"))
        .find(|k| layout.shard(k) == 1)
        .unwrap();
    let shards = Shards::new(layout, vec![a.pool.clone(), b.pool.clone()]).unwrap();
    let event = RawMessage {
        offset: 0,
        key: Some(key.as_bytes().to_vec()),
        value: Some(envelope(&key, serde_json::json!({ "n": 1 }))),
        traceparent: None,
        headers: Default::default(),
    };
    BatchProcessor::new(shards, Arc::new(Ledger))
        .process("t", 0, std::slice::from_ref(&event))
        .await
        .unwrap();

    // The same databases in the other order: the first holds the upper half.
    refused_by_every_command(
        &[&b, &a],
        &[],
        &[
            "shard 0 of the list",
            "holds buckets 512-1023",
            "gives it buckets 0-511",
        ],
    );
    // One database left out, as a pod with an old ConfigMap would start.
    refused_by_every_command(
        &[&a],
        &[],
        &["holds buckets 0-511", "gives it buckets 0-1023"],
    );
    // Another bucket count.
    refused_by_every_command(&[&a, &b], &["--buckets", "2048"], &["records 1024 buckets"]);
    // `migrate` with the wrong list is refused as well, and records nothing.
    let (ok, said) = run(&["migrate"], &[&b, &a], None);
    assert!(!ok && said.contains("holds buckets 512-1023"), "{said}");
    assert_eq!(spans(&a).await, ["0-511 held"]);
    assert_eq!(spans(&b).await, ["512-1023 held"]);

    // Nothing was claimed anywhere else: one claim, one ledger row, on the key's database.
    for (db, n) in [(&a, 0), (&b, 1)] {
        assert_eq!(db.count("SELECT count(*) FROM processed_events").await, n);
        assert_eq!(db.count("SELECT count(*) FROM ledger").await, n);
    }
    // The right list works.
    let (ok, said) = run(&["status"], &[&a, &b], None);
    assert!(ok, "{said}");
}

#[tokio::test]
async fn a_consumer_whose_database_stops_holding_its_range_refuses_its_new_connections() {
    let _heavy = heavy().await;
    let db = TestDb::new().await;
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("g"));
    let producer = producer(&kafka.brokers());
    produce(
        &producer,
        &topic,
        &[Record::event("evt-a", serde_json::json!({}))],
    )
    .await;
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &db.url, None);
    wait_for("the first event", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM ledger").await == 1
    })
    .await;
    // The database now says it holds only half the buckets (as after a move away), and its
    // sessions are cut: every new connection of the consumer is refused.
    sqlx::raw_sql("UPDATE shard_ranges SET last_bucket = 511")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = 'replayproof' AND datname = current_database()",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let later: Vec<Record> = (0..20)
        .map(|n| Record::event(&format!("evt-{n}"), serde_json::json!({})))
        .collect();
    produce(&producer, &topic, &later).await;
    // It keeps failing its batches: nothing more is claimed while the consumer runs.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 1);
    // Given its range back, it goes on by itself.
    sqlx::raw_sql("UPDATE shard_ranges SET last_bucket = 1023")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("the later events", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM ledger").await == 21
    })
    .await;
    consumer.terminate(Duration::from_secs(30)).await;
}

/// The ledger, one outbox operation per event, and a row of an application table whose
/// nullable jsonb column holds JSON `null` for odd events and SQL NULL for the rest.
struct LedgerOutboxAndDoc;

#[replayproof::async_trait]
impl Effect for LedgerOutboxAndDoc {
    fn name(&self) -> &'static str {
        "ledger-outbox-doc"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        LedgerAndOutbox.apply_batch(tx, events).await?;
        for e in events {
            let odd = e.key.as_str().ends_with(['1', '3', '5', '7', '9']);
            sqlx::query(
                "INSERT INTO public.app_docs (event_key, route_key, doc) \
                 VALUES ($1, $2, CASE WHEN $3 THEN 'null'::jsonb END)",
            )
            .bind(e.key.as_str())
            .bind(e.route_key())
            .bind(odd)
            .execute(&mut **tx)
            .await
            .map_err(EffectError::from)?;
        }
        Ok(())
    }
}

/// An event of `source` that happened an hour ago.
fn old_event(offset: i64, key: &str) -> RawMessage {
    let value = Envelope {
        route: None,
        key: key.try_into().unwrap(),
        source: "test".into(),
        event_type: Some("test.event".into()),
        received_at: None,
        occurred_at: Some(chrono::Utc::now() - chrono::Duration::hours(1)),
        payload: serde_json::value::to_raw_value(&serde_json::json!({ "n": offset })).unwrap(),
        unhashed: Vec::new(),
        replay_window_secs: None,
        request_id: None,
    }
    .to_bytes();
    RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(value),
        traceparent: None,
        headers: Default::default(),
    }
}

const APP_DOCS: &str = "CREATE TABLE IF NOT EXISTS public.app_docs (
    event_key TEXT COLLATE \"C\" NOT NULL, route_key TEXT COLLATE \"C\" NOT NULL, doc JSONB,
    PRIMARY KEY (event_key, route_key))";

#[tokio::test]
async fn a_move_cut_off_at_any_commit_leaves_no_range_live_on_both_sides_and_finishes_when_run_again(
) {
    for cut in [
        "shards::move_after_mark",
        "shards::move_after_copy",
        "shards::move_after_delete",
    ] {
        move_cut_off_at(cut).await;
    }
}

async fn move_cut_off_at(cut: &str) {
    let (a, c) = (TestDb::new().await, TestDb::new().await);
    for db in [&a, &c] {
        sqlx::raw_sql(APP_DOCS).execute(&db.pool).await.unwrap();
    }
    assert!(run(&["migrate"], &[&a], None).0);
    let (ok, said) = run(&["migrate", "--new-shards"], &[&c], None);
    assert!(ok && spans(&c).await.is_empty(), "{said}");
    let events: Vec<RawMessage> = (0..60)
        .map(|n| message_for(n, &format!("evt-{n}")))
        .collect();
    let one = BatchProcessor::new(a.pool.clone(), Arc::new(LedgerOutboxAndDoc));
    assert_eq!(one.process("t", 0, &events).await.unwrap().applied, 60);
    // Prune erased some ledger payloads (JSON null) and left a horizon for the source.
    sqlx::raw_sql(
        "UPDATE ledger SET payload = 'null'::jsonb WHERE event_key LIKE 'evt-1%';
         INSERT INTO prune_horizons (source, pruned_before) VALUES ('test', now());",
    )
    .execute(&a.pool)
    .await
    .unwrap();
    let before_nulls = a
        .count("SELECT count(*) FROM ledger WHERE payload = 'null'::jsonb")
        .await;

    let moving = [
        "shards",
        "move",
        "--range",
        "512-1023",
        "--table",
        "public.app_docs",
    ];
    let mut with_urls: Vec<&str> = moving.to_vec();
    with_urls.extend(["--from-url", &a.url, "--to-url", &c.url]);
    let failpoint = format!("{cut}=panic");
    let (ok, said) = run(&with_urls, &[], Some(&failpoint));
    assert!(!ok && said.contains(cut), "cut off at {cut}: {said}");

    // Meanwhile neither list can use either database: nothing is claimed, leased or applied.
    let metrics = format!("127.0.0.1:{}", free_port());
    for list in [vec![&a], vec![&a, &c]] {
        for command in commands(&metrics) {
            let args: Vec<&str> = command.iter().map(String::as_str).collect();
            let (ok, said) = run(&args, &list, None);
            assert!(
                !ok,
                "{cut}: {command:?} over {} database(s): {said}",
                list.len()
            );
            assert!(
                said.contains("did not finish") || said.contains("holds buckets"),
                "{cut}: {command:?}: {said}"
            );
        }
    }

    // Run again, it finishes; again, there is nothing left to do.
    let (ok, said) = run(&with_urls, &[], None);
    assert!(
        ok && said.contains("verified and finished"),
        "{cut}: {said}"
    );
    let (ok, said) = run(&with_urls, &[], None);
    assert!(
        ok && said.contains("held by the target already"),
        "{cut}: {said}"
    );
    assert_eq!(spans(&a).await, ["0-511 held"]);
    assert_eq!(spans(&c).await, ["512-1023 held"]);

    // Every row is in its place once, values as they were.
    let layout = Layout::new(1024, 2).unwrap();
    let mut claims = 0;
    for (i, db) in [&a, &c].into_iter().enumerate() {
        let keys: Vec<String> = sqlx::query_scalar("SELECT route_key FROM processed_events")
            .fetch_all(&db.pool)
            .await
            .unwrap();
        assert!(
            keys.iter().all(|k| layout.shard(k) == i),
            "{cut}: shard {i}"
        );
        claims += keys.len();
    }
    assert_eq!(claims, 60);
    let total = |sql: &'static str| {
        let (a, c) = (&a, &c);
        async move { a.count(sql).await + c.count(sql).await }
    };
    assert_eq!(
        total("SELECT count(*) FROM ledger WHERE payload = 'null'::jsonb").await,
        before_nulls
    );
    assert_eq!(
        total("SELECT count(*) FROM public.app_docs WHERE doc = 'null'::jsonb").await,
        30
    );
    assert_eq!(
        total("SELECT count(*) FROM public.app_docs WHERE doc IS NULL").await,
        30
    );
    assert_eq!(total("SELECT count(*) FROM outbox").await, 60);
    assert_eq!(
        c.count("SELECT count(*) FROM prune_horizons WHERE source = 'test'")
            .await,
        1,
        "{cut}: the horizon moved with the range"
    );

    // Every redelivery is a replay; an unknown key of an event older than the horizon, on the
    // target's buckets, is an expired replay there, not an effect.
    let two = BatchProcessor::new(
        Shards::new(layout, vec![a.pool.clone(), c.pool.clone()]).unwrap(),
        Arc::new(LedgerOutboxAndDoc),
    );
    let again = two.process("t", 1, &events).await.unwrap();
    assert_eq!((again.applied, again.duplicates), (0, 60), "{cut}");
    let late = (1000..)
        .map(|n| format!("evt-{n}"))
        .find(|k| layout.shard(k) == 1)
        .unwrap();
    let report = two.process("t", 2, &[old_event(0, &late)]).await.unwrap();
    assert_eq!((report.applied, report.expired), (0, 1), "{cut}");
    let (ok, said) = run(&["status"], &[&a, &c], None);
    assert!(ok, "{cut}: {said}");
}

fn message_for(offset: i64, key: &str) -> RawMessage {
    RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(envelope(key, serde_json::json!({ "n": offset }))),
        traceparent: None,
        headers: Default::default(),
    }
}

/// `key` routed by `route`, as a topic writer or a changed `route_from` would write it.
fn routed(key: &str, route: &str) -> Record {
    Record {
        key: Some(key.as_bytes().to_vec()),
        value: routed_envelope(key, Some(route), serde_json::json!({ "id": key })),
        partition: None,
    }
}

#[tokio::test]
async fn one_event_key_under_two_routes_is_one_effect_and_a_route_changed_conflict() {
    let _heavy = heavy().await;
    let db = TestDb::new().await;
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("g"));
    let producer = producer(&kafka.brokers());
    produce(&producer, &topic, &[routed("evt-1", "tenant-a")]).await;
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &db.url, None);
    wait_for("the first delivery", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM ledger").await == 1
    })
    .await;
    // A later batch: the same event under another route, then a marker event behind it.
    produce(
        &producer,
        &topic,
        &[routed("evt-1", "tenant-b"), routed("evt-2", "tenant-b")],
    )
    .await;
    wait_for("the marker event", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM ledger WHERE event_key = 'evt-2'")
            .await
            == 1
    })
    .await;
    consumer.terminate(Duration::from_secs(30)).await;
    assert_eq!(
        db.count("SELECT count(*) FROM ledger WHERE event_key = 'evt-1'")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events WHERE event_key = 'evt-1'")
            .await,
        1
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM key_conflicts WHERE event_key = 'evt-1' \
             AND route_key = 'tenant-b' AND reason LIKE 'route changed%'"
        )
        .await,
        1
    );

    // Both routes in one batch: the first claims, the second is the same conflict.
    let both: Vec<RawMessage> = ["tenant-a", "tenant-c"]
        .iter()
        .enumerate()
        .map(|(n, route)| {
            let r = routed("evt-3", route);
            RawMessage {
                offset: n as i64,
                key: r.key,
                value: Some(r.value),
                traceparent: None,
                headers: Default::default(),
            }
        })
        .collect();
    let report = BatchProcessor::new(db.pool.clone(), Arc::new(Ledger))
        .process("t", 0, &both)
        .await
        .unwrap();
    assert_eq!((report.applied, report.conflicts), (1, 1));
}

#[tokio::test]
async fn a_replay_window_is_checked_against_the_prune_horizons_of_every_database() {
    let (a, b) = (TestDb::new().await, TestDb::new().await);
    assert!(run(&["migrate"], &[&a, &b], None).0);
    // Only the second database has pruned anything (its source's claims of the last hour).
    sqlx::raw_sql("INSERT INTO prune_horizons (source, pruned_before) VALUES ('stripe', now())")
        .execute(&b.pool)
        .await
        .unwrap();
    let replay = [
        "replay",
        "--brokers",
        "127.0.0.1:1",
        "--since",
        "2h",
        "--reason",
        "deploy",
    ];
    let (ok, said) = run(&replay, &[&a, &b], None);
    assert!(!ok, "{said}");
    assert!(said.contains("stripe"), "{said}");
    assert_eq!(
        a.count("SELECT count(*) FROM operator_actions").await,
        0,
        "nothing replayed, nothing audited"
    );
}

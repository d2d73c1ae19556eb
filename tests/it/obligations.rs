//! The business boundary, through the binaries: operations keyed by the obligation their
//! events name (`consume --operation-key`), and the downstream's idempotency window
//! (`[dispatch.destinations."ORIGIN"] idempotency_window`), against a downstream that honours a
//! key for a few seconds only.

use crate::harness::dispatcher::{claim, dispatcher_of, Behaviour, Downstream};
use crate::harness::*;
use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::effect::{Effect, EffectError, Tx};
use replayproof::envelope::Event;
use replayproof::outbox::{self, NewOperation};
use serde_json::json;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// `replayproof dispatch` with the configuration file at `config`, sending quickly: its first
/// retry after `backoff`.
fn dispatch(config: &std::path::Path, backoff: &str) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args(["dispatch", "--config"])
        .arg(config)
        .args([
            "--poll",
            "50ms",
            "--request-timeout",
            "400ms",
            "--lease",
            "5s",
        ])
        .args(["--backoff", backoff, "--max-backoff", "1s"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env_remove("DATABASE_URL")
        .env_remove("REPLAYPROOF_CONFIG")
        .env("RUST_LOG", "warn,replayproof=info")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn replayproof dispatch")
}

/// The configuration file the docs show for a destination's window.
fn config_with_window(dir: &tempfile::TempDir, db: &TestDb, origin: &str) -> std::path::PathBuf {
    let path = dir.path().join("replayproof.toml");
    let text = format!(
        "[database]\nurl = \"{}\"\n\n[dispatch.destinations.\"{origin}\"]\nidempotency_window = \"3s\"\n",
        db.url
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// `replayproof events ...` against `db`; its exit status and what it printed.
fn events(db: &TestDb, args: &[&str]) -> (bool, String) {
    let out = replayproof()
        .arg("events")
        .args(args)
        .args(["--database-url", &db.url])
        .output()
        .unwrap();
    (out.status.success(), printed(&out))
}

async fn state_of(db: &TestDb, key: &str) -> (String, bool, Option<String>) {
    sqlx::query_as(
        "SELECT state, held_at IS NOT NULL, last_error FROM outbox WHERE operation_key = $1",
    )
    .bind(key)
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_applied_with_its_answer_lost_is_never_resent_past_the_window() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    downstream.forget_keys_after(Duration::from_secs(3));
    let key = "evt-window#deliver";
    // Applied, and every answer lost for longer than the downstream keeps the key.
    downstream.script(key, &[Behaviour::Hang; 60]);
    enqueue_http(&db, &downstream, &["evt-window".to_owned()], false).await;
    let dir = tempfile::tempdir().unwrap();
    let origin = outbox::origin(&downstream.url());
    let mut dispatcher = dispatch(&config_with_window(&dir, &db, &origin), "150ms");
    wait_for("the operation held", WAIT, || async {
        state_of(&db, key).await.1
    })
    .await;
    let (state, _, error) = state_of(&db, key).await;
    assert_eq!(state, "uncertain");
    assert!(
        error
            .as_deref()
            .unwrap_or_default()
            .contains("past the idempotency window"),
        "{error:?}"
    );
    // The dispatcher keeps turning (a later operation to the same origin is sent) and never
    // sends the held one again.
    let sent = downstream.requests(key);
    enqueue_http(&db, &downstream, &["evt-after".to_owned()], false).await;
    wait_for("a later operation delivered", WAIT, || async {
        downstream.applied().get("evt-after#deliver") == Some(&1)
    })
    .await;
    assert_eq!(downstream.requests(key), sent);
    assert_eq!(downstream.applied()[key], 1, "applied once");
    // The operator is refused unless they accept the risk, which the audit row records.
    let (ok, text) = events(&db, &["retry", "evt-window", "--reason", "customer asked"]);
    assert!(!ok && text.contains("idempotency window"), "{text}");
    let (ok, text) = events(&db, &["show", "evt-window"]);
    assert!(ok && text.contains("held_at"), "{text}");
    let (ok, text) = events(
        &db,
        &[
            "retry",
            "evt-window",
            "--accept-duplicate-risk",
            "--reason",
            "checked downstream",
        ],
    );
    assert!(ok, "{text}");
    let reason: String =
        sqlx::query_scalar("SELECT reason FROM operator_actions WHERE action = 'retry'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(reason.contains("accepted the duplicate risk"), "{reason}");
    dispatcher.kill().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_reconcile_url_an_operation_past_its_window_is_reconciled_not_resent() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    downstream.forget_keys_after(Duration::from_secs(3));
    downstream.lookups_unknown(true);
    let key = "evt-reconciled#deliver";
    downstream.script(key, &[Behaviour::Hang]);
    enqueue_http(&db, &downstream, &["evt-reconciled".to_owned()], true).await;
    let dir = tempfile::tempdir().unwrap();
    let origin = outbox::origin(&downstream.url());
    let mut dispatcher = dispatch(&config_with_window(&dir, &db, &origin), "1s");
    // The answer was lost, and the downstream cannot say whether it has the operation until
    // its window for the key has passed.
    wait_for("the window to pass", WAIT, || async {
        db.count(
            "SELECT count(*) FROM outbox WHERE idempotent_until < now() AND state = 'uncertain'",
        )
        .await
            == 1
    })
    .await;
    downstream.lookups_unknown(false);
    wait_for("the operation reconciled", WAIT, || async {
        state_of(&db, key).await.0 == "done"
    })
    .await;
    assert_eq!(downstream.requests(key), 1, "never sent again");
    assert_eq!(downstream.applied()[key], 1);
    let reconciled = db
        .count("SELECT count(*) FROM outbox_attempts WHERE outcome = 'reconciled_done'")
        .await;
    assert_eq!(reconciled, 1);
    dispatcher.kill().await.unwrap();
}

/// A consume process applying the http effect keyed by `/order`, with its metrics on `port`.
fn consume_by_order(
    kafka: &TestKafka,
    topic: &str,
    db: &TestDb,
    target: &str,
    port: u16,
) -> ConsumerProcess {
    let addr: &'static str = Box::leak(format!("127.0.0.1:{port}").into_boxed_str());
    let target: &'static str = Box::leak(target.to_owned().into_boxed_str());
    ConsumerProcess::spawn_with(
        &kafka.brokers(),
        topic,
        &unique("group"),
        &db.url,
        None,
        &[
            "--effect",
            "http",
            "--target-url",
            target,
            "--operation-key",
            "/order",
            "--metrics-addr",
            addr,
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_events_of_one_order_send_one_request_and_the_second_names_the_first() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let downstream = Downstream::start().await;
    let port = free_port();
    let consumer = consume_by_order(&kafka, &topic, &db, &downstream.url(), port);
    let records = [
        Record::event(
            "evt-checkout",
            json!({"order": "o-1", "type": "checkout.session.completed"}),
        ),
        Record::event(
            "evt-payment",
            json!({"order": "o-1", "type": "payment_intent.succeeded"}),
        ),
        Record::event("evt-other", json!({"order": 2})),
        Record::event("evt-unkeyed", json!({"customer": "c-1"})),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{}\"\n", db.url)).unwrap();
    let mut dispatcher = dispatch(&config, "150ms");
    wait_for("every claim and operation settled", WAIT, || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'done'")
            .await
            == 4
            && db
                .count("SELECT count(*) FROM outbox WHERE state = 'done'")
                .await
                == 3
    })
    .await;
    let applied = downstream.applied();
    assert_eq!(applied.get("test:o-1#deliver"), Some(&1));
    assert_eq!(
        downstream.requests("test:o-1#deliver"),
        1,
        "one request for the order"
    );
    assert_eq!(
        applied.get("test:2#deliver"),
        Some(&1),
        "another order: its own"
    );
    assert_eq!(
        applied.get("evt-unkeyed#deliver"),
        Some(&1),
        "no order: by event"
    );
    assert_eq!(applied.len(), 3);
    let (ok, text) = events(&db, &["show", "evt-payment"]);
    assert!(ok && text.contains("fulfilled by evt-checkout"), "{text}");
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (key, n) in [("obligation", 2), ("fulfilled", 1), ("fallback", 1)] {
        let line = format!(
            "replayproof_consume_operation_keys_total{{key=\"{key}\",source=\"test\"}} {n}"
        );
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    dispatcher.kill().await.unwrap();
    consumer.kill9().await;
}

#[tokio::test]
async fn with_several_databases_consume_refuses_an_obligation_its_sources_are_not_routed_by() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(
        &config,
        "[database]\nurl = [\"postgres://postgres@127.0.0.1:1/a\", \"postgres://postgres@127.0.0.1:1/b\"]\n\n\
         [consume]\neffect = \"http\"\ntarget_url = \"http://127.0.0.1:1/ops\"\noperation_key = \"/order\"\n\n\
         [[ingest.sources]]\nname = \"shop\"\nkind = \"shopify\"\nsecrets_env = [\"SHOP_SECRET\"]\n\
         route_from = { header = \"X-Shopify-Shop-Domain\" }\n",
    )
    .unwrap();
    let out = replayproof()
        .args(["consume", "--config"])
        .arg(&config)
        .args(["--brokers", "127.0.0.1:1", "--metrics-addr", "127.0.0.1:0"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("route_from") && text.contains("\"shop\""),
        "{text}"
    );
}

/// An application's effect: a `fulfil` and a `notify` of each event's order, through the
/// library's operation builder with an explicit obligation key.
struct FulfilAndNotify(String);

#[replayproof::async_trait]
impl Effect for FulfilAndNotify {
    fn name(&self) -> &'static str {
        "fulfil-and-notify"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let order = event.payload()?["order"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        for name in ["fulfil", "notify"] {
            let op = NewOperation::of_event(event, name, &self.0, event.envelope_bytes())
                .obligation(&event.source, &order);
            outbox::enqueue(tx, &op).await?;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fulfil_and_a_notify_of_one_order_are_both_sent_once() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    let processor =
        BatchProcessor::new(db.pool.clone(), Arc::new(FulfilAndNotify(downstream.url())));
    let orders = [("evt-1", "o-7"), ("evt-2", "o-7"), ("evt-3", "o-8")];
    // In one batch, and again in a later one: the earlier event holds the obligation.
    let message = |(i, (key, order)): (usize, &(&str, &str))| RawMessage {
        offset: i as i64,
        key: Some(key.as_bytes().to_vec()),
        value: Some(envelope(key, json!({"order": order}))),
        traceparent: None,
        headers: Default::default(),
    };
    let messages: Vec<RawMessage> = orders.iter().enumerate().map(message).collect();
    processor.process("t", 0, &messages[..2]).await.unwrap();
    processor.process("t", 0, &messages[2..]).await.unwrap();
    let sent = db.count("SELECT count(*) FROM outbox").await;
    assert_eq!(sent, 4, "fulfil and notify of o-7 and of o-8");
    let fulfilled: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT event_key, operation, fulfilled_by FROM fulfilled_operations ORDER BY operation",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let by_first = |op: &str| ("evt-2".to_owned(), op.to_owned(), "evt-1".to_owned());
    assert_eq!(fulfilled, vec![by_first("fulfil"), by_first("notify")]);
    let keys: Vec<String> = sqlx::query_scalar("SELECT operation_key FROM outbox ORDER BY 1")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let expected = [
        "test:o-7#fulfil",
        "test:o-7#notify",
        "test:o-8#fulfil",
        "test:o-8#notify",
    ];
    assert_eq!(keys, expected);
    let dispatcher = dispatcher_of(&db);
    wait_for("every operation sent", WAIT, || async {
        dispatcher.dispatch_once().await.unwrap();
        db.count("SELECT count(*) FROM outbox WHERE state = 'done'")
            .await
            == 4
    })
    .await;
    let applied = downstream.applied();
    for key in expected {
        assert_eq!(applied.get(key), Some(&1), "{key} sent once");
    }
    assert_eq!(applied.len(), 4);
}

/// Enqueues `obligation`'s operation for `event` in a transaction of its own, in the
/// background, once `first` holds the obligation: it waits for `first` to end.
async fn racing(
    db: &TestDb,
    event: &'static str,
    obligation: &'static str,
) -> tokio::task::JoinHandle<outbox::Enqueued> {
    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.unwrap();
        let op = NewOperation::new(event, "fulfil", "http://127.0.0.1:1/ops", b"{}".to_vec())
            .obligation("shop", obligation);
        let enqueued = outbox::enqueue(&mut tx, &op).await.unwrap();
        tx.commit().await.unwrap();
        enqueued
    });
    wait_for("the second to wait for the first's claim", WAIT, || async {
        db.count(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database() AND query LIKE '%operation_obligations%'",
        )
        .await
            == 1
    })
    .await;
    second
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_transactions_naming_one_obligation_at_once_enqueue_it_once() {
    let db = TestDb::new().await;
    for key in ["evt-first", "evt-second", "evt-third", "evt-fourth"] {
        claim(&db, key).await;
    }
    let op = |event: &'static str, obligation: &'static str| {
        NewOperation::new(event, "fulfil", "http://127.0.0.1:1/ops", b"{}".to_vec())
            .obligation("shop", obligation)
    };
    // The second waits for the first's claim of the obligation, and finds it held once the
    // first commits.
    let mut first = db.pool.begin().await.unwrap();
    let enqueued = outbox::enqueue(&mut first, &op("evt-first", "o-9"))
        .await
        .unwrap();
    assert!(enqueued.fulfilled.is_empty());
    let second = racing(&db, "evt-second", "o-9").await;
    first.commit().await.unwrap();
    let enqueued = second.await.unwrap();
    assert_eq!(enqueued.fulfilled.len(), 1);
    assert_eq!(enqueued.fulfilled[0].by, "evt-first");
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 1);
    // When the first rolls back instead, the waiting one claims the obligation and enqueues it.
    let mut third = db.pool.begin().await.unwrap();
    outbox::enqueue(&mut third, &op("evt-third", "o-10"))
        .await
        .unwrap();
    let fourth = racing(&db, "evt-fourth", "o-10").await;
    third.rollback().await.unwrap();
    assert!(fourth.await.unwrap().fulfilled.is_empty());
    let holder: String =
        sqlx::query_scalar("SELECT event_key FROM outbox WHERE operation_key = 'shop:o-10#fulfil'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(holder, "evt-fourth");
    assert_eq!(
        db.count("SELECT count(*) FROM fulfilled_operations").await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_within_the_window_keeps_the_first_window() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    enqueue_http(&db, &downstream, &["evt-kept".to_owned()], false).await;
    // Its first attempt without an answer an hour ago; Stripe's window ends in 23 hours.
    sqlx::query(
        "UPDATE outbox SET state = 'dead', maybe_applied_at = now() - interval '1 hour', \
         idempotent_until = now() + interval '23 hours'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (ok, text) = events(&db, &["retry", "evt-kept", "--reason", "downstream back"]);
    assert!(ok, "{text}");
    let kept: (String, bool) = sqlx::query_as(
        "SELECT state, maybe_applied_at < now() - interval '59 minutes' AND \
         idempotent_until > now() FROM outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        kept,
        ("pending".to_owned(), true),
        "the window still runs from the first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_key_is_recorded_as_such_never_as_a_plain_refusal() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    let mismatch: &'static [u8] = br#"{"error":{"type":"idempotency_error","message":"Keys for idempotent requests can only be used with the same parameters they were first used with."}}"#;
    let in_use: &'static [u8] = br#"{"error":{"code":"idempotency_key_in_use","message":"There is currently another in-progress request using this Idempotent Key."}}"#;
    downstream.script(
        "evt-mismatch#deliver",
        &[Behaviour::RefuseWithBody(400, mismatch)],
    );
    downstream.script(
        "evt-in-use#deliver",
        &[Behaviour::RefuseWithBody(409, in_use)],
    );
    let keys = ["evt-mismatch".to_owned(), "evt-in-use".to_owned()];
    enqueue_http(&db, &downstream, &keys, false).await;
    let dispatcher = dispatcher_of(&db);
    assert_eq!(dispatcher.dispatch_once().await.unwrap(), 2);
    let rows: Vec<(String, String, String, bool)> = sqlx::query_as(
        "SELECT o.operation_key, o.state, a.outcome, o.maybe_applied_at IS NOT NULL \
         FROM outbox o JOIN outbox_attempts a ON a.outbox_id = o.id ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let row = |k: &str, s: &str, o: &str, maybe| (k.to_owned(), s.to_owned(), o.to_owned(), maybe);
    assert_eq!(
        rows,
        vec![
            row("evt-in-use#deliver", "uncertain", "key_in_use", true),
            row("evt-mismatch#deliver", "failed", "key_mismatch", false),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_names_the_event_that_fulfils_and_why_a_held_operation_waits() {
    use crate::harness::console::{settings, TestConsole};
    let db = TestDb::new().await;
    let effect = replayproof::effect::HttpOutbox {
        target_url: "http://127.0.0.1:1/ops".into(),
        reconcile_url: None,
        max_attempts: 3,
        operation_keys: replayproof::effect::obligation::OperationKeys {
            default: Some("/order".into()),
            ..Default::default()
        },
    };
    let processor = BatchProcessor::new(db.pool.clone(), Arc::new(effect));
    let messages: Vec<RawMessage> = ["evt-first", "evt-again"]
        .iter()
        .enumerate()
        .map(|(i, key)| RawMessage {
            offset: i as i64,
            key: Some(key.as_bytes().to_vec()),
            value: Some(envelope(key, json!({"order": "o-5"}))),
            traceparent: None,
            headers: Default::default(),
        })
        .collect();
    processor.process("t", 0, &messages).await.unwrap();
    // The operation's answer was lost and the downstream's window passed: held.
    sqlx::query(
        "UPDATE outbox SET state = 'uncertain', maybe_applied_at = now() - interval '2 days', \
         idempotent_until = now() - interval '1 day', held_at = now(), \
         last_error = 'past the idempotency window'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let again = ann.get("/events/evt-again").await;
    assert!(
        again.body.contains("fulfilled by another event"),
        "{}",
        again.body
    );
    assert!(
        again.body.contains("href=\"/events/evt-first\""),
        "{}",
        again.body
    );
    let first = ann.get("/events/evt-first").await;
    assert!(first.body.contains("id=\"held\""), "{}", first.body);
    assert!(
        first.body.contains("id=\"accept-duplicate-risk\""),
        "{}",
        first.body
    );
    let token = ann.csrf("/events/evt-first").await;
    let form = [("csrf_token", token.as_str()), ("reason", "checked")];
    let refused = ann.post("/events/evt-first/retry", &form).await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert!(
        refused.body.contains("idempotency window"),
        "{}",
        refused.body
    );
    let accepted = [
        ("csrf_token", token.as_str()),
        ("reason", "checked"),
        ("accept_duplicate_risk", "yes"),
    ];
    let sent = ann.post("/events/evt-first/retry", &accepted).await;
    assert_eq!(sent.status, 303, "{}", sent.body);
    let state: (String, bool) = sqlx::query_as("SELECT state, held_at IS NULL FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(state, ("pending".to_owned(), true));
}

//! The operator path: each command does what it says, refuses what the states forbid, and
//! writes its audit row.

use crate::harness::dispatcher::Downstream;
use crate::harness::{stdout_of, TestDb, TestKafka};
use async_trait::async_trait;
use replayproof::consume::RawMessage;
use replayproof::effect::Registry;
use replayproof::effect::{Effect, EffectError, HttpOutbox, Ledger, Tx};
use replayproof::envelope::Event;
use replayproof::operator::events::{self, Resolution, Retry};
use replayproof::operator::{dead_letters, Act, Change, OperatorError};
use serde_json::json;
use std::sync::Arc;

/// `events retry` of `key` with the built-in effects, or with `effect` when given.
async fn retry(
    db: &TestDb,
    effect: Option<Arc<dyn Effect>>,
    key: &str,
    actor: &str,
    reason: &str,
) -> Result<Vec<Change>, OperatorError> {
    let retry = Retry {
        operation: None,
        effect,
        accept_duplicate_risk: false,
    };
    let act = Act::new(actor, reason);
    events::retry(&db.pool, &Registry::default(), key, &retry, &act).await
}

/// `events resolve` of `key`.
async fn resolve(
    db: &TestDb,
    key: &str,
    to: Resolution,
    actor: &str,
    reason: &str,
) -> Result<Vec<Change>, OperatorError> {
    events::resolve(&db.pool, key, None, to, &Act::new(actor, reason)).await
}

fn change(target: &str, before: &str, after: &str) -> Change {
    Change {
        target: target.into(),
        before: before.into(),
        after: after.into(),
    }
}

fn message(offset: i64, key: &str) -> RawMessage {
    crate::harness::operator::message(offset, key, json!({"n": offset}))
}

use crate::harness::operator::{operations_in, process};

async fn state(db: &TestDb, key: &str) -> (String, i32) {
    sqlx::query_as("SELECT state, attempts FROM outbox WHERE event_key = $1")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn audits(db: &TestDb) -> Vec<(String, String, String, String, String, String)> {
    sqlx::query_as("SELECT actor, action, target, reason, state_before, state_after FROM operator_actions ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn retry_moves_failed_uncertain_and_dead_operations_back_with_the_same_key() {
    let db = TestDb::new().await;
    operations_in(
        &db,
        &[
            ("f", "failed"),
            ("u", "uncertain"),
            ("d", "dead"),
            ("ok", "done"),
            ("p", "pending"),
        ],
    )
    .await;
    let payload_before: Vec<u8> =
        sqlx::query_scalar("SELECT payload FROM outbox WHERE event_key = 'u'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    for key in ["f", "u", "d"] {
        let changes = retry(&db, None, key, "alice", "downstream fixed")
            .await
            .unwrap();
        assert_eq!(changes[0].after, "pending");
        assert_eq!(state(&db, key).await, ("pending".into(), 0));
    }
    let op_key: String =
        sqlx::query_scalar("SELECT operation_key FROM outbox WHERE event_key = 'u'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(op_key, "u#deliver");
    let payload_after: Vec<u8> =
        sqlx::query_scalar("SELECT payload FROM outbox WHERE event_key = 'u'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(payload_before, payload_after);

    let done = retry(&db, None, "ok", "alice", "again").await.unwrap_err();
    assert!(matches!(done, OperatorError::AlreadyDone(_)), "{done}");
    let pending = retry(&db, None, "p", "alice", "again").await.unwrap_err();
    assert!(
        matches!(pending, OperatorError::OnItsWay { .. }),
        "{pending}"
    );
    assert_eq!(state(&db, "ok").await.0, "done");

    let audit = audits(&db).await;
    assert_eq!(audit.len(), 3, "refusals write nothing");
    assert_eq!(
        audit[0],
        (
            "alice".into(),
            "retry".into(),
            "f#deliver".into(),
            "downstream fixed".into(),
            "failed".into(),
            "pending".into()
        )
    );
}

#[tokio::test]
async fn resolve_settles_by_hand_and_refuses_a_live_lease() {
    let db = TestDb::new().await;
    operations_in(
        &db,
        &[("u", "uncertain"), ("l", "in_progress"), ("ok", "done")],
    )
    .await;
    let changes = resolve(
        &db,
        "u",
        Resolution::Done,
        "bob",
        "confirmed in the provider's dashboard",
    )
    .await
    .unwrap();
    assert_eq!(changes, [change("u#deliver", "uncertain", "done")]);
    assert_eq!(state(&db, "u").await.0, "done");

    sqlx::query(
        "UPDATE outbox SET lease_expires_at = now() + interval '1 hour' WHERE event_key = 'l'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let live = resolve(&db, "l", Resolution::Dead, "bob", "x").await;
    assert!(matches!(live, Err(OperatorError::LeaseLive(_))), "{live:?}");
    let settled = resolve(&db, "ok", Resolution::Dead, "bob", "x").await;
    assert!(
        matches!(settled, Err(OperatorError::NothingToResolve(_))),
        "nothing to resolve: {settled:?}"
    );
    assert!(
        <Resolution as clap::ValueEnum>::from_str("pending", false).is_err(),
        "an event is resolved as done or dead only"
    );
    let audit = audits(&db).await;
    assert_eq!(audit.len(), 1);
    assert_eq!(
        (
            audit[0].1.as_str(),
            audit[0].4.as_str(),
            audit[0].5.as_str()
        ),
        ("resolve", "uncertain", "done")
    );
}

/// Fails until `fixes` has a row, then writes the ledger row.
struct FailsUntilFixed;

#[async_trait]
impl Effect for FailsUntilFixed {
    fn name(&self) -> &'static str {
        "fails-until-fixed"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let fixed: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM fixes)")
            .fetch_one(&mut **tx)
            .await?;
        if !fixed {
            return Err(anyhow::anyhow!("not fixed yet: no row in fixes").into());
        }
        Ledger.apply(tx, event).await
    }
}

#[tokio::test]
async fn retry_runs_a_failed_local_effect_again_from_its_stored_payload() {
    let db = TestDb::new().await;
    sqlx::query("CREATE TABLE fixes (at timestamptz)")
        .execute(&db.pool)
        .await
        .unwrap();
    process(&db, Arc::new(FailsUntilFixed), &[message(0, "evt-f")]).await;
    let status: String = sqlx::query_scalar("SELECT status FROM processed_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "failed");

    let err = retry(
        &db,
        Some(Arc::new(FailsUntilFixed)),
        "evt-f",
        "carol",
        "try",
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, OperatorError::EffectFailed { error, .. } if format!("{error:#}").contains("fixes")),
        "{err:#}"
    );
    sqlx::query("INSERT INTO fixes VALUES (now())")
        .execute(&db.pool)
        .await
        .unwrap();
    let changes = retry(
        &db,
        Some(Arc::new(FailsUntilFixed)),
        "evt-f",
        "carol",
        "fixed",
    )
    .await
    .unwrap();
    assert_eq!(changes[0].after, "done");
    assert_eq!(db.ledger_counts().await["evt-f"], 1);
    let payload: serde_json::Value = sqlx::query_scalar("SELECT payload FROM ledger")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(payload, json!({"n": 0}));
    let again = retry(&db, Some(Arc::new(Ledger)), "evt-f", "carol", "again").await;
    assert!(
        matches!(again, Err(OperatorError::NotRetryable { .. })),
        "done is refused: {again:?}"
    );
    let audit = audits(&db).await;
    assert_eq!(
        audit.iter().map(|a| a.5.as_str()).collect::<Vec<_>>(),
        ["failed", "done"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_holds_no_lock_while_producing_and_marks_nothing_when_producing_fails() {
    let db = TestDb::new().await;
    let poison = RawMessage {
        offset: 7,
        key: Some(b"k".to_vec()),
        value: Some(b"oops".to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    process(&db, Arc::new(Ledger), &[poison]).await;
    let id = dead_letters::list(&db.pool, 10).await.unwrap()[0].id;
    let act = Act::new("erin", "broker was down");

    let failed = dead_letters::replay(&db.pool, id, &act, |_| async {
        anyhow::bail!("the broker is down")
    })
    .await;
    assert!(failed.is_err());
    let marked = "SELECT count(*) FROM dead_letters WHERE replayed_at IS NOT NULL";
    assert_eq!(db.count(marked).await, 0, "a failed produce marks nothing");
    assert_eq!(db.count("SELECT count(*) FROM operator_actions").await, 0);

    let pool = db.pool.clone();
    let changes = dead_letters::replay(&db.pool, id, &act, |letter| async move {
        assert_eq!(letter.value.as_deref(), Some(&b"oops"[..]));
        // While Kafka is waited on, anyone may lock the letter's row at once.
        sqlx::query("SELECT 1 FROM dead_letters WHERE id = $1 FOR UPDATE NOWAIT")
            .bind(id)
            .execute(&pool)
            .await?;
        Ok("webhooks".to_owned())
    })
    .await
    .unwrap();
    assert_eq!(changes[0].after, "replayed");
    assert_eq!(db.count(marked).await, 1);
    assert_eq!(db.count("SELECT count(*) FROM operator_actions").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_shown_and_replayed() {
    let (db, kafka) = (TestDb::new().await, TestKafka::mock());
    let topic = kafka.topic(1).await;
    process(
        &db,
        Arc::new(Ledger),
        &[RawMessage {
            offset: 4,
            key: Some(b"k".to_vec()),
            value: Some(b"oops".to_vec()),
            traceparent: None,
            headers: Default::default(),
        }],
    )
    .await;
    let list = dead_letters::list(&db.pool, 10).await.unwrap();
    assert_eq!(list.len(), 1);
    let id = list[0].id;
    let shown = dead_letters::show(&db.pool, id).await.unwrap();
    assert_eq!(shown.value.as_deref(), Some("oops"));

    stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args([
                "dead-letters",
                "replay",
                &id.to_string(),
                "--database-url",
                &db.url,
                "--brokers",
                &kafka.brokers(),
            ])
            .args([
                "--topic",
                &topic,
                "--reason",
                "fixed the producer",
                "--actor",
                "dave",
                "--json",
            ]),
    );
    let replayed: Option<String> = sqlx::query_scalar("SELECT replayed_at::text FROM dead_letters")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(replayed.is_some());
    let brokers = kafka.brokers();
    let (_, high) = tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::Consumer;
        let c: rdkafka::consumer::BaseConsumer =
            crate::harness::client_config(&brokers).create().unwrap();
        c.fetch_watermarks(&topic, 0, std::time::Duration::from_secs(10))
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(high, 1, "the raw message is back on the topic");
    let audit = audits(&db).await;
    assert_eq!(
        (audit[0].0.as_str(), audit[0].1.as_str()),
        ("dave", "replay")
    );
}

#[tokio::test]
async fn events_commands_print_tables_and_json() {
    let db = TestDb::new().await;
    operations_in(&db, &[("evt-1", "uncertain"), ("evt-2", "done")]).await;
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(args)
            .args(["--database-url", &db.url])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, stdout, _) = run(&["events", "list", "--state", "uncertain", "--json"]);
    assert!(ok);
    let rows: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1);
    assert_eq!(rows[0]["event_key"], "evt-1");
    assert_eq!(rows[0]["operations"], "deliver=uncertain");

    let (ok, stdout, _) = run(&["events", "show", "evt-1"]);
    assert!(ok);
    assert!(
        stdout.contains("== outbox operations")
            && stdout.contains("evt-1#deliver")
            && stdout.contains("uncertain"),
        "{stdout}"
    );

    let (ok, _, stderr) = run(&["events", "retry", "evt-2", "--reason", "why not"]);
    assert!(!ok, "retrying a done operation is refused");
    assert!(stderr.contains("done"), "{stderr}");
    let (ok, stdout, _) = run(&[
        "events",
        "retry",
        "evt-1",
        "--reason",
        "try again",
        "--actor",
        "erin",
    ]);
    assert!(ok);
    assert!(
        stdout.contains("evt-1#deliver: uncertain -> pending"),
        "{stdout}"
    );
}

/// A ledger that refuses one source until the operator lifts the block, then an outbox
/// operation: the chain a `--effect ledger,http` consumer runs.
async fn failed_chain(db: &TestDb, downstream: &Downstream, keys: &[&str]) {
    sqlx::query("ALTER TABLE ledger ADD CONSTRAINT blocked CHECK (source <> 'test')")
        .execute(&db.pool)
        .await
        .unwrap();
    let http = HttpOutbox {
        target_url: downstream.url(),
        reconcile_url: None,
        max_attempts: 4,
        operation_keys: Default::default(),
    };
    let chain = Registry::default()
        .build(&["ledger".into(), "http".into()], Some(&http))
        .unwrap();
    let messages: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| message(i as i64, k))
        .collect();
    process(db, chain, &messages).await;
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events WHERE status = 'failed'")
            .await,
        keys.len() as i64
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
    sqlx::query("ALTER TABLE ledger DROP CONSTRAINT blocked")
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn retry_runs_the_recorded_chain_again_outbox_operation_included() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    failed_chain(&db, &downstream, &["evt-chain"]).await;
    // Naming only one of the recorded effects would skip the other: refused.
    let partial = retry(&db, Some(Arc::new(Ledger)), "evt-chain", "erin", "try")
        .await
        .unwrap_err();
    assert!(
        matches!(partial, OperatorError::OtherEffects { .. }),
        "{partial:#}"
    );
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 0);
    // No effect named: the claim's recorded effects run again, both of them.
    let changes = retry(&db, None, "evt-chain", "erin", "unblocked")
        .await
        .unwrap();
    assert_eq!(changes, [change("evt-chain", "failed", "done")]);
    assert_eq!(db.ledger_counts().await["evt-chain"], 1);
    let (destination, state): (String, String) =
        sqlx::query_as("SELECT destination, state FROM outbox WHERE event_key = 'evt-chain'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((destination, state.as_str()), (downstream.url(), "pending"));
}

#[tokio::test]
async fn bulk_retry_dry_runs_then_retries_each_matching_event_with_an_audit_row() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    failed_chain(&db, &downstream, &["evt-b1", "evt-b2", "evt-b3"]).await;
    let run = |extra: &[&str]| {
        let stdout = stdout_of(
            std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
                .args(["events", "retry", "--state", "failed", "--source", "test"])
                .args(["--since", "2000-01-01T00:00:00Z", "--reason", "unblocked"])
                .args(["--actor", "frank", "--database-url", &db.url])
                .args(extra),
        );
        String::from_utf8_lossy(&stdout).into_owned()
    };
    let planned = run(&["--dry-run"]);
    assert!(planned.contains("3 events would be retried"), "{planned}");
    assert_eq!(
        db.count("SELECT count(*) FROM ledger").await,
        0,
        "a dry run changes nothing"
    );
    assert!(audits(&db).await.is_empty());

    let done = run(&[]);
    assert_eq!(done.lines().count(), 3, "{done}");
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 3);
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 3);
    let audit = audits(&db).await;
    assert_eq!(audit.len(), 3);
    assert!(audit
        .iter()
        .all(|a| a.0 == "frank" && a.1 == "retry" && a.4 == "failed"));
    // Nothing is failed any more: a second bulk retry finds nothing.
    assert!(run(&["--dry-run"]).contains("0 events would be retried"));
}

/// Runs `replayproof ARGS` and answers (stdout, stderr), asserting it succeeded.
fn run_cli(args: &[&str]) -> (String, String) {
    let out = crate::harness::replayproof().args(args).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    );
    assert!(out.status.success(), "{args:?}: {stderr}");
    (stdout, stderr)
}

#[tokio::test]
async fn events_list_pages_by_cursor_and_narrows_by_time_and_type() {
    let db = TestDb::new().await;
    let messages: Vec<_> = (0..7).map(|i| message(i, &format!("k{i}"))).collect();
    process(&db, Arc::new(Ledger), &messages).await;
    sqlx::query("UPDATE processed_events SET claimed_at = now() - interval '3 hours', event_type = 'old.kind' WHERE event_key IN ('k0', 'k1')")
        .execute(&db.pool)
        .await
        .unwrap();
    let keys = |json: &str| -> Vec<String> {
        let rows: Vec<serde_json::Value> = serde_json::from_str(json).unwrap();
        rows.iter()
            .map(|r| r["event_key"].as_str().unwrap().to_owned())
            .collect()
    };
    let base = ["events", "list", "--json", "--database-url", &db.url];
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = base.to_vec();
        args.extend(["--limit", "3"]);
        if let Some(a) = &after {
            args.extend(["--after", a.as_str()]);
        }
        let (stdout, stderr) = run_cli(&args);
        seen.extend(keys(&stdout));
        match stderr
            .lines()
            .find_map(|l| l.strip_prefix("next page: --after "))
        {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        seen,
        ["k6", "k5", "k4", "k3", "k2", "k1", "k0"],
        "every event once, newest first"
    );
    let recent = keys(&run_cli(&[&base[..], &["--since", "1h"]].concat()).0);
    assert_eq!(recent.len(), 5);
    let old = keys(&run_cli(&[&base[..], &["--until", "1h", "--type", "old.kind"]].concat()).0);
    assert_eq!(old, ["k1", "k0"]);
    let prefix = keys(&run_cli(&[&base[..], &["--key", "k1*"]].concat()).0);
    assert_eq!(prefix, ["k1"]);
    let bad = crate::harness::replayproof()
        .args([&base[..], &["--after", "not-a-cursor"]].concat())
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a cursor"));
}

#[tokio::test]
async fn dead_letters_replay_in_bulk_takes_only_the_letters_selected_and_a_dry_run_none() {
    let db = TestDb::new().await;
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let letter = |offset: i64, value: &str| RawMessage {
        offset,
        key: None,
        value: Some(value.as_bytes().to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    // Three that are not JSON, one JSON that is no envelope.
    process(
        &db,
        Arc::new(Ledger),
        &[
            letter(1, "oops"),
            letter(2, "{\"x\": 1}"),
            letter(3, "nope"),
            letter(4, "bad"),
        ],
    )
    .await;
    let replayed = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM dead_letters WHERE replayed_at IS NOT NULL",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let brokers = kafka.brokers();
    let base = [
        "dead-letters",
        "replay",
        "--database-url",
        &db.url,
        "--brokers",
        &brokers,
        "--topic",
        &topic,
        "--reason",
        "parser fixed",
        "--actor",
        "dave",
    ];
    let (dry, _) = run_cli(&[&base[..], &["--all", "--dry-run"]].concat());
    assert!(dry.contains("4 dead letters would be replayed"), "{dry}");
    assert_eq!(replayed().await, 0, "a dry run changes nothing");
    let reasons: Vec<String> = sqlx::query_scalar("SELECT reason FROM dead_letters ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    // The letter whose reason is the one of the JSON that is no envelope.
    assert!(
        reasons.iter().filter(|r| **r == reasons[1]).count() == 1,
        "{reasons:?}"
    );
    let pattern = reasons[1].clone();
    let (like, _) = run_cli(&[&base[..], &["--reason-like", &pattern]].concat());
    assert_eq!(replayed().await, 1, "{like}");
    run_cli(&[&base[..], &["--all"]].concat());
    assert_eq!(replayed().await, 4);
    let (again, _) = run_cli(&[&base[..], &["--all", "--dry-run"]].concat());
    assert!(
        again.contains("0 dead letters would be replayed"),
        "replayed ones are not taken again: {again}"
    );
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM operator_actions WHERE actor = 'dave' AND action = 'replay'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(audited, 4);
}

#[tokio::test]
async fn status_watch_shows_the_screen_again_until_interrupted() {
    let db = TestDb::new().await;
    let mut child = crate::harness::replayproof()
        .args(["status", "--watch", "200ms", "--database-url", &db.url])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
        text
    });
    // Three screens at least, then SIGINT.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let text = reader.join().unwrap();
    assert!(text.matches("(every 200ms)").count() >= 3, "{text}");
    assert!(
        text.contains("\x1b[2J"),
        "the screen is cleared between views"
    );
}

#[tokio::test]
async fn an_operation_whose_body_was_erased_is_never_sent_again() {
    let db = TestDb::new().await;
    operations_in(&db, &[("d", "dead"), ("d2", "dead")]).await;
    let cli = |args: &[&str]| {
        let out = crate::harness::replayproof()
            .args(args)
            .args(["--database-url", &db.url])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.success(), text)
    };
    let (ok, said) = cli(&["events", "erase", "--key", "d", "--reason", "gdpr"]);
    assert!(ok, "a dead operation's event may be erased: {said}");
    // One key, by the command line: refused, naming why.
    let (ok, said) = cli(&["events", "retry", "d", "--reason", "again"]);
    assert!(!ok, "{said}");
    assert!(said.contains("its body was erased"), "{said}");
    // In bulk: the erased one is not among the events a retry takes; the other dead one is.
    let (ok, said) = cli(&[
        "events",
        "retry",
        "--state",
        "dead",
        "--dry-run",
        "--reason",
        "r",
    ]);
    assert!(ok, "{said}");
    assert!(said.contains("1 events would be retried"), "{said}");
    assert!(!said.contains("d: would"), "{said}");
    // From the console: 409 with the reason.
    let console =
        crate::harness::console::TestConsole::start(&db, crate::harness::console::settings()).await;
    let ann = console.login("ann").await;
    let token = ann.csrf("/events/d").await;
    let form = [("csrf_token", token.as_str()), ("reason", "again")];
    let answer = ann.post("/events/d/retry", &form).await;
    assert_eq!(answer.status, 409, "{}", answer.body);
    assert!(
        answer.body.contains("its body was erased"),
        "{}",
        answer.body
    );
    let bulk = [
        ("csrf_token", token.as_str()),
        ("reason", "again"),
        ("keys", "d"),
    ];
    let answer = ann.post("/events/retry", &bulk).await;
    assert!(
        answer.body.contains("its body was erased"),
        "{}",
        answer.body
    );
    let (state, payload): (String, Vec<u8>) =
        sqlx::query_as("SELECT state, payload FROM outbox WHERE event_key = 'd'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), payload.len()), ("dead", 0));
    assert_eq!(
        db.count("SELECT count(*) FROM operator_actions WHERE action = 'retry'")
            .await,
        0
    );
}

//! An operator's pauses, through the binaries: a paused destination receives nothing while its
//! operations wait without spending attempts, and gets each once when resumed or when its pause
//! ends by itself; the console's pause and resume forms, audited with the logged-in user.

use crate::harness::console::{settings, TestConsole};
use crate::harness::dispatcher::Downstream;
use crate::harness::*;
use std::process::Stdio;
use std::time::Duration;

/// `replayproof dispatch` over `db`, polling often; killed when dropped.
fn dispatch_process(db: &TestDb) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args(["dispatch", "--database-url", &db.url, "--poll-ms", "50"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env_remove("DATABASE_URL")
        .env_remove("REPLAYPROOF_CONFIG")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

/// `replayproof destinations ARGS…` over `db` as `ann`.
fn destinations(db: &TestDb, args: &[&str]) -> std::process::Output {
    replayproof()
        .arg("destinations")
        .args(args)
        .args(["--database-url", &db.url, "--actor", "ann"])
        .output()
        .unwrap()
}

/// `destinations list --json`, as values.
fn listed(db: &TestDb) -> Vec<serde_json::Value> {
    let out = destinations(db, &["list", "--json"]);
    assert!(out.status.success(), "{}", printed(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn origin_of(downstream: &Downstream) -> String {
    format!("http://{}", downstream.addr)
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Attempts recorded for `origin`'s operations, on the rows and in `outbox_attempts`.
async fn attempts_to(db: &TestDb, origin: &str) -> (i64, i64) {
    let on_rows: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(attempts), 0)::int8 FROM outbox WHERE origin = $1")
            .bind(origin)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let recorded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox_attempts a JOIN outbox o ON o.id = a.outbox_id \
         WHERE o.origin = $1",
    )
    .bind(origin)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (on_rows, recorded)
}

async fn audits(db: &TestDb) -> Vec<(String, String, String, String)> {
    sqlx::query_as("SELECT actor, action, target, reason FROM operator_actions ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// Waits until every key of `keys` was received by `downstream`.
async fn delivered(downstream: &Downstream, keys: &[String]) {
    wait_for(
        "every operation delivered",
        Duration::from_secs(60),
        || async {
            let applied = downstream.applied();
            keys.iter()
                .all(|k| applied.contains_key(&format!("{k}#deliver")))
        },
    )
    .await;
}

fn assert_each_once(downstream: &Downstream, keys: &[String]) {
    for k in keys {
        let op = format!("{k}#deliver");
        assert_eq!(downstream.requests(&op), 1, "{op} was sent once");
        assert_eq!(downstream.applied().get(&op), Some(&1), "{op} applied once");
    }
}

#[tokio::test]
async fn a_paused_destination_receives_nothing_while_its_operations_wait_then_each_once_on_resume()
{
    let db = TestDb::new().await;
    let (paused, running) = (Downstream::start().await, Downstream::start().await);
    let (held, flowing) = (keys("evt-held", 5), keys("evt-flowing", 3));
    enqueue_http(&db, &paused, &held, false).await;
    let origin = origin_of(&paused);
    // Any URL of the destination names it: its origin is what is paused.
    let out = destinations(
        &db,
        &["pause", &paused.url(), "--reason", "provider maintenance"],
    );
    assert!(out.status.success(), "{}", printed(&out));
    assert!(printed(&out).contains("paused"), "{}", printed(&out));

    let _dispatch = dispatch_process(&db);
    enqueue_http(&db, &running, &flowing, false).await;
    delivered(&running, &flowing).await;
    // The dispatcher has had many turns since: the paused destination still got nothing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for k in &held {
        assert_eq!(paused.requests(&format!("{k}#deliver")), 0, "{k}");
    }
    assert_eq!(attempts_to(&db, &origin).await, (0, 0), "no attempt spent");
    let waiting = db
        .count(
            "SELECT count(*) FROM outbox WHERE state = 'pending' AND event_key LIKE 'evt-held-%'",
        )
        .await;
    assert_eq!(waiting, 5, "its operations wait, due");

    let list = listed(&db);
    let row = list
        .iter()
        .find(|d| d["origin"] == origin.as_str())
        .unwrap();
    assert_eq!(row["pause"]["by"], "ann", "{row}");
    assert_eq!(row["pause"]["reason"], "provider maintenance");
    assert!(row["pause"]["until"].is_null());
    assert_eq!(row["backlog"], 5);
    let other = list
        .iter()
        .find(|d| d["origin"] == origin_of(&running).as_str())
        .unwrap();
    assert!(other["pause"].is_null(), "{other}");
    let table = destinations(&db, &["list"]);
    assert!(
        printed(&table).contains("paused by ann"),
        "{}",
        printed(&table)
    );

    let out = destinations(&db, &["resume", &origin, "--reason", "maintenance over"]);
    assert!(out.status.success(), "{}", printed(&out));
    delivered(&paused, &held).await;
    assert_each_once(&paused, &held);
    assert_each_once(&running, &flowing);

    let again = destinations(&db, &["resume", &origin, "--reason", "twice"]);
    assert!(!again.status.success());
    assert!(
        printed(&again).contains("is not paused"),
        "{}",
        printed(&again)
    );
    let target = format!("destination:{origin}");
    let expected = [
        ("pause", "provider maintenance"),
        ("resume", "maintenance over"),
    ]
    .map(|(action, reason)| {
        (
            "ann".to_owned(),
            action.to_owned(),
            target.clone(),
            reason.to_owned(),
        )
    });
    assert_eq!(
        audits(&db).await,
        expected,
        "one audit row each, the refusal none"
    );
    assert!(listed(&db).iter().all(|d| d["pause"].is_null()));
}

#[tokio::test]
async fn a_pause_with_until_ends_by_itself() {
    let db = TestDb::new().await;
    let (paused, running) = (Downstream::start().await, Downstream::start().await);
    let (held, flowing) = (keys("evt-until", 3), keys("evt-other", 1));
    enqueue_http(&db, &paused, &held, false).await;
    let origin = origin_of(&paused);
    let out = destinations(
        &db,
        &["pause", &origin, "--reason", "deploy", "--until", "6s"],
    );
    assert!(out.status.success(), "{}", printed(&out));
    let row = listed(&db)
        .into_iter()
        .find(|d| d["origin"] == origin.as_str())
        .unwrap();
    assert!(row["pause"]["until"].is_string(), "{row}");

    let _dispatch = dispatch_process(&db);
    enqueue_http(&db, &running, &flowing, false).await;
    delivered(&running, &flowing).await;
    let still_paused = db
        .count("SELECT count(*) FROM outbox_destinations WHERE operator_pause_until > now()")
        .await;
    assert_eq!(still_paused, 1, "checked while the pause holds");
    for k in &held {
        assert_eq!(paused.requests(&format!("{k}#deliver")), 0, "{k}");
    }
    assert_eq!(attempts_to(&db, &origin).await, (0, 0));

    // No resume: the pause ends by itself and each operation goes once.
    delivered(&paused, &held).await;
    assert_each_once(&paused, &held);
    let row = listed(&db)
        .into_iter()
        .find(|d| d["origin"] == origin.as_str())
        .unwrap();
    assert!(row["pause"].is_null(), "an ended pause is not shown: {row}");
    let refused = destinations(&db, &["resume", &origin, "--reason", "late"]);
    assert!(
        printed(&refused).contains("is not paused"),
        "{}",
        printed(&refused)
    );
    assert_eq!(audits(&db).await.len(), 1, "the pause only");
}

#[tokio::test]
async fn the_overview_pauses_and_resumes_a_destination_audited_with_the_user() {
    let db = TestDb::new().await;
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let origin = "https://api.example.com";
    let token = ann.csrf("/").await;
    let pause = [
        ("csrf_token", token.as_str()),
        ("origin", "https://api.example.com/v1/charges"),
        ("reason", "their incident"),
        ("until", "2h"),
    ];
    let answer = ann.post("/destinations/pause", &pause).await;
    assert_eq!(answer.status, 303, "{}", answer.body);
    assert_eq!(answer.location.as_deref(), Some("/"));
    let page = ann.get("/").await;
    assert!(page.body.contains("paused-destinations"), "{}", page.body);
    assert!(page.body.contains(origin));
    assert!(page.body.contains("their incident"));
    let (by, until_set): (String, bool) = sqlx::query_as(
        "SELECT operator_paused_by, operator_pause_until > now() + interval '1 hour' \
         FROM outbox_destinations WHERE origin = $1",
    )
    .bind(origin)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((by.as_str(), until_set), ("ann", true));

    let bad = ann
        .post(
            "/destinations/pause",
            &[
                ("csrf_token", &token),
                ("origin", "stripe"),
                ("reason", "x"),
            ],
        )
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let resume = [
        ("csrf_token", token.as_str()),
        ("origin", origin),
        ("reason", "fixed"),
    ];
    let answer = ann.post("/destinations/resume", &resume).await;
    assert_eq!(answer.status, 303, "{}", answer.body);
    let page = ann.get("/").await;
    assert!(
        page.body.contains("No destination is paused."),
        "{}",
        page.body
    );
    let target = format!("destination:{origin}");
    let expected = [("pause", "their incident"), ("resume", "fixed")]
        .map(|(a, r)| ("ann".to_owned(), a.to_owned(), target.clone(), r.to_owned()));
    assert_eq!(audits(&db).await, expected);
    let again = ann.post("/destinations/resume", &resume).await;
    assert_eq!(again.status, 409, "{}", again.body);
}

#[tokio::test]
async fn the_overview_pauses_and_resumes_a_source_audited_with_the_user() {
    let db = TestDb::new().await;
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let token = ann.csrf("/").await;
    let page = ann.get("/").await;
    assert!(page.body.contains("No source is paused."), "{}", page.body);
    let pause = [
        ("csrf_token", token.as_str()),
        ("source", "stripe"),
        ("reason", "their incident"),
    ];
    let answer = ann.post("/sources/pause", &pause).await;
    assert_eq!(answer.status, 303, "{}", answer.body);
    let page = ann.get("/").await;
    assert!(page.body.contains("paused-sources"), "{}", page.body);
    assert!(page.body.contains("their incident"));
    let by: String =
        sqlx::query_scalar("SELECT paused_by FROM source_pauses WHERE source = 'stripe'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(by, "ann");
    let blank = [
        ("csrf_token", token.as_str()),
        ("source", " "),
        ("reason", "x"),
    ];
    assert_eq!(ann.post("/sources/pause", &blank).await.status, 400);
    let resume = [
        ("csrf_token", token.as_str()),
        ("source", "stripe"),
        ("reason", "fixed"),
    ];
    let answer = ann.post("/sources/resume", &resume).await;
    assert_eq!(answer.status, 303, "{}", answer.body);
    assert!(ann.get("/").await.body.contains("No source is paused."));
    let target = "source:stripe".to_owned();
    let expected = [("pause", "their incident"), ("resume", "fixed")]
        .map(|(a, r)| ("ann".to_owned(), a.to_owned(), target.clone(), r.to_owned()));
    assert_eq!(audits(&db).await, expected);
    assert_eq!(ann.post("/sources/resume", &resume).await.status, 409);
}

//! The console over HTTP: the login wall on every route, roles, CSRF, actions the state forbids,
//! the audit rows, searching and paging, and an event's story.

use crate::harness::console::{settings, TestConsole};
use crate::harness::dispatcher::Downstream;
use crate::harness::{TestDb, TestKafka};
use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::effect::{HttpOutbox, Ledger};
use serde_json::json;
use std::sync::Arc;

use crate::harness::operator::{message, operations_in, process};

async fn op_state(db: &TestDb, key: &str) -> String {
    sqlx::query_scalar("SELECT state FROM outbox WHERE event_key = $1")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn audits(db: &TestDb) -> Vec<(String, String, String, String)> {
    sqlx::query_as("SELECT actor, action, target, reason FROM operator_actions ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// Every route a logged-in user can reach, read and act.
const PAGES: &[&str] = &[
    "/",
    "/events",
    "/events?state=failed",
    "/events/f",
    "/events/retry?state=failed",
    "/dead-letters",
    "/dead-letters/1",
    "/dead-letters/replay",
    "/expired",
    "/replay",
    "/no-such-page",
];
const ACTIONS: &[&str] = &[
    "/events/f/retry",
    "/events/f/resolve",
    "/events/retry",
    "/dead-letters/1/replay",
    "/dead-letters/replay",
    "/replay",
    "/destinations/pause",
    "/destinations/resume",
    "/sources/pause",
    "/sources/resume",
];

#[tokio::test]
async fn without_a_session_every_route_but_login_and_the_stylesheet_redirects_to_login() {
    let db = TestDb::new().await;
    operations_in(&db, &[("f", "failed")]).await;
    let console = TestConsole::start(&db, settings()).await;
    let nobody = console.anonymous();
    let mut forged = console.anonymous();
    forged.cookie = Some(r#"replayproof_session={"u":"ann","s":"00","e":99999999999}"#.into());
    for client in [&nobody, &forged] {
        for path in PAGES {
            let answer = client.get(path).await;
            assert_eq!(answer.status, 303, "GET {path}");
            assert_eq!(answer.location.as_deref(), Some("/login"), "GET {path}");
            assert!(answer.body.is_empty(), "GET {path} said {}", answer.body);
        }
        for path in ACTIONS {
            let answer = client
                .post(path, &[("reason", "x"), ("csrf_token", "00")])
                .await;
            assert_eq!(answer.status, 303, "POST {path}");
            assert_eq!(answer.location.as_deref(), Some("/login"), "POST {path}");
        }
    }
    assert_eq!(op_state(&db, "f").await, "failed");
    assert!(audits(&db).await.is_empty());
    assert_eq!(nobody.get("/login").await.status, 200);
    let css = nobody.get("/static/console.css").await;
    assert_eq!(css.status, 200);
    assert!(css.body.contains("timeline"));
}

#[tokio::test]
async fn a_login_needs_the_right_password_and_too_many_attempts_are_429() {
    let db = TestDb::new().await;
    let mut s = settings();
    s.logins_per_minute = 3;
    let console = TestConsole::start(&db, s).await;
    let client = console.anonymous();
    let wrong = client
        .post("/login", &[("username", "ann"), ("password", "nope")])
        .await;
    assert_eq!(wrong.status, 401);
    assert!(wrong.set_cookie.is_none());
    assert!(wrong.body.contains("Wrong user or password"));
    let unknown = client
        .post("/login", &[("username", "mallory"), ("password", "x")])
        .await;
    assert_eq!(unknown.status, 401);
    assert!(
        unknown.body.contains("Wrong user or password"),
        "no hint that the user is unknown"
    );
    // The third attempt from this address is the last allowed; the fourth is refused, even
    // with the right password.
    assert_eq!(
        client
            .post("/login", &[("username", "ann"), ("password", "nope")])
            .await
            .status,
        401
    );
    let limited = client
        .post("/login", &[("username", "ann"), ("password", "ann-pass")])
        .await;
    assert_eq!(limited.status, 429);
    assert!(limited.set_cookie.is_none());
}

#[tokio::test]
async fn a_viewer_reads_every_page_but_each_action_is_403_and_changes_nothing() {
    let db = TestDb::new().await;
    operations_in(&db, &[("f", "failed")]).await;
    let payload = json!({"card": "visible-to-operators-only"});
    process(&db, Arc::new(Ledger), &[message(9, "l", payload)]).await;
    let console = TestConsole::start(&db, settings()).await;
    let vic = console.login("vic").await;
    let story = vic.get("/events/f").await;
    assert_eq!(story.status, 200);
    assert!(
        story.body.contains("operation deliver: failed"),
        "{}",
        story.body
    );
    assert!(
        !story.body.contains("id=\"retry\""),
        "no action offered to a viewer"
    );
    let ledger = vic.get("/events/l").await;
    assert!(
        !ledger.body.contains("visible-to-operators-only"),
        "no payload for a viewer"
    );
    assert!(ledger.body.contains("Payloads are shown to operators only"));
    let ann = console.login("ann").await;
    assert!(ann
        .get("/events/l")
        .await
        .body
        .contains("visible-to-operators-only"));
    for path in ["/", "/events", "/dead-letters", "/expired"] {
        assert_eq!(vic.get(path).await.status, 200, "{path}");
    }
    let token = vic.csrf("/").await;
    for path in ACTIONS {
        let answer = vic
            .post(
                path,
                &[
                    ("reason", "x"),
                    ("csrf_token", &token),
                    ("as", "done"),
                    ("keys", "f"),
                    ("ids", "1"),
                ],
            )
            .await;
        assert_eq!(answer.status, 403, "POST {path}: {}", answer.body);
    }
    for path in [
        "/events/retry?state=failed",
        "/dead-letters/replay",
        "/replay",
    ] {
        assert_eq!(vic.get(path).await.status, 403, "{path}");
    }
    assert_eq!(op_state(&db, "f").await, "failed");
    assert!(audits(&db).await.is_empty());

    // Unless the configuration shows payloads to viewers.
    let mut s = settings();
    s.show_payloads_to_viewers = true;
    let console = TestConsole::start(&db, s).await;
    let story = console.login("vic").await.get("/events/l").await;
    assert!(
        story.body.contains("visible-to-operators-only"),
        "{}",
        story.body
    );
}

#[tokio::test]
async fn an_action_without_this_session_s_csrf_token_is_refused_and_changes_nothing() {
    let db = TestDb::new().await;
    operations_in(&db, &[("f", "failed")]).await;
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let other_session = console.login("ann").await.csrf("/").await;
    for token in [None, Some(""), Some("00"), Some(other_session.as_str())] {
        let mut form = vec![("reason", "fixed")];
        if let Some(t) = token {
            form.push(("csrf_token", t));
        }
        let answer = ann.post("/events/f/retry", &form).await;
        assert_eq!(answer.status, 403, "token {token:?}");
        assert!(answer.body.contains("CSRF"));
    }
    // Without a reason: 400.
    let token = ann.csrf("/events/f").await;
    let answer = ann.post("/events/f/retry", &[("csrf_token", &token)]).await;
    assert_eq!(answer.status, 400);
    assert_eq!(op_state(&db, "f").await, "failed");
    assert!(audits(&db).await.is_empty());
}

#[tokio::test]
async fn an_action_the_state_forbids_is_refused_and_changes_nothing() {
    let db = TestDb::new().await;
    operations_in(&db, &[("ok", "done"), ("p", "pending")]).await;
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let token = ann.csrf("/").await;
    let story = ann.get("/events/ok").await;
    assert!(
        !story.body.contains("id=\"retry\""),
        "a done event offers no retry"
    );
    assert!(!story.body.contains("id=\"resolve\""), "nor a resolve");
    let form = [
        ("csrf_token", token.as_str()),
        ("reason", "again"),
        ("as", "dead"),
    ];
    let done = ann.post("/events/ok/retry", &form).await;
    assert_eq!(done.status, 409, "{}", done.body);
    assert!(done.body.contains("is done"), "{}", done.body);
    assert_eq!(ann.post("/events/ok/resolve", &form).await.status, 409);
    assert_eq!(ann.post("/events/p/retry", &form).await.status, 409);
    assert_eq!(ann.post("/events/missing/retry", &form).await.status, 404);
    assert_eq!(
        ann.post("/dead-letters/999/replay", &form).await.status,
        409,
        "no broker configured"
    );
    assert_eq!(op_state(&db, "ok").await, "done");
    assert_eq!(op_state(&db, "p").await, "pending");
    assert!(audits(&db).await.is_empty());
}

#[tokio::test]
async fn each_action_writes_its_audit_row_with_the_logged_in_user() {
    let db = TestDb::new().await;
    operations_in(&db, &[("f", "failed"), ("u", "uncertain"), ("d", "dead")]).await;
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    // Two dead letters: not envelopes.
    let bad = |offset: i64| RawMessage {
        offset,
        key: Some(b"junk".to_vec()),
        value: Some(format!("not json {offset}").into_bytes()),
        traceparent: None,
        headers: [("ce_id", format!("evt-{offset}"))].into_iter().collect(),
    };
    BatchProcessor::new(db.pool.clone(), Arc::new(Ledger))
        .process(&topic, 0, &[bad(10), bad(11)])
        .await
        .unwrap();
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM dead_letters ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut s = settings();
    s.kafka = Some(replayproof::operator::status::KafkaTarget {
        brokers: kafka.brokers(),
        topic: topic.clone(),
        group: "live".into(),
        options: vec![],
    });
    let console = TestConsole::start(&db, s).await;
    let ann = console.login("ann").await;
    let token = ann.csrf("/events/f").await;
    // A dead letter's raw bytes, as text and hex, to an operator only.
    let letter = ann.get(&format!("/dead-letters/{}", ids[0])).await;
    assert!(letter.body.contains("not json 10"), "{}", letter.body);
    assert!(
        letter.body.contains("<th>ce_id</th><td>evt-10</td>"),
        "its headers: {}",
        letter.body
    );
    assert!(
        letter.body.contains("6e 6f 74 20 6a 73 6f 6e"),
        "hex: {}",
        letter.body
    );
    let vic = console.login("vic").await;
    let hidden = vic.get(&format!("/dead-letters/{}", ids[0])).await;
    assert_eq!(hidden.status, 200);
    assert!(!hidden.body.contains("not json 10"), "{}", hidden.body);
    assert!(!hidden.body.contains("evt-10"), "{}", hidden.body);
    assert!(hidden
        .body
        .contains("Raw bytes are shown to operators only"));
    let listed = vic.get("/dead-letters?not_replayed=1").await;
    assert!(
        listed.body.contains(&format!("/dead-letters/{}", ids[1])),
        "{}",
        listed.body
    );

    let retried = ann
        .post(
            "/events/f/retry",
            &[("csrf_token", &token), ("reason", "downstream fixed")],
        )
        .await;
    assert_eq!(retried.status, 303, "{}", retried.body);
    assert_eq!(retried.location.as_deref(), Some("/events/f"));
    assert_eq!(op_state(&db, "f").await, "pending");

    let resolved = ann
        .post(
            "/events/u/resolve",
            &[
                ("csrf_token", &token),
                ("reason", "seen in their dashboard"),
                ("as", "done"),
            ],
        )
        .await;
    assert_eq!(resolved.status, 303, "{}", resolved.body);
    assert_eq!(op_state(&db, "u").await, "done");

    let one = ann
        .post(
            &format!("/dead-letters/{}/replay", ids[0]),
            &[("csrf_token", &token), ("reason", "parser fixed")],
        )
        .await;
    assert_eq!(one.status, 303, "{}", one.body);

    // In bulk: the preview names the one left, the form sends it.
    let preview = ann.get("/dead-letters/replay").await;
    assert!(
        preview
            .body
            .contains(&format!("name=\"ids\" value=\"{}\"", ids[1])),
        "{}",
        preview.body
    );
    assert!(
        !preview
            .body
            .contains(&format!("name=\"ids\" value=\"{}\"", ids[0])),
        "already replayed"
    );
    let many = ann
        .post(
            "/dead-letters/replay",
            &[
                ("csrf_token", &token),
                ("reason", "all of them"),
                ("ids", &ids[1].to_string()),
            ],
        )
        .await;
    assert_eq!(many.status, 200, "{}", many.body);
    assert!(
        many.body.contains("1 change(s), 0 refused"),
        "{}",
        many.body
    );

    let replayed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE replayed_at IS NOT NULL")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(replayed, 2);
    let audit = audits(&db).await;
    let expected = [
        ("retry", "f#deliver".to_owned(), "downstream fixed"),
        ("resolve", "u#deliver".to_owned(), "seen in their dashboard"),
        ("replay", format!("dead_letter:{}", ids[0]), "parser fixed"),
        ("replay", format!("dead_letter:{}", ids[1]), "all of them"),
    ];
    assert_eq!(audit.len(), expected.len(), "{audit:?}");
    for (row, (action, target, reason)) in audit.iter().zip(expected) {
        assert_eq!(
            (
                row.0.as_str(),
                row.1.as_str(),
                row.2.as_str(),
                row.3.as_str()
            ),
            ("ann", action, target.as_str(), reason)
        );
    }
    // The story shows the operator's action.
    let story = ann.get("/events/f").await;
    assert!(story.body.contains("operator retry: ann"), "{}", story.body);
    assert!(story.body.contains("downstream fixed"));
}

#[tokio::test]
async fn a_bulk_retry_previews_exactly_what_changes_and_retries_only_that() {
    let db = TestDb::new().await;
    operations_in(
        &db,
        &[
            ("f1", "failed"),
            ("f2", "failed"),
            ("d", "dead"),
            ("ok", "done"),
        ],
    )
    .await;
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let listed = ann.get("/events?state=failed").await;
    assert!(listed.body.contains("id=\"bulk-retry\""), "{}", listed.body);
    let preview = ann.get("/events/retry?state=failed").await;
    assert_eq!(preview.status, 200);
    assert!(
        preview.body.contains("2 event(s) would change"),
        "{}",
        preview.body
    );
    assert!(preview.body.contains("operation deliver: failed → pending"));
    assert!(
        !preview.body.contains("value=\"d\""),
        "a dead event is not in a search for failed ones"
    );
    assert_eq!(
        op_state(&db, "f1").await,
        "failed",
        "a preview changes nothing"
    );
    let token = ann.csrf("/").await;
    let done = ann
        .post(
            "/events/retry",
            &[
                ("csrf_token", &token),
                ("reason", "bulk"),
                ("keys", "f1"),
                ("keys", "f2"),
                ("keys", "ok"),
            ],
        )
        .await;
    assert_eq!(done.status, 200);
    assert!(
        done.body.contains("2 change(s), 1 refused"),
        "{}",
        done.body
    );
    assert_eq!(op_state(&db, "f1").await, "pending");
    assert_eq!(op_state(&db, "f2").await, "pending");
    assert_eq!(op_state(&db, "d").await, "dead");
    assert_eq!(op_state(&db, "ok").await, "done");
    assert_eq!(audits(&db).await.len(), 2);
}

/// The keys of the events on a page, in order.
fn keys_on(page: &str) -> Vec<String> {
    page.split("class=\"key\" href=\"/events/")
        .skip(1)
        .map(|rest| rest[..rest.find('"').unwrap()].to_owned())
        .collect()
}

fn next_link(page: &str) -> Option<String> {
    let at = page.find("id=\"next\" href=\"")?;
    let rest = &page[at + "id=\"next\" href=\"".len()..];
    Some(rest[..rest.find('"').unwrap()].replace("&amp;", "&"))
}

#[tokio::test]
async fn events_are_searched_by_key_state_and_time_and_paged_by_cursor() {
    let db = TestDb::new().await;
    let messages: Vec<_> = (0..120)
        .map(|i| message(i, &format!("evt:{i:03}"), json!({"i": i})))
        .collect();
    process(&db, Arc::new(Ledger), &messages).await;
    // Half an hour apart in two groups, to search by time.
    sqlx::query("UPDATE processed_events SET claimed_at = now() - interval '2 hours' WHERE event_key < 'evt:060'")
        .execute(&db.pool)
        .await
        .unwrap();
    let console = TestConsole::start(&db, settings()).await;
    let vic = console.login("vic").await;

    let mut seen = Vec::new();
    let mut path = Some("/events".to_owned());
    while let Some(p) = path {
        let page = vic.get(&p).await;
        assert_eq!(page.status, 200);
        seen.extend(keys_on(&page.body));
        path = next_link(&page.body);
    }
    let expected: Vec<String> = (0..120).rev().map(|i| format!("evt:{i:03}")).collect();
    assert_eq!(
        seen, expected,
        "every event once, newest first, across pages"
    );
    // The same through a prefix, which looks its few events up by key first.
    let mut by_prefix = Vec::new();
    let mut path = Some("/events?q=evt:*".to_owned());
    while let Some(p) = path {
        let page = vic.get(&p).await;
        by_prefix.extend(keys_on(&page.body));
        path = next_link(&page.body);
    }
    assert_eq!(by_prefix, expected, "the same order and pages by prefix");

    let exact = vic.get("/events?q=evt:007").await;
    assert_eq!(keys_on(&exact.body), ["evt:007"]);
    let prefix = vic.get("/events?q=evt:01*").await;
    assert_eq!(keys_on(&prefix.body).len(), 10);
    let recent = vic.get("/events?since=1h").await;
    assert_eq!(
        keys_on(&recent.body).len(),
        50,
        "a page of the 60 recent ones"
    );
    let old = vic.get("/events?until=1h").await;
    assert!(keys_on(&old.body).iter().all(|k| k.as_str() < "evt:060"));
    let none = vic.get("/events?state=failed").await;
    assert!(none.body.contains("No event matches"));
    let bad = vic.get("/events?since=yesterday").await;
    assert_eq!(bad.status, 400);
    let bad_cursor = vic.get("/events?after=zzz").await;
    assert_eq!(bad_cursor.status, 400);
}

#[tokio::test]
async fn an_event_s_story_has_its_message_claim_attempts_conflicts_and_dead_letters() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    // The destination carries a credential in its URL: never shown.
    let target = downstream
        .url()
        .replacen("http://", "http://user:hunter2secret@", 1);
    let http = HttpOutbox {
        target_url: target,
        reconcile_url: None,
        max_attempts: 3,
        operation_keys: Default::default(),
    };
    // A ledger row (which keeps the payload) and an operation.
    let effect = replayproof::effect::Registry::default()
        .build(&["ledger".into(), "http".into()], Some(&http))
        .unwrap();
    process(
        &db,
        effect,
        &[message(
            5,
            "stripe:evt_1",
            json!({"amount": 100, "currency": "eur"}),
        )],
    )
    .await;
    // Another payload under the same key: a conflict.
    process(
        &db,
        Arc::new(Ledger),
        &[message(
            6,
            "stripe:evt_1",
            json!({"amount": 999, "currency": "eur"}),
        )],
    )
    .await;
    // A message under the key that is no envelope: a dead letter of this key.
    let bad = RawMessage {
        offset: 7,
        key: Some(b"stripe:evt_1".to_vec()),
        value: Some(b"{not json".to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    process(&db, Arc::new(Ledger), &[bad]).await;
    // The first payload delivered again: a duplicate, the key's third delivery.
    let again = json!({"amount": 100, "currency": "eur"});
    process(&db, Arc::new(Ledger), &[message(8, "stripe:evt_1", again)]).await;
    // A recorded attempt, as a dispatcher writes it.
    sqlx::query(
        "INSERT INTO outbox_attempts (outbox_id, route_key, fencing_token, worker, kind, idempotency_key, payload_sha256, \
         started_at, duration_ms, status_code, error, outcome, applied, response_excerpt) \
         SELECT id, route_key, 41, 'dispatch-7', 'deliver', operation_key, '\\x00', now(), 123, 503, 'downstream 503', 'retryable', true, 'try later' \
         FROM outbox WHERE event_key = 'stripe:evt_1'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let console = TestConsole::start(&db, settings()).await;
    let ann = console.login("ann").await;
    let story = ann.get("/events/stripe:evt_1").await;
    assert_eq!(story.status, 200);
    let body = &story.body;
    for expected in [
        "received",
        "Kafka message",
        "webhooks/0@5",
        "claimed: ",
        "effect: ledger row",
        "operation deliver: pending",
        "attempt of deliver: retryable",
        "dispatch-7",
        "fencing token 41",
        "503",
        "123 ms",
        "try later",
        "key conflict",
        "class=\"del\"",
        "class=\"ins\"",
        "dead letter",
        "webhooks/0@7",
        "webhooks/0@6",
        "delivered 3 times, 2 suppressed as duplicates",
        "first delivered ",
    ] {
        assert!(
            body.contains(expected),
            "{expected:?} missing from the story: {body}"
        );
    }
    assert!(
        !body.contains("hunter2secret"),
        "a credential in a URL is never shown"
    );
    // Percent-encoded keys reach the same story.
    assert_eq!(ann.get("/events/stripe%3Aevt_1").await.status, 200);
    assert_eq!(ann.get("/events/stripe:evt_404").await.status, 404);
}

#[tokio::test]
async fn every_page_forbids_scripts_framing_and_caching() {
    let db = TestDb::new().await;
    let console = TestConsole::start(&db, settings()).await;
    let response = reqwest::get(format!("{}/login", console.base))
        .await
        .unwrap();
    let h = response.headers();
    assert!(h["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("default-src 'none'"));
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["cache-control"], "no-store");
    assert_eq!(h["x-content-type-options"], "nosniff");
}

#[tokio::test]
async fn a_trusted_proxy_s_header_names_the_user_and_anyone_else_s_is_ignored() {
    let db = TestDb::new().await;
    operations_in(&db, &[("f", "failed")]).await;
    let header = |trusted: &str| {
        let mut s = settings();
        s.auth_header = Some("X-Forwarded-User".into());
        s.trusted_proxies = vec![trusted.parse().unwrap()];
        s
    };
    let behind = TestConsole::start(&db, header("127.0.0.1")).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let get = |base: String, user: &'static str| {
        let http = http.clone();
        async move {
            let r = http
                .get(format!("{base}/events/f"))
                .header("X-Forwarded-User", user)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, page) = get(behind.base.clone(), "ann").await;
    assert_eq!(status, 200);
    assert!(page.contains("ann (operator)"), "{page}");
    assert!(
        page.contains("id=\"retry\""),
        "an operator through the proxy may act"
    );
    let (status, _) = get(behind.base.clone(), "mallory").await;
    assert_eq!(
        status, 403,
        "the proxy names someone who is not a console user"
    );
    // From an address that is not the proxy's, the header is nobody.
    let elsewhere = TestConsole::start(&db, header("10.9.8.7")).await;
    let (status, page) = get(elsewhere.base.clone(), "ann").await;
    assert_eq!(status, 303, "{page}");
}

#[tokio::test]
async fn a_session_cookie_is_secure_behind_tls_and_logging_out_removes_it() {
    let db = TestDb::new().await;
    let mut s = settings();
    s.trusted_proxies = vec!["127.0.0.1".parse().unwrap()];
    let console = TestConsole::start(&db, s).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = |proto: &'static str| {
        let http = http.clone();
        let base = console.base.clone();
        async move {
            let r = http
                .post(format!("{base}/login"))
                .header("X-Forwarded-Proto", proto)
                .form(&[("username", "ann"), ("password", "ann-pass")])
                .send()
                .await
                .unwrap();
            r.headers()["set-cookie"].to_str().unwrap().to_owned()
        }
    };
    assert!(login("https").await.contains("Secure"), "behind TLS");
    assert!(!login("http").await.contains("Secure"), "plain HTTP");
    let ann = console.login("ann").await;
    let out = ann.post("/logout", &[]).await;
    assert_eq!(out.status, 303);
    assert_eq!(out.location.as_deref(), Some("/login"));
    let removed = out.set_cookie.expect("the cookie is removed");
    assert!(removed.starts_with("replayproof_session=;"), "{removed}");
    assert!(
        removed.contains("Max-Age=0") || removed.contains("1970"),
        "{removed}"
    );
}

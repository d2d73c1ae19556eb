//! Effect errors (a claim's last error, an attempt's error, a deferral's reason, a dead
//! letter's reason) often quote payload values: they are shown as payloads are, to operators,
//! and to viewers only when `show_payloads_to_viewers` says so.

use crate::harness::console::{settings, TestConsole};
use crate::harness::operator::{operations_in, TOPIC};
use crate::harness::TestDb;
use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::effect::Ledger;
use std::sync::Arc;

/// The texts each error field holds, each quoting a payload value.
const SECRETS: &[&str] = &[
    "card 4242-last-error declined",
    "waiting for 4242-deferred",
    "downstream said 4242-attempt-error",
    "PostgreSQL refused 4242-letter-reason",
];

/// Event `f` with an operation, its claim's last error and deferral reason, an attempt's error,
/// and a dead letter under its key; returns the dead letter's id.
async fn errors_quoting_payloads(db: &TestDb) -> i64 {
    operations_in(db, &[("f", "failed")]).await;
    let claim = "UPDATE processed_events SET last_error = $1, deferred_reason = $2 \
                 WHERE event_key = 'f'";
    sqlx::query(claim)
        .bind(SECRETS[0])
        .bind(SECRETS[1])
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO outbox_attempts (outbox_id, fencing_token, worker, kind, idempotency_key, \
           payload_sha256, started_at, duration_ms, status_code, error, outcome, applied, \
           route_key) \
         SELECT id, 1, 'w1', 'deliver', 'k', '\\x00'::bytea, now(), 5, 500, $1, 'retryable', \
           true, route_key FROM outbox WHERE event_key = 'f'",
    )
    .bind(SECRETS[2])
    .execute(&db.pool)
    .await
    .unwrap();
    let bad = RawMessage {
        offset: 50,
        key: Some(b"f".to_vec()),
        value: Some(b"not json".to_vec()),
        traceparent: None,
        headers: Default::default(),
    };
    BatchProcessor::new(db.pool.clone(), Arc::new(Ledger))
        .process(TOPIC, 0, &[bad])
        .await
        .unwrap();
    sqlx::query_scalar("UPDATE dead_letters SET reason = $1 RETURNING id")
        .bind(SECRETS[3])
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// What each page a user can read shows, together.
async fn pages_of(client: &crate::harness::console::Client, letter: i64) -> String {
    let mut all = String::new();
    for path in [
        "/".to_owned(),
        "/events".to_owned(),
        "/events/f".to_owned(),
        "/dead-letters".to_owned(),
        format!("/dead-letters/{letter}"),
    ] {
        let page = client.get(&path).await;
        assert_eq!(page.status, 200, "{path}: {}", page.body);
        all.push_str(&page.body);
    }
    all
}

#[tokio::test]
async fn a_viewer_sees_no_effect_error_an_operator_sees() {
    let db = TestDb::new().await;
    let letter = errors_quoting_payloads(&db).await;
    let console = TestConsole::start(&db, settings()).await;
    let operator = pages_of(&console.login("ann").await, letter).await;
    let viewer = pages_of(&console.login("vic").await, letter).await;
    for secret in SECRETS {
        assert!(operator.contains(secret), "an operator sees {secret:?}");
        assert!(!viewer.contains(secret), "a viewer does not see {secret:?}");
    }
    // Nor does searching the reasons tell a viewer what they hold.
    let vic = console.login("vic").await;
    let probe = vic
        .get("/dead-letters?reason_like=%25letter-reason%25")
        .await;
    assert_eq!(probe.status, 403, "{}", probe.body);
    assert!(!probe.body.contains(SECRETS[3]), "{}", probe.body);
    // Unless the configuration shows payloads to viewers.
    let mut s = settings();
    s.show_payloads_to_viewers = true;
    let console = TestConsole::start(&db, s).await;
    let viewer = pages_of(&console.login("vic").await, letter).await;
    for secret in SECRETS {
        assert!(viewer.contains(secret), "shown to viewers: {secret:?}");
    }
    let vic = console.login("vic").await;
    let search = vic
        .get("/dead-letters?reason_like=%25letter-reason%25")
        .await;
    assert_eq!(search.status, 200, "{}", search.body);
    assert!(search.body.contains(SECRETS[3]), "{}", search.body);
}

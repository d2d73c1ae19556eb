//! The outbox and its dispatchers against a fake downstream that counts side effects per
//! idempotency key and misbehaves on demand.

use crate::harness::dispatcher::{Behaviour, Downstream};
use crate::harness::{enqueue_http, wait_for, TestDb};
use replayproof::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use replayproof::outbox;
use std::collections::HashSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(90);

fn settings(worker: &str) -> DispatchSettings {
    DispatchSettings {
        batch_size: 16,
        lease: Duration::from_secs(10),
        request_timeout: Duration::from_millis(400),
        poll_interval: Duration::from_millis(20),
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        ..DispatchSettings::new(worker)
    }
}

/// Dispatchers running in this process until stopped.
struct Dispatchers(CancellationToken, Vec<replayproof::dispatch::Running>);

impl Dispatchers {
    fn start(db: &TestDb, n: usize, settings: impl Fn(usize) -> DispatchSettings) -> Self {
        let token = CancellationToken::new();
        let tasks = (0..n)
            .map(|i| {
                let metrics = DispatchMetrics::new(&prometheus::Registry::new()).unwrap();
                let d = Dispatcher::build(
                    settings(i),
                    db.pool.clone(),
                    metrics,
                    replayproof::telemetry::Health::default(),
                )
                .unwrap();
                d.run_until_stopped(token.clone())
            })
            .collect();
        Self(token, tasks)
    }

    async fn stop(self) {
        self.0.cancel();
        for t in self.1 {
            t.stopped().await.unwrap();
        }
    }
}

async fn unsettled(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM outbox WHERE state NOT IN ('done', 'failed', 'dead')")
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storm_settles_with_one_side_effect_per_event_and_one_key_and_payload_per_operation() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let keys: Vec<String> = (0..150).map(|i| format!("evt-{i}")).collect();
    let mut rng = fastrand::Rng::with_seed(11);
    let refused: HashSet<String> = keys
        .iter()
        .step_by(15)
        .map(|k| outbox::operation_key(k, "deliver"))
        .collect();
    for k in &keys {
        let op = outbox::operation_key(k, "deliver");
        if refused.contains(&op) {
            downstream.script(&op, &[Behaviour::Refuse(500), Behaviour::Refuse(422)]);
            continue;
        }
        let choices = [
            Behaviour::ApplyThenDrop,
            Behaviour::Refuse(500),
            Behaviour::Refuse(429),
            Behaviour::Refuse(409),
            Behaviour::Hang,
            Behaviour::Ok,
        ];
        let script: Vec<Behaviour> = (0..rng.usize(0..4))
            .map(|_| choices[rng.usize(..choices.len())])
            .collect();
        downstream.script(&op, &script);
    }
    enqueue_http(&db, &downstream, &keys, false).await;
    let dispatchers = Dispatchers::start(&db, 3, |i| settings(&format!("worker-{i}")));
    wait_for("the outbox to settle", WAIT, || async {
        unsettled(&db).await == 0
    })
    .await;
    dispatchers.stop().await;

    let applied = downstream.applied();
    let bodies = downstream.bodies();
    let payloads: Vec<(String, Vec<u8>, String)> =
        sqlx::query_as("SELECT operation_key, payload, state FROM outbox")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(payloads.len(), keys.len());
    for (op, payload, state) in &payloads {
        if refused.contains(op) {
            assert_eq!(state, "failed", "{op}");
            assert_eq!(
                applied.get(op),
                None,
                "{op} was refused and must have no side effect"
            );
        } else {
            assert_eq!(state, "done", "{op}");
            assert_eq!(
                applied.get(op),
                Some(&1),
                "{op} must have exactly one side effect"
            );
        }
        // Every attempt carried this operation's key (how the bodies are filed) and its bytes.
        assert!(
            bodies[op].iter().all(|b| b == payload),
            "{op} was sent with another payload"
        );
    }
    assert_eq!(downstream.unkeyed(), 0);
    assert_eq!(
        downstream.max_in_flight(),
        1,
        "one operation was sent twice at once"
    );
    let keys_per_op: i64 = db
        .count("SELECT count(*) FROM (SELECT outbox_id FROM outbox_attempts GROUP BY outbox_id HAVING count(DISTINCT idempotency_key) > 1 OR count(DISTINCT payload_sha256) > 1) x")
        .await;
    assert_eq!(keys_per_op, 0);
    let kept: i64 = db.count("SELECT count(*) FROM outbox WHERE state = 'failed' AND last_status = 422 AND last_response IS NOT NULL").await;
    assert_eq!(kept as usize, refused.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_leases_never_share_a_row() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let keys: Vec<String> = (0..600).map(|i| format!("evt-{i}")).collect();
    enqueue_http(&db, &downstream, &keys, false).await;
    let leasers: Vec<_> = (0..3)
        .map(|w| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                loop {
                    let got = outbox::lease(&pool, &format!("w{w}"), 7, Duration::from_secs(60))
                        .await
                        .unwrap();
                    if got.is_empty() {
                        return mine;
                    }
                    mine.extend(got.into_iter().map(|l| l.id));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for l in leasers {
        all.extend(l.await.unwrap());
    }
    let distinct: HashSet<i64> = all.iter().copied().collect();
    assert_eq!(all.len(), 600, "every row leased once");
    assert_eq!(
        distinct.len(),
        600,
        "no row leased twice under a live lease"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncertain_outcome_is_reconciled_without_resending() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let op = outbox::operation_key("evt-r", "deliver");
    downstream.script(&op, &[Behaviour::ApplyThenDrop]);
    enqueue_http(&db, &downstream, &["evt-r".to_owned()], true).await;
    let dispatchers = Dispatchers::start(&db, 1, |_| settings("w"));
    wait_for("settled", WAIT, || async { unsettled(&db).await == 0 }).await;
    dispatchers.stop().await;
    let seen: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT outcome, error FROM outbox_attempts ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        downstream.bodies()[&op].len(),
        1,
        "the operation was sent once: {seen:?}"
    );
    assert_eq!(downstream.reconciles(), 1);
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM outbox_attempts ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(outcomes, ["uncertain", "reconciled_done"]);

    // Where the downstream does not have it (404), the same key is sent again.
    let op = outbox::operation_key("evt-s", "deliver");
    downstream.script(&op, &[Behaviour::Hang]);
    enqueue_http(&db, &downstream, &["evt-s".to_owned()], true).await;
    sqlx::query("UPDATE outbox SET state = 'uncertain' WHERE operation_key = $1")
        .bind(&op)
        .execute(&db.pool)
        .await
        .unwrap();
    let dispatchers = Dispatchers::start(&db, 1, |_| settings("w"));
    wait_for("settled", WAIT, || async { unsettled(&db).await == 0 }).await;
    dispatchers.stop().await;
    assert_eq!(downstream.applied()[&op], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_taken_over_makes_the_stale_completion_change_nothing() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    enqueue_http(&db, &downstream, &["evt-1".to_owned()], false).await;
    let first = outbox::lease(&db.pool, "gone", 10, Duration::from_millis(200))
        .await
        .unwrap()
        .remove(0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = outbox::lease(&db.pool, "next", 10, Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    assert_eq!(second.previous_state, outbox::OutboxState::InProgress);
    assert!(second.fencing_token > first.fencing_token);
    let attempt = |w| outbox::Attempt {
        worker: w,
        kind: outbox::AttemptKind::Deliver,
        started_at: chrono::Utc::now(),
        duration: Duration::ZERO,
        outcome: outbox::Outcome::Done,
    };
    let settle = |state| outbox::Settlement {
        state,
        next_attempt_at: None,
        status: Some(200),
        error: None,
        response: None,
        maybe_applied_since: None,
        idempotent_until: None,
        held: false,
    };
    assert!(outbox::complete(
        &db.pool,
        &second,
        &settle(outbox::OutboxState::Done),
        &attempt("next")
    )
    .await
    .unwrap());
    assert!(!outbox::complete(
        &db.pool,
        &first,
        &settle(outbox::OutboxState::Failed),
        &attempt("gone")
    )
    .await
    .unwrap());
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE state = 'done'")
            .await,
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox_attempts WHERE NOT applied")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_are_retryable_and_retry_after_is_honoured() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let op = outbox::operation_key("evt-429", "deliver");
    downstream.script(&op, &[Behaviour::Refuse(429)]);
    enqueue_http(&db, &downstream, &["evt-429".to_owned()], false).await;
    // An operation whose destination refuses connections: nothing was sent.
    sqlx::query(
        "INSERT INTO processed_events (event_key, route_key, source, status, payload_sha256, payload, kafka_topic, kafka_partition, kafka_offset) \
         VALUES ('evt-closed', 'evt-closed', 's', 'done', decode(repeat('00', 32), 'hex'), '{}', 't', 0, 99)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (_reserved, closed) = crate::harness::refusing_address();
    sqlx::query(
        "INSERT INTO outbox (operation_key, event_key, route_key, operation, destination, origin, payload) \
         VALUES ('evt-closed#deliver', 'evt-closed', 'evt-closed', 'deliver', $1, $2, '\\x7b7d')",
    )
    .bind(format!("http://{closed}/ops"))
    .bind(format!("http://{closed}"))
    .execute(&db.pool)
    .await
    .unwrap();

    let registry = prometheus::Registry::new();
    let d = Dispatcher::build(
        settings("w"),
        db.pool.clone(),
        DispatchMetrics::new(&registry).unwrap(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    assert_eq!(d.dispatch_once().await.unwrap(), 2);
    let rows: Vec<(String, String, f64, Option<i32>)> = sqlx::query_as(
        "SELECT event_key, state, extract(epoch FROM next_attempt_at - updated_at)::float8, last_status \
         FROM outbox ORDER BY event_key",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (rows[0].0.as_str(), rows[0].1.as_str(), rows[0].3),
        ("evt-429", "retryable", Some(429))
    );
    // Counted from the attempt's start, on the dispatcher's clock like `next_attempt_at`: the
    // row's `updated_at` is the database's clock when the settlement began, later by however
    // long the machine took to get there.
    let asked: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM o.next_attempt_at - a.started_at)::float8 \
         FROM outbox o JOIN outbox_attempts a ON a.outbox_id = o.id WHERE o.event_key = 'evt-429'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(asked >= 1.0, "Retry-After: 1 was not honoured: {asked}");
    assert_eq!(
        (rows[1].0.as_str(), rows[1].1.as_str(), rows[1].3),
        ("evt-closed", "retryable", None)
    );
    let outcomes: Vec<String> =
        sqlx::query_scalar("SELECT outcome FROM outbox_attempts ORDER BY outcome")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(outcomes, ["refused", "retryable"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_shows_in_the_metrics() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    enqueue_http(&db, &downstream, &["evt-stuck".to_owned()], false).await;
    outbox::lease(&db.pool, "vanished", 1, Duration::from_millis(300))
        .await
        .unwrap();
    let registry = prometheus::Registry::new();
    let metrics = DispatchMetrics::new(&registry).unwrap();
    metrics
        .refresh(std::slice::from_ref(&db.pool), &Default::default())
        .await
        .unwrap();
    assert_eq!(
        crate::harness::metric_value(&registry, "replayproof_outbox_expired_leases"),
        0.0
    );
    wait_for("the stuck lease to expire", WAIT, || async {
        db.count("SELECT count(*) FROM outbox WHERE lease_expires_at <= now()")
            .await
            == 1
    })
    .await;
    metrics
        .refresh(std::slice::from_ref(&db.pool), &Default::default())
        .await
        .unwrap();
    assert_eq!(
        crate::harness::metric_value(&registry, "replayproof_outbox_expired_leases"),
        1.0
    );
    let d = Dispatcher::build(
        settings("observer"),
        db.pool.clone(),
        metrics.clone(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    assert_eq!(
        d.dispatch_once().await.unwrap(),
        1,
        "the expired lease is taken over"
    );
    metrics
        .refresh(std::slice::from_ref(&db.pool), &Default::default())
        .await
        .unwrap();
    assert_eq!(
        crate::harness::metric_value(&registry, "replayproof_outbox_expired_leases"),
        0.0
    );
    assert_eq!(unsettled(&db).await, 0);
}

/// Leases and sends one round with a single dispatcher; returns the rows' (key, state, error).
async fn one_round(db: &TestDb) -> Vec<(String, String, Option<String>)> {
    let d = Dispatcher::build(
        settings("w"),
        db.pool.clone(),
        DispatchMetrics::new(&prometheus::Registry::new()).unwrap(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    d.dispatch_once().await.unwrap();
    sqlx::query_as("SELECT event_key, state, last_error FROM outbox ORDER BY event_key")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_far_in_the_future_or_as_a_date_is_clamped_not_a_crash() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let keys = ["evt-date", "evt-huge", "evt-max"].map(String::from);
    downstream.script(
        "evt-huge#deliver",
        &[Behaviour::RetryAfter("99999999999999")],
    );
    downstream.script(
        "evt-max#deliver",
        &[Behaviour::RetryAfter("18446744073709551615")],
    );
    let in_an_hour = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc2822();
    let in_an_hour: &'static str = Box::leak(in_an_hour.into_boxed_str());
    downstream.script("evt-date#deliver", &[Behaviour::RetryAfter(in_an_hour)]);
    enqueue_http(&db, &downstream, &keys, false).await;
    let rows = one_round(&db).await;
    assert!(
        rows.iter().all(|(_, state, _)| state == "retryable"),
        "{rows:?}"
    );
    let waits: Vec<(String, f64)> = sqlx::query_as(
        "SELECT event_key, extract(epoch FROM next_attempt_at - now())::float8 FROM outbox \
         ORDER BY event_key",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let day = replayproof::dispatch::MAX_RETRY_AFTER.as_secs_f64();
    assert!((3000.0..3700.0).contains(&waits[0].1), "{waits:?}");
    assert!((day - 60.0..=day + 1.0).contains(&waits[1].1), "{waits:?}");
    assert!((day - 60.0..=day + 1.0).contains(&waits[2].1), "{waits:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_are_failures_with_their_location_never_followed() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let keys = ["evt-301", "evt-302", "evt-303", "evt-307"].map(String::from);
    for (key, status) in keys.iter().zip([301, 302, 303, 307]) {
        downstream.script(&format!("{key}#deliver"), &[Behaviour::Redirect(status)]);
    }
    enqueue_http(&db, &downstream, &keys, false).await;
    let rows = one_round(&db).await;
    assert_eq!(downstream.followed_redirects(), 0);
    assert!(downstream.applied().is_empty());
    for (key, state, error) in &rows {
        assert_eq!(state, "failed", "{key}");
        let error = error.as_deref().unwrap_or_default();
        assert!(error.contains("/elsewhere"), "{key}: {error}");
    }
    let statuses: Vec<Option<i32>> =
        sqlx::query_scalar("SELECT last_status FROM outbox ORDER BY event_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(statuses, [Some(301), Some(302), Some(303), Some(307)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirected_reconcile_is_not_followed_and_keeps_its_location() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    enqueue_http(&db, &downstream, &["evt-moved".to_owned()], true).await;
    sqlx::query("UPDATE outbox SET state = 'uncertain'")
        .execute(&db.pool)
        .await
        .unwrap();
    downstream.redirect_lookups();
    let rows = one_round(&db).await;
    assert_eq!(downstream.followed_redirects(), 0);
    assert!(downstream.applied().is_empty(), "nothing was delivered");
    let (_, state, error) = &rows[0];
    assert_eq!(state, "uncertain");
    let error = error.as_deref().unwrap_or_default();
    assert!(
        error.contains("redirected to") && error.contains("/elsewhere"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_whose_worker_dies_every_time_goes_dead_after_its_attempts() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    enqueue_http(&db, &downstream, &["evt-killer".to_owned()], false).await;
    sqlx::query("UPDATE outbox SET max_attempts = 3")
        .execute(&db.pool)
        .await
        .unwrap();
    // Three workers lease the row and vanish without completing it.
    for worker in ["w1", "w2", "w3"] {
        let leased = outbox::lease(&db.pool, worker, 1, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(leased.len(), 1, "{worker} leases the row");
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    let fourth = outbox::lease(&db.pool, "w4", 1, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(fourth.is_empty(), "the row is not leased a fourth time");
    let (state, attempts, error): (String, i32, String) =
        sqlx::query_as("SELECT state, attempts, last_error FROM outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), attempts), ("dead", 3));
    assert!(error.contains("lease expired"), "{error}");
    assert!(downstream.applied().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_outbox_fails_health_until_it_is_back() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    enqueue_http(&db, &downstream, &["evt-h".to_owned()], false).await;
    sqlx::query("ALTER TABLE outbox RENAME TO outbox_away")
        .execute(&db.pool)
        .await
        .unwrap();
    let health = replayproof::telemetry::Health::default();
    let d = Dispatcher::build(
        DispatchSettings {
            unhealthy_after: Duration::from_millis(500),
            ..settings("h")
        },
        db.pool.clone(),
        DispatchMetrics::new(&prometheus::Registry::new()).unwrap(),
        health.clone(),
    )
    .unwrap();
    let stop = CancellationToken::new();
    let task = d.run_until_stopped(stop.clone());
    wait_for("/healthz to name the outbox", WAIT, || async {
        health
            .problems()
            .iter()
            .any(|p| p.starts_with("database: the outbox has been unreadable"))
    })
    .await;
    assert!(health.is_live(), "{:?}", health.liveness_problems());
    sqlx::query("ALTER TABLE outbox_away RENAME TO outbox")
        .execute(&db.pool)
        .await
        .unwrap();
    wait_for("ready again", WAIT, || async { health.is_ready() }).await;
    wait_for("the operation delivered", WAIT, || async {
        downstream.applied().len() == 1
    })
    .await;
    stop.cancel();
    task.stopped().await.unwrap();
}

/// Runs a dispatcher until `key`'s operation reaches `state`, then stops it.
async fn dispatch_until(db: &TestDb, settings: DispatchSettings, key: &str, state: &str) {
    let dispatchers = Dispatchers::start(db, 1, |_| settings.clone());
    wait_for(&format!("{key} to be {state}"), WAIT, || async {
        let at: Option<String> =
            sqlx::query_scalar("SELECT state FROM outbox WHERE event_key = $1")
                .bind(key)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        at.as_deref() == Some(state)
    })
    .await;
    dispatchers.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_whose_body_holds_a_nul_is_recorded_once_and_never_resent() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let key = "evt-nul".to_owned();
    let op = outbox::operation_key(&key, "deliver");
    downstream.script(
        &op,
        &[Behaviour::RefuseWithBody(
            400,
            b"{\"error\":\"bad\0input\"}",
        )],
    );
    enqueue_http(&db, &downstream, std::slice::from_ref(&key), false).await;
    let short_lease = DispatchSettings {
        lease: Duration::from_secs(2),
        ..settings("w")
    };
    // `failed` is final: no dispatcher leases it again.
    dispatch_until(&db, short_lease, &key, "failed").await;
    assert_eq!(
        downstream.requests(&op),
        1,
        "an answered request is never resent"
    );
    let (status, response): (Option<i32>, Option<String>) =
        sqlx::query_as("SELECT last_status, last_response FROM outbox")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, Some(400));
    let response = response.unwrap();
    assert!(response.contains("bad") && response.contains("input") && !response.contains('\0'));
    assert_eq!(db.count("SELECT count(*) FROM outbox_attempts").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_whose_record_postgres_refuses_still_settles_and_is_never_resent() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    // Every attempt record is refused as a data error, whatever it holds.
    sqlx::raw_sql(
        "CREATE FUNCTION refuse_attempt() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'no attempts today' USING ERRCODE = '22023'; END $$; \
         CREATE TRIGGER refuse_attempt BEFORE INSERT ON outbox_attempts \
         FOR EACH ROW EXECUTE FUNCTION refuse_attempt();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let key = "evt-unrecorded".to_owned();
    enqueue_http(&db, &downstream, std::slice::from_ref(&key), false).await;
    let short_lease = DispatchSettings {
        lease: Duration::from_secs(2),
        ..settings("w")
    };
    dispatch_until(&db, short_lease, &key, "done").await;
    assert_eq!(
        downstream.requests(&outbox::operation_key(&key, "deliver")),
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox_attempts").await, 0);
    let error: Option<String> = sqlx::query_scalar("SELECT last_error FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(error.unwrap_or_default().contains("could not be recorded"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_attempt_record_is_tried_again_within_the_lease_not_resent() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    // The first two attempt records fail as a connection would, then they go through.
    sqlx::raw_sql(
        "CREATE SEQUENCE refusals; \
         CREATE FUNCTION refuse_twice() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN IF nextval('refusals') <= 2 THEN \
              RAISE EXCEPTION 'busy' USING ERRCODE = '57P01'; \
            END IF; RETURN NEW; END $$; \
         CREATE TRIGGER refuse_twice BEFORE INSERT ON outbox_attempts \
         FOR EACH ROW EXECUTE FUNCTION refuse_twice();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let key = "evt-retried-record".to_owned();
    enqueue_http(&db, &downstream, std::slice::from_ref(&key), false).await;
    dispatch_until(&db, settings("w"), &key, "done").await;
    assert_eq!(
        downstream.requests(&outbox::operation_key(&key, "deliver")),
        1
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox_attempts").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_no_header_can_carry_fails_as_unsendable_and_is_never_sent() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let key = "evt-crlf".to_owned();
    enqueue_http(&db, &downstream, std::slice::from_ref(&key), false).await;
    // A row from before keys were checked, or from an effect's own operation name.
    sqlx::query("UPDATE outbox SET operation_key = operation_key || E'\\r\\nX-Injected: 1'")
        .execute(&db.pool)
        .await
        .unwrap();
    dispatch_until(&db, settings("w"), &key, "failed").await;
    assert!(downstream.bodies().is_empty(), "nothing was sent");
    let (outcome, error): (String, Option<String>) =
        sqlx::query_as("SELECT outcome, error FROM outbox_attempts")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(outcome, "unsendable");
    assert!(error.unwrap_or_default().contains("could not be built"));
    assert_eq!(db.count("SELECT count(*) FROM outbox_attempts").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_answer_is_read_only_as_far_as_its_excerpt() {
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let keys: Vec<String> = (0..4).map(|i| format!("evt-huge-{i}")).collect();
    const HUGE: usize = 200 << 20;
    for k in &keys {
        let op = outbox::operation_key(k, "deliver");
        downstream.script(&op, &[Behaviour::Huge(500, HUGE)]);
    }
    enqueue_http(&db, &downstream, &keys, false).await;
    // Time enough to read every answer whole, if the dispatcher tried.
    let patient = DispatchSettings {
        lease: Duration::from_secs(120),
        request_timeout: Duration::from_secs(30),
        ..settings("w")
    };
    let metrics = DispatchMetrics::new(&prometheus::Registry::new()).unwrap();
    let d = Dispatcher::build(
        patient,
        db.pool.clone(),
        metrics,
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    d.dispatch_once().await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE state = 'retryable'")
            .await,
        4
    );
    wait_for("the huge answers to end", WAIT, || async {
        downstream.streamed().is_some()
    })
    .await;
    // Four answers of 200 MiB each: the dispatcher took its excerpt and a few kernel buffers
    // of each, never the whole body.
    let streamed = downstream.streamed().unwrap();
    assert!(
        streamed < 4 * (24 << 20),
        "the dispatcher read {streamed} bytes"
    );
    let excerpts: Vec<i32> = sqlx::query_scalar("SELECT length(last_response) FROM outbox")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let most = outbox::RESPONSE_EXCERPT_CHARS as i32 + 1;
    assert!(
        excerpts.iter().all(|n| (2_000..=most).contains(n)),
        "{excerpts:?}"
    );
}

//! Outbox operations as the requests real APIs take (method, form bodies, headers, named
//! credentials, the destination's idempotency header), and each destination's limits held
//! across dispatchers: concurrency, rate, circuit breaker, a 429's pause.

use crate::harness::dispatcher::claim;
use crate::harness::recorder::{Answer, Recorder};
use crate::harness::*;
use replayproof::destinations::Limits;
use replayproof::dispatch::outbound::Header;
use replayproof::dispatch::{
    Credential, Credentials, Destination, Destinations, DispatchMetrics, DispatchSettings,
    Dispatcher,
};
use replayproof::outbox::{self, NewOperation};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

fn settings(destinations: Destinations) -> DispatchSettings {
    DispatchSettings {
        batch_size: 16,
        lease: Duration::from_secs(10),
        request_timeout: Duration::from_millis(1_000),
        poll_interval: Duration::from_millis(20),
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(100),
        destinations,
        ..DispatchSettings::new("w")
    }
}

fn limited(origin: &str, limits: Limits) -> (String, Destination) {
    (
        origin.to_owned(),
        Destination {
            limits,
            ..Destination::default()
        },
    )
}

/// Enqueues `op` in a transaction of its own, its claim first.
async fn enqueue(db: &TestDb, op: &NewOperation<'_>) -> sqlx::Result<()> {
    claim(db, op.event_key).await;
    let mut tx = db.pool.begin().await?;
    outbox::enqueue(&mut tx, op).await?;
    tx.commit().await
}

/// `n` JSON operations of their own events to `url`.
async fn enqueue_many(db: &TestDb, prefix: &str, url: &str, n: usize) {
    for i in 0..n {
        let key = format!("{prefix}-{i}");
        let op = NewOperation::new(&key, "deliver", url, b"{}".to_vec()).max_attempts(100);
        enqueue(db, &op).await.unwrap();
    }
}

fn dispatcher(db: &TestDb, settings: DispatchSettings) -> (Dispatcher, prometheus::Registry) {
    let registry = prometheus::Registry::new();
    let d = Dispatcher::build(
        settings,
        db.pool.clone(),
        DispatchMetrics::new(&registry).unwrap(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    (d, registry)
}

async fn count(db: &TestDb, sql: &str, bind: &str) -> i64 {
    sqlx::query_scalar(sql)
        .bind(bind)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn done_to(db: &TestDb, origin: &str) -> i64 {
    count(
        db,
        "SELECT count(*) FROM outbox WHERE origin = $1 AND state = 'done'",
        origin,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_is_sent_as_the_request_it_describes_with_its_credential_on_every_attempt() {
    let db = TestDb::new().await;
    let api = Recorder::start(Answer::Status(500)).await;
    let url = api.url("/v1/refunds");
    let form = [
        ("charge", "ch_1"),
        ("amount", "1999"),
        ("metadata[order]", "42"),
    ];
    let op = NewOperation::new("evt-r", "refund", &url, Vec::new())
        .method("put")
        .form(&form)
        .unwrap()
        .header("Stripe-Account", "acct_1")
        .credential("stripe_acme");
    enqueue(&db, &op).await.unwrap();
    let mut s = settings(Destinations {
        by_origin: BTreeMap::from([(
            api.origin(),
            Destination {
                idempotency_header: "x-idem".parse().unwrap(),
                ..Destination::default()
            },
        )]),
        ..Destinations::default()
    });
    s.outbound.credentials = Credentials(BTreeMap::from([(
        "stripe_acme".to_owned(),
        Credential {
            headers: vec![
                Header::secret("Authorization", "Bearer sk_test_acme_0123456789").unwrap(),
            ],
            origins: vec![api.origin()],
        },
    )]));
    let (d, _) = dispatcher(&db, s);
    assert_eq!(d.dispatch_once().await.unwrap(), 1);
    api.answer(Answer::Ok);
    wait_for("the retry", Duration::from_secs(10), || async {
        d.dispatch_once().await.unwrap();
        api.received().len() == 2
    })
    .await;

    let expected_body = "charge=ch_1&amount=1999&metadata%5Border%5D=42";
    for r in api.received() {
        assert_eq!(r.method, "PUT");
        assert_eq!(r.path, "/v1/refunds");
        assert_eq!(
            r.header("content-type"),
            Some("application/x-www-form-urlencoded")
        );
        assert_eq!(
            r.body,
            expected_body.as_bytes(),
            "the same bytes every time"
        );
        assert_eq!(
            r.header("x-idem"),
            Some("evt-r#refund"),
            "the destination's header"
        );
        assert_eq!(r.header("idempotency-key"), None);
        assert_eq!(r.header("stripe-account"), Some("acct_1"));
        assert_eq!(
            r.header("authorization"),
            Some("Bearer sk_test_acme_0123456789")
        );
    }
    let stored: String = sqlx::query_scalar(
        "SELECT concat_ws(' ', method, content_type, headers::text, credential, state) FROM outbox",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!stored.contains("sk_test"), "no secret is stored: {stored}");
    assert!(stored.ends_with("stripe_acme done"), "{stored}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_header_is_refused_at_enqueue_and_an_unknown_credential_fails_unsent() {
    let db = TestDb::new().await;
    let api = Recorder::start(Answer::Ok).await;
    let url = api.url("/charges");
    let secret = NewOperation::new("evt-s", "charge", &url, b"{}".to_vec())
        .header("Authorization", "Bearer sk_live_x");
    let refused = enqueue(&db, &secret).await.unwrap_err().to_string();
    assert!(refused.contains("name a credential"), "{refused}");
    for bad in [
        NewOperation::new("evt-m", "charge", &url, Vec::new()).method("NOT A METHOD"),
        NewOperation::new("evt-i", "charge", &url, Vec::new()).header("Idempotency-Key", "x"),
    ] {
        assert!(enqueue(&db, &bad).await.is_err(), "{bad:?}");
    }

    let unknown = NewOperation::new("evt-u", "charge", &url, b"{}".to_vec()).credential("nobody");
    enqueue(&db, &unknown).await.unwrap();
    let (d, _) = dispatcher(&db, settings(Destinations::default()));
    assert_eq!(d.dispatch_once().await.unwrap(), 1);
    let (state, error, outcome): (String, String, String) = sqlx::query_as(
        "SELECT o.state, o.last_error, a.outcome FROM outbox o \
         JOIN outbox_attempts a ON a.outbox_id = o.id",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((state.as_str(), outcome.as_str()), ("failed", "unsendable"));
    assert!(
        error.contains("\"nobody\" is not in [dispatch.credentials]"),
        "{error}"
    );
    assert!(api.received().is_empty(), "nothing was sent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_destination_opens_its_breaker_and_waits_while_a_healthy_one_drains_at_its_rate()
{
    let db = TestDb::new().await;
    let failing = Recorder::start(Answer::Status(503)).await;
    let healthy = Recorder::start(Answer::Ok).await;
    let breaker_open = Duration::from_millis(1_500);
    let destinations = Destinations {
        by_origin: BTreeMap::from([
            limited(
                &failing.origin(),
                Limits {
                    max_concurrency: Some(1),
                    breaker_failures: Some(3),
                    breaker_open,
                    ..Limits::default()
                },
            ),
            limited(
                &healthy.origin(),
                Limits {
                    rate_per_sec: Some(20.0),
                    ..Limits::default()
                },
            ),
        ]),
        ..Destinations::default()
    };
    enqueue_many(&db, "bad", &failing.url("/ops"), 6).await;
    enqueue_many(&db, "good", &healthy.url("/ops"), 100).await;
    let started = Instant::now();
    let stop = CancellationToken::new();
    let (d, registry) = dispatcher(&db, settings(destinations.clone()));
    let running = d.run_until_stopped(stop.clone());
    let breaker = |origin: String| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT breaker FROM outbox_destinations WHERE origin = $1",
            )
            .bind(origin)
            .fetch_optional(&pool)
            .await
            .unwrap()
            .unwrap_or_default()
        }
    };
    wait_for(
        "the healthy destination to drain and the failing one's breaker to open",
        Duration::from_secs(30),
        || async {
            done_to(&db, &healthy.origin()).await == 100
                && breaker(failing.origin()).await != "closed"
        },
    )
    .await;

    // The healthy one went at its rate: 20 starts a second, scheduled 50 ms apart, so the
    // last of 100 cannot come before 99 × 50 ms, however late a busy machine ran some.
    let arrivals: Vec<Instant> = healthy.received().iter().map(|r| r.at).collect();
    assert_eq!(arrivals.len(), 100);
    let last = arrivals.iter().max().unwrap().duration_since(started);
    assert!(
        last >= Duration::from_millis(4_900),
        "100 requests at 20/s all started within {last:?}"
    );
    // The failing one got three failures, then nothing but one probe per open period: each
    // is due only `breaker_open` after the last failure was recorded.
    let tries: Vec<Instant> = failing.received().iter().map(|r| r.at).collect();
    assert!(tries.len() >= 3, "{} attempts", tries.len());
    for pair in tries[2..].windows(2) {
        let gap = pair[1].duration_since(pair[0]);
        assert!(
            gap >= breaker_open - Duration::from_millis(100),
            "an attempt {gap:?} after the last, within the open period"
        );
    }
    let elapsed = tries[2].elapsed();
    let probes_at_most = (elapsed.as_millis() / breaker_open.as_millis()) as usize + 1;
    assert!(
        tries.len() <= 3 + probes_at_most,
        "{} attempts",
        tries.len()
    );
    // Every attempt counted is a request sent, but one that may be on its way (the dispatcher
    // runs on): no attempt is spent while the breaker is open.
    let sent_before = failing.received().len();
    let attempts: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(attempts), 0)::int8 FROM outbox WHERE origin = $1")
            .bind(failing.origin())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let sent_after = failing.received().len();
    assert!(
        sent_before <= attempts as usize && attempts as usize <= sent_after + 1,
        "{attempts} attempts for {sent_before}..{sent_after} requests"
    );
    let page = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    let open = format!(
        "replayproof_dispatch_breakers{{destination=\"{}\",state=\"open\"}} 1",
        failing.origin()
    );
    let half_open = open.replace("\"open\"", "\"half_open\"");
    wait_for(
        "the gauge to show the open breaker",
        Duration::from_secs(10),
        || {
            let registry = registry.clone();
            let (open, half_open) = (open.clone(), half_open.clone());
            async move {
                let page = prometheus::TextEncoder::new()
                    .encode_to_string(&registry.gather())
                    .unwrap();
                page.contains(&open) || page.contains(&half_open)
            }
        },
    )
    .await;
    assert!(page.contains("replayproof_dispatch_in_flight{destination="));

    // Healed, its next probe closes the breaker and the rest drains.
    failing.answer(Answer::Ok);
    wait_for(
        "the healed destination to drain",
        Duration::from_secs(30),
        || async { done_to(&db, &failing.origin()).await == 6 },
    )
    .await;
    assert_eq!(breaker(failing.origin()).await, "closed");
    stop.cancel();
    running.stopped().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_pauses_its_own_destination_while_others_go_on() {
    let db = TestDb::new().await;
    let throttled = Recorder::start(Answer::ThrottleOnce(2)).await;
    let other = Recorder::start(Answer::Ok).await;
    let destinations = Destinations {
        by_origin: BTreeMap::from([
            limited(
                &throttled.origin(),
                Limits {
                    max_concurrency: Some(1),
                    ..Limits::default()
                },
            ),
            limited(
                &other.origin(),
                Limits {
                    rate_per_sec: Some(4.0),
                    ..Limits::default()
                },
            ),
        ]),
        ..Destinations::default()
    };
    enqueue_many(&db, "slow", &throttled.url("/ops"), 3).await;
    enqueue_many(&db, "fast", &other.url("/ops"), 10).await;
    let stop = CancellationToken::new();
    let (d, _) = dispatcher(&db, settings(destinations));
    let running = d.run_until_stopped(stop.clone());
    wait_for(
        "both destinations to drain",
        Duration::from_secs(30),
        || async {
            done_to(&db, &throttled.origin()).await == 3
                && done_to(&db, &other.origin()).await == 10
        },
    )
    .await;
    stop.cancel();
    running.stopped().await.unwrap();

    let asked = throttled.received();
    let (first, second) = (asked[0].at, asked[1].at);
    assert!(
        second.duration_since(first) >= Duration::from_millis(1_900),
        "the throttled destination was asked again after {:?}",
        second.duration_since(first)
    );
    let meanwhile = other
        .received()
        .iter()
        .filter(|r| r.at > first && r.at < second)
        .count();
    assert!(
        meanwhile >= 3,
        "{meanwhile} requests to the other destination during the pause"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dispatcher_processes_together_stay_within_one_destinations_concurrency_limit_with_a_credential_from_the_environment(
) {
    let _heavy = heavy().await;
    let db = TestDb::new().await;
    let api = Recorder::start(Answer::SlowOk(Duration::from_millis(150))).await;
    let url = api.url("/ops");
    for i in 0..30 {
        let key = format!("ev-{i}");
        let op = NewOperation::new(&key, "deliver", &url, b"{}".to_vec()).credential("api");
        enqueue(&db, &op).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(
        &config,
        format!(
            "[dispatch.destinations.\"{}\"]\nmax_concurrency = 3\n\
             [dispatch.credentials.api]\nheaders = {{ Authorization = \"Bearer ${{API_TOKEN}}\" }}\n\
             origins = [\"{0}\"]\n",
            api.origin()
        ),
    )
    .unwrap();
    // Each process sends at most two at once: three in flight needs both of them, and four
    // would break the limit.
    let spawn = |worker: &str| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .arg("dispatch")
            .arg("--config")
            .arg(&config)
            .args(["--database-url", &db.url, "--worker", worker])
            .args(["--batch-size", "2", "--poll", "10ms", "--backoff", "20ms"])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .env("API_TOKEN", "tok_from_the_environment_42")
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let (mut one, mut two) = (spawn("one"), spawn("two"));
    wait_for(
        "every operation to be done",
        Duration::from_secs(60),
        || async { done_to(&db, &api.origin()).await == 30 },
    )
    .await;
    for child in [&mut one, &mut two] {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        assert!(child.wait().await.unwrap().success());
    }
    assert_eq!(api.received().len(), 30, "each once");
    assert!(api
        .received()
        .iter()
        .all(|r| r.header("authorization") == Some("Bearer tok_from_the_environment_42")));
    assert_eq!(
        api.max_in_flight(),
        3,
        "both processes sent, never more than the limit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_is_never_sent_to_an_origin_it_is_not_bound_to() {
    let db = TestDb::new().await;
    let bound = Recorder::start(Answer::Ok).await;
    let elsewhere = Recorder::start(Answer::Ok).await;
    for (key, api) in [("evt-bound", &bound), ("evt-elsewhere", &elsewhere)] {
        let url = api.url("/charges");
        let op = NewOperation::new(key, "charge", &url, b"{}".to_vec()).credential("live");
        enqueue(&db, &op).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    let text = format!(
        "[dispatch.credentials.live]\nheaders = {{ Authorization = \"Bearer ${{LIVE_TOKEN}}\" }}\n\
         origins = [\"{}\"]\n",
        bound.origin()
    );
    std::fs::write(&config, text).unwrap();
    let mut dispatch = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .arg("dispatch")
        .arg("--config")
        .arg(&config)
        .args(["--database-url", &db.url, "--poll", "10ms"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("LIVE_TOKEN", "tok_bound_to_one_origin_42")
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_for(
        "both operations settled",
        Duration::from_secs(60),
        || async {
            db.count("SELECT count(*) FROM outbox WHERE state IN ('done', 'failed')")
                .await
                == 2
        },
    )
    .await;
    let pid = nix::unistd::Pid::from_raw(dispatch.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(dispatch.wait().await.unwrap().success());
    assert_eq!(bound.received().len(), 1);
    assert_eq!(
        bound.received()[0].header("authorization"),
        Some("Bearer tok_bound_to_one_origin_42")
    );
    assert!(elsewhere.received().is_empty(), "nothing went elsewhere");
    let (state, error): (String, String) =
        sqlx::query_as("SELECT state, last_error FROM outbox WHERE event_key = 'evt-elsewhere'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(state, "failed");
    assert!(
        error.contains(&format!("is sent only to {}", bound.origin())),
        "{error}"
    );
}

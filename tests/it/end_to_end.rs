//! `replayproof ingest` and `replayproof consume` as real processes, against a real PostgreSQL
//! and the broker process (`KAFKA_BROKERS`, or the mock cluster hosted by this test).

use crate::harness::otlp::traced;
use crate::harness::*;
use std::collections::HashSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

const CONFIG: &str = r#"
[[sources]]
name = "github"
kind = "github"
secrets_env = ["E2E_GITHUB_SECRET"]

[[sources]]
name = "stripe"
kind = "stripe"
secrets_env = ["E2E_STRIPE_SECRET"]
"#;

/// One delivery: the event number decides the source and the id. 0: no answer.
async fn deliver(http: &reqwest::Client, base: &str, n: usize) -> u16 {
    sent(http, base, n)
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// One delivery, as the sender sees it: an answer or why there was none.
async fn sent(
    http: &reqwest::Client,
    base: &str,
    n: usize,
) -> Result<reqwest::Response, reqwest::Error> {
    let response = if n.is_multiple_of(2) {
        let body = format!(r#"{{"action":"opened","number":{n}}}"#);
        http.post(format!("{base}/webhooks/github"))
            .header(
                "x-hub-signature-256",
                format!(
                    "sha256={}",
                    hmac_hex("gh-secret-for-the-e2e-test", &[body.as_bytes()])
                ),
            )
            .header("x-github-delivery", format!("delivery-{n}"))
            .header("x-github-event", "pull_request")
            .body(body)
    } else {
        let body = format!(r#"{{"id":"evt_{n}","type":"charge.succeeded","object":"event"}}"#);
        let t = chrono::Utc::now().timestamp().to_string();
        let sig = hmac_hex(
            "whsec_e2e-secret-for-the-test",
            &[t.as_bytes(), b".", body.as_bytes()],
        );
        http.post(format!("{base}/webhooks/stripe"))
            .header("stripe-signature", format!("t={t},v1={sig}"))
            .body(body)
    };
    response.send().await
}

/// A `replayproof ingest` process on a free port, with the two sources above.
struct Ingress;

impl Ingress {
    fn spawn(
        kafka: &TestKafka,
        topic: &str,
        failpoints: Option<&str>,
    ) -> (tokio::process::Child, u16, tempfile::TempDir) {
        Self::spawn_with(kafka, topic, failpoints, &[])
    }

    /// Like [`Ingress::spawn`], with more arguments for `ingest`.
    fn spawn_with(
        kafka: &TestKafka,
        topic: &str,
        failpoints: Option<&str>,
        extra: &[&str],
    ) -> (tokio::process::Child, u16, tempfile::TempDir) {
        Self::spawn_traced(kafka, topic, failpoints, extra, None)
    }

    /// Like [`Ingress::spawn_with`], exporting its spans to `otlp` when given.
    fn spawn_traced(
        kafka: &TestKafka,
        topic: &str,
        failpoints: Option<&str>,
        extra: &[&str],
        otlp: Option<&str>,
    ) -> (tokio::process::Child, u16, tempfile::TempDir) {
        let (mut cmd, port, dir) = Self::command(kafka, topic, failpoints, extra, otlp);
        (cmd.spawn().unwrap(), port, dir)
    }

    /// The command [`Ingress::spawn_traced`] spawns.
    fn command(
        kafka: &TestKafka,
        topic: &str,
        failpoints: Option<&str>,
        extra: &[&str],
        otlp: Option<&str>,
    ) -> (tokio::process::Command, u16, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("replayproof.toml");
        std::fs::write(&config, CONFIG).unwrap();
        let port = free_port();
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
        cmd.arg("ingest")
            .arg("--config")
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--brokers", &kafka.brokers(), "--topic", topic])
            .args(["--kafka-option", "broker.address.family=v4"])
            .args(extra)
            .env("E2E_GITHUB_SECRET", "gh-secret-for-the-e2e-test")
            .env("E2E_STRIPE_SECRET", "whsec_e2e-secret-for-the-test")
            .env("RUST_LOG", "warn")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if !extra.contains(&"--metrics-addr") {
            cmd.args(["--metrics-addr", "127.0.0.1:0"]);
        }
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        if let Some(endpoint) = otlp {
            traced(&mut cmd, endpoint);
        }
        (cmd, port, dir)
    }
}

fn key(n: usize) -> String {
    if n.is_multiple_of(2) {
        format!("github:delivery-{n}")
    } else {
        format!("stripe:evt_{n}")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_signed_deliveries_with_redeliveries_have_one_effect_each() {
    let _heavy = heavy().await;
    const DISTINCT: usize = 1_400;
    const DELIVERIES: usize = 2_000;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(4).await, unique("group"));
    let (mut ingest, port, _dir) = Ingress::spawn(&kafka, &topic, None);
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &db.url, None);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_ready(&http, &base).await;

    // Every event once, plus 600 redeliveries, shuffled over 8 concurrent senders so that some
    // copies of one event are in flight at the same time.
    let mut rng = fastrand::Rng::with_seed(3);
    let mut plan: Vec<usize> = (0..DISTINCT).collect();
    plan.extend((0..DELIVERIES - DISTINCT).map(|_| rng.usize(..DISTINCT)));
    rng.shuffle(&mut plan);
    let plan = Arc::new(plan);
    let retried = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let senders: Vec<_> = (0..8)
        .map(|client| {
            let (plan, http, base) = (plan.clone(), http.clone(), base.clone());
            let retried = retried.clone();
            tokio::spawn(async move {
                for n in plan.iter().skip(client).step_by(8) {
                    // A sender retries until it gets a 2xx.
                    let mut status = deliver(&http, &base, *n).await;
                    while status != 200 {
                        retried.store(true, std::sync::atomic::Ordering::Relaxed);
                        assert!(
                            status == 503 || status == 0,
                            "delivery {n} answered {status}"
                        );
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        status = deliver(&http, &base, *n).await;
                    }
                }
            })
        })
        .collect();
    for s in senders {
        s.await.unwrap();
    }

    let expected: HashSet<String> = (0..DISTINCT).map(key).collect();
    assert_exactly_once(&db, &expected, Duration::from_secs(120)).await;
    let retried = retried.load(std::sync::atomic::Ordering::Relaxed);
    assert_every_delivery_counted(&db, &plan, retried).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(ingest.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), ingest.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "ingest exited with {status:?}");
    assert!(consumer.terminate(Duration::from_secs(30)).await.success());
}

/// Each claim counts every delivery of its key: as many as were sent when none was retried
/// (a retried delivery may have reached the topic too, so then at least as many), and
/// `events show --json` says so.
async fn assert_every_delivery_counted(db: &TestDb, plan: &[usize], retried: bool) {
    let mut sent: std::collections::HashMap<String, i32> = Default::default();
    for n in plan {
        *sent.entry(key(*n)).or_default() += 1;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rows: Vec<(String, i32)> =
            sqlx::query_as("SELECT event_key, deliveries FROM claim_deliveries")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let counted: std::collections::HashMap<String, i32> = rows.into_iter().collect();
        let short: Vec<_> = sent
            .iter()
            .filter(|(k, n)| counted.get(*k).copied().unwrap_or(0) < **n)
            .collect();
        if short.is_empty() {
            if !retried {
                assert_eq!(counted, sent, "every delivery counted once");
            }
            break;
        }
        // The duplicates of the last batches may still be on their way.
        assert!(
            tokio::time::Instant::now() < deadline,
            "not counted: {short:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (twice, _) = sent
        .iter()
        .find(|(_, n)| **n == 2)
        .expect("a key sent twice");
    let out = replayproof()
        .args(["events", "show", twice, "--json", "--database-url", &db.url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if !retried {
        assert_eq!(shown["claim"]["deliveries"], 2, "{shown}");
    }
    assert!(shown["claim"]["last_seen_at"].is_string(), "{shown}");
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_killed_after_the_ack_before_the_answer_makes_the_retry_a_harmless_replay() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let http = reqwest::Client::new();
    // The first ingress stops between the broker's acknowledgement and its answer.
    let (mut first, port, _dir) = Ingress::spawn(&kafka, &topic, Some("ingest::after_ack=pause"));
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(&http, &base).await;
    let sent = tokio::spawn({
        let (http, base) = (http.clone(), base.clone());
        async move { deliver(&http, &base, 7).await }
    });
    let brokers = kafka.brokers();
    let watermark = || {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                use rdkafka::consumer::Consumer;
                let c: rdkafka::consumer::BaseConsumer = client_config(&brokers).create().unwrap();
                c.fetch_watermarks(&topic, 0, Duration::from_secs(5))
                    .map(|(_, high)| high)
                    .unwrap_or(0)
            })
            .await
            .unwrap()
        }
    };
    wait_for(
        "the broker to have the record",
        Duration::from_secs(60),
        || async { watermark().await == 1 },
    )
    .await;
    first.kill().await.unwrap();
    assert_eq!(sent.await.unwrap(), 0, "the sender got no answer");

    // The sender retries against a restarted ingress: a second record, a harmless replay.
    let (mut second, port, _dir2) = Ingress::spawn(&kafka, &topic, None);
    let base = format!("http://127.0.0.1:{port}");
    wait_ready(&http, &base).await;
    assert_eq!(deliver(&http, &base, 7).await, 200);
    assert_eq!(watermark().await, 2);
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &db.url, None);
    let once = HashSet::from([key(7)]);
    assert_exactly_once(&db, &once, Duration::from_secs(60)).await;
    wait_committed_total(&kafka, &group, &topic, 1, 2).await;
    assert!(consumer.terminate(Duration::from_secs(30)).await.success());
    second.kill().await.unwrap();
}

/// What one sender saw of one delivery during a rolling update.
#[derive(Debug)]
enum Seen {
    Answered(u16),
    /// No answer: the connection was refused or closed before one came.
    NoAnswer(String),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_across_a_sigterm_are_accepted_for_the_shutdown_delay_and_never_get_a_5xx() {
    let _heavy = heavy().await;
    let delay = Duration::from_secs(3);
    let kafka = TestKafka::for_processes();
    let topic = kafka.topic(1).await;
    let metrics = format!("127.0.0.1:{}", crate::harness::free_port());
    let (mut ingest, port, _dir) = Ingress::spawn_with(
        &kafka,
        &topic,
        None,
        &["--shutdown-delay", "3s", "--metrics-addr", &metrics],
    );
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_ready(&http, &base).await;
    let ready_at = |at: String| {
        let http = http.clone();
        async move {
            let answer = http.get(format!("{at}/readyz")).send().await;
            answer.map(|r| r.status().as_u16()).unwrap_or(0)
        }
    };
    assert_eq!(ready_at(format!("http://{metrics}")).await, 200);

    // Four senders deliver without pause, on keep-alive connections, until the ingress is gone.
    let done = tokio_util::sync::CancellationToken::new();
    let senders: Vec<_> = (0..4)
        .map(|client| {
            let (http, base, done) = (http.clone(), base.clone(), done.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                for n in (client..).step_by(4) {
                    if done.is_cancelled() {
                        break;
                    }
                    let outcome = match sent(&http, &base, n).await {
                        Ok(response) => Seen::Answered(response.status().as_u16()),
                        Err(e) => Seen::NoAnswer(format!("{e:?}")),
                    };
                    seen.push((std::time::Instant::now(), n, outcome));
                }
                seen
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = std::time::Instant::now();
    let pid = nix::unistd::Pid::from_raw(ingest.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    wait_for("/readyz to answer 503 at once", delay / 2, || async {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 503)
    })
    .await;
    // One answer per process: the metrics port's /readyz says the same.
    assert_eq!(ready_at(format!("http://{metrics}")).await, 503);
    let status = tokio::time::timeout(Duration::from_secs(30), ingest.wait())
        .await
        .expect("ingest stops within its worst-case stop")
        .unwrap();
    assert!(status.success(), "ingest exited with {status:?}");
    done.cancel();

    let mut accepted = HashSet::new();
    let mut accepted_late = 0;
    for sender in senders {
        for (at, n, outcome) in sender.await.unwrap() {
            match outcome {
                Seen::Answered(200) => {
                    accepted.insert(n);
                    accepted_late += usize::from(at > signalled + delay / 2);
                }
                Seen::Answered(code) => panic!("delivery {n} answered {code}"),
                Seen::NoAnswer(why) => assert!(
                    at >= signalled + delay,
                    "delivery {n} got no answer {:?} after the SIGTERM, within the delay: {why}",
                    at - signalled
                ),
            }
        }
    }
    assert!(
        accepted_late > 0,
        "deliveries are still accepted well into the delay"
    );
    // Every 2xx is a record on the topic: none was answered without the broker's ack.
    let high = high_watermark(&kafka, &topic).await;
    assert_eq!(high, accepted.len() as i64);
}

/// The high watermark of partition 0 of `topic`.
async fn high_watermark(kafka: &TestKafka, topic: &str) -> i64 {
    let (brokers, topic) = (kafka.brokers(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        use rdkafka::consumer::Consumer;
        let c: rdkafka::consumer::BaseConsumer = client_config(&brokers).create().unwrap();
        c.fetch_watermarks(&topic, 0, Duration::from_secs(5))
            .map(|(_, high)| high)
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_the_webhook_through_the_claim_to_the_downstream_request() {
    use crate::harness::otlp::Collector;
    use crate::harness::recorder::{Answer, Recorder};
    let _heavy = heavy().await;
    let (collector, endpoint) = Collector::start().await;
    let downstream = Recorder::start(Answer::Ok).await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));

    let (_ingest, port, _dir) = Ingress::spawn_traced(&kafka, &topic, None, &[], Some(&endpoint));
    let mut consume = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    consume
        .arg("consume")
        .args([
            "--brokers",
            &kafka.brokers(),
            "--topic",
            &topic,
            "--group",
            &group,
        ])
        .args(["--database-url", &db.url, "--metrics-addr", "127.0.0.1:0"])
        .args([
            "--effect",
            "http",
            "--target-url",
            &downstream.url("/events"),
        ])
        .args(["--commit-interval-ms", "50"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for (k, v) in test_kafka_options() {
        consume.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    traced(&mut consume, &endpoint);
    let _consume = consume.spawn().unwrap();
    let mut dispatch = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    dispatch
        .arg("dispatch")
        .args(["--database-url", &db.url, "--metrics-addr", "127.0.0.1:0"])
        .args(["--poll", "20ms"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    traced(&mut dispatch, &endpoint);
    let _dispatch = dispatch.spawn().unwrap();

    // The sender's own trace: its request carries a traceparent.
    let (sender_trace, sender_span) = ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_ready(&http, &base).await;
    let body = r#"{"id":"evt_traced","type":"charge.succeeded","object":"event"}"#;
    let t = chrono::Utc::now().timestamp().to_string();
    let sig = hmac_hex(
        "whsec_e2e-secret-for-the-test",
        &[t.as_bytes(), b".", body.as_bytes()],
    );
    let answer = http
        .post(format!("{base}/webhooks/stripe"))
        .header("stripe-signature", format!("t={t},v1={sig}"))
        .header("traceparent", format!("00-{sender_trace}-{sender_span}-01"))
        .header("x-request-id", "lb-req-7")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let answer: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(answer["request_id"], "lb-req-7");

    wait_for(
        "the downstream request",
        Duration::from_secs(60),
        || async { !downstream.received().is_empty() },
    )
    .await;
    let sent = downstream.received()[0]
        .header("traceparent")
        .expect("the downstream request carries a traceparent")
        .to_owned();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!(
        parts[1], sender_trace,
        "the downstream saw the sender's trace"
    );

    let named = |service: &str, name: &str| {
        collector
            .spans()
            .into_iter()
            .find(|s| s.service == service && s.name == name && s.trace_id == sender_trace)
    };
    wait_for(
        "the spans of every hop",
        Duration::from_secs(30),
        || async {
            named("replayproof-ingest", "POST /webhooks/stripe").is_some()
                && named("replayproof-consume", "claim and apply stripe").is_some()
                && named(
                    "replayproof-dispatch",
                    &format!("POST {}", downstream.origin()),
                )
                .is_some()
        },
    )
    .await;
    let ingest = named("replayproof-ingest", "POST /webhooks/stripe").unwrap();
    let event = named("replayproof-consume", "claim and apply stripe").unwrap();
    let request = named(
        "replayproof-dispatch",
        &format!("POST {}", downstream.origin()),
    )
    .unwrap();
    assert_eq!(
        ingest.parent_span_id, sender_span,
        "ingest continues the sender"
    );
    assert_eq!(
        event.parent_span_id, ingest.span_id,
        "the claim continues ingest"
    );
    assert_eq!(
        request.parent_span_id, event.span_id,
        "the request continues the claim"
    );
    assert_eq!(
        parts[2], request.span_id,
        "the downstream's parent is the request span"
    );
    let linked = collector.spans().into_iter().any(|s| {
        s.service == "replayproof-consume"
            && s.links
                .contains(&(sender_trace.to_owned(), ingest.span_id.clone()))
    });
    assert!(linked, "the batch span links to the message's context");

    let shown = stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args([
                "events",
                "show",
                "stripe:evt_traced",
                "--database-url",
                &db.url,
            ])
            .env("RUST_LOG", "warn"),
    );
    let shown = String::from_utf8(shown).unwrap();
    assert!(shown.contains("lb-req-7"), "{shown}");
    assert!(shown.contains(sender_trace), "{shown}");
}

/// `replayproof sources ARGS…` over `db` as `ann`.
fn sources(db: &TestDb, args: &[&str]) -> std::process::Output {
    replayproof()
        .arg("sources")
        .args(args)
        .args(["--database-url", &db.url, "--actor", "ann"])
        .output()
        .unwrap()
}

/// A paused source: ingest keeps accepting its deliveries (2xx), the consumer claims its events
/// and holds them (deferred, no effect) while the other source's are applied; resumed, each
/// held event is applied once, its redeliveries still suppressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sources_events_are_held_while_ingest_accepts_them_then_applied_once_on_resume() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let out = sources(&db, &["pause", "stripe", "--reason", "their incident"]);
    assert!(out.status.success(), "{}", printed(&out));
    assert!(
        printed(&out).contains("source:stripe: running -> paused"),
        "{}",
        printed(&out)
    );
    assert!(
        printed(&out).contains("warning: no event of source \"stripe\" is claimed"),
        "a name no claim carries yet is pointed out: {}",
        printed(&out)
    );
    let (_ingest, port, _dir) = Ingress::spawn(&kafka, &topic, None);
    let extra = ["--defer-poll", "100ms"];
    let consumer =
        ConsumerProcess::spawn_with(&kafka.brokers(), &topic, &group, &db.url, None, &extra);
    let (base, http) = (format!("http://127.0.0.1:{port}"), reqwest::Client::new());
    wait_ready(&http, &base).await;
    // Events 0..40: github the even ones, stripe the odd ones; each stripe event twice.
    for n in (0..40).chain((1..40).step_by(2)) {
        assert_eq!(deliver(&http, &base, n).await, 200, "delivery {n}");
    }
    let github: HashSet<String> = (0..40).step_by(2).map(key).collect();
    let stripe: HashSet<String> = (1..40).step_by(2).map(key).collect();
    wait_for(
        "every stripe event held",
        Duration::from_secs(60),
        || async {
            db.count(
                "SELECT count(*) FROM processed_events p JOIN claim_deliveries d \
             USING (event_key, route_key) WHERE source = 'stripe' AND status = 'deferred' \
             AND deferred_reason LIKE 'its source is paused (by ann: their incident)%' \
             AND d.deliveries = 2",
            )
            .await
                == 20
        },
    )
    .await;
    assert_exactly_once(&db, &github, Duration::from_secs(60)).await;
    // Held, the claims are due at once: the applier's rounds (every 100 ms) pass them over.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        db.count("SELECT count(*) FROM ledger WHERE event_key LIKE 'stripe:%'")
            .await,
        0
    );
    let listed = sources(&db, &["list", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed[0]["source"], "stripe", "{listed}");
    assert_eq!(listed[0]["by"], "ann");

    let out = sources(&db, &["resume", "stripe", "--reason", "fixed"]);
    assert!(out.status.success(), "{}", printed(&out));
    let every: HashSet<String> = github.union(&stripe).cloned().collect();
    assert_exactly_once(&db, &every, Duration::from_secs(60)).await;
    let done = db
        .count(
            "SELECT count(*) FROM processed_events p JOIN claim_deliveries d \
             USING (event_key, route_key) WHERE status = 'done' AND d.deliveries = 2",
        )
        .await;
    assert_eq!(
        done, 20,
        "each held event applied once, its second delivery suppressed"
    );
    let again = sources(&db, &["resume", "stripe", "--reason", "twice"]);
    assert!(
        printed(&again).contains("source stripe is not paused"),
        "{}",
        printed(&again)
    );
    let seen = sources(&db, &["pause", "github", "--reason", "seen"]);
    assert!(seen.status.success(), "{}", printed(&seen));
    assert!(!printed(&seen).contains("warning"), "{}", printed(&seen));
    assert!(sources(&db, &["resume", "github", "--reason", "x"])
        .status
        .success());
    let audit: Vec<(String, String, String)> =
        sqlx::query_as("SELECT actor, action, target FROM operator_actions WHERE target = 'source:stripe' ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let row = |a: &str| ("ann".to_owned(), a.to_owned(), "source:stripe".to_owned());
    assert_eq!(audit, [row("pause"), row("resume")]);
    assert!(consumer.terminate(Duration::from_secs(30)).await.success());
    // The console's charts count the held events once, when the deferred applier applied them.
    let sums = "SELECT coalesce(sum(applied), 0)::int8, coalesce(sum(suppressed), 0)::int8 \
                FROM activity_minutes";
    let (applied, suppressed): (i64, i64) = sqlx::query_as(sums).fetch_one(&db.pool).await.unwrap();
    assert_eq!((applied, suppressed), (40, 20));
}

/// Ingest logs each accepted delivery at info with its key, request id, partition and offset,
/// at most 20 lines a second: past that a delivery is counted, and the next line logged says
/// how many were not, so the lines and their counts add up to every delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_logs_each_accepted_delivery_rate_limited_and_counts_the_rest() {
    use tokio::io::AsyncBufReadExt as _;
    let kafka = TestKafka::for_processes();
    let topic = kafka.topic(2).await;
    let (mut cmd, port, _dir) = Ingress::command(&kafka, &topic, None, &[], None);
    cmd.env("RUST_LOG", "warn,replayproof::ingest=info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped());
    let mut ingest = cmd.spawn().unwrap();
    let lines = tokio::io::BufReader::new(ingest.stderr.take().unwrap()).lines();
    let (base, http) = (format!("http://127.0.0.1:{port}"), reqwest::Client::new());
    wait_ready(&http, &base).await;
    const BURST: usize = 120;
    for n in 0..BURST {
        assert_eq!(deliver(&http, &base, n).await, 200);
    }
    // After a second, the bucket has room again: this one is logged, with the count.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(deliver(&http, &base, BURST).await, 200);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(ingest.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let mut lines = lines;
    let (mut logged, mut not_logged, mut last) = (0, 0, String::new());
    while let Some(line) = lines.next_line().await.unwrap() {
        if !line.contains("Accepted a webhook.") {
            continue;
        }
        assert!(line.contains(" INFO "), "{line}");
        for field in ["key=", "request_id=", "partition=", "offset=", "source="] {
            assert!(line.contains(field), "{field} missing: {line}");
        }
        let count = line.split("not_logged=").nth(1).unwrap();
        not_logged += count
            .split_whitespace()
            .next()
            .unwrap()
            .parse::<usize>()
            .unwrap();
        logged += 1;
        last = line;
    }
    ingest.wait().await.unwrap();
    assert!(
        logged < BURST,
        "{logged} lines for {BURST} quick deliveries: not limited"
    );
    assert_eq!(
        logged + not_logged,
        BURST + 1,
        "every delivery logged or counted"
    );
    assert!(last.contains(&format!("key={}", key(BURST))), "{last}");
}

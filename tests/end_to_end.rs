//! `replayproof ingest` and `replayproof consume` as real processes, against a real PostgreSQL
//! and the broker process (`KAFKA_BROKERS`, or the mock cluster hosted by this test).

mod common;

use common::*;
use hmac::{Hmac, Mac};
use sha2::Sha256;
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

fn sign(secret: &str, parts: &[&[u8]]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
    for p in parts {
        mac.update(p);
    }
    hex::encode(mac.finalize().into_bytes())
}

/// One delivery: the event number decides the source and the id.
async fn deliver(http: &reqwest::Client, base: &str, n: usize) -> u16 {
    let response = if n.is_multiple_of(2) {
        let body = format!(r#"{{"action":"opened","number":{n}}}"#);
        http.post(format!("{base}/webhooks/github"))
            .header(
                "x-hub-signature-256",
                format!(
                    "sha256={}",
                    sign("gh-secret-for-the-e2e-test", &[body.as_bytes()])
                ),
            )
            .header("x-github-delivery", format!("delivery-{n}"))
            .header("x-github-event", "pull_request")
            .body(body)
    } else {
        let body = format!(r#"{{"id":"evt_{n}","type":"charge.succeeded","object":"event"}}"#);
        let t = chrono::Utc::now().timestamp().to_string();
        let sig = sign(
            "whsec_e2e-secret-for-the-test",
            &[t.as_bytes(), b".", body.as_bytes()],
        );
        http.post(format!("{base}/webhooks/stripe"))
            .header("stripe-signature", format!("t={t},v1={sig}"))
            .body(body)
    };
    response
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
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
    const DISTINCT: usize = 1_400;
    const DELIVERIES: usize = 2_000;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(4).await, unique("group"));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut ingest = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .arg("ingest")
        .arg("--config")
        .arg(&config)
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--brokers",
            &kafka.brokers(),
            "--topic",
            &topic,
        ])
        .args(["--kafka-option", "broker.address.family=v4"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("E2E_GITHUB_SECRET", "gh-secret-for-the-e2e-test")
        .env("E2E_STRIPE_SECRET", "whsec_e2e-secret-for-the-test")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &db.url, None);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_for(
        "the ingress to be ready",
        Duration::from_secs(60),
        || async {
            http.get(format!("{base}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;

    // Every event once, plus 600 redeliveries, shuffled over 8 concurrent senders so that some
    // copies of one event are in flight at the same time.
    let mut rng = fastrand::Rng::with_seed(3);
    let mut plan: Vec<usize> = (0..DISTINCT).collect();
    plan.extend((0..DELIVERIES - DISTINCT).map(|_| rng.usize(..DISTINCT)));
    rng.shuffle(&mut plan);
    let plan = Arc::new(plan);
    let senders: Vec<_> = (0..8)
        .map(|client| {
            let (plan, http, base) = (plan.clone(), http.clone(), base.clone());
            tokio::spawn(async move {
                for n in plan.iter().skip(client).step_by(8) {
                    // A sender retries until it gets a 2xx.
                    let mut status = deliver(&http, &base, *n).await;
                    while status != 200 {
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

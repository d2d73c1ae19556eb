//! Drives `ingest` with many concurrent signed requests against a real broker and reports
//! requests per second with p50 and p99 latency, next to a bare endpoint that only answers 200
//! (the ceiling of the HTTP layer on this machine).
//!
//! `cargo bench --bench ingest` uses `KAFKA_BROKERS` when set, otherwise librdkafka's mock
//! cluster in this process. `BENCH_REQUESTS` (default 20000) and `BENCH_CONCURRENCY` (default
//! 64) size the run. The load generator shares the machine with what it measures.

use replayproof::devkit::embedded::EmbeddedKafka;
use replayproof::ingest::config::FileConfig;
use replayproof::ingest::{self, IngestSettings};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

mod common;
use common::{create_topic, env_or};

struct Report {
    rps: f64,
    p50: Duration,
    p99: Duration,
    errors: usize,
}

/// Sends `requests` POSTs from `concurrency` clients; request `i` carries delivery id `i`.
async fn drive(url: String, requests: usize, concurrency: usize) -> Report {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (http, url, next) = (http.clone(), url.clone(), next.clone());
            tokio::spawn(async move {
                let (mut latencies, mut errors) = (Vec::new(), 0);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= requests {
                        return (latencies, errors);
                    }
                    let body = format!(
                        r#"{{"action":"opened","number":{i},"padding":"{}"}}"#,
                        "x".repeat(512)
                    );
                    let t = Instant::now();
                    let r = http
                        .post(&url)
                        .header(
                            "x-hub-signature-256",
                            replayproof::devkit::sign::github("bench-secret", &body),
                        )
                        .header("x-github-delivery", format!("bench-{i}"))
                        .header("x-github-event", "pull_request")
                        .body(body)
                        .send()
                        .await;
                    latencies.push(t.elapsed());
                    if !r.is_ok_and(|r| r.status().is_success()) {
                        errors += 1;
                    }
                }
            })
        })
        .collect();
    let (mut all, mut errors) = (Vec::with_capacity(requests), 0);
    for w in workers {
        let (l, e) = w.await.unwrap();
        all.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed();
    all.sort();
    Report {
        rps: requests as f64 / elapsed.as_secs_f64(),
        p50: all[all.len() / 2],
        p99: all[all.len() * 99 / 100],
        errors,
    }
}

fn print(name: &str, r: &Report) {
    println!(
        "{name:<28} {:>9.0} req/s   p50 {:>7.2} ms   p99 {:>7.2} ms   errors {}",
        r.rps,
        r.p50.as_secs_f64() * 1e3,
        r.p99.as_secs_f64() * 1e3,
        r.errors
    );
}

async fn bare_endpoint() -> String {
    let app =
        axum::Router::new().route("/webhooks/{source}", axum::routing::post(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/webhooks/github")
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (requests, concurrency) = (
        env_or("BENCH_REQUESTS", 20_000),
        env_or("BENCH_CONCURRENCY", 64),
    );
    let mock = match std::env::var("KAFKA_BROKERS") {
        Ok(b) if !b.is_empty() => None,
        _ => Some(EmbeddedKafka::start().unwrap()),
    };
    let brokers = mock
        .as_ref()
        .map(|m| m.bootstrap_servers())
        .unwrap_or_else(|| std::env::var("KAFKA_BROKERS").unwrap());
    let topic = format!("bench_{}", std::process::id());
    if let Some(m) = &mock {
        m.create_topic(&topic, 4).unwrap();
    } else {
        runtime.block_on(create_topic(&brokers, &topic, 4));
    }
    let broker_name = if mock.is_some() {
        "mock cluster"
    } else {
        "KAFKA_BROKERS"
    };
    println!("{requests} requests, {concurrency} concurrent clients, broker: {broker_name}");
    runtime.block_on(async {
        let bare = drive(bare_endpoint().await, requests, concurrency).await;
        print("bare endpoint (200 only)", &bare);

        let config: FileConfig = toml::from_str(
            "[[sources]]\nname = \"github\"\nkind = \"github\"\nsecrets_env = [\"S\"]",
        )
        .unwrap();
        let sources = config
            .sources_with(|_| Some("bench-secret".into()))
            .unwrap();
        let mut settings = IngestSettings::new("127.0.0.1:0".parse().unwrap(), &brokers, &topic);
        settings.kafka_options = vec![("broker.address.family".into(), "v4".into())];
        let shutdown = CancellationToken::new();
        let ingress = ingest::Ingress::build(settings, sources, prometheus::Registry::new())
            .await
            .unwrap();
        let url = format!("http://{}/webhooks/github", ingress.addr());
        let running = ingress.run_until_stopped(shutdown.clone());
        drive(url.clone(), requests.min(2_000), concurrency).await; // warm-up
        let ingress = drive(url, requests, concurrency).await;
        print("ingest (signed, acks=all)", &ingress);
        shutdown.cancel();
        running.stopped().await.unwrap();
    });
}

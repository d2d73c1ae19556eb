//! Drives `ingest` with many concurrent signed requests against a real broker and reports
//! requests per second with p50 and p99 latency, next to a bare endpoint that only answers 200
//! (the ceiling of the HTTP layer on this machine).
//!
//! Then the `replayproof ingest` process, without an OTLP endpoint and with every request's
//! span exported to a collector in this process, interleaved (`BENCH_ROUNDS`, 3; medians),
//! with the CPU the process used per 10,000 requests: what tracing costs when it is on, and
//! that it costs nothing when it is not.
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

/// CPU seconds a process has used (user and system), from `/proc`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// The `replayproof ingest` process on `brokers`, traced to `otlp` when given: the requests'
/// report and the CPU seconds it used per 10,000 requests.
async fn process_run(
    brokers: &str,
    topic: &str,
    requests: usize,
    concurrency: usize,
    otlp: Option<&str>,
) -> (Report, f64) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(
        &config,
        "[[ingest.sources]]\nname = \"github\"\nkind = \"github\"\nsecrets_env = [\"S\"]\n",
    )
    .unwrap();
    let port = common::free_port();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    if let Some(endpoint) = otlp {
        command.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    }
    let mut child = command
        .arg("ingest")
        .arg("--config")
        .arg(&config)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--brokers", brokers, "--topic", topic])
        .args(["--kafka-option", "broker.address.family=v4"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("S", "bench-secret-0123456789")
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let base = format!("http://127.0.0.1:{port}");
    while reqwest::get(format!("{base}/readyz"))
        .await
        .map_or(true, |r| !r.status().is_success())
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url = format!("{base}/webhooks/github");
    drive(url.clone(), requests.min(2_000), concurrency).await; // warm-up
    let cpu = cpu_seconds(pid);
    let report = drive(url, requests, concurrency).await;
    let cpu = cpu_seconds(pid) - cpu;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    child.wait().await.unwrap();
    (report, cpu * 10_000.0 / requests as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

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
                            replayproof::devkit::sign::github("bench-secret-0123456789", &body),
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
            .sources_with(|_| Some("bench-secret-0123456789".into()))
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

        let exported = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let endpoint = common::otlp_sink(exported.clone()).await;
        let (mut off, mut on) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
        for _ in 0..env_or("BENCH_ROUNDS", 3) {
            for (otlp, into) in [(None, &mut off), (Some(endpoint.as_str()), &mut on)] {
                let (report, cpu) =
                    process_run(&brokers, &topic, requests, concurrency, otlp).await;
                let name = match otlp {
                    None => "process, no OTLP endpoint",
                    Some(_) => "process, spans exported",
                };
                print(name, &report);
                into.0.push(report.rps);
                into.1.push(cpu);
            }
        }
        let (off_rps, on_rps) = (median(off.0), median(on.0));
        println!(
            "medians: no endpoint {off_rps:.0} req/s, {:.2} CPU s per 10,000; exported {on_rps:.0} \
             req/s, {:.2} CPU s per 10,000; exported/no endpoint {:.2}; {} KiB of spans exported",
            median(off.1),
            median(on.1),
            on_rps / off_rps,
            exported.load(std::sync::atomic::Ordering::Relaxed) / 1024,
        );
        println!(
            "process with no endpoint ÷ bare endpoint: {:.2}",
            off_rps / bare.rps
        );
    });
}

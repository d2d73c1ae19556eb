//! What the benchmarks share: their sizes from the environment and a topic on a broker.

use replayproof::devkit::embedded::{EmbeddedKafka, EmbeddedPostgres};
use std::time::Duration;

/// PostgreSQL for a benchmark: `DATABASE_URL` when set, otherwise a throwaway server started
/// with `settings` (running while the first value lives); and its URL.
#[allow(dead_code)]
pub fn postgres(settings: &[&str]) -> (Option<EmbeddedPostgres>, String) {
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (None, url),
        _ => {
            let server = EmbeddedPostgres::start_with(settings).unwrap();
            let url = server.url();
            (Some(server), url)
        }
    }
}

/// The broker for a benchmark: `KAFKA_BROKERS` when set, otherwise librdkafka's mock cluster in
/// this process (running while the first value lives); and its bootstrap servers.
#[allow(dead_code)]
pub fn kafka() -> (Option<EmbeddedKafka>, String) {
    match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) if !brokers.is_empty() => (None, brokers),
        _ => {
            let mock = EmbeddedKafka::start().unwrap();
            let brokers = mock.bootstrap_servers();
            (Some(mock), brokers)
        }
    }
}

/// A free TCP port on 127.0.0.1, for a child process's metrics server.
#[allow(dead_code)]
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A size from the environment, or `default`.
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of a run's figures.
#[allow(dead_code)]
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// A client of `brokers` (IPv4, quiet).
#[allow(dead_code)]
pub fn client(brokers: &str) -> rdkafka::ClientConfig {
    let mut c = rdkafka::ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("broker.address.family", "v4")
        .set("log_level", "3");
    c
}

/// Creates `topic` on a broker process, then gives its metadata a moment to spread.
#[allow(dead_code)]
pub async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<_> = client(brokers).create().unwrap();
    admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// An OTLP/HTTP collector that takes every export and keeps only a count of the bytes: the
/// endpoint of the benchmarks' traced runs. Returns `OTEL_EXPORTER_OTLP_ENDPOINT`.
#[allow(dead_code)]
pub async fn otlp_sink(received: std::sync::Arc<std::sync::atomic::AtomicUsize>) -> String {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let received = received.clone();
            async move {
                received.fetch_add(body.len(), std::sync::atomic::Ordering::Relaxed);
                ""
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    endpoint
}

/// Applies each partition's messages through `processor` in batches of `batch`, one lane per
/// partition at once, and returns the time until every lane's batches committed (the
/// processor's pools closed after). Panics when a batch was left to retry.
#[allow(dead_code)]
pub async fn apply_in_lanes(
    processor: replayproof::consume::BatchProcessor,
    partitions: &[Vec<replayproof::consume::RawMessage>],
    batch: usize,
) -> Duration {
    let started = std::time::Instant::now();
    let lanes: Vec<_> = partitions
        .iter()
        .enumerate()
        .map(|(p, messages)| {
            let (processor, messages) = (processor.clone(), messages.clone());
            tokio::spawn(async move {
                let mut retrying = replayproof::consume::Retrying::default();
                for chunk in messages.chunks(batch) {
                    processor
                        .process_pass("bench", p as i32, chunk, &mut retrying)
                        .await
                        .unwrap();
                }
                assert!(retrying.next_due().is_none(), "a batch was left to retry");
            })
        })
        .collect();
    for lane in lanes {
        lane.await.unwrap();
    }
    let took = started.elapsed();
    processor.shards.close().await;
    took
}

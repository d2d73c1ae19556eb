//! Offered load far above what the ingress can acknowledge, for 30 s, against the real
//! process: it keeps answering, every answer is 2xx or 503, every 2xx'd delivery is on the
//! topic, and its memory stays under the bound docs/ingest.md gives whatever the load.

use crate::harness::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncBufReadExt as _;

const SECRET: &str = "whsec_overload-secret-0123456789";
const PARTITIONS: i32 = 4;
/// Verified webhooks being produced at once: a small capacity, so that 256 senders are far
/// above it.
const MAX_IN_FLIGHT: &str = "8";
const SENDERS: usize = 256;
const LOAD: Duration = Duration::from_secs(30);
/// The bound docs/ingest.md gives for these settings, in MiB: the process's base, plus the
/// connections' buffers and bodies of up to 1 MiB for the 8 in flight.
const RSS_BOUND_MIB: u64 = 128;

/// The process's resident memory, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The keys of every record on `topic`, all partitions.
fn keys_on(brokers: &str, topic: &str) -> HashSet<String> {
    let consumer: BaseConsumer = client_config(brokers)
        .set("group.id", unique("reader"))
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    let mut expected = 0;
    for p in 0..PARTITIONS {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .unwrap();
        expected += high - low;
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut keys = HashSet::new();
    let mut read = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    while read < expected {
        assert!(
            Instant::now() < deadline,
            "read {read} of {expected} records"
        );
        if let Some(m) = consumer.poll(Duration::from_secs(5)) {
            let m = m.unwrap();
            keys.insert(String::from_utf8(m.key().unwrap().to_vec()).unwrap());
            read += 1;
        }
    }
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_far_above_capacity_gets_2xx_or_503_loses_no_2xx_and_memory_stays_bounded() {
    let _heavy = heavy().await;
    let kafka = TestKafka::for_processes();
    let topic = kafka.topic(PARTITIONS).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(
        &config,
        "[[ingest.sources]]\nname = \"stripe\"\nkind = \"stripe\"\nsecrets_env = [\"S\"]\n",
    )
    .unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .arg("ingest")
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"])
        .args(["--brokers", &kafka.brokers(), "--topic", &topic])
        .args(["--kafka-option", "broker.address.family=v4"])
        .args(["--max-in-flight", MAX_IN_FLIGHT, "--shutdown-delay", "0s"])
        .env("S", SECRET)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    // The address it bound (port 0), from its log; the rest of the log is drained.
    let mut log = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = tokio::time::timeout(Duration::from_secs(60), log.next_line())
            .await
            .expect("the ingress logs its address")
            .unwrap()
            .expect("the ingress exited before listening");
        if let Some(at) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
        {
            break at.to_owned();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = log.next_line().await {} });
    let base = format!("http://{addr}");
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(SENDERS)
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    wait_ready(&http, &base).await;

    let idle_rss = rss_kib(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let rss = rss_kib(pid);
                peak.fetch_max(rss, Ordering::Relaxed);
                samples.push(rss);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            samples
        })
    };
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let (ok, unavailable) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let other = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let senders: Vec<_> = (0..SENDERS)
        .map(|sender| {
            let (http, url) = (http.clone(), format!("{base}/webhooks/stripe"));
            let (accepted, ok, unavailable, other) = (
                accepted.clone(),
                ok.clone(),
                unavailable.clone(),
                other.clone(),
            );
            tokio::spawn(async move {
                let mut i = 0;
                // Each sender resends at once, never waiting out Retry-After: the most a
                // crowd of senders can offer.
                while started.elapsed() < LOAD {
                    i += 1;
                    let id = format!("evt_{sender}_{i}");
                    let body = format!(
                        r#"{{"id":"{id}","object":"event","type":"invoice.paid","created":{},"data":{{"object":{{"amount":{i}}}}}}}"#,
                        chrono::Utc::now().timestamp()
                    );
                    let now = chrono::Utc::now().timestamp().to_string();
                    let answer = http
                        .post(&url)
                        .header(
                            "stripe-signature",
                            replayproof::devkit::sign::stripe(SECRET, &now, &body),
                        )
                        .body(body)
                        .send()
                        .await;
                    match answer.map(|r| r.status().as_u16()) {
                        Ok(200..=299) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            accepted.lock().unwrap().push(format!("stripe:{id}"));
                        }
                        Ok(503) => {
                            unavailable.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(status) => other.lock().unwrap().push(status.to_string()),
                        Err(e) => other.lock().unwrap().push(e.to_string()),
                    }
                }
            })
        })
        .collect();
    for s in senders {
        s.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.await.unwrap();

    let other = other.lock().unwrap().clone();
    assert!(
        other.is_empty(),
        "answers other than 2xx and 503 (or no answer): {} of them, first {:?}",
        other.len(),
        &other[..other.len().min(5)]
    );
    let (ok, unavailable) = (
        ok.load(Ordering::Relaxed),
        unavailable.load(Ordering::Relaxed),
    );
    assert!(ok > 100, "only {ok} deliveries were acknowledged in 30 s");
    assert!(
        unavailable > ok,
        "the load was not far above capacity: {ok} 2xx, {unavailable} 503"
    );
    // Still answering, at once, after the storm.
    assert_eq!(http_get_status(&http, &format!("{base}/readyz")).await, 200);

    let on_topic = keys_on(&kafka.brokers(), &topic);
    let accepted = accepted.lock().unwrap().clone();
    let lost: Vec<&String> = accepted.iter().filter(|k| !on_topic.contains(*k)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged deliveries are not on the topic, e.g. {:?}",
        lost.len(),
        accepted.len(),
        &lost[..lost.len().min(5)]
    );

    let peak_mib = peak.load(Ordering::Relaxed) / 1024;
    assert!(
        peak_mib < RSS_BOUND_MIB,
        "peak RSS {peak_mib} MiB over the {RSS_BOUND_MIB} MiB bound (idle {} MiB)",
        idle_rss / 1024
    );
    // Memory does not grow with the time under load: the last third's peak is within the
    // allocator's slack of the first third's.
    let third = samples.len() / 3;
    let first = samples[..third].iter().max().copied().unwrap_or(0);
    let last = samples[samples.len() - third..]
        .iter()
        .max()
        .copied()
        .unwrap_or(0);
    assert!(
        last <= first + first / 4 + 8 * 1024,
        "RSS grew under a steady load: first third's peak {} MiB, last third's {} MiB",
        first / 1024,
        last / 1024
    );
    eprintln!(
        "{ok} acknowledged, {unavailable} answered 503 in {:.0} s; RSS idle {} MiB, peak \
         {peak_mib} MiB",
        LOAD.as_secs_f64(),
        idle_rss / 1024
    );
    drop(child);
}

async fn http_get_status(http: &reqwest::Client, url: &str) -> u16 {
    http.get(url)
        .send()
        .await
        .map_or(0, |r| r.status().as_u16())
}

//! What the Kafka output relay costs against the fastest way to put the same records on the
//! same partitions, side by side in one run on one broker and one PostgreSQL server:
//!
//! - **bare**: a loop handing every record to an idempotent producer (`acks=all`, the relay's
//!   `linger.ms`), its partition computed (murmur2) and its headers set as the relay sets
//!   them, then waiting for every acknowledgement: no database at all;
//! - **relay**: the same records enqueued in `output_records` beforehand (untimed, with
//!   `output::enqueue_all`), then `output::Relay` (what `dispatch --brokers` runs) from start
//!   until every record is recorded `sent` in the database: partitioning, leases, the in-doubt
//!   mark before each batch and the offsets recorded after it included.
//!
//! Payloads of 512 B and 2 KiB, 4 partitions, a fresh topic per run. Runs are interleaved
//! (the order alternating) and repeated (`BENCH_REPEATS`, 3); medians are printed with the
//! ratio relay / bare, and CPU per record: this process's (the relay or the loop, plus
//! librdkafka's threads) and every `postgres` process's on the machine. After each run the
//! topic's log is checked to hold exactly the records sent. Without `DATABASE_URL` a throwaway
//! PostgreSQL is started with durable settings (`fsync=on`, `synchronous_commit=on`); without
//! `KAFKA_BROKERS`, librdkafka's mock cluster runs in this process (its CPU then counts as
//! this process's, and it keeps 5 MiB per partition, so runs are sized to fit). Size:
//! `BENCH_RECORDS` (50000 per run).
//!
//! `cargo bench --bench output`

// A benchmark's run reads as one script, start to finish: long ones are allowed here.
#![allow(clippy::too_many_lines)]

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use replayproof::db::Db;
use replayproof::envelope::{Envelope, Event};
use replayproof::output::{self, OutputMetrics, OutputRecord, Relay, RelaySettings};
use replayproof::telemetry::Health;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

// Its sizes from the environment, its servers and its topic helper are used here.
#[allow(dead_code)]
mod common;
use common::{create_topic, env_or, median};

const PARTITIONS: i32 = 4;
const SIZES: [usize; 2] = [512, 2048];
/// librdkafka properties both runs share: the relay's own besides its guarded ones.
const SHARED: [(&str, &str); 2] = [("broker.address.family", "v4"), ("log_level", "3")];

/// The events of one run, and the records the built-in effect makes of them.
struct Workload {
    events: Vec<Event>,
    records: Vec<OutputRecord>,
}

impl Workload {
    fn new(run: &str, count: usize, size: usize, topic: &str) -> Self {
        let events: Vec<Event> = (0..count)
            .map(|i| {
                let key = format!("{run}-evt-{i:08}");
                let pad = "x".repeat(size.saturating_sub(40));
                let envelope = Envelope {
                    route: None,
                    key: key.as_str().try_into().unwrap(),
                    source: "bench".into(),
                    event_type: Some("bench.event".into()),
                    received_at: None,
                    occurred_at: None,
                    payload: serde_json::value::to_raw_value(
                        &serde_json::json!({ "id": i, "pad": pad }),
                    )
                    .unwrap(),
                    unhashed: Vec::new(),
                    replay_window_secs: None,
                    request_id: None,
                };
                Event::parse(Some(key.as_bytes()), Some(&envelope.to_bytes())).unwrap()
            })
            .collect();
        let records = events
            .iter()
            .map(|e| OutputRecord::of_event(e, topic))
            .collect();
        Self { events, records }
    }
}

/// The bare loop: every record handed to the producer, then every acknowledgement awaited.
async fn bare(brokers: &str, topic: &str, w: &Workload) -> Duration {
    let options: Vec<(String, String)> = SHARED
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let tuning = [
        ("client.id", "bench-bare".to_string()),
        ("linger.ms", "5".into()),
    ];
    let producer: FutureProducer = replayproof::kafka::client_config(
        replayproof::kafka::Role::Producer,
        brokers,
        None,
        &tuning,
        &options,
    )
    .unwrap()
    .create()
    .unwrap();
    let started = Instant::now();
    let mut deliveries = Vec::with_capacity(w.records.len());
    for (event, record) in w.events.iter().zip(&w.records) {
        let key = record.key.as_deref().unwrap();
        let partition = output::partitioner::partition_of(key, PARTITIONS);
        let id = output::record_id(event.key.as_str(), &record.name);
        let mut headers = OwnedHeaders::new_with_capacity(record.headers.len() + 1);
        for (name, value) in &record.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        headers = headers.insert(Header {
            key: output::RECORD_ID_HEADER,
            value: Some(id.as_bytes()),
        });
        let mut message = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(partition)
            .key(key)
            .payload(record.value.as_deref().unwrap())
            .headers(headers);
        loop {
            match producer.send_result(message) {
                Ok(delivery) => break deliveries.push(delivery),
                Err((_, back)) => {
                    // The producer's queue is full: let it drain.
                    producer.poll(Duration::from_millis(1));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    message = back;
                }
            }
        }
    }
    for delivery in deliveries {
        delivery.await.unwrap().map_err(|(e, _)| e).unwrap();
    }
    let took = started.elapsed();
    producer.flush(Duration::from_secs(10)).unwrap();
    took
}

/// The relay: from its start until every enqueued record is recorded sent.
async fn relay(brokers: &str, pool: &Db, w: &Workload) -> Duration {
    let mut settings = RelaySettings::new("bench-relay", brokers);
    settings.kafka_options = SHARED
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let registry = prometheus::Registry::new();
    let metrics = OutputMetrics::new(&registry).unwrap();
    let relay = Relay::build(settings, pool.clone(), metrics.clone(), Health::default()).unwrap();
    let topic = w.records[0].topic.clone();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let running = tokio::spawn(relay.run(shutdown.clone()));
    // The counter is in this process: watching it costs the database nothing.
    while metrics.produced.with_label_values(&[topic.as_str()]).get() < w.records.len() as u64 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    loop {
        let pending: i64 =
            sqlx::query_scalar("SELECT count(*) FROM output_records WHERE state = 'pending'")
                .fetch_one(pool)
                .await
                .unwrap();
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = started.elapsed();
    shutdown.cancel();
    running.await.unwrap().unwrap();
    took
}

/// Enqueues the workload's records as the effect does, in transactions of 500 (untimed).
async fn enqueue(pool: &Db, w: &Workload) {
    for (events, records) in w.events.chunks(500).zip(w.records.chunks(500)) {
        let all: Vec<(&Event, &OutputRecord)> = events.iter().zip(records).collect();
        let mut tx = pool.begin().await.unwrap();
        output::enqueue_all(&mut tx, &all).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// The number of records in the topic's log, summed over its partitions.
fn logged(brokers: &str, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    let mut config = common::client(brokers);
    config.set("group.id", "bench-output-check");
    let consumer: BaseConsumer = config.create().unwrap();
    (0..PARTITIONS)
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            high - low
        })
        .sum()
}

/// A fresh migrated database on the server of `admin`, and its name.
async fn database(admin: &Db, admin_url: &str) -> (Db, String) {
    let name = format!("rp_bench_output_{:08x}", fastrand::u32(..));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin)
        .await
        .unwrap();
    let mut url = url::Url::parse(admin_url).unwrap();
    url.set_path(&name);
    let pool = replayproof::db::pool(&url.as_str().parse().unwrap(), 8).unwrap();
    replayproof::db::migrate(&pool).await.unwrap();
    (pool, name)
}

/// CPU time this process has used (user and system), in milliseconds.
fn cpu_ms() -> u64 {
    proc_cpu_ms("/proc/self/stat").unwrap()
}

/// CPU time every `postgres` process on the machine has used, in milliseconds.
fn postgres_cpu_ms() -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| {
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            stat.contains("(postgres)")
                .then(|| proc_cpu_ms(&e.path().join("stat").to_string_lossy()))?
        })
        .sum()
}

/// A process's user and system CPU time from its `stat` file, at 10 ms resolution.
fn proc_cpu_ms(path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some((fields[11].parse::<u64>().ok()? + fields[12].parse::<u64>().ok()?) * 10)
}

/// One run's figures.
#[derive(Clone, Copy)]
struct Figures {
    rate: f64,
    /// This process's CPU per record, in microseconds.
    cpu_us: f64,
    /// PostgreSQL's CPU per record, in microseconds.
    pg_us: f64,
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let records = env_or("BENCH_RECORDS", 50_000);
    let repeats = env_or("BENCH_REPEATS", 3);
    let (embedded_pg, database_url) = common::postgres(&[
        "fsync=on",
        "synchronous_commit=on",
        "shared_buffers=512MB",
        "max_wal_size=8GB",
    ]);
    let (mock, brokers) = common::kafka();
    println!(
        "{PARTITIONS} partitions, {repeats} repeats; broker: {}; PostgreSQL: {}; {} cores",
        if mock.is_some() {
            "mock cluster (in process)"
        } else {
            "KAFKA_BROKERS"
        },
        if embedded_pg.is_some() {
            "throwaway, fsync=on"
        } else {
            "DATABASE_URL"
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let mut results: BTreeMap<(&str, usize), Vec<Figures>> = BTreeMap::new();
    runtime.block_on(async {
        let admin = Db::from(sqlx::PgPool::connect(&database_url).await.unwrap());
        for repeat in 0..repeats {
            for size in SIZES {
                // The mock cluster keeps at most 5 MiB per partition.
                let count = match &mock {
                    Some(_) => records.min((4 << 20) / (size + 200) * PARTITIONS as usize * 9 / 10),
                    None => records,
                };
                let order: [&str; 2] = if repeat % 2 == 0 {
                    ["bare", "relay"]
                } else {
                    ["relay", "bare"]
                };
                for stage in order {
                    let topic = format!("bench_output_{stage}_{size}_{repeat}_{}", std::process::id());
                    match &mock {
                        Some(m) => m.create_topic(&topic, PARTITIONS).unwrap(),
                        None => create_topic(&brokers, &topic, PARTITIONS).await,
                    }
                    let w = Workload::new(&format!("r{repeat}"), count, size, &topic);
                    let db = match stage {
                        "relay" => {
                            let (pool, name) = database(&admin, &database_url).await;
                            enqueue(&pool, &w).await;
                            sqlx::query("CHECKPOINT").execute(&admin).await.unwrap();
                            Some((pool, name))
                        }
                        _ => None,
                    };
                    let (cpu, pg) = (cpu_ms(), postgres_cpu_ms());
                    let took = match &db {
                        Some((pool, _)) => relay(&brokers, pool, &w).await,
                        None => bare(&brokers, &topic, &w).await,
                    };
                    let (cpu, pg) = (cpu_ms() - cpu, postgres_cpu_ms().saturating_sub(pg));
                    let in_log = logged(&brokers, &topic);
                    assert_eq!(in_log, count as i64, "{stage}: the topic holds {in_log} records of {count}");
                    if let Some((pool, name)) = db {
                        pool.close().await;
                        sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
                            .execute(&admin)
                            .await
                            .unwrap();
                    }
                    let figures = Figures {
                        rate: count as f64 / took.as_secs_f64(),
                        cpu_us: cpu as f64 * 1000.0 / count as f64,
                        pg_us: pg as f64 * 1000.0 / count as f64,
                    };
                    println!(
                        "  {stage:>5} {size:>5} B, {count} records: {:>8.0} records/s, {:>6.1} µs CPU/record here, {:>6.1} µs in PostgreSQL",
                        figures.rate, figures.cpu_us, figures.pg_us
                    );
                    results.entry((stage, size)).or_default().push(figures);
                }
            }
        }
    });
    println!("\nmedians of {repeats}:");
    println!("| payload | bare records/s | relay records/s | relay / bare | CPU/record bare | CPU/record relay | PostgreSQL CPU/record (relay) |");
    println!("|---|---|---|---|---|---|---|");
    for size in SIZES {
        let m = |stage: &str, f: fn(&Figures) -> f64| {
            median(results[&(stage, size)].iter().map(f).collect())
        };
        let (bare, relay) = (m("bare", |f| f.rate), m("relay", |f| f.rate));
        println!(
            "| {size} B | {bare:.0} | {relay:.0} | {:.2} | {:.1} µs | {:.1} µs | {:.1} µs |",
            relay / bare,
            m("bare", |f| f.cpu_us),
            m("relay", |f| f.cpu_us),
            m("relay", |f| f.pg_us),
        );
    }
}

//! What applying events costs, stage by stage, side by side in one run against one PostgreSQL
//! and one broker, with the same payloads (100 B and 2 KiB), 30% replays and 4 partitions:
//!
//! - **A** the PostgreSQL limit: per batch of 500, one `INSERT … SELECT unnest … ON CONFLICT DO
//!   NOTHING RETURNING` into the claims and one insert of the effect rows, from arrays prepared
//!   beforehand, one connection per partition;
//! - **B** the batch processor (`BatchProcessor::process_pass`) fed the encoded messages, one
//!   lane per partition, no Kafka;
//! - **C** Kafka alone: the topic read into a counting sink;
//! - **D** the `replayproof consume` process with default settings draining the pre-filled topic;
//! - **T** D with traces exported over OTLP to a collector in this process (one span per event
//!   and per batch); D is the same process without an endpoint, when no span is made;
//! - **E** the peer: the copied snippet done right, one transaction per message (claim, then
//!   effect), then the offset;
//! - **F** A and B again with 1M and 10M keys already claimed (repeated, medians);
//! - **G** B with 0.2% of effects failing (retried, then recorded as failed);
//! - **H** B with 1% of events deferred by their effect (committed `deferred`, the partition
//!   moving on); then **H2**, the consumer's background task applying those deferred events
//!   once they can apply, one transaction per event, next to E (also one transaction per
//!   message);
//! - **L** the consumer next to PostgreSQL's own batched limit, fresh and fully redelivered
//!   backlogs, one and two processes (`consume/limit.rs` says what each of its runs is);
//! - statements and WAL bytes per message for A, B and D, the consumer's peak RSS during D, and a
//!   memory run: the consumer draining a backlog of 1M messages of 2 KiB on 16 partitions.
//!
//! Stages are interleaved and repeated (`BENCH_REPEATS`, 3); medians are printed. Without
//! `DATABASE_URL` a throwaway PostgreSQL is started with durable settings (`fsync=on`,
//! `synchronous_commit=on`) and `pg_stat_statements`; without `KAFKA_BROKERS`, librdkafka's
//! mock cluster runs in this process. Sizes: `BENCH_EVENTS` (50000 events per run, plus 30%
//! replays), `BENCH_PEER_MESSAGES` (10000: the peer is timed on the first messages of the same
//! backlog), `BENCH_PREFILL` (`1000000,10000000`; empty skips F), `BENCH_MEMORY_MESSAGES`
//! (1000000; 0 skips the memory run), `BENCH_LIMIT_EVENTS` (100000, L's backlog).
//! `BENCH_STAGES` picks stages (`ABCDEGHTL`),
//! `BENCH_STATEMENT_TIMES=1` prints each run's slowest statements from `pg_stat_statements`, and
//! `BENCH_D_ARGS` adds arguments to the consumer of D and of the memory run. Stages A and B print
//! the CPU time the benchmark process used while timed.
//!
//! `cargo bench --bench consume`

// A benchmark's run reads as one script, start to finish: long ones are allowed here.
#![allow(clippy::too_many_lines)]

use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use replayproof::consume::{BatchProcessor, ConsumeMetrics, DeferredApplier, RawMessage, Retrying};
use replayproof::db::Db;
use replayproof::devkit::embedded::EmbeddedKafka;
use replayproof::effect::{Deferred, Effect, EffectError, Ledger, Tx};
use replayproof::envelope::{Envelope, Event};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "consume/backlog.rs"]
mod backlog;
mod common;
use common::{client, create_topic, env_or, median};
#[path = "consume/limit.rs"]
mod limit;
#[path = "consume/sent.rs"]
mod sent;
#[path = "consume/summary.rs"]
mod summary;

const PARTITIONS: i32 = 4;
const BATCH: usize = 500;
const SIZES: [usize; 2] = [100, 2048];

/// One workload: the encoded messages by partition, in offset order.
struct Workload {
    size: usize,
    partitions: Vec<Vec<RawMessage>>,
}

impl Workload {
    /// `events` keys with a payload of about `size` bytes, and `replays` more messages that
    /// repeat a random one of them, all in a random order; keys are spread over the partitions
    /// by a stable hash.
    fn new(prefix: &str, events: usize, replays: usize, size: usize, partitions: i32) -> Self {
        let mut rng = fastrand::Rng::with_seed(size as u64);
        let replayed: Vec<usize> = (0..replays).map(|_| rng.usize(..events)).collect();
        let mut order: Vec<(u64, usize)> = (0..events)
            .chain(replayed)
            .map(|i| (rng.u64(..), i))
            .collect();
        order.sort_unstable();
        let order = order.into_iter().map(|(_, i)| i);
        let mut by_partition: Vec<Vec<RawMessage>> = vec![Vec::new(); partitions as usize];
        for i in order {
            let key = format!("{prefix}-{size}-{i:08}");
            let envelope = Envelope {
                route: None,
                key: key.as_str().try_into().unwrap(),
                source: "bench".into(),
                event_type: Some("bench.event".into()),
                received_at: None,
                occurred_at: None,
                payload: payload(i, size),
                unhashed: Vec::new(),
                replay_window_secs: None,
                request_id: None,
            };
            let p = (fxhash(&key) % partitions as u64) as usize;
            let offset = by_partition[p].len() as i64;
            by_partition[p].push(RawMessage {
                offset,
                key: Some(key.into_bytes()),
                value: Some(envelope.to_bytes()),
                traceparent: None,
                headers: Default::default(),
            });
        }
        Self {
            size,
            partitions: by_partition,
        }
    }

    fn messages(&self) -> usize {
        self.partitions.iter().map(Vec::len).sum()
    }
}

/// A payload of about `size` bytes whose padding does not compress (as real payloads mostly
/// do not), so the WAL and TOAST costs are those of `size` bytes.
fn payload(i: usize, size: usize) -> Box<serde_json::value::RawValue> {
    let mut rng = fastrand::Rng::with_seed(i as u64);
    let pad: String = (0..size.saturating_sub(60))
        .map(|_| rng.alphanumeric())
        .collect();
    let value = serde_json::json!({ "id": format!("evt_{i}"), "amount": i % 10_000, "pad": pad });
    serde_json::value::to_raw_value(&value).expect("a JSON value serialises")
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// The PostgreSQL everything runs against: one migrated template, a fresh database per run.
struct Database {
    admin: Db,
    base_url: String,
    next: std::sync::atomic::AtomicUsize,
    statements: bool,
}

impl Database {
    async fn new(url: &str) -> Self {
        let admin: Db = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .unwrap()
            .into();
        let base_url = url.rsplit_once('/').unwrap().0.to_owned();
        let _ = sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&admin)
            .await;
        let _ = sqlx::query("DROP DATABASE IF EXISTS bench_template")
            .execute(&admin)
            .await;
        sqlx::query("CREATE DATABASE bench_template")
            .execute(&admin)
            .await
            .unwrap();
        let template =
            replayproof::db::pool(&format!("{base_url}/bench_template").parse().unwrap(), 2)
                .unwrap();
        replayproof::db::migrate(&template).await.unwrap();
        let statements =
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements SCHEMA public")
                .execute(&template)
                .await
                .is_ok()
                && sqlx::query("SELECT count(*) FROM pg_stat_statements")
                    .execute(&template)
                    .await
                    .is_ok();
        template.close().await;
        Self {
            admin,
            base_url,
            next: Default::default(),
            statements,
        }
    }

    /// A fresh migrated database, from the template or another one.
    async fn fresh(&self, template: &str) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("bench_run_{n}");
        // A session that just closed can linger a moment on the template.
        for _ in 0..50 {
            // Copied as files, not through the WAL, and checkpointed: a run starts with no
            // writes of the copy or of the run before it still to flush.
            let created = sqlx::query(&format!(
                "CREATE DATABASE {name} TEMPLATE {template} STRATEGY = FILE_COPY"
            ))
            .execute(&self.admin)
            .await;
            if created.is_ok() {
                sqlx::query("CHECKPOINT")
                    .execute(&self.admin)
                    .await
                    .unwrap();
                return format!("{}/{name}", self.base_url);
            }
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            )
            .bind(template)
            .execute(&self.admin)
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("could not copy the database {template}");
    }

    async fn drop(&self, url: &str) {
        let name = url.rsplit_once('/').unwrap().1;
        let _ = sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
            .execute(&self.admin)
            .await;
    }

    /// Statements run and WAL written from here on, read by [`Counters::since`].
    async fn counters(&self) -> Counters {
        if self.statements {
            let _ = sqlx::query("SELECT pg_stat_statements_reset()")
                .execute(&self.admin)
                .await;
        }
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&self.admin)
            .await
            .unwrap();
        Counters { lsn }
    }
}

struct Counters {
    lsn: String,
}

#[derive(Clone, Copy, Default)]
struct Cost {
    statements: Option<f64>,
    wal_bytes: f64,
}

impl Counters {
    /// Per message, for the database `url`.
    async fn since(&self, db: &Database, url: &str, messages: usize) -> Cost {
        let wal: f64 = sqlx::query_scalar(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
        )
        .bind(&self.lsn)
        .fetch_one(&db.admin)
        .await
        .unwrap();
        let name = url.rsplit_once('/').unwrap().1;
        let statements = if db.statements {
            sqlx::query_scalar::<_, f64>(
                "SELECT coalesce(sum(calls), 0)::float8 FROM pg_stat_statements s
                 JOIN pg_database d ON d.oid = s.dbid
                 WHERE d.datname = $1",
            )
            .bind(name)
            .fetch_one(&db.admin)
            .await
            .ok()
        } else {
            None
        };
        if db.statements && std::env::var_os("BENCH_STATEMENT_TIMES").is_some() {
            let rows: Vec<(f64, f64, f64, String)> = sqlx::query_as(
                "SELECT calls::float8, total_exec_time, mean_exec_time, left(query, 70)
                 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
                 WHERE d.datname = $1 ORDER BY total_exec_time DESC LIMIT 6",
            )
            .bind(name)
            .fetch_all(&db.admin)
            .await
            .unwrap_or_default();
            for (calls, total, mean, query) in rows {
                let query = query.split_whitespace().collect::<Vec<_>>().join(" ");
                println!("    {calls:>6.0} calls {total:>8.1} ms {mean:>6.3} ms/call  {query}");
            }
            // Autovacuum and autoanalyze runs so far count in PostgreSQL's CPU too.
            let here = pool(url, 1).await;
            let maintenance: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0)::int8
                 FROM pg_stat_user_tables",
            )
            .fetch_one(&here)
            .await
            .unwrap_or(-1);
            here.close().await;
            println!("    autovacuum and autoanalyze runs on its tables so far: {maintenance}");
        }
        Cost {
            statements: statements.map(|n| n / messages as f64),
            wal_bytes: wal / messages as f64,
        }
    }
}

async fn pool(url: &str, connections: u32) -> Db {
    replayproof::db::pool(&url.parse().unwrap(), connections).unwrap()
}

// ------------------------------------------------------------------------------------ stage A

/// A batch's columns, prepared before the clock starts.
struct Columns {
    keys: Vec<String>,
    hashes: Vec<Vec<u8>>,
    payloads: Vec<String>,
    offsets: Vec<i64>,
}

fn columns(messages: &[RawMessage]) -> Columns {
    let events: Vec<Event> = messages
        .iter()
        .map(|m| Event::parse(m.key.as_deref(), m.value.as_deref()).unwrap())
        .collect();
    Columns {
        keys: events.iter().map(|e| e.key.to_string()).collect(),
        hashes: events.iter().map(|e| e.payload_sha256.to_vec()).collect(),
        payloads: events
            .iter()
            .map(|e| e.payload_json.get().to_owned())
            .collect(),
        offsets: messages.iter().map(|m| m.offset).collect(),
    }
}

/// Claim + effect for one batch, in one transaction, with the consumer's table layout.
async fn claim_and_apply(pool: &Db, c: &Columns) {
    let mut tx = pool.begin().await.unwrap();
    let sources = vec!["bench"; c.keys.len()];
    let claimed: Vec<String> = sqlx::query_scalar(
        r#"INSERT INTO processed_events (event_key, route_key, source, event_type, status,
                payload_sha256, kafka_topic, kafka_partition, kafka_offset, attempts, completed_at)
           SELECT k, k, s, 'bench.event', 'done', h, 'bench', 0, o, 1, now()
           FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[]) AS u(k, s, h, o)
           ORDER BY k COLLATE "C"
           ON CONFLICT (event_key, route_key) DO NOTHING
           RETURNING event_key"#,
    )
    .bind(&c.keys)
    .bind(&sources)
    .bind(&c.hashes)
    .bind(&c.offsets)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    let claimed: std::collections::HashSet<String> = claimed.into_iter().collect();
    let (keys, payloads): (Vec<&String>, Vec<&String>) = c
        .keys
        .iter()
        .zip(&c.payloads)
        .filter(|(k, _)| claimed.contains(*k))
        .unzip();
    sqlx::query(
        "INSERT INTO ledger (event_key, route_key, source, event_type, payload)
         SELECT k, k, 'bench', 'bench.event', p::jsonb FROM unnest($1::text[], $2::text[]) AS u(k, p)",
    )
    .bind(&keys)
    .bind(&payloads)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

async fn stage_a(url: &str, w: &Workload) -> Duration {
    let pool = pool(url, PARTITIONS as u32 + 1).await;
    let prepared: Vec<Vec<Columns>> = w
        .partitions
        .iter()
        .map(|p| p.chunks(BATCH).map(columns).collect())
        .collect();
    let cpu = cpu_ms();
    let started = Instant::now();
    let lanes: Vec<_> = prepared
        .into_iter()
        .map(|batches| {
            let pool = pool.clone();
            tokio::spawn(async move {
                for c in &batches {
                    claim_and_apply(&pool, c).await;
                }
            })
        })
        .collect();
    for lane in lanes {
        lane.await.unwrap();
    }
    let elapsed = started.elapsed();
    println!("    this process used {} ms of CPU", cpu_ms() - cpu);
    pool.close().await;
    elapsed
}

// ------------------------------------------------------------------------------------ stage B

/// The ledger effect, failing for good on one key in `one_in` (deterministic: retried, then
/// recorded as failed), as a statement over the batch would.
struct FailingLedger {
    one_in: u64,
}

#[async_trait::async_trait]
impl Effect for FailingLedger {
    fn name(&self) -> &'static str {
        "failing-ledger"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        Ledger.apply_batch(tx, events).await?;
        match events
            .iter()
            .find(|e| fxhash(e.key.as_str()).is_multiple_of(self.one_in))
        {
            Some(e) => Err(anyhow::anyhow!("the effect refuses {}", e.key).into()),
            None => Ok(()),
        }
    }
}

/// The ledger effect, deferring one key in `one_in` ("not yet") until `ready` is set.
struct DeferringLedger {
    one_in: u64,
    ready: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl Effect for DeferringLedger {
    fn name(&self) -> &'static str {
        "deferring-ledger"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        let waiting = !self.ready.load(Ordering::Relaxed)
            && events
                .iter()
                .any(|e| fxhash(e.key.as_str()).is_multiple_of(self.one_in));
        if waiting {
            return Err(Deferred::new("what it refers to has not arrived").into());
        }
        Ledger.apply_batch(tx, events).await
    }
}

/// H: the batches with 1% of events deferred (timed as B), then H2: the deferred events applied
/// by the background task once they can apply. Returns both times and how many were deferred.
async fn stage_h(url: &str, w: &Workload) -> (Duration, Duration, usize) {
    let ready = Arc::new(AtomicBool::new(false));
    let effect = Arc::new(DeferringLedger {
        one_in: 100,
        ready: ready.clone(),
    });
    let batches = stage_b(url, w, effect.clone()).await;
    let pool = pool(url, 2).await;
    let deferred: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_events WHERE status = 'deferred'")
            .fetch_one(&pool)
            .await
            .unwrap();
    ready.store(true, Ordering::Relaxed);
    sqlx::query("UPDATE processed_events SET due_at = now() WHERE status = 'deferred'")
        .execute(&pool)
        .await
        .unwrap();
    let processor = BatchProcessor::new(pool.clone(), effect);
    let metrics = ConsumeMetrics::new(&prometheus::Registry::new()).unwrap();
    let applier = DeferredApplier::new(processor, "bench", metrics);
    let stop = tokio_util::sync::CancellationToken::new();
    let started = Instant::now();
    let mut applied = 0;
    loop {
        let round = applier.apply_due(&stop).await.unwrap();
        applied += round.applied;
        if round.due == 0 {
            break;
        }
    }
    let took = started.elapsed();
    assert_eq!(
        applied as i64, deferred,
        "every deferred event applied once"
    );
    pool.close().await;
    (batches, took, deferred as usize)
}

/// Drives the batch processor as the lanes do; returns the time until every batch committed
/// (events waiting for a retry then are settled afterwards, off the clock).
async fn stage_b(url: &str, w: &Workload, effect: Arc<dyn Effect>) -> Duration {
    let processor = BatchProcessor::new(pool(url, PARTITIONS as u32 + 1).await, effect);
    let cpu = cpu_ms();
    let started = Instant::now();
    let lanes: Vec<_> = w
        .partitions
        .iter()
        .enumerate()
        .map(|(p, messages)| {
            let (processor, messages) = (processor.clone(), messages.clone());
            tokio::spawn(async move {
                let mut retrying = Retrying::default();
                for batch in messages.chunks(BATCH) {
                    processor
                        .process_pass("bench", p as i32, batch, &mut retrying)
                        .await
                        .unwrap();
                }
                let done = Instant::now();
                while let Some(due) = retrying.next_due() {
                    tokio::time::sleep_until(due).await;
                    processor
                        .process_pass("bench", p as i32, &[], &mut retrying)
                        .await
                        .unwrap();
                }
                done
            })
        })
        .collect();
    let mut last = started;
    for lane in lanes {
        last = last.max(lane.await.unwrap());
    }
    println!("    this process used {} ms of CPU", cpu_ms() - cpu);
    processor.shards.close().await;
    last - started
}

// ------------------------------------------------------------------------------- stages C, D, E

async fn fill_topic(brokers: &str, topic: &str, partitions: &[Vec<RawMessage>]) {
    let producer: FutureProducer = client(brokers)
        .set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.kbytes", "1048576")
        .set("compression.type", "none")
        .create()
        .unwrap();
    for (p, messages) in partitions.iter().enumerate() {
        for chunk in messages.chunks(20_000) {
            let sends: Vec<_> = chunk
                .iter()
                .map(|m| {
                    producer.send(
                        FutureRecord::to(topic)
                            .partition(p as i32)
                            .key(m.key.as_deref().unwrap())
                            .payload(m.value.as_deref().unwrap()),
                        Duration::from_secs(60),
                    )
                })
                .collect();
            for s in futures_util::future::join_all(sends).await {
                s.unwrap();
            }
        }
    }
}

/// Kafka alone: every message of the topic read and copied, as the consumer copies it.
fn stage_c(brokers: &str, topic: &str, messages: usize) -> Duration {
    let consumer: BaseConsumer = client(brokers)
        .set("group.id", format!("bench-c-{}", fastrand::u64(..)))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let (mut seen, mut bytes, mut started) = (0, 0usize, None);
    while seen < messages {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            started.get_or_insert_with(Instant::now);
            let copy = (m.key().map(<[u8]>::to_vec), m.payload().map(<[u8]>::to_vec));
            bytes += copy.1.map_or(0, |v| v.len());
            seen += 1;
        }
    }
    assert!(bytes > 0);
    started.unwrap().elapsed()
}

/// The peer: one transaction per message (claim, then effect), then the offset.
async fn stage_e(brokers: &str, topic: &str, url: &str, messages: usize) -> Duration {
    let pool = pool(url, 2).await;
    let consumer: StreamConsumer = client(brokers)
        .set("group.id", format!("bench-e-{}", fastrand::u64(..)))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut started = None;
    for n in 1..=messages {
        let m = consumer.recv().await.unwrap();
        started.get_or_insert_with(Instant::now);
        let event = Event::parse(m.key(), m.payload()).unwrap();
        let key = event.key.as_str();
        let mut tx = pool.begin().await.unwrap();
        let claimed = sqlx::query(
            "INSERT INTO processed_events (event_key, route_key, source, status, payload_sha256,
                 kafka_topic, kafka_partition, kafka_offset, attempts, completed_at)
             VALUES ($1, $1, $2, 'done', $3, $4, $5, $6, 1, now()) ON CONFLICT DO NOTHING",
        )
        .bind(key)
        .bind(&event.source)
        .bind(&event.payload_sha256[..])
        .bind(topic)
        .bind(m.partition())
        .bind(m.offset())
        .execute(&mut *tx)
        .await
        .unwrap()
        .rows_affected()
            == 1;
        if claimed {
            sqlx::query(
                "INSERT INTO ledger (event_key, route_key, source, payload)
                 VALUES ($1, $1, $2, $3::jsonb)",
            )
            .bind(key)
            .bind(&event.source)
            .bind(event.payload_json.get())
            .execute(&mut *tx)
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
        consumer.store_offset_from_message(&m).unwrap();
        if n % 1000 == 0 {
            let _ = consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Async);
        }
    }
    let elapsed = started.unwrap().elapsed();
    pool.close().await;
    elapsed
}

/// The consumer process, default settings, draining the topic into a fresh database: the time
/// from the start of its first transaction to its last commit (seen in its metrics, so that
/// watching it costs the database nothing), its peak RSS, and its RSS every half second.
async fn stage_d(
    brokers: &str,
    topic: &str,
    url: &str,
    messages: usize,
    otlp: Option<&str>,
) -> (Duration, u64, Vec<u64>) {
    let port = common::free_port();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    if let Some(endpoint) = otlp {
        command
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf");
    }
    let mut child = command
        .args(["consume", "--brokers", brokers, "--topic", topic])
        .args(["--group", &format!("bench-d-{}", fastrand::u64(..))])
        .args(["--database-url", url])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(["--kafka-option", "broker.address.family=v4"])
        .args(
            std::env::var("BENCH_D_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .env(
            "RUST_LOG",
            std::env::var("BENCH_D_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let http = reqwest::Client::new();
    let mut samples = Vec::new();
    let mut last_sample = Instant::now();
    loop {
        let n = consumed(&http, port).await;
        if last_sample.elapsed() >= Duration::from_millis(500) {
            samples.push(rss_kib(pid, "VmRSS"));
            last_sample = Instant::now();
        }
        if n >= messages {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // From the start of its first transaction (PostgreSQL's clock, on this machine) to now.
    let done = chrono::Utc::now();
    let db = pool(url, 1).await;
    let first: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT min(claimed_at) FROM processed_events")
            .fetch_one(&db)
            .await
            .unwrap();
    db.close().await;
    let elapsed = (done - first).to_std().unwrap();
    let peak = rss_kib(pid, "VmHWM");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    child.wait().await.unwrap();
    (elapsed, peak, samples)
}

/// Messages the consumer committed, from `replayproof_consume_events_total`.
async fn consumed(http: &reqwest::Client, port: u16) -> usize {
    let Ok(response) = http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
    else {
        return 0;
    };
    let page = response.text().await.unwrap_or_default();
    page.lines()
        .filter(|l| l.starts_with("replayproof_consume_events_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as usize
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

// --------------------------------------------------------------------------------- reporting

#[derive(Default)]
struct Results {
    /// Messages per second, by (stage, payload size).
    rates: BTreeMap<(String, usize), Vec<f64>>,
    costs: BTreeMap<(String, usize), Vec<Cost>>,
    rss_mib: Vec<f64>,
}

impl Results {
    fn rate(&mut self, stage: &str, size: usize, messages: usize, took: Duration) {
        let rate = messages as f64 / took.as_secs_f64();
        println!("  {stage} {size:>5} B: {rate:>9.0} messages/s");
        self.rates
            .entry((stage.into(), size))
            .or_default()
            .push(rate);
    }

    fn cost(&mut self, stage: &str, size: usize, cost: Cost) {
        self.costs
            .entry((stage.into(), size))
            .or_default()
            .push(cost);
    }

    fn median(&self, stage: &str, size: usize) -> f64 {
        self.rates
            .get(&(stage.to_owned(), size))
            .map(|v| median(v.clone()))
            .unwrap_or(f64::NAN)
    }

    fn costs(&self, stage: &str, size: usize) -> (String, f64) {
        let costs = self.costs.get(&(stage.to_owned(), size));
        let statements = costs
            .and_then(|c| c.iter().map(|c| c.statements).collect::<Option<Vec<f64>>>())
            .map(|v| format!("{:.3}", median(v)))
            .unwrap_or_else(|| "n/a".into());
        let wal = costs.map(|c| median(c.iter().map(|c| c.wal_bytes).collect()));
        (statements, wal.unwrap_or(f64::NAN))
    }
}

/// F for one number of keys already claimed: A and B on an empty table and on the filled one.
struct Growth {
    keys: usize,
    a0: f64,
    a: f64,
    b0: f64,
    b: f64,
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let events = env_or("BENCH_EVENTS", 50_000);
    let repeats = env_or("BENCH_REPEATS", 3);
    let peer_messages = env_or("BENCH_PEER_MESSAGES", 10_000);
    let memory_messages = env_or("BENCH_MEMORY_MESSAGES", 1_000_000);
    let prefill: Vec<usize> = std::env::var("BENCH_PREFILL")
        .unwrap_or_else(|_| "1000000,10000000".into())
        .split(',')
        .filter_map(|n| n.trim().parse().ok())
        .collect();

    let (embedded_pg, database_url) = common::postgres(&[
        "fsync=on",
        "synchronous_commit=on",
        "shared_preload_libraries=pg_stat_statements",
        "shared_buffers=512MB",
        "max_wal_size=8GB",
    ]);
    let (mock, brokers) = common::kafka();
    println!(
        "{events} events + 30% replays per run, {PARTITIONS} partitions, batches of {BATCH}, \
         {repeats} repeats; broker: {}; PostgreSQL: {}; {} cores",
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

    let stages = std::env::var("BENCH_STAGES").unwrap_or_else(|_| "ABCDEGHTL".into());
    let run = |stage: char| stages.contains(stage);
    let mut results = Results::default();
    runtime.block_on(async {
        let db = Database::new(&database_url).await;
        // The mock cluster keeps at most 5 MiB per partition: its runs are sized to fit.
        let fitting = |size: usize| match &mock {
            Some(_) => {
                let message = Workload::new("probe", 1, 0, size, 1).partitions[0][0].queued_bytes();
                let per_partition = (4 << 20) / message;
                events.min(per_partition * PARTITIONS as usize * 10 / 13)
            }
            None => events,
        };
        let workloads: Vec<Workload> = SIZES
            .iter()
            .map(|&size| {
                let events = fitting(size);
                println!("{size} B payloads: {events} events + {} replays per run", events * 3 / 10);
                Workload::new("evt", events, events * 3 / 10, size, PARTITIONS)
            })
            .collect();
        let mut topics = HashMap::new();
        for w in &workloads {
            let topic = format!("bench_{}_{}", w.size, std::process::id());
            new_topic(mock.as_ref(), &brokers, &topic, PARTITIONS).await;
            fill_topic(&brokers, &topic, &w.partitions).await;
            topics.insert(w.size, topic);
        }
        for round in 1..=repeats {
            println!("round {round}");
            for w in &workloads {
                let (size, messages) = (w.size, w.messages());
                let topic = &topics[&size];

                if run('A') {
                    let url = db.fresh("bench_template").await;
                    let counters = db.counters().await;
                    let took = stage_a(&url, w).await;
                    results.rate("A", size, messages, took);
                    results.cost("A", size, counters.since(&db, &url, messages).await);
                    db.drop(&url).await;
                }
                if run('B') {
                    let url = db.fresh("bench_template").await;
                    let counters = db.counters().await;
                    let took = stage_b(&url, w, Arc::new(Ledger)).await;
                    results.rate("B", size, messages, took);
                    results.cost("B", size, counters.since(&db, &url, messages).await);
                    db.drop(&url).await;
                }
                if run('C') {
                    let took = tokio::task::spawn_blocking({
                        let (brokers, topic) = (brokers.clone(), topic.clone());
                        move || stage_c(&brokers, &topic, messages)
                    })
                    .await
                    .unwrap();
                    results.rate("C", size, messages, took);
                }
                if run('D') {
                    let url = db.fresh("bench_template").await;
                    let counters = db.counters().await;
                    let (took, peak_kib, _) = stage_d(&brokers, topic, &url, messages, None).await;
                    results.rate("D", size, messages, took);
                    results.cost("D", size, counters.since(&db, &url, messages).await);
                    results.rss_mib.push(peak_kib as f64 / 1024.0);
                    db.drop(&url).await;
                }
                if run('T') {
                    let url = db.fresh("bench_template").await;
                    let exported = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                    let endpoint = common::otlp_sink(exported.clone()).await;
                    let (took, _, _) =
                        stage_d(&brokers, topic, &url, messages, Some(&endpoint)).await;
                    results.rate("T", size, messages, took);
                    println!(
                        "    T exported {} KiB of spans",
                        exported.load(Ordering::Relaxed) / 1024
                    );
                    db.drop(&url).await;
                }
                if run('E') {
                    let url = db.fresh("bench_template").await;
                    let peer = peer_messages.min(messages);
                    let took = stage_e(&brokers, topic, &url, peer).await;
                    results.rate("E", size, peer, took);
                    db.drop(&url).await;
                }
                if run('G') {
                    let url = db.fresh("bench_template").await;
                    let counters = db.counters().await;
                    let took = stage_b(&url, w, Arc::new(FailingLedger { one_in: 500 })).await;
                    results.rate("G", size, messages, took);
                    results.cost("G", size, counters.since(&db, &url, messages).await);
                    db.drop(&url).await;
                }
                if run('H') {
                    let url = db.fresh("bench_template").await;
                    let (batches, applying, deferred) = stage_h(&url, w).await;
                    results.rate("H", size, messages, batches);
                    results.rate("H2", size, deferred, applying);
                    db.drop(&url).await;
                }
            }
        }

        if run('L') {
            limit::run(&db, mock.as_ref(), &brokers, repeats).await;
        }

        let mut growth = Vec::new();
        for &keys in &prefill {
            println!("prefill {keys} claimed keys");
            let template = db.fresh("bench_template").await;
            let name = template.rsplit_once('/').unwrap().1.to_owned();
            let p = pool(&template, 1).await;
            let mut conn = p.pool().acquire().await.unwrap();
            sqlx::query("SET statement_timeout = 0")
                .execute(&mut *conn)
                .await
                .unwrap();
            sqlx::query(
                "INSERT INTO processed_events (event_key, route_key, source, status, payload_sha256,
                     kafka_topic, kafka_partition, kafka_offset, attempts, completed_at)
                 SELECT 'pre-' || g, 'pre-' || g, 'bench', 'done', sha256(g::text::bytea), 'bench', 0, g, 1, now()
                 FROM generate_series(1, $1::int8) AS g",
            )
            .bind(keys as i64)
            .execute(&mut *conn)
            .await
            .unwrap();
            sqlx::query("VACUUM ANALYZE processed_events")
                .execute(&mut *conn)
                .await
                .unwrap();
            drop(conn);
            p.close().await;
            let w = Workload::new(&format!("f{keys}"), events, events * 3 / 10, SIZES[0], PARTITIONS);
            let messages = w.messages();
            // The same workload on an empty table, interleaved with the prefilled runs and
            // repeated: each ratio compares runs made minutes apart at most. Medians.
            let mut rates: [Vec<f64>; 4] = Default::default();
            for _ in 0..repeats {
                for (i, template) in ["bench_template", name.as_str()].into_iter().enumerate() {
                    let url = db.fresh(template).await;
                    rates[i].push(messages as f64 / stage_a(&url, &w).await.as_secs_f64());
                    db.drop(&url).await;
                    let url = db.fresh(template).await;
                    let b = stage_b(&url, &w, Arc::new(Ledger)).await;
                    rates[2 + i].push(messages as f64 / b.as_secs_f64());
                    db.drop(&url).await;
                }
            }
            db.drop(&template).await;
            let [a0, a, b0, b] = rates.map(median);
            println!("  F {keys}: A {a0:.0} → {a:.0}, B {b0:.0} → {b:.0} messages/s (medians)");
            growth.push(Growth { keys, a0, a, b0, b });
        }

        let memory = if memory_messages > 0 && mock.is_some() {
            println!("memory run skipped: the mock cluster keeps 5 MiB per partition; run it with KAFKA_BROKERS");
            None
        } else if memory_messages > 0 {
            println!("memory run: {memory_messages} messages of 2 KiB on 16 partitions");
            let w = Workload::new("mem", memory_messages, 0, 2048, 16);
            let topic = format!("bench_memory_{}", std::process::id());
            new_topic(mock.as_ref(), &brokers, &topic, 16).await;
            fill_topic(&brokers, &topic, &w.partitions).await;
            let url = db.fresh("bench_template").await;
            let (took, peak, samples) = stage_d(&brokers, &topic, &url, w.messages(), None).await;
            db.drop(&url).await;
            Some((w.messages(), took, peak, samples))
        } else {
            None
        };

        // Stage L prints its own table; the others' is printed when one of them ran.
        if stages.chars().any(|c| c != 'L') {
            report(&results, &growth, memory);
        }
    });
}

fn report(r: &Results, growth: &[Growth], memory: Option<(usize, Duration, u64, Vec<u64>)>) {
    println!();
    println!("| stage | what | 100 B msg/s | 2 KiB msg/s | ÷A (100 B) | ÷A (2 KiB) |");
    println!("|---|---|---:|---:|---:|---:|");
    let stages = [
        ("A", "PostgreSQL alone: claim + effect, 500 per transaction"),
        ("B", "batch processor, no Kafka"),
        ("C", "Kafka alone, counting sink"),
        ("D", "`replayproof consume` process, defaults"),
        ("T", "D with every event's span exported (OTLP)"),
        ("E", "peer: one transaction per message"),
        ("G", "B with 0.2% of effects failing"),
        ("H", "B with 1% of events deferred"),
        (
            "H2",
            "deferred events applied when due, one transaction each",
        ),
    ];
    for (stage, what) in stages {
        let (small, large) = (r.median(stage, SIZES[0]), r.median(stage, SIZES[1]));
        println!(
            "| {stage} | {what} | {small:.0} | {large:.0} | {:.2} | {:.2} |",
            small / r.median("A", SIZES[0]),
            large / r.median("A", SIZES[1]),
        );
    }
    println!();
    for size in SIZES {
        let m = |s| r.median(s, size);
        println!(
            "{size} B: D/A {:.2}, D/E {:.1}, T/D {:.2}, B/A {:.2}, G/B {:.2}, H/B {:.2}, H2/E {:.2}, C/A {:.2}, D/C {:.2}",
            m("D") / m("A"),
            m("D") / m("E"),
            m("T") / m("D"),
            m("B") / m("A"),
            m("G") / m("B"),
            m("H") / m("B"),
            m("H2") / m("E"),
            m("C") / m("A"),
            m("D") / m("C"),
        );
    }
    println!();
    println!("| stage | size | statements/message | WAL bytes/message |");
    println!("|---|---:|---:|---:|");
    for stage in ["A", "B", "D", "G"] {
        for size in SIZES {
            let (statements, wal) = r.costs(stage, size);
            println!("| {stage} | {size} B | {statements} | {wal:.0} |");
        }
    }
    if !r.rss_mib.is_empty() {
        println!(
            "\nconsumer peak RSS during D: median {:.0} MiB, max {:.0} MiB",
            median(r.rss_mib.clone()),
            r.rss_mib.iter().cloned().fold(0.0, f64::max)
        );
    }
    if !growth.is_empty() {
        println!(
            "\n| keys already claimed | A msg/s, 0 keys | A msg/s | B msg/s, 0 keys | B msg/s | A ÷ A(0) | B ÷ B(0) |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|");
        for g in growth {
            println!(
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
                g.keys,
                g.a0,
                g.a,
                g.b0,
                g.b,
                g.a / g.a0,
                g.b / g.b0
            );
        }
    }
    if let Some((messages, took, peak, samples)) = memory {
        let mib: Vec<String> = samples.iter().map(|k| format!("{}", k / 1024)).collect();
        println!(
            "\nmemory run: {messages} messages of 2 KiB on 16 partitions drained at {:.0} messages/s; \
             consumer peak RSS {} MiB; RSS every 0.5 s (MiB): {}",
            messages as f64 / took.as_secs_f64(),
            peak / 1024,
            mib.join(" ")
        );
    }
}

async fn new_topic(mock: Option<&EmbeddedKafka>, brokers: &str, topic: &str, partitions: i32) {
    match mock {
        Some(m) => m.create_topic(topic, partitions).unwrap(),
        None => create_topic(brokers, topic, partitions).await,
    }
}

/// CPU time this process has used (user and system), in milliseconds, at 10 ms resolution.
fn cpu_ms() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    (fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()) * 10
}

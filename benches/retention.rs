//! What retention costs, side by side in one run against one PostgreSQL: events consumed as fast
//! as four partition lanes apply them (`BatchProcessor::process_pass`, batches of 500, the
//! ledger effect, 100-byte Stripe-like payloads), for `BENCH_SECONDS` (180) per mode, each mode
//! in a fresh database:
//!
//! - **plain**: events without an event time, so the expired-replay check never runs, no pruner;
//! - **checked**: events carrying `occurred_at`, so every batch reads its source's prune horizon
//!   (`claim_horizons`), no pruner;
//! - **pruned**: as checked, with the background pruner's round every `BENCH_PRUNE_EVERY_MS`
//!   (2000) under a retention of `BENCH_RETENTION_SECS` (30), short enough to prune
//!   continuously (below the floor, allowed);
//! - **steady checked** and **steady pruned**: the same two, the lanes paced at `BENCH_RATE`
//!   events per second in all (5000): the rate is kept in both, so the pruner's cost shows in
//!   the batches' times, and its deletes keep up, so the table stays flat.
//!
//! Printed: each mode's events per second and its ratio to the one before, each batch's time to
//! commit (p50, p99), the pruner's deletes
//! per second (claims with their ledger rows, per second of round time), and the size of
//! `processed_events`, its primary key and its live rows every `BENCH_SAMPLE_SECS` (15): flat
//! in the pruned mode once the retention is reached, growing in the others. Modes are repeated
//! `BENCH_REPEATS` (1) times, interleaved. Without `DATABASE_URL` a throwaway PostgreSQL is
//! started with durable settings (`fsync=on`, `synchronous_commit=on`) and autovacuum as shipped.
//!
//! `cargo bench --bench retention`

use replayproof::consume::{BatchProcessor, RawMessage, Retrying};
use replayproof::db::Db;
use replayproof::effect::Ledger;
use replayproof::envelope::Envelope;
use replayproof::ingest::config::Kind;
use replayproof::retention::round::{Pruner, TopicRetention};
use replayproof::retention::{Lifetimes, SourceRetention};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// This benchmark needs no broker: the shared Kafka helpers go unused here.
#[allow(dead_code)]
mod common;
use common::env_or;

const LANES: i32 = 4;
const BATCH: usize = 500;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    Plain,
    Checked,
    Pruned,
    /// Checked, paced at `BENCH_RATE`.
    SteadyChecked,
    /// Pruned, paced at `BENCH_RATE`.
    SteadyPruned,
}

impl Mode {
    fn timed(self) -> bool {
        self != Self::Plain
    }

    fn prunes(self) -> bool {
        matches!(self, Self::Pruned | Self::SteadyPruned)
    }

    fn paced(self) -> bool {
        matches!(self, Self::SteadyChecked | Self::SteadyPruned)
    }

    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Checked => "checked",
            Self::Pruned => "pruned",
            Self::SteadyChecked => "steady checked",
            Self::SteadyPruned => "steady pruned",
        }
    }
}

/// One sample of the claims table while a mode runs.
struct Sample {
    at: Duration,
    rows: i64,
    table_bytes: i64,
    key_bytes: i64,
}

struct Outcome {
    mode: Mode,
    events_per_second: f64,
    samples: Vec<Sample>,
    /// Claims the pruner deleted, and the time its rounds took.
    pruned: (i64, Duration),
    /// Each batch's time to commit, sorted.
    batch_times: Vec<Duration>,
}

/// How one lane runs: its number, whether its events carry their time, and the pace it keeps
/// (None: as fast as it can).
struct LaneRun {
    lane: i32,
    timed: bool,
    per_second: Option<f64>,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
}

fn batch(lane: i32, n: u64, timed: bool) -> Vec<RawMessage> {
    let now = chrono::Utc::now();
    (0..BATCH as u64)
        .map(|i| {
            let id = format!("evt_{lane}_{n}_{i}");
            let envelope = Envelope {
                route: None,
                key: format!("stripe:{id}").try_into().unwrap(),
                source: "stripe".into(),
                event_type: Some("invoice.paid".into()),
                received_at: Some(now),
                occurred_at: timed.then_some(now),
                payload: serde_json::value::to_raw_value(&serde_json::json!({
                    "id": id, "object": "event", "amount": 1999, "customer": "cus_0123456789"
                }))
                .expect("a JSON value serialises"),
                unhashed: Vec::new(),
                replay_window_secs: None,
                request_id: None,
            };
            RawMessage {
                offset: (n * BATCH as u64 + i) as i64,
                key: None,
                value: Some(envelope.to_bytes()),
                traceparent: None,
                headers: Default::default(),
            }
        })
        .collect()
}

async fn lane(processor: BatchProcessor, run: LaneRun) -> Vec<Duration> {
    let mut retrying = Retrying::default();
    let (mut n, mut times) = (0, Vec::new());
    let started = tokio::time::Instant::now();
    while !run.stop.load(Ordering::Relaxed) {
        if let Some(rate) = run.per_second {
            let due = started + Duration::from_secs_f64(n as f64 * BATCH as f64 / rate);
            tokio::time::sleep_until(due).await;
        }
        let messages = batch(run.lane, n, run.timed);
        let at = Instant::now();
        processor
            .process_pass("bench", run.lane, &messages, &mut retrying)
            .await
            .expect("a batch commits");
        times.push(at.elapsed());
        run.done.fetch_add(BATCH as u64, Ordering::Relaxed);
        n += 1;
    }
    times
}

fn pruner(pool: Db, retention: Duration) -> Pruner {
    let mut lifetimes = Lifetimes::default();
    lifetimes.sources.insert(
        "stripe".into(),
        SourceRetention {
            kind: Some(Kind::Stripe),
            retention: Some(retention),
            replay_window: None,
        },
    );
    Pruner {
        pool,
        lifetimes,
        topic: "bench".into(),
        topic_retention: TopicRetention::Stated(replayproof::retention::TopicKeeps::For {
            retention,
            segment: Duration::ZERO,
        }),
        allow_below_floor: true,
        allow_below_topic_retention: true,
        batch: replayproof::retention::prune::DEFAULT_BATCH,
        actor: "bench".into(),
    }
}

/// A round every `every` until `stop`: the claims deleted and the time the rounds took.
async fn prune_loop(pruner: Pruner, every: Duration, stop: Arc<AtomicBool>) -> (i64, Duration) {
    let (mut deleted, mut spent) = (0, Duration::ZERO);
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(every).await;
        let started = Instant::now();
        let round = pruner.round(false).await.expect("a prune round");
        spent += started.elapsed();
        deleted += round.pruned.of("processed_events");
    }
    (deleted, spent)
}

async fn sample(pool: &Db, at: Duration) -> Sample {
    let (rows, table_bytes, key_bytes): (i64, i64, i64) = sqlx::query_as(
        "SELECT n_live_tup, pg_table_size('processed_events'), \
                pg_relation_size('processed_events_pkey') \
         FROM pg_stat_user_tables WHERE relname = 'processed_events'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    Sample {
        at,
        rows,
        table_bytes,
        key_bytes,
    }
}

fn lanes(
    processor: &BatchProcessor,
    mode: Mode,
    stop: &Arc<AtomicBool>,
    done: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<Vec<Duration>>> {
    let rate = env_or("BENCH_RATE", 5000) as f64;
    (0..LANES)
        .map(|l| {
            let run = LaneRun {
                lane: l,
                timed: mode.timed(),
                per_second: mode.paced().then_some(rate / LANES as f64),
                stop: stop.clone(),
                done: done.clone(),
            };
            tokio::spawn(lane(processor.clone(), run))
        })
        .collect()
}

async fn run(url: &str, mode: Mode, seconds: u64) -> Outcome {
    let pool = replayproof::db::pool(&url.parse().unwrap(), 8).unwrap();
    let processor = BatchProcessor::new(pool.clone(), Arc::new(Ledger));
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let lanes = lanes(&processor, mode, &stop, &done);
    let prune = mode.prunes().then(|| {
        let retention = Duration::from_secs(env_or("BENCH_RETENTION_SECS", 30) as u64);
        let every = Duration::from_millis(env_or("BENCH_PRUNE_EVERY_MS", 2000) as u64);
        tokio::spawn(prune_loop(
            pruner(pool.clone(), retention),
            every,
            stop.clone(),
        ))
    });
    let started = Instant::now();
    let length = Duration::from_secs(seconds);
    let every = Duration::from_secs(env_or("BENCH_SAMPLE_SECS", 15) as u64);
    let mut samples = Vec::new();
    while started.elapsed() < length {
        tokio::time::sleep(every.min(length.saturating_sub(started.elapsed()))).await;
        samples.push(sample(&pool, started.elapsed()).await);
    }
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let mut batch_times = Vec::new();
    for l in lanes {
        batch_times.extend(l.await.unwrap());
    }
    batch_times.sort();
    let pruned = match prune {
        Some(p) => p.await.unwrap(),
        None => (0, Duration::ZERO),
    };
    Outcome {
        mode,
        events_per_second: done.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        samples,
        pruned,
        batch_times,
    }
}

async fn fresh_database(admin: &Db, base: &str, n: usize) -> String {
    let name = format!("bench_retention_{n}");
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
        .execute(admin)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin)
        .await
        .unwrap();
    let url = format!("{base}/{name}");
    let pool = replayproof::db::pool(&url.parse().unwrap(), 2).unwrap();
    replayproof::db::migrate(&pool).await.unwrap();
    pool.close().await;
    sqlx::query("CHECKPOINT").execute(admin).await.unwrap();
    url
}

async fn drop_database(admin: &Db, n: usize) {
    let name = format!("bench_retention_{n}");
    sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .execute(admin)
        .await
        .unwrap();
    sqlx::query("CHECKPOINT").execute(admin).await.unwrap();
}

fn quantile(sorted: &[Duration], q: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => sorted[((n - 1) as f64 * q) as usize].as_secs_f64() * 1000.0,
    }
}

fn report(outcomes: &[Outcome]) {
    println!(
        "\n{:<15} {:>10} {:>8} {:>12} {:>12}",
        "mode", "events/s", "ratio", "batch p50 ms", "batch p99 ms"
    );
    let mut before: Option<f64> = None;
    for o in outcomes {
        let ratio = before.map_or("-".into(), |b| format!("{:.3}", o.events_per_second / b));
        println!(
            "{:<15} {:>10.0} {:>8} {:>12.1} {:>12.1}",
            o.mode.name(),
            o.events_per_second,
            ratio,
            quantile(&o.batch_times, 0.5),
            quantile(&o.batch_times, 0.99)
        );
        before = Some(o.events_per_second);
        if o.mode.prunes() {
            let (deleted, spent) = o.pruned;
            println!(
                "{:<15} pruner: {deleted} claims deleted in {:.1} s of rounds: {:.0} deletes/s",
                "",
                spent.as_secs_f64(),
                deleted as f64 / spent.as_secs_f64().max(1e-9)
            );
        }
    }
    for o in outcomes {
        println!("\nprocessed_events over time, {}:", o.mode.name());
        println!(
            "{:>6} {:>10} {:>10} {:>10}",
            "s", "live rows", "table MB", "pkey MB"
        );
        for s in &o.samples {
            let mb = |b: i64| b as f64 / (1024.0 * 1024.0);
            println!(
                "{:>6.0} {:>10} {:>10.1} {:>10.1}",
                s.at.as_secs_f64(),
                s.rows,
                mb(s.table_bytes),
                mb(s.key_bytes)
            );
        }
    }
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let seconds = env_or("BENCH_SECONDS", 180) as u64;
    let repeats = env_or("BENCH_REPEATS", 1);
    let (_embedded, url) =
        common::postgres(&["fsync=on", "synchronous_commit=on", "shared_buffers=512MB"]);
    println!(
        "{LANES} lanes, batches of {BATCH}, {seconds} s per mode, {repeats} repeat(s), steady \
         modes at {} events/s; {} cores",
        env_or("BENCH_RATE", 5000),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    runtime.block_on(async {
        let admin = Db::from(sqlx::PgPool::connect(&url).await.unwrap());
        let base = url.rsplit_once('/').unwrap().0.to_owned();
        let mut outcomes = Vec::new();
        let mut n = 0;
        for _ in 0..repeats {
            for mode in [
                Mode::Plain,
                Mode::Checked,
                Mode::Pruned,
                Mode::SteadyChecked,
                Mode::SteadyPruned,
            ] {
                let db = fresh_database(&admin, &base, n).await;
                outcomes.push(run(&db, mode, seconds).await);
                // The next mode starts on a quiet server: no autovacuum of this run's tables,
                // no dirty pages of it still to write.
                drop_database(&admin, n).await;
                n += 1;
            }
        }
        report(&outcomes);
    });
}

//! What spreading the claims over shards costs and gives, side by side in one run on one
//! PostgreSQL server: the batch processor (`BatchProcessor::process_pass`) applying the same
//! workload (100 B payloads, 30% replays, 4 partitions as 4 lanes, batches of 500, the ledger
//! effect) with its claims
//!
//! - **1** in one database (the baseline: no split);
//! - **1×4** in one database split four ways, as with Citus, where every part is its own
//!   transaction through the coordinator: the cost of splitting alone;
//! - **2** and **4** in two and four databases of the same server, emulated shards.
//!
//! Each run starts from fresh, migrated databases. Runs are interleaved and repeated
//! (`BENCH_REPEATS`, 3); medians are printed, with claims per second, each run's ratio to the
//! baseline, and the split's overhead per batch. Without `DATABASE_URL` a throwaway PostgreSQL
//! is started with durable settings (`fsync=on`, `synchronous_commit=on`). Size:
//! `BENCH_EVENTS` (40000 events per run, plus 30% replays).
//!
//! On one machine the shards share its cores and disk, so little gain is expected; with each
//! shard on its own server (or Citus worker) the claims scale with them, as docs/scaling.md
//! works out.
//!
//! `cargo bench --bench shards`

// A benchmark's run reads as one script, start to finish: long ones are allowed here.
#![allow(clippy::too_many_lines)]

use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::db::Db;
use replayproof::effect::Ledger;
use replayproof::envelope::Envelope;
use replayproof::shard::{Layout, Shards};
use std::sync::Arc;
use std::time::Duration;

// Only its sizes from the environment are used here.
#[allow(dead_code)]
mod common;
use common::{env_or, median};

const PARTITIONS: usize = 4;
const BATCH: usize = 500;

/// How one run spreads its claims.
#[derive(Debug, Clone, Copy)]
enum Spread {
    /// One database, no split.
    Single,
    /// One database, each batch split into this many transactions.
    Split(usize),
    /// This many databases.
    Databases(usize),
}

impl Spread {
    fn label(self) -> String {
        match self {
            Spread::Single => "1 database".into(),
            Spread::Split(n) => format!("1 database split {n} ways (Citus-like)"),
            Spread::Databases(n) => format!("{n} databases"),
        }
    }

    fn databases(self) -> usize {
        match self {
            Spread::Databases(n) => n,
            _ => 1,
        }
    }
}

/// The workload's messages by partition: `events` keys and 30% replays in a random order.
fn workload(run: usize, events: usize) -> Vec<Vec<RawMessage>> {
    let mut rng = fastrand::Rng::with_seed(28);
    let replays: Vec<usize> = (0..events * 3 / 10).map(|_| rng.usize(..events)).collect();
    let mut order: Vec<usize> = (0..events).chain(replays).collect();
    rng.shuffle(&mut order);
    let mut partitions = vec![Vec::new(); PARTITIONS];
    for (offset, i) in order.into_iter().enumerate() {
        let key = format!("run{run}-evt-{i:08}");
        let envelope = Envelope {
            route: None,
            key: key.as_str().try_into().unwrap(),
            source: "bench".into(),
            event_type: Some("bench.event".into()),
            received_at: None,
            occurred_at: None,
            payload: serde_json::value::to_raw_value(&serde_json::json!({
                "id": i, "pad": "x".repeat(64)
            }))
            .unwrap(),
            unhashed: Vec::new(),
            replay_window_secs: None,
            request_id: None,
        };
        partitions[i % PARTITIONS].push(RawMessage {
            offset: offset as i64,
            key: Some(key.into_bytes()),
            value: Some(envelope.to_bytes()),
            traceparent: None,
            headers: Default::default(),
        });
    }
    partitions
}

/// Fresh migrated databases on the server of `admin`.
async fn databases(admin: &str, n: usize) -> Vec<Db> {
    let admin_pool = Db::from(sqlx::PgPool::connect(admin).await.unwrap());
    let mut pools = Vec::new();
    for _ in 0..n {
        let name = format!("rp_bench_shards_{:08x}", fastrand::u32(..));
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin_pool)
            .await
            .unwrap();
        let mut url = url::Url::parse(admin).unwrap();
        url.set_path(&name);
        let pool =
            replayproof::db::pool(&url.as_str().parse().unwrap(), PARTITIONS as u32 + 1).unwrap();
        replayproof::db::migrate(&pool).await.unwrap();
        pools.push(pool);
    }
    admin_pool.close().await;
    pools
}

/// One run: the time until every lane's batches committed.
async fn run(admin: &str, spread: Spread, messages: &[Vec<RawMessage>]) -> Duration {
    let pools = databases(admin, spread.databases()).await;
    let shards = match spread {
        Spread::Single => Shards::from(pools[0].clone()),
        Spread::Split(n) => Shards::citus(pools[0].clone(), 1024, n).unwrap(),
        Spread::Databases(n) => Shards::new(Layout::new(1024, n).unwrap(), pools).unwrap(),
    };
    let processor = BatchProcessor::new(shards, Arc::new(Ledger));
    common::apply_in_lanes(processor, messages, BATCH).await
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let events = env_or("BENCH_EVENTS", 40_000);
    let repeats = env_or("BENCH_REPEATS", 3);
    let (embedded, admin) = common::postgres(&[
        "fsync=on",
        "synchronous_commit=on",
        "shared_buffers=512MB",
        "max_wal_size=8GB",
        "max_connections=200",
    ]);
    let spreads = [
        Spread::Single,
        Spread::Split(4),
        Spread::Databases(2),
        Spread::Databases(4),
    ];
    println!(
        "{events} events + 30% replays per run, {PARTITIONS} lanes, batches of {BATCH}, \
         {repeats} repeats, {} cores; PostgreSQL: {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if embedded.is_some() {
            "throwaway, fsync=on"
        } else {
            "DATABASE_URL"
        },
    );
    let messages: usize = events + events * 3 / 10;
    let batches = messages.div_ceil(BATCH);
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); spreads.len()];
    let mut run_no = 0;
    for _ in 0..repeats {
        for (i, spread) in spreads.iter().enumerate() {
            run_no += 1;
            let workload = workload(run_no, events);
            let took = runtime.block_on(run(&admin, *spread, &workload));
            println!("  {:<40} {:>8.2} s", spread.label(), took.as_secs_f64());
            seconds[i].push(took.as_secs_f64());
        }
    }
    let medians: Vec<f64> = seconds.into_iter().map(median).collect();
    println!("\n| claims spread over | messages/s | ÷ 1 database | split overhead per batch |");
    println!("|---|---:|---:|---:|");
    for (spread, s) in spreads.iter().zip(&medians) {
        let overhead_ms = (s - medians[0]) * 1000.0 / batches as f64 * PARTITIONS as f64;
        println!(
            "| {} | {:.0} | {:.2} | {} |",
            spread.label(),
            messages as f64 / s,
            medians[0] / s,
            match spread {
                Spread::Single => "–".into(),
                _ => format!("{overhead_ms:+.2} ms"),
            }
        );
    }
    println!(
        "\n(per batch: the run's extra time over one database, times the {PARTITIONS} lanes \
         running at once, over the {batches} batches)"
    );
}

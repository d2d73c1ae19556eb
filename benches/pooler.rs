//! What a transaction-mode pooler costs: the batch processor (`BatchProcessor::process_pass`,
//! the `ledger` effect, one lane per partition, no Kafka) applying the same workload side by
//! side, interleaved and repeated (`BENCH_REPEATS`, 3; medians printed):
//!
//! - **direct**: straight to PostgreSQL, the session settings sent at startup, sqlx's
//!   statement cache on (`[database] pooler = "none"`);
//! - **pooled**: through PgBouncer in transaction mode (`default_pool_size` = the lanes), with
//!   `[database] pooler = "transaction"`: a `BEGIN` carrying the settings and a check of the
//!   database's buckets per transaction, each statement parsed again.
//!
//! Both open the database as `consume` does (`DatabaseArgs`).
//!
//! Sizes: `BENCH_EVENTS` (20000 events per run, plus 30% replays, payloads of 100 bytes),
//! `BENCH_BATCH` (500). PgBouncer is `REPLAYPROOF_PGBOUNCER` or Debian's `/usr/sbin/pgbouncer`;
//! without `DATABASE_URL` a throwaway PostgreSQL is started.
//!
//! `cargo bench --bench pooler`

use replayproof::consume::{BatchProcessor, RawMessage};
use replayproof::db::{Db, Pooler};
use replayproof::devkit::pgbouncer::EmbeddedPgBouncer;
use replayproof::effect::Ledger;
use replayproof::envelope::Envelope;
use std::sync::Arc;
use std::time::Duration;

mod common;
use common::{env_or, median};

const PARTITIONS: usize = 4;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

async fn run() {
    let (_server, admin) = common::postgres(&[]);
    let (events, batch) = (env_or("BENCH_EVENTS", 20_000), env_or("BENCH_BATCH", 500));
    let repeats = env_or("BENCH_REPEATS", 3);
    let server = url::Url::parse(&admin).unwrap();
    let bouncer = EmbeddedPgBouncer::in_front_of(&admin, PARTITIONS as u32).unwrap();
    let (mut direct, mut pooled) = (Vec::new(), Vec::new());
    for round in 0..repeats {
        let messages = workload(&format!("r{round}"), events, events * 3 / 10);
        let total = messages.iter().map(Vec::len).sum::<usize>() as f64;
        let database = fresh_database(&admin).await;
        let url = database_url(&server, &database);
        let d = apply(&url, Pooler::None, &messages, batch).await;
        direct.push(total / d.as_secs_f64());
        let database = fresh_database(&admin).await;
        let url = bouncer.url(&database);
        let p = apply(&url, Pooler::Transaction, &messages, batch).await;
        pooled.push(total / p.as_secs_f64());
        println!("round {round}: direct {d:?}, through PgBouncer {p:?} for {total} messages");
    }
    let (direct, pooled) = (median(direct), median(pooled));
    println!(
        "messages/s, median of {repeats}: direct {direct:.0}, through PgBouncer in transaction \
         mode {pooled:.0}: {:.2} of direct",
        pooled / direct
    );
}

/// `events` keys and `replays` repeats of some of them, spread over the partitions.
fn workload(prefix: &str, events: usize, replays: usize) -> Vec<Vec<RawMessage>> {
    let mut rng = fastrand::Rng::with_seed(7);
    let order = (0..events).chain((0..replays).map(|_| rng.usize(..events)));
    let mut partitions = vec![Vec::new(); PARTITIONS];
    for (n, i) in order.enumerate() {
        let key = format!("{prefix}-{i:08}");
        let envelope = Envelope {
            route: None,
            key: key.as_str().try_into().unwrap(),
            source: "bench".into(),
            event_type: Some("bench.event".into()),
            received_at: None,
            occurred_at: None,
            payload: serde_json::value::to_raw_value(&format!("{i:0>90}")).unwrap(),
            unhashed: Vec::new(),
            replay_window_secs: None,
            request_id: None,
        };
        let lane: &mut Vec<RawMessage> = &mut partitions[i % PARTITIONS];
        lane.push(RawMessage {
            offset: n as i64,
            key: Some(key.into_bytes()),
            value: Some(envelope.to_bytes()),
            traceparent: None,
            headers: Default::default(),
        });
    }
    partitions
}

/// The time the lanes took to apply `partitions` in batches of `batch`.
async fn apply(
    url: &str,
    pooler: Pooler,
    partitions: &[Vec<RawMessage>],
    batch: usize,
) -> Duration {
    // As `consume` opens its database: its holdings checked (behind a pooler, in every
    // transaction).
    let mut database = replayproof::args::DatabaseArgs::single(url.parse().unwrap());
    database.session.pooler = pooler;
    let pool = database.open_pool(PARTITIONS as u32 + 1).await.unwrap();
    let processor = BatchProcessor::new(pool, Arc::new(Ledger));
    common::apply_in_lanes(processor, partitions, batch).await
}

/// A new database, migrated directly.
async fn fresh_database(admin: &str) -> String {
    let name = format!("rp_bench_pooler_{:08x}", fastrand::u32(..));
    let pool = sqlx::PgPool::connect(admin).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let server = url::Url::parse(admin).unwrap();
    let direct = replayproof::db::pool(&database_url(&server, &name).parse().unwrap(), 1);
    let direct: Db = direct.unwrap();
    replayproof::db::migrate(&direct).await.unwrap();
    direct.close().await;
    name
}

/// `database` on `server`.
fn database_url(server: &url::Url, database: &str) -> String {
    let mut url = server.clone();
    url.set_path(database);
    url.set_query(None);
    url.to_string()
}

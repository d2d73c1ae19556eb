//! Stage **L** of `cargo bench --bench consume`: the consumer next to PostgreSQL's own batched
//! limit, side by side in one run, on a backlog of fresh events (one message per key, 100 B
//! payloads, 4 partitions):
//!
//! - **L2** PostgreSQL alone: the consumer's claim and ledger statements, batches of 500 keys
//!   generated in the server (nothing sent but the bounds), one transaction per batch, two
//!   clients; **L4** the same with four clients, one per partition as the consumer's lanes;
//! - **LA**, **LC** PostgreSQL alone with each batch sent by the client: the claim's columns as
//!   arrays (the consumer's way), or copied into a temporary table first ([`crate::sent`]);
//! - **D1**, **D2** one and two `replayproof consume` processes of one group draining the
//!   topic into a fresh database;
//! - **R2** two processes of a new group draining the same topic again into D2's database,
//!   vacuumed and checkpointed first (as a storm finds it, hours after the first deliveries):
//!   every message a redelivery of a claimed key;
//! - **N** the peer done right, one transaction per message (claim, then effect), then the
//!   offset, timed on the first `BENCH_PEER_MESSAGES` messages.
//!
//! For each: events per second, CPU per 1,000 events of the consumer processes (of the
//! benchmark's clients for L) and of PostgreSQL (every server process), and statements per
//! batch (from `pg_stat_statements`, `BEGIN` and `COMMIT` included: each is a round trip).
//! `BENCH_LIMIT_EVENTS` sizes the backlog (100000); `BENCH_LIMIT_PREFILL` starts every run on
//! that many claims already in the tables ([`backlog::prefilled`]); `BENCH_L_RUNS` picks runs
//! (`D2,R2`); `BENCH_STATEMENT_TIMES=1` prints each run's statements and its backends' wait
//! events. The limit is the fastest of L2, L4, LA and LC by median ([`crate::summary`] says
//! why). `BENCH_BASELINE_BIN` names another build of `replayproof` (the last commit's, say): each
//! round then also runs D2 with it, as **B2**, and `D2 ÷ B2` says what a change gained,
//! measured side by side.

use crate::backlog;
use crate::common::{self, env_or};
use crate::sent::{self, Form};
use crate::{fill_topic, new_topic, pool, stage_e, Database, Workload, BATCH, PARTITIONS};
use replayproof::devkit::embedded::EmbeddedKafka;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The consumer's claim ([`replayproof::claims::claim`]) over the batch `u`, with its columns `k, s, t, h, r, o, q, tp, rk`,
/// the topic and partition as `$1`, `$2`.
pub fn claim_over(u: &str) -> String {
    format!(
        r#"WITH u AS MATERIALIZED (
               SELECT u.*, f.route_key AS found_route, f.payload_sha256 AS found_hash
               FROM {u}
               LEFT JOIN LATERAL (SELECT x.route_key, x.payload_sha256 FROM processed_events x
                                  WHERE x.event_key = u.k OFFSET 0) AS f ON true),
           claimed AS (
               INSERT INTO processed_events (event_key, route_key, source, event_type, status,
                   payload_sha256, received_at, kafka_topic, kafka_partition, kafka_offset,
                   attempts, completed_at, request_id, traceparent)
               SELECT k, rk, s, t, 'done', h, r, $1, $2, o, 1, now(), q, tp
               FROM u WHERE found_route IS NULL
               ORDER BY k COLLATE "C", rk COLLATE "C"
               ON CONFLICT (event_key, route_key) DO NOTHING
               RETURNING event_key),
           seen AS (
               INSERT INTO redeliveries (kafka_topic, kafka_partition, event_keys, kafka_offsets)
               SELECT $1, $2, array_agg(k ORDER BY o), array_agg(o ORDER BY o)
               FROM u WHERE found_route IS NOT NULL
               HAVING count(*) > 0)
           SELECT event_key, NULL::text AS route_key, NULL::bytea AS hash FROM claimed
           UNION ALL
           SELECT k, found_route, found_hash FROM u WHERE found_route IS NOT NULL"#
    )
}

/// What one measured run cost.
#[derive(Clone, Copy, Default)]
pub struct Cost {
    /// Events per second.
    pub rate: f64,
    /// CPU milliseconds per 1,000 events of the consumer (or of the benchmark's clients).
    pub client_cpu: f64,
    /// CPU milliseconds per 1,000 events of every PostgreSQL process.
    pub server_cpu: f64,
    /// Statements per transaction, `BEGIN` and `COMMIT` included, when known.
    pub statements: Option<f64>,
}

/// CPU time of a process (`self` or a pid), user and system, with its reaped children's when
/// `children`, in milliseconds.
pub fn cpu_of(pid: &str, children: bool) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let take = if children { 15 } else { 13 };
    let ticks: f64 = fields
        .iter()
        .skip(11)
        .take(take - 11)
        .filter_map(|f| f.parse::<f64>().ok())
        .sum();
    ticks * 10.0
}

/// Every PostgreSQL process's CPU so far, in milliseconds: the postmaster with the backends it
/// reaped, and its live children.
pub fn server_cpu(postmaster: u32) -> f64 {
    let mut total = cpu_of(&postmaster.to_string(), true);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{name}/stat")).unwrap_or_default();
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if parent == Some(postmaster) {
            total += cpu_of(&name, false);
        }
    }
    total
}

/// The postmaster's pid, when the server runs on this machine.
pub async fn postmaster(db: &Database) -> u32 {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&db.admin)
        .await
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{backend}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Statements and transactions the database `url` ran so far (statements only with
/// `pg_stat_statements`, reset by [`Database::counters`]).
pub async fn statements(db: &Database, url: &str) -> Option<f64> {
    let name = url.rsplit_once('/').unwrap().1;
    match db.statements {
        true => sqlx::query_scalar::<_, f64>(
            "SELECT coalesce(sum(calls), 0)::float8 FROM pg_stat_statements s
             JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1",
        )
        .bind(name)
        .fetch_one(&db.admin)
        .await
        .ok(),
        false => None,
    }
}

/// What the database's client backends in a transaction are doing, sampled every 10 ms while a
/// run lasts, with `BENCH_STATEMENT_TIMES`: the share of each wait event, `running` when on the
/// CPU (or waiting for it), `waiting for the client` between two statements of a transaction.
pub struct Waits {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<BTreeMap<String, u64>>,
}

impl Waits {
    pub fn start(db: &Database, url: &str) -> Option<Self> {
        std::env::var_os("BENCH_STATEMENT_TIMES")?;
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let (admin, name) = (db.admin.clone(), url.rsplit_once('/')?.1.to_owned());
        let task = tokio::spawn(async move {
            let mut seen = BTreeMap::new();
            while stopped.try_recv().is_err() {
                let now: Vec<String> = sqlx::query_scalar(
                    "SELECT CASE WHEN state <> 'active' THEN 'waiting for the client'
                                 ELSE coalesce(wait_event_type || ':' || wait_event, 'running') END
                     FROM pg_stat_activity
                     WHERE datname = $1 AND backend_type = 'client backend'
                       AND state IN ('active', 'idle in transaction')",
                )
                .bind(&name)
                .fetch_all(&admin)
                .await
                .unwrap_or_default();
                for w in now {
                    *seen.entry(w).or_insert(0) += 1;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            seen
        });
        Some(Self { stop, task })
    }

    /// Stops sampling and prints the shares.
    pub async fn print(self) {
        let _ = self.stop.send(());
        let seen = self.task.await.unwrap();
        let total: u64 = seen.values().sum::<u64>().max(1);
        let mut shares: Vec<(&String, &u64)> = seen.iter().collect();
        shares.sort_by(|a, b| b.1.cmp(a.1));
        let line: Vec<String> = shares
            .iter()
            .take(6)
            .map(|(w, n)| format!("{w} {:.0}%", **n as f64 * 100.0 / total as f64))
            .collect();
        println!(
            "    backends in a transaction, sampled: {}",
            line.join(", ")
        );
    }
}

/// A PostgreSQL-alone run's clock and counters, started before its first transaction.
pub struct Meter {
    postmaster: u32,
    counters: crate::Counters,
    waits: Option<Waits>,
    cpu: f64,
    server: f64,
    started: Instant,
}

impl Meter {
    pub async fn start(db: &Database, url: &str) -> Self {
        let postmaster = postmaster(db).await;
        let counters = db.counters().await;
        let waits = Waits::start(db, url);
        let (cpu, server) = (cpu_of("self", false), server_cpu(postmaster));
        Self {
            postmaster,
            counters,
            waits,
            cpu,
            server,
            started: Instant::now(),
        }
    }

    /// What `done` events in batches of 500 cost since the start.
    pub async fn cost(self, db: &Database, url: &str, done: usize) -> Cost {
        let took = self.started.elapsed();
        if let Some(waits) = self.waits {
            waits.print().await;
        }
        let _ = self.counters.since(db, url, done).await;
        let done = done as f64;
        Cost {
            rate: done / took.as_secs_f64(),
            client_cpu: (cpu_of("self", false) - self.cpu) / done * 1000.0,
            server_cpu: (server_cpu(self.postmaster) - self.server) / done * 1000.0,
            statements: statements(db, url)
                .await
                .map(|s| s / (done / BATCH as f64).ceil()),
        }
    }
}

/// L: `clients` connections, each applying its share of `events` keys in batches of 500.
async fn stage_l(db: &Database, url: &str, events: usize, clients: usize) -> Cost {
    let pool = pool(url, clients as u32).await;
    let meter = Meter::start(db, url).await;
    let per_client = events / clients;
    let (claim, ledger) = (claim_over(&backlog::generated()), backlog::ledger());
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (pool, claim, ledger) = (pool.clone(), claim.clone(), ledger.clone());
            tokio::spawn(async move {
                let first = c * per_client;
                for lo in (first..first + per_client).step_by(BATCH) {
                    let hi = (lo + BATCH).min(first + per_client) - 1;
                    let mut tx = pool.begin().await.unwrap();
                    let claimed: Vec<(String, Option<String>, Option<Vec<u8>>)> =
                        sqlx::query_as(&claim)
                            .bind("bench")
                            .bind(c as i32)
                            .bind(lo as i64)
                            .bind(hi as i64)
                            .bind(events as i64)
                            .fetch_all(&mut *tx)
                            .await
                            .unwrap();
                    assert_eq!(claimed.len(), hi + 1 - lo);
                    sqlx::query(&ledger)
                        .bind(lo as i64)
                        .bind(hi as i64)
                        .bind(events as i64)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let cost = meter.cost(db, url, per_client * clients).await;
    pool.close().await;
    cost
}

/// The consumer processes of one group, started together on `topic` into `url`, until they
/// committed `messages`: the time from the first claim of this run to then, and their CPU.
async fn drain(
    db: &Database,
    brokers: &str,
    topic: &str,
    url: &str,
    messages: usize,
    processes: usize,
    bin: &str,
) -> Cost {
    let pm = postmaster(db).await;
    let counters = db.counters().await;
    let waits = Waits::start(db, url);
    let group = format!("bench-l-{}", fastrand::u64(..));
    let mut children = Vec::new();
    for _ in 0..processes {
        let port = common::free_port();
        let child = tokio::process::Command::new(bin)
            .args(["consume", "--brokers", brokers, "--topic", topic])
            .args(["--group", &group, "--database-url", url])
            .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
            .args(["--kafka-option", "broker.address.family=v4"])
            // A member joining is noticed at the others' next heartbeat: soon, here.
            .args(["--kafka-option", "heartbeat.interval.ms=100"])
            .args(
                std::env::var("BENCH_D_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        children.push((child, port));
    }
    let http = reqwest::Client::new();
    let client_cpu = || -> f64 {
        let pids = children.iter().map(|(c, _)| c.id().unwrap().to_string());
        pids.map(|pid| cpu_of(&pid, false)).sum()
    };
    // Timed from when the group has settled, every process holding its share of the
    // partitions (a second process joining makes the first give some back), to the last commit:
    // the rate two processes drain a backlog at, not how fast a group forms. CPU is counted over
    // the same span.
    // Each look is a scrape of every process's metrics page, which costs the processes CPU:
    // every 5 ms until the group settles, then every 50 ms (at 5 ms, serving the scrapes took
    // 15% of their CPU), and every 5 ms again over the last tenth, so the end is seen at most
    // 5 ms late.
    let mut settled: Option<(Instant, usize, f64, f64)> = None;
    let mut n = 0;
    while n < messages {
        let pause = if settled.is_some() && n * 10 < messages * 9 {
            50
        } else {
            5
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let mut assigned = Vec::new();
        n = 0;
        for (_, port) in &children {
            let (consumed, partitions) = progress(&http, *port).await;
            n += consumed;
            assigned.push(partitions);
        }
        let whole = assigned.iter().all(|a| *a > 0)
            && assigned.iter().sum::<usize>() == PARTITIONS as usize;
        if whole && n > 0 && settled.is_none() {
            settled = Some((Instant::now(), n, client_cpu(), server_cpu(pm)));
        }
    }
    let done = Instant::now();
    let (from, before, client, server) = settled.expect("the group settled before the end");
    let counted = (messages - before).max(1) as f64;
    let client = client_cpu() - client;
    let server = server_cpu(pm) - server;
    let batches = batches(&http, &children).await;
    if let Some(waits) = waits {
        waits.print().await;
    }
    let _ = counters.since(db, url, messages).await;
    let statements = statements(db, url).await;
    println!(
        "    timed from the group's settling, {before} events in; {:.0} events per batch",
        messages as f64 / batches
    );
    for (mut child, _) in children {
        let pid = child.id().unwrap() as i32;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        );
        child.wait().await.unwrap();
    }
    let took = done - from;
    Cost {
        rate: counted / took.as_secs_f64(),
        client_cpu: client / counted * 1000.0,
        server_cpu: server / counted * 1000.0,
        statements: statements.map(|s| s / batches),
    }
}

/// `processes` processes of `bin` draining `topic` into a fresh copy of `template`.
async fn drain_fresh(
    (db, template): (&Database, &str),
    brokers: &str,
    topic: &str,
    events: usize,
    processes: usize,
    bin: &str,
) -> Cost {
    let url = db.fresh(template).await;
    let cost = drain(db, brokers, topic, &url, events, processes, bin).await;
    db.drop(&url).await;
    cost
}

/// Batches the processes committed, from their `replayproof_batch_size` histograms.
async fn batches(http: &reqwest::Client, children: &[(tokio::process::Child, u16)]) -> f64 {
    let mut n = 0.0;
    for (_, port) in children {
        n += metric(
            &metrics_page(http, *port).await,
            "replayproof_batch_size_count",
        );
    }
    n.max(1.0)
}

/// Events a process committed and partitions it holds, from its metrics.
async fn progress(http: &reqwest::Client, port: u16) -> (usize, usize) {
    let page = metrics_page(http, port).await;
    (
        metric(&page, "replayproof_consume_events_total") as usize,
        metric(&page, "replayproof_assigned_partitions") as usize,
    )
}

/// A process's metrics page; empty while it does not answer yet.
async fn metrics_page(http: &reqwest::Client, port: u16) -> String {
    match http
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
    {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The sum of a metric's samples on a page, over every label.
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The database as a redelivery storm finds it, hours after the first deliveries: vacuumed,
/// analysed and checkpointed, so R2 pays neither D2's autovacuum nor its first reads.
pub async fn settle(url: &str) {
    let db = pool(url, 1).await;
    for sql in ["VACUUM ANALYZE", "CHECKPOINT"] {
        sqlx::query(sql).execute(&db).await.unwrap();
    }
    db.close().await;
}

/// Runs L2, L4, D1, D2, R2 and N `repeats` times, interleaved, and prints the medians.
pub async fn run(db: &Database, mock: Option<&EmbeddedKafka>, brokers: &str, repeats: usize) {
    let events = env_or("BENCH_LIMIT_EVENTS", 100_000);
    let peer = env_or("BENCH_PEER_MESSAGES", 10_000).min(events);
    println!(
        "stage L: {events} fresh events of 100 B on {PARTITIONS} partitions, batches of {BATCH}"
    );
    let prefill = backlog::prefilled(db, events).await;
    let template = prefill
        .as_deref()
        .map_or("bench_template", |url| url.rsplit_once('/').unwrap().1)
        .to_owned();
    let w = Workload::new("lim", events, 0, 100, PARTITIONS);
    // L claims these very keys ([`backlog::KEY`]): `lim-100-` and the event's number.
    let keyed = |m: &replayproof::consume::RawMessage| {
        m.key.as_deref().is_some_and(|k| k.starts_with(b"lim-100-"))
    };
    assert!(w.partitions.iter().flatten().all(keyed));
    let topic = format!("bench_limit_{}", std::process::id());
    new_topic(mock, brokers, &topic, PARTITIONS).await;
    fill_topic(brokers, &topic, &w.partitions).await;
    let mut costs: BTreeMap<&str, Vec<Cost>> = BTreeMap::new();
    let mut keep = |stage: &'static str, cost: Cost| {
        println!(
            "  {stage}: {:>7.0} events/s, CPU per 1,000 events {:.1} ms consumer, {:.0} ms PostgreSQL, {} statements per batch",
            cost.rate,
            cost.client_cpu,
            cost.server_cpu,
            cost.statements.map_or("n/a".into(), |s| format!("{s:.1}"))
        );
        costs.entry(stage).or_default().push(cost);
    };
    // `BENCH_L_RUNS` picks runs (`D2,R2`; all by default), to look at one at a time.
    let picked = std::env::var("BENCH_L_RUNS").unwrap_or_default();
    let wanted = |run: &str| picked.is_empty() || picked.split(',').any(|p| p.trim() == run);
    let baseline = std::env::var("BENCH_BASELINE_BIN").ok();
    for round in 1..=repeats {
        println!(" round {round}");
        for clients in [2, 4] {
            if !wanted(if clients == 2 { "L2" } else { "L4" }) {
                continue;
            }
            let url = db.fresh(&template).await;
            keep(
                if clients == 2 { "L2" } else { "L4" },
                stage_l(db, &url, events, clients).await,
            );
            db.drop(&url).await;
        }
        for (stage, form) in [("LA", Form::Arrays), ("LC", Form::Copy)] {
            if !wanted(stage) {
                continue;
            }
            let url = db.fresh(&template).await;
            keep(stage, sent::stage(db, &url, events, form).await);
            db.drop(&url).await;
        }
        let this = env!("CARGO_BIN_EXE_replayproof");
        // The baseline runs before D in even rounds and after it in odd ones.
        let (early, late) = (round % 2 == 0, round % 2 == 1);
        if let Some(baseline) = baseline.as_deref().filter(|_| early) {
            keep(
                "B2",
                drain_fresh((db, &template), brokers, &topic, events, 2, baseline).await,
            );
        }
        if wanted("D1") {
            keep(
                "D1",
                drain_fresh((db, &template), brokers, &topic, events, 1, this).await,
            );
        }
        if wanted("D2") || wanted("R2") {
            let url = db.fresh(&template).await;
            keep(
                "D2",
                drain(db, brokers, &topic, &url, events, 2, this).await,
            );
            if wanted("R2") {
                settle(&url).await;
                keep(
                    "R2",
                    drain(db, brokers, &topic, &url, events, 2, this).await,
                );
            }
            db.drop(&url).await;
        }
        if let Some(baseline) = baseline.as_deref().filter(|_| late) {
            keep(
                "B2",
                drain_fresh((db, &template), brokers, &topic, events, 2, baseline).await,
            );
        }
        if wanted("N") {
            let url = db.fresh(&template).await;
            let took = stage_e(brokers, &topic, &url, peer).await;
            keep(
                "N",
                Cost {
                    rate: peer as f64 / took.as_secs_f64(),
                    ..Cost::default()
                },
            );
            db.drop(&url).await;
        }
    }
    if let Some(url) = prefill {
        db.drop(&url).await;
    }
    crate::summary::report(&costs);
}

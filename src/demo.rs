//! `replayproof demo`: the whole promise, end to end, with no services.
//!
//! It starts the embedded broker and database, `ingest`, three `consume` processes and a
//! dispatcher, sends a storm of signed webhook deliveries through the real HTTP ingress (several
//! sources, redeliveries, some concurrent, a few malformed or badly signed), puts a few poison
//! records straight on the topic, kills one consumer with SIGKILL mid-stream and restarts it,
//! and lets a fake downstream drop some responses. Then it counts: every event must have
//! exactly one ledger row and exactly one side effect downstream.

use crate::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use crate::ingest::config::FileConfig;
use crate::ingest::{self, IngestSettings};
use crate::stack::Stack;
use anyhow::Context as _;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use hmac::{Hmac, Mac};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use sha2::Sha256;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The storm's size and shape.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Distinct events.
    pub events: usize,
    /// The share of events delivered again.
    pub redeliver: f64,
    pub seed: u64,
    pub consumers: usize,
    /// Concurrent senders.
    pub senders: usize,
    pub brokers: Option<String>,
    pub database_url: Option<crate::db::DatabaseUrl>,
}

const GITHUB_SECRET: &str = "demo-github-secret";
const STRIPE_SECRET: &str = "whsec_demo-secret-for-replayproof";
/// base64 of "demo-standard-webhooks-secret".
const SVIX_SECRET: &str = "whsec_ZGVtby1zdGFuZGFyZC13ZWJob29rcy1zZWNyZXQ=";
const SOURCES: &str = r#"
[[sources]]
name = "github"
kind = "github"
secrets_env = ["GITHUB"]
[[sources]]
name = "stripe"
kind = "stripe"
secrets_env = ["STRIPE"]
[[sources]]
name = "svix"
kind = "standard-webhooks"
secrets_env = ["SVIX"]
"#;

/// A fake downstream that honours idempotency keys, counts side effects per event (one per
/// distinct idempotency key that carried it), and lets every seventh new operation's answer
/// arrive only after the dispatcher stopped waiting.
#[derive(Default)]
struct Downstream {
    /// Idempotency keys applied, with the event each carried.
    operations: Mutex<HashMap<String, String>>,
    new_operations: AtomicU64,
    slow_answers: AtomicU64,
}

impl Downstream {
    /// Side effects per event key.
    fn effects(&self) -> HashMap<String, u32> {
        let mut effects = HashMap::new();
        for event in self.operations.lock().expect("downstream lock").values() {
            *effects.entry(event.clone()).or_insert(0) += 1;
        }
        effects
    }
}

async fn downstream_post(
    State(d): State<Arc<Downstream>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST;
    };
    let Ok(envelope) = serde_json::from_slice::<crate::envelope::Envelope>(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY;
    };
    // Honours the key: a repeat is answered, not applied again.
    let first = d
        .operations
        .lock()
        .expect("downstream lock")
        .insert(key.to_owned(), envelope.key)
        .is_none();
    if first && d.new_operations.fetch_add(1, Ordering::Relaxed) % 7 == 3 {
        d.slow_answers.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    StatusCode::OK
}

async fn downstream_get(State(d): State<Arc<Downstream>>, Path(key): Path<String>) -> StatusCode {
    if d.operations
        .lock()
        .expect("downstream lock")
        .contains_key(&key)
    {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn start_downstream(d: Arc<Downstream>) -> anyhow::Result<String> {
    let app = axum::Router::new()
        .route("/ops", axum::routing::post(downstream_post))
        .route("/ops/{key}", axum::routing::get(downstream_get))
        .with_state(d);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(format!("http://{addr}"))
}

fn hmac_hex(secret: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any key length");
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().to_vec()
}

/// One delivery of the storm.
#[derive(Debug, Clone, Copy)]
enum Delivery {
    Event(usize),
    BadSignature(usize),
    NotJson(usize),
}

fn event_key(n: usize) -> String {
    match n % 3 {
        0 => format!("github:delivery-{n}"),
        1 => format!("stripe:evt_{n}"),
        _ => format!("svix:msg_{n}"),
    }
}

fn request(http: &reqwest::Client, base: &str, delivery: Delivery) -> reqwest::RequestBuilder {
    use base64::Engine as _;
    let now = chrono::Utc::now().timestamp().to_string();
    let (n, tamper) = match delivery {
        Delivery::Event(n) => (n, false),
        Delivery::BadSignature(n) => (n, true),
        Delivery::NotJson(n) => {
            let body = format!("{{not json {n}");
            let sig = hex::encode(hmac_hex(
                STRIPE_SECRET.as_bytes(),
                &[now.as_bytes(), b".", body.as_bytes()],
            ));
            return http
                .post(format!("{base}/webhooks/stripe"))
                .header("stripe-signature", format!("t={now},v1={sig}"))
                .body(body);
        }
    };
    let secret_for = |s: &str| {
        if tamper {
            format!("{s}-wrong")
        } else {
            s.to_owned()
        }
    };
    match n % 3 {
        0 => {
            let body = format!(r#"{{"action":"opened","number":{n}}}"#);
            let sig = hex::encode(hmac_hex(
                secret_for(GITHUB_SECRET).as_bytes(),
                &[body.as_bytes()],
            ));
            http.post(format!("{base}/webhooks/github"))
                .header("x-hub-signature-256", format!("sha256={sig}"))
                .header("x-github-delivery", format!("delivery-{n}"))
                .header("x-github-event", "pull_request")
                .body(body)
        }
        1 => {
            let body =
                format!(r#"{{"id":"evt_{n}","type":"charge.succeeded","data":{{"amount":{n}}}}}"#);
            let sig = hex::encode(hmac_hex(
                secret_for(STRIPE_SECRET).as_bytes(),
                &[now.as_bytes(), b".", body.as_bytes()],
            ));
            http.post(format!("{base}/webhooks/stripe"))
                .header("stripe-signature", format!("t={now},v1={sig}"))
                .body(body)
        }
        _ => {
            let body = format!(r#"{{"type":"invoice.paid","data":{{"n":{n}}}}}"#);
            let engine = base64::engine::general_purpose::STANDARD;
            let mut key = engine
                .decode(SVIX_SECRET.trim_start_matches("whsec_"))
                .expect("valid base64");
            if tamper {
                key[0] ^= 1;
            }
            let id = format!("msg_{n}");
            let sig = engine.encode(hmac_hex(
                &key,
                &[id.as_bytes(), b".", now.as_bytes(), b".", body.as_bytes()],
            ));
            http.post(format!("{base}/webhooks/svix"))
                .header("webhook-id", id)
                .header("webhook-timestamp", now)
                .header("webhook-signature", format!("v1,{sig}"))
                .body(body)
        }
    }
}

/// The storm: every event once, a share again, a few bad ones, shuffled.
fn plan(o: &DemoOptions) -> Vec<Delivery> {
    let mut rng = fastrand::Rng::with_seed(o.seed);
    let mut plan: Vec<Delivery> = (0..o.events).map(Delivery::Event).collect();
    let redeliveries = (o.events as f64 * o.redeliver).round() as usize;
    plan.extend((0..redeliveries).map(|_| Delivery::Event(rng.usize(..o.events))));
    let bad = (o.events / 50).max(2);
    plan.extend((0..bad).map(|i| {
        if i % 2 == 0 {
            Delivery::BadSignature(i)
        } else {
            Delivery::NotJson(i)
        }
    }));
    rng.shuffle(&mut plan);
    plan
}

/// Answers by status, and retries after 503 or a failed connection.
#[derive(Default)]
struct Answers {
    by_status: Mutex<BTreeMap<u16, u64>>,
    retries: AtomicU64,
}

async fn send_storm(
    base: String,
    plan: Vec<Delivery>,
    senders: usize,
    answers: Arc<Answers>,
    bar: ProgressBar,
) {
    let http = reqwest::Client::new();
    let plan = Arc::new(plan);
    let tasks: Vec<_> = (0..senders)
        .map(|s| {
            let (plan, http, base, answers, bar) = (
                plan.clone(),
                http.clone(),
                base.clone(),
                answers.clone(),
                bar.clone(),
            );
            tokio::spawn(async move {
                for delivery in plan.iter().skip(s).step_by(senders) {
                    // Like a sender: retry until a final answer.
                    for attempt in 0..20 {
                        let status = request(&http, &base, *delivery)
                            .send()
                            .await
                            .map(|r| r.status().as_u16())
                            .unwrap_or(0);
                        if status != 503 && status != 0 {
                            *answers
                                .by_status
                                .lock()
                                .expect("answers lock")
                                .entry(status)
                                .or_default() += 1;
                            break;
                        }
                        answers.retries.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(100 * (attempt + 1))).await;
                    }
                    bar.inc(1);
                }
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
}

struct Consumers {
    exe: std::path::PathBuf,
    args: Vec<String>,
    children: Vec<tokio::process::Child>,
}

impl Consumers {
    fn spawn_one(&self) -> anyhow::Result<tokio::process::Child> {
        tokio::process::Command::new(&self.exe)
            .args(&self.args)
            .env("RUST_LOG", "error")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting a consumer process")
    }

    async fn kill_and_restart(&mut self, i: usize) -> anyhow::Result<()> {
        let pid = self.children[i]
            .id()
            .context("the consumer already exited")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        self.children[i].wait().await?;
        self.children[i] = self.spawn_one()?;
        Ok(())
    }

    async fn stop(mut self) {
        for child in &mut self.children {
            if let Some(pid) = child.id() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
        }
        for child in &mut self.children {
            let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
        }
    }
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap_or(-1)
}

/// Runs the demo and prints its report; returns whether every event had exactly one effect.
pub async fn run(o: DemoOptions) -> anyhow::Result<bool> {
    let started = Instant::now();
    let stack = Stack::start(
        o.brokers.clone(),
        o.database_url.clone(),
        &format!("demo_{}", std::process::id()),
        4,
    )
    .await?;
    let downstream = Arc::new(Downstream::default());
    let downstream_url = start_downstream(downstream.clone()).await?;
    let shutdown = CancellationToken::new();

    let secrets = HashMap::from([
        ("GITHUB", GITHUB_SECRET),
        ("STRIPE", STRIPE_SECRET),
        ("SVIX", SVIX_SECRET),
    ]);
    let sources = toml::from_str::<FileConfig>(SOURCES)?
        .sources_with(|v| secrets.get(v).map(|s| s.to_string()))?;
    let ingress = ingest::start(
        IngestSettings::new(([127, 0, 0, 1], 0).into(), &stack.brokers, &stack.topic),
        sources,
        prometheus::Registry::new(),
        shutdown.clone(),
    )
    .await?;
    let base = format!("http://{}", ingress.addr);

    let mut args: Vec<String> = [
        "consume",
        "--brokers",
        &stack.brokers,
        "--topic",
        &stack.topic,
        "--group",
        "demo",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend([
        "--database-url".into(),
        stack.database_url.clone(),
        "--effect".into(),
        "ledger".into(),
        "--effect".into(),
        "http".into(),
    ]);
    args.extend([
        "--target-url".into(),
        format!("{downstream_url}/ops"),
        "--reconcile-url".into(),
        format!("{downstream_url}/ops/{{key}}"),
    ]);
    args.extend(
        [
            "--metrics-addr",
            "127.0.0.1:0",
            "--batch-size",
            "50",
            "--commit-interval-ms",
            "50",
        ]
        .map(String::from),
    );
    for option in [
        "session.timeout.ms=6000",
        "heartbeat.interval.ms=500",
        "broker.address.family=v4",
    ] {
        args.extend(["--kafka-option".into(), option.into()]);
    }
    let mut consumers = Consumers {
        exe: std::env::current_exe()?,
        args,
        children: Vec::new(),
    };
    for _ in 0..o.consumers.max(1) {
        let child = consumers.spawn_one()?;
        consumers.children.push(child);
    }

    let settings = DispatchSettings {
        request_timeout: Duration::from_secs(1),
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(100),
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
        ..DispatchSettings::new("demo")
    };
    let dispatcher = Dispatcher::new(
        settings,
        stack.pool.clone(),
        DispatchMetrics::new(&prometheus::Registry::new())?,
    )?;
    let dispatching = tokio::spawn({
        let stop = shutdown.clone();
        async move { dispatcher.run(stop).await }
    });

    // The storm, a misbehaving producer, and a consumer killed mid-stream.
    let plan = plan(&o);
    let progress = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:>12} [{bar:40}] {pos}/{len}")
        .expect("a valid template")
        .progress_chars("=> ");
    let sent_bar = progress.add(
        ProgressBar::new(plan.len() as u64)
            .with_style(style.clone())
            .with_prefix("deliveries"),
    );
    let applied_bar = progress.add(
        ProgressBar::new(o.events as u64)
            .with_style(style)
            .with_prefix("applied"),
    );
    let answers = Arc::new(Answers::default());
    let storm = tokio::spawn(send_storm(
        base,
        plan.clone(),
        o.senders.max(1),
        answers.clone(),
        sent_bar.clone(),
    ));
    let poison = [
        b"not an envelope".as_slice(),
        br#"{"source":"demo","payload":{}}"#,
        b"\x00\x01\x02",
    ];
    for (i, value) in poison.iter().enumerate() {
        stack
            .produce_raw(format!("poison-{i}").as_bytes(), value)
            .await?;
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut killed = false;
    loop {
        let applied = count(&stack.pool, "SELECT count(DISTINCT event_key) FROM ledger").await;
        applied_bar.set_position(applied.max(0) as u64);
        if !killed && applied as f64 >= o.events as f64 * 0.35 {
            consumers.kill_and_restart(0).await?;
            progress
                .println("Killed one consumer with SIGKILL mid-stream and started it again.")?;
            killed = true;
        }
        let outbox_open = count(
            &stack.pool,
            "SELECT count(*) FROM outbox WHERE state <> 'done'",
        )
        .await;
        let downstream_done = downstream.operations.lock().expect("downstream lock").len();
        let dead = count(&stack.pool, "SELECT count(*) FROM dead_letters").await;
        if storm.is_finished()
            && dead >= poison.len() as i64
            && applied as usize >= o.events
            && outbox_open == 0
            && downstream_done >= o.events
        {
            break;
        }
        if Instant::now() > deadline {
            progress.println("Gave up waiting after 180 s; reporting what happened.")?;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    storm.abort();
    sent_bar.finish();
    applied_bar.finish();

    let report = Report::gather(
        &stack.pool,
        &o,
        &plan,
        &answers,
        &downstream,
        started.elapsed(),
        killed,
    )
    .await?;
    println!("{}", report.render());
    shutdown.cancel();
    consumers.stop().await;
    ingress.stopped().await?;
    dispatching.await??;
    stack.pool.close().await;
    drop(stack);
    Ok(report.passed())
}

struct Report {
    text: Vec<(String, String)>,
    zero: usize,
    doubled: usize,
    downstream_zero: usize,
    downstream_doubled: usize,
}

impl Report {
    async fn gather(
        pool: &sqlx::PgPool,
        o: &DemoOptions,
        plan: &[Delivery],
        answers: &Answers,
        downstream: &Downstream,
        elapsed: Duration,
        killed: bool,
    ) -> anyhow::Result<Self> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT event_key, count(*) FROM ledger GROUP BY event_key")
                .fetch_all(pool)
                .await?;
        let rows: HashMap<String, i64> = rows.into_iter().collect();
        let keys: Vec<String> = (0..o.events).map(event_key).collect();
        let zero = keys.iter().filter(|k| !rows.contains_key(*k)).count();
        let doubled = rows.values().filter(|n| **n > 1).count();
        let effects = downstream.effects();
        let downstream_zero = keys.iter().filter(|k| !effects.contains_key(*k)).count();
        let downstream_doubled = effects.values().filter(|n| **n > 1).count();
        let statuses = answers.by_status.lock().expect("answers lock").clone();
        let accepted: u64 = statuses
            .iter()
            .filter(|(s, _)| (200..300).contains(*s))
            .map(|(_, n)| n)
            .sum();
        let rejected: Vec<String> = statuses
            .iter()
            .filter(|(s, _)| !(200..300).contains(*s))
            .map(|(s, n)| format!("{n} × {s} {}", reason(*s)))
            .collect();
        let ledger_rows: i64 = rows.values().sum();
        let dead_letters = count(pool, "SELECT count(*) FROM dead_letters").await;
        let attempts = count(pool, "SELECT count(*) FROM outbox_attempts").await;
        let reconciled = count(
            pool,
            "SELECT count(*) FROM outbox_attempts WHERE outcome = 'reconciled_done'",
        )
        .await;
        let text = vec![
            ("deliveries sent".into(), format!("{} ({} retried after 503 or a refused connection)", plan.len(), answers.retries.load(Ordering::Relaxed))),
            ("accepted (2xx)".into(), accepted.to_string()),
            ("rejected".into(), if rejected.is_empty() { "none".into() } else { rejected.join(", ") }),
            ("distinct events".into(), o.events.to_string()),
            ("ledger rows".into(), format!("{ledger_rows} ({zero} events with none, {doubled} with more than one)")),
            ("duplicates suppressed".into(), (accepted as i64 - ledger_rows).max(0).to_string()),
            ("dead letters".into(), format!("{dead_letters} (poison records written straight to the topic)")),
            ("consumer killed".into(), if killed { "1 with SIGKILL, restarted".into() } else { "no (the storm ended first)".into() }),
            (
                "downstream side effects".into(),
                format!(
                    "{} from {attempts} attempts ({} answers arrived too late, {reconciled} settled by reconciliation)",
                    effects.values().sum::<u32>(),
                    downstream.slow_answers.load(Ordering::Relaxed)
                ),
            ),
            ("time".into(), format!("{:.1} s", elapsed.as_secs_f64())),
        ];
        Ok(Self {
            text,
            zero,
            doubled,
            downstream_zero,
            downstream_doubled,
        })
    }

    fn passed(&self) -> bool {
        self.zero == 0
            && self.doubled == 0
            && self.downstream_zero == 0
            && self.downstream_doubled == 0
    }

    fn render(&self) -> String {
        let mut out = String::from("\nreplayproof demo report\n");
        for (name, value) in &self.text {
            out += &format!("  {name:<24} {value}\n");
        }
        out += &if self.passed() {
            "VERDICT: PASS: every event has exactly one ledger row and exactly one downstream side effect.\n".to_owned()
        } else {
            format!(
                "VERDICT: FAIL: {} events without a ledger row, {} with several; {} without a downstream effect, {} with several.\n",
                self.zero, self.doubled, self.downstream_zero, self.downstream_doubled
            )
        };
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        400 => "bad request (not JSON)",
        401 => "unauthorized (bad signature)",
        413 => "too large",
        _ => "other",
    }
}

//! `replayproof demo` and `replayproof dev` as a newcomer runs them, and `dev` in a binary
//! built on `replayproof::Cli` (the orders example) as an effect's author runs it.

use crate::harness::*;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_reports_a_clean_verdict() {
    let _heavy = heavy().await;
    let db = TestDb::new().await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args([
            "demo",
            "--events",
            "120",
            "--seed",
            "7",
            "--database-url",
            &db.url,
        ])
        .env_remove("REPLAYPROOF_BROKERS")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("VERDICT: PASS"), "{stdout}");
    assert!(stdout.contains("1 with SIGKILL, restarted"), "{stdout}");
    // A passing demo stops in order: no process of it reports an error on the way out.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("ERROR") && !stderr.lines().any(|l| l.starts_with("error:")),
        "{stderr}"
    );
    // The report's numbers are the database's.
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 120);
    assert_eq!(
        db.count("SELECT count(DISTINCT event_key) FROM ledger")
            .await,
        120
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE state = 'done'")
            .await,
        120
    );
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 3);
}

/// A `dev` process of `binary`, its banner read from its stderr.
struct Dev {
    child: tokio::process::Child,
    /// Every line it wrote to stderr so far.
    lines: Arc<Mutex<Vec<String>>>,
    /// Where it takes webhooks.
    base: String,
}

impl Dev {
    /// `binary dev` with `args`, on `db`, its webhooks on a free port and its console on any.
    fn start(binary: &std::path::Path, db: &TestDb, args: &[&str]) -> Self {
        let port = free_port();
        let mut child = tokio::process::Command::new(binary)
            .arg("dev")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            // Port 0: the banner says the one it got.
            .args(["--console-listen", "127.0.0.1:0"])
            .args(["--database-url", &db.url])
            .args(args)
            .env_remove("REPLAYPROOF_BROKERS")
            .env_remove("REPLAYPROOF_CONFIG")
            .env_remove("REPLAYPROOF_EFFECT")
            .env_remove("REPLAYPROOF_METRICS_ADDR")
            .env_remove("STRIPE_WEBHOOK_SECRET")
            .env_remove("GITHUB_WEBHOOK_SECRET")
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("dev");
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncBufReadExt as _;
            let mut reader = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                sink.lock().unwrap().push(line);
            }
        });
        let base = format!("http://127.0.0.1:{port}");
        Self { child, lines, base }
    }

    /// The banner's line that starts with `label` (`Console:`), once it is printed.
    async fn banner(&self, label: &str) -> String {
        let found = || {
            let lines = self.lines.lock().unwrap();
            lines
                .iter()
                .find(|l| l.trim_start().starts_with(label))
                .cloned()
        };
        wait_for(&format!("the banner's {label}"), WAIT, || async {
            found().is_some()
        })
        .await;
        found().unwrap()
    }

    /// What it wrote to stderr.
    fn stderr(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// SIGINT, as Ctrl-C sends it; it must exit 0.
    async fn interrupt(mut self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "{status:?}\n{}", self.stderr());
    }
}

/// The `http://host:port` in a banner line.
fn address_in(line: &str) -> String {
    line.split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .map(|addr| format!("http://{addr}"))
        .unwrap_or_else(|| panic!("no address in {line}"))
}

async fn get(url: &str) -> (u16, String) {
    let r = reqwest::get(url).await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_applies_a_signed_delivery_serves_metrics_and_stops_on_sigint() {
    let db = TestDb::new().await;
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let dev = Dev::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_replayproof")),
        &db,
        &["--metrics-addr", &metrics_addr],
    );
    let http = reqwest::Client::new();
    let base = dev.base.clone();
    wait_ready(&http, &base).await;
    let body = br#"{"action":"opened","number":1}"#;
    let sig = replayproof::devkit::sign::github(
        "dev-secret-for-replayproof",
        std::str::from_utf8(body).unwrap(),
    );
    let r = http
        .post(format!("{base}/webhooks/github"))
        .header("x-hub-signature-256", sig)
        .header("x-github-delivery", "dev-1")
        .header("x-github-event", "pull_request")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    wait_for("the event applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger WHERE event_key = 'github:dev-1'")
            .await
            == 1
    })
    .await;
    // The banner says where the metrics and probes are; they answer there.
    let metrics_line = dev.banner("Metrics:").await;
    assert!(
        metrics_line.contains(&format!("http://{metrics_addr}/metrics")),
        "{metrics_line}"
    );
    let probes = dev.banner("Probes:").await;
    let metrics_base = format!("http://{metrics_addr}");
    for probe in ["/livez", "/readyz"] {
        assert!(
            probes.contains(&format!("{metrics_base}{probe}")),
            "{probes}"
        );
    }
    wait_for("dev's /readyz", WAIT, || async {
        get(&format!("{metrics_base}/readyz")).await == (200, "ok\n".to_owned())
    })
    .await;
    assert_eq!(get(&format!("{metrics_base}/livez")).await.0, 200);
    // One page holds every role's metrics, as Prometheus and the dashboard read them.
    let (status, page) = get(&format!("{metrics_base}/metrics")).await;
    assert_eq!(status, 200);
    let applied = "replayproof_consume_events_total{outcome=\"applied\",source=\"github\"}";
    assert_eq!(scraped(&page, applied), 1.0, "{page}");
    let accepted = "replayproof_ingest_requests_total{outcome=\"accepted\",source=\"github\"}";
    assert_eq!(scraped(&page, accepted), 1.0, "{page}");
    assert!(page.contains("role=\"dev\""), "{page}");
    // The console `dev` serves shows it, to the user the banner names.
    let banner = dev.banner("Console:").await;
    let console_base = address_in(&banner);
    assert!(!console_base.ends_with(":0"), "{banner}");
    let password = banner
        .split("password ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no password in {banner}"));
    let cookie = console_login(&console_base, "dev", password).await;
    let console = reqwest::Client::new();
    let page = console
        .get(format!("{console_base}/events?q=github:dev-1"))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("/events/github:dev-1"), "{page}");
    // A second dev on the same ports stops at once, saying why, and the first runs on.
    let second = replayproof_dev(&["--metrics-addr", &metrics_addr], &db).await;
    assert!(!second.status.success());
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(
        said.contains(&format!("serving /metrics on {metrics_addr}")),
        "{said}"
    );
    assert!(said.contains("--metrics-addr"), "{said}");
    assert_eq!(get(&format!("{metrics_base}/readyz")).await.0, 200);
    dev.interrupt().await;
}

/// Logs `user` in to the console at `base`; the session's cookie.
async fn console_login(base: &str, user: &str, password: &str) -> String {
    let console = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = console
        .post(format!("{base}/login"))
        .form(&[("username", user), ("password", password)])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303);
    let cookie = login.headers()["set-cookie"].to_str().unwrap();
    cookie.split(';').next().unwrap().to_owned()
}

/// `replayproof dev` with `args`, run to its end (for the ones that stop at start).
async fn replayproof_dev(args: &[&str], db: &TestDb) -> std::process::Output {
    dev_output(
        std::path::Path::new(env!("CARGO_BIN_EXE_replayproof")),
        args,
        db,
    )
    .await
}

async fn dev_output(binary: &std::path::Path, args: &[&str], db: &TestDb) -> std::process::Output {
    let run = tokio::process::Command::new(binary)
        .arg("dev")
        .args(["--listen", "127.0.0.1:0", "--console-listen", "127.0.0.1:0"])
        .args(["--database-url", &db.url])
        .args(args)
        .env_remove("REPLAYPROOF_BROKERS")
        .env_remove("REPLAYPROOF_CONFIG")
        .env_remove("REPLAYPROOF_EFFECT")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(WAIT, run).await.unwrap().unwrap()
}

/// The orders example's binary, built next to this test binary
/// (`cargo build --all-features --examples`).
fn orders_binary() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let target = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>");
    let binary = target.join("examples").join("orders");
    assert!(
        binary.exists(),
        "build the orders example first: cargo build --all-features --examples"
    );
    binary
}

/// A payment for `order_id` as Stripe sends it to `dev`'s stripe source.
async fn pay(http: &reqwest::Client, base: &str, event: &str, order_id: i64, amount: i64) {
    let body = format!(
        r#"{{"id":"{event}","type":"payment_intent.succeeded","order_id":{order_id},"amount":{amount}}}"#
    );
    let now = chrono::Utc::now().timestamp().to_string();
    let signature =
        replayproof::devkit::sign::stripe("whsec_dev-secret-for-replayproof", &now, &body);
    let r = http
        .post(format!("{base}/webhooks/stripe"))
        .header("stripe-signature", signature)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

/// The orders example's `dev --effect orders`: its migration creates `orders`, a signed
/// payment marks the order paid, and the payment redelivered changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_binary_runs_dev_with_its_own_effect_once_per_event() {
    let db = TestDb::new().await;
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let dev = Dev::start(
        &orders_binary(),
        &db,
        &["--effect", "orders", "--metrics-addr", &metrics_addr],
    );
    let http = reqwest::Client::new();
    let base = dev.base.clone();
    wait_ready(&http, &base).await;
    let effects = dev.banner("Effects:").await;
    assert!(effects.contains("orders (from --effect)"), "{effects}");
    // dev ran the application's migration: its table is there.
    sqlx::query("INSERT INTO orders (id, amount) VALUES (42, 1999)")
        .execute(&db.pool)
        .await
        .unwrap();
    for _ in 0..2 {
        pay(&http, &base, "evt_dev_42", 42, 1999).await;
    }
    let metrics = format!("http://{metrics_addr}/metrics");
    let counted = |outcome: &'static str| {
        let metrics = metrics.clone();
        async move {
            let name = format!("replayproof_consume_events_total{{outcome=\"{outcome}\"");
            scraped(&get(&metrics).await.1, &name)
        }
    };
    wait_for("the payment and its redelivery consumed", WAIT, || async {
        counted("applied").await + counted("duplicate").await == 2.0
    })
    .await;
    assert_eq!(
        (counted("applied").await, counted("duplicate").await),
        (1.0, 1.0)
    );
    let paid: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, status, provider_event_id FROM orders")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        paid,
        [(42, "paid".to_owned(), Some("stripe:evt_dev_42".to_owned()))]
    );
    let claims = db
        .count("SELECT count(*) FROM processed_events WHERE event_key = 'stripe:evt_dev_42' AND status = 'done'")
        .await;
    assert_eq!(claims, 1);
    // Nothing of the stock ledger: the application's effect alone ran.
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 0);
    dev.interrupt().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_refuses_an_effect_the_binary_does_not_have_and_names_those_it_has() {
    let db = TestDb::new().await;
    let out = dev_output(&orders_binary(), &["--effect", "order"], &db).await;
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("no effect is called \"order\""), "{said}");
    assert!(said.contains("ledger") && said.contains("orders"), "{said}");
    // The file's [consume] effect is the default; a flag wins over it.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("orders.toml");
    std::fs::write(&config, "[consume]\neffect = [\"refunds\"]\n").unwrap();
    let config = config.to_str().unwrap();
    let out = dev_output(&orders_binary(), &["--config", config], &db).await;
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        said.contains("dev --effect refunds (from [consume] effect)"),
        "{said}"
    );
}

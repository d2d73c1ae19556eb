//! `replayproof demo` and `replayproof dev` as a newcomer runs them.

use crate::harness::*;
use std::time::Duration;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_applies_a_signed_delivery_and_stops_on_sigint() {
    let db = TestDb::new().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut dev = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args([
            "dev",
            "--listen",
            &format!("127.0.0.1:{port}"),
            // Port 0: the banner says the one it got.
            "--console-listen",
            "127.0.0.1:0",
            "--database-url",
            &db.url,
        ])
        .env_remove("REPLAYPROOF_BROKERS")
        .env_remove("GITHUB_WEBHOOK_SECRET")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // The banner names the console and the password made for this run.
    let stderr = dev.stderr.take().unwrap();
    let (banner_tx, banner_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt as _;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let mut banner_tx = Some(banner_tx);
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("Console:") {
                if let Some(tx) = banner_tx.take() {
                    let _ = tx.send(line);
                }
            }
        }
    });
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    wait_for("dev to be ready", Duration::from_secs(60), || async {
        http.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
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
    wait_for("the event applied", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM ledger WHERE event_key = 'github:dev-1'")
            .await
            == 1
    })
    .await;
    // The console `dev` serves shows it, to the user the banner names.
    let banner = tokio::time::timeout(Duration::from_secs(30), banner_rx)
        .await
        .unwrap()
        .unwrap();
    let console_base = banner
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .map(|addr| format!("http://{addr}"))
        .unwrap_or_else(|| panic!("no console address in {banner}"));
    assert!(!console_base.ends_with(":0"), "{banner}");
    let password = banner
        .split("password ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no password in {banner}"));
    let console = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = console
        .post(format!("{console_base}/login"))
        .form(&[("username", "dev"), ("password", password)])
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303);
    let cookie = login.headers()["set-cookie"].to_str().unwrap();
    let cookie = cookie.split(';').next().unwrap().to_owned();
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
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dev.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), dev.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

//! Secrets never printed or stored: a refused value is not echoed, URLs with credentials are
//! redacted in `config check`, errors, logs and the outbox, and an unverified database
//! connection is warned about. Each test runs the real binary and looks everywhere.

use crate::harness::*;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The binary with a clean environment of its own settings.
fn replayproof() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.env_remove("DATABASE_URL")
        .env_remove("REPLAYPROOF_CONFIG")
        .env_remove("REPLAYPROOF_SIGNING_SECRET")
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null());
    cmd
}

/// Both streams of a finished command, as text.
fn assert_nowhere(secret: &str, texts: &[&str]) {
    for text in texts {
        assert!(!text.contains(secret), "{secret:?} leaked into: {text}");
    }
}

const PASSWORD: &str = "Sup3r-Secret-Passw0rd";

#[test]
fn a_refused_database_url_never_prints_its_password() {
    let url = format!("postgres://app:{PASSWORD}@db.example.com:5432/rp?sslmode=verfy-full");
    let by_flag = replayproof()
        .args(["migrate", "--database-url", &url])
        .output()
        .unwrap();
    let by_env = replayproof()
        .args(["events", "list"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    for out in [&by_flag, &by_env] {
        assert_eq!(out.status.code(), Some(2), "{}", printed(out));
        let text = printed(out);
        assert!(text.contains("--database-url"), "{text}");
        assert!(text.contains("verfy-full"), "the reason is kept: {text}");
        assert_nowhere(PASSWORD, &[&text]);
    }
    // The same URL from the configuration file, in `config check`.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    std::fs::write(&file, format!("[database]\nurl = \"{url}\"\n")).unwrap();
    let check = replayproof()
        .args(["config", "check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let text = printed(&check);
    assert!(text.contains("migrate: problem"), "{text}");
    assert_nowhere(PASSWORD, &[&text]);
}

#[test]
fn a_malformed_signing_secret_or_header_never_prints_itself() {
    let db_url = "postgres://postgres@127.0.0.1:1/none";
    let signing = "whsec_Not*Base64*But-Secret-Enough";
    let header_token = "t0ken-That-Must-Stay-Secret";
    let runs = [
        replayproof()
            .args([
                "dispatch",
                "--database-url",
                db_url,
                "--signing-secret",
                signing,
            ])
            .output()
            .unwrap(),
        replayproof()
            .args(["dispatch", "--database-url", db_url])
            .env("REPLAYPROOF_SIGNING_SECRET", signing)
            .output()
            .unwrap(),
        replayproof()
            .args(["dispatch", "--database-url", db_url, "--header"])
            .arg(format!("Authorization=Bearer {header_token}\n"))
            .output()
            .unwrap(),
        replayproof()
            .args(["dispatch", "--database-url", db_url, "--header"])
            .arg(format!("Authorization: Bearer {header_token}=x"))
            .output()
            .unwrap(),
        replayproof()
            .args(["consume", "--brokers", "b:9092", "--database-url", db_url])
            .args(["--kafka-option", &format!("sasl.password{header_token}")])
            .output()
            .unwrap(),
    ];
    for out in &runs {
        let text = printed(out);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert_nowhere("Not*Base64*But-Secret-Enough", &[&text]);
        assert_nowhere(header_token, &[&text]);
    }
    // The same values from the configuration file, in `config check`.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    for dispatch in [
        format!("signing_secret = \"{signing}\""),
        format!("headers = {{ Authorization = \"Bearer {header_token}\\n\" }}"),
    ] {
        std::fs::write(
            &file,
            format!("[database]\nurl = \"{db_url}\"\n[dispatch]\n{dispatch}\n"),
        )
        .unwrap();
        let check = replayproof()
            .args(["config", "check", "--config"])
            .arg(&file)
            .output()
            .unwrap();
        let text = printed(&check);
        assert!(text.contains("dispatch: problem"), "{text}");
        assert_nowhere("Not*Base64*But-Secret-Enough", &[&text]);
        assert_nowhere(header_token, &[&text]);
    }
}

/// A Slack-like incoming webhook: the token is the last path segment; the query holds another.
const TOKEN: &str = "XyZ123abcDEF456ghiJKL789";
const QUERY_TOKEN: &str = "tkn-5ecret-987654";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_urls_with_credentials_are_redacted_in_config_check_errors_logs_and_the_outbox() {
    let target =
        format!("https://hooks.slack.com/services/T0001/B0001/{TOKEN}?token={QUERY_TOKEN}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    std::fs::write(
        &file,
        format!(
            "[kafka]\nbrokers = \"b:9092\"\n[database]\nurl = \"postgres://u@127.0.0.1/x\"\n\
             [consume]\neffect = [\"http\"]\ntarget_url = \"{target}\"\n"
        ),
    )
    .unwrap();
    let check = replayproof()
        .args(["config", "check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let check_text = printed(&check);
    assert!(
        check_text.contains("hooks.slack.com/services/T0001/B0001/"),
        "{check_text}"
    );
    assert!(check_text.contains("consume: ready"), "{check_text}");
    let refused = replayproof()
        .args([
            "consume",
            "--brokers",
            "b:9092",
            "--database-url",
            "postgres://u@127.0.0.1/x",
        ])
        .args([
            "--target-url",
            &format!("ftp://hooks.example.com/{TOKEN}?token={QUERY_TOKEN}"),
        ])
        .output()
        .unwrap();
    let refused_text = printed(&refused);
    assert_eq!(refused.status.code(), Some(2), "{refused_text}");

    // A delivery to a URL that refuses connections: its error is recorded and logged.
    let db = TestDb::new().await;
    let unreachable =
        format!("http://bot:{PASSWORD}@127.0.0.1:1/hooks/T0001/B0001/{TOKEN}?token={QUERY_TOKEN}");
    enqueue_to(&db, &unreachable, None, &["evt-slack".to_owned()]).await;
    // Its spans are exported too, to a collector that keeps every body whole.
    let (collector, endpoint) = crate::harness::otlp::Collector::start().await;
    let mut dispatch = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    dispatch
        .args(["dispatch", "--database-url", &db.url, "--poll-ms", "50"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "debug")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    crate::harness::otlp::traced(&mut dispatch, &endpoint);
    let mut dispatch = dispatch.spawn().unwrap();
    wait_for("an attempt recorded", Duration::from_secs(60), || async {
        db.count("SELECT count(*) FROM outbox_attempts").await >= 1
    })
    .await;
    let pid = nix::unistd::Pid::from_raw(dispatch.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(30), dispatch.wait()).await;
    let logs = {
        use tokio::io::AsyncReadExt as _;
        let mut text = String::new();
        dispatch
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut text)
            .await
            .unwrap();
        text
    };
    assert!(
        logs.contains("127.0.0.1:1"),
        "the attempt was logged: {logs}"
    );
    let stored: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(last_error, '') FROM outbox \
         UNION ALL SELECT coalesce(error, '') FROM outbox_attempts",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        stored.iter().any(|e| e.contains("127.0.0.1:1")),
        "{stored:?}"
    );
    let show = replayproof()
        .args(["events", "show", "evt-slack", "--database-url", &db.url])
        .output()
        .unwrap();
    let show_json = replayproof()
        .args([
            "events",
            "show",
            "evt-slack",
            "--json",
            "--database-url",
            &db.url,
        ])
        .output()
        .unwrap();
    let (show, show_json) = (printed(&show), printed(&show_json));
    assert!(show.contains("127.0.0.1:1/hooks/T0001/B0001/"), "{show}");
    let exported = collector.bodies();
    assert!(
        exported.iter().any(|b| b.contains("127.0.0.1:1")),
        "the attempt's span was exported: {exported:?}"
    );
    let mut everywhere: Vec<&str> = vec![&check_text, &refused_text, &logs, &show, &show_json];
    everywhere.extend(stored.iter().map(String::as_str));
    everywhere.extend(exported.iter().map(String::as_str));
    for secret in [TOKEN, QUERY_TOKEN, PASSWORD] {
        assert_nowhere(secret, &everywhere);
    }
}

#[test]
fn config_check_warns_of_a_remote_database_without_certificate_verification() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    let check = |url: &str| {
        std::fs::write(&file, format!("[database]\nurl = \"{url}\"\n")).unwrap();
        let out = replayproof()
            .args(["config", "check", "--config"])
            .arg(&file)
            .output()
            .unwrap();
        printed(&out)
    };
    let remote = check("postgres://app@db.example.com:5432/rp");
    assert!(remote.contains("warning: [database] url"), "{remote}");
    assert!(remote.contains("sslmode=prefer"), "{remote}");
    let required = check("postgres://app@db.example.com:5432/rp?sslmode=require");
    assert!(
        required.contains("sslmode=require, which checks no certificate"),
        "{required}"
    );
    // Every command says so at start, too.
    let started = replayproof()
        .args([
            "migrate",
            "--database-url",
            "postgres://app@db.invalid:5432/rp",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = printed(&started);
    assert!(
        text.contains("The database connection is not verified"),
        "{text}"
    );
    for quiet in [
        "postgres://app@db.example.com:5432/rp?sslmode=verify-full",
        "postgres://app@127.0.0.1:5432/rp",
        "postgres://app@localhost/rp",
    ] {
        let text = check(quiet);
        assert!(!text.contains("warning:"), "{quiet}: {text}");
    }
}

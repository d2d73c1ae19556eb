//! The console in a real browser: Debian's chromium driven through chromedriver (WebDriver).
//! Log in, find an event, open its story, retry it with a reason; then the database says what
//! the page said. Screenshots of the overview and the story are saved under the test's output
//! directory (`target/tmp/console-screenshots`).

use crate::harness::console::{settings, TestConsole};
use crate::harness::dispatcher::Downstream;
use crate::harness::{
    envelope, produce, producer, test_kafka_options, wait_for, Record, TestDb, TestKafka,
};
use fantoccini::{Client, ClientBuilder, Locator};
use replayproof::consume::{BatchProcessor, EffectRetry, RawMessage};
use replayproof::effect::{HttpOutbox, Registry};
use serde_json::json;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// chromedriver, stopped by its own pid when the test ends.
struct Driver {
    child: Child,
    port: u16,
    _profile: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn program(name: &str) -> PathBuf {
    let found = ["/usr/bin", "/usr/lib/chromium"]
        .iter()
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.exists());
    found.unwrap_or_else(|| {
        panic!("{name} is missing: install Debian's chromium and chromium-driver (scripts/test.sh does)")
    })
}

/// chromedriver on a port it chose itself (`--port=0`), read from what it prints: no other
/// test can take the port between its choice and its use.
async fn driver() -> Driver {
    use std::io::BufRead as _;
    let mut child = Command::new(program("chromedriver"))
        .arg("--port=0")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromedriver starts");
    let stdout = child.stdout.take().unwrap();
    let port = tokio::task::spawn_blocking(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        let port = lines.by_ref().find_map(|line| {
            let line = line.ok()?;
            let rest = line.split("started successfully on port ").nth(1)?;
            rest.trim_end_matches('.').trim().parse::<u16>().ok()
        });
        // Keep reading, so chromedriver never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        port
    })
    .await
    .unwrap()
    .expect("chromedriver says its port");
    wait_for(
        "chromedriver listening",
        Duration::from_secs(30),
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    Driver {
        child,
        port,
        _profile: tempfile::tempdir().unwrap(),
    }
}

async fn browser(driver: &Driver) -> Client {
    let profile = driver._profile.path().display().to_string();
    let args = [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1200,800",
        &format!("--user-data-dir={profile}"),
    ];
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({ "binary": program("chromium").display().to_string(), "args": args }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.port))
        .await
        .expect("a browser session")
}

fn screenshots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn text_of(c: &Client, css: &str) -> String {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_an_event_reads_its_story_and_retries_it_in_a_browser() {
    let db = TestDb::new().await;
    let downstream = Downstream::start().await;
    let http = HttpOutbox {
        target_url: downstream.url(),
        reconcile_url: None,
        max_attempts: 3,
        operation_keys: Default::default(),
    };
    let effect = Registry::default()
        .build(&["ledger".into(), "http".into()], Some(&http))
        .unwrap();
    let messages: Vec<RawMessage> = ["stripe:evt_paid", "stripe:evt_refund", "github:d-41"]
        .iter()
        .enumerate()
        .map(|(i, key)| RawMessage {
            offset: i as i64,
            key: Some(key.as_bytes().to_vec()),
            value: Some(envelope(
                key,
                json!({"amount": 1200 + i, "currency": "eur"}),
            )),
            traceparent: None,
            headers: Default::default(),
        })
        .collect();
    BatchProcessor::new(db.pool.clone(), effect)
        .with_retry(EffectRetry {
            attempts: 1,
            backoff: Duration::ZERO,
        })
        .process("webhooks", 0, &messages)
        .await
        .unwrap();
    // The downstream refused one for good.
    sqlx::query("UPDATE outbox SET state = 'failed', attempts = 1, last_status = 422, last_error = 'card declined' WHERE event_key = 'stripe:evt_refund'")
        .execute(&db.pool)
        .await
        .unwrap();
    // A topic with the three events on it and no consumer yet: the overview shows their lag.
    let kafka = TestKafka::mock();
    let topic = kafka.topic(2).await;
    let records: Vec<Record> = ["stripe:evt_paid", "stripe:evt_refund", "github:d-41"]
        .iter()
        .map(|k| Record::event(k, json!({})))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let mut s = settings();
    s.kafka = Some(replayproof::operator::status::KafkaTarget {
        brokers: kafka.brokers(),
        topic,
        group: "replayproof".into(),
        options: test_kafka_options(),
    });
    let console = TestConsole::start(&db, s).await;
    let driver = driver().await;
    let c = browser(&driver).await;

    c.goto(&format!("{}/events", console.base)).await.unwrap();
    assert!(
        c.current_url().await.unwrap().path() == "/login",
        "the login wall first"
    );
    c.find(Locator::Id("username"))
        .await
        .unwrap()
        .send_keys("ann")
        .await
        .unwrap();
    c.find(Locator::Id("password"))
        .await
        .unwrap()
        .send_keys("ann-pass")
        .await
        .unwrap();
    c.find(Locator::Id("login"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // A click returns once the form is sent, not once the next page is there: wait for it.
    wait_text(&c, "#user", "ann (operator)").await;
    assert_eq!(c.current_url().await.unwrap().path(), "/");
    let lag: u32 = c
        .find_all(Locator::Css("#lag tbody tr"))
        .await
        .unwrap()
        .len() as u32;
    assert_eq!(lag, 2, "a row per partition");
    let overview = c.screenshot().await.unwrap();
    std::fs::write(screenshots().join("overview.png"), &overview).unwrap();

    c.goto(&format!("{}/events", console.base)).await.unwrap();
    c.find(Locator::Id("q"))
        .await
        .unwrap()
        .send_keys("stripe:evt_ref*")
        .await
        .unwrap();
    c.find(Locator::Id("search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for("the search's page", Duration::from_secs(20), || async {
        c.current_url()
            .await
            .is_ok_and(|u| u.query().is_some_and(|q| q.contains("q=")))
    })
    .await;
    let found = c.find_all(Locator::Css("#events a.key")).await.unwrap();
    assert_eq!(found.len(), 1, "one event matches the prefix");
    found[0].click().await.unwrap();
    wait_text(&c, "#event-key", "stripe:evt_refund").await;
    assert!(text_of(&c, "#operation-states")
        .await
        .contains("deliver=failed"));
    assert!(text_of(&c, "#timeline")
        .await
        .contains("operation deliver: failed"));
    let story = c.screenshot().await.unwrap();
    std::fs::write(screenshots().join("story.png"), &story).unwrap();

    c.find(Locator::Id("retry-reason"))
        .await
        .unwrap()
        .send_keys("card updated by the customer")
        .await
        .unwrap();
    c.find(Locator::Id("retry"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // The page shows the new state.
    wait_text(&c, "#operation-states", "deliver=pending").await;
    assert!(text_of(&c, "#timeline")
        .await
        .contains("operator retry: ann"));
    c.close().await.unwrap();

    let state: String =
        sqlx::query_scalar("SELECT state FROM outbox WHERE event_key = 'stripe:evt_refund'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(state, "pending");
    let audit: (String, String, String, String) =
        sqlx::query_as("SELECT actor, action, target, reason FROM operator_actions")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        audit,
        (
            "ann".into(),
            "retry".into(),
            "stripe:evt_refund#deliver".into(),
            "card updated by the customer".into()
        )
    );
    for shot in ["overview.png", "story.png"] {
        let bytes = std::fs::read(screenshots().join(shot)).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{shot} is a PNG");
    }
}

/// Waits until the element `css` is on the page and its text has `needle`.
async fn wait_text(c: &Client, css: &str, needle: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(element) = c.find(Locator::Css(css)).await {
            if element.text().await.is_ok_and(|t| t.contains(needle)) {
                return;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{css} never said {needle:?}: {}",
            c.source().await.unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

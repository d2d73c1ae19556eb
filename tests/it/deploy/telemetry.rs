//! The metrics server a user scrapes.

use replayproof::consume::BatchReport;
use replayproof::consume::ConsumeMetrics;
use replayproof::telemetry::{serve_metrics, Health, Probe};

#[tokio::test]
async fn metrics_and_health_are_served() {
    let registry = prometheus::Registry::new();
    let metrics = ConsumeMetrics::new(&registry).unwrap();
    metrics.known_sources(["github"]);
    metrics.record(&BatchReport {
        applied: 3,
        duplicates: 2,
        dead_letters: vec![replayproof::consume::DeadLettered {
            offset: 7,
            reason: "the message has no value".into(),
        }],
        // applied, duplicate, conflict, dead letter, failed, deferred, expired replay, skipped
        by_source: [
            ("github".to_owned(), [3, 2, 0, 0, 0, 0, 0, 0]),
            ("unknown".to_owned(), [0, 0, 0, 1, 0, 0, 0, 0]),
        ]
        .into(),
        ..BatchReport::default()
    });
    let health = Health::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let addr = serve_metrics(
        "127.0.0.1:0".parse().unwrap(),
        registry,
        health.clone(),
        stop.clone().cancelled_owned(),
    )
    .await
    .unwrap();
    let get = |path: &'static str| async move {
        let r = reqwest::get(format!("http://{addr}{path}")).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    let (status, body) = get("/metrics").await;
    assert_eq!(status, 200);
    let events = |labels: &str| format!("replayproof_consume_events_total{{{labels}}}");
    for (labels, n) in [
        (r#"outcome="applied",source="github""#, 3),
        (r#"outcome="duplicate",source="github""#, 2),
        (r#"outcome="dead_letter",source="unknown""#, 1),
        // Known before anything happened: born at 0, so the first one is an increase.
        (r#"outcome="failed",source="github""#, 0),
        (r#"outcome="dead_letter",source="github""#, 0),
    ] {
        let line = format!("{} {n}", events(labels));
        assert!(body.lines().any(|l| l == line), "{line} in {body}");
    }
    for probe in ["/livez", "/readyz", "/healthz"] {
        assert_eq!(get(probe).await.0, 200, "{probe}");
    }
    // A dependency down: not ready, still live (`/healthz` is `/readyz`).
    health.report("database", Some("unreachable for 61 s".into()));
    for probe in ["/readyz", "/healthz"] {
        let (status, body) = get(probe).await;
        assert_eq!(
            (status, body.as_str()),
            (503, "database: unreachable for 61 s\n"),
            "{probe}"
        );
    }
    assert_eq!(get("/livez").await, (200, "ok\n".to_owned()));
    health.report("database", None);
    assert_eq!(get("/readyz").await.0, 200);
    // A wedged part fails both.
    health.report_as("lanes", Probe::Live, Some("stuck".into()));
    assert_eq!(get("/livez").await, (503, "lanes: stuck\n".to_owned()));
    assert_eq!(get("/readyz").await.0, 503);
    health.report("lanes", None);
    assert_eq!(get("/livez").await.0, 200);
    // A loop whose heartbeat is overdue is neither live nor ready until it beats again.
    health.beat("poll loop", std::time::Duration::from_secs(30));
    assert_eq!(get("/livez").await.0, 200);
    // A beat that may be 1 ms old at most is overdue once 20 ms have passed, however slow the
    // machine: no race with the request.
    health.beat("poll loop", std::time::Duration::from_millis(1));
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    for probe in ["/livez", "/readyz"] {
        let (status, body) = get(probe).await;
        assert_eq!(status, 503, "{probe}");
        assert!(body.starts_with("poll loop: no progress"), "{body}");
    }
    health.beat("poll loop", std::time::Duration::from_secs(60));
    assert_eq!(get("/livez").await.0, 200);
    stop.cancel();
}

#[test]
fn json_logs_put_the_message_and_the_event_fields_at_the_top_level() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args(["--log-format", "json", "migrate", "--database-url"])
        .arg(format!(
            "postgres://nobody@127.0.0.1:{}/none",
            crate::harness::free_port()
        ))
        .env_remove("REPLAYPROOF_CONFIG")
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line: serde_json::Value = stderr
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .find(|l: &serde_json::Value| l["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no JSON error line in {stderr}"));
    assert_eq!(
        line["message"], "replayproof stopped on an error.",
        "{line}"
    );
    assert!(
        line["error"].is_string(),
        "the event's field at the top level: {line}"
    );
    assert!(line.get("fields").is_none(), "{line}");
}

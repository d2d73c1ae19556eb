//! Retention: prune deletes only settled claims past their source's retention (with their
//! operations), refuses retentions its guard forbids, catches a redelivery of a pruned event as
//! an expired replay instead of applying it twice, and erasure keeps dedupe.

use crate::harness::{metric_value, stdout_of, wait_for, TestDb, TestKafka};
use replayproof::consume::{BatchProcessor, EffectRetry, RawMessage};
use replayproof::effect::{Ledger, Registry};
use replayproof::envelope::Envelope;
use replayproof::ingest::config::Kind;
use replayproof::operator::{expired, Act};
use replayproof::retention::round::{Pruner, RoundError, TopicRetention};
use replayproof::retention::{Lifetimes, Refusal, SourceRetention, TopicKeeps};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A Stripe event that happened `days_ago`, as the ingress writes it.
fn stripe_event(id: &str, days_ago: i64) -> Vec<u8> {
    let occurred = chrono::Utc::now() - chrono::Duration::days(days_ago);
    Envelope {
        route: None,
        key: format!("stripe:{id}").try_into().unwrap(),
        source: "stripe".into(),
        event_type: Some("invoice.paid".into()),
        received_at: None,
        occurred_at: Some(occurred),
        payload: serde_json::value::to_raw_value(
            &json!({"id": id, "created": occurred.timestamp(), "customer": "cus_1"}),
        )
        .unwrap(),
        unhashed: Vec::new(),
        replay_window_secs: None,
        request_id: None,
    }
    .to_bytes()
}

fn raw(offset: i64, value: Vec<u8>) -> RawMessage {
    RawMessage {
        offset,
        key: None,
        value: Some(value),
        traceparent: None,
        headers: Default::default(),
    }
}

async fn consume(db: &TestDb, messages: &[RawMessage]) -> replayproof::consume::BatchReport {
    BatchProcessor::new(db.pool.clone(), Arc::new(Ledger))
        .with_retry(EffectRetry {
            attempts: 1,
            backoff: Duration::ZERO,
        })
        .process("t", 0, messages)
        .await
        .unwrap()
}

/// A pruner keeping stripe's claims for `retention`, the topic keeping messages for half a day.
fn pruner(db: &TestDb, retention: Duration) -> Pruner {
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
        pool: db.pool.clone(),
        lifetimes,
        topic: "t".into(),
        topic_retention: TopicRetention::Stated(TopicKeeps::For {
            retention: DAY / 2,
            segment: Duration::ZERO,
        }),
        allow_below_floor: false,
        allow_below_topic_retention: false,
        batch: 2,
        actor: "test".into(),
    }
}

async fn backdate_claims(db: &TestDb, days: i64) {
    sqlx::query("UPDATE processed_events SET claimed_at = now() - make_interval(days => $1)")
        .bind(days as i32)
        .execute(&db.pool)
        .await
        .unwrap();
}

async fn ledger_rows(db: &TestDb, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE event_key = $1")
        .bind(key)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_redelivery_after_its_key_was_pruned_is_an_expired_replay_applied_once_by_hand() {
    let db = TestDb::new().await;
    let event = stripe_event("evt_old", 10);
    assert_eq!(consume(&db, &[raw(0, event.clone())]).await.applied, 1);
    backdate_claims(&db, 10).await;
    let round = pruner(&db, 5 * DAY).round(false).await.unwrap();
    assert_eq!(round.pruned.of("processed_events"), 1);
    assert_eq!(
        ledger_rows(&db, "stripe:evt_old").await,
        0,
        "pruned with its claim"
    );

    // The sender resends the 10-day-old event: its key is gone, and it is not applied again.
    let report = consume(&db, &[raw(1, event.clone())]).await;
    assert_eq!((report.applied, report.expired), (0, 1));
    assert_eq!(
        ledger_rows(&db, "stripe:evt_old").await,
        0,
        "no second effect"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 0);
    // Once more: the same expired replay, seen twice.
    consume(&db, &[raw(2, event.clone())]).await;
    let seen: Vec<(i64, Option<String>)> =
        sqlx::query_as("SELECT times_seen, resolution FROM expired_replays")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(seen, [(2, None)]);

    // A fresh event of the same source is applied as ever.
    let fresh = consume(&db, &[raw(3, stripe_event("evt_new", 0))]).await;
    assert_eq!((fresh.applied, fresh.expired), (1, 0));

    // The operator applies it: once, audited; a later redelivery is a plain replay.
    let act = Act::new("ops", "customer asked");
    let changes = expired::apply(&db.pool, &Registry::default(), "stripe:evt_old", None, &act)
        .await
        .unwrap();
    assert_eq!(changes[0].after, "done");
    assert_eq!(ledger_rows(&db, "stripe:evt_old").await, 1);
    let again = expired::apply(&db.pool, &Registry::default(), "stripe:evt_old", None, &act).await;
    assert!(again.is_err(), "nothing left to apply");
    let report = consume(&db, &[raw(4, event)]).await;
    assert_eq!((report.duplicates, report.expired), (1, 0));
    assert_eq!(ledger_rows(&db, "stripe:evt_old").await, 1);
    let audited = db
        .count("SELECT count(*) FROM operator_actions WHERE action = 'apply-expired'")
        .await;
    assert_eq!(audited, 1);
}

#[tokio::test]
async fn an_expired_replay_beside_a_fresh_event_counts_once() {
    let db = TestDb::new().await;
    let event = stripe_event("evt_gone", 10);
    consume(&db, &[raw(0, event.clone())]).await;
    backdate_claims(&db, 10).await;
    pruner(&db, 5 * DAY).round(false).await.unwrap();
    // The pruned event again, and a fresh one, in one batch: two messages, two outcomes.
    let report = consume(&db, &[raw(1, event), raw(2, stripe_event("evt_fresh", 0))]).await;
    assert_eq!(
        (report.applied, report.expired, report.duplicates),
        (1, 1, 0),
        "{report:?}"
    );
}

#[tokio::test]
async fn a_dropped_expired_replay_is_never_applied_and_is_audited() {
    let db = TestDb::new().await;
    let event = stripe_event("evt_drop", 10);
    consume(&db, &[raw(0, event.clone())]).await;
    backdate_claims(&db, 10).await;
    pruner(&db, 5 * DAY).round(false).await.unwrap();
    assert_eq!(consume(&db, &[raw(1, event)]).await.expired, 1);
    let act = Act::new("ops", "duplicate of a manual fix");
    expired::drop(&db.pool, "stripe:evt_drop", &act)
        .await
        .unwrap();
    let registry = Registry::default();
    let applied = expired::apply(&db.pool, &registry, "stripe:evt_drop", None, &act).await;
    assert!(applied.is_err());
    assert_eq!(ledger_rows(&db, "stripe:evt_drop").await, 0);
    let audited = db
        .count("SELECT count(*) FROM operator_actions WHERE action = 'drop-expired'")
        .await;
    assert_eq!(audited, 1);
}

#[tokio::test]
async fn prune_keeps_failed_deferred_and_unsettled_claims_and_takes_operations_with_the_rest() {
    let db = TestDb::new().await;
    let messages: Vec<RawMessage> = ["done", "failed", "deferred", "op_pending", "op_done"]
        .iter()
        .enumerate()
        .map(|(i, id)| raw(i as i64, stripe_event(id, 10)))
        .collect();
    consume(&db, &messages).await;
    sqlx::raw_sql(
        "UPDATE processed_events SET status = 'failed', payload = '{}' WHERE event_key = 'stripe:failed';
         UPDATE processed_events SET status = 'deferred', payload = '{}', due_at = now(),
             deadline_at = now() + interval '1 day' WHERE event_key = 'stripe:deferred';
         INSERT INTO outbox (operation_key, event_key, route_key, operation, destination, payload,
                             state)
         VALUES ('stripe:op_pending/http', 'stripe:op_pending', 'stripe:op_pending', 'http', 'x',
                 '', 'pending'),
                ('stripe:op_done/http', 'stripe:op_done', 'stripe:op_done', 'http', 'x', '',
                 'done');
         INSERT INTO outbox_attempts (outbox_id, route_key, fencing_token, worker, kind,
             idempotency_key, payload_sha256, started_at, duration_ms, outcome, applied)
         SELECT id, route_key, 1, 'w', 'deliver', operation_key, sha256(''), now(), 1, 'done',
                true FROM outbox",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    backdate_claims(&db, 10).await;

    let dry = pruner(&db, 5 * DAY).round(true).await.unwrap();
    assert_eq!(dry.pruned.of("processed_events"), 2);
    assert_eq!(
        db.count("SELECT count(*) FROM processed_events").await,
        5,
        "dry"
    );

    let round = pruner(&db, 5 * DAY).round(false).await.unwrap();
    assert_eq!(round.pruned.of("processed_events"), 2);
    assert_eq!(round.pruned.of("outbox"), 1);
    assert_eq!(round.pruned.of("outbox_attempts"), 1);
    let left: Vec<String> = sqlx::query_scalar("SELECT event_key FROM processed_events ORDER BY 1")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        left,
        ["stripe:deferred", "stripe:failed", "stripe:op_pending"]
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM outbox_attempts").await, 1);
}

#[tokio::test]
async fn prune_drops_only_the_destinations_that_are_idle_closed_and_have_nothing_to_send() {
    let db = TestDb::new().await;
    consume(&db, &[raw(0, stripe_event("evt_waiting", 1))]).await;
    sqlx::raw_sql(
        "INSERT INTO outbox_destinations (origin, breaker, consecutive_failures, paused_until, updated_at) VALUES
             ('https://idle.example', 'closed', 0, now() - interval '40 days', now() - interval '31 days'),
             ('https://recent.example', 'closed', 0, NULL, now() - interval '29 days'),
             ('https://open.example', 'open', 5, NULL, now() - interval '31 days'),
             ('https://failing.example', 'closed', 2, NULL, now() - interval '31 days'),
             ('https://paused.example', 'closed', 0, now() + interval '1 hour', now() - interval '31 days'),
             ('https://waiting.example', 'closed', 0, NULL, now() - interval '31 days');
         INSERT INTO outbox (operation_key, event_key, route_key, operation, destination, origin,
                             payload, state)
         VALUES ('stripe:evt_waiting/http', 'stripe:evt_waiting', 'stripe:evt_waiting', 'http',
                 'https://waiting.example/hook', 'https://waiting.example', '', 'retryable');",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let left = || async {
        sqlx::query_scalar::<_, String>("SELECT origin FROM outbox_destinations ORDER BY 1")
            .fetch_all(&db.pool)
            .await
            .unwrap()
    };

    let dry = pruner(&db, 5 * DAY).round(true).await.unwrap();
    assert_eq!(dry.pruned.of("outbox_destinations"), 1);
    assert_eq!(left().await.len(), 6, "dry");
    let round = pruner(&db, 5 * DAY).round(false).await.unwrap();
    assert_eq!(round.pruned.of("outbox_destinations"), 1);
    assert_eq!(
        left().await,
        [
            "https://failing.example",
            "https://open.example",
            "https://paused.example",
            "https://recent.example",
            "https://waiting.example"
        ]
    );
}

#[tokio::test]
async fn claims_younger_than_the_retention_stay() {
    let db = TestDb::new().await;
    consume(&db, &[raw(0, stripe_event("evt_1", 3))]).await;
    backdate_claims(&db, 3).await;
    let round = pruner(&db, 5 * DAY).round(false).await.unwrap();
    assert_eq!(round.pruned.of("processed_events"), 0);
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 1);
}

#[tokio::test]
async fn every_refusal_of_the_guard_deletes_nothing_and_an_allowed_one_is_audited() {
    let db = TestDb::new().await;
    consume(&db, &[raw(0, stripe_event("evt_1", 10))]).await;
    backdate_claims(&db, 10).await;
    let claims = || db.count("SELECT count(*) FROM processed_events");

    let below_floor = pruner(&db, DAY);
    let refused = below_floor.round(false).await.unwrap_err();
    assert!(matches!(
        refused,
        RoundError::Refused(Refusal::BelowFloor { .. })
    ));
    assert_eq!(claims().await, 1);

    let mut below_topic = pruner(&db, 5 * DAY);
    below_topic.topic_retention = TopicRetention::Stated(TopicKeeps::For {
        retention: 7 * DAY,
        segment: Duration::ZERO,
    });
    let refused = below_topic.round(false).await.unwrap_err();
    assert!(matches!(
        refused,
        RoundError::Refused(Refusal::BelowTopic { .. })
    ));
    below_topic.topic_retention = TopicRetention::Stated(TopicKeeps::Forever { compacted: false });
    assert!(
        below_topic.round(false).await.is_err(),
        "a topic kept forever"
    );
    assert_eq!(claims().await, 1);

    let mut hmac = pruner(&db, 5 * DAY);
    hmac.lifetimes.sources.insert(
        "custom".into(),
        SourceRetention {
            kind: Some(Kind::Hmac),
            retention: None,
            replay_window: None,
        },
    );
    let refused = hmac.round(false).await.unwrap_err();
    assert!(matches!(refused, RoundError::Refused(Refusal::Unstated(_))));
    assert_eq!(claims().await, 1);

    let mut allowed = pruner(&db, DAY);
    allowed.allow_below_floor = true;
    allowed.round(false).await.unwrap();
    assert_eq!(claims().await, 0);
    let audited = db
        .count("SELECT count(*) FROM operator_actions WHERE action = 'prune.below_floor' AND target = 'stripe'")
        .await;
    assert_eq!(audited, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_stated_topic_retention_prune_asks_the_broker_and_refuses_when_it_cannot_say() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let mut p = pruner(&db, 5 * DAY);
    p.topic_retention = TopicRetention::Broker {
        config: replayproof::kafka::client_config(
            replayproof::kafka::Role::Reader,
            &kafka.brokers(),
            None,
            &[],
            &[],
        )
        .unwrap(),
        topic: "t".into(),
    };
    // librdkafka's mock cluster does not answer DescribeConfigs: nothing is pruned blind.
    let refused = p.round(false).await.unwrap_err();
    assert!(
        format!("{refused}").contains("--topic-retention"),
        "{refused}"
    );
}

#[tokio::test]
async fn erasure_removes_payloads_keeps_dedupe_and_refuses_unsettled_events() {
    let db = TestDb::new().await;
    let event = stripe_event("evt_pii", 0);
    consume(
        &db,
        &[raw(0, event.clone()), raw(1, stripe_event("evt_failed", 0))],
    )
    .await;
    sqlx::query("UPDATE processed_events SET status = 'failed', payload = '{\"customer\": \"cus_1\"}' WHERE event_key = 'stripe:evt_failed'")
        .execute(&db.pool)
        .await
        .unwrap();
    let keys = replayproof::retention::erase::matching(&db.pool, "stripe", "customer", "cus_1")
        .await
        .unwrap();
    assert_eq!(keys, ["stripe:evt_failed", "stripe:evt_pii"]);
    let act = Act::new("dpo", "erasure request 42");
    let erased = replayproof::retention::erase::erase(&db.pool, &keys, &act)
        .await
        .unwrap();
    assert_eq!(erased.erased, ["stripe:evt_pii"]);
    assert_eq!(
        erased.refused.len(),
        1,
        "the failed claim still needs its payload"
    );
    let payload: serde_json::Value =
        sqlx::query_scalar("SELECT payload FROM ledger WHERE event_key = 'stripe:evt_pii'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(payload, serde_json::Value::Null);
    // The key and hash stay: the redelivery is a replay, not a second effect.
    let report = consume(&db, &[raw(2, event)]).await;
    assert_eq!(
        (report.duplicates, report.applied, report.conflicts),
        (1, 0, 0)
    );
    assert_eq!(ledger_rows(&db, "stripe:evt_pii").await, 1);
    let audited = db
        .count("SELECT count(*) FROM operator_actions WHERE action = 'erase'")
        .await;
    assert_eq!(audited, 1);
}

/// Rounds of 500 fresh events an hour apart, each followed, when `prune`, by a prune round
/// under a 30-minute retention, then a VACUUM (as autovacuum would): the claims' live rows and
/// primary key size after each.
async fn rounds(db: &TestDb, prune: bool, n: usize) -> Vec<(i64, i64)> {
    let mut p = pruner(db, Duration::from_secs(1800));
    p.allow_below_floor = true;
    p.allow_below_topic_retention = true;
    p.batch = 1000;
    let mut sizes = Vec::new();
    for round in 0..n {
        let messages: Vec<RawMessage> = (0..500)
            .map(|i| raw(i, stripe_event(&format!("r{round}-{i}"), 0)))
            .collect();
        consume(db, &messages).await;
        sqlx::query("UPDATE processed_events SET claimed_at = claimed_at - interval '1 hour'")
            .execute(&db.pool)
            .await
            .unwrap();
        if prune {
            p.round(false).await.unwrap();
        }
        sqlx::query("VACUUM processed_events")
            .execute(&db.pool)
            .await
            .unwrap();
        let rows = db.count("SELECT count(*) FROM processed_events").await;
        let index = db
            .count("SELECT pg_relation_size('processed_events_pkey')")
            .await;
        sizes.push((rows, index));
    }
    sizes
}

#[tokio::test]
async fn the_claims_table_and_its_index_stop_growing_once_retention_is_reached() {
    let (pruned_db, kept_db) = (TestDb::new().await, TestDb::new().await);
    let pruned = rounds(&pruned_db, true, 10).await;
    let kept = rounds(&kept_db, false, 10).await;
    assert!(pruned.iter().all(|(rows, _)| *rows == 0), "{pruned:?}");
    assert_eq!(kept.last().unwrap().0, 10 * 500);
    // Freed index pages are reused once no snapshot can still see them, which other tests'
    // transactions may delay by a round: compared with the same rounds unpruned, not to the
    // byte.
    let (pruned_index, kept_index) = (pruned.last().unwrap().1, kept.last().unwrap().1);
    assert!(
        pruned_index * 2 < kept_index,
        "pruned {pruned_index} bytes against {kept_index} kept: {pruned:?} {kept:?}"
    );
}

#[tokio::test]
async fn prune_dry_run_from_the_command_line_reads_the_file_and_changes_nothing() {
    let db = TestDb::new().await;
    consume(&db, &[raw(0, stripe_event("evt_1", 10))]).await;
    backdate_claims(&db, 10).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    std::fs::write(
        &file,
        r#"
[retention]
default_retention = "9days"

[[ingest.sources]]
name = "stripe"
kind = "stripe"
secrets_env = ["STRIPE_SECRET"]
retention = "6days"
"#,
    )
    .unwrap();
    let run = |extra: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
        command
            .args(["prune", "--config"])
            .arg(&file)
            .args(["--database-url", &db.url, "--brokers", "127.0.0.1:1"])
            .args(["--topic-retention", "1day", "--topic-segment", "1h"])
            .args(extra);
        command
    };
    let text = String::from_utf8(stdout_of(&mut run(&["--dry-run"]))).unwrap();
    assert!(
        text.contains("stripe: kind stripe, retention 6days"),
        "{text}"
    );
    assert!(
        text.contains("would delete 1 processed_events rows (source stripe)"),
        "{text}"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 1);
    let below = run(&["--source-retention", "stripe=1day"])
        .output()
        .unwrap();
    assert!(!below.status.success());
    let stderr = String::from_utf8_lossy(&below.stderr);
    assert!(stderr.contains("--allow-below-floor"), "{stderr}");
    assert!(run(&[]).status().unwrap().success());
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 0);
}

#[tokio::test]
async fn the_background_pruner_prunes_every_interval_and_counts_what_it_did() {
    use replayproof::retention::background::Background;
    let db = TestDb::new().await;
    consume(&db, &[raw(0, stripe_event("evt_1", 10))]).await;
    backdate_claims(&db, 10).await;
    let registry = prometheus::Registry::new();
    let metrics = replayproof::consume::ConsumeMetrics::new(&registry).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();

    // A round the guard refuses deletes nothing, is counted, and the task goes on.
    let refused = Background {
        pruner: pruner(&db, DAY),
        every: Duration::from_millis(50),
        metrics: metrics.prune.clone(),
    };
    let task = tokio::spawn(refused.run(shutdown.clone()));
    wait_for("a refused round", Duration::from_secs(10), || async {
        metric_value(&registry, "replayproof_prune_rounds_total") >= 2.0
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 1);
    shutdown.cancel();
    task.await.unwrap();

    let shutdown = tokio_util::sync::CancellationToken::new();
    let background = Background {
        pruner: pruner(&db, 5 * DAY),
        every: Duration::from_millis(50),
        metrics: metrics.prune.clone(),
    };
    let task = tokio::spawn(background.run(shutdown.clone()));
    wait_for(
        "the claim pruned and counted",
        Duration::from_secs(10),
        || async { metric_value(&registry, "replayproof_pruned_rows_total") >= 2.0 },
    )
    .await;
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 0);
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 0);
    assert_eq!(
        metric_value(&registry, "replayproof_retention_seconds"),
        (5 * DAY).as_secs_f64()
    );
    shutdown.cancel();
    task.await.unwrap();
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    assert!(
        text.contains(r#"replayproof_prune_rounds_total{outcome="refused"}"#),
        "{text}"
    );
    assert!(
        text.contains(r#"replayproof_pruned_rows_total{table="processed_events"} 1"#),
        "{text}"
    );
}

#[tokio::test]
async fn prune_counts_the_topics_segments_and_refuses_a_compacted_or_unbounded_topic() {
    let db = TestDb::new().await;
    let prune = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(["prune", "--dry-run", "--database-url", &db.url])
            .args([
                "--brokers",
                "127.0.0.1:1",
                "--source-retention",
                "stripe=95days",
            ])
            .args(extra)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.success(), said)
    };
    // 90 days of retention.ms fit under 95 days of claims (above the 91 days of a source of no
    // known kind), but a record stays readable until its whole segment (a week, Kafka's
    // default) is past retention.
    let (ok, said) = prune(&["--topic-retention", "90days"]);
    assert!(!ok, "{said}");
    assert!(said.contains("plus segment.ms 7days"), "{said}");
    let (ok, said) = prune(&["--topic-retention", "90days", "--topic-segment", "1day"]);
    assert!(ok, "{said}");
    let (ok, said) = prune(&["--topic-retention", "forever"]);
    assert!(!ok && said.contains("for ever"), "{said}");
}

/// `replayproof prune` deletes the Kafka output records sent longer ago than the attempt
/// retention, and never a pending one, however old.
#[tokio::test]
async fn prune_deletes_output_records_sent_past_the_attempt_retention_and_no_pending_one() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO output_records (route_key, event_key, name, record_id, topic, state,
                                     enqueued_at, sent_at, kafka_partition, kafka_offset,
                                     confirmed_by)
         VALUES ('old', 'old', 'kafka', 'old#kafka', 't', 'sent', now() - interval '41 days',
                 now() - interval '40 days', 0, 1, 'ack'),
                ('new', 'new', 'kafka', 'new#kafka', 't', 'sent', now() - interval '2 days',
                 now() - interval '1 day', 0, 2, 'ack'),
                ('waiting', 'waiting', 'kafka', 'waiting#kafka', 't', 'pending',
                 now() - interval '90 days', NULL, 0, NULL, NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args([
                "prune",
                "--database-url",
                &db.url,
                "--brokers",
                "127.0.0.1:1",
            ])
            .args(["--topic-retention", "1day", "--topic-segment", "1h"]),
    );
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("deleted 1 output_records rows"), "{text}");
    let left: Vec<String> =
        sqlx::query_scalar("SELECT event_key FROM output_records ORDER BY event_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, ["new", "waiting"]);
}

/// Redeliveries recorded by batch are kept while any settled claim they count on may be: past
/// the longest retention decided for a source, a kind's floor included (a source of unknown
/// kind keeps its claims 91 days, whatever the 35-day default says).
#[tokio::test]
async fn prune_deletes_redeliveries_older_than_the_longest_claim_retention() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO processed_events (event_key, route_key, source, status, payload_sha256,
                                       kafka_topic, kafka_partition, kafka_offset, attempts,
                                       completed_at)
         VALUES ('kept', 'kept', 'anon', 'done', sha256(''), 't', 0, 0, 1, now())",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO redeliveries (kafka_topic, kafka_partition, event_keys, kafka_offsets, seen_at)
         VALUES ('t', 0, '{old}', '{1}', now() - interval '101 days'),
                ('t', 0, '{kept}', '{2}', now() - interval '41 days'),
                ('t', 0, '{new}', '{3}', now() - interval '1 day')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = stdout_of(
        std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(["prune", "--database-url", &db.url])
            .args(["--brokers", "127.0.0.1:1"])
            .args(["--topic-retention", "1day", "--topic-segment", "1h"])
            .args(["--default-retention", "35d"]),
    );
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("deleted 1 redeliveries rows"), "{text}");
    let left: Vec<String> =
        sqlx::query_scalar("SELECT event_keys[1] FROM redeliveries ORDER BY seen_at")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(left, ["kept", "new"]);
}

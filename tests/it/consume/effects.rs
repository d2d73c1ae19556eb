//! Effects for events that arrive out of order: deferral (a claim committed `deferred`, applied
//! when due, failed past its deadline, moved by an operator) and newest-state-wins.

use crate::harness::*;
use async_trait::async_trait;
use replayproof::consume::{DeferSettings, DeferredApplier};
use replayproof::effect::newest::{self, Candidate};
use replayproof::effect::{DeferPolicy, Deferred, Effect, EffectError, Ledger, Tx};
use replayproof::envelope::{Envelope, Event};
use replayproof::operator::events::{self, Retry};
use replayproof::operator::search::{self, EventFilter};
use replayproof::operator::{Act, OperatorError};
use replayproof::testing::{envelope as event, EffectTest, TEST_TOPIC};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// A ledger row, deferred until `gates` has a row named like the payload's `gate`.
struct Gated;

const GATES: &str = "CREATE TABLE gates (name TEXT PRIMARY KEY)";

#[async_trait]
impl Effect for Gated {
    fn name(&self) -> &'static str {
        "gated"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let gate = event.payload()?["gate"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let open: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM gates WHERE name = $1)")
            .bind(&gate)
            .fetch_one(&mut **tx)
            .await?;
        if !open {
            return Err(Deferred::new(format!("gate {gate} is closed")).into());
        }
        Ledger.apply(tx, event).await
    }
}

async fn gated_db() -> TestDb {
    let db = TestDb::new().await;
    sqlx::raw_sql(GATES).execute(&db.pool).await.unwrap();
    db
}

async fn open(db: &TestDb, gate: &str) {
    sqlx::query("INSERT INTO gates VALUES ($1)")
        .bind(gate)
        .execute(&db.pool)
        .await
        .unwrap();
}

fn gated(key: &str, gate: &str) -> Envelope {
    event(key, "test", "test.event", json!({ "gate": gate }))
}

#[tokio::test]
async fn a_deferred_event_does_not_hold_the_events_after_it_and_applies_once_when_due() {
    let db = gated_db().await;
    open(&db, "open").await;
    let mut test = EffectTest::new(db.pool.clone(), Gated);
    let report = test
        .deliver(&[
            gated("evt-a", "later"),
            gated("evt-b", "open"),
            gated("evt-c", "open"),
        ])
        .await
        .unwrap();
    assert_eq!((report.applied, report.deferred, report.failed), (2, 1, 0));
    let counts = db.ledger_counts().await;
    assert_eq!((counts.get("evt-a"), counts.len()), (None, 2));
    let claim = test.claim("evt-a").await.unwrap().unwrap();
    assert_eq!(claim.status.as_str(), "deferred");
    assert_eq!(
        claim.deferred_reason.as_deref(),
        Some("gate later is closed")
    );
    // Still closed when due: deferred again, later, with one more attempt counted.
    let round = test.apply_deferred().await.unwrap();
    assert_eq!((round.due, round.deferred), (1, 1));
    let again = test.claim("evt-a").await.unwrap().unwrap();
    assert_eq!(again.attempts, claim.attempts + 1);
    assert!(again.due_at > claim.due_at);
    assert_eq!(again.deadline_at, claim.deadline_at, "the deadline stays");
    open(&db, "later").await;
    let round = test.apply_deferred().await.unwrap();
    assert_eq!((round.applied, round.deferred), (1, 0));
    assert_eq!(db.ledger_counts().await.get("evt-a"), Some(&1));
    let done = test.claim("evt-a").await.unwrap().unwrap();
    assert_eq!(done.status.as_str(), "done");
    assert!(done.payload.is_none() && done.due_at.is_none());
    assert_eq!(test.apply_deferred().await.unwrap().due, 0);
    assert_eq!(db.ledger_counts().await.get("evt-a"), Some(&1));
}

#[tokio::test]
async fn an_event_still_deferred_at_its_deadline_fails_with_its_reason() {
    let db = gated_db().await;
    let no_patience = DeferSettings {
        default: DeferPolicy {
            deadline: Duration::ZERO,
            ..DeferPolicy::default()
        },
        ..DeferSettings::default()
    };
    let mut test = EffectTest::new(db.pool.clone(), Gated).with_defer(no_patience);
    let report = test.deliver(&[gated("evt-x", "never")]).await.unwrap();
    assert_eq!(report.deferred, 1);
    let round = test.apply_deferred().await.unwrap();
    assert_eq!((round.failed, round.deferred), (1, 0));
    let claim = test.claim("evt-x").await.unwrap().unwrap();
    assert_eq!(claim.status.as_str(), "failed");
    let error = claim.last_error.unwrap();
    assert!(
        error.starts_with("still deferred at its deadline")
            && error.ends_with("gate never is closed"),
        "{error}"
    );
    assert!(claim.payload.is_some(), "kept for an operator's retry");
}

#[tokio::test]
async fn a_sources_deadline_applies_to_its_events_only() {
    let db = gated_db().await;
    let settings = DeferSettings {
        sources: [(
            "impatient".to_owned(),
            DeferPolicy {
                deadline: Duration::ZERO,
                ..DeferPolicy::default()
            },
        )]
        .into(),
        ..DeferSettings::default()
    };
    let mut test = EffectTest::new(db.pool.clone(), Gated).with_defer(settings);
    let impatient = event("evt-i", "impatient", "t", json!({"gate": "g"}));
    test.deliver(&[impatient, gated("evt-p", "g")])
        .await
        .unwrap();
    let round = test.apply_deferred().await.unwrap();
    assert_eq!((round.failed, round.deferred), (1, 1));
    assert_eq!(
        test.status("evt-i").await.unwrap().as_deref(),
        Some("failed")
    );
    assert_eq!(
        test.status("evt-p").await.unwrap().as_deref(),
        Some("deferred")
    );
}

#[tokio::test]
async fn an_operator_lists_retries_and_resolves_deferred_events() {
    let db = gated_db().await;
    let mut test = EffectTest::new(db.pool.clone(), Gated);
    test.deliver(&[gated("evt-1", "g1"), gated("evt-2", "g2")])
        .await
        .unwrap();
    let filter = EventFilter {
        state: Some("deferred".parse().unwrap()),
        limit: 10,
        ..EventFilter::default()
    };
    let listed = search::list(&db.pool, &filter).await.unwrap();
    assert_eq!(listed.len(), 2);
    let registry = replayproof::effect::Registry::default();
    let act = Act::new("ops", "order imported");
    let retry = Retry {
        effect: Some(Arc::new(Gated)),
        ..Retry::default()
    };
    // Retried while still blocked: it stays deferred, and the refusal says why.
    let refused = events::retry(&db.pool, &registry, "evt-1", &retry, &act).await;
    match refused {
        Err(e @ OperatorError::StillDeferred { .. }) => {
            let said = e.to_string();
            assert!(
                said.contains("evt-1 is still not ready: gate g1 is closed"),
                "{said}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        test.status("evt-1").await.unwrap().as_deref(),
        Some("deferred")
    );
    open(&db, "g1").await;
    let changes = events::retry(&db.pool, &registry, "evt-1", &retry, &act)
        .await
        .unwrap();
    assert_eq!(
        (changes[0].before.as_str(), changes[0].after.as_str()),
        ("deferred", "done")
    );
    assert_eq!(db.ledger_counts().await.get("evt-1"), Some(&1));
    let resolved = events::resolve(&db.pool, "evt-2", None, events::Resolution::Dead, &act)
        .await
        .unwrap();
    assert_eq!(
        (resolved[0].before.as_str(), resolved[0].after.as_str()),
        ("deferred", "dead")
    );
    // Neither is due any more: the background task finds nothing.
    open(&db, "g2").await;
    assert_eq!(test.apply_deferred().await.unwrap().due, 0);
    assert_eq!(db.ledger_counts().await.get("evt-2"), None);
    let audited = db.count("SELECT count(*) FROM operator_actions").await;
    assert_eq!(audited, 3);
}

#[tokio::test]
async fn an_operator_retried_event_defers_by_its_sources_policy() {
    let db = gated_db().await;
    let stripe = DeferPolicy {
        backoff: Duration::from_secs(3600),
        max_backoff: Duration::from_secs(7200),
        deadline: Duration::from_secs(72 * 3600),
    };
    let settings = DeferSettings {
        sources: [("stripe".to_owned(), stripe)].into(),
        ..DeferSettings::default()
    };
    let mut test = EffectTest::new(db.pool.clone(), Gated).with_defer(settings);
    let payment = event(
        "evt_1",
        "stripe",
        "invoice.paid",
        json!({"gate": "invoice"}),
    );
    test.deliver(&[payment]).await.unwrap();
    let registry = replayproof::effect::Registry::default();
    let act = Act::new("ops", "invoice imported?");
    let retry = Retry {
        effect: Some(Arc::new(Gated)),
        ..Retry::default()
    };
    let hours_from_now =
        |at: chrono::DateTime<chrono::Utc>| (at - chrono::Utc::now()).num_seconds() as f64 / 3600.0;
    // Still blocked: deferred again after the source's backoff, doubled for the second
    // deferral (2 h), not the default's (20 s).
    let refused = events::retry(&db.pool, &registry, "evt_1", &retry, &act).await;
    assert!(matches!(refused, Err(OperatorError::StillDeferred { .. })));
    let claim = test.claim("evt_1").await.unwrap().unwrap();
    let due = hours_from_now(claim.due_at.unwrap());
    assert!((1.9..=2.0).contains(&due), "due in {due} h");
    // From `failed` (as after its deadline): a fresh deadline from the source's policy.
    sqlx::query("UPDATE processed_events SET status = 'failed', due_at = NULL, deadline_at = now() - interval '1 hour'")
        .execute(&db.pool)
        .await
        .unwrap();
    let refused = events::retry(&db.pool, &registry, "evt_1", &retry, &act).await;
    assert!(matches!(refused, Err(OperatorError::StillDeferred { .. })));
    let claim = test.claim("evt_1").await.unwrap().unwrap();
    assert_eq!(claim.status.as_str(), "deferred");
    let deadline = hours_from_now(claim.deadline_at.unwrap());
    assert!(
        (71.9..=72.0).contains(&deadline),
        "deadline in {deadline} h"
    );
}

/// A processor for `effect` whose deferred events are due again within 100 ms, looked for
/// every 20 ms.
fn quickly_deferring(db: &TestDb, effect: Arc<dyn Effect>) -> replayproof::consume::BatchProcessor {
    replayproof::consume::BatchProcessor::new(db.pool.clone(), effect).with_defer(DeferSettings {
        default: DeferPolicy {
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(100),
            ..DeferPolicy::default()
        },
        poll_interval: Duration::from_millis(20),
        ..DeferSettings::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_applies_its_deferred_events_when_due_and_reports_them() {
    let (kafka, db) = (TestKafka::mock(), gated_db().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let processor = quickly_deferring(&db, Arc::new(Gated));
    let consumer =
        InProcessConsumer::with_processor(settings(&kafka.brokers(), &topic, &group), processor);
    let records = [
        Record::event("evt-wait", json!({"gate": "g"})),
        Record::event("evt-go", json!({"gate": "open"})),
    ];
    open(&db, "open").await;
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    // The deferred event does not hold the offset.
    wait_committed_total(&kafka, &group, &topic, 1, 2).await;
    wait_for("the deferred gauges", Duration::from_secs(30), || async {
        consumer.metric("replayproof_deferred_events") == 1.0
            && consumer.metric("replayproof_deferred_oldest_age_seconds") > 0.0
    })
    .await;
    assert!(consumer.metric("replayproof_deferred_attempts_total") >= 1.0);
    open(&db, "g").await;
    wait_for(
        "the deferred event applied",
        Duration::from_secs(30),
        || async { db.ledger_counts().await.get("evt-wait") == Some(&1) },
    )
    .await;
    wait_for("the gauge back to 0", Duration::from_secs(30), || async {
        consumer.metric("replayproof_deferred_events") == 0.0
    })
    .await;
    consumer.stop().await;
    assert_eq!(db.ledger_counts().await.len(), 2);
    // Another topic's deferred claims are not this consumer's: its own effect applies them.
    let other = replayproof::consume::BatchProcessor::new(db.pool.clone(), Arc::new(Gated));
    let metrics = replayproof::consume::ConsumeMetrics::new(&prometheus::Registry::new()).unwrap();
    let applier = DeferredApplier::new(other, &topic, metrics);
    let mut elsewhere = EffectTest::new(db.pool.clone(), Gated);
    elsewhere
        .deliver(&[gated("evt-elsewhere", "shut")])
        .await
        .unwrap();
    sqlx::query("UPDATE processed_events SET due_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    assert_eq!(
        applier.apply_due(&stop).await.unwrap().due,
        0,
        "{TEST_TOPIC} is not {topic}"
    );
}

/// Keeps each subscription's status from its newest event; the version is the event's
/// `created` (as Stripe's).
struct SubscriptionStatus;

const SUBSCRIPTIONS: &str =
    "CREATE TABLE subscriptions (id TEXT PRIMARY KEY, status TEXT NOT NULL)";

#[async_trait]
impl Effect for SubscriptionStatus {
    fn name(&self) -> &'static str {
        "subscriptions"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        let mut parsed = Vec::new();
        for e in events {
            let object = &e.payload()?["data"]["object"];
            let id = object["id"]
                .as_str()
                .ok_or_else(|| EffectError::permanent(anyhow::anyhow!("no id")))?;
            let version = newest::version(e, "/created").map_err(EffectError::Permanent)?;
            parsed.push((id, version, object["status"].as_str(), e));
        }
        let candidates: Vec<Candidate> = parsed
            .iter()
            .map(|(id, version, _, e)| Candidate::new("subscription", id, *version, e))
            .collect();
        let newest = newest::newest(tx, &candidates).await?;
        for ((id, _, status, _), newest) in parsed.iter().zip(newest) {
            if newest {
                sqlx::query(
                    "INSERT INTO subscriptions (id, status) VALUES ($1, $2) \
                     ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status",
                )
                .bind(id)
                .bind(status)
                .execute(&mut **tx)
                .await?;
            }
        }
        Ok(())
    }
}

fn subscription_event(n: i64, id: &str, status: &str) -> Envelope {
    let payload = json!({
        "id": format!("evt_{id}_{n}"),
        "created": 1_700_000_000 + n,
        "data": {"object": {"id": id, "status": status}},
    });
    event(
        &format!("evt_{id}_{n}"),
        "stripe",
        "customer.subscription.updated",
        payload,
    )
}

async fn subscription_states(db: &TestDb) -> Vec<(String, String)> {
    sqlx::query_as("SELECT id, status FROM subscriptions ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_objects_events_in_reverse_order_end_in_the_newest_state() {
    let db = TestDb::new().await;
    sqlx::raw_sql(SUBSCRIPTIONS)
        .execute(&db.pool)
        .await
        .unwrap();
    let statuses = ["incomplete", "trialing", "active", "past_due", "canceled"];
    let mut test = EffectTest::new(db.pool.clone(), SubscriptionStatus);
    // One batch per event, newest first.
    for (n, status) in statuses.iter().enumerate().rev() {
        let report = test
            .deliver(&[subscription_event(n as i64, "sub_a", status)])
            .await
            .unwrap();
        assert_eq!(
            report.applied, 1,
            "applied as an event, changing nothing when older"
        );
    }
    // One batch holding another subscription's events, newest first, twice over.
    let reversed: Vec<Envelope> = statuses
        .iter()
        .enumerate()
        .rev()
        .map(|(n, status)| subscription_event(n as i64, "sub_b", status))
        .collect();
    test.deliver(&reversed).await.unwrap();
    let report = test.deliver(&reversed).await.unwrap();
    assert_eq!(report.duplicates, statuses.len());
    assert_eq!(
        subscription_states(&db).await,
        [
            ("sub_a".to_owned(), "canceled".to_owned()),
            ("sub_b".to_owned(), "canceled".to_owned())
        ]
    );
    // An older event arriving late changes nothing; a newer one still does.
    test.deliver(&[subscription_event(-1, "sub_a", "active")])
        .await
        .unwrap();
    assert_eq!(subscription_states(&db).await[0].1, "canceled");
    test.deliver(&[subscription_event(9, "sub_a", "active")])
        .await
        .unwrap();
    assert_eq!(subscription_states(&db).await[0].1, "active");
    let recorded: (i64, String) =
        sqlx::query_as("SELECT version, event_key FROM object_versions WHERE object_id = 'sub_a'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(recorded, (1_700_000_009, "evt_sub_a_9".to_owned()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_objects_events_racing_on_two_partitions_end_in_the_newest_state() {
    let db = TestDb::new().await;
    sqlx::raw_sql(SUBSCRIPTIONS)
        .execute(&db.pool)
        .await
        .unwrap();
    let processor =
        || replayproof::consume::BatchProcessor::new(db.pool.clone(), Arc::new(SubscriptionStatus));
    // Even versions on partition 0, odd on 1, each partition newest first, 20 rounds.
    for round in 0..20 {
        let id = format!("sub_{round}");
        let messages = |parity: i64| -> Vec<replayproof::consume::RawMessage> {
            (0..10)
                .rev()
                .filter(|n| n % 2 == parity)
                .enumerate()
                .map(|(offset, n)| {
                    let e = subscription_event(n, &id, &format!("s{n}"));
                    replayproof::consume::RawMessage {
                        offset: offset as i64,
                        key: Some(e.key.as_str().as_bytes().to_vec()),
                        value: Some(e.to_bytes()),
                        traceparent: None,
                        headers: Default::default(),
                    }
                })
                .collect()
        };
        let (even, odd) = (messages(0), messages(1));
        let (p0, p1) = (processor(), processor());
        let (a, b) = tokio::join!(p0.process("t", 0, &even), p1.process("t", 1, &odd));
        a.unwrap();
        b.unwrap();
    }
    let states = subscription_states(&db).await;
    assert_eq!(states.len(), 20);
    assert!(states.iter().all(|(_, s)| s == "s9"), "{states:?}");
}

/// Deferred while its gate is closed; once it is open, does what the payload's `then` says:
/// `panic`, fail `transient`ly, or apply (a ledger row).
struct Moody;

#[async_trait]
impl Effect for Moody {
    fn name(&self) -> &'static str {
        "moody"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let payload = event.payload()?;
        let gate = payload["gate"].as_str().unwrap_or_default().to_owned();
        let open: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM gates WHERE name = $1)")
            .bind(&gate)
            .fetch_one(&mut **tx)
            .await?;
        if !open {
            return Err(Deferred::new(format!("gate {gate} is closed")).into());
        }
        match payload["then"].as_str() {
            Some("panic") => panic!("moody panics at {}", event.key),
            Some("transient") => Err(EffectError::transient(anyhow::anyhow!(
                "the downstream is busy"
            ))),
            _ => Ledger.apply(tx, event).await,
        }
    }
}

fn moody(key: &str, gate: &str, then: &str) -> Envelope {
    event(
        key,
        "test",
        "test.event",
        json!({ "gate": gate, "then": then }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_effect_that_panics_fails_its_event_and_the_applier_goes_on() {
    let (kafka, db) = (TestKafka::mock(), gated_db().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let processor = quickly_deferring(&db, Arc::new(Moody));
    let consumer =
        InProcessConsumer::with_processor(settings(&kafka.brokers(), &topic, &group), processor);
    let producer = producer(&kafka.brokers());
    let record = |key: &str, gate: &str, then: &str| Record {
        key: Some(key.as_bytes().to_vec()),
        value: moody(key, gate, then).to_bytes(),
        partition: None,
    };
    produce(
        &producer,
        &topic,
        &[
            record("evt-boom", "g", "panic"),
            record("evt-ok", "g", "apply"),
        ],
    )
    .await;
    wait_for("both deferred", Duration::from_secs(30), || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'deferred'")
            .await
            == 2
    })
    .await;
    open(&db, "g").await;
    wait_for("the panicking event failed, the other applied", Duration::from_secs(30), || async {
        db.ledger_counts().await.get("evt-ok") == Some(&1)
            && db.count("SELECT count(*) FROM processed_events WHERE status = 'failed' AND last_error LIKE '%panicked: moody panics%'").await == 1
    })
    .await;
    assert_eq!(consumer.metric("replayproof_deferred_panics_total"), 1.0);
    // The applier lives on: an event deferred after the panic is applied when due.
    produce(&producer, &topic, &[record("evt-later", "h", "apply")]).await;
    wait_for(
        "the later event deferred",
        Duration::from_secs(30),
        || async {
            db.count("SELECT count(*) FROM processed_events WHERE status = 'deferred'")
                .await
                == 1
        },
    )
    .await;
    open(&db, "h").await;
    wait_for(
        "the later event applied",
        Duration::from_secs(30),
        || async { db.ledger_counts().await.get("evt-later") == Some(&1) },
    )
    .await;
    consumer.stop().await;
}

#[tokio::test]
async fn a_deferred_event_failing_transiently_is_postponed_and_the_round_goes_on() {
    let db = gated_db().await;
    let mut test = EffectTest::new(db.pool.clone(), Moody);
    test.deliver(&[
        moody("evt-busy", "g", "transient"),
        moody("evt-ok", "g", "apply"),
    ])
    .await
    .unwrap();
    open(&db, "g").await;
    // Whichever comes first in the round, the busy one no longer ends it.
    let round = test.apply_deferred().await.unwrap();
    assert_eq!((round.postponed, round.applied), (1, 1), "{round:?}");
    assert_eq!(
        test.status("evt-ok").await.unwrap().as_deref(),
        Some("done")
    );
    assert_eq!(
        test.status("evt-busy").await.unwrap().as_deref(),
        Some("deferred")
    );
    let (due_in, error): (f64, Option<String>) = sqlx::query_as(
        "SELECT extract(epoch FROM due_at - now())::float8, last_error FROM processed_events \
         WHERE event_key = 'evt-busy'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(due_in > 0.0, "due again later, not at once: {due_in}");
    assert!(error.unwrap_or_default().contains("busy"));
}

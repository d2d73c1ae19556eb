//! `replayproof consume` as real processes: killed with SIGKILL at chosen steps, stopped with
//! SIGTERM, and run three at a time. The broker is `KAFKA_BROKERS` (the test script starts a
//! nisshi broker process) or, without it, the mock cluster hosted by this test process.

use crate::harness::*;
use serde_json::json;
use std::collections::HashSet;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(120);

fn spawn(
    kafka: &TestKafka,
    topic: &str,
    group: &str,
    db: &TestDb,
    failpoints: Option<&str>,
) -> ConsumerProcess {
    ConsumerProcess::spawn(&kafka.brokers(), topic, group, &db.url, failpoints)
}

/// One event on a fresh one-partition topic, for killing its consumer at a chosen step.
#[cfg(feature = "failpoints")]
struct OneEvent {
    kafka: TestKafka,
    db: TestDb,
    topic: String,
    group: String,
    /// More `consume` arguments, such as another effect.
    extra: &'static [&'static str],
}

#[cfg(feature = "failpoints")]
impl OneEvent {
    async fn start(extra: &'static [&'static str]) -> Self {
        let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
        let (topic, group) = (kafka.topic(1).await, unique("group"));
        Self {
            kafka,
            db,
            topic,
            group,
            extra,
        }
    }

    fn consumer(&self, failpoints: Option<&str>) -> ConsumerProcess {
        let brokers = self.kafka.brokers();
        ConsumerProcess::spawn_with(
            &brokers,
            &self.topic,
            &self.group,
            &self.db.url,
            failpoints,
            self.extra,
        )
    }

    async fn produce(&self, key: &str) {
        let record = Record::event(key, json!({"n": 1}));
        produce(&producer(&self.kafka.brokers()), &self.topic, &[record]).await;
    }

    async fn committed(&self) -> Vec<i64> {
        committed(&self.kafka, &self.group, &self.topic, 1).await
    }

    /// Checks that the killed consumer committed no offset, then that a fresh consumer applies
    /// `key` exactly once.
    async fn applied_once_after_restart(&self, key: &str) {
        assert_eq!(self.committed().await, [-1], "no offset was committed");
        let once = HashSet::from([key.to_owned()]);
        self.restart_until_committed(assert_exactly_once(&self.db, &once, WAIT))
            .await;
    }

    /// Starts a fresh consumer, waits for the event's offset to be committed, stops it cleanly.
    async fn restart_until_committed(&self, check: impl std::future::Future<Output = ()>) {
        let second = self.consumer(None);
        wait_committed_total(&self.kafka, &self.group, &self.topic, 1, 1).await;
        check.await;
        assert!(second.terminate(Duration::from_secs(30)).await.success());
    }
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_between_claim_and_commit_applies_the_event_once_after_restart() {
    let _heavy = heavy().await;
    let t = OneEvent::start(&[]).await;
    let first = t.consumer(Some("consume::before_commit=pause"));
    t.produce("evt-kill").await;
    kill_inside_transaction(first, &t.db).await;
    assert_eq!(
        t.db.count("SELECT count(*) FROM processed_events").await,
        0,
        "the claim rolled back"
    );
    t.applied_once_after_restart("evt-kill").await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_after_commit_before_offset_commit_replays_harmlessly() {
    let _heavy = heavy().await;
    let t = OneEvent::start(&[]).await;
    let first = t.consumer(Some("consume::after_commit=pause"));
    t.produce("evt-kill").await;
    wait_for("the transaction to commit", WAIT, || async {
        t.db.count("SELECT count(*) FROM ledger").await == 1
    })
    .await;
    first.kill9().await;
    t.applied_once_after_restart("evt-kill").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_commits_what_committed_and_exits_zero() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let consumer = spawn(&kafka, &topic, &group, &db, None);
    let records: Vec<Record> = (0..3_000)
        .map(|i| Record::event(&format!("evt-{i}"), json!(i)))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    wait_for("some events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await >= 500
    })
    .await;

    let status = consumer.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "exit status {status:?}");
    // After a clean stop the committed offsets cover exactly what was applied: nothing will be
    // replayed, and nothing is skipped.
    let offsets = committed(&kafka, &group, &topic, 2).await;
    for partition in 0..2 {
        let applied: i64 = sqlx::query_scalar(
            "SELECT coalesce(max(kafka_offset) + 1, 0) FROM processed_events WHERE kafka_partition = $1",
        )
        .bind(partition)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let offset = offsets[partition as usize];
        if applied == 0 {
            assert!(
                offset <= 0,
                "partition {partition}: offset {offset} with nothing applied"
            );
        } else {
            assert_eq!(offset, applied, "partition {partition}");
        }
    }
}

/// The consumer's promise at scale: 20,000 events, 30% redelivered, 4 partitions, 3 consumer
/// processes, one of them killed with SIGKILL twice. Prints the sustained rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_events_three_processes_one_killed_twice() {
    let _heavy = heavy().await;
    const EVENTS: usize = 20_000;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(4).await, unique("group"));
    let mut rng = fastrand::Rng::with_seed(7);
    let keys: Vec<String> = (0..EVENTS).map(|i| format!("evt-{i:05}")).collect();
    let mut records: Vec<Record> = keys
        .iter()
        .map(|k| Record::event(k, json!({"k": k})))
        .collect();
    for _ in 0..EVENTS * 3 / 10 {
        let k = &keys[rng.usize(..EVENTS)];
        let at = rng.usize(..records.len());
        records.insert(at, Record::event(k, json!({"k": k})));
    }
    let messages = records.len() as i64;

    let started = Instant::now();
    let mut victim = spawn(&kafka, &topic, &group, &db, None);
    let steady = [
        spawn(&kafka, &topic, &group, &db, None),
        spawn(&kafka, &topic, &group, &db, None),
    ];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    for at in [5_000, 12_000] {
        wait_for("progress before the kill", WAIT, || async {
            db.count("SELECT count(*) FROM ledger").await >= at
        })
        .await;
        victim.kill9().await;
        victim = spawn(&kafka, &topic, &group, &db, None);
    }
    let expected: HashSet<String> = keys.into_iter().collect();
    assert_exactly_once(&db, &expected, Duration::from_secs(300)).await;
    let elapsed = started.elapsed();
    let (first, last): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as("SELECT min(applied_at), max(applied_at) FROM ledger")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let applying = (last - first).to_std().unwrap_or_default().as_secs_f64();
    eprintln!(
        "{EVENTS} events ({messages} messages) applied by 3 consumers in {:.1} s from start \
         ({:.0} events/s); first to last effect {applying:.1} s ({:.0} events/s, {:.0} messages/s)",
        elapsed.as_secs_f64(),
        EVENTS as f64 / elapsed.as_secs_f64(),
        EVENTS as f64 / applying,
        messages as f64 / applying,
    );
    wait_committed_total(&kafka, &group, &topic, 4, messages).await;
    for consumer in steady.into_iter().chain([victim]) {
        assert!(consumer.terminate(Duration::from_secs(30)).await.success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_killed_mid_request_is_taken_over_and_its_late_completion_changes_nothing() {
    let _heavy = heavy().await;
    use crate::harness::dispatcher::{Behaviour, Downstream};
    use replayproof::outbox;
    let (db, downstream) = (TestDb::new().await, Downstream::start().await);
    let op = outbox::operation_key("evt-d", "deliver");
    downstream.script(&op, &[Behaviour::Hang]);
    let processor = replayproof::consume::BatchProcessor::new(
        db.pool.clone(),
        std::sync::Arc::new(replayproof::effect::HttpOutbox {
            target_url: downstream.url(),
            reconcile_url: None,
            max_attempts: 5,
            operation_keys: Default::default(),
        }),
    )
    .with_retry(Default::default());
    let message = replayproof::consume::RawMessage {
        offset: 0,
        key: Some(b"evt-d".to_vec()),
        value: Some(envelope("evt-d", json!({"amount": 5}))),
        traceparent: None,
        headers: Default::default(),
    };
    processor.process("t", 0, &[message]).await.unwrap();

    let mut first = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .args([
            "dispatch",
            "--database-url",
            &db.url,
            "--lease-secs",
            "2",
            "--request-timeout-ms",
            "900",
        ])
        .args([
            "--poll-ms",
            "50",
            "--metrics-addr",
            "127.0.0.1:0",
            "--worker",
            "first",
        ])
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_for("the request to be in flight", WAIT, || async {
        downstream.in_flight() == 1
    })
    .await;
    let token: i64 = sqlx::query_scalar("SELECT fencing_token FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    first.wait().await.unwrap();

    let metrics =
        replayproof::dispatch::DispatchMetrics::new(&prometheus::Registry::new()).unwrap();
    let settings = replayproof::dispatch::DispatchSettings {
        poll_interval: Duration::from_millis(50),
        request_timeout: Duration::from_secs(2),
        ..replayproof::dispatch::DispatchSettings::new("second")
    };
    let second = replayproof::dispatch::Dispatcher::build(
        settings,
        db.pool.clone(),
        metrics,
        replayproof::telemetry::Health::default(),
    )
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = second.run_until_stopped(stop.clone());
    wait_for(
        "the operation done by the second dispatcher",
        WAIT,
        || async {
            db.count("SELECT count(*) FROM outbox WHERE state = 'done' AND leased_by = 'second'")
                .await
                == 1
        },
    )
    .await;
    stop.cancel();
    running.stopped().await.unwrap();
    assert_eq!(downstream.applied()[&op], 1, "one side effect");
    assert!(downstream.bodies()[&op]
        .iter()
        .all(|b| b == &downstream.bodies()[&op][0]));

    // The first dispatcher's completion, arriving late with its old token, changes nothing.
    let (id, payload): (i64, Vec<u8>) = sqlx::query_as("SELECT id, payload FROM outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let stale = outbox::Leased {
        id,
        route_key: "evt-d".into(),
        operation_key: op.clone(),
        destination: downstream.url(),
        origin: outbox::origin(&downstream.url()),
        method: "POST".into(),
        content_type: outbox::JSON.into(),
        payload,
        headers: Default::default(),
        credential: None,
        reconcile_url: None,
        traceparent: None,
        attempts: 1,
        max_attempts: 5,
        fencing_token: token,
        previous_state: outbox::OutboxState::Pending,
        maybe_applied_at: None,
    };
    let settlement = outbox::Settlement {
        state: outbox::OutboxState::Failed,
        next_attempt_at: None,
        status: Some(500),
        error: Some("late".into()),
        response: None,
        maybe_applied_since: None,
        idempotent_until: None,
        held: false,
    };
    let attempt = outbox::Attempt {
        worker: "first",
        kind: outbox::AttemptKind::Deliver,
        started_at: chrono::Utc::now(),
        duration: Duration::from_secs(3),
        outcome: outbox::Outcome::Failed,
    };
    assert!(!outbox::complete(&db.pool, &stale, &settlement, &attempt)
        .await
        .unwrap());
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE state = 'done'")
            .await,
        1
    );
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_consumer_leaves_no_orphan_outbox_operation() {
    let _heavy = heavy().await;
    let t = OneEvent::start(&["--effect", "http", "--target-url", "http://127.0.0.1:9/ops"]).await;
    let first = t.consumer(Some("consume::before_commit=pause"));
    t.produce("evt-o").await;
    kill_inside_transaction(first, &t.db).await;
    assert_eq!(
        t.db.count("SELECT count(*) FROM outbox").await,
        0,
        "no orphan operation"
    );
    assert_eq!(t.db.count("SELECT count(*) FROM processed_events").await, 0);

    t.restart_until_committed(async {
        let sql = "SELECT count(*) FROM outbox WHERE operation_key = 'evt-o#deliver'";
        assert_eq!(t.db.count(sql).await, 1);
    })
    .await;
}

/// The partitions a consumer process owns, read from its metrics.
async fn assigned(port: u16) -> Option<f64> {
    let (_, page) = http_get(port, "/metrics").await?;
    Some(scraped(&page, "replayproof_assigned_partitions"))
}

/// Waits until the two consumers serving metrics on `ports` own one of the topic's two
/// partitions each, then produces `events` keys spread over both; returns the keys.
#[cfg(feature = "failpoints")]
async fn once_split_produce(
    kafka: &TestKafka,
    topic: &str,
    ports: [u16; 2],
    events: usize,
) -> HashSet<String> {
    wait_for("each consumer to own one partition", WAIT, || async {
        assigned(ports[0]).await == Some(1.0) && assigned(ports[1]).await == Some(1.0)
    })
    .await;
    let keys: Vec<String> = (0..events).map(|i| format!("evt-{i}")).collect();
    let records: Vec<Record> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| Record::event(k, json!(i)).on(i as i32 % 2))
        .collect();
    produce(&producer(&kafka.brokers()), topic, &records).await;
    keys.into_iter().collect()
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_stopped_with_sigstop_mid_batch_is_taken_over_and_nothing_doubles() {
    let _heavy = heavy().await;
    const EVENTS: usize = 400;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let ports = [free_port(), free_port()];
    let spawn_on = |port: u16| {
        let addr: &'static str = Box::leak(format!("127.0.0.1:{port}").into_boxed_str());
        ConsumerProcess::spawn_with(
            &kafka.brokers(),
            &topic,
            &group,
            &db.url,
            // Each holds its first batch's transaction open for 8 s: long enough to stop it there.
            Some("consume::stall_before_commit=1*return(8000)"),
            &[
                "--metrics-addr",
                addr,
                "--idle-in-transaction-timeout-ms",
                "3000",
                "--lock-timeout-ms",
                "2000",
            ],
        )
    };
    let (stopped, survivor) = (spawn_on(ports[0]), spawn_on(ports[1]));
    let expected = once_split_produce(&kafka, &topic, ports, EVENTS).await;
    wait_for("both consumers inside a batch", WAIT, || async {
        open_transactions(&db).await == 2
    })
    .await;

    stopped.signal(nix::sys::signal::Signal::SIGSTOP);
    // The stopped member's claims end with its session, its partition moves to the survivor.
    wait_for(
        "the survivor to apply every event",
        Duration::from_secs(90),
        || async { db.count("SELECT count(*) FROM ledger").await == EVENTS as i64 },
    )
    .await;
    stopped.signal(nix::sys::signal::Signal::SIGCONT);

    wait_committed_total(&kafka, &group, &topic, 2, EVENTS as i64).await;
    assert_exactly_once(&db, &expected, WAIT).await;
    survivor.terminate(Duration::from_secs(30)).await;
    stopped.terminate(Duration::from_secs(30)).await;
    assert_exactly_once(&db, &expected, WAIT).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_stuck_past_its_limits_fails_health_then_exits_non_zero() {
    let _heavy = heavy().await;
    let t = OneEvent::start(&[]).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let stuck = ConsumerProcess::spawn_with(
        &t.kafka.brokers(),
        &t.topic,
        &t.group,
        &t.db.url,
        Some("consume::stall_before_commit=return(600000)"),
        &[
            "--metrics-addr",
            &addr,
            "--unhealthy-after-secs",
            "2",
            "--stall-exit-secs",
            "8",
            "--shutdown-grace-secs",
            "2",
        ],
    );
    wait_for("healthy at first", WAIT, || async {
        http_get(port, "/healthz")
            .await
            .is_some_and(|(s, _)| s == 200)
    })
    .await;
    t.produce("evt-stuck").await;
    wait_for_open_transaction(&t.db).await;
    wait_for("/healthz to name the stuck lane", WAIT, || async {
        http_get(port, "/healthz")
            .await
            .is_some_and(|(s, body)| s == 503 && body.contains("has not committed its batch"))
    })
    .await;
    let status = stuck.exited(Duration::from_secs(60)).await;
    assert!(
        !status.success(),
        "a stalled consumer exits non-zero: {status:?}"
    );
    t.applied_once_after_restart("evt-stuck").await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_stops_at_once_and_the_event_is_applied_once_later() {
    let _heavy = heavy().await;
    let t = OneEvent::start(&[]).await;
    let stuck = ConsumerProcess::spawn_with(
        &t.kafka.brokers(),
        &t.topic,
        &t.group,
        &t.db.url,
        Some("consume::stall_before_commit=return(600000)"),
        &["--shutdown-grace-secs", "600"],
    );
    t.produce("evt-impatient").await;
    wait_for_open_transaction(&t.db).await;
    stuck.signal(nix::sys::signal::Signal::SIGTERM);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stuck.signal(nix::sys::signal::Signal::SIGTERM);
    let status = stuck.exited(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(130), "{status:?}");
    t.applied_once_after_restart("evt-impatient").await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_cut_off_from_its_group_keeps_its_claims_and_the_new_owner_replays_harmlessly() {
    let _heavy = heavy().await;
    const EVENTS: usize = 200;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let ports = [free_port(), free_port()];
    let addrs = ports.map(|p| format!("127.0.0.1:{p}"));
    // The first member's poll thread stalls for 15 s right after its first batch committed:
    // past max.poll.interval.ms, librdkafka takes it out of the group while its database work
    // stands, and its offsets are never committed.
    let cut = ConsumerProcess::spawn_with(
        &kafka.brokers(),
        &topic,
        &group,
        &db.url,
        Some("consume::before_store=1*sleep(15000)"),
        &[
            "--metrics-addr",
            &addrs[0],
            "--kafka-option",
            "max.poll.interval.ms=6000",
        ],
    );
    let survivor = ConsumerProcess::spawn_with(
        &kafka.brokers(),
        &topic,
        &group,
        &db.url,
        None,
        &["--metrics-addr", &addrs[1]],
    );
    let expected = once_split_produce(&kafka, &topic, ports, EVENTS).await;

    wait_for("the survivor to own both partitions", WAIT, || async {
        assigned(ports[1]).await == Some(2.0)
    })
    .await;
    wait_committed_total(&kafka, &group, &topic, 2, EVENTS as i64).await;
    assert_exactly_once(&db, &expected, WAIT).await;
    // The new owner replayed what the cut-off member had committed to the database.
    let (_, page) = http_get(ports[1], "/metrics").await.unwrap();
    let duplicates = scraped(
        &page,
        r#"replayproof_consume_events_total{outcome="duplicate""#,
    );
    assert!(
        duplicates > 0.0,
        "the survivor replayed the cut-off member's batch: {page}"
    );
    survivor.terminate(Duration::from_secs(30)).await;
    cut.terminate(Duration::from_secs(30)).await;
    assert_exactly_once(&db, &expected, WAIT).await;
}

/// A member of the rolling-restart group: cooperative-sticky, static membership, metrics on
/// `port`.
fn static_member(
    kafka: &TestKafka,
    topic: &str,
    group: &str,
    db: &TestDb,
    id: &str,
    port: u16,
) -> ConsumerProcess {
    let port = format!("127.0.0.1:{port}");
    ConsumerProcess::spawn_with(
        &kafka.brokers(),
        topic,
        group,
        &db.url,
        None,
        &[
            "--assignor",
            "cooperative-sticky",
            "--group-instance-id",
            id,
            "--metrics-addr",
            &port,
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_three_static_cooperative_consumers_loses_and_doubles_nothing() {
    let _heavy = heavy().await;
    const PARTITIONS: i32 = 4;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(PARTITIONS).await, unique("group"));
    let ids = ["member-a", "member-b", "member-c"];
    let ports = [free_port(), free_port(), free_port()];
    let mut members: Vec<ConsumerProcess> = (0..3)
        .map(|i| static_member(&kafka, &topic, &group, &db, ids[i], ports[i]))
        .collect();
    let settled = || async {
        let mut total = 0.0;
        for port in ports {
            match assigned(port).await {
                Some(n) if n > 0.0 => total += n,
                _ => return false,
            }
        }
        total == f64::from(PARTITIONS)
    };
    wait_for("the group to settle", WAIT, settled).await;

    // Events keep arriving through the whole rolling restart.
    let stop = tokio_util::sync::CancellationToken::new();
    let producing = {
        let (brokers, topic, stop) = (kafka.brokers(), topic.clone(), stop.clone());
        tokio::spawn(async move {
            let producer = producer(&brokers);
            let mut chunks = 0;
            while !stop.is_cancelled() {
                let records: Vec<Record> = (0..100)
                    .map(|i| Record::event(&format!("evt-{chunks}-{i}"), json!({"chunk": chunks})))
                    .collect();
                produce(&producer, &topic, &records).await;
                chunks += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            chunks
        })
    };
    for i in 0..3 {
        let applied = db.count("SELECT count(*) FROM ledger").await;
        wait_for("progress before the restart", WAIT, || async {
            db.count("SELECT count(*) FROM ledger").await > applied
        })
        .await;
        // Stopped cleanly, then started again under the same name, as a deployment does.
        let status = members.remove(i).terminate(Duration::from_secs(30)).await;
        assert!(status.success(), "{} stopped with {status}", ids[i]);
        members.insert(
            i,
            static_member(&kafka, &topic, &group, &db, ids[i], ports[i]),
        );
        wait_for("the group to settle again", WAIT, settled).await;
    }
    stop.cancel();
    let chunks = producing.await.unwrap();

    let expected: HashSet<String> = (0..chunks)
        .flat_map(|c| (0..100).map(move |i| format!("evt-{c}-{i}")))
        .collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    wait_committed_total(&kafka, &group, &topic, PARTITIONS, expected.len() as i64).await;
    for member in members {
        assert!(member.terminate(Duration::from_secs(30)).await.success());
    }
}

/// `consume`'s arguments for the `ledger-after` effect, its deferred events due again within
/// 200 ms and looked for every 50 ms, with metrics at `metrics_addr`.
#[cfg(feature = "failpoints")]
fn ledger_after_quickly(metrics_addr: &str) -> [&str; 10] {
    [
        "--effect",
        "ledger-after",
        "--defer-backoff",
        "100ms",
        "--defer-max-backoff",
        "200ms",
        "--defer-poll-ms",
        "50",
        "--metrics-addr",
        metrics_addr,
    ]
}

/// A deferred event whose effect one consumer has applied but not yet committed, while a second
/// consumer's background task finds it due: the second skips it (the first holds its claim);
/// then the first is killed (`kill`) or commits. Either way the event is applied once: by the
/// second after the kill, by the first otherwise.
#[cfg(feature = "failpoints")]
async fn deferred_event_applied_once_by_two_consumers(kill: bool) {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let consumer = |failpoints: Option<&str>, port: &str| {
        let extra = ledger_after_quickly(port);
        ConsumerProcess::spawn_with(
            &kafka.brokers(),
            &topic,
            &group,
            &db.url,
            failpoints,
            &extra,
        )
    };
    let (port_a, port_b) = (free_port(), free_port());
    let (addr_a, addr_b) = (format!("127.0.0.1:{port_a}"), format!("127.0.0.1:{port_b}"));
    // The first application of a deferred event stops before COMMIT, its transaction open:
    // long enough to be killed there, or for the second consumer to meet it and move on.
    let stall = match kill {
        true => "consume::deferred_applied_stall_before_commit=1*return(120000)",
        false => "consume::deferred_applied_stall_before_commit=1*return(10000)",
    };
    let mut first = Some(consumer(Some(stall), &addr_a));
    let producer = producer(&kafka.brokers());
    let late = Record::event("evt-late", json!({"after": "evt-first"}));
    produce(&producer, &topic, &[late]).await;
    wait_for("the late event deferred", WAIT, || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'deferred'")
            .await
            == 1
    })
    .await;
    produce(&producer, &topic, &[Record::event("evt-first", json!({}))]).await;
    wait_for(
        "the first consumer inside the deferred event's transaction",
        WAIT,
        || async { idle_in_transaction(&db).await == 1 },
    )
    .await;
    let second = consumer(None, &addr_b);
    let skipped = "replayproof_deferred_attempts_total{outcome=\"skipped\"}";
    wait_for(
        "the second consumer to find the event held",
        WAIT,
        || async {
            match http_get(port_b, "/metrics").await {
                Some((_, page)) => scraped(&page, skipped) >= 1.0,
                None => false,
            }
        },
    )
    .await;
    assert_eq!(
        db.count("SELECT count(*) FROM ledger WHERE event_key = 'evt-late'")
            .await,
        0,
        "nothing applied it while the first consumer held it"
    );
    if kill {
        first.take().expect("running").kill9().await;
    }
    wait_for("the deferred event applied", WAIT, || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'done'")
            .await
            == 2
    })
    .await;
    let applied = "replayproof_deferred_attempts_total{outcome=\"applied\"}";
    let by_second = scraped(&http_get(port_b, "/metrics").await.unwrap().1, applied);
    assert_eq!(by_second, if kill { 1.0 } else { 0.0 });
    if let Some(first) = first {
        assert!(first.terminate(WAIT).await.success());
    }
    assert!(second.terminate(WAIT).await.success());
    let both = HashSet::from(["evt-first".to_owned(), "evt-late".to_owned()]);
    assert_exactly_once(&db, &both, WAIT).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_event_whose_consumer_is_killed_mid_apply_is_applied_once_by_another() {
    let _heavy = heavy().await;
    deferred_event_applied_once_by_two_consumers(true).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_event_held_by_one_consumer_is_skipped_by_another_and_applied_once() {
    let _heavy = heavy().await;
    deferred_event_applied_once_by_two_consumers(false).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_applier_that_panics_is_started_again_counted_and_applies_what_is_due() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let extra = ledger_after_quickly(&addr);
    // The applier's first round panics outside any effect.
    let consumer = ConsumerProcess::spawn_with(
        &kafka.brokers(),
        &topic,
        &group,
        &db.url,
        Some("consume::deferred_round=1*panic(the applier breaks)"),
        &extra,
    );
    let producer = producer(&kafka.brokers());
    let late = Record::event("evt-late", json!({"after": "evt-first"}));
    produce(&producer, &topic, &[late]).await;
    produce(&producer, &topic, &[Record::event("evt-first", json!({}))]).await;
    wait_for("both events applied", WAIT, || async {
        db.count("SELECT count(*) FROM processed_events WHERE status = 'done'")
            .await
            == 2
    })
    .await;
    let page = http_get(port, "/metrics").await.unwrap().1;
    assert_eq!(scraped(&page, "replayproof_deferred_restarts_total"), 1.0);
    assert_eq!(http_get(port, "/healthz").await.unwrap().0, 200);
    assert!(consumer.terminate(WAIT).await.success());
    let both = HashSet::from(["evt-first".to_owned(), "evt-late".to_owned()]);
    assert_exactly_once(&db, &both, WAIT).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_applier_that_cannot_run_fails_health() {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let extra = ["--defer-poll-ms", "20", "--metrics-addr", &addr];
    // Every round panics.
    let consumer = ConsumerProcess::spawn_with(
        &kafka.brokers(),
        &topic,
        &group,
        &db.url,
        Some("consume::deferred_round=panic(the applier breaks)"),
        &extra,
    );
    wait_for("/healthz to name the deferred applier", WAIT, || async {
        http_get(port, "/healthz")
            .await
            .is_some_and(|(status, body)| {
                status == 503 && body.contains("deferred applier: it panicked")
            })
    })
    .await;
    assert!(consumer.terminate(WAIT).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_down_for_longer_than_the_stall_limit_keeps_the_consumer_up_and_it_applies_the_backlog(
) {
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::on_own_cluster().await);
    let postgres = db.cluster.as_ref().unwrap();
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let stall_exit = Duration::from_secs(6);
    let mut consumer = ConsumerProcess::spawn_with(
        &kafka.brokers(),
        &topic,
        &group,
        &db.url,
        None,
        &[
            "--metrics-addr",
            &addr,
            "--unhealthy-after",
            "2s",
            "--stall-exit",
            "6s",
        ],
    );
    let status = |path: &'static str| async move { http_get(port, path).await.map(|(s, _)| s) };
    wait_for("ready and live", WAIT, || async {
        status("/readyz").await == Some(200) && status("/livez").await == Some(200)
    })
    .await;
    let records = |range: std::ops::Range<usize>| -> Vec<Record> {
        range
            .map(|i| Record::event(&format!("evt-{i}"), json!({"n": i})))
            .collect()
    };
    let producer = producer(&kafka.brokers());
    produce(&producer, &topic, &records(0..50)).await;
    wait_for("the first events applied", WAIT, || async {
        db.count("SELECT count(*) FROM ledger").await == 50
    })
    .await;

    postgres.stop().unwrap();
    // A batch now waits for the database, longer than the stall limit.
    produce(&producer, &topic, &records(50..100)).await;
    wait_for("/readyz to name the database", WAIT, || async {
        http_get(port, "/readyz")
            .await
            .is_some_and(|(s, body)| s == 503 && body.contains("database"))
    })
    .await;
    let down_since = Instant::now();
    while down_since.elapsed() < stall_exit * 3 {
        assert!(
            consumer.is_running(),
            "the consumer exited during the outage"
        );
        assert_eq!(
            status("/livez").await,
            Some(200),
            "not live during the outage"
        );
        assert_eq!(
            status("/readyz").await,
            Some(503),
            "ready during the outage"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    postgres.resume().unwrap();
    let expected: HashSet<String> = (0..100).map(|i| format!("evt-{i}")).collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    wait_committed_total(&kafka, &group, &topic, 1, 100).await;
    wait_for("ready again", WAIT, || async {
        status("/readyz").await == Some(200)
    })
    .await;
    assert!(consumer.is_running());
    assert!(consumer.terminate(WAIT).await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_counter_an_alert_reads_is_exported_at_zero_before_anything_happens() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    let sources = "[[ingest.sources]]\nname = \"github\"\nkind = \"github\"\nsecrets_env = [\"UNSET_GITHUB_SECRET\"]\n";
    std::fs::write(&config, sources).unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let config = config.to_str().unwrap();
    let consumer = ConsumerProcess::spawn_with(
        &kafka.brokers(),
        &topic,
        &group,
        &db.url,
        None,
        &["--metrics-addr", &addr, "--config", config],
    );
    wait_for("both partitions assigned", WAIT, || async {
        assigned(port).await == Some(2.0)
    })
    .await;
    let (_, page) = http_get(port, "/metrics").await.unwrap();
    let zero = [
        r#"replayproof_consume_events_total{outcome="dead_letter",source="github"}"#,
        r#"replayproof_consume_events_total{outcome="dead_letter",source="unknown"}"#,
        r#"replayproof_consume_events_total{outcome="failed",source="github"}"#,
        r#"replayproof_consume_events_total{outcome="conflict",source="github"}"#,
        r#"replayproof_consume_events_total{outcome="expired_replay",source="github"}"#,
        r#"replayproof_deferred_attempts_total{outcome="failed"}"#,
        r#"replayproof_committed_offset{partition="0",topic="TOPIC"}"#,
        r#"replayproof_committed_offset{partition="1",topic="TOPIC"}"#,
    ];
    for series in zero {
        let line = format!("{} 0", series.replace("TOPIC", &topic));
        assert!(page.lines().any(|l| l == line), "{line} in {page}");
    }
    assert!(consumer.terminate(WAIT).await.success());
}

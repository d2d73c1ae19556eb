//! The database reached through PgBouncer in transaction mode, as managed platforms put a pooler
//! in front of PostgreSQL: Debian's `pgbouncer` (the test script installs it;
//! `REPLAYPROOF_PGBOUNCER` names the binary), a few server connections shared by every client,
//! refusing the startup parameters it does not know, as it does by default
//! ([`EmbeddedPgBouncer`]).

use crate::harness::*;
use replayproof::db::{Db, Pooler, Session};
use replayproof::devkit::pgbouncer::EmbeddedPgBouncer;
use serde_json::json;
#[cfg(feature = "failpoints")]
use std::collections::HashSet;
#[cfg(feature = "failpoints")]
use std::path::PathBuf;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

/// PgBouncer in transaction mode in front of the test database's server, with
/// `server_connections` server connections.
fn pgbouncer(db: &TestDb, server_connections: u32) -> EmbeddedPgBouncer {
    EmbeddedPgBouncer::in_front_of(&db.url, server_connections).expect("pgbouncer")
}

/// `db`'s database through `bouncer`.
fn through(bouncer: &EmbeddedPgBouncer, db: &TestDb) -> String {
    bouncer.url(&database_name(db))
}

fn database_name(db: &TestDb) -> String {
    url::Url::parse(&db.url).unwrap().path()[1..].to_owned()
}

/// A direct URL without the test harness's startup options.
fn direct_url(db: &TestDb) -> String {
    let mut url = url::Url::parse(&db.url).unwrap();
    url.set_query(None);
    url.to_string()
}

fn pooled_session() -> Session {
    Session {
        pooler: Pooler::Transaction,
        ..Session::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_setting_sent_at_startup_is_refused_by_the_pooler_and_pooler_mode_sends_none() {
    let db = TestDb::new().await;
    let bouncer = pgbouncer(&db, 2);
    let url = through(&bouncer, &db).parse().unwrap();

    // How every pool connected before `[database] pooler`: the schema and the time limits in
    // the `options` startup parameter, which PgBouncer refuses.
    let direct_mode = replayproof::db::pool_in(&url, 1, &Session::default()).unwrap();
    let refused = sqlx::query("SELECT 1")
        .execute(&direct_mode)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("unsupported startup parameter"),
        "{refused}"
    );

    // Straight to PostgreSQL they are the session's, JIT compilation off among them.
    let direct = direct_url(&db).parse().unwrap();
    let direct = replayproof::db::pool_in(&direct, 1, &Session::default()).unwrap();
    let jit: String = sqlx::query_scalar("SELECT current_setting('jit')")
        .fetch_one(&direct)
        .await
        .unwrap();
    assert_eq!(jit, "off");

    // Behind the pooler each transaction sets them for itself.
    let session = Session {
        limits: replayproof::db::Limits {
            statement_timeout: Duration::from_millis(1234),
            lock_timeout: Duration::from_millis(567),
            ..Default::default()
        },
        ..pooled_session()
    };
    let pooled = replayproof::db::pool_in(&url, 2, &session).unwrap();
    let settings: (String, String, String, String, String) = sqlx::query_as(
        "SELECT current_setting('search_path'), current_setting('statement_timeout'), \
         current_setting('lock_timeout'), current_setting('idle_in_transaction_session_timeout'), \
         current_setting('jit')",
    )
    .fetch_one(&pooled)
    .await
    .unwrap();
    assert_eq!(
        settings,
        (
            "replayproof, public".into(),
            "1234ms".into(),
            "567ms".into(),
            "30s".into(),
            "off".into()
        )
    );
    // replayproof's tables are found without the schema in the SQL, on every server connection.
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_events")
        .fetch_one(&pooled)
        .await
        .unwrap();
    assert_eq!(claims, 0);
    // A statement past its limit is ended by PostgreSQL, as on a direct connection.
    let slow = sqlx::query("SELECT pg_sleep(3)")
        .execute(&pooled)
        .await
        .unwrap_err();
    let code = slow.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("57014"), "{slow}");
}

/// Many clients, each with its own statement names, over two server connections: with sqlx's
/// statement cache on (its default; only the startup options left out) statements fail on a
/// prepared statement another client made or the server connection lacks; in pooler mode none
/// fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_of_many_clients_over_two_server_connections_all_succeed_in_pooler_mode() {
    let db = TestDb::new().await;
    let bouncer = pgbouncer(&db, 2);
    let url: replayproof::db::DatabaseUrl = through(&bouncer, &db).parse().unwrap();
    let cached = || {
        let options: sqlx::postgres::PgConnectOptions = url.expose().parse().unwrap();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(3)
            .connect_lazy_with(options.extra_float_digits(None::<i8>));
        Db::from(pool)
    };
    let failed = failures((0..4).map(|_| cached()).collect()).await;
    assert!(
        failed > 0,
        "the cached statements never met another client's"
    );

    let pooled = || replayproof::db::pool_in(&url, 3, &pooled_session()).unwrap();
    let failed = failures((0..4).map(|_| pooled()).collect()).await;
    assert_eq!(failed, 0, "statements failed in pooler mode");
}

/// Runs 40 rounds per pool at once (two statements in a transaction, one on its own) and
/// counts the rounds that failed.
async fn failures(pools: Vec<Db>) -> usize {
    let work = pools.iter().enumerate().flat_map(|(i, pool)| {
        (0..40_i64).map(move |n| async move {
            let mut tx = pool.begin().await?;
            let first: i64 = sqlx::query_scalar("SELECT $1::int8 + 1")
                .bind(n)
                .fetch_one(&mut *tx)
                .await?;
            let second: String = sqlx::query_scalar("SELECT $1::text || 'x'")
                .bind(format!("{i}"))
                .fetch_one(&mut *tx)
                .await?;
            tx.commit().await?;
            let third: i64 = sqlx::query_scalar("SELECT $1::int8 * 2")
                .bind(n)
                .fetch_one(pool)
                .await?;
            anyhow::ensure!(first == n + 1 && second == format!("{i}x") && third == 2 * n);
            Ok::<_, anyhow::Error>(())
        })
    });
    let results = futures_util::future::join_all(work).await;
    results.into_iter().filter(Result::is_err).count()
}

#[cfg(feature = "failpoints")]
/// The configuration file docs/production.md shows for a transaction-mode pooler, for consumers
/// of `ledger-after,http` whose deferred events are due again quickly, with `direct_url` only
/// when `direct` is given.
fn pooler_file(dir: &std::path::Path, pooled: &str, direct: Option<&str>, target: &str) -> PathBuf {
    let file = dir.join(format!("replayproof-{}.toml", direct.is_some()));
    let direct = direct.map_or(String::new(), |d| format!("direct_url = \"{d}\"\n"));
    std::fs::write(
        &file,
        format!(
            "[database]\nurl = \"{pooled}\"\npooler = \"transaction\"\n{direct}\n\
             [consume]\neffect = \"ledger-after,http\"\ntarget_url = \"{target}\"\n\
             defer_backoff = \"100ms\"\ndefer_max_backoff = \"200ms\"\ndefer_poll_ms = 50\n\n\
             [dispatch]\npoll_ms = 50\nbackoff = \"100ms\"\nmax_backoff = \"200ms\"\n"
        ),
    )
    .unwrap();
    file
}

fn replayproof_with(file: &std::path::Path, args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    command
        .args(args)
        .arg("--config")
        .arg(file)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn");
    command
}

/// Through PgBouncer in transaction mode with four server connections: `migrate` refused
/// without a direct URL and run with one; a consumer killed inside its batch's transaction,
/// two more consuming 2 partitions with redeliveries on the other partition, a deferred event
/// applied by the background applier, a dispatcher retrying a refused request; then `prune`.
/// Each event has one effect and each operation one downstream call.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_every_event_has_one_effect_and_one_downstream_call() {
    use crate::harness::dispatcher::{Behaviour, Downstream};
    let _heavy = heavy().await;
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let downstream = Downstream::start().await;
    let bouncer = pgbouncer(&db, 4);
    let pooled = through(&bouncer, &db);
    let dir = tempfile::tempdir().unwrap();
    let target = downstream.url();
    let without_direct = pooler_file(dir.path(), &pooled, None, &target);
    let file = pooler_file(dir.path(), &pooled, Some(&direct_url(&db)), &target);

    let refused = replayproof_with(&without_direct, &["migrate"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "migrate through the pooler alone"
    );
    assert!(
        said.contains("direct connection") && said.contains("direct_url"),
        "{said}"
    );
    let checked = config_check(&without_direct);
    let problem = "migrate: problem: the migrations need a direct connection";
    assert!(checked.contains(problem), "{checked}");
    stdout_of(&mut replayproof_with(&file, &["migrate"]));

    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let keys: Vec<String> = (0..120).map(|i| format!("evt-{i}")).collect();
    let retried = replayproof::outbox::operation_key("evt-7", "deliver");
    downstream.script(&retried, &[Behaviour::Refuse(503), Behaviour::Ok]);
    let consumer = |failpoints: Option<&str>| {
        let config = file.to_str().unwrap();
        let extra = ["--config", config, "--metrics-addr", "127.0.0.1:0"];
        ConsumerProcess::spawn_with(
            &kafka.brokers(),
            &topic,
            &group,
            &pooled,
            failpoints,
            &extra,
        )
    };
    let first = consumer(Some("consume::before_commit=pause"));
    let producer = producer(&kafka.brokers());
    let late = Record::event("evt-late", json!({"after": "evt-0"})).on(1);
    produce(&producer, &topic, &[late]).await;
    let records: Vec<Record> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| Record::event(k, json!({"n": i})).on((i % 2) as i32))
        .collect();
    produce(&producer, &topic, &records).await;
    kill_inside_transaction(first, &db).await;

    let members = [consumer(None), consumer(None)];
    let mut dispatcher = tokio::process::Command::from(replayproof_with(
        &file,
        &["dispatch", "--metrics-addr", "127.0.0.1:0"],
    ));
    let mut dispatcher = dispatcher.kill_on_drop(true).spawn().unwrap();
    // Redeliveries of every tenth event, on the other partition.
    let again: Vec<Record> = keys
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 10 == 0)
        .map(|(i, k)| Record::event(k, json!({"n": i})).on(((i + 1) % 2) as i32))
        .collect();
    produce(&producer, &topic, &again).await;

    let mut expected: HashSet<String> = keys.iter().cloned().collect();
    expected.insert("evt-late".into());
    assert_exactly_once(&db, &expected, WAIT).await;
    let total = (1 + keys.len() + again.len()) as i64;
    wait_committed_total(&kafka, &group, &topic, 2, total).await;
    wait_for("every operation delivered", WAIT, || async {
        downstream.applied().len() == expected.len()
    })
    .await;
    for (op, calls) in downstream.applied() {
        assert_eq!(calls, 1, "{op} applied {calls} times downstream");
    }
    assert_eq!(
        downstream.requests(&retried),
        2,
        "the refused request retried once"
    );
    wait_for("every operation settled done", WAIT, || async {
        db.count("SELECT count(*) FROM outbox WHERE state <> 'done'")
            .await
            == 0
    })
    .await;
    for member in members {
        assert!(member.terminate(WAIT).await.success());
    }
    dispatcher.kill().await.unwrap();

    // prune, through the pooler, deletes the claims past their retention.
    sqlx::query("UPDATE processed_events SET claimed_at = now() - interval '100 days'")
        .execute(&db.pool)
        .await
        .unwrap();
    let pruned = stdout_of(&mut replayproof_with(
        &file,
        &[
            "prune",
            "--brokers",
            "127.0.0.1:1",
            "--default-retention",
            "95days",
            "--topic-retention",
            "1day",
            "--topic-segment",
            "1h",
        ],
    ));
    let pruned = String::from_utf8(pruned).unwrap();
    assert!(
        pruned.contains(&format!("deleted {} processed_events rows", expected.len())),
        "{pruned}"
    );
    assert_eq!(db.count("SELECT count(*) FROM processed_events").await, 0);

    // config check, through the pooler whose server connections the processes used: the
    // database answers with every migration applied, each time.
    for _ in 0..5 {
        let checked = config_check(&file);
        assert!(checked.contains("migrate: ready"), "{checked}");
        let applied = "migrations are applied in schema replayproof";
        assert!(checked.contains(applied), "{checked}");
    }
}

#[cfg(feature = "failpoints")]
/// What `config check` prints about `file`, connecting.
fn config_check(file: &std::path::Path) -> String {
    let out = replayproof_with(file, &["config", "check"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two databases holding half the buckets each, reached through the pooler under names the
/// pooler maps; the pooler is then pointed at the other database for each name (an edited
/// `[databases]` and a reload, or a failover to the wrong replica) while a consumer stays
/// connected: it claims nothing in a database that does not hold the event's bucket, and once
/// the pooler is put right, every event has had one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_swapped_behind_the_pooler_is_refused_by_connected_processes() {
    let _heavy = heavy().await;
    let kafka = TestKafka::for_processes();
    let (first, second) = (TestDb::new().await, TestDb::new().await);
    let server = url::Url::parse(&first.url).unwrap();
    let name = database_name;
    let (host, port) = (server.host_str().unwrap(), server.port().unwrap_or(5432));
    let map = |a: &TestDb, b: &TestDb| {
        format!(
            "sa = host={host} port={port} dbname={}\nsb = host={host} port={port} dbname={}",
            name(a),
            name(b)
        )
    };
    let bouncer = EmbeddedPgBouncer::start(&map(&first, &second), 4).expect("pgbouncer");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    let at = |db: &str| bouncer.url(db);
    std::fs::write(
        &file,
        format!(
            "[database]\nshards = [\"{}\", \"{}\"]\npooler = \"transaction\"\n",
            at("sa"),
            at("sb")
        ),
    )
    .unwrap();
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let metrics = free_port();
    let mut consume = tokio::process::Command::from(replayproof_with(
        &file,
        &["consume", "--brokers", &kafka.brokers(), "--topic", &topic],
    ));
    consume
        .args(["--group", &group, "--commit-interval-ms", "50"])
        .args(["--max-retry-backoff-ms", "200"])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics}")])
        .kill_on_drop(true);
    for (k, v) in test_kafka_options() {
        consume.arg("--kafka-option").arg(format!("{k}={v}"));
    }
    let consumer = ConsumerProcess {
        child: consume.spawn().unwrap(),
    };
    let keys: Vec<String> = (0..60).map(|i| format!("evt-{i}")).collect();
    let records: Vec<Record> = keys.iter().map(|k| Record::event(k, json!({}))).collect();
    let producer = producer(&kafka.brokers());
    produce(&producer, &topic, &records).await;
    wait_committed_total(&kafka, &group, &topic, 1, 60).await;

    bouncer.repoint(&map(&second, &first)).unwrap();
    produce(&producer, &topic, &records).await;
    let retries = "replayproof_batch_retries_total";
    wait_for("the redeliveries refused, or applied", WAIT, || async {
        let refused = http_get(metrics, "/metrics")
            .await
            .is_some_and(|(_, page)| scraped(&page, retries) >= 2.0);
        refused || committed(&kafka, &group, &topic, 1).await == [120]
    })
    .await;
    bouncer.repoint(&map(&first, &second)).unwrap();
    wait_committed_total(&kafka, &group, &topic, 1, 120).await;
    assert!(consumer.terminate(WAIT).await.success());
    let mut effects = first.ledger_counts().await;
    for (key, n) in second.ledger_counts().await {
        *effects.entry(key).or_default() += n;
    }
    let expected: std::collections::HashMap<String, i64> =
        keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(
        effects, expected,
        "one effect per event over both databases"
    );
}

#[test]
fn dev_refuses_a_file_that_puts_its_database_behind_a_transaction_pooler() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    std::fs::write(
        &file,
        "[database]\nurl = \"postgres://postgres@127.0.0.1:6432/app\"\npooler = \"transaction\"\n",
    )
    .unwrap();
    let out = replayproof_with(&file, &["dev"]).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(said.contains("dev needs a direct connection"), "{said}");
}

//! `replayproof console` as a user starts it (docs/console.md): the built binary with a
//! configuration file whose user's hash `console hash-password` made, its database from the
//! file, the flag or `DATABASE_URL`, a login over HTTP, the overview and a logout; and a list of shards
//! that disagrees with what the databases record, refused at start.

use crate::harness::console::{console_command, ConsoleProcess};
use crate::harness::*;
use std::io::Write as _;
use std::time::Duration;

const SESSION_KEY: &str = "a session key of at least thirty-two bytes, for the process";
const PASSWORD: &str = "correct horse battery staple";

/// `password`'s hash, as `printf '%s' "$PASSWORD" | replayproof console hash-password` prints it.
fn hash_password(password: &str) -> String {
    let mut child = console_command(&["console", "hash-password"], &[])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(password.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let hash = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(hash.starts_with("$argon2id$"), "{hash}");
    hash
}

/// A configuration file with `database` (a `[database]` section or nothing), and a `[console]`
/// listening on `listen` with one operator, `alice`, whose password is [`PASSWORD`].
fn config_file(dir: &tempfile::TempDir, database: &str, listen: &str, hash: &str) -> String {
    let path = dir.path().join(format!("replayproof-{}.toml", free_port()));
    let text = format!(
        "{database}\n[console]\nlisten = \"{listen}\"\nsession_key = \"{SESSION_KEY}\"\n\n\
         [[console.users]]\nname = \"alice\"\nrole = \"operator\"\npassword_hash = \"{hash}\"\n"
    );
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Logs in as `alice` at the console, reads the overview and logs out: a copy of the session's
/// cookie opens nothing afterwards.
async fn logs_in_and_sees_the_overview(console: &ConsoleProcess) {
    let alice = console.client().logged_in("alice", PASSWORD).await;
    let overview = alice.get("/").await;
    assert_eq!(overview.status, 200, "{}", overview.body);
    assert!(overview.body.contains("Overview"), "{}", overview.body);
    let mut copy = console.client();
    copy.cookie = alice.cookie.clone();
    assert_eq!(alice.post("/logout", &[]).await.status, 303);
    let after = copy.get("/").await;
    assert_eq!(after.location.as_deref(), Some("/login"), "{}", after.body);
}

/// Where a console's database is given: the file's section, flags, the environment.
type Way<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);

#[tokio::test]
async fn the_console_starts_with_its_database_from_the_file_the_flag_or_database_url() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let hash = hash_password(PASSWORD);
    let in_file = format!("[database]\nurl = \"{}\"\n", db.url);
    let database_url = [("DATABASE_URL", db.url.as_str())];
    let flag = ["--database-url", db.url.as_str()];
    let ways: [Way; 3] = [
        (&in_file, &[], &[]),
        ("", &flag, &[]),
        ("", &[], &database_url),
    ];
    for (database, args, env) in ways {
        let listen = format!("127.0.0.1:{}", free_port());
        let config = config_file(&dir, database, &listen, &hash);
        let mut argv = vec!["console", "--config", &config];
        argv.extend(args);
        if args.is_empty() {
            // `config check` says it would start from the file and the environment, and it does.
            let check = ["config", "check", "--no-connect", "--config", &config];
            let out = console_command(&check, env).output().unwrap();
            let said = String::from_utf8_lossy(&out.stdout);
            assert!(said.contains("console: ready"), "{said}");
        }
        let console = ConsoleProcess::listening(&argv, env, &listen).await;
        logs_in_and_sees_the_overview(&console).await;
    }
}

/// How `replayproof args` ended and what it printed on stderr; a process still running after
/// 30 s is killed by its pid and fails the test.
async fn exited(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = console_command(args, &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
            child.wait().unwrap();
            panic!("{args:?} was still running after 30 s");
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_console_refuses_a_reordered_shard_list_at_start() {
    let (a, b) = (TestDb::new().await, TestDb::new().await);
    let migrate = [
        "migrate",
        "--database-url",
        &a.url,
        "--database-url",
        &b.url,
    ];
    let out = console_command(&migrate, &[]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let reordered = format!("[database]\nshards = [\"{}\", \"{}\"]\n", b.url, a.url);
    let config = config_file(&dir, &reordered, &listen, &hash_password(PASSWORD));
    let (status, said) = exited(&["console", "--config", &config]).await;
    assert!(!status.success(), "the console must not start: {said}");
    assert!(said.contains("refused"), "{said}");
    assert!(said.contains("holds buckets 512-1023"), "{said}");
}

#[tokio::test]
async fn config_check_says_a_console_without_a_database_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let hash = hash_password(PASSWORD);
    let check = |database: &str| {
        let config = config_file(&dir, database, "127.0.0.1:9480", &hash);
        let argv = ["config", "check", "--no-connect", "--config", &config];
        let out = console_command(&argv, &[]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let alone = check("");
    assert!(alone.contains("console: needs --database-url"), "{alone}");
    let shards = "[database]\nshards = [\"postgres://u@a/x\", \"postgres://u@b/y\"]\n";
    let sharded = check(shards);
    assert!(sharded.contains("console: ready"), "{sharded}");
}

/// A `[database]` with `db` and a `[consume]` applying a ledger row and an outbox operation.
fn consume_applying_ledger_and_http(db: &TestDb) -> String {
    format!(
        "[database]\nurl = \"{}\"\n\n[consume]\neffect = \"ledger,http\"\n\
         target_url = \"http://127.0.0.1:9/ops\"\n",
        db.url
    )
}

/// A console from `config` reading `topic` on `brokers`, as a replay by time needs it.
async fn console_reading(config: &str, brokers: &str, topic: &str, listen: &str) -> ConsoleProcess {
    let mut argv = vec![
        "console",
        "--config",
        config,
        "--brokers",
        brokers,
        "--topic",
        topic,
    ];
    let options: Vec<String> = test_kafka_options()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for option in &options {
        argv.extend(["--kafka-option", option]);
    }
    ConsoleProcess::listening(&argv, &[], listen).await
}

#[tokio::test]
async fn the_consoles_replay_by_time_applies_the_effects_of_consume() {
    let kafka = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) if !brokers.is_empty() => TestKafka::External(brokers),
        _ => {
            eprintln!("NOT RUN: replay by time needs a broker that looks offsets up by time");
            return;
        }
    };
    let db = TestDb::new().await;
    let topic = kafka.topic(1).await;
    let since = (chrono::Utc::now() - chrono::Duration::seconds(5)).to_rfc3339();
    let records = [Record::event("evt-missing", serde_json::json!({ "n": 1 }))];
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let database = consume_applying_ledger_and_http(&db);
    let config = config_file(&dir, &database, &listen, &hash_password(PASSWORD));
    let console = console_reading(&config, &kafka.brokers(), &topic, &listen).await;
    let alice = console.client().logged_in("alice", PASSWORD).await;
    let token = alice.csrf("/replay").await;
    let form = [
        ("csrf_token", token.as_str()),
        ("since", since.as_str()),
        ("reason", "the deploy skipped events"),
    ];
    let page = alice.post("/replay", &form).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(
        page.body
            .contains("<td>newly applied</td><td class=\"n\">1</td>"),
        "{}",
        page.body
    );
    // Both of consume's effects: the ledger row and the operation the dispatcher delivers.
    assert_eq!(db.ledger_counts().await.get("evt-missing"), Some(&1));
    let operations = db.count("SELECT count(*) FROM outbox").await;
    assert_eq!(operations, 1, "the replay applied consume's http effect");
}

#[tokio::test]
async fn the_consoles_replay_by_time_reads_the_topic_as_consume_reads_it() {
    use rdkafka::message::{Header, OwnedHeaders};
    let kafka = match std::env::var("KAFKA_BROKERS") {
        Ok(brokers) if !brokers.is_empty() => TestKafka::External(brokers),
        _ => {
            eprintln!("NOT RUN: replay by time needs a broker that looks offsets up by time");
            return;
        }
    };
    let db = TestDb::new().await;
    let topic = kafka.topic(1).await;
    let since = (chrono::Utc::now() - chrono::Duration::seconds(5)).to_rfc3339();
    // A CloudEvent in binary mode, its Kafka key only a partition key.
    let headers = [
        ("ce_specversion", "1.0"),
        ("ce_id", "A-1"),
        ("ce_source", "/shop"),
        ("ce_type", "order.created"),
    ]
    .into_iter()
    .fold(OwnedHeaders::new(), |h, (key, value)| {
        h.insert(Header {
            key,
            value: Some(value),
        })
    });
    let record = rdkafka::producer::FutureRecord::<str, str>::to(&topic)
        .key("tenant-7")
        .payload(r#"{"order":1}"#)
        .headers(headers);
    producer(&kafka.brokers())
        .send(record, std::time::Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let database = format!(
        "[database]\nurl = \"{}\"\n\n[consume]\ninput = \"cloudevents\"\n",
        db.url
    );
    let config = config_file(&dir, &database, &listen, &hash_password(PASSWORD));
    let console = console_reading(&config, &kafka.brokers(), &topic, &listen).await;
    let alice = console.client().logged_in("alice", PASSWORD).await;
    let token = alice.csrf("/replay").await;
    let form = [
        ("csrf_token", token.as_str()),
        ("since", since.as_str()),
        ("reason", "missed while the consumer read envelopes"),
    ];
    let page = alice.post("/replay", &form).await;
    assert_eq!(page.status, 200, "{}", page.body);
    let key = replayproof::inputs::cloudevent_key("/shop", "A-1");
    assert_eq!(
        db.ledger_counts().await.get(&key),
        Some(&1),
        "{}",
        page.body
    );
    assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 0);
}

#[tokio::test]
async fn the_console_refuses_an_effect_chain_other_than_consumes() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let database = consume_applying_ledger_and_http(&db);
    let config = config_file(&dir, &database, &listen, &hash_password(PASSWORD));
    let argv = ["console", "--config", &config, "--effect", "ledger"];
    let (status, said) = exited(&argv).await;
    assert!(!status.success(), "the console must not start: {said}");
    assert!(said.contains("[consume] effect"), "{said}");
}

/// The overview draws what a real consumer did in the last hour (applied, duplicates
/// suppressed, dead letters per minute, lag per partition) as inline SVG, and reloads itself
/// unless paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_draws_the_last_hour_a_consumer_recorded_and_refreshes_unless_paused() {
    let (kafka, db) = (TestKafka::for_processes(), TestDb::new().await);
    let (topic, group) = (kafka.topic(2).await, unique("group"));
    let mut records: Vec<Record> = (0..30)
        .map(|n| Record::event(&format!("evt-chart-{n}"), serde_json::json!({ "n": n })))
        .collect();
    records.extend(
        (0..10).map(|n| Record::event(&format!("evt-chart-{n}"), serde_json::json!({ "n": n }))),
    );
    records.extend((0..2).map(|_| Record {
        key: Some(b"k".to_vec()),
        value: b"not json".to_vec(),
        partition: None,
    }));
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &db.url, None);
    let recorded = "SELECT coalesce(sum(applied), 0)::int8 FROM activity_minutes";
    wait_for(
        "the consumer's activity written",
        Duration::from_secs(60),
        || async { db.count(recorded).await == 30 },
    )
    .await;
    assert!(consumer.terminate(Duration::from_secs(30)).await.success());

    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let database = format!("[database]\nurl = \"{}\"\n", db.url);
    let config = config_file(&dir, &database, &listen, &hash_password(PASSWORD));
    let brokers = kafka.brokers();
    let mut argv = vec!["console", "--config", &config, "--brokers", &brokers];
    argv.extend(["--topic", &topic, "--group", &group]);
    let options: Vec<String> = test_kafka_options()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for option in &options {
        argv.extend(["--kafka-option", option]);
    }
    let console = ConsoleProcess::listening(&argv, &[], &listen).await;
    let alice = console.client().logged_in("alice", PASSWORD).await;
    let page = alice.get("/").await;
    assert_eq!(page.status, 200, "{}", page.body);
    let body = &page.body;
    for caption in [
        "Events applied per minute: 30 in the hour",
        "Duplicates suppressed per minute: 10 in the hour",
        "Dead letters per minute: 2 in the hour",
    ] {
        assert!(body.contains(caption), "{caption}: {body}");
    }
    assert!(body.contains("<svg"), "{body}");
    assert!(body.contains("<polyline"), "a lag line: {body}");
    assert!(
        body.contains(r#"<meta http-equiv="refresh" content="30">"#),
        "{body}"
    );
    assert!(
        !body.contains("<script") && !body.contains("style=\""),
        "{body}"
    );
    let paused = alice.get("/?refresh=off").await;
    assert!(
        !paused.body.contains("http-equiv=\"refresh\""),
        "{}",
        paused.body
    );
    assert!(paused.body.contains("Not refreshing."), "{}", paused.body);
}

/// The overview's "Kafka output" section, as an operator reads it: each output partition's
/// backlog, the records not yet given a partition, a stop in its own words and a partition
/// in doubt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_kafka_output_backlog_a_stop_and_a_doubt() {
    let db = TestDb::new().await;
    sqlx::query(
        "INSERT INTO output_partitions (topic, kafka_partition, partition_count, in_doubt,
                                        stopped)
         VALUES ('orders.clean', 0, 2, true, NULL),
                ('orders.clean', 1, 2, false, 'the partition count changed')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO output_records (route_key, event_key, name, record_id, topic,
                                     kafka_partition)
         VALUES ('a', 'a', 'kafka', 'a#kafka', 'orders.clean', 0),
                ('b', 'b', 'kafka', 'b#kafka', 'orders.clean', 1),
                ('c', 'c', 'kafka', 'c#kafka', 'orders.clean', 1),
                ('d', 'd', 'kafka', 'd#kafka', 'payments.clean', NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let database = format!("[database]\nurl = \"{}\"\n", db.url);
    let config = config_file(&dir, &database, &listen, &hash_password(PASSWORD));
    let console = ConsoleProcess::listening(&["console", "--config", &config], &[], &listen).await;
    let alice = console.client().logged_in("alice", PASSWORD).await;
    let page = alice.get("/").await;
    assert_eq!(page.status, 200, "{}", page.body);
    let section = page
        .body
        .split("<h2>Kafka output</h2>")
        .nth(1)
        .unwrap_or_else(|| panic!("{}", page.body));
    let rows: Vec<&str> = section
        .split("</table>")
        .next()
        .unwrap()
        .split("<tr>")
        .skip(2)
        .collect();
    assert_eq!(rows.len(), 3, "{section}");
    assert!(rows[0].contains("orders.clean") && rows[0].contains("<td>0</td>"));
    assert!(rows[0].contains("in doubt: read back first"), "{}", rows[0]);
    assert!(rows[1].contains("<td>1</td>") && rows[1].contains("<td>2</td>"));
    assert!(
        rows[1].contains("stopped: the partition count changed"),
        "{}",
        rows[1]
    );
    assert!(rows[2].contains("payments.clean") && rows[2].contains("unassigned"));
}

#[tokio::test]
async fn the_console_serves_its_metrics_and_probes_where_metrics_addr_says() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let metrics_port = free_port();
    let in_file = format!("[database]\nurl = \"{}\"\n", db.url);
    let config = config_file(&dir, &in_file, &listen, &hash_password(PASSWORD));
    let metrics = format!("127.0.0.1:{metrics_port}");
    let env = [("REPLAYPROOF_METRICS_ADDR", metrics.as_str())];
    let _console =
        ConsoleProcess::listening(&["console", "--config", &config], &env, &listen).await;
    let (status, page) = http_get(metrics_port, "/metrics").await.expect("/metrics");
    assert_eq!(status, 200);
    assert!(
        page.lines()
            .any(|l| l.starts_with("replayproof_build_info{") && l.contains("role=\"console\"")),
        "{page}"
    );
    assert!(page.contains("process_resident_memory_bytes"), "{page}");
    for probe in ["/livez", "/readyz"] {
        let (status, _) = http_get(metrics_port, probe).await.expect(probe);
        assert_eq!(status, 200, "{probe}");
    }
}

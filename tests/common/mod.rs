//! Test helpers: a fresh database per test, a broker per test, producers, counters, and a fake
//! downstream.
#![allow(dead_code)]

pub mod downstream;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replayproof::consume::{self, BatchProcessor, ConsumerSettings, EffectRetry};
use replayproof::effect::{Effect, Ledger};
use replayproof::embedded::{EmbeddedKafka, EmbeddedPostgres};
use replayproof::envelope::Envelope;
use replayproof::telemetry::ConsumeMetrics;
use sqlx::PgPool;
use std::collections::HashMap;
use std::future::Future;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A name no other test uses, for topics, groups and databases.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{:08x}", std::process::id(), fastrand::u32(..))
}

/// A migrated database of its own for one test.
pub struct TestDb {
    pub pool: PgPool,
    pub url: String,
    /// The cluster behind it when the test started one (no `DATABASE_URL`, or a restart test).
    pub cluster: Option<EmbeddedPostgres>,
}

impl TestDb {
    /// A fresh database on the `DATABASE_URL` server, or on a throwaway cluster without one.
    pub async fn new() -> Self {
        match std::env::var("DATABASE_URL") {
            Ok(admin) => Self::create_on(&admin, None).await,
            Err(_) => Self::on_own_cluster().await,
        }
    }

    /// A fresh database on a cluster this test owns and may stop and start.
    pub async fn on_own_cluster() -> Self {
        let cluster = tokio::task::spawn_blocking(EmbeddedPostgres::start)
            .await
            .unwrap()
            .expect("a throwaway PostgreSQL cluster");
        let admin = cluster.url();
        Self::create_on(&admin, Some(cluster)).await
    }

    async fn create_on(admin: &str, cluster: Option<EmbeddedPostgres>) -> Self {
        let name = unique("rp_test");
        let admin_pool = PgPool::connect(admin).await.expect("connect to PostgreSQL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin_pool)
            .await
            .expect("create the test database");
        admin_pool.close().await;
        let mut url = url::Url::parse(admin).expect("DATABASE_URL is a URL");
        url.set_path(&name);
        let url = url.to_string();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
            .expect("connect to the test database");
        replayproof::db::MIGRATOR.run(&pool).await.expect("migrate");
        Self { pool, url, cluster }
    }

    /// Ledger rows per event key.
    pub async fn ledger_counts(&self) -> HashMap<String, i64> {
        sqlx::query_as("SELECT event_key, count(*) FROM ledger GROUP BY event_key")
            .fetch_all(&self.pool)
            .await
            .expect("count ledger rows")
            .into_iter()
            .collect()
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(&self.pool)
            .await
            .expect(sql)
    }
}

/// A Kafka-protocol broker for one test.
pub enum TestKafka {
    /// librdkafka's mock cluster in this process.
    Mock(EmbeddedKafka),
    /// A separate broker process (`KAFKA_BROKERS`), such as nisshi started by the test script.
    External(String),
}

impl TestKafka {
    pub fn mock() -> Self {
        Self::Mock(EmbeddedKafka::start().expect("mock cluster"))
    }

    /// The broker for tests that run consumers as separate processes: `KAFKA_BROKERS` when set,
    /// otherwise the mock cluster, which listens on localhost for other processes too.
    pub fn for_processes() -> Self {
        match std::env::var("KAFKA_BROKERS") {
            Ok(b) if !b.is_empty() => Self::External(b),
            _ => Self::mock(),
        }
    }

    pub fn brokers(&self) -> String {
        match self {
            Self::Mock(k) => k.bootstrap_servers(),
            Self::External(b) => b.clone(),
        }
    }

    /// Creates a fresh topic and returns its name.
    pub async fn topic(&self, partitions: i32) -> String {
        let topic = unique("webhooks");
        match self {
            Self::Mock(k) => k.create_topic(&topic, partitions).expect("create topic"),
            Self::External(b) => create_external_topic(b, &topic, partitions).await,
        }
        topic
    }
}

async fn create_external_topic(brokers: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<_> = client_config(brokers).create().expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .expect("create topics");
    for r in results {
        r.expect("topic created");
    }
    // Wait until the broker serves metadata for every partition.
    let consumer: BaseConsumer = client_config(brokers).create().unwrap();
    wait_for("topic metadata", Duration::from_secs(20), || {
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(2));
        let ok = md.is_ok_and(|m| {
            m.topics()
                .first()
                .is_some_and(|t| t.partitions().len() == partitions as usize)
        });
        async move { ok }
    })
    .await;
}

pub fn client_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("broker.address.family", "v4")
        .set("log_level", "3");
    c
}

/// The librdkafka options every test consumer uses: quick group membership, IPv4.
pub fn test_kafka_options() -> Vec<(String, String)> {
    [
        ("session.timeout.ms", "6000"),
        ("heartbeat.interval.ms", "500"),
        ("broker.address.family", "v4"),
        ("topic.metadata.refresh.interval.ms", "2000"),
        ("log_level", "3"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

pub fn settings(brokers: &str, topic: &str, group: &str) -> ConsumerSettings {
    ConsumerSettings {
        kafka_options: test_kafka_options(),
        batch_size: 200,
        commit_interval: Duration::from_millis(50),
        shutdown_grace: Duration::from_secs(10),
        max_retry_backoff: Duration::from_millis(500),
        ..ConsumerSettings::new(brokers, topic, group)
    }
}

/// An envelope value for `key`.
pub fn envelope(key: &str, payload: serde_json::Value) -> Vec<u8> {
    Envelope {
        key: key.into(),
        source: "test".into(),
        event_type: Some("test.event".into()),
        received_at: None,
        payload,
        unhashed: Vec::new(),
        replay_window_secs: None,
    }
    .to_bytes()
}

/// Claims `keys` through the consume transaction with the http effect, which enqueues one
/// `deliver` operation each to `downstream` (with its reconcile URL when `reconcile`).
pub async fn enqueue_http(
    db: &TestDb,
    downstream: &downstream::Downstream,
    keys: &[String],
    reconcile: bool,
) {
    let effect = replayproof::effect::HttpOutbox {
        target_url: downstream.url(),
        reconcile_url: reconcile.then(|| downstream.reconcile_url()),
        max_attempts: 8,
    };
    let processor = BatchProcessor {
        pool: db.pool.clone(),
        effect: Arc::new(effect),
        retry: EffectRetry::default(),
    };
    let messages: Vec<consume::RawMessage> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| consume::RawMessage {
            offset: i as i64,
            key: Some(k.as_bytes().to_vec()),
            value: Some(envelope(k, serde_json::json!({"n": i}))),
        })
        .collect();
    for chunk in messages.chunks(100) {
        processor.process("t", 0, chunk).await.unwrap();
    }
}

/// One record to produce: key, value, and a partition when the test chooses it.
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub partition: Option<i32>,
}

impl Record {
    pub fn event(key: &str, payload: serde_json::Value) -> Self {
        Self {
            key: Some(key.as_bytes().to_vec()),
            value: envelope(key, payload),
            partition: None,
        }
    }

    pub fn on(mut self, partition: i32) -> Self {
        self.partition = Some(partition);
        self
    }
}

pub fn producer(brokers: &str) -> FutureProducer {
    client_config(brokers)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

/// Produces records in order and waits for every acknowledgement.
pub async fn produce(producer: &FutureProducer, topic: &str, records: &[Record]) {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};
    let mut pending = Vec::with_capacity(records.len());
    for r in records {
        let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(&r.value);
        if let Some(k) = &r.key {
            record = record.key(k);
        }
        if let Some(p) = r.partition {
            record = record.partition(p);
        }
        // `send_result` enqueues now; awaiting `send` one by one would produce one at a time.
        loop {
            match producer.send_result(record) {
                Ok(delivery) => break pending.push(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => panic!("produce failed: {e}"),
            }
        }
    }
    for p in pending {
        p.await
            .expect("delivery reported")
            .map_err(|(e, _)| e)
            .expect("record acknowledged");
    }
}

/// A consumer running in this process, stopped like a SIGTERM would stop it.
pub struct InProcessConsumer {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub registry: prometheus::Registry,
}

impl InProcessConsumer {
    pub fn start(settings: ConsumerSettings, pool: PgPool) -> Self {
        Self::with_effect(settings, pool, Arc::new(Ledger))
    }

    pub fn with_effect(settings: ConsumerSettings, pool: PgPool, effect: Arc<dyn Effect>) -> Self {
        let registry = prometheus::Registry::new();
        let metrics = ConsumeMetrics::new(&registry).unwrap();
        let processor = BatchProcessor {
            pool,
            effect,
            retry: EffectRetry {
                attempts: 3,
                backoff: Duration::from_millis(10),
            },
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(consume::run(settings, processor, metrics, shutdown.clone()));
        Self {
            shutdown,
            task,
            registry,
        }
    }

    pub fn metric(&self, name: &str) -> f64 {
        metric_value(&self.registry, name)
    }

    /// Waits for the consumer to stop by itself, and returns how it ended.
    pub async fn ended(self, timeout: Duration) -> anyhow::Result<()> {
        tokio::time::timeout(timeout, self.task)
            .await
            .expect("the consumer stops by itself")
            .expect("consumer task")
    }

    /// Stops it like a SIGTERM would, and returns how it ended.
    pub async fn stop_result(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.task.await.expect("consumer task")
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task
            .await
            .expect("consumer task")
            .expect("consumer result");
    }
}

/// The sum of a metric's samples across labels (counters, gauges, histogram counts).
pub fn metric_value(registry: &prometheus::Registry, name: &str) -> f64 {
    use prometheus::proto::MetricType;
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter().map(move |m| (f.get_field_type(), m)))
        .map(|(kind, m)| match kind {
            MetricType::COUNTER => m.get_counter().get_value(),
            MetricType::GAUGE => m.get_gauge().get_value(),
            _ => m.get_histogram().get_sample_count() as f64,
        })
        .sum()
}

/// Polls `check` until it is true, failing the test after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The group's committed offsets for partitions `0..partitions`; -1 where none is committed.
pub fn committed_offsets(brokers: &str, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let consumer: BaseConsumer = client_config(brokers)
        .set("group.id", group)
        .create()
        .expect("offset reader");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .map(
            |p| match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            },
        )
        .collect()
}

/// [`committed_offsets`] off the async runtime's threads.
pub async fn committed(kafka: &TestKafka, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
    let (b, g, t) = (kafka.brokers(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || committed_offsets(&b, &g, &t, partitions))
        .await
        .unwrap()
}

/// Waits until the group's committed offsets add up to `total`.
pub async fn wait_committed_total(
    kafka: &TestKafka,
    group: &str,
    topic: &str,
    partitions: i32,
    total: i64,
) {
    wait_for("offsets committed", Duration::from_secs(120), || async {
        committed(kafka, group, topic, partitions)
            .await
            .iter()
            .sum::<i64>()
            == total
    })
    .await;
}

/// Waits until every row of `expected` keys is in the ledger, then checks one row per key and
/// no other keys.
pub async fn assert_exactly_once(
    db: &TestDb,
    expected: &std::collections::HashSet<String>,
    timeout: Duration,
) {
    wait_for("every event applied", timeout, || async {
        db.count("SELECT count(DISTINCT event_key) FROM ledger")
            .await as usize
            >= expected.len()
    })
    .await;
    let counts = db.ledger_counts().await;
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "keys with more than one effect: {doubled:?}"
    );
    let keys: std::collections::HashSet<String> = counts.into_keys().collect();
    assert_eq!(
        &keys, expected,
        "the ledger's keys are not the events' keys"
    );
}

/// A `replayproof consume` process.
pub struct ConsumerProcess {
    pub child: tokio::process::Child,
}

impl ConsumerProcess {
    pub fn spawn(
        brokers: &str,
        topic: &str,
        group: &str,
        database_url: &str,
        failpoints: Option<&str>,
    ) -> Self {
        Self::spawn_with(brokers, topic, group, database_url, failpoints, &[])
    }

    /// Like [`ConsumerProcess::spawn`], with more arguments for `consume`.
    pub fn spawn_with(
        brokers: &str,
        topic: &str,
        group: &str,
        database_url: &str,
        failpoints: Option<&str>,
        extra: &[&str],
    ) -> Self {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
        cmd.arg("consume")
            .args(["--brokers", brokers, "--topic", topic, "--group", group])
            .args(["--database-url", database_url])
            .args(["--batch-size", "200"])
            .args([
                "--commit-interval-ms",
                "50",
                "--max-retry-backoff-ms",
                "500",
            ])
            .args(extra)
            .env("RUST_LOG", "warn,replayproof=info")
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in test_kafka_options() {
            cmd.arg("--kafka-option").arg(format!("{k}={v}"));
        }
        if !extra.contains(&"--metrics-addr") {
            cmd.args(["--metrics-addr", "127.0.0.1:0"]);
        }
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        Self {
            child: cmd.spawn().expect("spawn replayproof consume"),
        }
    }

    pub fn pid(&self) -> nix::unistd::Pid {
        nix::unistd::Pid::from_raw(self.child.id().expect("running") as i32)
    }

    /// kill -9, then reap it.
    pub async fn kill9(mut self) {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGKILL).expect("kill -9");
        self.child.wait().await.expect("reap");
    }

    /// Waits for the process to exit by itself.
    pub async fn exited(mut self, timeout: Duration) -> std::process::ExitStatus {
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .expect("exits by itself in time")
            .expect("exit status")
    }

    /// Sends a signal, such as SIGSTOP or SIGCONT.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(self.pid(), signal).expect("signal");
    }

    /// SIGTERM, then wait for the exit status.
    pub async fn terminate(mut self, timeout: Duration) -> std::process::ExitStatus {
        nix::sys::signal::kill(self.pid(), nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        tokio::time::timeout(timeout, self.child.wait())
            .await
            .expect("exits within the grace period")
            .expect("exit status")
    }
}

/// Waits for `consumer` to stop at a failpoint with its transaction open, kills it with
/// SIGKILL, and waits until PostgreSQL has ended (rolled back) that transaction.
pub async fn kill_inside_transaction(consumer: ConsumerProcess, db: &TestDb) {
    wait_for_open_transaction(db).await;
    consumer.kill9().await;
    wait_for(
        "the killed consumer's transaction to end",
        Duration::from_secs(60),
        || async { idle_in_transaction(db).await == 0 },
    )
    .await;
}

/// Sessions of this test's database sitting idle inside a transaction, whoever opened them.
pub async fn idle_in_transaction(db: &TestDb) -> i64 {
    db.count(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND state = 'idle in transaction'",
    )
    .await
}

/// A free TCP port on 127.0.0.1, for a process's metrics server.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET `http://127.0.0.1:{port}{path}`: the status and body, or None when nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let r = reqwest::get(format!("http://127.0.0.1:{port}{path}"))
        .await
        .ok()?;
    Some((r.status().as_u16(), r.text().await.ok()?))
}

/// The value of an unlabelled (or summed) metric in a Prometheus text page.
pub fn scraped(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Open transactions of `replayproof` sessions in this database.
pub async fn open_transactions(db: &TestDb) -> i64 {
    db.count(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'replayproof' AND state = 'idle in transaction'",
    )
    .await
}

/// Waits until a `replayproof` connection of this database sits idle inside a transaction: the
/// consumer stopped at a failpoint with its claim uncommitted.
pub async fn wait_for_open_transaction(db: &TestDb) {
    wait_for(
        "a consumer holding an open transaction",
        Duration::from_secs(60),
        || async {
            db.count(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'replayproof' AND state = 'idle in transaction'",
            )
            .await
                > 0
        },
    )
    .await;
}

//! Claims and effects over several databases, as Citus would spread them: four databases of
//! one throwaway cluster are four shards. Routing matches PostgreSQL's `hashtext`, every claim
//! and effect lands once and only on its bucket's database, a crash between shards' commits
//! replays harmlessly, lanes racing across shards never deadlock, adding partitions moves no
//! key between databases, the schema keeps Citus's rules, and a claim held by a prepared
//! (two-phase) transaction blocks its competitor as a Citus coordinator's would.

use crate::harness::*;
use rdkafka::producer::FutureRecord;
use replayproof::consume::{BatchProcessor, EffectRetry, RawMessage};
use replayproof::effect::{Effect, EffectError, Ledger, Tx};
use replayproof::envelope::Event;
use replayproof::shard::{hashtext, range_index, Layout, Shards};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Four migrated databases, the shards of one layout in order.
struct ShardedDb {
    dbs: Vec<TestDb>,
    layout: Layout,
}

impl ShardedDb {
    async fn new(n: usize) -> Self {
        let mut dbs = Vec::with_capacity(n);
        for _ in 0..n {
            dbs.push(TestDb::new().await);
        }
        Self {
            dbs,
            layout: Layout::new(replayproof::shard::DEFAULT_BUCKETS, n).unwrap(),
        }
    }

    fn shards(&self) -> Shards {
        Shards::new(
            self.layout,
            self.dbs.iter().map(|d| d.pool.clone()).collect(),
        )
        .unwrap()
    }

    fn processor(&self, effect: Arc<dyn Effect>) -> BatchProcessor {
        BatchProcessor::new(self.shards(), effect).with_retry(EffectRetry {
            attempts: 3,
            backoff: Duration::from_millis(10),
        })
    }

    /// (event key, route key) of every row of `table` on shard `i`.
    async fn rows(&self, i: usize, table: &str) -> Vec<(String, String)> {
        sqlx::query_as(&format!("SELECT event_key, route_key FROM {table}"))
            .fetch_all(&self.dbs[i].pool)
            .await
            .unwrap()
    }

    /// Ledger rows per event key over every shard, after checking that each row and its claim
    /// are on the shard of their route key.
    async fn effects_in_place(&self) -> HashMap<String, i64> {
        let mut counts = HashMap::new();
        for i in 0..self.dbs.len() {
            for table in ["ledger", "processed_events"] {
                for (key, route) in self.rows(i, table).await {
                    assert_eq!(
                        self.layout.shard(&route),
                        i,
                        "{table} row of {key} (route {route}) is on shard {i}"
                    );
                    if table == "ledger" {
                        *counts.entry(key).or_insert(0) += 1;
                    }
                }
            }
        }
        counts
    }

    async fn claims(&self) -> usize {
        let mut n = 0;
        for i in 0..self.dbs.len() {
            n += self.rows(i, "processed_events").await.len();
        }
        n
    }
}

fn message(offset: i64, key: &str, route: Option<&str>) -> RawMessage {
    RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(routed_envelope(
            key,
            route,
            serde_json::json!({ "n": offset }),
        )),
        traceparent: None,
        headers: Default::default(),
    }
}

/// Ten thousand keys: event ids of every shape, lengths 0 to 600, non-ASCII ones included.
fn parity_keys() -> Vec<String> {
    let alphabet: Vec<char> = "abcXYZ019_:-./ éüßøçñ中文字日本語한국어🙂🚀\u{7f}\u{a0}ẞ"
        .chars()
        .collect();
    let mut rng = fastrand::Rng::with_seed(28);
    let mut keys = vec![
        String::new(),
        "a".into(),
        "stripe:evt_1NqXyZ2eZvKYlo2C".into(),
    ];
    while keys.len() < 10_000 {
        let len = match rng.u8(..) {
            0..=200 => rng.usize(1..40),
            _ => rng.usize(40..600),
        };
        keys.push(
            (0..len)
                .map(|_| alphabet[rng.usize(..alphabet.len())])
                .collect(),
        );
    }
    keys
}

#[tokio::test]
async fn buckets_hash_keys_exactly_as_postgresql_hashtext_does() {
    let db = TestDb::new().await;
    let keys = parity_keys();
    assert!(
        keys.iter().any(|k| !k.is_ascii()),
        "non-ASCII keys included"
    );
    let hashes: Vec<i32> = sqlx::query_scalar(
        "SELECT hashtext(k) FROM unnest($1::text[]) WITH ORDINALITY AS u(k, i) ORDER BY i",
    )
    .bind(&keys)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let layout = Layout::new(1024, 32).unwrap();
    for (key, pg) in keys.iter().zip(&hashes) {
        assert_eq!(hashtext(key.as_bytes()), *pg, "hashtext({key:?})");
        // The shard Citus picks with 32 shards, computed by PostgreSQL from its own hash.
        let citus = ((*pg as i64 + (1 << 31)) * 32) >> 32;
        assert_eq!(layout.shard(key) as i64, citus, "shard of {key:?}");
        assert_eq!(range_index(*pg, 32) as i64, citus);
    }
    // Golden shard indexes with 32 shards: these keys live there for the life of the data.
    for (key, shard) in [
        ("stripe:evt_1NqXyZ2eZvKYlo2C", 7),
        ("github:6a0c3f84-1e3b-11ef-9b0e-3d2f8a1b9c10", 4),
        ("acct_1032D82eZvKYlo2C", 12),
        ("shop-ünïcødé.myshopify.com", 24),
        ("tenant-7", 12),
        ("", 4),
    ] {
        assert_eq!(layout.shard(key), shard, "golden shard of {key:?}");
    }
}

/// Held claims and ledger rows over `dbs`: events claimed and deferred by the pause `ann` made,
/// and effects.
async fn held_and_applied(dbs: &[TestDb]) -> (i64, i64) {
    let (mut held, mut applied) = (0, 0);
    for db in dbs {
        held += db
            .count(
                "SELECT count(*) FROM processed_events WHERE status = 'deferred' \
                 AND deferred_reason LIKE 'its source is paused (by ann: their incident)%'",
            )
            .await;
        applied += db.count("SELECT count(*) FROM ledger").await;
    }
    (held, applied)
}

/// A source paused between two batches holds every event of the second: on one database the
/// batch reads the pause in its own transaction, over two shards on the first database, whose
/// pause the other shards' transactions follow. Resumed, the next batch applies again.
#[tokio::test]
async fn a_source_paused_between_two_batches_holds_the_second_on_one_database_and_over_shards() {
    use replayproof::audit::Act;
    use replayproof::sources::pauses;
    let batch = |from: i64| -> Vec<RawMessage> {
        (from..from + 30)
            .map(|i| message(i, &format!("evt-{i}"), None))
            .collect()
    };
    let one = TestDb::new().await;
    let sharded = ShardedDb::new(2).await;
    let runs = [
        (
            BatchProcessor::new(one.pool.clone(), Arc::new(Ledger)),
            std::slice::from_ref(&one),
        ),
        (sharded.processor(Arc::new(Ledger)), &sharded.dbs[..]),
    ];
    for (p, dbs) in runs {
        let (first, n) = (&dbs[0].pool, dbs.len());
        assert_eq!(p.process("t", 0, &batch(0)).await.unwrap().applied, 30);
        let act = Act::new("ann", "their incident");
        pauses::pause(first, "test", &act).await.unwrap();
        let report = p.process("t", 0, &batch(30)).await.unwrap();
        assert_eq!((report.applied, report.deferred), (0, 30), "{n} databases");
        assert_eq!(held_and_applied(dbs).await, (30, 30), "{n} databases");
        pauses::resume(first, "test", &act).await.unwrap().unwrap();
        let report = p.process("t", 0, &batch(60)).await.unwrap();
        assert_eq!((report.applied, report.deferred), (30, 0), "{n} databases");
        assert_eq!(held_and_applied(dbs).await, (30, 60), "{n} databases");
    }
}

#[tokio::test]
async fn a_storm_over_four_shards_applies_each_event_once_on_its_buckets_database() {
    let sharded = ShardedDb::new(4).await;
    let kafka = TestKafka::mock();
    let topic = kafka.topic(4).await;
    let producer = producer(&kafka.brokers());
    // 600 events, a third routed by tenant; each delivered twice, a tenth also on another
    // partition at once (a provider's retry racing the first delivery), and poison messages.
    let mut expected = HashSet::new();
    let mut records = Vec::new();
    for n in 0..600 {
        let key = format!("evt-{n}");
        let tenant = format!("tenant-{}", n % 7);
        let route = (n % 3 == 0).then_some(tenant.as_str());
        let value = routed_envelope(&key, route, serde_json::json!({ "n": n }));
        for copy in 0..2 {
            records.push(Record {
                key: Some(key.clone().into_bytes()),
                value: value.clone(),
                partition: None,
            });
            if n % 10 == 0 && copy == 0 {
                records.push(Record {
                    key: Some(key.clone().into_bytes()),
                    value: value.clone(),
                    partition: Some((n / 10) % 4),
                });
            }
        }
        expected.insert(key);
    }
    for n in 0..5 {
        records.push(Record {
            key: None,
            value: format!("not an envelope {n}").into_bytes(),
            partition: Some(n % 4),
        });
    }
    // Poison with keys of other shards: dead letters too, and all on the first shard.
    let keyed_poison: Vec<String> = (0..)
        .map(|n| format!("bad-{n}"))
        .filter(|k| sharded.layout.shard(k) != 0)
        .take(5)
        .collect();
    for key in &keyed_poison {
        records.push(Record {
            key: Some(key.clone().into_bytes()),
            value: b"{\"key\": 42}".to_vec(),
            partition: None,
        });
    }
    fastrand::shuffle(&mut records);
    produce(&producer, &topic, &records).await;

    let group = unique("g");
    let processor = sharded.processor(Arc::new(Ledger));
    let a = InProcessConsumer::with_processor(
        settings(&kafka.brokers(), &topic, &group),
        processor.clone(),
    );
    let b =
        InProcessConsumer::with_processor(settings(&kafka.brokers(), &topic, &group), processor);
    wait_for("every event applied", Duration::from_secs(120), || async {
        sharded.claims().await >= expected.len()
    })
    .await;
    wait_committed_total(&kafka, &group, &topic, 4, records.len() as i64).await;
    a.stop().await;
    b.stop().await;

    let counts = sharded.effects_in_place().await;
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "keys with more than one effect: {doubled:?}"
    );
    assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), expected);
    // A tenant's events share one shard; the shards are all used.
    for t in 0..7 {
        let tenant = format!("tenant-{t}");
        let shard = sharded.layout.shard(&tenant);
        let routes = sharded.rows(shard, "processed_events").await;
        assert_eq!(
            routes.iter().filter(|(_, r)| *r == tenant).count(),
            (0..600).filter(|n| n % 3 == 0 && n % 7 == t).count(),
            "every event of {tenant} on shard {shard}"
        );
    }
    for i in 0..4 {
        assert!(
            !sharded.rows(i, "ledger").await.is_empty(),
            "shard {i} used"
        );
    }
    // The poison messages are dead letters, all on the first shard.
    assert_eq!(
        sharded.dbs[0]
            .count("SELECT count(*) FROM dead_letters")
            .await,
        10
    );
    for db in &sharded.dbs[1..] {
        assert_eq!(db.count("SELECT count(*) FROM dead_letters").await, 0);
    }
}

#[tokio::test]
async fn a_kill_between_shards_commits_replays_with_no_effect_twice_and_none_missing() {
    let _heavy = heavy().await;
    let sharded = ShardedDb::new(4).await;
    let kafka = TestKafka::for_processes();
    let topic = kafka.topic(2).await;
    let keys: Vec<String> = (0..400).map(|n| format!("evt-{n}")).collect();
    let records: Vec<Record> = keys
        .iter()
        .map(|k| Record::event(k, serde_json::json!({ "k": k })))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    // The last shard's effect hangs inside its transaction: the other shards' parts commit,
    // the batch's offset does not, and the process is killed there.
    let stalled = &sharded.dbs[3];
    sqlx::raw_sql(
        "CREATE FUNCTION public.stall() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(600); RETURN NULL; END $$;
         CREATE TRIGGER stall BEFORE INSERT ON replayproof.ledger
             FOR EACH STATEMENT EXECUTE FUNCTION public.stall();",
    )
    .execute(&stalled.pool)
    .await
    .unwrap();
    let urls: Vec<&str> = sharded.dbs.iter().map(|d| d.url.as_str()).collect();
    let mut extra = Vec::new();
    for url in &urls[1..] {
        extra.extend(["--database-url", url]);
    }
    let group = unique("g");
    let brokers = kafka.brokers();
    let first = ConsumerProcess::spawn_with(&brokers, &topic, &group, urls[0], None, &extra);
    let sleeping = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                    AND wait_event = 'PgSleep'";
    wait_for(
        "the last shard's part to hang",
        Duration::from_secs(60),
        || async { stalled.count(sleeping).await > 0 },
    )
    .await;
    wait_for(
        "the other shards' parts to commit",
        Duration::from_secs(60),
        || async {
            let mut committed = true;
            for db in &sharded.dbs[..3] {
                committed &= db.count("SELECT count(*) FROM ledger").await > 0;
            }
            committed
        },
    )
    .await;
    first.kill9().await;
    let before: Vec<i64> = {
        let mut n = Vec::new();
        for db in &sharded.dbs[..3] {
            n.push(db.count("SELECT count(*) FROM ledger").await);
        }
        n
    };
    assert_eq!(
        committed(&kafka, &group, &topic, 2).await,
        vec![-1, -1],
        "no offset committed while a shard's part had not"
    );
    assert_eq!(
        stalled.count("SELECT count(*) FROM processed_events").await,
        0
    );
    // The hung session goes (as PostgreSQL's timeouts would end it), and the stall with it.
    sqlx::raw_sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event = 'PgSleep';",
    )
    .execute(&stalled.pool)
    .await
    .unwrap();
    wait_for(
        "the hung session to end",
        Duration::from_secs(30),
        || async { stalled.count(sleeping).await == 0 },
    )
    .await;
    sqlx::raw_sql("DROP TRIGGER stall ON replayproof.ledger")
        .execute(&stalled.pool)
        .await
        .unwrap();

    let second = ConsumerProcess::spawn_with(&brokers, &topic, &group, urls[0], None, &extra);
    wait_committed_total(&kafka, &group, &topic, 2, keys.len() as i64).await;
    second.terminate(Duration::from_secs(30)).await;
    let counts = sharded.effects_in_place().await;
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "keys with more than one effect: {doubled:?}"
    );
    assert_eq!(
        counts.keys().cloned().collect::<HashSet<_>>(),
        keys.iter().cloned().collect::<HashSet<_>>(),
        "every event applied"
    );
    for (i, n) in before.iter().enumerate() {
        assert!(*n > 0);
        assert!(
            sharded.dbs[i].count("SELECT count(*) FROM ledger").await >= *n,
            "shard {i} kept what it committed before the kill"
        );
    }
}

/// The ledger effect, holding its transaction a little so that lanes overlap.
struct SlowLedger;

#[replayproof::async_trait]
impl Effect for SlowLedger {
    fn name(&self) -> &'static str {
        "slow-ledger"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        Ledger.apply_batch(tx, events).await?;
        sqlx::query("SELECT pg_sleep(0.02)")
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn two_lanes_racing_on_the_same_keys_across_shards_never_deadlock() {
    let sharded = ShardedDb::new(4).await;
    let processor = sharded.processor(Arc::new(SlowLedger));
    let mut keys = HashSet::new();
    for round in 0..15 {
        // The same 40 keys (some routed by tenant) in opposite orders on two partitions.
        let batch: Vec<RawMessage> = (0..40)
            .map(|n| {
                let key = format!("r{round}-evt-{n}");
                keys.insert(key.clone());
                let route = (n % 4 == 0).then(|| format!("tenant-{}", n % 3));
                message(n, &key, route.as_deref())
            })
            .collect();
        let reversed: Vec<RawMessage> = batch.iter().rev().cloned().collect();
        let (a, b) = tokio::time::timeout(
            Duration::from_secs(60),
            futures_util::future::join(
                processor.process("t", 0, &batch),
                processor.process("t", 1, &reversed),
            ),
        )
        .await
        .expect("both lanes finish");
        let (a, b) = (a.expect("lane 0 commits"), b.expect("lane 1 commits"));
        assert_eq!(a.applied + b.applied, 40, "round {round}");
        assert_eq!(a.duplicates + b.duplicates, 40, "round {round}");
    }
    let counts = sharded.effects_in_place().await;
    assert!(counts.values().all(|n| *n == 1), "one effect per key");
    assert_eq!(counts.keys().cloned().collect::<HashSet<_>>(), keys);
}

/// Produces each record with the default partitioner; returns the partition each went to.
async fn produce_placed(brokers: &str, topic: &str, records: &[(String, Vec<u8>)]) -> Vec<i32> {
    let producer = producer(brokers);
    let mut placed = Vec::new();
    for (key, value) in records {
        let record = FutureRecord::<[u8], [u8]>::to(topic)
            .key(key.as_bytes())
            .payload(value);
        let delivery = producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("acknowledged");
        placed.push(delivery.partition);
    }
    placed
}

/// Adding partitions changes where the default partitioner puts a key (`crc32(key) % count`).
/// Neither test broker can add partitions to a topic (CreatePartitions), so the topic after the
/// change is a second topic of 8 partitions: each key lands there exactly where it would after
/// `kafka-topics --alter --partitions 8`.
#[tokio::test]
async fn adding_partitions_moves_no_key_between_databases_where_partition_routing_would_double() {
    let sharded = ShardedDb::new(4).await;
    let kafka = TestKafka::mock();
    let brokers = kafka.brokers();
    let (topic, expanded) = (kafka.topic(4).await, kafka.topic(8).await);
    let events: Vec<(String, Vec<u8>)> = (0..300)
        .map(|n| {
            let key = format!("evt-{n}");
            let value = routed_envelope(&key, None, serde_json::json!({ "n": n }));
            (key, value)
        })
        .collect();
    let before = produce_placed(&brokers, &topic, &events).await;
    let after = produce_placed(&brokers, &expanded, &events).await;
    // Routing by partition gives each database a contiguous range of the partitions, as a
    // consumer owning its partitions' claims would: partition p of P in database p * 4 / P.
    let by_partition = |partition: i32, count: i32| (partition * 4 / count) as usize;
    let moved = before
        .iter()
        .zip(&after)
        .filter(|(old, new)| by_partition(**old, 4) != by_partition(**new, 8))
        .count();
    assert!(
        moved > 0,
        "some keys now land in another database by partition"
    );
    for (topic, partitions) in [(&topic, 4), (&expanded, 8)] {
        let group = unique("g");
        let consumer = InProcessConsumer::with_processor(
            settings(&brokers, topic, &group),
            sharded.processor(Arc::new(Ledger)),
        );
        wait_committed_total(&kafka, &group, topic, partitions, events.len() as i64).await;
        consumer.stop().await;
    }
    let counts = sharded.effects_in_place().await;
    assert_eq!(counts.len(), events.len());
    assert!(
        counts.values().all(|n| *n == 1),
        "routing by key: one effect per key"
    );

    // The negative control: the same deliveries routed by partition, each applied by the
    // database its partition names.
    let control = ShardedDb::new(4).await;
    for (round, (placement, count)) in [(&before, 4), (&after, 8)].into_iter().enumerate() {
        for ((key, value), partition) in events.iter().zip(placement) {
            let m = RawMessage {
                offset: round as i64,
                key: Some(key.clone().into_bytes()),
                value: Some(value.clone()),
                traceparent: None,
                headers: Default::default(),
            };
            let pool = control.dbs[by_partition(*partition, count)].pool.clone();
            BatchProcessor::new(pool, Arc::new(Ledger))
                .process("webhooks", *partition, &[m])
                .await
                .unwrap();
        }
    }
    let mut applied = 0;
    for db in &control.dbs {
        applied += db.count("SELECT count(*) FROM ledger").await;
    }
    assert_eq!(
        applied as usize,
        events.len() + moved,
        "routing by partition applies every moved key twice"
    );
}

#[tokio::test]
async fn the_schema_keeps_route_key_in_every_unique_key_and_compares_keys_bytewise() {
    let db = TestDb::new().await;
    let findings = replayproof::shard::lint::check(&db.pool, &[])
        .await
        .unwrap();
    assert!(findings.is_empty(), "{findings:?}");
    // Unique indexes of the reference tables are the only ones without route_key.
    let unique_without: Vec<String> = sqlx::query_scalar(
        r#"SELECT c.relname::text FROM pg_index x
           JOIN pg_class c ON c.oid = x.indrelid
           JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE n.nspname = 'replayproof' AND x.indisunique AND c.relname <> '_sqlx_migrations'
             AND NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid
                             AND a.attname = 'route_key' AND a.attnum = ANY (x.indkey))
           ORDER BY 1"#,
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    // And the tables each database keeps of itself (which buckets it holds).
    let mut reference: Vec<&str> = replayproof::shard::citus::REFERENCE.to_vec();
    reference.extend(replayproof::shard::citus::LOCAL);
    reference.sort();
    assert_eq!(unique_without, reference);

    // The check finds what breaks the rules, on replayproof's tables and an application's.
    sqlx::raw_sql(
        "CREATE UNIQUE INDEX outbox_operation_alone ON replayproof.outbox (operation_key);
         CREATE TABLE public.subscriptions (id TEXT PRIMARY KEY, route_key TEXT NOT NULL,
             event_key TEXT COLLATE \"C\");
         CREATE TABLE public.invoices (id TEXT PRIMARY KEY);",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let tables = [
        "public.subscriptions".to_owned(),
        "public.invoices".to_owned(),
    ];
    let findings = replayproof::shard::lint::check(&db.pool, &tables)
        .await
        .unwrap();
    let said: Vec<String> = findings.iter().map(|f| f.to_string()).collect();
    let has = |table: &str, words: &str| {
        said.iter()
            .any(|f| f.starts_with(table) && f.contains(words))
    };
    assert!(
        has("replayproof.outbox", "outbox_operation_alone"),
        "{said:?}"
    );
    assert!(
        has("public.subscriptions", "subscriptions_pkey"),
        "{said:?}"
    );
    assert!(
        has("public.subscriptions", "route_key compares by collation"),
        "{said:?}"
    );
    assert!(has("public.invoices", "no route_key column"), "{said:?}");
    assert_eq!(said.len(), 4, "{said:?}");
}

#[tokio::test]
async fn migrate_runs_on_every_shard_and_refuses_citus_where_it_is_not_installed() {
    let a = TestDb::unmigrated().await;
    let b = TestDb::unmigrated().await;
    let replayproof = env!("CARGO_BIN_EXE_replayproof");
    let out = std::process::Command::new(replayproof)
        .args([
            "migrate",
            "--database-url",
            &a.url,
            "--database-url",
            &b.url,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for db in [&a, &b] {
        let applied = db
            .count("SELECT count(*) FROM replayproof._sqlx_migrations WHERE success")
            .await;
        assert_eq!(applied as usize, replayproof::db::MIGRATOR.iter().count());
    }
    // A database of its own: `a` now records that it holds half the buckets, which a Citus
    // coordinator (holding them all) would be refused for first.
    let coordinator = TestDb::unmigrated().await;
    let out = std::process::Command::new(replayproof)
        .args(["migrate", "--citus", "--database-url", &coordinator.url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("citus extension is not installed"),
        "{stderr}"
    );
    // Shards that do not split the buckets evenly are refused before anything runs.
    let c = TestDb::unmigrated().await;
    let out = std::process::Command::new(replayproof)
        .args([
            "migrate",
            "--database-url",
            &a.url,
            "--database-url",
            &b.url,
        ])
        .args(["--database-url", &c.url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("do not split 1024 buckets evenly"),
        "{stderr}"
    );
    assert_eq!(
        c.count("SELECT count(*) FROM pg_namespace WHERE nspname = 'replayproof'")
            .await,
        0
    );
}

#[tokio::test]
async fn a_claim_in_a_prepared_transaction_blocks_its_competitor_until_resolved() {
    let db = TestDb::new().await;
    let prepared: i64 = db
        .count("SELECT current_setting('max_prepared_transactions')::int8")
        .await;
    assert!(
        prepared > 0,
        "the test cluster needs max_prepared_transactions > 0 (scripts/test.sh sets 16)"
    );
    let processor = BatchProcessor::new(db.pool.clone(), Arc::new(Ledger));
    for (n, resolution) in ["COMMIT PREPARED", "ROLLBACK PREPARED"]
        .into_iter()
        .enumerate()
    {
        let key = format!("evt-in-doubt-{n}");
        let gid = unique("citus_gid");
        let competitor = message(1, &key, None);
        let event = Event::parse(competitor.key.as_deref(), competitor.value.as_deref()).unwrap();
        let hash = hex::encode(event.payload_sha256);
        // What a Citus coordinator leaves on a worker between PREPARE and its decision: the
        // claim and its effect, written, locked and in doubt.
        let mut coordinator = db.pool.pool().acquire().await.unwrap();
        sqlx::raw_sql(&format!(
            "BEGIN;
             INSERT INTO processed_events (event_key, route_key, source, status, payload_sha256,
                 kafka_topic, kafka_partition, kafka_offset)
             VALUES ('{key}', '{key}', 'test', 'done', decode('{hash}', 'hex'), 'coordinator', 0, 0);
             INSERT INTO ledger (event_key, route_key, source, payload)
             VALUES ('{key}', '{key}', 'test', '{{}}');
             PREPARE TRANSACTION '{gid}';"
        ))
        .execute(&mut *coordinator)
        .await
        .unwrap();
        let competing = {
            let processor = processor.clone();
            tokio::spawn(async move { processor.process("t", 0, &[competitor]).await })
        };
        wait_for(
            "the competing claim to wait on the prepared one",
            Duration::from_secs(30),
            || async {
                db.count(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND wait_event_type = 'Lock'",
                )
                .await
                    > 0
            },
        )
        .await;
        assert!(
            !competing.is_finished(),
            "blocked while the claim is in doubt"
        );
        sqlx::raw_sql(&format!("{resolution} '{gid}'"))
            .execute(&mut *coordinator)
            .await
            .unwrap();
        let report = competing.await.unwrap().expect("the batch commits");
        match resolution {
            "COMMIT PREPARED" => assert_eq!(report.duplicates, 1, "found claimed"),
            _ => assert_eq!(report.applied, 1, "claimed once the other rolled back"),
        }
        let effects = db
            .count(&format!(
                "SELECT count(*) FROM ledger WHERE event_key = '{key}'"
            ))
            .await;
        assert_eq!(effects, 1, "{resolution}: one effect");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dispatch_process_delivers_every_shards_outbox_within_one_concurrency_limit() {
    use crate::harness::recorder::{Answer, Recorder};
    let _heavy = heavy().await;
    let sharded = ShardedDb::new(2).await;
    let api = Recorder::start(Answer::SlowOk(Duration::from_millis(100))).await;
    let effect = replayproof::effect::HttpOutbox {
        target_url: api.url("/ops"),
        reconcile_url: None,
        max_attempts: 8,
        operation_keys: Default::default(),
    };
    let batch: Vec<RawMessage> = (0..40)
        .map(|n| message(n, &format!("evt-{n}"), None))
        .collect();
    let report = sharded
        .processor(Arc::new(effect))
        .process("t", 0, &batch)
        .await
        .unwrap();
    assert_eq!(report.applied, 40);
    for db in &sharded.dbs {
        assert!(
            db.count("SELECT count(*) FROM outbox").await > 0,
            "each shard has operations"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nshards = [\"{}\", \"{}\"]\n\
             [dispatch.destinations.\"{}\"]\nmax_concurrency = 3\n",
            sharded.dbs[0].url,
            sharded.dbs[1].url,
            api.origin()
        ),
    )
    .unwrap();
    let mut dispatch = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .arg("dispatch")
        .arg("--config")
        .arg(&config)
        .args(["--batch-size", "8", "--poll", "10ms", "--backoff", "20ms"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .env_remove("DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let done = "SELECT count(*) FROM outbox WHERE state = 'done'";
    wait_for(
        "every shard's operations done",
        Duration::from_secs(60),
        || async { sharded.dbs[0].count(done).await + sharded.dbs[1].count(done).await == 40 },
    )
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dispatch.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(dispatch.wait().await.unwrap().success());
    assert_eq!(api.received().len(), 40, "each operation sent once");
    // One limit over both databases: 3 at once, where a share per shard would give 1 each.
    assert_eq!(
        api.max_in_flight(),
        3,
        "the shards' loops are admitted by one row: {} in flight",
        api.max_in_flight()
    );
    for (i, db) in sharded.dbs.iter().enumerate() {
        for (key, route) in sharded.rows(i, "outbox").await {
            assert_eq!(sharded.layout.shard(&route), i, "operation of {key}");
        }
        assert_eq!(
            db.count("SELECT count(*) FROM outbox_attempts a JOIN outbox o ON o.id = a.outbox_id AND o.route_key = a.route_key").await,
            db.count("SELECT count(*) FROM outbox").await,
            "each attempt recorded with its operation, on its shard"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_s_breaker_counts_the_failures_of_every_shard_once() {
    use crate::harness::recorder::{Answer, Recorder};
    let _heavy = heavy().await;
    let sharded = ShardedDb::new(2).await;
    let api = Recorder::start(Answer::Status(503)).await;
    let effect = replayproof::effect::HttpOutbox {
        target_url: api.url("/ops"),
        reconcile_url: None,
        max_attempts: 50,
        operation_keys: Default::default(),
    };
    let batch: Vec<RawMessage> = (0..20)
        .map(|n| message(n, &format!("evt-{n}"), None))
        .collect();
    sharded
        .processor(Arc::new(effect))
        .process("t", 0, &batch)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("replayproof.toml");
    // One request at a time, over two shards: a limit no share per shard could keep.
    std::fs::write(
        &config,
        format!(
            "[database]\nshards = [\"{}\", \"{}\"]\n\
             [dispatch.destinations.\"{}\"]\nmax_concurrency = 1\nbreaker_failures = 4\n\
             breaker_open = \"10m\"\n",
            sharded.dbs[0].url,
            sharded.dbs[1].url,
            api.origin()
        ),
    )
    .unwrap();
    let mut dispatch = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .arg("dispatch")
        .arg("--config")
        .arg(&config)
        .args(["--batch-size", "8", "--poll", "10ms", "--backoff", "10ms"])
        .args(["--max-backoff", "10ms", "--metrics-addr", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .env_remove("DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let open = "SELECT count(*) FROM outbox_destinations WHERE breaker = 'open'";
    wait_for("the breaker open", Duration::from_secs(60), || async {
        sharded.dbs[0].count(open).await == 1
    })
    .await;
    // Let every loop take a turn with the breaker open: none sends.
    let attempts = "SELECT count(*) FROM outbox_attempts";
    let turns =
        || async { sharded.dbs[0].count(attempts).await + sharded.dbs[1].count(attempts).await };
    // The breaker is written before the attempt that opened it: wait for every request
    // sent to be recorded, then let the loops turn.
    wait_for(
        "every request sent recorded",
        Duration::from_secs(30),
        || async { turns().await == api.received().len() as i64 },
    )
    .await;
    let settled = turns().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(turns().await, settled, "nothing is sent while it is open");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dispatch.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(dispatch.wait().await.unwrap().success());
    assert_eq!(
        api.received().len(),
        4,
        "four failures in a row, whichever shard they came from, open it"
    );
    assert_eq!(api.max_in_flight(), 1);
    assert_eq!(
        sharded.dbs[1]
            .count("SELECT count(*) FROM outbox_destinations")
            .await,
        0,
        "the limits live on the first shard only"
    );
}

/// An effect that refuses every event for good: each is settled `failed`.
struct Refuses;

#[replayproof::async_trait]
impl Effect for Refuses {
    fn name(&self) -> &'static str {
        "refuses"
    }

    async fn apply(&self, _: &mut Tx<'_>, _: &Event) -> Result<(), EffectError> {
        Err(EffectError::permanent(anyhow::anyhow!("refused")))
    }
}

/// `replayproof ARGS… --database-url A --database-url B`: (success, stdout, stderr).
fn run_over(sharded: &ShardedDb, args: &[&str]) -> (bool, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "warn");
    for db in &sharded.dbs {
        cmd.args(["--database-url", &db.url]);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn operator_commands_find_an_events_shard_and_status_adds_every_shard_up() {
    let sharded = ShardedDb::new(2).await;
    let failing: Arc<dyn Effect> = Arc::new(Refuses);
    let processor = BatchProcessor::new(sharded.shards(), failing).with_retry(EffectRetry {
        attempts: 1,
        backoff: Duration::ZERO,
    });
    let mut batch: Vec<RawMessage> = (0..10)
        .map(|n| message(n, &format!("evt-{n}"), None))
        .collect();
    // One event routed by tenant: it lives on the tenant's shard, and so does its retry.
    let tenant = (0..)
        .map(|t| format!("tenant-{t}"))
        .find(|t| sharded.layout.shard(t) == 0)
        .unwrap();
    let routed_key = (0..)
        .map(|n| format!("evt-t{n}"))
        .find(|k| sharded.layout.shard(k) == 1)
        .unwrap();
    batch.push(message(10, &routed_key, Some(&tenant)));
    processor.process("t", 0, &batch).await.unwrap();
    let on = |key: &str| sharded.layout.shard(key);
    assert!(
        (0..10).any(|n| on(&format!("evt-{n}")) == 1)
            && (0..10).any(|n| on(&format!("evt-{n}")) == 0)
    );

    // Status adds every shard's claims up.
    let (ok, out, err) = run_over(&sharded, &["status", "--json"]);
    assert!(ok, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let failed = status["claims"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c[0] == "failed")
        .map(|c| c[1].as_i64().unwrap());
    assert_eq!(failed, Some(11), "{out}");

    // A key is found on its shard, shown and resolved there.
    let key = (0..10)
        .map(|n| format!("evt-{n}"))
        .find(|k| on(k) == 1)
        .unwrap();
    let (ok, out, err) = run_over(&sharded, &["events", "show", &key, "--json"]);
    assert!(ok, "{err}");
    assert!(out.contains(&key) && out.contains("failed"), "{out}");
    let (ok, _, err) = run_over(
        &sharded,
        &[
            "events", "resolve", &key, "--as", "dead", "--reason", "test",
        ],
    );
    assert!(ok, "{err}");
    let status: String =
        sqlx::query_scalar("SELECT status FROM processed_events WHERE event_key = $1")
            .bind(&key)
            .fetch_one(&sharded.dbs[1].pool)
            .await
            .unwrap();
    assert_eq!(status, "dead");
    let (ok, _, err) = run_over(&sharded, &["events", "show", "evt-unknown"]);
    assert!(
        !ok && err.contains("no shard holds the event evt-unknown"),
        "{err}"
    );

    // Retried with the ledger, the routed event's effect is written under its tenant's route,
    // on the tenant's shard.
    let (ok, _, err) = run_over(
        &sharded,
        &[
            "events",
            "retry",
            &routed_key,
            "--effect",
            "ledger",
            "--reason",
            "test",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(
        sharded.rows(0, "ledger").await,
        vec![(routed_key.clone(), tenant.clone())]
    );
    assert!(sharded.rows(1, "ledger").await.is_empty());

    // Lists merge every shard's rows: pages of 4 by cursor give each event once, newest first.
    let mut listed = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec!["events", "list", "--limit", "4", "--json"];
        if let Some(cursor) = &after {
            args.extend(["--after", cursor.as_str()]);
        }
        let (ok, out, err) = run_over(&sharded, &args);
        assert!(ok, "{err}");
        let page: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        listed.extend(
            page.iter()
                .map(|e| e["event_key"].as_str().unwrap().to_owned()),
        );
        match err
            .lines()
            .find_map(|l| l.strip_prefix("next page: --after "))
        {
            Some(cursor) => after = Some(cursor.to_owned()),
            None => break,
        }
    }
    let unique: HashSet<&String> = listed.iter().collect();
    assert_eq!((listed.len(), unique.len()), (11, 11), "{listed:?}");
    // `--shard` narrows a list to one database; dead letters are all on the first.
    let (ok, out, err) = run_over(&sharded, &["events", "list", "--shard", "1", "--json"]);
    assert!(ok, "{err}");
    let on_one: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(
        on_one.len(),
        sharded.rows(1, "processed_events").await.len()
    );
    let (ok, _, err) = run_over(&sharded, &["dead-letters", "list"]);
    assert!(ok, "{err}");

    // The console spans every shard: its list, an event's story and an action on its shard.
    let console = crate::harness::console::TestConsole::over(
        sharded.shards(),
        crate::harness::console::settings(),
    )
    .await;
    let ann = console.login("ann").await;
    let list = ann.get("/events").await;
    assert_eq!(list.status, 200);
    for n in 0..10 {
        assert!(list.body.contains(&format!("evt-{n}")), "evt-{n} listed");
    }
    let other = (0..10)
        .map(|n| format!("evt-{n}"))
        .find(|k| on(k) == 0)
        .unwrap();
    let story = ann.get(&format!("/events/{other}")).await;
    assert_eq!(story.status, 200, "{}", story.body);
    assert!(story.body.contains(&other));
    let token = ann.csrf("/").await;
    let answer = ann
        .post(
            &format!("/events/{other}/resolve"),
            &[("reason", "x"), ("csrf_token", &token), ("as", "done")],
        )
        .await;
    assert_eq!(answer.status, 303, "{}", answer.body);
    let status: String =
        sqlx::query_scalar("SELECT status FROM processed_events WHERE event_key = $1")
            .bind(&other)
            .fetch_one(&sharded.dbs[0].pool)
            .await
            .unwrap();
    assert_eq!(status, "done");
    assert_eq!(
        ann.get("/").await.status,
        200,
        "the overview adds every shard up"
    );
}

/// `replayproof shards move --from-url FROM --to-url TO --range RANGE`, with `failpoints`.
fn move_buckets(
    from: &TestDb,
    to: &TestDb,
    range: &str,
    failpoints: Option<&str>,
) -> (bool, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
    cmd.args([
        "shards",
        "move",
        "--from-url",
        &from.url,
        "--to-url",
        &to.url,
    ])
    .args(["--range", range])
    .env("RUST_LOG", "warn")
    .env_remove("FAILPOINTS");
    if let Some(f) = failpoints {
        cmd.env("FAILPOINTS", f);
    }
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[tokio::test]
async fn splitting_two_shards_into_four_moves_each_bucket_range_once_even_when_cut_off() {
    let two = ShardedDb::new(2).await;
    let events: Vec<RawMessage> = (0..300)
        .map(|n| {
            let route = (n % 3 == 0).then(|| format!("tenant-{}", n % 11));
            message(n, &format!("evt-{n}"), route.as_deref())
        })
        .collect();
    let report = two
        .processor(Arc::new(LedgerAndOutbox))
        .process("t", 0, &events)
        .await
        .unwrap();
    assert_eq!(report.applied, 300);
    // Each event delivered a second time: the delivery is recorded on the claim's database.
    let again = two.processor(Arc::new(LedgerAndOutbox));
    let again = again.process("t", 2, &events).await.unwrap();
    assert_eq!(again.duplicates, 300);
    for db in &two.dbs {
        sqlx::raw_sql(
            "INSERT INTO outbox_attempts (outbox_id, route_key, fencing_token, worker, kind,
                 idempotency_key, payload_sha256, started_at, duration_ms, outcome, applied)
             SELECT id, route_key, 1, 'w', 'deliver', operation_key, sha256(''), now(), 1,
                    'retryable', true FROM outbox",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    }
    // The layout recorded as the docs have it: the list as it was split, then the new shards.
    let (ok, _, said) = run_over(&two, &["migrate"]);
    assert!(ok, "{said}");
    let ShardedDb { mut dbs, .. } = two;
    let (b, a) = (dbs.pop().unwrap(), dbs.pop().unwrap());
    let (c, d) = (TestDb::new().await, TestDb::new().await);
    let new = ShardedDb {
        dbs: vec![c, d],
        layout: Layout::new(1024, 2).unwrap(),
    };
    let (ok, _, said) = run_over(&new, &["migrate", "--new-shards"]);
    assert!(ok, "{said}");
    let ShardedDb { mut dbs, .. } = new;
    let (d, c) = (dbs.pop().unwrap(), dbs.pop().unwrap());

    // Fence: a replayproof process still connected to the source stops the move.
    let straggler = replayproof::db::pool(&a.url.parse().unwrap(), 1).unwrap();
    let held = straggler.pool().acquire().await.unwrap();
    let (ok, said) = move_buckets(&a, &c, "256-511", None);
    assert!(
        !ok && said.contains("stop the consumers and dispatchers"),
        "{said}"
    );
    drop(held);
    straggler.close().await;

    // Cut off after the copy committed: the range is on both sides; run again, it finishes.
    let (ok, said) = move_buckets(&a, &c, "256-511", Some("shards::move_after_copy=panic"));
    assert!(!ok, "{said}");
    assert!(
        c.count("SELECT count(*) FROM processed_events").await > 0,
        "{said}"
    );
    let (ok, said) = move_buckets(&a, &c, "256-511", None);
    assert!(ok && said.contains("verified and finished"), "{said}");
    let (ok, said) = move_buckets(&b, &d, "768-1023", None);
    assert!(ok && said.contains("moved and verified"), "{said}");

    // Four shards in the order [A, C, B, D]: each holds exactly its quarter of the buckets.
    let four = ShardedDb {
        dbs: vec![a, c, b, d],
        layout: Layout::new(1024, 4).unwrap(),
    };
    let counts = four.effects_in_place().await;
    assert_eq!(counts.len(), 300);
    assert!(
        counts.values().all(|n| *n == 1),
        "one effect per key after the moves"
    );
    for (i, db) in four.dbs.iter().enumerate() {
        assert!(
            !four.rows(i, "processed_events").await.is_empty(),
            "shard {i} holds claims"
        );
        for (key, route) in four.rows(i, "outbox").await {
            assert_eq!(four.layout.shard(&route), i, "operation of {key}");
        }
        assert_eq!(
            db.count(
                "SELECT count(*) FROM outbox_attempts a JOIN outbox o
                   ON o.id = a.outbox_id AND o.route_key = a.route_key"
            )
            .await,
            db.count("SELECT count(*) FROM outbox").await,
            "shard {i}: every attempt with its operation"
        );
    }
    // Every event redelivered afterwards is a replay wherever its key now lives, and each
    // claim counts the deliveries it had before the move and the one after.
    let processor = four.processor(Arc::new(LedgerAndOutbox));
    let again = processor.process("t", 1, &events).await.unwrap();
    assert_eq!((again.applied, again.duplicates), (0, 300));
    assert!(four.effects_in_place().await.values().all(|n| *n == 1));
    let mut counted = 0;
    for db in &four.dbs {
        assert_eq!(
            db.count("SELECT count(*) FROM claim_deliveries WHERE deliveries <> 3")
                .await,
            0,
            "a claim lost deliveries in the move"
        );
        counted += db.count("SELECT count(*) FROM claim_deliveries").await;
    }
    assert_eq!(counted, 300);
    // Moved back, the range finds none of its deliveries left behind on A to count again.
    let (ok, said) = move_buckets(&four.dbs[1], &four.dbs[0], "256-511", None);
    assert!(ok && said.contains("moved and verified"), "{said}");
    assert_eq!(
        four.dbs[0]
            .count("SELECT count(*) FROM claim_deliveries WHERE deliveries <> 3")
            .await,
        0,
        "a range moved back counted its old redeliveries twice"
    );
    assert!(
        four.dbs[1]
            .count("SELECT count(*) FROM processed_events")
            .await
            == 0
    );
}

#[tokio::test]
async fn prune_and_replay_run_over_every_shard() {
    let _heavy = heavy().await;
    let sharded = ShardedDb::new(2).await;
    // Replay by time needs a broker that looks offsets up by time: the broker process.
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(2).await, unique("g"));
    let events: Vec<Record> = (0..40)
        .map(|n| Record::event(&format!("evt-{n}"), serde_json::json!({ "n": n })))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &events).await;
    let consumer = InProcessConsumer::with_processor(
        settings(&kafka.brokers(), &topic, &group),
        sharded.processor(Arc::new(Ledger)),
    );
    wait_committed_total(&kafka, &group, &topic, 2, 40).await;
    consumer.stop().await;

    // A bad deploy lost some claims and their effects on both shards; the replay applies
    // exactly those, each on its own shard.
    let lost: Vec<String> = (0..40).step_by(7).map(|n| format!("evt-{n}")).collect();
    assert!(lost.iter().any(|k| sharded.layout.shard(k) == 0));
    assert!(lost.iter().any(|k| sharded.layout.shard(k) == 1));
    for db in &sharded.dbs {
        sqlx::raw_sql(
            "DELETE FROM ledger WHERE event_key IN ('evt-0','evt-7','evt-14','evt-21','evt-28','evt-35');
             DELETE FROM processed_events WHERE event_key IN ('evt-0','evt-7','evt-14','evt-21','evt-28','evt-35');",
        )
        .execute(&db.pool)
        .await
        .unwrap();
    }
    let brokers = kafka.brokers();
    let mut args = vec![
        "replay",
        "--brokers",
        &brokers,
        "--topic",
        &topic,
        "--since",
        "1h",
        "--reason",
        "deploy",
        "--json",
    ];
    let options: Vec<String> = test_kafka_options()
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for option in &options {
        args.extend(["--kafka-option", option.as_str()]);
    }
    let (ok, out, err) = run_over(&sharded, &args);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["newly_applied"], lost.len(), "{out}");
    assert_eq!(report["already_applied"], 40 - lost.len(), "{out}");
    let counts = sharded.effects_in_place().await;
    assert_eq!(counts.len(), 40);
    assert!(
        counts.values().all(|n| *n == 1),
        "one effect per key after the replay"
    );

    // Prune deletes the settled claims older than their retention on every shard (a source
    // missing from the configuration is held to the highest floor, 91 days).
    for db in &sharded.dbs {
        sqlx::raw_sql("UPDATE processed_events SET claimed_at = now() - interval '100 days'")
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("replayproof.toml");
    std::fs::write(&file, "[retention]\ndefault_retention = \"9days\"\n").unwrap();
    let file = file.to_str().unwrap().to_owned();
    let (ok, out, err) = run_over(
        &sharded,
        &[
            "prune",
            "--config",
            &file,
            "--brokers",
            "127.0.0.1:1",
            "--topic-retention",
            "1day",
        ],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("shard 0:") && out.contains("shard 1:"),
        "{out}"
    );
    assert_eq!(sharded.claims().await, 0, "{out}");
}

/// A CloudEvent routed by an extension one mode spells `True` (Python's SDK in binary mode) and
/// the other `true`: both copies go to one database, and the event has one effect.
#[tokio::test]
async fn a_cloudevent_routed_by_an_extension_each_mode_spells_otherwise_has_one_effect() {
    use replayproof::inputs::{Format, Input};
    let sharded = ShardedDb::new(4).await;
    let (binary_spelling, structured_spelling) =
        [("True", "true"), ("7.0", "7"), ("FALSE", "false")]
            .into_iter()
            .find(|(a, b)| sharded.layout.shard(a) != sharded.layout.shard(b))
            .expect("a pair of spellings the layout puts apart");
    let input = Input {
        route_attribute: Some("flag".into()),
        ..Input::of(Format::CloudEvents)
    };
    let binary = RawMessage {
        offset: 0,
        key: None,
        value: Some(br#"{"n":1}"#.to_vec()),
        traceparent: None,
        headers: [
            ("ce_specversion", "1.0"),
            ("ce_id", "F-1"),
            ("ce_source", "/flags"),
            ("ce_type", "t"),
            ("ce_flag", binary_spelling),
        ]
        .into_iter()
        .collect(),
    };
    let flag = match structured_spelling {
        "7" | "true" | "false" => structured_spelling.to_owned(),
        other => format!("\"{other}\""),
    };
    let structured = RawMessage {
        offset: 1,
        key: None,
        value: Some(
            format!(r#"{{"specversion":"1.0","id":"F-1","source":"/flags","type":"t","flag":{flag},"data":{{"n":1}}}}"#)
                .into_bytes(),
        ),
        traceparent: None,
        headers: [("content-type", "application/cloudevents+json")].into_iter().collect(),
    };
    let processor = sharded.processor(Arc::new(Ledger)).with_input(input);
    processor.process("flags", 0, &[binary]).await.unwrap();
    processor.process("flags", 1, &[structured]).await.unwrap();
    let effects = sharded.effects_in_place().await;
    let key = replayproof::inputs::cloudevent_key("/flags", "F-1");
    assert_eq!(effects.get(&key), Some(&1), "{effects:?}");
    assert_eq!(sharded.claims().await, 1);
}

//! A fresh, migrated database per test, and what tests read from it.

use super::*;
use replayproof::db::Db;
use replayproof::devkit::embedded::EmbeddedPostgres;
use std::collections::HashMap;
use std::time::Duration;

/// A migrated database of its own for one test.
pub struct TestDb {
    pub pool: Db,
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

    /// A fresh, empty database that nothing has migrated, reached without any search_path:
    /// what a host application's database looks like before replayproof's first `migrate`.
    pub async fn unmigrated() -> Self {
        let admin = std::env::var("DATABASE_URL").ok();
        let cluster = match admin {
            Some(_) => None,
            None => Some(
                tokio::task::spawn_blocking(EmbeddedPostgres::start)
                    .await
                    .unwrap()
                    .expect("a throwaway PostgreSQL cluster"),
            ),
        };
        let admin = admin.unwrap_or_else(|| cluster.as_ref().unwrap().url());
        let url = create_database(&admin).await;
        Self {
            pool: connect(&url).await,
            url,
            cluster,
        }
    }

    async fn create_on(admin: &str, cluster: Option<EmbeddedPostgres>) -> Self {
        let mut url = url::Url::parse(&create_database(admin).await).expect("a URL");
        // Sessions find replayproof's tables in its schema, as the processes' sessions do; a
        // process given this URL sets the same search_path again.
        url.query_pairs_mut()
            .append_pair("options", "-c search_path=replayproof,public");
        let url = url.to_string();
        let pool = connect(&url).await;
        replayproof::db::migrate(&pool).await.expect("migrate");
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

/// Creates a database of a unique name on the server `admin` points at; returns its URL.
async fn create_database(admin: &str) -> String {
    let name = unique("rp_test");
    let admin_pool = sqlx::PgPool::connect(admin)
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin_pool)
        .await
        .expect("create the test database");
    admin_pool.close().await;
    let mut url = url::Url::parse(admin).expect("DATABASE_URL is a URL");
    url.set_path(&name);
    url.to_string()
}

async fn connect(url: &str) -> Db {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect("connect to the test database")
        .into()
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

#[cfg(feature = "failpoints")]
/// Sessions of this test's database sitting idle inside a transaction, whoever opened them.
pub async fn idle_in_transaction(db: &TestDb) -> i64 {
    db.count(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND state = 'idle in transaction'",
    )
    .await
}

#[cfg(feature = "failpoints")]
/// Open transactions of `replayproof` sessions in this database.
pub async fn open_transactions(db: &TestDb) -> i64 {
    db.count(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'replayproof' AND state = 'idle in transaction'",
    )
    .await
}

#[cfg(feature = "failpoints")]
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

//! Testing an effect the way the consumer runs it, with no Kafka: a throwaway database with
//! replayproof's tables and the application's, events delivered in batches that claim and apply
//! them in one transaction, and deferred events applied when due.
//!
//! ```no_run
//! use replayproof::testing::{envelope, EffectTest, TestDatabase};
//! use serde_json::json;
//!
//! # async fn example() -> anyhow::Result<()> {
//! let db = TestDatabase::new(&["CREATE TABLE orders (id BIGINT PRIMARY KEY, paid BOOLEAN)"]).await?;
//! let mut test = EffectTest::new(db.pool.clone(), replayproof::effect::Ledger);
//! let report = test
//!     .deliver(&[envelope("evt_1", "stripe", "payment.succeeded", json!({"order_id": 1}))])
//!     .await?;
//! assert_eq!(report.applied, 1);
//! assert_eq!(test.status("evt_1").await?.as_deref(), Some("done"));
//! // A deferred event is applied again with `apply_deferred`, due or not.
//! let round = test.apply_deferred().await?;
//! # Ok(())
//! # }
//! ```
//!
//! Compiled with the `devkit` feature (on by default).

use crate::claims::{self, ClaimRow};
use crate::consume::{
    BatchProcessor, BatchReport, ConsumeMetrics, DeferSettings, DeferredApplier, EffectRetry,
    RawMessage, Round,
};
use crate::db::Db;
use crate::devkit::embedded::EmbeddedPostgres;
use crate::effect::Effect;
use crate::envelope::{Envelope, EventKey};
use anyhow::Context as _;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The topic [`EffectTest`] files its events under.
pub const TEST_TOPIC: &str = "replayproof-effect-test";

/// A fresh database of its own, migrated, for one test: on the server `DATABASE_URL` names
/// (a new database each time), or on a throwaway cluster started from the local PostgreSQL
/// binaries when it is not set. The cluster is removed when this is dropped.
pub struct TestDatabase {
    /// Connections whose `search_path` finds replayproof's tables, then `public`.
    pub pool: Db,
    /// The database's URL, for a process.
    pub url: String,
    _cluster: Option<EmbeddedPostgres>,
}

impl TestDatabase {
    /// Creates the database and applies replayproof's migrations, then `migrations` (the
    /// application's own SQL, such as an effect's tables), in order.
    pub async fn new(migrations: &[&str]) -> anyhow::Result<Self> {
        let (admin, cluster) = match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => (url, None),
            _ => {
                let cluster = tokio::task::spawn_blocking(EmbeddedPostgres::start).await??;
                (cluster.url(), Some(cluster))
            }
        };
        let name = format!(
            "rp_effect_test_{}_{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let admin_pool = sqlx::PgPool::connect(&admin)
            .await
            .context("connecting to PostgreSQL")?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin_pool)
            .await
            .context("creating the test database")?;
        admin_pool.close().await;
        let mut url = reqwest::Url::parse(&admin).context("DATABASE_URL is not a URL")?;
        url.set_path(&name);
        url.query_pairs_mut()
            .append_pair("options", "-c search_path=replayproof,public");
        let url = url.to_string();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .context("connecting to the test database")?;
        let pool = Db::from(pool);
        crate::db::migrate_with(&pool, migrations).await?;
        Ok(Self {
            pool,
            url,
            _cluster: cluster,
        })
    }
}

/// An envelope as a source writes it, its payload the JSON text of `payload`.
///
/// # Panics
///
/// When `key` is no valid event key ([`EventKey`]): a producer cannot write one.
pub fn envelope(key: &str, source: &str, event_type: &str, payload: serde_json::Value) -> Envelope {
    let payload = serde_json::value::to_raw_value(&payload).expect("a JSON value serialises");
    Envelope {
        route: None,
        key: EventKey::try_from(key).expect("a valid event key"),
        source: source.into(),
        event_type: Some(event_type.into()),
        received_at: None,
        occurred_at: None,
        payload,
        unhashed: Vec::new(),
        replay_window_secs: None,
        request_id: None,
    }
}

/// One effect, driven as the consumer drives it: [`EffectTest::deliver`] runs a batch through
/// the consumer's own [`BatchProcessor`] (claims, replays, key conflicts, the effect, its
/// retries, failures and deferrals, one transaction), and [`EffectTest::apply_deferred`] runs
/// the consumer's background task over the deferred claims.
pub struct EffectTest {
    /// The database the effect writes in.
    pub pool: Db,
    processor: BatchProcessor,
    next_offset: i64,
}

impl EffectTest {
    /// A test of `effect` in the database of `pool`, with the consumer's default retries (fast
    /// backoff) and deferral settings.
    pub fn new(pool: Db, effect: impl Effect) -> Self {
        Self::with_effect(pool, Arc::new(effect))
    }

    /// [`EffectTest::new`] for an effect already shared.
    pub fn with_effect(pool: Db, effect: Arc<dyn Effect>) -> Self {
        Self {
            processor: BatchProcessor::new(pool.clone(), effect).with_retry(EffectRetry {
                backoff: std::time::Duration::from_millis(1),
                ..EffectRetry::default()
            }),
            pool,
            next_offset: 0,
        }
    }

    /// Uses `defer` for deferred events' due times and deadlines.
    pub fn with_defer(mut self, defer: DeferSettings) -> Self {
        self.processor.defer = defer;
        self
    }

    /// Delivers `envelopes` as one batch of one partition, at the next offsets, and returns
    /// what the batch did once every event is settled (applied, failed or deferred).
    pub async fn deliver(&mut self, envelopes: &[Envelope]) -> anyhow::Result<BatchReport> {
        let messages: Vec<RawMessage> = envelopes
            .iter()
            .map(|e| {
                let message = RawMessage {
                    offset: self.next_offset,
                    key: Some(e.key.as_str().as_bytes().to_vec()),
                    value: Some(e.to_bytes()),
                    traceparent: None,
                    headers: Default::default(),
                };
                self.next_offset += 1;
                message
            })
            .collect();
        Ok(self.processor.process(TEST_TOPIC, 0, &messages).await?)
    }

    /// Makes every deferred claim due now, then applies them once, as the consumer's background
    /// task would when they are due.
    pub async fn apply_deferred(&self) -> anyhow::Result<Round> {
        sqlx::query("UPDATE processed_events SET due_at = now() WHERE status = 'deferred'")
            .execute(&self.pool)
            .await?;
        let metrics = ConsumeMetrics::new(&prometheus::Registry::new())?;
        let applier = DeferredApplier::new(self.processor.clone(), TEST_TOPIC, metrics);
        Ok(applier.apply_due(&CancellationToken::new()).await?)
    }

    /// An event's claim, as `events show` gives it.
    pub async fn claim(&self, key: &str) -> anyhow::Result<Option<ClaimRow>> {
        Ok(claims::find(&self.pool, key).await?)
    }

    /// An event's claim status (`done`, `deferred`, `failed`, …), None when never claimed.
    pub async fn status(&self, key: &str) -> anyhow::Result<Option<String>> {
        Ok(self.claim(key).await?.map(|c| c.status.to_string()))
    }
}

//! The services one process needs, real when configured and embedded otherwise: a Kafka broker
//! (librdkafka's in-process mock cluster) and a PostgreSQL (a throwaway cluster), for `dev` and
//! `demo`.

use super::embedded::{EmbeddedKafka, EmbeddedPostgres};
use crate::db::Db;
use crate::db::{self, DatabaseUrl};
use anyhow::Context as _;

/// The broker and database in use, and the embedded ones to stop on drop.
pub struct Stack {
    pub brokers: String,
    pub topic: String,
    pub database_url: String,
    pub pool: Db,
    /// Whether each one is embedded, for telling the user.
    pub embedded_kafka: bool,
    pub embedded_postgres: bool,
    // Dropped last: the pool closes before the cluster stops.
    _kafka: Option<EmbeddedKafka>,
    _postgres: Option<EmbeddedPostgres>,
}

impl Stack {
    /// Uses `brokers` and `database_url` when given; otherwise starts the embedded ones, and
    /// says so. An embedded broker gets `topic` with `partitions` partitions; a real one must
    /// have the topic already.
    pub async fn start(
        brokers: Option<String>,
        database_url: Option<DatabaseUrl>,
        topic: &str,
        partitions: i32,
    ) -> anyhow::Result<Self> {
        let kafka = match &brokers {
            Some(b) => {
                tracing::info!(brokers = %b, "Using the configured Kafka brokers.");
                None
            }
            None => {
                let k = EmbeddedKafka::start()?;
                k.create_topic(topic, partitions)?;
                tracing::info!(brokers = %k.bootstrap_servers(), topic, partitions, "No brokers configured: using librdkafka's in-process mock Kafka cluster.");
                Some(k)
            }
        };
        let postgres = match &database_url {
            Some(_) => {
                tracing::info!("Using the configured PostgreSQL (DATABASE_URL).");
                None
            }
            None => {
                let pg = tokio::task::spawn_blocking(EmbeddedPostgres::start)
                    .await?
                    .context(
                        "starting a throwaway PostgreSQL (set DATABASE_URL to use your own)",
                    )?;
                tracing::info!(url = %pg.url(), "No DATABASE_URL: using a throwaway PostgreSQL cluster, removed on exit.");
                Some(pg)
            }
        };
        let database_url = match (&database_url, &postgres) {
            (Some(url), _) => url.expose().to_owned(),
            (None, Some(pg)) => pg.url(),
            (None, None) => unreachable!("one of them is set"),
        };
        let pool = db::pool(&database_url.parse()?, 32)?;
        db::migrate(&pool).await?;
        Ok(Self {
            brokers: brokers.unwrap_or_else(|| {
                kafka
                    .as_ref()
                    .map(|k| k.bootstrap_servers())
                    .unwrap_or_default()
            }),
            topic: topic.into(),
            database_url,
            pool,
            embedded_kafka: kafka.is_some(),
            embedded_postgres: postgres.is_some(),
            _kafka: kafka,
            _postgres: postgres,
        })
    }

    /// Puts a raw record on the topic, bypassing the ingress (the demo's misbehaving producer).
    pub async fn produce_raw(&self, key: &[u8], value: &[u8]) -> anyhow::Result<()> {
        let producer = crate::kafka::producer(&self.brokers, &[])?;
        let none = crate::inputs::Headers::new();
        crate::kafka::produce_raw(&producer, &self.topic, Some(key), Some(value), &none).await
    }
}

//! A real effect written against the library: a payment event marks an order paid.
//!
//! The `orders` table has `UNIQUE (provider_event_id)`, and the transition is conditional
//! (`… WHERE id = $1 AND status = 'pending'`), so the effect is correct on its own terms too:
//! an order is paid once, by one event, and a late or repeated event changes nothing.
//!
//! Run it against a topic of envelopes whose payload looks like
//! `{"order_id": 42, "amount": 1999}`:
//!
//! ```sh
//! DATABASE_URL=postgres://… REPLAYPROOF_BROKERS=localhost:9092 cargo run --example orders
//! ```

use anyhow::Context as _;
use async_trait::async_trait;
use replayproof::consume::{self, BatchProcessor, ConsumerSettings, EffectRetry};
use replayproof::effect::{Effect, Tx};
use replayproof::envelope::Event;
use std::sync::Arc;

/// The table this effect owns. A real application keeps it in its own migrations.
pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS orders (
    id                BIGINT      PRIMARY KEY,
    status            TEXT        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'paid')),
    amount            BIGINT      NOT NULL,
    provider_event_id TEXT        UNIQUE,
    paid_at           TIMESTAMPTZ
)"#;

/// Marks the order named in the event's payload as paid.
pub struct MarkOrderPaid;

#[async_trait]
impl Effect for MarkOrderPaid {
    fn name(&self) -> &'static str {
        "orders"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> anyhow::Result<()> {
        let order_id = event.payload["order_id"]
            .as_i64()
            .context("the payment event has no numeric order_id")?;
        let updated = sqlx::query(
            "UPDATE orders SET status = 'paid', provider_event_id = $2, paid_at = now() \
             WHERE id = $1 AND status = 'pending'",
        )
        .bind(order_id)
        .bind(event.key.as_str())
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if updated == 0 {
            // Already paid (by this event or another), or no such order: nothing to do, and
            // nothing to retry.
            tracing::info!(order_id, key = %event.key, "The order was not pending; left as it is.");
        }
        Ok(())
    }
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    replayproof::telemetry::init_logging();
    let env = |name: &str| std::env::var(name).with_context(|| format!("{name} is not set"));
    let url = env("DATABASE_URL")?.parse()?;
    let pool = replayproof::db::pool(&url, 8)?;
    replayproof::db::migrate(&pool).await?;
    sqlx::query(SCHEMA).execute(&pool).await?;
    let settings = ConsumerSettings::new(
        &env("REPLAYPROOF_BROKERS")?,
        &env("REPLAYPROOF_TOPIC").unwrap_or_else(|_| "webhooks".into()),
        &env("REPLAYPROOF_GROUP").unwrap_or_else(|_| "orders".into()),
    );
    let processor = BatchProcessor {
        pool,
        effect: Arc::new(MarkOrderPaid),
        retry: EffectRetry::default(),
    };
    let shutdown = replayproof::shutdown::on_signal();
    let metrics = replayproof::telemetry::ConsumeMetrics::new(&prometheus::Registry::new())?;
    consume::run(settings, processor, metrics, shutdown).await
}

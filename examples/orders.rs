//! A complete binary built on the library: the stock command line with one more effect, a
//! payment event that marks an order paid.
//!
//! The `orders` table has `UNIQUE (provider_event_id)`, and the transition is conditional
//! (`… WHERE id = $1 AND status = 'pending'`), so the effect is correct on its own terms too:
//! an order is paid once, by one event, and a late or repeated event changes nothing.
//!
//! ```sh
//! cargo run --example orders -- migrate                      # replayproof's tables and `orders`
//! cargo run --example orders -- consume --effect orders      # envelopes like {"order_id": 42}
//! cargo run --example orders -- events retry KEY --effect orders --reason "fixed"
//! ```

use anyhow::Context as _;
use async_trait::async_trait;
use replayproof::effect::{Effect, Tx};
use replayproof::envelope::Event;

/// The table this effect owns, created by `migrate`.
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
        let order_id = event.payload()["order_id"]
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

fn main() -> std::process::ExitCode {
    replayproof::Cli::new()
        .with_effect("orders", MarkOrderPaid)
        .with_migration(SCHEMA)
        .run()
}

//! A complete binary built on the library: the stock command line with one more effect, a
//! payment event that marks an order paid.
//!
//! Payments and orders race: the provider's `payment.succeeded` webhook can arrive before the
//! checkout that created the order has committed. So the effect has three answers:
//!
//! - the order exists, is pending and the amount matches: it is marked paid, by this event;
//! - the order does not exist yet: [`Deferred`], "not yet". The claim waits as `deferred` with
//!   the payload and the consumer applies it again when due (backoff with a cap), until the
//!   order exists or the deadline passes, when it is settled `failed` for an operator;
//! - anything else can never succeed and is refused as [`EffectError::Permanent`], settled `failed` with a
//!   reason an operator can act on: an amount that does not match, an order already paid by
//!   another payment (a double charge to refund), a payment that names no order.
//!
//! A replay of the same event never reaches the effect: the claim finds the key. The
//! transition is conditional all the same (`… AND status = 'pending'`), and `orders` has
//! `UNIQUE (provider_event_id)`: the effect is correct on its own terms too.
//!
//! ```sh
//! cargo run --example orders -- migrate                      # replayproof's tables and `orders`
//! cargo run --example orders -- consume --effect orders      # {"order_id": 42, "amount": 1999}
//! cargo run --example orders -- events list --state deferred
//! cargo run --example orders -- events retry KEY --reason "order imported by hand"
//! ```

use anyhow::Context as _;
use replayproof::async_trait;
use replayproof::effect::{Deferred, Effect, EffectError, Tx};
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

/// Marks the order named in a payment event as paid.
pub struct MarkOrderPaid;

/// A payment as the event carries it.
struct Payment {
    order_id: i64,
    amount: i64,
}

impl Payment {
    /// The payment in `event`'s payload; a payload without one can never apply.
    fn of(event: &Event) -> Result<Self, EffectError> {
        let field = |name: &str| {
            event.payload()?[name]
                .as_i64()
                .with_context(|| format!("the payment event has no integer {name}"))
                .map_err(EffectError::Permanent)
        };
        Ok(Self {
            order_id: field("order_id")?,
            amount: field("amount")?,
        })
    }
}

#[async_trait]
impl Effect for MarkOrderPaid {
    fn name(&self) -> &'static str {
        "orders"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        let payment = Payment::of(event)?;
        let order_id = payment.order_id;
        // Locked, so a concurrent payment for the same order waits and then sees this one.
        let order: Option<(i64, String, Option<String>)> = sqlx::query_as(
            "SELECT amount, status, provider_event_id FROM orders WHERE id = $1 FOR UPDATE",
        )
        .bind(order_id)
        .fetch_optional(&mut **tx)
        .await?;
        let Some((amount, status, paid_by)) = order else {
            return Err(Deferred::new(format!("order {order_id} does not exist yet")).into());
        };
        if payment.amount != amount {
            return Err(EffectError::permanent(anyhow::anyhow!(
                "the payment of {} does not match order {order_id}'s amount of {amount}",
                payment.amount
            )));
        }
        if status != "pending" {
            let by = paid_by.as_deref().unwrap_or("an unknown event");
            return Err(EffectError::permanent(anyhow::anyhow!(
                "order {order_id} was already paid by {by}: this second payment needs a refund"
            )));
        }
        sqlx::query(
            "UPDATE orders SET status = 'paid', provider_event_id = $2, paid_at = now() \
             WHERE id = $1 AND status = 'pending'",
        )
        .bind(order_id)
        .bind(event.key.as_str())
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

fn main() -> std::process::ExitCode {
    replayproof::Cli::new()
        .with_effect("orders", MarkOrderPaid)
        .with_migration(SCHEMA)
        .run()
}

/// The effect's paths, tested as the consumer runs it with the crate's test helpers
/// (`replayproof::testing`): a database of its own for each test, on `DATABASE_URL`'s server
/// or a throwaway cluster.
#[cfg(all(test, feature = "devkit"))]
mod tests {
    use super::*;
    use replayproof::testing::{envelope, EffectTest, TestDatabase};
    use serde_json::json;

    async fn setup() -> (TestDatabase, EffectTest) {
        let db = TestDatabase::new(&[SCHEMA]).await.unwrap();
        let test = EffectTest::new(db.pool.clone(), MarkOrderPaid);
        (db, test)
    }

    fn payment(key: &str, order_id: i64, amount: i64) -> replayproof::envelope::Envelope {
        let payload = json!({"order_id": order_id, "amount": amount});
        envelope(key, "stripe", "payment.succeeded", payload)
    }

    async fn order(db: &TestDatabase, id: i64) -> Option<(String, i64, Option<String>)> {
        sqlx::query_as("SELECT status, amount, provider_event_id FROM orders WHERE id = $1")
            .bind(id)
            .fetch_optional(&db.pool)
            .await
            .unwrap()
    }

    async fn create_order(db: &TestDatabase, id: i64, amount: i64) {
        sqlx::query("INSERT INTO orders (id, amount) VALUES ($1, $2)")
            .bind(id)
            .bind(amount)
            .execute(&db.pool)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_payment_pays_its_order_and_a_replay_changes_nothing() {
        let (db, mut test) = setup().await;
        create_order(&db, 1, 1999).await;
        let report = test
            .deliver(&[payment("evt_1", 1, 1999), payment("evt_1", 1, 1999)])
            .await
            .unwrap();
        assert_eq!((report.applied, report.duplicates), (1, 1));
        let later = test.deliver(&[payment("evt_1", 1, 1999)]).await.unwrap();
        assert_eq!((later.applied, later.duplicates), (0, 1));
        assert_eq!(
            order(&db, 1).await,
            Some(("paid".into(), 1999, Some("evt_1".into())))
        );
        assert_eq!(test.status("evt_1").await.unwrap().as_deref(), Some("done"));
    }

    #[tokio::test]
    async fn a_payment_before_its_order_is_deferred_and_applied_once_the_order_exists() {
        let (db, mut test) = setup().await;
        let report = test.deliver(&[payment("evt_early", 7, 500)]).await.unwrap();
        assert_eq!((report.applied, report.deferred), (0, 1));
        let claim = test.claim("evt_early").await.unwrap().unwrap();
        assert_eq!(claim.status.as_str(), "deferred");
        assert_eq!(
            claim.deferred_reason.as_deref(),
            Some("order 7 does not exist yet")
        );
        assert!(claim.due_at.is_some() && claim.payload.is_some());
        // Due again before the order exists: deferred again, nothing written.
        let round = test.apply_deferred().await.unwrap();
        assert_eq!((round.applied, round.deferred), (0, 1));
        assert_eq!(order(&db, 7).await, None);
        // A redelivery meanwhile is a replay of the deferred claim.
        let replay = test.deliver(&[payment("evt_early", 7, 500)]).await.unwrap();
        assert_eq!((replay.applied, replay.duplicates), (0, 1));
        create_order(&db, 7, 500).await;
        let round = test.apply_deferred().await.unwrap();
        assert_eq!((round.applied, round.deferred), (1, 0));
        assert_eq!(
            order(&db, 7).await,
            Some(("paid".into(), 500, Some("evt_early".into())))
        );
        assert_eq!(
            test.status("evt_early").await.unwrap().as_deref(),
            Some("done")
        );
        // Nothing is left to apply.
        assert_eq!(test.apply_deferred().await.unwrap().due, 0);
    }

    #[tokio::test]
    async fn a_wrong_amount_a_second_payment_and_no_order_id_fail_with_their_reasons() {
        let (db, mut test) = setup().await;
        create_order(&db, 1, 1999).await;
        create_order(&db, 2, 700).await;
        let report = test
            .deliver(&[
                payment("evt_paid", 1, 1999),
                payment("evt_again", 1, 1999),
                payment("evt_short", 2, 1),
                envelope(
                    "evt_bare",
                    "stripe",
                    "payment.succeeded",
                    json!({"amount": 1}),
                ),
            ])
            .await
            .unwrap();
        assert_eq!((report.applied, report.failed), (1, 3));
        let reason = |key: &'static str| {
            let test = &test;
            async move { test.claim(key).await.unwrap().unwrap().last_error.unwrap() }
        };
        assert!(reason("evt_again")
            .await
            .contains("already paid by evt_paid"));
        assert!(reason("evt_short")
            .await
            .contains("the payment of 1 does not match order 2's amount of 700"));
        assert!(reason("evt_bare").await.contains("no integer order_id"));
        assert_eq!(order(&db, 2).await, Some(("pending".into(), 700, None)));
        assert_eq!(
            test.status("evt_again").await.unwrap().as_deref(),
            Some("failed")
        );
    }
}

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
//! A marketplace pays its sellers: when the payment names a `tenant` and its connected
//! `account`, the same transaction enqueues a transfer to that account through a Stripe-like
//! API, form-encoded, with the tenant's own API key. The outbox stores only the credential's
//! name (`stripe_<tenant>`); `replayproof dispatch` adds its header from
//! `[dispatch.credentials.stripe_<tenant>]`, sends `Idempotency-Key` on every attempt, and
//! keeps within the API's limits.
//!
//! ```sh
//! cargo run --example orders -- migrate                      # replayproof's tables and `orders`
//! cargo run --example orders -- consume --effect orders      # {"order_id": 42, "amount": 1999}
//! cargo run --example orders -- dispatch --config orders.toml
//! cargo run --example orders -- events list --state deferred
//! cargo run --example orders -- events retry KEY --reason "order imported by hand"
//! ```
//!
//! ```toml
//! # orders.toml
//! [dispatch.credentials.stripe_acme]
//! headers = { Authorization = "Bearer ${STRIPE_ACME_KEY}" }
//! origins = ["https://api.stripe.com"]
//!
//! [dispatch.destinations."https://api.stripe.com"]
//! max_concurrency = 4
//! rate_per_sec = 25
//! breaker_failures = 5
//! breaker_open = "30s"
//! ```

use anyhow::Context as _;
use replayproof::async_trait;
use replayproof::effect::{Deferred, Effect, EffectError, Tx};
use replayproof::envelope::Event;
use replayproof::outbox::{self, NewOperation};

/// The table this effect owns, created by `migrate`.
pub const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS orders (
    id                BIGINT      PRIMARY KEY,
    status            TEXT        NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'paid')),
    amount            BIGINT      NOT NULL,
    provider_event_id TEXT        UNIQUE,
    paid_at           TIMESTAMPTZ
)"#;

/// Marks the order named in a payment event as paid, and pays the seller's share out when
/// the payment names a tenant.
pub struct MarkOrderPaid {
    /// The payments API's base URL: `https://api.stripe.com`, or `ORDERS_PAYMENTS_API`.
    pub payments_api: String,
}

impl MarkOrderPaid {
    /// The effect with the payments API of `ORDERS_PAYMENTS_API`, else Stripe's.
    pub fn from_env() -> Self {
        Self {
            payments_api: std::env::var("ORDERS_PAYMENTS_API")
                .unwrap_or_else(|_| "https://api.stripe.com".into()),
        }
    }
}

/// A payment as the event carries it.
struct Payment {
    order_id: i64,
    amount: i64,
    /// The seller this marketplace payment is for, and their connected account.
    seller: Option<(String, String)>,
}

impl Payment {
    /// The payment in `event`'s payload; a payload without one can never apply.
    fn of(event: &Event) -> Result<Self, EffectError> {
        let payload = event.payload()?;
        let field = |name: &str| {
            payload[name]
                .as_i64()
                .with_context(|| format!("the payment event has no integer {name}"))
                .map_err(EffectError::Permanent)
        };
        let text = |name: &str| payload[name].as_str().map(str::to_owned);
        let seller = match (text("tenant"), text("account")) {
            (None, None) => None,
            (Some(tenant), Some(account))
                if !tenant.is_empty()
                    && tenant.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') =>
            {
                Some((tenant, account))
            }
            _ => {
                return Err(EffectError::permanent(anyhow::anyhow!(
                    "a marketplace payment names both its tenant (a-z, _) and its account"
                )))
            }
        };
        Ok(Self {
            order_id: field("order_id")?,
            amount: field("amount")?,
            seller,
        })
    }
}

/// A transfer as the payments API takes it, form-encoded.
#[derive(serde::Serialize)]
struct Transfer<'a> {
    amount: i64,
    currency: &'a str,
    destination: &'a str,
    transfer_group: String,
}

impl MarkOrderPaid {
    /// Enqueues the seller's transfer in the effect's transaction: sent later by `dispatch`,
    /// with the tenant's credential and the operation key as `Idempotency-Key`.
    async fn pay_out(
        &self,
        tx: &mut Tx<'_>,
        event: &Event,
        payment: &Payment,
    ) -> Result<(), EffectError> {
        let Some((tenant, account)) = &payment.seller else {
            return Ok(());
        };
        let url = format!("{}/v1/transfers", self.payments_api);
        let transfer = Transfer {
            amount: payment.amount,
            currency: "usd",
            destination: account,
            transfer_group: format!("order_{}", payment.order_id),
        };
        let op = NewOperation::of_event(event, "transfer", &url, Vec::new())
            .form(&transfer)
            .map_err(EffectError::Permanent)?
            .credential(&format!("stripe_{tenant}"));
        outbox::enqueue(tx, &op).await?;
        Ok(())
    }
}

#[async_trait]
impl Effect for MarkOrderPaid {
    fn name(&self) -> &'static str {
        "orders"
    }

    // A span of the effect's own: run event by event, it joins the event's trace.
    #[tracing::instrument(name = "pay order", skip_all, fields(key = event.key.as_str()))]
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
        self.pay_out(tx, event, &payment).await
    }
}

fn main() -> std::process::ExitCode {
    replayproof::Cli::new()
        .with_effect("orders", MarkOrderPaid::from_env())
        .with_migration(SCHEMA)
        .run()
}

/// The effect's paths, tested as the consumer runs it with the crate's test helpers
/// (`replayproof::testing`): a database of its own for each test, on `DATABASE_URL`'s server
/// or a throwaway cluster.
#[cfg(all(test, feature = "devkit"))]
#[allow(clippy::too_many_lines)]
mod tests {
    use super::*;
    use replayproof::testing::{envelope, EffectTest, TestDatabase};
    use serde_json::json;

    async fn setup() -> (TestDatabase, EffectTest) {
        let db = TestDatabase::new(&[SCHEMA]).await.unwrap();
        let test = EffectTest::new(db.pool.clone(), MarkOrderPaid::from_env());
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

    /// A Stripe-like payments API on a local port: form-encoded transfers, one secret key per
    /// connected tenant, idempotency keys honoured as Stripe honours them (a key seen before
    /// gets the first answer again and moves no money), and a first answer of 503.
    mod payments_api {
        use axum::http::{HeaderMap, StatusCode};
        use std::collections::HashMap;
        use std::sync::{Arc, Mutex};

        /// A transfer the API made: its idempotency key, the key it was made with, its form.
        pub type Made = (String, String, String);

        #[derive(Clone, Default)]
        pub struct Api {
            made: Arc<Mutex<Vec<Made>>>,
            answered: Arc<Mutex<HashMap<String, u16>>>,
            requests: Arc<Mutex<u32>>,
        }

        pub const KEYS: [(&str, &str); 2] = [
            ("acme", "sk_test_acme_4242"),
            ("globex", "sk_test_globex_4242"),
        ];

        impl Api {
            pub async fn start() -> (Self, String) {
                let api = Self::default();
                let app = axum::Router::new()
                    .route("/v1/transfers", axum::routing::post(transfer))
                    .with_state(api.clone());
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let base = format!("http://{}", listener.local_addr().unwrap());
                tokio::spawn(async move { axum::serve(listener, app).await });
                (api, base)
            }

            pub fn made(&self) -> Vec<Made> {
                self.made.lock().unwrap().clone()
            }

            pub fn requests(&self) -> u32 {
                *self.requests.lock().unwrap()
            }
        }

        async fn transfer(
            axum::extract::State(api): axum::extract::State<Api>,
            headers: HeaderMap,
            body: String,
        ) -> StatusCode {
            let header = |name: &str| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
            };
            let first = {
                let mut n = api.requests.lock().unwrap();
                *n += 1;
                *n == 1
            };
            if first {
                return StatusCode::SERVICE_UNAVAILABLE;
            }
            if header("content-type") != "application/x-www-form-urlencoded" {
                return StatusCode::UNSUPPORTED_MEDIA_TYPE;
            }
            let bearer = header("authorization")
                .strip_prefix("Bearer ")
                .unwrap_or("");
            if !KEYS.iter().any(|(_, key)| *key == bearer) {
                return StatusCode::UNAUTHORIZED;
            }
            let key = header("idempotency-key").to_owned();
            if key.is_empty() {
                return StatusCode::BAD_REQUEST;
            }
            let mut answered = api.answered.lock().unwrap();
            let status = *answered.entry(key.clone()).or_insert_with(|| {
                api.made
                    .lock()
                    .unwrap()
                    .push((key, bearer.to_owned(), body));
                200
            });
            StatusCode::from_u16(status).unwrap()
        }
    }

    fn sale(
        key: &str,
        order_id: i64,
        amount: i64,
        tenant: &str,
    ) -> replayproof::envelope::Envelope {
        let payload = json!({
            "order_id": order_id, "amount": amount, "tenant": tenant, "account": format!("acct_{tenant}")
        });
        envelope(key, "stripe", "payment.succeeded", payload)
    }

    #[tokio::test]
    async fn a_marketplace_payment_transfers_once_to_its_seller_with_the_tenants_own_key() {
        use replayproof::dispatch::{
            outbound::Header, Credential, Credentials, DispatchSettings, Dispatcher,
        };
        let (api, base) = payments_api::Api::start().await;
        let origin = replayproof::outbox::origin(&base);
        let db = TestDatabase::new(&[SCHEMA]).await.unwrap();
        let mut test = EffectTest::new(db.pool.clone(), MarkOrderPaid { payments_api: base });
        create_order(&db, 1, 1999).await;
        create_order(&db, 2, 500).await;
        let report = test
            .deliver(&[
                sale("evt_a", 1, 1999, "acme"),
                sale("evt_b", 2, 500, "globex"),
                sale("evt_a", 1, 1999, "acme"),
            ])
            .await
            .unwrap();
        assert_eq!((report.applied, report.duplicates), (2, 1));

        let mut settings = DispatchSettings {
            backoff_base: std::time::Duration::from_millis(10),
            ..DispatchSettings::new("example")
        };
        let credentials = payments_api::KEYS.iter().map(|(tenant, key)| {
            let header = Header::secret("Authorization", &format!("Bearer {key}")).unwrap();
            let credential = Credential {
                headers: vec![header],
                origins: vec![origin.clone()],
            };
            (format!("stripe_{tenant}"), credential)
        });
        settings.outbound.credentials = Credentials(credentials.collect());
        let dispatcher = Dispatcher::build(
            settings,
            db.pool.clone(),
            replayproof::dispatch::DispatchMetrics::new(&Default::default()).unwrap(),
            Default::default(),
        )
        .unwrap();
        for _ in 0..200 {
            dispatcher.dispatch_once().await.unwrap();
            if api.made().len() == 2 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let mut made = api.made();
        made.sort();
        assert_eq!(
            made,
            vec![
                (
                    "evt_a#transfer".to_owned(),
                    "sk_test_acme_4242".to_owned(),
                    "amount=1999&currency=usd&destination=acct_acme&transfer_group=order_1"
                        .to_owned()
                ),
                (
                    "evt_b#transfer".to_owned(),
                    "sk_test_globex_4242".to_owned(),
                    "amount=500&currency=usd&destination=acct_globex&transfer_group=order_2"
                        .to_owned()
                ),
            ]
        );
        assert_eq!(
            api.requests(),
            3,
            "the 503 was retried once, with the same key"
        );
        let stored: Vec<String> =
            sqlx::query_scalar("SELECT concat_ws(' ', credential, state) FROM outbox ORDER BY 1")
                .fetch_all(&db.pool)
                .await
                .unwrap();
        assert_eq!(stored, ["stripe_acme done", "stripe_globex done"]);
    }
}

//! The `orders` example effect, through the batch transaction.

mod common;

#[path = "../examples/orders.rs"]
mod orders;

use common::{envelope, TestDb};
use replayproof::consume::{BatchProcessor, EffectRetry, RawMessage};
use serde_json::json;
use std::sync::Arc;

fn payment(offset: i64, key: &str, order_id: i64) -> RawMessage {
    RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(envelope(key, json!({"order_id": order_id}))),
    }
}

#[tokio::test]
async fn a_payment_event_pays_its_order_once() {
    let db = TestDb::new().await;
    sqlx::query(orders::SCHEMA).execute(&db.pool).await.unwrap();
    sqlx::query("INSERT INTO orders (id, amount) VALUES (1, 1999), (2, 500)")
        .execute(&db.pool)
        .await
        .unwrap();
    let p = BatchProcessor {
        pool: db.pool.clone(),
        effect: Arc::new(orders::MarkOrderPaid),
        retry: EffectRetry::default(),
    };
    let first = p
        .process("t", 0, &[payment(0, "stripe:evt_1", 1)])
        .await
        .unwrap();
    assert_eq!(first.applied, 1);
    // A replay, and a second provider event for an order already paid.
    let again = p
        .process(
            "t",
            0,
            &[payment(0, "stripe:evt_1", 1), payment(1, "stripe:evt_2", 1)],
        )
        .await
        .unwrap();
    assert_eq!((again.duplicates, again.applied), (1, 1));
    let paid: Vec<(i64, String, Option<String>)> =
        sqlx::query_as("SELECT id, status, provider_event_id FROM orders ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        paid,
        [
            (1, "paid".to_owned(), Some("stripe:evt_1".to_owned())),
            (2, "pending".to_owned(), None)
        ]
    );
}

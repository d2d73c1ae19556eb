//! Events in the states an operator acts on: applied once through the batch processor, then
//! their operations put where a test needs them.

use super::dispatcher::Downstream;
use super::{envelope, TestDb};
use replayproof::consume::{BatchProcessor, EffectRetry, RawMessage};
use replayproof::effect::{Effect, HttpOutbox};
use serde_json::json;
use std::sync::Arc;

/// The topic these events claim to come from (partition 0).
pub const TOPIC: &str = "webhooks";

/// An envelope of `key` with `payload` at `offset`.
pub fn message(offset: i64, key: &str, payload: serde_json::Value) -> RawMessage {
    RawMessage {
        offset,
        key: Some(key.as_bytes().to_vec()),
        value: Some(envelope(key, payload)),
        traceparent: None,
        headers: Default::default(),
    }
}

/// Applies `messages` with `effect`, one attempt each: a failing effect settles `failed`.
pub async fn process(db: &TestDb, effect: Arc<dyn Effect>, messages: &[RawMessage]) {
    let p = BatchProcessor::new(db.pool.clone(), effect).with_retry(EffectRetry {
        attempts: 1,
        backoff: std::time::Duration::ZERO,
    });
    p.process(TOPIC, 0, messages).await.unwrap();
}

/// Events whose one operation (`deliver`) is then put in the state given.
pub async fn operations_in(db: &TestDb, states: &[(&str, &str)]) {
    let downstream = Downstream::start().await;
    let effect = HttpOutbox {
        target_url: downstream.url(),
        reconcile_url: None,
        max_attempts: 3,
        operation_keys: Default::default(),
    };
    let messages: Vec<_> = states
        .iter()
        .enumerate()
        .map(|(i, (k, _))| message(i as i64, k, json!({"n": i})))
        .collect();
    process(db, Arc::new(effect), &messages).await;
    for (key, state) in states {
        sqlx::query("UPDATE outbox SET state = $2, attempts = 3 WHERE event_key = $1")
            .bind(key)
            .bind(state)
            .execute(&db.pool)
            .await
            .unwrap();
    }
}

//! A fake downstream for the demo: it honours idempotency keys, counts side effects per event
//! (one per distinct idempotency key that carried it), and lets every seventh new operation's
//! answer arrive only after the dispatcher stopped waiting.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
pub struct Downstream {
    /// Idempotency keys applied, with the event each carried.
    operations: Mutex<HashMap<String, String>>,
    new_operations: AtomicU64,
    slow_answers: AtomicU64,
}

impl Downstream {
    /// Serves `POST /ops` and `GET /ops/{key}` on a free port; returns its base URL.
    pub async fn start(self: &Arc<Self>) -> anyhow::Result<String> {
        let app = axum::Router::new()
            .route("/ops", axum::routing::post(post))
            .route("/ops/{key}", axum::routing::get(get))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(format!("http://{addr}"))
    }

    /// Side effects per event key.
    pub fn effects(&self) -> HashMap<String, u32> {
        let mut effects = HashMap::new();
        for event in self.operations.lock().expect("downstream lock").values() {
            *effects.entry(event.clone()).or_insert(0) += 1;
        }
        effects
    }

    /// Operations applied.
    pub fn applied(&self) -> usize {
        self.operations.lock().expect("downstream lock").len()
    }

    /// Answers that arrived after the dispatcher stopped waiting.
    pub fn slow_answers(&self) -> u64 {
        self.slow_answers.load(Ordering::Relaxed)
    }
}

async fn post(
    State(d): State<Arc<Downstream>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST;
    };
    let Ok(envelope) = serde_json::from_slice::<crate::envelope::Envelope>(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY;
    };
    // Honours the key: a repeat is answered, not applied again.
    let first = d
        .operations
        .lock()
        .expect("downstream lock")
        .insert(key.to_owned(), envelope.key.into())
        .is_none();
    if first && d.new_operations.fetch_add(1, Ordering::Relaxed) % 7 == 3 {
        d.slow_answers.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    StatusCode::OK
}

async fn get(State(d): State<Arc<Downstream>>, Path(key): Path<String>) -> StatusCode {
    let known = d
        .operations
        .lock()
        .expect("downstream lock")
        .contains_key(&key);
    if known {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

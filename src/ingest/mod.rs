//! `replayproof ingest`: the thin producer in front of the topic.
//!
//! `POST /webhooks/{source}` reads the body under a size limit, verifies the sender's
//! signature over the raw bytes, derives the event's key from its identity (namespaced by the
//! source's name), writes the envelope to the topic keyed by that key with an idempotent
//! `acks=all` producer, and answers 2xx only once the broker acknowledged the record. When the
//! broker does not acknowledge in time, the answer is 503 with `Retry-After`, and the sender's
//! retry is a harmless replay.

#[cfg(feature = "cli")]
pub mod args;
pub mod config;
mod connections;
mod metrics;
use connections::{serve, ConnectionLimits};
pub mod signature;

pub use metrics::IngestMetrics;

use crate::envelope::{Envelope, EventKey};
use anyhow::Context as _;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use config::Source;
use prometheus::Registry;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use rdkafka::ClientConfig;
use serde_json::json;
use signature::{Rejection, Verified};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How the ingress listens and produces.
#[derive(Debug, Clone)]
pub struct IngestSettings {
    pub listen: SocketAddr,
    pub brokers: String,
    pub topic: String,
    /// Passed to librdkafka last, so they override everything set here.
    pub kafka_options: Vec<(String, String)>,
    /// The largest body accepted; larger ones get 413 before any hashing.
    pub max_body_bytes: usize,
    /// How long the broker has to acknowledge a record before the answer is 503.
    pub produce_timeout: Duration,
    /// The `Retry-After` sent with a 503, in seconds.
    pub retry_after_secs: u64,
    /// Where `/metrics` is served; never on the public webhook port. None: not served.
    pub metrics_listen: Option<SocketAddr>,
    /// Verified webhooks being written to Kafka at once; more get 503 with `Retry-After` at
    /// once, so an overload costs neither unbounded memory nor the broker's time. Taken only
    /// after the body arrived and its signature checked out: a slow or unsigned sender never
    /// holds one.
    pub max_in_flight: usize,
    /// Open connections at once; past it, new connections wait in the kernel's backlog. With
    /// the body limit, this bounds the memory of bodies being read.
    pub max_connections: usize,
    /// How long a sender has to deliver its whole body; a slower one gets 408.
    pub body_timeout: Duration,
    /// How long a connection has to send a request's headers, counted from when it opened or
    /// from the previous answer: a half-sent request, and a keep-alive connection idle that
    /// long, are closed, so they cannot hold connection places.
    pub header_timeout: Duration,
}

/// Requests being written to Kafka at once before ingest answers 503 (`--max-in-flight`).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
/// Open connections at once (`--max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// A body still arriving after this long gets 408 (`--body-timeout-ms`).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection that has not sent a request's headers this long after it opened, or after its
/// last answer, is closed (`--header-timeout-ms`).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

impl IngestSettings {
    pub fn new(listen: SocketAddr, brokers: &str, topic: &str) -> Self {
        Self {
            listen,
            brokers: brokers.into(),
            topic: topic.into(),
            kafka_options: Vec::new(),
            max_body_bytes: 1024 * 1024,
            produce_timeout: Duration::from_secs(5),
            retry_after_secs: 5,
            metrics_listen: None,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
        }
    }

    /// The longest a stop waits for connections: a body still arriving, then the broker's
    /// acknowledgement. Past it, what is left is closed; a request cut off then was never
    /// answered 2xx, and its sender retries.
    fn drain_limit(&self) -> Duration {
        self.body_timeout + self.produce_timeout + Duration::from_secs(1)
    }

    /// The most bytes one envelope may take: the body, JSON-escaped at worst, and the rest.
    fn max_message_bytes(&self) -> usize {
        self.max_body_bytes * 2 + 64 * 1024
    }

    fn producer_config(&self) -> anyhow::Result<ClientConfig> {
        let mut settings = crate::kafka::producer_tuning("replayproof-ingest");
        settings.extend([
            ("linger.ms", "2".to_owned()),
            (
                "message.timeout.ms",
                self.produce_timeout.as_millis().to_string(),
            ),
            ("message.max.bytes", self.max_message_bytes().to_string()),
        ]);
        crate::kafka::client_config(
            crate::kafka::Role::Producer,
            &self.brokers,
            None,
            &settings,
            &self.kafka_options,
        )
    }
}

struct AppState {
    sources: HashMap<String, Source>,
    producer: FutureProducer,
    settings: IngestSettings,
    metrics: IngestMetrics,
    ready: AtomicBool,
    /// One permit per webhook request being handled.
    in_flight: Arc<tokio::sync::Semaphore>,
}

/// A running ingress.
pub struct Running {
    /// Where it listens; useful when the configured port was 0.
    pub addr: SocketAddr,
    /// Where `/metrics` is served, when it is.
    pub metrics_addr: Option<SocketAddr>,
    task: crate::shutdown::Running,
}

impl Running {
    /// Waits until the ingress has stopped (after its shutdown token is cancelled).
    pub async fn stopped(self) -> anyhow::Result<()> {
        self.task.stopped().await
    }
}

/// Binds the listener and serves until `shutdown` is cancelled; then stops accepting, lets the
/// requests in flight finish (each acknowledged or answered 503) and flushes the producer.
pub async fn start(
    settings: IngestSettings,
    sources: HashMap<String, Source>,
    registry: Registry,
    shutdown: CancellationToken,
) -> anyhow::Result<Running> {
    let producer: FutureProducer = settings
        .producer_config()?
        .create()
        .context("creating the Kafka producer")?;
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("listening on {}", settings.listen))?;
    let addr = listener.local_addr()?;
    let metrics = IngestMetrics::new(&registry)?;
    let metrics_addr = serve_metrics(settings.metrics_listen, registry, &shutdown).await?;
    let state = Arc::new(AppState {
        metrics,
        sources,
        producer,
        in_flight: Arc::new(tokio::sync::Semaphore::new(settings.max_in_flight.max(1))),
        settings,
        ready: AtomicBool::new(false),
    });
    tokio::spawn(watch_broker(state.clone(), shutdown.clone()));
    let mut names: Vec<&String> = state.sources.keys().collect();
    names.sort();
    tracing::info!(%addr, sources = ?names, topic = %state.settings.topic, "Accepting webhooks at /webhooks/{{source}}.");
    let app = router(state.clone());
    let limits = ConnectionLimits {
        max_connections: state.settings.max_connections,
        header_timeout: state.settings.header_timeout,
        drain_limit: state.settings.drain_limit(),
    };
    let task = crate::shutdown::Running::spawn(async move {
        serve(listener, app, limits, shutdown).await;
        let producer = state.producer.clone();
        tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(10)))
            .await?
            .context("flushing the producer")?;
        tracing::info!("The ingress stopped.");
        Ok(())
    });
    Ok(Running {
        addr,
        metrics_addr,
        task,
    })
}

/// Serves `/metrics` on its own listener, when one is configured; returns its address.
async fn serve_metrics(
    at: Option<SocketAddr>,
    registry: Registry,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<SocketAddr>> {
    let Some(at) = at else { return Ok(None) };
    let health = crate::telemetry::Health::default();
    let stopped = shutdown.clone().cancelled_owned();
    let addr = crate::telemetry::serve_metrics(at, registry, health, stopped)
        .await
        .with_context(|| format!("serving /metrics on {at}"))?;
    Ok(Some(addr))
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/webhooks/{source}", post(webhook))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Keeps `ready` true while the producer can fetch the topic's metadata from the broker.
async fn watch_broker(state: Arc<AppState>, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        let probe = state.clone();
        let ok = tokio::task::spawn_blocking(move || {
            let md = probe
                .producer
                .client()
                .fetch_metadata(Some(&probe.settings.topic), Duration::from_secs(2));
            md.is_ok_and(|m| {
                m.topics()
                    .iter()
                    .any(|t| t.error().is_none() && !t.partitions().is_empty())
            })
        })
        .await
        .unwrap_or(false);
        if state.ready.swap(ok, Ordering::Relaxed) != ok {
            tracing::info!(ready = ok, "The broker's reachability changed.");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

async fn readyz(State(state): State<Arc<AppState>>) -> (StatusCode, &'static str) {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the broker is not reachable\n",
        )
    }
}

/// The outcome of one webhook request, as answered and as counted.
enum Outcome {
    Accepted {
        key: String,
        partition: i32,
        offset: i64,
    },
    Challenge(String),
    NotFound,
    TooLarge,
    Unauthorized,
    BadRequest(String),
    Unavailable(u64),
    /// More requests in flight than allowed: 503 at once.
    Overloaded(u64),
    /// The body did not arrive within the request timeout.
    TimedOut,
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Self::Accepted { .. } => "accepted",
            Self::Challenge(_) => "challenge",
            Self::NotFound => "not_found",
            Self::TooLarge => "too_large",
            Self::Unauthorized => "unauthorized",
            Self::BadRequest(_) => "bad_request",
            Self::Unavailable(_) => "unavailable",
            Self::Overloaded(_) => "overloaded",
            Self::TimedOut => "timed_out",
        }
    }
}

impl IntoResponse for Outcome {
    fn into_response(self) -> Response {
        let error = |status: StatusCode, message: &str| {
            (status, Json(json!({ "error": message }))).into_response()
        };
        match self {
            Self::Accepted { key, partition, offset } => {
                Json(json!({ "status": "accepted", "key": key, "partition": partition, "offset": offset }))
                    .into_response()
            }
            Self::Challenge(challenge) => Json(json!({ "challenge": challenge })).into_response(),
            Self::NotFound => error(StatusCode::NOT_FOUND, "unknown source"),
            Self::TooLarge => error(StatusCode::PAYLOAD_TOO_LARGE, "the body is over the limit"),
            Self::Unauthorized => error(StatusCode::UNAUTHORIZED, "the signature could not be verified"),
            Self::BadRequest(reason) => error(StatusCode::BAD_REQUEST, &reason),
            Self::Unavailable(retry_after) => {
                retry_later(error(StatusCode::SERVICE_UNAVAILABLE, "the event could not be stored; retry later"), retry_after)
            }
            Self::Overloaded(retry_after) => {
                retry_later(error(StatusCode::SERVICE_UNAVAILABLE, "too many requests in flight; retry later"), retry_after)
            }
            Self::TimedOut => error(StatusCode::REQUEST_TIMEOUT, "the body did not arrive in time"),
        }
    }
}

/// Adds `Retry-After` to a 503, so the sender comes back rather than gives up.
fn retry_later(mut response: Response, secs: u64) -> Response {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    response
}

/// Reads the body (under its own timeout and limit), verifies it, and only then takes an
/// in-flight permit for the produce: unauthenticated or slow senders never hold one.
async fn webhook(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    let source = state.sources.get(&name);
    let label = source.map_or("unknown", |s| s.name.as_str());
    let outcome = match source {
        None => Outcome::NotFound,
        Some(source) => accept(&state, source, request).await,
    };
    state
        .metrics
        .requests
        .with_label_values(&[label, outcome.label()])
        .inc();
    outcome.into_response()
}

async fn accept(state: &AppState, source: &Source, request: Request) -> Outcome {
    let envelope = match verify(state, source, request).await {
        Ok(envelope) => envelope,
        Err(outcome) => return outcome,
    };
    let Ok(_permit) = state.in_flight.clone().try_acquire_owned() else {
        return Outcome::Overloaded(state.settings.retry_after_secs);
    };
    produce(state, envelope).await
}

/// The request's envelope, or the answer that refuses it: the body read under its timeout and
/// limit, the signature verified, the key derived and checked.
async fn verify(state: &AppState, source: &Source, request: Request) -> Result<Envelope, Outcome> {
    let (parts, body) = request.into_parts();
    let reading = read_body(body, &parts.headers, state.settings.max_body_bytes);
    let Ok(body) = tokio::time::timeout(state.settings.body_timeout, reading).await else {
        return Err(Outcome::TimedOut);
    };
    let Some(body) = body else {
        return Err(Outcome::TooLarge);
    };
    let req = signature::Request {
        headers: &parts.headers,
        body: &body,
        now: chrono::Utc::now().timestamp(),
    };
    let identity = match source
        .scheme
        .verify(&source.secrets, source.tolerance_secs, &req)
    {
        Ok(Verified::Event(identity)) => identity,
        Ok(Verified::Challenge(c)) => return Err(Outcome::Challenge(c)),
        Err(Rejection::Unauthorized(why)) => {
            tracing::info!(source = %source.name, why, "Refused a webhook: unauthorized.");
            return Err(Outcome::Unauthorized);
        }
        Err(Rejection::BadRequest(why)) => return Err(Outcome::BadRequest(why)),
    };
    let key = EventKey::try_from(format!("{}:{}", source.name, identity.id))
        .map_err(|e| Outcome::BadRequest(format!("the event id makes no valid key: {e}")))?;
    let envelope = Envelope {
        key: key.into(),
        source: source.name.clone(),
        event_type: identity.event_type,
        received_at: Some(chrono::Utc::now()),
        payload: identity.payload,
        unhashed: source
            .scheme
            .unhashed_fields()
            .iter()
            .map(|f| f.to_string())
            .collect(),
        replay_window_secs: source.replay_window_secs,
    };
    envelope
        .check_storable()
        .map_err(|unstorable| Outcome::BadRequest(unstorable.to_string()))?;
    Ok(envelope)
}

/// Reads the body, refusing (None) as soon as it is over `limit`: a declared length over the
/// limit is refused before reading anything.
async fn read_body(
    body: Body,
    headers: &http::HeaderMap,
    limit: usize,
) -> Option<axum::body::Bytes> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return None;
    }
    axum::body::to_bytes(body, limit).await.ok()
}

async fn produce(state: &AppState, envelope: Envelope) -> Outcome {
    let value = envelope.to_bytes();
    if value.len() > state.settings.max_message_bytes() {
        return Outcome::TooLarge;
    }
    let record = FutureRecord::to(&state.settings.topic)
        .key(&envelope.key)
        .payload(&value);
    let started = Instant::now();
    // The producer gives up on the record after `message.timeout.ms` (the produce timeout); the
    // outer timeout only guards against a delivery report that never comes.
    let limit = state.settings.produce_timeout + Duration::from_secs(1);
    let delivery = tokio::time::timeout(
        limit,
        state
            .producer
            .send(record, Timeout::After(state.settings.produce_timeout)),
    )
    .await;
    state
        .metrics
        .produce_seconds
        .observe(started.elapsed().as_secs_f64());
    match delivery {
        Ok(Ok(delivered)) => {
            crate::failpoint!("ingest::after_ack");
            Outcome::Accepted {
                key: envelope.key,
                partition: delivered.partition,
                offset: delivered.offset,
            }
        }
        Ok(Err((
            rdkafka::error::KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
            _,
        ))) => {
            tracing::warn!(source = %envelope.source, bytes = value.len(), "The broker refused a record as too large; answered 413.");
            Outcome::TooLarge
        }
        Ok(Err((e, _))) => {
            tracing::warn!(source = %envelope.source, error = %e, "The broker did not acknowledge a webhook; answered 503.");
            Outcome::Unavailable(state.settings.retry_after_secs)
        }
        Err(_) => {
            tracing::warn!(source = %envelope.source, "No delivery report in time; answered 503.");
            Outcome::Unavailable(state.settings.retry_after_secs)
        }
    }
}

//! `replayproof ingest`: the thin producer in front of the topic.
//!
//! `POST /webhooks/{source}` reads the body under a size limit, verifies the sender's
//! signature over the raw bytes, derives the event's key from its identity (namespaced by the
//! source's name), writes the envelope to the topic keyed by that key with an `acks=all`
//! producer, and answers 2xx only once the broker acknowledged the record. When the
//! broker does not acknowledge in time, the answer is 503 with `Retry-After`, and the sender's
//! retry is a harmless replay.

mod accepted;
#[cfg(feature = "cli")]
pub mod args;
pub mod config;
mod connections;
mod metrics;
mod readiness;
use connections::{serve, ConnectionLimits};
mod settings;
pub mod signature;

pub use metrics::IngestMetrics;
pub use settings::*;

pub use crate::shutdown::Running;

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
use serde_json::json;
use signature::{Identity, Rejection, Verified};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

struct AppState {
    sources: HashMap<String, Source>,
    producer: FutureProducer,
    settings: IngestSettings,
    metrics: IngestMetrics,
    /// What `/readyz` answers, on the webhook port and the metrics port alike: the broker's
    /// reachability and, after SIGTERM, the drain.
    health: crate::telemetry::Health,
    /// Set on SIGTERM: `/readyz` answers 503 while webhooks are still accepted, each answer
    /// closing its connection, for the shutdown delay.
    draining: AtomicBool,
    /// Cancelled when the listener closes, after the shutdown delay: a body still arriving
    /// then has [`IngestSettings::closing_body_timeout`] left at most.
    closing: CancellationToken,
    /// One permit per webhook request being handled.
    in_flight: Arc<tokio::sync::Semaphore>,
    /// Each accepted delivery's log line, rate-limited.
    accepted: accepted::AcceptedLog,
}

/// The ingress, built and checked: its producer created, its listeners bound. It accepts
/// webhooks once it runs.
pub struct Ingress {
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    state: Arc<AppState>,
    /// Stops the `/metrics` server when the ingress stops (or is dropped without running).
    metrics_stop: tokio_util::sync::DropGuard,
}

impl Ingress {
    /// Creates the producer and binds the webhook listener and, when configured, the
    /// `/metrics` one; a refused option or a taken port is an error here.
    pub async fn build(
        settings: IngestSettings,
        sources: HashMap<String, Source>,
        registry: Registry,
    ) -> anyhow::Result<Self> {
        let producer: FutureProducer = settings
            .producer_config()?
            .create()
            .context("creating the Kafka producer")?;
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("listening on {}", settings.listen))?;
        let addr = listener.local_addr()?;
        let metrics = IngestMetrics::new(&registry)?;
        // Every series at 0 from the start: one born at its first increment hides that
        // increment from `increase()`, and an alert on it misses the first one after a restart.
        for (name, source) in &sources {
            for outcome in Outcome::LABELS {
                metrics.requests.with_label_values(&[name, outcome]);
            }
            if source.scheme.carries_event_time() {
                metrics.untimed.with_label_values(&[name]);
            }
        }
        metrics
            .requests
            .with_label_values(&["unknown", "not_found"]);
        let metrics_stop = CancellationToken::new();
        let health = crate::telemetry::Health::default();
        health.report(readiness::BROKER_CHECK, Some("not reached yet".into()));
        let metrics_addr =
            serve_metrics(settings.metrics_listen, registry, &health, &metrics_stop).await?;
        let state = Arc::new(AppState {
            metrics,
            sources,
            producer,
            in_flight: Arc::new(tokio::sync::Semaphore::new(settings.max_in_flight.max(1))),
            settings,
            health,
            draining: AtomicBool::new(false),
            closing: CancellationToken::new(),
            accepted: Default::default(),
        });
        Ok(Self {
            listener,
            addr,
            metrics_addr,
            state,
            metrics_stop: metrics_stop.drop_guard(),
        })
    }

    /// Where it listens; useful when the configured port was 0.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where `/metrics` is served, when it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Serves until `shutdown` is cancelled; then answers 503 at `/readyz` while it still
    /// accepts webhooks for [`IngestSettings::shutdown_delay`], stops accepting, lets the
    /// requests in flight finish (each acknowledged or answered 503) and flushes the producer.
    /// The whole stop takes at most [`IngestSettings::worst_case_stop`].
    pub fn run_until_stopped(self, shutdown: CancellationToken) -> Running {
        let Self {
            listener,
            addr,
            state,
            metrics_stop,
            ..
        } = self;
        tokio::spawn(readiness::watch_broker(state.clone(), shutdown.clone()));
        let mut names: Vec<&String> = state.sources.keys().collect();
        names.sort();
        tracing::info!(%addr, sources = ?names, topic = %state.settings.topic, "Accepting webhooks at /webhooks/{{source}}.");
        let app = router(state.clone());
        let limits = ConnectionLimits {
            max_connections: state.settings.max_connections,
            header_timeout: state.settings.header_timeout,
            drain_limit: state.settings.drain_limit(),
        };
        tokio::spawn(readiness::drain_after(state.clone(), shutdown));
        Running::spawn(async move {
            serve(listener, app, limits, state.closing.clone()).await;
            let producer = state.producer.clone();
            let limit = state.settings.flush_limit();
            let flushed = tokio::task::spawn_blocking(move || producer.flush(limit)).await?;
            if let Err(e) = flushed {
                // Every 2xx was answered after its record's acknowledgement: what is still
                // queued belongs to requests answered 503 or cut off, whose senders retry.
                tracing::warn!(error = %e, "Records were still queued at the flush limit; their requests were not acknowledged.");
            }
            drop(metrics_stop);
            tracing::info!("The ingress stopped.");
            Ok(())
        })
    }
}

/// Serves `/metrics` on its own listener, when one is configured; returns its address.
async fn serve_metrics(
    at: Option<SocketAddr>,
    registry: Registry,
    health: &crate::telemetry::Health,
    stop: &CancellationToken,
) -> anyhow::Result<Option<SocketAddr>> {
    let Some(at) = at else { return Ok(None) };
    let health = health.clone();
    let stopped = stop.clone().cancelled_owned();
    let addr = crate::telemetry::serve_metrics(at, registry, health, stopped)
        .await
        .with_context(|| format!("serving /metrics on {at}"))?;
    Ok(Some(addr))
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/webhooks/{source}", post(webhook))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readiness::readyz))
        .route("/healthz", get(readiness::readyz))
        .with_state(state)
}

/// The outcome of one webhook request, as answered and as counted.
enum Outcome {
    Accepted {
        key: String,
        request_id: Option<String>,
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
    /// Every label a known source's requests may end with.
    const LABELS: [&'static str; 8] = [
        "accepted",
        "challenge",
        "too_large",
        "unauthorized",
        "bad_request",
        "unavailable",
        "overloaded",
        "timed_out",
    ];

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
            Self::Accepted {
                key,
                request_id,
                partition,
                offset,
            } => {
                // Written straight from the fields, without a map of values in between.
                #[derive(serde::Serialize)]
                struct Accepted<'a> {
                    status: &'static str,
                    key: &'a str,
                    request_id: Option<&'a str>,
                    partition: i32,
                    offset: i64,
                }
                Json(Accepted {
                    status: "accepted",
                    key: &key,
                    request_id: request_id.as_deref(),
                    partition,
                    offset,
                })
                .into_response()
            }
            Self::Challenge(challenge) => Json(json!({ "challenge": challenge })).into_response(),
            Self::NotFound => error(StatusCode::NOT_FOUND, "unknown source"),
            Self::TooLarge => error(StatusCode::PAYLOAD_TOO_LARGE, "the body is over the limit"),
            Self::Unauthorized => error(
                StatusCode::UNAUTHORIZED,
                "the signature could not be verified",
            ),
            Self::BadRequest(reason) => error(StatusCode::BAD_REQUEST, &reason),
            Self::Unavailable(retry_after) => retry_later(
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the event could not be stored; retry later",
                ),
                retry_after,
            ),
            Self::Overloaded(retry_after) => retry_later(
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many requests in flight; retry later",
                ),
                retry_after,
            ),
            Self::TimedOut => error(
                StatusCode::REQUEST_TIMEOUT,
                "the body did not arrive in time",
            ),
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
    let mut response = outcome.into_response();
    if state.draining.load(Ordering::Relaxed) {
        // The sender's next request opens a new connection, which the load balancer sends to
        // a member that is not stopping.
        let close = HeaderValue::from_static("close");
        response.headers_mut().insert(header::CONNECTION, close);
    }
    response
}

async fn accept(state: &AppState, source: &Source, request: Request) -> Outcome {
    let (envelope, incoming) = match verify(state, source, request).await {
        Ok(verified) => verified,
        Err(outcome) => return outcome,
    };
    let Ok(_permit) = state.in_flight.clone().try_acquire_owned() else {
        return Outcome::Overloaded(state.settings.retry_after_secs);
    };
    let span = crate::trace::ingest_span(
        &envelope.source,
        envelope.request_id.as_deref(),
        incoming.as_deref(),
    );
    tracing::Instrument::instrument(produce(state, envelope, incoming), span).await
}

/// The request's id: the provider's delivery id where it sends one (GitHub, Shopify), else a
/// load balancer's `X-Request-Id`, else a fresh random one. It names this delivery, not the
/// event: a redelivery gets another (except from GitHub, whose redeliveries keep theirs).
pub fn request_id(headers: &http::HeaderMap) -> String {
    ["x-github-delivery", "x-shopify-webhook-id", "x-request-id"]
        .into_iter()
        .filter_map(|name| headers.get(name)?.to_str().ok())
        .map(str::trim)
        .find(|id| {
            !id.is_empty()
                && id.len() <= crate::envelope::MAX_REQUEST_ID_BYTES
                && id.bytes().all(|b| b.is_ascii_graphic())
        })
        .map_or_else(|| format!("{:032x}", fastrand::u128(..)), str::to_owned)
}

/// The request's envelope and its sender's `traceparent`, or the answer that refuses it: the
/// body read under its timeout and limit, the signature verified, the key derived and checked.
async fn verify(
    state: &AppState,
    source: &Source,
    request: Request,
) -> Result<(Envelope, Option<String>), Outcome> {
    let (parts, body) = request.into_parts();
    let request_id = request_id(&parts.headers);
    let body = read_in_time(state, body, &parts.headers).await?;
    let identity = authenticate(source, &parts.headers, &body, &request_id)?;
    if identity.occurred_at.is_none() && source.scheme.carries_event_time() {
        state
            .metrics
            .untimed
            .with_label_values(&[&source.name])
            .inc();
    }
    let envelope = envelope_of(source, &parts.headers, identity, request_id)?;
    Ok((envelope, traceparent_of(&parts.headers)))
}

/// The body, read under its timeout and limit; once the listener closed, a body still
/// arriving has a short while left, so that a stop is bounded.
async fn read_in_time(
    state: &AppState,
    body: Body,
    headers: &http::HeaderMap,
) -> Result<axum::body::Bytes, Outcome> {
    let reading = read_body(body, headers, state.settings.max_body_bytes);
    let closing = async {
        state.closing.cancelled().await;
        tokio::time::sleep(state.settings.closing_body_timeout()).await;
    };
    let read = tokio::select! {
        read = tokio::time::timeout(state.settings.body_timeout, reading) => read.ok(),
        _ = closing => None,
    };
    let Some(body) = read else {
        return Err(Outcome::TimedOut);
    };
    body.ok_or(Outcome::TooLarge)
}

/// The event the signed request carries, once its signature is verified by the source's
/// scheme; a challenge is answered, a refusal logged without its detail reaching the sender.
fn authenticate(
    source: &Source,
    headers: &http::HeaderMap,
    body: &[u8],
    request_id: &str,
) -> Result<Identity, Outcome> {
    let req = signature::Request {
        headers,
        body,
        now: chrono::Utc::now().timestamp(),
    };
    match source
        .scheme
        .verify(&source.secrets, source.tolerance_secs, &req)
    {
        Ok(Verified::Event(identity)) => Ok(identity),
        Ok(Verified::Challenge(c)) => Err(Outcome::Challenge(c)),
        Err(Rejection::Unauthorized(why)) => {
            tracing::info!(source = %source.name, request_id, why, "Refused a webhook: unauthorized.");
            Err(Outcome::Unauthorized)
        }
        Err(Rejection::BadRequest(why)) => Err(Outcome::BadRequest(why)),
    }
}

/// The envelope of a verified event: its key derived from the source and the event's id, its
/// route from the field the source routes by, both checked as keys, and every value checked
/// storable, so that a refusal is a 400 now rather than a dead letter later.
fn envelope_of(
    source: &Source,
    headers: &http::HeaderMap,
    identity: Identity,
    request_id: String,
) -> Result<Envelope, Outcome> {
    let key = EventKey::try_from(format!("{}:{}", source.name, identity.id))
        .map_err(|e| Outcome::BadRequest(format!("the event id makes no valid key: {e}")))?;
    let route = source
        .route_from
        .as_ref()
        .and_then(|from| signature::route_of(from, headers, &identity.payload))
        .map(EventKey::try_from)
        .transpose()
        .map_err(|e| Outcome::BadRequest(format!("the route field makes no valid key: {e}")))?;
    let envelope = Envelope {
        route,
        key,
        source: source.name.clone(),
        event_type: identity.event_type,
        received_at: Some(chrono::Utc::now()),
        occurred_at: identity.occurred_at,
        payload: identity.payload,
        unhashed: source
            .scheme
            .unhashed_fields()
            .iter()
            .map(|f| f.to_string())
            .collect(),
        replay_window_secs: source.replay_window_secs,
        request_id: Some(request_id),
    };
    envelope
        .check_storable()
        .map_err(|unstorable| Outcome::BadRequest(unstorable.to_string()))?;
    Ok(envelope)
}

/// The sender's W3C `traceparent`, when it is valid.
fn traceparent_of(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get(crate::trace::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::trace::valid_traceparent)
        .map(str::to_owned)
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

/// Writes the envelope to the topic, with the trace context as its `traceparent` header (the
/// OpenTelemetry messaging conventions' way), and answers once the broker acknowledged it.
async fn produce(state: &AppState, envelope: Envelope, incoming: Option<String>) -> Outcome {
    let value = envelope.to_bytes();
    if value.len() > state.settings.max_message_bytes() {
        return Outcome::TooLarge;
    }
    let mut record = FutureRecord::to(&state.settings.topic)
        .key(envelope.key.as_str())
        .payload(&value);
    if let Some(traceparent) = crate::trace::outgoing(incoming.as_deref()) {
        record = record.headers(rdkafka::message::OwnedHeaders::new().insert(
            rdkafka::message::Header {
                key: crate::trace::TRACEPARENT,
                value: Some(traceparent.as_str()),
            },
        ));
    }
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
            let (partition, offset) = (delivered.partition, delivered.offset);
            state.accepted.accepted(&envelope, partition, offset);
            Outcome::Accepted {
                key: envelope.key.into(),
                request_id: envelope.request_id,
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
            tracing::warn!(source = %envelope.source, request_id = envelope.request_id.as_deref().unwrap_or_default(), error = %e, "The broker did not acknowledge a webhook; answered 503.");
            Outcome::Unavailable(state.settings.retry_after_secs)
        }
        Err(_) => {
            tracing::warn!(source = %envelope.source, "No delivery report in time; answered 503.");
            Outcome::Unavailable(state.settings.retry_after_secs)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Outcome;

    #[test]
    fn every_outcome_of_a_known_source_is_created_at_start() {
        let every = [
            Outcome::Accepted {
                key: String::new(),
                request_id: None,
                partition: 0,
                offset: 0,
            },
            Outcome::Challenge(String::new()),
            Outcome::TooLarge,
            Outcome::Unauthorized,
            Outcome::BadRequest(String::new()),
            Outcome::Unavailable(1),
            Outcome::Overloaded(1),
            Outcome::TimedOut,
        ];
        let labels: Vec<&str> = every.iter().map(Outcome::label).collect();
        assert_eq!(labels, Outcome::LABELS);
        // An unknown source's only outcome is counted under `unknown`.
        assert_eq!(Outcome::NotFound.label(), "not_found");
    }
}

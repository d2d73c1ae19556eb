//! How the ingress listens, bounds its connections and produces: the settings, their defaults,
//! and the producer's librdkafka configuration.

use rdkafka::ClientConfig;
use std::net::SocketAddr;
use std::time::Duration;

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
    /// How long, after SIGTERM, `/readyz` answers 503 while webhooks are still accepted and
    /// acknowledged, before the listener closes: the time a load balancer (a Kubernetes
    /// Service) takes to stop routing here. Zero (the default of [`IngestSettings::new`];
    /// `replayproof ingest` defaults to [`DEFAULT_SHUTDOWN_DELAY`]) closes the listener at once.
    pub shutdown_delay: Duration,
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
/// After SIGTERM, webhooks are still accepted this long while `/readyz` says 503
/// (`--shutdown-delay`).
pub const DEFAULT_SHUTDOWN_DELAY: Duration = Duration::from_secs(5);
/// Once the listener closed, a body still arriving gets at most this long before its 408,
/// whatever `--body-timeout` says, so that a stop is bounded.
pub const SHUTDOWN_BODY_TIMEOUT: Duration = Duration::from_secs(5);
/// The ingress producer's `linger.ms`.
const INGEST_LINGER_MS: &str = "0.5";
/// The ingress producer's requests in flight per broker connection.
const INGEST_MAX_IN_FLIGHT: &str = "2";
/// How long a stop waits for the producer's last records, once every request was answered.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

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
            // The command's default is DEFAULT_SHUTDOWN_DELAY; a host embedding the ingress,
            // and its tests, stop at once unless they ask.
            shutdown_delay: Duration::ZERO,
        }
    }

    /// How long a body may still take once the listener closed.
    pub(super) fn closing_body_timeout(&self) -> Duration {
        self.body_timeout.min(SHUTDOWN_BODY_TIMEOUT)
    }

    /// The longest a stop waits for connections once the listener closed: a body still
    /// arriving (capped), then the broker's acknowledgement. Past it, what is left is closed; a
    /// request cut off then was never answered 2xx, and its sender retries.
    pub(super) fn drain_limit(&self) -> Duration {
        self.closing_body_timeout() + self.produce_timeout + Duration::from_secs(1)
    }

    /// How long the producer's last records may take once every request was answered.
    pub(super) fn flush_limit(&self) -> Duration {
        FLUSH_LIMIT
    }

    /// The longest a stop takes from SIGTERM to exit: the delay, the drain, the flush. A
    /// deployment's grace period (Kubernetes' `terminationGracePeriodSeconds`) must be longer.
    pub fn worst_case_stop(&self) -> Duration {
        self.shutdown_delay + self.drain_limit() + self.flush_limit()
    }

    /// The most bytes one envelope may take: the body, JSON-escaped at worst, and the rest.
    pub(super) fn max_message_bytes(&self) -> usize {
        self.max_body_bytes * 2 + 64 * 1024
    }

    /// The producer's librdkafka configuration: replayproof's tuning, then the options, then
    /// `acks=all`, which no option changes.
    ///
    /// Tuned for many small records, each awaited by a request: `linger.ms` 0.5 sends a lone
    /// record at once, and at most 2 requests in flight per broker (`max.in.flight`) let what
    /// arrives meanwhile gather into the next request, so a busy or slow broker gets fewer,
    /// larger requests instead of more, smaller ones. Idempotence is off by default (see
    /// [`crate::kafka::Role::Ingress`]). `benches/ingest.rs` measured these against the
    /// alternatives (docs/performance.md).
    pub fn producer_config(&self) -> anyhow::Result<ClientConfig> {
        let mut settings = crate::kafka::producer_tuning("replayproof-ingest");
        settings.extend([
            ("enable.idempotence", "false".to_owned()),
            ("linger.ms", INGEST_LINGER_MS.to_owned()),
            ("max.in.flight", INGEST_MAX_IN_FLIGHT.to_owned()),
            (
                "message.timeout.ms",
                self.produce_timeout.as_millis().to_string(),
            ),
            ("message.max.bytes", self.max_message_bytes().to_string()),
        ]);
        crate::kafka::client_config(
            crate::kafka::Role::Ingress,
            &self.brokers,
            None,
            &settings,
            &self.kafka_options,
        )
    }
}

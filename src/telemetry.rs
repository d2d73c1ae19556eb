//! Logs, metrics and the small HTTP server that exposes `/metrics` and `/healthz`.

use axum::{extract::State, http::StatusCode, routing::get, Router};
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing_subscriber::EnvFilter;

/// Starts structured logging on stderr; `RUST_LOG` filters, `REPLAYPROOF_LOG_FORMAT=json`
/// switches to one JSON object a line.
pub fn init_logging() {
    init_logging_with("info,sqlx=warn,rdkafka=warn");
}

/// Like [`init_logging`], with `default` as the filter when `RUST_LOG` is not set.
pub fn init_logging_with(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let json = std::env::var("REPLAYPROOF_LOG_FORMAT").is_ok_and(|v| v == "json");
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

/// The consumer's metrics. Labels are bounded: an outcome from a fixed list, a partition.
#[derive(Clone)]
pub struct ConsumeMetrics {
    /// Events by outcome: applied, duplicate, conflict, dead_letter, failed.
    pub events: IntCounterVec,
    /// Effect attempts that returned an error, retried or not.
    pub effect_failures: IntCounter,
    /// Batches that failed on a database error and were retried.
    pub batch_retries: IntCounter,
    pub batch_size: Histogram,
    pub batch_seconds: Histogram,
    /// The last offset committed to Kafka, per partition.
    pub committed_offset: IntGaugeVec,
    /// Partitions this member owns now.
    pub assigned_partitions: IntGauge,
    /// Messages after the last applied batch, per partition.
    pub consumer_lag: IntGaugeVec,
    /// Lanes that panicked; each stops the process so its partitions move on.
    pub lane_panics: IntCounter,
    /// Errors Kafka reported while consuming, by librdkafka's error code.
    pub kafka_errors: IntCounterVec,
}

impl ConsumeMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let m = Self {
            events: IntCounterVec::new(
                Opts::new(
                    "replayproof_consume_events_total",
                    "Events consumed, by outcome.",
                ),
                &["outcome"],
            )?,
            effect_failures: IntCounter::new(
                "replayproof_effect_failures_total",
                "Effect attempts that failed.",
            )?,
            batch_retries: IntCounter::new(
                "replayproof_batch_retries_total",
                "Batches retried after a database error.",
            )?,
            batch_size: Histogram::with_opts(
                HistogramOpts::new("replayproof_batch_size", "Messages per batch.")
                    .buckets(prometheus::exponential_buckets(1.0, 2.0, 12)?),
            )?,
            batch_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "replayproof_batch_duration_seconds",
                    "Time from the start of a batch to its commit.",
                )
                .buckets(prometheus::exponential_buckets(0.0005, 2.0, 16)?),
            )?,
            committed_offset: IntGaugeVec::new(
                Opts::new(
                    "replayproof_committed_offset",
                    "The next offset to read, as last committed to Kafka.",
                ),
                &["partition"],
            )?,
            assigned_partitions: IntGauge::new(
                "replayproof_assigned_partitions",
                "Partitions assigned to this consumer.",
            )?,
            consumer_lag: IntGaugeVec::new(
                Opts::new(
                    "replayproof_consumer_lag",
                    "Messages in the partition after the last applied batch.",
                ),
                &["partition"],
            )?,
            lane_panics: IntCounter::new(
                "replayproof_lane_panics_total",
                "Partition lanes that panicked.",
            )?,
            kafka_errors: IntCounterVec::new(
                Opts::new(
                    "replayproof_kafka_consume_errors_total",
                    "Errors Kafka reported while consuming, by error code.",
                ),
                &["code"],
            )?,
        };
        registry.register(Box::new(m.events.clone()))?;
        registry.register(Box::new(m.effect_failures.clone()))?;
        registry.register(Box::new(m.batch_retries.clone()))?;
        registry.register(Box::new(m.batch_size.clone()))?;
        registry.register(Box::new(m.batch_seconds.clone()))?;
        registry.register(Box::new(m.committed_offset.clone()))?;
        registry.register(Box::new(m.assigned_partitions.clone()))?;
        registry.register(Box::new(m.consumer_lag.clone()))?;
        registry.register(Box::new(m.lane_panics.clone()))?;
        registry.register(Box::new(m.kafka_errors.clone()))?;
        Ok(m)
    }

    /// Counts what one committed batch did.
    pub fn record(&self, report: &crate::consume::BatchReport) {
        let outcomes = [
            ("applied", report.applied),
            ("duplicate", report.duplicates),
            ("conflict", report.conflicts),
            ("dead_letter", report.dead_letters.len()),
            ("failed", report.failed),
        ];
        for (outcome, n) in outcomes {
            if n > 0 {
                self.events.with_label_values(&[outcome]).inc_by(n as u64);
            }
        }
        self.effect_failures.inc_by(report.effect_errors as u64);
    }
}

/// Whether the process is doing its job. `/healthz` answers 503, naming each problem, while a
/// check reports one or a heartbeat is overdue: a supervisor can restart what is stuck.
#[derive(Clone, Default)]
pub struct Health(Arc<Mutex<Checks>>);

#[derive(Default)]
struct Checks {
    /// Problems reported by name; a check clears its own with `None`.
    problems: BTreeMap<&'static str, String>,
    /// Heartbeats by name: the last beat and how old it may grow.
    beats: BTreeMap<&'static str, (Instant, Duration)>,
}

impl Health {
    /// Records a check's finding: `Some(problem)` makes the process unhealthy until the same
    /// check reports `None`.
    pub fn report(&self, check: &'static str, problem: Option<String>) {
        let mut checks = self.0.lock().expect("health lock");
        match problem {
            Some(p) => checks.problems.insert(check, p),
            None => checks.problems.remove(check),
        };
    }

    /// Records that a loop turned; once a beat is older than `max_age`, the process is
    /// unhealthy until the next one.
    pub fn beat(&self, check: &'static str, max_age: Duration) {
        let mut checks = self.0.lock().expect("health lock");
        checks.beats.insert(check, (Instant::now(), max_age));
    }

    /// Forgets a heartbeat, for a loop that ended on purpose.
    pub fn forget(&self, check: &'static str) {
        self.0.lock().expect("health lock").beats.remove(check);
    }

    /// What is wrong now, one sentence each; empty when healthy.
    pub fn problems(&self) -> Vec<String> {
        let checks = self.0.lock().expect("health lock");
        let stale = checks.beats.iter().filter_map(|(name, (at, max))| {
            let age = at.elapsed();
            (age > *max).then(|| format!("{name}: no progress for {} s", age.as_secs()))
        });
        let reported = checks
            .problems
            .iter()
            .map(|(name, problem)| format!("{name}: {problem}"));
        reported.chain(stale).collect()
    }

    pub fn is_healthy(&self) -> bool {
        self.problems().is_empty()
    }
}

#[derive(Clone)]
struct ServerState {
    registry: Registry,
    health: Health,
}

/// Serves `/metrics` and `/healthz` until `shutdown` resolves. Returns the bound address, which
/// matters when the configured port is 0.
pub async fn serve_metrics(
    addr: SocketAddr,
    registry: Registry,
    health: Health,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(ServerState { registry, health });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "The metrics server stopped.");
        }
    });
    Ok(bound)
}

async fn metrics(State(state): State<ServerState>) -> (StatusCode, String) {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&state.registry.gather(), &mut buf) {
        Ok(()) => (StatusCode::OK, String::from_utf8_lossy(&buf).into_owned()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn healthz(State(state): State<ServerState>) -> (StatusCode, String) {
    let problems = state.health.problems();
    if problems.is_empty() {
        (StatusCode::OK, "ok\n".into())
    } else {
        let mut body = problems.join("\n");
        body.push('\n');
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

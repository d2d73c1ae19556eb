//! Logging, the small HTTP server that exposes a process's `/metrics`, `/livez` and `/readyz`
//! (`/healthz` is the old name of `/readyz`), and the probe that asks one of them from outside.

use axum::{extract::State, http::StatusCode, routing::get, Router};
use prometheus::{Encoder, Registry, TextEncoder};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing_subscriber::EnvFilter;

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum LogFormat {
    /// Human-readable lines, coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object a line, for a log pipeline.
    Json,
}

/// Starts structured logging on stderr in `format`; `RUST_LOG` filters.
pub fn init_logging(format: LogFormat) {
    init_logging_with("info,sqlx=warn,rdkafka=warn", format);
}

/// Like [`init_logging`], with `default` as the filter when `RUST_LOG` is not set.
pub fn init_logging_with(default: &str, format: LogFormat) {
    init_telemetry(default, format, "replayproof");
}

/// Logging as [`init_logging_with`] sets it up and, with the `otel` feature and an OTLP
/// endpoint in the environment ([`crate::trace`]), the export of spans, as the service
/// `service` unless `OTEL_SERVICE_NAME` names another. Call before the async runtime starts;
/// [`crate::trace::shutdown`] exports the last spans at the end.
pub fn init_telemetry(default: &str, format: LogFormat, service: &str) {
    use std::io::IsTerminal as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Every line passes through the scrubber: a registered secret never reaches the log.
    let lines = tracing_subscriber::fmt::layer().with_writer(crate::secrets::scrubbing_stderr);
    let lines = match format {
        // `message` and the event's fields at the top level of each object, as log pipelines
        // expect them.
        LogFormat::Json => lines.json().flatten_event(true).with_filter(filter).boxed(),
        LogFormat::Text => lines
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter)
            .boxed(),
    };
    let registry = tracing_subscriber::registry().with(lines);
    #[cfg(feature = "otel")]
    let (registry, problem) = {
        match crate::trace::otel::layer(service) {
            Ok(Some(layer)) => {
                let (spans, bad_filter) = traces_filter();
                let problem = bad_filter.map(|e| {
                    let message = "REPLAYPROOF_TRACES_FILTER is not a filter: the default chooses the exported spans.";
                    (message, e)
                });
                (registry.with(Some(layer.with_filter(spans))), problem)
            }
            Ok(None) => (registry.with(None), None),
            Err(e) => {
                let message = "Traces are not exported: the OTLP exporter could not start.";
                (registry.with(None), Some((message, format!("{e:#}"))))
            }
        }
    };
    #[cfg(not(feature = "otel"))]
    let (problem, _) = (None::<(&str, String)>, service);
    let _ = registry.try_init();
    if let Some((message, error)) = problem {
        tracing::warn!(error, "{message}");
    }
}

/// Which spans are exported, in `RUST_LOG`'s syntax; [`TRACES_FILTER`] by default.
pub const TRACES_FILTER_VAR: &str = "REPLAYPROOF_TRACES_FILTER";

/// The spans exported by default: replayproof's and an application's own (an effect's
/// `#[instrument]` spans join the event's trace) at `info`, the database and Kafka clients only
/// at `warn`, and none of the HTTP client's or the exporter's own, which would trace the
/// export itself.
pub const TRACES_FILTER: &str = "info,sqlx=warn,rdkafka=warn,hyper=off,hyper_util=off,h2=off,\
                                 reqwest=off,tower=off,opentelemetry=off,opentelemetry_sdk=off,\
                                 opentelemetry_otlp=off,opentelemetry_http=off";

/// The filter of the exported spans: [`TRACES_FILTER_VAR`] when it is set, else
/// [`TRACES_FILTER`]; the default and the parse error when the variable is not a filter.
#[cfg(feature = "otel")]
fn traces_filter() -> (EnvFilter, Option<String>) {
    match std::env::var(TRACES_FILTER_VAR) {
        Ok(directives) if !directives.trim().is_empty() => match EnvFilter::try_new(&directives) {
            Ok(filter) => (filter, None),
            Err(e) => (EnvFilter::new(TRACES_FILTER), Some(e.to_string())),
        },
        _ => (EnvFilter::new(TRACES_FILTER), None),
    }
}

/// Registers what every long-running role exports besides its own metrics:
/// `replayproof_build_info{version, librdkafka, role}` = 1, and the process's CPU, memory, open
/// files and start time (`process_*`).
pub fn register_process_metrics(registry: &Registry, role: &str) -> prometheus::Result<()> {
    let info = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "replayproof_build_info",
            "Always 1; the labels say which build runs in which role.",
        ),
        &["version", "librdkafka", "role"],
    )?;
    let (_, librdkafka) = rdkafka::util::get_rdkafka_version();
    info.with_label_values(&[env!("CARGO_PKG_VERSION"), &librdkafka, role])
        .set(1);
    registry.register(Box::new(info))?;
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    Ok(())
}

/// What a process says to its two probes. `/readyz` (and its old name `/healthz`) answers 503,
/// naming each problem, while any check reports one: the process cannot do its work now, for
/// whatever reason, so a load balancer or a disruption budget should not count on it. `/livez`
/// answers 503 only for what a restart of this process would mend: a loop that stopped
/// turning (a stale heartbeat) or a problem reported as [`Probe::Live`]. A dependency that is
/// down for everyone is never a liveness problem: restarting every member fixes nothing.
#[derive(Clone, Default)]
pub struct Health(Arc<Mutex<Checks>>);

/// Which probes a reported problem fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The process cannot do its work now (a dependency does not answer, it has not joined its
    /// group yet, it is draining): `/readyz` fails, `/livez` does not.
    Ready,
    /// The process is wedged while its dependencies answer: `/livez` fails too, so a
    /// supervisor restarts it.
    Live,
}

#[derive(Default)]
struct Checks {
    /// Problems reported by name, each with the probes it fails; a check clears its own with
    /// `None`.
    problems: BTreeMap<&'static str, (Probe, String)>,
    /// Heartbeats by name: the last beat and how old it may grow. A stale one fails both
    /// probes.
    beats: BTreeMap<&'static str, (Instant, Duration)>,
}

impl Health {
    /// Records a check's finding: `Some(problem)` makes the process not ready until the same
    /// check reports `None`.
    pub fn report(&self, check: &'static str, problem: Option<String>) {
        self.report_as(check, Probe::Ready, problem);
    }

    /// Records a finding that fails the probes `probe` names.
    pub fn report_as(&self, check: &'static str, probe: Probe, problem: Option<String>) {
        let mut checks = self.0.lock().expect("health lock");
        match problem {
            Some(p) => checks.problems.insert(check, (probe, p)),
            None => checks.problems.remove(check),
        };
    }

    /// Records that a loop turned; once a beat is older than `max_age`, the process is
    /// neither live nor ready until the next one.
    pub fn beat(&self, check: &'static str, max_age: Duration) {
        let mut checks = self.0.lock().expect("health lock");
        checks.beats.insert(check, (Instant::now(), max_age));
    }

    /// Forgets a heartbeat, for a loop that ended on purpose.
    pub fn forget(&self, check: &'static str) {
        self.0.lock().expect("health lock").beats.remove(check);
    }

    /// What keeps the process from being ready now, one sentence each; empty when ready.
    pub fn problems(&self) -> Vec<String> {
        self.named(|_| true)
    }

    /// What says the process is wedged, one sentence each; empty when live.
    pub fn liveness_problems(&self) -> Vec<String> {
        self.named(|probe| probe == Probe::Live)
    }

    fn named(&self, counts: impl Fn(Probe) -> bool) -> Vec<String> {
        let checks = self.0.lock().expect("health lock");
        let stale = checks.beats.iter().filter_map(|(name, (at, max))| {
            let age = at.elapsed();
            (age > *max).then(|| format!("{name}: no progress for {} s", age.as_secs()))
        });
        let reported = checks
            .problems
            .iter()
            .filter(|(_, (probe, _))| counts(*probe))
            .map(|(name, (_, problem))| format!("{name}: {problem}"));
        reported.chain(stale).collect()
    }

    /// What `/readyz` answers: 200 `ok`, or 503 with one line per problem.
    pub fn ready_answer(&self) -> (StatusCode, String) {
        answer(self.problems())
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.problems().is_empty()
    }

    /// Whether `/livez` answers 200.
    pub fn is_live(&self) -> bool {
        self.liveness_problems().is_empty()
    }

    /// The old name of [`Health::is_ready`].
    pub fn is_healthy(&self) -> bool {
        self.is_ready()
    }
}

#[derive(Clone)]
struct ServerState {
    registry: Registry,
    health: Health,
}

/// Serves `/metrics`, `/livez`, `/readyz` and `/healthz` until `shutdown` resolves. Returns the bound address, which
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
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/healthz", get(readyz))
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

/// Serves `/metrics` and the probes until `shutdown` is cancelled, and returns the [`Health`]
/// they read: the start of every long-running role.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    shutdown: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<Health> {
    let health = Health::default();
    let stopped = shutdown.clone().cancelled_owned();
    let addr = serve_metrics(addr, registry, health.clone(), stopped)
        .await
        .map_err(|e| e.context("starting the metrics server"))?;
    tracing::info!(%addr, "Serving /metrics, /livez and /readyz.");
    Ok(health)
}

async fn metrics(State(state): State<ServerState>) -> (StatusCode, String) {
    let mut buf = Vec::new();
    match TextEncoder::new().encode(&state.registry.gather(), &mut buf) {
        Ok(()) => (StatusCode::OK, String::from_utf8_lossy(&buf).into_owned()),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

async fn readyz(State(state): State<ServerState>) -> (StatusCode, String) {
    state.health.ready_answer()
}

async fn livez(State(state): State<ServerState>) -> (StatusCode, String) {
    answer(state.health.liveness_problems())
}

/// 200 `ok`, or 503 with one line per problem.
fn answer(problems: Vec<String>) -> (StatusCode, String) {
    if problems.is_empty() {
        (StatusCode::OK, "ok\n".into())
    } else {
        let mut body = problems.join("\n");
        body.push('\n');
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

/// `replayproof probe`: succeeds when `url` (a `/livez` or `/readyz`) answers 2xx within five seconds, for
/// images without curl.
pub async fn probe(url: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let status = client.get(url).send().await?.status();
    anyhow::ensure!(status.is_success(), "{url} answered {status}");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_traces_filter_parses_whole() {
        // `EnvFilter::new` skips a directive it cannot parse; `try_new` refuses it.
        let filter = tracing_subscriber::EnvFilter::try_new(super::TRACES_FILTER).unwrap();
        let text = filter.to_string();
        for directive in ["sqlx=warn", "reqwest=off", "opentelemetry_sdk=off", "info"] {
            assert!(text.contains(directive), "{directive} missing from {text}");
        }
    }
}

//! The `otel` feature: spans exported over OTLP/HTTP, configured by the standard variables.
//!
//! - `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`): where spans go;
//!   unset, nothing is exported and no span is made.
//! - `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf` (the default) or `http/json`.
//! - `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`: the resource; the service is
//!   `replayproof-<command>` unless named.
//! - `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`: the sampler (parent-based, always on,
//!   by default); `OTEL_BSP_*`: the batch exporter's delay and sizes;
//!   `OTEL_EXPORTER_OTLP_HEADERS`: headers such as an API key; `OTEL_SDK_DISABLED=true`: off.
//!
//! Every exported span passes the secret scrubber first ([`super::scrubbed`]), as every log
//! line does.

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

static EXPORTING: AtomicBool = AtomicBool::new(false);
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Whether an exporter is running.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Whether the environment asks for traces: an endpoint is set and the SDK is not disabled.
pub fn configured(env: &dyn Fn(&str) -> Option<String>) -> bool {
    let set = |name: &str| env(name).is_some_and(|v| !v.trim().is_empty());
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let no_exporter = env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim() == "none");
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && !disabled
        && !no_exporter
}

/// The OTLP protocol `OTEL_EXPORTER_OTLP_PROTOCOL` names; gRPC is not built in.
fn protocol(name: Option<String>) -> anyhow::Result<opentelemetry_otlp::Protocol> {
    match name.as_deref().map(str::trim) {
        None | Some("" | "http/protobuf") => Ok(opentelemetry_otlp::Protocol::HttpBinary),
        Some("http/json") => Ok(opentelemetry_otlp::Protocol::HttpJson),
        Some(other) => anyhow::bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported: use http/protobuf or http/json \
             (a collector's port 4318)"
        ),
    }
}

/// The layer that turns the project's spans into exported ones, when the environment asks
/// for traces; `service` names the process unless `OTEL_SERVICE_NAME` does. Starts the
/// exporter (its own thread): call before the async runtime starts.
pub fn layer<S>(service: &str) -> anyhow::Result<Option<impl tracing_subscriber::Layer<S>>>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let env = |name: &str| std::env::var(name).ok();
    if !configured(&env) {
        return Ok(None);
    }
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol(env("OTEL_EXPORTER_OTLP_PROTOCOL"))?)
        .build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none_or(|v| v.trim().is_empty()) {
        resource = resource.with_service_name(service.to_owned());
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(super::scrubbed::Scrubbed(exporter))
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("replayproof");
    let _ = PROVIDER.set(provider);
    EXPORTING.store(true, Ordering::Relaxed);
    Ok(Some(tracing_opentelemetry::layer().with_tracer(tracer)))
}

/// Exports what is still buffered and stops the exporter: at the end of the process.
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get() {
        EXPORTING.store(false, Ordering::Relaxed);
        if let Err(e) = provider.shutdown() {
            tracing::warn!(error = %e, "Could not export the last spans.");
        }
    }
}

/// The context a valid `traceparent` names.
pub fn context_of(traceparent: Option<&str>) -> Option<Context> {
    let traceparent = traceparent.and_then(super::valid_traceparent)?;
    let carrier = HashMap::from([(super::TRACEPARENT.to_owned(), traceparent.to_owned())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes `span` a child of the context `traceparent` names, when it names one.
pub fn continue_from(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(cx) = context_of(traceparent) {
        let _ = span.set_parent(cx);
    }
}

/// Links `span` to the context `traceparent` names (a batch span to each of its messages).
pub fn link(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(cx) = context_of(traceparent) {
        span.add_link(cx.span().span_context().clone());
    }
}

/// The `traceparent` of `span`, when it is a span of an exported trace.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(super::TRACEPARENT)
}

/// The `traceparent` of the current span, when traces are exported.
pub fn current_traceparent() -> Option<String> {
    if !exporting() {
        return None;
    }
    traceparent_of(&tracing::Span::current())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_variables_switch_it_on_and_off() {
        let with = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(!configured(&with(&[])));
        assert!(configured(&with(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://c:4318"
        )])));
        assert!(configured(&with(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://c:4318/v1/traces"
        )])));
        assert!(!configured(&with(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_SDK_DISABLED", "true")
        ])));
        assert!(!configured(&with(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_TRACES_EXPORTER", "none")
        ])));
        assert!(protocol(None).is_ok());
        assert!(protocol(Some("http/json".into())).is_ok());
        assert!(protocol(Some("grpc".into())).is_err());
    }

    #[test]
    fn a_traceparent_goes_in_and_comes_out_the_same() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = context_of(Some(tp)).unwrap();
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        assert_eq!(carrier[super::super::TRACEPARENT], tp);
        assert!(context_of(Some("00-0-0-0")).is_none());
    }
}

//! The exporter that scrubs every registered secret ([`crate::secrets::scrub`]) from what a
//! span carries before it leaves the process: its name, its fields and status, its events (a
//! log line inside a span becomes one) and its links' attributes. The log writer scrubs
//! stderr; this is the same rule for the spans exported over OTLP.

use crate::secrets::scrub;
use opentelemetry::trace::Status;
use opentelemetry::{Array, KeyValue, StringValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use std::borrow::Cow;
use std::time::Duration;

/// Wraps an exporter: each batch is scrubbed, then handed on.
#[derive(Debug)]
pub struct Scrubbed<E>(pub E);

impl<E: SpanExporter> SpanExporter for Scrubbed<E> {
    fn export(
        &self,
        mut batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        batch.iter_mut().for_each(scrub_span);
        self.0.export(batch)
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource)
    }
}

/// `span` with every registered secret replaced wherever it holds text.
pub fn scrub_span(span: &mut SpanData) {
    scrub_cow(&mut span.name);
    span.attributes.iter_mut().for_each(scrub_field);
    for event in span.events.events.iter_mut() {
        scrub_cow(&mut event.name);
        event.attributes.iter_mut().for_each(scrub_field);
    }
    for link in span.links.links.iter_mut() {
        link.attributes.iter_mut().for_each(scrub_field);
    }
    if let Status::Error { description } = &mut span.status {
        scrub_cow(description);
    }
}

fn scrub_cow(text: &mut Cow<'static, str>) {
    if let Cow::Owned(clean) = scrub(text) {
        *text = Cow::Owned(clean);
    }
}

fn scrub_field(field: &mut KeyValue) {
    match &mut field.value {
        Value::String(text) => scrub_string(text),
        Value::Array(Array::String(texts)) => texts.iter_mut().for_each(scrub_string),
        _ => {}
    }
}

fn scrub_string(text: &mut StringValue) {
    if let Cow::Owned(clean) = scrub(text.as_str()) {
        *text = StringValue::from(clean);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Event, SpanContext, SpanId, SpanKind};
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};

    fn span(text: &str) -> SpanData {
        let mut events = SpanEvents::default();
        events.events.push(Event::new(
            text.to_owned(),
            std::time::SystemTime::now(),
            vec![KeyValue::new("message", text.to_owned())],
            0,
        ));
        SpanData {
            span_context: SpanContext::empty_context(),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Owned(text.to_owned()),
            start_time: std::time::SystemTime::now(),
            end_time: std::time::SystemTime::now(),
            attributes: vec![
                KeyValue::new("error", text.to_owned()),
                KeyValue::new("n", 3),
                KeyValue::new(
                    "urls",
                    Value::Array(vec![StringValue::from(text.to_owned())].into()),
                ),
            ],
            dropped_attributes_count: 0,
            events,
            links: SpanLinks::default(),
            status: Status::error(text.to_owned()),
            instrumentation_scope: Default::default(),
        }
    }

    #[test]
    fn a_registered_secret_leaves_no_part_of_a_span() {
        crate::secrets::register("sp4n-s3cret-token");
        let mut data = span("posting to https://x/hooks/sp4n-s3cret-token failed");
        scrub_span(&mut data);
        let shown = format!("{data:?}");
        assert!(!shown.contains("sp4n-s3cret-token"), "{shown}");
        assert!(shown.contains(crate::secrets::REDACTED), "{shown}");
        assert!(
            shown.contains("https://x/hooks/"),
            "the rest stays: {shown}"
        );
    }
}

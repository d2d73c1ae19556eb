//! W3C trace context across the hops: the ingress writes a `traceparent` Kafka header, the
//! consumer reads it into the event, an outbox operation stores it, and the dispatcher sends
//! it downstream. With the `otel` feature and an OTLP endpoint configured, each hop is also a
//! span of that trace; without, the sender's trace context still travels through unchanged.

#[cfg(feature = "otel")]
pub mod otel;
#[cfg(feature = "otel")]
pub mod scrubbed;

/// The `traceparent` header's name, in HTTP and in Kafka.
pub const TRACEPARENT: &str = "traceparent";

/// `text` when it is a valid W3C `traceparent` of version 00 (`00-<trace id>-<parent id>-<flags>`,
/// lowercase hex, neither id all zeros).
pub fn valid_traceparent(text: &str) -> Option<&str> {
    let parts: Vec<&str> = text.trim().split('-').collect();
    let [version, trace_id, parent_id, flags] = parts[..] else {
        return None;
    };
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let zero = |s: &str| s.bytes().all(|b| b == b'0');
    (version == "00"
        && hex(trace_id, 32)
        && hex(parent_id, 16)
        && hex(flags, 2)
        && !zero(trace_id)
        && !zero(parent_id))
    .then_some(text.trim())
}

/// The trace id of a valid `traceparent`.
pub fn trace_id(traceparent: &str) -> Option<&str> {
    valid_traceparent(traceparent).map(|t| &t[3..35])
}

/// The `traceparent` to send onwards from the current span: its own context when a span of
/// an exported trace is current, else `inherited` (the context that arrived) unchanged.
pub fn outgoing(inherited: Option<&str>) -> Option<String> {
    #[cfg(feature = "otel")]
    if let Some(current) = otel::current_traceparent() {
        return Some(current);
    }
    inherited.and_then(valid_traceparent).map(str::to_owned)
}

/// Exports the spans still buffered: at the end of the process.
pub fn shutdown() {
    #[cfg(feature = "otel")]
    otel::shutdown();
}

/// Whether spans are exported: only then are the spans below made at all, so that without an
/// endpoint tracing costs nothing per request.
pub fn exporting() -> bool {
    #[cfg(feature = "otel")]
    return otel::exporting();
    #[cfg(not(feature = "otel"))]
    false
}

/// The ingress's span of one webhook request, continuing the sender's `traceparent`.
pub fn ingest_span(
    source: &str,
    request_id: Option<&str>,
    incoming: Option<&str>,
) -> tracing::Span {
    if !exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "webhook",
        otel.name = format!("POST /webhooks/{source}"),
        otel.kind = "server",
        source,
        request_id,
    );
    continued(span, incoming)
}

/// `span`, made a child of the context `traceparent` names when it names one.
fn continued(span: tracing::Span, traceparent: Option<&str>) -> tracing::Span {
    #[cfg(feature = "otel")]
    otel::continue_from(&span, traceparent);
    #[cfg(not(feature = "otel"))]
    let _ = traceparent;
    span
}

/// The consumer's span of one event (from `source`, keyed `key`), a child of the trace its
/// message carries (`traceparent`), when traces are exported. Returned with the span's own
/// `traceparent`, which the event carries on so that its outbox operations continue from it;
/// `traceparent` itself when the span has none to give.
pub fn event_span(
    source: &str,
    key: &str,
    request_id: Option<&str>,
    traceparent: Option<String>,
) -> (Option<tracing::Span>, Option<String>) {
    if !exporting() {
        return (None, traceparent);
    }
    let span = tracing::info_span!(
        "event",
        otel.name = format!("claim and apply {source}"),
        otel.kind = "consumer",
        key,
        request_id,
    );
    let span = continued(span, traceparent.as_deref());
    #[cfg(feature = "otel")]
    let traceparent = otel::traceparent_of(&span).or(traceparent);
    (Some(span), traceparent)
}

/// Links the current span (a batch's) to each message's trace, when traces are exported.
pub fn link_current<'a>(traceparents: impl Iterator<Item = Option<&'a str>>) {
    if !exporting() {
        return;
    }
    #[cfg(feature = "otel")]
    {
        let span = tracing::Span::current();
        for traceparent in traceparents {
            otel::link(&span, traceparent);
        }
    }
    #[cfg(not(feature = "otel"))]
    let _ = traceparents.count();
}

/// The span of one outbox request, continuing the event's trace.
pub fn dispatch_span(
    operation_key: &str,
    method: &str,
    origin: &str,
    inherited: Option<&str>,
) -> tracing::Span {
    if !exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "dispatch",
        otel.name = format!("{method} {origin}"),
        otel.kind = "client",
        operation = operation_key,
        http.request.method = method,
        server.address = origin,
    );
    continued(span, inherited)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_well_formed_traceparent_is_carried() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(valid_traceparent(good), Some(good));
        assert_eq!(trace_id(good), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xx",
        ] {
            assert_eq!(valid_traceparent(bad), None, "{bad}");
        }
    }
}

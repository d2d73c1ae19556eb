//! A collector for the test: an OTLP/HTTP receiver (`POST /v1/traces`, the JSON encoding)
//! that decodes every span the processes export.

use axum::extract::State;
use axum::http::StatusCode;
use serde_json::Value;
use std::sync::{Arc, Mutex};

/// One exported span, as the trace is put back together from.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// Each link's trace and span id.
    pub links: Vec<(String, String)>,
}

/// The variables that send a process's spans to the test's collector, flushed every 100 ms.
pub fn traced(cmd: &mut tokio::process::Command, endpoint: &str) {
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_SERVICE_NAME");
}

#[derive(Clone, Default)]
pub struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
    /// Every request body as it arrived, to look for what must never be exported.
    bodies: Arc<Mutex<Vec<String>>>,
}

impl Collector {
    /// Starts the receiver; its endpoint is the `OTEL_EXPORTER_OTLP_ENDPOINT` to give.
    pub async fn start() -> (Self, String) {
        let me = Self::default();
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(receive))
            .with_state(me.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (me, endpoint)
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// Every exported body, whole.
    pub fn bodies(&self) -> Vec<String> {
        self.bodies.lock().unwrap().clone()
    }
}

async fn receive(State(me): State<Collector>, body: String) -> (StatusCode, &'static str) {
    me.bodies.lock().unwrap().push(body.clone());
    let Ok(request) = serde_json::from_str::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "{}");
    };
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut decoded = Vec::new();
    for resource in request["resourceSpans"].as_array().into_iter().flatten() {
        let service = resource["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .map(|a| text(&a["value"]["stringValue"]))
            .unwrap_or_default();
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            for span in scope["spans"].as_array().into_iter().flatten() {
                decoded.push(Span {
                    service: service.clone(),
                    name: text(&span["name"]),
                    trace_id: text(&span["traceId"]),
                    span_id: text(&span["spanId"]),
                    parent_span_id: text(&span["parentSpanId"]),
                    links: span["links"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|l| (text(&l["traceId"]), text(&l["spanId"])))
                        .collect(),
                });
            }
        }
    }
    me.spans.lock().unwrap().extend(decoded);
    (StatusCode::OK, "{}")
}

//! A downstream that records every request as it arrived (method, path, headers, body, time)
//! and answers as told: the other end of the dispatcher's real requests, its limits, and the
//! trace context it sends.

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How the recorder answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// 200.
    Ok,
    /// This status.
    Status(u16),
    /// 200 after holding the request this long.
    SlowOk(Duration),
    /// 429 with `Retry-After` this many seconds, once; then 200.
    ThrottleOnce(u64),
}

/// One request as it arrived.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: Method,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Default)]
struct Inner {
    received: Vec<Received>,
    answer: Option<Answer>,
    in_flight: u32,
    max_in_flight: u32,
}

#[derive(Clone)]
pub struct Recorder {
    pub addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
}

impl Recorder {
    pub async fn start(answer: Answer) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let me = Self {
            addr: listener.local_addr().unwrap(),
            inner: Arc::new(Mutex::new(Inner {
                answer: Some(answer),
                ..Inner::default()
            })),
        };
        let app = axum::Router::new().fallback(record).with_state(me.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        me
    }

    /// `http://127.0.0.1:PORT`: the origin its limits are configured under.
    pub fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.origin())
    }

    pub fn answer(&self, answer: Answer) {
        self.inner.lock().unwrap().answer = Some(answer);
    }

    pub fn received(&self) -> Vec<Received> {
        self.inner.lock().unwrap().received.clone()
    }

    /// The most requests it held at once.
    pub fn max_in_flight(&self) -> u32 {
        self.inner.lock().unwrap().max_in_flight
    }
}

async fn record(State(me): State<Recorder>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let answer = {
        let mut inner = me.inner.lock().unwrap();
        inner.received.push(Received {
            method: parts.method,
            path: parts.uri.path().to_owned(),
            headers: parts.headers,
            body,
            at: Instant::now(),
        });
        inner.in_flight += 1;
        inner.max_in_flight = inner.max_in_flight.max(inner.in_flight);
        let answer = inner.answer.unwrap_or(Answer::Ok);
        if let Answer::ThrottleOnce(_) = answer {
            inner.answer = Some(Answer::Ok);
        }
        answer
    };
    let response = match answer {
        Answer::Ok => StatusCode::OK.into_response(),
        Answer::Status(code) => StatusCode::from_u16(code).unwrap().into_response(),
        Answer::SlowOk(hold) => {
            tokio::time::sleep(hold).await;
            StatusCode::OK.into_response()
        }
        Answer::ThrottleOnce(secs) => (
            StatusCode::TOO_MANY_REQUESTS,
            [("retry-after", secs.to_string())],
        )
            .into_response(),
    };
    me.inner.lock().unwrap().in_flight -= 1;
    response
}

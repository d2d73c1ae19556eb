//! The outbox side: operations enqueued through the consume transaction, and a fake
//! downstream HTTP server that honours idempotency keys like Stripe's API does, counts
//! side effects per key, and misbehaves on demand.

use super::{envelope, TestDb};
use replayproof::consume::{BatchProcessor, RawMessage};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the downstream does with one POST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Applies the operation (once per key) and answers 200.
    Ok,
    /// Applies the operation, then closes the connection without an answer.
    ApplyThenDrop,
    /// Answers this status without applying anything; 429 comes with `Retry-After: 1`.
    Refuse(u16),
    /// Applies the operation and never answers.
    Hang,
    /// Answers 503 with this `Retry-After` value, applying nothing.
    RetryAfter(&'static str),
    /// Answers a redirect with this status to `/elsewhere`, applying nothing.
    Redirect(u16),
    /// Answers this status with this body, applying nothing.
    RefuseWithBody(u16, &'static [u8]),
    /// Answers this status with a body of this many bytes, written as fast as the client
    /// reads it, applying nothing; [`Downstream::streamed`] tells how much was taken.
    Huge(u16, usize),
}

#[derive(Default)]
struct State {
    /// Side effects per idempotency key: how many times the operation really happened.
    applied: HashMap<String, u32>,
    /// Every body received per key, in order.
    bodies: HashMap<String, Vec<Vec<u8>>>,
    /// POSTs without an idempotency key.
    unkeyed: u32,
    in_flight: HashMap<String, u32>,
    max_in_flight: u32,
    reconciles: u32,
    /// Requests that followed a redirect to `/elsewhere`.
    followed_redirects: u32,
    /// Lookups (GET) answered with a redirect to `/elsewhere`.
    redirect_lookups: bool,
    /// Bytes of huge answers the clients took, and whether every such answer has ended.
    streamed: usize,
    streaming: u32,
    script: HashMap<String, VecDeque<Behaviour>>,
    /// How long a key is honoured; None: forever. Past it, the same key applies again.
    key_window: Option<Duration>,
    /// When each key was last applied.
    applied_at: HashMap<String, std::time::Instant>,
    /// Lookups (GET) answered 503: the downstream cannot say.
    lookups_unknown: bool,
}

#[derive(Clone)]
pub struct Downstream {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
}

impl Downstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let me = Self {
            addr: listener.local_addr().unwrap(),
            state: Arc::default(),
        };
        let server = me.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(server.clone().serve(stream));
            }
        });
        me
    }

    pub fn url(&self) -> String {
        format!("http://{}/ops", self.addr)
    }

    pub fn reconcile_url(&self) -> String {
        format!("http://{}/ops/{{key}}", self.addr)
    }

    /// The behaviours of the next POSTs with `key`, in order; `Ok` once they run out.
    pub fn script(&self, key: &str, behaviours: &[Behaviour]) {
        self.state
            .lock()
            .unwrap()
            .script
            .insert(key.into(), behaviours.iter().copied().collect());
    }

    /// Honours each idempotency key for `window` only, as Stripe does for 24 hours: past it,
    /// a request with the same key is applied again.
    pub fn forget_keys_after(&self, window: Duration) {
        self.state.lock().unwrap().key_window = Some(window);
    }

    /// Lookups (GET) answer 503 while `unknown`: the downstream cannot say.
    pub fn lookups_unknown(&self, unknown: bool) {
        self.state.lock().unwrap().lookups_unknown = unknown;
    }

    pub fn applied(&self) -> HashMap<String, u32> {
        self.state.lock().unwrap().applied.clone()
    }

    pub fn bodies(&self) -> HashMap<String, Vec<Vec<u8>>> {
        self.state.lock().unwrap().bodies.clone()
    }

    pub fn unkeyed(&self) -> u32 {
        self.state.lock().unwrap().unkeyed
    }

    /// The most requests ever in flight at once for one key.
    pub fn max_in_flight(&self) -> u32 {
        self.state.lock().unwrap().max_in_flight
    }

    pub fn in_flight(&self) -> u32 {
        self.state.lock().unwrap().in_flight.values().sum()
    }

    /// Answers every lookup (reconcile GET) with a redirect from now on.
    pub fn redirect_lookups(&self) {
        self.state.lock().unwrap().redirect_lookups = true;
    }

    pub fn followed_redirects(&self) -> u32 {
        self.state.lock().unwrap().followed_redirects
    }

    pub fn reconciles(&self) -> u32 {
        self.state.lock().unwrap().reconciles
    }

    /// Bytes of huge answers written to clients, once no huge answer is still being written.
    pub fn streamed(&self) -> Option<usize> {
        let s = self.state.lock().unwrap();
        (s.streaming == 0).then_some(s.streamed)
    }

    /// POSTs received for `key`, whatever was answered.
    pub fn requests(&self, key: &str) -> usize {
        self.state
            .lock()
            .unwrap()
            .bodies
            .get(key)
            .map_or(0, Vec::len)
    }

    async fn serve(self, mut stream: TcpStream) {
        let Some((method, path, key, body)) = read_request(&mut stream).await else {
            return;
        };
        if path == "/elsewhere" {
            self.state.lock().unwrap().followed_redirects += 1;
            let _ = respond(&mut stream, 200).await;
            return;
        }
        if method == "GET" && self.state.lock().unwrap().redirect_lookups {
            let location = format!("Location: http://{}/elsewhere\r\n", self.addr);
            let _ = respond_with(&mut stream, 302, &location).await;
            return;
        }
        if method == "GET" && self.state.lock().unwrap().lookups_unknown {
            self.state.lock().unwrap().reconciles += 1;
            let _ = respond(&mut stream, 503).await;
            return;
        }
        if method == "GET" {
            let key = path.trim_start_matches("/ops/");
            let key = percent_encoding::percent_decode_str(key)
                .decode_utf8_lossy()
                .into_owned();
            let known = {
                let mut s = self.state.lock().unwrap();
                s.reconciles += 1;
                s.applied.contains_key(&key)
            };
            let _ = respond(&mut stream, if known { 200 } else { 404 }).await;
            return;
        }
        let Some(key) = key else {
            self.state.lock().unwrap().unkeyed += 1;
            let _ = respond(&mut stream, 400).await;
            return;
        };
        let behaviour = {
            let mut s = self.state.lock().unwrap();
            s.bodies.entry(key.clone()).or_default().push(body);
            let n = s.in_flight.entry(key.clone()).or_default();
            *n += 1;
            let n = *n;
            s.max_in_flight = s.max_in_flight.max(n);
            s.script
                .get_mut(&key)
                .and_then(VecDeque::pop_front)
                .unwrap_or(Behaviour::Ok)
        };
        let apply = |s: &mut State| {
            let now = std::time::Instant::now();
            let forgotten = match (s.key_window, s.applied_at.get(&key)) {
                (Some(window), Some(at)) => now.duration_since(*at) >= window,
                _ => false,
            };
            let n = s.applied.entry(key.clone()).or_insert(0);
            if *n == 0 || forgotten {
                *n += 1;
                s.applied_at.insert(key.clone(), now);
            }
        };
        match behaviour {
            Behaviour::Ok => {
                apply(&mut self.state.lock().unwrap());
                self.done(&key);
                let _ = respond(&mut stream, 200).await;
            }
            Behaviour::ApplyThenDrop => {
                apply(&mut self.state.lock().unwrap());
                self.done(&key);
                drop(stream);
            }
            Behaviour::Refuse(status) => {
                self.done(&key);
                let _ = respond(&mut stream, status).await;
            }
            Behaviour::RetryAfter(value) => {
                self.done(&key);
                let _ = respond_with(&mut stream, 503, &format!("Retry-After: {value}\r\n")).await;
            }
            Behaviour::Redirect(status) => {
                self.done(&key);
                let location = format!("Location: http://{}/elsewhere\r\n", self.addr);
                let _ = respond_with(&mut stream, status, &location).await;
            }
            Behaviour::RefuseWithBody(status, body) => {
                self.done(&key);
                let head = format!(
                    "HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body).await;
                let _ = stream.shutdown().await;
            }
            Behaviour::Huge(status, size) => {
                self.done(&key);
                self.state.lock().unwrap().streaming += 1;
                let written = write_huge(&mut stream, status, size).await;
                let mut s = self.state.lock().unwrap();
                s.streamed += written;
                s.streaming -= 1;
            }
            Behaviour::Hang => {
                apply(&mut self.state.lock().unwrap());
                // Holds the connection until the client gives up.
                let mut buf = [0u8; 1];
                let _ = tokio::time::timeout(Duration::from_secs(120), stream.read(&mut buf)).await;
                self.done(&key);
            }
        }
    }

    fn done(&self, key: &str) {
        if let Some(n) = self.state.lock().unwrap().in_flight.get_mut(key) {
            *n -= 1;
        }
    }
}

async fn read_request(stream: &mut TcpStream) -> Option<(String, String, Option<String>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.lines();
    let mut first = lines.next()?.split_whitespace();
    let (method, path) = (first.next()?.to_owned(), first.next()?.to_owned());
    let mut length = 0;
    let mut key = None;
    for line in lines {
        if let Some((name, value)) = line.split_once(':') {
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = value.trim().parse().ok()?,
                "idempotency-key" => key = Some(value.trim().to_owned()),
                _ => {}
            }
        }
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((method, path, key, body))
}

/// Writes a `status` answer with a body of `size` bytes in 64 KiB chunks until the client stops
/// reading; returns the body bytes written.
async fn write_huge(stream: &mut TcpStream, status: u16, size: usize) -> usize {
    let head = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: text/plain\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
    );
    if stream.write_all(head.as_bytes()).await.is_err() {
        return 0;
    }
    let chunk = vec![b'x'; 64 * 1024];
    let mut written = 0;
    while written < size {
        let n = chunk.len().min(size - written);
        let write = stream.write_all(&chunk[..n]);
        match tokio::time::timeout(Duration::from_secs(5), write).await {
            Ok(Ok(())) => written += n,
            _ => break,
        }
    }
    written
}

async fn respond(stream: &mut TcpStream, status: u16) -> std::io::Result<()> {
    let extra = if status == 429 {
        "Retry-After: 1\r\n"
    } else {
        ""
    };
    respond_with(stream, status, extra).await
}

async fn respond_with(stream: &mut TcpStream, status: u16, extra: &str) -> std::io::Result<()> {
    let body = format!("{{\"status\":{status}}}");
    let response = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// A claim for `key`, so that operations can hang off it.
pub async fn claim(db: &TestDb, key: &str) {
    sqlx::query(
        "INSERT INTO processed_events (event_key, route_key, source, status, payload_sha256, \
         payload, kafka_topic, kafka_partition, kafka_offset) \
         VALUES ($1, $1, 's', 'done', decode(repeat('00', 32), 'hex'), '{}', 't', 0, 0)",
    )
    .bind(key)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// A dispatcher of `db` with the default settings, driven by its test.
pub fn dispatcher_of(db: &TestDb) -> replayproof::dispatch::Dispatcher {
    replayproof::dispatch::Dispatcher::build(
        replayproof::dispatch::DispatchSettings::new("w"),
        db.pool.clone(),
        replayproof::dispatch::DispatchMetrics::new(&prometheus::Registry::new()).unwrap(),
        replayproof::telemetry::Health::default(),
    )
    .unwrap()
}

/// Claims `keys` through the consume transaction with the http effect, which enqueues one
/// `deliver` operation each to `downstream` (with its reconcile URL when `reconcile`).
pub async fn enqueue_http(db: &TestDb, downstream: &Downstream, keys: &[String], reconcile: bool) {
    let reconcile = reconcile.then(|| downstream.reconcile_url());
    enqueue_to(db, &downstream.url(), reconcile, keys).await;
}

/// Like [`enqueue_http`], to any target URL.
pub async fn enqueue_to(
    db: &TestDb,
    target_url: &str,
    reconcile_url: Option<String>,
    keys: &[String],
) {
    let effect = replayproof::effect::HttpOutbox {
        target_url: target_url.into(),
        reconcile_url,
        max_attempts: 8,
        operation_keys: Default::default(),
    };
    let processor = BatchProcessor::new(db.pool.clone(), Arc::new(effect));
    let messages: Vec<RawMessage> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| RawMessage {
            offset: i as i64,
            key: Some(k.as_bytes().to_vec()),
            value: Some(envelope(k, serde_json::json!({"n": i}))),
            traceparent: None,
            headers: Default::default(),
        })
        .collect();
    for chunk in messages.chunks(100) {
        processor.process("t", 0, chunk).await.unwrap();
    }
}

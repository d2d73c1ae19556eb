//! Test helpers: a fresh database per test, a broker per test, producers, processes, an
//! ingress envelope builder and a fake downstream.

pub mod console;
pub mod database;
pub mod dispatcher;
pub mod effects;
pub mod ingress;
#[cfg(feature = "failpoints")]
pub mod isolation;
pub mod kafka;
pub mod operator;
pub mod otlp;
pub mod processes;
pub mod recorder;
pub mod tls;

pub use database::*;
pub use dispatcher::{enqueue_http, enqueue_to};
pub use effects::LedgerAndOutbox;
pub use ingress::*;
pub use kafka::*;
pub use processes::*;
pub use tls::*;

use std::future::Future;
use std::time::{Duration, Instant};

/// Held by the scenarios that run several processes against timeouts (kills, stalls, storms,
/// failpoint children): they run one at a time, so that on a two-core machine they do not
/// starve each other into timing out, while the light tests run beside them.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    HEAVY.lock().await
}

/// A name no other test uses, for topics, groups and databases.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{:08x}", std::process::id(), fastrand::u32(..))
}

/// The sum of a metric's samples across labels (counters, gauges, histogram counts).
pub fn metric_value(registry: &prometheus::Registry, name: &str) -> f64 {
    use prometheus::proto::MetricType;
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter().map(move |m| (f.get_field_type(), m)))
        .map(|(kind, m)| match kind {
            MetricType::COUNTER => m.get_counter().get_value(),
            MetricType::GAUGE => m.get_gauge().get_value(),
            _ => m.get_histogram().get_sample_count() as f64,
        })
        .sum()
}

/// Waits until the ingress at `base` answers 200 at `/readyz`, failing the test after 60 s.
pub async fn wait_ready(http: &reqwest::Client, base: &str) {
    wait_for(
        "the ingress to be ready",
        Duration::from_secs(60),
        || async {
            http.get(format!("{base}/readyz"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
}

/// Polls `check` until it is true, failing the test after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A free TCP port on 127.0.0.1, for a process's metrics server.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An address on 127.0.0.1 that refuses connections for as long as the socket lives: it is
/// bound, so no other test or process can take the port, and never listens.
pub fn refusing_address() -> (tokio::net::TcpSocket, std::net::SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    (socket, addr)
}

/// GET `http://127.0.0.1:{port}{path}`: the status and body, or None when nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let r = reqwest::get(format!("http://127.0.0.1:{port}{path}"))
        .await
        .ok()?;
    Some((r.status().as_u16(), r.text().await.ok()?))
}

/// The value of an unlabelled (or summed) metric in a Prometheus text page. `name` may hold
/// the first labels too (`x{outcome="a"`): the series with more labels after them are summed.
pub fn scraped(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with([' ', '{', ',']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

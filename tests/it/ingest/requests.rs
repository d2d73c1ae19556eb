//! The ingress over HTTP, producing to a real Kafka-protocol broker (the mock cluster).

use crate::harness::*;
use futures_util::StreamExt as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use replayproof::ingest::config::FileConfig;
use replayproof::ingest::{self, IngestSettings};
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const CONFIG: &str = r#"
[[sources]]
name = "github"
kind = "github"
secrets_env = ["GITHUB"]

[[sources]]
name = "stripe"
kind = "stripe"
secrets_env = ["STRIPE_OLD", "STRIPE"]

[[sources]]
name = "slack"
kind = "slack"
secrets_env = ["SLACK_SIGNING"]

[[sources]]
name = "svix"
kind = "standard-webhooks"
secrets_env = ["SVIX"]

[[sources]]
name = "shopify"
kind = "shopify"
secrets_env = ["SHOPIFY"]

[[sources]]
name = "github-unguarded"
kind = "github"
secrets_env = ["GITHUB"]
replay_window_secs = 0
"#;

/// The Standard Webhooks source's key, before base64.
const SVIX_KEY: &[u8] = b"secret-of-SVIX-standard";

fn secret(name: &str) -> Option<String> {
    use base64::Engine as _;
    Some(match name {
        "SVIX" => format!(
            "whsec_{}",
            base64::engine::general_purpose::STANDARD.encode(SVIX_KEY)
        ),
        _ => format!("secret-of-{name}"),
    })
}

struct Ingress {
    base: String,
    shutdown: CancellationToken,
    running: Option<ingest::Running>,
    metrics_addr: Option<std::net::SocketAddr>,
    http: reqwest::Client,
}

impl Ingress {
    async fn start(brokers: &str, topic: &str, tweak: impl FnOnce(&mut IngestSettings)) -> Self {
        let sources = toml::from_str::<FileConfig>(CONFIG)
            .unwrap()
            .sources_with(secret)
            .unwrap();
        let mut settings = IngestSettings::new("127.0.0.1:0".parse().unwrap(), brokers, topic);
        settings.kafka_options = vec![("broker.address.family".into(), "v4".into())];
        tweak(&mut settings);
        let shutdown = CancellationToken::new();
        let ingress = ingest::Ingress::build(settings, sources, prometheus::Registry::new())
            .await
            .unwrap();
        let (addr, metrics_addr) = (ingress.addr(), ingress.metrics_addr());
        let running = ingress.run_until_stopped(shutdown.clone());
        Self {
            base: format!("http://{addr}"),
            metrics_addr,
            shutdown,
            running: Some(running),
            http: reqwest::Client::new(),
        }
    }

    /// A POST to `source`'s webhook path.
    fn post(&self, source: &str) -> reqwest::RequestBuilder {
        self.http.post(format!("{}/webhooks/{source}", self.base))
    }

    async fn github(&self, delivery: &str, body: &[u8]) -> reqwest::Response {
        let body_text = std::str::from_utf8(body).unwrap();
        let sig = replayproof::devkit::sign::github("secret-of-GITHUB", body_text);
        self.post("github")
            .header("x-hub-signature-256", sig)
            .header("x-github-delivery", delivery)
            .header("x-github-event", "push")
            .body(body.to_vec())
            .send()
            .await
            .unwrap()
    }

    /// A delivery signed as Stripe signs, sent at `t`.
    fn stripe_request(&self, secret: &str, t: i64, body: &[u8]) -> reqwest::RequestBuilder {
        let body_text = std::str::from_utf8(body).unwrap();
        let header = replayproof::devkit::sign::stripe(secret, &t.to_string(), body_text);
        self.post("stripe")
            .header("stripe-signature", header)
            .body(body.to_vec())
    }

    async fn stripe(&self, secret: &str, t: i64, body: &[u8]) -> reqwest::Response {
        self.stripe_request(secret, t, body).send().await.unwrap()
    }

    async fn probe(&self, path: &str) -> u16 {
        reqwest::Client::new()
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    }

    async fn readyz(&self) -> u16 {
        let r = self
            .http
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .unwrap();
        r.status().as_u16()
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        self.running.take().unwrap().stopped().await.unwrap();
    }

    /// Stops the ingress, then reads what it produced.
    async fn stop_and_read(self, brokers: &str, topic: &str) -> Vec<(String, serde_json::Value)> {
        parsed(self.stop_and_read_raw(brokers, topic).await)
    }

    /// Stops the ingress, then reads what it produced, each value as its bytes.
    async fn stop_and_read_raw(self, brokers: &str, topic: &str) -> Vec<(String, Vec<u8>)> {
        self.stop().await;
        let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || raw_records(&brokers, &topic))
            .await
            .unwrap()
    }
}

/// The topic's records, as (key, value), in partition 0.
fn records(brokers: &str, topic: &str) -> Vec<(String, serde_json::Value)> {
    parsed(raw_records(brokers, topic))
}

/// Records with their values parsed.
fn parsed(raw: Vec<(String, Vec<u8>)>) -> Vec<(String, serde_json::Value)> {
    raw.into_iter()
        .map(|(key, value)| (key, serde_json::from_slice(&value).unwrap()))
        .collect()
}

/// The topic's records, as (key, value bytes), in partition 0.
fn raw_records(brokers: &str, topic: &str) -> Vec<(String, Vec<u8>)> {
    let consumer: BaseConsumer = client_config(brokers)
        .set("group.id", unique("reader"))
        .create()
        .unwrap();
    let (_, high) = consumer
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    while (out.len() as i64) < high {
        if let Some(m) = consumer.poll(Duration::from_secs(5)) {
            let m = m.unwrap();
            let key = String::from_utf8(m.key().unwrap().to_vec()).unwrap();
            out.push((key, m.payload().unwrap().to_vec()));
        }
    }
    out
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_delivery_sent_three_times_is_three_records_with_one_key_and_one_effect() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&kafka.brokers(), &topic, |_| {}).await;
    let body = br#"{"ref":"refs/heads/main","commits":[]}"#;
    for _ in 0..3 {
        let r = ingress.github("72d3162e-cc78-11e3", body).await;
        assert_eq!(r.status(), 200);
        let answer: serde_json::Value = r.json().await.unwrap();
        assert_eq!(answer["key"], "github:72d3162e-cc78-11e3");
    }
    let (b, t) = (kafka.brokers(), topic.clone());
    let recs = tokio::task::spawn_blocking(move || records(&b, &t))
        .await
        .unwrap();
    assert_eq!(recs.len(), 3);
    for (key, value) in &recs {
        assert_eq!(key, "github:72d3162e-cc78-11e3");
        assert_eq!(value["key"], "github:72d3162e-cc78-11e3");
        assert_eq!(value["source"], "github");
        assert_eq!(value["type"], "push");
        assert_eq!(value["payload"]["ref"], "refs/heads/main");
    }
    let consumer = InProcessConsumer::start(
        settings(&kafka.brokers(), &topic, &unique("g")),
        db.pool.clone(),
    );
    assert_exactly_once(
        &db,
        &HashSet::from(["github:72d3162e-cc78-11e3".to_owned()]),
        Duration::from_secs(60),
    )
    .await;
    wait_for("all three consumed", Duration::from_secs(60), || async {
        consumer.metric("replayproof_consume_events_total") >= 3.0
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM ledger").await, 1);
    consumer.stop().await;
    ingress.stop().await;
}

/// A request the ingress must refuse (or answer without producing), and the status it gets.
struct Case {
    what: &'static str,
    request: reqwest::RequestBuilder,
    status: u16,
}

impl Ingress {
    /// The bad requests of the fault matrix, each with the status it must get.
    fn bad_requests(&self, secret: &str) -> Vec<Case> {
        let valid = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
        let t = now();
        let signed = replayproof::devkit::sign::stripe(
            secret,
            &t.to_string(),
            std::str::from_utf8(valid).unwrap(),
        );
        let sig = signed.split_once(",v1=").unwrap().1.to_owned();
        let big = format!(r#"{{"id":"evt_big","pad":"{}"}}"#, "x".repeat(2000));
        let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
            vec![Ok(vec![b'x'; 800]), Ok(vec![b'x'; 800])];
        let streamed = reqwest::Body::wrap_stream(futures_util::stream::iter(chunks));
        let stripe_with = |header: String, body: &[u8]| {
            self.post("stripe")
                .header("stripe-signature", header)
                .body(body.to_vec())
        };
        let challenge = br#"{"type":"url_verification","challenge":"c-123"}"#;
        let slack_sig = format!(
            "v0={}",
            hmac_hex(
                "secret-of-SLACK_SIGNING",
                &[b"v0:", t.to_string().as_bytes(), b":", challenge]
            )
        );
        vec![
            Case {
                what: "malformed JSON with a valid signature",
                request: self.stripe_request(secret, t, b"{not json"),
                status: 400,
            },
            Case {
                what: "no event id",
                request: self.stripe_request(secret, t, br#"{"type":"x"}"#),
                status: 400,
            },
            Case {
                what: "a body over the limit",
                request: self.stripe_request(secret, t, big.as_bytes()),
                status: 413,
            },
            Case {
                what: "a body streamed past the limit without a length",
                request: self
                    .post("github")
                    .header("x-hub-signature-256", "sha256=00")
                    .body(streamed),
                status: 413,
            },
            Case {
                what: "the wrong secret",
                request: self.stripe_request("not-the-secret", t, valid),
                status: 401,
            },
            Case {
                what: "a re-serialised body",
                request: stripe_with(
                    signed.clone(),
                    br#"{"id": "evt_1", "type": "charge.succeeded"}"#,
                ),
                status: 401,
            },
            Case {
                what: "an empty v1",
                request: stripe_with(format!("t={t},v1="), valid),
                status: 401,
            },
            Case {
                what: "a truncated v1",
                request: stripe_with(format!("t={t},v1={}", &sig[..40]), valid),
                status: 401,
            },
            Case {
                what: "v0 only",
                request: stripe_with(format!("t={t},v0={sig}"), valid),
                status: 401,
            },
            Case {
                what: "a signature an hour old",
                request: self.stripe_request(secret, t - 3600, valid),
                status: 401,
            },
            Case {
                what: "skew just past the tolerance, behind",
                request: self.stripe_request(secret, t - 320, valid),
                status: 401,
            },
            Case {
                what: "skew just past the tolerance, ahead",
                request: self.stripe_request(secret, t + 320, valid),
                status: 401,
            },
            Case {
                what: "an unknown source",
                request: self.post("nope").body("{}"),
                status: 404,
            },
            Case {
                what: "another method",
                request: self.http.get(format!("{}/webhooks/stripe", self.base)),
                status: 405,
            },
            Case {
                what: "no signature",
                request: self.post("github").body("{}"),
                status: 401,
            },
            Case {
                what: "Slack's url_verification, answered without producing",
                request: self
                    .post("slack")
                    .header("x-slack-request-timestamp", t.to_string())
                    .header("x-slack-signature", slack_sig)
                    .body(challenge.to_vec()),
                status: 200,
            },
        ]
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_their_status_and_produce_nothing() {
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&kafka.brokers(), &topic, |s| s.max_body_bytes = 1024).await;
    let secret = "secret-of-STRIPE";
    for case in ingress.bad_requests(secret) {
        let answer = case.request.send().await.unwrap();
        assert_eq!(answer.status(), case.status, "{}", case.what);
        let said = answer.text().await.unwrap();
        // A refusal says nothing of the secret or the signature's parts.
        assert!(
            !said.contains("secret-of") && !said.contains("timestamp"),
            "{}: {said}",
            case.what
        );
        if case.status == 200 {
            assert_eq!(
                serde_json::from_str::<serde_json::Value>(&said).unwrap(),
                json!({"challenge": "c-123"})
            );
        }
    }
    let (b, tp) = (kafka.brokers(), topic.clone());
    assert!(
        tokio::task::spawn_blocking(move || records(&b, &tp))
            .await
            .unwrap()
            .is_empty(),
        "nothing was produced"
    );
    // Within the tolerance (and with the older of two rotated secrets) the same event passes.
    let valid = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
    assert_eq!(
        ingress.stripe(secret, now() - 290, valid).await.status(),
        200
    );
    assert_eq!(
        ingress
            .stripe("secret-of-STRIPE_OLD", now() - 290, valid)
            .await
            .status(),
        200
    );
    ingress.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_gives_503_with_retry_after_and_back_up_gives_2xx() {
    let TestKafka::Mock(kafka) = TestKafka::mock() else {
        unreachable!()
    };
    let brokers = kafka.bootstrap_servers();
    let topic = unique("webhooks");
    kafka.create_topic(&topic, 1).unwrap();
    let ingress = Ingress::start(&brokers, &topic, |s| {
        s.produce_timeout = Duration::from_millis(1500)
    })
    .await;
    assert_eq!(ingress.github("before", b"{}").await.status(), 200);
    wait_for("ready", Duration::from_secs(30), || async {
        ingress.readyz().await == 200
    })
    .await;

    kafka.set_broker_up(false).unwrap();
    let down = ingress.github("during", b"{}").await;
    assert_eq!(down.status(), 503);
    assert_eq!(down.headers()["retry-after"], "5");
    wait_for("not ready", Duration::from_secs(30), || async {
        ingress.readyz().await == 503
    })
    .await;
    // The broker is down for everyone: restarting the ingress mends nothing.
    assert_eq!(ingress.probe("/livez").await, 200);
    assert_eq!(ingress.probe("/healthz").await, 503, "/healthz is /readyz");

    kafka.set_broker_up(true).unwrap();
    // The sender retries until it gets a 2xx, as senders do.
    let mut answered = 0;
    for _ in 0..20 {
        answered = ingress.github("during", b"{}").await.status().as_u16();
        if answered == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(answered, 200);
    let recs = ingress.stop_and_read(&brokers, &topic).await;
    let keys: HashSet<String> = recs.into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        HashSet::from(["github:before".to_owned(), "github:during".to_owned()])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_postgresql_cannot_store_gets_400_with_a_reason_and_produces_nothing() {
    let kafka = TestKafka::mock();
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |_| {}).await;
    let nul_in_json = br#"{"id":"evt_nul","type":"customer.updated","name":"a\u0000b"}"#;
    let stripe = ingress.stripe("secret-of-STRIPE", now(), nul_in_json).await;
    assert_eq!(stripe.status(), 400);
    let said: serde_json::Value = stripe.json().await.unwrap();
    assert!(
        said["error"].as_str().unwrap().contains("NUL"),
        "the reason is named: {said}"
    );
    // A body that is not JSON is kept as text; a NUL byte in it cannot be stored either.
    assert_eq!(ingress.github("nul-bytes", b"a\0b").await.status(), 400);
    // An escaped backslash is ordinary text.
    let fine = br#"{"id":"evt_ok","name":"a\\u0000b"}"#;
    assert_eq!(
        ingress
            .stripe("secret-of-STRIPE", now(), fine)
            .await
            .status(),
        200
    );
    let recs = ingress.stop_and_read(&brokers, &topic).await;
    let keys: Vec<String> = recs.into_iter().map(|(k, _)| k).collect();
    assert_eq!(keys, ["stripe:evt_ok"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_on_their_own_listener_not_the_webhook_port() {
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let mut ingress = Ingress::start(&kafka.brokers(), &topic, |s| {
        s.metrics_listen = Some("127.0.0.1:0".parse().unwrap())
    })
    .await;
    let at = ingress.metrics_addr.unwrap();
    let scrape = || async move {
        let page = reqwest::get(format!("http://{at}/metrics")).await.unwrap();
        page.text().await.unwrap()
    };
    // Before any request, every series a known source may count is there at 0: the first
    // unauthorized request after a restart is an increase an alert sees.
    let page = scrape().await;
    for outcome in ["accepted", "unauthorized", "unavailable", "timed_out"] {
        let line = format!(
            r#"replayproof_ingest_requests_total{{outcome="{outcome}",source="github"}} 0"#
        );
        assert!(page.lines().any(|l| l == line), "{line} in {page}");
    }
    assert_eq!(ingress.github("m-1", b"{}").await.status(), 200);
    let public = ingress
        .http
        .get(format!("{}/metrics", ingress.base))
        .send()
        .await
        .unwrap();
    assert_eq!(public.status(), 404, "no metrics on the public port");
    let page = scrape().await;
    assert!(
        page.contains(r#"replayproof_ingest_requests_total{outcome="accepted",source="github"} 1"#),
        "{page}"
    );
    // A Stripe event without its `created` time is counted: a late redelivery of it after
    // prune could not be caught as an expired replay. One with it, Unix or RFC 3339, is not.
    let untimed = r#"replayproof_ingest_events_without_time_total{source="stripe"}"#;
    assert!(page.contains(&format!("{untimed} 0")), "{page}");
    for body in [
        &br#"{"id":"evt_t1","created":1700000000}"#[..],
        br#"{"id":"evt_t2","created":"2023-11-14T22:13:20Z"}"#,
        br#"{"id":"evt_t3"}"#,
    ] {
        let answer = ingress.stripe("secret-of-STRIPE", now(), body).await;
        assert_eq!(answer.status(), 200);
    }
    assert!(scrape().await.contains(&format!("{untimed} 1")));
    ingress.shutdown.cancel();
    ingress.running.take().unwrap().stopped().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_gets_503_at_once_while_a_produce_holds_the_only_place() {
    let TestKafka::Mock(kafka) = TestKafka::mock() else {
        unreachable!()
    };
    let topic = unique("webhooks");
    kafka.create_topic(&topic, 1).unwrap();
    let ingress = Ingress::start(&kafka.bootstrap_servers(), &topic, |s| {
        s.max_in_flight = 1;
        s.produce_timeout = Duration::from_secs(3);
    })
    .await;
    assert_eq!(ingress.github("before", b"{}").await.status(), 200);
    // With the broker gone, a verified webhook waits for its acknowledgement in the only place.
    kafka.set_broker_up(false).unwrap();
    let waiting = {
        let (http, base) = (ingress.http.clone(), ingress.base.clone());
        let sig = replayproof::devkit::sign::github("secret-of-GITHUB", "{}");
        tokio::spawn(async move {
            http.post(format!("{base}/webhooks/github"))
                .header("x-hub-signature-256", sig)
                .header("x-github-delivery", "waiting")
                .body("{}")
                .send()
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    let shed = ingress.github("shed", b"{}").await;
    assert_eq!(shed.status(), 503);
    assert_eq!(shed.headers()["retry-after"], "5");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "answered at once"
    );
    assert_eq!(waiting.await.unwrap().status(), 503, "not acknowledged");
    kafka.set_broker_up(true).unwrap();
    ingress.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_and_holds_no_place_meanwhile() {
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&kafka.brokers(), &topic, |s| {
        s.max_in_flight = 1;
        s.body_timeout = Duration::from_millis(1500);
    })
    .await;
    // A sender that starts its body and never finishes it.
    let stalled_body = futures_util::stream::iter([Ok::<_, std::io::Error>(b"{\"id\":".to_vec())])
        .chain(futures_util::stream::pending());
    let stalled = ingress
        .http
        .post(format!("{}/webhooks/github", ingress.base))
        .header("x-github-delivery", "stalled")
        .body(reqwest::Body::wrap_stream(stalled_body))
        .send();
    let stalled = tokio::spawn(stalled);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ingress.github("meanwhile", b"{}").await.status(), 200);
    let stalled = stalled.await.unwrap().unwrap();
    assert_eq!(stalled.status(), 408);
    ingress.stop().await;
}

/// Opens a connection and sends `head` (perhaps not all of a request), then keeps it open.
async fn connection_sending(addr: &str, head: &[u8]) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt as _;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head).await.unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_unsigned_senders_never_starve_signed_ones() {
    use tokio::io::AsyncWriteExt as _;
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&kafka.brokers(), &topic, |s| {
        s.max_in_flight = 2;
        s.max_connections = 8;
        s.body_timeout = Duration::from_secs(30);
    })
    .await;
    let addr = ingress.base.trim_start_matches("http://").to_owned();
    // Six senders, more than the places for produces, each trickling an unsigned body a byte
    // at a time, well within the body timeout.
    let head = b"POST /webhooks/github HTTP/1.1\r\nHost: x\r\nX-GitHub-Delivery: slow\r\nContent-Length: 64\r\n\r\n";
    let mut slow = Vec::new();
    for _ in 0..6 {
        slow.push(connection_sending(&addr, head).await);
    }
    let trickle = tokio::spawn(async move {
        for _ in 0..50 {
            for s in &mut slow {
                let _ = s.write_all(b" ").await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        slow
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..10 {
        let status = ingress.github(&format!("signed-{i}"), b"{}").await.status();
        assert_eq!(status, 200, "signed delivery {i}");
    }
    drop(trickle.await.unwrap());
    ingress.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_at_the_limit_are_closed_and_health_still_answers() {
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&kafka.brokers(), &topic, |s| {
        s.max_connections = 3;
        s.header_timeout = Duration::from_millis(500);
    })
    .await;
    let addr = ingress.base.trim_start_matches("http://").to_owned();
    // Three connections that never send a byte, and one whose headers never end.
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(connection_sending(&addr, b"").await);
    }
    idle.push(connection_sending(&addr, b"POST /webhooks/github HTTP/1.1\r\nHost: x\r\n").await);
    let asked = reqwest::Client::new()
        .get(format!("{}/livez", ingress.base))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert_eq!(asked.expect("answered").status(), 200);
    // The idle ones were closed by the ingress.
    for mut stream in idle {
        use tokio::io::AsyncReadExt as _;
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
        assert!(
            matches!(read, Ok(Ok(_)) | Ok(Err(_))),
            "closed, not held open"
        );
    }
    ingress.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_cannot_hold_a_stop() {
    let kafka = TestKafka::mock();
    let topic = kafka.topic(1).await;
    let mut ingress = Ingress::start(&kafka.brokers(), &topic, |s| {
        s.header_timeout = Duration::from_secs(1);
        s.body_timeout = Duration::from_secs(2);
        s.produce_timeout = Duration::from_secs(1);
    })
    .await;
    let addr = ingress.base.trim_start_matches("http://").to_owned();
    let _half = connection_sending(&addr, b"POST /webhooks/github HTTP/1.1\r\nHost: x\r\n").await;
    let _idle = connection_sending(&addr, b"").await;
    let head = b"POST /webhooks/github HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{";
    let _half_body = connection_sending(&addr, head).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    ingress.shutdown.cancel();
    let running = ingress.running.take().unwrap();
    // The drain limit is 2 s + 1 s + 1 s; the producer's flush comes after.
    let stopped = tokio::time::timeout(Duration::from_secs(15), running.stopped()).await;
    stopped.expect("the stop is bounded").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_id_with_a_line_break_gets_400_and_produces_nothing() {
    let kafka = TestKafka::mock();
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |_| {}).await;
    let body = br#"{"id":"evt_1\r\nX-Injected: 1","type":"invoice.paid"}"#;
    let refused = ingress.stripe("secret-of-STRIPE", now(), body).await;
    assert_eq!(refused.status(), 400);
    let reason = refused.text().await.unwrap();
    assert!(reason.contains("control character"), "{reason}");
    assert!(ingress.stop_and_read(&brokers, &topic).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_nested_200000_levels_deep_is_refused_or_kept_as_text_never_a_crash() {
    let kafka = TestKafka::mock();
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |s| s.max_body_bytes = 1 << 20).await;
    let body = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
    // Stripe's key is in the body, which cannot be read: 400.
    let refused = ingress
        .stripe("secret-of-STRIPE", now(), body.as_bytes())
        .await;
    assert_eq!(refused.status(), 400);
    // GitHub's key is a header: a body that is not readable JSON travels as text, flat.
    assert_eq!(ingress.github("deep", body.as_bytes()).await.status(), 200);
    let recs = ingress.stop_and_read(&brokers, &topic).await;
    assert_eq!(recs.len(), 1);
    assert!(
        recs[0].1["payload"].is_string(),
        "kept as text, nested nowhere"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_reach_the_topic_byte_for_byte() {
    let kafka = TestKafka::mock();
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |_| {}).await;
    let body = br#"{"id":"evt_big","amount":123456789012345678901234567890,"rate":0.1000000000000000055511151231257827}"#;
    assert_eq!(
        ingress
            .stripe("secret-of-STRIPE", now(), body)
            .await
            .status(),
        200
    );
    let recs = ingress.stop_and_read_raw(&brokers, &topic).await;
    // Read as text: a parsed value would round the numbers in this build.
    #[derive(serde::Deserialize)]
    struct Produced<'a> {
        #[serde(borrow)]
        payload: &'a serde_json::value::RawValue,
    }
    let produced: Produced = serde_json::from_slice(&recs[0].1).unwrap();
    assert_eq!(produced.payload.get().as_bytes(), body.as_slice());
}

/// The produced records as the consumer receives them, offsets from 0.
fn as_messages(records: &[(String, serde_json::Value)]) -> Vec<replayproof::consume::RawMessage> {
    records
        .iter()
        .enumerate()
        .map(|(i, (key, value))| replayproof::consume::RawMessage {
            offset: i as i64,
            key: Some(key.as_bytes().to_vec()),
            value: Some(serde_json::to_vec(value).unwrap()),
            traceparent: None,
            headers: Default::default(),
        })
        .collect()
}

/// A batch processor with the ledger effect on `db`.
fn ledger(db: &TestDb) -> replayproof::consume::BatchProcessor {
    replayproof::consume::BatchProcessor::new(
        db.pool.clone(),
        std::sync::Arc::new(replayproof::effect::Ledger),
    )
    .with_retry(replayproof::consume::EffectRetry::default())
}

/// Delivers `body` as `kind`'s sender would, with the event id `id`.
async fn deliver(ingress: &Ingress, kind: &str, id: &str, body: &[u8]) -> u16 {
    use base64::Engine as _;
    let b64 = |bytes: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(bytes);
    let mac = replayproof::devkit::sign::hmac;
    let t = now().to_string();
    let post = |path: &str| {
        ingress
            .http
            .post(format!("{}/webhooks/{path}", ingress.base))
            .body(body.to_vec())
    };
    let response = match kind {
        "stripe" => {
            return ingress
                .stripe("secret-of-STRIPE", now(), body)
                .await
                .status()
                .as_u16()
        }
        "github" => return ingress.github(id, body).await.status().as_u16(),
        "svix" => post("svix")
            .header("webhook-id", id)
            .header("webhook-timestamp", &t)
            .header(
                "webhook-signature",
                format!(
                    "v1,{}",
                    b64(mac(
                        SVIX_KEY,
                        &[id.as_bytes(), b".", t.as_bytes(), b".", body]
                    ))
                ),
            ),
        "shopify" => post("shopify")
            .header(
                "x-shopify-hmac-sha256",
                b64(mac(b"secret-of-SHOPIFY", &[body])),
            )
            .header("x-shopify-shop-domain", "shop.myshopify.com")
            .header("x-shopify-event-id", id),
        "slack" => post("slack")
            .header("x-slack-request-timestamp", &t)
            .header("x-slack-retry-num", "1")
            .header(
                "x-slack-signature",
                format!(
                    "v0={}",
                    hex::encode(mac(
                        b"secret-of-SLACK_SIGNING",
                        &[b"v0:", t.as_bytes(), b":", body]
                    ))
                ),
            ),
        other => panic!("no sender for {other}"),
    };
    response.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_is_a_duplicate_and_a_changed_business_field_is_a_conflict_for_every_kind() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |_| {}).await;
    // (kind, id, first delivery, the provider's redelivery, the same id with another amount)
    let cases: [(&str, &str, String, String, String); 5] = [
        (
            "stripe",
            "evt_r",
            r#"{"id":"evt_r","type":"invoice.paid","pending_webhooks":2,"request":{"id":null},"data":{"amount":100}}"#.into(),
            r#"{"id":"evt_r","type":"invoice.paid","pending_webhooks":1,"request":{"id":"req_9","idempotency_key":null},"data":{"amount":100}}"#.into(),
            r#"{"id":"evt_r","type":"invoice.paid","pending_webhooks":1,"request":{"id":null},"data":{"amount":200}}"#.into(),
        ),
        ("github", "d-1", r#"{"action":"opened","amount":100}"#.into(), r#"{"action":"opened","amount":100}"#.into(), r#"{"action":"opened","amount":200}"#.into()),
        ("svix", "msg_1", r#"{"type":"x","amount":100}"#.into(), r#"{"type":"x","amount":100}"#.into(), r#"{"type":"x","amount":200}"#.into()),
        ("shopify", "e-1", r#"{"id":1,"amount":100}"#.into(), r#"{"id":1,"amount":100}"#.into(), r#"{"id":1,"amount":200}"#.into()),
        (
            "slack",
            "Ev1",
            r#"{"type":"event_callback","team_id":"T1","event_id":"Ev1","event_time":1,"amount":100}"#.into(),
            r#"{"type":"event_callback","team_id":"T1","event_id":"Ev1","event_time":1,"amount":100}"#.into(),
            r#"{"type":"event_callback","team_id":"T1","event_id":"Ev1","event_time":1,"amount":200}"#.into(),
        ),
    ];
    for (kind, id, first, again, changed) in &cases {
        for body in [first, again, changed] {
            assert_eq!(
                deliver(&ingress, kind, id, body.as_bytes()).await,
                200,
                "{kind}"
            );
        }
    }
    let recs = ingress.stop_and_read(&brokers, &topic).await;
    assert_eq!(recs.len(), 15);
    let processor = ledger(&db);
    let messages = as_messages(&recs);
    for ((kind, ..), three) in cases.iter().zip(messages.chunks(3)) {
        let report = processor.process("webhooks", 0, three).await.unwrap();
        assert_eq!(
            (report.applied, report.duplicates, report.conflicts),
            (1, 1, 1),
            "{kind}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_delivery_resent_under_forged_ids_has_one_effect() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |_| {}).await;
    let capture = br#"{"action":"completed","check_run":{"id":7}}"#;
    // The real delivery, GitHub's own redelivery, then the capture under three forged ids.
    for delivery in ["real", "real", "forged-1", "forged-2", "forged-3"] {
        assert_eq!(ingress.github(delivery, capture).await.status(), 200);
    }
    // The same capture at a source whose guard is off is applied under each id.
    for delivery in ["open-1", "open-2"] {
        let sig = replayproof::devkit::sign::github(
            "secret-of-GITHUB",
            std::str::from_utf8(capture).unwrap(),
        );
        let r = ingress
            .http
            .post(format!("{}/webhooks/github-unguarded", ingress.base))
            .header("x-hub-signature-256", sig)
            .header("x-github-delivery", delivery)
            .body(capture.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let recs = ingress.stop_and_read(&brokers, &topic).await;
    let messages = as_messages(&recs);
    let processor = ledger(&db);
    // One batch, then the forged ones again one by one: neither way gets past the guard.
    processor.process("webhooks", 0, &messages).await.unwrap();
    for m in &messages[2..5] {
        processor
            .process("webhooks", 0, std::slice::from_ref(m))
            .await
            .unwrap();
    }
    let counts = db.ledger_counts().await;
    let mut keys: Vec<&str> = counts.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "github-unguarded:open-1",
            "github-unguarded:open-2",
            "github:real"
        ]
    );
    assert!(counts.values().all(|n| *n == 1));
    let forged: Vec<(String, String)> =
        sqlx::query_as("SELECT event_key, reason FROM key_conflicts ORDER BY event_key")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(forged.len(), 3, "{forged:?}");
    assert!(forged[0].0.ends_with("forged-1"));
    assert!(
        forged[0].1.contains("delivered as github:real"),
        "{forged:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_capture_beside_a_fresh_event_counts_once_as_a_conflict() {
    let (kafka, db) = (TestKafka::mock(), TestDb::new().await);
    let brokers = kafka.brokers();
    let topic = kafka.topic(1).await;
    let ingress = Ingress::start(&brokers, &topic, |_| {}).await;
    let capture = br#"{"action":"completed","check_run":{"id":7}}"#;
    for delivery in ["real", "forged-1"] {
        assert_eq!(ingress.github(delivery, capture).await.status(), 200);
    }
    let fresh = br#"{"action":"created","check_run":{"id":8}}"#;
    assert_eq!(ingress.github("other", fresh).await.status(), 200);
    let recs = ingress.stop_and_read(&brokers, &topic).await;
    let messages = as_messages(&recs);
    let processor = ledger(&db);
    processor
        .process("webhooks", 0, &messages[..1])
        .await
        .unwrap();
    // The capture under a forged id, then a fresh event, in one batch: two messages, two
    // outcomes.
    let report = processor
        .process("webhooks", 0, &messages[1..])
        .await
        .unwrap();
    assert_eq!(
        (report.applied, report.duplicates, report.conflicts),
        (1, 0, 1),
        "{report:?}"
    );
    assert_eq!(report.by_source["github"].iter().sum::<usize>(), 2);
}

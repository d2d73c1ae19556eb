//! Connections as managed services require them: PostgreSQL over verified TLS, Kafka over TLS
//! with SASL/SCRAM, dispatch over HTTPS to a private CA with signed deliveries, and one
//! configuration whose secrets come only from the environment.

use crate::harness::*;
use replayproof::devkit::embedded::EmbeddedPostgres;

use std::process::Stdio;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_verified_tls_and_a_wrong_ca_or_plaintext_is_refused() {
    let pki = Pki::local();
    let (cert, key) = (pki.cert_pem.clone(), pki.key_pem.clone());
    let cluster = tokio::task::spawn_blocking(move || EmbeddedPostgres::start_tls(&cert, &key))
        .await
        .unwrap()
        .expect("a TLS-only PostgreSQL cluster");
    let port = cluster.port();
    let verified = tls_url(port, "verify-full", &pki.ca);

    stdout_of(replayproof().args(["migrate", "--database-url", &verified]));

    // The server takes no connection without TLS, and a server certificate from another CA is
    // refused by the client, with the reason in the error.
    let plain = format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=disable");
    let stderr = migrate_refused(&plain);
    assert!(stderr.contains("no encryption"), "{stderr}");
    let stderr = migrate_refused(&tls_url(port, "verify-full", &pki.wrong_ca));
    assert!(stderr.contains("UnknownIssuer"), "{stderr}");

    // consume applies events over the verified connection, and events list reads them.
    let kafka = TestKafka::for_processes();
    let (topic, group) = (kafka.topic(1).await, unique("group"));
    let consumer = ConsumerProcess::spawn(&kafka.brokers(), &topic, &group, &verified, None);
    let records: Vec<Record> = (0..20)
        .map(|i| Record::event(&format!("tls-{i}"), serde_json::json!({ "i": i })))
        .collect();
    produce(&producer(&kafka.brokers()), &topic, &records).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&format!(
            "{verified}&options=-c%20search_path%3Dreplayproof"
        ))
        .await
        .unwrap();
    wait_for("the events applied over TLS", WAIT, || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT event_key) FROM ledger")
            .fetch_one(&pool)
            .await
            .is_ok_and(|n| n == 20)
    })
    .await;
    let listed =
        stdout_of(replayproof().args(["events", "list", "--json", "--database-url", &verified]));
    let listed = String::from_utf8_lossy(&listed);
    assert!(listed.contains("tls-7"), "{listed}");
    consumer.kill9().await;
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_and_consume_over_tls_with_scram_from_one_file_and_secrets_only_in_the_environment()
{
    let Some(bin) = nisshi() else {
        eprintln!(
            "SKIPPED: no nisshi binary (the test script installs it); Kafka over TLS with \
             SASL is not exercised"
        );
        return;
    };
    let _heavy = heavy().await;
    const PASSWORD: &str = "kafka-secret-9f1c2b7e";
    const SOURCE_SECRET: &str = "github-secret-7c41e0aa";
    let pki = Pki::local();
    let (topic, output) = (unique("webhooks"), unique("clean"));
    let broker = SecuredBroker::start(&bin, &pki, "app", PASSWORD, &[&topic, &output]);
    let db = TestDb::new().await;
    let ingest_port = free_port();
    let metrics_port = free_port();
    let config = pki.dir.path().join("replayproof.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[kafka]
brokers = "127.0.0.1:{port}"
topic = "{topic}"
group = "{group}"
security.protocol = "SASL_SSL"
sasl.mechanism = "SCRAM-SHA-512"
sasl.username = "app"
"ssl.ca.location" = "{ca}"
"broker.address.family" = "v4"
"session.timeout.ms" = "6000"

[database]
url = "${{TEST_DATABASE_URL}}"

[consume]
commit_interval_ms = 50
metrics_addr = "127.0.0.1:{metrics_port}"
effect = "ledger,kafka"
output_topic = "{output}"

[dispatch]
metrics_addr = "127.0.0.1:0"
poll = "50ms"

[ingest]
listen = "127.0.0.1:{ingest_port}"
metrics_addr = "127.0.0.1:0"

[[ingest.sources]]
name = "github"
kind = "github"
secrets_env = ["TEST_GITHUB_SECRET"]
"#,
            port = broker.port,
            group = unique("group"),
            ca = pki.ca.display(),
        ),
    )
    .unwrap();
    let env = [
        ("REPLAYPROOF_CONFIG", config.display().to_string()),
        ("REPLAYPROOF_KAFKA_SASL_PASSWORD", PASSWORD.to_owned()),
        ("TEST_DATABASE_URL", db.url.clone()),
        ("TEST_GITHUB_SECRET", SOURCE_SECRET.to_owned()),
        ("RUST_LOG", "info,replayproof=debug".to_owned()),
    ];
    let logs = tempfile::tempdir().unwrap();
    let spawn = |command: &str| {
        let log = std::fs::File::create(logs.path().join(command)).unwrap();
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"));
        cmd.arg(command)
            .env_remove("DATABASE_URL")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true);
        cmd.spawn().unwrap()
    };
    let mut ingest = spawn("ingest");
    let mut consume = spawn("consume");
    // The output relay, from the same file: the same brokers, TLS and SCRAM.
    let mut dispatch = spawn("dispatch");
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{ingest_port}");
    for n in 0..30 {
        let body = format!(r#"{{"action":"opened","number":{n}}}"#);
        let signature = format!("sha256={}", hmac_hex(SOURCE_SECRET, &[body.as_bytes()]));
        let mut delivered = false;
        for _ in 0..300 {
            let sent = http
                .post(format!("{base}/webhooks/github"))
                .header("x-hub-signature-256", &signature)
                .header("x-github-delivery", format!("d-{n}"))
                .header("x-github-event", "pull_request")
                .body(body.clone())
                .send()
                .await;
            if sent.is_ok_and(|r| r.status() == 200) {
                delivered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            delivered,
            "delivery {n} was never acknowledged over SASL_SSL"
        );
    }
    let expected = (0..30).map(|n| format!("github:d-{n}")).collect();
    assert_exactly_once(&db, &expected, WAIT).await;
    // The chained effect's records, each once in the output topic over SASL_SSL.
    wait_for("every output record sent", WAIT, || async {
        db.count("SELECT count(*) FROM output_records WHERE state = 'sent'")
            .await
            == 30
    })
    .await;
    let keys = secured_keys(broker.port, &pki, PASSWORD, &output, 30);
    assert_eq!(keys, expected, "each event's record once");

    // The secrets are in no process's command line, answer, log, or `config check`.
    let mut seen = vec![
        read_cmdline(ingest.id().unwrap()),
        read_cmdline(consume.id().unwrap()),
        read_cmdline(dispatch.id().unwrap()),
    ];
    for path in ["/metrics", "/healthz"] {
        seen.push(http_get(metrics_port, path).await.unwrap_or_default().1);
    }
    let check = replayproof()
        .args(["config", "check"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let check_text = String::from_utf8_lossy(&check.stdout).into_owned();
    assert!(
        check.status.success(),
        "{check_text}{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(
        check_text.contains("\"sasl.password\" = \"<redacted>\""),
        "{check_text}"
    );
    assert!(
        check_text.contains("env REPLAYPROOF_KAFKA_SASL_PASSWORD"),
        "{check_text}"
    );
    assert!(check_text.contains("consume: ready"), "{check_text}");
    // It connected as the commands do: over TLS, logged in with SCRAM.
    let connected = format!(
        "kafka 127.0.0.1:{} topic {topic} (consume, ingest): the brokers answer",
        broker.port
    );
    assert!(check_text.contains(&connected), "{check_text}");
    seen.push(check_text);
    // A wrong password: the check says the broker does not let it in, and fails.
    let refused = replayproof()
        .args(["config", "check"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("REPLAYPROOF_KAFKA_SASL_PASSWORD", "not-the-password")
        .output()
        .unwrap();
    let refused_text = String::from_utf8_lossy(&refused.stdout).into_owned();
    assert!(!refused.status.success(), "{refused_text}");
    let line = refused_text
        .lines()
        .find(|l| l.starts_with("kafka ") && l.contains("problem"))
        .unwrap_or_else(|| panic!("no Kafka problem in {refused_text}"));
    assert!(line.to_lowercase().contains("auth"), "{line}");
    seen.push(refused_text);
    ingest.kill().await.unwrap();
    consume.kill().await.unwrap();
    dispatch.kill().await.unwrap();
    for command in ["ingest", "consume", "dispatch"] {
        seen.push(std::fs::read_to_string(logs.path().join(command)).unwrap());
    }
    for text in &seen {
        for secret in [PASSWORD, SOURCE_SECRET] {
            assert!(!text.contains(secret), "a secret leaked into: {text}");
        }
    }
}

/// The keys of the `n` records of `topic`'s two partitions, read over SASL_SSL as `app`;
/// fails unless the log holds exactly `n`, each key once.
fn secured_keys(
    port: u16,
    pki: &Pki,
    password: &str,
    topic: &str,
    n: usize,
) -> std::collections::HashSet<String> {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::message::Message as _;
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", format!("127.0.0.1:{port}"))
        .set("broker.address.family", "v4")
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "SCRAM-SHA-512")
        .set("sasl.username", "app")
        .set("sasl.password", password)
        .set("ssl.ca.location", pki.ca.display().to_string())
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut list = rdkafka::TopicPartitionList::new();
    for p in 0..2 {
        list.add_partition_offset(topic, p, rdkafka::Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&list).unwrap();
    let mut keys = Vec::new();
    let started = std::time::Instant::now();
    while keys.len() < n && started.elapsed() < WAIT {
        if let Some(m) = consumer.poll(Duration::from_millis(200)) {
            let m = m.unwrap();
            keys.push(String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned());
        }
    }
    // The log holds exactly these: no second copy of any.
    let logged: i64 = (0..2)
        .map(|p| {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            high - low
        })
        .sum();
    assert_eq!(logged, n as i64, "records in {topic}: {keys:?}");
    let distinct: std::collections::HashSet<String> = keys.into_iter().collect();
    assert_eq!(distinct.len(), n, "no key twice");
    distinct
}

/// One request an HTTPS receiver got: its headers and body.
#[derive(Clone, Debug)]
struct Received {
    headers: http::HeaderMap,
    body: Vec<u8>,
}

/// An HTTPS receiver with the given certificate that answers 200 to everything and keeps what
/// it got.
struct HttpsReceiver {
    port: u16,
    received: std::sync::Arc<std::sync::Mutex<Vec<Received>>>,
    handshakes_failed: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl HttpsReceiver {
    async fn start(cert_pem: &str, key_pem: &str) -> Self {
        use rustls_pki_types::pem::PemObject as _;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let certs: Vec<_> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .unwrap();
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
        let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let handshakes_failed = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (got, failed) = (received.clone(), handshakes_failed.clone());
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, got, failed) = (acceptor.clone(), got.clone(), failed.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        return;
                    };
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 8192];
                    let (head_end, length) = loop {
                        let Ok(n) = tls.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..at]).to_ascii_lowercase();
                            let length = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                            break (at + 4, length);
                        }
                    };
                    while buf.len() < head_end + length {
                        let Ok(n) = tls.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                    let mut headers = http::HeaderMap::new();
                    for line in head.lines().skip(1) {
                        if let Some((k, v)) = line.split_once(':') {
                            headers.append(
                                http::HeaderName::try_from(k.trim()).unwrap(),
                                http::HeaderValue::try_from(v.trim()).unwrap(),
                            );
                        }
                    }
                    let body = buf[head_end..head_end + length].to_vec();
                    got.lock().unwrap().push(Received { headers, body });
                    let _ = tls
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        Self {
            port,
            received,
            handshakes_failed,
        }
    }

    fn url(&self, host: &str) -> String {
        format!("https://{host}:{}/hooks", self.port)
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatch_delivers_over_https_with_a_private_ca_signed_for_a_standard_webhooks_verifier() {
    const SIGNING_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const TOKEN: &str = "downstream-token-3b9d";
    let db = TestDb::new().await;
    let pki = Pki::local();
    let good = HttpsReceiver::start(&pki.cert_pem, &pki.key_pem).await;
    // A receiver whose certificate, from the same CA, names another host.
    let mismatched = HttpsReceiver::start(&pki.other_cert_pem, &pki.other_key_pem).await;
    let keys: Vec<String> = (0..5).map(|i| format!("https-{i}")).collect();
    enqueue_to(&db, &good.url("localhost"), None, &keys).await;
    enqueue_to(
        &db,
        &mismatched.url("127.0.0.1"),
        None,
        &["mismatch".into()],
    )
    .await;

    let mut dispatcher = tokio::process::Command::new(env!("CARGO_BIN_EXE_replayproof"))
        .arg("dispatch")
        .args(["--database-url", &db.url])
        .arg("--ca-file")
        .arg(&pki.ca)
        .args(["--header", "Authorization=Bearer ${TEST_DOWNSTREAM_TOKEN}"])
        .args(["--metrics-addr", "127.0.0.1:0", "--poll-ms", "50"])
        .args(["--backoff-ms", "100", "--max-backoff-ms", "200"])
        .env("TEST_DOWNSTREAM_TOKEN", TOKEN)
        .env("REPLAYPROOF_SIGNING_SECRET", SIGNING_SECRET)
        .env("RUST_LOG", "warn")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_for("the deliveries over HTTPS", WAIT, || async {
        good.received().len() >= keys.len()
    })
    .await;
    let verifier = standardwebhooks::Webhook::new(SIGNING_SECRET).unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for request in good.received() {
        verifier
            .verify(&request.body, &request.headers)
            .expect("the official Standard Webhooks verifier accepts the delivery");
        assert_eq!(request.headers["authorization"], format!("Bearer {TOKEN}"));
        let id = request.headers["webhook-id"].to_str().unwrap().to_owned();
        assert_eq!(request.headers["idempotency-key"], id.as_str());
        ids.insert(id);
        // A tampered body fails the same verifier.
        let mut tampered = request.body.clone();
        tampered.push(b' ');
        assert!(verifier.verify(&tampered, &request.headers).is_err());
    }
    assert_eq!(ids.len(), keys.len());

    // The certificate that names another host is refused before anything is sent: the
    // operation waits as retryable with the reason, and the receiver got no request.
    wait_for("the mismatched attempt recorded", WAIT, || async {
        db.count("SELECT count(*) FROM outbox WHERE event_key = 'mismatch' AND attempts >= 2 AND state = 'retryable'")
            .await
            == 1
    })
    .await;
    let error: String =
        sqlx::query_scalar("SELECT last_error FROM outbox WHERE event_key = 'mismatch'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(error.contains("certificate not valid for name"), "{error}");
    assert!(mismatched.received().is_empty());
    assert!(
        mismatched
            .handshakes_failed
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 1
    );
    dispatcher.kill().await.unwrap();
}

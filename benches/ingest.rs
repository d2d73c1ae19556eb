//! The acknowledged path against a bare endpoint, with an external load generator.
//!
//! `wrk` (Debian's package) drives the release `replayproof ingest` process from outside it,
//! 64 connections, 10 s per run, side by side in one run, interleaved, three rounds, medians:
//!
//! - **bare**: `GET /healthz` of the same server: the ceiling of its HTTP layer here.
//! - **ingest**: signed Stripe deliveries with distinct ids (so records spread over the
//!   partitions), each answered 2xx only after the broker acknowledged it (`acks=all`), with
//!   bodies of 512 B, 2 KiB and 32 KiB; against librdkafka's mock cluster (in a process of its
//!   own) and against nisshi.
//! - **produce loop**: the same number of concurrent sends, each waiting for its
//!   acknowledgement before the next, with the ingress's own producer settings and envelopes of
//!   the same size, from a process of its own against the same broker: what the broker allows.
//! - **two processes**: two `ingest` processes on two ports sharing only the broker, one `wrk`
//!   each (half the connections each), summed.
//! - **traced**: the ingest process exporting every request's span to a collector in this
//!   process, next to the same process without an endpoint.
//!
//! For each: requests per second, p50 and p99 latency, answers other than 2xx, the CPU seconds
//! per 10,000 requests of the ingest process (or the produce loop), of the broker and of wrk,
//! and the share of the machine's CPU left idle. From those, the *CPU ceiling*: what the cores
//! would allow an ingress that cost nothing beyond the bare answer, given wrk's CPU and the
//! broker's CPU per record at the produce loop's batching (when it is below the bare answer's
//! rate, the broker's CPU is the limit before the ingress's).
//!
//! `scripts/bench-ingest.sh` installs wrk and nisshi and runs this. Without the script: nisshi
//! is taken from `REPLAYPROOF_NISSHI`, the `PATH` or `~/.cargo/bin` (its runs are left out,
//! loudly, when it is missing), `KAFKA_BROKERS` adds a broker of your own (its CPU unmeasured),
//! `BENCH_SECONDS` (10), `BENCH_ROUNDS` (3), `BENCH_CONNECTIONS` (64) and `BENCH_SIZES`
//! (`512,2048,32768`) size the run, `BENCH_BROKERS` (`mock,nisshi,external`) picks the brokers.

// A benchmark's run reads as one script, start to finish: long ones are allowed here.
#![allow(clippy::too_many_lines)]

use std::io::{BufRead as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::env_or;

const SECRET: &str = "whsec_bench_0123456789abcdef";
const PARTITIONS: i32 = 4;
const WRK_THREADS: usize = 2;

/// CPU seconds a process has used (user and system), from `/proc`.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// The machine's idle and total CPU time so far, in ticks, from `/proc/stat`.
#[derive(Debug, Clone, Copy, Default)]
struct Ticks {
    idle: f64,
    total: f64,
}

impl Ticks {
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let cpu: Vec<f64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal: idle and iowait are idle.
        Self {
            idle: cpu.get(3).copied().unwrap_or(0.0) + cpu.get(4).copied().unwrap_or(0.0),
            total: cpu.iter().take(8).sum(),
        }
    }

    /// The share of the machine's CPU time that was idle since `self`.
    fn idle_since(self) -> f64 {
        let now = Self::now();
        (now.idle - self.idle) / (now.total - self.total).max(1.0)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One measured run.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    requests: f64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// Answers other than 2xx, and connection errors and timeouts.
    errors: f64,
    /// CPU seconds of the measured process (ingest, or the produce loop).
    cpu: f64,
    /// CPU seconds of the broker process, when known.
    broker_cpu: Option<f64>,
    /// CPU seconds of the load generator (wrk), when it is a process of its own.
    wrk_cpu: Option<f64>,
    /// The share of the machine's CPU that stayed idle during the run.
    idle: f64,
}

impl Run {
    fn rps(&self) -> f64 {
        self.requests / self.seconds
    }
    fn per_10k(&self, cpu: f64) -> f64 {
        cpu * 10_000.0 / self.requests.max(1.0)
    }
}

/// A Kafka-protocol broker the runs produce to.
struct Broker {
    name: &'static str,
    bootstrap: String,
    /// Its process, whose CPU is measured; none for `KAFKA_BROKERS`.
    pid: Option<u32>,
    _child: Option<ChildGuard>,
    /// Topics are created per run on brokers that keep everything (nisshi), and deleted after.
    fresh_topics: bool,
}

impl Broker {
    fn cpu(&self) -> Option<f64> {
        self.pid.map(cpu_seconds)
    }

    /// The CPU seconds it used since [`Broker::cpu`] read `before`.
    fn cpu_since(&self, before: Option<f64>) -> Option<f64> {
        self.cpu().zip(before).map(|(now, before)| now - before)
    }

    /// The topic named `base` for a run: a fresh one per run (`tag` and `round`) where topics
    /// are made per run, the one created at start otherwise.
    fn topic(&self, base: &str, tag: u32, round: usize) -> String {
        match self.fresh_topics {
            true => format!("{base}_{tag}_{round}"),
            false => base.to_owned(),
        }
    }
}

/// Kills its process (by its own pid) when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// librdkafka's mock cluster in a process of its own (this benchmark, as a role), so its CPU
/// is counted apart from everything else; `topics` are created before it answers.
fn start_mock(topics: &[String]) -> Broker {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("BENCH_ROLE", "mock-broker")
        .env("BENCH_TOPICS", topics.join(","))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    Broker {
        name: "mock cluster",
        bootstrap: line.trim().to_owned(),
        pid: Some(child.id()),
        _child: Some(ChildGuard(child)),
        fresh_topics: false,
    }
}

fn mock_broker_role() {
    let mock = replayproof::devkit::embedded::EmbeddedKafka::start().unwrap();
    for topic in std::env::var("BENCH_TOPICS").unwrap().split(',') {
        mock.create_topic(topic, PARTITIONS).unwrap();
    }
    println!("{}", mock.bootstrap_servers());
    std::io::stdout().flush().unwrap();
    // Until the benchmark closes the pipe (or dies).
    let _ = std::io::stdin().read_line(&mut String::new());
}

fn nisshi_binary() -> Option<PathBuf> {
    let candidates = std::env::var_os("REPLAYPROOF_NISSHI")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join("nisshi"))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        )
        .chain(std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin/nisshi")));
    candidates.into_iter().find(|p| p.is_file())
}

fn start_nisshi(bin: &Path, dir: &Path) -> Broker {
    let port = common::free_port();
    let url = format!("tcp://127.0.0.1:{port}");
    let log = std::fs::File::create(dir.join("nisshi.log")).unwrap();
    let child = Command::new(bin)
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ])
        .args(["--storage-engine", "memory://nisshi/"])
        .args(["--group-initial-rebalance-delay", "0s"])
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let guard = ChildGuard(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nisshi did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    Broker {
        name: "nisshi",
        bootstrap: format!("127.0.0.1:{port}"),
        pid: Some(guard.0.id()),
        _child: Some(guard),
        fresh_topics: true,
    }
}

/// A Stripe event of exactly `size` bytes (padding fills it up), with the id `id`.
fn stripe_body(id: &str, size: usize) -> String {
    let now = chrono::Utc::now().timestamp();
    let head = format!(
        r#"{{"id":"{id}","object":"event","api_version":"2024-06-20","created":{now},"type":"invoice.paid","livemode":false,"pending_webhooks":1,"data":{{"object":{{"id":"in_{id}","object":"invoice","amount_paid":2000,"currency":"eur","padding":""#
    );
    let tail = r#""}}}"#;
    let pad = size.saturating_sub(head.len() + tail.len());
    let mut body = String::with_capacity(size);
    body.push_str(&head);
    // Varied text, as real payloads are, rather than one repeated byte.
    body.extend((0..pad).map(|i| (b'a' + (i * 7 % 26) as u8) as char));
    body.push_str(tail);
    body
}

/// Writes the requests each wrk thread sends, signed now: `{prefix}-{thread}`, requests
/// separated by a NUL byte. Each thread cycles through its own; ids differ across all of them.
fn write_requests(dir: &Path, run: &str, port: u16, size: usize, seconds: usize) -> PathBuf {
    let now = chrono::Utc::now().timestamp().to_string();
    // Enough for the run at 50,000 req/s, within 192 MiB per thread.
    let per_thread = (50_000 * seconds / WRK_THREADS).min(192 * 1024 * 1024 / (size + 300));
    let prefix = dir.join(format!("requests-{run}"));
    for thread in 0..WRK_THREADS {
        let file = std::fs::File::create(format!("{}-{thread}", prefix.display())).unwrap();
        let mut out = std::io::BufWriter::new(file);
        for i in 0..per_thread {
            let body = stripe_body(&format!("evt_{run}_{thread}_{i}"), size);
            let signature = replayproof::devkit::sign::stripe(SECRET, &now, &body);
            write!(
                out,
                "POST /webhooks/stripe HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
                 Content-Type: application/json; charset=utf-8\r\nStripe-Signature: {signature}\r\n\
                 Content-Length: {}\r\n\r\n{body}\0",
                body.len()
            )
            .unwrap();
        }
        out.flush().unwrap();
    }
    prefix
}

/// wrk's script: each thread reads its own requests and cycles through them; the summary is
/// printed as one JSON line.
const WRK_SCRIPT: &str = r#"
local counter = 0
function setup(thread)
  thread:set("id", counter)
  counter = counter + 1
end
function init(args)
  requests = {}
  if args[1] then
    local f = assert(io.open(args[1] .. "-" .. id, "rb"))
    local data = f:read("*a")
    f:close()
    local pos = 1
    while true do
      local e = data:find("\0", pos, true)
      if not e then break end
      requests[#requests + 1] = data:sub(pos, e - 1)
      pos = e + 1
    end
  end
  i = 0
end
function request()
  if #requests == 0 then return wrk.format() end
  i = i + 1
  if i > #requests then i = 1 end
  return requests[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests":%d,"duration_us":%d,"errors":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration, e.status + e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"#;

/// Starts wrk against `url` for `seconds` with `connections`, sending the requests at `prefix`
/// (none: `GET url`).
fn spawn_wrk(
    dir: &Path,
    url: &str,
    threads: usize,
    connections: usize,
    seconds: usize,
    prefix: Option<&Path>,
) -> Child {
    let script = dir.join("bench.lua");
    if !script.exists() {
        std::fs::write(&script, WRK_SCRIPT).unwrap();
    }
    let mut wrk = Command::new("wrk");
    wrk.arg(format!("-t{threads}"))
        .arg(format!("-c{connections}"))
        .arg(format!("-d{seconds}s"))
        .arg("--timeout")
        .arg("10s")
        .arg("-s")
        .arg(&script)
        .arg(url);
    if let Some(prefix) = prefix {
        wrk.arg("--").arg(prefix);
    }
    wrk.stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("wrk is needed: apt-get install wrk (scripts/bench-ingest.sh installs it)")
}

/// wrk's summary line, as a run with wrk's own CPU seconds (read once it exited, before it is
/// reaped) and no other CPU figures.
fn wrk_result(mut child: Child) -> Run {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut text).unwrap();
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let flags = nix::sys::wait::WaitPidFlag::WEXITED | nix::sys::wait::WaitPidFlag::WNOWAIT;
    nix::sys::wait::waitid(nix::sys::wait::Id::Pid(pid), flags).unwrap();
    let wrk_cpu = cpu_seconds(child.id());
    child.wait().unwrap();
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("wrk printed no summary: {text}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let n = |k: &str| v[k].as_f64().unwrap();
    Run {
        requests: n("requests"),
        seconds: n("duration_us") / 1e6,
        p50_ms: n("p50_us") / 1e3,
        p99_ms: n("p99_us") / 1e3,
        errors: n("errors"),
        wrk_cpu: Some(wrk_cpu),
        ..Run::default()
    }
}

/// A `replayproof ingest` process on `port`, ready.
fn start_ingest(
    dir: &Path,
    broker: &Broker,
    topic: &str,
    port: u16,
    otlp: Option<&str>,
) -> ChildGuard {
    let config = dir.join("replayproof.toml");
    std::fs::write(
        &config,
        "[[ingest.sources]]\nname = \"stripe\"\nkind = \"stripe\"\nsecrets_env = [\"S\"]\n",
    )
    .unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_replayproof"));
    if let Some(endpoint) = otlp {
        command.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    }
    let child = ChildGuard(
        command
            .arg("ingest")
            .arg("--config")
            .arg(&config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--brokers", &broker.bootstrap, "--topic", topic])
            .args(["--kafka-option", "broker.address.family=v4"])
            .args(
                kafka_options()
                    .iter()
                    .flat_map(|(k, v)| ["--kafka-option".into(), format!("{k}={v}")]),
            )
            .args(["--metrics-addr", "127.0.0.1:0", "--shutdown-delay", "0s"])
            .env("S", SECRET)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "ingest did not become ready");
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            let mut answer = String::new();
            let _ = std::io::Read::read_to_string(&mut s, &mut answer);
            if answer.starts_with("HTTP/1.1 200") {
                return child;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `BENCH_KAFKA_OPTIONS` (`key=value,…`): librdkafka options for the ingress and the produce
/// loop alike, to compare producer settings.
fn kafka_options() -> Vec<(String, String)> {
    std::env::var("BENCH_KAFKA_OPTIONS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// Creates `topic` on `broker` when its topics are made per run.
fn create_topic(runtime: &tokio::runtime::Runtime, broker: &Broker, topic: &str) {
    if broker.fresh_topics {
        runtime.block_on(common::create_topic(&broker.bootstrap, topic, PARTITIONS));
    }
}

fn delete_topic(runtime: &tokio::runtime::Runtime, broker: &Broker, topic: &str) {
    if broker.fresh_topics {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let admin: AdminClient<_> = common::client(&broker.bootstrap).create().unwrap();
        let _ = runtime.block_on(admin.delete_topics(&[topic], &AdminOptions::new()));
    }
}

struct Settings {
    seconds: usize,
    connections: usize,
}

/// One ingest process under wrk for a warm-up and a measured run of signed deliveries of
/// `size` bytes (or `GET /healthz` when `size` is None).
#[allow(clippy::too_many_arguments)]
fn ingest_run(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    broker: &Broker,
    topic: &str,
    size: Option<usize>,
    otlp: Option<&str>,
    run: &str,
    s: &Settings,
) -> Run {
    create_topic(runtime, broker, topic);
    let port = common::free_port();
    let ingest = start_ingest(dir, broker, topic, port, otlp);
    let pid = ingest.0.id();
    let prefix = size.map(|size| write_requests(dir, run, port, size, s.seconds));
    let url = match size {
        Some(_) => format!("http://127.0.0.1:{port}/"),
        None => format!("http://127.0.0.1:{port}/healthz"),
    };
    // A warm-up: connections, the producer's metadata, the allocator's pools.
    let warm = spawn_wrk(dir, &url, WRK_THREADS, s.connections, 2, prefix.as_deref());
    wrk_result(warm);
    let (cpu, broker_cpu, ticks) = (cpu_seconds(pid), broker.cpu(), Ticks::now());
    let wrk = spawn_wrk(
        dir,
        &url,
        WRK_THREADS,
        s.connections,
        s.seconds,
        prefix.as_deref(),
    );
    let mut result = wrk_result(wrk);
    result.idle = ticks.idle_since();
    result.cpu = cpu_seconds(pid) - cpu;
    result.broker_cpu = broker.cpu_since(broker_cpu);
    drop(ingest);
    if let Some(prefix) = prefix {
        remove_requests(&prefix);
    }
    delete_topic(runtime, broker, topic);
    result
}

/// Removes the request files [`write_requests`] wrote at `prefix`.
fn remove_requests(prefix: &Path) {
    for thread in 0..WRK_THREADS {
        let _ = std::fs::remove_file(format!("{}-{thread}", prefix.display()));
    }
}

/// Two ingest processes on two ports, one wrk each with half the connections, at once.
fn two_processes_run(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    broker: &Broker,
    topic: &str,
    size: usize,
    s: &Settings,
) -> Run {
    create_topic(runtime, broker, topic);
    let ports = [common::free_port(), common::free_port()];
    let processes: Vec<ChildGuard> = ports
        .iter()
        .map(|&port| start_ingest(dir, broker, topic, port, None))
        .collect();
    let prefixes: Vec<PathBuf> = ports
        .iter()
        .enumerate()
        .map(|(i, &port)| write_requests(dir, &format!("two{i}"), port, size, s.seconds))
        .collect();
    let url = |port: u16| format!("http://127.0.0.1:{port}/");
    let spawn_both = |seconds| -> Vec<Child> {
        ports
            .iter()
            .zip(&prefixes)
            .map(|(&port, prefix)| {
                spawn_wrk(dir, &url(port), 1, s.connections / 2, seconds, Some(prefix))
            })
            .collect()
    };
    spawn_both(2).into_iter().for_each(|w| {
        wrk_result(w);
    });
    let cpu = |ps: &[ChildGuard]| ps.iter().map(|p| cpu_seconds(p.0.id())).sum::<f64>();
    let (before, broker_before, ticks) = (cpu(&processes), broker.cpu(), Ticks::now());
    let results: Vec<Run> = spawn_both(s.seconds).into_iter().map(wrk_result).collect();
    let idle = ticks.idle_since();
    let mut sum = Run {
        requests: results.iter().map(|r| r.requests).sum(),
        seconds: results.iter().map(|r| r.seconds).fold(0.0, f64::max),
        p50_ms: results.iter().map(|r| r.p50_ms).fold(0.0, f64::max),
        p99_ms: results.iter().map(|r| r.p99_ms).fold(0.0, f64::max),
        errors: results.iter().map(|r| r.errors).sum(),
        wrk_cpu: results.iter().map(|r| r.wrk_cpu).sum(),
        idle,
        ..Run::default()
    };
    sum.cpu = cpu(&processes) - before;
    sum.broker_cpu = broker.cpu_since(broker_before);
    drop(processes);
    prefixes.iter().for_each(|p| remove_requests(p));
    delete_topic(runtime, broker, topic);
    sum
}

/// The produce loop, in a process of its own: `connections` tasks, each sending an envelope
/// of a `size`-byte body and waiting for its acknowledgement before the next.
fn produce_loop_run(
    runtime: &tokio::runtime::Runtime,
    broker: &Broker,
    topic: &str,
    size: usize,
    s: &Settings,
) -> Run {
    create_topic(runtime, broker, topic);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("BENCH_ROLE", "produce-loop")
        .env("BENCH_BOOTSTRAP", &broker.bootstrap)
        .env("BENCH_TOPIC", topic)
        .env("BENCH_SIZE", size.to_string())
        .env("BENCH_CONNECTIONS", s.connections.to_string())
        .env("BENCH_SECONDS", s.seconds.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut broker_before, mut ticks) = (None, Ticks::now());
    let mut result = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line == "measuring" {
            (broker_before, ticks) = (broker.cpu(), Ticks::now());
        } else if line.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            let n = |k: &str| v[k].as_f64().unwrap();
            result = Some(Run {
                requests: n("requests"),
                seconds: n("seconds"),
                p50_ms: n("p50_us") / 1e3,
                p99_ms: n("p99_us") / 1e3,
                errors: n("errors"),
                cpu: n("cpu"),
                broker_cpu: broker.cpu_since(broker_before),
                wrk_cpu: None,
                idle: ticks.idle_since(),
            });
        }
    }
    child.wait().unwrap();
    delete_topic(runtime, broker, topic);
    result.expect("the produce loop printed no result")
}

fn produce_loop_role() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let var = |k: &str| std::env::var(k).unwrap();
    let (bootstrap, topic) = (var("BENCH_BOOTSTRAP"), var("BENCH_TOPIC"));
    let size: usize = var("BENCH_SIZE").parse().unwrap();
    let connections: usize = var("BENCH_CONNECTIONS").parse().unwrap();
    let seconds: u64 = var("BENCH_SECONDS").parse().unwrap();
    let mut settings = replayproof::ingest::IngestSettings::new(
        "127.0.0.1:0".parse().unwrap(),
        &bootstrap,
        &topic,
    );
    settings.kafka_options = vec![("broker.address.family".into(), "v4".into())];
    settings.kafka_options.extend(kafka_options());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let producer: FutureProducer = settings.producer_config().unwrap().create().unwrap();
        let producer = std::sync::Arc::new(producer);
        let run = |duration: Duration, measure: bool| {
            let producer = producer.clone();
            let topic = topic.clone();
            async move {
                let until = Instant::now() + duration;
                let tasks: Vec<_> = (0..connections)
                    .map(|task| {
                        let (producer, topic) = (producer.clone(), topic.clone());
                        tokio::spawn(async move {
                            let (mut latencies, mut errors, mut i) = (Vec::new(), 0usize, 0usize);
                            while Instant::now() < until {
                                let id = format!("evt_{measure}_{task}_{i}");
                                i += 1;
                                let envelope = replayproof::envelope::Envelope {
                                    route: None,
                                    key: format!("stripe:{id}").try_into().unwrap(),
                                    source: "stripe".into(),
                                    event_type: Some("invoice.paid".into()),
                                    received_at: Some(chrono::Utc::now()),
                                    occurred_at: Some(chrono::Utc::now()),
                                    payload: serde_json::value::RawValue::from_string(
                                        stripe_body(&id, size),
                                    )
                                    .unwrap(),
                                    unhashed: vec!["pending_webhooks".into(), "request".into()],
                                    replay_window_secs: None,
                                    request_id: Some(format!("{:032x}", i)),
                                };
                                let value = envelope.to_bytes();
                                let t = Instant::now();
                                let sent = producer
                                    .send(
                                        FutureRecord::to(&topic)
                                            .key(envelope.key.as_str())
                                            .payload(&value),
                                        Duration::from_secs(10),
                                    )
                                    .await;
                                latencies.push(t.elapsed());
                                errors += usize::from(sent.is_err());
                            }
                            (latencies, errors)
                        })
                    })
                    .collect();
                let (mut all, mut errors) = (Vec::new(), 0);
                for t in tasks {
                    let (l, e) = t.await.unwrap();
                    all.extend(l);
                    errors += e;
                }
                all.sort();
                (all, errors)
            }
        };
        run(Duration::from_secs(2), false).await;
        println!("measuring");
        let pid = std::process::id();
        let (cpu, started) = (cpu_seconds(pid), Instant::now());
        let (all, errors) = run(Duration::from_secs(seconds), true).await;
        let elapsed = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds(pid) - cpu;
        let at = |q: usize| all[(all.len() * q / 100).min(all.len() - 1)].as_micros();
        println!(
            r#"{{"requests":{},"seconds":{elapsed},"errors":{errors},"p50_us":{},"p99_us":{},"cpu":{cpu}}}"#,
            all.len(),
            at(50),
            at(99),
        );
    });
}

/// The medians of a row's runs, printed.
fn print_row(name: &str, runs: &[Run]) -> Run {
    let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let row = Run {
        requests: m(&|r| r.rps()),
        seconds: 1.0,
        p50_ms: m(&|r| r.p50_ms),
        p99_ms: m(&|r| r.p99_ms),
        errors: runs.iter().map(|r| r.errors).sum(),
        cpu: m(&|r| r.per_10k(r.cpu)),
        broker_cpu: runs
            .iter()
            .map(|r| r.broker_cpu.map(|b| r.per_10k(b)))
            .collect::<Option<Vec<f64>>>()
            .map(median),
        wrk_cpu: runs
            .iter()
            .map(|r| r.wrk_cpu.map(|w| r.per_10k(w)))
            .collect::<Option<Vec<f64>>>()
            .map(median),
        idle: m(&|r| r.idle),
    };
    let or_na = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}"));
    println!(
        "| {name} | {:.0} | {:.2} | {:.2} | {:.0} | {:.2} | {} | {} | {:.0} |",
        row.requests,
        row.p50_ms,
        row.p99_ms,
        row.errors,
        row.cpu,
        or_na(row.broker_cpu),
        or_na(row.wrk_cpu),
        row.idle * 100.0
    );
    row
}

fn main() {
    match std::env::var("BENCH_ROLE").as_deref() {
        Ok("mock-broker") => return mock_broker_role(),
        Ok("produce-loop") => return produce_loop_role(),
        _ => {}
    }
    let s = Settings {
        seconds: env_or("BENCH_SECONDS", 10),
        connections: env_or("BENCH_CONNECTIONS", 64),
    };
    let rounds = env_or("BENCH_ROUNDS", 3);
    let sizes: Vec<usize> = std::env::var("BENCH_SIZES")
        .unwrap_or_else(|_| "512,2048,32768".into())
        .split(',')
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let wanted = std::env::var("BENCH_BROKERS").unwrap_or_else(|_| "mock,nisshi,external".into());
    let wanted = |name: &str| wanted.split(',').any(|w| w.trim() == name);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();

    let mut brokers = Vec::new();
    if wanted("mock") {
        let mut topics: Vec<String> = sizes.iter().map(|s| format!("ingest_{s}")).collect();
        topics.extend(sizes.iter().map(|s| format!("loop_{s}")));
        topics.extend(["two", "traced"].map(String::from));
        brokers.push(start_mock(&topics));
    }
    if wanted("nisshi") {
        match nisshi_binary() {
            Some(bin) => brokers.push(start_nisshi(&bin, dir.path())),
            None => println!(
                "NOT MEASURED: nisshi (not found; `cargo +nightly install nisshi --version 0.8.1 \
                 --locked`, or scripts/bench-ingest.sh)"
            ),
        }
    }
    if let (true, Ok(bootstrap)) = (wanted("external"), std::env::var("KAFKA_BROKERS")) {
        if !bootstrap.is_empty() {
            brokers.push(Broker {
                name: "KAFKA_BROKERS",
                bootstrap,
                pid: None,
                _child: None,
                fresh_topics: true,
            });
        }
    }
    println!(
        "wrk {WRK_THREADS} threads, {} connections, {} s per run, {rounds} rounds (medians); \
         topics of {PARTITIONS} partitions; signed Stripe deliveries, acks=all",
        s.connections, s.seconds
    );

    // Every run of every row, interleaved round by round.
    let mut rows: Vec<(String, Vec<Run>)> = Vec::new();
    let mut push = |name: String, run: Run| {
        eprintln!(
            "  {name}: {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, errors {}",
            run.rps(),
            run.p50_ms,
            run.p99_ms,
            run.errors
        );
        match rows.iter_mut().find(|(n, _)| *n == name) {
            Some((_, runs)) => runs.push(run),
            None => rows.push((name, vec![run])),
        }
    };
    let otlp = runtime.block_on(common::otlp_sink(Default::default()));
    let tag = std::process::id();
    for round in 0..rounds {
        eprintln!("round {}", round + 1);
        let first = &brokers[0];
        let r = ingest_run(
            &runtime,
            dir.path(),
            first,
            "ingest_512",
            None,
            None,
            "bare",
            &s,
        );
        push("bare: GET /healthz, same server".into(), r);
        for broker in &brokers {
            for &size in &sizes {
                let topic = broker.topic(&format!("ingest_{size}"), tag, round);
                let run = format!("{round}_{size}");
                let r = ingest_run(
                    &runtime,
                    dir.path(),
                    broker,
                    &topic,
                    Some(size),
                    None,
                    &run,
                    &s,
                );
                push(format!("ingest, {size} B, {}", broker.name), r);
                let topic = broker.topic(&format!("loop_{size}"), tag, round);
                let r = produce_loop_run(&runtime, broker, &topic, size, &s);
                push(format!("produce loop, {size} B, {}", broker.name), r);
            }
        }
        let last = brokers.last().unwrap();
        let size = sizes[0];
        let topic = last.topic("two", tag, round);
        let r = two_processes_run(&runtime, dir.path(), last, &topic, size, &s);
        push(format!("two ingest processes, {size} B, {}", last.name), r);
        let topic = last.topic("traced", tag, round);
        let run = format!("traced{round}");
        let r = ingest_run(
            &runtime,
            dir.path(),
            last,
            &topic,
            Some(size),
            Some(&otlp),
            &run,
            &s,
        );
        push(
            format!("ingest, {size} B, {}, every span exported", last.name),
            r,
        );
    }

    println!();
    println!(
        "| run | req/s | p50 ms | p99 ms | not 2xx | CPU s/10k, process | CPU s/10k, broker \
         | CPU s/10k, wrk | machine idle % |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let medians: Vec<(String, Run)> = rows
        .iter()
        .map(|(name, runs)| (name.clone(), print_row(name, runs)))
        .collect();
    let get = |name: &str| medians.iter().find(|(n, _)| n == name).map(|(_, r)| *r);
    let bare = get("bare: GET /healthz, same server").unwrap();
    println!();
    // What the machine's cores allow an ingress that costs nothing beyond the bare answer: each
    // acknowledged request still needs the bare answer's CPU, wrk's, and the broker's CPU per
    // record at the produce loop's (best) batching.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    println!(
        "| broker | body | ingest ÷ bare | ingest ÷ produce loop | produce loop ÷ bare \
         | CPU ceiling ÷ bare |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for broker in &brokers {
        for &size in &sizes {
            let ingest = get(&format!("ingest, {size} B, {}", broker.name)).unwrap();
            let produce = get(&format!("produce loop, {size} B, {}", broker.name)).unwrap();
            let ceiling = produce.broker_cpu.zip(bare.wrk_cpu).map(|(record, wrk)| {
                let per_request = (bare.cpu + wrk + record) / 10_000.0;
                cores / per_request / bare.requests
            });
            println!(
                "| {} | {size} B | {:.2} | {:.2} | {:.2} | {} |",
                broker.name,
                ingest.requests / bare.requests,
                ingest.requests / produce.requests,
                produce.requests / bare.requests,
                ceiling.map_or_else(|| "n/a".to_owned(), |c| format!("{c:.2}")),
            );
        }
    }
    println!(
        "CPU ceiling: {cores} cores ÷ (bare's CPU + wrk's CPU per request + the broker's CPU per \
         record in the produce loop), as a share of bare"
    );
    let last = brokers.last().unwrap();
    let size = sizes[0];
    if let (Some(one), Some(two), Some(traced)) = (
        get(&format!("ingest, {size} B, {}", last.name)),
        get(&format!("two ingest processes, {size} B, {}", last.name)),
        get(&format!(
            "ingest, {size} B, {}, every span exported",
            last.name
        )),
    ) {
        println!(
            "two processes ÷ one: {:.2}; every span exported ÷ none: {:.2} ({:.0} µs of CPU per \
             request for its span)",
            two.requests / one.requests,
            traced.requests / one.requests,
            (traced.cpu - one.cpu) * 100.0
        );
    }
}
